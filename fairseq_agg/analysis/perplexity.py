"""Perplexity per frequency group of the target token (Yu et al., ACL 2022, Table 1; docs/stats.md).

:func:`group_nll_sums` and :func:`perplexity` are the pure-torch math; :func:`group_perplexity`
scores a split with a loaded fairseq model and :func:`per_group_perplexity` does the same for a
checkpoint file.

A language model is scored exactly as ``fairseq-eval-lm`` scores it: the task's own
``eval_lm_dataloader`` (blocks of ``tokens_per_sample - context_window`` tokens, each wrapped by
fairseq's ``LMContextWindowDataset`` so that it sees up to ``context_window`` tokens of the blocks
before it), fairseq's ``SequenceScorer``, the first position dropped with ``--add-bos-token`` and
tokens with an infinite score skipped. The total is therefore eval-lm's loss over the same tokens
(eval-lm without ``--post-process``); the groups split those same token NLLs. A translation model
is scored by the same ``SequenceScorer`` on the target given the source (as
``fairseq-generate --score-reference``).
"""
import contextlib
import math
from collections import OrderedDict
from typing import Dict, Optional, Sequence

import torch

from fairseq_agg.stats import groups as G

from .checkpoints import AnalyzeError, cfg_get, load_checkpoint, load_model_and_task


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


def _check_context_window(context_window: int, tokens_per_sample: int, source: str):
    """eval-lm scores blocks of ``tokens_per_sample - context_window`` >= 1 tokens."""
    if not 0 <= context_window < tokens_per_sample:
        raise AnalyzeError(
            f"--context-window must be in [0, {tokens_per_sample}) ({source}), got {context_window}"
        )


def scoring_tokens_per_sample(state: dict, path: str, context_window: int = 0,
                              tokens_per_sample: Optional[int] = None) -> Optional[int]:
    """The ``tokens_per_sample`` a split of checkpoint ``path`` (loaded ``state``) is scored with:
    ``tokens_per_sample`` (``--tokens-per-sample``) or else the checkpoint's own; ``None`` for a
    task that ``fairseq-eval-lm`` cannot score (e.g. translation). Raises :class:`AnalyzeError`,
    naming the flag and its range, for a setting that eval-lm would refuse, before anything is
    loaded."""
    from fairseq.tasks import TASK_REGISTRY

    if tokens_per_sample is not None and tokens_per_sample < 1:
        raise AnalyzeError(f"--tokens-per-sample must be >= 1, got {tokens_per_sample}")
    if context_window < 0:
        raise AnalyzeError(f"--context-window must be in [0, tokens_per_sample), got {context_window}")
    task_name = cfg_get(state.get("cfg"), "task", "_name")
    task_class = TASK_REGISTRY.get(task_name)
    if task_class is None or not hasattr(task_class, "eval_lm_dataloader"):
        for flag, value in (("--context-window", context_window or None), ("--tokens-per-sample", tokens_per_sample)):
            if value is not None:
                raise AnalyzeError(f"{flag} applies to language-model checkpoints (as in fairseq-eval-lm); "
                                   f"{path} has task {task_name!r}")
        return None
    if tokens_per_sample is not None:
        source = f"--tokens-per-sample {tokens_per_sample}"
    else:
        tokens_per_sample = cfg_get(state.get("cfg"), "task", "tokens_per_sample")
        source = f"the tokens_per_sample of {path}; --tokens-per-sample sets another"
    _check_context_window(context_window, tokens_per_sample, source)
    return int(tokens_per_sample)


@contextlib.contextmanager
def _task_tokens_per_sample(task, tokens_per_sample: int):
    """Sets the task's ``tokens_per_sample`` for the dataset and dataloader built inside, and puts
    back the caller's value afterwards."""
    old = task.args.tokens_per_sample
    task.args.tokens_per_sample = tokens_per_sample
    try:
        yield
    finally:
        task.args.tokens_per_sample = old


def _load_split(task, split: str):
    try:
        task.load_dataset(split)
    except FileNotFoundError as e:
        raise AnalyzeError(f"split {split!r} not found: {e}")
    return task.dataset(split)


def _scoring_batches(model, task, split: str, max_tokens: int, batch_size: Optional[int], context_window: int,
                     tokens_per_sample: Optional[int]):
    """(the batches of ``split`` as fairseq scores them, whether a leading <s> goes unscored, the
    tokens per sample of a language model or None): see :func:`group_perplexity`."""
    from fairseq import utils

    if hasattr(task, "eval_lm_dataloader"):
        tokens_per_sample = int(tokens_per_sample or task.args.tokens_per_sample)
        _check_context_window(context_window, tokens_per_sample, f"tokens_per_sample {tokens_per_sample}")
        # as fairseq-eval-lm: blocks of T - C tokens, each given up to C tokens of context
        with _task_tokens_per_sample(task, tokens_per_sample - context_window):
            itr = task.eval_lm_dataloader(
                dataset=_load_split(task, split), max_tokens=max_tokens, batch_size=batch_size,
                max_positions=utils.resolve_max_positions(model.max_positions()), num_workers=0,
                context_window=context_window,
            )
        return itr, bool(getattr(task.args, "add_bos_token", False)), tokens_per_sample
    if context_window or tokens_per_sample is not None:
        flag = "--context-window" if context_window else "--tokens-per-sample"
        raise AnalyzeError(f"{flag} applies to language-modeling tasks (as in fairseq-eval-lm), "
                           f"not to {type(task).__name__}")
    # batch-size multiple 1: fairseq drops a last batch smaller than the multiple (fairseq#5036)
    itr = task.get_batch_iterator(
        dataset=_load_split(task, split), max_tokens=max_tokens, max_sentences=batch_size,
        max_positions=utils.resolve_max_positions(task.max_positions(), model.max_positions()),
        ignore_invalid_inputs=True, required_batch_size_multiple=1, seed=1, num_workers=0,
    ).next_epoch_itr(shuffle=False)
    return itr, False, None


def _scored_tokens(scorer, model, sample, remove_bos: bool):
    """(the NLL of every scored target token of ``sample``, their ids), as fairseq-eval-lm scores them."""
    targets, nlls = [], []
    for hypos in scorer.generate([model], sample):  # one hypothesis per sentence: its target
        tokens, scores = hypos[0]["tokens"], hypos[0]["positional_scores"].float()
        if remove_bos:  # eval-lm does not score the <s> that --add-bos-token puts first
            tokens, scores = tokens[1:], scores[1:]
        finite = ~torch.isinf(scores)  # eval-lm skips tokens with an infinite score
        targets.append(tokens[finite])
        nlls.append(-scores[finite])
    return torch.cat(nlls), torch.cat(targets)


@torch.no_grad()
def group_perplexity(model, task, split: str, groups: Dict[str, torch.Tensor], max_tokens: int = 2048,
                     batch_size: Optional[int] = None, device=None, context_window: int = 0,
                     tokens_per_sample: Optional[int] = None) -> dict:
    """PPL of ``split`` in total and per group of the target token.

    ``groups`` maps a group name to target-dictionary ids (e.g. :func:`groups.frequency_groups`).
    A language-modeling task is scored as ``fairseq-eval-lm --tokens-per-sample T --context-window
    C`` scores it (``T``: ``tokens_per_sample``, default the task's own); any other task (MT) as
    ``fairseq-generate --score-reference`` (no context window). Batching (``max_tokens``,
    ``batch_size``) does not change the scores. The result also holds ``ungrouped``: the tokens
    whose type is in no group (``</s>``, ``<unk>``, ...), so that the groups and ``ungrouped``,
    weighted by their tokens, add up to ``total``.
    """
    from fairseq import utils
    from fairseq.sequence_scorer import SequenceScorer

    device = torch.device(device) if device is not None else next(model.parameters()).device
    model.eval()
    tgt_dict = task.target_dictionary
    itr, remove_bos, tokens_per_sample = _scoring_batches(model, task, split, max_tokens, batch_size,
                                                          context_window, tokens_per_sample)
    scorer = SequenceScorer(tgt_dict)
    lookup = G.group_lookup(groups, len(tgt_dict)).to(device)
    num_groups = len(groups)
    sums = torch.zeros(num_groups, dtype=torch.float64, device=device)
    counts = torch.zeros(num_groups, dtype=torch.float64, device=device)
    total_nll, total_n = 0.0, 0
    for sample in itr:
        if not sample or "net_input" not in sample:
            continue
        sample = utils.apply_to_sample(lambda t: t.to(device), sample)
        nll, target = _scored_tokens(scorer, model, sample, remove_bos)
        s, c = group_nll_sums(nll, target, lookup, num_groups)
        sums += s
        counts += c
        total_nll += nll.double().sum().item()
        total_n += int(target.numel())
    if total_n == 0:
        raise AnalyzeError(f"split {split!r} has no scorable tokens")
    grouped_nll, grouped_n = float(sums.sum()), float(counts.sum())
    return {
        "split": split,
        "context_window": context_window,
        "tokens_per_sample": tokens_per_sample,
        "total": _entry(total_nll, total_n),
        "groups": OrderedDict((g, _entry(float(sums[k]), float(counts[k]))) for k, g in enumerate(groups)),
        "ungrouped": _entry(total_nll - grouped_nll, total_n - grouped_n),
    }


def per_group_perplexity(checkpoint: str, data: str, split: str = "valid",
                         fractions: Sequence[float] = G.DEFAULT_FRACTIONS, preset: Optional[str] = None,
                         max_tokens: int = 2048, device=None, state=None, context_window: int = 0,
                         tokens_per_sample: Optional[int] = None) -> dict:
    """Loads ``checkpoint`` (or its already loaded ``state``) with its task on ``data`` and returns
    :func:`group_perplexity`'s dict for ``split`` with groups of the target dictionary;
    ``context_window`` and ``tokens_per_sample`` (default: the checkpoint's) as in
    ``fairseq-eval-lm``, for a language model only."""
    if state is None:
        state = load_checkpoint(checkpoint)
    tokens_per_sample = scoring_tokens_per_sample(state, checkpoint, context_window, tokens_per_sample)
    device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, task = load_model_and_task(checkpoint, state, data, device)
    try:
        groups = G.frequency_groups(task.target_dictionary, fractions, preset, flag="--group-preset")
    except ValueError as e:
        raise AnalyzeError(str(e))
    return group_perplexity(model, task, split, groups, max_tokens=max_tokens, device=device,
                            context_window=context_window, tokens_per_sample=tokens_per_sample)
