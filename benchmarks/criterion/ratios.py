"""The output-layer benchmark's ratios, each row "a / b" of two measured keys with its wall, paired,
CPU and memory ratios and the targets of the one table (benchmarks/targets.py) it is judged by;
a row is printed only where both keys were measured."""
from benchmarks import ops, variants
from benchmarks.criterion.selection import primary_key
from benchmarks.targets import CRITERION, target
from tests.support.output_layer_problem import MIB

REMEDIES = ("freeze", "cosreg", "face", "ul")  # docs/baselines.md


def goal(name):
    """The row of the target table that this benchmark judges ``name`` by."""
    return target(name, CRITERION)


class Measured:
    """The run's timings (:class:`benchmarks.timing.Samples`) and peak bytes, by key text."""

    def __init__(self, samples, peaks):
        self.samples, self.peaks = samples, peaks

    def memory_ratio(self, a, b):
        if a in self.peaks and b in self.peaks and self.peaks[b] > 0:
            return self.peaks[a] / self.peaks[b]
        return None


def extra_memory(args, m, a, b, t):
    """A target on the peak of ``a`` above that of ``b``, in N x V fp32 tensors: (text, passed)."""
    if a not in m.peaks or b not in m.peaks:
        return None
    extra = m.peaks[a] - m.peaks[b]
    return f"peak {extra / MIB:+.0f} MiB over {b} < 1 NxV", t.passed(extra / (args.tokens * args.vocab * 4))


def ratio_line(m, label, a, b, time_target=None, memory_target=None, memory_note=None, mem_base=None):
    """``a`` against ``b``: wall, paired, CPU and memory ratios (memory against ``mem_base`` when
    given), and PASS/MISS per target."""
    s = m.samples
    rt, rm = s.median(a) / s.median(b), m.memory_ratio(a, mem_base or b)
    wanted, results = [], []
    if time_target is not None:
        wanted.append(f"time {time_target.text()}x ({time_target.source})")
        results.append(time_target.passed(rt))
    if memory_target is not None and rm is not None:
        wanted.append(f"mem {memory_target.text()}x")
        results.append(memory_target.passed(rm))
    if memory_note is not None:
        wanted.append(memory_note[0])
        results.append(memory_note[1])
    verdict = " ".join("PASS" if ok else "MISS" for ok in results)
    rms = f"{rm:.3f}x" if rm is not None else "-"
    return (f"{label:<58s} {rt:7.3f}x {s.paired(a, b):7.3f}x {s.median_cpu(a) / s.median_cpu(b):7.3f}x {rms:>8s}   "
            f"{(', '.join(wanted) or 'info'):<52s} {verdict}")


class Rows:
    """The ratio rows of one report: a row is added only when both of its keys were measured."""

    def __init__(self, args, m, keys):
        self.args, self.m, self.keys, self.lines = args, m, keys, []
        self.have = {str(k) for k in keys}

    def add(self, a, b, *targets, label=None, **kwargs):
        a, b = str(a), str(b)
        if a in self.have and b in self.have and a != b:
            self.lines.append(ratio_line(self.m, label or f"{a} / {b}", a, b, *targets, **kwargs))

    def package(self, *names, foreign=False):
        """The measured package keys of ``names`` (all where none) on the package's own kernels (on
        the foreign ones: ``foreign``)."""
        return [k for k in self.keys if k.variant.family == variants.PACKAGE and (not names or k.name in names)
                and (k.kernel in ops.FOREIGN_KERNELS) == foreign]

    def like(self, k, name, kernel="same"):
        """The key of ``name`` measured like ``k``: its smoothing (where ``name`` takes one), kernel and chunk."""
        smoothed = k.smoothed and variants.VARIANTS[name].smoothing == variants.TAKES
        kernel = k.kernel if kernel == "same" else kernel
        if variants.VARIANTS[name].family != variants.PACKAGE:
            kernel = None
        chunk = k.chunk if variants.VARIANTS[name].chunked else None
        return variants.key(name, smoothed, kernel, chunk, self.args.chunk_size)


def item7_lines(rows):
    """Issue #46's CPU ratios on the path ``auto`` picks: the fused CE and AGG (at the run's
    smoothing where measured so, as the issue measured it) against the floor, the fused CE against
    torch's chunked path."""
    args = rows.args
    fce, floor = primary_key(args, "fused_ce", kernel="auto"), variants.key("floor")
    agg = next((k for k in (primary_key(args, "agg", True, "auto"), primary_key(args, "agg", False, "auto"))
                if str(k) in rows.have), None)
    rows.add(fce, floor, goal("auto_fused_ce_time_vs_floor"))
    if agg is not None:
        rows.add(agg, floor, goal("auto_agg_time_vs_floor"))
    rows.add(fce, "torch_auto", goal("auto_fused_ce_time_vs_torch_chunked"))


def floor_lines(rows):
    """Issue #33, on every kernel: the fused CE and AGG against the floor, the augmented loss
    against the fused CE and against its own floor (at the fused CE's limit)."""
    for k in rows.package("fused_ce", "agg"):
        rows.add(k, rows.like(k, "floor"), goal(f"{k.name}_time_vs_floor"))
    for k in rows.package("al"):
        rows.add(k, rows.like(k, "fused_ce"), goal("al_time_vs_fused_ce"))
        rows.add(k, rows.like(k, "al_floor"), goal("fused_ce_time_vs_floor"),
                 label=f"{k} / {rows.like(k, 'al_floor')} (the fused CE's limit)")


def kernel_lines(rows, base):
    """Every other kernel of the chunk body against ``base``: above 1, ``base`` is the faster."""
    base = None if base == ops.DEFAULT_KERNEL else base
    for k in rows.package():
        if k.kernel != base:
            rows.add(k, rows.like(k, k.name, base), label=f"{k} / {rows.like(k, k.name, base)} (the speed-up)")


def goal_lines(rows):
    """The project's goals and issue #25's remedies, on every kernel: AGG against stock at the same
    smoothing (time and memory), the augmented loss against stock CE, the fused CE against stock,
    each remedy against the fused CE."""
    args, m = rows.args, rows.m
    for k in rows.package("agg"):
        rows.add(k, rows.like(k, "stock"), goal("agg_time_vs_stock"), goal("agg_memory_vs_stock"))
    for k in rows.package("al"):
        stock = rows.like(k, "stock")
        rows.add(k, stock, goal("al_time_vs_stock"), None, extra_memory(args, m, str(k), str(stock),
                                                                     goal("al_extra_memory_in_nxv")))
    for k in rows.package("fused_ce"):
        rows.add(k, rows.like(k, "stock"))
    for k in rows.package(*REMEDIES):
        fused = rows.like(k, "fused_ce")
        rows.add(k, fused, goal("remedy_time_vs_fused_ce"), None, extra_memory(args, m, str(k), str(fused),
                                                                            goal("remedy_extra_memory_in_nxv")))


def reference_lines(rows):
    """The reference constructions against stock and the package, and stock CE against stock
    label-smoothed CE."""
    args = rows.args
    for smoothed in (True, False):
        agg_ref = variants.key("agg_ref", smoothed)
        rows.add(agg_ref, variants.key("stock", smoothed))
        rows.add(primary_key(args, "agg", smoothed), agg_ref)
    rows.add("al_ref", "stock")
    rows.add("stock", "stock+ls")


def foreign_lines(rows):
    """The package on the foreign kernels against the floor and its own chunk body, and the fused
    CE on torch's kernel against torch's op itself (the package's wrapper's cost)."""
    for k in rows.package(foreign=True):
        rows.add(k, rows.like(k, "floor"))
        rows.add(k, primary_key(rows.args, k.name, k.smoothed))
        if k.name == "fused_ce" and not k.smoothed:
            rows.add(k, "torch_auto", label=f"{k} / torch_auto (the wrapper's cost)")


def torch_fastest(rows, smoothed):
    """The key text of torch's fastest variant at eps > 0 (``smoothed``) or at 0, or None."""
    measured = [str(k) for k in rows.keys if k.variant.family == variants.TORCH and k.smoothed == smoothed]
    return min(measured, key=rows.m.samples.median) if measured else None


def anchor_lines(rows, primary):
    """Issue #25's comparisons on the first kernel: the package's variants (other than the fused CE
    and AGG, set against the floor above) against the floor, all of them against torch's fastest
    variant at the same smoothing (memory against torch's chunked path with its own chunk size)."""
    primary = None if primary == ops.DEFAULT_KERNEL else primary
    on_primary = [k for k in rows.package() if k.kernel == primary]
    for k in on_primary:
        if k.name not in ("fused_ce", "agg"):
            rows.add(k, rows.like(k, "floor"))
    fastest = {smoothed: torch_fastest(rows, smoothed) for smoothed in (False, True)}
    chunked = "torch_auto" if "torch_auto" in rows.have else None
    for k in on_primary:
        best = fastest[k.smoothed]
        if best is not None:
            rows.add(k, best, None, goal("memory_vs_torch_chunked") if chunked else None, mem_base=chunked,
                     label=f"{k} / {best}" + (", mem / torch_auto" if chunked else ""))
    for best in fastest.values():
        if best is not None:
            rows.add(best, "floor")


def ratio_lines(args, keys, m, auto_path):
    """The comparisons the measured keys allow, the targets first."""
    head = f"{'ratio':<58s} {'wall':>8s} {'paired':>8s} {'cpu':>8s} {'memory':>8s}   {'target':<52s} result"
    rows = Rows(args, m, keys)
    sections = [(f"issue #46, item 7: on the path auto picks here ({auto_path})", item7_lines),
                ("issue #33: against the floors, per kernel", floor_lines),
                (f"each kernel against {args.kernel_list[0]}", lambda r: kernel_lines(r, args.kernel_list[0])),
                ("the project's goals and issue #25's remedies", goal_lines),
                ("the reference constructions", reference_lines),
                ("the package on the foreign kernels", foreign_lines),
                ("issue #25's anchors", lambda r: anchor_lines(r, args.kernel_list[0]))]
    lines = [head, "-" * len(head)]
    for title, fill in sections:
        before = len(rows.lines)
        fill(rows)
        if len(rows.lines) > before:
            lines += [f"-- {title}"] + rows.lines[before:]
    return lines
