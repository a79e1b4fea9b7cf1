"""Optimizers: :class:`~fairseq_agg.optim.coupled_adam.CoupledAdam` in pure torch, and with fairseq
installed its registration as ``--optimizer coupled_adam`` (on import)."""
import importlib.util

from .coupled_adam import CoupledAdam, CoupledBlock  # noqa: F401

if importlib.util.find_spec("fairseq") is not None:
    from . import fairseq_coupled_adam  # noqa: F401
