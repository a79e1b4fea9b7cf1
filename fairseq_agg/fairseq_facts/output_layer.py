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

The features come from the model run with ``features_only=True`` where it takes that argument
(fairseq's Transformer; :func:`takes_features_only`). A model without it that applies a linear
``output_projection`` last (lightconv, dynamicconv, ``lightconv_lm``, the language-pair models of
``multilingual_translation``) is run whole, with the projection's input captured and its matmul
skipped (:class:`ProjectionInput`); the decoder must return the projection's output unchanged,
else the batch is refused. A decoder output computed
elsewhere (a task that calls the criterion's ``compute_loss``, as ``translation_moe`` does) is
matched to the features of the projection call that produced it (:meth:`ProjectionInput.watch`).
"""
import contextlib
import inspect
import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from fairseq_agg.errors import UsageError

from .checkpoint_state import anchored


# What to train instead of adaptive softmax / adaptive input. fairseq's WikiText-103 arch sets both
# by default and no flag unsets them (an unset cutoff takes the arch's default), so the same sizes
# and regularisation with a plain output layer is transformer_lm_big with the arch's other settings.
PLAIN_OUTPUT_LAYER_INSTEAD = (
    "train with a plain output layer instead: leave out --adaptive-softmax-cutoff and --adaptive-input (for --arch "
    "transformer_lm_wiki103, which sets both, train its sizes as --arch transformer_lm_big --decoder-layers 16 "
    "--decoder-attention-heads 8 --no-decoder-final-norm --dropout 0.3 --attention-dropout 0.1 --activation-dropout "
    "0.1 --share-decoder-input-output-embed)"
)


def training_device(cfg) -> torch.device:
    """The device fairseq trains on: a GPU when there is one, unless ``--cpu``."""
    return torch.device("cuda" if torch.cuda.is_available() and not cfg.cpu else "cpu")


def output_projection_weight(model):
    """The V x d output matrix of a fairseq decoder, refusing setups without one."""
    decoder = getattr(model, "decoder", None)
    if decoder is None:
        raise UsageError("this criterion needs an encoder-decoder or decoder-only fairseq model with a decoder")
    if getattr(decoder, "adaptive_softmax", None) is not None:
        raise UsageError("--adaptive-softmax-cutoff is not supported by this criterion: it needs the full output "
                         f"projection matrix; {PLAIN_OUTPUT_LAYER_INSTEAD}")
    embed = getattr(decoder, "embed_tokens", None)
    if embed is not None and embed.__class__.__name__ == "AdaptiveInput":
        raise UsageError(f"--adaptive-input is not supported by this criterion; {PLAIN_OUTPUT_LAYER_INSTEAD}")
    projection = getattr(decoder, "output_projection", None)
    if not isinstance(projection, torch.nn.Linear):
        raise UsageError(
            f"the model {type(model).__name__} has no linear output projection (decoder.output_projection); this "
            "criterion needs one (tied via --share-decoder-input-output-embed / --share-all-embeddings, or untied)"
        )
    if projection.bias is not None:
        raise UsageError("output projections with a bias are not supported by this criterion")
    return projection.weight


def takes_features_only(model) -> bool:
    """Whether the model returns its decoder's features when run with ``features_only=True``: its
    ``forward`` names the argument, or (a decoder-only model) its decoder's does. An
    encoder-decoder model that passes only ``**kwargs`` on (fairseq's ``FairseqEncoderDecoderModel``,
    the per-language-pair models of ``multilingual_translation``) hands them to its encoder too."""
    if "features_only" in inspect.signature(model.forward).parameters:
        return True
    if getattr(model, "encoder", None) is not None:
        return False
    return "features_only" in inspect.signature(model.decoder.forward).parameters


class ProjectionInput:
    """The input of a decoder's linear output projection: the decoder's features.

    :meth:`skipping` runs a decoder with the projection's matmul replaced by a placeholder of the
    logits' shape (a stride-0 view, no memory) and gives back what went in; :meth:`watch` keeps a
    forward hook on the projection that remembers, for the latest call, its output and input, so
    that :meth:`features_of` finds the features behind a decoder output computed elsewhere.
    """

    def __init__(self):
        self._watched = None  # the projection the hook is on
        self._latest = None  # (weak reference to the latest output, its input)

    def watch(self, projection: torch.nn.Module):
        if self._watched is not projection:
            projection.register_forward_hook(self._remember)
            self._watched = projection

    def _remember(self, module, inputs, output):
        self._latest = (weakref.ref(output), inputs[0])

    def features_of(self, model, logits: torch.Tensor) -> torch.Tensor:
        """The features the output projection turned into ``logits``."""
        latest, self._latest = self._latest, None
        if latest is None or latest[0]() is not logits:
            raise UsageError(f"compute_loss: the decoder output of {type(model).__name__} handed to this criterion is "
                             "not the output of its output projection (decoder.output_projection) as last run")
        return latest[1]

    @contextlib.contextmanager
    def skipping(self, model, projection: torch.nn.Linear):
        """Within: a call of ``projection`` keeps its input and returns a placeholder of the logits'
        shape; ``check(net_output)`` gives that input, refusing a decoder that did not call the
        projection once and return its placeholder unchanged."""
        captured = []  # (features, the placeholder returned for them)

        def placeholder(features):
            logits = features.new_zeros(()).expand(*features.shape[:-1], projection.out_features)
            captured.append((features, logits))
            return logits

        def check(net_output):
            returned = net_output[0] if isinstance(net_output, (tuple, list)) else net_output
            if len(captured) != 1 or returned is not captured[0][1]:
                raise UsageError(f"the model {type(model).__name__} neither takes features_only=True nor returns its "
                                 "linear output projection's output unchanged: this criterion cannot find its features")
            return captured[0][0]

        projection.forward = placeholder  # an instance attribute: nn.Module.__call__ reads self.forward
        try:
            yield check
        finally:
            del projection.forward
            self._latest = None  # what the watch remembered of this call is no decoder output to match


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
        self.projection_input = ProjectionInput()
        self._given_output = None  # a decoder output computed by the task (compute_loss)

    def watch(self, model):
        """From the model's check at start-up on: decoder outputs computed elsewhere can be read
        (:meth:`decoder_output`)."""
        self.projection_input.watch(model.decoder.output_projection)

    @contextlib.contextmanager
    def decoder_output(self, net_output):
        """Within: :meth:`batch` reads the features behind ``net_output`` instead of running the model."""
        self._given_output = net_output
        try:
            yield
        finally:
            self._given_output = None

    def features(self, model, sample):
        """(features B x T x d, the decoder's output) of ``sample``; see the module docstring."""
        if self._given_output is not None:
            net_output = self._given_output
            return self.projection_input.features_of(model, net_output[0]), net_output
        if takes_features_only(model):
            net_output = model(**sample["net_input"], features_only=True)
            return net_output[0], net_output
        with self.projection_input.skipping(model, model.decoder.output_projection) as check:
            net_output = model(**sample["net_input"])
        return check(net_output), net_output

    def batch(self, model, sample) -> OutputBatch:
        """The model's features at the non-padding targets: padding is masked everywhere, before
        the output layer."""
        if self.on_first_batch is not None:
            self.on_first_batch(model)
            self.on_first_batch = None  # once it has passed: a refusal refuses again
        weight = output_projection_weight(model)
        features, net_output = self.features(model, sample)
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
