"""The figures of a part's report (study/report.py), made from its runs' result.json files: the
learning curves, test PPL per frequency group, the PPL-isotropy frontier of AGG's alpha sweep, and
the statistics by depth; each run in its style of the part (:func:`part_styles`)."""
import math
import os

from fairseq_agg.analysis.plots import pyplot
from study.columns import GROUPS
from study.figure_style import draw_series, group_bars, label_points, log_ticks, marks_of, method_styles, seeds_of
from study.figure_style import show_coinciding
from study.harness.fairseq_logs import train_curve
from study.harness.figures import save_study_figure, seed_band


def part_styles(part, names, groups):
    """The style of every planned run of ``part`` (:func:`study.figure_style.method_styles`): a run
    looks the same in every figure, however many runs have finished; the depth part's runs share
    their method's colour and marker."""
    return method_styles(names, (lambda n: groups[n]["method"]) if part.by_depth else None)


def train_cross_entropy(res, runs_dir):
    """[(update, plain cross-entropy in bits per token)] of one run's train_inner lines.

    The plugin's criteria log ``loss`` as what they optimise (FACE's weighted loss, the CE plus the
    augmented or unlikelihood term) and the plain cross-entropy as ``nll_loss``; a stock criterion
    that logs no ``nll_loss`` logs the cross-entropy as ``loss``. A result.json written before the
    study kept the ``nll_loss`` curve has it read from the run's train.log in ``runs_dir``; [] when
    that is gone too (the run is then left out of the panel, not drawn on the wrong quantity)."""
    curves = res["curves"]
    if curves.get("train_nll"):
        return curves["train_nll"]
    if "nll_loss" not in (res.get("last_train") or {}):
        return curves.get("train_loss") or []
    log = os.path.join(runs_dir, res["run_id"], "train.log")
    if not os.path.isfile(log):
        return []
    with open(log, encoding="utf-8") as f:
        return train_curve(f.read().splitlines(), "nll_loss")


def valid_cross_entropy(res):
    """[(update, validation cross-entropy in bits per token)], from fairseq's logged validation
    perplexity (2 ** nll_loss for every criterion, label smoothing and the plugin's terms left out)."""
    return [(u, math.log2(ppl)) for u, ppl in res["curves"].get("valid_ppl") or []]


def over_seeds(seed_counts, several):
    """What a figure's values are: ``several`` (e.g. "mean over seeds; band: min-max") where runs
    have several seeds, "one seed" where every run has one."""
    counts = [c for c in seed_counts if c]
    if not counts or max(counts) == 1:
        return "one seed"
    if min(counts) == 1:
        return f"{several}; a run of one seed shows that seed"
    return several


def draw_seed_curves(ax, by_name, names, get, styles, **band):
    """Per run name with a curve (``get(result)``, [] without one) the mean over its seeds in the
    run's style, and where it has several seeds their min-max band (``band``: fill_between's style)."""
    for name in names:
        curves = [c for c in (get(r) for r in by_name[name]) if c]
        if not curves:
            continue
        u, mean, lo, hi = seed_band(curves)
        ax.plot(u, mean, label=name, markevery=max(1, len(u) // 8), markersize=4, **styles[name])
        if len(curves) > 1:
            ax.fill_between(u, lo, hi, color=styles[name]["color"], **band)


def figure_curves(by_name, names, path, panels, styles=None):
    """Learning curves, one panel per (getter of a run's curve, y label, log scale): per run name
    the mean over seeds and a min-max band, in the run's style of the part (``styles``, by
    :func:`study.figure_style.method_styles`; default: of ``names``)."""
    plt = pyplot()
    styles = styles or method_styles(names)
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5))
    axes = [axes] if len(panels) == 1 else list(axes)
    for ax, (get, ylabel, log) in zip(axes, panels):
        draw_seed_curves(ax, by_name, names, get, styles, alpha=0.2)
        ax.set_xlabel("update")
        ax.set_ylabel(ylabel)
        if log:
            ax.set_yscale("log")
            log_ticks(ax)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small")
    fig.suptitle(f"learning curves ({over_seeds([len(by_name[n]) for n in names], 'mean over seeds; band: min-max')})")
    return save_study_figure(fig, path)


def figure_group_ppl(summary, names, path, styles=None):
    """Test PPL per frequency group: a run's bars in its colour of the part, the group by hatch
    and shade (:func:`study.figure_style.group_bars`)."""
    plt = pyplot()
    styles = styles or method_styles(names)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(names)), 4.5))
    handles = group_bars(ax, names, {g: [summary[n][f"test_ppl_{g}"] for n in names] for g in GROUPS},
                         [seeds_of(summary, n) for n in names], styles)
    ax.set_yscale("log")
    log_ticks(ax)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set_ylabel("test perplexity (log scale)")
    ax.set_title("test perplexity per frequency group "
                 f"({over_seeds([len(summary[n]['seeds']) for n in names], 'mean ± half range over seeds')})")
    ax.legend(handles=handles, title="group", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return save_study_figure(fig, path)


def figure_frontier(summary, names, groups, path, styles=None):
    """Test PPL against I(W) (headline and the paper's form): every run a point in its style of the
    part, AGG's alpha sweeps joined by grey lines and labelled with their α. A point on another is
    drawn open and larger around it, as the legend's title says; no label covers a point."""
    plt = pyplot()
    styles = styles or method_styles(names)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharey=True)
    drawn = {0: [], 1: []}  # per panel: (name, Line2D) of each point, in drawing order
    for k, (ax, key, label) in enumerate(((axes[0], "isotropy", "I(W), sign-symmetric (headline)"),
                                          (axes[1], "isotropy_raw",
                                           "I(W), paper's form (the AGG paper's; eigenvector signs by a fixed rule)"))):
        for g1, dashes in (("code", "-"), ("normalized", "--")):
            sweep = [n for _, n in sorted((groups[n]["alpha"], n) for n in names if groups[n].get("g1") == g1)]
            if sweep:
                ax.plot([summary[n][key]["mean"] for n in sweep], [summary[n]["test_ppl"]["mean"] for n in sweep],
                        color="0.6", linestyle=dashes, linewidth=1, zorder=1, label=f"AGG's α sweep, g1 {g1}")
        for n in names:
            x, y = summary[n][key], summary[n]["test_ppl"]
            if x["mean"] is not None and y["mean"] is not None:
                drawn[k].append((n, draw_series(ax, [x["mean"]], [y["mean"]], [seeds_of(summary, n)],
                                                xerr=[x["spread"] or 0], yerr=[y["spread"] or 0], label=n,
                                                markersize=7, zorder=2, **dict(styles[n], linestyle="none"))))
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("test perplexity")
    overlaid = [show_coinciding(ax, [line for _, line in drawn[k]]) for k, ax in enumerate(axes)]
    axes[1].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small",
                   title="open, larger marker:\na point on another" if any(overlaid) else None, title_fontsize="small")
    fig.suptitle("perplexity vs isotropy of the output embedding "
                 f"({over_seeds([len(summary[n]['seeds']) for n in names], 'mean ± half range over seeds')})")
    for k, ax in enumerate(axes):
        label_points(ax, [(*line.get_xydata()[0], f"α={groups[n]['alpha']:g}", styles[n]["color"])
                          for n, line in drawn[k] if groups[n].get("g1")], marks_of([line for _, line in drawn[k]]))
    return save_study_figure(fig, path)


def figure_depth(summary, names, groups, path, spikes=None, styles=None):
    """µTEV, σTEV, test PPL and the largest gradient norm against the depth, one line per variant;
    a panel of gradient-norm spike counts only where some run had one (``spikes``: the settings,
    named in the title). A variant's line is in its style of the part (``styles``; default: of
    the variants)."""
    plt = pyplot()
    panels = [("tev_mu", "µTEV"), ("tev_sigma", "σTEV"), ("test_ppl", "test perplexity"),
              ("max_gnorm", "largest gradient norm")]
    counted = sum((summary[n].get(key) or {}).get("mean") or 0 for n in names for key in ("gnorm_spikes", "loss_spikes"))
    if counted:
        panels.append(("gnorm_spikes", "gradient-norm spikes (count)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.0 * len(panels), 4.2))
    variants = list(dict.fromkeys(groups[n]["method"] for n in names))
    styles = styles or method_styles(variants)
    for ax, (key, ylabel) in zip(axes, panels):
        for v in variants:
            pts = sorted((groups[n]["depth"], n) for n in names if groups[n]["method"] == v)
            draw_series(ax, [d for d, _ in pts], [summary[n][key]["mean"] for _, n in pts],
                        [seeds_of(summary, n) for _, n in pts], yerr=[summary[n][key]["spread"] or 0 for _, n in pts],
                        label=v, **styles[v])
        ax.set_xticks(sorted({groups[n]["depth"] for n in names}))
        ax.set_xlabel("decoder layers")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[-1].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    title = f"by depth ({over_seeds([len(summary[n]['seeds']) for n in names], 'mean ± half range over seeds')})"
    if not counted:
        rule = "" if spikes is None else (f" (a gradient norm above {spikes['gnorm_factor']:g} ×, or a loss above "
                                          f"{spikes['loss_factor']:g} ×, the median of the previous "
                                          f"{spikes['window']} train_inner values)")
        title += f"; no spike in any run{rule}"
    fig.suptitle(title)
    return save_study_figure(fig, path)
