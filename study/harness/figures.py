"""What the figures of the demos and the study share: a mean curve with its band over seeds, and
the study's way of saving a figure."""
import statistics


def save_study_figure(fig, path):
    """Lays out ``fig``, writes it to ``path`` (PNG, 110 dpi, legends outside the axes kept) and
    closes it; returns ``path``."""
    from fairseq_agg.analysis.plots import pyplot

    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    pyplot().close(fig)
    return path


def seed_band(curves):
    """(updates, mean, min, max) over the seeds' curves ([(update, value)] each), at the updates
    every seed logged."""
    if not curves:
        return [], [], [], []
    by_seed = [dict(c) for c in curves]
    common = sorted(set.intersection(*(set(s) for s in by_seed)))
    vals = [[s[u] for s in by_seed] for u in common]
    return common, [statistics.fmean(v) for v in vals], [min(v) for v in vals], [max(v) for v in vals]
