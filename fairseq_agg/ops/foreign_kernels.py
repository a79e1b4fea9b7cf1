"""Other fused linear cross-entropy kernels behind the same contract, and gates on dW on top of them.

``LossRequest(kernel=...)`` may name a kernel that is not this package's
(:mod:`fairseq_agg.ops.output_kernel`): PyTorch's own ``F.linear_cross_entropy`` (``torch``),
Liger-Kernel's fused linear cross-entropy (``liger``) or Apple's cut-cross-entropy (``cce``). Each
computes (label-smoothed) cross-entropy and its gradients without a tokens x V tensor, per row.

A term that gates dW can still run on them where it says how (:class:`fairseq_agg.ops.term.Term`):
it splits the rows into sets (``foreign_row_classes``), the kernel runs on each set apart, and the
term forms its gated dW from the un-gated dW of each set (``foreign_grad_weight``; AGG's algebra:
docs/agg.md, "AGG on another kernel", in :mod:`fairseq_agg.ops.agg`); a gate on the summed dW
(freezing) acts afterwards, as in the package's own layer. Everything else a term adds is refused
in one line, naming the term (``foreign_refusal``).

The kernels' per-row loss gives back what such an algebra needs at O(N d): with the target logit
z_{n, y_n} = h_n . w_{y_n} and sum_k z_{n, k} = h_n . sum_k w_k (:func:`target_and_summed_logits`),

    loss_n = lse_n - (1 - eps') z_{n, y_n} - (eps' / V) sum_k z_{n, k}

(eps' = eps V / (V - 1): these kernels spread eps' / V over every class where fairseq gives the
target 1 - eps and the rest eps / (V - 1); the two are the same distribution).
"""
import importlib
from typing import Callable, NamedTuple, Optional

import torch

from fairseq_agg.errors import UsageError


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


def load_foreign_kernel(kernel: str) -> Callable:
    """The per-row loss function of a foreign kernel, or a UsageError saying what is missing."""
    if kernel not in _LOADERS:
        raise UsageError(f"--output-kernel must be one of auto, eager, compiled, {', '.join(_LOADERS)}, "
                         f"got {kernel!r}")
    return _LOADERS[kernel]()


def target_and_summed_logits(hidden, weight, target, acc):
    """z_{n, y_n} = h_n . w_{y_n} and sum_k z_{n, k} = h_n . sum_k w_k of every row, in ``acc``; O(N d)."""
    h, w = hidden.to(acc), weight.to(acc)
    return (h * w.index_select(0, target)).sum(dim=1), h @ w.sum(dim=0)


class ForeignRows(NamedTuple):
    """What a gate's ``foreign_grad_weight`` gets: the call's inputs, the per-row losses and their
    incoming gradient, eps' (:func:`torch_smoothing`), the row sets it asked for and the un-gated
    dW of each (V x d, in the kernel's dtype)."""

    hidden: torch.Tensor
    weight: torch.Tensor
    target: torch.Tensor
    row_loss: torch.Tensor
    grad_rows: torch.Tensor
    epsilon: float
    classes: list
    parts: list


def _row_splitter(request):
    """The one term that splits the rows (a gate that acts per tile), or None."""
    splitting = [term for term in request.terms if term.tile is not None and term.foreign_refusal is None]
    if len(splitting) > 1:
        raise UsageError(f"--output-kernel {request.kernel} can serve one gate on dW at most, got "
                         f"{', '.join(term.name for term in splitting)}")
    return splitting[0] if splitting else None


class _ForeignLinearLoss(torch.autograd.Function):
    """Per-row losses of a foreign kernel; backward forms dH and the gated dW."""

    @staticmethod
    def forward(ctx, hidden, weight, target, request, per_row):
        epsilon = torch_smoothing(request.label_smoothing, weight.size(0))
        splitter = _row_splitter(request)
        classes = ([torch.arange(target.numel(), device=target.device)] if splitter is None
                   else splitter.foreign_row_classes(target))
        with torch.enable_grad():
            h = hidden.detach().requires_grad_(hidden.requires_grad)
            weights = [weight.detach().requires_grad_(weight.requires_grad) for _ in classes]
            row_loss = torch.zeros(target.shape, dtype=torch.promote_types(hidden.dtype, torch.float32),
                                   device=hidden.device)
            for rows, w in zip(classes, weights):
                if rows.numel():
                    loss = per_row(h.index_select(0, rows), w, target.index_select(0, rows), epsilon)
                    row_loss = row_loss.index_copy(0, rows, loss.to(row_loss.dtype))
        ctx.graph = (h, weights, row_loss, classes, epsilon, splitter)
        ctx.request = request
        ctx.save_for_backward(hidden, weight, target)
        return row_loss.detach()

    @staticmethod
    def backward(ctx, grad_rows):
        hidden, weight, target = ctx.saved_tensors
        h, weights, row_loss, classes, epsilon, splitter = ctx.graph
        inputs = [t for t in (h, *weights) if t.requires_grad]
        grads = dict(zip(map(id, inputs), torch.autograd.grad(row_loss, inputs, grad_rows, allow_unused=True)))
        grad_hidden = grads.get(id(h)) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            parts = [grads.get(id(w)) for w in weights]
            parts = [torch.zeros_like(weight) if p is None else p for p in parts]
            if splitter is None:
                grad_weight = parts[0].float() if parts[0].dtype != torch.float64 else parts[0]
            else:
                grad_weight = splitter.foreign_grad_weight(ForeignRows(
                    hidden=hidden, weight=weight, target=target, row_loss=row_loss.detach(), grad_rows=grad_rows,
                    epsilon=epsilon, classes=classes, parts=parts))
            for term in ctx.request.terms:
                term.finish_grad_weight(grad_weight)
            grad_weight = grad_weight.to(weight.dtype)
        del ctx.graph
        return grad_hidden, grad_weight, None, None, None


def foreign_linear_loss(hidden, weight, target, request, refusal: Optional[str] = None):
    """(per-row loss, per-row NLL) of ``request`` through its foreign kernel; the loss is
    differentiable in ``hidden`` and ``weight``, with the gates' dW. ``refusal``: why the kernel
    cannot serve the request (:func:`fairseq_agg.ops.output_kernel.foreign_refusal`), raised."""
    if refusal:
        raise UsageError(refusal)
    per_row = load_foreign_kernel(request.output_kernel.implementation)
    row_loss = _ForeignLinearLoss.apply(hidden, weight, target, request, per_row)
    with torch.no_grad():
        nll = row_loss.detach()
        epsilon = torch_smoothing(request.label_smoothing, weight.size(0))
        if epsilon > 0:  # nll = loss - eps' z_y + (eps' / V) sum_k z_k (module docstring)
            target_logit, logit_sum = target_and_summed_logits(hidden.detach(), weight.detach(), target, nll.dtype)
            nll = nll - epsilon * target_logit + (epsilon / weight.size(0)) * logit_sum
    return row_loss, nll
