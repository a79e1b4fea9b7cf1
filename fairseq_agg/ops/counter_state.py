"""The saved state of the token counters of :mod:`fairseq_agg.ops.counting`: its format (the
window's one-byte ring and its overflow table) and the checks a saved state passes before it is
loaded, so that a damaged checkpoint is refused in one line instead of failing at a later update.

Every check below holds for each state the counters write (whatever the history of updates,
resizes and restarts), so a state that fails one was damaged or edited.
"""
from typing import Dict, Mapping, Optional, Sequence, Tuple

import torch

from fairseq_agg.errors import UsageError

SATURATED = 255  # a ring entry of 255 means: the count is in the overflow table
WINDOW_KEYS = ("ring", "overflow", "counts", "current", "meta")  # a RareTokenWindow's entries
WINDOW_KEYS_INT32 = ("ring", "counts", "current", "meta")  # the format before the one-byte ring
CUMULATIVE_KEYS = ("counts",)  # a CumulativeCounts' entries


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
    """Checks a saved :class:`~fairseq_agg.ops.counting.RareTokenWindow` (``ring``, ``overflow``,
    ``counts``, ``current``, ``meta`` under ``prefix``; or the int32 ``ring`` without ``overflow``
    of earlier versions) against the dictionary and against itself; returns (window,
    update_index, recorded). Raises :class:`UsageError` naming the entry and the failed check.

    The checks are invariants of every state that ``RareTokenWindow.start_update``, ``resize``
    and loading leave: the running sum is the ring plus the open
    update; the ring row of the open update is empty (``start_update`` clears it); only the rows of
    the ``recorded - 1`` updates before the open one hold counts (the finished updates in the
    window; an update number that goes back renumbers them); nothing is counted before the first
    update. ``saved_after``: the updates the checkpoint was saved after, which the open update
    equals (or exceeds by one, after a skipped update such as an fp16 overflow).
    """
    int32_format = prefix + "ring" in state_dict and prefix + "overflow" not in state_dict and \
        getattr(state_dict[prefix + "ring"], "dtype", None) == torch.int32
    entries = counter_entries(state_dict, prefix, WINDOW_KEYS_INT32 if int32_format else WINDOW_KEYS)
    ring, counts, current, meta = (entries[key] for key in WINDOW_KEYS_INT32)
    ring_name, overflow_name, counts_name, current_name, meta_name = (prefix + key for key in WINDOW_KEYS)
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
    """Checks a saved :class:`~fairseq_agg.ops.counting.CumulativeCounts` (``counts`` under ``prefix``): non-negative
    int64 counts, one per dictionary entry. Raises :class:`UsageError` naming the failed check."""
    name = prefix + "counts"
    counts = counter_entries(state_dict, prefix, CUMULATIVE_KEYS)["counts"]
    _check_tensor(name, counts, torch.int64)
    if counts.dim() != 1:
        raise UsageError(f"{name} has shape {tuple(counts.shape)}, expected ({vocab_size},)")
    _check_vocabulary(name, counts.numel(), vocab_size)
