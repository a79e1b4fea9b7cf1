"""The output-layer benchmark's printed report (what was measured, one row per key, the ratios) and
its raw measurements as JSON."""
import json
import platform

import torch

from benchmarks import ops
from benchmarks.criterion.ratios import Measured, ratio_lines
from fairseq_agg.files import atomic_output
from tests.support.output_layer_problem import MIB, torch_auto_chunk, torch_label_smoothing


def setup_lines(args, p, memory_method):
    """What was measured: shapes, targets, method settings, how time and memory were taken."""
    n, v, s = args.tokens, args.vocab, p.stats
    return [
        f"shapes: N={n} target tokens, d={args.dim}, V={v}, dtype={args.dtype}, device={args.device}, "
        f"threads={torch.get_num_threads()}, torch {torch.__version__}, chunk size {args.chunk_size}",
        f"targets: Zipf s={args.zipf}; AGG alpha={args.agg_alpha}, window {args.window_updates} updates x "
        f"{args.tokens_per_update} tokens -> {s['rare_types']} rare types ({100 * s['rare_type_frac']:.1f}% of V), "
        f"{100 * s['rare_target_frac']:.1f}% of targets rare, {100 * s['very_rare_target_frac']:.1f}% with g2<1; "
        f"{s['unique_targets']} unique targets (teacher {s['unique_targets'] * v * 4 / MIB:.0f} MiB fp32)",
        f"keys name[+ls][:kernel][@chunk] (benchmarks/variants.py): +ls at label smoothing {args.label_smoothing}, "
        f"the others at 0; AL alpha={args.aug_alpha}, tau={args.aug_temperature}, scale {args.aug_scale} "
        f"(coef {p.aug_coef:g})",
        kernel_setup_line(args, p),
        torch_setup_line(args, p),
        f"time: median of {args.repeats} interleaved rounds after one untimed first call per variant (it compiles "
        f"the chunk body of the compiled ones: column '1st ms') and {args.warmup} warm-up rounds, wall clock "
        f"(PASS/MISS) and process CPU time of all threads (robust to other load on the machine)",
        f"peak memory: {memory_method}",
        f"one N x V fp32 tensor = {n * v * 4 / MIB:.0f} MiB",
    ]


def kernel_setup_line(args, p):
    """Which chunk bodies were measured, and what the default (``auto``) runs here."""
    dropped = f"; left out: {args.kernels_dropped}" if args.kernels_dropped else ""
    return (f"kernels of the package variants: {', '.join(args.kernel_list)} (no :kernel in a key: auto){dropped}; "
            f"the default kernel 'auto' runs the {ops.describe_path('auto', p.device)}")


def torch_setup_line(args, p):
    """How PyTorch's op was called: the smoothing in its convention, its automatic chunk size."""
    auto = torch_auto_chunk(p)
    auto = f"{auto[0]} rows, acc_policy {auto[1]}" if auto else "not readable"
    return (f"torch F.linear_cross_entropy: reduction sum; torch_ref+ls at eps' = eps V/(V-1) = "
            f"{torch_label_smoothing(args.label_smoothing, args.vocab):.6g} (PyTorch spreads eps'/V over every class, "
            f"fairseq eps/(V-1) over the non-targets: the same distribution); its chunked path takes no smoothing, "
            f"so torch_ref+ls is torch's best at eps > 0, and agg+ls:torch runs its reference path; auto chunk: {auto}")


def variant_lines(keys, m, eps):
    """One row per key: median and best wall time, median CPU time, peak memory, and the untimed
    first call (compilation included for a compiled variant)."""
    head = (f"{'key':<24s} {'variant':<58s} {'wall ms':>9s} {'min ms':>9s} {'cpu ms':>9s} {'peak MiB':>9s} "
            f"{'1st ms':>9s}")
    lines = [head, "-" * len(head)]
    s = m.samples
    for k in keys:
        key = str(k)
        peak = f"{m.peaks[key] / MIB:9.0f}" if key in m.peaks else f"{'-':>9s}"
        first = f"{s.first[key] * 1e3:9.1f}" if key in s.first else f"{'-':>9s}"
        lines.append(f"{key:<24s} {k.label(eps):<58s} {s.median(key) * 1e3:9.1f} {s.best(key) * 1e3:9.1f} "
                     f"{s.median_cpu(key) * 1e3:9.1f} {peak} {first}")
    return lines


def report(args, p, keys, samples, peaks, memory_method, checks):
    """The printed report."""
    m = Measured(samples, peaks)
    lines = setup_lines(args, p, memory_method) + [""] + variant_lines(keys, m, args.label_smoothing) + [""]
    lines += ratio_lines(args, keys, m, ops.describe_path("auto", p.device))
    if checks:
        lines += ["", "equivalence checks, max-abs relative (fp32: ~1e-6 expected, bf16/fp16: ~1e-2; agg vs stock dW "
                      "is gated, not compared):"]
        lines += ["  " + c for c in checks]
    return "\n".join(lines)


def write_raw(path, args, p, keys, samples, peaks, memory_method, checks):
    """The raw measurements as JSON, written atomically."""
    texts = [str(k) for k in keys]
    data = {"args": vars(args), "stats": p.stats, "kernels": args.kernel_list,
            "auto_path": ops.describe_path("auto", p.device),
            "variants": {str(k): {"name": k.name, "smoothed": k.smoothed, "kernel": k.kernel, "chunk": k.chunk,
                                  "label": k.label(args.label_smoothing)} for k in keys},
            "first_call_s": samples.first, "times_s": samples.wall, "cpu_s": samples.cpu,
            "median_s": {k: samples.median(k) for k in texts}, "peak_bytes": peaks,
            "memory_method": memory_method, "checks": checks, "platform": platform.platform(),
            "torch": torch.__version__, "threads": torch.get_num_threads()}
    with atomic_output(path, "w", flag="--json") as f:
        json.dump(data, f, indent=2, default=str)
