"""Every fact the plugin reads from fairseq, read in one place.

fairseq hands a criterion only ``(model, sample)``; the methods need a little more:

* **the update number** (AGG's counting window and the augmented loss's warm-up advance per
  optimizer update, the statistics log every N updates), **whether a batch is a dummy batch**
  (``ignore_grad``), and **the number of updates in an epoch** (AGG's default window). Stock tasks
  know all three, so :func:`observe_task` wraps three methods of *the criterion's own task
  instance* and passes them to a :class:`TrainingLoop`:

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
  :func:`anchor_criterion_state` gives a criterion one zero parameter so that its buffers (AGG's
  window) travel with every checkpoint. Side effects, all harmless: the anchor is in the optimizer's
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

* **numpy 2**: fairseq's Cython extensions built against numpy 1.x do not import under numpy 2, and
  fairseq says so only at the first batch, as "Please build Cython components"
  (:func:`check_fairseq_extensions_match_numpy` says it at registration, naming the fix).
"""
import argparse
import contextlib
import importlib
import inspect
import io
import logging
import math
import re
import weakref
from typing import List, Optional

import torch

from fairseq_agg.errors import InstallError

logger = logging.getLogger(__name__)

# --- the training loop ------------------------------------------------------------------------


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

    def on_train_batches(self, batches_per_epoch: int):
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
                _notify(task, "on_train_batches", batches)
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


def anchor_criterion_state(criterion):
    """Gives ``criterion`` the one zero parameter that makes fairseq save and restore its
    ``state_dict`` (see the module docstring); its forward passes the loss through :func:`anchored`."""
    criterion.state_anchor = torch.nn.Parameter(torch.zeros(1))


def anchored(loss, criterion):
    """``loss`` + 0 x the anchor: keeps the anchor in the graph (DDP), adds nothing."""
    return loss + 0.0 * criterion.state_anchor.sum()


def holds_criterion_state(state_dict, module_names) -> bool:
    """Whether a checkpoint's criterion state holds the entries of these submodules. It does not
    when another criterion wrote it (a stock one: no state; another stateful one: other keys), as
    when fine-tuning from it: the counts then start empty."""
    prefixes = tuple(f"{name}." for name in module_names)
    return state_dict is not None and any(key.startswith(prefixes) for key in state_dict)


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


# --- optimizers ---------------------------------------------------------------------------------


def locate_model_parameters(optimizer_params):
    """For an optimizer that fairseq's ``Trainer`` is building from ``optimizer_params``: (the
    model, {trainable model parameter: (the optimizer tensor that holds it, its element offset)}),
    or (None, {}) when no Trainer is building one.

    fairseq hands an optimizer a bare list (``Trainer._build_optimizer``): the trainable parameters
    of ``model.parameters()`` in that order, then the criterion's. The parameters themselves in
    fp32, ``--amp`` and ``--memory-efficient-fp16``; fp32 copies in that order under ``--fp16
    --fp16-no-flatten-grads``; under ``--fp16`` one flat fp32 tensor concatenating them
    (``FP16Optimizer.build_fp32_params``). Other layouts (``fully_sharded``, pipeline parallelism)
    locate nothing. The trainer is found up the call stack, so nothing of fairseq's is patched.
    """
    from fairseq.trainer import Trainer

    received = list(optimizer_params)
    frame, trainer = inspect.currentframe(), None
    while frame is not None and trainer is None:
        if frame.f_code is Trainer._build_optimizer.__code__:
            trainer = frame.f_locals.get("self")
        frame = frame.f_back
    del frame
    if trainer is None:
        return None, {}
    model = trainer.model
    trainable = [p for p in model.parameters() if p.requires_grad]
    received_ids = {id(q) for q in received}
    if any(id(p) in received_ids for p in trainable):
        return model, {p: (p, 0) for p in trainable if id(p) in received_ids}
    if len(received) >= len(trainable) and all(p.shape == q.shape for p, q in zip(trainable, received)):
        return model, {p: (q, 0) for p, q in zip(trainable, received)}
    if len(received) == 1 and received[0].dim() == 1 and received[0].numel() >= sum(p.numel() for p in trainable):
        offsets = [0]
        for p in trainable[:-1]:
            offsets.append(offsets[-1] + p.numel())
        return model, {p: (received[0], offset) for p, offset in zip(trainable, offsets)}
    return model, {}


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


# --- numpy 2 ------------------------------------------------------------------------------------

# fairseq's extension compiled against numpy's C API that fairseq-train needs for its first batch
# (data_utils.batch_by_size); token_block_utils_fast is built and fails alongside it.
NUMPY_EXTENSION = "fairseq.data.data_utils_fast"


def _installed_fairseq() -> str:
    """``NAME==VERSION`` of the distribution that installed fairseq (fairseq, fairseq-fixed, ...)."""
    from importlib import metadata

    names = getattr(metadata, "packages_distributions", dict)().get("fairseq") or ["fairseq"]
    try:
        return f"{names[0]}=={metadata.version(names[0])}"
    except metadata.PackageNotFoundError:
        return names[0]


def check_fairseq_extensions_match_numpy():
    """Under numpy >= 2, refuses a fairseq whose compiled extensions were built against numpy 1.x,
    with one line naming the two fixes (an ImportError) (fairseq itself fails only at the first batch,
    with "Please build Cython components"). Under numpy 1.x nothing is imported; an extension
    missing for another reason (fairseq built without them) is left to fairseq's own message."""
    import numpy

    if int(numpy.__version__.split(".")[0]) < 2:
        return
    try:
        # numpy writes its own explanation and a stack listing to sys.stderr before it fails
        with contextlib.redirect_stderr(io.StringIO()):
            importlib.import_module(NUMPY_EXTENSION)
    except ImportError as e:
        if "numpy" not in str(e).lower():
            return
        raise InstallError(
            f"fairseq's compiled extensions ({NUMPY_EXTENSION}) were built against numpy 1.x and do not "
            f"import under numpy {numpy.__version__}: rebuild them with pip install --no-build-isolation "
            f"--no-deps --force-reinstall --no-cache-dir {_installed_fairseq()}, or pip install 'numpy<2'"
        ) from None
