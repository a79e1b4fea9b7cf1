"""Token counts per optimizer update: the sliding window of AGG (Yu et al., ACL 2022, §4;
docs/agg.md (A1)) and the run-long counts of FACE's released code (docs/baselines.md, "FACE").

Both counters have one interface: ``start_update(t)`` opens update t (1, 2, ...; calling it again
with the same t is a no-op), ``add(histogram)`` adds a micro-batch's histogram to it, ``counts``
(length V, int64) is what the method reads, ``nbytes`` what the counter adds to each checkpoint.
Both save and restore themselves through ``state_dict``, so a resumed run continues with the
same counts; a saved state is checked before it is loaded (:func:`check_window_state`,
:func:`check_cumulative_state`), so a damaged checkpoint is refused in one line instead of failing
at a later update. :func:`target_histogram` is the one place ids become a histogram (summed over
data-parallel ranks when asked).
"""
import logging
from typing import Dict, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from fairseq_agg.errors import UsageError, check_integer, flag_name


logger = logging.getLogger(__name__)

# The window keeps window x V counts in host memory and in every checkpoint, one byte each: a
# token's count in one update is stored in a uint8 ring, and the few counts of 255 or more (the
# most frequent tokens of large updates: a few dozen per update at the AGG paper's 32k tokens) in
# an overflow table beside it, exactly. At the paper's shape this is about 4x smaller than the
# int32 ring of the released code; the gates read the int64 running sum, so they do not change.
SATURATED = 255  # a ring entry of 255 means: the count is in the overflow table

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
    _KEYS = ("ring", "overflow", "counts", "current", "meta")
    _KEYS_INT32 = ("ring", "counts", "current", "meta")  # the format before the one-byte ring

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
    _KEYS = ("counts",)

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


# --- checking a saved state before it is loaded: every check below holds for each state the
# counters write (whatever the history of updates, resizes and restarts), so a state that fails
# one was damaged or edited.

def counter_entries(state_dict: Mapping, prefix: str, keys: Sequence[str]) -> dict:
    """The entries of one counter in ``state_dict`` (keys ``prefix + name``), by name; refuses a
    set of names other than ``keys`` (some missing, or those of another kind of counter)."""
    entries = {key[len(prefix):]: value for key, value in state_dict.items() if key.startswith(prefix)}
    missing = [prefix + key for key in keys if key not in entries]
    unexpected = [prefix + key for key in entries if key not in keys]
    if missing or unexpected:
        problems = ([f"{', '.join(missing)} missing"] if missing else []) + (
            [f"{', '.join(unexpected)} not expected"] if unexpected else [])
        raise UsageError(f"incomplete or foreign counts: {'; '.join(problems)} (expected "
                         f"{', '.join(prefix + key for key in keys)})")
    return entries


def overflow_table(overflow: Dict[int, Tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The overflow entries as one (n, 3) int64 tensor of (row, id, count), by row and id."""
    rows = [torch.stack([torch.full_like(ids, slot), ids, counts], 1) for slot, (ids, counts) in sorted(overflow.items())]
    return torch.cat(rows) if rows else torch.zeros(0, 3, dtype=torch.int64)


def overflow_rows(table: torch.Tensor) -> Dict[int, Tuple[torch.Tensor, torch.Tensor]]:
    """:func:`overflow_table` read back: {row: (ids, counts)}."""
    return {int(slot): (table[table[:, 0] == slot, 1].clone(), table[table[:, 0] == slot, 2].clone())
            for slot in table[:, 0].unique().tolist()}


def saved_ring(state_dict: Mapping, prefix: str = ""):
    """The (uint8 ring, overflow rows) of a checked saved window; a checkpoint from before the
    one-byte ring (an int32 ring, no overflow entry) is converted exactly."""
    ring = state_dict[prefix + "ring"].to("cpu")
    if prefix + "overflow" in state_dict:
        return ring.clone(), overflow_rows(state_dict[prefix + "overflow"].to("cpu"))
    overflow = {}
    for slot in ring.ge(SATURATED).any(1).nonzero().squeeze(1).tolist():
        ids = ring[slot].ge(SATURATED).nonzero().squeeze(1)
        overflow[slot] = (ids, ring[slot, ids].to(torch.int64))
    return ring.clamp(max=SATURATED).to(torch.uint8), overflow


def _check_tensor(name: str, value, dtype: torch.dtype, shape: Optional[Tuple[int, ...]] = None):
    """A saved tensor of the dtype the counters write (and of ``shape``), with no negative entry
    (counts, and the window's metadata, are never negative)."""
    if not isinstance(value, torch.Tensor):
        raise UsageError(f"{name} is a {type(value).__name__}, not a tensor")
    if value.dtype != dtype:
        raise UsageError(f"{name} has dtype {value.dtype}, expected {dtype}")
    if shape is not None and tuple(value.shape) != tuple(shape):
        raise UsageError(f"{name} has shape {tuple(value.shape)}, expected {tuple(shape)}")
    if value.numel() and int(value.min()) < 0:
        raise UsageError(f"{name} has negative entries ({int((value < 0).sum())} of {value.numel()})")


def ring_totals(ring: torch.Tensor, overflow: Mapping) -> Tuple[torch.Tensor, torch.Tensor]:
    """The exact column sums (int64) of a ring and its overflow rows, and which rows are non-empty
    (bool), a few rows at a time: summing a ring at once makes an int64 copy of all of it."""
    sums = torch.zeros(ring.size(1), dtype=torch.int64)
    filled = []
    for rows in ring.split(64):
        sums += rows.sum(0)
        filled.append(rows.ne(0).any(1))
    for ids, counts in overflow.values():
        sums.index_add_(0, ids, counts - SATURATED)
    return sums, torch.cat(filled) if filled else torch.zeros(0, dtype=torch.bool)


def _check_overflow(name: str, table, ring: torch.Tensor, ring_name: str):
    """The overflow table: (row, id, count) entries inside the ring, each count >= 255, one per
    ring entry that reads 255 and none elsewhere."""
    _check_tensor(name, table, torch.int64)
    if table.dim() != 2 or table.size(1) != 3:
        raise UsageError(f"{name} has shape {tuple(table.shape)}, expected (entries, 3)")
    rows, ids, counts = table.unbind(1)
    if table.numel() and (int(rows.max()) >= ring.size(0) or int(ids.max()) >= ring.size(1)):
        raise UsageError(f"{name} has entries outside {ring_name}'s {ring.size(0)} x {ring.size(1)} counts")
    if table.numel() and int(counts.min()) < SATURATED:
        raise UsageError(f"{name} holds a count below {SATURATED} (those are kept in {ring_name})")
    marked = sum(int(part.eq(SATURATED).sum()) for part in ring.split(64))
    distinct = (rows * ring.size(1) + ids).unique().numel()
    if marked != table.size(0) or distinct != table.size(0) or not ring[rows, ids].eq(SATURATED).all():
        raise UsageError(f"{name} does not list exactly the entries of {ring_name} that read {SATURATED}")


def _check_vocabulary(name: str, size: int, vocab_size: int):
    if size != vocab_size:
        raise UsageError(f"{name} counts a vocabulary of {size} tokens, the dictionary has {vocab_size}")


def check_window_state(state_dict: Mapping, vocab_size: int, prefix: str = "",
                       saved_after: Optional[int] = None) -> Tuple[int, int, int]:
    """Checks a saved :class:`RareTokenWindow` (``ring``, ``overflow``, ``counts``, ``current``,
    ``meta`` under ``prefix``; or the int32 ``ring`` without ``overflow`` of earlier versions) against the dictionary and against itself; returns (window, update_index,
    recorded). Raises :class:`UsageError` naming the entry and the failed check.

    The checks are invariants of every state that :meth:`RareTokenWindow.start_update`,
    :meth:`~RareTokenWindow.resize` and loading leave: the running sum is the ring plus the open
    update; the ring row of the open update is empty (``start_update`` clears it); only the rows of
    the ``recorded - 1`` updates before the open one hold counts (the finished updates in the
    window; an update number that goes back renumbers them); nothing is counted before the first
    update. ``saved_after``: the updates the checkpoint was saved after, which the open update
    equals (or exceeds by one, after a skipped update such as an fp16 overflow).
    """
    int32_format = prefix + "ring" in state_dict and prefix + "overflow" not in state_dict and \
        getattr(state_dict[prefix + "ring"], "dtype", None) == torch.int32
    entries = counter_entries(state_dict, prefix, RareTokenWindow._KEYS_INT32 if int32_format else RareTokenWindow._KEYS)
    ring, counts, current, meta = (entries[key] for key in RareTokenWindow._KEYS_INT32)
    ring_name, overflow_name, counts_name, current_name, meta_name = (prefix + key for key in RareTokenWindow._KEYS)
    _check_tensor(meta_name, meta, torch.int64, (3,))
    window, update_index, recorded = (int(v) for v in meta.tolist())
    _check_tensor(ring_name, ring, torch.int32 if int32_format else torch.uint8)
    if ring.dim() != 2:
        raise UsageError(f"{ring_name} has shape {tuple(ring.shape)}, expected (window, {vocab_size})")
    _check_vocabulary(ring_name, ring.size(1), vocab_size)
    if window < 1:
        raise UsageError(f"{meta_name} says a window of {window} updates (at least 1)")
    if ring.size(0) != window:
        raise UsageError(f"{meta_name} says a window of {window} updates, but {ring_name} has {ring.size(0)} rows")
    for name, value in ((counts_name, counts), (current_name, current)):
        _check_tensor(name, value, torch.int64, (vocab_size,))
    if not int32_format:
        _check_overflow(overflow_name, entries["overflow"], ring, ring_name)
    ring, overflow = saved_ring(state_dict, prefix)
    ring_sums, filled = ring_totals(ring, overflow)
    if not torch.equal(counts, ring_sums + current):
        raise UsageError(f"{counts_name} is not the sum of {ring_name} and {current_name}")
    if recorded > window or (update_index == 0) != (recorded == 0):
        raise UsageError(f"{meta_name} says update {update_index} with {recorded} updates recorded (expected "
                         f"1 <= recorded <= the window of {window} from update 1 on, 0 before)")
    if update_index == 0:
        if counts.any():
            raise UsageError(f"{counts_name} holds counts before the first update ({meta_name} says update 0)")
        return window, update_index, recorded
    _check_filled_rows(filled, ring_name, meta_name, update_index, recorded)
    if saved_after is not None and update_index not in (saved_after, saved_after + 1):
        raise UsageError(f"{meta_name} says update {update_index}, but the checkpoint was saved after {saved_after} "
                         f"updates (expected update {saved_after}, or {saved_after + 1} after a skipped update)")
    return window, update_index, recorded


def _check_filled_rows(filled: torch.Tensor, ring_name: str, meta_name: str, update_index: int, recorded: int):
    """The non-empty rows of a ring (``filled``, bool) are rows of the ``recorded - 1`` finished
    updates before the open ``update_index``, and the open update's row is empty."""
    window = filled.numel()
    open_row = update_index % window
    if filled[open_row]:
        raise UsageError(f"row {open_row} of {ring_name}, the row of the update being counted (update "
                         f"{update_index} in {meta_name}), is not empty")
    finished = int(filled.sum())
    if finished > recorded - 1:
        raise UsageError(f"{ring_name} holds {finished} finished updates, but {meta_name} says {recorded} updates "
                         f"recorded (the open one and at most {recorded - 1} finished)")
    held = torch.zeros(window, dtype=torch.bool)
    held[(update_index - torch.arange(1, recorded)) % window] = True
    stray = (filled & ~held).nonzero().flatten().tolist()
    if stray:
        span = (f"the rows of updates {update_index - recorded + 1} to {update_index - 1}" if recorded > 1
                else "no row")
        raise UsageError(f"row {stray[0]} of {ring_name} holds counts, but {meta_name} says update {update_index} "
                         f"with {recorded} updates recorded: {span} (mod {window}) may hold finished counts")


def check_cumulative_state(state_dict: Mapping, vocab_size: int, prefix: str = ""):
    """Checks a saved :class:`CumulativeCounts` (``counts`` under ``prefix``): non-negative
    int64 counts, one per dictionary entry. Raises :class:`UsageError` naming the failed check."""
    name = prefix + "counts"
    counts = counter_entries(state_dict, prefix, CumulativeCounts._KEYS)["counts"]
    _check_tensor(name, counts, torch.int64)
    if counts.dim() != 1:
        raise UsageError(f"{name} has shape {tuple(counts.shape)}, expected ({vocab_size},)")
    _check_vocabulary(name, counts.numel(), vocab_size)


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
