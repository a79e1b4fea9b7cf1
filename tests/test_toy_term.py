"""A new method joins the fused output layer without an edit to ``fairseq_agg/ops/``: the toy
z-loss term of tests/support/zloss_plugin (coef * lse(z)^2 per token) against its formula in
float64, eager and compiled, alone and beside AGG's gates; the same term refused by a foreign
kernel in one line; and a real ``fairseq-train`` of the plugin's criterion, which composes the
package's public pieces and registers with one line."""
import math
import os
import re

import pytest
import torch

from fairseq_agg.errors import UsageError
from fairseq_agg.ops import LossRequest, agg_gates, body_runner, fused_linear_loss, output_kernel
from fairseq_runs import TINY_LM_ARGS, read_json_log, run_cli
from reference_constructions import gate_matrix
from zloss_plugin.zloss import ZLoss

PLUGIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "support", "zloss_plugin")
OPS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fairseq_agg", "ops")
N, D, V, CHUNK, NSPECIAL = 37, 8, 53, 16, 4
COEF = 0.3
KERNELS = ["eager"] + (["compiled"] if output_kernel.compile_unavailable(torch.device("cpu")) is None else [])


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def problem(dtype):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, D, generator=g, dtype=torch.float64)
    weight = torch.randn(V, D, generator=g, dtype=torch.float64) * D**-0.5 * 4
    target = torch.randint(NSPECIAL, V, (N,), generator=g)
    counts = torch.randint(0, 40, (V,), generator=g)
    counts[V - 8:] = 0
    gates = agg_gates(counts, 10, 1.0, NSPECIAL)
    return hidden.to(dtype).requires_grad_(True), weight.to(dtype).requires_grad_(True), target, gates


def by_formula(hidden, weight, target, epsilon, gates):
    """Float64 on full logits: loss = sum_n [-sum_k Q_nk log p_nk + coef lse_n^2] (fairseq's
    smoothing Q), G = p - Q + 2 coef lse p, dH = G W, dW = (Gamma * G)^T H (Gamma = 1 without AGG)."""
    h, w = hidden.detach().double(), weight.detach().double()
    z = h @ w.t()
    q = torch.full_like(z, epsilon / (V - 1)).scatter_(1, target.unsqueeze(1), 1 - epsilon)
    lse = torch.logsumexp(z, dim=1, keepdim=True)
    p = torch.exp(z - lse)
    loss = -(q * (z - lse)).sum() + COEF * (lse**2).sum()
    g = p - q + 2 * COEF * lse * p
    gamma = torch.ones_like(z) if gates is None else gate_matrix(target, gates).double()
    return loss, (lse**2).sum(), g @ w, (gamma * g).t() @ h


@pytest.mark.parametrize("agg", [False, True], ids=["alone", "with-agg"])
@pytest.mark.parametrize("epsilon", [0.0, 0.1])
@pytest.mark.parametrize("kernel", KERNELS)
def test_the_toy_term_against_its_formula_in_float64(kernel, epsilon, agg):
    hidden, weight, target, gates = problem(torch.float64)
    request = LossRequest(epsilon, chunk_size=CHUNK, kernel=kernel).with_terms(gates if agg else None, ZLoss(COEF))
    out = fused_linear_loss(hidden, weight, target, request)
    out.loss.backward()
    loss, lse_squared, grad_hidden, grad_weight = by_formula(hidden, weight, target, epsilon, gates if agg else None)
    assert rel(out.loss, loss) <= 1e-12
    assert rel(out.terms["zloss"]["lse_squared"], lse_squared) <= 1e-12
    assert rel(hidden.grad, grad_hidden) <= 1e-12 and rel(weight.grad, grad_weight) <= 1e-12
    plain = fused_linear_loss(hidden.detach(), weight.detach(), target, LossRequest(epsilon, chunk_size=CHUNK))
    assert rel(out.loss, plain.loss) > 1e-3  # the term is really in the loss


@pytest.mark.parametrize("per_token", [False, True], ids=["summed", "per-token"])
def test_the_toy_term_compiled_equals_eager_in_fp32(per_token):
    if "compiled" not in KERNELS:
        pytest.skip(str(output_kernel.compile_unavailable(torch.device("cpu"))))
    runs = {}
    for kernel in ("eager", "compiled"):
        hidden, weight, target, gates = problem(torch.float32)
        request = LossRequest(0.1, chunk_size=CHUNK, per_token=per_token, kernel=kernel).with_terms(gates, ZLoss(COEF))
        out = fused_linear_loss(hidden, weight, target, request)
        upstream = torch.linspace(0.5, 2.0, N) if per_token else 1.0
        (out.loss * upstream).sum().backward()
        runs[kernel] = (out.loss.detach(), out.terms["zloss"]["lse_squared"], hidden.grad, weight.grad)
    for got, want in zip(runs["compiled"], runs["eager"]):
        assert rel(got, want) <= 2e-5


def test_the_toy_term_compiles_into_the_one_kernel_of_its_plan():
    """Dynamo unrolls the fold over the terms: the toy term joins the one generated kernel of its
    plan (a fresh compilation, the process's compiled bodies put back afterwards)."""
    if "compiled" not in KERNELS:
        pytest.skip(str(output_kernel.compile_unavailable(torch.device("cpu"))))
    from torch._inductor.utils import run_and_get_code

    hidden, weight, target, _ = problem(torch.bfloat16)
    request = LossRequest(0.1, chunk_size=CHUNK, kernel="compiled").with_terms(ZLoss(COEF))
    kept = dict(body_runner._compiled)
    body_runner._compiled.clear()
    try:
        with torch._inductor.config.patch(fx_graph_cache=False):
            _, codes = run_and_get_code(lambda: fused_linear_loss(hidden, weight, target, request).loss.backward())
    finally:
        body_runner._compiled.clear()
        body_runner._compiled.update(kept)
    assert len(codes) == 1
    assert len(set(re.findall(r"\b(cpp_fused_\w+)\(", codes[0]))) == 1


def test_no_file_of_the_core_names_the_toy_term():
    for name in os.listdir(OPS):
        if name.endswith(".py"):
            with open(os.path.join(OPS, name)) as f:
                text = f.read().lower()
            assert "zloss" not in text and "z-loss" not in text, name


def test_a_foreign_kernel_refuses_the_toy_term_in_one_line():
    hidden, weight, target, _ = problem(torch.float32)
    request = LossRequest(kernel="torch").with_terms(ZLoss(COEF))
    with pytest.raises(UsageError, match=r"^--output-kernel torch cannot compute the z-loss \(--zloss-coef\)"):
        fused_linear_loss(hidden, weight, target, request)


def test_the_toy_criterion_trains_in_fairseq_train(lm_data_bin, tmp_path):
    coef = 0.01
    args = [lm_data_bin, "--user-dir", PLUGIN] + TINY_LM_ARGS + [
        "--criterion", "cross_entropy_zloss", "--zloss-coef", coef, "--max-update", 3, "--save-dir", tmp_path,
        "--log-format", "json", "--no-save",
    ]
    proc = run_cli("fairseq-train", args)
    records = [r for r in read_json_log(proc.stdout + proc.stderr) if "num_updates" in r and "zloss" in r]
    assert [int(r["num_updates"]) for r in records] == [1, 2, 3]
    for r in records:  # loss = nll + coef * lse^2 per token, in bits; the log rounds the loss to 3 decimals
        lse_squared = float(r["zloss"])
        assert lse_squared > 1.0
        assert float(r["loss"]) == pytest.approx(float(r["nll_loss"]) + coef * lse_squared / math.log(2), abs=2e-3)
    # refused at start-up on a kernel that cannot compute it: one line, exit status 2
    proc = run_cli("fairseq-train", args + ["--output-kernel", "torch"], expect_ok=False)
    assert proc.returncode == 2 and "--output-kernel torch cannot compute the z-loss" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_request_checks_its_terms():
    class NoRole(ZLoss):
        role = "scales the moon"

    with pytest.raises(ValueError, match="a term's role must be one of"):
        LossRequest(terms=(NoRole(COEF),))
    with pytest.raises(ValueError, match="two terms log values under the same name: zloss, zloss"):
        LossRequest().with_terms(ZLoss(COEF), ZLoss(2 * COEF))
    template = LossRequest(0.1, chunk_size=CHUNK)
    batch = template.with_terms(None, ZLoss(COEF), per_token=True)
    assert [type(term) for term in batch.terms] == [ZLoss] and batch.per_token and batch.chunk_size == CHUNK
    assert template.terms == () and not template.per_token  # the template is left as it was
