"""Cost of the embedding statistics (fairseq_agg.stats), measured side by side in one run
(``python -m scripts.bench_stats``).

1. Time of each metric on a V x d matrix (default V = 50,000, d = 1,024, fp32 N(0, d^-1/2)
   weights, as fairseq initialises embeddings), and of one live measurement as the criteria do it
   (a warm-up call, then the best of --repeats: benchmarks/timing.py).
2. Overhead of live logging on a small real fairseq-train LM run at the recommended interval
   (--embed-stats-interval 100; isotropy every 10 x 100 = 1000 updates; both at validation):
   the same run with and without the statistics, interleaved, plus the time spent inside
   ``EmbeddingStats.log`` itself (every call, measured in the training process).
"""
import argparse
import os
import subprocess
import sys
import tempfile

import torch

from benchmarks.timing import seconds_of
from benchmarks.train_worker import run_worker
from tests.support.synthetic_text import markov_sentences, write_lines


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
        t = seconds_of(fn, device, repeats, reduce=min)  # a warm-up call, then the best of the repeats
        results[name] = t
        print(f"| {name:40s} | {1000 * t:10.1f} |")
    return results


# ----------------------------------------------------------------------------- training overhead


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


def _training_flags(data, save_dir, updates, max_tokens):
    return [
        data, "--task", "language_modeling", "--arch", "transformer_lm", "--decoder-layers", "2",
        "--decoder-embed-dim", "128", "--decoder-input-dim", "128", "--decoder-output-dim", "128",
        "--decoder-ffn-embed-dim", "256", "--decoder-attention-heads", "4", "--share-decoder-input-output-embed",
        "--tokens-per-sample", "128", "--sample-break-mode", "none", "--max-tokens", str(max_tokens),
        "--optimizer", "adam", "--lr", "0.001", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "100",
        "--dropout", "0.1", "--seed", "1", "--cpu", "--num-workers", "0", "--log-interval", "100",
        "--no-progress-bar", "--max-update", str(updates), "--no-save", "--save-dir", save_dir,
        "--criterion", "cross_entropy_with_stats",
    ]


def _print_overhead(runs, updates, repeats, threads, max_tokens):
    off = min(r["wall_s"] for r in runs["off"])
    on = min(r["wall_s"] for r in runs["stats"])
    inside = min(r["stats_log_s"] / r["wall_s"] for r in runs["stats"])
    inside_off = max(r["stats_log_s"] for r in runs["off"])
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


def bench_training(updates, repeats, threads, max_tokens=1024):
    """The same fairseq-train run with and without the statistics, interleaved (drifts in machine
    load hit both), each in the shared worker (benchmarks/train_worker.py)."""
    with tempfile.TemporaryDirectory() as root:
        common = _training_flags(_make_data(root), os.path.join(root, "ckpt"), updates, max_tokens)
        variants = {"off": [], "stats": ["--embed-stats-interval", "100"]}
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        runs = {k: [] for k in variants}
        for rep in range(repeats):
            for name, extra in variants.items():
                proc, res = run_worker(os.path.join(root, "worker.json"), common + extra, env)
                if proc.returncode != 0 or res is None:
                    sys.exit(f"training run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
                runs[name].append(res)
                print(f"  run {rep + 1} {name:5s}: total {res['wall_s']:.1f} s, inside EmbeddingStats.log "
                      f"{res['stats_log_s'] * 1000:.1f} ms over {res['stats_log_calls']} calls")
        return _print_overhead(runs, updates, repeats, threads, max_tokens)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m scripts.bench_stats", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=50000)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--updates", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=1024, help="tokens per update of the training run")
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    p.add_argument("--skip-metrics", action="store_true")
    p.add_argument("--skip-train", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not args.skip_metrics:
        bench_metrics(args.vocab, args.dim, torch.device(args.device), max(1, args.repeats))
    if not args.skip_train:
        bench_training(args.updates, max(1, args.repeats), args.threads, args.max_tokens)


