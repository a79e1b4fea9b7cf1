"""Another fused linear cross-entropy behind the package's contract (``LossRequest(kernel=...)``):
PyTorch's own ``F.linear_cross_entropy``, which this torch has on the CPU, stands in for every
foreign kernel. Plain CE, label smoothing, freezing and AGG (through its algebra in
fairseq_agg/ops/agg.py: two un-gated calls, a per-row dW scale and an O(N d) correction at
the rare targets) equal the package's own chunk body in float64 (1e-12) and fp32;
what such a kernel cannot compute, or a kernel that is not installed, is one UsageError."""
import importlib.util

import pytest
import torch

from fairseq_agg.errors import UsageError
from fairseq_agg.ops import LossRequest, agg_gates, build_teacher, fused_linear_loss
from fairseq_agg.ops.agg import target_column_correction
from fairseq_agg.ops.foreign_kernels import torch_smoothing
from fairseq_agg.ops.freezing import FrozenRows

HAS_TORCH_LCE = hasattr(torch.nn.functional, "linear_cross_entropy")
needs_torch_lce = pytest.mark.skipif(not HAS_TORCH_LCE, reason=f"torch {torch.__version__} has no F.linear_cross_entropy")

N, D, V, NSPECIAL = 45, 8, 41, 4


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def problem(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=g, dtype=torch.float64)
    weight = torch.randn(V, D, generator=g, dtype=torch.float64) * 0.7
    target = torch.randint(NSPECIAL, V, (N,), generator=g)
    counts = torch.randint(0, 30, (V,), generator=g)
    counts[V - 6:] = 0
    gates = agg_gates(counts, 10, 1.0, NSPECIAL)
    assert gates.rare[target].any() and (~gates.rare[target]).any()
    return hidden.to(dtype), weight.to(dtype), target, gates


def run(kernel, dtype, epsilon, agg, freeze, per_token):
    hidden, weight, target, gates = problem(dtype)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    request = LossRequest(epsilon, per_token=per_token, chunk_size=16, kernel=kernel).with_terms(
        gates if agg else None, FrozenRows(gates.rare) if freeze else None)
    out = fused_linear_loss(hidden, weight, target, request)
    upstream = torch.linspace(0.3, 1.7, N, dtype=out.loss.dtype) if per_token else 1.0
    (out.loss * upstream).sum().backward()
    return out.loss.detach(), out.nll, hidden.grad, weight.grad


@needs_torch_lce
@pytest.mark.parametrize("per_token", [False, True], ids=["summed", "per-token"])
@pytest.mark.parametrize("case", ["ce", "ls", "agg", "agg+ls", "freeze+ls"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_torch_kernel_equals_the_package_body(case, dtype, per_token):
    methods = case.split("+")
    kwargs = dict(epsilon=0.1 if "ls" in methods else 0.0, agg="agg" in methods, freeze="freeze" in methods,
                  per_token=per_token)
    ours, theirs = run("eager", dtype, **kwargs), run("torch", dtype, **kwargs)
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    for name, a, b in zip(("loss", "nll", "dH", "dW"), theirs, ours):
        assert rel(a, b) <= tol, (name, rel(a, b))


def test_target_column_correction_by_hand():
    """Row k of the correction is sum over rare-target rows with y_n = k of (1 - g2_k) G[n, k] h_n,
    G[n, k] = p(k | h_n) - (1 - eps); here from the exact per-row loss of torch's convention."""
    hidden, weight, target, gates = problem(torch.float64)
    epsilon = 0.1
    eps_torch = torch_smoothing(epsilon, V)
    z = hidden @ weight.t()
    log_p = torch.log_softmax(z, dim=1)
    q = torch.full_like(z, eps_torch / V).scatter_(1, target.unsqueeze(1), 1 - eps_torch + eps_torch / V)
    row_loss = -(q * log_p).sum(dim=1)
    got = target_column_correction(hidden, weight, target, row_loss, eps_torch, gates.g2)
    want = torch.zeros_like(weight)
    for n in range(N):
        k = int(target[n])
        want[k] += (1 - gates.g2[k].double()) * (log_p[n, k].exp() - (1 - epsilon)) * hidden[n]
    assert rel(got, want) <= 1e-12


@needs_torch_lce
def test_what_a_foreign_kernel_cannot_compute_is_refused():
    hidden, weight, target, _ = problem(torch.float32)
    teacher = build_teacher(weight, target, 2.0, 1.0)
    with pytest.raises(UsageError, match=r"--output-kernel torch cannot compute the augmented loss"):
        fused_linear_loss(hidden, weight, target, LossRequest(terms=(teacher,), kernel="torch"))
    with pytest.raises(UsageError, match=r"--output-kernel must be one of"):
        LossRequest(kernel="triton")


@pytest.mark.parametrize("kernel,module", [("liger", "liger_kernel"), ("cce", "cut_cross_entropy")])
def test_a_kernel_that_is_not_installed_is_one_usage_error(kernel, module):
    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} is installed here")
    hidden, weight, target, _ = problem(torch.float32)
    with pytest.raises(UsageError, match=rf"--output-kernel {kernel} needs .*pip install"):
        fused_linear_loss(hidden, weight, target, LossRequest(kernel=kernel))
