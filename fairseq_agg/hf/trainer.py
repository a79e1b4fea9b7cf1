"""The method's counting window under Hugging Face ``Trainer`` (docs/hf.md, "Under Trainer").

:class:`MethodStateCallback` drives the :class:`~fairseq_agg.hf.causal_lm.CausalLMMethod` that
:func:`~fairseq_agg.hf.apply` put on the model (``model.fairseq_agg``):

* at the start of every optimizer update it sets ``update_num`` to ``state.global_step``, so the
  window advances once per update whatever ``gradient_accumulation_steps`` is (``on_step_begin``
  fires before the first micro-batch of each update);
* at train begin it sizes a window left at 0 to one epoch of updates, from the Trainer's own
  figures (batches per epoch of its train dataloader, per process, and the accumulation steps);
* at every checkpoint it writes the method's ``state_dict()`` to :data:`STATE_FILE` beside
  ``optimizer.pt`` (the main process, atomically; every rank holds the same all-reduced counts),
  never into the model's weights;
* on ``trainer.train(resume_from_checkpoint=...)`` it loads that file back before the first update,
  refusing in one line a state of another method or vocabulary, or one whose update index is not
  the checkpoint's step.

A callback is not told which checkpoint the Trainer resumes from, so :func:`add_method_state_callback`
adds the callback and gives this one trainer instance a ``train`` that passes the checkpoint on
(``trainer.train`` is the public entry every script calls; the class is left unchanged). A resumed
run whose callback does not know its checkpoint is refused at train begin instead of counting from
an empty window.
"""
import logging
import math
import os

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint, has_length

from ..errors import UsageError
from ..files import atomic_output

logger = logging.getLogger(__name__)

STATE_FILE = "fairseq_agg_method_state.pt"  # in each checkpoint-<step>/ directory, beside optimizer.pt


def method_of(model):
    """The :class:`CausalLMMethod` of ``model`` (through DDP-style wrappers); a model without one is refused."""
    while not hasattr(model, "fairseq_agg") and hasattr(model, "module"):
        model = model.module
    method = getattr(model, "fairseq_agg", None)
    if method is None:
        raise UsageError(f"MethodStateCallback: the model ({type(model).__name__}) has no method: call "
                         "fairseq_agg.hf.apply(model, ...) before training")
    return method



def updates_per_epoch(train_dataloader, gradient_accumulation_steps: int, option: str = "agg_window") -> int:
    """The optimizer updates of one epoch, as the Trainer counts them: its dataloader's batches
    (per process) in groups of ``gradient_accumulation_steps``, the last group possibly shorter.
    ``option``: the window's option, named in the refusal of a dataset without a length."""
    if train_dataloader is None or not has_length(train_dataloader):
        raise UsageError(f"{option}=0 (one epoch of updates) needs a train dataset with a length (an iterable "
                         f"dataset has no epoch): pass {option}=N (N >= 1) to apply")
    return max(math.ceil(len(train_dataloader) / gradient_accumulation_steps), 1)


def uses_fsdp(args) -> bool:
    return bool(getattr(args, "fsdp", None)) or getattr(args, "fsdp_plugin_args", None) is not None


def checkpoint_directory(args, state) -> str:
    """The directory the Trainer has just written this step's checkpoint to (outside a hyperparameter search)."""
    return os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")


def save_method_state(method, directory: str) -> str:
    """Writes ``method.state_dict()`` to ``directory``/:data:`STATE_FILE`, atomically; returns the path."""
    if not os.path.isdir(directory):
        raise UsageError(f"MethodStateCallback: the checkpoint directory {directory} does not exist (a "
                         "hyperparameter search writes elsewhere, which this callback does not follow)")
    path = os.path.join(directory, STATE_FILE)
    with atomic_output(path, flag="output_dir") as handle:
        torch.save(method.state_dict(), handle)
    return path


def load_method_state(method, directory: str, global_step: int) -> None:
    """Loads the method's state saved in checkpoint ``directory`` after ``global_step`` updates; a
    missing or damaged file, or a state that does not fit (another method or vocabulary, another
    update index), is a UsageError in one line naming the file."""
    path = os.path.join(directory, STATE_FILE)
    restart = "add_method_state_callback(trainer, restart_counts=True) starts the counts empty instead"
    if not os.path.isfile(path):
        raise UsageError(f"checkpoint {directory} has no {STATE_FILE} (written without MethodStateCallback?): "
                         f"{restart}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # a damaged file fails in many ways (RuntimeError, UnpicklingError, EOFError, ...)
        raise UsageError(f"{path} is truncated or damaged ({os.path.getsize(path)} bytes, not a complete torch "
                         f"file of tensors and plain values): {restart}") from error
    expected = global_step if method.keeps_window else 0
    updates = state.get("updates") if isinstance(state, dict) else None
    ours = isinstance(updates, int) and (state.get("method"), state.get("vocab_size")) == (method.name, method.vocab_size)
    if ours and updates != expected:  # another method or vocabulary: load_state_dict says so
        raise UsageError(f"{path}: the counts are of update {updates}, but the checkpoint was saved after "
                         f"{global_step} updates (expected update {expected}): {restart}")
    try:
        method.load_state_dict(state)
    except UsageError as error:
        raise UsageError(f"{path}: {error}; {restart}") from None


class MethodStateCallback(TrainerCallback):
    """Keeps the method's counting window in step with the Trainer's optimizer updates, and in its
    checkpoints (see the module docstring). Add it with :func:`add_method_state_callback`, which
    also lets it resume; added through ``Trainer(callbacks=[...])`` it serves fresh runs only.

    ``restart_counts``: on resume, start the counts empty instead of loading the checkpoint's
    (fairseq's ``--agg-restart-counts``), e.g. for a checkpoint written without this callback.
    """

    def __init__(self, restart_counts: bool = False):
        self.restart_counts = bool(restart_counts)
        self.checkpoint = None  # the checkpoint this train() call resumes from, set by add_method_state_callback
        self.knows_checkpoint = False  # whether a train() call told it (None: a fresh run)

    def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        method = method_of(model)
        if uses_fsdp(args):
            # tried on CPU: torch 2.13, accelerate 1.16, transformers 5.25 (docs/hf.md, "Multi-process")
            raise UsageError("TrainingArguments.fsdp: fairseq_agg.hf does not support FSDP yet (untested under the "
                             "Trainer); leave fsdp unset to train with DDP")
        if state.global_step > 0:
            self._resume(method, state.global_step)
        if not method.window_is_set:
            option = "face_window" if method.name == "face" else "agg_window"
            window = updates_per_epoch(train_dataloader, args.gradient_accumulation_steps, option)
            logger.info(f"{method.name}: counting window of {window} updates (one epoch; {option}=N to change)")
            method.set_window(window)
        method.update_num = state.global_step

    def _resume(self, method, global_step: int):
        if not self.knows_checkpoint or self.checkpoint is None:
            raise UsageError(f"the Trainer resumed after {global_step} updates, but MethodStateCallback does not know "
                             "from which checkpoint: add it with fairseq_agg.hf.add_method_state_callback(trainer), "
                             "whose trainer.train(resume_from_checkpoint=...) passes it on")
        if self.restart_counts:
            logger.info(f"restart_counts: the counts of {method.name} start empty ({self.checkpoint}'s are not loaded)")
            return
        load_method_state(method, self.checkpoint, global_step)
        logger.info(f"{method.name}: counts loaded from {os.path.join(self.checkpoint, STATE_FILE)}")

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        # before the first micro-batch of each optimizer update: every micro-batch sees this number
        method_of(model).update_num = state.global_step

    def on_save(self, args, state, control, model=None, **kwargs):
        if args.should_save:  # the main process; the counts are the same on every rank
            save_method_state(method_of(model), checkpoint_directory(args, state))

    def on_train_end(self, args, state, control, model=None, **kwargs):
        # a training-mode forward after train() no longer counts into the last update
        method_of(model).update_num = None


def resolve_checkpoint(trainer, resume_from_checkpoint):
    """The checkpoint directory ``Trainer.train`` resumes from for this argument (``True``: the
    last one in ``output_dir``), or None for a fresh run."""
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    if resume_from_checkpoint is True:
        return get_last_checkpoint(trainer.args.output_dir)  # None: the Trainer refuses it itself
    return str(resume_from_checkpoint)


def add_method_state_callback(trainer, *, restart_counts: bool = False) -> MethodStateCallback:
    """Adds :class:`MethodStateCallback` to ``trainer`` (or takes the one it has) and makes this
    trainer's ``train(resume_from_checkpoint=...)`` tell it the checkpoint, so the counts resume
    with the weights and the optimizer. Returns the callback."""
    callback = next((cb for cb in trainer.callback_handler.callbacks if isinstance(cb, MethodStateCallback)), None)
    if callback is None:
        callback = MethodStateCallback()
        trainer.add_callback(callback)
    callback.restart_counts = bool(restart_counts)
    if getattr(trainer.train, "method_state_callback", None) is callback:
        return callback
    train = trainer.train

    def train_with_method_state(resume_from_checkpoint=None, *args, **kwargs):
        callback.checkpoint = resolve_checkpoint(trainer, resume_from_checkpoint)
        callback.knows_checkpoint = True
        try:
            return train(resume_from_checkpoint, *args, **kwargs)
        finally:
            callback.checkpoint, callback.knows_checkpoint = None, False

    train_with_method_state.__doc__ = train.__doc__
    train_with_method_state.method_state_callback = callback
    trainer.train = train_with_method_state
    return callback
