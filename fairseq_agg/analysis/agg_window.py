"""AGG's rare set and operating point at a checkpoint, from the window of counts it carries.

A checkpoint written with ``--criterion cross_entropy_agg`` (gating or freezing) holds the
criterion's window: the counts of the last K updates (``window.counts``) and ``window.meta`` =
[K, update index, updates recorded]. With the run's own alpha, threshold mode and g1 mode this
gives the rare set AGG gated at the last update, and the operating point
(:func:`fairseq_agg.ops.agg_threshold.operating_point`; docs/agg.md, "The operating point"): the
count per epoch below which a type is rare, and the share of updates in which a type at that count
is a target. The tokens per update are the window's mean; an epoch is known when the window was
sized automatically (``--agg-window 0``: one epoch of updates); with an explicit window the count
per epoch is left out (None).
"""
import os
from typing import Optional

import torch

from fairseq_agg.fairseq_facts.dictionary import nspecial
from fairseq_agg.ops.agg import agg_gates
from fairseq_agg.ops.agg_threshold import operating_point, resolve_threshold

from .checkpoints import cfg_get


def split_target_counts(data: str, split: str, dictionary) -> Optional[torch.Tensor]:
    """(V,) how often each id is a target in ``split`` of a language-modelling data-bin (every token
    of ``DATA/SPLIT.bin``, each line's </s> included); None where there is no such file (a
    translation data-bin names its files by language pair)."""
    from fairseq.data import data_utils

    path = os.path.join(data, split)
    if not os.path.exists(path + ".bin"):
        return None
    dataset = data_utils.load_indexed_dataset(path, dictionary)
    if dataset is None:
        return None
    counts = torch.zeros(len(dictionary), dtype=torch.int64)
    for i in range(len(dataset)):
        counts += torch.bincount(dataset[i].long(), minlength=len(dictionary))
    return counts


def agg_window_report(state: dict, dictionary=None, target_counts: Optional[torch.Tensor] = None) -> Optional[dict]:
    """The rare set and operating point of a loaded checkpoint ``state``; None when it carries no
    AGG window (another criterion). ``dictionary``: the target dictionary (its special symbols are
    never rare); fairseq's four specials without one. ``target_counts`` (V,): the targets of a split
    (:func:`split_target_counts`), for the share of them the rare set holds."""
    criterion = state.get("criterion") or {}
    counts, meta = criterion.get("window.counts"), criterion.get("window.meta")
    if counts is None or meta is None:
        return None
    cfg = state.get("cfg")

    def get(key):
        return cfg_get(cfg, "criterion", key)

    translation = "translation" in str(cfg_get(cfg, "task", "_name") or "")
    mode, ref_tokens = resolve_threshold(get("agg_threshold_mode") or "auto", get("agg_ref_tokens") or 0, translation)
    alpha = float(get("agg_alpha"))
    window, _, recorded = (int(v) for v in meta.tolist())
    gates = agg_gates(counts, max(recorded, 1), alpha, nspecial(dictionary), get("agg_g1_mode") or "code", mode,
                      ref_tokens)
    rare, seen = gates.rare, counts > 0
    n_rare, window_tokens = int(rare.sum()), int(counts.sum())
    frozen = bool(get("agg_freeze_rare"))
    out = {"alpha": alpha, "threshold_mode": mode, "ref_tokens": ref_tokens, "window": window,
           "window_updates": recorded, "window_tokens": window_tokens, "rare": n_rare,
           "rare_seen": int((rare & seen).sum()),
           "rare_seen_fraction": float((rare & seen).sum()) / n_rare if n_rare else None,
           "frozen": frozen,
           # what freezing froze: this window set, or the static rare group of the statistics
           "freeze_set": (get("agg_freeze_set") or "window") if frozen else None,
           "rare_target_share": None}
    if target_counts is not None and int(target_counts.sum()):
        out["rare_target_share"] = float(target_counts[rare].sum()) / float(target_counts.sum())
    epoch_is_window = not get("agg_window")  # 0: the window was sized to one epoch of updates
    out.update(tokens_per_update=None, target_share=None, updates_per_epoch=None, rare_below_per_epoch=None)
    if recorded and window_tokens:
        # the share of updates does not depend on the epoch's length; the count per epoch does
        updates = window if epoch_is_window else recorded
        point = operating_point(alpha, mode, ref_tokens, window_tokens / recorded * updates, updates)
        out.update(tokens_per_update=point.tokens_per_update, target_share=point.target_share)
        if epoch_is_window:
            out.update(updates_per_epoch=window, rare_below_per_epoch=point.count_per_epoch)
    return out
