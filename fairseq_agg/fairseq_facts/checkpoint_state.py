"""Criterion state in fairseq's checkpoints, and loading them with torch's safe loader.

fairseq saves and restores a criterion's ``state_dict`` only when the criterion has parameters
(``Trainer.state_dict`` / ``load_checkpoint``). :func:`anchor_criterion_state` gives a criterion one
zero parameter so that its buffers (AGG's window) travel with every checkpoint. Side effects, all
harmless: the anchor is in the optimizer's parameter list (its gradient is always 0, so Adam and
weight decay keep it at 0), and under ``--ddp-backend c10d`` / ``legacy_ddp`` fairseq wraps the
criterion in DDP too (the anchor joins the graph through ``loss + 0 * anchor``, so DDP sees it used
on every step).

torch >= 2.6 loads with ``weights_only=True``, which refuses the ``argparse.Namespace`` that
fairseq stores for models without a dataclass config (:func:`allow_namespace_in_checkpoints`).
fairseq calls ``torch.load`` without ``weights_only``, so ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``
in the environment would unpickle a checkpoint's code; the plugin's loads run inside
:func:`safe_loads`, which passes ``weights_only=True`` explicitly (the environment cannot turn it
off then), and a file the safe loader refuses (:func:`refused_as_unsafe`) is one line,
:func:`unsafe_checkpoint`.
"""
import argparse
import contextlib
import pickle

import torch

from fairseq_agg.errors import UsageError


def anchor_criterion_state(criterion):
    """Gives ``criterion`` the one zero parameter that makes fairseq save and restore its
    ``state_dict`` (see the module docstring); its forward passes the loss through :func:`anchored`."""
    criterion.state_anchor = torch.nn.Parameter(torch.zeros(1))


def anchored(loss, criterion):
    """``loss`` + 0 x the anchor: keeps the anchor in the graph (DDP), adds nothing."""
    return loss + 0.0 * criterion.state_anchor.sum()


def holds_criterion_state(state_dict, module_names) -> bool:
    """Whether a checkpoint's criterion state holds the entries of these submodules. It does not
    when another criterion wrote it (a stock one: no state; another stateful one: other keys), as
    when fine-tuning from it: the counts then start empty."""
    prefixes = tuple(f"{name}." for name in module_names)
    return state_dict is not None and any(key.startswith(prefixes) for key in state_dict)


def allow_namespace_in_checkpoints():
    """Lets torch's safe loading accept the ``argparse.Namespace`` fairseq stores in checkpoints."""
    if hasattr(torch.serialization, "add_safe_globals"):
        torch.serialization.add_safe_globals([argparse.Namespace])


@contextlib.contextmanager
def safe_loads():
    """Within: every ``torch.load`` (fairseq's included, which names no ``weights_only``) is torch's
    safe loader, with fairseq's Namespace allowed, whatever the caller or the environment asks."""
    allow_namespace_in_checkpoints()
    torch_load = torch.load

    def load(*args, **kwargs):
        return torch_load(*args, **{**kwargs, "weights_only": True})

    torch.load = load
    try:
        yield
    finally:
        torch.load = torch_load


def refused_as_unsafe(error: BaseException) -> bool:
    """Whether ``error`` is torch's safe loader refusing an object it would have to run."""
    return isinstance(error, pickle.UnpicklingError) and "weights only load failed" in str(error).lower()


class UnsafeCheckpoint(UsageError):
    """A checkpoint that torch's safe loader refuses: it holds objects that loading would run."""


def unsafe_checkpoint(path: str) -> UnsafeCheckpoint:
    """The one-line refusal of a checkpoint the safe loader refuses."""
    return UnsafeCheckpoint(f"checkpoint {path} holds objects that a safe load (torch.load with weights_only=True) "
                            "does not run; load it yourself, with weights_only=False, only if you trust its source")
