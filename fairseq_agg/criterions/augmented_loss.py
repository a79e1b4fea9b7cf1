"""``augmented_loss``: the augmented loss of Inan, Khosravi & Socher (ICLR 2017, arXiv 1611.01462).

    J_tot = J + alpha * s(tau) * J_aug,   J_aug = KL(y~ || y^)            (v1 eq. 3.2-3.3)
    y^ = softmax(W h / tau)                                                (v1 eq. 3.1)
    y~ = softmax(L^T u / tau),  u = L y*  (the *target* word's embedding)  (v1 eq. 3.6-3.7)

J is (label-smoothed) cross-entropy; L is the decoder's unscaled input embedding, so tied
embeddings (``--share-decoder-input-output-embed`` / ``--share-all-embeddings``) give the paper's
REAL and untied ones its "AL only". s(tau) is 1, tau or tau^2 (``--aug-scale``; the paper leaves it
open). Formulas, defaults and their sources: docs/augmented_loss.md.

This module is the augmented loss's one home on the fairseq side: its flags
(:class:`AugmentedLossConfig`) and its teacher logic (:class:`AugmentedLossMixin`), used by this
criterion and by ``cross_entropy_agg`` (which offers ``--aug-alpha`` too, off by default). The math
is in :mod:`fairseq_agg.ops.augmented`.
"""
import math
from dataclasses import dataclass, field

from fairseq import metrics
from fairseq.criterions import register_criterion
from fairseq.dataclass import ChoiceEnum

from fairseq_agg.fairseq_hooks import never_real_ids
from fairseq_agg.ops.augmented import SCALES, aug_scale_factor, augmented_kl_direct, build_teacher

from .output_loss import OutputLossConfig, OutputLossCriterion, check_range, output_projection_weight

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
        metadata={"help": "with AGG: also gate the augmented-loss part of the output-embedding gradient"},
    )


class AugmentedLossMixin:
    """Adds the augmented loss to an :class:`OutputLossCriterion` whose config has the ``aug_*`` fields.

    The detached teacher (the default) is evaluated inside the fused output layer; the non-detached
    one (``--no-aug-detach-target``) as a separate chunked KL added to the fused CE. Logged:
    ``aug_loss`` (the KL before its weight, base 2, per token) and ``aug_alpha`` (after warm-up).
    """

    def __init__(self, task, cfg: AugmentedLossConfig):
        check_range("aug_alpha", cfg.aug_alpha, cfg.aug_alpha >= 0.0, ">= 0")
        check_range("aug_temperature", cfg.aug_temperature, cfg.aug_temperature > 0.0, "> 0")
        check_range("aug_warmup_updates", cfg.aug_warmup_updates, cfg.aug_warmup_updates >= 0, ">= 0")
        if cfg.no_aug_detach_target and cfg.aug_gate_with_agg:
            raise ValueError(
                "--aug-gate-with-agg cannot be combined with --no-aug-detach-target: the non-detached "
                "augmented loss is computed outside the fused (gated) output layer"
            )
        super().__init__(task, cfg)

    def check_model(self, model):
        weight = super().check_model(model)
        if self.cfg.aug_alpha > 0:
            self.teacher_matrix(model)
        return weight

    def current_aug_alpha(self):
        """alpha after the linear warm-up over ``--aug-warmup-updates`` updates."""
        alpha = self.cfg.aug_alpha
        warmup = self.cfg.aug_warmup_updates
        if alpha > 0 and warmup > 0 and self.update_num is not None:
            alpha *= min(1.0, (self.update_num + 1) / warmup)
        return alpha

    def teacher_matrix(self, model):
        """The V x d teacher matrix, not detached: the unscaled input embedding, or the output rows."""
        if self.cfg.aug_embed == "input":
            embed = getattr(model.decoder, "embed_tokens", None)
            if embed is None or not hasattr(embed, "weight"):
                raise ValueError("--aug-embed input needs a decoder input embedding (decoder.embed_tokens)")
            return embed.weight  # unscaled rows: fairseq's embed_scale must not leak into tau
        return output_projection_weight(model)

    def masked_teacher_columns(self):
        return None if self.cfg.no_aug_mask_special else never_real_ids(self.dictionary)

    def aug_coef(self):
        """alpha * s(tau), the weight of the KL in the loss."""
        return self.current_aug_alpha() * aug_scale_factor(self.cfg.aug_scale, self.cfg.aug_temperature)

    def build_teacher(self, model, target):
        """The detached teacher of these targets, or None (augmented loss off, or not detached)."""
        if self.current_aug_alpha() <= 0 or self.cfg.no_aug_detach_target:
            return None
        return build_teacher(
            self.teacher_matrix(model).detach(), target, self.cfg.aug_temperature, self.aug_coef(),
            self.masked_teacher_columns(), gate_with_agg=self.cfg.aug_gate_with_agg,
        )

    def output_loss(self, model, hidden, weight, target, gates):
        alpha = self.current_aug_alpha()
        if alpha <= 0:
            return super().output_loss(model, hidden, weight, target, gates)
        if self.cfg.no_aug_detach_target:
            loss, nll, _ = self.output_layer(hidden, weight, target, gates)
            kl = augmented_kl_direct(
                hidden, weight, self.teacher_matrix(model), target, self.cfg.aug_temperature,
                self.masked_teacher_columns(), chunk_size=self.cfg.output_chunk_tokens,
            )
            loss = loss + self.aug_coef() * kl
            aug_kl = kl.detach()
        else:
            loss, nll, aug_kl = self.output_layer(hidden, weight, target, gates, self.build_teacher(model, target))
        return loss, nll, {"aug_loss": aug_kl.data, "aug_alpha": alpha, "aug_steps": 1}

    @classmethod
    def reduce_extra_metrics(cls, logging_outputs, total):
        super().reduce_extra_metrics(logging_outputs, total)
        aug_steps = total("aug_steps")
        if aug_steps:
            ntokens = total("ntokens")
            metrics.log_scalar("aug_loss", total("aug_loss") / ntokens / math.log(2), ntokens, round=4)
            metrics.log_scalar("aug_alpha", total("aug_alpha") / aug_steps, aug_steps, round=4)


@register_criterion("augmented_loss", dataclass=AugmentedLossConfig)
class AugmentedLossCriterion(AugmentedLossMixin, OutputLossCriterion):
    """(Label-smoothed) cross-entropy plus alpha * s(tau) * KL(y~ || softmax(z / tau)); see the module docstring."""
