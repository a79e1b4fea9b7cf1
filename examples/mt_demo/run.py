"""The offline MT demo: English->German on Ding example sentences and LibreOffice help pages.

    python -m examples.mt_demo.run [--quick] [--seeds 1 2] [--methods baseline agg mlra ...]

Steps: ``apt-get download`` the Debian packages trans-de-en, libreoffice-help-en-us and
libreoffice-help-de (once; cached) and unpack them with ``dpkg-deb -x``; extract the sentence
pairs (Ding: aligned example sentences; LibreOffice: paragraphs aligned by (file, id)); split
(Ding at random after de-duplication, LibreOffice by HTML file); a joint sentencepiece model;
fairseq-preprocess --joined-dictionary; one fairseq-train per method and seed with the same
model, data and number of updates; fairseq-generate (beam 4, length penalty 0.6) on the
held-out test set; sacreBLEU BLEU and chrF (with their signatures), in total and per source.

What the study (``study/``) uses, its public surface: the tables :data:`METHODS`, :data:`MODEL`,
:data:`BUDGET` and :data:`COMMON_TRAIN`, :func:`train_command` (one fairseq-train command from a
method, a model and a budget), :func:`prepare` (the corpus), :func:`quick_test_set`,
:func:`evaluate` (beam search and sacreBLEU) and :func:`final_valid_nll`.
"""
import os
import shutil
import sys
import time

from examples import textprep
from examples.demo_common import Demo, build_parser
from examples.mt_demo import data as mtdata
from study.harness import fairseq_commands
from study.harness.cli import check_args, exit_in_one_line
from study.harness.fairseq_commands import USER_DIR, console_script, preprocess, run_logged
from study.harness.progress import minutes, say
from study.harness.tables import write_json

MODEL = {
    "default": ["--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "128",
                "--decoder-embed-dim", "128", "--encoder-ffn-embed-dim", "512", "--decoder-ffn-embed-dim", "512",
                "--encoder-attention-heads", "4", "--decoder-attention-heads", "4"],
    "quick": ["--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "64",
              "--decoder-embed-dim", "64", "--encoder-ffn-embed-dim", "256", "--decoder-ffn-embed-dim", "256",
              "--encoder-attention-heads", "4", "--decoder-attention-heads", "4"],
}
BUDGET = {  # test_max: --quick scores this many evenly spaced test pairs
    # 3000 updates of ~1,860 target tokens reach ~12 sacreBLEU (seed 1; 10 near 1,800 updates), and
    # baseline + AGG fit in about 22 minutes on 2 idle cores: docs/results.md.
    "default": {"updates": 3000, "max_tokens": 2048, "warmup": 400, "test_max": None},
    "quick": {"updates": 80, "max_tokens": 1024, "warmup": 20, "test_max": 300},
}

COMMON_TRAIN = [
    "--task", "translation", "--source-lang", "en", "--target-lang", "de", "--share-all-embeddings",
    "--dropout", "0.1", "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--weight-decay", "0.01",
    "--clip-norm", "0.0", "--lr", "0.002", "--lr-scheduler", "inverse_sqrt", "--warmup-init-lr", "1e-07",
    "--required-batch-size-multiple", "1", "--no-epoch-checkpoints", "--no-save-optimizer-state",
    "--num-workers", "0", "--log-format", "simple", "--no-progress-bar",
]
LS = ["--label-smoothing", "0.1"]
METHODS = {
    "baseline": {"criterion": "label_smoothed_cross_entropy", "arch": "transformer", "args": LS,
                 "name": "baseline (label-smoothed cross-entropy)", "what": "stock label-smoothed CE (eps 0.1)"},
    "agg": {"criterion": "cross_entropy_agg", "arch": "transformer", "args": LS + ["--agg-alpha", "0.08"],
            "name": "AGG (adaptive gradient gating)",
            "what": "AGG, label smoothing 0.1, alpha 0.08 (the AGG paper's MT setting)"},
    "mlra": {"criterion": "label_smoothed_cross_entropy", "arch": "transformer_mlra", "args": LS,
             "name": "MLRA (low-rank attention)", "what": "label-smoothed CE on the MLRA transformer (low-rank Q/K/V)"},
    "agg+mlra": {"criterion": "cross_entropy_agg", "arch": "transformer_mlra", "args": LS + ["--agg-alpha", "0.08"],
                 "name": "AGG + MLRA", "what": "AGG on the MLRA transformer"},
    # rare-word remedies beside AGG (docs/baselines.md); not in the default list
    "face": {"criterion": "cross_entropy_face", "arch": "transformer", "args": LS,
             "name": "FACE (frequency-aware CE)",
             "what": "frequency-aware CE, pre-weighting of argmax counts, label smoothing 0.1 (Jiang et al. 2019)"},
    "antifocal": {"criterion": "cross_entropy_antifocal", "arch": "transformer", "args": LS + ["--antifocal-gamma", "1"],
                  "name": "anti-focal loss",
                  "what": "CE weighted by (1 + p_t)^gamma, gamma 1, label smoothing 0.1 (Raunak et al. 2020)"},
}
DEFAULT_METHODS = ["baseline", "agg"]  # two lanes: one round of runs

DEMO = Demo(
    tag="demo-mt", methods=METHODS, model=MODEL, budget=BUDGET, train_flags=COMMON_TRAIN,
    # per run: start-up, validation, beam search and scoring
    sec_per_update={"default": 0.42, "quick": 0.35}, sec_per_run={"default": 45.0, "quick": 30.0},
    sec_prepare=150.0, log_lines_per_run=10,
)


def train_command(method, data_bin, save_dir, seed, updates, cpu, *, model, budget, train_flags=None, data_flags=(),
                  log_lines=DEMO.log_lines_per_run):
    """fairseq-train's argument list of one translation run (the LM demo's ``train_command`` with
    this demo's defaults): ``method`` a :data:`METHODS` entry or a variant of one, ``model`` and
    ``budget`` (max_tokens, warmup) e.g. entries of :data:`MODEL` and :data:`BUDGET`, the shared
    ``train_flags`` (default :data:`COMMON_TRAIN`)."""
    flags = COMMON_TRAIN if train_flags is None else train_flags
    return fairseq_commands.train_command(method, model, flags, budget, data_bin, save_dir, seed, updates, cpu,
                                          data_flags, log_lines)


COLUMNS = [("bleu", "BLEU", 2), ("chrf", "chrF", 2), ("bleu_ding", "BLEU Ding", 2),
           ("bleu_libreoffice", "BLEU LO", 2), ("valid_nll", "valid nll", 3), ("rare_tokens", "rare tok", 0),
           ("train_seconds", "train s", 0)]


def parse_args(argv):
    description = (
        "Trains a small English-to-German transformer on Ding's example sentences and LibreOffice's\n"
        "help pages (Debian packages, fetched with apt-get download) once with fairseq's label-smoothed\n"
        "cross-entropy and once with each method, all with the same data, model and number of updates,\n"
        "then translates the held-out test pairs (beam 4) and prints sacreBLEU BLEU and chrF per method,\n"
        "in total and per source. Results and every run's log go to WORK_DIR (default demo_runs/mt).\n"
        "Details: docs/examples.md.")
    p = build_parser("python -m examples.mt_demo.run", description, METHODS, DEFAULT_METHODS,
                     os.path.join("demo_runs", "mt"),
                     os.path.join(os.path.expanduser("~"), ".cache", "fairseq-agg", "debian"),
                     quick_help="smaller model, budget and test subset")
    p.add_argument("--ding-file", help="a local Ding de-en file instead of the trans-de-en package")
    p.add_argument("--lo-help-dir", help="a local LibreOffice help root (with en-US/ and de/) instead of the packages")
    a = p.parse_args(argv)
    check_args(p, a)
    if bool(a.ding_file) != bool(a.lo_help_dir):
        p.error("--ding-file and --lo-help-dir go together (or neither: the Debian packages)")
    return a


def corpus_roots(a, data_dir):
    """(the Ding file, the LibreOffice help root with en-US/ and de/, {package: deb and sha256}):
    the local copies given on the command line, or the Debian packages (fetched once)."""
    if a.ding_file and a.lo_help_dir:
        return a.ding_file, a.lo_help_dir, {}
    pk = mtdata.fetch_packages(a.cache_dir, log=say)
    debs = {k: {"deb": v[2], "sha256": v[1]} for k, v in pk.items()}
    # both help packages unpack into usr/share/libreoffice/help/<lang>; merge the two roots
    lo_root = os.path.join(data_dir, "lo-help")
    os.makedirs(lo_root)
    for pkg, lang in (("libreoffice-help-en-us", "en-US"), ("libreoffice-help-de", "de")):
        os.symlink(os.path.join(os.path.abspath(pk[pkg][0]), mtdata.LO_HELP, lang), os.path.join(lo_root, lang))
    return os.path.join(pk["trans-de-en"][0], mtdata.DING_FILE), lo_root, debs


def write_raw_splits(splits, raw):
    """RAW/SPLIT.{en,de,source}, one pair a line; returns the counts of each split."""
    os.makedirs(raw)
    counts = {}
    for split, rows in splits.items():
        for k, ext in ((0, "en"), (1, "de"), (2, "source")):
            with open(os.path.join(raw, f"{split}.{ext}"), "w", encoding="utf-8") as f:
                f.write("".join(r[k] + "\n" for r in rows))
        counts[split] = {"pairs": len(rows), "ding": sum(r[2] == "ding" for r in rows),
                         "libreoffice": sum(r[2] == "libreoffice" for r in rows),
                         "en_words": sum(len(r[0].split()) for r in rows)}
        say(f"[demo-mt] {split:5s}: {len(rows):6d} pairs ({counts[split]['ding']} Ding, "
            f"{counts[split]['libreoffice']} LibreOffice), {counts[split]['en_words']} English words")
    return counts


def prepare(a, env):
    """Pairs -> joint sentencepiece -> cleaning -> fairseq-preprocess; cached under WORK_DIR/data."""
    data_dir = os.path.join(a.work_dir, "data")
    source = {"ding": a.ding_file or "debian:trans-de-en", "lo": a.lo_help_dir or "debian:libreoffice-help"}
    info = DEMO.reuse_prepared(data_dir, source, a.vocab_size)
    if info is not None:
        return data_dir, info
    os.makedirs(data_dir)
    ding_file, lo_root, debs = corpus_roots(a, data_dir)
    say("[demo-mt] extracting sentence pairs (Ding example sentences, LibreOffice paragraphs by id)")
    splits = mtdata.split_all(mtdata.ding_pairs(ding_file), mtdata.lo_pairs(lo_root))
    raw = os.path.join(data_dir, "raw")
    counts = write_raw_splits(splits, raw)
    say(f"[demo-mt] training a joint sentencepiece model (BPE, {a.vocab_size} pieces)")
    spm = textprep.spm_train([os.path.join(raw, "train.en"), os.path.join(raw, "train.de")],
                             os.path.join(data_dir, "spm"), a.vocab_size, threads=max(a.jobs, a.threads))
    ins = [os.path.join(raw, f"{s}.{l}") for s in ("train", "valid", "test") for l in ("en", "de")]
    outs = [os.path.join(data_dir, f"{s}.spm.{l}") for s in ("train", "valid", "test") for l in ("en", "de")]
    textprep.spm_encode(spm, ins, outs)
    kept, total = textprep.clean_corpus(*[os.path.join(data_dir, f"train.spm.{l}") for l in ("en", "de")],
                                        *[os.path.join(data_dir, f"train.clean.{l}") for l in ("en", "de")])
    say(f"[demo-mt] cleaning (1..250 pieces, ratio 1.5) kept {kept} of {total} training pairs")
    preprocess(["--source-lang", "en", "--target-lang", "de", "--trainpref", os.path.join(data_dir, "train.clean"),
                "--validpref", os.path.join(data_dir, "valid.spm"), "--testpref", os.path.join(data_dir, "test.spm"),
                "--destdir", os.path.join(data_dir, "data-bin"), "--joined-dictionary",
                "--workers", str(max(a.jobs, a.threads))], data_dir, env)
    info = {"source": source, "vocab": a.vocab_size, "splits": counts, "debs": debs, "train_kept": kept}
    write_json(os.path.join(data_dir, "done.json"), info)
    return data_dir, info


def quick_test_set(data_dir, test_max, env):
    """A directory like DATA_DIR whose test split is TEST_MAX evenly spaced test pairs (both
    sources), binarised with the full data's dictionary; made once."""
    sub = os.path.join(data_dir, f"quick-test-{test_max}")
    if os.path.isdir(sub):
        return sub
    os.makedirs(os.path.join(sub, "raw"))
    for ext in ("en", "de", "source"):
        with open(os.path.join(data_dir, "raw", f"test.{ext}"), encoding="utf-8") as f:
            lines = f.readlines()
        step = max(1, len(lines) // test_max)
        with open(os.path.join(sub, "raw", f"test.{ext}"), "w", encoding="utf-8") as f:
            f.writelines(lines[::step][:test_max])
    shutil.copy(os.path.join(data_dir, "spm.model"), sub)
    textprep.spm_encode(os.path.join(sub, "spm.model"),
                        [os.path.join(sub, "raw", "test.en"), os.path.join(sub, "raw", "test.de")],
                        [os.path.join(sub, "test.spm.en"), os.path.join(sub, "test.spm.de")])
    preprocess(["--source-lang", "en", "--target-lang", "de", "--testpref", os.path.join(sub, "test.spm"),
                "--destdir", os.path.join(sub, "data-bin"), "--srcdict",
                os.path.join(data_dir, "data-bin", "dict.en.txt"), "--joined-dictionary"], sub, env, show=False)
    for f in ("dict.en.txt", "dict.de.txt"):
        shutil.copy(os.path.join(data_dir, "data-bin", f), os.path.join(sub, "data-bin", f))
    return sub


def score(hyps, refs, sources):
    import sacrebleu

    bleu, chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
    out = {"bleu": bleu.corpus_score(hyps, [refs]).score, "chrf": chrf.corpus_score(hyps, [refs]).score,
           "bleu_signature": f"BLEU|{bleu.get_signature()}", "chrf_signature": f"chrF2|{chrf.get_signature()}"}
    for src in ("ding", "libreoffice"):
        idx = [i for i, s in enumerate(sources) if s == src]
        if idx:
            out[f"bleu_{src}"] = sacrebleu.metrics.BLEU().corpus_score([hyps[i] for i in idx], [[refs[i] for i in idx]]).score
    return out


def read_lines(path):
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def evaluate(label, ckpt, data_dir, out_dir, env, cpu):
    """Beam search on DATA_DIR's test split, sentencepiece decoding and sacreBLEU."""
    gen = os.path.join(out_dir, "generate.out")
    cmd = [console_script("fairseq-generate"), os.path.join(data_dir, "data-bin"), "--user-dir", USER_DIR,
           "--task", "translation", "--source-lang", "en", "--target-lang", "de", "--path", ckpt,
           "--gen-subset", "test", "--beam", "4", "--lenpen", "0.6", "--batch-size", "64",
           "--required-batch-size-multiple", "1", "--max-len-a", "1.5", "--max-len-b", "10"]
    if cpu:
        cmd.append("--cpu")
    rc, lines, wall = run_logged(cmd, gen, f"[{label} generate] ", env, show=False)
    if rc != 0:
        raise RuntimeError(f"fairseq-generate failed for {label}; see {gen}")
    sp = textprep.spm_processor(os.path.join(data_dir, "spm.model"))
    hyps = [sp.decode_pieces(h.split()) for h in textprep.read_generate(gen, "H")]
    refs = read_lines(os.path.join(data_dir, "raw", "test.de"))
    sources = read_lines(os.path.join(data_dir, "raw", "test.source"))
    if len(hyps) != len(refs):
        raise RuntimeError(f"{label}: {len(hyps)} hypotheses for {len(refs)} references")
    with open(os.path.join(out_dir, "hyp.txt"), "w", encoding="utf-8") as f:
        f.write("".join(h + "\n" for h in hyps))
    res = score(hyps, refs, sources)
    res["generate_seconds"] = wall
    return res


def final_valid_nll(lines):
    """nll_loss of the last '| valid |' line of a fairseq-train log (None without one)."""
    valid_nll = None
    for line in lines:
        if "| valid |" in line:
            parts = dict(kv.strip().split(" ", 1) for kv in line.split("|")[3:] if " " in kv.strip())
            valid_nll = float(parts.get("nll_loss", "nan"))
    return valid_nll


def train_and_score_all(a, plan, data_dir, eval_dir):
    """Trains every method and seed, side by side, and scores each run: {label: (method, scores)}."""

    def one_run(method, seed):
        run = DEMO.train(a, plan, method, seed, os.path.join(data_dir, "data-bin"))
        say(f"[demo-mt] {run.label}: beam search on the test set")
        res = evaluate(run.label, run.checkpoint, eval_dir, run.save_dir, plan.env, a.cpu)
        res.update(train_seconds=run.train_seconds, valid_nll=final_valid_nll(run.lines),
                   rare_tokens=run.rare_tokens)
        DEMO.finished(plan, run.label, f"BLEU {res['bleu']:.2f}, chrF {res['chrf']:.2f}")
        return run, res

    return {run.label: (run.method, res) for run, res in DEMO.run_side_by_side(one_run, a, plan)}


def report(a, plan, info, scored, eval_dir):
    """The table and results.json."""
    methods, out_dir = plan.methods, plan.out_dir
    results = {m: [] for m in methods}
    for method, res in scored.values():
        results[method].append(res)
    per_run = {label: res for label, (_, res) in scored.items()}
    os.makedirs(out_dir, exist_ok=True)
    n_test = len(read_lines(os.path.join(eval_dir, "raw", "test.de")))
    first = per_run[next(iter(per_run))]
    say("")
    say(f"[demo-mt] En->De after {plan.updates} updates per run, seeds {a.seeds} (mean ± half the range); "
        f"test set: {n_test} held-out pairs")
    say(f"[demo-mt] {first['bleu_signature']}")
    say(f"[demo-mt] {first['chrf_signature']}")
    DEMO.write_results(a, plan, info, results, COLUMNS, runs=per_run, test_pairs=n_test)


def main(argv=None):
    a = parse_args(argv)
    plan = DEMO.plan(a)
    data_dir, info = DEMO.prepare_data(prepare, a, plan)
    if a.prepare_only:
        return 0
    test_max = plan.budget["test_max"]
    eval_dir = quick_test_set(data_dir, test_max, plan.env) if test_max else data_dir
    scored = train_and_score_all(a, plan, data_dir, eval_dir)
    report(a, plan, info, scored, eval_dir)
    say(f"[demo-mt] total time {minutes(time.time() - plan.t_start)}")
    return 0


if __name__ == "__main__":
    sys.exit(exit_in_one_line(main))
