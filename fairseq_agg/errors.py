"""User mistakes as one line, and files that are never half-written.

Imports neither torch nor fairseq, so the command-line tools can use it before their heavy imports.

* :class:`UsageError`: what the plugin raises for a user's mistake (a flag out of range, two flags
  that contradict each other, a missing or unusable file). It is a ``ValueError``, so library
  callers catch it as before. In a command-line process it is printed as
  ``PROG: error: MESSAGE`` with exit status 2 (argparse's convention, which fairseq's CLIs follow):
  :func:`report_usage_errors_in_one_line` installs that for ``fairseq-train`` and friends, where
  the plugin's checks run inside fairseq's own ``main``. A genuine bug keeps its traceback.
* :func:`check_number`: the one range check every numeric flag goes through (nan and inf included).
* :func:`atomic_output`: a file written under a temporary name in the destination's directory and
  renamed over the destination only when complete.
* :func:`check_output_path` / :func:`check_output_directory`: an output file / directory checked
  before any work (not a directory / file, writable, never one of the inputs).
"""
import contextlib
import math
import os
import stat
import sys
import tempfile


class UsageError(ValueError):
    """A user's mistake, reported in one line naming the flag or file and what is allowed."""


class InstallError(UsageError, ImportError):
    """An environment the plugin cannot run in (a dependency built for another version), found
    when the plugin is imported: an ImportError for importers, one line with exit 2 in a CLI."""


def flag_name(name: str) -> str:
    """``agg_alpha`` -> ``--agg-alpha``; names that already look like flags are kept."""
    return name if name.startswith("-") else "--" + name.replace("_", "-")


def plain_value(value):
    """A flag's value as the user wrote it: fairseq's ChoiceEnum members as their string value,
    anything else as it is."""
    return getattr(value, "value", value)


def check_number(name, value, low=None, high=None, low_open=False, high_open=False, integer=False):
    """Refuses nan, inf (unless a bound is infinite) and values outside [low, high].

    ``low_open`` / ``high_open`` exclude the bound itself. Returns the value, so configs can write
    ``self.alpha = check_number("agg_alpha", cfg.agg_alpha, 0, 1, low_open=True)``.
    """
    def show(bound):
        return str(int(bound)) if float(bound).is_integer() and abs(bound) < 1e15 else f"{bound:g}"

    lo = "(" if low_open else "["
    hi = ")" if high_open else "]"
    if low is not None and high is not None:
        allowed = f"in {lo}{show(low)}, {show(high)}{hi}"
    elif low is not None:
        allowed = f"{'>' if low_open else '>='} {show(low)}"
    elif high is not None:
        allowed = f"{'<' if high_open else '<='} {show(high)}"
    else:
        allowed = "a finite number"
    if integer:
        allowed = "an integer " + allowed
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise UsageError(f"{flag_name(name)} must be {allowed}, got {value!r}") from None
    bad = math.isnan(number) or math.isinf(number)
    if low is not None:
        bad = bad or number < low or (low_open and number == low)
    if high is not None:
        bad = bad or number > high or (high_open and number == high)
    if integer and not bad:
        bad = number != int(number)
    if bad:
        why = " (not a finite number)" if math.isnan(number) or math.isinf(number) else ""
        raise UsageError(f"{flag_name(name)} must be {allowed}, got {value}{why}")
    return value


def report_usage_errors_in_one_line(prog=None):
    """Makes an uncaught :class:`UsageError` print ``PROG: error: MESSAGE`` and exit with status 2.

    For processes whose ``main`` the plugin does not own (``fairseq-train``, ``fairseq-generate``,
    ``fairseq-eval-lm``): their user-dir import runs before the plugin's checks can fail. Every
    other exception goes to the previous hook unchanged. Idempotent.
    """
    previous = sys.excepthook
    if getattr(previous, "_reports_usage_errors", False):
        return

    def hook(exc_type, exc, tb):
        if isinstance(exc, UsageError):
            name = prog or os.path.basename(sys.argv[0] or "fairseq") or "fairseq"
            sys.stdout.flush()
            print(f"{name}: error: {exc}", file=sys.stderr)
            sys.exit(2)
        previous(exc_type, exc, tb)

    hook._reports_usage_errors = True
    sys.excepthook = hook


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
