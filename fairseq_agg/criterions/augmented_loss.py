"""``augmented_loss``: the augmented loss of Inan, Khosravi & Socher (ICLR 2017, arXiv 1611.01462).

    J_tot = J + alpha * s(tau) * J_aug,   J_aug = KL(y~ || y^)            (v1 eq. 3.2-3.3)
    y^ = softmax(W h / tau)                                                (v1 eq. 3.1)
    y~ = softmax(L^T u / tau),  u = L y*  (the *target* word's embedding)  (v1 eq. 3.6-3.7)

J is (label-smoothed) cross-entropy; L is the decoder's unscaled input embedding, so tied
embeddings (``--share-decoder-input-output-embed`` / ``--share-all-embeddings``) give the paper's
REAL and untied ones its "AL only". s(tau) is 1, tau or tau^2 (``--aug-scale``; the paper leaves it
open). Formulas, defaults and their sources: docs/augmented_loss.md. The math is
:class:`fairseq_agg.ops.AugmentedLoss`; this module is its fairseq side: the flags
(:class:`AugmentedLossConfig`, also offered by ``cross_entropy_agg`` as ``--aug-alpha``), the
object built from them, the teacher matrix of a model, and the logging. Logged: ``aug_loss`` (the
KL before its weight, base 2, per token) and ``aug_alpha`` (after warm-up).
"""
import math
from dataclasses import dataclass, field

from fairseq import metrics
from fairseq.criterions import register_criterion
from fairseq.dataclass import ChoiceEnum

from fairseq_agg.errors import UsageError
from fairseq_agg.fairseq_facts.dictionary import never_real_ids
from fairseq_agg.ops import AugmentedLoss, TeacherTargets
from fairseq_agg.ops.augmented import SCALES

from fairseq_agg.fairseq_facts.output_layer import output_projection_weight

from .output_loss import OutputLossConfig, OutputLossCriterion, logged_total, refuse_without

AUG_SCALE_CHOICES = ChoiceEnum(list(SCALES))
AUG_EMBED_CHOICES = ChoiceEnum(["input", "output"])


@dataclass
class AugmentedLossConfig(OutputLossConfig):
    aug_alpha: float = field(
        default=0.5,
        metadata={"help": "weight alpha of the augmented loss (>= 0; 0 = plain (label-smoothed) "
                  "cross-entropy exactly); Inan et al. eq. 3.3"},
    )
    aug_temperature: float = field(
        default=10.0, metadata={"help": "temperature tau of both softmaxes of the augmented loss (> 0)"}
    )
    aug_scale: AUG_SCALE_CHOICES = field(
        default="tau",
        metadata={"help": "extra factor s(tau) on the KL: none = 1, tau, or tau2 = tau^2 (the paper leaves it open)"},
    )
    # fairseq turns a bool field into a store_true flag (store_false if its default is True, under the
    # same, positive name), so the non-default choices are spelled as negative fields.
    no_aug_detach_target: bool = field(
        default=False,
        metadata={"help": "let gradients flow into the embedding through the teacher (ablation; by default "
                  "the teacher is a constant, see docs/augmented_loss.md)"},
    )
    aug_embed: AUG_EMBED_CHOICES = field(
        default="input",
        metadata={"help": "matrix the teacher is built from: input = decoder input embedding (the paper), output = output projection"},
    )
    no_aug_mask_special: bool = field(
        default=False,
        metadata={"help": "let the padding and madeupword columns have teacher mass (by default they get none)"},
    )
    aug_warmup_updates: int = field(
        default=0, metadata={"help": "ramp alpha linearly from 0 over this many updates (>= 0; 0 = none)"}
    )
    aug_gate_with_agg: bool = field(
        default=False,
        metadata={"help": "with AGG (--criterion cross_entropy_agg): also gate the augmented-loss part of the "
                  "output-embedding gradient"},
    )


def augmented_loss_from_config(cfg, dictionary) -> AugmentedLoss:
    """The :class:`~fairseq_agg.ops.AugmentedLoss` of the ``--aug-*`` flags (validated there)."""
    return AugmentedLoss(
        alpha=cfg.aug_alpha, temperature=cfg.aug_temperature, scale=cfg.aug_scale,
        warmup_updates=cfg.aug_warmup_updates, detach_teacher=not cfg.no_aug_detach_target,
        gate_with_agg=cfg.aug_gate_with_agg,
        masked_columns=None if cfg.no_aug_mask_special else never_real_ids(dictionary),
    )


def teacher_matrix(model, aug_embed: str, augmented: AugmentedLoss):
    """The V x d teacher matrix, not detached: the unscaled input embedding, or the output rows;
    None while the augmented loss is off (alpha 0)."""
    if augmented.alpha == 0:
        return None
    if str(aug_embed) == "input":
        embed = getattr(model.decoder, "embed_tokens", None)
        if embed is None or not hasattr(embed, "weight"):
            raise UsageError("--aug-embed input needs a decoder input embedding (decoder.embed_tokens)")
        return embed.weight  # unscaled rows: fairseq's embed_scale must not leak into tau
    return output_projection_weight(model)


def augmented_logging(augmented: AugmentedLoss, result, update_num) -> dict:
    """The logging entries of the augmented loss (none while its alpha is 0)."""
    alpha = augmented.alpha_at(update_num)
    if alpha <= 0:
        return {}
    return {"aug_loss": result.terms[TeacherTargets.name]["kl"].data, "aug_alpha": alpha, "aug_steps": 1}


def reduce_augmented_metrics(logging_outputs):
    total = logged_total(logging_outputs)
    aug_steps = total("aug_steps")
    if aug_steps:
        ntokens = total("ntokens")
        metrics.log_scalar("aug_loss", total("aug_loss") / ntokens / math.log(2), ntokens, round=4)
        metrics.log_scalar("aug_alpha", total("aug_alpha") / aug_steps, aug_steps, round=4)


@register_criterion("augmented_loss", dataclass=AugmentedLossConfig)
class AugmentedLossCriterion(OutputLossCriterion):
    """(Label-smoothed) cross-entropy plus alpha * s(tau) * KL(y~ || softmax(z / tau)); see the module docstring."""

    def __init__(self, task, cfg: AugmentedLossConfig):
        refuse_without(cfg, AugmentedLossConfig, ["aug_gate_with_agg"], False, "--criterion cross_entropy_agg")
        super().__init__(task, cfg, "augmented_loss")
        self.augmented = augmented_loss_from_config(cfg, self.dictionary)
        self.refuse_output_kernel(*([TeacherTargets] if self.augmented.fused_teacher else []))

    def check_model(self, model):
        weight = super().check_model(model)
        teacher_matrix(model, self.cfg.aug_embed, self.augmented)  # refuses a model without one
        return weight

    def forward(self, model, sample, reduce=True):
        batch = self.io.batch(model, sample)
        update_num = self.loop.update_num  # alpha's warm-up follows the training updates
        embedding = teacher_matrix(model, self.cfg.aug_embed, self.augmented)
        result = self.augmented(batch.hidden, batch.weight, embedding, batch.target, update_num,
                                self.request.with_terms(per_token=not reduce))
        extra = augmented_logging(self.augmented, result, update_num)
        return self.io.finish(model, batch, result.loss, result.nll, extra)

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        reduce_augmented_metrics(logging_outputs)
