"""The options the demos and the study share (each command line defines them itself) and their
checks, and the one-line end of a command whose work refuses a path or a full disk."""
from fairseq_agg.errors import UsageError, print_usage_error

# Both demos prepare one corpus for both modes; the output layer dominates the cost of such small
# models, so the vocabulary is what keeps the default budget under 15 minutes.
VOCAB = 4000


def check_args(p, a):
    """Rejects bad values of the shared options before anything is written."""
    if a.updates is not None and a.updates < 1:
        p.error(f"--updates must be >= 1, got {a.updates}")
    if a.threads < 1:
        p.error(f"--threads must be >= 1, got {a.threads}")
    if getattr(a, "jobs", 1) < 1:
        p.error(f"--jobs must be >= 1, got {a.jobs}")
    if a.vocab_size < 50:
        p.error(f"--vocab-size must be >= 50, got {a.vocab_size}")
    if len(set(a.seeds)) != len(a.seeds):
        p.error("--seeds must be distinct")
    if any(s < 0 for s in a.seeds):
        p.error("--seeds must be >= 0")
    methods = getattr(a, "methods", None) or []  # the study's parser has none
    if len(set(methods)) != len(methods):
        p.error(f"--methods must be distinct, got {' '.join(methods)}")


def exit_in_one_line(main):
    """Runs a command's ``main()``; a UsageError raised past its argument checks (an output that
    cannot be written, a full disk) ends in one line and exit status 2, as a bad argument does.
    Importing the package installs no process-wide hook for this (docs/architecture.md)."""
    try:
        return main()
    except UsageError as error:
        print_usage_error(error)
        return 2
