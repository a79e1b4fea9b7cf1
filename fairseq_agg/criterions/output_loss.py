"""Shared base of the plugin's output-layer criteria (AGG, the augmented loss, and both together).

The criterion runs the model with ``features_only=True`` and applies the decoder's output
projection itself through :func:`fairseq_agg.ops.fused_linear_loss.fused_linear_loss`, so the
logits are computed once, in chunks of ``--output-chunk-tokens`` target tokens, and never kept as a
tokens x V tensor. LM and MT go through the same code; label smoothing is a parameter (fairseq's
convention). Subclasses add the AGG gates (``compute_gates``) and the augmented loss
(``output_loss``; see :mod:`fairseq_agg.criterions.augmented_loss`).

Logged like fairseq's stock criteria: ``loss`` (the optimised loss, base 2, per ``sample_size``),
``nll_loss`` (plain cross-entropy, base 2, per target token) and ``ppl`` derived from ``nll_loss``.
"""
import logging
import math
from dataclasses import dataclass, field

import torch
from fairseq import metrics, utils
from fairseq.criterions import FairseqCriterion
from omegaconf import II

from fairseq_agg.fairseq_hooks import TrainingObserver, observe_task
from fairseq_agg.ops.fused_linear_loss import fused_linear_loss
from fairseq_agg.stats.config import EmbeddingStatsConfig
from fairseq_agg.stats.live import EmbeddingStatsMixin, reduce_embedding_stats


logger = logging.getLogger(__name__)


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
    sentence_avg: bool = II("optimization.sentence_avg")
    update_freq: list = II("optimization.update_freq")
    train_subset: str = II("dataset.train_subset")
    ddp_backend: str = II("distributed_training.ddp_backend")


def check_range(name, value, ok, allowed):
    """The one start-up error for a flag out of range, naming the flag and the allowed range."""
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


@dataclass
class OutputBatch:
    """The current micro-batch as the output layer sees it: ``target`` (B, T) with padding, the
    flat indices ``keep`` of its non-padding positions (the rows given to the output layer, in
    order) and fairseq's ``sample_size``."""

    target: torch.Tensor
    keep: torch.Tensor
    sample_size: int


class OutputLossCriterion(EmbeddingStatsMixin, TrainingObserver, FairseqCriterion):
    """Fused output projection + loss; see the module docstring.

    The training loop reaches it as a :class:`~fairseq_agg.fairseq_hooks.TrainingObserver`:
    ``self.update_num`` / ``self.ignore_grad`` describe the current micro-batch, and the model is
    checked in ``begin_epoch``, before fairseq can write any checkpoint.
    """

    def __init__(self, task, cfg: OutputLossConfig):
        check_range("label_smoothing", cfg.label_smoothing, 0.0 <= cfg.label_smoothing < 1.0, "in [0, 1)")
        check_range("output_chunk_tokens", cfg.output_chunk_tokens, cfg.output_chunk_tokens >= 1, ">= 1")
        if cfg.ddp_backend == "fully_sharded":
            # FSDP shards the output matrix, which the fused output layer reads and gates whole
            raise ValueError(
                "--ddp-backend fully_sharded (FSDP) is not supported by this criterion: use "
                "--ddp-backend c10d, pytorch_ddp, legacy_ddp or no_c10d"
            )
        super().__init__(task)
        self.cfg = cfg
        self.eps = float(cfg.label_smoothing)
        self.sentence_avg = cfg.sentence_avg
        self.dictionary = task.target_dictionary
        self._model_checked = False
        observe_task(task, self, train_subset=cfg.train_subset or "train")

    def on_begin_epoch(self, epoch, model):
        self.check_model(model)
        self._model_checked = True

    def check_model(self, model):
        """Refuses models without a usable output projection (clear error naming the flag)."""
        weight = output_projection_weight(model)
        if weight.size(0) != len(self.dictionary):
            raise ValueError(
                f"output projection has {weight.size(0)} rows but the target dictionary has {len(self.dictionary)}"
            )
        return weight

    def set_update_num(self, update_num: int, ignore_grad: bool = False):
        """For use outside fairseq-train: the update_num of the micro-batches that follow."""
        self.on_train_step(update_num, ignore_grad)

    # --- hooks for subclasses
    def compute_gates(self, model, target):
        """AGG gates for this micro-batch, or None (no gating)."""
        return None

    def output_layer(self, hidden, weight, target, gates=None, teacher=None, **terms):
        """The fused output layer: ``(loss, nll, aug_kl)`` summed over the tokens; ``terms`` are the
        other per-method inputs of :func:`~fairseq_agg.ops.fused_linear_loss.fused_linear_loss`."""
        return fused_linear_loss(
            hidden, weight, target, self.eps, gates=gates, teacher=teacher, chunk_size=self.cfg.output_chunk_tokens,
            **terms,
        )

    def output_loss(self, model, hidden, weight, target, gates):
        """The summed training loss and NLL of the tokens, and the logging entries of extra terms."""
        loss, nll, _ = self.output_layer(hidden, weight, target, gates)
        return loss, nll, {}

    def adjust_loss(self, loss):
        return loss

    def extra_logging(self):
        return {}

    # --- forward
    def forward(self, model, sample, reduce=True):
        if not reduce:
            raise ValueError("this criterion only supports reduce=True")
        if not self._model_checked:
            self.check_model(model)
            self._model_checked = True
        weight = output_projection_weight(model)
        net_output = model(**sample["net_input"], features_only=True)
        features = net_output[0]
        target = model.get_targets(sample, net_output).reshape(-1)
        features = features.reshape(-1, features.size(-1))
        keep = target.ne(self.padding_idx).nonzero().squeeze(1)  # padding masked everywhere
        ntokens = sample["ntokens"]
        sample_size = sample["target"].size(0) if self.sentence_avg else ntokens
        # where the kept rows sit in the batch (UL's candidates), and the divisor fairseq will apply
        self.batch = OutputBatch(target=target.view(sample["target"].shape), keep=keep, sample_size=sample_size)
        hidden = features.index_select(0, keep)
        target = target.index_select(0, keep)

        gates = self.compute_gates(model, target)
        loss, nll, extra = self.output_loss(model, hidden, weight, target, gates)
        loss = self.adjust_loss(loss)

        logging_output = {
            "loss": loss.data,
            "nll_loss": nll.data,
            "ntokens": ntokens,
            "nsentences": sample["target"].size(0),
            "sample_size": sample_size,
        }
        logging_output.update(extra)
        logging_output.update(self.extra_logging())
        self.log_embedding_stats(model, logging_output)
        return loss, sample_size, logging_output

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        def total(key):
            return sum(log.get(key, 0) for log in logging_outputs)

        loss_sum, nll_sum = total("loss"), total("nll_loss")
        ntokens, sample_size = total("ntokens"), total("sample_size")
        metrics.log_scalar("loss", loss_sum / sample_size / math.log(2), sample_size, round=3)
        metrics.log_scalar("nll_loss", nll_sum / ntokens / math.log(2), ntokens, round=3)
        metrics.log_derived("ppl", lambda meters: utils.get_perplexity(meters["nll_loss"].avg))
        cls.reduce_extra_metrics(logging_outputs, total)
        reduce_embedding_stats(logging_outputs)

    @classmethod
    def reduce_extra_metrics(cls, logging_outputs, total):
        """Subclasses log their own keys here (call ``super()`` first)."""

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        return True
