"""fairseq-agg: token-embedding remedies and metrics for fairseq, loaded with ``--user-dir``.

Importing this package registers its criteria, models and architectures with fairseq, so
``fairseq-train --user-dir $(fairseq-agg user-dir) ...`` (or ``python -m fairseq_agg``) is all a
run needs.
"""
import os

__version__ = "0.1.0"

USER_DIR = os.path.dirname(os.path.abspath(__file__))


def user_dir() -> str:
    """The path to pass to fairseq's ``--user-dir``."""
    return USER_DIR


# fairseq stores the argparse.Namespace of models without a dataclass config (transformer,
# transformer_mlra) in checkpoints, and torch >= 2.6 loads with weights_only=True, which refuses that
# class: allow it, so fairseq-generate / fairseq-interactive with --user-dir load such checkpoints.
import argparse as _argparse  # noqa: E402

import torch as _torch  # noqa: E402

if hasattr(_torch.serialization, "add_safe_globals"):
    _torch.serialization.add_safe_globals([_argparse.Namespace])

# Registration side effects: fairseq's registries are filled on import.
from . import criterions  # noqa: E402,F401
from . import models  # noqa: E402,F401
