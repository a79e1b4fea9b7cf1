"""The interface of a **term**: what a method adds to the fused output layer, whose chunk body
(:mod:`fairseq_agg.ops.output_chunk`) folds the request's terms by role.

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
here, in the chunk body or in the chunk loop names a method.
"""
from typing import Callable, NamedTuple, Optional, Tuple

import torch

# --- the roles -----------------------------------------------------------------------------------

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
