"""The offline MT demo: English->German on Ding example sentences and LibreOffice help pages.

    python -m examples.demo_mt.run [--quick] [--seeds 1 2] [--methods baseline agg mlra ...]

Steps: ``apt-get download`` the Debian packages trans-de-en, libreoffice-help-en-us and
libreoffice-help-de (once; cached) and unpack them with ``dpkg-deb -x``; extract the sentence
pairs (Ding: aligned example sentences; LibreOffice: paragraphs aligned by (file, id)); split
(Ding at random after de-duplication, LibreOffice by HTML file); a joint sentencepiece model;
fairseq-preprocess --joined-dictionary; one fairseq-train per method and seed with the same
model, data and number of updates; fairseq-generate (beam 4, length penalty 0.6) on the
held-out test set; sacreBLEU BLEU and chrF (with their signatures), in total and per source.
"""
import argparse
import json
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from examples.demo.common import (
    USER_DIR,
    console_script,
    done_seconds,
    fmt,
    last_train_stats,
    markdown_table,
    minutes,
    print_table,
    run_settings,
    runnable_methods,
    run_logged,
    say,
    textprep,
    write_json,
)
from examples.demo_mt import data as mtdata

VOCAB = 4000
MODEL = {
    "default": ["--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "128",
                "--decoder-embed-dim", "128", "--encoder-ffn-embed-dim", "512", "--decoder-ffn-embed-dim", "512",
                "--encoder-attention-heads", "4", "--decoder-attention-heads", "4"],
    "quick": ["--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "64",
              "--decoder-embed-dim", "64", "--encoder-ffn-embed-dim", "256", "--decoder-ffn-embed-dim", "256",
              "--encoder-attention-heads", "4", "--decoder-attention-heads", "4"],
}
BUDGET = {
    "default": {"updates": 300, "max_tokens": 1024, "warmup": 75, "test_max": None},
    "quick": {"updates": 80, "max_tokens": 1024, "warmup": 20, "test_max": 300},
}
SEC_PER_UPDATE = {"default": 0.9, "quick": 0.35}
SEC_PER_RUN = {"default": 90.0, "quick": 30.0}  # start-up, validation, beam search, scoring
SEC_PREPARE = 150.0

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
                 "what": "stock label-smoothed CE (eps 0.1)"},
    "agg": {"criterion": "cross_entropy_agg", "arch": "transformer", "args": LS + ["--agg-alpha", "0.08"],
            "what": "AGG, label smoothing 0.1, alpha 0.08 (the AGG paper's MT setting)"},
    "mlra": {"criterion": "label_smoothed_cross_entropy", "arch": "transformer_mlra", "args": LS,
             "what": "label-smoothed CE on the MLRA transformer (low-rank Q/K/V)"},
    "agg+mlra": {"criterion": "cross_entropy_agg", "arch": "transformer_mlra", "args": LS + ["--agg-alpha", "0.08"],
                 "what": "AGG on the MLRA transformer"},
}
DEFAULT_METHODS = ["baseline", "agg", "mlra"]


def build_parser():
    p = argparse.ArgumentParser(prog="python -m examples.demo_mt.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smaller model, budget and test subset")
    p.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, choices=list(METHODS))
    p.add_argument("--seeds", nargs="+", type=int, default=[1])
    p.add_argument("--updates", type=int, help="updates per run (overrides the budget)")
    p.add_argument("--jobs", type=int, default=max(1, min(2, os.cpu_count() or 1)), help="runs at a time")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per run (default 1)")
    p.add_argument("--work-dir", default=os.path.join("demo_runs", "mt"))
    p.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "fairseq-agg", "debian"))
    p.add_argument("--ding-file", help="a local Ding de-en file instead of the trans-de-en package")
    p.add_argument("--lo-help-dir", help="a local LibreOffice help root (with en-US/ and de/) instead of the packages")
    p.add_argument("--vocab-size", type=int, default=VOCAB,
                   help=f"sentencepiece vocabulary (default {VOCAB}; smaller for tiny test corpora)")
    p.add_argument("--prepare-only", action="store_true")
    p.add_argument("--cpu", action="store_true")
    return p


def prepare(a, env):
    data_dir = os.path.join(a.work_dir, "data")
    stamp = os.path.join(data_dir, "done.json")
    source = {"ding": a.ding_file or "debian:trans-de-en", "lo": a.lo_help_dir or "debian:libreoffice-help"}
    if os.path.isfile(stamp):
        with open(stamp) as f:
            info = json.load(f)
        if info.get("source") == source and info.get("vocab") == a.vocab_size:
            say(f"[demo-mt] using the prepared data in {data_dir}")
            return data_dir, info
    shutil.rmtree(data_dir, ignore_errors=True)
    os.makedirs(data_dir)
    debs = {}
    if not (a.ding_file and a.lo_help_dir):
        pk = mtdata.fetch_packages(a.cache_dir, log=say)
        debs = {k: {"deb": v[2], "sha256": v[1]} for k, v in pk.items()}
    ding_file = a.ding_file or os.path.join(pk["trans-de-en"][0], mtdata.DING_FILE)
    if a.lo_help_dir:
        lo_root = a.lo_help_dir
    else:
        # both help packages unpack into usr/share/libreoffice/help/<lang>; merge the two roots
        lo_root = os.path.join(data_dir, "lo-help")
        os.makedirs(lo_root)
        for pkg, lang in (("libreoffice-help-en-us", "en-US"), ("libreoffice-help-de", "de")):
            os.symlink(os.path.join(os.path.abspath(pk[pkg][0]), mtdata.LO_HELP, lang), os.path.join(lo_root, lang))
    say("[demo-mt] extracting sentence pairs (Ding example sentences, LibreOffice paragraphs by id)")
    ding = mtdata.ding_pairs(ding_file)
    lo = mtdata.lo_pairs(lo_root)
    splits = mtdata.split_all(ding, lo)
    raw = os.path.join(data_dir, "raw")
    os.makedirs(raw)
    counts = {}
    for split, rows in splits.items():
        for k, lang in ((0, "en"), (1, "de")):
            textprep_lines = [r[k] for r in rows]
            with open(os.path.join(raw, f"{split}.{lang}"), "w", encoding="utf-8") as f:
                f.write("".join(t + "\n" for t in textprep_lines))
        with open(os.path.join(raw, f"{split}.source"), "w", encoding="utf-8") as f:
            f.write("".join(r[2] + "\n" for r in rows))
        counts[split] = {"pairs": len(rows), "ding": sum(r[2] == "ding" for r in rows),
                         "libreoffice": sum(r[2] == "libreoffice" for r in rows),
                         "en_words": sum(len(r[0].split()) for r in rows)}
        say(f"[demo-mt] {split:5s}: {len(rows):6d} pairs ({counts[split]['ding']} Ding, "
            f"{counts[split]['libreoffice']} LibreOffice), {counts[split]['en_words']} English words")
    say(f"[demo-mt] training a joint sentencepiece model (BPE, {a.vocab_size} pieces)")
    spm = textprep.spm_train([os.path.join(raw, "train.en"), os.path.join(raw, "train.de")],
                             os.path.join(data_dir, "spm"), a.vocab_size, threads=max(a.jobs, a.threads))
    ins = [os.path.join(raw, f"{s}.{l}") for s in ("train", "valid", "test") for l in ("en", "de")]
    outs = [os.path.join(data_dir, f"{s}.spm.{l}") for s in ("train", "valid", "test") for l in ("en", "de")]
    textprep.spm_encode(spm, ins, outs)
    kept, total = textprep.clean_corpus(*[os.path.join(data_dir, f"train.spm.{l}") for l in ("en", "de")],
                                        *[os.path.join(data_dir, f"train.clean.{l}") for l in ("en", "de")])
    say(f"[demo-mt] cleaning (1..250 pieces, ratio 1.5) kept {kept} of {total} training pairs")
    rc, lines, _ = run_logged(
        [console_script("fairseq-preprocess"), "--source-lang", "en", "--target-lang", "de",
         "--trainpref", os.path.join(data_dir, "train.clean"), "--validpref", os.path.join(data_dir, "valid.spm"),
         "--testpref", os.path.join(data_dir, "test.spm"), "--destdir", os.path.join(data_dir, "data-bin"),
         "--joined-dictionary", "--workers", str(max(a.jobs, a.threads))],
        os.path.join(data_dir, "preprocess.log"), "[preprocess] ", env)
    if rc != 0:
        raise SystemExit(f"fairseq-preprocess failed; see {data_dir}/preprocess.log")
    info = {"source": source, "vocab": a.vocab_size, "splits": counts, "debs": debs, "train_kept": kept}
    with open(stamp, "w") as f:
        json.dump(info, f)
    return data_dir, info


def train_cmd(method, data_bin, save_dir, seed, mode, budget, updates, cpu):
    m = METHODS[method]
    cmd = [console_script("fairseq-train"), data_bin, "--user-dir", USER_DIR, "--arch", m["arch"],
           "--criterion", m["criterion"], *m["args"], *MODEL[mode], *COMMON_TRAIN,
           "--max-tokens", str(budget["max_tokens"]), "--warmup-updates", str(min(budget["warmup"], max(1, updates // 4))),
           "--max-update", str(updates), "--seed", str(seed), "--save-dir", save_dir,
           "--log-interval", str(max(10, updates // 10))]
    if cpu:
        cmd.append("--cpu")
    return cmd


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


def evaluate(label, ckpt, data_dir, out_dir, env, test_max, cpu):
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
    hyps = [textprep._processor(os.path.join(data_dir, "spm.model")).decode_pieces(h.split())
            for h in textprep.read_generate(gen, "H")]
    with open(os.path.join(data_dir, "raw", "test.de"), encoding="utf-8") as f:
        refs = [l.rstrip("\n") for l in f]
    with open(os.path.join(data_dir, "raw", "test.source"), encoding="utf-8") as f:
        sources = [l.rstrip("\n") for l in f]
    if len(hyps) != len(refs):
        raise RuntimeError(f"{label}: {len(hyps)} hypotheses for {len(refs)} references")
    with open(os.path.join(out_dir, "hyp.txt"), "w", encoding="utf-8") as f:
        f.write("".join(h + "\n" for h in hyps))
    res = score(hyps, refs, sources)
    res["generate_seconds"] = wall
    return res


COLUMNS = [("bleu", "BLEU", 2), ("chrf", "chrF", 2), ("bleu_ding", "BLEU Ding", 2),
           ("bleu_libreoffice", "BLEU LO", 2), ("valid_nll", "valid nll", 3), ("rare_tokens", "rare tok", 0),
           ("train_seconds", "train s", 0)]


def main(argv=None):
    p = build_parser()
    a = p.parse_args(argv)
    if a.updates is not None and a.updates < 1:
        p.error(f"--updates must be >= 1, got {a.updates}")
    if a.jobs < 1 or a.threads < 1:
        p.error("--jobs and --threads must be >= 1")
    if a.vocab_size < 50:
        p.error(f"--vocab-size must be >= 50, got {a.vocab_size}")
    if bool(a.ding_file) != bool(a.lo_help_dir):
        p.error("--ding-file and --lo-help-dir go together (or neither: the Debian packages)")
    mode, budget, updates, env = run_settings(a, BUDGET)
    methods, skipped = runnable_methods(a.methods, METHODS, "demo-mt")
    jobs = [(m, s) for s in a.seeds for m in methods]
    lanes = min(a.jobs, len(jobs))
    prepared = os.path.isfile(os.path.join(a.work_dir, "data", "done.json"))
    est = -(-len(jobs) // lanes) * (updates * SEC_PER_UPDATE[mode] + SEC_PER_RUN[mode]) + (0 if prepared else SEC_PREPARE)
    say(f"[demo-mt] {mode} budget: {len(methods)} methods x {len(a.seeds)} seed(s), {updates} updates of "
        f"{budget['max_tokens']} tokens each, {lanes} run(s) at a time")
    say(f"[demo-mt] this will take about {minutes(est)} on 2 CPU cores; fairseq's own log lines follow")
    t0 = time.time()
    try:
        data_dir, info = prepare(a, env)
    except mtdata.DataUnavailable as e:
        raise SystemExit(f"[demo-mt] the MT data is not available on this system: {e}")
    if a.prepare_only:
        return 0
    test_max = budget["test_max"]
    if test_max:
        # --quick scores N evenly spaced test pairs (both sources), rewritten as a smaller test split
        sub = os.path.join(data_dir, f"quick-test-{test_max}")
        if not os.path.isdir(sub):
            os.makedirs(os.path.join(sub, "raw"))
            for ext in ("en", "de", "source"):
                with open(os.path.join(data_dir, "raw", f"test.{ext}"), encoding="utf-8") as f:
                    lines = f.readlines()
                step = max(1, len(lines) // test_max)
                lines = lines[::step][:test_max]
                with open(os.path.join(sub, "raw", f"test.{ext}"), "w", encoding="utf-8") as f:
                    f.writelines(lines)
            shutil.copy(os.path.join(data_dir, "spm.model"), sub)
            textprep.spm_encode(os.path.join(sub, "spm.model"), [os.path.join(sub, "raw", "test.en"), os.path.join(sub, "raw", "test.de")],
                                [os.path.join(sub, "test.spm.en"), os.path.join(sub, "test.spm.de")])
            run_logged([console_script("fairseq-preprocess"), "--source-lang", "en", "--target-lang", "de",
                        "--testpref", os.path.join(sub, "test.spm"), "--destdir", os.path.join(sub, "data-bin"),
                        "--srcdict", os.path.join(data_dir, "data-bin", "dict.en.txt"), "--joined-dictionary"],
                       os.path.join(sub, "preprocess.log"), "[preprocess] ", env, show=False)
            for f in ("dict.en.txt", "dict.de.txt"):
                shutil.copy(os.path.join(data_dir, "data-bin", f), os.path.join(sub, "data-bin", f))
        eval_dir = sub
    else:
        eval_dir = data_dir

    runs_dir = os.path.join(a.work_dir, f"runs-{mode}")

    def one(job):
        m, seed = job
        label = f"{m}-s{seed}"
        save_dir = os.path.join(runs_dir, label)
        shutil.rmtree(save_dir, ignore_errors=True)
        os.makedirs(save_dir)
        say(f"[demo-mt] === {label}: {METHODS[m]['what']} ===")
        rc, lines, wall = run_logged(train_cmd(m, os.path.join(data_dir, "data-bin"), save_dir, seed, mode, budget,
                                               updates, a.cpu), os.path.join(save_dir, "train.log"), f"[{label}] ", env)
        ckpt = os.path.join(save_dir, "checkpoint_last.pt")
        if rc != 0 or not os.path.isfile(ckpt):
            raise RuntimeError(f"fairseq-train failed for {label}:\n" + "\n".join(lines[-20:]))
        stats = last_train_stats(lines)
        valid_nll = None
        for line in lines:
            if "| valid |" in line:
                parts = dict(kv.strip().split(" ", 1) for kv in line.split("|")[3:] if " " in kv.strip())
                valid_nll = float(parts.get("nll_loss", "nan"))
        say(f"[demo-mt] {label}: beam search on the test set")
        res = evaluate(label, ckpt, eval_dir, save_dir, env, test_max, a.cpu)
        res.update(train_seconds=done_seconds(lines) or wall, valid_nll=valid_nll,
                   rare_tokens=float(stats["agg_rare"]) if "agg_rare" in stats else None)
        say(f"[demo-mt] === {label}: BLEU {res['bleu']:.2f}, chrF {res['chrf']:.2f} ===")
        return label, m, res

    results = {m: [] for m in methods}
    per_run = {}
    with ThreadPoolExecutor(max_workers=lanes) as pool:
        try:
            for label, m, res in pool.map(one, jobs):
                results[m].append(res)
                per_run[label] = res
        except RuntimeError as e:
            raise SystemExit(f"[demo-mt] {e}")

    out_dir = os.path.join(a.work_dir, f"results-{mode}")
    os.makedirs(out_dir, exist_ok=True)
    headers = ["method"] + [h for _, h, _ in COLUMNS]
    rows = [[m] + [fmt([r.get(k) for r in results[m]], d) for k, _, d in COLUMNS] for m in methods]
    n_test = sum(1 for _ in open(os.path.join(eval_dir, "raw", "test.de"), encoding="utf-8"))
    say("")
    say(f"[demo-mt] En->De after {updates} updates per run, seeds {a.seeds} (mean ± half the range); "
        f"test set: {n_test} held-out pairs")
    say(f"[demo-mt] {per_run[next(iter(per_run))]['bleu_signature']}")
    say(f"[demo-mt] {per_run[next(iter(per_run))]['chrf_signature']}")
    print_table(headers, rows, out=os.path.join(out_dir, "table.txt"))
    write_json(os.path.join(out_dir, "results.json"), {
        "mode": mode, "updates": updates, "seeds": a.seeds, "methods": methods, "data": info, "model": MODEL[mode],
        "budget": budget, "results": results, "runs": per_run, "test_pairs": n_test,
        "skipped": skipped,
        "markdown": markdown_table(headers, rows), "total_seconds": time.time() - t0})
    say(f"[demo-mt] table and numbers: {out_dir}/table.txt, {out_dir}/results.json; total time {minutes(time.time() - t0)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
