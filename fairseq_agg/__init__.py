"""fairseq-agg: token-embedding remedies and metrics for fairseq, loaded with ``--user-dir``.

Importing this package registers its criteria, models and architectures with fairseq: fairseq's
``--user-dir DIR`` imports the package by the directory's name, so
``fairseq-train --user-dir "$(fairseq-agg)" ...`` is all a run needs. (``fairseq-agg`` itself finds
the directory without importing the package; see ``fairseq_agg_cli``.)
"""
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


def _require_torch_and_fairseq():
    # Neither is a pinned dependency (installing the plugin must not replace a user's torch or
    # fairseq), so a missing or too old one is reported here, in one line.
    try:
        import torch
        import fairseq  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name not in ("torch", "fairseq"):
            raise
        raise ImportError(f"fairseq-agg needs {e.name}, which is not installed: {_INSTALL_HINT}") from None
    found = re.match(r"(\d+)\.(\d+)", torch.__version__)
    if found and tuple(int(x) for x in found.groups()) < MIN_TORCH:
        raise ImportError(
            f"fairseq-agg needs torch >= {'.'.join(map(str, MIN_TORCH))}, found {torch.__version__}: "
            "upgrade torch and rebuild fairseq against it"
        )


_require_torch_and_fairseq()

from .fairseq_hooks import allow_namespace_in_checkpoints  # noqa: E402

allow_namespace_in_checkpoints()

# Registration side effects: fairseq's registries are filled on import.
from . import criterions  # noqa: E402,F401
from . import models  # noqa: E402,F401
