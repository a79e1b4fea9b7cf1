"""``cross_entropy_agg``: Adaptive Gradient Gating (Yu et al., ACL 2022, "Rare Tokens Degenerate All Tokens").

The loss value and the hidden-state gradients are those of (label-smoothed) cross-entropy; only
the output-softmax part of the output-embedding gradient is gated (paper §4; docs/agg.md): for a
rare token r, its "pushing" gradient from contexts with a non-rare target is scaled by g1_r, from
contexts with another rare target by g2_r; its gradient from its own contexts is kept.

Rare tokens are found from target counts over the last K optimizer updates (K = updates per epoch
by default). Counts move only in training, are summed over data-parallel ranks, and are saved in
the checkpoint, so a resumed run continues with the same counts and gates. The math is in
:mod:`fairseq_agg.ops.agg_gates`; ``--aug-alpha`` adds the augmented loss in the same fused pass
(:mod:`fairseq_agg.criterions.augmented_loss`).
"""
import logging
from dataclasses import dataclass, field

import torch
from fairseq import metrics
from fairseq.criterions import register_criterion
from fairseq.dataclass import ChoiceEnum

from fairseq_agg.fairseq_hooks import CheckpointedState, is_translation_task
from fairseq_agg.ops.agg_gates import (
    RareTokenWindow, agg_gates, alpha_allowed_range, frozen_rare_rows, resolve_threshold,
)
from fairseq_agg.stats.groups import frequency_groups, parse_fractions

from .augmented_loss import AugmentedLossConfig, AugmentedLossMixin
from .target_counting import add_counts, open_update, set_epoch_window
from .output_loss import OutputLossCriterion, check_range

logger = logging.getLogger(__name__)


@dataclass
class AggCriterionConfig(AugmentedLossConfig):
    aug_alpha: float = field(
        default=0.0, metadata={"help": "weight alpha of the augmented loss (>= 0; 0 = off)"}
    )
    agg_alpha: float = field(
        default=0.03,
        metadata={"help": "rare-token threshold alpha (in (0, 1] with --agg-g1-mode code, > 0 with normalized): a token is rare if it occurs fewer than alpha times "
                  "per --agg-ref-tokens target tokens of the window (per optimizer update with "
                  "--agg-threshold-mode per-update); paper: 0.03 for WikiText-103 LM, 0.08 for WMT14 MT"},
    )
    agg_window: int = field(
        default=0,
        metadata={"help": "number K of recent optimizer updates whose targets are counted (>= 1); "
                  "0 = auto, the number of updates per epoch as in the paper"},
    )
    agg_g1_mode: ChoiceEnum(["code", "normalized"]) = field(
        default="code",
        metadata={"help": "gate g1 of rare tokens: code = a_k (the released code), normalized = a_k / alpha"},
    )
    agg_threshold_mode: ChoiceEnum(["auto", "relative", "per-update"]) = field(
        default="auto",
        metadata={"help": "auto = relative (batch-size invariant); relative: a_k = count per --agg-ref-tokens "
                  "target tokens of the window; per-update: a_k = mean count per optimizer update (the "
                  "released code, whose strength depends on the tokens per update)"},
    )
    agg_ref_tokens: int = field(
        default=0,
        metadata={"help": "reference target tokens per update B_ref of the relative threshold (>= 1); 0 = auto: "
                  "the paper's recipes, 32768 for language modeling, 65536 for translation"},
    )
    agg_local_counts: bool = field(
        default=False,
        metadata={"help": "count targets of this rank only (the released code's multi-GPU behaviour) "
                  "instead of summing the counts over data-parallel ranks"},
    )
    agg_legacy_double_loss: bool = field(
        default=False,
        metadata={"help": "report loss = 2 x CE as the released code did (gradients unchanged)"},
    )
    agg_freeze_rare: bool = field(
        default=False,
        metadata={"help": "rare-token freezing instead of gating (the AGG paper's Table 1 analysis): the "
                  "output-embedding gradient of every rare token is zero, the rest is plain cross-entropy"},
    )
    agg_freeze_set: ChoiceEnum(["window", "group"]) = field(
        default="window",
        metadata={"help": "rare tokens to freeze: window = AGG's rare group (window counts, --agg-alpha); "
                  "group = the static rare group of the statistics (--embed-group-fractions, default the "
                  "bottom 20 percent of the dictionary)"},
    )
    agg_freeze_until_update: int = field(
        default=0,
        metadata={"help": "freeze during the first N updates only (>= 0; 0 = the whole run)"},
    )


@register_criterion("cross_entropy_agg", dataclass=AggCriterionConfig)
class AggCriterion(CheckpointedState, AugmentedLossMixin, OutputLossCriterion):
    STATE_MODULES, STATE_NAME = ("window",), "AGG counting window"

    def __init__(self, task, cfg: AggCriterionConfig):
        allowed_alpha, alpha_ok = alpha_allowed_range(cfg.agg_g1_mode)
        check_range("agg_alpha", cfg.agg_alpha, alpha_ok(cfg.agg_alpha), allowed_alpha)
        check_range("agg_window", cfg.agg_window, cfg.agg_window >= 0, ">= 1 (or 0 for auto)")
        check_range("agg_ref_tokens", cfg.agg_ref_tokens, cfg.agg_ref_tokens >= 0, ">= 1 (or 0 for auto)")
        super().__init__(task, cfg)
        self.nspecial = self.dictionary.nspecial
        self.window = RareTokenWindow(len(self.dictionary), cfg.agg_window or None)
        self.anchor_state()  # the window travels with every checkpoint
        self.threshold_mode, self.ref_tokens = resolve_threshold(
            cfg.agg_threshold_mode, cfg.agg_ref_tokens, is_translation_task(task)
        )
        self._threshold_logged = False
        if self.window.is_configured:
            self.log_threshold()
        self._last_gates = None
        check_range("agg_freeze_until_update", cfg.agg_freeze_until_update, cfg.agg_freeze_until_update >= 0, ">= 0")
        self.frozen_rows = None  # rows of dW held at zero in this micro-batch (--agg-freeze-rare)
        self.frozen_group = None
        if cfg.agg_freeze_rare and cfg.agg_freeze_set == "group":
            self.frozen_group = frequency_groups(
                self.dictionary, parse_fractions(cfg.embed_group_fractions), cfg.embed_group_preset
            )["rare"]

    def on_train_batches(self, batches_per_epoch):
        set_epoch_window(self.window, batches_per_epoch, self.cfg.update_freq, "AGG", "--agg-window")
        self.log_threshold()  # also after a resume, whose window came from the checkpoint

    def log_threshold(self):
        """Says once, at start-up, what --agg-alpha means in this run."""
        if self._threshold_logged:
            return
        self._threshold_logged = True
        alpha, window = self.cfg.agg_alpha, self.window.window
        if self.threshold_mode == "relative":
            logger.info(
                f"AGG: a token is rare below {alpha:g} occurrences per {self.ref_tokens} target tokens "
                f"(relative frequency < {alpha / self.ref_tokens:.3g}, whatever the tokens per update); "
                f"{window} updates per window"
            )
        else:
            logger.info(
                f"AGG: a token is rare below {alpha:g} occurrences per optimizer update (--agg-threshold-mode "
                f"per-update: the threshold scales with the tokens per update); {window} updates per window"
            )

    def compute_gates(self, model, target):
        self._last_gates = None
        self.frozen_rows = None
        if not open_update(self, self.window, model, "cross_entropy_agg", "--agg-window"):
            return None  # validation: counts never change, and no gradient needs gating
        add_counts(self, self.window, target, len(self.dictionary), all_reduce=not self.cfg.agg_local_counts)
        gates = agg_gates(
            self.window.counts,
            self.window.recorded,
            self.cfg.agg_alpha,
            self.nspecial,
            g1_mode=self.cfg.agg_g1_mode,
            threshold_mode=self.threshold_mode,
            ref_tokens=self.ref_tokens,
        ).to(target.device)
        if self.cfg.agg_freeze_rare:
            until = self.cfg.agg_freeze_until_update
            if until == 0 or self.update_num < until:
                self.frozen_rows = frozen_rare_rows(
                    len(self.dictionary), gates=None if self.frozen_group is not None else gates,
                    group=self.frozen_group, device=target.device,
                )
            return None  # freezing replaces the gates: plain cross-entropy on every other row
        self._last_gates = gates
        return gates

    def output_layer(self, hidden, weight, target, gates=None, teacher=None, **terms):
        return super().output_layer(hidden, weight, target, gates, teacher, frozen_rows=self.frozen_rows, **terms)

    def adjust_loss(self, loss):
        loss = super().adjust_loss(loss)
        if self.cfg.agg_legacy_double_loss:
            loss = loss + loss.detach()
        return loss

    def extra_logging(self):
        if self.frozen_rows is not None:
            return {"agg_freeze_steps": 1, "agg_frozen": self.frozen_rows.sum()}
        gates = self._last_gates
        if gates is None:
            return {}
        # tensors, not Python numbers: no device synchronisation; fairseq sums them after the step
        rare = gates.rare.float()
        n_rare = rare.sum()
        denom = n_rare.clamp(min=1)
        return {
            "agg_steps": 1,
            "agg_rare": n_rare,
            "agg_very_rare": ((gates.g2 < 1).float() * rare).sum(),
            "agg_g1": torch.where(n_rare > 0, (gates.g1 * rare).sum() / denom, torch.ones_like(n_rare)),
            "agg_g2": torch.where(n_rare > 0, (gates.g2 * rare).sum() / denom, torch.ones_like(n_rare)),
        }

    @classmethod
    def reduce_extra_metrics(cls, logging_outputs, total):
        super().reduce_extra_metrics(logging_outputs, total)
        steps = total("agg_steps")
        if steps:
            for key, digits in (("agg_rare", 1), ("agg_very_rare", 1), ("agg_g1", 4), ("agg_g2", 4)):
                metrics.log_scalar(key, total(key) / steps, steps, round=digits)
        freeze_steps = total("agg_freeze_steps")
        if freeze_steps:
            metrics.log_scalar("agg_frozen", total("agg_frozen") / freeze_steps, freeze_steps, round=1)
