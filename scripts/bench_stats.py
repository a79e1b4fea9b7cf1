#!/usr/bin/env python
"""Cost of the embedding statistics (fairseq_agg.stats), measured side by side in one run.

1. Time of each metric on a V x d matrix (default V = 50,000, d = 1,024, fp32 N(0, d^-1/2)
   weights, as fairseq initialises embeddings), and of one live measurement as the criteria do it.
2. Overhead of live logging on a small real fairseq-train LM run at the recommended interval
   (--embed-stats-interval 100; isotropy every 10 x 100 = 1000 updates; both at validation):
   the same run with and without the statistics, interleaved, plus the time spent inside
   ``EmbeddingStats.log`` itself (every call, measured in the training process).

Usage (from the repository root): python -m scripts.bench_stats [--vocab 50000 --dim 1024] [--updates 1000]
       [--max-tokens 1024] [--repeats 2] [--device cpu|cuda] [--skip-train] [--skip-metrics]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

if __package__ != "scripts":  # run as a file: the repository root, and so tests.support, is not importable
    sys.exit("run it from the repository root as: python -m scripts.bench_stats [ARGS]")

import torch

from tests.support.output_layer_problem import wall_seconds
from tests.support.synthetic_text import markov_sentences, write_lines

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _timed(fn, device, repeats=3):
    fn()  # warm-up
    return min(wall_seconds(fn, device) for _ in range(repeats))


def bench_metrics(V, d, device, repeats):
    from fairseq.data import Dictionary

    from fairseq_agg.stats import groups as G
    from fairseq_agg.stats.config import EmbeddingStatsSettings
    from fairseq_agg.stats.live import compute_embedding_stats
    from fairseq_agg.stats.metrics import embedding_spectrum, isotropy, mean_pairwise_cosine, tev_stats

    torch.manual_seed(0)
    W = (torch.randn(V, d) * d**-0.5).to(device)
    dictionary = Dictionary()
    for i in range(V - dictionary.nspecial):
        dictionary.add_symbol(f"w{i}", n=V - i)
    rows = G.select_rows(dictionary).to(device)
    grp = {g: ids.to(device) for g, ids in G.frequency_groups(dictionary).items()}
    spec = embedding_spectrum(W, rows)

    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(V, d, padding_idx=1).to(device)
            self.embed_tokens.weight.data.copy_(W)
            self.embed_scale = d**0.5

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.decoder = Decoder()

    model = Model()
    live = EmbeddingStatsSettings(embed_stats_interval=100)
    live_groups = EmbeddingStatsSettings(embed_stats_interval=100, embed_stats_groups=True)
    cache = {}
    dicts = {"dec": dictionary}
    cases = [
        ("tev_stats (fp32)", lambda: tev_stats(W, rows)),
        ("mean_pairwise_cosine (fp64)", lambda: mean_pairwise_cosine(W, rows)),
        ("embedding_spectrum (fp64 Gram + eigh)", lambda: embedding_spectrum(W, rows)),
        ("isotropy incl. spectrum (fp64)", lambda: isotropy(W, rows)),
        ("isotropy, spectrum given", lambda: isotropy(W, rows, spectrum=spec)),
        ("isotropy of the 3 frequency groups", lambda: [isotropy(W, r) for r in grp.values()]),
        ("live step: TEV + mean_cos", lambda: compute_embedding_stats(model, live, dicts, tev=True, iso=False, cache=cache)),
        ("live step: isotropy", lambda: compute_embedding_stats(model, live, dicts, tev=False, iso=True, cache=cache)),
        ("live step: all, with groups",
         lambda: compute_embedding_stats(model, live_groups, dicts, tev=True, iso=True, cache=cache)),
    ]
    print(f"\n== metric times, V = {V:,}, d = {d:,}, device = {device}, threads = {torch.get_num_threads()} ==")
    print(f"| {'metric':40s} | {'time (ms)':>10s} |")
    print(f"|{'-' * 42}|{'-' * 12}|")
    results = {}
    for name, fn in cases:
        t = _timed(fn, device, repeats)
        results[name] = t
        print(f"| {name:40s} | {1000 * t:10.1f} |")
    return results


# ----------------------------------------------------------------------------- training overhead

WORKER_CODE = r"""
import json, sys, time
from fairseq_agg.stats import live
calls = {"n": 0, "t": 0.0}
orig = live.EmbeddingStats.log
def timed(self, model, logging_output=None):
    t = time.perf_counter()
    try:
        return orig(self, model, logging_output)
    finally:
        calls["n"] += 1
        calls["t"] += time.perf_counter() - t
live.EmbeddingStats.log = timed
from fairseq_cli import train
sys.argv = ["fairseq-train"] + json.loads(sys.argv[1])
t0 = time.perf_counter()
train.cli_main()
total = time.perf_counter() - t0
print("BENCH_RESULT " + json.dumps({"total_s": total, "stats_s": calls["t"], "calls": calls["n"]}))
"""


def _make_data(root):
    raw = os.path.join(root, "raw")
    os.makedirs(raw, exist_ok=True)
    sents = markov_sentences(12000, n_words=5000, seed=0)
    write_lines(os.path.join(raw, "train.txt"), sents[:11000])
    write_lines(os.path.join(raw, "valid.txt"), sents[11000:])
    dest = os.path.join(root, "bin")
    preprocess = os.path.join(os.path.dirname(sys.executable), "fairseq-preprocess")
    proc = subprocess.run([preprocess, "--only-source", "--trainpref", f"{raw}/train.txt", "--validpref",
                           f"{raw}/valid.txt", "--destdir", dest, "--workers", "1"], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"fairseq-preprocess failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return dest


def bench_training(updates, repeats, threads, max_tokens=1024):
    with tempfile.TemporaryDirectory() as root:
        data = _make_data(root)
        common = [
            data, "--task", "language_modeling", "--arch", "transformer_lm", "--decoder-layers", "2",
            "--decoder-embed-dim", "128", "--decoder-input-dim", "128", "--decoder-output-dim", "128",
            "--decoder-ffn-embed-dim", "256", "--decoder-attention-heads", "4", "--share-decoder-input-output-embed",
            "--tokens-per-sample", "128", "--sample-break-mode", "none", "--max-tokens", str(max_tokens),
            "--optimizer", "adam", "--lr", "0.001", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "100",
            "--dropout", "0.1", "--seed", "1", "--cpu", "--num-workers", "0", "--log-interval", "100",
            "--no-progress-bar", "--max-update", str(updates), "--no-save",
            "--user-dir", os.path.join(ROOT, "fairseq_agg_plugin"),
            "--criterion", "cross_entropy_with_stats",
        ]
        variants = {"off": [], "stats": ["--embed-stats-interval", "100"]}
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
        runs = {k: [] for k in variants}
        for rep in range(repeats):
            for name, extra in variants.items():  # interleaved, so drifts in machine load hit both
                proc = subprocess.run([sys.executable, "-c", WORKER_CODE, json.dumps(common + extra)], env=env,
                                      capture_output=True, text=True, cwd=root)
                line = [l for l in proc.stdout.splitlines() if l.startswith("BENCH_RESULT ")]
                if proc.returncode != 0 or not line:
                    sys.exit(f"training run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
                res = json.loads(line[0][len("BENCH_RESULT "):])
                runs[name].append(res)
                print(f"  run {rep + 1} {name:5s}: total {res['total_s']:.1f} s, inside EmbeddingStats.log "
                      f"{res['stats_s'] * 1000:.1f} ms over {res['calls']} calls")
        off = min(r["total_s"] for r in runs["off"])
        on = min(r["total_s"] for r in runs["stats"])
        inside = min(r["stats_s"] / r["total_s"] for r in runs["stats"])
        inside_off = max(r["stats_s"] for r in runs["off"])
        print(f"\n== live-logging overhead, {updates} updates of {max_tokens} tokens, V = 5,004, d = 128, "
              f"threads = {threads} ==")
        print(f"| {'quantity':52s} | {'value':>12s} |")
        print(f"|{'-' * 54}|{'-' * 14}|")
        print(f"| {'training wall time, statistics off (best of %d)' % repeats:52s} | {off:10.2f} s |")
        print(f"| {'training wall time, --embed-stats-interval 100':52s} | {on:10.2f} s |")
        print(f"| {'wall-time ratio on / off':52s} | {on / off:12.4f} |")
        print(f"| {'time inside EmbeddingStats.log / training time':52s} | {100 * inside:10.3f} % |")
        print(f"| {'time inside EmbeddingStats.log with stats off':52s} | {1000 * inside_off:9.2f} ms |")
        return {"off_s": off, "on_s": on, "ratio": on / off, "inside_fraction": inside}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=50000)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--updates", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=1024, help="tokens per update of the training run")
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    p.add_argument("--skip-metrics", action="store_true")
    p.add_argument("--skip-train", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if not args.skip_metrics:
        bench_metrics(args.vocab, args.dim, torch.device(args.device), max(1, args.repeats))
    if not args.skip_train:
        bench_training(args.updates, max(1, args.repeats), args.threads, args.max_tokens)


if __name__ == "__main__":
    main()
