"""``cross_entropy_face``: frequency-aware cross-entropy, FACE (Jiang et al., WWW 2019, "Improving
Neural Response Diversity with Frequency-Aware Cross-Entropy Loss").

Each target token's (label-smoothed) cross-entropy is weighted by a weight from running token
counts (:mod:`fairseq_agg.ops.face`), inside the shared fused output layer: pre-weighting (the
default) from the counts alone, post-weighting from the counts of the model's argmax and of the
target. The counts are of the model's argmax predictions (``out``, the default) or of the targets
(``gt``), over the same sliding window of optimizer updates as AGG's (summed over data-parallel
ranks, moved only in training, saved in the checkpoint), or over the whole run
(``--face-cumulative``, the released code). Logged: ``face_weight``, the mean target weight.
Defaults and the choices the paper leaves open: docs/baselines.md, "FACE".
"""
from dataclasses import dataclass, field

import torch
from fairseq import metrics
from fairseq.criterions import register_criterion
from fairseq.dataclass import ChoiceEnum

from fairseq_agg.fairseq_hooks import CheckpointedState
from fairseq_agg.ops.agg_gates import RareTokenWindow
from fairseq_agg.ops.face import FREQUENCIES, WEIGHINGS, CumulativeCounts, FaceWeights, counted_ids, face_token_weights

from .target_counting import add_counts, open_update, set_epoch_window
from .output_loss import OutputLossConfig, OutputLossCriterion, check_range


@dataclass
class FaceConfig(OutputLossConfig):
    face_weighing: ChoiceEnum(list(WEIGHINGS)) = field(
        default="pre",
        metadata={"help": "pre: weight w_k = V u_k / sum u, u_k = 1 - RF_k / max RF, of the target (the "
                  "released code's default); post: 1 + max(0, f[argmax] - f[target]) / sum f"},
    )
    face_frequency: ChoiceEnum(list(FREQUENCIES)) = field(
        default="out",
        metadata={"help": "what is counted: out = the model's argmax predictions (the released code's "
                  "default), gt = the targets"},
    )
    face_window: int = field(
        default=0,
        metadata={"help": "count over the last K optimizer updates, AGG's sliding window (>= 1); 0 = auto, "
                  "the number of updates per epoch"},
    )
    face_cumulative: bool = field(
        default=False,
        metadata={"help": "count over the whole run without decay (the released code) instead of the window"},
    )
    face_count_eos: bool = field(
        default=False,
        metadata={"help": "count the end-of-sentence token too (the paper-era code; the released code "
                  "never counts it)"},
    )


@register_criterion("cross_entropy_face", dataclass=FaceConfig)
class FaceCriterion(CheckpointedState, OutputLossCriterion):
    """FACE-weighted (label-smoothed) cross-entropy; see the module docstring."""

    STATE_MODULES, STATE_NAME = ("counter",), "FACE counts"

    def __init__(self, task, cfg: FaceConfig):
        check_range("face_window", cfg.face_window, cfg.face_window >= 0, ">= 1 (or 0 for auto)")
        super().__init__(task, cfg)
        vocab = len(self.dictionary)
        if cfg.face_cumulative:
            self.counter = CumulativeCounts(vocab)
        else:
            self.counter = RareTokenWindow(vocab, cfg.face_window or None)
        self.uncounted = None if cfg.face_count_eos else self.dictionary.eos()
        self.anchor_state()  # the counts travel with every checkpoint

    def on_train_batches(self, batches_per_epoch):
        set_epoch_window(self.counter, batches_per_epoch, self.cfg.update_freq, "FACE", "--face-window")

    def _counting(self, model):
        return open_update(self, self.counter, model, "cross_entropy_face", "--face-window")

    def _count(self, ids):
        add_counts(self, self.counter, counted_ids(ids, self.uncounted), len(self.dictionary))

    def output_loss(self, model, hidden, weight, target, gates):
        counting = self._counting(model)
        if counting and self.cfg.face_frequency == "gt":
            self._count(target)  # the released code counts the batch before weighting it
        counts = self.counter.counts.to(target.device)
        pre = self.cfg.face_weighing == "pre"
        face = FaceWeights(
            token_weight=face_token_weights(counts) if pre else None,
            counts=None if pre else counts,
            record_predictions=counting and self.cfg.face_frequency == "out",
        )
        loss, nll, _ = self.output_layer(hidden, weight, target, gates, row_weights=face)
        if face.record_predictions:
            self._count(face.predictions if face.predictions is not None else target[:0])
        weight_sum = face.weight_sum if face.weight_sum is not None else torch.zeros((), device=target.device)
        return loss, nll, {"face_weight": weight_sum.data}

    @classmethod
    def reduce_extra_metrics(cls, logging_outputs, total):
        super().reduce_extra_metrics(logging_outputs, total)
        ntokens = total("ntokens")
        if ntokens:
            metrics.log_scalar("face_weight", total("face_weight") / ntokens, ntokens, round=4)
