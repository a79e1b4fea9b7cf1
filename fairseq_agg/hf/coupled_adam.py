"""Coupled Adam (Stollenwerk & Stollenwerk, ACL 2025; docs/coupled_adam.md) for a Hugging Face
model: :func:`coupled_adam_for` finds the model's token-embedding matrices and builds the
package's :class:`~fairseq_agg.optim.coupled_adam.CoupledAdam` over its trainable parameters,
ready for ``Trainer(optimizers=(optimizer, None))`` or a plain loop.

The matrices are the weights of ``get_input_embeddings()`` and ``get_output_embeddings()``, the
input and output roles of the fairseq optimizer's ``--coupled-adam-matrices``; a tied matrix is one
parameter and is coupled once. The options are the fairseq optimizer's flags without dashes, with
its defaults, except ``coupled_adam_decay``: here the authors' setting is the default (weight
decay reaches the matrices other than the coupled ones; the coupled matrices and the 1-D
parameters are not decayed), given as two torch parameter groups.
"""
import logging

import torch

from ..errors import UsageError, check_choice, check_number
from ..optim.coupled_adam import DECAY_CHOICES, CoupledAdam
from ..stats.matrices import MATRIX_CHOICES

logger = logging.getLogger(__name__)


def embedding_weights(model, which: str = "all"):
    """The distinct trainable token-embedding weights of ``model`` in role ``which`` (``input``:
    ``get_input_embeddings()``, ``output``: ``get_output_embeddings()``, ``all``: both), each once."""
    getters = {"input": ("get_input_embeddings",), "output": ("get_output_embeddings",),
               "all": ("get_input_embeddings", "get_output_embeddings")}[which]
    found = []
    for getter in getters:
        module = getattr(model, getter, lambda: None)()
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.nn.Parameter) and weight.dim() == 2 and weight.requires_grad \
                and all(weight is not w for w in found):
            found.append(weight)
    return found


def coupled_adam_for(model, lr=1e-3, adam_betas=(0.9, 0.999), adam_eps=1e-8, weight_decay=0.0,
                     coupled_adam_matrices="all", coupled_adam_scale=1.0,
                     coupled_adam_decay="non-embedding-matrices") -> CoupledAdam:
    """A :class:`CoupledAdam` over ``model``'s trainable parameters whose ``coupled_adam_matrices``
    embedding matrices share one second moment per dimension (scaled by ``coupled_adam_scale``).

    ``coupled_adam_decay``: ``non-embedding-matrices`` (default, the authors' setting: group 0 the
    parameters of 2 or more dimensions other than the coupled matrices, with ``weight_decay``;
    group 1 the coupled matrices and the 1-D parameters, with weight decay 0) or ``all`` (one group,
    as fairseq's adam). A bad option is a :class:`~fairseq_agg.errors.UsageError` in one line.
    """
    check_number("lr", lr, 0, None, low_open=True)
    betas = _check_betas(adam_betas)
    check_number("adam_eps", adam_eps, 0, None)
    check_number("weight_decay", weight_decay, 0, None)
    which = check_choice("coupled_adam_matrices", coupled_adam_matrices, MATRIX_CHOICES)
    scale = check_number("coupled_adam_scale", coupled_adam_scale, 0, None, low_open=True)
    decay = check_choice("coupled_adam_decay", coupled_adam_decay, DECAY_CHOICES)

    trainable = [p for p in model.parameters() if p.requires_grad]
    coupled = embedding_weights(model, which)
    if not coupled:
        raise UsageError(f"--coupled-adam-matrices {which}: {type(model).__name__} has no trainable such matrix "
                         "(the weight of get_input_embeddings() / get_output_embeddings()), nothing to couple")
    _log_coupled(model, coupled, scale)
    if decay == "all":
        groups = [{"params": trainable}]
    else:
        decayed = [p for p in trainable if p.dim() >= 2 and all(p is not c for c in coupled)]
        undecayed = [p for p in trainable if all(p is not d for d in decayed)]
        groups = [{"params": decayed}, {"params": undecayed, "weight_decay": 0.0}]
        logger.info(f"coupled_adam: weight decay skips the coupled matrices and {len(undecayed) - len(coupled)} "
                    "1-D parameters (coupled_adam_decay non-embedding-matrices)")
    return CoupledAdam([g for g in groups if g["params"]], lr=lr, betas=betas, eps=adam_eps,
                       weight_decay=weight_decay, coupled=coupled, coupling_scale=scale)


def _check_betas(betas):
    """Two numbers in [0, 1), as fairseq's ``--adam-betas``."""
    if isinstance(betas, str) or not hasattr(betas, "__len__") or len(betas) != 2:
        raise UsageError(f"--adam-betas must be two numbers in [0, 1), got {betas!r}")
    return tuple(float(check_number("adam_betas", b, 0, 1, high_open=True)) for b in betas)


def _log_coupled(model, coupled, scale):
    names = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(p, []).append(name)
    for weight in coupled:
        rows, cols = weight.shape
        logger.info(f"coupled_adam: the {rows} rows of {' = '.join(names.get(weight, ['?']))} ({rows} x {cols}) "
                    f"share one second moment per dimension, scale {scale:g}")
