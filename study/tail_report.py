"""The tail part's report (docs/study.md, "Part tail"): what :func:`study.report.make_report`
adds for it, from the finished runs' result.json files and the data report alone.

* the data: vocabulary, coverage and ``<unk>`` rate per split, the frequency groups, and AGG's
  rare set at a window of one full epoch (:func:`study.tail_data.data_report`);
* two tables (perplexity; embedding and diversity), the claims table (claim | measured | exceeds
  the spread? | verdict, the form of docs/results.md; the verdict is the mechanical one of
  :func:`verdict`, to be read with the numbers), the convergence of every run and seed (the
  calibration criterion), and the part's wall time at this budget;
* figures, each run in one style (an Okabe-Ito colour, a marker and a line style) in every panel
  and figure (:func:`tail_styles`, study/figure_style.py): learning curves with one panel per
  group of methods, test PPL per frequency group under both groupings, the size of AGG's rare set
  over training, and isotropy against the rare set;
* with ``--compare-budget`` (:func:`write_budget_comparison`), the comparison with the same runs at
  another budget: each metric's difference to the baseline at both budgets, whether each claim's
  verdict survives the other budget, and the baseline's convergence at each.
"""
import os
from typing import Dict, List, Optional

from examples.demo_common import markdown_table, save_study_figure, seed_band, write_json
from examples.lm_demo.wordsim import DATASETS
from fairseq_agg.analysis.plots import pyplot
from study.figure_style import group_bars, log_ticks, method_styles
from study.metrics import compare_to_baseline, convergence, resolvable_difference, spearman_interval
from study.report import metric, over_seeds, summarise, train_cross_entropy
from study.tail import GROUPINGS, PAPER_TYPES

GROUPS = ("freq", "med", "rare")
# the learning-curve panels: AGG's family, and the other remedies; the baseline is in both
PANELS = (("AGG, its threshold, freezing", ("baseline", "agg", "agg-a0.09", "agg-a0.01", "freeze", "agg+coupled-adam")),
          ("AGG's operating point: the per-update rule, Table 1's freezing",
           ("baseline", "agg-pu", "agg-pu-a0.09", "agg-pu-a0.01", "freeze-pu", "freeze-group")),
          ("other remedies", ("baseline", "coupled-adam", "al", "cosreg", "face", "ul")))

# (claim and its source, run, metric key of the summary, expected change, compared with).
# "up" / "down": the run's value is higher / lower than the other's; "same": no difference.
CLAIMS = (
    ("AGG raises isotropy I(W) (Yu et al., ACL 2022, main table; 0.377 → 0.813 in the authors' slides, "
     "unverified)", "agg", "isotropy", "up", "baseline"),
    ("… also in the paper's form of I(W)", "agg", "isotropy_raw", "up", "baseline"),
    ("… at about equal test PPL (same source: 15.51 for both)", "agg", "test_ppl", "same", "baseline"),
    ("AGG lowers the rare group's PPL (Yu et al. 2022, per-group table; the paper's groups)", "agg",
     "test_ppl_rare", "down", "baseline"),
    ("AGG raises Uniq (Yu et al. 2022, main table)", "agg", "uniq", "up", "baseline"),
    ("AGG improves word similarity (Yu et al. 2022: WS353 among MEN/RG65/RW)", "agg", "ws_wordsim353", "up",
     "baseline"),
    ("… on SimLex-999 (not in the paper)", "agg", "ws_simlex999", "up", "baseline"),
    ("Freezing rare embeddings raises I(W) (Yu et al. 2022, Table 1; secondary quotation, unverified)", "freeze",
     "isotropy", "up", "baseline"),
    ("… while the rare group's PPL rises (same table: 3.7×)", "freeze", "test_ppl_rare", "up", "baseline"),
    ("AGG spares the rare group the PPL that freezing costs it: lower rare-group PPL than freezing (Yu et al. "
     "2022: freezing raises it in Table 1, AGG lowers it)", "agg", "test_ppl_rare", "down", "freeze"),
    ("Coupled Adam raises isotropy (Stollenwerk & Stollenwerk, ACL 2025)", "coupled-adam", "isotropy", "up",
     "baseline"),
    ("Coupled Adam lowers the PPL (same paper, larger models and data)", "coupled-adam", "test_ppl", "down",
     "baseline"),
    ("REAL lowers the PPL of a tied model (Inan et al., ICLR 2017, Table 1: 85.1 → 82.7)", "al", "test_ppl", "down",
     "baseline"),
    ("CosReg raises isotropy (Gao et al., ICLR 2019)", "cosreg", "isotropy", "up", "baseline"),
    ("AGG has a lower PPL than CosReg (Yu et al. 2022, main table)", "agg", "test_ppl", "down", "cosreg"),
    ("AGG has a lower PPL than FACE (same)", "agg", "test_ppl", "down", "face"),
    ("AGG has a lower PPL than UL (same)", "agg", "test_ppl", "down", "ul"),
    ("FACE raises diversity, Uniq (Jiang et al., WWW 2019)", "face", "uniq", "up", "baseline"),
    ("Token-level unlikelihood raises diversity, Uniq (Welleck et al., ICLR 2020)", "ul", "uniq", "up", "baseline"),
    # at AGG's own operating point: the released per-update rule at alpha 0.03 (a rare type is a
    # target in at most 3 % of the updates, as in the paper's run; docs/agg.md, "The operating point")
    ("At the paper's operating point (per-update rule): AGG raises I(W) (Yu et al. 2022, main table)", "agg-pu",
     "isotropy", "up", "baseline"),
    ("… also in the paper's form of I(W)", "agg-pu", "isotropy_raw", "up", "baseline"),
    ("… at about equal test PPL (same source)", "agg-pu", "test_ppl", "same", "baseline"),
    ("… and lowers the rare group's PPL (Yu et al. 2022, per-group table)", "agg-pu", "test_ppl_rare", "down",
     "baseline"),
    ("… raises Uniq (Yu et al. 2022, main table)", "agg-pu", "uniq", "up", "baseline"),
    ("… improves word similarity on WS353 (Yu et al. 2022)", "agg-pu", "ws_wordsim353", "up", "baseline"),
    ("… on SimLex-999 (not in the paper)", "agg-pu", "ws_simlex999", "up", "baseline"),
    ("Freezing the static bottom 20 % raises I(W) (Yu et al. 2022, Table 1: 0.293 → 0.739)", "freeze-group",
     "isotropy", "up", "baseline"),
    ("… at equal total PPL (same table: 20.78 → 20.77)", "freeze-group", "test_ppl", "same", "baseline"),
    ("… while the rare group's PPL rises (same table: 814 → 3,018; the demo's 30/50/20 groups, as Table 1)",
     "freeze-group", "test_ppl_demo_rare", "up", "baseline"),
    ("AGG at its operating point has a lower rare-group PPL than Table 1's freezing (30/50/20 groups)", "agg-pu",
     "test_ppl_demo_rare", "down", "freeze-group"),
)


# the legend under the part's tables
NOTES = ("Word-level LM on the Bibles, Shakespeare and Milton (vocabulary: train count >= 3, else <unk>). PPL per "
         "word or punctuation token on the held-out works and books, scored like fairseq-eval-lm with a context "
         "window; paper freq / med / rare = the AGG paper's groups by frequency rank (its 13,000 / 23,000 / 8,256 "
         "of 44,256 types as fractions of this vocabulary), 30/50/20 = the demo's. I(W) (sign-symmetric), I(W) "
         "paper (eigenvector signs by a fixed rule), TEV and mean cos: the tied embedding. ρ = Spearman's rho "
         "of word similarity over the pairs whose two words are in the vocabulary. Uniq = distinct tokens in "
         "greedy continuations of test prefixes. AGG rare = AGG's rare set at the last update (from the "
         "checkpoint's window; frozen rows for freeze), rare seen % = its share with non-zero window counts, rare "
         "test tok % = its share of the test targets; rare below /epoch and target share % = AGG's operating "
         "point (docs/agg.md): the count per epoch below which a type is rare, and the share of updates in which "
         "a type at that count is a target. freeze-group freezes the static bottom 20 % (30/50/20 groups), not "
         "the AGG rare set these columns show.")


def _percent(key):
    """100 x metrics.agg_window[key], or None."""
    def get(r):
        value = (r["metrics"].get("agg_window") or {}).get(key)
        return None if value is None else 100.0 * value
    return get


def columns(m, results, spikes=None):
    """The tail part's (key, header, digits, getter) columns; ``m(*path)`` reads result["metrics"]
    (the signature of every part's columns, :class:`study.parts.Part`; no spike columns here)."""
    ppl = [("valid_ppl", "valid PPL", 1, m("valid_ppl")), ("test_ppl", "test PPL", 1, m("test_ppl"))]
    ppl += [(f"test_ppl_{g}", f"paper {g}", 1, m(f"test_ppl_{g}")) for g in GROUPS]
    ppl += [(f"test_ppl_demo_{g}", f"30/50/20 {g}", 1, m(f"test_ppl_demo_{g}")) for g in GROUPS]
    emb = [("isotropy", "I(W)", 3, m("isotropy")), ("isotropy_raw", "I(W) paper", 3, m("isotropy_raw")),
           ("tev_mu", "µTEV", 4, m("tev_mu")), ("tev_sigma", "σTEV", 4, m("tev_sigma")),
           ("mean_cos", "mean cos", 3, m("mean_cos"))]
    stems = sorted({s for r in results for s in (r["metrics"].get("word_similarity") or {})})
    emb += [(f"ws_{stem}", f"ρ {DATASETS.get(stem, stem)}", 3, m("word_similarity", stem, "single", "rho"))
            for stem in stems]
    emb += [("uniq", "Uniq", 0, m("uniq", "uniq")), ("agg_rare", "AGG rare", 0, m("agg_window", "rare")),
            ("agg_rare_seen", "rare seen %", 1, _percent("rare_seen_fraction")),
            ("agg_rare_test", "rare test tok %", 2, _percent("rare_target_share")),
            ("agg_rare_below", "rare below /epoch", 3, m("agg_window", "rare_below_per_epoch")),
            ("agg_target_share", "target share %", 3, _percent("target_share")),
            ("train_seconds", "train s", 0, lambda r: r.get("train_seconds"))]
    return ppl + emb


def tables(headers, rows, n_ppl=8):
    """The two markdown tables of the part: perplexity, then embedding and diversity (the first
    two columns, run and seeds, in both)."""
    first = markdown_table(headers[:2 + n_ppl], [r[:2 + n_ppl] for r in rows])
    second = markdown_table(headers[:2] + headers[2 + n_ppl:], [r[:2] + r[2 + n_ppl:] for r in rows])
    return ["### Perplexity", "", first, "", "### Embedding, word similarity, diversity, AGG's rare set", "", second]


# ---------------------------------------------------------------------------- claims


def verdict(expected: str, diff: Optional[float], exceeds: Optional[bool]) -> str:
    """The mechanical verdict of one claim: the sign of ``diff`` (run − other) against the
    ``expected`` change, and whether it exceeds the seed spread (None: one seed on a side)."""
    if diff is None:
        return "not measured"
    if expected == "same":
        if exceeds is None:
            return "one seed: no spread to judge"
        return "**reproduced**: no difference beyond the spread" if not exceeds else "**not reproduced**: differs"
    if diff == 0:
        return "**not reproduced**: no difference"
    matches = diff > 0 if expected == "up" else diff < 0
    if exceeds is None:
        return f"one seed: direction {'as claimed' if matches else 'opposite'}, no spread to judge"
    if not exceeds:
        return "**not reproduced**: within the seed spread"
    return "**reproduced in direction**" if matches else "**reversed**"


def _number(x):
    """3 significant digits, without an exponent for large values (perplexities of thousands)."""
    return f"{x:.0f}" if abs(x) >= 1000 else f"{x:.3g}"


def _cell(s):
    if s is None or s["mean"] is None:
        return "-"
    n = len([v for v in s["values"] if v is not None])
    return _number(s["mean"]) + (f"±{_number(s['spread'])}" if n > 1 else "")


def claims(summary) -> List[dict]:
    """Every claim whose runs finished: its numbers and verdict."""
    out = []
    for text, run, key, expected, other in CLAIMS:
        if run not in summary or other not in summary or key not in summary[run]:
            continue
        a, b = summary[run][key], summary[other][key]
        if a["mean"] is None or b["mean"] is None:
            continue
        diff = a["mean"] - b["mean"]
        exceeds = compare_to_baseline(a["values"], b["values"])
        rel = f" ({100 * diff / abs(b['mean']):+.1f} %)" if b["mean"] else ""
        seeds_run, seeds_other = len(a["values"]), len(b["values"])
        out.append({"claim": text, "run": run, "other": other, "key": key, "expected": expected, "diff": diff,
                    "exceeds": exceeds, "verdict": verdict(expected, diff, exceeds), "seeds_run": seeds_run,
                    "seeds_other": seeds_other,
                    "measured": f"{key}: {other} {_cell(b)} → {run} {_cell(a)}{rel}; seeds {seeds_other} / "
                                f"{seeds_run}"})
    return out


def claims_table(found) -> List[str]:
    if not found:
        return []
    rows = [[c["claim"], c["measured"], {True: "yes", False: "no", None: "—"}[c["exceeds"]], c["verdict"]]
            for c in found]
    return ["### Claims", "", markdown_table(["claim (source)", "measured (mean±h over seeds)",
                                              "exceeds the spread?", "verdict (mechanical)"], rows), "",
            "Exceeds the spread: |difference of the means| > h + h_other (h = half the seed range; needs two "
            "seeds on both sides, — otherwise). The verdict only combines that with the sign of the difference.", ""]


# ---------------------------------------------------------------------------- data and calibration


def data_section(report) -> List[str]:
    if not report:
        return ["### Data", "", "(no data report: the data directory WORK/_data/tail is not there)", ""]
    v, rows = report["vocabulary"], []
    for split, s in report["splits"].items():
        rows.append([split, s["lines"], s["tokens"], s["unk"], f"{100 * s['unk_rate']:.2f} %",
                     f"{100 * s['coverage']:.2f} %"])
    lines = ["### Data", "",
             f"Vocabulary ({v['rule']}, fairseq-preprocess --thresholdsrc): {v['size']} entries = {v['types']} types "
             f"+ {v['specials']} specials + {v['madeupwords']} madeupword fillers; the training split has "
             f"{v['train_types']} types, {v['train_types_at_min_count']} of them at least {v['min_train_count']} "
             "times. "
             f"Token coverage over all splits: {100 * report['coverage']:.2f} %.", "",
             markdown_table(["split", "lines", "tokens", "<unk>", "<unk> rate", "coverage"], rows), "",
             "Frequency groups (types): " + "; ".join(
                 f"{name} " + " / ".join(f"{g} {n}" for g, n in sizes.items())
                 for name, sizes in report["groups"].items()) + ".", ""]
    rare = [[f"{r['alpha']:g}", f"{r['count_threshold']:.2f}", r["rare"], r["rare_seen"], r["rare_unseen"],
             "-" if r["rare_seen_fraction"] is None else f"{100 * r['rare_seen_fraction']:.1f} %", r["very_rare"]]
            for r in report["agg_rare_full_window"]]
    lines += ["AGG's rare set over a window of one full epoch (every training target, relative threshold at "
              f"{report['agg_rare_full_window'][0]['ref_tokens']} tokens per update): a type is rare below the "
              "count threshold.", "",
              markdown_table(["α", "count threshold", "rare", "with counts", "never counted", "share with counts",
                              "g2 < 1"], rare), ""]
    return lines


CONVERGENCE_HEADERS = ["run", "seed", "valid PPL", "change", "converged"]


def convergence_section(names, by_name) -> List[str]:
    """Every run's valid PPL change over the last fifth, seed by seed (the calibration criterion)."""
    rows = [[n, r["seed"]] + convergence_cells(run_convergence(r)) for n in names for r in by_name[n]]
    return ["### Convergence of every run (valid PPL over the last fifth of training; criterion |change| < 1 %)", "",
            markdown_table(CONVERGENCE_HEADERS, rows), ""]


def run_convergence(result) -> Optional[dict]:
    """:func:`study.metrics.convergence` of one run's valid PPL."""
    return convergence(result["curves"]["valid_ppl"], result["updates"])


def convergence_cells(c) -> list:
    """The valid PPL, change and converged cells of a :func:`run_convergence` (None: too few validations)."""
    if c is None:
        return ["-", "-", "too few validations"]
    return [f"{c['from']:.2f} → {c['to']:.2f}", f"{100 * c['change']:+.2f} %", "yes" if c["converged"] else "**no**"]


def timing_section(results, planned, jobs) -> List[str]:
    """The mean wall time of the finished runs and what the planned runs take at that rate."""
    walls = [r.get("wall_seconds") for r in results if r.get("wall_seconds")]
    if not walls:
        return []
    mean = sum(walls) / len(walls)
    return [f"Per run: {mean / 60:.1f} min of wall time on average (training and evaluation, {len(walls)} runs); "
            f"the {planned} planned runs at that rate on {jobs} lane(s): about {planned * mean / jobs / 3600:.1f} h.",
            ""]


# ---------------------------------------------------------------------------- figures


def tail_styles(names):
    """{name: {color, linestyle, marker}} of the runs ``names``, fixed by the order of the runs in
    :data:`PANELS` (then any other run), so that a run looks the same in every panel and figure."""
    return method_styles(list(dict.fromkeys([n for _, members in PANELS for n in members] + list(names))))


def curve_panels(names) -> List[tuple]:
    """(title, runs) of each learning-curve panel for the runs ``names``: :data:`PANELS` in order,
    then the runs of no panel; a panel with no run but the baseline is left out (the baseline is
    in every panel, so it alone compares nothing), unless the baseline is the only run."""
    panels = [(title, [n for n in members if n in names]) for title, members in PANELS]
    panels += [("other runs", [n for n in names if not any(n in members for _, members in PANELS)])]
    compared = [(t, members) for t, members in panels if any(n != "baseline" for n in members)]
    return compared or [(t, members) for t, members in panels[:1] if members]


def figure_curves(by_name, names, path, runs_dir, styles=None):
    """Train cross-entropy and valid PPL (rows) for each group of methods (columns): the mean over
    seeds with a min-max band. The train row is the plain cross-entropy of every run
    (:func:`study.report.train_cross_entropy`, read from the runs in ``runs_dir`` where result.json
    predates it), never a criterion's own optimised loss (FACE's weighted one, CE + a term)."""
    plt = pyplot()
    panels = curve_panels(names)
    rows = ((lambda r: train_cross_entropy(r, runs_dir), "train cross-entropy (nll_loss, bits/token)", False),
            (lambda r: r["curves"].get("valid_ppl") or [], "valid PPL (log scale)", True))
    fig, axes = plt.subplots(len(rows), len(panels), figsize=(6.5 * len(panels), 8.0), squeeze=False,
                             sharex=True, sharey="row")
    style = styles or tail_styles(names)
    for col, (title, members) in enumerate(panels):
        for row, (get, ylabel, log) in enumerate(rows):
            ax = axes[row][col]
            for n in members:
                curves = [c for c in (get(r) for r in by_name[n]) if c]
                if not curves:
                    continue
                u, mean, lo, hi = seed_band(curves)
                ax.plot(u, mean, label=n, markevery=max(1, len(u) // 8), markersize=4, **style[n])
                if len(curves) > 1:
                    ax.fill_between(u, lo, hi, color=style[n]["color"], alpha=0.15, linewidth=0)
            if log:
                ax.set_yscale("log")
                log_ticks(ax)
            ax.grid(alpha=0.3)
            ax.set_ylabel(ylabel)
            if row == 0:
                ax.set_title(title)
            if row == len(rows) - 1:
                ax.set_xlabel("update")
        handles, labels = axes[0][col].get_legend_handles_labels()
        if handles:
            axes[-1][col].legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=3,
                                 fontsize="small")
    fig.suptitle(f"learning curves ({over_seeds([len(by_name[n]) for n in names], 'mean over seeds; band: min-max')})")
    return save_study_figure(fig, path)


def grouping_title(name, sizes=None):
    """A panel title (two lines) of :data:`study.tail.GROUPINGS`' grouping ``name``: where it
    comes from, its fractions and, given ``sizes`` ({group: types} in this vocabulary), the types in
    each group here."""
    percent = " / ".join(f"{100 * f:.1f}" for f in GROUPINGS[name])
    here = f"{' / '.join(f'{sizes[g]:,}' for g in GROUPS)} types here ({percent} %)" if sizes else f"{percent} %"
    if name == "paper":
        return f"the AGG paper's grouping (its 13,000 / 23,000 / 8,256 of {PAPER_TYPES:,} types)\nas fractions: {here}"
    return f"the demo's grouping\n{here}"


def figure_group_ppl(summary, names, path, sizes=None, styles=None):
    """Test PPL per frequency group, the paper's grouping and the demo's side by side, a run's bars
    in its colour, the group by hatch and shade, with error bars of half the seed range (two seeds
    or more); ``sizes``: the data report's {grouping: {group: types}}, for the titles."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(max(12.0, 1.4 * len(names)), 4.8), sharey=True)
    styles, sizes = styles or tail_styles(names), sizes or {}
    for ax, (prefix, title) in zip(axes, (("test_ppl_", grouping_title("paper", sizes.get("paper"))),
                                          ("test_ppl_demo_", grouping_title("demo", sizes.get("demo"))))):
        handles = group_bars(ax, names, {g: [summary[n].get(f"{prefix}{g}") or {"mean": None, "spread": None}
                                             for n in names] for g in GROUPS},
                             [len(summary[n].get("seeds") or []) for n in names], styles)
        ax.set_yscale("log")
        log_ticks(ax)
        ax.set_xticks(range(len(names)), names, rotation=35, ha="right")
        ax.set_title(title, fontsize="small")
        ax.grid(alpha=0.3, axis="y")
    axes[0].set_ylabel("test perplexity (log scale)")
    axes[1].legend(handles=handles, title="group", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle("test perplexity per frequency group "
                 f"({over_seeds([len(summary[n]['seeds']) for n in names], 'mean ± half range over seeds')})")
    return save_study_figure(fig, path)


def figure_rare_set(by_name, names, path, styles=None) -> Optional[str]:
    """The size of AGG's rare set over training (the logged agg_rare; agg_frozen when freezing)."""
    shown = [n for n in names if any(r["metrics"].get("agg_rare_curve") for r in by_name[n])]
    if not shown:
        return None
    plt = pyplot()
    style = styles or tail_styles(names)
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    # Runs at one α count the same targets in the same order (agg, freeze, agg+coupled-adam), so
    # their curves coincide: each line is drawn thinner than the one before, so all stay visible.
    for i, n in enumerate(shown):
        u, mean, lo, hi = seed_band([r["metrics"]["agg_rare_curve"] for r in by_name[n]
                                     if r["metrics"].get("agg_rare_curve")])
        ax.plot(u, mean, label=n, markevery=max(1, len(u) // 8), markersize=4,
                **{**style[n], "linewidth": 1.2 + 0.8 * (len(shown) - 1 - i)})
        if len(by_name[n]) > 1:
            ax.fill_between(u, lo, hi, color=style[n]["color"], alpha=0.15, linewidth=0)
    ax.set_yscale("log")
    log_ticks(ax)
    return _finish_single_axes(fig, ax, path, "update", "tokens in AGG's rare set",
                               "AGG's rare set over training "
                               f"({over_seeds([len(by_name[n]) for n in shown], 'mean over seeds; band: min-max')})")


def _finish_single_axes(fig, ax, path, xlabel, ylabel, title):
    """Labels, grid, the legend outside the axes, title; saves the figure."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    ax.set_title(title)
    return save_study_figure(fig, path)


def word_similarity_section(names, by_name) -> List[str]:
    """Every run's and seed's rho with its 95 % interval (Fisher z over the pair count), and the
    smallest difference the pair sets can resolve."""
    stems = sorted({s for rs in by_name.values() for r in rs for s in (r["metrics"].get("word_similarity") or {})})
    if not stems:
        return []
    rows, pairs_of = [], {}
    for n in names:
        for r in by_name[n]:
            row = [n, r["seed"]]
            for stem in stems:
                score = ((r["metrics"].get("word_similarity") or {}).get(stem) or {}).get("single") or {}
                rho, pairs = score.get("rho"), score.get("pairs") or 0
                pairs_of[stem] = max(pairs_of.get(stem, 0), pairs)
                ci = spearman_interval(rho, pairs)
                row.append("-" if ci is None else f"{rho:.3f} [{ci[0]:.3f}, {ci[1]:.3f}] ({pairs})")
            rows.append(row)
    resolved = "; ".join(f"{DATASETS.get(stem, stem)} ({pairs_of[stem]} pairs): about "
                         f"{resolvable_difference(pairs_of[stem]):.2f}" for stem in stems
                         if resolvable_difference(pairs_of[stem]) is not None)
    return ["### Word similarity with 95 % intervals", "",
            markdown_table(["run", "seed"] + [f"ρ {DATASETS.get(stem, stem)} [95 %] (pairs)" for stem in stems], rows),
            "", "Interval: Fisher's z = atanh(ρ) with variance 1.06 / (pairs − 3) (Spearman's ρ). Two runs' ρ differ "
            f"beyond 1.96 standard errors of their difference (near ρ = 0, as if independent) only when they differ "
            f"by more than: {resolved}. Smaller differences cannot be resolved by these pair sets.", ""]


def figure_isotropy_vs_rare(by_name, names, path, static_rare: Optional[int] = None, styles=None) -> Optional[str]:
    """I(W) against the size of AGG's rare set at the end, one point per run and seed, for every
    AGG or freezing run of either threshold rule and the baseline (rare set 0); freezing of the
    static group at that group's size ``static_rare`` (left out without it)."""
    points = {}
    for n in names:
        for r in by_name[n]:
            window, iso = r["metrics"].get("agg_window"), r["metrics"].get("isotropy")
            if iso is None or (window is None and n != "baseline"):
                continue
            rule = "baseline" if window is None else ("group" if window.get("freeze_set") == "group"
                                                      else window.get("threshold_mode"))
            size = 0 if window is None else (static_rare if rule == "group" else window["rare"])
            if size is not None:
                points.setdefault((rule, n), []).append((size, iso))
    if len(points) < 2:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    style = styles or tail_styles(names)
    # each run's colour and marker of the part; hollow = freezing, whose points may lie on its AGG run's
    for (rule, n), pts in sorted(points.items(), key=lambda kv: kv[0][1]):
        window = next((r["metrics"].get("agg_window") for r in by_name[n] if r["metrics"].get("agg_window")), None)
        frozen = bool(window and window.get("frozen"))
        ax.scatter([p[0] + 1 for p in pts], [p[1] for p in pts], label=n if rule == n else f"{n} ({rule})",
                   marker=style[n]["marker"], facecolors="none" if frozen else style[n]["color"],
                   edgecolors=style[n]["color"], linewidths=1.5 if frozen else 0.5, s=60)
    ax.set_xscale("log")
    log_ticks(ax, "x")
    return _finish_single_axes(fig, ax, path, "rare set at the end (types, + 1; log scale): AGG's, or the frozen "
                               "static group", "I(W) (sign-symmetric)",
                               "isotropy against the rare set, both threshold rules (one point per run and seed)")


def extend(summary, names, by_name, results, planned, jobs, data_report, out_dir):
    """(lines for table.md, {figure name: path}, extra results.json entries) of the tail part."""
    found = claims(summary)
    lines = claims_table(found) + word_similarity_section(names, by_name) + convergence_section(names, by_name)
    lines += timing_section(results, planned, jobs) + data_section(data_report)
    styles = tail_styles(names)  # one per run for every figure below
    figures = {"curves": figure_curves(by_name, names, os.path.join(out_dir, "learning_curves.png"),
                                       os.path.dirname(out_dir), styles),
               "group_ppl": figure_group_ppl(summary, names, os.path.join(out_dir, "group_ppl.png"),
                                             (data_report or {}).get("groups"), styles)}
    rare = figure_rare_set(by_name, names, os.path.join(out_dir, "agg_rare.png"), styles)
    if rare:
        figures["agg_rare"] = rare
    static = ((data_report or {}).get("groups") or {}).get("demo", {}).get("rare")  # the 30/50/20 rare group
    iso = figure_isotropy_vs_rare(by_name, names, os.path.join(out_dir, "isotropy_vs_rare.png"), static, styles)
    if iso:
        figures["isotropy_vs_rare"] = iso
    extra: Dict[str, object] = {"claims": found, "data": data_report,
                                "agg_window": {r["run_id"]: r["metrics"].get("agg_window") for r in results}}
    return lines, figures, extra


# ---------------------------------------------------------------------------- the budget comparison

COMPARED_SEED = 1  # the seed both budgets have (the longer budget trains only the first)
# compared across budgets besides every word list's ρ and every metric a claim is judged on
COMPARED_METRICS = ("test_ppl", "test_ppl_rare", "isotropy", "mean_cos")
BUDGET_COMPARISON_JSON = "budget_comparison.json"
SIDES = ("first", "second")  # the budgets: this work dir's, --compare-budget's


def compared_columns(results):
    """The (key, header, digits, getter) columns of :func:`columns` compared across budgets."""
    keys = set(COMPARED_METRICS) | {key for _, _, key, _, _ in CLAIMS}
    return [c for c in columns(metric, results) if c[0] in keys or c[0].startswith("ws_")]


def budget_label(results) -> str:
    """A budget named by its runs' updates, e.g. "3,000 updates"."""
    return " / ".join(f"{u:,}" for u in sorted({r["updates"] for r in results})) + " updates"


def runs_of_seed(results, seed=COMPARED_SEED) -> Dict[str, dict]:
    """{run name: its result at ``seed``}, in the order of ``results``."""
    return {r["name"]: r for r in results if r["seed"] == seed}


def _minus(a, b):
    return None if a is None or b is None else a - b


def _sign(x):
    return (x > 0) - (x < 0)


def metric_differences(first: Dict[str, dict], second: Dict[str, dict], cols) -> dict:
    """The baseline's values and every other run's difference to the baseline of the same budget
    and seed, at both budgets (``first``, ``second``: :func:`runs_of_seed` of each) and the change
    between them: {"baseline": {key: {"first", "second"}}, "runs": {name: {key: {"first", "second",
    "change"}}}} for the runs at both budgets; None where a value is missing."""
    base = (first.get("baseline"), second.get("baseline"))
    out = {"baseline": {key: {"first": get(base[0]) if base[0] else None,
                              "second": get(base[1]) if base[1] else None} for key, _, _, get in cols},
           "runs": {}}
    for name in (n for n in first if n in second and n != "baseline"):
        diffs = out["runs"][name] = {}
        for key, _, _, get in cols:
            d1 = _minus(get(first[name]), out["baseline"][key]["first"])
            d2 = _minus(get(second[name]), out["baseline"][key]["second"])
            diffs[key] = {"first": d1, "second": d2, "change": _minus(d2, d1)}
    return out


def survival(expected: str, first: Optional[dict], second: Optional[dict], labels) -> dict:
    """Whether a claim's verdict is the same at both budgets ("survives more budget").

    ``first``, ``second``: the claim at each budget ({"exceeds", "verdict", "seed_diff"}: the report's
    :func:`claims` entry and the run − other difference at :data:`COMPARED_SEED`), None where not
    measured; ``labels``: the budgets' names. The verdicts are compared only where both judged the
    seed spread (two seeds on both sides, the report's rule); otherwise only the direction of the
    seed's difference can be, and a claim of no difference cannot be judged at all.
    Returns {"survives": True / False / None, "basis": "verdict" / "direction" / None, "text"}."""
    if first is None or second is None:
        where = " and ".join(label for label, c in zip(labels, (first, second)) if c is None)
        return {"survives": None, "basis": None, "text": f"not measured at {where}"}
    if first["exceeds"] is not None and second["exceeds"] is not None:
        same = first["verdict"] == second["verdict"]
        return {"survives": same, "basis": "verdict", "text": "yes" if same else "**no**"}
    why = " and ".join(label for label, c in zip(labels, (first, second)) if c["exceeds"] is None)
    why = f"one seed at {why}: no spread to judge"
    if expected == "same":
        return {"survives": None, "basis": None, "text": f"cannot tell ({why})"}
    d1, d2 = first["seed_diff"], second["seed_diff"]
    if d1 is None or d2 is None:
        return {"survives": None, "basis": None, "text": f"not measured at seed {COMPARED_SEED}"}
    same = _sign(d1) == _sign(d2)
    return {"survives": same, "basis": "direction",
            "text": f"{'yes' if same else '**no**'}, in direction only (seed {COMPARED_SEED}; {why})"}


def _claims_by_id(part, results, cols) -> Dict[tuple, dict]:
    """The report's :func:`claims` of one budget's results (all its seeds), by (claim, run, key, other)."""
    names = list(dict.fromkeys(r["name"] for r in results))
    by_name = {n: sorted((r for r in results if r["name"] == n), key=lambda r: r["seed"]) for n in names}
    summary, _ = summarise(part, names, by_name, cols, {})
    return {(c["claim"], c["run"], c["key"], c["other"]): c for c in claims(summary)}


def claim_comparison(part, first_results, second_results, cols, labels) -> dict:
    """{"compared": [...], "not_compared": [...]}: every claim whose runs have seed
    :data:`COMPARED_SEED` at both budgets, with its verdict at each budget (over that budget's seeds,
    as the report makes it), the seed's difference (run − other) at each and :func:`survival`; and
    every claim whose runs have it at one budget only, with {"first" / "second": the runs missing there}."""
    runs = (runs_of_seed(first_results), runs_of_seed(second_results))
    found = (_claims_by_id(part, first_results, cols), _claims_by_id(part, second_results, cols))
    getter = {key: get for key, _, _, get in cols}
    compared, not_compared = [], []
    for text, run, key, expected, other in CLAIMS:
        missing = {side: [n for n in (run, other) if n not in seed_runs] for side, seed_runs in zip(SIDES, runs)}
        entry = {"claim": text, "run": run, "key": key, "expected": expected, "other": other}
        if all(missing.values()) or key not in getter:  # runs or metric at neither budget: no claim of either
            continue
        if any(missing.values()):
            not_compared.append(dict(entry, missing={side: ns for side, ns in missing.items() if ns}))
            continue
        at = []
        for seed_runs, by_id in zip(runs, found):
            c = by_id.get((text, run, key, other))
            at.append(None if c is None else {
                "verdict": c["verdict"], "exceeds": c["exceeds"], "diff": c["diff"],
                "seeds": {run: c["seeds_run"], other: c["seeds_other"]},
                "seed_diff": _minus(getter[key](seed_runs[run]), getter[key](seed_runs[other]))})
        if at == [None, None]:  # not measured at either budget
            continue
        compared.append(dict(entry, first=at[0], second=at[1], **survival(expected, at[0], at[1], labels)))
    return {"compared": compared, "not_compared": not_compared}


def budget_comparison(part, first_results, second_results, first_dir, second_dir) -> dict:
    """The comparison of two budgets of the part (what ``--compare-budget`` writes to
    :data:`BUDGET_COMPARISON_JSON`), from their results alone: at :data:`COMPARED_SEED`, each metric's
    difference to the baseline at each budget and its change, the runs at one budget only, every
    claim's verdict at both (:func:`claim_comparison`), and the baseline's convergence at each."""
    labels = (budget_label(first_results), budget_label(second_results))
    cols = compared_columns(first_results + second_results)
    first, second = runs_of_seed(first_results), runs_of_seed(second_results)
    baselines = [[r for r in results if r["name"] == "baseline"] for results in (first_results, second_results)]
    return {
        "seed": COMPARED_SEED,
        "budgets": {side: {"label": label, "work_dir": work_dir}
                    for side, label, work_dir in zip(SIDES, labels, (first_dir, second_dir))},
        "metrics": [{"key": key, "header": header, "digits": digits} for key, header, digits, _ in cols],
        "differences": metric_differences(first, second, cols),
        "missing": {"first": [n for n in second if n not in first], "second": [n for n in first if n not in second]},
        "claims": claim_comparison(part, first_results, second_results, cols, labels),
        "baseline_convergence": [{"budget": label, "seed": r["seed"], "convergence": run_convergence(r)}
                                 for label, rs in zip(labels, baselines) for r in rs],
    }


def _signed(x, digits):
    return "-" if x is None else f"{x:+.{digits}f}"


def _plain(x, digits):
    return "-" if x is None else f"{x:.{digits}f}"


def _verdict_cell(at):
    if at is None:
        return "not measured"
    return f"{at['verdict']} (seeds {' / '.join(str(n) for n in at['seeds'].values())})"


def budget_comparison_section(comparison) -> List[str]:
    """table.md's section of a :func:`budget_comparison`."""
    label = {side: b["label"] for side, b in comparison["budgets"].items()}
    b1, b2 = label["first"], label["second"]
    seed, diffs = comparison["seed"], comparison["differences"]
    rows = []
    for name, by_key in diffs["runs"].items():
        for m in comparison["metrics"]:
            key, digits = m["key"], m["digits"]
            base, d = diffs["baseline"][key], by_key[key]
            rows.append([name, m["header"], _plain(base["first"], digits), _signed(d["first"], digits),
                         _plain(base["second"], digits), _signed(d["second"], digits), _signed(d["change"], digits)])
    missing = comparison["missing"]
    lines = [f"### Budget comparison: {b1} ({comparison['budgets']['first']['work_dir']}) and {b2} "
             f"({comparison['budgets']['second']['work_dir']})", "",
             f"Seed {seed} at both budgets. Δ = the run's value − the baseline's at the same budget and seed; "
             f"change = Δ at {b2} − Δ at {b1}.", ""]
    if not diffs["runs"]:
        lines += [f"(no run besides the baseline has seed {seed} at both budgets, or the baseline lacks it at one)", ""]
    else:
        lines += [markdown_table(["run", "metric", f"baseline, {b1}", f"Δ, {b1}", f"baseline, {b2}", f"Δ, {b2}",
                                  "change of Δ"], rows), ""]
    lines += [f"Runs with seed {seed} at one budget only (not compared): at {b1} only: "
              f"{', '.join(missing['second']) or 'none'}; at {b2} only: {', '.join(missing['first']) or 'none'}.", ""]
    found = comparison["claims"]
    if found["compared"]:
        digits = {m["key"]: m["digits"] for m in comparison["metrics"]}
        rows = [[c["claim"], f"{c['run']} − {c['other']}: {c['key']}", _verdict_cell(c["first"]),
                 _verdict_cell(c["second"]),
                 " → ".join(_signed(c[side] and c[side]["seed_diff"], digits[c["key"]]) for side in SIDES), c["text"]]
                for c in found["compared"]]
        lines += ["#### Claims at both budgets", "",
                  markdown_table(["claim (source)", "compared", f"verdict at {b1} (seeds run / other)",
                                  f"verdict at {b2} (seeds run / other)", f"seed {seed}: run − other, {b1} → {b2}",
                                  "same verdict at both budgets?"], rows), "",
                  "Verdicts as in the claims table, each over its budget's seeds. The verdicts themselves are "
                  "compared only where both budgets judged the seed spread (two seeds on both sides); otherwise "
                  f"only the direction of seed {seed}'s difference is, and a claim of no difference cannot be "
                  "judged.", ""]
    if found["not_compared"]:
        lines += ["Claims measured at one budget only (not compared): " + "; ".join(
            f"{c['run']} − {c['other']}: {c['key']} (" + ", ".join(
                f"no seed {seed} of {' '.join(ns)} at {label[side]}" for side, ns in c["missing"].items()) + ")"
            for c in found["not_compared"]) + ".", ""]
    lines += ["#### The baseline's convergence at each budget (valid PPL over the last fifth of training)", "",
              markdown_table(["budget"] + CONVERGENCE_HEADERS,
                             [[c["budget"], "baseline", c["seed"]] + convergence_cells(c["convergence"])
                              for c in comparison["baseline_convergence"]]), ""]
    return lines


def write_budget_comparison(part, first_results, second_results, first_dir, second_dir, out_dir) -> str:
    """``--compare-budget``: appends the comparison's section to out_dir/table.md (made by the report
    just before) and writes it to out_dir/:data:`BUDGET_COMPARISON_JSON`; returns that path."""
    comparison = budget_comparison(part, first_results, second_results, first_dir, second_dir)
    with open(os.path.join(out_dir, "table.md"), "a", encoding="utf-8") as f:
        f.write("\n" + "\n".join(budget_comparison_section(comparison)) + "\n")
    path = os.path.join(out_dir, BUDGET_COMPARISON_JSON)
    write_json(path, comparison)
    return path
