"""Optimizers: :class:`~fairseq_agg.optim.coupled_adam.CoupledAdam` in pure torch (importing this
package needs torch only), and its fairseq registration as ``--optimizer coupled_adam``
(:mod:`.fairseq_coupled_adam`, imported by :func:`fairseq_agg.register_with_fairseq`)."""
from .coupled_adam import CoupledAdam, CoupledBlock  # noqa: F401
