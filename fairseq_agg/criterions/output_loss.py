"""Shared base of the plugin's output-layer criteria (AGG, augmented loss, and their combination).

The criterion runs the model with ``features_only=True`` and applies the decoder's output
projection itself through :func:`fairseq_agg.ops.fused_linear_loss.fused_linear_loss`, so the
logits are computed once, in chunks, and never kept as a tokens x V tensor. LM and MT go through the
same code; label smoothing is a parameter (fairseq's convention). Subclasses add the AGG gates
(``compute_gates``); the augmented loss is configured here because both criteria offer it.

Logged like fairseq's stock criteria: ``loss`` (the optimised loss, base 2, per ``sample_size``),
``nll_loss`` (plain cross-entropy, base 2, per target token) and ``ppl`` derived from ``nll_loss``,
plus ``aug_loss`` (KL of the augmented loss, base 2, per token) when it is on.
"""
import logging
import math
from dataclasses import dataclass, field

import torch
from fairseq import metrics, utils
from fairseq.criterions import FairseqCriterion
from fairseq.dataclass import ChoiceEnum
from omegaconf import II

from fairseq_agg.dictionary_utils import never_real_ids
from fairseq_agg.ops.augmented import SCALES, aug_scale_factor, build_teacher
from fairseq_agg.ops.augmented_direct import augmented_kl_direct
from fairseq_agg.ops.fused_linear_loss import fused_linear_loss
from fairseq_agg.stats.live import EmbeddingStatsConfig, EmbeddingStatsMixin

from ._training_hooks import TrainingObserver, observe_task

logger = logging.getLogger(__name__)

AUG_SCALE_CHOICES = ChoiceEnum(list(SCALES))
AUG_EMBED_CHOICES = ChoiceEnum(["input", "output"])


@dataclass
class OutputLossConfig(EmbeddingStatsConfig):
    label_smoothing: float = field(
        default=0.0,
        metadata={"help": "epsilon for label smoothing, 0 means none; 0 <= eps < 1 (MT recipes: 0.1)"},
    )
    sentence_avg: bool = II("optimization.sentence_avg")
    update_freq: list = II("optimization.update_freq")
    train_subset: str = II("dataset.train_subset")
    # Augmented loss (Inan et al., ICLR 2017): J = CE + alpha * s(tau) * KL(teacher || softmax(z / tau)).
    aug_alpha: float = field(
        default=0.0, metadata={"help": "weight alpha of the augmented loss (>= 0; 0 = off)"}
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
                  "the teacher is a constant, spec augmented_loss.md §2.4)"},
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


def _check_range(name, value, ok, allowed):
    if not ok:
        raise ValueError(f"--{name.replace('_', '-')} must be {allowed}, got {value}")


def output_projection_weight(model):
    """The V x d output matrix of a fairseq decoder, refusing setups without one."""
    decoder = getattr(model, "decoder", None)
    if decoder is None:
        raise ValueError("this criterion needs an encoder-decoder or decoder-only fairseq model with a decoder")
    if getattr(decoder, "adaptive_softmax", None) is not None:
        raise ValueError(
            "--adaptive-softmax-cutoff is not supported by this criterion: it needs the full output "
            "projection matrix (train without adaptive softmax)"
        )
    embed = getattr(decoder, "embed_tokens", None)
    if embed is not None and embed.__class__.__name__ == "AdaptiveInput":
        raise ValueError("--adaptive-input is not supported by this criterion (train with a plain embedding)")
    projection = getattr(decoder, "output_projection", None)
    if not isinstance(projection, torch.nn.Linear):
        raise ValueError(
            "the model has no linear output projection (decoder.output_projection); this criterion "
            "needs one (tied via --share-decoder-input-output-embed / --share-all-embeddings, or untied)"
        )
    if projection.bias is not None:
        raise ValueError("output projections with a bias are not supported by this criterion")
    return projection.weight


class OutputLossCriterion(EmbeddingStatsMixin, TrainingObserver, FairseqCriterion):
    """Fused output projection + loss; see the module docstring."""

    chunk_size = 2048

    def __init__(self, task, cfg: OutputLossConfig):
        super().__init__(task)
        self.cfg = cfg
        _check_range("label_smoothing", cfg.label_smoothing, 0.0 <= cfg.label_smoothing < 1.0, "in [0, 1)")
        _check_range("aug_alpha", cfg.aug_alpha, cfg.aug_alpha >= 0.0, ">= 0")
        _check_range("aug_temperature", cfg.aug_temperature, cfg.aug_temperature > 0.0, "> 0")
        _check_range("aug_warmup_updates", cfg.aug_warmup_updates, cfg.aug_warmup_updates >= 0, ">= 0")
        if cfg.no_aug_detach_target and cfg.aug_gate_with_agg:
            raise ValueError(
                "--aug-gate-with-agg cannot be combined with --no-aug-detach-target: the non-detached "
                "augmented loss is computed outside the fused (gated) output layer"
            )
        self.eps = float(cfg.label_smoothing)
        self.sentence_avg = cfg.sentence_avg
        self.dictionary = task.target_dictionary
        self._update_num = None  # set by the task hook in training
        self._ignore_grad = False
        self._model_checked = False
        observe_task(task, self, train_subset=cfg.train_subset or "train")

    # --- training-loop events (see _training_hooks.py)
    def on_train_step(self, update_num, ignore_grad):
        self._update_num = update_num
        self._ignore_grad = ignore_grad

    def on_begin_epoch(self, epoch, model):
        self.check_model(model)

    def check_model(self, model):
        """Refuses models without a usable output projection (clear error naming the flag)."""
        weight = output_projection_weight(model)
        if weight.size(0) != len(self.dictionary):
            raise ValueError(
                f"output projection has {weight.size(0)} rows but the target dictionary has {len(self.dictionary)}"
            )
        if self.cfg.aug_alpha > 0:
            self.teacher_matrix(model)
        self._model_checked = True
        return weight

    def set_update_num(self, update_num: int, ignore_grad: bool = False):
        """For use outside fairseq-train: the index of the update the next forward belongs to."""
        self.on_train_step(update_num, ignore_grad)

    # --- hooks for subclasses
    def compute_gates(self, model, target):
        """AGG gates for this micro-batch, or None (no gating)."""
        return None

    def extra_logging(self):
        return {}

    # --- augmented loss
    def current_aug_alpha(self):
        alpha = self.cfg.aug_alpha
        warmup = self.cfg.aug_warmup_updates
        if alpha > 0 and warmup > 0 and self._update_num is not None:
            alpha *= min(1.0, (self._update_num + 1) / warmup)
        return alpha

    def teacher_matrix(self, model):
        """The V x d teacher matrix, not detached: the unscaled input embedding, or the output rows."""
        if self.cfg.aug_embed == "input":
            embed = getattr(model.decoder, "embed_tokens", None)
            if embed is None or not hasattr(embed, "weight"):
                raise ValueError("--aug-embed input needs a decoder input embedding (decoder.embed_tokens)")
            return embed.weight  # unscaled rows: fairseq's embed_scale must not leak into tau (§8.3)
        return output_projection_weight(model)

    def masked_teacher_columns(self):
        return None if self.cfg.no_aug_mask_special else never_real_ids(self.dictionary)

    def build_teacher(self, model, target):
        alpha = self.current_aug_alpha()
        if alpha <= 0 or self.cfg.no_aug_detach_target:
            return None  # off, or the non-detached variant (added in forward)
        matrix = self.teacher_matrix(model)
        masked = self.masked_teacher_columns()
        coef = alpha * aug_scale_factor(self.cfg.aug_scale, self.cfg.aug_temperature)
        return build_teacher(
            matrix.detach(), target, self.cfg.aug_temperature, coef, masked, gate_with_agg=self.cfg.aug_gate_with_agg
        )

    # --- forward
    def forward(self, model, sample, reduce=True):
        if not reduce:
            raise ValueError("this criterion only supports reduce=True")
        weight = output_projection_weight(model) if self._model_checked else self.check_model(model)
        net_output = model(**sample["net_input"], features_only=True)
        features = net_output[0]
        target = model.get_targets(sample, net_output).reshape(-1)
        features = features.reshape(-1, features.size(-1))
        keep = target.ne(self.padding_idx).nonzero().squeeze(1)  # padding masked everywhere
        hidden = features.index_select(0, keep)
        target = target.index_select(0, keep)

        gates = self.compute_gates(model, target)
        teacher = self.build_teacher(model, target)
        loss, nll, aug_kl = fused_linear_loss(
            hidden, weight, target, self.eps, gates=gates, teacher=teacher, chunk_size=self.chunk_size
        )
        direct = self.cfg.no_aug_detach_target and self.current_aug_alpha() > 0
        if direct:
            # --no-aug-detach-target: gradients also flow into E through the teacher (spec §2.4, §4)
            coef = self.current_aug_alpha() * aug_scale_factor(self.cfg.aug_scale, self.cfg.aug_temperature)
            kl = augmented_kl_direct(
                hidden, weight, self.teacher_matrix(model), target, self.cfg.aug_temperature,
                self.masked_teacher_columns(), chunk_size=self.chunk_size,
            )
            loss = loss + coef * kl
            aug_kl = kl.detach()
        loss = self.adjust_loss(loss)

        ntokens = sample["ntokens"]
        sample_size = sample["target"].size(0) if self.sentence_avg else ntokens
        logging_output = {
            "loss": loss.data,
            "nll_loss": nll.data,
            "ntokens": ntokens,
            "nsentences": sample["target"].size(0),
            "sample_size": sample_size,
        }
        if teacher is not None or direct:
            logging_output["aug_loss"] = aug_kl.data
            logging_output["aug_alpha"] = self.current_aug_alpha()
            logging_output["aug_steps"] = 1
        logging_output.update(self.extra_logging())
        self.log_embedding_stats(model)
        return loss, sample_size, logging_output

    def adjust_loss(self, loss):
        return loss

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        def total(key):
            return sum(log.get(key, 0) for log in logging_outputs)

        loss_sum, nll_sum = total("loss"), total("nll_loss")
        ntokens, sample_size = total("ntokens"), total("sample_size")
        metrics.log_scalar("loss", loss_sum / sample_size / math.log(2), sample_size, round=3)
        metrics.log_scalar("nll_loss", nll_sum / ntokens / math.log(2), ntokens, round=3)
        metrics.log_derived("ppl", lambda meters: utils.get_perplexity(meters["nll_loss"].avg))
        aug_steps = total("aug_steps")
        if aug_steps:
            metrics.log_scalar("aug_loss", total("aug_loss") / ntokens / math.log(2), ntokens, round=4)
            metrics.log_scalar("aug_alpha", total("aug_alpha") / aug_steps, aug_steps, round=4)
        cls.reduce_extra_metrics(logging_outputs, total)
        reduce_stats = getattr(cls, "reduce_embedding_stats", None)
        if reduce_stats is not None:
            reduce_stats(logging_outputs)

    @classmethod
    def reduce_extra_metrics(cls, logging_outputs, total):
        pass

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        return True
