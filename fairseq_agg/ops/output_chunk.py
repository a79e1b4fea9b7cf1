"""The body of the fused output layer's chunk loop, the **terms** it folds over, and how it runs.

The body is everything between ``Z = H_c W^T`` and the matmuls ``dH = G W`` and ``dW += G_w^T H_c``,
as one pure function of the logit tile (:func:`chunk_body`, read top to bottom below). It is a
fold: cross-entropy (with fairseq's label smoothing; :func:`cross_entropy` and
:func:`cross_entropy_grad`, together) is its core; the request's terms join it by role, in the
request's order.

**A term** is what a method adds to the fused output layer, one interface for every method
(:class:`Term`). A :class:`~fairseq_agg.ops.fused_linear_loss.LossRequest` carries an ordered
tuple of them. A term has

* a ``name``, under which :class:`~fairseq_agg.ops.fused_linear_loss.LossResult` returns the sums
  of its logged per-row values (``value_names``);
* a ``role``: it adds a loss (:data:`ADDS_LOSS`), weights the rows' cross-entropy
  (:data:`WEIGHTS_ROWS`) or gates the gradient that forms dW (:data:`GATES_DW`);
* ``tile_inputs(rows, target, acc)``: its index work of O(rows) for the token positions ``rows``
  (a slice) whose targets are ``target``, done outside the body; scalars as 0-d tensors of dtype
  ``acc``, so that a changing weight never recompiles the body;
* a static ``tile(tile, inputs) -> TermOut``: pure tensor code on the tile (None for a gate that
  acts on the summed dW only, such as freezing).

**What a term's ``tile`` sees** is the :class:`Tile`, a small context: the logits ``z`` (in the
accumulation dtype), ``target``, ``is_target`` (each row's target as a comparison with the column
index), ``row_max`` and ``lse`` (rows x 1), ``argmax`` (when asked), the body's cross-entropy
``ce`` (per row, label-smoothed when the request smooths), ``nll`` (= -log p_t, the target's
negative log-probability), ``smoothing`` (None, or the smoothed targets' two values
(1 - eps - eps_i, eps_i), eps_i = eps / (V - 1)), and ``probs()`` (softmax), ``target_logprob()``,
``smoothed_targets()`` (Q, rows x V) and ``ce_grad()`` (P - Q, d ce / dz). A term never recomputes
cross-entropy and is never handed eps apart from the request.

The rest has defaults: what it checks against a call's inputs and request (:meth:`Term.check_inputs`,
so a term refuses a setting it cannot serve, e.g. label smoothing, in one line), what it does to
the summed dW (:meth:`Term.finish_grad_weight`), whether it needs each row's argmax, and whether
and how another fused cross-entropy (``--output-kernel torch``, ``liger``, ``cce``) can serve it
(:attr:`Term.foreign_refusal`). A new method subclasses :class:`Term` in its own module; nothing
here or in the chunk loop names a method.

**The fold**, by role:

* the terms that **weight rows** multiply each row's cross-entropy by a factor w (``TermOut.factor``).
  A constant weight scales the gradient by the same w. A weight that depends on the target's
  probability and carries gradient gives its derivative ``TermOut.slope`` = dw / d log p_t too:
  the body then adds ce * slope * (e_t - P) (d log p_t / dz = e_t - P), so such a method (focal or
  anti-focal weights) writes no rows x V gradient of its own. Several weights multiply (their
  slopes by the product rule);
* the terms that **add a loss** add a per-row loss and a logit-gradient expression (the gradients
  in the reverse order of the losses), plus optional sparse columns, which the caller adds in
  place after the body (inside a compiled graph a scatter would copy the whole chunk);
* the terms that **gate dW** turn the logit gradient into the one that forms dW; dH is never
  gated, and a loss term that is not ``gated`` keeps its part of dW un-gated. The body writes both
  gradients where the caller asks (a GPU); on a CPU the caller gates in place after dH instead
  (``gate_after_dh`` in fused_linear_loss says why).

**How it runs** (:class:`BodyRunner`): eagerly (the reference and the fallback) or through
``torch.compile``, where Dynamo unrolls the fold: the generated code is one kernel per plan
(Inductor: Triton on a GPU, C++/OpenMP on a CPU). Which of the two a run uses is the choice of
``--output-kernel`` (:mod:`fairseq_agg.ops.output_kernel`), resolved once per device.

Dtypes: the tile's logits arrive in the model dtype, every expression is evaluated in fp32 (fp64
for fp64 inputs), and the gradients are written back in the model dtype into buffers the caller
owns. Compiled, the expressions stay in registers: in bf16/fp16 no fp32 chunk x V tensor exists
(tests/test_output_kernel.py reads the generated code). The softmax is written as
``exp(z - lse)`` rather than ``exp(z - max) / sum`` on purpose: the second form reuses
``exp(z - max)`` and makes Inductor store it as an fp32 chunk x V buffer.

A plan (:class:`BodyPlan`) is the static shape of the fold: the dtype, the switches, and each
term's role, static function and gating. A process compiles one graph per plan, the first time it
is used; all dimensions are dynamic, so fairseq's varying batch sizes do not recompile it.
"""
import contextlib
import types
from typing import Callable, Dict, NamedTuple, Optional, Tuple

import torch

from .output_kernel import note_compile_failure, private_compile_settings, resolve_body

# --- the terms -----------------------------------------------------------------------------------

ADDS_LOSS = "adds a loss"  # per-row loss, its logit gradient (and sparse columns)
WEIGHTS_ROWS = "weights rows"  # one factor per row on the cross-entropy (and its derivative, if it has one)
GATES_DW = "gates dW"  # a factor on the logit gradient that forms dW, and/or a change of the summed dW
ROLES = (ADDS_LOSS, WEIGHTS_ROWS, GATES_DW)


class TermOut(NamedTuple):
    """What a term gives back on a tile, by role: a loss term its per-row ``loss`` (weighted, in
    the optimised loss), the logit-gradient expression ``grad`` (rows x V) and, where it has
    sparse columns, their ids (rows x L) and the gradient added there; a row weight its ``factor``
    (rows,) and, where the weight carries gradient, its ``slope`` (rows,), d factor / d log p_t;
    a gate its ``factor`` (rows x V). ``values`` are the per-row values it logs, in the order of
    its ``value_names`` (the layer returns their sums)."""

    loss: Optional[torch.Tensor] = None
    grad: Optional[torch.Tensor] = None
    factor: Optional[torch.Tensor] = None
    values: Tuple[torch.Tensor, ...] = ()
    columns: Optional[torch.Tensor] = None
    column_grad: Optional[torch.Tensor] = None
    slope: Optional[torch.Tensor] = None


class Term:
    """The interface of a term (see the module docstring); subclasses set ``name``, ``role`` and
    ``tile`` (a staticmethod) and override what they need."""

    name: str = "term"
    role: str = ADDS_LOSS
    value_names: Tuple[str, ...] = ()
    tile: Optional[Callable] = None
    gated: bool = True  # a loss term: whether the gates act on its part of dW too
    needs_argmax: bool = False  # the body takes each row's argmax for it
    gates_in_place: bool = False  # a gate: it can act in place on a written gradient (gate_in_place)
    # what another fused cross-entropy cannot compute, for its one-line refusal; None: it can, by
    # foreign_row_classes and foreign_grad_weight (a gate) or finish_grad_weight alone
    foreign_refusal: Optional[str] = "a term of this package"

    def tile_inputs(self, rows: slice, target: torch.Tensor, acc: torch.dtype):
        """The term's inputs for the token positions ``rows`` (targets ``target``)."""
        return None

    def scalars(self, acc: torch.dtype, device, *values) -> Tuple[torch.Tensor, ...]:
        """``values`` (the term's numbers) as 0-d tensors of dtype ``acc`` on ``device``, made once per
        dtype and device and kept on the term: for ``tile_inputs``, so that another value never
        recompiles the body."""
        made = self.__dict__.setdefault("_scalars_made", {})
        if (acc, device) not in made:
            made[acc, device] = tuple(torch.tensor(value, dtype=acc, device=device) for value in values)
        return made[acc, device]

    def check_inputs(self, target: torch.Tensor, vocab: int, request=None) -> None:
        """Refuses a call whose targets (N,), vocabulary V or request
        (:class:`~fairseq_agg.ops.fused_linear_loss.LossRequest`) do not fit this term (ValueError,
        or a :class:`~fairseq_agg.errors.UsageError` naming the flag)."""

    def finish_grad_weight(self, grad_weight: torch.Tensor) -> None:
        """Changes the summed dW (V x d) in place after every chunk (a gate on dW's rows)."""

    def gate_in_place(self, grad: torch.Tensor, target: torch.Tensor, run=None) -> None:
        """A gate: G_w over a written chunk gradient ``grad`` in place (after dH on a CPU);
        ``run(fn, grad, inputs_of)`` applies a static in-place ``fn`` compiled or block by block."""
        raise NotImplementedError(f"{type(self).__name__} cannot gate in place")

    def foreign_row_classes(self, target: torch.Tensor):
        """A gate on another kernel: the row sets (index tensors) to run through it apart."""
        raise NotImplementedError(f"{type(self).__name__} cannot run on another kernel")

    def foreign_grad_weight(self, rows):
        """A gate on another kernel: the gated dW from the un-gated dW of each row set
        (:class:`fairseq_agg.ops.foreign_kernels.ForeignRows`)."""
        raise NotImplementedError(f"{type(self).__name__} cannot run on another kernel")


# --- the body, top to bottom ---------------------------------------------------------------------


class TermPlan(NamedTuple):
    """One term as the body sees it: its role, its static tile function, whether gates act on it."""

    role: str
    tile: Callable
    gated: bool


class BodyPlan(NamedTuple):
    """The static shape of a chunk body; one compiled graph per distinct plan."""

    acc: torch.dtype  # the arithmetic's dtype: fp32, or fp64 for fp64 inputs
    smoothing: bool  # label smoothing on (its weights are an argument: no graph per epsilon or V)
    needs_grad: bool
    row_scale: bool
    argmax: bool
    terms: Tuple[TermPlan, ...] = ()


class RowValues(NamedTuple):
    """The per-row results of a chunk; the chunk loop sums them or keeps them per token."""

    loss: torch.Tensor
    nll: torch.Tensor
    argmax: Optional[torch.Tensor]
    terms: Tuple[tuple, ...]  # each term's per-row values, in the plan's order (() for a gate)
    # each sparse-column term's (columns (rows x L), what they add to G, what they add to G_w or None)
    columns: Tuple[tuple, ...] = ()


def chunk_body(plan: BodyPlan, z, target, smoothing, row_scale, grad_out, grad_weight_out, inputs) -> RowValues:
    """One chunk: the per-row values, and with ``plan.needs_grad`` the logit gradient written into
    ``grad_out`` (for dH; it may be ``z`` itself) and the gated one into ``grad_weight_out`` (for dW,
    only with a gate in the plan). ``inputs`` holds each term's tile inputs, in the plan's order.
    Reads all of ``z`` before writing."""
    tile = Tile(z, target, plan.acc, plan.argmax, smoothing if plan.smoothing else None)  # and its cross-entropy
    outs = [None] * len(plan.terms)
    row_weight = row_slope = None
    for i, term in enumerate(plan.terms):  # the row weights, multiplied
        if term.role == WEIGHTS_ROWS:
            outs[i] = term.tile(tile, inputs[i])
            row_weight, row_slope = _times(row_weight, row_slope, outs[i])
    loss = tile.ce if row_weight is None else row_weight * tile.ce
    for i, term in enumerate(plan.terms):  # the added losses
        if term.role == ADDS_LOSS:
            outs[i] = term.tile(tile, inputs[i])
            loss = loss + outs[i].loss
    values = RowValues(loss=loss, nll=tile.nll, argmax=tile.argmax,
                       terms=tuple(() if out is None else out.values for out in outs))
    if not plan.needs_grad:
        return values
    columns = _write_gradients(plan, tile, row_weight, row_slope, outs, inputs, row_scale, grad_out, grad_weight_out)
    return values._replace(columns=columns)


class Tile:
    """A chunk of logits as every term sees it (the module docstring lists what it holds), with
    the body's cross-entropy of it computed once."""

    def __init__(self, z: torch.Tensor, target: torch.Tensor, acc: torch.dtype, with_argmax: bool,
                 smoothing: Optional[torch.Tensor] = None):
        self.target = target
        self.columns = torch.arange(z.size(1), device=target.device)
        self.is_target = self.columns.unsqueeze(0) == target.unsqueeze(1)
        self.z = z.to(acc)
        if with_argmax:
            row_max, self.argmax = self.z.max(dim=1, keepdim=True)
            self.argmax = self.argmax.squeeze(1)
        else:
            row_max, self.argmax = self.z.amax(dim=1, keepdim=True), None
        self.row_max = row_max
        self.lse = row_max + torch.exp(self.z - row_max).sum(dim=1, keepdim=True).log()
        self.smoothing = smoothing
        self.ce, self.nll = cross_entropy(self)

    @property
    def vocab(self) -> int:
        return self.z.size(1)

    def probs(self) -> torch.Tensor:
        """softmax(z), recomputed from z and lse (see the module docstring)."""
        return torch.exp(self.z - self.lse)

    def target_logit(self) -> torch.Tensor:
        return self.z.gather(1, self.target.unsqueeze(1)).squeeze(1)

    def target_logprob(self) -> torch.Tensor:
        """log p_t per row."""
        return -self.nll

    def smoothed_targets(self) -> torch.Tensor:
        """Q (rows x V, built by comparison): the one-hot target, or fairseq's smoothed one."""
        if self.smoothing is None:
            return self.is_target.to(self.z.dtype)
        return torch.where(self.is_target, self.smoothing[0] + self.smoothing[1], self.smoothing[1])

    def ce_grad(self) -> torch.Tensor:
        """d ce / dz = softmax(z) - Q (:func:`cross_entropy_grad`)."""
        return cross_entropy_grad(self)


# cross-entropy, the body's core: fairseq's label_smoothed_nll_loss on a tile, and its gradient


def smoothing_weights(epsilon: float, vocab: int, acc: torch.dtype, device) -> torch.Tensor:
    """(1 - eps - eps_i, eps_i), eps_i = eps / (V - 1): fairseq's label smoothing gives the target
    1 - eps and every other class eps_i (``label_smoothed_nll_loss``)."""
    smooth = epsilon / (vocab - 1) if epsilon > 0 else 0.0
    return torch.tensor([1.0 - epsilon - smooth, smooth], dtype=acc, device=device)


def cross_entropy(tile: Tile):
    """Per-row (label-smoothed) cross-entropy and NLL of a tile: nll = lse - z_t and
    ce = (1 - eps - eps_i) nll + eps_i sum_k -log p_k, with ``tile.smoothing`` = (1 - eps - eps_i, eps_i)."""
    nll = tile.lse.squeeze(1) - tile.target_logit()
    if tile.smoothing is None:
        return nll, nll
    smooth = tile.vocab * tile.lse.squeeze(1) - tile.z.sum(dim=1)
    return tile.smoothing[0] * nll + tile.smoothing[1] * smooth, nll


def cross_entropy_grad(tile: Tile) -> torch.Tensor:
    """d ce / dz of :func:`cross_entropy`: softmax(z) - Q."""
    return tile.probs() - tile.smoothed_targets()


def _times(weight, slope, out: TermOut):
    """The product of the row weights so far (``weight``, d weight / d log p_t ``slope``) and one
    more (``out.factor``, ``out.slope``), by the product rule; None for what is absent."""
    if weight is None:
        return out.factor, out.slope
    new_slope = None if slope is None else slope * out.factor
    if out.slope is not None:
        new_slope = weight * out.slope if new_slope is None else new_slope + weight * out.slope
    return weight * out.factor, new_slope


def _write_gradients(plan, tile, row_weight, row_slope, outs, inputs, row_scale, grad_out, grad_weight_out):
    """The logit gradient G into ``grad_out`` and, with gates, G_w into ``grad_weight_out``; returns
    the sparse columns' (ids, G part, G_w part or None) for the caller to add."""
    scale = None if row_scale is None else row_scale.to(tile.z.dtype).unsqueeze(1)
    grad = tile.ce_grad()
    if row_weight is not None:
        grad = grad * row_weight.unsqueeze(1)
    if row_slope is not None:  # d(w ce)/dz = w (P - Q) + ce (dw / d log p_t) (e_t - P)
        grad = grad - (tile.ce * row_slope).unsqueeze(1) * (tile.probs() - tile.is_target.to(tile.z.dtype))
    # the parts of G that the gates act on, and the rest (loss terms kept apart from them); the
    # loss terms' gradients are added in the reverse order of their losses
    gated, apart, columns = grad, None, []
    for term, out in reversed(list(zip(plan.terms, outs))):
        if term.role != ADDS_LOSS:
            continue
        if out.grad is not None:
            if term.gated:
                gated = gated + out.grad
            else:
                apart = out.grad if apart is None else apart + out.grad
        if out.columns is not None:
            columns.insert(0, (out.columns, out.column_grad, term.gated))
    grad = gated if apart is None else gated + apart
    if scale is not None:
        grad = grad * scale
        columns = [(ids, column_grad * scale, on_gated) for ids, column_grad, on_gated in columns]

    factor = None
    for i, term in enumerate(plan.terms):
        if term.role == GATES_DW:
            part = term.tile(tile, inputs[i]).factor
            factor = part if factor is None else factor * part
    if factor is None:
        grad_out.copy_(grad.to(grad_out.dtype))
        return tuple((ids, column_grad, None) for ids, column_grad, _ in columns)
    grad_weight = gated * factor
    if apart is not None:
        grad_weight = grad_weight + apart
    if scale is not None:
        grad_weight = grad_weight * scale
    columns = tuple((ids, column_grad, factor.gather(1, ids) * column_grad if on_gated else column_grad)
                    for ids, column_grad, on_gated in columns)
    grad_weight_out.copy_(grad_weight.to(grad_weight_out.dtype))
    grad_out.copy_(grad.to(grad_out.dtype))
    return columns


def add_columns(out: torch.Tensor, columns: torch.Tensor, column_grad: torch.Tensor):
    """Adds a term's sparse column gradient to a written chunk gradient, in place (duplicate ids
    carry zeros)."""
    out.scatter_add_(1, columns, column_grad.to(out.dtype))


# --- running the body ----------------------------------------------------------------------------

MAX_GRAPHS = 4096
_compiled: Dict[BodyPlan, Callable] = {}
_compiled_in_place: Dict[Callable, Callable] = {}
_runners: Dict[Tuple[str, torch.device], "BodyRunner"] = {}


def body_runner(body: str, device: torch.device) -> "BodyRunner":
    """The runner of the body asked (``auto``, ``eager`` or ``compiled``) on ``device``, one per
    pair in a process: the choice is resolved once, not at every call."""
    runner = _runners.get((body, device))
    if runner is None:
        runner = _runners[body, device] = BodyRunner(body, device)
    return runner


def _own_code(function: Callable, name: str) -> Callable:
    """``function`` with a code object of its own named ``name``, for Dynamo to compile and cache apart."""
    # co_qualname exists from Python 3.11 on
    names = {"co_name": name, **({"co_qualname": name} if hasattr(function.__code__, "co_qualname") else {})}
    return types.FunctionType(function.__code__.replace(**names), function.__globals__, name)


def _compiled_version(cache: dict, key, function: Callable, name: str) -> Callable:
    """The compiled ``function`` kept under ``key``. Each key gets a code object of its own:
    Dynamo keeps, and caps, the graphs per code object, so plans sharing one would crowd each
    other out of that cap in a process that uses many of them."""
    compiled = cache.get(key)
    if compiled is None:
        own = _own_code(function, f"{name}_{len(cache)}")
        # dynamic: the rows of a chunk (and V, and a term's widths) vary without recompiling
        compiled = cache[key] = torch.compile(own, dynamic=True, fullgraph=True)
    return compiled


class BodyRunner:
    """How the chunk loop runs its bodies on ``device``: the body asked (``auto``, ``eager`` or
    ``compiled``) as :func:`~fairseq_agg.ops.output_kernel.resolve_body` resolves it there; under
    ``auto`` a failed compilation falls back to eager once and for all (said in the log)."""

    def __init__(self, body: str, device: torch.device):
        self.asked, self.device = body, device
        self.body = resolve_body(body, device)
        # torch's private config modules, looked up only when the compiled body is chosen
        self.settings = private_compile_settings() if self.body == "compiled" else None

    def __call__(self, plan: BodyPlan, *args) -> RowValues:
        if self.body == "compiled" and self.asked == "auto":
            try:
                return self._run(plan, args)
            except Exception as error:  # noqa: BLE001 - any compiler failure: the eager body is the same math
                note_compile_failure(self.device, error)
                self.body = "eager"
        return self._run(plan, args)

    def _compile_settings(self):
        """Dynamo's settings for the chunk body: no duck sizing, which would tie sizes that happen to
        be equal in the first call (a chunk's rows and the batch's, a width of 2) and compile again
        when they differ; and room for a process's many plans under Dynamo's cap on all its graphs."""
        dynamo_config, fx_config = self.settings
        stack = contextlib.ExitStack()
        stack.enter_context(dynamo_config.patch(accumulated_recompile_limit=MAX_GRAPHS))
        stack.enter_context(fx_config.patch(use_duck_shape=False))
        return stack

    def _run(self, plan, args):
        if self.body == "eager":
            return chunk_body(plan, *args)
        with self._compile_settings():
            return _compiled_version(_compiled, plan, chunk_body, "chunk_body")(plan, *args)

    def in_place(self, function: Callable, grad: torch.Tensor, inputs_of: Callable, eager_block: int):
        """The static in-place ``function(grad_rows, inputs)`` over a written chunk gradient, with
        ``inputs_of(rows)`` the inputs of those rows: over the whole chunk compiled, or eager
        through blocks of ``eager_block`` rows (the eager body's cache-sized blocks) so that its
        temporaries stay small."""
        if self.body == "compiled":
            compiled = _compiled_version(_compiled_in_place, function, function, function.__name__)
            with self._compile_settings():
                compiled(grad, inputs_of(slice(0, grad.size(0))))
            return
        for start in range(0, grad.size(0), eager_block):
            rows = slice(start, start + eager_block)
            function(grad[rows], inputs_of(rows))
