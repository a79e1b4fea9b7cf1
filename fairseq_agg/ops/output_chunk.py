"""The body of the fused output layer's chunk loop: everything between ``Z = H_c W^T`` and the
matmuls ``dH = G W`` and ``dW += G_w^T H_c``, as one pure function of the logit tile.

The body is a fold. Cross-entropy (with fairseq's label smoothing) is its core; the request's
terms (:mod:`fairseq_agg.ops.terms`) join it by role, in the request's order:

* the terms that **weight rows** scale each row's cross-entropy and its gradient;
* the terms that **add a loss** add a per-row loss and a logit-gradient expression (the gradients
  in the reverse order of the losses), plus optional sparse columns, which the caller adds in
  place after the body (inside a compiled graph a scatter would copy the whole chunk);
* the terms that **gate dW** turn the logit gradient into the one that forms dW; dH is never
  gated, and a loss term that is not ``gated`` keeps its part of dW un-gated. The body writes both
  gradients where the caller asks (a GPU); on a CPU the caller gates in place after dH instead
  (``gate_after_dh`` in fused_linear_loss says why).

Each term's ``tile_inputs`` does its index work outside the body; its static ``tile`` is what the
body calls. The same body runs eagerly (the reference and the fallback) or through
``torch.compile`` (:mod:`fairseq_agg.ops.output_kernel`), where Dynamo unrolls the fold: the
generated code is one kernel per plan (Inductor: Triton on a GPU, C++/OpenMP on a CPU).

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

from .terms import ADDS_LOSS, GATES_DW, WEIGHTS_ROWS


class Tile:
    """A chunk of logits as every term sees it: ``z`` (rows x V) in the accumulation dtype, the
    targets, each row's target as a comparison with the column index (``is_target``, never
    materialised when compiled), the row maximum and log-sum-exp (rows x 1)."""

    def __init__(self, z: torch.Tensor, target: torch.Tensor, acc: torch.dtype, with_argmax: bool):
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

    @property
    def vocab(self) -> int:
        return self.z.size(1)

    def probs(self) -> torch.Tensor:
        """softmax(z), recomputed from z and lse (see the module docstring)."""
        return torch.exp(self.z - self.lse)

    def target_logit(self) -> torch.Tensor:
        return self.z.gather(1, self.target.unsqueeze(1)).squeeze(1)


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


def smoothing_weights(epsilon: float, vocab: int, acc: torch.dtype, device) -> torch.Tensor:
    """(1 - eps - eps_i, eps_i), eps_i = eps / (V - 1): fairseq's label smoothing gives the target
    1 - eps and every other class eps_i (``label_smoothed_nll_loss``)."""
    smooth = epsilon / (vocab - 1) if epsilon > 0 else 0.0
    return torch.tensor([1.0 - epsilon - smooth, smooth], dtype=acc, device=device)


def cross_entropy_tile(tile: Tile, smoothing: Optional[torch.Tensor]):
    """Per-row (label-smoothed) cross-entropy and NLL of a tile:
    loss = (1 - eps - eps_i) nll + eps_i sum_k -log p_k, with ``smoothing`` = (1 - eps - eps_i, eps_i)."""
    nll = tile.lse.squeeze(1) - tile.target_logit()
    if smoothing is None:
        return nll, nll
    smooth = tile.vocab * tile.lse.squeeze(1) - tile.z.sum(dim=1)
    return smoothing[0] * nll + smoothing[1] * smooth, nll


def cross_entropy_grad(tile: Tile, smoothing: Optional[torch.Tensor]) -> torch.Tensor:
    """d(loss)/dz of :func:`cross_entropy_tile`: softmax(z) - Q, Q built by comparison."""
    if smoothing is None:
        return tile.probs() - tile.is_target.to(tile.z.dtype)
    return tile.probs() - torch.where(tile.is_target, smoothing[0] + smoothing[1], smoothing[1])


def chunk_body(plan: BodyPlan, z, target, smoothing, row_scale, grad_out, grad_weight_out, inputs) -> RowValues:
    """One chunk: the per-row values, and with ``plan.needs_grad`` the logit gradient written into
    ``grad_out`` (for dH; it may be ``z`` itself) and the gated one into ``grad_weight_out`` (for dW,
    only with a gate in the plan). ``inputs`` holds each term's tile inputs, in the plan's order.
    Reads all of ``z`` before writing."""
    tile = Tile(z, target, plan.acc, plan.argmax)
    smoothing = smoothing if plan.smoothing else None
    ce, nll = cross_entropy_tile(tile, smoothing)
    outs = [None] * len(plan.terms)
    row_weight = None
    for i, term in enumerate(plan.terms):
        if term.role == WEIGHTS_ROWS:
            outs[i] = term.tile(tile, inputs[i])
            row_weight = outs[i].factor if row_weight is None else row_weight * outs[i].factor
    loss = ce if row_weight is None else row_weight * ce
    for i, term in enumerate(plan.terms):
        if term.role == ADDS_LOSS:
            outs[i] = term.tile(tile, inputs[i])
            loss = loss + outs[i].loss
    values = RowValues(loss=loss, nll=nll, argmax=tile.argmax,
                       terms=tuple(() if out is None else out.values for out in outs))
    if not plan.needs_grad:
        return values
    columns = _write_gradients(plan, tile, smoothing, row_weight, outs, inputs, row_scale, grad_out, grad_weight_out)
    return values._replace(columns=columns)


def _write_gradients(plan, tile, smoothing, row_weight, outs, inputs, row_scale, grad_out, grad_weight_out):
    """The logit gradient G into ``grad_out`` and, with gates, G_w into ``grad_weight_out``; returns
    the sparse columns' (ids, G part, G_w part or None) for the caller to add."""
    scale = None if row_scale is None else row_scale.to(tile.z.dtype).unsqueeze(1)
    grad = cross_entropy_grad(tile, smoothing)
    if row_weight is not None:
        grad = grad * row_weight.unsqueeze(1)
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
