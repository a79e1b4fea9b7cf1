"""The body of the fused output layer's chunk loop: cross-entropy and the request's terms, folded.

The body is everything between ``Z = H_c W^T`` and the matmuls ``dH = G W`` and ``dW += G_w^T H_c``,
as one pure function of the logit tile (:func:`chunk_body`, read top to bottom below). It is a
fold: cross-entropy (with fairseq's label smoothing; :func:`cross_entropy` and
:func:`cross_entropy_grad`, together) is its core; the request's terms (their interface:
:mod:`fairseq_agg.ops.term`) join it by role, in the request's order. How the body runs, eagerly
or compiled: :mod:`fairseq_agg.ops.body_runner`.

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
from typing import Callable, NamedTuple, Optional, Tuple

import torch

from .term import ADDS_LOSS, GATES_DW, WEIGHTS_ROWS, TermOut

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
