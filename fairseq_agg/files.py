"""Files that are never half-written and never written over an input.

Imports neither torch nor fairseq. Every output of the plugin's commands goes through here:

* :func:`atomic_output` / :func:`atomic_path`: a file written under a temporary name in the
  destination's directory and renamed over the destination only when complete.
* :func:`check_output_path` / :func:`check_output_directory`: an output file / directory checked
  before any work (not a directory / file, writable, never one of the inputs); a refusal is a
  :class:`~fairseq_agg.errors.UsageError`.
"""
import contextlib
import os
import stat
import tempfile

from fairseq_agg.errors import UsageError


@contextlib.contextmanager
def atomic_output(path, mode="wb", inputs=(), flag="--output"):
    """Opens a temporary file beside ``path`` and renames it to ``path`` when the block succeeds.

    The destination is checked first (:func:`check_output_path`); on any error the temporary file
    is removed, so a reader sees either the old file or the complete new one. Use it for files;
    callers that hand a path to a library (``torch.save``, ``savefig``) use :func:`atomic_path`.
    """
    with atomic_path(path, inputs=inputs, suffix=os.path.splitext(path)[1], flag=flag) as tmp:
        with open(tmp, mode) as handle:
            yield handle


def _new_file_mode():
    umask = os.umask(0)  # the only way to read the umask is to set it
    os.umask(umask)
    return 0o666 & ~umask


@contextlib.contextmanager
def atomic_path(path, inputs=(), suffix="", flag="--output"):
    """A temporary path in ``path``'s directory, renamed to ``path`` when the block succeeds."""
    check_output_path(path, inputs=inputs, flag=flag)
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=suffix + ".tmp", dir=directory)
    except OSError as e:  # what os.access cannot tell: a read-only file system, root's access checks
        raise UsageError(f"{flag} {path}: cannot create a file in {directory} ({e.strerror})") from None
    os.close(fd)
    try:
        # mkstemp makes the file private (0600); the output gets the mode a plain open() would give
        # it (or keeps the mode of the file it replaces)
        os.chmod(tmp, stat.S_IMODE(os.stat(path).st_mode) if os.path.exists(path) else _new_file_mode())
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def check_output_path(path, inputs=(), flag="--output"):
    """Refuses, before any work, an output that is a directory, sits in a missing or unwritable
    directory, or is one of the inputs."""
    if not path:
        raise UsageError(f"{flag} must name a file, got an empty path")
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path} is a directory; name a file")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise UsageError(f"{flag} {path}: the directory {directory} does not exist")
    if not os.access(directory, os.W_OK):
        raise UsageError(f"{flag} {path}: the directory {directory} is not writable")
    for item in inputs:
        if os.path.exists(item) and os.path.exists(path) and os.path.samefile(item, path):
            raise UsageError(f"{flag} {path} is one of the inputs; it would be overwritten")


def check_output_directory(path, names=(), inputs=(), flag="--out"):
    """Refuses, before any work, an output directory that is an empty path or a file, or that
    cannot be created (missing directories are created only when the outputs are written), or
    in which one of the files ``names`` would be one of the inputs."""
    if not path:
        raise UsageError(f"{flag} must name a directory, got an empty path")
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"{flag} {path} is a file; name a directory")
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise UsageError(f"{flag} {path}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: the directory {existing} is not writable")
    if os.path.isdir(path):
        for name in names:
            check_output_path(os.path.join(path, name), inputs=inputs, flag=flag)
