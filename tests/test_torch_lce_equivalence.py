"""The fused output layer computes what PyTorch's own op, ``F.linear_cross_entropy``, computes: the
same summed (or per-token) cross-entropy and the same gradients of H and W, on torch's reference
path and on its chunked path, with label smoothing once the two conventions are matched
(tests/support/output_layer_problem.py: ``torch_label_smoothing``), and with padding that torch skips through
``ignore_index`` and the fused criterion removes before the layer.

scripts/bench_criterion.py and scripts/gpu_check.py time the two against each other; this is the
check that they compare the same computation."""
import pytest
import torch
import torch.nn.functional as F

from fairseq_agg.ops.fused_linear_loss import LossRequest, fused_linear_loss

from output_layer_problem import (PAD, OutputProblem, torch_chunking_options, torch_label_smoothing,
                                  torch_linear_ce, torch_linear_ce_missing)

pytestmark = pytest.mark.skipif(torch_linear_ce_missing() is not None, reason=str(torch_linear_ce_missing()))

N, D, V, CHUNK = 37, 8, 53, 16  # N not a multiple of the chunk, V not a power of two
TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5}
CHUNKINGS = [None, "auto", 8]  # torch's reference path, its own chunk size, a chunk size of ours


def leaves(dtype, seed=0, pad_rows=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True)
    weight = (torch.randn(V, D, generator=g, dtype=torch.float64) * D**-0.5).to(dtype).requires_grad_(True)
    target = torch.randint(4, V, (N,), generator=g)
    target[torch.randperm(N, generator=g)[:pad_rows]] = PAD
    return hidden, weight, target


def fused(hidden, weight, target, epsilon=0.0, per_token=False, upstream=None):
    """The fused layer on the non-padding rows, as the criteria call it; (N,) loss where per token."""
    keep = target.ne(PAD)
    h = hidden.detach()[keep].requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    loss = fused_linear_loss(h, w, target[keep], LossRequest(epsilon, chunk_size=CHUNK, per_token=per_token)).loss
    (loss if upstream is None else (loss * upstream[keep]).sum()).backward()
    grad_hidden = torch.zeros_like(hidden)
    grad_hidden[keep] = h.grad
    if per_token:
        loss = torch.zeros(target.shape, dtype=loss.dtype).masked_scatter(keep, loss.detach())
    return loss.detach(), grad_hidden, w.grad


def torch_op(hidden, weight, target, epsilon=0.0, chunking=None, reduction="sum", upstream=None):
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    loss = F.linear_cross_entropy(h, w, target, reduction=reduction, ignore_index=PAD,
                                  label_smoothing=torch_label_smoothing(epsilon, V),
                                  options=torch_chunking_options(chunking))
    (loss if upstream is None else (loss * upstream).sum()).backward()
    return loss.detach(), h.grad, w.grad


def assert_close(ours, theirs, dtype):
    tol = TOLERANCE[dtype]
    for name, a, b in zip(("loss", "dH", "dW"), ours, theirs):
        scale = b.abs().max().clamp_min(1e-30)
        assert float((a.to(b.dtype) - b).abs().max() / scale) <= tol, name


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunking", CHUNKINGS)
def test_cross_entropy_equals_torch(dtype, chunking):
    hidden, weight, target = leaves(dtype)
    assert_close(fused(hidden, weight, target), torch_op(hidden, weight, target, chunking=chunking), dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("epsilon", [0.1, 0.3])
def test_label_smoothing_equals_torch_at_the_equivalent_epsilon(dtype, epsilon):
    hidden, weight, target = leaves(dtype, seed=1)
    ours = fused(hidden, weight, target, epsilon)
    assert_close(ours, torch_op(hidden, weight, target, epsilon), dtype)
    # the same number in both conventions is a different distribution, and a different loss (by
    # little: eps / V against eps / (V - 1) off the target, but far more than float64 rounding)
    h64, w64 = hidden.detach().double(), weight.detach().double()
    naive = F.linear_cross_entropy(h64, w64, target, reduction="sum", label_smoothing=epsilon)
    matched = F.linear_cross_entropy(h64, w64, target, reduction="sum", label_smoothing=torch_label_smoothing(epsilon, V))
    assert abs(float(naive - matched)) > 1e3 * TOLERANCE[torch.float64] * abs(float(matched))


# torch's chunked path takes no label smoothing: with it, only the reference path
SMOOTHING_AND_CHUNKING = [(0.0, chunking) for chunking in CHUNKINGS] + [(0.1, None)]


@pytest.mark.parametrize("epsilon,chunking", SMOOTHING_AND_CHUNKING)
def test_padding_torch_ignores_is_what_the_fused_layer_never_sees(epsilon, chunking):
    hidden, weight, target = leaves(torch.float64, seed=2, pad_rows=9)
    ours = fused(hidden, weight, target, epsilon)
    theirs = torch_op(hidden, weight, target, epsilon, chunking)
    assert_close(ours, theirs, torch.float64)
    assert theirs[1][target.eq(PAD)].abs().max() == 0  # torch leaves the padding rows' dH at zero


@pytest.mark.parametrize("epsilon,chunking", SMOOTHING_AND_CHUNKING)
def test_per_token_losses_equal_torch_without_reduction(epsilon, chunking):
    hidden, weight, target = leaves(torch.float64, seed=3, pad_rows=5)
    upstream = torch.linspace(0.5, 2.0, N, dtype=torch.float64)  # a different incoming gradient per token
    ours = fused(hidden, weight, target, epsilon, per_token=True, upstream=upstream)
    theirs = torch_op(hidden, weight, target, epsilon, chunking, reduction="none", upstream=upstream)
    assert_close(ours, theirs, torch.float64)


@pytest.mark.parametrize("epsilon,chunking", [(0.0, None), (0.0, "auto"), (0.0, 7), (0.1, None)])
def test_the_benchmarks_torch_anchor_matches_the_fused_layer(epsilon, chunking):
    """output_layer_problem.py's ``torch_linear_ce``, which the benchmarks time, on their problem."""
    p = OutputProblem(50, 12, 101, dtype=torch.float64, seed=4)
    loss = torch_linear_ce(p, epsilon, chunking)
    theirs = (loss, p.hidden.grad.clone(), p.weight.grad.clone())
    p.clear_grads()
    assert_close(fused(p.hidden, p.weight, p.target, epsilon), theirs, torch.float64)


def test_the_anchor_refuses_smoothing_on_torchs_chunked_path():
    p = OutputProblem(20, 4, 30, seed=5)
    with pytest.raises(ValueError, match="no label smoothing"):
        torch_linear_ce(p, 0.1, "auto")
