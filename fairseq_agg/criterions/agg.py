"""``cross_entropy_agg``: Adaptive Gradient Gating (Yu et al., ACL 2022, "Rare Tokens Degenerate All Tokens").

The loss value and the hidden-state gradients are those of (label-smoothed) cross-entropy; only
the output-softmax part of the output-embedding gradient is gated (paper §4; docs/agg.md): for a
rare token r, its "pushing" gradient from contexts with a non-rare target is scaled by g1_r, from
contexts with another rare target by g2_r; its gradient from its own contexts is kept.

Rare tokens are found from target counts over the last K optimizer updates (K = updates per epoch
by default). Counts move only in training, are summed over data-parallel ranks, and are saved in
the checkpoint, so a resumed run continues with the same counts and gates. The method is
:class:`fairseq_agg.ops.AggLoss` (the math in :mod:`fairseq_agg.ops.agg`), rare-token
freezing :class:`fairseq_agg.ops.RareFreezing`; ``--aug-alpha`` adds the augmented loss in the same
fused pass (:mod:`fairseq_agg.criterions.augmented_loss`; with it off, the step never passes
through it). :meth:`AggCriterion.forward` is the whole step.
"""
import logging
from dataclasses import dataclass, field

from fairseq.criterions import register_criterion
from fairseq.dataclass import ChoiceEnum

from fairseq_agg.fairseq_facts.dictionary import nspecial
from fairseq_agg.fairseq_facts.distributed import data_parallel_group, data_parallel_world_size
from fairseq_agg.fairseq_facts.training_loop import is_translation_task, updates_per_epoch
from fairseq_agg.ops import AggLoss, RareFreezing, TeacherTargets, fused_linear_loss, gate_statistics
from fairseq_agg.ops.agg_threshold import resolve_threshold
from fairseq_agg.stats.groups import frequency_groups, parse_fractions

from .augmented_loss import (
    AugmentedLossConfig, augmented_logging, augmented_loss_from_config, reduce_augmented_metrics, teacher_matrix,
)
from .output_loss import OutputLossCriterion, log_means, refuse_without

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
    agg_restart_counts: bool = field(
        default=False,
        metadata={"help": "start the window's counts empty instead of loading those of the checkpoint resumed or "
                  "fine-tuned from (for a checkpoint whose counts are missing or refused as damaged)"},
    )


@register_criterion("cross_entropy_agg", dataclass=AggCriterionConfig)
class AggCriterion(OutputLossCriterion):
    """AGG's gated cross-entropy (or rare-token freezing), optionally with the augmented loss.

    One window per target dictionary (``self.aggs``, by state name; ``self.agg`` is the first, the
    only one unless multilingual_translation splits its dictionaries per target language:
    fairseq_facts/target_vocabularies.py); each language pair's batch counts into, and is gated
    by, the window of its target dictionary."""

    counts_per_vocabulary = True

    def __init__(self, task, cfg: AggCriterionConfig):
        threshold_mode, ref_tokens = resolve_threshold(cfg.agg_threshold_mode, cfg.agg_ref_tokens,
                                                       is_translation_task(task))
        super().__init__(task, cfg, "cross_entropy_agg")
        self.aggs = self.per_vocabulary("window", lambda dictionary: AggLoss(
            len(dictionary), alpha=cfg.agg_alpha, window=cfg.agg_window or None, nspecial=nspecial(dictionary),
            g1_mode=cfg.agg_g1_mode, threshold_mode=threshold_mode,
            ref_tokens=ref_tokens if threshold_mode == "relative" else (cfg.agg_ref_tokens or None),
            all_reduce=not cfg.agg_local_counts, process_group=data_parallel_group(),
        ))
        self.agg = next(iter(self.aggs.values()))
        if self.vocabularies.split:  # freezing's rows and the augmented loss's teacher are of one dictionary
            refuse_without(cfg, AggCriterionConfig, ["agg_freeze_rare", "aug_alpha"], False,
                           "one target dictionary (multilingual_translation splits them per target language)")
        group = None
        if cfg.agg_freeze_set == "group":
            fractions = parse_fractions(cfg.embed_group_fractions)
            group = frequency_groups(self.dictionary, fractions, cfg.embed_group_preset)["rare"]
        freezing = RareFreezing(len(self.dictionary), rare_set=cfg.agg_freeze_set, group=group,
                                until_update=cfg.agg_freeze_until_update)  # validates the values first
        refuse_without(cfg, AggCriterionConfig, ["agg_freeze_set", "agg_freeze_until_update"], cfg.agg_freeze_rare,
                       "--agg-freeze-rare")
        self.freezing = freezing if cfg.agg_freeze_rare else None
        augmented = augmented_loss_from_config(cfg, self.dictionary)  # validates the --aug-* flags
        self.augmented = augmented if augmented.alpha > 0 else None  # off: the step never reaches it
        self.refuse_output_kernel(*([TeacherTargets] if augmented.fused_teacher else []))
        # the windows travel with every checkpoint
        self.keep_in_checkpoints("agg_restart_counts", **{name: agg.counter for name, agg in self.aggs.items()})
        # public, for inspection: the gates of the latest training micro-batch (None after validation)
        self.last_gates = None
        self._threshold_logged = self._operating_point_logged = False
        if self.agg.counter.is_configured:
            self.log_threshold()

    def on_epoch_batches(self, batches_per_epoch):
        for name, agg in self.aggs.items():
            self.set_epoch_window(agg.counter, batches_per_epoch, self.vocabulary_label("AGG", name))
        self.log_threshold()  # also after a resume, whose window came from the checkpoint
        self.log_operating_point(batches_per_epoch)

    def check_model(self, model):
        weight = super().check_model(model)
        if self.augmented is not None:
            teacher_matrix(model, self.cfg.aug_embed, self.augmented)  # refuses a model without one
        return weight

    def log_threshold(self):
        """Says once, at start-up, what --agg-alpha means in this run."""
        if not self._threshold_logged:
            self._threshold_logged = True
            logger.info(f"AGG: {self.agg.describe()}")

    def log_operating_point(self, batches_per_epoch: int):
        """Says once, at start-up, where alpha puts AGG's rare set in this run (docs/agg.md, "The
        operating point"), for each window its own target tokens; not for freezing a static group,
        which ignores the window."""
        tokens = self.loop.tokens_per_epoch
        if self._operating_point_logged or not tokens or self.cfg.agg_freeze_rare and self.cfg.agg_freeze_set == "group":
            return
        self._operating_point_logged = True
        tokens_of = {name: tokens for name in self.aggs}
        if self.vocabularies.split and self.loop.tokens_per_pair:  # a window per target language
            tokens_of = dict.fromkeys(self.aggs, 0)
            for pair, pair_tokens in self.loop.tokens_per_pair.items():
                tokens_of[self._state_name("window", self.vocabularies.name_of_pair(pair))] += pair_tokens
        updates = updates_per_epoch(batches_per_epoch, self.cfg.update_freq)
        for name, agg in self.aggs.items():
            window_tokens = tokens_of[name]
            if not agg.all_reduce:  # --agg-local-counts: each rank counts its own share of the epoch
                window_tokens = window_tokens / data_parallel_world_size()
            logger.info(f"{self.vocabulary_label('AGG', name)}: {agg.describe_operating_point(window_tokens, updates)}")

    def forward(self, model, sample, reduce=True):
        batch = self.io.batch(model, sample)
        # Training only: count this micro-batch's targets into the window (a dummy batch counts
        # nothing but still joins the sum over the ranks), then gate, or freeze, its gradient.
        # Validation moves no counts and needs no gates (no gradient).
        update_num = self.loop.training_update(model, self.name)
        self.last_gates, frozen, extra = None, None, {}
        if update_num is not None:
            counted = batch.target[:0] if self.loop.ignore_grad else batch.target
            self.last_gates = self.aggs[self.vocabulary_state("window", model)].step(counted, update_num)
            if self.freezing is not None:  # freezing replaces the gates: plain CE on every other row
                frozen = self.freezing.terms(update_num, self.last_gates, batch.target.device)
                extra = {"agg_freeze_steps": 1, "agg_frozen": frozen[0].mask.sum()} if frozen else {}
            else:
                extra = {"agg_steps": 1, **gate_statistics(self.last_gates)}
        request = self.request.with_terms(*((self.last_gates,) if frozen is None else frozen), per_token=not reduce)
        if self.augmented is None:
            result = fused_linear_loss(batch.hidden, batch.weight, batch.target, request)
        else:  # the augmented loss (--aug-alpha > 0) joins the same fused pass
            embedding = teacher_matrix(model, self.cfg.aug_embed, self.augmented)
            result = self.augmented(batch.hidden, batch.weight, embedding, batch.target, self.loop.update_num, request)
            extra = {**augmented_logging(self.augmented, result, self.loop.update_num), **extra}
        loss = result.loss
        if self.cfg.agg_legacy_double_loss:  # the released code's 2 x CE value; gradients unchanged
            loss = loss + loss.detach()
        return self.io.finish(model, batch, loss, result.nll, extra)

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        reduce_augmented_metrics(logging_outputs)
        log_means(logging_outputs, "agg_steps", {"agg_rare": 1, "agg_very_rare": 1, "agg_g1": 4, "agg_g2": 4})
        log_means(logging_outputs, "agg_freeze_steps", {"agg_frozen": 1})
