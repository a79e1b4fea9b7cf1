"""A part's report, WORK/PART/report/: table.md, results.json and the figures, made from its
finished runs' result.json files alone (so ``--report`` can remake them at any time, with other
spike settings too).

Every cell is mean ± h over the seeds (h = half the range, :func:`study.harness.tables.fmt`);
a ``*`` marks a method whose difference to the baseline exceeds the spread
(:func:`study.metrics.compare_to_baseline`). What a part's report holds is said by its
:class:`study.parts.Part`, never by its name: its columns and tables, and its ``report``, the
sections below in their order, each a function of the :class:`Report` that gives the lines,
figures and results.json entries it adds (a :class:`Section`).
"""
import dataclasses
import os
import time
from typing import Callable, Dict, List, Optional

from examples.lm_demo.wordsim import DATASETS
from study import report_figures as F
from study.columns import metric, run_spikes
from study.harness.tables import fmt, markdown_table, mean_spread, write_json
from study.metrics import compare_to_baseline, convergence


def headline(part, res):
    """One finished run of ``part`` in a few numbers (the console's "done" line)."""
    m = res["metrics"]
    if not part.corpus.language_model:
        return f"BLEU {m['bleu']:.2f}, chrF {m['chrf']:.2f}"
    text = f"test PPL {m['test_ppl']:.2f}, I(W) {m['isotropy']:.3f}"
    if part.by_depth:
        text += f", µTEV {m['tev_mu']:.4f}"
    if part.uniq:
        text += f", Uniq {m['uniq']['uniq']}"
    return text


# ---------------------------------------------------------------------------- the table


def baseline_of(part, name, groups):
    """The run name a method is compared with: the baseline (at the same depth in a part by depth)."""
    if part.by_depth:
        return f"baseline-L{groups[name]['depth']}"
    return "baseline"


def summarise(part, names, by_name, cols, groups):
    """{name: {key: {"mean", "spread", "values", "exceeds_baseline"}}} and the table's rows."""
    summary, rows = {}, []
    for name in names:
        runs = by_name[name]
        base = by_name.get(baseline_of(part, name, groups), [])
        summary[name], row = {"seeds": [r["seed"] for r in runs]}, [name, str(len(runs))]
        for key, _, digits, get in cols:
            vals = [get(r) for r in runs]
            exceeds = None if name == baseline_of(part, name, groups) else compare_to_baseline(vals, [get(r) for r in base])
            mean, spread = mean_spread(vals)
            summary[name][key] = {"mean": mean, "spread": spread, "values": vals, "exceeds_baseline": exceeds}
            row.append(fmt(vals, digits) + (" *" if exceeds else ""))
        rows.append(row)
    return summary, rows


def one_table(headers, rows) -> List[str]:
    """A part's table as one markdown table (:class:`study.parts.Part`'s default ``tables``)."""
    return [markdown_table(headers, rows)]


# ---------------------------------------------------------------------------- the sections


@dataclasses.dataclass(frozen=True)
class Report:
    """What a part's report sections read."""

    part: object  # its study.parts.Part
    a: object  # the invocation's flags (budget, jobs)
    budget: dict  # the part's budget at this invocation
    planned: int  # the number of planned runs
    results: List[dict]  # the finished runs' result.json
    names: List[str]  # the run names with a finished run, in the part's order
    groups: Dict[str, dict]  # every planned run name's group (study.parts.RunSpec.group)
    by_name: Dict[str, List[dict]]  # name -> its results, by seed
    summary: dict  # :func:`summarise`'s
    out_dir: str  # WORK/PART/report
    spikes: dict  # the spike settings
    styles: Dict[str, dict]  # every planned run's style (report_figures.part_styles)
    projection: Optional[Callable] = None  # (labels, checkpoints, png) -> png: see make_report
    data_report: Optional[dict] = None  # the corpus's own (the tail part's)


@dataclasses.dataclass
class Section:
    """What one section adds to the report: lines of table.md, figures {name: path}, entries of
    results.json."""

    lines: List[str] = dataclasses.field(default_factory=list)
    figures: Dict[str, str] = dataclasses.field(default_factory=dict)
    results: Dict[str, object] = dataclasses.field(default_factory=dict)


def convergence_line(r: Report) -> Section:
    """Whether the baseline's valid PPL converged (study.metrics.convergence), and every run's change."""
    conv = {n: [convergence(res["curves"]["valid_ppl"], res["updates"]) for res in r.by_name[n]] for n in r.names}
    base = "baseline" if "baseline" in conv else next((n for n in r.names if n.startswith("baseline")), None)
    if base is None:
        return Section(results={"convergence": conv})
    changes = [c for c in conv[base] if c is not None]
    if not changes:
        line = (f"Convergence: {base} validated too rarely to tell (needs two validations in the last fifth of "
                "training).")
    else:
        worst = max(abs(c["change"]) for c in changes)
        ok = all(c["converged"] for c in changes)
        line = (f"Convergence: the {base} valid PPL changed by at most {100 * worst:.2f} % over the last fifth of "
                f"training (criterion < 1 %): {'met' if ok else '**NOT MET**: not converged'}.")
    return Section([line, ""], results={"convergence": conv})


def uniq_line(r: Report) -> Section:
    """Uniq's settings and the distinct tokens of the reference continuations."""
    refs = [res["metrics"]["uniq"]["uniq_reference"] for res in r.results if "uniq" in res["metrics"]]
    if not refs:
        return Section()
    u = r.results[0]["metrics"].get("uniq") or {}
    return Section([f"Uniq: {u.get('prefixes')} test prefixes of {u.get('prefix_len')} tokens, {u.get('length')} "
                    f"greedy tokens each; the reference continuations have {max(refs)} distinct tokens.", ""])


def word_similarity_pairs(r: Report) -> Section:
    """How many pairs of each word-similarity list were scored."""
    ws = r.results[0]["metrics"].get("word_similarity") or {}
    pairs = [f"{DATASETS.get(stem, stem)} {v['single']['pairs']} single-token / {v['subword']['pairs']} all of "
             f"{v['total_pairs']}" for stem, v in sorted(ws.items()) if v]
    return Section(["Word-similarity pairs scored: " + "; ".join(pairs) + ".", ""] if pairs else [])


def spike_line(r: Report) -> Section:
    """The spike settings, and every run's spikes in results.json."""
    s = r.spikes
    return Section([f"Spikes: window {s['window']}, gnorm factor {s['gnorm_factor']}, loss factor {s['loss_factor']}.",
                    ""], results={"spikes": {res["run_id"]: run_spikes(res, s) for res in r.results}})


def learning_curves(r: Report) -> Section:
    """The plain cross-entropy of every criterion, train and valid (a language model's validation
    as its PPL, log scale), never a criterion's own optimised loss."""
    runs_dir = os.path.dirname(r.out_dir)
    valid = ((lambda res: res["curves"].get("valid_ppl") or [], "valid PPL (plain cross-entropy)", True)
             if r.part.corpus.language_model else
             (F.valid_cross_entropy, "valid cross-entropy\n(nll_loss: no label smoothing; bits/token)", False))
    train = (lambda res: F.train_cross_entropy(res, runs_dir), "train cross-entropy (nll_loss, bits/token)", False)
    path = os.path.join(r.out_dir, "learning_curves.png")
    return Section(figures={"curves": F.figure_curves(r.by_name, r.names, path, [train, valid], r.styles)})


def group_ppl_figure(r: Report) -> Section:
    path = os.path.join(r.out_dir, "group_ppl.png")
    return Section(figures={"group_ppl": F.figure_group_ppl(r.summary, r.names, path, r.styles)})


def projections_figure(r: Report) -> Section:
    """The embedding projections of every run's first seed, from the checkpoints (left out when a
    checkpoint is gone or there is no ``projection``)."""
    ckpts = [os.path.join(os.path.dirname(r.out_dir), r.by_name[n][0]["run_id"], "checkpoint_last.pt") for n in r.names]
    if r.projection is None or not all(os.path.isfile(c) for c in ckpts):
        return Section()
    return Section(figures={"projections": r.projection(r.names, ckpts, os.path.join(r.out_dir, "projections.png"))})


def frontier_figure(r: Report) -> Section:
    path = os.path.join(r.out_dir, "frontier.png")
    return Section(figures={"frontier": F.figure_frontier(r.summary, r.names, r.groups, path, r.styles)})


def depth_figure(r: Report) -> Section:
    path = os.path.join(r.out_dir, "depth.png")
    return Section(figures={"depth": F.figure_depth(r.summary, r.names, r.groups, path, r.spikes, r.styles)})


# ---------------------------------------------------------------------------- the report


def wall_time_line(results, invocations):
    """(table.md's line of the time the runs took, results.json's "wall")."""
    run_seconds = sum(r.get("wall_seconds") or 0.0 for r in results)
    trained = "; ".join(f"{r['seconds'] / 60:.1f} min ({r['runs_trained']} run{'' if r['runs_trained'] == 1 else 's'})"
                        for r in invocations)
    return (f"Wall time: {run_seconds / 60:.1f} min of runs (sum over runs, training and evaluation); "
            f"the invocations that trained them: {trained or 'none recorded'}."), \
        {"run_seconds": run_seconds, "invocations": invocations}


def make_report(part, a, budget, specs, results, out_dir, spikes, invocations, projection=None, data_report=None):
    """WORK/PART/report/: table.md, results.json and the figures of ``part`` (a
    :class:`study.parts.Part`): its table, then each section of ``part.report`` in order; returns
    out_dir. ``invocations``: the records of the invocations that trained the part's runs
    (store.py). ``projection(labels, checkpoints, png)``, when given, draws the embedding
    projections (one panel per method, its first seed) into png for :func:`projections_figure`:
    the one figure made from checkpoints, not from result.json. ``data_report``: the corpus's own
    (the tail part's, tail_data.data_report), for the part's own section."""
    os.makedirs(out_dir, exist_ok=True)
    groups = {}
    for s in specs:
        groups.setdefault(s.name, s.group)
    by_name = {n: sorted((r for r in results if r["name"] == n), key=lambda r: r["seed"]) for n in groups}
    names = [n for n in groups if by_name[n]]
    cols = part.columns(metric, results, spikes)
    summary, rows = summarise(part, names, by_name, cols, groups)
    r = Report(part, a, budget, len(specs), results, names, groups, by_name, summary, out_dir, spikes,
               F.part_styles(part, list(groups), groups), projection, data_report)
    sections = [section(r) for section in part.report]
    wall_line, wall = wall_time_line(results, invocations)
    figures = {k: v for s in sections for k, v in s.figures.items()}
    lines = [f"# Study part `{part.name}`", "",
             f"Budget `{a.budget}`: {budget['updates']} updates per run; {len(results)} finished runs of "
             f"{len(specs)} planned. Cells: mean±h over the seeds (h = half the range); `*`: the difference to "
             "the baseline exceeds h + h_baseline (needs two seeds or more on both sides).", "",
             *part.tables(["run", "seeds"] + [h for _, h, _, _ in cols], rows), "", part.notes, "",
             *(line for s in sections for line in s.lines), wall_line,
             "", "Figures: " + ", ".join(os.path.basename(f) for f in figures.values())]
    with open(os.path.join(out_dir, "table.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    write_json(os.path.join(out_dir, "results.json"), {
        "part": part.name, "budget": a.budget, "updates": budget["updates"], "planned_runs": len(specs),
        "finished_runs": len(results), "names": names, "groups": groups, "summary": summary,
        "spike_settings": spikes, **{k: v for s in sections for k, v in s.results.items()}, "wall": wall,
        "figures": {k: os.path.basename(v) for k, v in figures.items()}, "made": time.time(),
    })
    return out_dir
