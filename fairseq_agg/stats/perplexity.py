"""Perplexity per frequency group of the target token (Yu et al., ACL 2022, Table 1; docs/stats.md).

:func:`group_nll_sums` and :func:`perplexity` are the pure-torch math; :func:`group_perplexity`
scores a split with a loaded fairseq model (teacher forcing, no context window, like
``fairseq-eval-lm``'s default; for MT the target given the source) and
:func:`per_group_perplexity` does the same for a checkpoint file.
"""
import math
from collections import OrderedDict
from typing import Dict, Optional, Sequence

import torch

from . import groups as G
from .checkpoints import AnalyzeError, load_checkpoint, load_model_and_task


def group_nll_sums(
    nll: torch.Tensor, target: torch.Tensor, group_of_token: torch.Tensor, num_groups: int
):
    """Per-group sums of token NLL and token counts.

    ``nll`` and ``target`` are 1-D (padding already removed); ``group_of_token`` is a [V] long
    tensor mapping a token id to its group (``-1``: in no group). Returns float64 ``(sums, counts)``
    of shape [num_groups]; the caller adds them over batches.
    """
    nll = nll.reshape(-1).double()
    target = target.reshape(-1)
    if nll.numel() != target.numel():
        raise ValueError("nll and target must have the same number of tokens")
    g = group_of_token.to(target.device)[target]
    keep = g >= 0
    g = g[keep]
    sums = torch.zeros(num_groups, dtype=torch.float64, device=nll.device)
    sums.index_add_(0, g, nll[keep])
    counts = torch.bincount(g, minlength=num_groups).double()
    return sums, counts


def perplexity(nll_sum: float, count: float) -> Optional[float]:
    """exp(mean NLL in nats) = 2^(mean base-2 loss), fairseq's ``ppl``; None without tokens."""
    if count <= 0:
        return None
    return math.exp(nll_sum / count)


def _entry(nll_sum, n):
    return {"tokens": int(n), "nll": (nll_sum / n) if n else None, "ppl": perplexity(nll_sum, n)}


@torch.no_grad()
def group_perplexity(model, task, split: str, groups: Dict[str, torch.Tensor], max_tokens: int = 2048,
                     batch_size: Optional[int] = None, device=None) -> dict:
    """Teacher-forced PPL of ``split`` in total and per group of the target token.

    ``groups`` maps a group name to target-dictionary ids (e.g. :func:`groups.frequency_groups`).
    Works for any fairseq model whose task yields ``net_input`` and ``target`` (LM, MT); log-probs
    come from ``model.get_normalized_probs`` in fp32; padding is never scored.
    """
    from fairseq import utils

    device = torch.device(device) if device is not None else next(model.parameters()).device
    model.eval()
    try:
        task.load_dataset(split)
    except FileNotFoundError as e:
        raise AnalyzeError(f"split {split!r} not found: {e}")
    dataset = task.dataset(split)
    tgt_dict = task.target_dictionary
    lookup = G.group_lookup(groups, len(tgt_dict)).to(device)
    itr = task.get_batch_iterator(
        dataset=dataset, max_tokens=max_tokens, max_sentences=batch_size,
        max_positions=utils.resolve_max_positions(task.max_positions(), model.max_positions()),
        ignore_invalid_inputs=True, required_batch_size_multiple=1, seed=1, num_workers=0,
    ).next_epoch_itr(shuffle=False)
    num_groups = len(groups)
    sums = torch.zeros(num_groups, dtype=torch.float64, device=device)
    counts = torch.zeros(num_groups, dtype=torch.float64, device=device)
    total_nll, total_n = 0.0, 0
    for sample in itr:
        if not sample or "net_input" not in sample:
            continue
        sample = utils.apply_to_sample(lambda t: t.to(device), sample)
        net_output = model(**sample["net_input"])
        lprobs = model.get_normalized_probs(net_output, log_probs=True).float()
        target = model.get_targets(sample, net_output)
        nll = -lprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        keep = target.ne(tgt_dict.pad())
        nll, target = nll[keep], target[keep]
        s, c = group_nll_sums(nll, target, lookup, num_groups)
        sums += s
        counts += c
        total_nll += nll.double().sum().item()
        total_n += int(target.numel())
    if total_n == 0:
        raise AnalyzeError(f"split {split!r} has no scorable tokens")
    return {
        "split": split,
        "total": _entry(total_nll, total_n),
        "groups": OrderedDict((g, _entry(float(sums[k]), float(counts[k]))) for k, g in enumerate(groups)),
    }


def per_group_perplexity(checkpoint: str, data: str, split: str = "valid",
                         fractions: Sequence[float] = G.DEFAULT_FRACTIONS, preset: Optional[str] = None,
                         max_tokens: int = 2048, device=None, state=None) -> dict:
    """Loads ``checkpoint`` (or its already loaded ``state``) with its task on ``data`` and returns
    :func:`group_perplexity`'s dict for ``split`` with groups of the target dictionary."""
    if state is None:
        state = load_checkpoint(checkpoint)
    device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, task = load_model_and_task(checkpoint, state, data, device)
    try:
        groups = G.frequency_groups(task.target_dictionary, fractions, preset, flag="--group-preset")
    except ValueError as e:
        raise AnalyzeError(str(e))
    return group_perplexity(model, task, split, groups, max_tokens=max_tokens, device=device)
