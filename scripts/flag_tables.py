#!/usr/bin/env python
"""Prints the Markdown tables of every command-line flag this plugin adds to fairseq-train.

The flags are read from fairseq's own argument parser: for each plugin criterion and architecture,
the options that the stock counterpart does not have, with their defaults and help texts. The
README's flag tables are this script's output (tests/test_readme.py keeps them in sync).

    python scripts/flag_tables.py            # all tables
"""
import argparse
import sys

import fairseq_agg  # noqa: F401  (registers the plugin)
from fairseq import options

# plugin component -> (fairseq-train arguments selecting it, arguments selecting the stock baseline)
COMPONENTS = {
    "cross_entropy_agg": (["--task", "language_modeling", "--arch", "transformer_lm", "--criterion", "cross_entropy_agg"],
                          ["--task", "language_modeling", "--arch", "transformer_lm", "--criterion", "cross_entropy"]),
    "augmented_loss": (["--task", "language_modeling", "--arch", "transformer_lm", "--criterion", "augmented_loss"],
                       ["--task", "language_modeling", "--arch", "transformer_lm", "--criterion", "cross_entropy"]),
    "cross_entropy_with_stats": (
        ["--task", "language_modeling", "--arch", "transformer_lm", "--criterion", "cross_entropy_with_stats"],
        ["--task", "language_modeling", "--arch", "transformer_lm", "--criterion", "cross_entropy"]),
    "label_smoothed_cross_entropy_with_stats": (
        ["--task", "translation", "--arch", "transformer", "--criterion", "label_smoothed_cross_entropy_with_stats"],
        ["--task", "translation", "--arch", "transformer", "--criterion", "label_smoothed_cross_entropy"]),
    "transformer_lm_mlra": (["--task", "language_modeling", "--arch", "transformer_lm_mlra"],
                            ["--task", "language_modeling", "--arch", "transformer_lm"]),
    "transformer_mlra": (["--task", "translation", "--arch", "transformer_mlra"],
                         ["--task", "translation", "--arch", "transformer"]),
}


def _actions(argv, task_default):
    parser = options.get_training_parser(default_task=task_default)
    # parse_args_and_arch adds the selected components' arguments to the parser
    args = ["DATA", "--user-dir", fairseq_agg.user_dir()] + argv
    parsed, _ = options.parse_args_and_arch(parser, args, parse_known=True)
    return {a.option_strings[0]: a for a in parser._actions if a.option_strings}, parsed


def flag_rows(name):
    plugin, stock = COMPONENTS[name]
    task = plugin[1]
    try:
        new, parsed = _actions(plugin, task)
    except (SystemExit, RuntimeError, KeyError):
        return None  # not registered
    old, _ = _actions(stock, task)
    rows = []
    for flag, action in new.items():
        if flag in old:
            continue
        default = action.default
        if default is argparse.SUPPRESS:  # model flags: the architecture function sets the default
            default = getattr(parsed, action.dest, None)
        if isinstance(action, argparse._StoreTrueAction) or action.nargs == 0:
            default = "off" if not default else "on"
        help_text = (action.help or "").replace("|", "\\|").replace("\n", " ")
        rows.append((flag, default, help_text))
    return rows


# The statistics flags are shared by every plugin criterion: listed once, in this component's table.
SHARED = "cross_entropy_with_stats"


def table_rows(name):
    """flag_rows without the shared statistics flags (for the other criteria)."""
    rows = flag_rows(name)
    if rows is None or name == SHARED or "--criterion" not in COMPONENTS[name][0]:
        return rows
    shared = {(flag, str(default)) for flag, default, _ in (flag_rows(SHARED) or [])}
    return [r for r in rows if (r[0], str(r[1])) not in shared]


def markdown(name):
    rows = table_rows(name)
    if rows is None:
        return f"(`{name}` is not registered)\n"
    lines = ["| flag | default | meaning |", "|---|---|---|"]
    for flag, default, help_text in rows:
        lines.append(f"| `{flag}` | `{default}` | {help_text} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("components", nargs="*", default=list(COMPONENTS), help="which tables")
    args = parser.parse_args(argv)
    for name in args.components:
        print(f"### `{name}`\n")
        print(markdown(name))


if __name__ == "__main__":
    sys.exit(main())
