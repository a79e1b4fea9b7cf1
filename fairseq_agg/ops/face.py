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
(``gt``). With no counts yet (sum f = 0) every weight is 1.

:class:`FaceWeights` is what the fused output layer (:mod:`fairseq_agg.ops.fused_linear_loss`)
evaluates block by block: one scalar per row, folded into the row's loss and logit gradient, and,
for ``out`` counting, the argmax of each row recorded on the way.
"""
from dataclasses import dataclass
from typing import Optional

import torch

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
class FaceWeights:
    """FACE's per-token weights for one micro-batch, evaluated inside the fused output layer.

    ``token_weight`` (length V) is set for pre-weighting, ``counts`` (length V) for
    post-weighting. With ``record_predictions`` the argmax of every row is written to
    ``predictions`` (length N, the ``out`` counts of this micro-batch).
    """

    token_weight: Optional[torch.Tensor] = None
    counts: Optional[torch.Tensor] = None
    record_predictions: bool = False
    predictions: Optional[torch.Tensor] = None
    weight_sum: Optional[torch.Tensor] = None  # summed weight of the rows seen (for logging)

    def __post_init__(self):
        if (self.token_weight is None) == (self.counts is None):
            raise ValueError("FaceWeights needs exactly one of token_weight (pre) and counts (post)")

    @property
    def needs_argmax(self) -> bool:
        return self.counts is not None or self.record_predictions

    def block_row_weight(self, target: torch.Tensor, predicted: Optional[torch.Tensor], rows: slice, n_rows: int):
        """The weight of each row of a block (targets ``target``, argmax ``predicted``)."""
        if self.record_predictions:
            if self.predictions is None:
                self.predictions = torch.empty(n_rows, dtype=torch.long, device=target.device)
            self.predictions[rows] = predicted
        if self.token_weight is not None:
            weight = self.token_weight.index_select(0, target)
        else:
            weight = face_post_weights(self.counts, target, predicted)
        total = weight.sum().detach()
        self.weight_sum = total if self.weight_sum is None else self.weight_sum + total
        return weight


def counted_ids(ids: torch.Tensor, excluded_id: Optional[int]) -> torch.Tensor:
    """The ids that enter FACE's counts: all of ``ids`` but ``excluded_id`` (eos in the released code)."""
    if excluded_id is None:
        return ids
    return ids[ids != excluded_id]


class CumulativeCounts(torch.nn.Module):
    """Token counts over the whole run, without decay (the released FACE code's estimate).

    Same interface as :class:`fairseq_agg.ops.agg_gates.RareTokenWindow` where FACE uses it
    (``start_update``, ``add``, ``counts``); saved in the module's ``state_dict``.
    """

    def __init__(self, vocab_size: int):
        super().__init__()
        self.register_buffer("counts", torch.zeros(int(vocab_size), dtype=torch.int64))

    is_configured = True

    def start_update(self, t: int):
        """Nothing to drop: the counts never decay."""

    def add(self, histogram: torch.Tensor):
        histogram = histogram.to(torch.int64)
        if self.counts.device != histogram.device:
            self.counts = self.counts.to(histogram.device)
        self.counts += histogram
