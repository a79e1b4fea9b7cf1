"""``fairseq-agg [COMMAND] ...``: the plugin's command line (also ``python -m fairseq_agg``).

With no command it prints the directory to pass to fairseq's ``--user-dir``, so shells can write
``fairseq-train --user-dir "$(fairseq-agg)" ...``.

This module lives outside the ``fairseq_agg`` package on purpose: importing that package registers
its criteria and models with fairseq (fairseq's ``--user-dir`` imports it by name and relies on
that), which imports torch and fairseq and takes seconds. Printing the path must not pay for it, so
the package is located with ``importlib.util.find_spec``, which does not run it; the other
commands import their own module only when they run.
"""
import importlib
import importlib.util
import os
import sys

PACKAGE = "fairseq_agg"

# command -> ("module:function", help)
COMMANDS = {
    "user-dir": ("fairseq_agg_cli:print_user_dir", "print the path to pass to --user-dir (default)"),
    "flags": ("fairseq_agg.flags:main", "the flags of the plugin's criteria and architectures, with defaults"),
    "analyze": ("fairseq_agg.stats.analyze:main", "embedding report of checkpoints (= fairseq-agg-analyze)"),
    "average-checkpoints": (
        "fairseq_agg.tools.average_checkpoints:main",
        "average the parameters of several fairseq checkpoints",
    ),
}


def user_dir() -> str:
    """The directory of the installed ``fairseq_agg`` package, found without importing it."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"fairseq-agg: the {PACKAGE} package is not importable from {sys.executable}")
    return os.path.abspath(list(spec.submodule_search_locations)[0])


def print_user_dir(argv=None):
    import argparse

    argparse.ArgumentParser(prog="fairseq-agg user-dir", description=COMMANDS["user-dir"][1]).parse_args(argv)
    print(user_dir())
    return 0


def _usage():
    lines = ["usage: fairseq-agg [COMMAND] [ARGS]   (COMMAND --help for its options)", "", "commands:"]
    lines += [f"  {name:22s} {help_text}" for name, (_, help_text) in COMMANDS.items()]
    lines += ["", "options:", f"  {'-h, --help':22s} this message", f"  {'--version':22s} the installed version"]
    return "\n".join(lines)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv and argv[0] == "--version":
        from importlib.metadata import version

        print(f"fairseq-agg {version('fairseq-agg')}")
        return 0
    if not argv:
        argv = ["user-dir"]
    if argv[0] not in COMMANDS:
        print(f"fairseq-agg: unknown command {argv[0]!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module_name, func_name = COMMANDS[argv[0]][0].split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    result = func(argv[1:])
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
