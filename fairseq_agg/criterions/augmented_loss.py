"""``augmented_loss``: the augmented loss of Inan, Khosravi & Socher (ICLR 2017, arXiv 1611.01462).

    J_tot = J + alpha * s(tau) * J_aug,   J_aug = KL(y~ || y^)            (v1 eq. 3.2-3.3)
    y^ = softmax(W h / tau)                                                (v1 eq. 3.1)
    y~ = softmax(L^T u / tau),  u = L y*  (the *target* word's embedding)  (v1 eq. 3.6-3.7)

J is (label-smoothed) cross-entropy; L is the decoder's unscaled input embedding, so tied
embeddings (``--share-decoder-input-output-embed`` / ``--share-all-embeddings``) give the paper's
REAL and untied ones its "AL only". s(tau) is 1, tau or tau^2 (``--aug-scale``; the paper leaves it
open, spec augmented_loss.md §2.5).

All the work is done by the shared base :class:`~fairseq_agg.criterions.output_loss.OutputLossCriterion`
(the teacher is built once per unique target type, the KL uses the exact rewrite
lse(z / tau) - t.z / tau - H(t) inside the fused, chunked output layer; spec §5). This criterion
only turns the augmented loss on by default (alpha = 0.5, the reimplementation's PTB value, §13)
and exposes the token chunk size under the name the spec gives it.
"""
from dataclasses import dataclass, field

from fairseq.criterions import register_criterion

from .output_loss import OutputLossConfig, OutputLossCriterion, _check_range


@dataclass
class AugmentedLossConfig(OutputLossConfig):
    aug_alpha: float = field(
        default=0.5,
        metadata={"help": "weight alpha of the augmented loss (>= 0; 0 = plain (label-smoothed) "
                  "cross-entropy exactly); Inan et al. eq. 3.3"},
    )
    aug_chunk_tokens: int = field(
        default=2048,
        metadata={"help": "target tokens per chunk of the fused output layer (>= 1); the extra "
                  "memory is O(chunk x V), never tokens x V"},
    )


@register_criterion("augmented_loss", dataclass=AugmentedLossConfig)
class AugmentedLossCriterion(OutputLossCriterion):
    """(Label-smoothed) cross-entropy plus alpha * s(tau) * KL(y~ || softmax(z / tau)); see the module docstring."""

    def __init__(self, task, cfg: AugmentedLossConfig):
        super().__init__(task, cfg)  # checks label smoothing, alpha >= 0, tau > 0, warm-up >= 0
        _check_range("aug_chunk_tokens", cfg.aug_chunk_tokens, cfg.aug_chunk_tokens >= 1, ">= 1")
        self.chunk_size = int(cfg.aug_chunk_tokens)
