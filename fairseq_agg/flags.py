"""The command-line flags the plugin adds to fairseq, with the defaults fairseq really uses.

fairseq's ``--help`` shows a criterion's or an architecture's options only once it is selected, among
hundreds of its own. This module reads them from fairseq's own argument parser: for each criterion
and architecture of the plugin, the options its stock counterpart does not have, with their defaults
(those an architecture function sets included) and help texts. It is the one source of
``fairseq-agg flags [NAME ...]`` and of the README's flag tables (``fairseq-agg flags --markdown``,
kept in sync by tests/test_readme.py).
"""
import argparse
import textwrap
from typing import List, NamedTuple

from fairseq import options
from fairseq.criterions import CRITERION_REGISTRY
from fairseq.models import ARCH_MODEL_NAME_REGISTRY, ARCH_MODEL_REGISTRY

import fairseq_agg  # noqa: F401  (registers the plugin)

_LM = ["--task", "language_modeling", "--arch", "transformer_lm"]
_MT = ["--task", "translation", "--arch", "transformer"]

# plugin criterion -> (task and architecture to parse it with, the stock criterion it extends);
# a criterion not listed is compared with cross_entropy on a language model
CRITERIA = {
    "cross_entropy_agg": (_LM, "cross_entropy"),
    "augmented_loss": (_LM, "cross_entropy"),
    "cross_entropy_with_stats": (_LM, "cross_entropy"),
    "label_smoothed_cross_entropy_with_stats": (_MT, "label_smoothed_cross_entropy"),
}
# plugin model (also the name of its base architecture) -> (task, the stock architecture it extends)
MODELS = {
    "transformer_lm_mlra": ("language_modeling", "transformer_lm"),
    "transformer_mlra": ("translation", "transformer"),
}
# The statistics flags are shared by every plugin criterion: the tables list them once, under this one.
SHARED = "cross_entropy_with_stats"
# The README's tables, in this order (label_smoothed_cross_entropy_with_stats adds only the
# statistics flags, which the SHARED table lists).
TABLES = ["cross_entropy_agg", "augmented_loss", "cross_entropy_cosreg", "cross_entropy_face",
          "cross_entropy_unlikelihood", SHARED] + list(MODELS)


class Flag(NamedTuple):
    flag: str
    default: object  # as fairseq sets it; "on" / "off" for switches
    help: str


def _is_plugin(cls) -> bool:
    return cls.__module__.split(".")[0] == "fairseq_agg"


def plugin_criteria() -> List[str]:
    """The criteria the plugin registers with fairseq."""
    return sorted(name for name, cls in CRITERION_REGISTRY.items() if _is_plugin(cls))


def plugin_archs() -> List[str]:
    """The architectures the plugin registers with fairseq (base and named ones)."""
    return sorted(name for name, cls in ARCH_MODEL_REGISTRY.items() if _is_plugin(cls))


def kind(name: str) -> str:
    return "criterion" if name in CRITERION_REGISTRY else "architecture"


def stock_criterion(name: str) -> str:
    """The stock criterion whose flags ``name``'s table leaves out."""
    return CRITERIA[name][1] if name in CRITERIA else "cross_entropy"


def _selection(name):
    """fairseq-train arguments selecting ``name``, and those selecting its stock counterpart."""
    if name in CRITERION_REGISTRY:
        task_and_arch = CRITERIA[name][0] if name in CRITERIA else _LM
        return task_and_arch + ["--criterion", name], task_and_arch + ["--criterion", stock_criterion(name)]
    if ARCH_MODEL_NAME_REGISTRY.get(name) in MODELS:
        task, stock_arch = MODELS[ARCH_MODEL_NAME_REGISTRY[name]]
        return ["--task", task, "--arch", name], ["--task", task, "--arch", stock_arch]
    raise KeyError(f"{name!r} is not a criterion, nor an architecture of a model in fairseq_agg.flags.MODELS")


def _parse(argv):
    parser = options.get_training_parser(default_task=argv[1])
    # parse_args_and_arch adds the selected components' arguments to the parser and applies the
    # architecture function's defaults to the parsed namespace
    parsed, _ = options.parse_args_and_arch(parser, ["DATA"] + argv, parse_known=True)
    return {a.option_strings[0]: a for a in parser._actions if a.option_strings}, parsed


def flag_rows(name: str) -> List[Flag]:
    """Every flag ``name`` adds to fairseq-train, with its default and help."""
    plugin, stock = _selection(name)
    new, parsed = _parse(plugin)
    old, _ = _parse(stock)
    rows = []
    for flag, action in new.items():
        if flag in old:
            continue
        default = action.default
        if default is argparse.SUPPRESS:  # model flags: the architecture function sets the default
            default = getattr(parsed, action.dest, None)
        if isinstance(action, argparse._StoreTrueAction) or action.nargs == 0:
            default = "on" if default else "off"
        rows.append(Flag(flag, default, " ".join((action.help or "").split())))
    return rows


def table_rows(name: str) -> List[Flag]:
    """flag_rows without the shared statistics flags, except in the SHARED criterion's table."""
    rows = flag_rows(name)
    if name == SHARED or name not in CRITERION_REGISTRY:
        return rows
    shared = {(row.flag, str(row.default)) for row in flag_rows(SHARED)}
    return [row for row in rows if (row.flag, str(row.default)) not in shared]


def markdown(name: str) -> str:
    """The README table of ``name``."""
    lines = ["| flag | default | meaning |", "|---|---|---|"]
    for row in table_rows(name):
        lines.append(f"| `{row.flag}` | `{row.default}` | {row.help.replace('|', chr(92) + '|')} |")
    return "\n".join(lines) + "\n"


def describe(name: str, rows: List[Flag], width: int = 100) -> str:
    """``name``'s flags as plain text for a terminal."""
    option = "--criterion" if kind(name) == "criterion" else "--arch"
    lines = [f"{kind(name)} {name}  (fairseq-train DATA --user-dir \"$(fairseq-agg)\" {option} {name} ...)"]
    for row in rows:
        lines.append(f"  {row.flag}  (default: {row.default})")
        lines += textwrap.wrap(row.help, width, initial_indent=" " * 6, subsequent_indent=" " * 6,
                               break_on_hyphens=False, break_long_words=False)
    return "\n".join(lines)


def _overview() -> str:
    """Every criterion and model, the statistics flags once, and the named architectures of each model."""
    parts = []
    for name in plugin_criteria() + list(MODELS):
        text = describe(name, table_rows(name))
        if name in CRITERION_REGISTRY and name != SHARED:
            text += f"\n  (and the statistics flags of {SHARED})"
        if name in MODELS:
            named = sorted(a for a in plugin_archs() if ARCH_MODEL_NAME_REGISTRY[a] == name and a != name)
            if named:
                text += (f"\n  named architectures with these flags and their own defaults "
                         f"(fairseq-agg flags ARCH): {', '.join(named)}")
        parts.append(text)
    return "\n\n".join(parts)


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="fairseq-agg flags",
        description="The fairseq-train flags of the plugin's criteria and architectures, with the "
                    "defaults fairseq uses and their help (all of them without NAME).",
    )
    parser.add_argument("names", nargs="*", metavar="CRITERION|ARCH",
                        help="a criterion or architecture of the plugin, e.g. cross_entropy_agg")
    parser.add_argument("--markdown", action="store_true",
                        help="print the README's Markdown tables instead (TABLES, or the NAMEs given)")
    args = parser.parse_args(argv)
    known = plugin_criteria() + plugin_archs()
    for name in args.names:
        if name not in known:
            parser.error(f"unknown criterion or architecture {name!r}; the plugin's criteria: "
                         f"{', '.join(plugin_criteria())}; its architectures: {', '.join(plugin_archs())}")
    if args.markdown:
        for name in args.names or TABLES:
            print(f"### `{name}`\n\n{markdown(name)}")
    elif args.names:
        print("\n\n".join(describe(name, flag_rows(name)) for name in args.names))
    else:
        print(_overview())
    return 0
