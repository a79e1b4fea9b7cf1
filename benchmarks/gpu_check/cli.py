"""The GPU check's command line (``python -m scripts.gpu_check``): the plan, the parts, the report."""
import argparse
import os
import sys
import time

import torch

import benchmarks.gpu_check
from benchmarks.flags import choose
from benchmarks.gpu_check.correctness import part_correctness
from benchmarks.gpu_check.evaluate import evaluate_targets
from benchmarks.gpu_check.hf import part_hf
from benchmarks.gpu_check.output_layer import part_output_layer
from benchmarks.gpu_check.plan import CPU_SMOKE_PLAN, GPU_PLAN
from benchmarks.gpu_check.record import Budget, Report, collect_meta, log
from benchmarks.gpu_check.stats import add_stats_share, part_stats
from benchmarks.gpu_check.train import part_train, part_train_mt

PARTS = ("correctness", "output_layer", "train", "train_mt", "stats", "hf")
DEFAULT_PARTS = ("correctness", "output_layer", "train", "stats")


def build_parser():
    ap = argparse.ArgumentParser(prog="python -m scripts.gpu_check",
                                 description=benchmarks.gpu_check.__doc__.split("\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (CI)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu_check",
                    help="output folder (default: $OUT or ./gpu_check)")
    ap.add_argument("--deadline", type=float, default=None, help="Unix time by which the check must end")
    ap.add_argument("--budget-s", type=float, default=None, help="seconds from now (if --deadline is not given; "
                    "default 450 on a GPU, 300 for --cpu-smoke)")
    ap.add_argument("--parts", default=",".join(DEFAULT_PARTS),
                    help=f"comma-separated subset of {','.join(PARTS)} (default: {','.join(DEFAULT_PARTS)}; "
                    "train_mt, the WMT14 recipe's models, and hf, the Hugging Face path, take a run of their own)")
    return ap


def _no_gpu(args, argv):
    """Recorded like any other failure, so that the output folder says what happened."""
    report = Report(args.out, collect_meta(GPU_PLAN.mode, torch.device("cpu"), argv))
    report.data["error"] = (f"no CUDA device: torch {torch.__version__} (CUDA {torch.version.cuda}) sees none; "
                            "run on the accelerator machine, or pass --cpu-smoke")
    report.save()
    log("[gpu_check] " + report.data["error"])
    return 1


def run_parts(parts, plan, device, budget, report):
    if "correctness" in parts:
        report.run_part("correctness", lambda: part_correctness(plan, device), budget, 5)
    if "output_layer" in parts:
        reserve = plan.train_reserve_s if {"train", "train_mt"} & set(parts) else 0.0  # keep the training parts' time
        report.run_part("output_layer", lambda: part_output_layer(plan, device, budget, reserve), budget, 20)
    if "stats" in parts:  # before training: quick, and the training part takes what time is left
        report.run_part("stats", lambda: part_stats(plan, device), budget, 5)
    if "train" in parts:
        report.run_part("train", lambda: part_train(plan, device, budget), budget, 30)
    if "train_mt" in parts:
        report.run_part("train_mt", lambda: part_train_mt(plan, device, budget), budget, 30)
    if "hf" in parts:
        report.run_part("hf", lambda: part_hf(plan, device), budget, 20)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    parts = choose(args.parts, PARTS, "--parts")
    if not args.cpu_smoke and not torch.cuda.is_available():
        return _no_gpu(args, argv)
    plan, device = (CPU_SMOKE_PLAN, torch.device("cpu")) if args.cpu_smoke else (GPU_PLAN, torch.device("cuda"))
    deadline = args.deadline
    if deadline is None:
        deadline = time.time() + (args.budget_s or (300.0 if args.cpu_smoke else 450.0))
    budget = Budget(deadline)
    report = Report(args.out, collect_meta(plan.mode, device, argv))
    log(f"[gpu_check] {plan.mode} on {report.data['meta']['device']}, {budget.left():.0f} s budget, output {args.out}")
    run_parts(parts, plan, device, budget, report)
    add_stats_share(report.data["parts"])
    report.data["targets"] = evaluate_targets(report.data)
    report.save()
    ok = all(p["status"] in ("ok", "partial") for p in report.data["parts"].values())
    log(f"[gpu_check] wrote {os.path.join(args.out, 'gpu_check.json')} and gpu_check.md; "
        f"{'all parts ran' if ok else 'some parts failed'}")
    return 0 if ok else 1
