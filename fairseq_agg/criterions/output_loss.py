"""The one base class of the plugin's output-layer criteria: the fairseq side of the fused layer.

A criterion runs the model for its decoder's features (``features_only=True``, or the output
projection's input: :mod:`fairseq_agg.fairseq_facts.output_layer`) and applies the decoder's output
projection itself through :func:`fairseq_agg.ops.fused_linear_loss`, so the logits are computed once, in
chunks of ``--output-chunk-tokens`` target tokens, and never kept as a tokens x V tensor. LM and MT
go through the same code; label smoothing is a parameter (fairseq's convention). Each criterion
holds the method objects of :mod:`fairseq_agg.ops` it uses and calls them in its own ``forward``,
between ``self.io.batch`` (the pad-free rows of a batch) and ``self.io.finish`` (fairseq's answer
and the logging), both :mod:`fairseq_agg.fairseq_facts.output_layer`. This base builds them and the
request of the shared flags (``self.request``, built and checked once at start-up; a batch adds
its terms with ``LossRequest.with_terms``), the training loop (``self.loop``), the live embedding
statistics (``self.embedding_stats``) and checkpointed counts
(:meth:`~OutputLossCriterion.keep_in_checkpoints`).

Logged like fairseq's stock criteria: ``loss`` (the optimised loss, base 2, per ``sample_size``),
``nll_loss`` (plain cross-entropy, base 2, per target token) and ``ppl`` derived from ``nll_loss``.
With ``reduce=False`` the loss is per target position, as fairseq's ``cross_entropy`` returns it:
a (B x T,) tensor in the order of ``sample["target"].view(-1)``, 0 at padding.

fairseq's criterion API in full: ``build_criterion`` also takes a partial Namespace (the missing
fields take their defaults), and ``compute_loss`` serves a task that runs the decoder itself
(``translation_moe``).
"""
import dataclasses
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Optional

from fairseq import metrics, utils
from fairseq.criterions import FairseqCriterion
from fairseq.dataclass import ChoiceEnum
from omegaconf import II

from fairseq_agg.errors import UsageError, flag_name, plain_value
from fairseq_agg.fairseq_facts.checkpoint_files import criterion_state_saved_after, last_loaded_checkpoint
from fairseq_agg.fairseq_facts.checkpoint_state import anchor_criterion_state, holds_criterion_state
from fairseq_agg.fairseq_facts.criterion_config import complete_config
from fairseq_agg.fairseq_facts.output_layer import OutputLayerIO, output_projection_weight, training_device
from fairseq_agg.fairseq_facts.target_vocabularies import SHARED, TargetVocabularies, language_pair_models
from fairseq_agg.fairseq_facts.training_loop import TrainingLoop, updates_per_epoch
from fairseq_agg.ops import LossRequest
from fairseq_agg.ops.output_kernel import FLAG_CHOICES, check_available, describe, foreign_refusal
from fairseq_agg.stats.config import EmbeddingStatsConfig
from fairseq_agg.stats.live import EmbeddingStats, reduce_embedding_stats

logger = logging.getLogger(__name__)

# A criterion whose counts add more than this to every checkpoint says so once, in the log.
LARGE_STATE_BYTES = 8 << 20


@dataclass
class OutputLossConfig(EmbeddingStatsConfig):
    label_smoothing: float = field(
        default=0.0,
        metadata={"help": "epsilon for label smoothing, 0 means none; 0 <= eps < 1 (MT recipes: 0.1)"},
    )
    output_chunk_tokens: int = field(
        default=2048,
        metadata={"help": "target tokens per chunk of the fused output layer (>= 1); the extra memory is "
                  "O(chunk x V), never tokens x V"},
    )
    output_kernel: ChoiceEnum(list(FLAG_CHOICES)) = field(
        default="auto",
        metadata={"help": "the fused output layer's chunk body: auto (compiled where torch.compile can generate "
                  "code for the device, else eager), compiled, eager; or another fused cross-entropy, for plain CE, "
                  "label smoothing, AGG and freezing only: torch (F.linear_cross_entropy), liger (Liger-Kernel), "
                  "cce (cut-cross-entropy, no label smoothing)"},
    )
    sentence_avg: bool = II("optimization.sentence_avg")
    cpu: bool = II("common.cpu")
    update_freq: list = II("optimization.update_freq")
    train_subset: str = II("dataset.train_subset")
    ddp_backend: str = II("distributed_training.ddp_backend")
    # fine-tuning (counts of the checkpoint loaded start empty): fairseq's own options
    reset_optimizer: bool = II("checkpoint.reset_optimizer")
    reset_dataloader: bool = II("checkpoint.reset_dataloader")
    finetune_from_model: Optional[str] = II("checkpoint.finetune_from_model")


def flag_default(config_class, name: str):
    """The default of a flag, read from the config dataclass that declares it."""
    for config_field in dataclasses.fields(config_class):
        if config_field.name == name:
            return config_field.default
    raise KeyError(name)


def refuse_without(cfg, config_class, names, switch_on: bool, switch: str):
    """A flag of ``names`` given (different from its default) without the switch it needs: a
    UsageError naming both."""
    if switch_on:
        return
    for name in names:
        value = getattr(cfg, name)
        if str(plain_value(value)) != str(flag_default(config_class, name)):
            raise UsageError(f"{flag_name(name)} needs {switch}")


def logged_total(logging_outputs):
    """``total(key)``: the sum of ``key`` over the logging outputs (0 where missing)."""
    return lambda key: sum(log.get(key, 0) for log in logging_outputs)


def log_means(logging_outputs, per: str, digits: dict) -> None:
    """Logs each key of ``digits`` as its sum over the sum of ``per`` (its weight, e.g. ``ntokens``
    or a method's step count), rounded to its digits; nothing where ``per`` sums to 0."""
    total = logged_total(logging_outputs)
    weight = total(per)
    if weight:
        for key, rounded in digits.items():
            metrics.log_scalar(key, total(key) / weight, weight, round=rounded)


class OutputLossCriterion(FairseqCriterion):
    """Fused output projection + loss; see the module docstring. ``name`` is the registered name."""

    # whether the criterion keeps its per-token state per target dictionary (per_vocabulary); one
    # that does not refuses a task with several at start-up
    counts_per_vocabulary = False

    def __init__(self, task, cfg: OutputLossConfig, name: str):
        # the shared flags, checked here once; forward adds only what changes per batch
        request = LossRequest(label_smoothing=cfg.label_smoothing, chunk_size=cfg.output_chunk_tokens,
                              kernel=cfg.output_kernel)
        check_available(request.output_kernel, training_device(cfg))  # e.g. compiled without a compiler
        if cfg.ddp_backend == "fully_sharded":
            # FSDP shards the output matrix, which the fused output layer reads and gates whole
            raise UsageError("--ddp-backend fully_sharded (FSDP) is not supported by this criterion: use "
                             "--ddp-backend c10d, pytorch_ddp, legacy_ddp or no_c10d")
        super().__init__(task)
        self.cfg = cfg
        self.name = name
        self.request = request
        # the target dictionaries: one per target language in multilingual_translation (split),
        # else one (fairseq_facts/target_vocabularies.py); self.dictionary is the first
        self.vocabularies = TargetVocabularies(task)
        if self.vocabularies.split and not self.counts_per_vocabulary:
            raise UsageError(
                f"{name} does not support one target dictionary per language (multilingual_translation, target "
                f"languages {', '.join(self.vocabularies.dictionaries)}): use --criterion cross_entropy_agg, or one "
                "shared output matrix (--share-decoders with a joined dictionary)")
        self.dictionary = self.vocabularies.first
        self.loop = TrainingLoop(task, cfg.train_subset or "train", on_epoch_batches=self.on_epoch_batches,
                                 on_begin_epoch=lambda epoch, model: self.check_model(model))
        self.embedding_stats = EmbeddingStats(cfg, task, self.loop)
        self.state_names = ()  # submodules whose counts travel with the checkpoints
        self.restart_flag = None  # the boolean flag that starts them empty instead of loading them
        self._model_checked = False
        self._state_size_reported = False
        # reads fairseq's batches, answers fairseq (the criterion's forward calls it first and last)
        self.io = OutputLayerIO(self.padding_idx, cfg.sentence_avg, on_first_batch=self.first_batch,
                                log_stats=self.embedding_stats.log)

    @classmethod
    def build_criterion(cls, cfg, task):
        """fairseq's builder: ``cfg`` may also be a partial Namespace (as fairseq's tests build
        criteria), whose missing fields take their defaults (:func:`complete_config`)."""
        return cls(task, complete_config(cfg, getattr(cls, "__dataclass")))

    def refuse_output_kernel(self, *term_types):
        """A foreign ``--output-kernel`` that cannot compute the terms this criterion will add (their
        classes, :class:`fairseq_agg.ops.term.Term`): a UsageError at start-up."""
        kernel = self.request.output_kernel
        if kernel.foreign:
            refusal = foreign_refusal(kernel, term_types, label_smoothing=self.request.label_smoothing > 0)
            if refusal:
                raise UsageError(refusal)

    def set_update_num(self, update_num: int, ignore_grad: bool = False):
        """For use outside fairseq-train: the update_num of the micro-batches that follow."""
        self.loop.set_update_num(update_num, ignore_grad)

    def on_epoch_batches(self, batches_per_epoch: int):
        """The training subset has this many batches per epoch (epoch-sized windows are set here)."""

    def check_model(self, model):
        """Refuses models without a usable output projection (one line naming the flag), each language
        pair's of a multilingual model; fairseq calls it in ``task.begin_epoch``, before it could write
        any checkpoint."""
        for pair, pair_model in language_pair_models(model).items():
            where = f"language pair {pair}: " if pair != SHARED else ""
            try:
                rows = output_projection_weight(pair_model).size(0)
            except UsageError as refusal:
                raise UsageError(f"{where}{refusal}") from None
            dictionary = self.vocabularies.dictionaries[self.vocabularies.name_of(pair_model)]
            if rows != len(dictionary):
                raise UsageError(f"{where}the output projection has {rows} rows but the target dictionary has "
                                 f"{len(dictionary)}")
        weight = output_projection_weight(model)
        self.io.watch(model)  # for compute_loss on a decoder output the task computed
        self._model_checked = True
        return weight

    # --- counts in checkpoints
    def per_vocabulary(self, prefix: str, build):
        """``{state name: build(dictionary)}``, one per target vocabulary: ``prefix`` where the task
        has one (the checkpoint keys of a single-dictionary run), ``prefix_LANG`` per target language
        where it splits them."""
        return {self._state_name(prefix, name): build(dictionary)
                for name, dictionary in self.vocabularies.dictionaries.items()}

    def vocabulary_state(self, prefix: str, model) -> str:
        """The state name, as :meth:`per_vocabulary` gave it, of the vocabulary ``model`` predicts over."""
        return self._state_name(prefix, self.vocabularies.name_of(model))

    @staticmethod
    def _state_name(prefix: str, vocabulary: str) -> str:
        return prefix if vocabulary == SHARED else f"{prefix}_{vocabulary}"

    @staticmethod
    def vocabulary_label(method: str, state_name: str) -> str:
        """``method`` in a log line, with the target language of a ``prefix_LANG`` state name."""
        return f"{method} ({state_name.split('_', 1)[1]})" if "_" in state_name else method

    def fine_tuned_checkpoint(self, loaded) -> Optional[str]:
        """Why the checkpoint loaded is another run's that this one fine-tunes, or None: fairseq loads
        it with a fresh optimizer (--reset-optimizer, the update count restarts at 0), a fresh data
        order (--reset-dataloader), or as --finetune-from-model."""
        if self.cfg.reset_optimizer or self.cfg.reset_dataloader:
            reset = [flag_name(n) for n in ("reset_optimizer", "reset_dataloader") if getattr(self.cfg, n)]
            return " and ".join(reset)
        source = self.cfg.finetune_from_model
        if source and loaded is not None and os.path.realpath(loaded.path) == os.path.realpath(source):
            return "--finetune-from-model"
        return None

    def keep_in_checkpoints(self, restart_flag: str, **counters):
        """Registers counters (modules with ``nbytes``) whose state travels with every checkpoint;
        ``restart_flag`` names the config's boolean flag that starts them empty on load instead."""
        for name, counter in counters.items():
            setattr(self, name, counter)
        self.state_names = tuple(counters)
        self.restart_flag = restart_flag
        anchor_criterion_state(self)
        self.io.anchor = self
        self.report_state_size()

    def report_state_size(self):
        """Says once, in the log, when the counts make every checkpoint large."""
        nbytes = sum(getattr(self, name).nbytes for name in self.state_names)
        if nbytes > LARGE_STATE_BYTES and not self._state_size_reported:
            self._state_size_reported = True
            sizing = [flag_name(c.flag) for c in (getattr(self, n) for n in self.state_names) if hasattr(c, "flag")]
            logger.warning(f"{self.name}: its counts add {nbytes / 2**20:.0f} MiB to every checkpoint "
                           f"(a smaller {' or '.join(sizing) or 'vocabulary'} makes them smaller)")

    def set_epoch_window(self, counter, batches_per_epoch: int, method: str):
        """The auto window (its flag 0): one epoch of updates, once the epoch's length is known."""
        if not counter.is_configured:
            window = updates_per_epoch(batches_per_epoch, self.cfg.update_freq)
            flag = flag_name(counter.flag)
            logger.info(f"{method} counting window: {window} updates (one epoch; set {flag} to change)")
            counter.set_window(window)
            self.report_state_size()

    def load_state_dict(self, state_dict, strict=True, **kwargs):
        """The counts of a checkpoint, checked before anything is loaded (fairseq calls this before
        the first update): damaged counts, or a checkpoint of this criterion without them, are a
        UsageError naming the checkpoint; another criterion's checkpoint starts them empty."""
        if not self.state_names:
            return super().load_state_dict(state_dict, strict=strict, **kwargs)
        loaded = last_loaded_checkpoint()
        source = f"checkpoint {loaded.path}" if loaded else "the checkpoint"
        restart = flag_name(self.restart_flag)
        fine_tuning = self.fine_tuned_checkpoint(loaded)
        holds_counts = holds_criterion_state(state_dict, self.state_names)
        if fine_tuning and holds_counts:  # the pretraining's counts: another run's data and update numbers
            logger.info(f"{self.name}: fine-tuning ({fine_tuning}): the counts start empty ({source}'s are not loaded)")
            return None
        if getattr(self.cfg, self.restart_flag):
            logger.info(f"{restart}: the counts of {self.name} start empty ({source}'s are not loaded)")
            return None
        if not holds_counts:
            # A checkpoint of this criterion always holds its counts; the checkpoint loaded last may
            # be another file than this state's only where the state holds another criterion's entries.
            own = {name for name, _ in self.named_parameters()}
            foreign = set(state_dict or ()) - own
            if loaded is not None and loaded.criterion == self.name and not foreign and not fine_tuning:
                raise UsageError(f"{source} was written by {self.name} but holds none of its counts "
                                 f"({', '.join(n + '.*' for n in self.state_names)}): {restart} starts them empty")
            logger.info(f"the checkpoint has no counts of {self.name} (written by another criterion): they start empty")
            return None
        for name in self.state_names:  # a window's update number is checked against the checkpoint's
            if hasattr(getattr(self, name), "saved_after"):
                getattr(self, name).saved_after = criterion_state_saved_after(state_dict)
        try:
            return super().load_state_dict(state_dict, strict=strict, **kwargs)
        except UsageError as error:
            raise UsageError(f"{source}: the counts of {self.name} fail a check: {error}; {restart} starts them "
                             "empty instead") from None

    # --- one forward: reading the batch and answering fairseq is self.io's (fairseq_facts/output_layer.py)
    def first_batch(self, model):
        """Before the first forward: the model's check (where fairseq's begin_epoch did not run it)
        and which output layer runs, in one log line."""
        if not self._model_checked:
            self.check_model(model)
        weight = output_projection_weight(model)
        logger.info(f"{self.name}: output layer: {describe(self.request.output_kernel, weight.device)}")

    def compute_loss(self, model, net_output, sample, reduce=True):
        """fairseq's ``compute_loss`` (``translation_moe`` asks for it): this criterion's step on a
        decoder output the task computed, from the features its output projection received; returns
        (loss, nll), per target position with ``reduce=False``. Training counts its targets like a
        forward does (a task that calls it k times per batch counts them k times)."""
        with self.io.decoder_output(net_output):
            loss, _, logging_output = self.forward(model, sample, reduce=reduce)
        return loss, logging_output["nll_loss"]

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        total = logged_total(logging_outputs)
        loss_sum, nll_sum = total("loss"), total("nll_loss")
        ntokens, sample_size = total("ntokens"), total("sample_size")
        metrics.log_scalar("loss", loss_sum / sample_size / math.log(2), sample_size, round=3)
        metrics.log_scalar("nll_loss", nll_sum / ntokens / math.log(2), ntokens, round=3)
        metrics.log_derived("ppl", lambda meters: utils.get_perplexity(meters["nll_loss"].avg))
        reduce_embedding_stats(logging_outputs)

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        return True
