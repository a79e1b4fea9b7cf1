"""An invalid choice of one of the plugin's flags as one line, not after fairseq's usage text.

argparse answers ``--coupled-adam-matrices foo`` with fairseq-train's whole usage (about 170
lines) before the line that matters. For the flags of the plugin's components (the fields of the
dataclasses its criteria, models and optimizers register), :func:`report_invalid_choices_in_one_line`
makes the answer read like the plugin's other refusals (:func:`fairseq_agg.errors.check_choice`):
``PROG: error: --FLAG must be one of A, B, got 'foo'``, exit status 2. Other flags, and every
parser that is not a fairseq command's, keep argparse's answer.
"""
import argparse
import dataclasses
import functools
import re

from fairseq.models import MODEL_DATACLASS_REGISTRY, MODEL_REGISTRY
from fairseq.registry import REGISTRIES

from fairseq_agg.errors import flag_name

# argparse's message for a value outside ``choices`` (Lib/argparse.py, _check_value)
_INVALID_CHOICE = re.compile(r"argument (?P<flag>--[\w-]+)(?:/[^:]*)?: invalid choice: (?P<value>.*) \(choose from (?P<choices>.*)\)$")


def from_plugin(cls) -> bool:
    """Whether a class fairseq registered is one of the plugin's components."""
    return cls.__module__.split(".")[0] == "fairseq_agg"


def plugin_dataclasses():
    """The config dataclasses of the components the plugin registers with fairseq."""
    found = []
    for registry in REGISTRIES.values():
        for name, cls in registry["registry"].items():
            config = registry["dataclass_registry"].get(name)
            if from_plugin(cls) and config is not None:
                found.append(config)
    found += [MODEL_DATACLASS_REGISTRY[name] for name, cls in MODEL_REGISTRY.items()
              if from_plugin(cls) and name in MODEL_DATACLASS_REGISTRY]
    return found


def plugin_flags():
    """Every flag the plugin's components add (their dataclass fields as fairseq names them)."""
    return {flag_name(field.name) for config in plugin_dataclasses() for field in dataclasses.fields(config)}


def plugin_criteria_taking(field_name: str):
    """The names of the plugin's registered criteria whose config declares ``field_name``
    (``output_kernel``: the output-layer criteria), sorted; read from fairseq's registry, so that a
    new criterion counts without a list to edit. Call it after ``fairseq_agg.register_with_fairseq()``."""
    registry = REGISTRIES["criterion"]
    configs = {name: registry["dataclass_registry"].get(name) for name, cls in registry["registry"].items()
               if from_plugin(cls)}
    return tuple(sorted(name for name, config in configs.items()
                        if config is not None and any(f.name == field_name for f in dataclasses.fields(config))))


def one_line_choice_error(message: str, flags) -> str:
    """The plugin's wording of argparse's invalid-choice ``message`` for one of ``flags``, or None."""
    found = _INVALID_CHOICE.match(message)
    if found is None or found.group("flag") not in flags:
        return None
    choices = ", ".join(choice.strip().strip("'\"") for choice in found.group("choices").split(","))
    return f"{found.group('flag')} must be one of {choices}, got {found.group('value')}"


def give_one_line_choice_errors(parser: argparse.ArgumentParser):
    """Makes ``parser``'s invalid-choice error of a plugin flag one line (see the module
    docstring); its other errors keep argparse's answer. Idempotent; the flags are read when the
    error happens (every component is registered then)."""
    stock_error = parser.error
    if getattr(stock_error, "_plugin_choices", False):
        return

    def error(message):
        line = one_line_choice_error(message, plugin_flags())
        if line is None:
            stock_error(message)
        parser.exit(2, f"{parser.prog}: error: {line}\n")

    error._plugin_choices = True
    parser.error = error


def report_invalid_choices_in_one_line():
    """Gives the parser of each fairseq command the plugin's invalid-choice error
    (:func:`give_one_line_choice_errors`), and no other parser of the process. fairseq's commands
    (``fairseq-train``, ``fairseq-generate``, ``fairseq-eval-lm``, ``fairseq-validate``,
    ``fairseq-interactive``) parse their flags with ``fairseq.options.parse_args_and_arch``, which
    they call through the module after the plugin is loaded; that function is wrapped.
    Idempotent."""
    from fairseq import options

    fairseq_parse = options.parse_args_and_arch
    if getattr(fairseq_parse, "_plugin_choices", False):
        return

    @functools.wraps(fairseq_parse)
    def parse_args_and_arch(parser, *args, **kwargs):
        give_one_line_choice_errors(parser)
        return fairseq_parse(parser, *args, **kwargs)

    parse_args_and_arch._plugin_choices = True
    options.parse_args_and_arch = parse_args_and_arch
