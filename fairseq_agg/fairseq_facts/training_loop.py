"""What fairseq's training loop tells a criterion, observed on its task.

A criterion needs **the update number** (AGG's counting window and the augmented loss's warm-up
advance per optimizer update, the statistics log every N updates), **whether a batch is a dummy
batch** (``ignore_grad``), and **the number of updates in an epoch** (AGG's default window). Stock
tasks know all three, so :func:`observe_task` wraps three methods of *the criterion's own task
instance* and passes them to a :class:`TrainingLoop`:

- ``train_step(..., update_num, ignore_grad)``: the trainer calls it once per micro-batch and only
  in training (validation goes through ``valid_step``), so counts never move in validation;
  ``update_num`` is the number of optimizer updates completed before this one;
- ``get_batch_iterator(dataset=...)``: for the training subset, ``len(iterator)`` is the number of
  batches per epoch on this rank;
- ``begin_epoch(epoch, model)``: called before the first training step and outside the step's
  error handling, so a model a criterion cannot serve is refused before fairseq writes
  ``crash.pt``.
"""
import inspect
import math
import weakref
from typing import Optional

import numpy as np
import torch


class TrainingLoop:
    """What fairseq's training loop tells a criterion, observed on its task (:func:`observe_task`).

    ``update_num`` is fairseq's ``update_num`` of the current micro-batch (optimizer updates
    completed before it; ``None`` before the first training step) and ``ignore_grad`` whether it
    is a dummy batch. ``on_epoch_batches(batches)`` is called with the batches per epoch of the
    training subset, ``on_begin_epoch(epoch, model)`` before an epoch's first training step.
    Without a task (a criterion built by hand), :meth:`set_update_num` says what fairseq would.
    """

    def __init__(self, task=None, train_subset: Optional[str] = None, on_epoch_batches=None, on_begin_epoch=None):
        self.update_num = None
        self.tokens_per_epoch = None  # target tokens of the training subset (all ranks), once known
        self.tokens_per_pair = None  # the same per language pair, under multilingual_translation
        self.ignore_grad = False
        self._on_epoch_batches = on_epoch_batches
        self._on_begin_epoch = on_begin_epoch
        observe_task(task, self, train_subset)

    def set_update_num(self, update_num: int, ignore_grad: bool = False):
        self.update_num = update_num
        self.ignore_grad = ignore_grad

    def training_update(self, model, criterion_name: str) -> Optional[int]:
        """The update number when this forward trains (train mode, gradients on), None otherwise:
        counts and schedules move in training forward passes only, never in validation."""
        if not (model.training and torch.is_grad_enabled()):
            return None
        if self.update_num is None:
            raise RuntimeError(
                f"{criterion_name} needs the update number: train with fairseq-train, or call "
                "criterion.set_update_num(n) before each training forward"
            )
        return self.update_num

    # --- called by the task's wrapped methods
    def on_train_step(self, update_num: int, ignore_grad: bool):
        self.set_update_num(update_num, ignore_grad)

    def on_train_batches(self, batches_per_epoch: int, tokens_per_epoch: Optional[int] = None,
                         tokens_per_pair: Optional[dict] = None):
        self.tokens_per_pair = tokens_per_pair
        self.tokens_per_epoch = sum(tokens_per_pair.values()) if tokens_per_pair else tokens_per_epoch
        if self._on_epoch_batches is not None:
            self._on_epoch_batches(batches_per_epoch)

    def on_begin_epoch(self, epoch: int, model):
        if self._on_begin_epoch is not None:
            self._on_begin_epoch(epoch, model)


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
                _notify(task, "on_train_batches", batches, epoch_target_tokens(dataset, iterator),
                        epoch_target_tokens_per_pair(dataset, iterator))
        return iterator

    begin_epoch = task.begin_epoch

    def observed_begin_epoch(epoch, model):
        _notify(task, "on_begin_epoch", epoch, model)
        return begin_epoch(epoch, model)

    task.train_step = observed_train_step
    task.get_batch_iterator = observed_get_batch_iterator
    task.begin_epoch = observed_begin_epoch


def observe_task(task, listener: TrainingLoop, train_subset: Optional[str] = None):
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


def epoch_target_tokens(dataset, iterator) -> Optional[int]:
    """The target tokens of one epoch, every rank's share: the sizes (a translation dataset's target
    sizes; a language-modelling dataset's, one target per token) of the samples in the iterator's
    batches, which may leave some out (fairseq drops a last incomplete batch); None without sizes."""
    sizes = getattr(dataset, "tgt_sizes", None)
    if sizes is None:
        sizes = getattr(dataset, "sizes", None)
    if sizes is None:
        return None
    sizes = np.asarray(sizes)
    try:
        batches = getattr(iterator, "frozen_batches", None)
        if batches is not None:
            return int(sum(int(sizes[np.asarray(batch, dtype=np.int64)].sum()) for batch in batches))
        return int(sizes.sum())
    except (IndexError, TypeError, ValueError):
        return None


def epoch_target_tokens_per_pair(dataset, iterator) -> Optional[dict]:
    """``{language pair: target tokens of one epoch}`` of ``multilingual_translation``'s round-robin
    dataset (``RoundRobinZipDatasets``), None for any other. Each batch index gives every pair a
    sample, a shorter pair's taken again from its start: fairseq's ``_map_index``, read here on the
    order that fairseq set for the epoch (``_ordered_indices``, after its size filter)."""
    from fairseq.data import RoundRobinZipDatasets

    batches = getattr(iterator, "frozen_batches", None)
    order = getattr(dataset, "_ordered_indices", None)
    if not isinstance(dataset, RoundRobinZipDatasets) or batches is None or order is None:
        return None
    indices = np.concatenate([np.asarray(batch, dtype=np.int64) for batch in batches] or [np.zeros(0, np.int64)])
    counts = {}
    for pair, pair_dataset in dataset.datasets.items():
        while getattr(pair_dataset, "tgt_sizes", None) is None and hasattr(pair_dataset, "dataset"):
            pair_dataset = pair_dataset.dataset  # e.g. the language-token wrapper of --decoder-langtok
        sizes, pair_order = getattr(pair_dataset, "tgt_sizes", None), np.asarray(order[pair], dtype=np.int64)
        if sizes is None or not len(pair_order):
            return None
        counts[pair] = int(np.asarray(sizes)[pair_order[indices % len(pair_order)]].sum())
    return counts


def updates_per_epoch(batches_per_epoch: int, update_freq) -> int:
    """ceil(batches / update_freq): optimizer updates in one epoch on one rank."""
    if not isinstance(update_freq, (int, float)):  # a list (ListConfig) with one entry per epoch
        update_freq = list(update_freq)[0] if len(update_freq) else 1
    return int(math.ceil(batches_per_epoch / max(int(update_freq), 1)))


def is_translation_task(task) -> bool:
    """True for fairseq's translation tasks and their subclasses (a source side: ``translation``,
    ``multilingual_translation``, ``translation_multi_simple_epoch``), False for LM."""
    from fairseq.tasks.multilingual_translation import MultilingualTranslationTask
    from fairseq.tasks.translation import TranslationTask
    from fairseq.tasks.translation_multi_simple_epoch import TranslationMultiSimpleEpochTask

    return isinstance(task, (TranslationTask, MultilingualTranslationTask, TranslationMultiSimpleEpochTask))
