"""Token-level unlikelihood training, UL (Welleck et al., ICLR 2020, "Neural Text Generation with
Unlikelihood Training", §5.1), its math in one place; pure torch.

At target position t of a sequence, with p = softmax(z_t) and alpha >= 0:

    L_t = CE_t + alpha * sum_{c in C_t} -log(1 - p_c),   C_t = {y_1 .. y_{t-1}} minus {y_t} minus {pad}

C_t is the set of the *distinct* previous targets of the same sequence (the "previous context"
candidates; docs/baselines.md, "UL"). As in the authors' code, 1 - p_c is clamped at ``clamp``
(1e-5): a clamped candidate adds -log(clamp) and no gradient. With r_c = p_c / (1 - p_c) on the
unclamped candidates and S = sum_c r_c, the logit gradient of the UL term is

    d/dz_k = alpha * (r_k [k in C_t] - S p_k),

so the fused output layer folds -alpha S into the softmax's row scale and scatter-adds alpha r at
the candidates' columns: no tokens x V mask.

The candidates are found without a tokens x V mask either: :func:`first_occurrences` keeps, per
sequence, each token only at its first position (a stable sort per row), so the distinct tokens
before position t are exactly the kept entries at positions < t.
"""
from dataclasses import dataclass
from typing import Optional

import torch

DEFAULT_CLAMP = 1e-5


def first_occurrences(target: torch.Tensor, pad: int) -> torch.Tensor:
    """(B, T) table: ``target[b, j]`` where it is the first occurrence of that id in row b, else -1
    (padding is never kept). No (B, V) or (B, T, T) intermediate: one stable sort per row."""
    if target.dim() != 2:
        raise ValueError(f"expected a (B, T) target matrix, got {tuple(target.shape)}")
    sorted_ids, order = torch.sort(target, dim=1, stable=True)
    first_in_sorted = torch.ones_like(sorted_ids, dtype=torch.bool)
    first_in_sorted[:, 1:] = sorted_ids[:, 1:] != sorted_ids[:, :-1]
    keep = torch.zeros_like(first_in_sorted).scatter_(1, order, first_in_sorted)
    keep &= target != pad
    return torch.where(keep, target, torch.full_like(target, -1))


@dataclass
class UnlikelihoodCandidates:
    """UL's previous-context candidates for the (pad-free) rows of one micro-batch.

    ``table`` is :func:`first_occurrences` of the (B, T) targets; row n of the output layer is
    position ``position[n]`` of sequence ``sequence[n]``.
    """

    table: torch.Tensor
    sequence: torch.Tensor
    position: torch.Tensor
    alpha: float = 1.0
    clamp: float = DEFAULT_CLAMP
    value_sum: Optional[torch.Tensor] = None  # summed UL value of the rows seen (before alpha)
    candidate_count: Optional[torch.Tensor] = None  # summed |C_t| of the rows seen

    def block_candidates(self, rows: slice, target: torch.Tensor):
        """(ids, valid) of a block of rows, (rows x L) each: row n's candidates are ``ids[n][valid[n]]``.

        L is the sequence length T (no device synchronisation to find a narrower width; T is far
        below V); invalid slots hold the row's target (so a gather or scatter through them is
        harmless)."""
        position = self.position[rows]
        ids = self.table.index_select(0, self.sequence[rows])
        before = torch.arange(ids.size(1), device=ids.device).unsqueeze(0) < position.unsqueeze(1)
        target = target.unsqueeze(1)
        valid = before & (ids >= 0) & (ids != target)
        return torch.where(valid, ids, target), valid

    def block_terms(self, exp_logits: torch.Tensor, exp_sum: torch.Tensor, rows: slice, target: torch.Tensor):
        """The UL term of a block of rows from exp(z - max z) and its row sums.

        Returns ``(value, rate, ids, coef)``: value[n] = sum_c -log(max(1 - p_c, clamp)) (before
        alpha), rate[n] = S_n, and coef = r at the slots ``ids`` (0 on invalid and clamped slots):
        the logit gradient of alpha * value is alpha * (scatter(coef at ids) - rate * p). The sums of
        the value and of the candidate counts are accumulated in ``value_sum`` and
        ``candidate_count`` (for logging).
        """
        ids, valid = self.block_candidates(rows, target)
        p = exp_logits.gather(1, ids) / exp_sum.unsqueeze(1)
        one_minus = (1.0 - p).clamp_(min=self.clamp)
        unclamped = valid & (one_minus > self.clamp)
        value = torch.where(valid, -torch.log(one_minus), torch.zeros_like(p)).sum(1)
        coef = torch.where(unclamped, p / one_minus, torch.zeros_like(p))
        total, count = value.sum().detach(), valid.sum()
        self.value_sum = total if self.value_sum is None else self.value_sum + total
        self.candidate_count = count if self.candidate_count is None else self.candidate_count + count
        return value, coef.sum(1), ids, coef


def unlikelihood_candidates(target: torch.Tensor, keep: torch.Tensor, pad: int, alpha: float = 1.0,
                            clamp: float = DEFAULT_CLAMP) -> UnlikelihoodCandidates:
    """Candidates for the output-layer rows ``keep`` (flat indices into the (B, T) ``target``)."""
    width = target.size(1)
    return UnlikelihoodCandidates(
        table=first_occurrences(target, pad),
        sequence=torch.div(keep, width, rounding_mode="floor"),
        position=keep % width,
        alpha=float(alpha),
        clamp=float(clamp),
    )
