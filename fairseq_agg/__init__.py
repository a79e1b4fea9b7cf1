"""fairseq-agg: token-embedding remedies and metrics for fairseq, loaded with ``--user-dir``.

Importing this package, or its pure-torch core :mod:`fairseq_agg.ops`, imports torch and changes
nothing else in the process: no fairseq, no registration, no hook. fairseq loads the plugin with
``fairseq-train --user-dir "$(fairseq-agg)" ...``: that directory is the small
``fairseq_agg_plugin`` package (:data:`USER_DIR`), whose import registers the plugin's criteria,
models, architectures and optimizer with fairseq and installs its fairseq hooks (a refused flag
prints ``PROG: error: MESSAGE`` with exit status 2). A program that runs fairseq's own ``main`` in
its process calls :func:`register_with_fairseq` instead. (``fairseq-agg`` itself finds the
directory without importing anything; see ``fairseq_agg_cli``.)

Without fairseq, :mod:`fairseq_agg.ops` still works (the methods for any PyTorch loop);
:mod:`fairseq_agg.criterions` and :mod:`fairseq_agg.models` say what to install.
"""
import os

from fairseq_agg.registration import register_with_fairseq
from fairseq_agg.requirements import MIN_TORCH, require_torch

__version__ = "0.1.0"
__all__ = ["register_with_fairseq", "user_dir", "USER_DIR", "MIN_TORCH", "__version__"]

# the package fairseq's --user-dir loads, installed beside this one
PLUGIN = "fairseq_agg_plugin"
USER_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), PLUGIN)


def user_dir() -> str:
    """The path to pass to fairseq's ``--user-dir``."""
    return USER_DIR


require_torch()
