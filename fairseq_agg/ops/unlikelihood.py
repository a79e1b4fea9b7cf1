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
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch

from fairseq_agg.errors import check_integer, check_number

from .fused_linear_loss import LossRequest, LossResult, fused_linear_loss
from .term import ADDS_LOSS, Term, TermOut

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
class UnlikelihoodCandidates(Term):
    """UL's previous-context candidates for the (pad-free) rows of one micro-batch: the fused
    layer's term that adds alpha * UL per token (logged as ``unlikelihood``: ``penalty``, the UL
    term before alpha, and ``candidates``, the summed |C_t|).

    ``table`` is :func:`first_occurrences` of the (B, T) targets; row n of the output layer is
    position ``position[n]`` of sequence ``sequence[n]``.
    """

    table: torch.Tensor
    sequence: torch.Tensor
    position: torch.Tensor
    alpha: float = 1.0
    clamp: float = DEFAULT_CLAMP
    _scalars: Optional[tuple] = field(default=None, init=False, repr=False, compare=False)  # alpha, clamp

    name = "unlikelihood"
    role = ADDS_LOSS
    value_names = ("penalty", "candidates")
    foreign_refusal = "the unlikelihood penalty"

    def check_inputs(self, target: torch.Tensor, vocab: int, request=None) -> None:
        if self.position.shape != target.shape:
            raise ValueError("the unlikelihood candidates must have one position per target")

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

    def tile_inputs(self, rows: slice, target: torch.Tensor, acc: torch.dtype) -> "PenaltyInputs":
        """What the chunk body needs for the rows ``rows`` (targets ``target``): their candidate
        slots, and alpha and the clamp as 0-d tensors."""
        ids, valid = self.block_candidates(rows, target)
        if self._scalars is None or self._scalars[0].dtype != acc:
            self._scalars = tuple(torch.tensor(x, dtype=acc, device=ids.device) for x in (self.alpha, self.clamp))
        alpha, clamp = self._scalars
        return PenaltyInputs(ids=ids, valid=valid, alpha=alpha, clamp=clamp)

    @staticmethod
    def tile(tile, inputs: "PenaltyInputs") -> TermOut:
        """alpha * sum_c -log(max(1 - p_c, clamp)) per row of a logit tile and its gradient:
        alpha * (r at the candidate columns - S p), r_c = p_c / (1 - p_c) on the unclamped
        candidates, S = sum_c r_c (0 on invalid and clamped slots)."""
        p = torch.exp(tile.z.gather(1, inputs.ids) - tile.lse)
        one_minus = torch.clamp(1.0 - p, min=inputs.clamp)
        unclamped = inputs.valid & (one_minus > inputs.clamp)
        value = torch.where(inputs.valid, -torch.log(one_minus), torch.zeros_like(p)).sum(1)
        ratio = torch.where(unclamped, p / one_minus, torch.zeros_like(p))
        alpha = inputs.alpha
        grad = (-alpha * ratio.sum(1, keepdim=True)) * tile.probs()
        loss, column_grad, count = alpha * value, alpha * ratio, inputs.valid.sum(1)
        return TermOut(loss=loss, grad=grad, values=(value, count), columns=inputs.ids, column_grad=column_grad)


class PenaltyInputs(NamedTuple):
    ids: torch.Tensor  # (rows, L) candidate columns; invalid slots hold the row's target
    valid: torch.Tensor  # (rows, L)
    alpha: torch.Tensor  # 0-d
    clamp: torch.Tensor  # 0-d


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
        (``LossResult.terms["unlikelihood"]``: ``penalty``, the UL term before alpha, and
        ``candidates``, the summed |C_t|)."""
        request = LossRequest() if request is None else request
        target = padded_target.reshape(-1).index_select(0, keep)
        request = request.with_terms(self.candidates(padded_target, keep))
        return fused_linear_loss(hidden, weight, target, request)
