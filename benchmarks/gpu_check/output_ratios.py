"""The ratios of one output-layer run of the GPU check (a shape in a dtype): the package's default
path against stock, Liger and CCE, its other paths (eager, foreign kernels) against the default one,
the floors and stock, and issue #25's anchors (torch's fastest variant, its chunked path's peak)."""
from benchmarks import variants

DEFAULT_PATH = ("fused_ce", "agg", "al")


def entry_key(eps, name, kernel=None, chunk=None) -> variants.Key:
    """The key of ``name`` in a run at label smoothing ``eps``: ``+ls`` where it takes the smoothing."""
    smoothed = eps > 0 and variants.VARIANTS[name].smoothing == variants.TAKES
    return variants.key(name, smoothed, kernel, chunk)


def ratio(a, b):
    if a is None or b is None or b == 0:
        return None
    return round(a / b, 3)


class _Run:
    """The median ms and peak MiB of a run's variants, looked up by name (and kernel)."""

    def __init__(self, entry):
        self.entry, self.eps = entry, entry["eps"]

    def key(self, name, kernel=None):
        return str(entry_key(self.eps, name, kernel))

    def ms(self, name, kernel=None):
        return self.entry["variants"].get(self.key(name, kernel), {}).get("median_ms")

    def mem(self, name, kernel=None):
        return self.entry["variants"].get(self.key(name, kernel), {}).get("peak_mib")


def output_ratios(entry):
    """The default path against stock and Liger, and every other path of the package (eager,
    foreign kernels) against the default one (above 1 for eager: the compiled body is faster),
    the floor, Liger and stock."""
    run, out = _Run(entry), {}
    for name in DEFAULT_PATH:
        out[f"{name}_time_vs_stock"] = ratio(run.ms(name), run.ms("stock"))
        out[f"{name}_time_vs_liger"] = ratio(run.ms(name), run.ms("liger"))
        out[f"{name}_memory_vs_stock"] = ratio(run.mem(name), run.mem("stock"))
        out[f"{name}_memory_vs_liger"] = ratio(run.mem(name), run.mem("liger"))
    out["liger_time_vs_stock"] = ratio(run.ms("liger"), run.ms("stock"))
    for name in DEFAULT_PATH:
        out[f"{name}_speedup_vs_eager"] = ratio(run.ms(name, "eager"), run.ms(name))
    for text in entry["variants"]:
        k = variants.parse_key(text)
        if k.kernel:
            tag, ms, mem = f"{k.name}_{k.kernel}", run.ms(k.name, k.kernel), run.mem(k.name, k.kernel)
            if k.kernel != "eager":  # for eager: {name}_speedup_vs_eager
                out[f"{tag}_time_vs_default"] = ratio(ms, run.ms(k.name))
            out[f"{tag}_time_vs_floor"] = ratio(ms, run.ms("floor"))
            out[f"{tag}_time_vs_liger"] = ratio(ms, run.ms("liger"))
            out[f"{tag}_time_vs_stock"] = ratio(ms, run.ms("stock"))
            out[f"{tag}_memory_vs_stock"] = ratio(mem, run.mem("stock"))
    return out


def anchor_ratios(entry):
    """Issue #25's ratios: the default path against the floor, torch's fastest variant at the
    shape's smoothing, the peak of torch's chunked path (its own chunk size) and CCE; AL against the
    fused CE and against its own floor (the three matmuls and the teacher's)."""
    run = _Run(entry)
    timed = {**entry["variants"], **{k: v for k, v in entry["sweep"].items() if k.startswith("torch_chunk@")}}
    ms = {k: v.get("median_ms") for k, v in timed.items()}
    torch_keys = [k for k in timed if variants.parse_key(k).variant.family == variants.TORCH and ms.get(k)]
    best = min(torch_keys, key=ms.get) if torch_keys else None
    out = {"torch_best": best, "al_time_vs_fused_ce": ratio(run.ms("al"), run.ms("fused_ce")),
           "al_time_vs_al_floor": ratio(run.ms("al"), run.ms("al_floor"))}
    for name in DEFAULT_PATH:
        out[f"{name}_time_vs_floor"] = ratio(run.ms(name), run.ms("floor"))
        out[f"{name}_time_vs_torch_best"] = ratio(run.ms(name), ms.get(best))
        out[f"{name}_memory_vs_torch_chunked"] = ratio(run.mem(name), run.mem("torch_auto"))
        out[f"{name}_time_vs_cce"] = ratio(run.ms(name), run.ms("cce"))
    out["torch_best_time_vs_floor"] = ratio(ms.get(best), run.ms("floor"))
    return out


def best_chunks(entry, chunk0):
    """The fastest chunk size of AGG, AL and torch's chunked path, over the run's chunk and the sweep."""
    run, best = _Run(entry), {}
    for name in ("agg", "al", "torch_chunk"):
        timed = {chunk0: run.ms(name)}
        for text, value in entry["sweep"].items():
            k = variants.parse_key(text)
            if k.name == name:
                timed[k.chunk] = value.get("median_ms")
        timed = {c: t for c, t in timed.items() if t is not None}
        if timed:
            best[name] = min(timed, key=timed.get)
    return best
