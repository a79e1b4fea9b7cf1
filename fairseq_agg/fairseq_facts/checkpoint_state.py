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
"""
import argparse

import torch


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
