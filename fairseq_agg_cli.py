"""``fairseq-agg [COMMAND] ...`` and ``fairseq-agg-analyze``: the plugin's command line (also
``python -m fairseq_agg_cli``).

With no command it prints the directory to pass to fairseq's ``--user-dir``, so shells can write
``fairseq-train --user-dir "$(fairseq-agg)" ...``.

This module lives outside the ``fairseq_agg`` package on purpose: importing that package imports
torch, and a command's work (fairseq's registries, checkpoints) imports fairseq, which takes
seconds. So every command's argument parser is here: ``--help`` and a mistyped flag are answered
at once, and the module that does the work is imported only once the arguments parse. The path
is the directory of the ``fairseq_agg_plugin`` package (whose import registers the plugin with
fairseq), found with ``importlib.util.find_spec``, which does not run it.
"""
import argparse
import importlib
import importlib.util
import os
import sys
from typing import Callable, NamedTuple

PLUGIN = "fairseq_agg_plugin"  # the package fairseq's --user-dir loads (fairseq_agg.PLUGIN)

# The choices of ``analyze --rows`` and ``--group-preset``. fairseq_agg.stats.groups defines them
# next to the code that applies them, but importing it imports torch; tests/test_cli.py checks
# that both name the same choices.
ROW_POLICIES = ("all", "no-pad-madeup", "no-special")
GROUP_PRESETS = ("wikitext103-official",)


class CommandLineParser(argparse.ArgumentParser):
    """argparse with each error in one line, ``PROG: error: MESSAGE``, and exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def positive_int(text):
    """argparse type of a count that must be >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


# ----------------------------------------------------------------------------------------------
# the parsers of the commands


def user_dir_parser():
    return CommandLineParser(prog="fairseq-agg user-dir", description=COMMANDS["user-dir"].help)


def flags_parser():
    p = CommandLineParser(
        prog="fairseq-agg flags",
        description="The fairseq-train flags of the plugin's criteria, architectures and optimizers, with "
                    "the defaults fairseq uses and their help (all of them without NAME).",
    )
    p.add_argument("names", nargs="*", metavar="NAME",
                   help="a criterion, architecture or optimizer of the plugin, e.g. cross_entropy_agg")
    p.add_argument("--markdown", action="store_true",
                   help="print Markdown: the flag reference docs/flags.md, or the tables of the NAMEs given")
    p.add_argument("--output", metavar="FILE", help="write to FILE (replaced only once complete) instead of stdout")
    return p


def analyze_parser():
    p = CommandLineParser(
        prog="fairseq-agg-analyze",
        description="Embedding report (TEV, isotropy, mean cosine, spectrum, per-group PPL, word similarity) "
                    "of fairseq checkpoints: report.json, table.md and figures in --out, the table on stdout.",
    )
    p.add_argument("checkpoints", nargs="+", metavar="CHECKPOINT", help="fairseq checkpoint files (.pt)")
    p.add_argument("--data", metavar="DATA_BIN", help="data-bin directory: dictionaries and per-group perplexity")
    p.add_argument("--split", default="valid", help="split scored with --data (default: valid)")
    p.add_argument("--out", default="analysis", metavar="DIR",
                   help="output directory, created if missing (default: analysis)")
    p.add_argument("--labels", nargs="+", help="one label per checkpoint (default: file names)")
    p.add_argument("--rows", default="no-pad-madeup", choices=ROW_POLICIES, help="rows used by every matrix statistic")
    p.add_argument("--group-fractions", default="0.3,0.5,0.2",
                   help="frequent,medium,rare fractions of the non-special types")
    p.add_argument("--group-preset", choices=GROUP_PRESETS, help="fixed id ranges instead of fractions")
    p.add_argument("--max-tokens", type=positive_int, default=2048,
                   help="tokens per batch when scoring (default: 2048)")
    p.add_argument("--context-window", type=int, default=0, metavar="C",
                   help="score a language model as fairseq-eval-lm --context-window C: blocks of "
                        "tokens_per_sample - C tokens, each seeing up to C tokens before it (default: 0)")
    p.add_argument("--tokens-per-sample", type=int, metavar="T",
                   help="as fairseq-eval-lm --tokens-per-sample (default: the checkpoint's training value)")
    p.add_argument("--no-ppl", action="store_true", help="with --data, skip the perplexity (dictionaries only)")
    p.add_argument("--no-figures", action="store_true", help="write no PNG files")
    p.add_argument("--max-points", type=positive_int, default=3000,
                   help="points per group in projection.png (default: 3000)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU even when a GPU is available")
    p.add_argument("--word-sim", nargs="+", metavar="FILE",
                   help="word-similarity files ('word1 word2 score' lines, separated by tabs (a word may then hold "
                        "spaces) or by spaces; e.g. WordSim-353, SimLex-999, "
                        "or a list of your own): Spearman's rho of embedding cosines vs the scores, per matrix "
                        "(docs/stats.md)")
    p.add_argument("--word-sim-spm", metavar="MODEL",
                   help="sentencepiece model that splits --word-sim words into pieces (default: greedy "
                        "longest match over the dictionary)")
    return p


def average_checkpoints_parser():
    p = CommandLineParser(
        prog="fairseq-agg average-checkpoints",
        description="Average the model parameters of fairseq checkpoints into a new checkpoint.",
    )
    p.add_argument("--inputs", nargs="+", required=True,
                   help="checkpoint files, or one directory with --num-epoch/--num-update-checkpoints")
    p.add_argument("--output", required=True,
                   help="path of the averaged checkpoint (in an existing directory; never one of the inputs)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--num-epoch-checkpoints", type=positive_int, help="average the last N checkpointEPOCH.pt")
    g.add_argument("--num-update-checkpoints", type=positive_int, help="average the last N checkpoint_E_UPDATE.pt")
    p.add_argument("--checkpoint-upper-bound", type=int,
                   help="ignore checkpoints after this epoch (or update, with --num-update-checkpoints)")
    return p


# ----------------------------------------------------------------------------------------------
# the commands


class Command(NamedTuple):
    help: str
    parser: Callable[[], argparse.ArgumentParser]
    # "module:function" doing the work, called with the parsed arguments and the parser (for
    # parser.error); imported only after the arguments parse
    run: str


COMMANDS = {
    "user-dir": Command("print the path to pass to --user-dir (default)", user_dir_parser,
                        "fairseq_agg_cli:print_user_dir"),
    "flags": Command("the flags of the plugin's criteria, architectures and optimizers, with defaults",
                     flags_parser, "fairseq_agg.flags:run"),
    "analyze": Command("embedding report of checkpoints (= fairseq-agg-analyze)", analyze_parser,
                       "fairseq_agg.analysis.analyze:run"),
    "average-checkpoints": Command("average the parameters of several fairseq checkpoints",
                                   average_checkpoints_parser, "fairseq_agg.tools.average_checkpoints:run"),
}


def user_dir() -> str:
    """The directory of the installed ``fairseq_agg_plugin`` package, found without importing it."""
    spec = importlib.util.find_spec(PLUGIN)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"fairseq-agg: the {PLUGIN} package is not importable from {sys.executable}")
    return os.path.abspath(list(spec.submodule_search_locations)[0])


def print_user_dir(args=None, parser=None):
    print(user_dir())
    return 0


def run_command(name, argv=None):
    """Parses ``argv`` with command ``name``'s parser, then imports and runs its work."""
    parser = COMMANDS[name].parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    module_name, func_name = COMMANDS[name].run.split(":")
    if module_name.startswith("fairseq_agg."):  # its work imports fairseq, whose import configures logging
        importlib.import_module("fairseq_agg.fairseq_facts.import_logging").import_fairseq()
    result = getattr(importlib.import_module(module_name), func_name)(args, parser)
    return result if isinstance(result, int) else 0


def _usage():
    lines = ["usage: fairseq-agg [COMMAND] [ARGS]   (COMMAND --help for its options)", "", "commands:"]
    lines += [f"  {name:22s} {command.help}" for name, command in COMMANDS.items()]
    lines += ["", "options:", f"  {'-h, --help':22s} this message", f"  {'--version':22s} the installed version"]
    return "\n".join(lines)


def main(argv=None):
    """``fairseq-agg [COMMAND] ...``"""
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
        print(f"fairseq-agg: error: unknown command {argv[0]!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    return run_command(argv[0], argv[1:])


def analyze_main(argv=None):
    """``fairseq-agg-analyze ...`` (= ``fairseq-agg analyze ...``)"""
    return run_command("analyze", argv)


if __name__ == "__main__":
    sys.exit(main())
