"""Argument checks shared by the method objects of :mod:`fairseq_agg.ops`.

Every message names the fairseq flag an argument corresponds to (``window`` of AGG is
``--agg-window``), so a refused flag and a refused library argument read the same. Numbers go
through :func:`fairseq_agg.errors.check_number` (nan and inf refused).
"""
import numbers

from fairseq_agg.errors import UsageError, check_number, flag_name, plain_value


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
