"""``cross_entropy_agg``: Adaptive Gradient Gating (Yu et al., ACL 2022, "Rare Tokens Degenerate All Tokens").

The loss value and the hidden-state gradients are those of (label-smoothed) cross-entropy; only
the output-softmax part of the output-embedding gradient is gated (paper §4; spec agg.md §1-§5):
for a rare token r, its "pushing" gradient from contexts with a non-rare target is scaled by
g1_r, from contexts with another rare target by g2_r; its gradient from its own contexts is kept.

Rare tokens are found from target counts over the last K optimizer updates (K = updates per epoch
by default). Counts move only in training, are summed over data-parallel ranks, and are saved in
the checkpoint, so a resumed run continues with the same counts and gates.
"""
import logging
from dataclasses import dataclass, field

import torch
from fairseq.criterions import register_criterion
from fairseq.dataclass import ChoiceEnum

from fairseq_agg.ops.rare_tokens import RareTokenWindow, agg_gates, target_histogram

from ._training_hooks import updates_per_epoch
from .output_loss import OutputLossConfig, OutputLossCriterion, _check_range

logger = logging.getLogger(__name__)


@dataclass
class AggCriterionConfig(OutputLossConfig):
    agg_alpha: float = field(
        default=0.03,
        metadata={"help": "rare-token threshold alpha (> 0): a token is rare if its mean count per update is "
                  "below alpha (paper: 0.03 for WikiText-103 LM, 0.08 for WMT14 MT)"},
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
    agg_threshold_mode: ChoiceEnum(["per-update", "relative"]) = field(
        default="per-update",
        metadata={"help": "per-update: a_k = mean count per update (the paper); relative: a_k = count per "
                  "--agg-ref-tokens target tokens, invariant to the batch size"},
    )
    agg_ref_tokens: int = field(
        default=32768,
        metadata={"help": "reference target tokens per update for --agg-threshold-mode relative (>= 1)"},
    )
    agg_local_counts: bool = field(
        default=False,
        metadata={"help": "count targets of this rank only (the released code's multi-GPU behaviour) "
                  "instead of summing the counts over data-parallel ranks"},
    )
    agg_chunk_size: int = field(
        default=2048,
        metadata={"help": "target tokens per chunk of the fused output layer (>= 1); memory is O(chunk x V)"},
    )
    agg_legacy_double_loss: bool = field(
        default=False,
        metadata={"help": "report loss = 2 x CE as the released code did (gradients unchanged)"},
    )


@register_criterion("cross_entropy_agg", dataclass=AggCriterionConfig)
class AggCriterion(OutputLossCriterion):
    def __init__(self, task, cfg: AggCriterionConfig):
        super().__init__(task, cfg)
        _check_range("agg_alpha", cfg.agg_alpha, cfg.agg_alpha > 0, "> 0")
        _check_range("agg_window", cfg.agg_window, cfg.agg_window >= 0, ">= 1 (or 0 for auto)")
        _check_range("agg_ref_tokens", cfg.agg_ref_tokens, cfg.agg_ref_tokens >= 1, ">= 1")
        _check_range("agg_chunk_size", cfg.agg_chunk_size, cfg.agg_chunk_size >= 1, ">= 1")
        self.chunk_size = cfg.agg_chunk_size
        self.nspecial = self.dictionary.nspecial
        self.window = RareTokenWindow(len(self.dictionary), cfg.agg_window or None)
        # fairseq saves and restores a criterion's state_dict only when the criterion has
        # parameters (Trainer.state_dict / load_checkpoint). This one-element anchor, added to the
        # loss times zero, makes the counting window part of every checkpoint; it never changes.
        self.state_anchor = torch.nn.Parameter(torch.zeros(1))
        self._last_gates = None

    def on_train_batches(self, batches_per_epoch):
        if not self.window.is_configured:
            window = updates_per_epoch(batches_per_epoch, self.cfg.update_freq)
            logger.info(f"AGG counting window: {window} updates (one epoch; set --agg-window to change)")
            self.window.set_window(window)

    def compute_gates(self, model, target):
        self._last_gates = None
        if not (model.training and torch.is_grad_enabled()):
            return None  # validation: counts never change, and no gradient needs gating
        if self._update_num is None:
            raise RuntimeError(
                "cross_entropy_agg needs the update number: train with fairseq-train, or call "
                "criterion.set_update_num(n) before each training forward"
            )
        if not self.window.is_configured:
            raise ValueError(
                "--agg-window is 0 (auto, one epoch of updates) but the number of updates per epoch is "
                "unknown here; pass --agg-window N (N >= 1)"
            )
        self.window.start_update(self._update_num + 1)
        if self._ignore_grad:
            target = target[:0]  # a dummy batch still joins the collective, with nothing in it
        histogram = target_histogram(
            target, len(self.dictionary), all_reduce=not self.cfg.agg_local_counts, group=_data_parallel_group()
        )
        self.window.add(histogram)
        gates = agg_gates(
            self.window.counts,
            self.window.recorded,
            self.cfg.agg_alpha,
            self.nspecial,
            g1_mode=self.cfg.agg_g1_mode,
            threshold_mode=self.cfg.agg_threshold_mode,
            ref_tokens=self.cfg.agg_ref_tokens,
        )
        gates.g1 = gates.g1.to(target.device)
        gates.g2 = gates.g2.to(target.device)
        gates.rare = gates.rare.to(target.device)
        self._last_gates = gates
        return gates

    def adjust_loss(self, loss):
        loss = loss + 0.0 * self.state_anchor.sum()  # keeps the anchor in the graph (DDP), adds nothing
        if self.cfg.agg_legacy_double_loss:
            loss = loss + loss.detach()
        return loss

    def extra_logging(self):
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
        from fairseq import metrics

        steps = total("agg_steps")
        if steps:
            for key, digits in (("agg_rare", 1), ("agg_very_rare", 1), ("agg_g1", 4), ("agg_g2", 4)):
                metrics.log_scalar(key, total(key) / steps, steps, round=digits)

    def load_state_dict(self, state_dict, strict=True, **kwargs):
        if state_dict is None:  # checkpoint written by another criterion
            logger.info("checkpoint has no AGG counts: the counting window starts empty")
            return
        return super().load_state_dict(state_dict, strict=strict, **kwargs)


def _data_parallel_group():
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    from fairseq.distributed import utils as distributed_utils

    return distributed_utils.get_data_parallel_group()
