"""The anti-focal loss (ops/antifocal.py, criterion cross_entropy_antifocal): both readings against
their float64 references on materialised logits (the formula with the weight differentiated by
autograd; the released criterion's arithmetic ported), eager with and without label smoothing and
compiled with it (one graph per reading); a focal weight written in this file as a row weight and
its slope only (no rows x V gradient of its own), multiplied with the anti-focal one; the
criterion in a real fairseq-train (validation plain cross-entropy)."""
import math

import pytest
import torch
import torch.nn.functional as F

from fairseq_agg.errors import UsageError
from fairseq_agg.ops import WEIGHTS_ROWS, LossRequest, Term, TermOut, fused_linear_loss, output_kernel
from fairseq_agg.ops.antifocal import AntiFocalLoss, AntiFocalWeights
from fairseq_runs import TINY_LM_ARGS, USER_DIR, read_json_log, run_cli

N, D, V, CHUNK = 37, 8, 53, 16
KERNELS = ["eager"] + (["compiled"] if output_kernel.compile_unavailable(torch.device("cpu")) is None else [])


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def problem(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, D, generator=g, dtype=torch.float64)
    weight = torch.randn(V, D, generator=g, dtype=torch.float64) * D**-0.5 * 4  # confident rows: p_t far from 0
    target = torch.randint(4, V, (N,), generator=g)
    return hidden.to(dtype).requires_grad_(True), weight.to(dtype).requires_grad_(True), target


def smoothed_ce(logits, target, epsilon):
    """fairseq's label-smoothed cross-entropy per row (target 1 - eps, the others eps / (V - 1))."""
    lprobs = torch.log_softmax(logits, dim=1)
    q = torch.full_like(lprobs, epsilon / (V - 1)).scatter_(1, target.unsqueeze(1), 1 - epsilon)
    return -(q * lprobs).sum(1), lprobs


def reference(hidden, weight, target, gamma, epsilon, constant):
    """float64 on full logits: the formula, sum_n (1 + p_t)^gamma CE_eps, differentiated by autograd
    through p_t; or (``constant``) the released criterion's arithmetic: the log-probabilities times
    (1 + exp(lprobs.detach()))^gamma, then F.nll_loss summed (the smoothed CE times the same
    detached weight with eps > 0)."""
    h, w = hidden.detach().double().requires_grad_(True), weight.detach().double().requires_grad_(True)
    ce, lprobs = smoothed_ce(h @ w.t(), target, epsilon)
    if constant and epsilon == 0:
        loss = F.nll_loss((1.0 + lprobs.detach().exp()) ** gamma * lprobs, target, reduction="sum")
    else:
        p_t = lprobs.gather(1, target.unsqueeze(1)).squeeze(1).exp()
        loss = ((1.0 + (p_t.detach() if constant else p_t)) ** gamma * ce).sum()
    loss.backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("constant", [False, True], ids=["formula", "released-code"])
@pytest.mark.parametrize("kernel,epsilon", [("eager", 0.0), ("eager", 0.1)] + [(k, 0.1) for k in KERNELS[1:]])
def test_both_readings_against_their_references_in_float64(kernel, epsilon, constant):
    gamma = 2.0
    hidden, weight, target = problem()
    afl = AntiFocalLoss(gamma=gamma, constant_weight=constant)
    out = afl(hidden, weight, target, LossRequest(epsilon, chunk_size=CHUNK, kernel=kernel))
    out.loss.backward()
    loss, grad_hidden, grad_weight = reference(hidden, weight, target, gamma, epsilon, constant)
    assert rel(out.loss, loss) <= 1e-12
    assert rel(hidden.grad, grad_hidden) <= 1e-12 and rel(weight.grad, grad_weight) <= 1e-12
    # the other reading is measurably different: the test tells them apart
    _, other_hidden, _ = reference(hidden, weight, target, gamma, epsilon, not constant)
    assert rel(hidden.grad, other_hidden) > 1e-2
    lprobs = torch.log_softmax(hidden.detach() @ weight.detach().t(), 1).gather(1, target.unsqueeze(1))
    assert rel(out.terms["antifocal"]["weight"], ((1 + lprobs.exp()) ** gamma).sum()) <= 1e-12
    assert rel(out.nll, -lprobs.sum()) <= 1e-12  # the NLL stays plain


def test_validation_and_gamma_zero_are_cross_entropy():
    hidden, weight, target = problem()
    request = LossRequest(0.1, chunk_size=CHUNK, kernel="eager")
    plain = fused_linear_loss(hidden, weight, target, request)
    assert torch.equal(AntiFocalLoss(gamma=3.0)(hidden, weight, target, request, training=False).loss, plain.loss)
    zero = AntiFocalLoss(gamma=0.0)(hidden, weight, target, request)
    assert rel(zero.loss, plain.loss) <= 1e-14 and "antifocal" in zero.terms


class FocalWeight(Term):
    """Focal loss's row weight (1 - p_t)^gamma (Lin et al., 2017), given as the factor and its
    derivative d w / d log p_t = -gamma (1 - p_t)^(gamma - 1) p_t only: the chunk body forms the
    rows x V gradient."""

    name, role, value_names = "focal", WEIGHTS_ROWS, ()

    def __init__(self, gamma):
        self.gamma = gamma

    def tile_inputs(self, rows, target, acc):
        return torch.tensor(self.gamma, dtype=acc, device=target.device)

    @staticmethod
    def tile(tile, gamma):
        p = torch.exp(tile.target_logprob())
        return TermOut(factor=(1 - p) ** gamma, slope=-gamma * (1 - p) ** (gamma - 1) * p)


def test_a_probability_dependent_row_weight_needs_no_gradient_of_its_own():
    # the focal weight times the anti-focal one: the product rule of the body, against autograd
    hidden, weight, target = problem()
    request = LossRequest(0.1, chunk_size=CHUNK, kernel="eager").with_terms(FocalWeight(2.0), AntiFocalWeights(1.5))
    out = fused_linear_loss(hidden, weight, target, request)
    out.loss.backward()
    h, w = hidden.detach().clone().requires_grad_(True), weight.detach().clone().requires_grad_(True)
    ce, lprobs = smoothed_ce(h @ w.t(), target, 0.1)
    p_t = lprobs.gather(1, target.unsqueeze(1)).squeeze(1).exp()
    loss = ((1 - p_t) ** 2.0 * (1 + p_t) ** 1.5 * ce).sum()
    loss.backward()
    assert rel(out.loss, loss) <= 1e-12
    assert rel(hidden.grad, h.grad) <= 1e-12 and rel(weight.grad, w.grad) <= 1e-12


def test_a_bad_gamma_and_a_foreign_kernel_are_refused_in_one_line():
    with pytest.raises(UsageError, match="--antifocal-gamma"):
        AntiFocalLoss(gamma=-1.0)
    hidden, weight, target = problem(torch.float32)
    with pytest.raises(UsageError, match=r"^--output-kernel torch cannot compute the anti-focal weights"):
        AntiFocalLoss()(hidden, weight, target, LossRequest(kernel="torch"))


def test_the_criterion_trains_in_fairseq_train(lm_data_bin, tmp_path):
    gamma = 2.0
    args = [lm_data_bin, "--user-dir", USER_DIR] + TINY_LM_ARGS + [
        "--criterion", "cross_entropy_antifocal", "--antifocal-gamma", gamma, "--max-update", 3,
        "--save-dir", tmp_path, "--log-format", "json", "--no-save", "--validate-interval-updates", 3,
    ]
    proc = run_cli("fairseq-train", args)
    records = read_json_log(proc.stdout + proc.stderr)
    train = [r for r in records if "antifocal_weight" in r]
    assert [int(r["num_updates"]) for r in train] == [1, 2, 3]
    for r in train:  # w = (1 + p_t)^gamma in [1, 2^gamma], so the weighted loss is above the plain NLL
        assert 1.0 < float(r["antifocal_weight"]) < 2.0 ** gamma
        assert float(r["loss"]) > float(r["nll_loss"])
    valid = [r for r in records if "valid_loss" in r]
    assert valid and all(math.isclose(float(r["valid_loss"]), float(r["valid_nll_loss"])) for r in valid)
