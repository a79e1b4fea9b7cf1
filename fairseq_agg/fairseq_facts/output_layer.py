"""What a fairseq model and sample give an output-layer criterion, and what fairseq takes back.

The plugin's criteria compute their loss from three tensors (:class:`OutputBatch`): the decoder's
features at the non-padding target positions (the model run with ``features_only=True``), the
output projection's weight, and those targets. fairseq hands a criterion only ``(model, sample)``:
:func:`output_projection_weight` finds the weight on a fairseq decoder, refusing set-ups without a
plain one, on the device :func:`training_device` names; :class:`OutputLayerIO` reads the rest and
builds fairseq's ``(loss, sample_size, logging_output)``: ``sample_size`` is sentences with
``--sentence-avg``, else target tokens; with ``reduce=False`` the loss goes back per target
position, as fairseq's ``cross_entropy`` returns it (a (B x T,) tensor in the order of
``sample["target"].view(-1)``, 0 at padding).
"""
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from fairseq_agg.errors import UsageError

from .checkpoint_state import anchored


def training_device(cfg) -> torch.device:
    """The device fairseq trains on: a GPU when there is one, unless ``--cpu``."""
    return torch.device("cuda" if torch.cuda.is_available() and not cfg.cpu else "cpu")


def output_projection_weight(model):
    """The V x d output matrix of a fairseq decoder, refusing setups without one."""
    decoder = getattr(model, "decoder", None)
    if decoder is None:
        raise UsageError("this criterion needs an encoder-decoder or decoder-only fairseq model with a decoder")
    if getattr(decoder, "adaptive_softmax", None) is not None:
        raise UsageError(
            "--adaptive-softmax-cutoff is not supported by this criterion: it needs the full output "
            "projection matrix (train without adaptive softmax)"
        )
    embed = getattr(decoder, "embed_tokens", None)
    if embed is not None and embed.__class__.__name__ == "AdaptiveInput":
        raise UsageError("--adaptive-input is not supported by this criterion (train with a plain embedding)")
    projection = getattr(decoder, "output_projection", None)
    if not isinstance(projection, torch.nn.Linear):
        raise UsageError(
            "the model has no linear output projection (decoder.output_projection); this criterion "
            "needs one (tied via --share-decoder-input-output-embed / --share-all-embeddings, or untied)"
        )
    if projection.bias is not None:
        raise UsageError("output projections with a bias are not supported by this criterion")
    return projection.weight


@dataclass
class OutputBatch:
    """A micro-batch as the output layer sees it: the ``hidden`` features and ``target`` ids of its
    non-padding positions (rows ``keep`` of the flattened (B, T) ``padded_target``, in order), the
    output projection ``weight``, and fairseq's sizes."""

    hidden: torch.Tensor
    weight: torch.Tensor
    target: torch.Tensor
    keep: torch.Tensor
    padded_target: torch.Tensor
    sample_size: int
    ntokens: int
    nsentences: int


class OutputLayerIO:
    """One criterion's exchange with fairseq around the fused output layer.

    ``padding_idx`` is the target dictionary's pad, ``sentence_avg`` fairseq's ``--sentence-avg``;
    ``on_first_batch(model)`` runs once, before the first batch (the criterion's own check of the
    model and its log line); ``log_stats(model, logging_output)`` after every batch (the live
    embedding statistics). ``anchor``: the criterion whose counts travel with the checkpoints
    (:func:`~fairseq_agg.fairseq_facts.checkpoint_state.anchored`), or None.
    """

    def __init__(self, padding_idx: int, sentence_avg: bool, on_first_batch: Optional[Callable], log_stats: Callable):
        self.padding_idx, self.sentence_avg = padding_idx, sentence_avg
        self.on_first_batch, self.log_stats = on_first_batch, log_stats
        self.anchor = None

    def batch(self, model, sample) -> OutputBatch:
        """The model's features (``features_only=True``) at the non-padding targets: padding is
        masked everywhere, before the output layer."""
        if self.on_first_batch is not None:
            self.on_first_batch(model)
            self.on_first_batch = None  # once it has passed: a refusal refuses again
        weight = output_projection_weight(model)
        net_output = model(**sample["net_input"], features_only=True)
        features = net_output[0]
        padded_target = model.get_targets(sample, net_output)
        target = padded_target.reshape(-1)
        keep = target.ne(self.padding_idx).nonzero().squeeze(1)
        ntokens, nsentences = sample["ntokens"], sample["target"].size(0)
        return OutputBatch(
            hidden=features.reshape(-1, features.size(-1)).index_select(0, keep), weight=weight,
            target=target.index_select(0, keep), keep=keep, padded_target=padded_target,
            sample_size=nsentences if self.sentence_avg else ntokens, ntokens=ntokens, nsentences=nsentences,
        )

    def finish(self, model, batch: OutputBatch, loss, nll, extra: dict):
        """fairseq's ``(loss, sample_size, logging_output)`` with the values of ``extra`` logged too;
        per-token losses (``reduce=False``) are put back at their (B x T) positions."""
        if loss.dim() == 1:
            loss, nll = per_position(batch, loss), per_position(batch, nll)
        if self.anchor is not None:
            loss = anchored(loss, self.anchor)
        logging_output = {
            "loss": loss.data, "nll_loss": nll.data, "ntokens": batch.ntokens, "nsentences": batch.nsentences,
            "sample_size": batch.sample_size,
        }
        logging_output.update(extra)
        self.log_stats(model, logging_output)
        return loss, batch.sample_size, logging_output


def per_position(batch: OutputBatch, values):
    """Per-token ``values`` (N,) at their places in the flattened (B x T) target, 0 at padding."""
    positions = torch.zeros(batch.padded_target.numel(), dtype=values.dtype, device=values.device)
    return positions.index_copy(0, batch.keep, values)
