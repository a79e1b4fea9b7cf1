"""The token-embedding matrices of a fairseq model or checkpoint, and the rows each statistic uses.

Shared by the live logging (a model in memory) and ``fairseq-agg-analyze`` (a checkpoint's state
dict), so both name, tie and select rows the same way (docs/stats.md, "Matrices" and "Rows"):

* ``enc`` = ``encoder.embed_tokens``, ``dec`` = ``decoder.embed_tokens``, ``out`` =
  ``decoder.output_projection`` (or a legacy ``decoder.embed_out``); tied matrices count once,
  under the first of these names. Adaptive inputs/softmax have no single matrix and are skipped.
* the dictionary of ``enc`` is the task's source dictionary, that of ``dec`` and ``out`` the target
  one; a dictionary whose size is not the matrix's row count is not used (fairseq's default
  layout is assumed instead).
"""
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, NamedTuple, Optional

import torch

from . import groups as G

logger = logging.getLogger(__name__)

MATRIX_CHOICES = ("input", "output", "all")
# (state-dict name, matrix name, role), in naming order
EMBEDDING_PARAMS = (
    ("encoder.embed_tokens.weight", "enc", "input"),
    ("decoder.embed_tokens.weight", "dec", "input"),
    ("decoder.output_projection.weight", "out", "output"),
    ("decoder.embed_out", "out", "output"),
)


@dataclass
class EmbeddingMatrix:
    name: str  # "enc", "dec" or "out"
    weight: torch.Tensor
    role: str  # "input" or "output": the role of ``param``
    param: str  # its state-dict name
    tied: List[str] = field(default_factory=list)  # the other state-dict names of the same matrix
    holds_output: bool = False  # whether it is (also) the output projection
    embed_scale: Optional[float] = None  # fairseq's embed_scale of an input embedding (live models)
    padding_idx: Optional[int] = None  # the nn.Embedding's padding row (live models)


def _same_matrix(a: torch.Tensor, b: torch.Tensor, compare_values: bool) -> bool:
    if a is b:
        return True
    if a.shape != b.shape or a.device != b.device:
        return False
    return a.data_ptr() == b.data_ptr() or (compare_values and torch.equal(a, b))


def distinct_matrices(params: Mapping[str, torch.Tensor], compare_values: bool = False) -> List[EmbeddingMatrix]:
    """The distinct embedding matrices among ``params`` (state-dict name -> tensor).

    Tied parameters share their storage. ``compare_values`` also ties equal tensors: fairseq moves
    each tensor of a GPU run to the CPU separately when it saves a checkpoint, so tied weights
    arrive as equal copies. A live model is never compared by value: untied matrices that happen
    to be equal would change the log keys mid-run.
    """
    found: List[EmbeddingMatrix] = []
    for param, name, role in EMBEDDING_PARAMS:
        w = params.get(param)
        if not torch.is_tensor(w) or w.dim() != 2:
            continue
        same = next((m for m in found if _same_matrix(m.weight, w, compare_values)), None)
        if same is not None:
            same.tied.append(param)
            same.holds_output = same.holds_output or role == "output"
        elif all(m.name != name for m in found):
            found.append(EmbeddingMatrix(name, w, role, param, holds_output=role == "output"))
    return found


def _unwrap(model):
    # DDP / fairseq's ModuleProxyWrapper keep the real model in .module
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


def _attribute(obj, dotted: str):
    for attr in dotted.split("."):
        obj = getattr(obj, attr, None)
    return obj


def embedding_matrices(model, which: str = "all") -> List[EmbeddingMatrix]:
    """The distinct token-embedding matrices of a fairseq model: ``which`` = ``input`` (the input
    embeddings), ``output`` (the matrix of the output projection) or ``all``."""
    m = _unwrap(model)
    params = {param: _attribute(m, param) for param, _, _ in EMBEDDING_PARAMS}
    found = distinct_matrices(params)
    for mat in found:
        stack = _attribute(m, mat.param.split(".")[0])  # the encoder or the decoder
        scale = getattr(stack, "embed_scale", 1.0) if mat.role == "input" else 1.0
        mat.embed_scale = float(scale or 1.0)
        module = _attribute(m, mat.param.rpartition(".")[0])  # e.g. decoder.embed_tokens
        if isinstance(module, torch.nn.Embedding):
            mat.padding_idx = module.padding_idx
    if which == "input":
        return [mat for mat in found if mat.role == "input"]
    if which == "output":
        return [mat for mat in found if mat.holds_output]
    return found


def task_dictionaries(task) -> Dict[str, object]:
    """Dictionary per matrix name: the source dictionary for ``enc``, the target one otherwise."""

    def get(attr):
        try:
            return getattr(task, attr)
        except (AttributeError, NotImplementedError):
            return None

    if task is None:
        return {}
    src, tgt = get("source_dictionary"), get("target_dictionary")
    return {"enc": src if src is not None else tgt, "dec": tgt if tgt is not None else src,
            "out": tgt if tgt is not None else src}


def dictionary_for(dictionary, num_rows: int):
    """``dictionary`` if it indexes a matrix of ``num_rows`` rows, else None (with a warning)."""
    if dictionary is not None and len(dictionary) != num_rows:
        logger.warning("dictionary size %d != %d embedding rows; using fairseq's default layout",
                       len(dictionary), num_rows)
        return None
    return dictionary


class MatrixRows(NamedTuple):
    all: torch.Tensor  # the selected row ids of the whole matrix
    groups: "OrderedDict[str, torch.Tensor]"  # group name -> its selected row ids (empty: no groups)


def matrix_rows(
    dictionary,
    num_rows: int,
    policy: str = "no-pad-madeup",
    exclude_unseen: bool = False,
    groups: Optional[Mapping[str, torch.Tensor]] = None,
    padding_idx: Optional[int] = None,
) -> MatrixRows:
    """The rows a statistic uses (CPU tensors): those of the row ``policy``, over the whole matrix
    and within each frequency group (``groups``: name -> ids, e.g. :func:`groups.frequency_groups`).

    ``dictionary`` must index the matrix (see :func:`dictionary_for`); without one, ``padding_idx``
    (the embedding's own) or fairseq's default padding id is dropped.
    """
    mask = G.row_mask(dictionary, policy, exclude_unseen, num_rows, padding_idx if dictionary is None else None)
    selected = OrderedDict()
    for name, ids in (groups or {}).items():
        in_group = torch.zeros_like(mask)
        in_group[ids] = True
        selected[name] = (in_group & mask).nonzero().reshape(-1)
    return MatrixRows(mask.nonzero().reshape(-1), selected)
