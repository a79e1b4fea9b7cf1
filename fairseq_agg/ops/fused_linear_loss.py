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
* ``per_token``: per-token losses (fairseq's ``reduce=False``) instead of their sum;
* ``kernel``: how a chunk's element-wise work runs: ``auto`` (compiled where torch.compile can
  generate code for the device, else eager), ``compiled`` or ``eager``; or ``torch`` / ``liger`` /
  ``cce``, another fused cross-entropy that serves plain CE, smoothing, AGG and freezing
  (:mod:`fairseq_agg.ops.foreign_kernels`).

The logits ``Z = H W^T`` are computed once, chunk by chunk over the tokens, into one reused buffer
in the model dtype; the chunk body (:mod:`fairseq_agg.ops.output_chunk`: cross-entropy and the
methods' terms composed into one pure function, one generated kernel when compiled) turns them, in
place, into the logit gradient G (and AGG's gated G_w into a second buffer); then ``dH = G W`` and
``dW += G_w^T H`` stay matmuls (cuBLAS/MKL), dW accumulated in fp32. Only dH and dW are kept, so no
N x V tensor outlives a chunk (the fused linear-cross-entropy pattern; docs/agg.md, "How it is
computed"). Backward only scales the saved gradients by the incoming gradient; per-token losses,
whose incoming gradient differs per token, are differentiated by a second pass that weights each
row. Softmax and all loss arithmetic run in fp32 (fp64 for fp64 inputs) whatever the dtype of H
and W; the matmuls run in the model dtype.
"""
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Protocol

import torch

from fairseq_agg.errors import check_choice, check_integer, check_number

from .foreign_kernels import FOREIGN_KERNELS, foreign_linear_loss
from .output_chunk import KERNELS as OUTPUT_KERNELS
from .output_chunk import (
    BodyPlan, add_columns, note_compile_failure, resolve_kernel, run_chunk_body, run_gate_in_place, smoothing_weights,
)


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


# On a CPU the eager chunk body works block by block, a block of rows small enough (~4 MiB) that
# the temporaries of its dozen operations stay in cache. On a GPU, and for the compiled body (one
# kernel that keeps each row in registers or cache anyway), the whole chunk is one block.
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
#
# Each method object says what it needs from a chunk (``tile_inputs``, index work of O(rows) done
# outside the body; its scalars as 0-d tensors) and gives the static, pure-tensor function the
# chunk body calls (:mod:`fairseq_agg.ops.output_chunk`).


class GradientGates(Protocol):
    """AGG's gates (:class:`fairseq_agg.ops.agg_gates.TokenGates`)."""

    def tile_inputs(self, target: torch.Tensor): ...

    tile_gate: Callable  # (tile, inputs) -> the (rows x V) factor that turns G into G_w
    def gate_in_place(self, grad: torch.Tensor, target: torch.Tensor, scale_rows_=None) -> None:
        """G_w over G in place, a pass of its own after dH (on a CPU)."""


class Teacher(Protocol):
    """The augmented loss's detached teacher (:class:`fairseq_agg.ops.augmented.TeacherTargets`)."""

    index: torch.Tensor  # (N,): one entry per target
    gate_with_agg: bool  # whether AGG's gates also act on the KL's part of dW

    def tile_inputs(self, rows: slice, acc: torch.dtype): ...

    tile_term: Callable  # (tile, inputs) -> TermOut: coef * KL per row, KL, coef * dKL/dz


class RowWeights(Protocol):
    """FACE's per-token weights (:class:`fairseq_agg.ops.face.FaceWeights`)."""

    needs_argmax: bool

    def tile_inputs(self, target: torch.Tensor): ...

    tile_row_weight: Callable  # (tile, inputs) -> (rows,) weight of each row's cross-entropy


class Penalty(Protocol):
    """Token-level unlikelihood (:class:`fairseq_agg.ops.unlikelihood.UnlikelihoodCandidates`)."""

    position: torch.Tensor  # (N,): one entry per target

    def tile_inputs(self, rows: slice, target: torch.Tensor, acc: torch.dtype): ...

    tile_term: Callable  # (tile, inputs) -> TermOut with the candidate columns


KERNELS = OUTPUT_KERNELS + FOREIGN_KERNELS


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
    kernel: str = "auto"  # the chunk body: auto | eager | compiled; or a foreign fused CE: torch | liger | cce

    def __post_init__(self):
        self.label_smoothing = float(check_number("label_smoothing", self.label_smoothing, 0, 1, high_open=True))
        self.chunk_size = check_integer("output_chunk_tokens", self.chunk_size, 1)
        self.kernel = check_choice("output_kernel", self.kernel, KERNELS)

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


def gate_after_dh(request: LossRequest, device: torch.device, needs_grad: bool) -> bool:
    """Whether AGG's gate runs as an in-place pass after dH = G W instead of as the body's second
    output. On a CPU a second chunk x V buffer costs page faults at every call (here a fresh
    256 MiB buffer takes about 0.09 s to write, an in-place pass over one 0.02 s); on a GPU the
    caching allocator keeps it, and the second output saves that pass's read. A teacher kept apart
    from the gate needs the second output everywhere (G_w = Gamma * G_CE + G_AL)."""
    teacher = request.teacher
    return (request.gates is not None and needs_grad and device.type == "cpu"
            and (teacher is None or teacher.gate_with_agg))


def body_plan(request: LossRequest, acc: torch.dtype, needs_grad: bool, row_scale: bool,
              gate_in_body: bool) -> BodyPlan:
    """The static shape of the chunk body for ``request`` (one compiled graph per plan)."""
    teacher = request.teacher
    return BodyPlan(
        acc=acc, smoothing=request.label_smoothing > 0, needs_grad=needs_grad,
        row_scale=row_scale, argmax=request.needs_argmax,
        gate=type(request.gates).tile_gate if gate_in_body else None,
        row_weight=None if request.row_weights is None else request.row_weights.tile_row_weight,
        teacher=None if teacher is None else type(teacher).tile_term,
        teacher_gated=teacher is None or teacher.gate_with_agg,
        penalty=None if request.penalty is None else type(request.penalty).tile_term,
    )


def _output_layer_pass(hidden, weight, target, request: LossRequest, needs_grad, row_scale=None) -> _Pass:
    """One pass over the chunks: the values, and with ``needs_grad`` dH and dW, each row's part of
    the logit gradient multiplied by ``row_scale[n]`` when given (the per-token backward)."""
    n_rows, vocab = hidden.size(0), weight.size(0)
    gates, teacher, row_weights, penalty = request.gates, request.teacher, request.row_weights, request.penalty
    chunk_size, per_token = request.chunk_size, request.per_token
    kernel = resolve_kernel(request.kernel, hidden.device)

    acc = loss_dtype(hidden, weight)
    opts = dict(dtype=acc, device=hidden.device)
    grad_hidden = torch.empty(hidden.shape, **opts) if needs_grad else None
    grad_weight = torch.zeros(weight.shape, **opts) if needs_grad else None
    sums = {name: torch.zeros((), **opts) for name in ("loss", "nll", "aug_kl", "penalty", "row_weight")}
    candidate_count = torch.zeros((), dtype=torch.long, device=hidden.device)
    token_loss = torch.empty(n_rows, **opts) if per_token else None
    token_nll = torch.empty(n_rows, **opts) if per_token else None
    argmax = torch.empty(n_rows if request.needs_argmax else 0, dtype=torch.long, device=hidden.device)

    # The logits, and then in place their gradient, live in one reused buffer in the model's dtype
    # (on a CPU each fresh chunk x V tensor costs more in page faults than the arithmetic on it); a
    # second one holds AGG's gated gradient for dW. The eager body works through cache-sized blocks
    # of rows on a CPU; the compiled body takes the whole chunk.
    rows = min(chunk_size, n_rows)
    logit_dtype = weight.dtype if hidden.dtype == weight.dtype else acc
    # One spare row: every chunk is then a strict part of its buffer, so the compiled body sees the
    # same view relation for full and partial chunks (else Dynamo compiles a second graph for the last).
    logits_buf = torch.empty((rows + 1, vocab), dtype=logit_dtype, device=hidden.device)
    gate_after = gate_after_dh(request, hidden.device, needs_grad)
    gate_in_body = needs_grad and gates is not None and not gate_after
    gated_buf = torch.empty_like(logits_buf) if gate_in_body else None
    block = rows if kernel == "compiled" else block_rows(hidden.device, vocab, acc, rows)
    plan = body_plan(request, acc, needs_grad, row_scale is not None, gate_in_body)
    smoothing = smoothing_weights(request.label_smoothing, vocab, acc, hidden.device)
    weight_t = weight.t()

    for start, stop in chunk_bounds(n_rows, chunk_size):
        h = hidden[start:stop]
        z_chunk = logits_buf[: stop - start]
        _matmul_into(z_chunk, h, weight_t)  # the only logits matmul
        for b in range(start, stop, block):
            e = min(b + block, stop)
            z, y = z_chunk[b - start : e - start], target[b:e]
            args = (
                z, y, smoothing, None if row_scale is None else row_scale[b:e], z,
                None if gated_buf is None else gated_buf[b - start : e - start],
                gates.tile_inputs(y) if gate_in_body else None,
                None if row_weights is None else row_weights.tile_inputs(y),
                None if teacher is None else teacher.tile_inputs(slice(b, e), acc),
                None if penalty is None else penalty.tile_inputs(slice(b, e), y, acc),
            )
            values, kernel = _run_body(kernel, request.kernel, plan, args, hidden.device)
            if values.columns is not None:
                add_columns(z, values.columns, values.column_grad)
                if values.gated_column_grad is not None:
                    add_columns(gated_buf[b - start : e - start], values.columns, values.gated_column_grad)
            if per_token:
                token_loss[b:e] = values.loss
                token_nll[b:e] = values.nll
            sums["loss"] += values.loss.sum()
            sums["nll"] += values.nll.sum()
            if values.aug_kl is not None:
                sums["aug_kl"] += values.aug_kl.sum()
            if values.penalty is not None:
                sums["penalty"] += values.penalty.sum()
                candidate_count += values.candidates.sum()
            if values.row_weight is not None:
                sums["row_weight"] += values.row_weight.sum()
            if values.argmax is not None:
                argmax[b:e] = values.argmax
        if needs_grad:  # dH from the un-gated G, dW from the gated one (docs/agg.md (A6))
            _matmul_into(grad_hidden[start:stop], z_chunk, weight)
            if gate_after:
                run_gate_in_place(kernel, gates, z_chunk, target[start:stop], block)
            for_weight = z_chunk if gated_buf is None else gated_buf[: stop - start]
            _matmul_into(grad_weight, for_weight.t(), h, accumulate=True)

    if needs_grad and request.frozen_rows is not None:
        grad_weight.masked_fill_(request.frozen_rows.unsqueeze(1), 0.0)  # all terms: the rows never move
    return _Pass(
        loss=token_loss if per_token else sums["loss"], nll=token_nll if per_token else sums["nll"],
        aug_kl=sums["aug_kl"], penalty=sums["penalty"], penalty_candidates=candidate_count,
        row_weight_sum=sums["row_weight"], argmax=argmax, grad_hidden=grad_hidden, grad_weight=grad_weight,
    )


def chunk_bounds(n_rows: int, chunk_size: int):
    """(start, stop) of each chunk: ``chunk_size`` rows, the last the rest, but never a chunk of one
    row after others (the one before gives it a row): a compiled body specialises on a size of 1."""
    bounds = [(start, min(start + chunk_size, n_rows)) for start in range(0, n_rows, chunk_size)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1 and chunk_size > 1:
        bounds[-2:] = [(bounds[-2][0], bounds[-2][1] - 1), (bounds[-1][0] - 1, bounds[-1][1])]
    return bounds


def _run_body(kernel: str, asked: str, plan: BodyPlan, args, device):
    """The chunk body on ``kernel``; under ``auto`` a failed compilation falls back to eager once
    and for all (said in the log). Returns the values and the kernel to use from now on."""
    if kernel == "compiled" and asked == "auto":
        try:
            return run_chunk_body(kernel, plan, *args), kernel
        except Exception as error:  # noqa: BLE001 - any compiler failure: the eager body is the same math
            note_compile_failure(device, error)
            kernel = "eager"
    return run_chunk_body(kernel, plan, *args), kernel


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
    if request.kernel in FOREIGN_KERNELS:
        row_loss, row_nll = foreign_linear_loss(hidden, weight, target, request)
        zero = torch.zeros((), dtype=row_nll.dtype, device=hidden.device)
        return LossResult(
            loss=row_loss if request.per_token else row_loss.sum(), nll=row_nll if request.per_token else row_nll.sum(),
            aug_kl=zero, penalty=zero, penalty_candidates=torch.zeros((), dtype=torch.long, device=hidden.device),
            row_weight_sum=zero,
        )
    # Under torch.no_grad (validation) the gradients are not formed at all.
    compute_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    loss, nll, aug_kl, penalty, candidates, weight_sum, argmax = _FusedLinearLoss.apply(
        hidden, weight, target, request, compute_grad
    )
    return LossResult(
        loss=loss, nll=nll, aug_kl=aug_kl, penalty=penalty, penalty_candidates=candidates,
        row_weight_sum=weight_sum, argmax=argmax if request.needs_argmax else None,
    )
