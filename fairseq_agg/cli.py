"""Thin command-line entry point: ``fairseq-agg [COMMAND] ...`` (also ``python -m fairseq_agg``).

With no command it prints the plugin directory, so shells can write
``fairseq-train --user-dir "$(fairseq-agg)" ...``.
"""
import argparse
import importlib
import sys

# command -> ("module:function", help); each command's module is imported only when it runs.
COMMANDS = {
    "user-dir": ("fairseq_agg.cli:print_user_dir", "print the path to pass to --user-dir (default)"),
    "analyze": ("fairseq_agg.stats.analyze:main", "embedding report of checkpoints (= fairseq-agg-analyze)"),
    "average-checkpoints": (
        "fairseq_agg.tools.average_checkpoints:main",
        "average the parameters of several fairseq checkpoints",
    ),
}


def print_user_dir(argv=None):
    argparse.ArgumentParser(prog="fairseq-agg user-dir", description=COMMANDS["user-dir"][1]).parse_args(argv)
    from fairseq_agg import user_dir

    print(user_dir())


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        if argv and argv[0] in ("-h", "--help"):
            print("usage: fairseq-agg [COMMAND] [ARGS]\n\ncommands:")
            for name, (_, help_text) in COMMANDS.items():
                print(f"  {name:22s} {help_text}")
            return 0
        if argv:
            print(f"fairseq-agg: unknown command {argv[0]!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
            return 2
        argv = ["user-dir"]
    target, _ = COMMANDS[argv[0]]
    module_name, func_name = target.split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    result = func(argv[1:])
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
