"""Part 2 of the GPU check: the output layer + loss at the papers' shapes, every variant of the
registry (:mod:`benchmarks.variants`) at the shape's label smoothing, timed by the one harness
(:mod:`benchmarks.timing`), then a chunk-size sweep of the default path; the ratios are
:mod:`.output_ratios`'."""
import statistics

import torch

from benchmarks import external, ops, variants
from benchmarks.gpu_check.output_ratios import anchor_ratios, best_chunks, entry_key, output_ratios
from benchmarks.gpu_check.plan import Plan
from benchmarks.gpu_check.record import Budget, log
from benchmarks.timing import Harness
from tests.support.output_layer_problem import DTYPES, MIB, torch_linear_ce_missing
from tests.support.output_layer_steps import StepProblem

PACKAGE_VARIANTS = ("fused_ce", "agg", "al")  # on the default path and on the eager chunk body
FOREIGN_THROUGH_PACKAGE = ("fused_ce", "agg")  # what the foreign kernels compute (no teacher)
ANCHORS = ("torch_ref", "torch_auto", "floor", "al_floor", "liger", "cce")
SWEPT = ("agg", "al", "torch_chunk")


class ShapeProblem(StepProblem):
    """The output-layer problem at one of the plan's shapes (N, d, V, label smoothing, AGG alpha),
    with the augmented loss's defaults."""

    def __init__(self, shape, dtype, device):
        tokens, dim, vocab, eps, agg_alpha = shape
        al = ops.augmented_defaults()
        super().__init__(tokens, dim, vocab, eps=eps, aug_tau=al["tau"], aug_coef=al["coef"], dtype=dtype,
                         device=device, agg_alpha=agg_alpha)


def package_kernel_notes():
    """Per foreign kernel: what it is, or "skipped: why" where it does not load here."""
    notes = {}
    for kernel in ops.FOREIGN_KERNELS:
        problem = ops.foreign_kernel_problem(kernel)
        notes[kernel] = (f"skipped: {problem}" if problem else
                         f"{ops.foreign_kernel_description(kernel)} through fused_linear_loss (AGG's gates by algebra)")
    return notes


def measured_names(kernel_notes):
    """(name, kernel) of every variant of a run, in the report's order: stock, the package's default
    path, its eager path, the package on the foreign kernels that load here, then the anchors (Liger
    and CCE only where they import)."""
    names = [("stock", None)] + [(name, None) for name in PACKAGE_VARIANTS]
    names += [(name, "eager") for name in PACKAGE_VARIANTS]
    names += [(name, kernel) for kernel in ops.FOREIGN_KERNELS if not kernel_notes[kernel].startswith("skipped")
              for name in FOREIGN_THROUGH_PACKAGE]
    external_missing = {name for name, v in variants.VARIANTS.items()
                        if v.family == variants.EXTERNAL and v.unavailable() is not None}
    return names + [(name, None) for name in ANCHORS if name not in external_missing]


def _measurement(samples, peaks, key):
    if key in samples.failed:
        return samples.failed[key]
    ms = [round(t * 1e3, 3) for t in samples.wall[key]]
    return {"median_ms": round(statistics.median(ms), 3), "ms": ms, "peak_mib": peaks.get(key),
            "loss": float(samples.result[key]), "first_call_ms": round(samples.first[key] * 1e3, 1)}


def measure_keys(p, plan, wanted, chunk0):
    """{key: measurement} of ``wanted`` ({key: registry Key}): the harness's median ms, each round's
    ms, the CUDA peak MiB above the start (None on a CPU), the loss and the first call's ms; a
    variant that cannot run at the shape is recorded as skipped, one that fails as an error."""
    calls, out = {}, {}
    for text, k in wanted.items():
        reason = variants.unavailable(k)
        if k.variant.smoothing == variants.NONE and p.eps > 0:
            reason = f"{k.name} takes no label smoothing"
        if reason:
            out[text] = {"skipped": reason}
        else:
            calls[text] = (lambda k=k: variants.run(p, k, p.eps, chunk0))
    harness = Harness(p.device, before=lambda key: p.clear_grads(), record_errors=True)
    samples = harness.measure(calls, plan.warmup, plan.repeats)
    peaks = {}
    if p.device.type == "cuda":
        peaks = {key: round(harness.cuda_peak(fn, key) / MIB, 1) for key, fn in calls.items()
                 if key not in samples.failed}
    p.clear_grads()
    out.update({key: _measurement(samples, peaks, key) for key in calls})
    return {text: out[text] for text in wanted}


def _sweep(p, plan, budget, reserve_s, chunk0):
    """The sweep of the chunk sizes: AGG and AL on the default path, torch's chunked path."""
    sweep = {}
    for name in SWEPT:
        if name == "torch_chunk" and (p.eps > 0 or torch_linear_ce_missing()):
            continue  # torch's chunked path takes no smoothing
        for chunk in plan.chunk_sweep:
            if (chunk == chunk0 and name != "torch_chunk") or budget.left() < 15 + reserve_s:
                continue
            k = entry_key(p.eps, name, chunk=chunk)
            sweep.update(measure_keys(p, plan, {str(k): k}, chunk0))
    return sweep


def measure_run(plan, run_name, shape, dtype_name, device, names, budget, reserve_s, chunk0):
    """One run (a shape in a dtype): every variant, the sweep, the ratios."""
    p = ShapeProblem(shape, DTYPES[dtype_name], device)
    stats = p.target_stats()
    entry = {"N": p.tokens, "d": p.dim, "V": p.vocab, "eps": p.eps, "agg_alpha": p.agg_alpha,
             "rare_target_fraction": round(stats["rare_target_frac"], 4), "unique_targets": stats["unique_targets"]}
    wanted = {str(k): k for k in (entry_key(p.eps, name, kernel) for name, kernel in names)}
    entry["variants"] = measure_keys(p, plan, wanted, chunk0)
    for key, m in entry["variants"].items():
        log(f"[gpu_check] {run_name} {key}: {m}")
    entry["auto_path"] = ops.describe_path("auto", device)  # after the runs: a fallback would show here
    entry["sweep"] = _sweep(p, plan, budget, reserve_s, chunk0)
    entry["ratios"] = {**output_ratios(entry), **anchor_ratios(entry)}
    entry["best_chunk"] = best_chunks(entry, chunk0)
    return entry


def part_output_layer(plan: Plan, device: torch.device, budget: Budget, reserve_s: float = 0.0):
    """The output-layer runs, bf16 first; a run is not started with less than ``reserve_s`` + 20 s
    left (the time kept for the training part)."""
    chunk0 = ops.default_chunk()
    kernel_notes = package_kernel_notes()
    names = measured_names(kernel_notes)
    torch_missing = torch_linear_ce_missing()
    result = {"default_chunk": chunk0, "liger": external.note("liger"), "cce": external.note("cce"),
              "torch": torch_missing or f"torch {torch.__version__} F.linear_cross_entropy, reduction sum; label "
              "smoothing converted to PyTorch's convention, eps' = eps V / (V - 1) (the same distribution)",
              "auto_path": ops.describe_path("auto", device),
              "package_kernels": {"auto": "the default path (variants fused_ce, agg, al)",
                                  "eager": "the eager chunk body, the path before issue #33 (variants *:eager)",
                                  **kernel_notes},
              "memory": "torch.cuda.max_memory_allocated above the step's start" if device.type == "cuda"
              else "not measured on a CPU",
              "timing": ("CUDA events" if device.type == "cuda" else "perf_counter") + f", median of {plan.repeats} "
              f"interleaved rounds after one untimed first call (compilation included where it is the first of its "
              f"kind) and {plan.warmup} warm-up",
              "runs": {}}
    skipped = []
    for dtype_name in plan.bench_dtypes:  # bf16 first: issue #33's targets are there
        for shape_name, shape in plan.shapes.items():
            key = f"{shape_name} {dtype_name}"
            if budget.left() < 20 + reserve_s:
                skipped.append(key)
                continue
            result["runs"][key] = measure_run(plan, key, shape, dtype_name, device, names, budget, reserve_s, chunk0)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if skipped:
        result["skipped"] = skipped
        result["status"] = "partial"
    return result
