"""Rare-token freezing (Yu et al., ACL 2022, §3, Table 1): the output-embedding rows of the rare
tokens get no gradient at all (docs/baselines.md, "Rare-token freezing"); pure torch.

It is AGG's gating with g1 = g2 = 0 on the rare group *and* its own column zeroed too, i.e. the
whole rows of dW of those tokens are zero. The fused output layer does it once per micro-batch,
after its chunk loop: :class:`FrozenRows` is a term that gates the summed dW
(:class:`fairseq_agg.ops.term.Term`), the same on this package's kernel and on a foreign one.
:class:`RareFreezing` is the method for a training loop; the fairseq criterion
``cross_entropy_agg --agg-freeze-rare`` is a thin user of it.
"""
from dataclasses import dataclass
from typing import Optional

import torch

from fairseq_agg.errors import UsageError, check_choice, check_integer

from .term import GATES_DW, Term


def frozen_rare_rows(vocab_size: int, gates=None, group: Optional[torch.Tensor] = None, device=None) -> torch.Tensor:
    """The (V,) bool mask of output-embedding rows that get no gradient: either AGG's rare group of
    this micro-batch (``gates.rare`` of its :class:`~fairseq_agg.ops.agg.TokenGates`, the
    window-and-threshold set) or a fixed group of ids (``group``, e.g. the static bottom 20 % of
    the dictionary)."""
    if (gates is None) == (group is None):
        raise ValueError("frozen_rare_rows needs exactly one of gates and group")
    if gates is not None:
        return gates.rare.to(device=device, dtype=torch.bool)
    mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    mask[group.to(mask.device)] = True
    return mask


@dataclass
class FrozenRows(Term):
    """The term of the fused layer: the rows ``mask`` ((V,) bool) of dW set to zero after the
    chunk loop, for every other term's part too."""

    mask: torch.Tensor

    name = "freezing"
    role = GATES_DW
    foreign_refusal = None  # the summed dW of any kernel

    def check_inputs(self, target: torch.Tensor, vocab: int, request=None) -> None:
        if self.mask.dtype != torch.bool or self.mask.shape != (vocab,):
            raise ValueError(f"frozen_rows must be a bool mask of shape ({vocab},)")

    def finish_grad_weight(self, grad_weight: torch.Tensor) -> None:
        grad_weight.masked_fill_(self.mask.unsqueeze(1), 0.0)


FREEZE_SETS = ("window", "group")


class RareFreezing:
    """Rare-token freezing: the output-embedding rows of the rare tokens get no gradient at all.

    Args:
        vocab_size: V.
        rare_set: ``"window"`` = AGG's rare group of the micro-batch (its gates' ``rare``), or
            ``"group"`` = the fixed ids ``group`` (e.g. the bottom 20 % of the dictionary).
        until_update: freeze during the first N updates only; 0 = the whole run.
    """

    def __init__(self, vocab_size: int, *, rare_set: str = "window", group: Optional[torch.Tensor] = None,
                 until_update: int = 0):
        self.vocab_size = check_integer("vocab_size", vocab_size, 1)
        self.rare_set = check_choice("agg_freeze_set", rare_set, FREEZE_SETS)
        self.until_update = check_integer("agg_freeze_until_update", until_update, 0)
        if (self.rare_set == "group") != (group is not None):
            raise UsageError("--agg-freeze-set group needs the group's ids, and only it takes them")
        self.group = None if group is None else torch.as_tensor(group, dtype=torch.long)

    def active(self, update_num: int) -> bool:
        return self.until_update == 0 or update_num < self.until_update

    def rows(self, update_num: int, gates=None, device=None) -> Optional[torch.Tensor]:
        """The (V,) bool mask of the rows frozen in this update, None once freezing ended.
        ``gates`` (AGG's, of this micro-batch) give the ``window`` set."""
        if not self.active(update_num):
            return None
        if self.rare_set == "window":
            if gates is None:
                raise ValueError("--agg-freeze-set window freezes AGG's rare group: pass this micro-batch's gates")
            return frozen_rare_rows(self.vocab_size, gates=gates, device=device)
        return frozen_rare_rows(self.vocab_size, group=self.group, device=device)

    def terms(self, update_num: int, gates=None, device=None):
        """The terms for ``LossRequest.with_terms`` in this update: the frozen rows, or none once
        freezing ended."""
        mask = self.rows(update_num, gates, device)
        return () if mask is None else (FrozenRows(mask),)
