"""The tail part's figures, each run in one style (an Okabe-Ito colour, a marker and a line style)
in every panel and figure (:func:`tail_styles`, study/figure_style.py): learning curves with one
panel per group of methods, test PPL per frequency group under both groupings, the size of AGG's
rare set over training, and isotropy against the rare set.

The per-group figure can also be drawn from a table's printed values, kept where the runs are gone
({"runs": {name: {"seeds": n, "test_ppl_<group>" / "test_ppl_demo_<group>": [mean, half range or
null]}}, "sizes": {grouping: {group: types}}}, keys starting with "_" are notes):

    python -m study.tail_figures --group-ppl docs/data/tail_group_ppl.json --figure OUT.png
"""
import argparse
import os
import sys
from typing import List, Optional

from fairseq_agg.analysis.plots import pyplot
from study.columns import GROUPS
from study.figure_style import group_bars, log_ticks, method_styles
from study.harness.figures import save_study_figure, seed_band
from study.report_figures import draw_seed_curves, over_seeds, train_cross_entropy
from study.tail import GROUPINGS, PAPER_TYPES

# the learning-curve panels: AGG's family, and the other remedies; the baseline is in both
PANELS = (("AGG, its threshold, freezing", ("baseline", "agg", "agg-a0.09", "agg-a0.01", "freeze", "agg+coupled-adam")),
          ("AGG's operating point: the per-update rule, Table 1's freezing",
           ("baseline", "agg-pu", "agg-pu-a0.09", "agg-pu-a0.01", "freeze-pu", "freeze-group")),
          ("other remedies", ("baseline", "coupled-adam", "al", "cosreg", "face", "ul", "antifocal")))


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
    (:func:`study.report_figures.train_cross_entropy`, read from the runs in ``runs_dir`` where
    result.json predates it), never a criterion's own optimised loss (FACE's weighted one, CE + a
    term)."""
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
            draw_seed_curves(ax, by_name, members, get, style, alpha=0.15, linewidth=0)
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


def printed_summary(table) -> dict:
    """The report's summary ({name: {key: {mean, spread}, "seeds": [...]}}) of a table's printed
    group PPLs (the module's docstring), for :func:`figure_group_ppl`."""
    return {name: {"seeds": list(range(1, run["seeds"] + 1)),
                   **{key: {"mean": v[0], "spread": v[1]} for key, v in run.items() if key.startswith("test_ppl")}}
            for name, run in table["runs"].items()}


def main(argv=None):
    from fairseq_agg.files import atomic_output
    from study import store

    p = argparse.ArgumentParser(prog="python -m study.tail_figures", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--group-ppl", metavar="JSON", required=True, help="a table's printed group PPLs (above)")
    p.add_argument("--figure", metavar="OUT.png", required=True, help="where to draw test PPL per frequency group")
    a = p.parse_args(argv)
    if not os.path.isfile(a.group_ppl):
        p.error(f"--group-ppl: no such file: {a.group_ppl}")
    table = store.read_json(a.group_ppl)
    with atomic_output(a.figure, inputs=(a.group_ppl,), flag="--figure") as handle:
        figure_group_ppl(printed_summary(table), list(table["runs"]), handle, sizes=table.get("sizes"))
    print(a.figure)
    return 0


if __name__ == "__main__":
    from study.harness.cli import exit_in_one_line

    sys.exit(exit_in_one_line(main))
