"""fairseq's checkpoint files: copies that a kill cannot truncate, and a damaged file as one line.

fairseq writes each checkpoint atomically (``torch_persistent_save``: a ``.tmp`` file, then a
rename) but then *copies* it to ``checkpoint_last.pt`` / ``checkpoint_best.pt`` /
``checkpoint_N_M.pt`` with a plain ``PathManager.copy``. A kill during that copy (cluster
preemption) leaves a truncated ``checkpoint_last.pt``, from which the same command used to die
with fairseq's ``EOFError`` traceback. Loading the plugin changes two things, without changing
fairseq's files:

* :func:`make_checkpoint_copies_atomic`: ``PathManager.copy`` of a local file writes a temporary
  file in the destination's directory and renames it over the destination
  (:func:`fairseq_agg.files.atomic_path`), so the destination is the old file or the complete new
  one, and a full disk is one line saying that the previous file is kept.
* :func:`make_checkpoint_saves_one_line`: fairseq's first write of a checkpoint
  (``torch_persistent_save``, to ``NAME.tmp`` then renamed) goes through the same atomic writer,
  so a full disk there is one line too, and no ``NAME.tmp`` is left filling the disk.
* :func:`check_checkpoints_on_load`: every checkpoint fairseq loads goes through torch's safe
  loader (``weights_only=True``, which ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` cannot turn off), and
  one holding objects it refuses is one line naming it; a checkpoint that torch cannot read
  (truncated by an older run, or damaged) is refused in one line naming it and the newest intact
  checkpoint beside it that loads safely, to pass to ``--restore-file``; the path and the
  criterion of the checkpoint loaded last are kept for the plugin's criteria
  (:func:`last_loaded_checkpoint`), whose counts name the file when they refuse it, and its
  criterion state carries the updates it was saved after (:func:`criterion_state_saved_after`),
  which a counting window's update number must match.
"""
import glob
import os
import shutil
import zipfile
from typing import NamedTuple, Optional

import torch

from fairseq_agg.errors import UsageError
from fairseq_agg.fairseq_facts.checkpoint_state import (
    allow_namespace_in_checkpoints, refused_as_unsafe, safe_loads, unsafe_checkpoint,
)
from fairseq_agg.files import atomic_path, remove_dead_temporaries, temporary_file_pattern


class LoadedCheckpoint(NamedTuple):
    path: str
    criterion: Optional[str]  # the fairseq name of the criterion that wrote it (None: unknown)


_last_loaded: Optional[LoadedCheckpoint] = None


def last_loaded_checkpoint() -> Optional[LoadedCheckpoint]:
    """The checkpoint this process loaded last through fairseq (None before any, and on the ranks
    that receive the state by broadcast instead of reading the file)."""
    return _last_loaded


def writing_criterion(state) -> Optional[str]:
    """The fairseq name of the criterion a checkpoint's training run used."""
    cfg = state.get("cfg") if isinstance(state, dict) else None
    criterion = cfg.get("criterion") if cfg is not None and hasattr(cfg, "get") else None
    if criterion is not None and hasattr(criterion, "get") and criterion.get("_name"):
        return str(criterion.get("_name"))
    args = state.get("args") if isinstance(state, dict) else None
    return getattr(args, "criterion", None)


def saved_updates(state) -> Optional[int]:
    """The number of updates a checkpoint's training run had done when it saved it (fairseq's
    ``optimizer_history``), or None when it does not say."""
    try:
        return int(state["optimizer_history"][-1]["num_updates"])
    except (KeyError, IndexError, TypeError, ValueError):
        return None


# the attribute of a loaded checkpoint's criterion state that holds saved_updates of the checkpoint
SAVED_AFTER = "_fairseq_agg_saved_after"


def mark_criterion_state(state):
    """Tags the criterion state of a loaded checkpoint with the updates it was saved after. fairseq's
    Trainer hands that same object to the criterion's ``load_state_dict`` (and, loading on one rank,
    pickles it with its attributes to the others); a plain dict, or no state, takes no tag."""
    criterion_state = state.get("criterion") if isinstance(state, dict) else None
    try:
        setattr(criterion_state, SAVED_AFTER, saved_updates(state))
    except AttributeError:
        pass


def criterion_state_saved_after(criterion_state) -> Optional[int]:
    """The updates the checkpoint of this criterion state was saved after (None: not known)."""
    return getattr(criterion_state, SAVED_AFTER, None)


def atomic_copy(src_path: str, dst_path: str) -> bool:
    """Copies ``src_path`` to ``dst_path`` through a temporary file beside the destination."""
    with atomic_path(dst_path, flag="--save-dir") as tmp:
        shutil.copyfile(src_path, tmp)
    return True


# the temporaries of fairseq's checkpoint copies (checkpoint_last.pt, checkpoint_best.pt, checkpoint_E_U.pt, ...)
CHECKPOINT_TEMPORARY = temporary_file_pattern(r"checkpoint[^/]*\.pt")


def remove_stale_copies(directory: str):
    """Removes the temporary copies that killed processes left in ``directory``; called before a
    run's checkpoint is loaded."""
    remove_dead_temporaries(directory, CHECKPOINT_TEMPORARY)


def make_checkpoint_copies_atomic():
    """Replaces ``fairseq.file_io.PathManager.copy`` for local files by :func:`atomic_copy`
    (remote paths, through iopath, keep fairseq's copy). Idempotent."""
    from fairseq.file_io import PathManager

    fairseq_copy = PathManager.__dict__["copy"].__func__
    if getattr(fairseq_copy, "_atomic", False):
        return

    def copy(src_path: str, dst_path: str, overwrite: bool = False) -> bool:
        if PathManager.path_requires_pathmanager(dst_path):
            return fairseq_copy(src_path, dst_path, overwrite)
        return atomic_copy(src_path, dst_path)  # like fairseq's local copy, it overwrites either way

    copy._atomic = True
    PathManager.copy = staticmethod(copy)


def make_checkpoint_saves_one_line():
    """Replaces ``fairseq.checkpoint_utils.torch_persistent_save`` (which the Trainer calls through
    the module) for local files written synchronously: ``torch.save`` to a file object, as fairseq
    does, inside :func:`fairseq_agg.files.atomic_path`. Asynchronous and remote writes keep
    fairseq's. Idempotent."""
    from fairseq import checkpoint_utils
    from fairseq.file_io import PathManager

    fairseq_save = checkpoint_utils.torch_persistent_save
    if getattr(fairseq_save, "_atomic", False):
        return

    def torch_persistent_save(obj, filename, async_write: bool = False):
        if async_write or PathManager.path_requires_pathmanager(filename):
            return fairseq_save(obj, filename, async_write=async_write)
        with atomic_path(filename, flag="--save-dir") as tmp, open(tmp, "wb") as f:
            torch.save(obj, f)

    torch_persistent_save._atomic = True
    checkpoint_utils.torch_persistent_save = torch_persistent_save


def newest_intact_checkpoint(directory: str, exclude: str) -> Optional[str]:
    """The intact ``checkpoint*.pt`` in ``directory`` (other than ``exclude``) that loads safely
    and holds the most updates; among equals a numbered one (``checkpoint_best.pt`` is a copy,
    which may be older than its mtime says), then the newest. None when no file qualifies."""
    ranked = []
    for path in glob.glob(os.path.join(glob.escape(directory), "checkpoint*.pt")):
        if os.path.abspath(path) == os.path.abspath(exclude) or not readable_checkpoint(path):
            continue
        state = safely_loaded(path)
        if state is None:  # not a checkpoint torch's safe loader reads: never proposed
            continue
        updates = saved_updates(state)
        is_copy = os.path.basename(path) in ("checkpoint_best.pt", "checkpoint_last.pt")
        ranked.append((-1 if updates is None else updates, not is_copy, os.path.getmtime(path), path))
    return max(ranked)[-1] if ranked else None


def safely_loaded(path: str) -> Optional[dict]:
    """The checkpoint as torch's safe loader reads it (memory-mapped), or None if it reads no dict:
    the save directory may hold any file named checkpoint*.pt, and unpickling one must not run its
    code."""
    allow_namespace_in_checkpoints()
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception:
        return None
    return state if isinstance(state, dict) else None


def checkpoint_updates(path: str) -> int:
    """The number of updates a checkpoint was saved after; -1 if it does not say, or if torch's
    safe loader does not read it (:func:`safely_loaded`)."""
    state = safely_loaded(path)
    if state is None:
        return -1
    updates = saved_updates(state)
    return -1 if updates is None else updates


def readable_checkpoint(path: str) -> bool:
    """Whether ``path`` is a complete torch archive (its zip directory reads and its entries'
    checksums match) -- what a truncated or overwritten file is not."""
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.testzip() is None
    except (OSError, zipfile.BadZipFile, EOFError, ValueError):
        return False


def check_checkpoints_on_load():
    """Wraps fairseq's ``checkpoint_utils.load_checkpoint_to_cpu`` (which the Trainer calls through
    the module) so that an unreadable checkpoint is a :class:`UsageError` and the loaded one is
    remembered (:func:`last_loaded_checkpoint`). Idempotent."""
    from fairseq import checkpoint_utils

    fairseq_load = checkpoint_utils.load_checkpoint_to_cpu
    if getattr(fairseq_load, "_checked", False):
        return

    def load_checkpoint_to_cpu(path, *args, **kwargs):
        global _last_loaded
        remove_stale_copies(os.path.dirname(os.path.abspath(path)))
        try:
            with safe_loads():
                state = fairseq_load(path, *args, **kwargs)
        except Exception as error:  # a damaged file fails in many ways (EOFError, IndexError, ...)
            if os.path.isfile(path) and not readable_checkpoint(path):
                raise UsageError(damaged_checkpoint_message(path)) from error
            if refused_as_unsafe(error):
                raise unsafe_checkpoint(path) from None
            raise
        _last_loaded = LoadedCheckpoint(os.path.abspath(path), writing_criterion(state))
        mark_criterion_state(state)
        return state

    load_checkpoint_to_cpu._checked = True
    checkpoint_utils.load_checkpoint_to_cpu = load_checkpoint_to_cpu


def damaged_checkpoint_message(path: str) -> str:
    size = os.path.getsize(path)
    intact = newest_intact_checkpoint(os.path.dirname(os.path.abspath(path)), exclude=path)
    advice = (f"resume from the newest intact one with --restore-file {intact}" if intact
              else "no intact checkpoint that loads safely is beside it; remove it to start afresh")
    return f"checkpoint {path} is truncated or damaged ({size} bytes, not a complete torch archive): {advice}"
