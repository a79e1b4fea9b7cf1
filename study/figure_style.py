"""What the study's figures share (study/report_figures.py, study/tail_figures.py,
study/trajectory.py): one style per run for a whole part, error bars only where there are seeds
to span, labelled ticks on log axes, and labels and coinciding points that stay readable.

* :func:`method_styles`: the registry. Every run of a part gets one colour (Okabe & Ito, 2008,
  "Color Universal Design": distinguishable with the common colour-vision deficiencies), marker and
  line style, fixed in the part's order of runs, so that a run looks the same in every panel and
  figure of the part's report, whatever else a panel shows.
* :func:`draw_series`: a one-seed point is a plain marker, in the legend too (an error bar of
  length zero still draws its caps, and the legend shows them).
* :class:`LogTicks`: a log axis labels round numbers across the whole view, not only its powers
  of ten (a curve from 170 to 80 would otherwise show labels at 80-100 alone).
* :func:`show_coinciding` and :func:`label_points`: a point on top of another becomes an open,
  larger marker around it; a label covers no other label and no point.
"""
import math

from matplotlib.ticker import FuncFormatter, Locator, LogLocator, MaxNLocator, NullFormatter

# black for the baseline, the pale yellow last
OKABE_ITO = ("#000000", "#E69F00", "#56B4E9", "#009E73", "#D55E00", "#0072B2", "#CC79A7", "#F0E442")
LINE_STYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "D", "v", "P", "X")
BASELINE = {"color": OKABE_ITO[0], "linestyle": "-", "marker": "o"}
GROUP_HATCHES = {"freq": "", "med": "//", "rare": ".."}
GROUP_SHADES = {"freq": 1.0, "med": 0.55, "rare": 0.2}  # the opacity of the run's colour in a group's bar
OPEN_SCALE = 1.6  # how much larger an open marker on another point is: a ring around it


def method_styles(names, family=None):
    """{name: {color, linestyle, marker}} of the runs ``names`` of a part, in the part's order.
    The baseline's family is black, solid and round; the other families take the other seven
    colours in turn, and their markers shift once the colours wrap round, so that no two of the
    first 49 families share both. ``family(name)`` (default: the name itself) groups runs of one
    method (e.g. at several depths): they share its colour and marker and differ in line style,
    and the family is in the registry under its own name too."""
    family = family or (lambda n: n)
    styles, count = {}, {}
    for n in names:
        if n in styles:
            continue
        f = family(n)
        if f not in styles:
            j = len([k for k in count if k != "baseline"])
            styles[f] = dict(BASELINE) if f == "baseline" else {
                "color": OKABE_ITO[1 + j % 7], "linestyle": LINE_STYLES[(1 + j) % len(LINE_STYLES)],
                "marker": MARKERS[(1 + j + j // 7) % len(MARKERS)]}
            count[f] = 0
        if n != f:
            first = LINE_STYLES.index(styles[f]["linestyle"])
            styles[n] = dict(styles[f], linestyle=LINE_STYLES[(first + count[f]) % len(LINE_STYLES)])
            count[f] += 1
    return styles


def seeds_of(summary, n):
    """How many seeds run ``n`` of a report's summary has."""
    return len(summary[n].get("seeds") or [])


def draw_series(ax, xs, ys, seeds, xerr=None, yerr=None, **style):
    """Draws points (xs, ys) with ``style`` and returns their Line2D: error bars (``xerr`` /
    ``yerr``, one a point) only at the points of two seeds or more (``seeds``, one a point), so
    that a one-seed series is plain markers, in the legend too."""
    several = [i for i, s in enumerate(seeds) if s > 1]
    if several and len(several) == len(xs):
        return ax.errorbar(xs, ys, xerr=xerr, yerr=yerr, capsize=3, **style).lines[0]
    line, = ax.plot(xs, ys, **style)
    if several:  # bars of their own, left out of the legend, which shows the plain marker
        def pick(v):
            return None if v is None else [v[i] for i in several]
        ax.errorbar(pick(xs), pick(ys), xerr=pick(xerr), yerr=pick(yerr), fmt="none", ecolor=line.get_color(),
                    capsize=3)
    return line


def group_bars(ax, names, stats, seeds, styles, width=0.27):
    """Bars of one value a (run, frequency group): run i's at i - width, i, i + width, in the run's
    colour, the group told by hatch and shade (full, lighter, lightest); ``stats``: {group:
    [{mean, spread}, one a run]}; error bars (half the seed range) only for runs of two seeds or
    more. Returns the legend handles of the groups (grey, with each group's hatch and shade)."""
    from matplotlib.colors import to_rgba
    from matplotlib.patches import Patch

    handles = []
    for k, (g, s) in enumerate(stats.items()):
        xs = [i + (k - 1) * width for i in range(len(names))]
        ys = [x["mean"] or 0 for x in s]
        ax.bar(xs, ys, width, color=[to_rgba(styles[n]["color"], GROUP_SHADES.get(g, 1.0)) for n in names],
               hatch=GROUP_HATCHES.get(g, ""), edgecolor="black", linewidth=0.4)
        several = [i for i in range(len(names)) if seeds[i] > 1]
        if several:
            ax.errorbar([xs[i] for i in several], [ys[i] for i in several], yerr=[s[i]["spread"] or 0 for i in several],
                        fmt="none", ecolor="black", capsize=3)
        handles.append(Patch(facecolor=to_rgba("0.35", GROUP_SHADES.get(g, 1.0)), hatch=GROUP_HATCHES.get(g, ""),
                             edgecolor="black", linewidth=0.4, label=g))
    return handles


class LogTicks(Locator):
    """Major ticks of a log axis at round numbers across the whole view: evenly spaced ones
    (80, 100, 120, ...) where the view spans less than a decade, else 1, 2 and 5 of each decade."""

    def __call__(self):
        return self.tick_values(*self.axis.get_view_interval())

    def tick_values(self, vmin, vmax):
        lo, hi = sorted((vmin, vmax))
        if lo <= 0:
            lo = hi / 10 if hi > 0 else 1.0
        if hi / lo <= 10:
            ticks = [t for t in MaxNLocator(nbins=6, steps=[1, 2, 2.5, 5, 10]).tick_values(lo, hi) if t > 0]
        else:
            ticks = LogLocator(subs=(1.0, 2.0, 5.0)).tick_values(lo, hi)
        return self.raise_if_exceeds(ticks)


def log_ticks(ax, which="y"):
    """Puts ``ax``'s log axis ``which`` on :class:`LogTicks`, labelled as plain numbers; the minor
    ticks stay unlabelled (matplotlib labels some of them, which would crowd the round numbers)."""
    axis = ax.yaxis if which == "y" else ax.xaxis
    axis.set_major_locator(LogTicks())
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def show_coinciding(ax, lines):
    """Each one-point Line2D of ``lines`` whose marker overlaps an earlier one's (in display space)
    becomes an open marker, :data:`OPEN_SCALE` times as large and drawn above them: the filled
    marker shows inside the ring, and rings of other colours and shapes show each other. Returns
    whether any did. Call once the axes' limits are final (the figure is laid out here)."""
    ax.figure.tight_layout()
    px = ax.figure.dpi / 72
    placed, moved = [], False  # (display position, radius in pixels) of the points drawn so far
    for line in lines:
        if _point(line) is None:
            continue
        xy = ax.transData.transform(_point(line))
        r = line.get_markersize() * px / 2
        if any(math.dist(xy, p) < r + q for p, q in placed):
            line.set_markerfacecolor("none")
            line.set_markeredgewidth(1.6)
            line.set_markersize(line.get_markersize() * OPEN_SCALE)
            line.set_zorder(line.get_zorder() + 1)
            r *= OPEN_SCALE
            moved = True
        placed.append((xy, r))
    return moved


def _point(line):
    """(x, y) of a one-point Line2D, or None where a value is missing."""
    x, y = line.get_xdata()[0], line.get_ydata()[0]
    return None if x is None or y is None or not (math.isfinite(x) and math.isfinite(y)) else (x, y)


def marks_of(lines):
    """[(x, y, radius in points)] of the markers of one-point Line2Ds: what labels keep clear of."""
    return [(*_point(line), line.get_markersize() / 2 + line.get_markeredgewidth()) for line in lines
            if _point(line) is not None]


def label_points(ax, points, marks=None):
    """Writes each (x, y, text, colour) of ``points`` beside its point, in the colour of its
    series and joined to it by a thin line: the label goes outwards from the middle of the points,
    at the nearest place where it covers no label written before and no marker of ``marks``
    ([(x, y, radius in points)]; default: the labelled points, 4 points wide) with 2 points to
    spare (greedy, in display space). Call once the axes are final."""
    from matplotlib.transforms import Bbox

    fig = ax.figure
    fig.tight_layout()  # the layout the figure is saved with, so that display positions hold
    renderer = fig.canvas.get_renderer()
    px = fig.dpi / 72
    marks = [(x, y, 4.0) for x, y, _, _ in points] if marks is None else marks
    taken = []
    for x, y, r in marks:
        mx, my = ax.transData.transform((x, y))
        r = (r + 2) * px
        taken.append(Bbox.from_extents(mx - r, my - r, mx + r, my + r))
    labelled = [ax.transData.transform((x, y)) for x, y, _, _ in points]
    middle = sum(labelled) / len(labelled) if labelled else None
    for (x, y, text, colour), mark in zip(points, labelled):
        out = math.atan2(*(mark - middle)[::-1]) if len(labelled) > 1 else math.pi / 4
        dx, dy, align, box = _label_place(ax, renderer, (x, y), text, out, taken)
        label = ax.annotate(text, (x, y), textcoords="offset points", xytext=(dx, dy), fontsize="x-small",
                            color=colour, arrowprops={"arrowstyle": "-", "color": colour, "lw": 0.5, "shrinkA": 0,
                                                      "shrinkB": 3}, **align)
        label.set_in_layout(False)  # or the layout at saving would move the points under the labels
        taken.append(box)


def _label_place(ax, renderer, xy, text, out, taken):
    """(dx, dy, alignment, box) of a label of the point ``xy``: the first of 12 directions at 7
    distances (points; the nearest and most outward from ``out`` first) with the fewest clashes
    with the boxes ``taken``."""
    tries = sorted(((r, abs(math.remainder(k * math.pi / 6 - out, 2 * math.pi))), k * math.pi / 6)
                   for r in (8, 18, 30, 44, 60, 78, 100) for k in range(12))
    best = None  # (clashes, offset, box): the first place with the fewest clashes
    for (r, _), angle in tries:
        dx, dy = r * math.cos(angle), r * math.sin(angle)
        align = {"ha": "left" if dx > 1 else "right" if dx < -1 else "center",
                 "va": "bottom" if dy > 1 else "top" if dy < -1 else "center"}
        trial = ax.annotate(text, xy, textcoords="offset points", xytext=(dx, dy), fontsize="x-small", **align)
        box = trial.get_window_extent(renderer)
        trial.remove()
        clashes = sum(box.overlaps(b) for b in taken)
        if best is None or clashes < best[0]:
            best = (clashes, (dx, dy, align), box)
        if clashes == 0:
            break
    return (*best[1], best[2])
