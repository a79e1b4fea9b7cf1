"""Token counts per optimizer update: the sliding window of AGG (Yu et al., ACL 2022, §4;
docs/agg.md (A1)) and the run-long counts of FACE's released code (docs/baselines.md, "FACE").

Both counters have one interface: ``start_update(t)`` opens update t (1, 2, ...; calling it again
with the same t is a no-op), ``add(histogram)`` adds a micro-batch's histogram to it, ``counts``
(length V, int64) is what the method reads, ``nbytes`` what the counter adds to each checkpoint.
Both save and restore themselves through ``state_dict``, so a resumed run continues with the
same counts; a saved state is checked before it is loaded (:mod:`fairseq_agg.ops.counter_state`),
so a damaged checkpoint is refused in one line instead of failing at a later update.
:func:`target_histogram` is the one place ids become a histogram (summed over data-parallel ranks
when asked).
"""
import logging
from typing import Optional

import torch
import torch.distributed as dist

from fairseq_agg.errors import UsageError, check_integer, flag_name

from .counter_state import (
    CUMULATIVE_KEYS, SATURATED, WINDOW_KEYS, check_cumulative_state, check_window_state, overflow_table, ring_totals,
    saved_ring,
)

logger = logging.getLogger(__name__)

# The window keeps window x V counts in host memory and in every checkpoint, one byte each: a
# token's count in one update is stored in a uint8 ring, and the few counts of SATURATED (255) or
# more (the most frequent tokens of large updates: a few dozen per update at the AGG paper's 32k
# tokens) in an overflow table beside it, exactly (:mod:`fairseq_agg.ops.counter_state`). At the
# paper's shape this is about 4x smaller than the int32 ring of the released code; the gates read
# the int64 running sum, so they do not change.

# A window whose ring would need more than this is refused (at V = 50,000: 171,798 updates).
MAX_WINDOW_BYTES = 8 << 30


def max_window(vocab_size: int) -> int:
    """The largest window (in updates) whose ring fits in :data:`MAX_WINDOW_BYTES`."""
    return max(1, MAX_WINDOW_BYTES // max(int(vocab_size), 1))


def check_window(flag: str, window, vocab_size: int) -> int:
    """A window size in [1, max_window(V)]; the message says what the upper bound allocates."""
    window = check_integer(flag, window, 1)
    bound = max_window(vocab_size)
    if window > bound:
        raise UsageError(
            f"{flag_name(flag)} must be <= {bound}, got {window}: a window of K updates keeps K x V one-byte counts "
            f"(V = {vocab_size}) in host memory and in every checkpoint, at most {MAX_WINDOW_BYTES >> 30} GiB"
        )
    return window


def target_histogram(target: torch.Tensor, vocab_size: int, all_reduce: bool = False, group=None) -> torch.Tensor:
    """Histogram of the (already pad-free) target ids, summed over data-parallel ranks if asked.

    Every rank must call this the same number of times when ``all_reduce`` is on (fairseq gives
    all ranks the same number of micro-batches, using dummy batches with an empty target).
    """
    hist = torch.bincount(target.reshape(-1), minlength=vocab_size)
    if all_reduce and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(hist, group=group)
    return hist


class RareTokenWindow(torch.nn.Module):
    """Token counts over a sliding window of the last ``window`` optimizer updates.

    The window holds the current (partial) update plus the ``window - 1`` previous ones, as the
    released code's ring buffer does. ``start_update(t)`` must be called with the update index
    before the histograms of that update are added; calling it again with the same t (every
    micro-batch of one update, or a repeated index after an fp16 overflow) is a no-op.

    Storage: the (window x V) uint8 ring stays in host memory (one row is touched per update); a
    count of :data:`SATURATED` or more is stored as 255 in the ring and exactly in ``overflow``
    ({row: (ids, counts)}). The running sum and the current update's histogram (int64) live on the
    device of the histograms. ``flag`` is the flag that sizes the window (named in errors and warnings).
    """

    def __init__(self, vocab_size: int, window: Optional[int] = None, flag: str = "agg_window"):
        super().__init__()
        self.vocab_size = int(vocab_size)
        self.flag = flag
        self.window = None
        self.ring = None  # (window, V) uint8, CPU
        self.overflow = {}  # ring row -> (ids, exact counts), the entries of the row that read 255
        self.counts = torch.zeros(self.vocab_size, dtype=torch.int64)  # running window sum S
        self.current = torch.zeros(self.vocab_size, dtype=torch.int64)  # histogram of update `update_index`
        self.update_index = 0  # t of the update being counted (0 = none yet)
        self.recorded = 0  # updates in the window, capped at `window` (the denominator)
        self.saved_after = None  # updates of the checkpoint being loaded (None: unknown), set by the criterion
        if window is not None:
            self.set_window(window)

    @property
    def is_configured(self) -> bool:
        return self.ring is not None

    @property
    def nbytes(self) -> int:
        """Bytes this window adds to a checkpoint (the ring, the running sum and the current update)."""
        ring = 0 if self.ring is None else self.ring.numel()
        overflow = 3 * 8 * sum(ids.numel() for ids, _ in self.overflow.values())
        return ring + overflow + 2 * 8 * self.vocab_size

    def set_window(self, window: int):
        window = check_window(self.flag, window, self.vocab_size)
        if self.ring is not None:
            if self.ring.size(0) != window:
                raise ValueError(f"window already set to {self.ring.size(0)} updates, cannot change it to {window}")
            return
        self.window = window
        self.ring = torch.zeros(self.window, self.vocab_size, dtype=torch.uint8)

    def _slot(self, t: int) -> int:
        return t % self.window

    def resize(self, window: int):
        """Changes the window to ``window`` updates, keeping the newest updates that both sizes hold.

        The current update and the ``min(old, new) - 1`` finished updates before it keep their
        counts; older rows are dropped (shrinking). Growing keeps every count and the window fills
        up from there: the denominator stays the number of updates held, capped at the new size.
        """
        window = check_window(self.flag, window, self.vocab_size)
        if not self.is_configured or window == self.window:
            self.set_window(window)
            return
        t = self.update_index
        ring = torch.zeros(window, self.vocab_size, dtype=torch.uint8)
        overflow = {}
        # finished updates kept (those numbered 0 or less come from an update number that went back)
        for s in range(t - min(window, self.window) + 1, t):
            ring[s % window] = self.ring[self._slot(s)]
            if self._slot(s) in self.overflow:
                overflow[s % window] = self.overflow[self._slot(s)]
        self.ring, self.overflow, self.window = ring, overflow, window
        self.counts = ring_totals(ring, overflow)[0].to(self.counts.device) + self.current
        self.recorded = min(self.recorded, self.window)

    def start_update(self, t: int):
        """Opens update t (= fairseq's update_num + 1): drops the update that is `window` updates old."""
        if not self.is_configured:
            raise RuntimeError("RareTokenWindow.set_window must be called before counting")
        if t == self.update_index:
            return
        if t < self.update_index:  # the update number went back: go on from t - 1
            self._renumber(t - 1)
        elif self.update_index > 0:  # commit the finished update to its ring row
            self.commit(self.current.to("cpu"))
        # Normally t = update_index + 1; a jump drops every slot it passes.
        steps = t - self.update_index
        for s in range(max(t - min(steps, self.window) + 1, 1), t + 1):
            if self.ring[self._slot(s)].any():
                self.counts -= self.row_counts(self._slot(s)).to(self.counts.device)
            self.ring[self._slot(s)].zero_()
            self.overflow.pop(self._slot(s), None)
        self.current.zero_()
        # The denominator counts updates since the first one this window saw (a run that starts,
        # or fine-tunes from a checkpoint without counts, at update 5001 has recorded 1, not K).
        first = self.update_index == 0 and self.recorded == 0
        self.update_index = t
        self.recorded = 1 if first else min(self.recorded + steps, self.window)

    def _renumber(self, new: int):
        """Commits the open update as update ``new`` (< update_index) and rotates the ring with it, so
        that every finished update keeps its age and the oldest still leave first. fairseq restarts
        the update number at 0 on ``--finetune-from-model``; the rows stay where
        :func:`check_window_state` expects them."""
        self.commit(self.current.to("cpu"))
        shift = new - self.update_index
        self.ring = torch.roll(self.ring, shift, 0)
        self.overflow = {(slot + shift) % self.window: entry for slot, entry in self.overflow.items()}
        self.current.zero_()
        self.update_index = new

    def commit(self, finished: torch.Tensor):
        """Stores the finished update's counts (int64, CPU) in its ring row: 255 and above go to
        the overflow table."""
        slot = self._slot(self.update_index)
        self.ring[slot] = finished.clamp(max=SATURATED).to(torch.uint8)
        large = finished.ge(SATURATED).nonzero().squeeze(1)
        if large.numel():
            self.overflow[slot] = (large, finished[large].clone())
        else:
            self.overflow.pop(slot, None)

    def row_counts(self, slot: int) -> torch.Tensor:
        """The exact counts (int64) of one ring row."""
        row = self.ring[slot].to(torch.int64)
        if slot in self.overflow:
            ids, counts = self.overflow[slot]
            row[ids] = counts
        return row

    def add(self, histogram: torch.Tensor):
        """Adds one micro-batch's histogram (length V, integer) to the current update."""
        histogram = histogram.to(torch.int64)
        if self.counts.device != histogram.device:
            self.counts = self.counts.to(histogram.device)
            self.current = self.current.to(histogram.device)
        self.counts += histogram
        self.current += histogram

    # --- checkpointing: the ring is not a registered buffer (it stays on the CPU), so the module
    # writes and reads its own entries.
    _KEYS = WINDOW_KEYS

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if self.ring is None:
            return
        destination[prefix + "ring"] = self.ring.clone()
        destination[prefix + "overflow"] = overflow_table(self.overflow)
        destination[prefix + "counts"] = self.counts.detach().cpu().clone()
        destination[prefix + "current"] = self.current.detach().cpu().clone()
        destination[prefix + "meta"] = torch.tensor([self.window, self.update_index, self.recorded], dtype=torch.int64)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        if not any(prefix + k in state_dict for k in self._KEYS):
            return  # a checkpoint without counts (e.g. from a stock criterion): start fresh
        window, update_index, recorded = check_window_state(state_dict, self.vocab_size, prefix, self.saved_after)
        configured_window = self.window  # this run's window flag (None: auto, the checkpoint's K stays)
        device = self.counts.device
        self.window = window
        self.ring, self.overflow = saved_ring(state_dict, prefix)
        self.counts = state_dict[prefix + "counts"].to(device, torch.int64).clone()
        self.current = state_dict[prefix + "current"].to(device, torch.int64).clone()
        self.update_index = update_index
        self.recorded = recorded
        if configured_window is not None and configured_window != window:
            logger.warning(
                f"{flag_name(self.flag)} {configured_window} differs from the checkpoint's window of {window} "
                f"updates: resizing it to {configured_window} (the newest updates keep their counts)"
            )
            self.resize(configured_window)


class CumulativeCounts(torch.nn.Module):
    """Token counts over the whole run, without decay (the released FACE code's estimate).

    The interface of :class:`RareTokenWindow` (``start_update``, ``add``, ``counts``); saved in the
    module's ``state_dict``.
    """

    is_configured = True
    _KEYS = CUMULATIVE_KEYS

    def __init__(self, vocab_size: int):
        super().__init__()
        self.register_buffer("counts", torch.zeros(int(vocab_size), dtype=torch.int64))

    @property
    def nbytes(self) -> int:
        return self.counts.numel() * 8

    def start_update(self, t: int):
        """Nothing to drop: the counts never decay."""

    def add(self, histogram: torch.Tensor):
        histogram = histogram.to(torch.int64)
        if self.counts.device != histogram.device:
            self.counts = self.counts.to(histogram.device)
        self.counts += histogram

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        check_cumulative_state(state_dict, self.counts.numel(), prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def counted_ids(ids: torch.Tensor, excluded_id: Optional[int]) -> torch.Tensor:
    """The ids that enter the counts: all of ``ids`` but ``excluded_id`` (eos in the released code)."""
    if excluded_id is None:
        return ids
    return ids[ids != excluded_id]


class CountsPerUpdate:
    """What AGG and FACE share: ids counted per optimizer update into ``self.counter`` (a
    :class:`RareTokenWindow` or :class:`CumulativeCounts`), summed over the data-parallel ranks of
    ``process_group`` when ``all_reduce``. Subclasses set ``counter``, ``vocab_size``,
    ``window_flag`` (the flag that sizes the window), ``all_reduce``, ``process_group`` and
    ``uncounted_id`` (an id never counted; None = every id)."""

    counter = None
    uncounted_id: Optional[int] = None

    def set_window(self, window: int):
        """Sizes a window created without one (``window=None``); a no-op once it has this size."""
        self.counter.set_window(window)

    def start_update(self, update_num: int):
        """Opens the update after ``update_num`` completed ones; again with the same number: a no-op."""
        if not self.counter.is_configured:
            raise UsageError(f"{self.window_flag} is 0 (auto, one epoch of updates) but the number of updates per "
                             f"epoch is unknown here; pass {self.window_flag} N (N >= 1)")
        self.counter.start_update(int(update_num) + 1)

    def count(self, ids: torch.Tensor):
        """Adds one micro-batch's (pad-free) ids to the current update."""
        ids = counted_ids(ids, self.uncounted_id)
        self.counter.add(target_histogram(ids, self.vocab_size, all_reduce=self.all_reduce, group=self.process_group))

    def state_dict(self):
        return self.counter.state_dict()

    def load_state_dict(self, state_dict):
        return self.counter.load_state_dict(state_dict)
