"""``cross_entropy_face``: frequency-aware cross-entropy, FACE (Jiang et al., WWW 2019, "Improving
Neural Response Diversity with Frequency-Aware Cross-Entropy Loss").

Each target token's (label-smoothed) cross-entropy is weighted by a weight from running token
counts, inside the shared fused output layer: pre-weighting (the default) from the counts alone,
post-weighting from the counts of the model's argmax and of the target. The counts are of the
model's argmax predictions (``out``, the default) or of the targets (``gt``), over the whole run
(``--face-counting cumulative``, the default, as in the released code) or over AGG's sliding
window of the last K optimizer updates (``--face-counting window``, ``--face-window K``); summed
over data-parallel ranks, moved only in training, saved in the checkpoint. The method is
:class:`fairseq_agg.ops.FaceLoss`. Logged: ``face_weight``, the mean target weight. Defaults and
the choices the paper leaves open: docs/baselines.md, "FACE".
"""
from dataclasses import dataclass, field

from fairseq.criterions import register_criterion
from fairseq.dataclass import ChoiceEnum

from fairseq_agg.fairseq_facts.dictionary import eos_index
from fairseq_agg.fairseq_facts.distributed import data_parallel_group
from fairseq_agg.ops import FaceLoss, FaceWeights
from fairseq_agg.ops.face import COUNTINGS, FREQUENCIES, WEIGHINGS

from .output_loss import OutputLossConfig, OutputLossCriterion, log_means


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
    face_counting: ChoiceEnum(list(COUNTINGS)) = field(
        default="cumulative",
        metadata={"help": "cumulative = count over the whole run, never reset (the released code); window = "
                  "over the last --face-window optimizer updates (AGG's sliding window)"},
    )
    face_window: int = field(
        default=0,
        metadata={"help": "with --face-counting window: count over the last K optimizer updates (>= 1); 0 = "
                  "auto, the number of updates per epoch"},
    )
    face_count_eos: bool = field(
        default=False,
        metadata={"help": "count the end-of-sentence token too (the paper-era code; the released code "
                  "never counts it)"},
    )
    face_restart_counts: bool = field(
        default=False,
        metadata={"help": "start the counts empty instead of loading those of the checkpoint resumed or fine-tuned "
                  "from (for a checkpoint whose counts are missing, refused as damaged, or of another --face-counting)"},
    )


@register_criterion("cross_entropy_face", dataclass=FaceConfig)
class FaceCriterion(OutputLossCriterion):
    """FACE-weighted (label-smoothed) cross-entropy; see the module docstring. Counts per target
    dictionary (``self.faces``, by state name; ``self.face`` the first), as AGG's windows."""

    counts_per_vocabulary = True

    def __init__(self, task, cfg: FaceConfig):
        super().__init__(task, cfg, "cross_entropy_face")
        self.faces = self.per_vocabulary("counter", lambda dictionary: FaceLoss(
            len(dictionary), weighing=cfg.face_weighing, frequency=cfg.face_frequency,
            counting=cfg.face_counting, window=cfg.face_window or None,
            uncounted_id=None if cfg.face_count_eos else eos_index(dictionary), process_group=data_parallel_group(),
        ))
        self.face = next(iter(self.faces.values()))
        self.refuse_output_kernel(FaceWeights)
        # the counts travel with every checkpoint
        self.keep_in_checkpoints("face_restart_counts", **{name: face.counter for name, face in self.faces.items()})

    def on_epoch_batches(self, batches_per_epoch):
        if self.face.counting == "window":
            for name, face in self.faces.items():
                self.set_epoch_window(face.counter, batches_per_epoch, self.vocabulary_label("FACE", name))

    def forward(self, model, sample, reduce=True):
        batch = self.io.batch(model, sample)
        # training moves the counts (the targets before the pass, or the argmax after it);
        # validation does not
        update_num = self.loop.training_update(model, self.name)
        request = self.request.with_terms(per_token=not reduce)
        face = self.faces[self.vocabulary_state("counter", model)]
        result = face(batch.hidden, batch.weight, batch.target, update_num, request, dummy=self.loop.ignore_grad)
        extra = {"face_weight": result.terms[FaceWeights.name]["weight"].data}
        return self.io.finish(model, batch, result.loss, result.nll, extra)

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        log_means(logging_outputs, "ntokens", {"face_weight": 4})
