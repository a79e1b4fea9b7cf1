"""The figures of ``fairseq-agg-analyze``: overlaid singular-value spectra, and embeddings projected
on their top two right-singular directions, coloured by frequency group (Yu et al., ACL 2022, show
this "narrow cone" for the rare tokens; docs/stats.md). Also the helpers the demos' figures share:
:func:`pyplot`, :func:`line_style` and :func:`save_figure`.

Every figure is meant to be put in a paper as it is: labelled axes, legends outside the axes,
shared axes where panels are compared, and lines told apart by colour, line style and marker.
Each plotting function returns its (closed) Figure, so that code and tests can look at it.
"""
import logging
import math
from collections import OrderedDict

import torch

from fairseq_agg.stats.metrics import SIGN_TIE_RTOL

GROUP_COLOURS = {"freq": "tab:blue", "med": "tab:orange", "rare": "tab:red"}
GROUP_LABELS = {"freq": "frequent", "med": "medium", "rare": "rare", "all": "all rows"}
COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:gray",
           "tab:olive", "tab:cyan")
LINE_STYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "D", "v", "P", "X")  # 7 and 4 styles: the first 28 lines differ in both
PROJECTION_COLUMNS = 4  # panels per row of projection.png
DPI = 150


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend, with matplotlib's logger at WARNING: a
    process whose root logger is at DEBUG (importing fairseq's tasks sets it so) would otherwise
    print matplotlib's debug lines as it is imported."""
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def line_style(i):
    """{color, linestyle, marker} of the i-th line of a plot: no two of the first ten lines share a
    colour, and neighbours also differ in line style and marker (legible in grey, and where lines lie
    on top of each other)."""
    return {"color": COLOURS[i % len(COLOURS)], "linestyle": LINE_STYLES[i % len(LINE_STYLES)],
            "marker": MARKERS[i % len(MARKERS)]}


def save_figure(fig, path):
    """Writes ``fig`` to ``path`` (PNG at :data:`DPI`) and closes it; returns it."""
    fig.savefig(path, dpi=DPI)
    pyplot().close(fig)
    return fig


def plot_spectrum(entries, path):
    """entries: [(label, singular values, largest first)] -> PATH: the raw spectra (left) and the
    spectra divided by their largest value (right), overlaid, both on a log scale; returns the Figure."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True, layout="constrained")
    shown = [(label, [s for s in sv if s > 0]) for label, sv in entries]  # exact zeros (rank < d): not on a log axis
    shown = [(label, sv) for label, sv in shown if sv]
    for i, (label, sv) in enumerate(shown):
        # a marker every tenth of the axes' diagonal, shifted per line: lines on top of each other
        # (e.g. two methods with the same spectrum) still show each one's markers
        style = dict(line_style(i), markevery=(0.1 * i / len(shown), 0.1), markersize=4, linewidth=1.2, label=label)
        index = range(1, len(sv) + 1)
        axes[0].plot(index, sv, **style)
        axes[1].plot(index, [s / sv[0] for s in sv], **style)
    axes[0].set_title("singular values of the embedding matrix")
    axes[0].set_ylabel(r"singular value $\sigma_i$ (log scale)")
    axes[1].set_title("relative to the largest")
    axes[1].set_ylabel(r"$\sigma_i / \sigma_1$ (log scale)")
    for ax in axes:
        ax.set_yscale("log")
        ax.set_xlabel(r"index $i$ (largest first)")
        ax.grid(alpha=0.3, which="both")
    if shown:
        fig.legend(*axes[0].get_legend_handles_labels(), loc="outside right upper", title="checkpoint:matrix",
                   fontsize="small")
    return save_figure(fig, path)


def projection_directions(spec):
    """The top two right-singular directions of ``spec`` (rows), each turned towards the mean row
    (the direction the cone points to, the rule of ``isotropy_fixed``), so that panels of different
    checkpoints do not mirror each other; one orthogonal to the mean keeps its canonical sign."""
    top2 = spec.directions[:2]
    along = top2 @ spec.mean.to(top2.dtype)
    away = along < -SIGN_TIE_RTOL * float(spec.mean.norm())
    return top2 * torch.where(away, -1.0, 1.0).to(top2.dtype).unsqueeze(1)


def _limits(values, margin=0.05):
    low, high = min(values), max(values)
    pad = margin * (high - low) or 1.0
    return low - pad, high + pad


def plot_projection(panels, path, max_points=3000):
    """panels: [(title, W, rows, spectrum, {group: rows})], one per checkpoint -> PATH: W's rows
    projected on the top two right-singular directions of W[rows] (:func:`projection_directions`),
    coloured by frequency group, at most ``max_points`` rows a group (evenly spaced,
    deterministic); all panels on the same axes, equal in scale on both, each panel as tall as that
    makes it; returns the Figure."""
    plt = pyplot()
    n = len(panels)
    projected = []  # per panel: [(group, points)]
    for title, W, rows, spec, group_rows in panels:
        top2 = projection_directions(spec)
        shown = []
        for g, r in (group_rows or OrderedDict([("all", rows)])).items():
            if r.numel() == 0:
                continue
            step = max(1, math.ceil(r.numel() / max_points))
            shown.append((g, (W.index_select(0, r[::step]).double() @ top2.t()).cpu()))
        projected.append(shown)
    points = [pts for shown in projected for _, pts in shown]
    xlim = _limits([float(v) for pts in points for v in (pts[:, 0].min(), pts[:, 0].max())] or [0.0])
    ylim = _limits([float(v) for pts in points for v in (pts[:, 1].min(), pts[:, 1].max())] or [0.0])
    # equal scales on shared axes fix each panel's shape: size the rows to it, so that a wide cloud
    # leaves no empty band between the rows
    ratio = min(4.0, max(0.25, (ylim[1] - ylim[0]) / (xlim[1] - xlim[0])))
    width = 3.6 if ratio <= 1 else 3.6 / ratio
    nrows = math.ceil(n / PROJECTION_COLUMNS)
    ncols = math.ceil(n / nrows)  # rows as full as possible: 5 panels are 3 + 2, not 4 + 1
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols + 1.6, (width * ratio + 0.45) * nrows + 0.7),
                             sharex=True, sharey=True, squeeze=False, layout="constrained")
    for k, ax in enumerate(axes.flat):
        if k >= n:
            ax.set_visible(False)
            continue
        for g, pts in projected[k]:
            ax.scatter(pts[:, 0], pts[:, 1], s=3, alpha=0.5, linewidths=0, label=GROUP_LABELS.get(g, g),
                       color=GROUP_COLOURS.get(g, "tab:gray"), rasterized=True)
        ax.set_title(panels[k][0], fontsize=9)
        # shared axes: axis labels on the left column and under the lowest panel of each column
        if k + ncols >= n:
            ax.set_xlabel(r"projection on $v_1$")
            ax.xaxis.set_tick_params(labelbottom=True)
        if k % ncols == 0:
            ax.set_ylabel(r"projection on $v_2$")
        ax.axhline(0, color="k", lw=0.3)
        ax.axvline(0, color="k", lw=0.3)
        ax.set_xlim(*xlim)
        ax.set_ylim(*ylim)
        ax.set_aspect("equal", adjustable="box")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if handles:
        legend = fig.legend(handles, labels, loc="outside right upper", title="frequency group", markerscale=4,
                            fontsize="small")
        for h in legend.legend_handles:
            h.set_alpha(1)
    fig.suptitle(r"rows of W on its top two right-singular vectors $v_1, v_2$, each turned towards the mean row",
                 fontsize=10)
    return save_figure(fig, path)
