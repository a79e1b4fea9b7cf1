"""fairseq's stock ``cross_entropy`` and ``label_smoothed_cross_entropy`` plus live embedding
statistics, so that a baseline run logs the same TEV / isotropy keys as a method run.

Loss, gradients and the other logged values are exactly those of the stock criteria; only the
``--embed-stats-*`` / ``--tev-*`` / ``--iso-rows`` flags are added (see ``fairseq_agg.stats.live``).
"""
from dataclasses import dataclass

from fairseq.criterions import register_criterion
from fairseq.criterions.cross_entropy import CrossEntropyCriterion, CrossEntropyCriterionConfig
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
)

from fairseq_agg.stats.live import EmbeddingStatsConfig, EmbeddingStatsMixin


@dataclass
class CrossEntropyWithStatsConfig(CrossEntropyCriterionConfig, EmbeddingStatsConfig):
    pass


@register_criterion("cross_entropy_with_stats", dataclass=CrossEntropyWithStatsConfig)
class CrossEntropyWithStatsCriterion(EmbeddingStatsMixin, CrossEntropyCriterion):
    def forward(self, model, sample, reduce=True):
        self.log_embedding_stats(model)
        return super().forward(model, sample, reduce=reduce)


@dataclass
class LabelSmoothedCrossEntropyWithStatsConfig(LabelSmoothedCrossEntropyCriterionConfig, EmbeddingStatsConfig):
    pass


@register_criterion(
    "label_smoothed_cross_entropy_with_stats", dataclass=LabelSmoothedCrossEntropyWithStatsConfig
)
class LabelSmoothedCrossEntropyWithStatsCriterion(EmbeddingStatsMixin, LabelSmoothedCrossEntropyCriterion):
    def forward(self, model, sample, reduce=True):
        self.log_embedding_stats(model)
        return super().forward(model, sample, reduce=reduce)
