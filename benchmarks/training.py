"""Whole training steps: real ``fairseq-train`` processes, stock ``cross_entropy`` against each
method of this package, with the embedding statistics off and on (``python -m scripts.bench_training``).

Shapes (``--shape``):

  demo   the demo LM of examples/lm_demo/run.py (its MODEL["default"] and BUDGET["default"] batches):
         transformer_lm_gpt, 3 layers, d 96, FFN 384, 4 heads, pre-LN, tied embeddings, 128 tokens
         per sample, 1,024 tokens per update, Adam; V = 4,000 (the demo's sentencepiece vocabulary)
  words  the same model at d 128 (FFN 512) over a word-level vocabulary of 18,000 types

Data: a fairseq data-bin of i.i.d. Zipf(1.1) tokens written on the spot (tests/support/training_runs.py's
``write_synthetic_lm_bin``: a dictionary of exactly V types in frequency order, as
fairseq-preprocess writes one); enough for one epoch of ``--updates``, validation off.

Configurations (``--methods``): stock ``cross_entropy`` (fairseq's own) and ``agg``
(cross_entropy_agg, alpha 0.03 as in the demo), ``al`` (augmented_loss), ``freeze``
(cross_entropy_agg --agg-freeze-rare), ``cosreg``, ``face``, ``ul`` (the criteria of
docs/baselines.md) and ``coupled_adam`` (stock CE, --optimizer coupled_adam), all with the
statistics off; each method of ``--stats-methods`` also runs with ``--embed-stats-interval``
(default 100, isotropy every 10x that; stock CE's statistics through cross_entropy_with_stats).

Measured per run, in the training process (benchmarks/train_worker.py): updates per second, from
the time at which every ``Trainer.train_step`` returned, over the updates after the first
``--warmup-fraction`` (so start-up, data loading and the first steps' allocations are left out and
everything between two updates, logging and statistics included, is in); and the process's peak
RSS. Every round runs every configuration once, the order rotated from round to round, and each
ratio is the median over rounds of the ratio within a round (same machine load).

Goals (printed PASS/MISS; rows of benchmarks/targets.py): every method >= 0.97x stock CE's
updates/s; the statistics at ``--stats-interval`` (default 100; the plugin's own default is off)
cost <= 2 % of a run's time. The second is judged within each run with the statistics
(``in_run_share``: how much longer its measuring updates take than its median update); the paired
ratio to the same method without them is printed beside it, but two processes on this VM differ
by a few per cent on their own, which hides a cost of 0.1-0.2 %.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile

import torch

from benchmarks.flags import choose, refuse
from benchmarks.targets import TRAINING, target
from benchmarks.train_worker import run_worker
from fairseq_agg.files import atomic_output
from tests.support.training_runs import in_run_share, train_log_records, updates_per_second, write_synthetic_lm_bin

MODEL = {  # arch flags; examples/lm_demo/run.py's MODEL["default"], and the same at d 128
    "demo": ["--decoder-layers", "3", "--decoder-embed-dim", "96", "--decoder-ffn-embed-dim", "384",
             "--decoder-attention-heads", "4"],
    "words": ["--decoder-layers", "3", "--decoder-embed-dim", "128", "--decoder-ffn-embed-dim", "512",
              "--decoder-attention-heads", "4"],
}
VOCAB = {"demo": 4000, "words": 18000}
TOKENS_PER_SAMPLE, MAX_TOKENS = 128, 1024  # examples/lm_demo/run.py's BUDGET["default"]

# examples/lm_demo/run.py's COMMON_TRAIN, less its logging and checkpoint flags (see train_flags)
COMMON = [
    "--task", "language_modeling", "--arch", "transformer_lm_gpt", "--sample-break-mode", "none",
    "--share-decoder-input-output-embed", "--decoder-normalize-before", "--dropout", "0.1",
    "--attention-dropout", "0.1", "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--weight-decay", "0.01",
    "--clip-norm", "0.0", "--lr", "0.002", "--lr-scheduler", "inverse_sqrt", "--warmup-init-lr", "1e-07",
    "--required-batch-size-multiple", "1", "--num-workers", "0", "--seed", "1",
]

METHODS = {  # name -> criterion (and optimizer) flags; the demo's settings (examples/lm_demo/run.py)
    "stock": ["--criterion", "cross_entropy"],
    "agg": ["--criterion", "cross_entropy_agg", "--agg-alpha", "0.03"],
    "al": ["--criterion", "augmented_loss"],
    "freeze": ["--criterion", "cross_entropy_agg", "--agg-freeze-rare", "--agg-alpha", "0.03"],
    "cosreg": ["--criterion", "cross_entropy_cosreg"],
    "face": ["--criterion", "cross_entropy_face"],
    "ul": ["--criterion", "cross_entropy_unlikelihood"],
    "coupled_adam": ["--criterion", "cross_entropy", "--optimizer", "coupled_adam"],  # the last --optimizer wins
}
STATS = "+stats"
METHOD_GOAL = target("method_speed_vs_stock", TRAINING)
STATS_SHARE_GOAL = target("stats_share_of_run", TRAINING)


def with_statistics(flags, interval):
    """A method's flags with the statistics on; fairseq's own cross_entropy has none, its
    plugin twin cross_entropy_with_stats computes them."""
    flags = ["cross_entropy_with_stats" if f == "cross_entropy" else f for f in flags]
    return flags + ["--embed-stats-interval", str(interval)]


def configurations(args):
    """(name, flags) of every run of a round: the methods, then those with statistics."""
    configs = [(m, METHODS[m]) for m in args.methods]
    configs += [(m + STATS, with_statistics(METHODS[m], args.stats_interval)) for m in args.stats_methods]
    return configs


def train_flags(args, shape, data, save_dir):
    flags = [data, *COMMON, *MODEL[shape], "--tokens-per-sample", str(TOKENS_PER_SAMPLE),
             "--max-tokens", str(MAX_TOKENS), "--warmup-updates", str(max(1, args.updates // 4)),
             "--max-update", str(args.updates), "--log-format", "json", "--log-interval", str(args.log_interval),
             "--disable-validation", "--no-save", "--save-dir", save_dir]
    if args.device == "cpu":
        flags.append("--cpu")
    return flags


def run_once(args, shape, data, workdir, name, flags):
    """One fairseq-train process; its updates/s, peak RSS, update count and last logged loss."""
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    train_args = [*train_flags(args, shape, data, os.path.join(workdir, "ckpt")), *flags]
    proc, worker = run_worker(os.path.join(workdir, "worker.json"), train_args, env)
    if proc.returncode != 0 or worker is None:
        sys.exit(f"fairseq-train failed for {shape} {name}:\n{(proc.stdout + proc.stderr)[-5000:]}")
    records = train_log_records(proc.stdout + proc.stderr)
    interval = args.stats_interval if name.endswith(STATS) else 0
    return {"ups": updates_per_second(worker["update_ends_s"], args.warmup_fraction),
            "stats_share": in_run_share(worker["update_ends_s"], args.warmup_fraction, interval),
            "updates": len(worker["update_ends_s"]), "wall_s": worker["wall_s"],
            "peak_rss_mib": worker["max_rss_mib"], "loss_last": float(records[-1]["loss"]) if records else None}


def bench_shape(args, shape, log):
    """Every configuration ``--repeats`` times at one shape, interleaved."""
    configs = configurations(args)
    runs = {name: [] for name, _ in configs}
    with tempfile.TemporaryDirectory(prefix="bench_training_") as workdir:
        train_tokens = int(args.updates * MAX_TOKENS * 1.05) + 10 * TOKENS_PER_SAMPLE
        data = write_synthetic_lm_bin(os.path.join(workdir, "data-bin"), VOCAB[shape], train_tokens,
                                      4 * TOKENS_PER_SAMPLE)
        for r in range(args.repeats):
            order = configs[r % len(configs):] + configs[: r % len(configs)]
            for name, flags in order:
                run = run_once(args, shape, data, workdir, name, flags)
                runs[name].append(run)
                log(f"  {shape} round {r + 1}/{args.repeats} {name:<20s} {run['ups']:8.2f} updates/s, "
                    f"peak RSS {run['peak_rss_mib']:7.0f} MiB, {run['wall_s']:6.1f} s, last loss {run['loss_last']}")
    return runs


def paired_ratio(runs, a, b):
    """Median over rounds of a's updates/s over b's in the same round."""
    return statistics.median(x["ups"] / y["ups"] for x, y in zip(runs[a], runs[b]))


def _goal(runs, name, rs, vs_stock):
    """The PASS/MISS text of one configuration's goal."""
    if name.endswith(STATS) and rs and rs[0].get("stats_share") is not None:
        share = statistics.median(r["stats_share"] for r in rs)
        return (f"in-run share of the statistics {100 * share:.2f} % (<= {100 * STATS_SHARE_GOAL.limit:.0f} %: "
                f"{'PASS' if STATS_SHARE_GOAL.passed(share) else 'MISS'})")
    if vs_stock is not None:
        return f"{METHOD_GOAL.text()}x stock: {'PASS' if METHOD_GOAL.passed(vs_stock) else 'MISS'}"
    return ""


def report(args, shape, runs):
    """The table of one shape: updates/s, peak RSS, the ratios and the goals."""
    head = (f"{'configuration':<20s} {'updates/s':>10s} {'min':>8s} {'max':>8s} {'RSS MiB':>8s} {'/ stock':>8s} "
            f"{'/ no stats':>10s}   goal")
    lines = [f"== {shape}: V = {VOCAB[shape]:,}, {' '.join(MODEL[shape])}, {args.updates} updates of {MAX_TOKENS} "
             f"tokens, {args.repeats} rounds, {args.threads} threads, {args.device} ==", head, "-" * len(head)]
    for name, rs in runs.items():
        ups = [r["ups"] for r in rs]
        method = name[: -len(STATS)] if name.endswith(STATS) else None
        vs_stock = paired_ratio(runs, name, "stock") if "stock" in runs and name != "stock" else None
        vs_plain = paired_ratio(runs, name, method) if method in runs else None
        lines.append(
            f"{name:<20s} {statistics.median(ups):10.3f} {min(ups):8.3f} {max(ups):8.3f} "
            f"{statistics.median(r['peak_rss_mib'] for r in rs):8.0f} "
            f"{'' if vs_stock is None else f'{vs_stock:.3f}x':>8s} {'' if vs_plain is None else f'{vs_plain:.3f}x':>10s}"
            f"   {_goal(runs, name, rs, vs_stock)}")
    return lines


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m scripts.bench_training", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="demo,words", help="comma-separated: demo, words (default both)")
    ap.add_argument("--methods", default="all", help=f"comma-separated subset of {','.join(METHODS)} (stock is "
                    "always run: the baseline)")
    ap.add_argument("--stats-methods", default="stock", help="methods also run with the statistics on "
                    "(comma-separated, all, or none; default stock)")
    ap.add_argument("--stats-interval", type=int, default=100, help="--embed-stats-interval of those runs")
    ap.add_argument("--updates", type=int, default=300, help="updates per run (default 300, the demo's)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds; every configuration once per round")
    ap.add_argument("--warmup-fraction", type=float, default=0.2, help="leading share of updates left out")
    ap.add_argument("--log-interval", type=int, default=25)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--json", default=None, help="also write every run's measurements to this file")
    ap.add_argument("--quiet", action="store_true", help="no per-run progress lines")
    args = ap.parse_args(argv)
    args.shapes = choose(args.shape, list(MODEL), "--shape", "all")
    args.methods = ["stock"] + [m for m in choose(args.methods, list(METHODS), "--methods", "all") if m != "stock"]
    args.stats_methods = [] if args.stats_methods == "none" else choose(args.stats_methods, list(METHODS),
                                                                          "--stats-methods", "all")
    if args.updates < 5 or args.repeats < 1 or not 0 <= args.warmup_fraction < 1:
        refuse("--updates must be >= 5, --repeats >= 1 and --warmup-fraction in [0, 1)")
    return args


def main(argv=None):
    args = parse_args(argv)
    log = (lambda *_: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    results = {}
    for shape in args.shapes:
        results[shape] = bench_shape(args, shape, log)
        print("\n".join(report(args, shape, results[shape])) + "\n", flush=True)
    if args.json:
        with atomic_output(args.json, "w", flag="--json") as f:
            json.dump({"args": vars(args), "torch": torch.__version__, "runs": results}, f, indent=2)
