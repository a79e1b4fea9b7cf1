"""The fused, chunked output layer: ``softmax(H W^T)`` and its (label-smoothed) cross-entropy,
with the terms of the methods folded in.

One autograd Function serves every method of this package. Its contract is three tensors and one
request, and one result back:

    result = fused_linear_loss(hidden, weight, target, LossRequest(...))

:class:`LossRequest` carries what is the same for a run (label smoothing in fairseq's convention:
the target gets 1 - eps, every other entry eps / (V - 1); the chunk size; which kernel,
:mod:`fairseq_agg.ops.output_kernel`) and, added per batch by :meth:`LossRequest.with_terms`, an
ordered tuple of **terms** (:class:`fairseq_agg.ops.term.Term`): each adds a loss, weights rows, or gates
dW, and is read here only through that one interface; the methods' modules import this one, never
the other way round. :class:`LossResult` gives back the loss, the NLL and, by each term's name, the
sums of the values it logs; ``per_token`` gives per-token losses (fairseq's ``reduce=False``).

The file reads in execution order: the request and the result, :func:`fused_linear_loss`, the
autograd Function, the chunk loop (:class:`_ChunkLoop`: per chunk the logits matmul, the body on
each block of rows, then dH and dW), and last the small helpers they call.

The logits ``Z = H W^T`` are computed once, chunk by chunk over the tokens, into one reused buffer
in the model dtype; the chunk body (:mod:`fairseq_agg.ops.output_chunk`: cross-entropy and the
fold over the terms, one generated kernel when compiled) turns them, in place, into the logit
gradient G (and the gated G_w into a second buffer); then ``dH = G W`` and ``dW += G_w^T H`` stay
matmuls (cuBLAS/MKL), dW accumulated in fp32. Only dH and dW are kept, so no N x V tensor outlives
a chunk (the fused linear-cross-entropy pattern; docs/agg.md, "How it is computed"). Backward only
scales the saved gradients by the incoming gradient; per-token losses, whose incoming gradient
differs per token, are differentiated by a second pass that weights each row. Softmax and all
loss arithmetic run in fp32 (fp64 for fp64 inputs) whatever the dtype of H and W; the matmuls run
in the model dtype.
"""
import copy
from dataclasses import dataclass, field
from typing import Dict, NamedTuple, Optional, Tuple

import torch

from fairseq_agg.errors import check_integer, check_number

from .foreign_kernels import foreign_linear_loss
from .body_runner import body_runner
from .output_chunk import BodyPlan, TermPlan, add_columns, smoothing_weights
from .term import ADDS_LOSS, GATES_DW, ROLES, Term
from .output_kernel import OutputKernel, foreign_refusal

# --- the request and the result ----------------------------------------------------------------


@dataclass
class LossRequest:
    """What the fused layer adds to (label-smoothed) cross-entropy; see the module docstring."""

    label_smoothing: float = 0.0
    terms: Tuple[Term, ...] = ()  # in the order their losses are added (None: left out)
    chunk_size: int = 2048  # tokens per chunk; peak extra memory O(chunk_size x V)
    per_token: bool = False  # loss and nll per token (N,) instead of their sums
    record_argmax: bool = False  # return each row's argmax
    kernel: str = "auto"  # --output-kernel: a body (auto | eager | compiled) or a foreign kernel (torch | liger | cce)
    output_kernel: OutputKernel = field(init=False, repr=False, compare=False)  # ``kernel`` on its two axes

    def __post_init__(self):
        self.label_smoothing = float(check_number("label_smoothing", self.label_smoothing, 0, 1, high_open=True))
        self.chunk_size = check_integer("output_chunk_tokens", self.chunk_size, 1)
        self.output_kernel = OutputKernel.from_flag(self.kernel)
        self.kernel = self.output_kernel.flag
        self.terms = _checked_terms(self.terms)

    def with_terms(self, *terms, per_token: Optional[bool] = None,
                   record_argmax: Optional[bool] = None) -> "LossRequest":
        """This request with ``terms`` (None: left out) added after its own, and ``per_token`` or
        ``record_argmax`` set where given: what a batch adds to a request built once, whose values
        are not checked again."""
        request = copy.copy(self)
        request.terms = _checked_terms(self.terms + terms)
        if per_token is not None:
            request.per_token = bool(per_token)
        if record_argmax is not None:
            request.record_argmax = bool(record_argmax)
        return request

    @property
    def needs_argmax(self) -> bool:
        return self.record_argmax or any(term.needs_argmax for term in self.terms)

    def logged_values(self):
        """(term's name, value's name) of every value the terms log, in their order."""
        return [(term.name, name) for term in self.terms for name in term.value_names]


def _checked_terms(terms) -> Tuple[Term, ...]:
    """The terms as a tuple (None left out), each with a known role, the names of logged values unique."""
    terms = tuple(term for term in terms if term is not None)
    names = [term.name for term in terms if term.value_names]
    for term in terms:
        if getattr(term, "role", None) not in ROLES:
            raise ValueError(f"a term's role must be one of {', '.join(ROLES)}, got {term!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"two terms log values under the same name: {', '.join(names)}")
    return terms


@dataclass
class LossResult:
    """What the fused layer returns; every tensor but ``loss`` carries no gradient."""

    loss: torch.Tensor  # summed loss, or (N,) per token with ``per_token``; differentiable
    nll: torch.Tensor  # summed NLL (ppl), or (N,) per token
    terms: Dict[str, Dict[str, torch.Tensor]] = field(default_factory=dict)  # {term: {value: its sum}}
    argmax: Optional[torch.Tensor] = None  # (N,) argmax of every row's logits, when asked


# --- the entry ---------------------------------------------------------------------------------


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
    for term in request.terms:
        term.check_inputs(target, weight.size(0), request)
    if request.output_kernel.foreign:
        refusal = foreign_refusal(request.output_kernel, request.terms, label_smoothing=request.label_smoothing > 0,
                                  argmax=request.needs_argmax)
        row_loss, row_nll = foreign_linear_loss(hidden, weight, target, request, refusal)
        return LossResult(loss=row_loss if request.per_token else row_loss.sum(),
                          nll=row_nll if request.per_token else row_nll.sum())
    # Under torch.no_grad (validation) the gradients are not formed at all.
    compute_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    loss, nll, argmax, *values = _FusedLinearLoss.apply(hidden, weight, target, request, compute_grad)
    return LossResult(loss=loss, nll=nll, terms=_by_term(request, values),
                      argmax=argmax if request.needs_argmax else None)


def _by_term(request: LossRequest, values) -> Dict[str, Dict[str, torch.Tensor]]:
    terms: Dict[str, Dict[str, torch.Tensor]] = {}
    for (term, name), value in zip(request.logged_values(), values):
        terms.setdefault(term, {})[name] = value
    return terms


# --- the autograd Function ---------------------------------------------------------------------


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
        values = (out.nll, out.argmax, *out.values)
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


# --- the chunk loop ----------------------------------------------------------------------------


def _output_layer_pass(hidden, weight, target, request: LossRequest, needs_grad, row_scale=None) -> "_Pass":
    """One pass over the chunks: the values, and with ``needs_grad`` dH and dW, each row's part of
    the logit gradient multiplied by ``row_scale[n]`` when given (the per-token backward)."""
    loop = _ChunkLoop(hidden, weight, request, needs_grad, row_scale)
    for start, stop in chunk_bounds(hidden.size(0), request.chunk_size):
        loop.chunk(hidden, target, start, stop)
    return loop.result()


class _Pass(NamedTuple):
    loss: torch.Tensor  # sum, or (N,) per token
    nll: torch.Tensor
    values: tuple  # the sums of LossRequest.logged_values, in order
    argmax: torch.Tensor  # empty unless asked
    grad_hidden: Optional[torch.Tensor]
    grad_weight: Optional[torch.Tensor]


class _ChunkLoop:
    """One pass over the chunks: its buffers, the body's plan and runner, and the running sums.

    The logits, and then in place their gradient, live in one reused buffer in the model's dtype
    (on a CPU each fresh chunk x V tensor costs more in page faults than the arithmetic on it); a
    second one holds the gated gradient for dW. The eager body works through cache-sized blocks of
    rows on a CPU; the compiled body takes the whole chunk."""

    def __init__(self, hidden, weight, request: LossRequest, needs_grad: bool, row_scale):
        n_rows, vocab, device = hidden.size(0), weight.size(0), hidden.device
        self.request, self.needs_grad, self.row_scale, self.weight = request, needs_grad, row_scale, weight
        self.runner = body_runner(request.output_kernel.body, device)
        self.acc = acc = loss_dtype(hidden, weight)
        opts = dict(dtype=acc, device=device)
        self.grad_hidden = torch.empty(hidden.shape, **opts) if needs_grad else None
        self.grad_weight = torch.zeros(weight.shape, **opts) if needs_grad else None
        self.loss_sum, self.nll_sum, self.sums = torch.zeros((), **opts), torch.zeros((), **opts), {}
        self.token_loss = torch.empty(n_rows, **opts) if request.per_token else None
        self.token_nll = torch.empty(n_rows, **opts) if request.per_token else None
        self.argmax = torch.empty(n_rows if request.needs_argmax else 0, dtype=torch.long, device=device)
        rows = min(request.chunk_size, n_rows)
        logit_dtype = weight.dtype if hidden.dtype == weight.dtype else acc
        # One spare row: every chunk is then a strict part of its buffer, so the compiled body sees the
        # same view relation for full and partial chunks (else Dynamo compiles a second graph for the last).
        self.logits_buf = torch.empty((rows + 1, vocab), dtype=logit_dtype, device=device)
        self.gates_after = _tile_gates(request) if gate_after_dh(request, device, needs_grad) else []
        gate_in_body = needs_grad and bool(_tile_gates(request)) and not self.gates_after
        self.gated_buf = torch.empty_like(self.logits_buf) if gate_in_body else None
        self.block = rows if self.runner.body == "compiled" else block_rows(device, vocab, acc, rows)
        # (position in the request, term) of each term the body folds over
        self.body_terms = [(i, term) for i, term in enumerate(request.terms)
                           if term.tile is not None and (term.role != GATES_DW or gate_in_body)]
        self.plan = body_plan(request, acc, needs_grad, row_scale is not None, self.body_terms)
        self.smoothing = smoothing_weights(request.label_smoothing, vocab, acc, device)
        self.weight_t = weight.t()

    def chunk(self, hidden, target, start: int, stop: int):
        h = hidden[start:stop]
        z_chunk = self.logits_buf[: stop - start]
        _matmul_into(z_chunk, h, self.weight_t)  # the only logits matmul
        for b in range(start, stop, self.block):
            self._block(z_chunk, target, start, b, min(b + self.block, stop))
        if self.needs_grad:  # dH from the un-gated G, dW from the gated one (docs/agg.md (A6))
            _matmul_into(self.grad_hidden[start:stop], z_chunk, self.weight)
            for gate in self.gates_after:
                gate.gate_in_place(z_chunk, target[start:stop], self._in_place)
            for_weight = z_chunk if self.gated_buf is None else self.gated_buf[: stop - start]
            _matmul_into(self.grad_weight, for_weight.t(), h, accumulate=True)

    def _in_place(self, function, grad, inputs_of):
        self.runner.in_place(function, grad, inputs_of, self.block)

    def _block(self, z_chunk, target, start: int, b: int, e: int):
        z, y = z_chunk[b - start : e - start], target[b:e]
        gated = None if self.gated_buf is None else self.gated_buf[b - start : e - start]
        inputs = tuple(term.tile_inputs(slice(b, e), y, self.acc) for _, term in self.body_terms)
        values = self.runner(self.plan, z, y, self.smoothing, None if self.row_scale is None else self.row_scale[b:e],
                             z, gated, inputs)
        for columns, column_grad, gated_column_grad in values.columns:
            add_columns(z, columns, column_grad)
            if gated_column_grad is not None:
                add_columns(gated, columns, gated_column_grad)
        if self.request.per_token:
            self.token_loss[b:e] = values.loss
            self.token_nll[b:e] = values.nll
        self.loss_sum += values.loss.sum()
        self.nll_sum += values.nll.sum()
        for (position, _), term_values in zip(self.body_terms, values.terms):
            for j, value in enumerate(term_values):
                total = self.sums.get((position, j))
                if total is None:
                    total = self.sums[position, j] = torch.zeros((), dtype=value.dtype, device=value.device)
                total += value.sum()
        if values.argmax is not None:
            self.argmax[b:e] = values.argmax

    def result(self) -> _Pass:
        if self.needs_grad:
            for term in self.request.terms:  # a gate on the summed dW (freezing: its rows never move)
                term.finish_grad_weight(self.grad_weight)
        values = tuple(self.sums[i, j] if (i, j) in self.sums else self.argmax.new_zeros((), dtype=self.acc)
                       for i, term in enumerate(self.request.terms) for j in range(len(term.value_names)))
        per_token = self.request.per_token
        return _Pass(loss=self.token_loss if per_token else self.loss_sum,
                     nll=self.token_nll if per_token else self.nll_sum, values=values, argmax=self.argmax,
                     grad_hidden=self.grad_hidden, grad_weight=self.grad_weight)


# --- what the loop calls -----------------------------------------------------------------------


def chunk_bounds(n_rows: int, chunk_size: int):
    """(start, stop) of each chunk: ``chunk_size`` rows, the last the rest, but never a chunk of one
    row after others (the one before gives it a row): a compiled body specialises on a size of 1."""
    bounds = [(start, min(start + chunk_size, n_rows)) for start in range(0, n_rows, chunk_size)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1 and chunk_size > 1:
        bounds[-2:] = [(bounds[-2][0], bounds[-2][1] - 1), (bounds[-1][0] - 1, bounds[-1][1])]
    return bounds


def body_plan(request: LossRequest, acc: torch.dtype, needs_grad: bool, row_scale: bool, body_terms) -> BodyPlan:
    """The static shape of the chunk body for ``request`` (one compiled graph per plan)."""
    return BodyPlan(acc=acc, smoothing=request.label_smoothing > 0, needs_grad=needs_grad, row_scale=row_scale,
                    argmax=request.needs_argmax,
                    terms=tuple(TermPlan(term.role, term.tile, term.gated) for _, term in body_terms))


def gate_after_dh(request: LossRequest, device: torch.device, needs_grad: bool) -> bool:
    """Whether the gates run as an in-place pass after dH = G W instead of as the body's second
    output. On a CPU a second chunk x V buffer costs page faults at every call (here a fresh
    256 MiB buffer takes about 0.09 s to write, an in-place pass over one 0.02 s); on a GPU the
    caching allocator keeps it, and the second output saves that pass's read. A loss term kept
    apart from the gates needs the second output everywhere (G_w = Gamma * G_gated + G_apart)."""
    gates = _tile_gates(request)
    return (needs_grad and device.type == "cpu" and bool(gates) and all(term.gates_in_place for term in gates)
            and all(term.gated for term in request.terms if term.role == ADDS_LOSS))


def _tile_gates(request: LossRequest):
    return [term for term in request.terms if term.role == GATES_DW and term.tile is not None]


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
