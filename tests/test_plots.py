"""The figures of fairseq-agg-analyze (fairseq_agg/analysis/plots.py) on small synthetic inputs: PNGs
are written, and the matplotlib objects have labelled axes, legends outside the axes, shared axes
across the projection panels and lines told apart by colour, style and marker. No pixel is compared."""
from collections import OrderedDict

import numpy as np
import torch

from fairseq_agg.analysis import analyze as A
from fairseq_agg.analysis import plots
from fairseq_agg.stats.metrics import embedding_spectrum

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _is_png(path):
    return path.stat().st_size > 1000 and path.read_bytes()[:8] == PNG_MAGIC


def _legend_outside(fig, legend, axes):
    """The legend's box overlaps none of the axes (it hides nothing)."""
    fig.canvas.draw()
    box = legend.get_window_extent()
    return not any(box.overlaps(ax.get_window_extent()) for ax in axes if ax.get_visible())


def test_spectrum_lines_are_told_apart_and_axes_labelled(tmp_path):
    sv = [4.0, 2.0, 1.0, 0.5]
    entries = [("baseline:dec", sv), ("agg:dec", [2.0, 1.9, 1.8, 1.7]), ("agg+mlra:dec", [2.0, 1.9, 1.8, 1.7]),
               ("rank2:dec", [3.0, 1.0, 0.0, 0.0])]
    fig = plots.plot_spectrum(entries, str(tmp_path / "spectrum.png"))
    assert _is_png(tmp_path / "spectrum.png")
    raw, rel = fig.axes[:2]
    for ax in (raw, rel):
        assert ax.get_xlabel() and ax.get_ylabel() and ax.get_yscale() == "log"
    assert raw.get_shared_x_axes().joined(raw, rel)
    # one line per entry and panel; identical spectra (AGG vs AGG+MLRA) still differ in colour,
    # line style and marker
    styles = [(line.get_color(), line.get_linestyle(), line.get_marker()) for line in raw.get_lines()]
    assert len(styles) == 4
    for k in range(3):
        assert len({s[k] for s in styles}) == 4
    # the right panel is each spectrum over its largest value; exact zeros are left out of the log axis
    assert list(rel.get_lines()[0].get_ydata()) == [1.0, 0.5, 0.25, 0.125]
    assert list(raw.get_lines()[3].get_ydata()) == [3.0, 1.0]
    legend = fig.legends[0]
    assert [t.get_text() for t in legend.get_texts()] == [label for label, _ in entries]
    assert _legend_outside(fig, legend, fig.axes)


def _panel(title, seed, n=60, d=6):
    W = torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    rows = torch.arange(4, n)
    groups = OrderedDict(freq=torch.arange(4, 20), med=torch.arange(20, 50), rare=torch.arange(50, n))
    return title, W, rows, embedding_spectrum(W, rows), groups


def test_projection_panels_share_axes_and_are_labelled(tmp_path):
    panels = [_panel(f"run{k}: dec, I(W) = 0.{k}00", k) for k in range(5)]
    fig = plots.plot_projection(panels, str(tmp_path / "projection.png"), max_points=10)
    assert _is_png(tmp_path / "projection.png")
    shown = [ax for ax in fig.axes if ax.get_visible()]
    assert len(shown) == 5 and len(fig.axes) == 6  # 3 + 2 panels, the sixth place left empty
    assert [ax.get_title() for ax in shown] == [p[0] for p in panels]
    for ax in shown[1:]:
        assert shown[0].get_shared_x_axes().joined(shown[0], ax)
        assert shown[0].get_shared_y_axes().joined(shown[0], ax)
    # axis labels on the left column and under the lowest panel of every column
    assert [bool(ax.get_ylabel()) for ax in shown] == [True, False, False, True, False]
    assert [bool(ax.get_xlabel()) for ax in shown] == [False, False, True, True, True]
    # at most max_points rows a group, evenly spaced: 16, 30 and 10 rows -> 8, 10 and 10 points
    assert [len(c.get_offsets()) for c in shown[0].collections] == [8, 10, 10]
    # the points are the rows projected on the top two right-singular directions, turned towards
    # the mean row
    title, W, rows, spec, groups = panels[0]
    expected = W[groups["rare"]] @ plots.projection_directions(spec).t()
    assert np.allclose(np.asarray(shown[0].collections[2].get_offsets()), expected.numpy(), rtol=1e-6, atol=1e-9)
    assert torch.allclose(plots.projection_directions(spec).abs(), spec.directions[:2].abs())
    legend = fig.legends[0]
    assert [t.get_text() for t in legend.get_texts()] == ["frequent", "medium", "rare"]
    assert _legend_outside(fig, legend, fig.axes)


def test_analyze_projection_titles_carry_the_isotropy(tmp_path, monkeypatch):
    """fairseq-agg-analyze's projection panels are titled with I(W) of the matrix they show."""
    gen = torch.Generator().manual_seed(3)
    for name, scale in (("wide", 1.0), ("cone", 0.2)):
        W = torch.randn(40, 8, generator=gen)
        W[:, 0] += 1.0 / scale  # a common direction: a lower isotropy
        torch.save({"model": {"decoder.embed_tokens.weight": W}, "cfg": None, "extra_state": {"train_iterator": None},
                    "optimizer_history": [{"criterion_name": "CrossEntropyCriterion", "optimizer_name": "adam",
                                           "lr_scheduler_state": {}, "num_updates": 7}]}, tmp_path / f"{name}.pt")
    figures = []

    def keep(panels, path, max_points):
        figures.append(plots.plot_projection(panels, path, max_points=max_points))

    monkeypatch.setattr(A, "plot_projection", keep)
    report = A.analyze([str(tmp_path / "wide.pt"), str(tmp_path / "cone.pt")], out=str(tmp_path / "out"),
                       device="cpu")
    iso = [c["matrices"]["dec"]["all"]["isotropy"] for c in report["checkpoints"]]
    assert iso[1] < iso[0]
    titles = [ax.get_title() for ax in figures[0].axes if ax.get_visible()]
    assert titles == [f"wide: dec, I(W) = {iso[0]:.3f}", f"cone: dec, I(W) = {iso[1]:.3f}"]
    assert _is_png(tmp_path / "out" / "projection.png") and _is_png(tmp_path / "out" / "spectrum.png")


def _cone(seed, direction, n=200, d=8):
    """Rows along ``direction`` * (0 .. 6) on the first axis plus small noise: a wide cloud."""
    W = 0.3 * torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    W[:, 0] += direction * torch.linspace(0, 6, n, dtype=torch.float64)
    rows = torch.arange(4, n)
    groups = OrderedDict(freq=torch.arange(4, 60), med=torch.arange(60, 160), rare=torch.arange(160, n))
    return W, rows, embedding_spectrum(W, rows), groups


def test_projection_directions_point_to_the_mean_row_in_every_panel(tmp_path):
    """Checkpoints whose cones point either way, or whose solver signed v1 either way, are drawn
    the same way round: the mean row projects on the positive side of v1 in every panel."""
    W, rows, spec, groups = _cone(0, +1.0)
    mirrored = spec._replace(directions=-spec.directions)  # the other sign a solver may return
    W2, rows2, spec2, groups2 = _cone(1, -1.0)
    panels = [("a", W, rows, spec, groups), ("a, solver's other sign", W, rows, mirrored, groups),
              ("b, cone the other way", W2, rows2, spec2, groups2)]
    fig = plots.plot_projection(panels, str(tmp_path / "projection.png"), max_points=1000)
    shown = [ax for ax in fig.axes if ax.get_visible()]
    rare = [np.asarray(ax.collections[2].get_offsets()) for ax in shown]
    assert np.allclose(rare[0], rare[1])
    assert all(points[:, 0].mean() > 0 for points in rare)
    for _, Wk, rk, sk, _ in panels:
        assert float((Wk[rk].mean(0) @ plots.projection_directions(sk)[0].t())) > 0


def test_projection_rows_are_as_tall_as_the_shared_scale_makes_them(tmp_path):
    """A wide cloud on equal scales makes short panels; the rows follow them without an empty band."""
    panels = [(f"run{k}", *_cone(k, 1.0)) for k in range(8)]
    fig = plots.plot_projection(panels, str(tmp_path / "projection.png"), max_points=100)
    shown = [ax for ax in fig.axes if ax.get_visible()]
    assert len(shown) == 8 and shown[0].get_aspect() == 1.0
    width, height = fig.get_size_inches()
    top, below = shown[0].get_position(), shown[4].get_position()  # rows 1 and 2 of 4 panels each
    assert top.height * height < 0.5 * top.width * width  # a wide cloud: short panels
    assert (top.y0 - below.y1) * height < 0.25 * top.width * width  # the gap: titles and tick labels only
