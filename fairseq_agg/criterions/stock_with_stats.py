"""fairseq's stock ``cross_entropy`` and ``label_smoothed_cross_entropy`` plus live embedding
statistics, so that a baseline run logs the same TEV / isotropy keys as a method run.

Loss, gradients and the other logged values are exactly those of the stock criteria; only the
``--embed-stats-*`` / ``--tev-*`` / ``--iso-rows`` flags are added (docs/stats.md).
"""
from dataclasses import dataclass

from fairseq.criterions import register_criterion
from fairseq.criterions.cross_entropy import CrossEntropyCriterion, CrossEntropyCriterionConfig
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
)

from fairseq_agg.stats.config import EmbeddingStatsConfig
from fairseq_agg.stats.live import EmbeddingStatsMixin, reduce_embedding_stats


class _WithStats(EmbeddingStatsMixin):
    """The statistics added to a stock criterion's ``forward`` and ``reduce_metrics``."""

    def forward(self, model, sample, reduce=True):
        loss, sample_size, logging_output = super().forward(model, sample, reduce=reduce)
        self.log_embedding_stats(model, logging_output)
        return loss, sample_size, logging_output

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        reduce_embedding_stats(logging_outputs)


@dataclass
class CrossEntropyWithStatsConfig(CrossEntropyCriterionConfig, EmbeddingStatsConfig):
    pass


@register_criterion("cross_entropy_with_stats", dataclass=CrossEntropyWithStatsConfig)
class CrossEntropyWithStatsCriterion(_WithStats, CrossEntropyCriterion):
    pass


@dataclass
class LabelSmoothedCrossEntropyWithStatsConfig(LabelSmoothedCrossEntropyCriterionConfig, EmbeddingStatsConfig):
    pass


@register_criterion(
    "label_smoothed_cross_entropy_with_stats", dataclass=LabelSmoothedCrossEntropyWithStatsConfig
)
class LabelSmoothedCrossEntropyWithStatsCriterion(_WithStats, LabelSmoothedCrossEntropyCriterion):
    pass
