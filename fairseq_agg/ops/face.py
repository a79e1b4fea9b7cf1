"""Frequency-aware cross-entropy, FACE (Jiang et al., WWW 2019, "Improving Neural Response Diversity
with Frequency-Aware Cross-Entropy Loss", arXiv 1902.09191), its math in one place; pure torch.

Cross-entropy with one weight per target token, from running token counts f (docs/baselines.md,
"FACE"; the forms are those of the authors' released code, the paper's equations could not be read):

* **pre-weighting** (the code's ``pre``, the README's Eq. 10): with RF_k = f_k / sum_j f_j,
  u_k = 1 - RF_k / max_j RF_j and w_k = V u_k / sum_j u_j, i.e. the closed form
  w_k = (1 - f_k / f_max) / (1 - sum_j f_j / (V f_max)); the loss of token n is w_{y_n} CE_n;
* **post-weighting** (``post``, Eq. 11): v_n = 1 + max(0, f[yhat_n] - f[y_n]) / sum_j f_j with yhat_n
  the model's argmax at position n; the loss of token n is v_n CE_n (v carries no gradient).

The counts are of the model's argmax predictions (``out``, the code's default) or of the targets
(``gt``), over the whole run (the code's) or a sliding window of updates. With no counts yet
(sum f = 0) every weight is 1.

:class:`FaceWeights` is FACE's term of the fused output layer (:class:`fairseq_agg.ops.term.Term`), which
the chunk body evaluates on each logit tile: one scalar per row, folded into the row's loss and
logit gradient (the layer returns each row's argmax for ``out`` counting). :class:`FaceLoss` owns the counts and puts
the pieces together for one training micro-batch.
"""
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from fairseq_agg.errors import UsageError, check_choice, check_integer

from .counting import CountsPerUpdate, CumulativeCounts, RareTokenWindow, check_window, counted_ids  # noqa: F401
from .fused_linear_loss import LossRequest, LossResult, fused_linear_loss
from .term import WEIGHTS_ROWS, Term, TermOut

WEIGHINGS = ("pre", "post")
FREQUENCIES = ("out", "gt")


def face_token_weights(counts: torch.Tensor) -> torch.Tensor:
    """Pre-weights w (length V, fp32) from the counts f (length V): mean 1 over the vocabulary,
    0 for the most counted token, the maximum for never-counted tokens; all 1 without counts."""
    f = counts.to(torch.float64)
    vocab = f.numel()
    f_max = f.max() if vocab else f.new_zeros(())
    total = f.sum()
    if total <= 0:
        return torch.ones(vocab, dtype=torch.float32, device=counts.device)
    u = 1.0 - f / f_max
    u_sum = u.sum()
    if u_sum <= 0:  # every token counted equally often: nothing to re-weight
        return torch.ones(vocab, dtype=torch.float32, device=counts.device)
    return (u * (vocab / u_sum)).float()


def face_post_weights(counts: torch.Tensor, target: torch.Tensor, predicted: torch.Tensor) -> torch.Tensor:
    """Post-weights v_n = 1 + max(0, f[predicted_n] - f[target_n]) / sum f (fp32; all 1 without counts)."""
    f = counts.to(torch.float64)
    total = f.sum().clamp(min=1.0)  # sum f = 0 gives f = 0 everywhere, so v = 1
    excess = (f.index_select(0, predicted) - f.index_select(0, target)).clamp(min=0.0)
    return (1.0 + excess / total).float()


@dataclass
class FaceWeights(Term):
    """FACE's per-token weights for one micro-batch, the fused layer's term that weights rows (the
    summed weights logged as ``face`` / ``weight``).

    ``token_weight`` (length V) is set for pre-weighting, ``counts`` (length V) for post-weighting
    (which needs each row's argmax, taken by the fused layer in the same pass).
    """

    token_weight: Optional[torch.Tensor] = None
    counts: Optional[torch.Tensor] = None

    name = "face"
    role = WEIGHTS_ROWS
    value_names = ("weight",)
    foreign_refusal = "FACE's row weights"

    def __post_init__(self):
        if (self.token_weight is None) == (self.counts is None):
            raise ValueError("FaceWeights needs exactly one of token_weight (pre) and counts (post)")

    @property
    def needs_argmax(self) -> bool:
        return self.counts is not None

    def tile_inputs(self, rows: slice, target: torch.Tensor, acc: torch.dtype) -> "FaceInputs":
        """What the chunk body needs for rows with targets ``target``."""
        if self.token_weight is not None:
            return FaceInputs(row_weight=self.token_weight.index_select(0, target))
        return FaceInputs(counts=self.counts)

    @property
    def tile(self):
        """The static function of this weighing: (tile, inputs) -> each row's weight."""
        return _pre_row_weight if self.token_weight is not None else _post_row_weight


class FaceInputs(NamedTuple):
    row_weight: Optional[torch.Tensor] = None  # (rows,) pre-weights of the targets
    counts: Optional[torch.Tensor] = None  # (V,) counts for post-weights


def _pre_row_weight(tile, inputs: FaceInputs) -> TermOut:
    weight = inputs.row_weight.to(tile.z.dtype)
    return TermOut(factor=weight, values=(weight,))


def _post_row_weight(tile, inputs: FaceInputs) -> TermOut:
    weight = face_post_weights(inputs.counts, tile.target, tile.argmax).to(tile.z.dtype)
    return TermOut(factor=weight, values=(weight,))


COUNTINGS = ("cumulative", "window")


class FaceLoss(CountsPerUpdate):
    """Frequency-aware cross-entropy for any training loop; owns its token counts.

    Args:
        vocab_size: V.
        weighing: ``"pre"`` (weights from the counts alone) or ``"post"`` (from the counts of the
            argmax and of the target).
        frequency: what is counted: ``"out"`` = the model's argmax predictions, after the pass,
            or ``"gt"`` = the targets, before it.
        counting: ``"cumulative"`` = over the whole run, never reset (the released code), or
            ``"window"`` = over the last ``window`` optimizer updates (AGG's sliding window).
        window: the window's size (``--face-window``), only with ``counting="window"``; ``None``:
            set it later with :meth:`set_window`.
        uncounted_id: an id never counted (eos in the released code); None = count every id.
        all_reduce: sum the counts over the data-parallel ranks of ``process_group``.
    """

    def __init__(self, vocab_size: int, *, weighing: str = "pre", frequency: str = "out",
                 counting: str = "cumulative", window: Optional[int] = None, uncounted_id: Optional[int] = None,
                 all_reduce: bool = True, process_group=None):
        self.vocab_size = check_integer("vocab_size", vocab_size, 2)
        self.weighing = check_choice("face_weighing", weighing, WEIGHINGS)
        self.frequency = check_choice("face_frequency", frequency, FREQUENCIES)
        self.counting = check_choice("face_counting", counting, COUNTINGS)
        if window is not None:
            window = check_window("face_window", window, self.vocab_size)
        if self.counting == "cumulative":
            if window is not None:
                raise UsageError("--face-window needs --face-counting window: cumulative counts have no window")
            self.counter = CumulativeCounts(self.vocab_size)
        else:
            self.counter = RareTokenWindow(self.vocab_size, window, flag="face_window")
        self.window_flag = "--face-window"
        self.uncounted_id = uncounted_id
        self.all_reduce = bool(all_reduce)
        self.process_group = process_group

    def weights(self, device=None) -> FaceWeights:
        """This micro-batch's weights from the counts as they are now."""
        counts = self.counter.counts.to(device)
        if self.weighing == "pre":
            return FaceWeights(token_weight=face_token_weights(counts))
        return FaceWeights(counts=counts)

    def __call__(self, hidden, weight, target, update_num: Optional[int] = None,
                 request: Optional[LossRequest] = None, dummy: bool = False) -> LossResult:
        """The FACE-weighted fused loss; with ``update_num`` (training) the counts move: the targets
        before the pass (``gt``) or the argmax after it (``out``). ``dummy`` (fairseq's dummy batch):
        count nothing, but still join the data-parallel sum."""
        request = LossRequest() if request is None else request
        counting = update_num is not None
        if counting:
            self.start_update(update_num)
            if self.frequency == "gt":
                self.count(target[:0] if dummy else target)
        record = counting and self.frequency == "out"
        request = request.with_terms(self.weights(target.device), record_argmax=request.record_argmax or record)
        result = fused_linear_loss(hidden, weight, target, request)
        if record:
            self.count(target[:0] if dummy else result.argmax)
        return result

