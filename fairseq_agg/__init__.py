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


# Registration side effects: fairseq's registries are filled on import.
from . import criterions  # noqa: E402,F401
from . import models  # noqa: E402,F401
