"""The figures of ``fairseq-agg-analyze``: overlaid singular-value spectra, and embeddings projected
on their top two right-singular directions, coloured by frequency group (Yu et al., ACL 2022, show
this "narrow cone" for the rare tokens; docs/stats.md)."""
import math
from collections import OrderedDict

GROUP_COLOURS = {"freq": "tab:blue", "med": "tab:orange", "rare": "tab:red"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_spectrum(entries, path):
    """entries: [(label, singular values list)] -> overlaid raw and normalised spectra."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for label, sv in entries:
        sv = [s for s in sv if s > 0]  # exact zeros (rank < d) have no place on a log axis
        if not sv:
            continue
        axes[0].plot(range(1, len(sv) + 1), sv, label=label)
        axes[1].plot(range(1, len(sv) + 1), [s / sv[0] for s in sv], label=label)
    axes[0].set_title("singular values")
    axes[1].set_title("singular values / largest")
    for ax in axes:
        ax.set_yscale("log")
        ax.set_xlabel("index")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_projection(panels, path, max_points=3000):
    """panels: [(title, W, rows, spectrum, {group: rows})]; one panel per checkpoint."""
    plt = _pyplot()
    n = len(panels)
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 4), squeeze=False)
    for ax, (title, W, rows, spec, group_rows) in zip(axes[0], panels):
        top2 = spec.directions[:2]  # top two right-singular directions (uncentred, as the AGG figure)
        sets = group_rows or OrderedDict([("all", rows)])
        for g, r in sets.items():
            if r.numel() == 0:
                continue
            step = max(1, math.ceil(r.numel() / max_points))  # even subsample, deterministic
            pts = (W.index_select(0, r[::step]).double() @ top2.t()).cpu()
            ax.scatter(pts[:, 0], pts[:, 1], s=4, alpha=0.6, label=g, c=GROUP_COLOURS.get(g, "tab:gray"))
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("u1")
        ax.set_ylabel("u2")
        ax.axhline(0, color="k", lw=0.3)
        ax.axvline(0, color="k", lw=0.3)
        ax.legend(fontsize=7, markerscale=3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
