"""Live embedding-statistics logging shared by every criterion of this plugin.

INTERFACE PLACEHOLDER: the statistics issue fills this in. Criteria inherit
``EmbeddingStatsConfig`` in their dataclass and ``EmbeddingStatsMixin`` in their class, and call
``self.log_embedding_stats(model)`` once per forward.
"""
from dataclasses import dataclass, field

from fairseq.dataclass import FairseqDataclass


@dataclass
class EmbeddingStatsConfig(FairseqDataclass):
    embed_stats_interval: int = field(
        default=0,
        metadata={"help": "log TEV / mean cosine of the embeddings every N updates (0 = off)"},
    )


class EmbeddingStatsMixin:
    def log_embedding_stats(self, model):
        """Called by the criterion once per forward (training and validation)."""
        return None
