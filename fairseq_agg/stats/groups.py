"""Frequency groups and row policies for a fairseq dictionary (see docs/stats.md, "Metrics").

fairseq's ``Dictionary.finalize`` sorts the types by training count after the ``nspecial``
special symbols (``<s>``, ``<pad>``, ``</s>``, ``<unk>`` and any extra specials), so dictionary
order is frequency order. ``fairseq-preprocess`` then pads the vocabulary to a multiple of 8
with never-seen ``madeupwordNNNN`` types, which are never trained. Which ids are special or
``madeupword`` is read from :mod:`fairseq_agg.fairseq_facts.dictionary`.

Groups (names ``freq``, ``med``, ``rare``):

* by fractions (default 30 % / 50 % / 20 %, the split of Yu et al. 2022, Table 1) of the
  *eligible* types, i.e. the non-special, non-``madeupword`` ones in dictionary order; the
  boundaries are ``round(f1·n)`` and ``round((f1+f2)·n)`` for n eligible types;
* preset ``wikitext103-official``: the id ranges [0, 13001), [13001, 36000), [36000, V) of the
  authors' released WikiText-103 evaluation (their eval_lm.py: ids <= 13000 frequent, ids >= 36000
  rare), specials included, to reproduce it exactly.

:func:`split_by_fractions` is the cut by fractions alone, for any ids in frequency order (the
Hugging Face statistics sort a vocabulary by its training counts: docs/hf.md, "Statistics").

Row policies for matrix statistics: ``all``; ``no-pad-madeup`` (default: drops the zero-initialised
padding row and the ``madeupword`` rows); ``no-special`` (also drops every special symbol).

Only the dictionary's ``symbols``, ``count``, ``nspecial`` and ``pad()`` are used (duck typing).
"""
import math
from collections import OrderedDict
from typing import Dict, Optional, Sequence, Tuple

import torch

from fairseq_agg.errors import UsageError
from fairseq_agg.fairseq_facts.dictionary import madeupword_ids, nspecial, pad_index, special_ids

GROUP_NAMES = ("freq", "med", "rare")
DEFAULT_FRACTIONS = (0.3, 0.5, 0.2)
# preset name -> (first medium id, first rare id); the authors' eval_lm.py counts id 13000 as frequent
PRESETS = {"wikitext103-official": (13001, 36000)}
ROW_POLICIES = ("all", "no-pad-madeup", "no-special")


def parse_fractions(value, flag: str = "--embed-group-fractions") -> Tuple[float, float, float]:
    """Parses "0.3,0.5,0.2" (or a 3-sequence) into three fractions that sum to 1."""
    try:
        parts = value.split(",") if isinstance(value, str) else list(value)
        fr = tuple(float(p) for p in parts)
    except (TypeError, ValueError):
        raise UsageError(f"{flag}: expected three comma-separated numbers like 0.3,0.5,0.2, got {value!r}") from None
    if len(fr) != 3 or any(not (0.0 <= f <= 1.0) for f in fr) or abs(sum(fr) - 1.0) > 1e-6:
        raise UsageError(
            f"{flag}: expected three fractions in [0, 1] (frequent, medium, rare) that sum to 1, got {value!r}"
        )
    return fr


def _size(dictionary, num_rows):
    if dictionary is not None:
        if num_rows is not None and num_rows != len(dictionary):
            raise ValueError(f"the matrix has {num_rows} rows but the dictionary has {len(dictionary)} types")
        return len(dictionary)
    if num_rows is None:
        raise ValueError("need a dictionary or num_rows")
    return num_rows


def row_mask(
    dictionary=None,
    policy: str = "no-pad-madeup",
    exclude_unseen: bool = False,
    num_rows: Optional[int] = None,
    padding_idx: Optional[int] = None,
) -> torch.Tensor:
    """Boolean [V] mask of the rows a matrix statistic uses (see the module docstring).

    ``exclude_unseen`` also drops non-special types whose dictionary count is 0 (never seen in the
    data the dictionary was built from). Without a dictionary, fairseq's default layout is assumed
    (4 specials, padding id 1, or ``padding_idx``) and no ``madeupword`` row can be recognised.
    """
    if policy not in ROW_POLICIES:
        raise ValueError(f"row policy must be one of {', '.join(ROW_POLICIES)}, got {policy!r}")
    V = _size(dictionary, num_rows)
    mask = torch.ones(V, dtype=torch.bool)
    if policy == "all":
        return mask
    pad = pad_index(dictionary) if padding_idx is None else padding_idx
    if 0 <= pad < V:
        mask[pad] = False
    mask[madeupword_ids(dictionary)] = False
    if policy == "no-special":
        mask[[i for i in special_ids(dictionary) if i < V]] = False
    if exclude_unseen and dictionary is not None:
        first = nspecial(dictionary)
        unseen = [i for i, c in enumerate(dictionary.count) if i >= first and c == 0]
        mask[unseen] = False
    return mask


def select_rows(dictionary=None, policy="no-pad-madeup", exclude_unseen=False, num_rows=None, padding_idx=None):
    """Row ids (LongTensor) selected by :func:`row_mask`."""
    return row_mask(dictionary, policy, exclude_unseen, num_rows, padding_idx).nonzero().reshape(-1)


def eligible_ids(dictionary=None, num_rows: Optional[int] = None) -> torch.Tensor:
    """Non-special, non-``madeupword`` ids in dictionary (= frequency) order."""
    V = _size(dictionary, num_rows)
    mask = torch.ones(V, dtype=torch.bool)
    mask[[i for i in special_ids(dictionary) if i < V]] = False
    mask[madeupword_ids(dictionary)] = False
    return mask.nonzero().reshape(-1)


def _round_half_up(x: float) -> int:
    return int(math.floor(x + 0.5))


def frequency_groups(
    dictionary=None,
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
    preset: Optional[str] = None,
    num_rows: Optional[int] = None,
    flag: str = "--embed-group-preset",
) -> "OrderedDict[str, torch.Tensor]":
    """Frequency groups ``{"freq": ids, "med": ids, "rare": ids}`` (see the module docstring)."""
    V = _size(dictionary, num_rows)
    if preset is not None:
        if preset not in PRESETS:
            raise UsageError(f"{flag}: unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
        b1, b2 = PRESETS[preset]
        if V <= b2:
            raise UsageError(
                f"{flag} {preset} uses the id ranges [0,{b1}), [{b1},{b2}), [{b2},V) and needs a "
                f"vocabulary of more than {b2} types; this one has {V}"
            )
        ids = torch.arange(V)
        return OrderedDict(zip(GROUP_NAMES, (ids[:b1], ids[b1:b2], ids[b2:])))
    return split_by_fractions(eligible_ids(dictionary, V), fractions)


def split_by_fractions(ids: torch.Tensor, fractions: Sequence[float] = DEFAULT_FRACTIONS,
                       flag: str = "--embed-group-fractions") -> "OrderedDict[str, torch.Tensor]":
    """``{"freq", "med", "rare"}``: ``ids`` (most frequent first) cut at round(f1·n) and
    round((f1+f2)·n), rounding halves up (a dictionary's eligible ids, or any vocabulary's ids
    sorted by their training counts)."""
    f1, f2, _ = parse_fractions(fractions, flag)
    n = ids.numel()
    b1, b2 = _round_half_up(f1 * n), _round_half_up((f1 + f2) * n)
    return OrderedDict(zip(GROUP_NAMES, (ids[:b1], ids[b1:b2], ids[b2:])))


def group_lookup(groups: Dict[str, torch.Tensor], num_rows: int) -> torch.Tensor:
    """[V] long tensor: the position of each id's group in ``groups`` (``-1`` for none)."""
    out = torch.full((num_rows,), -1, dtype=torch.long)
    for k, ids in enumerate(groups.values()):
        out[ids] = k
    return out
