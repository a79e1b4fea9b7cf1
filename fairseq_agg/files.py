"""Files that are never half-written, never written over an input, and leave no debris.

Imports neither torch nor fairseq. Every output of the plugin's commands goes through here:

* :func:`atomic_output` / :func:`atomic_path`: a file written under the temporary name
  ``.NAME.<pid>.<random>.tmp`` in the destination's directory, flushed to disk and renamed over the
  destination only when complete.
* :func:`atomic_directory`: a directory of files (``fairseq-agg-analyze``'s report) built as
  ``.NAME.new-<pid>.tmp`` beside the destination and swapped in as a whole (the previous one goes
  through ``.NAME.old-<pid>.tmp``); entries of the previous directory that are not the report's
  files are carried over.
* Debris of a killed process: before an output is written, the temporaries of that output whose
  process is gone are removed, and a killed directory swap is undone (:func:`atomic_directory`).
* A full disk, quota or file-size limit (ENOSPC, EDQUOT, EFBIG) while writing is a
  :class:`~fairseq_agg.errors.UsageError` in one line; the previous output is kept.
* :func:`check_output_path` / :func:`check_output_directory`: an output file / directory checked
  before any work (a regular file / a directory or nothing, writable, never one of the inputs).
* :func:`irregular_file_kind`: what a path that is no regular file is, for one-line refusals of
  inputs and outputs.
"""
import contextlib
import errno
import logging
import os
import re
import stat
import tempfile

from fairseq_agg.errors import UsageError, exception_chain

logger = logging.getLogger(__name__)

# what a write that ran out of room raises, and how the refusal names it
_FULL_DISK = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file size limit exceeded",
}

# the temporaries this process is writing now: a temporary named with this process's pid that is
# not among them was left by a killed process that had the same pid (pids are reused)
_writing = set()


# ----------------------------------------------------------------------------------------------
# what a path is


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))


def irregular_file_kind(path):
    """What ``path`` is when it exists and is no regular file (``"a FIFO"``, ``"a symbolic link to
    a directory"``); None for a regular file (or a link to one) and for a missing path."""
    try:
        mode = os.stat(path).st_mode  # follows links: a link to a FIFO is read and written as one
    except (OSError, ValueError):
        return None
    if stat.S_ISREG(mode):
        return None
    kind = next((name for is_kind, name in _KINDS if is_kind(mode)), "a special file")
    return f"a symbolic link to {kind}" if os.path.islink(path) else kind


# ----------------------------------------------------------------------------------------------
# checks before any work


def check_output_path(path, inputs=(), flag="--output"):
    """Refuses, before any work, an output that is a directory or another file that is not a
    regular one (a device, FIFO or socket), sits in a missing or unwritable directory, or is one of
    the inputs."""
    if not path:
        raise UsageError(f"{flag} must name a file, got an empty path")
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path} is a directory; name a file")
    kind = irregular_file_kind(path)
    if kind is not None:  # renaming over it would replace the device node, or write to no file at all
        raise UsageError(f"{flag} {path}: not a regular file ({kind}); name a regular file")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise UsageError(f"{flag} {path}: the directory {directory} does not exist")
    if not os.access(directory, os.W_OK):
        raise UsageError(f"{flag} {path}: the directory {directory} is not writable")
    for item in inputs:
        if os.path.exists(item) and os.path.exists(path) and os.path.samefile(item, path):
            raise UsageError(f"{flag} {path} is one of the inputs; it would be overwritten")


def check_output_directory(path, names=(), inputs=(), flag="--out"):
    """Refuses, before any work, an output directory that :func:`atomic_directory` could not
    replace: an empty path, a file, a path that cannot be created (missing directories are created
    only when the outputs are written), a mount point, the current directory or one holding it, a
    directory whose parent is not writable, or one in which one of the files ``names`` is no
    regular file or one of the inputs."""
    if not path:
        raise UsageError(f"{flag} must name a directory, got an empty path")
    if os.path.exists(path) and not os.path.isdir(path):
        kind = irregular_file_kind(path)
        if kind is None:
            raise UsageError(f"{flag} {path} is a file; name a directory")
        raise UsageError(f"{flag} {path}: not a directory ({kind}); name a directory")
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise UsageError(f"{flag} {path}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: the directory {existing} is not writable")
    if not os.path.isdir(path):
        return
    target = os.path.realpath(path)
    if os.path.ismount(target):
        raise UsageError(f"{flag} {path} is a mount point, which cannot be replaced; name a directory inside it")
    with contextlib.suppress(OSError):  # a deleted current directory holds nothing
        here = os.getcwd()
        if here == target or here.startswith(target.rstrip(os.sep) + os.sep):
            raise UsageError(f"{flag} {path} is or holds the current directory, and replacing it as a whole "
                             "would leave this shell in a removed directory; name another directory")
    parent = os.path.dirname(target)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: the directory {parent} is not writable "
                         f"(the new {os.path.basename(target)} is built in it and swapped in)")
    for name in names:
        check_output_path(os.path.join(path, name), inputs=inputs, flag=flag)


# ----------------------------------------------------------------------------------------------
# a full disk, in one line


def _full_disk_errno(error):
    """The ENOSPC / EDQUOT / EFBIG behind ``error``, or None. torch.save reports a failed write to
    a Python file as a RuntimeError raised while handling the file's OSError, so the chain of
    causes and contexts is searched."""
    return next((cause.errno for cause in exception_chain(error)
                 if isinstance(cause, OSError) and cause.errno in _FULL_DISK), None)


@contextlib.contextmanager
def _full_disk_in_one_line(target, existed):
    """A write to ``target`` that runs out of room becomes a UsageError saying what is kept."""
    try:
        yield
    except UsageError:
        raise
    except Exception as error:
        code = _full_disk_errno(error)
        if code is None:
            raise
        kept = f"the previous {target} is kept" if existed else f"{target} was not written"
        raise UsageError(f"{_FULL_DISK[code]} writing {target}; {kept}") from error


def _sync_file(path):
    """Flushes a finished file to disk before it is renamed into place (a crash must not leave an
    empty file under the output's name); a network file system may only report a full disk here."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_directory(directory):
    """Makes a rename in ``directory`` durable where the file system can sync a directory."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ----------------------------------------------------------------------------------------------
# temporaries of killed processes


def _writer_alive(pid, temporary):
    """Whether the process that named ``temporary`` after itself may still be writing it."""
    if pid == os.getpid():
        return temporary in _writing
    if pid <= 0:  # no process of ours: leave it alone
        return True
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # another user's process, or no pid at all: leave it alone
        return True
    return True


def dead_writers(directory, pattern):
    """(pid, name) of the entries of ``directory`` whose names fully match ``pattern`` (group 1:
    the pid of the process that wrote them) and whose process is gone: the debris of killed
    processes, for every temporary named after its writer's pid."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    dead = []
    for name in names:
        match = pattern.fullmatch(name)
        if match and not _writer_alive(int(match.group(1)), os.path.join(directory, name)):
            dead.append((int(match.group(1)), name))
    return dead


def temporary_file_pattern(name_pattern):
    """The names of :func:`atomic_path`'s temporaries for outputs whose base names fully match the
    regular expression ``name_pattern`` (group 1: the writer's pid). mkstemp's random part holds no
    dot, so the temporaries of "a.pt" and "a.pt.1" never mix."""
    return re.compile(r"\." + name_pattern + r"\.(\d+)\.[a-z0-9_]+\.tmp")


def remove_dead_temporaries(directory, pattern):
    """Removes the regular files of ``directory`` whose names match ``pattern`` (see
    :func:`temporary_file_pattern`) and whose writers are gone."""
    for _, name in dead_writers(directory, pattern):
        temporary = os.path.join(directory, name)
        with contextlib.suppress(OSError):
            if stat.S_ISREG(os.lstat(temporary).st_mode):
                os.remove(temporary)


def remove_stale_temporaries(path):
    """Removes the temporary files of ``path`` (see :func:`atomic_path`) left by killed processes."""
    remove_dead_temporaries(os.path.dirname(os.path.abspath(path)),
                            temporary_file_pattern(re.escape(os.path.basename(path))))


# ----------------------------------------------------------------------------------------------
# one file


@contextlib.contextmanager
def atomic_output(path, mode="wb", inputs=(), flag="--output"):
    """Opens a temporary file beside ``path`` and renames it to ``path`` when the block succeeds.

    The destination is checked first (:func:`check_output_path`); on any error the temporary file
    is removed, so a reader sees either the old file or the complete new one. Use it for files and
    for libraries that write to a file object (``torch.save``, ``savefig``): their failed writes
    surface as the OSError with its errno, which a full disk needs (:func:`atomic_path`).
    """
    with atomic_path(path, inputs=inputs, flag=flag) as tmp:
        with open(tmp, mode) as handle:
            yield handle


def _new_file_mode():
    umask = os.umask(0)  # the only way to read the umask is to set it
    os.umask(umask)
    return 0o666 & ~umask


@contextlib.contextmanager
def atomic_path(path, inputs=(), flag="--output"):
    """A temporary path ``.NAME.<pid>.<random>.tmp`` in ``path``'s directory, renamed to ``path``
    when the block succeeds.

    First the destination is checked (:func:`check_output_path`) and the temporaries of ``path``
    left by killed processes are removed. A write that runs out of room (ENOSPC, EDQUOT, EFBIG) is
    a UsageError in one line; on any error the temporary file is removed and the previous file kept.
    """
    check_output_path(path, inputs=inputs, flag=flag)
    remove_stale_temporaries(path)
    directory = os.path.dirname(os.path.abspath(path))
    existed = os.path.exists(path)
    with _full_disk_in_one_line(path, existed):
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.{os.getpid()}.", suffix=".tmp", dir=directory)
        except OSError as e:  # what os.access cannot tell: a read-only file system, root's access checks
            if _full_disk_errno(e) is not None:
                raise
            raise UsageError(f"{flag} {path}: cannot create a file in {directory} ({e.strerror})") from None
        os.close(fd)
        _writing.add(tmp)
        try:
            mode = stat.S_IMODE(os.stat(path).st_mode) if existed else _new_file_mode()
            yield tmp
            _sync_file(tmp)
            # mkstemp makes the file private (0600); the output gets the mode a plain open() would
            # give it, or keeps the mode of the file it replaces (set once written: it may be read-only)
            os.chmod(tmp, mode)
            os.replace(tmp, path)
            _sync_directory(directory)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise
        finally:
            _writing.discard(tmp)


# ----------------------------------------------------------------------------------------------
# a directory of files, replaced as a whole


def _swap_directories(target, pid):
    """The new and the old directory of one swap of ``target`` by process ``pid``, beside it."""
    parent, name = os.path.split(target)
    return os.path.join(parent, f".{name}.new-{pid}.tmp"), os.path.join(parent, f".{name}.old-{pid}.tmp")


def _is_own_file(directory, name, names):
    """Whether the entry ``name`` of ``directory`` is one of the files ``names`` or a temporary
    ``.NAME.*.tmp`` of one (left there by a killed run of a version that wrote them one by one); a
    directory of such a name is not: it belongs to the user."""
    own = name in names or (name.endswith(".tmp") and any(name.startswith(f".{file}.") for file in names))
    return own and not stat.S_ISDIR(os.lstat(os.path.join(directory, name)).st_mode)


def _carry_over(source, destination, names):
    """Moves every entry of ``source`` that is not one of the files ``names`` into ``destination``
    (one rename each, on the same file system; an entry whose name is taken there stays)."""
    for name in os.listdir(source):
        if not _is_own_file(source, name, names) and not os.path.lexists(os.path.join(destination, name)):
            os.rename(os.path.join(source, name), os.path.join(destination, name))


def _dissolve(leftover, target, names):
    """Empties the leftover directory of a swap into ``target`` (its own files ``names`` are
    removed, anything else moves into ``target``) and removes it; what cannot move stays, named in
    a warning, for nothing but the files ``names`` is ever deleted."""
    if os.path.islink(leftover) or not os.path.isdir(leftover):
        return
    if os.path.isdir(target):
        _carry_over(leftover, target, names)
    for name in os.listdir(leftover):
        if _is_own_file(leftover, name, names):
            os.remove(os.path.join(leftover, name))
    try:
        os.rmdir(leftover)
    except OSError:
        logger.warning("kept %s: it holds %s, whose names %s already has", leftover,
                       ", ".join(sorted(os.listdir(leftover))), target)


def _undo_swap(target, names, pid):
    """Brings ``target`` back to one complete directory after a swap by ``pid`` that did not finish
    (killed, or failed in this process), from any point of :func:`_swap_in`."""
    new, old = _swap_directories(target, pid)
    if os.path.isdir(old) and not os.path.lexists(target):
        os.rename(old, target)  # stopped between the two renames: the previous directory stays
    for leftover in (old, new):
        _dissolve(leftover, target, names)


def _undo_swaps_of_killed_processes(target, names):
    parent, name = os.path.split(target)
    pattern = re.compile(re.escape(f".{name}.") + r"(?:new|old)-(\d+)\.tmp")
    for pid in sorted({pid for pid, _ in dead_writers(parent, pattern)}):
        _undo_swap(target, names, pid)


def _swap_in(new, target, names):
    """Makes ``new`` the directory ``target``: the entries of ``target`` that are not the files
    ``names`` move into ``new``, ``target`` becomes the old directory, ``new`` becomes ``target``,
    and the old directory is emptied (stragglers into ``target``) and removed."""
    _, old = _swap_directories(target, os.getpid())
    if os.path.isdir(target):
        _carry_over(target, new, names)
        os.rename(target, old)
    os.rename(new, target)
    _sync_directory(os.path.dirname(target))
    _dissolve(old, target, names)


@contextlib.contextmanager
def atomic_directory(path, names, inputs=(), flag="--out"):
    """A new empty directory ``.NAME.new-<pid>.tmp`` beside ``path``, for the files ``names``;
    when the block succeeds it replaces ``path`` as a whole, so a reader sees the previous
    directory or the complete new one, never a mix.

    ``names`` are all the files the command may write: those of the previous directory (and
    temporaries of them) are dropped with it, anything else in it (the user's files and
    directories) is moved into the new one. The swap renames the previous directory to ``.NAME.old-<pid>.tmp`` and the new one to
    ``path``; a swap left by a killed process is undone first (between the two renames: the previous
    directory comes back), and one that fails here is undone before the error is raised. A symbolic
    link to the directory keeps pointing at the replacement. Checks: :func:`check_output_directory`.
    """
    check_output_directory(path, names=names, inputs=inputs, flag=flag)
    target = os.path.realpath(path)
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot create the directory {os.path.dirname(target)} ({e.strerror})") from None
    _undo_swaps_of_killed_processes(target, names)
    existed = os.path.isdir(target)
    new, _ = _swap_directories(target, os.getpid())
    _writing.add(new)
    try:
        with _full_disk_in_one_line(path, existed):
            try:
                os.mkdir(new)
            except OSError as e:
                if _full_disk_errno(e) is not None:
                    raise
                raise UsageError(f"{flag} {path}: cannot create a directory in {os.path.dirname(target)} "
                                 f"({e.strerror})") from None
            yield new
            for name in os.listdir(new):
                _sync_file(os.path.join(new, name))
            _sync_directory(new)
            if existed:  # the mode of the directory it replaces, set once written: it may be read-only
                os.chmod(new, stat.S_IMODE(os.stat(target).st_mode))
            _swap_in(new, target, names)  # moving the user's entries may need a directory block
    except BaseException:
        with contextlib.suppress(OSError):
            _undo_swap(target, names, os.getpid())
        raise
    finally:
        _writing.discard(new)
