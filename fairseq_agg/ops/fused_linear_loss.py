"""The fused, chunked output layer: ``softmax(H W^T)`` and its (label-smoothed) cross-entropy.

One autograd Function serves every method of this package. Its contract is three tensors and one
request, and one result back:

    result = fused_linear_loss(hidden, weight, target, LossRequest(...))

:class:`LossRequest` says what to add to cross-entropy; each field is filled by one method object
and is read here only through the small interfaces below (the methods import this module, never
the other way round):

* ``label_smoothing`` in fairseq's convention: the target gets 1 - eps, every other entry
  eps / (V - 1) (``label_smoothed_nll_loss`` in fairseq/criterions/label_smoothed_cross_entropy.py);
* ``gates`` (AGG, :class:`GradientGates`): gates the cross-entropy part of the output-embedding
  gradient; the hidden-state gradient is never gated (docs/agg.md (A6));
* ``teacher`` (augmented loss, :class:`Teacher`): adds ``coef * KL(teacher || softmax(z / tau))``
  per token (Inan et al., ICLR 2017, eq. 3.2-3.3; docs/augmented_loss.md);
* ``row_weights`` (FACE, :class:`RowWeights`): one weight per token on its (smoothed)
  cross-entropy and therefore on its row of the logit gradient (docs/baselines.md, "FACE");
* ``penalty`` (token-level unlikelihood, :class:`Penalty`): adds ``alpha * sum_c -log(1 - p_c)`` over
  a few candidate columns per token, whose logit gradient is a change of the softmax's row scale
  plus a scatter at those columns (docs/baselines.md, "UL");
* ``frozen_rows`` (rare-token freezing): rows of the output-embedding gradient set to zero after
  the chunk loop (docs/baselines.md);
* ``per_token``: per-token losses (fairseq's ``reduce=False``) instead of their sum.

The logits ``Z = H W^T`` are computed once, chunk by chunk over the tokens; in the same pass the
gradients ``dH = G W`` and ``dW = G_w^T H`` are formed and only they are kept, so no N x V tensor
outlives a chunk (the fused linear-cross-entropy pattern; docs/agg.md, "How it is computed").
Backward only scales the saved gradients by the incoming gradient; per-token losses, whose
incoming gradient differs per token, are differentiated by a second pass that weights each row.
Softmax and all loss arithmetic run in fp32 whatever the dtype of H and W; the matmuls run in the
model dtype.
"""
from dataclasses import dataclass
from typing import NamedTuple, Optional, Protocol

import torch

from .checks import check_integer
from fairseq_agg.errors import check_number


def _matmul_into(out, a, b, accumulate=False):
    """out (+)= a @ b with the matmul in b's dtype; in place (no temporary) when all dtypes agree."""
    if a.dtype == b.dtype == out.dtype:
        if accumulate:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)
    else:
        product = (a.to(b.dtype) @ b).to(out.dtype)
        if accumulate:
            out += product
        else:
            out.copy_(product)


# On a CPU, the element-wise work on a chunk's logits is done block by block, a block of rows small
# enough (~4 MiB) to stay in cache across the dozen operations it goes through, so each chunk x V
# buffer is read and written about once. On a GPU the whole chunk is one block (few kernel launches).
_CPU_BLOCK_BYTES = 1 << 22


def block_rows(device, vocab, dtype, chunk_rows):
    """Rows of a V-wide block of element-wise work (see ``_CPU_BLOCK_BYTES``)."""
    if device.type != "cpu":
        return chunk_rows
    size = torch.empty((), dtype=dtype).element_size()
    return max(1, min(chunk_rows, _CPU_BLOCK_BYTES // (vocab * size)))


def loss_dtype(*tensors) -> torch.dtype:
    """fp32 at least for softmax and loss arithmetic (fp16/bf16 inputs), float64 for float64 inputs."""
    dtype = torch.float32
    for tensor in tensors:
        dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


def check_output_layer_inputs(hidden, weight, target):
    """One clear error for inputs of the wrong shape."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.size(1) != weight.size(1):
        raise ValueError(f"expected hidden (N, d) and weight (V, d), got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if target.shape != hidden.shape[:1]:
        raise ValueError(f"target must have shape ({hidden.size(0)},), got {tuple(target.shape)}")


# --- what the methods hand in -------------------------------------------------------------------


class GradientGates(Protocol):
    """AGG's gates (:class:`fairseq_agg.ops.agg_gates.TokenGates`)."""

    def gate_logit_grad_(self, grad: torch.Tensor, target: torch.Tensor) -> None:
        """Gates a chunk of the logit gradient (rows x V, targets ``target``) in place."""


class Teacher(Protocol):
    """The augmented loss's detached teacher (:class:`fairseq_agg.ops.augmented.TeacherTargets`)."""

    index: torch.Tensor  # (N,): one entry per target
    coef: float  # weight of the KL in the loss
    gate_with_agg: bool  # whether AGG's gates also act on the KL's part of dW

    def block_kl(self, z, row_max, rows: slice, teacher_out, tempered_out):
        """Per-token KL of a block of logit rows, and the row sums of the tempered softmax."""

    def block_grad_(self, tempered, tempered_sum, teacher_rows, row_scale=None, add_to=None) -> None:
        """coef * dKL/dz of the block, its rows times ``row_scale`` when given: added to ``add_to``,
        or else written over ``tempered``."""


class RowWeights(Protocol):
    """FACE's per-token weights (:class:`fairseq_agg.ops.face.FaceWeights`)."""

    needs_argmax: bool

    def block_row_weight(self, target: torch.Tensor, predicted: Optional[torch.Tensor]) -> torch.Tensor:
        """The weight of each row of a block (targets, and argmax when ``needs_argmax``)."""


class PenaltyBlock(NamedTuple):
    """A penalty's terms on a block of rows (see :class:`Penalty`)."""

    value: torch.Tensor  # (rows,) the penalty before alpha
    rate: torch.Tensor  # (rows,) change of the softmax's row scale, before alpha
    columns: torch.Tensor  # (rows, L) the candidate columns
    column_grad: torch.Tensor  # (rows, L) logit gradient at those columns, before alpha
    candidates: torch.Tensor  # number of valid candidates in the block


class Penalty(Protocol):
    """Token-level unlikelihood (:class:`fairseq_agg.ops.unlikelihood.UnlikelihoodCandidates`)."""

    alpha: float
    position: torch.Tensor  # (N,): one entry per target

    def block_terms(self, exp_logits, exp_sum, rows: slice, target) -> PenaltyBlock:
        """The penalty of a block from exp(z - max z) and its row sums."""


@dataclass
class LossRequest:
    """What the fused layer adds to (label-smoothed) cross-entropy; see the module docstring."""

    label_smoothing: float = 0.0
    gates: Optional[GradientGates] = None
    teacher: Optional[Teacher] = None
    row_weights: Optional[RowWeights] = None
    penalty: Optional[Penalty] = None
    frozen_rows: Optional[torch.Tensor] = None  # (V,) bool
    chunk_size: int = 2048  # tokens per chunk; peak extra memory O(chunk_size x V)
    per_token: bool = False  # loss and nll per token (N,) instead of their sums
    record_argmax: bool = False  # return each row's argmax (FACE's ``out`` counts)

    def __post_init__(self):
        self.label_smoothing = float(check_number("label_smoothing", self.label_smoothing, 0, 1, high_open=True))
        self.chunk_size = check_integer("output_chunk_tokens", self.chunk_size, 1)

    @property
    def needs_argmax(self) -> bool:
        return self.record_argmax or (self.row_weights is not None and self.row_weights.needs_argmax)


@dataclass
class LossResult:
    """What the fused layer returns; every tensor but ``loss`` carries no gradient."""

    loss: torch.Tensor  # summed loss, or (N,) per token with ``per_token``; differentiable
    nll: torch.Tensor  # summed NLL (ppl), or (N,) per token
    aug_kl: torch.Tensor  # summed KL(teacher || softmax(z / tau)) before its weight; 0 without a teacher
    penalty: torch.Tensor  # summed penalty before alpha; 0 without
    penalty_candidates: torch.Tensor  # summed number of penalty candidates
    row_weight_sum: torch.Tensor  # summed row weights; 0 without
    argmax: Optional[torch.Tensor] = None  # (N,) argmax of every row's logits, when asked


# --- the chunk loop ------------------------------------------------------------------------------


class _Pass(NamedTuple):
    loss: torch.Tensor  # sum, or (N,) per token
    nll: torch.Tensor
    aug_kl: torch.Tensor
    penalty: torch.Tensor
    penalty_candidates: torch.Tensor
    row_weight_sum: torch.Tensor
    argmax: torch.Tensor  # empty unless asked
    grad_hidden: Optional[torch.Tensor]
    grad_weight: Optional[torch.Tensor]


def _logit_grad_(z, z_sum, y, target_weight, eps_i, row_weight, penalty, terms):
    """Turns a block's exp(z - max z) into its logit gradient, in place:
    G = w (softmax(Z) - Q), Q = (1-eps-eps_i) onehot + eps_i, w the row weight (1 without); a
    penalty moves the softmax's row scale and adds its own columns."""
    if row_weight is None and penalty is None:
        z.mul_(z_sum.reciprocal().unsqueeze(1))
    else:
        scale = torch.ones_like(z_sum) if row_weight is None else row_weight
        if penalty is not None:
            scale = scale - penalty.alpha * terms.rate
        z.mul_((scale / z_sum).unsqueeze(1))
    if eps_i > 0:
        z.sub_(eps_i if row_weight is None else (eps_i * row_weight).unsqueeze(1))
    if row_weight is None:
        target_grad = torch.full((z.size(0), 1), -target_weight, dtype=z.dtype, device=z.device)
    else:
        target_grad = (-target_weight * row_weight).unsqueeze(1)
    z.scatter_add_(1, y.unsqueeze(1), target_grad)
    if penalty is not None:
        z.scatter_add_(1, terms.columns, terms.column_grad.mul_(penalty.alpha))


def _chunk_grads(grad, aug_grad, h, weight, gates, target, grad_hidden, grad_weight):
    """dH = G W for a chunk (never gated) and dW += (gated G)^T H. ``aug_grad``: the augmented
    loss's gradient when it is kept apart from G (AGG gates the CE part only), else None."""
    if aug_grad is None:
        _matmul_into(grad_hidden, grad, weight)
    else:
        # dH from the un-gated total, dW from the gated CE part plus the un-gated AL part: the AL
        # buffer holds the total for the matmul, then G is taken back out of it
        aug_grad.add_(grad)
        _matmul_into(grad_hidden, aug_grad, weight)
        aug_grad.sub_(grad)
    if gates is not None:
        gates.gate_logit_grad_(grad, target)
    if aug_grad is not None:
        grad.add_(aug_grad)
    _matmul_into(grad_weight, grad.t(), h, accumulate=True)


def _output_layer_pass(hidden, weight, target, request: LossRequest, needs_grad, row_scale=None) -> _Pass:
    """One pass over the chunks: the values, and with ``needs_grad`` dH and dW, each row's part of
    the logit gradient multiplied by ``row_scale[n]`` when given (the per-token backward)."""
    n_rows, _ = hidden.shape
    vocab = weight.size(0)
    gates, teacher, row_weights, penalty = request.gates, request.teacher, request.row_weights, request.penalty
    epsilon, chunk_size, per_token = request.label_smoothing, request.chunk_size, request.per_token
    eps_i = epsilon / (vocab - 1) if epsilon > 0 else 0.0
    target_weight = 1.0 - epsilon - eps_i  # fairseq: loss = (1-eps-eps_i)*nll + eps_i*smooth

    acc = loss_dtype(hidden, weight)
    opts = dict(dtype=acc, device=hidden.device)
    grad_hidden = torch.empty(hidden.shape, **opts) if needs_grad else None
    grad_weight = torch.zeros(weight.shape, **opts) if needs_grad else None
    loss, nll_sum, aug_sum, penalty_sum, weight_sum = (torch.zeros((), **opts) for _ in range(5))
    candidate_count = torch.zeros((), dtype=torch.long, device=hidden.device)
    token_loss = torch.empty(n_rows, **opts) if per_token else None
    token_nll = torch.empty(n_rows, **opts) if per_token else None
    argmax = torch.empty(n_rows if request.needs_argmax else 0, dtype=torch.long, device=hidden.device)

    # Work buffers reused by every chunk, and every step below in place: on a CPU each fresh
    # chunk x V tensor costs more (page faults) than the arithmetic done on it.
    rows = min(chunk_size, n_rows)
    block = block_rows(hidden.device, vocab, acc, rows)
    logits_buf = torch.empty((rows, vocab), **opts)
    # The augmented-loss gradient is kept apart from the CE one only when AGG gates the CE part
    # alone (docs/augmented_loss.md, "Combination with AGG").
    separate_aug = teacher is not None and needs_grad and gates is not None and not teacher.gate_with_agg
    if teacher is not None:
        tempered_buf = torch.empty((rows if separate_aug else block, vocab), **opts)
        teacher_buf = torch.empty((block, vocab), **opts)
    weight_t = weight.t()

    for start in range(0, n_rows, chunk_size):
        stop = min(start + chunk_size, n_rows)
        h = hidden[start:stop]
        z_chunk = logits_buf[: stop - start]
        _matmul_into(z_chunk, h, weight_t)  # the only logits matmul

        for b in range(start, stop, block):
            e = min(b + block, stop)
            z = z_chunk[b - start : e - start]
            y = target[b:e]
            target_logit = z.gather(1, y.unsqueeze(1)).squeeze(1)
            predicted = None
            if request.needs_argmax:
                row_max, predicted = z.max(dim=1, keepdim=True)  # the argmax in the same pass
                predicted = predicted.squeeze(1)
                argmax[b:e] = predicted
            else:
                row_max = z.amax(dim=1, keepdim=True)
            row_weight = None
            if row_weights is not None:
                row_weight = row_weights.block_row_weight(y, predicted).to(acc)
                weight_sum += row_weight.sum()
            logit_sum = z.sum(dim=-1) if eps_i > 0 else None

            if teacher is not None:  # before z is overwritten
                t = teacher_buf[: e - b]
                q = tempered_buf[b - start : e - start] if separate_aug else tempered_buf[: e - b]
                kl, q_sum = teacher.block_kl(z, row_max, slice(b, e), t, q)
                aug_sum += kl.sum()
                loss += teacher.coef * kl.sum()

            z.sub_(row_max).exp_()  # z now holds exp(z - max z)
            z_sum = z.sum(dim=-1)
            lse = row_max.squeeze(1) + z_sum.log()
            nll = lse - target_logit
            nll_sum += nll.sum()
            if eps_i > 0:
                smooth = vocab * lse - logit_sum  # sum_k -log p_k
                ce = target_weight * nll + eps_i * smooth
            else:
                ce = nll
            loss += ce.sum() if row_weight is None else row_weight.dot(ce)
            if penalty is not None:  # from exp(z - max z), before it is overwritten
                terms = penalty.block_terms(z, z_sum, slice(b, e), y)
                penalty_sum += terms.value.sum()
                candidate_count += terms.candidates
                loss += penalty.alpha * terms.value.sum()
            if per_token:
                row_loss = ce if row_weight is None else row_weight * ce
                if teacher is not None:
                    row_loss = row_loss + teacher.coef * kl
                if penalty is not None:
                    row_loss = row_loss + penalty.alpha * terms.value
                token_loss[b:e] = row_loss
                token_nll[b:e] = nll
            if not needs_grad:
                continue

            _logit_grad_(z, z_sum, y, target_weight, eps_i, row_weight, penalty, terms if penalty is not None else None)
            scale_rows = None
            if row_scale is not None:  # each token's own incoming gradient (per-token losses)
                scale_rows = row_scale[b:e].to(acc)
                z.mul_(scale_rows.unsqueeze(1))
            if teacher is not None:  # added to G (one gradient for dH and dW), or kept apart in q
                teacher.block_grad_(q, q_sum, t, scale_rows, add_to=None if separate_aug else z)

        if needs_grad:
            _chunk_grads(z_chunk, tempered_buf[: stop - start] if separate_aug else None, h, weight, gates,
                         target[start:stop], grad_hidden[start:stop], grad_weight)

    if needs_grad and request.frozen_rows is not None:
        grad_weight.masked_fill_(request.frozen_rows.unsqueeze(1), 0.0)  # all terms: the rows never move
    return _Pass(
        loss=token_loss if per_token else loss, nll=token_nll if per_token else nll_sum, aug_kl=aug_sum,
        penalty=penalty_sum, penalty_candidates=candidate_count, row_weight_sum=weight_sum, argmax=argmax,
        grad_hidden=grad_hidden, grad_weight=grad_weight,
    )


class _FusedLinearLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, request, compute_grad):
        needs_grad = compute_grad and (ctx.needs_input_grad[0] or ctx.needs_input_grad[1])
        # Per-token losses get a different gradient per token: the gradients are formed in backward,
        # by a second pass that knows them. Summed losses get theirs now, in the same pass.
        out = _output_layer_pass(hidden, weight, target, request, needs_grad and not request.per_token)
        if request.per_token:
            ctx.save_for_backward(hidden, weight, target)
            ctx.request = request
        else:
            ctx.save_for_backward(out.grad_hidden, out.grad_weight)
        ctx.computed = needs_grad
        ctx.input_dtypes = (hidden.dtype, weight.dtype)
        values = (out.nll, out.aug_kl, out.penalty, out.penalty_candidates, out.row_weight_sum, out.argmax)
        ctx.mark_non_differentiable(*values)
        return (out.loss, *values)

    @staticmethod
    def backward(ctx, grad_loss, *_grad_values):
        if not ctx.computed:
            raise RuntimeError("fused_linear_loss was called without gradient tracking; it cannot be backpropagated")
        hidden_dtype, weight_dtype = ctx.input_dtypes
        if getattr(ctx, "request", None) is not None:
            hidden, weight, target = ctx.saved_tensors
            out = _output_layer_pass(hidden, weight, target, ctx.request, True, row_scale=grad_loss)
            grad_hidden, grad_weight = out.grad_hidden, out.grad_weight
        else:
            grad_hidden, grad_weight = ctx.saved_tensors
            grad_hidden, grad_weight = grad_hidden * grad_loss, grad_weight * grad_loss
        out_h = grad_hidden.to(hidden_dtype) if ctx.needs_input_grad[0] else None
        out_w = grad_weight.to(weight_dtype) if ctx.needs_input_grad[1] else None
        return out_h, out_w, None, None, None


def fused_linear_loss(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, request: Optional[LossRequest] = None
) -> LossResult:
    """The loss of ``softmax(hidden @ weight.T)`` against ``target``, with the terms of ``request``.

    Args:
        hidden: (N, d) decoder features of the non-padding positions.
        weight: (V, d) output projection (no bias).
        target: (N,) target ids; padding must already be removed by the caller.
        request: what to add to cross-entropy (:class:`LossRequest`); ``None`` = plain CE.

    Returns:
        A :class:`LossResult`: the differentiable loss (summed, or per token) and the values of
        every term for logging.
    """
    request = LossRequest() if request is None else request
    check_output_layer_inputs(hidden, weight, target)
    if request.teacher is not None and request.teacher.index.shape != target.shape:
        raise ValueError("teacher.index must have one entry per target")
    if request.penalty is not None and request.penalty.position.shape != target.shape:
        raise ValueError("the unlikelihood candidates must have one position per target")
    frozen = request.frozen_rows
    if frozen is not None and (frozen.dtype != torch.bool or frozen.shape != weight.shape[:1]):
        raise ValueError(f"frozen_rows must be a bool mask of shape ({weight.size(0)},)")
    # Under torch.no_grad (validation) the gradients are not formed at all.
    compute_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    loss, nll, aug_kl, penalty, candidates, weight_sum, argmax = _FusedLinearLoss.apply(
        hidden, weight, target, request, compute_grad
    )
    return LossResult(
        loss=loss, nll=nll, aug_kl=aug_kl, penalty=penalty, penalty_candidates=candidates,
        row_weight_sum=weight_sum, argmax=argmax if request.needs_argmax else None,
    )
