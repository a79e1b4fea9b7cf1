"""Other fused linear cross-entropy kernels behind the same contract, and AGG on top of them.

``LossRequest(kernel=...)`` may name a kernel that is not this package's: PyTorch's own
``F.linear_cross_entropy`` (``torch``), Liger-Kernel's fused linear cross-entropy (``liger``) or
Apple's cut-cross-entropy (``cce``). Each computes (label-smoothed) cross-entropy and its gradients
without a tokens x V tensor; none knows AGG. AGG's gated dW is nevertheless reachable from them by
algebra, without touching an N x V block (docs/agg.md, "AGG on another kernel"):

Split the rows into A (target not rare) and B (target rare). With G the logit gradient and
Gamma AGG's gate (docs/agg.md (A5)), row k of the gated dW is

    dW_k = g1_k (G_A^T H_A)_k + g2_k (G_B^T H_B)_k + sum_{n in B, y_n = k} (1 - g2_k) G[n, k] h_n,

the last sum restoring the target's own column, which is never gated. G_A^T H_A and G_B^T H_B are
the un-gated dW of two calls of the foreign kernel on the two row sets (dH of both is the un-gated
one AGG keeps); G[n, y_n] = p(y_n | h_n) - (1 - eps) needs only z_{n, y_n} = h_n . w_{y_n} and the
row's log-sum-exp, which the kernel's per-row loss gives back exactly:

    loss_n = lse_n - (1 - eps') z_{n, y_n} - (eps' / V) sum_k z_{n, k},   sum_k z_{n, k} = h_n . sum_k w_k

(eps' = eps V / (V - 1): these kernels spread eps' / V over every class where fairseq gives the
target 1 - eps and the rest eps / (V - 1); the two are the same distribution). All of it is O(N d).

Freezing zeroes rows of dW afterwards, as in the package's own layer. What these kernels cannot
do (a teacher, row weights, a penalty, an argmax; CCE: label smoothing) is refused in one line.
"""
import importlib
from typing import Callable, Optional

import torch

from fairseq_agg.errors import UsageError

FOREIGN_KERNELS = ("torch", "liger", "cce")


def torch_smoothing(epsilon: float, vocab: int) -> float:
    """fairseq's epsilon in the convention of torch, Liger and CCE (eps' / V on every class)."""
    return epsilon * vocab / (vocab - 1) if epsilon > 0 else 0.0


def _torch_kernel() -> Callable:
    op = getattr(torch.nn.functional, "linear_cross_entropy", None)
    if op is None:
        raise UsageError(f"--output-kernel torch needs torch.nn.functional.linear_cross_entropy, which torch "
                         f"{torch.__version__} does not have (choose auto, compiled or eager)")
    options = getattr(torch.nn, "LinearCrossEntropyOptions", None)

    def per_row(hidden, weight, target, epsilon):
        # its chunked path takes no label smoothing (it would warn and fall back): ask for it only without
        chunked = options() if options is not None and epsilon == 0 else None
        return op(hidden, weight, target, reduction="none", label_smoothing=epsilon, options=chunked)

    return per_row


def _installed(kernel: str, package: str, module: str, name: str) -> Callable:
    """``module.name`` of an optional package, or a UsageError naming the flag and the package."""
    try:
        return getattr(importlib.import_module(module), name)
    except Exception as error:  # not installed, or no Triton
        raise UsageError(f"--output-kernel {kernel} needs {package} (pip install {package}): "
                         f"{type(error).__name__}: {error}") from None


def _liger_kernel() -> Callable:
    fused = _installed("liger", "liger-kernel", "liger_kernel.transformers.functional", "liger_fused_linear_cross_entropy")
    return lambda hidden, weight, target, epsilon: fused(hidden, weight, target, label_smoothing=epsilon,
                                                         reduction="none")


def _cce_kernel() -> Callable:
    fused = _installed("cce", "cut-cross-entropy", "cut_cross_entropy", "linear_cross_entropy")
    return lambda hidden, weight, target, epsilon: fused(hidden, weight, target, reduction="none")


_LOADERS = {"torch": _torch_kernel, "liger": _liger_kernel, "cce": _cce_kernel}


def foreign_refusal(kernel: str, *, label_smoothing=False, teacher=False, row_weights=False, penalty=False,
                    argmax=False) -> Optional[str]:
    """Why ``kernel`` cannot compute what is asked (one line naming the flags), or None."""
    asked = [(teacher, "the augmented loss (--aug-alpha)"), (row_weights, "FACE's row weights"),
             (penalty, "the unlikelihood penalty"), (argmax, "each row's argmax (FACE's out counts)"),
             (kernel == "cce" and label_smoothing, "label smoothing (--label-smoothing)")]
    for wanted, what in asked:
        if wanted:
            return (f"--output-kernel {kernel} cannot compute {what}: it computes cross-entropy only (choose auto, "
                    "compiled or eager)")
    return None


DESCRIPTIONS = {
    "torch": "PyTorch's F.linear_cross_entropy",
    "liger": "Liger-Kernel's fused linear cross-entropy",
    "cce": "cut-cross-entropy's linear_cross_entropy",
}


def load_foreign_kernel(kernel: str) -> Callable:
    """The per-row loss function of a foreign kernel, or a UsageError saying what is missing."""
    if kernel not in _LOADERS:
        raise UsageError(f"--output-kernel must be one of auto, eager, compiled, {', '.join(FOREIGN_KERNELS)}, "
                         f"got {kernel!r}")
    return _LOADERS[kernel]()


def _target_and_summed_logits(hidden, weight, target, acc):
    """z_{n, y_n} = h_n . w_{y_n} and sum_k z_{n, k} = h_n . sum_k w_k of every row, in ``acc``; O(N d)."""
    h, w = hidden.to(acc), weight.to(acc)
    return (h * w.index_select(0, target)).sum(dim=1), h @ w.sum(dim=0)


def target_column_correction(hidden_b, weight, target_b, row_loss_b, epsilon_torch, g2, row_scale_b=None):
    """The last sum of the module docstring: (V, d) with rows sum_{n in B, y_n = k} (1 - g2_k) G[n, k] h_n,
    from the rare-target rows' features, targets and per-row losses; O(N_B d)."""
    vocab = weight.size(0)
    acc = row_loss_b.dtype if row_loss_b.dtype == torch.float64 else torch.float32
    target_logit, logit_sum = _target_and_summed_logits(hidden_b, weight, target_b, acc)
    lse = row_loss_b.to(acc) + (1 - epsilon_torch) * target_logit + (epsilon_torch / vocab) * logit_sum
    on_target = 1 - epsilon_torch + epsilon_torch / vocab  # Q at the target, = 1 - eps in fairseq's terms
    grad_at_target = torch.exp(target_logit - lse) - on_target
    coef = (1 - g2.to(acc).index_select(0, target_b)) * grad_at_target
    if row_scale_b is not None:
        coef = coef * row_scale_b.to(acc)
    return torch.zeros(weight.shape, dtype=acc, device=weight.device).index_add_(
        0, target_b, coef.unsqueeze(1) * hidden_b.to(acc))


class _ForeignLinearLoss(torch.autograd.Function):
    """Per-row losses of a foreign kernel; backward forms dH and the gated, frozen dW."""

    @staticmethod
    def forward(ctx, hidden, weight, target, request, per_row):
        epsilon = torch_smoothing(request.label_smoothing, weight.size(0))
        gates = request.gates
        classes = [torch.arange(target.numel(), device=target.device)]
        if gates is not None:
            rare_row = gates.rare.index_select(0, target)
            classes = [(~rare_row).nonzero().squeeze(1), rare_row.nonzero().squeeze(1)]
        with torch.enable_grad():
            h = hidden.detach().requires_grad_(hidden.requires_grad)
            weights = [weight.detach().requires_grad_(weight.requires_grad) for _ in classes]
            row_loss = torch.zeros(target.shape, dtype=torch.promote_types(hidden.dtype, torch.float32),
                                   device=hidden.device)
            for rows, w in zip(classes, weights):
                if rows.numel():
                    loss = per_row(h.index_select(0, rows), w, target.index_select(0, rows), epsilon)
                    row_loss = row_loss.index_copy(0, rows, loss.to(row_loss.dtype))
        ctx.graph = (h, weights, row_loss, classes, epsilon)
        ctx.request = request
        ctx.save_for_backward(hidden, weight, target)
        return row_loss.detach()

    @staticmethod
    def backward(ctx, grad_rows):
        hidden, weight, target = ctx.saved_tensors
        h, weights, row_loss, classes, epsilon = ctx.graph
        request = ctx.request
        inputs = [t for t in (h, *weights) if t.requires_grad]
        grads = dict(zip(map(id, inputs), torch.autograd.grad(row_loss, inputs, grad_rows, allow_unused=True)))
        grad_hidden = grads.get(id(h)) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            parts = [grads.get(id(w)) for w in weights]
            parts = [torch.zeros_like(weight) if p is None else p for p in parts]
            gates = request.gates
            if gates is None:
                grad_weight = parts[0].float() if parts[0].dtype != torch.float64 else parts[0]
            else:
                acc = torch.float64 if weight.dtype == torch.float64 else torch.float32
                rare_rows = classes[1]
                grad_weight = (gates.g1.to(acc).unsqueeze(1) * parts[0].to(acc)
                               + gates.g2.to(acc).unsqueeze(1) * parts[1].to(acc))
                if rare_rows.numel():
                    grad_weight += target_column_correction(
                        hidden.index_select(0, rare_rows), weight, target.index_select(0, rare_rows),
                        row_loss.detach().index_select(0, rare_rows), epsilon, gates.g2,
                        grad_rows.index_select(0, rare_rows))
            if request.frozen_rows is not None:
                grad_weight = grad_weight.masked_fill(request.frozen_rows.unsqueeze(1), 0.0)
            grad_weight = grad_weight.to(weight.dtype)
        del ctx.graph
        return grad_hidden, grad_weight, None, None, None


def foreign_linear_loss(hidden, weight, target, request):
    """(per-row loss, per-row NLL) of ``request`` through the foreign kernel ``request.kernel``; the
    loss is differentiable in ``hidden`` and ``weight``, with AGG's gates and freezing applied to dW."""
    refusal = foreign_refusal(
        request.kernel, label_smoothing=request.label_smoothing > 0, teacher=request.teacher is not None,
        row_weights=request.row_weights is not None, penalty=request.penalty is not None, argmax=request.needs_argmax)
    if refusal:
        raise UsageError(refusal)
    per_row = load_foreign_kernel(request.kernel)
    row_loss = _ForeignLinearLoss.apply(hidden, weight, target, request, per_row)
    with torch.no_grad():
        nll = row_loss.detach()
        epsilon = torch_smoothing(request.label_smoothing, weight.size(0))
        if epsilon > 0:  # nll = loss - eps' z_y + (eps' / V) sum_k z_k (module docstring)
            target_logit, logit_sum = _target_and_summed_logits(hidden.detach(), weight.detach(), target, nll.dtype)
            nll = nll - epsilon * target_logit + (epsilon / weight.size(0)) * logit_sum
    return row_loss, nll
