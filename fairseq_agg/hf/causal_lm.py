"""The remedies for a Hugging Face causal LM in one call: :func:`apply` (docs/hf.md, "The one call").

``apply(model, method="agg", **options)`` gives one model instance a forward that, with ``labels``,
runs its base model for the last hidden state and the method's loss through the fused output
layer of :mod:`fairseq_agg.ops` on the shifted, non-ignored positions, so no tokens x V logits
are formed; without labels it runs the model's own forward unchanged (logits, ``generate``). The
loss is transformers' ``ForCausalLMLoss`` convention: labels shifted left by one (or
``shift_labels``), ``ignore_index`` -100, the sum divided by ``num_items_in_batch`` when given
(gradient accumulation under ``Trainer``), else the mean over the non-ignored labels.

:class:`CausalLMMethod` (``model.fairseq_agg``) holds the method objects and the state a training
loop or callback drives: ``update_num`` (the optimizer updates completed before the micro-batch;
counting and gating happen only in training with it set), the windows (``set_window``,
``state_dict``), and the logged values (``logs``).
"""
import dataclasses
import functools
import inspect
import types
from typing import Optional

import torch
import torch.nn.functional as F

from fairseq_agg.errors import UsageError
from fairseq_agg.ops import (
    AggLoss, AugmentedLoss, CosRegLoss, FaceLoss, FaceWeights, LossRequest, RareFreezing, TeacherTargets,
    UnlikelihoodCandidates, UnlikelihoodLoss, fused_linear_loss, gate_statistics,
)
from fairseq_agg.ops.agg_threshold import resolve_threshold
from fairseq_agg.ops.output_kernel import check_available, foreign_refusal

from .model_check import base_model, check_model, probe_output_class
from .options import option_names_in, resolve_options

IGNORE_INDEX = -100  # transformers' ignore index, also the padding id of unlikelihood's (B, T) targets
LOSS_KWARGS = ("num_items_in_batch", "shift_labels", "ignore_index")  # ForCausalLMLoss's, not the base model's


def config_ids(config, *names) -> list:
    """The token ids the config names under ``names`` (an id or a list of ids each), without repeats."""
    ids = []
    for name in names:
        value = getattr(config, name, None)
        for token in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(token, int) and token >= 0 and token not in ids:
                ids.append(token)
    return ids


def padding_ids(config) -> list:
    """The config's padding id, unless it is also its bos or eos (GPT-2 recipes pad with eos, a real target)."""
    real = config_ids(config, "bos_token_id", "eos_token_id")
    return [token for token in config_ids(config, "pad_token_id") if token not in real]


class CausalLMMethod:
    """One method on one model (``model.fairseq_agg``); see the module docstring and docs/hf.md.

    ``name``: the method; ``options``: the resolved options; ``vocab_size``: rows of the head;
    ``update_num``: set by the loop (or ``MethodStateCallback``) before each optimizer update.
    """

    def __init__(self, model, method: str = "agg", **options):
        self.name = method
        self.options = resolve_options(method, options)
        self.model = model
        self.vocab_size = self.output_weight().size(0)
        self.update_num: Optional[int] = None
        self.output_class = None  # the model's output class, from the probe at apply
        self._logged = {}
        try:
            self._build(model.config, self.options)
        except UsageError as error:
            raise UsageError(option_names_in(str(error), self.options)) from None

    def _build(self, config, o):
        vocab = self.vocab_size
        self.request = LossRequest(label_smoothing=o["label_smoothing"], chunk_size=o["output_chunk_tokens"],
                                   kernel=o["output_kernel"])
        check_available(self.request.output_kernel, self.output_weight().device)
        self.agg = self.freezing = self.augmented = self.face = self.unlikelihood = self.cosreg = None
        term_types, argmax = [], False
        if self.name == "agg":
            mode, ref_tokens = resolve_threshold(o["agg_threshold_mode"], o["agg_ref_tokens"], False)
            # no never-rare ids: a Hugging Face vocabulary has no fairseq specials at ids 0-3 (docs/api.md)
            self.agg = AggLoss(vocab, alpha=o["agg_alpha"], window=o["agg_window"] or None, nspecial=0,
                               g1_mode=o["agg_g1_mode"], threshold_mode=mode,
                               ref_tokens=ref_tokens if mode == "relative" else (o["agg_ref_tokens"] or None),
                               all_reduce=not o["agg_local_counts"])
            if o["agg_freeze_rare"]:
                self.freezing = RareFreezing(vocab, until_update=o["agg_freeze_until_update"])
        if self.name in ("agg", "augmented_loss"):
            augmented = AugmentedLoss(
                alpha=o["aug_alpha"], temperature=o["aug_temperature"], scale=o["aug_scale"],
                warmup_updates=o["aug_warmup_updates"], detach_teacher=not o["no_aug_detach_target"],
                gate_with_agg=o.get("aug_gate_with_agg", False),
                masked_columns=None if o["no_aug_mask_special"] else padding_ids(config))
            # cross_entropy_agg leaves it out at alpha 0; augmented_loss keeps it (plain CE exactly)
            self.augmented = augmented if self.name == "augmented_loss" or augmented.alpha > 0 else None
            if self.augmented is not None:
                self.teacher_matrix()  # refuses a model without one
                term_types += [TeacherTargets] if augmented.fused_teacher else []
        if self.name == "face":
            eos = config_ids(config, "eos_token_id")
            self.face = FaceLoss(vocab, weighing=o["face_weighing"], frequency=o["face_frequency"],
                                 counting=o["face_counting"], window=o["face_window"] or None,
                                 uncounted_id=eos[0] if len(eos) == 1 and not o["face_count_eos"] else None)
            term_types, argmax = [FaceWeights], self.face.frequency == "out"
        if self.name == "unlikelihood":
            self.unlikelihood = UnlikelihoodLoss(alpha=o["ul_alpha"], clamp=o["ul_clamp"], pad=IGNORE_INDEX)
            term_types = [UnlikelihoodCandidates]
        if self.name == "cosreg":
            special = {"all": [], "no-pad-madeup": padding_ids(config),
                       "no-special": config_ids(config, "pad_token_id", "bos_token_id", "eos_token_id", "unk_token_id")}
            kept = torch.ones(vocab, dtype=torch.bool)
            kept[[token for token in special[o["cosreg_rows"]] if token < vocab]] = False
            rows = None if kept.all() else kept.nonzero().squeeze(1)
            self.cosreg = CosRegLoss(gamma=o["cosreg_gamma"], normalizer=o["cosreg_normalizer"], rows=rows)
            self.regularised_matrices()  # refuses a model without one
        if self.request.output_kernel.foreign:
            refusal = foreign_refusal(self.request.output_kernel, term_types,
                                      label_smoothing=self.request.label_smoothing > 0, argmax=argmax)
            if refusal:
                raise UsageError(refusal)

    # --- the model's matrices
    def output_weight(self) -> torch.Tensor:
        """The head's (V, d) weight (the input embedding's, when tied)."""
        return self.model.get_output_embeddings().weight

    def _input_weight(self, option: str) -> torch.Tensor:
        embedding = self.model.get_input_embeddings() if hasattr(self.model, "get_input_embeddings") else None
        weight = getattr(embedding, "weight", None)
        if weight is None or weight.dim() != 2 or weight.size(0) != self.vocab_size:
            raise UsageError(f"{option} needs an input embedding with one row per output row "
                             f"({self.vocab_size}); {type(self.model).__name__} has none")
        return weight

    def teacher_matrix(self) -> torch.Tensor:
        """The augmented loss's teacher: the (unscaled) input embedding, or the head; the same
        matrix when tied (REAL)."""
        if self.options["aug_embed"] == "output":
            return self.output_weight()
        return self._input_weight("aug_embed='input'")

    def regularised_matrices(self) -> list:
        """CosReg's matrices (``cosreg_matrix``; a tied one counts once in the regulariser)."""
        which = self.options["cosreg_matrix"]
        matrices = [self.output_weight()] if which in ("output", "both") else []
        return matrices + ([self._input_weight(f"cosreg_matrix={which!r}")] if which in ("input", "both") else [])

    # --- windows and their state
    def _counting_methods(self) -> dict:
        """{name: method} of the methods that count targets (AGG, FACE), present in this run."""
        return {name: method for name, method in (("agg", self.agg), ("face", self.face)) if method is not None}

    def _counters(self) -> dict:
        """The counting methods that keep a window of per-update counts."""
        return {name: method for name, method in self._counting_methods().items() if hasattr(method.counter, "window")}

    def set_window(self, updates: int) -> None:
        """Sizes the windows left at 0 (auto: one epoch of updates, the paper's); a window the options
        sized, or one already set, stays."""
        for method in self._counters().values():
            if not method.counter.is_configured:
                try:
                    method.set_window(updates)
                except UsageError as error:
                    raise UsageError(option_names_in(str(error), self.options)) from None

    @property
    def keeps_window(self) -> bool:
        """Whether the method keeps a window of per-update counts (AGG; FACE with a window), whose
        update index a checkpoint's state must carry."""
        return bool(self._counters())

    @property
    def counts(self) -> bool:
        """Whether training counts targets (AGG, FACE), and so needs ``update_num``."""
        return self.agg is not None or self.face is not None

    @property
    def window_is_set(self) -> bool:
        return all(method.counter.is_configured for method in self._counters().values())

    def _counted_updates(self) -> int:
        indices = [method.counter.update_index for method in self._counters().values()]
        return indices[0] if indices else 0

    def state_dict(self) -> dict:
        """Every count the method holds (AGG's window, FACE's counts), tagged with the method, the
        vocabulary size and the updates counted."""
        counted = self._counting_methods()
        return {"method": self.name, "vocab_size": self.vocab_size, "updates": self._counted_updates(),
                "counts": {name: method.state_dict() for name, method in counted.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Loads :meth:`state_dict`'s counts after checking them (a UsageError in one line: another
        method, another vocabulary, counts that do not match their update index)."""
        keys = ("method", "vocab_size", "updates", "counts")
        if not isinstance(state, dict) or any(key not in state for key in keys):
            raise UsageError(f"not a fairseq_agg.hf method state (a dict with {', '.join(keys)})")
        if state["method"] != self.name:
            raise UsageError(f"the state is of method {state['method']!r}, this model runs {self.name!r}")
        if state["vocab_size"] != self.vocab_size:
            raise UsageError(f"the state counts a vocabulary of {state['vocab_size']} tokens, the model has "
                             f"{self.vocab_size}")
        counted = self._counting_methods()
        if set(state["counts"]) != set(counted):
            raise UsageError(f"the state holds counts of {sorted(state['counts'])}, the method keeps {sorted(counted)}")
        for name, method in counted.items():
            windowed = hasattr(method.counter, "saved_after")  # a window's update index is checked against the tag
            if windowed:
                method.counter.saved_after = state["updates"]
            try:
                method.load_state_dict(state["counts"][name])
            except UsageError as error:
                raise UsageError(f"the {name} counts of the state fail a check: {error}") from None
            finally:
                if windowed:
                    method.counter.saved_after = None

    # --- logging
    def _log(self, **values) -> None:
        for key, value in values.items():
            value = value.detach() if torch.is_tensor(value) else value
            self._logged[key] = self._logged.get(key, 0) + value

    def logs(self) -> dict:
        """The logged values summed since the last call (``ntokens``, ``nll`` and the method's, e.g.
        ``agg_steps``, ``agg_rare``, ``agg_g1``: divide a sum by its count to average it)."""
        logged, self._logged = self._logged, {}
        return {key: float(value) for key, value in logged.items()}

    # --- the loss
    def loss(self, hidden: torch.Tensor, labels: Optional[torch.Tensor], *, num_items_in_batch=None,
             shift_labels: Optional[torch.Tensor] = None, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
        """The method's loss from the (B, T, d) last hidden state, as ``ForCausalLMLoss`` reduces it."""
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        padded = shift_labels.to(hidden.device)
        if padded.shape != hidden.shape[:-1]:
            raise UsageError(f"labels of shape {tuple(padded.shape)} do not match the inputs' "
                             f"{tuple(hidden.shape[:-1])}")
        flat = padded.reshape(-1)
        keep = flat.ne(ignore_index).nonzero().squeeze(1)
        rows = hidden.reshape(-1, hidden.size(-1)).index_select(0, keep)
        target = flat.index_select(0, keep)
        if self.model.training and self.update_num is None and self.counts:
            # training without the update number would silently be plain cross-entropy
            raise UsageError(f"{self.name} counts targets per optimizer update, but model.fairseq_agg.update_num "
                             "is None while training: under Trainer use fairseq_agg.hf.add_method_state_callback"
                             "(trainer); in your own loop set it to the updates done before each update")
        counting = self.update_num if self.model.training else None
        try:
            result, logged = self._method_loss(rows, target, padded, keep, ignore_index, counting)
        except UsageError as error:  # e.g. counting with an auto window that was never set
            raise UsageError(option_names_in(str(error), self.options)) from None
        divisor = keep.numel() if num_items_in_batch is None else num_items_in_batch
        loss = result.loss / (divisor.to(result.loss.device) if torch.is_tensor(divisor) else divisor)
        if self.cosreg is not None:
            regulariser = self.cosreg.regularizer(*self.regularised_matrices())
            if self.cosreg.gamma > 0:  # once per update: each micro-batch its share of the update's tokens
                share = 1.0 if num_items_in_batch is None else keep.numel() / divisor
                loss = loss + (self.cosreg.gamma * share) * regulariser
            logged.update(cosreg=regulariser, cosreg_steps=1)
        self._log(ntokens=keep.numel(), nll=result.nll, **logged)
        return loss

    def _method_loss(self, rows, target, padded, keep, ignore_index, counting):
        """(LossResult, logged values) of the method on the pad-free rows; ``counting`` is the update
        number in training, None in evaluation (nothing counted or gated)."""
        weight, request, logged = self.output_weight(), self.request, {}
        if self.agg is not None:
            terms = ()
            if counting is not None:
                gates = self.agg.step(target, counting)
                if self.freezing is not None:  # freezing replaces the gates: plain CE on every other row
                    terms = self.freezing.terms(counting, gates, target.device)
                    logged = {"agg_freeze_steps": 1, "agg_frozen": terms[0].mask.sum()} if terms else {}
                else:
                    terms = (gates,)
                    logged = {"agg_steps": 1, **gate_statistics(gates)}
            request = request.with_terms(*terms)
        if self.augmented is not None:
            result = self.augmented(rows, weight, self.teacher_matrix(), target, self.update_num, request)
            alpha = self.augmented.alpha_at(self.update_num)
            if alpha > 0:
                logged.update(aug_loss=result.terms[TeacherTargets.name]["kl"], aug_alpha=alpha, aug_steps=1)
            return result, logged
        if self.face is not None:
            result = self.face(rows, weight, target, counting, request)
            return result, {"face_weight": result.terms[FaceWeights.name]["weight"]}
        if self.unlikelihood is not None:
            if ignore_index != IGNORE_INDEX:
                padded = padded.masked_fill(padded.eq(ignore_index), IGNORE_INDEX)
            result = self.unlikelihood(rows, weight, padded, keep, request)
            values = result.terms[UnlikelihoodCandidates.name]
            return result, {"ul_loss": values["penalty"], "ul_candidates": values["candidates"]}
        return fused_linear_loss(rows, weight, target, request), logged

    # --- the forward with labels
    def forward_with_labels(self, labels, arguments: dict):
        """The base model on ``arguments`` (the forward's own, less the loss's), then :meth:`loss`;
        the model's output class with ``loss`` set and no logits."""
        loss_kwargs = {name: arguments.pop(name) for name in LOSS_KWARGS if name in arguments}
        logits_to_keep = arguments.pop("logits_to_keep", 0)
        if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
            raise UsageError("logits_to_keep selects logits, which the fused loss does not form: leave it 0 with labels")
        return_dict = arguments.pop("return_dict", None)
        if return_dict is None:
            return_dict = getattr(self.model.config, "return_dict", True)
        outputs = base_model(self.model)(**arguments, return_dict=True)
        loss = self.loss(outputs.last_hidden_state, labels, **loss_kwargs)
        fields = {field.name: getattr(outputs, field.name) for field in dataclasses.fields(self.output_class)
                  if field.name not in ("loss", "logits") and hasattr(outputs, field.name)}
        output = self.output_class(loss=loss, logits=None, **fields)
        return output if return_dict else output.to_tuple()


@functools.lru_cache(maxsize=None)
def _signature(forward) -> inspect.Signature:
    return inspect.signature(forward)


def named_arguments(forward, model, args, kwargs) -> dict:
    """The arguments of a call of the class's ``forward``, by name (its ``**kwargs`` merged in)."""
    signature = _signature(forward)
    bound = dict(signature.bind(model, *args, **kwargs).arguments)
    for name, parameter in signature.parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            bound.update(bound.pop(name, {}))
        elif parameter.kind is inspect.Parameter.VAR_POSITIONAL and bound.get(name):
            raise TypeError(f"{type(model).__name__}.forward: unexpected positional arguments {bound[name]!r}")
    bound.pop(next(iter(signature.parameters)))  # self
    return bound


def _forward_with_method(self, *args, **kwargs):
    """The forward :func:`apply` gives the instance: the class's own without labels, the fused loss with them."""
    forward = type(self).forward
    arguments = named_arguments(forward, self, args, kwargs)
    labels = arguments.pop("labels", None)
    if labels is None:
        return forward(self, *args, **kwargs)
    return self.fairseq_agg.forward_with_labels(labels, arguments)


@functools.lru_cache(maxsize=None)
def fused_forward(model_class):
    """The forward :func:`apply` binds to an instance of ``model_class``: :func:`_forward_with_method`
    under the class forward's name and signature, which ``Trainer`` reads to keep the dataset's
    columns (``remove_unused_columns``)."""

    @functools.wraps(model_class.forward)
    def forward(self, *args, **kwargs):
        return _forward_with_method(self, *args, **kwargs)

    return forward


def apply(model, method: str = "agg", **options):
    """Gives ``model`` (this instance only) the fused forward of ``method`` and returns it;
    ``model.fairseq_agg`` is its :class:`CausalLMMethod`. Methods: ``ce``, ``agg`` (with
    ``agg_freeze_rare=True``: rare-token freezing; with ``aug_alpha > 0``: plus the augmented loss),
    ``augmented_loss``, ``face``, ``unlikelihood``, ``cosreg``; options: docs/hf.md. A model or an
    option it cannot take is a :class:`~fairseq_agg.errors.UsageError` in one line."""
    check_model(model)
    agent = CausalLMMethod(model, method, **options)
    agent.output_class = probe_output_class(model)
    model.fairseq_agg = agent
    # bound to the instance, not a closure over it: a deep copy of the model runs its own copy
    model.forward = types.MethodType(fused_forward(type(model)), model)
    return model
