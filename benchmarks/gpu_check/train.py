"""Parts 3 and 3b of the GPU check: real fairseq-train runs (a worker process each,
:mod:`benchmarks.train_worker`) on synthetic data-bins made on the spot; words per second after the
warm-up updates and peak memory, ratios against the stock run of the same precision and size."""
import json
import os
import re
import statistics
import subprocess
import tempfile
import time

import torch

from benchmarks.gpu_check.output_ratios import ratio
from benchmarks.gpu_check.plan import Plan
from benchmarks.gpu_check.record import Budget, log
from benchmarks.gpu_check.train_flags import mt_train_args, mt_train_runs, run_key, train_args, train_runs
from benchmarks.train_worker import run_worker
from tests.support.training_runs import (fairseq_precision_problem, train_log_records, write_synthetic_lm_bin,
                                         write_synthetic_translation_bin)

# the criteria's one line at their first forward ("<criterion>: output layer: <path>"), and the
# warning of a compilation that failed under --output-kernel auto (the run went on eagerly)
_OUTPUT_LAYER = re.compile(r"\S+: output layer: (.+?)\s*$", re.MULTILINE)
_COMPILE_FALLBACK = re.compile(r"fused output layer: (torch\.compile failed.*?)\s*$", re.MULTILINE)
MT_PAIR_LENGTHS = (10, 60)  # tokens per side of a synthetic pair, before </s> (WMT14's BPE sentences: ~30)


def output_layer_path(text: str):
    """Which path the fused output layer ran in a training log, or None (a stock criterion)."""
    found = _OUTPUT_LAYER.search(text)
    if not found:
        return None
    fallback = _COMPILE_FALLBACK.search(text)
    return found.group(1) + (f"; then eager: {fallback.group(1)}" if fallback else "")


def _log_tail(proc) -> str:
    """The ends of both streams: fairseq logs to stdout, Python's warnings go to stderr."""
    return f"--- stdout ---\n{proc.stdout[-2500:]}\n--- stderr ---\n{proc.stderr[-1500:]}"


def _speed(plan: Plan, records):
    """Words per second and per batch after the warm-up updates, or the reason there are none."""
    records = [r for r in records if int(float(r["num_updates"])) > 0]
    after = [r for r in records if int(float(r["num_updates"])) > plan.warmup_updates]
    if not after:
        return {"error": f"no train_inner record after update {plan.warmup_updates}"}
    wps = round(statistics.mean(float(r["wps"]) for r in after), 1)
    wpb = round(statistics.mean(float(r["wpb"]) for r in after), 1)
    return {"wps": wps, "wpb": wpb, "seconds_per_update": round(wpb / wps, 5),
            "num_updates": int(float(records[-1]["num_updates"])), "loss_first": float(records[0]["loss"]),
            "loss_last": float(records[-1]["loss"])}


def run_train(plan: Plan, device, args, workdir, name, arch, extra, precision, timeout):
    """One measured fairseq-train run: ``args`` (data, task, model, schedule) and the criterion's
    ``extra`` flags, in a worker process."""
    env = dict(os.environ)
    if device.type == "cpu":
        env.setdefault("OMP_NUM_THREADS", "2")
    started = time.time()
    proc, worker = run_worker(os.path.join(workdir, "worker.json"), [*args, *extra], env, timeout)
    run = {"name": name, "precision": precision, "arch": arch, "flags": extra, "returncode": proc.returncode,
           "seconds": round(time.time() - started, 1)}
    text = proc.stdout + proc.stderr
    run["output_layer"] = output_layer_path(text)
    speed = _speed(plan, train_log_records(text)) if proc.returncode == 0 else {"error": "fairseq-train failed"}
    run.update(speed)
    if "error" in run:
        run["log_tail"] = _log_tail(proc)
        return run
    run["wall_s"] = round(worker["wall_s"], 1)
    run["peak_mib"] = round(worker["cuda_peak_mib"], 1) if "cuda_peak_mib" in worker else None
    run["max_rss_mib"] = round(worker["max_rss_mib"], 1)
    return run


def _train_one(plan, device, budget, workdir, label, run_spec, args_for):
    name, size, arch, extra = run_spec
    args = args_for(arch, label["precision"], os.path.join(workdir, "ckpt"))
    try:
        return {**label, **run_train(plan, device, args, workdir, name, arch, extra, label["precision"],
                                     timeout=max(30.0, budget.left() - 5))}
    except subprocess.TimeoutExpired:
        return {**label, "error": "timed out (time budget)"}


def train_each(plan: Plan, device: torch.device, budget: Budget, workdir: str, runs, args_for, result):
    """Each run (name, size or None, arch, criterion flags) at each of the plan's precisions, into
    ``result["runs"]``; ``args_for(arch, precision, save_dir)`` gives its other flags. A run the
    time left cannot hold is recorded as skipped; the part's status says whether any failed."""
    expected = 60.0 if device.type == "cuda" else 40.0  # first guess of one run's seconds
    for precision in plan.train_precisions:
        problem = fairseq_precision_problem(precision)
        if problem:
            result.setdefault("not_runnable", {})[precision] = problem
            continue
        for run_spec in runs:
            name, size = run_spec[:2]
            label = {"name": name, "precision": precision, **({"size": size} if size else {})}
            if budget.left() < expected * 1.2:
                result["runs"].append({**label, "skipped": "time budget"})
                continue
            run = _train_one(plan, device, budget, workdir, label, run_spec, args_for)
            if "seconds" in run:
                expected = max(expected * 0.5, run["seconds"])
            log(f"[gpu_check] train {precision} {size or ''} {name}: "
                f"{json.dumps({k: v for k, v in run.items() if k != 'log_tail'})}")
            if "error" in run and "log_tail" in run:
                log(run["log_tail"][-1200:])
            result["runs"].append(run)
    if any("error" in r for r in result["runs"]):
        result["status"] = "failed"
    elif any("skipped" in r for r in result["runs"]):
        result["status"] = "partial"
    return result


def memory_note(device: torch.device) -> str:
    return ("torch.cuda.max_memory_allocated of the training process" if device.type == "cuda"
            else "not measured on a CPU (max RSS recorded)")


def part_train(plan: Plan, device: torch.device, budget: Budget):
    result = {"arch": plan.train_arch, "mlra_arch": plan.train_mlra_arch, "vocab": plan.train_vocab,
              "tokens_per_sample": plan.tokens_per_sample, "max_tokens": plan.max_tokens, "updates": plan.updates,
              "warmup_updates_dropped": plan.warmup_updates, "memory": memory_note(device),
              "data": "synthetic Zipf(1.1) data-bin written with fairseq's mmap builder", "runs": [],
              "target_precisions": list(plan.target_train_precisions)}
    runs = [(name, None, arch, extra) for name, arch, extra in train_runs(plan)]
    with tempfile.TemporaryDirectory(prefix="gpu_check_train_") as workdir:
        train_tokens = int(plan.updates * plan.max_tokens * 1.1) + 10 * plan.tokens_per_sample
        data = write_synthetic_lm_bin(os.path.join(workdir, "data-bin"), plan.train_vocab, train_tokens,
                                      4 * plan.tokens_per_sample)
        train_each(plan, device, budget, workdir, runs,
                   lambda arch, precision, save_dir: train_args(plan, data, save_dir, arch, precision, device), result)
    result["ratios"] = train_ratios(result["runs"], "stock cross_entropy")
    return result


def part_train_mt(plan: Plan, device: torch.device, budget: Budget):
    """Words (target tokens) per second of the WMT14 recipe's models and METHODs, what pricing a
    paper-scale run of examples/wmt14_en_de needs: --max-tokens as the recipe's per GPU, ratios
    against the same size's baseline."""
    result = {"archs": dict(plan.mt_archs), "mlra_arch": plan.mt_mlra_arch, "vocab": plan.mt_vocab,
              "max_tokens": plan.mt_max_tokens, "updates": plan.updates, "warmup_updates_dropped": plan.warmup_updates,
              "memory": memory_note(device), "runs": [],
              "data": f"synthetic Zipf(1.1) sentence pairs of {MT_PAIR_LENGTHS[0]}-{MT_PAIR_LENGTHS[1] - 1} tokens "
                      "per side plus </s>, one joined dictionary, written with fairseq's mmap builder"}
    with tempfile.TemporaryDirectory(prefix="gpu_check_train_mt_") as workdir:
        # enough pairs for every update's micro-batch, with a tenth to spare
        per_pair = sum(MT_PAIR_LENGTHS) / 2 + 1
        pairs = int(plan.updates * plan.mt_max_tokens * 1.1 / per_pair) + 64
        data = write_synthetic_translation_bin(os.path.join(workdir, "data-bin"), plan.mt_vocab, pairs, 64,
                                               lengths=MT_PAIR_LENGTHS)
        train_each(plan, device, budget, workdir, mt_train_runs(plan),
                   lambda arch, precision, save_dir: mt_train_args(plan, data, save_dir, arch, precision, device),
                   result)
    result["ratios"] = train_ratios(result["runs"], "baseline")
    return result


def train_ratios(runs, stock_name):
    """{run key: words/s and peak memory against the run named ``stock_name`` of the same
    precision and size}."""
    ratios = {}
    measured = [r for r in runs if "wps" in r]
    for r in measured:
        stock = next((x for x in measured if x["name"] == stock_name and x["precision"] == r["precision"]
                      and x.get("size") == r.get("size")), None)
        if stock is None or r is stock:
            continue
        ratios[run_key(r)] = {"wps_vs_stock": ratio(r["wps"], stock["wps"]),
                              "memory_vs_stock": ratio(r.get("peak_mib"), stock.get("peak_mib"))}
    return ratios
