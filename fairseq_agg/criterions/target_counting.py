"""The training-loop side of counting targets over a sliding window of updates, shared by AGG and
FACE (the window itself is :class:`fairseq_agg.ops.agg_gates.RareTokenWindow`).

Counts move only in training (never in validation), one window row per optimizer update; a dummy
batch still joins the data-parallel all-reduce with nothing in it, so every rank calls it equally
often.
"""
import logging

import torch

from fairseq_agg.fairseq_hooks import data_parallel_group, updates_per_epoch
from fairseq_agg.ops.agg_gates import target_histogram

logger = logging.getLogger(__name__)


def set_epoch_window(counter, batches_per_epoch, update_freq, method, window_flag):
    """The auto window (``window_flag`` 0): one epoch of updates, once the epoch's length is known."""
    if not counter.is_configured:
        window = updates_per_epoch(batches_per_epoch, update_freq)
        logger.info(f"{method} counting window: {window} updates (one epoch; set {window_flag} to change)")
        counter.set_window(window)


def open_update(criterion, counter, model, criterion_name, window_flag) -> bool:
    """Whether this micro-batch moves the counts (training only); if so, opens its update."""
    if not (model.training and torch.is_grad_enabled()):
        return False
    if criterion.update_num is None:
        raise RuntimeError(
            f"{criterion_name} needs the update number: train with fairseq-train, or call "
            "criterion.set_update_num(n) before each training forward"
        )
    if not counter.is_configured:
        raise ValueError(
            f"{window_flag} is 0 (auto, one epoch of updates) but the number of updates per epoch is "
            f"unknown here; pass {window_flag} N (N >= 1)"
        )
    counter.start_update(criterion.update_num + 1)
    return True


def add_counts(criterion, counter, ids, vocab_size, all_reduce=True):
    """Adds the histogram of ``ids`` (summed over data-parallel ranks unless ``all_reduce`` is off)."""
    if criterion.ignore_grad:
        ids = ids[:0]  # a dummy batch still joins the collective, with nothing in it
    counter.add(target_histogram(ids, vocab_size, all_reduce=all_reduce, group=data_parallel_group()))
