"""The output-layer benchmark's command line (``python -m scripts.bench_criterion``)."""
import argparse
import json
import sys

import torch

import benchmarks.criterion
from benchmarks import memory, ops
from benchmarks.criterion.checks import profile_variant, sanity_check
from benchmarks.criterion.report import report, write_raw
from benchmarks.criterion.selection import (DEFAULT_VARIANTS, Problem, check_device, parse_kernels, primary_key,
                                            variant_keys)
from benchmarks.flags import refuse
from benchmarks.timing import Harness
from benchmarks.variants import VARIANTS, parse_key
from tests.support.output_layer_problem import DTYPES, MIB

COMMAND = "scripts.bench_criterion"


def _shape_flags(ap):
    ap.add_argument("--tokens", type=int, default=4096, help="N, target tokens in the batch (default 4096)")
    ap.add_argument("--dim", type=int, default=512, help="d, decoder output width (default 512)")
    ap.add_argument("--vocab", type=int, default=32768, help="V, vocabulary size (default 32768)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--quick", action="store_true", help="small shapes (N=1024, d=256, V=8192), 1+3 rounds")
    ap.add_argument("--chunk-size", type=int, default=2048, help="chunk of the fused function (criterion default 2048)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of the target distribution")
    ap.add_argument("--agg-alpha", type=float, default=0.08, help="AGG rarity threshold (MT recipe 0.08)")
    ap.add_argument("--label-smoothing", type=float, default=0.1, help="eps of the +ls keys")
    ap.add_argument("--window-updates", type=int, default=200, help="updates in the AGG count window")
    ap.add_argument("--tokens-per-update", type=int, default=None, help="tokens per update in the window (default N)")
    ap.add_argument("--aug-alpha", type=float, default=0.5)
    ap.add_argument("--aug-temperature", type=float, default=10.0)
    ap.add_argument("--aug-scale", choices=["none", "tau", "tau2"], default="tau", help="criterion default: tau")
    ap.add_argument("--ul-seq-len", type=int, default=512, help="sequence length of the ul variant")


def build_parser():
    ap = argparse.ArgumentParser(prog="python -m scripts.bench_criterion", description=benchmarks.criterion.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    _shape_flags(ap)
    ap.add_argument("--warmup", type=int, default=2,
                    help="warm-up rounds (every variant once per round), after one untimed first call of every "
                    "variant (which compiles the compiled ones)")
    ap.add_argument("--repeats", type=int, default=7, help="timed rounds (every variant once per round)")
    ap.add_argument("--chunk-sizes", default=None, help="comma-separated sweep of chunk sizes of the fused variants")
    ap.add_argument("--torch-chunk-sizes", default="256,1024,4096",
                    help="batch_chunk_size sweep of torch_chunk, capped at N (default 256,1024,4096)")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                    help=f"comma-separated keys name[+ls][:kernel] of {','.join(VARIANTS)} (default: "
                    f"{','.join(DEFAULT_VARIANTS)})")
    ap.add_argument("--kernels", default="auto,eager",
                    help=f"comma-separated kernels of the chunk body ({','.join(ops.PACKAGE_KERNELS)}) on which each "
                    "package variant without a :kernel is measured, the first one the reference of the other "
                    "comparisons (default auto,eager)")
    ap.add_argument("--memory", choices=["auto", "profiler", "rss", "none"], default="auto",
                    help="peak-memory method (auto: cuda allocator stats on CUDA, profiler on CPU)")
    ap.add_argument("--no-check", action="store_true", help="skip the loss/gradient equivalence check")
    ap.add_argument("--profile", default=None,
                    help="comma-separated keys to profile with torch.profiler (agg+ls, agg+ls:eager; a package "
                    "variant without :kernel on the first of --kernels)")
    ap.add_argument("--profile-rows", type=int, default=20)
    ap.add_argument("--json", default=None, help="also write the raw measurements to this file")
    ap.add_argument("--quiet", action="store_true", help="no per-round progress lines")
    ap.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)
    return ap


def parse_args(argv):
    args = build_parser().parse_args(argv)
    if args.quick:
        args.tokens, args.dim, args.vocab = 1024, 256, 8192
        args.warmup, args.repeats = min(args.warmup, 1), min(args.repeats, 3)
    for flag, value, low in (("--tokens", args.tokens, 1), ("--dim", args.dim, 1), ("--vocab", args.vocab, 6),
                             ("--chunk-size", args.chunk_size, 1), ("--repeats", args.repeats, 1),
                             ("--warmup", args.warmup, 0)):
        if value < low:
            refuse(f"{flag} must be >= {low}, got {value}")
    if args.tokens_per_update is None:
        args.tokens_per_update = args.tokens
    check_device(args)
    args.kernel_list, args.kernels_dropped = parse_kernels(args.kernels, torch.device(args.device))
    return args


CHILD_FLAGS = ("tokens", "dim", "vocab", "dtype", "device", "seed", "zipf", "agg_alpha", "label_smoothing",
               "aug_alpha", "aug_temperature", "aug_scale", "window_updates", "tokens_per_update", "chunk_size",
               "ul_seq_len", "kernels")


def measure_peaks(args, p, keys, method, log):
    """Peak memory of one step per key, by ``method`` (cuda, profiler, rss or none)."""
    peaks = {}
    if method == "none":
        return peaks
    log(f"peak memory ({method}):")
    child_argv = [x for name in CHILD_FLAGS for x in ("--" + name.replace("_", "-"), str(getattr(args, name)))]
    harness = Harness(p.device, before=lambda key: p.clear_grads())
    for k in keys:
        key = str(k)
        if method == "cuda":
            peaks[key] = harness.cuda_peak(lambda: p.run(k), key)
        elif method == "profiler":
            peaks[key] = memory.profiler_peak(lambda: p.run(k), p.clear_grads)
        else:
            peaks[key] = memory.rss_peak(COMMAND, key, child_argv)
        log(f"  {key:<24s} {peaks[key] / MIB:8.0f} MiB")
    return peaks


def rss_child(args):
    """In a fresh process: the peak RSS of one step of --rss-child's key, printed as JSON."""
    p, k = Problem(args), parse_key(args.rss_child)
    print(json.dumps({"key": args.rss_child, "peak_bytes": memory.rss_of_one_step(lambda: p.run(k), p.clear_grads)}))


def main(argv=None):
    args = parse_args(argv)
    if args.rss_child:
        return rss_child(args)
    log = (lambda *_: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    keys = variant_keys(args)
    p = Problem(args)
    method = args.memory if args.memory != "auto" else "cuda" if p.device.type == "cuda" else "profiler"
    log(f"setup: N={args.tokens} d={args.dim} V={args.vocab} {args.dtype} {args.device}, kernels {args.kernel_list}, "
        f"keys {', '.join(map(str, keys))}")
    harness = Harness(p.device, before=lambda key: p.clear_grads(), log=log)
    calls = {str(k): (lambda k=k: p.run(k)) for k in keys}
    log("first calls (untimed; they compile the compiled variants' chunk bodies):")
    samples = harness.first_calls(calls)
    checks = [] if args.no_check else sanity_check(p, keys, log, args.kernel_list[0])
    log("timing:")
    harness.rounds(calls, args.warmup, args.repeats, samples)
    p.clear_grads()
    peaks = measure_peaks(args, p, keys, method, log)
    print(report(args, p, keys, samples, peaks, memory.METHODS[method], checks))
    for text in (args.profile.split(",") if args.profile else ()):
        k = _profile_key(args, text)
        profile_variant(p, k, args.profile_rows)
    if args.json:
        write_raw(args.json, args, p, keys, samples, peaks, memory.METHODS[method], checks)


def _profile_key(args, text):
    try:
        k = parse_key(text)
    except ValueError as error:
        refuse(f"--profile: {error}")
    return primary_key(args, k.name, k.smoothed, k.kernel)
