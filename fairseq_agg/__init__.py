"""fairseq-agg: token-embedding remedies and metrics for fairseq, loaded with ``--user-dir``.

With fairseq installed, importing this package registers its criteria, models and architectures
(and optimizers) with fairseq: fairseq's ``--user-dir DIR`` imports the package by the directory's
name, so ``fairseq-train --user-dir "$(fairseq-agg)" ...`` is all a run needs, and a refused flag
prints ``PROG: error: MESSAGE`` with exit status 2. (``fairseq-agg`` itself finds the directory
without importing the package; see ``fairseq_agg_cli``.)

Without fairseq, the pure-torch core :mod:`fairseq_agg.ops` still imports (the methods for any
PyTorch loop); :mod:`fairseq_agg.criterions` and :mod:`fairseq_agg.models` say what to install.
"""
import importlib
import importlib.util
import os
import re

__version__ = "0.1.0"

USER_DIR = os.path.dirname(os.path.abspath(__file__))

MIN_TORCH = (2, 1)  # F.scaled_dot_product_attention(scale=...) in the MLRA attention

_INSTALL_HINT = (
    "install torch >= 2.1, then a fairseq built against it: stock fairseq 0.12.x (Python <= 3.10), "
    "fairseq main from source, or the fork with pip install --no-build-isolation 'fairseq-agg[fairseq]' "
    "(scripts/setup_env.sh does all of this)"
)


def user_dir() -> str:
    """The path to pass to fairseq's ``--user-dir``."""
    return USER_DIR


def _missing(name: str) -> ImportError:
    return ImportError(f"fairseq-agg needs {name}, which is not installed: {_INSTALL_HINT}")


def require_torch():
    # Neither torch nor fairseq is a pinned dependency (installing the plugin must not replace a
    # user's torch or fairseq), so a missing or too old one is reported here, in one line.
    try:
        import torch
    except ModuleNotFoundError as e:
        if e.name != "torch":
            raise
        raise _missing("torch") from None
    found = re.match(r"(\d+)\.(\d+)", torch.__version__)
    if found and tuple(int(x) for x in found.groups()) < MIN_TORCH:
        raise ImportError(
            f"fairseq-agg needs torch >= {'.'.join(map(str, MIN_TORCH))}, found {torch.__version__}: "
            "upgrade torch and rebuild fairseq against it"
        )


def require_fairseq():
    """What the fairseq side of the plugin calls first: one line naming what to install."""
    require_torch()
    try:
        import fairseq  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name != "fairseq":
            raise
        raise _missing("fairseq") from None


def _register_with_fairseq():
    """Fills fairseq's registries (criteria, models, architectures, optimizers) and reports the
    plugin's refusals in one line; first refuses a fairseq built for numpy 1.x under numpy 2.
    Makes fairseq's checkpoint saves and copies atomic (a full disk one line) and a damaged checkpoint one line
    (:mod:`fairseq_agg.fairseq_facts.checkpoint_files`)."""
    from .errors import report_usage_errors_in_one_line
    from .fairseq_facts.checkpoint_files import (check_checkpoints_on_load, make_checkpoint_copies_atomic,
                                                  make_checkpoint_saves_one_line)
    from .fairseq_facts.checkpoint_state import allow_namespace_in_checkpoints
    from .fairseq_facts.flag_choices import report_invalid_choices_in_one_line
    from .fairseq_facts.numpy_check import check_fairseq_extensions_match_numpy

    check_fairseq_extensions_match_numpy()
    allow_namespace_in_checkpoints()
    make_checkpoint_copies_atomic()
    make_checkpoint_saves_one_line()
    check_checkpoints_on_load()
    report_invalid_choices_in_one_line()
    report_usage_errors_in_one_line()
    for name in ("criterions", "models", "optim"):
        if importlib.util.find_spec(f"{__name__}.{name}") is not None:
            importlib.import_module(f"{__name__}.{name}")


require_torch()
if importlib.util.find_spec("fairseq") is not None:  # without fairseq: the pure-torch core only
    _register_with_fairseq()
