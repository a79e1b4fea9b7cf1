"""Every fact the plugin reads from fairseq, read in one place.

fairseq hands a criterion only ``(model, sample)``; the methods need a little more:

* **the update number** (AGG's counting window and the augmented loss's warm-up advance per
  optimizer update, the statistics log every N updates), **whether a batch is a dummy batch**
  (``ignore_grad``), and **the number of updates in an epoch** (AGG's default window). Stock tasks
  know all three, so :func:`observe_task` wraps three methods of *the criterion's own task
  instance* and passes them to a :class:`TrainingObserver`:

  - ``train_step(..., update_num, ignore_grad)``: the trainer calls it once per micro-batch and only
    in training (validation goes through ``valid_step``), so counts never move in validation;
    ``update_num`` is the number of optimizer updates completed before this one;
  - ``get_batch_iterator(dataset=...)``: for the training subset, ``len(iterator)`` is the number of
    batches per epoch on this rank;
  - ``begin_epoch(epoch, model)``: called before the first training step and outside the step's
    error handling, so a model a criterion cannot serve is refused before fairseq writes
    ``crash.pt``.

* **data-parallel facts**: the data-parallel process group (AGG sums its histograms over it) and
  whether this process is global rank 0 (only rank 0 computes and logs statistics).

* **criterion state in checkpoints**: fairseq saves and restores a criterion's ``state_dict`` only
  when the criterion has parameters (``Trainer.state_dict`` / ``load_checkpoint``).
  :class:`CheckpointedState` gives a criterion one zero parameter so that its buffers (AGG's window)
  travel with every checkpoint. Side effects, all harmless: the anchor is in the optimizer's
  parameter list (its gradient is always 0, so Adam and weight decay keep it at 0), and under
  ``--ddp-backend c10d`` / ``legacy_ddp`` fairseq wraps the criterion in DDP too (the anchor joins
  the graph through ``loss + 0 * anchor``, so DDP sees it used on every step).

* **dictionary facts**: the special symbols, and the ``madeupwordNNNN`` fillers that
  ``fairseq-preprocess --padding-factor`` appends (never a real target, never trained).

* **checkpoint loading**: torch >= 2.6 loads with ``weights_only=True``, which refuses the
  ``argparse.Namespace`` that fairseq stores for models without a dataclass config
  (:func:`allow_namespace_in_checkpoints`).

* **meters**: fairseq's ``MetersDict`` cannot forget a meter (:func:`remove_meter`); the statistics
  drop their reset meters so that log lines without a measurement carry no ``None`` value.
"""
import argparse
import inspect
import logging
import math
import re
import weakref
from typing import List, Optional

import torch

logger = logging.getLogger(__name__)

# --- the training loop ------------------------------------------------------------------------


class TrainingObserver:
    """Receives the training-loop events of a task (see :func:`observe_task`).

    ``update_num`` is fairseq's ``update_num`` of the current micro-batch (optimizer updates
    completed before it; ``None`` before the first training step) and ``ignore_grad`` whether the
    micro-batch is a dummy batch. Subclasses that override :meth:`on_train_step` call ``super()``.
    """

    update_num = None
    ignore_grad = False

    def on_train_step(self, update_num: int, ignore_grad: bool):
        self.update_num = update_num
        self.ignore_grad = ignore_grad

    def on_train_batches(self, batches_per_epoch: int):
        pass

    def on_begin_epoch(self, epoch: int, model):
        pass


def _notify(task, method, *args):
    for ref in list(task._fairseq_agg_listeners):
        listener = ref()
        if listener is None:
            task._fairseq_agg_listeners.remove(ref)
        else:
            getattr(listener, method)(*args)


def _wrap(task):
    train_step = task.train_step
    train_sig = inspect.signature(train_step)

    def observed_train_step(*args, **kwargs):
        bound = train_sig.bind(*args, **kwargs)
        bound.apply_defaults()
        _notify(task, "on_train_step", int(bound.arguments["update_num"]), bool(bound.arguments.get("ignore_grad", False)))
        return train_step(*args, **kwargs)

    get_batch_iterator = task.get_batch_iterator
    iter_sig = inspect.signature(get_batch_iterator)

    def observed_get_batch_iterator(*args, **kwargs):
        iterator = get_batch_iterator(*args, **kwargs)
        dataset = iter_sig.bind(*args, **kwargs).arguments.get("dataset")
        train_subset = getattr(task, "_fairseq_agg_train_subset", "train")
        if dataset is not None and dataset is task.datasets.get(train_subset):
            try:
                batches = len(iterator)
            except TypeError:  # streaming iterators have no length
                batches = None
            if batches:
                _notify(task, "on_train_batches", batches)
        return iterator

    begin_epoch = task.begin_epoch

    def observed_begin_epoch(epoch, model):
        _notify(task, "on_begin_epoch", epoch, model)
        return begin_epoch(epoch, model)

    task.train_step = observed_train_step
    task.get_batch_iterator = observed_get_batch_iterator
    task.begin_epoch = observed_begin_epoch


def observe_task(task, listener: TrainingObserver, train_subset: Optional[str] = None):
    """Registers ``listener`` (held by a weak reference) for the training events of ``task``;
    ``train_subset`` (``--train-subset``, default ``train``) is kept when a listener passes none."""
    if task is None:
        return
    if train_subset is not None:
        task._fairseq_agg_train_subset = train_subset
    if not hasattr(task, "_fairseq_agg_listeners"):
        task._fairseq_agg_listeners = []
        _wrap(task)
    task._fairseq_agg_listeners.append(weakref.ref(listener))


def updates_per_epoch(batches_per_epoch: int, update_freq) -> int:
    """ceil(batches / update_freq): optimizer updates in one epoch on one rank."""
    if not isinstance(update_freq, (int, float)):  # a list (ListConfig) with one entry per epoch
        update_freq = list(update_freq)[0] if len(update_freq) else 1
    return int(math.ceil(batches_per_epoch / max(int(update_freq), 1)))


def is_translation_task(task) -> bool:
    """True for fairseq's translation task and its subclasses (a source side), False for LM."""
    from fairseq.tasks.translation import TranslationTask

    return isinstance(task, TranslationTask)


# --- data parallelism ---------------------------------------------------------------------------


def _distributed() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized()


def data_parallel_group():
    """fairseq's data-parallel process group, or None when not running distributed."""
    if not _distributed():
        return None
    from fairseq.distributed import utils as distributed_utils

    return distributed_utils.get_data_parallel_group()


def is_global_rank0() -> bool:
    return not _distributed() or torch.distributed.get_rank() == 0


# --- criterion state in checkpoints -------------------------------------------------------------


class CheckpointedState:
    """Mixin of a criterion whose running counts travel with fairseq's checkpoints (AGG's window,
    FACE's counts): ``STATE_MODULES`` names the submodules that hold them and ``STATE_NAME`` says
    what they are in the log. :meth:`anchor_state` adds the one zero parameter that makes fairseq
    save and restore the criterion's ``state_dict`` (see the module docstring), and the
    criterion's ``adjust_loss`` hook keeps it in the loss's graph. A checkpoint written by another criterion (a stock one: no state;
    another stateful one: none of these submodules' keys), as when fine-tuning from it, starts the
    counts empty; one that holds them is loaded strictly."""

    STATE_MODULES = ()
    STATE_NAME = "counts"

    def anchor_state(self):
        self.state_anchor = torch.nn.Parameter(torch.zeros(1))

    def adjust_loss(self, loss):
        loss = loss + 0.0 * self.state_anchor.sum()  # keeps the anchor in the graph (DDP), adds nothing
        return super().adjust_loss(loss)

    def load_state_dict(self, state_dict, strict=True, **kwargs):
        prefixes = tuple(f"{name}." for name in self.STATE_MODULES)
        if state_dict is None or not any(key.startswith(prefixes) for key in state_dict):
            logger.info(f"the checkpoint has no {self.STATE_NAME} of this criterion (written by another one): "
                        "they start empty")
            return None
        return super().load_state_dict(state_dict, strict=strict, **kwargs)


# --- dictionaries -------------------------------------------------------------------------------

FAIRSEQ_NSPECIAL = 4  # bos, pad, eos, unk: fairseq's Dictionary without extra special symbols
FAIRSEQ_PAD = 1
_MADEUPWORD = re.compile(r"^madeupword\d{4}$")  # Dictionary.pad_to_multiple_


def nspecial(dictionary) -> int:
    return FAIRSEQ_NSPECIAL if dictionary is None else int(dictionary.nspecial)


def pad_index(dictionary) -> int:
    return FAIRSEQ_PAD if dictionary is None else int(dictionary.pad())


def madeupword_ids(dictionary) -> List[int]:
    """Ids of the vocabulary-padding fillers (``madeupword0000`` ...); none without a dictionary."""
    if dictionary is None:
        return []
    first = nspecial(dictionary)
    return [i for i, sym in enumerate(dictionary.symbols) if i >= first and _MADEUPWORD.match(sym)]


def special_ids(dictionary) -> List[int]:
    """Ids of the special symbols: the first ``nspecial`` entries and the padding symbol."""
    return sorted(set(range(nspecial(dictionary))) | {pad_index(dictionary)})


def never_real_ids(dictionary) -> List[int]:
    """Ids that are never a real target: the padding symbol and the madeupword fillers."""
    return sorted({pad_index(dictionary)} | set(madeupword_ids(dictionary)))


# --- checkpoint loading -------------------------------------------------------------------------


def allow_namespace_in_checkpoints():
    """Lets torch's safe loading accept the ``argparse.Namespace`` fairseq stores in checkpoints."""
    if hasattr(torch.serialization, "add_safe_globals"):
        torch.serialization.add_safe_globals([argparse.Namespace])


# --- metrics ------------------------------------------------------------------------------------


def remove_meter(meters, key: str):
    """Removes ``key`` from a fairseq ``MetersDict``: it keeps a sorted ``priorities`` list next to
    the dict (its ``state_dict`` walks that list) and has no removal method of its own."""
    if key in meters:
        del meters[key]
        meters.priorities[:] = [entry for entry in meters.priorities if entry[2] != key]
