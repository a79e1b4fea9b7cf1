"""The commands' bad input: one line naming the flag and what is allowed, exit status 2 (argparse's
convention), no traceback."""
import os
import sys


def refuse(message):
    """Prints ``PROG: error: MESSAGE`` and exits with status 2."""
    prog = os.path.splitext(os.path.basename(sys.argv[0] or "benchmark"))[0]
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(2)


def choose(text, allowed, flag, everything=None):
    """The comma-separated names of ``text``, each one of ``allowed`` (``everything``, such as
    "all", stands for all of them), or a refusal naming ``flag``."""
    chosen = [n.strip() for n in text.split(",") if n.strip()]
    if everything is not None and chosen == [everything]:
        return list(allowed)
    unknown = [n for n in chosen if n not in allowed]
    if unknown or not chosen:
        refuse(f"{flag}: unknown or no names {', '.join(unknown)}; choose from {', '.join(allowed)}"
               + (f" (or {everything})" if everything else ""))
    return chosen
