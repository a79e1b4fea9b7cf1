"""What a criterion needs from fairseq's training loop, observed without forking fairseq.

fairseq hands a criterion only ``(model, sample)``. AGG also needs the optimizer-update index (its
counting window advances per update, not per micro-batch), whether the batch is a dummy batch
(``ignore_grad``), and the number of updates in an epoch (the default window). Stock tasks
(``language_modeling``, ``translation``) know all three, so the criterion wraps two methods of *its
own task instance*:

* ``train_step(..., update_num, ignore_grad)``: the trainer calls it once per micro-batch, only in
  training (validation goes through ``valid_step``), so counts can never move during validation;
* ``get_batch_iterator(dataset=...)``: for the training subset, ``len(iterator)`` is the number of
  batches per epoch on this rank;
* ``begin_epoch(epoch, model)``: called by the trainer before the first training step, outside the
  step's error handling, so a model the criterion cannot serve is refused before fairseq would
  write a ``crash.pt``.
"""
import inspect
import math
import weakref


class TrainingObserver:
    """Interface of the objects notified by :func:`observe_task`."""

    def on_train_step(self, update_num: int, ignore_grad: bool):
        pass

    def on_train_batches(self, batches_per_epoch: int):
        pass

    def on_begin_epoch(self, epoch: int, model):
        pass


def _listeners(task):
    if not hasattr(task, "_fairseq_agg_listeners"):
        task._fairseq_agg_listeners = []
        _wrap(task)
    return task._fairseq_agg_listeners


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


def observe_task(task, listener: TrainingObserver, train_subset: str = "train"):
    """Registers ``listener`` for the training events of ``task`` (a weak reference)."""
    if task is None:
        return
    task._fairseq_agg_train_subset = train_subset
    _listeners(task).append(weakref.ref(listener))


def updates_per_epoch(batches_per_epoch: int, update_freq) -> int:
    """ceil(batches / update_freq): optimizer updates in one epoch on one rank (agg.md §3.1)."""
    if not isinstance(update_freq, (int, float)):  # a list (ListConfig) with one entry per epoch
        update_freq = list(update_freq)[0] if len(update_freq) else 1
    return int(math.ceil(batches_per_epoch / max(int(update_freq), 1)))
