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
before position t are exactly the kept entries at positions < t. :class:`UnlikelihoodLoss` is the
method for a training loop (and the object the fairseq criterion holds).
"""
from dataclasses import dataclass, replace
from typing import Optional

import torch

from fairseq_agg.errors import check_number

from .checks import check_integer
from .fused_linear_loss import LossRequest, LossResult, PenaltyBlock, fused_linear_loss

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

    def block_terms(self, exp_logits: torch.Tensor, exp_sum: torch.Tensor, rows: slice,
                    target: torch.Tensor) -> PenaltyBlock:
        """The UL term of a block of rows from exp(z - max z) and its row sums.

        value[n] = sum_c -log(max(1 - p_c, clamp)) (before alpha), rate[n] = S_n, and the column
        gradient r at the slots ``columns`` (0 on invalid and clamped slots): the logit gradient of
        alpha * value is alpha * (scatter(r at columns) - rate * p). ``candidates`` counts |C_t|.
        """
        ids, valid = self.block_candidates(rows, target)
        p = exp_logits.gather(1, ids) / exp_sum.unsqueeze(1)
        one_minus = (1.0 - p).clamp_(min=self.clamp)
        unclamped = valid & (one_minus > self.clamp)
        value = torch.where(valid, -torch.log(one_minus), torch.zeros_like(p)).sum(1)
        coef = torch.where(unclamped, p / one_minus, torch.zeros_like(p))
        return PenaltyBlock(value=value, rate=coef.sum(1), columns=ids, column_grad=coef, candidates=valid.sum())


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


class UnlikelihoodLoss:
    """Token-level unlikelihood training for any loop: CE + alpha * UL over the previous-context
    candidates.

    Args:
        alpha: the weight of the UL term (``--ul-alpha``, >= 0; 0 = plain cross-entropy).
        clamp: lower bound of 1 - p(c) (``--ul-clamp``, in (0, 1)); a clamped candidate adds
            -log(clamp) and no gradient.
        pad: the padding id of the (B, T) targets (never a candidate).
    """

    def __init__(self, *, alpha: float = 1.0, clamp: float = DEFAULT_CLAMP, pad: int = 1):
        self.alpha = float(check_number("ul_alpha", alpha, 0))
        self.clamp = float(check_number("ul_clamp", clamp, 0, 1, low_open=True, high_open=True))
        self.pad = check_integer("pad", pad)

    def candidates(self, padded_target: torch.Tensor, keep: torch.Tensor) -> UnlikelihoodCandidates:
        """The candidates of the rows ``keep`` (flat indices of the non-pad positions of the (B, T)
        ``padded_target``, in the order of the rows given to the output layer)."""
        return unlikelihood_candidates(padded_target, keep, self.pad, self.alpha, self.clamp)

    def __call__(self, hidden, weight, padded_target, keep, request: Optional[LossRequest] = None) -> LossResult:
        """The fused loss plus alpha * UL; ``hidden`` holds the rows ``keep`` of ``padded_target``
        (``LossResult.penalty`` is the UL term before alpha, ``penalty_candidates`` the summed |C_t|)."""
        request = LossRequest() if request is None else request
        target = padded_target.reshape(-1).index_select(0, keep)
        request = replace(request, penalty=self.candidates(padded_target, keep))
        return fused_linear_loss(hidden, weight, target, request)
