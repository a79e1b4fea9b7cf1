#!/usr/bin/env python
"""Benchmark of the output layer + loss: fairseq's stock criteria, PyTorch's own fused op and a
three-matmul floor vs this package's fused function.

Times forward+backward through the output projection and the loss (median of interleaved repeats
after warm-up) and measures the step's peak memory for

  (a) stock   fairseq ``label_smoothed_cross_entropy`` on full logits (eps = 0.1):
              ``lprobs = log_softmax(H @ W.T, float32)`` + fairseq's ``label_smoothed_nll_loss``
  (b) agg     AGG through ``fused_linear_loss`` with realistic gates (Zipfian targets and window
              counts; histogram + ``agg_gates`` inside the timed region), eps = 0.1
  (c) ref     the reference three-CE AGG construction (``reference_output_loss``), eps = 0.1
  (d) al      augmented loss through ``fused_linear_loss`` (alpha = 0.5, tau = 10, scale tau;
              per-type teacher built by ``build_teacher`` inside the timed region), eps = 0
  (e) ce      stock fairseq ``cross_entropy`` (eps = 0) on full logits: the baseline of (d)
  (f) al_ref  direct AL on a materialised N x V teacher (``reference_teacher`` + KL by definition)
  (g) fce     plain CE (eps = 0) through ``fused_linear_loss``: what (d) costs over the fused CE alone
  (h) freeze  rare-token freezing: fused CE with AGG's rare rows of dW zeroed (``frozen_rows``; the
              histogram + ``agg_gates`` inside the timed region), eps = 0
  (i) cosreg  fused CE + N * CosReg(W) (gamma = 1, ``cosine_regularizer`` over the non-pad rows)
  (j) face    FACE pre-weighting of argmax counts: weights from the window counts, the argmax
              recorded in the pass and counted (bincount) inside the timed region, eps = 0
  (k) ul      token-level unlikelihood (alpha = 1): the N tokens as sequences of ``--ul-seq-len``,
              candidates (``unlikelihood_candidates``) built inside the timed region, eps = 0
  (l) fce_ls  label-smoothed CE (eps = 0.1) through ``fused_linear_loss``: (g) at (a)'s smoothing
  (m) torch_ref     PyTorch's ``F.linear_cross_entropy`` (reduction sum), its reference path
                    (``options=None``: the logits materialised), eps = 0
  (n) torch_auto    the same, chunked, the chunk size torch picks (``LinearCrossEntropyOptions()``)
  (o) torch_chunk   the same, chunked, ``batch_chunk_size`` from ``--torch-chunk-sizes``
  (p) torch_ref_ls  (m) at (a)'s smoothing in PyTorch's convention, eps' = eps V / (V - 1) (the
                    same target distribution: fairseq puts eps / (V - 1) on each non-target,
                    PyTorch eps' / V on every class); torch's chunked path takes no smoothing
                    (it falls back to the reference path), so (p) is torch's best at eps > 0
  (q) floor   the three matmuls alone (logits, dH, dW), chunked like the fused function

and prints the ratios against the project's goals (docs/benchmarks.md: AGG <= 1.05x stock time and
<= 1.0x stock peak memory; AL <= 1.15x CE time and no extra N x V tensor) and issue #25's: the
fused CE (g) and AGG (b) <= 1.10x the floor (q); AL (d) <= 1.15x the fused CE (g); each of (h)-(k)
<= 1.05x (g) and no extra N x V tensor; the fused variants' peak memory <= that of torch's chunked
path (n). Each fused variant is also set against torch's fastest variant at its smoothing. Ratios
mean something only on an otherwise idle machine.

Peak memory: on CUDA, ``torch.cuda.max_memory_allocated`` above the step's start. On CPU, the
default (``--memory profiler``) replays the allocation trace of ``torch.profiler`` (profile_memory=
True: every allocation/free of torch's CPU allocator, with its size and time) and takes the maximum
of the running sum of live bytes above the step's start; ``--memory rss`` instead runs each variant
in a fresh subprocess (glibc malloc forced to mmap every block >= 64 KiB, so freed tensors leave the
RSS) and reads the peak RSS (VmHWM, reset through /proc/self/clear_refs) above the RSS at the step's
start. Both count the gradients H.grad and W.grad that the step leaves behind.

Examples:
  OMP_NUM_THREADS=2 python scripts/bench_criterion.py                 # N=4096, d=512, V=32768, fp32 CPU
  python scripts/bench_criterion.py --quick                           # small shapes, a smoke test
  python scripts/bench_criterion.py --chunk-sizes 512,1024,2048,4096  # chunk-size sweep of the fused variants
  python scripts/bench_criterion.py --variants fce,fce_ls,agg,al,torch_ref,torch_auto,torch_chunk,torch_ref_ls,floor
  python scripts/bench_criterion.py --device cuda --dtype bf16        # with a GPU
  python scripts/bench_criterion.py --profile agg                     # where the time goes
"""
import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from fairseq import utils as fairseq_utils

from fairseq_agg.ops.augmented import aug_scale_factor, build_teacher
from fairseq_agg.ops.cosreg import cosine_regularizer
from fairseq_agg.ops.face import FaceWeights, face_token_weights
from fairseq_agg.ops.unlikelihood import unlikelihood_candidates
from fairseq_agg.ops.fused_linear_loss import LossRequest, fused_linear_loss
from fairseq_agg.ops.agg_gates import frozen_rare_rows
from fairseq_agg.ops.counting import target_histogram

from output_problem import (DTYPES, MIB, PAD, OutputProblem, cuda_peak_bytes, matmul_floor, rel_diff, stock_loss,
                            synchronize, torch_auto_chunk, torch_label_smoothing, torch_linear_ce,
                            torch_linear_ce_missing, wall_seconds)
from reference_constructions import kl_to_teacher, reference_output_loss, reference_teacher

LABELS = {
    "stock": "(a) stock label_smoothed_cross_entropy, full logits",
    "agg": "(b) AGG, fused_linear_loss + gates",
    "ref": "(c) AGG reference, three CE terms",
    "al": "(d) AL, fused_linear_loss + build_teacher",
    "ce": "(e) stock cross_entropy, full logits",
    "al_ref": "(f) AL direct, materialised teacher",
    "fce": "(g) CE, fused_linear_loss (no AL)",
    "freeze": "(h) freezing, fused + frozen_rows",
    "cosreg": "(i) CosReg, fused + cosine_regularizer",
    "face": "(j) FACE pre/out, fused + row weights",
    "ul": "(k) token-level UL, fused + candidates",
    "fce_ls": "(l) label-smoothed CE, fused_linear_loss",
    "torch_ref": "(m) torch linear_cross_entropy, reference",
    "torch_auto": "(n) torch linear_cross_entropy, chunked auto",
    "torch_chunk": "(o) torch linear_cross_entropy, chunked",
    "torch_ref_ls": "(p) torch linear_cross_entropy eps>0, reference",
    "floor": "(q) floor: the 3 matmuls alone",
}
ALL_VARIANTS = list(LABELS)
TORCH_VARIANTS = ("torch_ref", "torch_auto", "torch_chunk", "torch_ref_ls")


# --------------------------------------------------------------------------- problem setup
class Problem(OutputProblem):
    """The inputs of every variant (scripts/output_problem.py) at the command line's settings."""

    def __init__(self, args):
        super().__init__(args.tokens, args.dim, args.vocab, dtype=DTYPES[args.dtype], device=args.device,
                         seed=args.seed, zipf=args.zipf, window_updates=args.window_updates,
                         tokens_per_update=args.tokens_per_update, agg_alpha=args.agg_alpha)
        self.args = args
        self.coef = args.aug_alpha * aug_scale_factor(args.aug_scale, args.aug_temperature)
        self.cosreg_rows = torch.cat([torch.arange(PAD), torch.arange(PAD + 1, args.vocab)]).to(self.device)
        self.stats = self.target_stats()


# --------------------------------------------------------------------------- the variants
def run_stock(p, chunk):
    return stock_loss(p, label_smoothing=p.args.label_smoothing)


def run_ce(p, chunk):
    return stock_loss(p)


def run_agg(p, chunk):
    gates = p.gates()
    loss = fused_linear_loss(p.hidden, p.weight, p.target, LossRequest(p.args.label_smoothing, gates=gates, chunk_size=chunk)).loss
    loss.backward()
    return loss.detach()


def run_ref(p, chunk):
    gates = p.gates()
    loss, _nll, _ = reference_output_loss(p.hidden, p.weight, p.target, p.args.label_smoothing, gates=gates)
    loss.backward()
    return loss.detach()


def run_al(p, chunk):
    teacher = build_teacher(p.weight.detach(), p.target, p.args.aug_temperature, p.coef, masked_columns=[PAD])
    loss = fused_linear_loss(p.hidden, p.weight, p.target, LossRequest(teacher=teacher, chunk_size=chunk)).loss
    loss.backward()
    return loss.detach()


def run_fce(p, chunk):
    loss = fused_linear_loss(p.hidden, p.weight, p.target, LossRequest(chunk_size=chunk)).loss
    loss.backward()
    return loss.detach()


def run_al_ref(p, chunk):
    teacher = reference_teacher(p.weight.detach(), p.target, p.args.aug_temperature, masked_columns=[PAD])
    logits = F.linear(p.hidden, p.weight)
    lprobs = fairseq_utils.log_softmax(logits, dim=-1)
    loss = F.nll_loss(lprobs, p.target, ignore_index=PAD, reduction="sum")
    loss = loss + p.coef * kl_to_teacher(logits, teacher, p.args.aug_temperature)
    loss.backward()
    return loss.detach()


def run_freeze(p, chunk):
    frozen = frozen_rare_rows(p.args.vocab, gates=p.gates())
    loss = fused_linear_loss(p.hidden, p.weight, p.target, LossRequest(frozen_rows=frozen, chunk_size=chunk)).loss
    loss.backward()
    return loss.detach()


def run_cosreg(p, chunk):
    loss = fused_linear_loss(p.hidden, p.weight, p.target, LossRequest(chunk_size=chunk)).loss
    regulariser, _ = cosine_regularizer(p.weight, p.cosreg_rows)
    loss = loss + p.target.numel() * regulariser  # gamma = 1, sample_size = N
    loss.backward()
    return loss.detach()


def run_face(p, chunk):
    face = FaceWeights(token_weight=face_token_weights(p.window_counts.to(p.device)))
    request = LossRequest(row_weights=face, chunk_size=chunk, record_argmax=True)
    result = fused_linear_loss(p.hidden, p.weight, p.target, request)
    target_histogram(result.argmax, p.args.vocab)  # the counts of the next micro-batch
    result.loss.backward()
    return result.loss.detach()


def run_fce_ls(p, chunk):
    loss = fused_linear_loss(p.hidden, p.weight, p.target, LossRequest(p.args.label_smoothing, chunk_size=chunk)).loss
    loss.backward()
    return loss.detach()


def run_torch_ref(p, chunk):
    return torch_linear_ce(p)


def run_torch_auto(p, chunk):
    return torch_linear_ce(p, chunking="auto")


def run_torch_chunk(p, chunk):
    return torch_linear_ce(p, chunking=chunk)


def run_torch_ref_ls(p, chunk):
    return torch_linear_ce(p, label_smoothing=p.args.label_smoothing)


def run_floor(p, chunk):
    return matmul_floor(p, chunk)


def run_ul(p, chunk):
    n = p.target.numel()
    width = p.args.ul_seq_len
    sequences = p.target.new_full((-(-n // width) * width,), PAD)
    sequences[:n] = p.target
    candidates = unlikelihood_candidates(sequences.view(-1, width), torch.arange(n, device=p.device), PAD, 1.0)
    loss = fused_linear_loss(p.hidden, p.weight, p.target, LossRequest(penalty=candidates, chunk_size=chunk)).loss
    loss.backward()
    return loss.detach()


RUNNERS = {"stock": run_stock, "agg": run_agg, "ref": run_ref, "al": run_al, "ce": run_ce, "al_ref": run_al_ref, "fce": run_fce,
           "freeze": run_freeze, "cosreg": run_cosreg, "face": run_face, "ul": run_ul, "fce_ls": run_fce_ls,
           "torch_ref": run_torch_ref, "torch_auto": run_torch_auto, "torch_chunk": run_torch_chunk,
           "torch_ref_ls": run_torch_ref_ls, "floor": run_floor}
BASELINES = ("freeze", "cosreg", "face", "ul")  # the remedies of docs/baselines.md
PACKAGE_FUSED = ("agg", "al", "fce", "fce_ls") + BASELINES
FUSED = PACKAGE_FUSED + ("floor",)  # swept over --chunk-sizes
SMOOTHED = ("agg", "fce_ls")  # the fused variants at --label-smoothing; the others at eps 0


def key_of(name, chunk):
    return f"{name}@{chunk}" if name in FUSED or name == "torch_chunk" else name


def parse_key(key):
    name, _, chunk = key.partition("@")
    return name, (int(chunk) if chunk else None)


# --------------------------------------------------------------------------- measurement
def run_once(p, key):
    name, chunk = parse_key(key)
    p.clear_grads()
    return RUNNERS[name](p, chunk or p.args.chunk_size)


def time_once(p, key):
    """Wall-clock and process CPU seconds of one step."""
    p.clear_grads()
    gc.collect()
    cpu_started = time.process_time()
    wall = wall_seconds(lambda: run_once(p, key), p.device)
    return wall, time.process_time() - cpu_started


def measure_times(p, keys, warmup, repeats, log):
    """Wall-clock and process CPU seconds (all threads) of every step, per variant."""
    for w in range(warmup):
        for key in keys:
            t, c = time_once(p, key)
            log(f"  warm-up {w + 1}/{warmup} {key:<10s} {t * 1e3:9.1f} ms wall {c * 1e3:9.1f} ms cpu")
    times = {k: [] for k in keys}
    cpu = {k: [] for k in keys}
    for r in range(repeats):
        order = keys[r % len(keys):] + keys[: r % len(keys)]  # rotate the order every round
        for key in order:
            t, c = time_once(p, key)
            times[key].append(t)
            cpu[key].append(c)
        log(f"  round {r + 1}/{repeats} wall/cpu ms: " + "  ".join(
            f"{k}={times[k][-1] * 1e3:.0f}/{cpu[k][-1] * 1e3:.0f}" for k in keys))
    p.clear_grads()
    return times, cpu


def peak_profiler(p, key):
    """Peak live bytes of torch's CPU allocator during one step, above the step's start."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    p.clear_grads()
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run_once(p, key)
    records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    records.sort(key=lambda e: e.start_ns())
    host = (DeviceType.CPU, DeviceType.MKLDNN, DeviceType.IDEEP)
    live = peak = 0
    for e in records:
        if e.device_type() in host:
            live += e.nbytes()
            peak = max(peak, live)
    p.clear_grads()
    return peak


def peak_cuda(p, key):
    p.clear_grads()
    gc.collect()
    peak = cuda_peak_bytes(lambda: run_once(p, key))
    p.clear_grads()
    return peak


def _proc_status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def rss_child(args):
    """Runs in a fresh process: one warm-up step, then the peak RSS increase of one more step."""
    p = Problem(args)
    key = args.rss_child
    run_once(p, key)  # warm-up: thread pools, kernel caches, lazy initialisation
    p.clear_grads()
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    base = _proc_status_kib("VmRSS")
    run_once(p, key)
    peak = _proc_status_kib("VmHWM")
    print(json.dumps({"key": key, "peak_bytes": (peak - base) * 1024}))


def peak_rss(args, key):
    cmd = [sys.executable, os.path.abspath(__file__), "--rss-child", key] + child_argv(args)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="65536")
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_bytes"]


def child_argv(args):
    argv = []
    for name in ("tokens", "dim", "vocab", "dtype", "device", "seed", "zipf", "agg_alpha", "label_smoothing",
                 "aug_alpha", "aug_temperature", "aug_scale", "window_updates", "tokens_per_update", "chunk_size"):
        argv += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return argv


# --------------------------------------------------------------------------- checks and profiling
def sanity_check(p, keys, log):
    """The variants compute the same thing: compares the losses and the gradients pairwise."""
    out = {}
    for key in keys:
        loss = run_once(p, key)
        out[key] = (float(loss), p.hidden.grad.detach().float().clone(), p.weight.grad.detach().float().clone())
    p.clear_grads()

    pairs = []
    names = {parse_key(k)[0]: k for k in keys}
    if "agg" in names and "ref" in names:
        pairs.append((names["agg"], names["ref"], "loss, dH, dW"))
    if "agg" in names and "stock" in names:
        pairs.append((names["agg"], names["stock"], "loss, dH (dW differs: gated)"))
    if "al" in names and "al_ref" in names:
        pairs.append((names["al"], names["al_ref"], "loss, dH, dW"))
    if "fce" in names and "ce" in names:
        pairs.append((names["fce"], names["ce"], "loss, dH, dW"))
    if "freeze" in names and "fce" in names:
        pairs.append((names["freeze"], names["fce"], "loss, dH (dW differs: rare rows zero)"))
    for torch_name in ("torch_ref", "torch_auto", "torch_chunk"):
        if torch_name in names and "fce" in names:
            pairs.append((names["fce"], names[torch_name], "loss, dH, dW"))
    if "fce_ls" in names and "torch_ref_ls" in names:
        pairs.append((names["fce_ls"], names["torch_ref_ls"], "loss, dH, dW"))
    if "fce_ls" in names and "stock" in names:
        pairs.append((names["fce_ls"], names["stock"], "loss, dH, dW"))
    lines = []
    for a, b, what in pairs:
        la, ha, wa = out[a]
        lb, hb, wb = out[b]
        msg = f"{a} vs {b}: loss rel {abs(la - lb) / abs(lb):.1e}, dH rel {rel_diff(ha, hb):.1e}"
        if "dW," in what or what.endswith("dW"):
            msg += f", dW rel {rel_diff(wa, wb):.1e}"
        lines.append(msg)
    for line in lines:
        log("  " + line)
    return lines


def profile_variant(p, key, rows):
    from torch.profiler import ProfilerActivity, profile

    run_once(p, key)  # warm
    p.clear_grads()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if p.device.type == "cuda" else [])
    with profile(activities=acts, record_shapes=True) as prof:
        run_once(p, key)
        synchronize(p.device)
    p.clear_grads()
    sort = "self_cuda_time_total" if p.device.type == "cuda" else "self_cpu_time_total"
    print(f"\n=== torch.profiler: {key} (sorted by {sort}) ===")
    print(prof.key_averages(group_by_input_shape=True).table(sort_by=sort, row_limit=rows, max_name_column_width=40))


# --------------------------------------------------------------------------- report
# The goals of the fused function (docs/benchmarks.md): AGG at most 5 % slower than fairseq's stock
# label-smoothed CE and with no more peak memory; the augmented loss at most 15 % slower than stock
# CE and without an extra N x V tensor.
AGG_TIME_TARGET = 1.05
AGG_MEMORY_TARGET = 1.0
AL_TIME_TARGET = 1.15
# Issue #25's targets, against the work any linear cross-entropy does and against PyTorch's own op:
# the fused CE and AGG within 10 % of the three-matmul floor, AL within 15 % of the fused CE, each
# remedy of docs/baselines.md within 5 % of it, and no fused variant above the peak memory of
# torch's chunked path.
FLOOR_TIME_TARGET = 1.10
AL_OWN_TIME_TARGET = 1.15
BASELINE_TIME_TARGET = 1.05
TORCH_MEMORY_TARGET = 1.0


def fmt_ratio(x):
    return f"{x:.3f}x"


def verdict(ok):
    return "PASS" if ok else "MISS"


class Measurements:
    """The timings and peaks of one run, with the medians and ratios the report prints."""

    def __init__(self, times, cpu, peaks):
        self.times, self.cpu, self.peaks = times, cpu, peaks
        self.med = {k: statistics.median(ts) for k, ts in times.items()}
        self.med_cpu = {k: statistics.median(ts) for k, ts in cpu.items()}

    def paired(self, a, b):
        """Median over rounds of the per-round ratio (same round = same machine load)."""
        return statistics.median(x / y for x, y in zip(self.times[a], self.times[b]))

    def memory_ratio(self, a, b):
        if a in self.peaks and b in self.peaks and self.peaks[b] > 0:
            return self.peaks[a] / self.peaks[b]
        return None


def setup_lines(args, p, mem_method):
    """What was measured: shapes, targets, method settings, how time and memory were taken."""
    n, v, s = args.tokens, args.vocab, p.stats
    return [
        f"shapes: N={n} target tokens, d={args.dim}, V={v}, dtype={args.dtype}, device={args.device}, "
        f"threads={torch.get_num_threads()}, torch {torch.__version__}, chunk size {args.chunk_size}",
        f"targets: Zipf s={args.zipf}; AGG alpha={args.agg_alpha}, window {args.window_updates} updates x "
        f"{args.tokens_per_update} tokens -> {s['rare_types']} rare types ({100 * s['rare_type_frac']:.1f}% of V), "
        f"{100 * s['rare_target_frac']:.1f}% of targets rare, {100 * s['very_rare_target_frac']:.1f}% with g2<1; "
        f"{s['unique_targets']} unique targets (teacher {s['unique_targets'] * v * 4 / MIB:.0f} MiB fp32)",
        f"label smoothing {args.label_smoothing} for (a)-(c) and (l); AL alpha={args.aug_alpha}, "
        f"tau={args.aug_temperature}, scale {args.aug_scale} (coef {p.coef:g}); eps 0 for the others",
        torch_setup_line(args, p),
        f"time: median of {args.repeats} interleaved rounds after {args.warmup} warm-up rounds, wall clock "
        f"(PASS/MISS) and process CPU time of all threads (robust to other load on the machine)",
        f"peak memory: {mem_method}",
        f"one N x V fp32 tensor = {n * v * 4 / MIB:.0f} MiB",
    ]


def torch_setup_line(args, p):
    """How PyTorch's op was called: the smoothing in its convention, its automatic chunk size."""
    auto = torch_auto_chunk(p)
    auto = f"{auto[0]} rows, acc_policy {auto[1]}" if auto else "not readable"
    return (f"torch F.linear_cross_entropy (m)-(p): reduction sum; (p) at eps' = eps V/(V-1) = "
            f"{torch_label_smoothing(args.label_smoothing, args.vocab):.6g} (PyTorch spreads eps'/V over every class, "
            f"fairseq eps/(V-1) over the non-targets: the same distribution); its chunked path takes no smoothing, "
            f"so (p) is torch's best at eps > 0; auto chunk: {auto}")


def variant_lines(keys, m):
    """One row per variant: median and best wall time, median CPU time, peak memory."""
    head = f"{'variant':<55s} {'wall ms':>9s} {'min ms':>9s} {'cpu ms':>9s} {'peak MiB':>9s}"
    lines = [head, "-" * len(head)]
    for key in keys:
        name, chunk = parse_key(key)
        label = LABELS[name] + (f" [chunk {chunk}]" if chunk else "")
        pk = f"{m.peaks[key] / MIB:9.0f}" if key in m.peaks else f"{'-':>9s}"
        lines.append(
            f"{label:<55s} {m.med[key] * 1e3:9.1f} {min(m.times[key]) * 1e3:9.1f} {m.med_cpu[key] * 1e3:9.1f} {pk}"
        )
    return lines


def ratio_line(m, label, a, b, target_t=None, target_m=None, mem_note=None, mem_base=None):
    """Variant a against variant b: wall, paired, CPU and memory ratios (memory against ``mem_base``
    when given), and PASS/MISS per target."""
    rt = m.med[a] / m.med[b]
    rm = m.memory_ratio(a, mem_base or b)
    res, tgt = [], []
    if target_t is not None:
        tgt.append(f"time <= {target_t:.2f}x")
        res.append(verdict(rt <= target_t))
    if target_m is not None and rm is not None:
        tgt.append(f"mem <= {target_m:.2f}x")
        res.append(verdict(rm <= target_m))
    if mem_note is not None:
        tgt.append(mem_note[0])
        res.append(verdict(mem_note[1]))
    rms = fmt_ratio(rm) if rm is not None else "-"
    return (
        f"{label:<54s} {fmt_ratio(rt):>8s} {fmt_ratio(m.paired(a, b)):>8s} {fmt_ratio(m.med_cpu[a] / m.med_cpu[b]):>8s} "
        f"{rms:>8s}   "
        f"{(', '.join(tgt) or 'info'):<44s} {' '.join(res)}"
    )


def al_memory_note(args, m, al):
    """The augmented loss's memory goal: its peak less stock CE's stays below one N x V tensor."""
    if al not in m.peaks or "ce" not in m.peaks:
        return None
    extra = m.peaks[al] - m.peaks["ce"]
    return f"AL-CE peak {extra / MIB:+.0f} MiB < 1 NxV", extra < args.tokens * args.vocab * 4


def extra_memory_note(args, m, variant, base):
    """A baseline's memory goal: its peak above the fused CE's stays below one N x V tensor."""
    if variant not in m.peaks or base not in m.peaks:
        return None
    extra = m.peaks[variant] - m.peaks[base]
    return f"peak {extra / MIB:+.0f} MiB over fused CE < 1 NxV", extra < args.tokens * args.vocab * 4


def torch_fastest(keys, m, smoothed):
    """The key of torch's fastest variant at eps > 0 (``smoothed``) or at eps 0, or None."""
    names = ("torch_ref_ls",) if smoothed else ("torch_ref", "torch_auto", "torch_chunk")
    measured = [k for k in keys if parse_key(k)[0] in names]
    return min(measured, key=m.med.get) if measured else None


def ratio_lines(args, keys, m):
    """The comparisons the measured variants allow, the goals first (per chunk size when swept)."""
    head = f"{'ratio':<54s} {'wall':>8s} {'paired':>8s} {'cpu':>8s} {'memory':>8s}   {'target':<44s} result"
    lines = [head, "-" * len(head)]
    have = set(keys)
    chunks = sorted({parse_key(k)[1] for k in keys if parse_key(k)[0] in FUSED})

    def tag(c):
        return f" [chunk {c}]" if len(chunks) > 1 else ""

    for c in chunks:
        if f"agg@{c}" in have and "stock" in have:
            lines.append(ratio_line(m, f"AGG / stock{tag(c)}", f"agg@{c}", "stock", AGG_TIME_TARGET, AGG_MEMORY_TARGET))
    if "ref" in have and "stock" in have:
        lines.append(ratio_line(m, "reference AGG / stock", "ref", "stock"))
    if "ref" in have and f"agg@{args.chunk_size}" in have:
        lines.append(ratio_line(m, "AGG / reference AGG", f"agg@{args.chunk_size}", "ref"))
    for c in chunks:
        if f"al@{c}" in have and "ce" in have:
            lines.append(ratio_line(m, f"AL / CE{tag(c)}", f"al@{c}", "ce", AL_TIME_TARGET, None,
                                    al_memory_note(args, m, f"al@{c}")))
    for c in chunks:
        if f"al@{c}" in have and f"fce@{c}" in have:
            lines.append(ratio_line(m, f"AL / fused CE (AL's own cost){tag(c)}", f"al@{c}", f"fce@{c}",
                                    AL_OWN_TIME_TARGET))
        if f"fce@{c}" in have and "ce" in have:
            lines.append(ratio_line(m, f"fused CE / stock CE{tag(c)}", f"fce@{c}", "ce"))
    for c in chunks:
        for name in BASELINES:
            if f"{name}@{c}" in have and f"fce@{c}" in have:
                lines.append(ratio_line(m, f"{name} / fused CE{tag(c)}", f"{name}@{c}", f"fce@{c}",
                                        BASELINE_TIME_TARGET, None, extra_memory_note(args, m, f"{name}@{c}", f"fce@{c}")))
    if "al_ref" in have and "ce" in have:
        lines.append(ratio_line(m, "direct AL (materialised) / CE", "al_ref", "ce"))
    if "ce" in have and "stock" in have:
        lines.append(ratio_line(m, "stock CE / stock label-smoothed CE", "ce", "stock"))
    return lines + anchor_lines(keys, m, chunks, tag)


def anchor_lines(keys, m, chunks, tag):
    """Issue #25's comparisons: the fused variants against the floor and against torch's fastest
    variant at the same smoothing (memory against torch's chunked path with its own chunk size)."""
    have = set(keys)
    lines = []
    for c in chunks:
        floor = f"floor@{c}"
        for name in PACKAGE_FUSED:
            if f"{name}@{c}" in have and floor in have:
                target = FLOOR_TIME_TARGET if name in ("fce", "agg") else None
                lines.append(ratio_line(m, f"{name} / floor{tag(c)}", f"{name}@{c}", floor, target))
    fastest = {False: torch_fastest(keys, m, False), True: torch_fastest(keys, m, True)}
    chunked = "torch_auto" if "torch_auto" in have else None
    for c in chunks:
        for name in PACKAGE_FUSED:
            best = fastest[name in SMOOTHED]
            if f"{name}@{c}" in have and best is not None:
                label = f"{name} / {best}" + (", mem / torch_auto" if chunked else "") + tag(c)
                lines.append(ratio_line(m, label, f"{name}@{c}", best, None, TORCH_MEMORY_TARGET if chunked else None,
                                        mem_base=chunked))
    for smoothed, best in fastest.items():
        floor = f"floor@{chunks[0]}" if chunks else None
        if best is not None and floor in have:
            lines.append(ratio_line(m, f"{best} / floor{tag(chunks[0])}", best, floor))
    return lines


def report(args, p, keys, times, cpu, peaks, mem_method, checks):
    """The printed report and the median times."""
    m = Measurements(times, cpu, peaks)
    lines = setup_lines(args, p, mem_method) + [""] + variant_lines(keys, m) + [""] + ratio_lines(args, keys, m)
    if checks:
        lines += ["", "equivalence checks, max-abs relative (fp32: ~1e-6 expected, bf16/fp16: ~1e-2; agg vs stock dW "
                      "is gated, not compared):"]
        lines += ["  " + c for c in checks]
    return "\n".join(lines), m.med


# --------------------------------------------------------------------------- main
def build_parser():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096, help="N, target tokens in the batch (default 4096)")
    ap.add_argument("--dim", type=int, default=512, help="d, decoder output width (default 512)")
    ap.add_argument("--vocab", type=int, default=32768, help="V, vocabulary size (default 32768)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--quick", action="store_true", help="small shapes (N=1024, d=256, V=8192), 2+3 rounds")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up rounds (every variant once per round)")
    ap.add_argument("--repeats", type=int, default=7, help="timed rounds (every variant once per round)")
    ap.add_argument("--chunk-size", type=int, default=2048, help="chunk of the fused function (criterion default 2048)")
    ap.add_argument("--chunk-sizes", default=None, help="comma-separated sweep of chunk sizes of the fused variants")
    ap.add_argument("--torch-chunk-sizes", default="256,1024,4096",
                    help="batch_chunk_size sweep of torch's chunked path (o), capped at N (default 256,1024,4096)")
    ap.add_argument("--variants", default=",".join(ALL_VARIANTS), help=f"subset of {','.join(ALL_VARIANTS)}")
    ap.add_argument("--memory", choices=["auto", "profiler", "rss", "none"], default="auto",
                    help="peak-memory method (auto: cuda allocator stats on CUDA, profiler on CPU)")
    ap.add_argument("--no-check", action="store_true", help="skip the loss/gradient equivalence check")
    ap.add_argument("--profile", default=None, help="comma-separated variants to profile with torch.profiler")
    ap.add_argument("--profile-rows", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of the target distribution")
    ap.add_argument("--agg-alpha", type=float, default=0.08, help="AGG rarity threshold (MT recipe 0.08)")
    ap.add_argument("--label-smoothing", type=float, default=0.1)
    ap.add_argument("--window-updates", type=int, default=200, help="updates in the AGG count window")
    ap.add_argument("--tokens-per-update", type=int, default=None, help="tokens per update in the window (default N)")
    ap.add_argument("--aug-alpha", type=float, default=0.5)
    ap.add_argument("--aug-temperature", type=float, default=10.0)
    ap.add_argument("--aug-scale", choices=["none", "tau", "tau2"], default="tau", help="criterion default: tau")
    ap.add_argument("--ul-seq-len", type=int, default=512, help="sequence length of the UL variant (k)")
    ap.add_argument("--json", default=None, help="also write the raw measurements to this file")
    ap.add_argument("--quiet", action="store_true", help="no per-round progress lines")
    ap.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)
    return ap


def parse_args(argv):
    args = build_parser().parse_args(argv)
    if args.quick:
        args.tokens, args.dim, args.vocab = 1024, 256, 8192
        args.warmup, args.repeats = min(args.warmup, 1), min(args.repeats, 3)
    if args.tokens_per_update is None:
        args.tokens_per_update = args.tokens
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device available")
    if args.dtype != "fp32" and args.device == "cpu":
        print("note: bf16/fp16 on CPU is supported but slow and not what the targets are about", file=sys.stderr)
    return args


def variant_keys(args):
    """The measured variants, each fused one once per chunk size (``name@chunk``)."""
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in RUNNERS]
    if unknown:
        sys.exit(f"unknown variants {unknown}; choose from {ALL_VARIANTS}")
    missing = torch_linear_ce_missing()
    if missing and any(v in TORCH_VARIANTS for v in variants):
        print(f"note: {missing}; variants {', '.join(TORCH_VARIANTS)} left out", file=sys.stderr)
        variants = [v for v in variants if v not in TORCH_VARIANTS]
    chunks = [args.chunk_size]
    if args.chunk_sizes:
        chunks = sorted({int(c) for c in args.chunk_sizes.split(",")} | {args.chunk_size})
    torch_chunks = sorted({min(int(c), args.tokens) for c in args.torch_chunk_sizes.split(",")})
    keys = []
    for name in variants:
        if name in FUSED:
            keys += [key_of(name, c) for c in chunks]
        elif name == "torch_chunk":
            keys += [key_of(name, c) for c in torch_chunks]
        else:
            keys.append(name)
    return keys


MEMORY_METHODS = {
    "cuda": "torch.cuda.max_memory_allocated() above the step's start",
    "profiler": "torch.profiler allocation trace (profile_memory=True): max live torch CPU bytes above the step's start",
    "rss": "fresh subprocess per variant: peak RSS (VmHWM after clear_refs) above the RSS at the step's start, "
    "MALLOC_MMAP_THRESHOLD_=64KiB",
    "none": "not measured",
}


def measure_peaks(args, p, keys, mem_method, log):
    """Peak memory of one step per variant, by ``mem_method`` (cuda, profiler, rss or none)."""
    peaks = {}
    if mem_method == "none":
        return peaks
    log(f"peak memory ({mem_method}):")
    for key in keys:
        if mem_method == "cuda":
            peaks[key] = peak_cuda(p, key)
        elif mem_method == "profiler":
            peaks[key] = peak_profiler(p, key)
        else:
            peaks[key] = peak_rss(args, key)
        log(f"  {key:<10s} {peaks[key] / MIB:8.0f} MiB")
    return peaks


def write_raw(path, args, p, times, cpu, med, peaks, mem_desc, checks):
    """The raw measurements as JSON."""
    with open(path, "w") as f:
        json.dump(
            {
                "args": vars(args),
                "stats": p.stats,
                "times_s": times,
                "cpu_s": cpu,
                "median_s": med,
                "peak_bytes": peaks,
                "memory_method": mem_desc,
                "checks": checks,
                "platform": platform.platform(),
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
            },
            f,
            indent=2,
        )


def main(argv=None):
    args = parse_args(argv)
    if args.rss_child:
        return rss_child(args)
    log = (lambda *_: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    keys = variant_keys(args)
    p = Problem(args)
    mem_method = args.memory
    if mem_method == "auto":
        mem_method = "cuda" if p.device.type == "cuda" else "profiler"

    log(f"setup: N={args.tokens} d={args.dim} V={args.vocab} {args.dtype} {args.device}, variants {keys}")
    checks = []
    if not args.no_check:
        log("equivalence check:")
        checks = sanity_check(p, [k for k in keys if parse_key(k)[1] in (None, args.chunk_size)], log)
    log("timing:")
    times, cpu = measure_times(p, keys, args.warmup, args.repeats, log)
    peaks = measure_peaks(args, p, keys, mem_method, log)
    text, med = report(args, p, keys, times, cpu, peaks, MEMORY_METHODS[mem_method], checks)
    print(text)
    if args.profile:
        for name in args.profile.split(","):
            profile_variant(p, key_of(name.strip(), args.chunk_size), args.profile_rows)
    if args.json:
        write_raw(args.json, args, p, times, cpu, med, peaks, MEMORY_METHODS[mem_method], checks)


if __name__ == "__main__":
    main()
