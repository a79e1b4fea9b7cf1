"""The fairseq-free core of fairseq-agg: pure-torch objects for any PyTorch training loop.

Importing this package needs torch only. The fairseq criteria of :mod:`fairseq_agg.criterions` are
thin users of the same objects, so a plain loop that makes the same calls gets the same gradients.
Conventions: ``hidden`` (N, d) are the decoder features of the non-padding target positions,
``weight`` (V, d) the output projection, ``target`` (N,) their ids; ``update_num`` is the number of
optimizer updates completed before the micro-batch (every micro-batch of an update passes the
same number). Bad arguments raise :class:`fairseq_agg.errors.UsageError` naming the matching
fairseq flag. Usage: docs/api.md.

* the output layer: :func:`fused_linear_loss` with a :class:`LossRequest`, returning a
  :class:`LossResult` (chunked, fp32 softmax, no tokens x V tensor); the methods join it as
  terms (:class:`Term`, one of three roles: :data:`ADDS_LOSS`, :data:`WEIGHTS_ROWS`, :data:`GATES_DW`;
  :mod:`fairseq_agg.ops.term`), whose tile function sees a :class:`Tile` (the logits, the
  body's cross-entropy, the target's log-probability, the smoothed targets; :func:`cross_entropy`
  and :func:`cross_entropy_grad` are the body's own);
* the methods, each an object that validates its arguments at construction: :class:`AggLoss`
  (AGG, owns its counting window), :class:`RareFreezing`, :class:`AugmentedLoss`,
  :class:`FaceLoss`, :class:`UnlikelihoodLoss`, :class:`CosRegLoss`;
* their lower-level parts (gates, windows, teachers, weights, candidates);
* embedding statistics of a plain (V, d) matrix: TEV, isotropy I(W), mean pairwise cosine.
"""
from fairseq_agg.stats.metrics import (
    embedding_spectrum, isotropy, mean_pairwise_cosine, singular_values, tev_per_token, tev_stats,
)

from .agg import AggLoss, TokenGates, agg_gates, gate_statistics
from .augmented import AugmentedLoss, TeacherTargets, aug_scale_factor, augmented_kl_direct, build_teacher
from .cosreg import CosRegLoss, cosine_regularizer
from .counting import CumulativeCounts, RareTokenWindow, target_histogram
from .face import FaceLoss, FaceWeights, face_post_weights, face_token_weights
from .freezing import FrozenRows, RareFreezing, frozen_rare_rows
from .fused_linear_loss import LossRequest, LossResult, fused_linear_loss
from .output_chunk import Tile, cross_entropy, cross_entropy_grad
from .term import ADDS_LOSS, GATES_DW, WEIGHTS_ROWS, Term, TermOut
from .unlikelihood import UnlikelihoodCandidates, UnlikelihoodLoss, unlikelihood_candidates

__all__ = [
    # the output layer
    "LossRequest", "LossResult", "fused_linear_loss", "Term", "TermOut", "ADDS_LOSS", "WEIGHTS_ROWS", "GATES_DW",
    "Tile", "cross_entropy", "cross_entropy_grad",
    # the methods
    "AggLoss", "RareFreezing", "AugmentedLoss", "FaceLoss", "UnlikelihoodLoss", "CosRegLoss",
    # their parts
    "TokenGates", "agg_gates", "FrozenRows", "frozen_rare_rows", "gate_statistics", "RareTokenWindow",
    "CumulativeCounts",
    "target_histogram", "TeacherTargets", "build_teacher", "aug_scale_factor", "augmented_kl_direct",
    "FaceWeights", "face_token_weights", "face_post_weights", "UnlikelihoodCandidates",
    "unlikelihood_candidates", "cosine_regularizer",
    # embedding statistics
    "tev_stats", "tev_per_token", "isotropy", "mean_pairwise_cosine", "embedding_spectrum", "singular_values",
]
