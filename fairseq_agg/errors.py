"""User mistakes as one line: the error the plugin raises, and the argument checks that raise it.

Imports neither torch nor fairseq, so the command-line tools can use it before their heavy imports.

* :class:`UsageError`: what the plugin raises for a user's mistake (a flag out of range, two flags
  that contradict each other, a missing or unusable file). It is a ``ValueError``, so library
  callers catch it as before. In a command-line process it is printed as
  ``PROG: error: MESSAGE`` with exit status 2 (argparse's convention, which fairseq's CLIs follow):
  :func:`report_usage_errors_in_one_line` installs that for ``fairseq-train`` and friends, where
  the plugin's checks run inside fairseq's own ``main``, when the plugin registers with fairseq.
  A genuine bug keeps its traceback.
* :func:`check_number`, :func:`check_integer`, :func:`check_choice`: the checks every flag and
  every library argument goes through (nan and inf included). Each message names the fairseq flag
  the argument corresponds to (``window`` of AGG is ``--agg-window``), so a refused flag and a
  refused library argument read the same.

Files that are never half-written and never over an input: :mod:`fairseq_agg.files`.
"""
import math
import numbers
import os
import sys


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


def check_integer(name, value, low=None, high=None):
    """An integer within [low, high]; a non-integral number is refused with "an integer" in the message."""
    integral = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    return int(check_number(name, value, low, high, integer=not integral))


def check_choice(name, value, choices):
    """One of ``choices`` (fairseq's ChoiceEnum members are compared by their value)."""
    value = str(plain_value(value))
    if value not in choices:
        raise UsageError(f"{flag_name(name)} must be one of {', '.join(choices)}, got {value!r}")
    return value


def exception_chain(exc):
    """``exc``, then the exceptions it was raised from or while handling, innermost last."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def usage_error_behind(exc):
    """``exc`` if it is a :class:`UsageError`, else the UsageError it was raised while handling.

    fairseq re-raises whatever fails while it loads a checkpoint's model and criterion state as a
    plain ``Exception("Cannot load model parameters from checkpoint ...")``; the plugin's reason
    (a damaged AGG state, a vocabulary that does not match) is that exception's ``__context__``.
    """
    return next((error for error in exception_chain(exc) if isinstance(error, UsageError)), None)


def raised_within(tb, packages) -> bool:
    """Whether the traceback ``tb`` passes through a module of one of ``packages`` (top-level names)."""
    while tb is not None:
        if str(tb.tb_frame.f_globals.get("__name__", "")).split(".")[0] in packages:
            return True
        tb = tb.tb_next
    return False


def print_usage_error(error):
    """Prints ``PROG: error: MESSAGE`` on stderr, as argparse does, for a UsageError that ends a command."""
    name = os.path.basename(sys.argv[0] or "fairseq") or "fairseq"
    sys.stdout.flush()
    print(f"{name}: error: {error}", file=sys.stderr)


def report_usage_errors_in_one_line(within):
    """Makes an uncaught :class:`UsageError` raised inside the code of ``within`` (top-level
    package names: fairseq's, for its commands) print ``PROG: error: MESSAGE`` and exit with status 2.

    For processes whose ``main`` the plugin does not own (``fairseq-train``, ``fairseq-generate``,
    ``fairseq-eval-lm``): their user-dir import runs before the plugin's checks can fail. So does
    an exception raised while handling one (:func:`usage_error_behind`). Every other exception, a
    UsageError of the program's own code included, goes to the previous hook unchanged. Idempotent.
    """
    previous = sys.excepthook
    if getattr(previous, "_reports_usage_errors", False):
        return

    def hook(exc_type, exc, tb):
        usage_error = usage_error_behind(exc)
        if usage_error is not None and raised_within(tb, within):
            print_usage_error(usage_error)
            sys.exit(2)
        previous(exc_type, exc, tb)

    hook._reports_usage_errors = True
    sys.excepthook = hook
