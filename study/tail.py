"""The tail part's own numbers (docs/study.md, "Part tail"), beside what fairseq-agg-analyze
reports for every LM part:

* :func:`group_perplexities`: the test PPL per frequency group under two groupings at once, the
  AGG paper's and the demo's (:data:`GROUPINGS`), from one scoring pass: the split is scored once
  over the cells both groupings cut the vocabulary into (:func:`refined_groups`), and each
  grouping's groups are sums of cells (:func:`merge_cells`);
* :func:`agg_window_numbers`: AGG's rare set at the end of training, recomputed from the window
  of counts the checkpoint carries, and the share of it with non-zero counts (the tokens AGG gates
  by their frequency; the never-counted ones get g1 = g2 = 0, exactly what freezing does to them);
* :func:`evaluate`: all of a run's numbers (the part's ``evaluate``, study/parts.py).
"""
import builtins
import collections
import contextlib
import re
import warnings
from typing import Dict, Optional, Sequence

import torch

from fairseq_agg.stats import groups as G
from study import evaluate as E
from study.columns import GROUPS
from study.harness.fairseq_logs import train_curve
from study.harness.fairseq_commands import NOISY_WARNINGS

# Frequency groups by rank, as fractions of the non-special types. "paper": the AGG paper's
# WikiText-103 evaluation (Yu et al. 2022, Table 1; the released eval_lm.py): the 13,000 most
# frequent of its 44,256 types, the next 23,000 (ranks up to 36,000), and the other 8,256;
# "demo": the 30 / 50 / 20 % of the LM demo and the other parts (fairseq-agg-analyze's default).
PAPER_TYPES = 44256
GROUPINGS = {
    "paper": (13000 / PAPER_TYPES, 23000 / PAPER_TYPES, 8256 / PAPER_TYPES),
    "demo": G.DEFAULT_FRACTIONS,
}


@contextlib.contextmanager
def quiet_known_warnings():
    """Turns off, in this process, the third-party warnings that fairseq's scoring prints at
    every call and that the child processes never show (study.harness.fairseq_commands.NOISY_WARNINGS: the
    same ``action:message:category:module`` filters). The filters are process-wide while this
    runs, so runs scored side by side in threads are quieted too."""
    with warnings.catch_warnings():
        for spec in NOISY_WARNINGS:
            action, message, category, module = spec.split(":")[:4]
            warnings.filterwarnings(action, message=re.escape(message), category=getattr(builtins, category),
                                    module=re.escape(module))
        yield


def fractions_flag(fractions: Sequence[float]) -> str:
    """``--group-fractions`` text of ``fractions`` (full precision: their sum stays 1)."""
    return ",".join(repr(float(f)) for f in fractions)


def grouping_sizes(dictionary, groupings=GROUPINGS) -> Dict[str, Dict[str, int]]:
    """{grouping: {group: number of types}}."""
    return {name: {g: int(ids.numel()) for g, ids in G.frequency_groups(dictionary, fr).items()}
            for name, fr in groupings.items()}


def refined_groups(dictionary, groupings=GROUPINGS):
    """(cells, members): the vocabulary cut at every boundary of every grouping. ``cells`` is an
    OrderedDict {cell name: ids} (the name joins the id's group in each grouping, e.g.
    "freq/med"), ``members`` {grouping: {group: [cell names]}}; ids in no group of a grouping
    (the specials, madeupwords) are in no cell."""
    size = len(dictionary)
    lookups = {name: G.group_lookup(G.frequency_groups(dictionary, fr), size) for name, fr in groupings.items()}
    cells = collections.OrderedDict()
    members = {name: {g: [] for g in G.GROUP_NAMES} for name in groupings}
    for i in range(size):
        where = [int(lookup[i]) for lookup in lookups.values()]
        if min(where) < 0:
            continue
        cell = "/".join(G.GROUP_NAMES[k] for k in where)
        if cell not in cells:
            cells[cell] = []
            for name, k in zip(groupings, where):
                members[name][G.GROUP_NAMES[k]].append(cell)
        cells[cell].append(i)
    return collections.OrderedDict((c, torch.tensor(ids)) for c, ids in cells.items()), members


def _entry(nll_sum, tokens):
    return {"tokens": int(tokens), "nll": nll_sum / tokens if tokens else None,
            "ppl": float(torch.tensor(nll_sum / tokens).exp()) if tokens else None}


def merge_cells(ppl: dict, members: Dict[str, Sequence[str]]) -> dict:
    """The ``ppl`` entry (fairseq-agg-analyze's schema: total, groups, ungrouped) of a grouping
    whose group g is the union of the cells ``members[g]`` of ``ppl["groups"]``: token counts
    add, and so do the summed NLLs (tokens x mean NLL)."""
    groups = collections.OrderedDict()
    for g, cells in members.items():
        parts = [ppl["groups"][c] for c in cells]
        tokens = sum(p["tokens"] for p in parts)
        groups[g] = _entry(sum(p["tokens"] * p["nll"] for p in parts if p["tokens"]), tokens)
    return {**{k: v for k, v in ppl.items() if k != "groups"}, "groups": groups}


def group_perplexities(checkpoint: str, data: str, split: str, context_window: int,
                       groupings=GROUPINGS) -> Dict[str, dict]:
    """{grouping: ppl entry} of ``checkpoint`` on ``split`` of ``data``, scored once like
    ``fairseq-eval-lm --context-window`` (fairseq_agg.analysis.perplexity.group_perplexity) on the
    CPU; every grouping has the same total and the same ungrouped tokens."""
    from fairseq_agg.analysis.checkpoints import load_checkpoint, load_model_and_task
    from fairseq_agg.analysis.perplexity import group_perplexity, scoring_tokens_per_sample

    state = load_checkpoint(checkpoint)
    tokens_per_sample = scoring_tokens_per_sample(state, checkpoint, context_window)
    model, task = load_model_and_task(checkpoint, state, data, torch.device("cpu"))
    cells, members = refined_groups(task.target_dictionary, groupings)
    scored = group_perplexity(model, task, split, cells, device="cpu", context_window=context_window,
                              tokens_per_sample=tokens_per_sample)
    return {name: merge_cells(scored, members[name]) for name in groupings}


def agg_window_numbers(checkpoint: str, data: str) -> Optional[dict]:
    """AGG's rare set and operating point at the checkpoint's last update, from the window of counts
    its criterion state holds (``--criterion cross_entropy_agg``, gating or freezing), with the
    run's own alpha, threshold mode and g1 mode, and the rare set's share of the test targets
    (fairseq-agg-analyze's ``agg`` entry); None for other criteria."""
    from fairseq.data import Dictionary

    from fairseq_agg.analysis.agg_window import agg_window_report, split_target_counts
    from fairseq_agg.analysis.checkpoints import load_checkpoint

    state, dictionary = load_checkpoint(checkpoint), Dictionary.load(f"{data}/dict.txt")
    if "window.counts" not in (state.get("criterion") or {}):
        return None
    return agg_window_report(state, dictionary, split_target_counts(data, "test", dictionary))


def evaluate(ctx, spec, budget, directory, ckpt, lines):
    """The tail part's numbers of a run (study.evaluate's signature): fairseq-agg-analyze for the
    embedding (the AGG paper's frequency groups, word similarity on plain words), the test PPL
    under both groupings in one scoring pass (:func:`group_perplexities`), Uniq, and AGG's rare
    set: its size over training (the logged agg_rare, agg_frozen when freezing) and at the end
    from the checkpoint's window (:func:`agg_window_numbers`)."""
    data_bin = ctx.data[spec.corpus.name][0]
    # the embedding's statistics per group of the paper's grouping; the PPL is scored here, below
    extra = ["--no-ppl", "--group-fractions", fractions_flag(GROUPINGS["paper"]),
             *ctx.word_sim.get(spec.corpus.name, [])]
    rep = E.analyze(ctx, spec, data_bin, directory, ckpt, extra)
    torch.set_num_threads(ctx.a.threads)  # before the scoring, as for Uniq
    with quiet_known_warnings():
        ppl = group_perplexities(ckpt, data_bin, "test", budget["context_window"])
        uniq = E.uniq_numbers(ctx, spec, data_bin, ckpt)
    out = {"analysis_flags": extra, "context_window": budget["context_window"],
           **E.analysis_numbers({**rep, "ppl": ppl["paper"]}), "ppl": ppl, "uniq": uniq,
           "agg_window": agg_window_numbers(ckpt, data_bin),
           "agg_rare_curve": train_curve(lines, "agg_rare") or train_curve(lines, "agg_frozen")}
    for g in GROUPS:
        out[f"test_ppl_demo_{g}"] = ppl["demo"]["groups"][g]["ppl"]
    return out
