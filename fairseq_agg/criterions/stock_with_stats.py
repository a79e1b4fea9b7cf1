"""fairseq's stock ``cross_entropy`` and ``label_smoothed_cross_entropy`` plus live embedding
statistics, so that a baseline run logs the same TEV / isotropy keys as a method run.

Loss, gradients and the other logged values are exactly those of the stock criteria; only the
``--embed-stats-*`` / ``--tev-*`` / ``--iso-rows`` flags are added (docs/stats.md). Each class is
its stock criterion holding an :class:`~fairseq_agg.stats.live.EmbeddingStats`.
"""
from dataclasses import dataclass

from fairseq.criterions import register_criterion
from fairseq.criterions.cross_entropy import CrossEntropyCriterion, CrossEntropyCriterionConfig
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
)

from fairseq_agg.fairseq_facts.criterion_config import complete_config
from fairseq_agg.stats.config import EmbeddingStatsConfig
from fairseq_agg.stats.live import EmbeddingStats, reduce_embedding_stats


def with_embedding_stats(stock_criterion, config_class, name):
    """``stock_criterion`` registered as ``name`` with the statistics flags and their logging."""

    @dataclass
    class Config(config_class, EmbeddingStatsConfig):
        pass

    class WithStats(stock_criterion):
        embedding_stats = EmbeddingStats()  # off, until build_criterion reads the flags

        @classmethod
        def build_criterion(cls, cfg, task):
            cfg = complete_config(cfg, Config)  # a partial Namespace takes the defaults
            criterion = super().build_criterion(cfg, task)
            criterion.embedding_stats = EmbeddingStats(cfg, task)
            return criterion

        def forward(self, model, sample, reduce=True):
            loss, sample_size, logging_output = super().forward(model, sample, reduce=reduce)
            self.embedding_stats.log(model, logging_output)
            return loss, sample_size, logging_output

        @classmethod
        def reduce_metrics(cls, logging_outputs) -> None:
            super().reduce_metrics(logging_outputs)
            reduce_embedding_stats(logging_outputs)

    stem = stock_criterion.__name__.replace("Criterion", "")
    Config.__name__ = Config.__qualname__ = f"{stem}WithStatsConfig"
    WithStats.__name__ = WithStats.__qualname__ = f"{stem}WithStatsCriterion"
    return Config, register_criterion(name, dataclass=Config)(WithStats)


CrossEntropyWithStatsConfig, CrossEntropyWithStatsCriterion = with_embedding_stats(
    CrossEntropyCriterion, CrossEntropyCriterionConfig, "cross_entropy_with_stats"
)
LabelSmoothedCrossEntropyWithStatsConfig, LabelSmoothedCrossEntropyWithStatsCriterion = with_embedding_stats(
    LabelSmoothedCrossEntropyCriterion, LabelSmoothedCrossEntropyCriterionConfig,
    "label_smoothed_cross_entropy_with_stats",
)
