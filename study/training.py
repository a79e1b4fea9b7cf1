"""Training and evaluating a part's runs (study/run.py plans them): what one invocation shares
(:class:`Context`: the flags, the child processes' environment, each corpus prepared once), one
run from run.json to result.json (:func:`execute`; :func:`train` resumes an interrupted one), and
a part's unfinished runs ``--jobs`` at a time (:func:`run_part`)."""
import os
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

from examples.lm_demo import wordsim
from fairseq_agg.fairseq_facts.checkpoint_files import checkpoint_updates, readable_checkpoint
from study import report as R
from study import store
from study import trajectory as TJ
from study.harness.corpus_cache import DataUnavailable
from study.harness.fairseq_logs import done_seconds, last_train_stats, train_curve
from study.harness.fairseq_commands import child_env, quiet_fairseq_logging, run_logged
from study.harness.progress import minutes, say
from study.metrics import resumed_log, valid_curve

TAG = "[study]"


class Context:
    """What every run of one invocation shares."""

    def __init__(self, a):
        self.a = a
        self.env = child_env(a.threads)
        self.data = {}  # corpus -> (data-bin, data stamp)
        self.eval_dir = None  # MT: the directory scored by beam search
        self.word_sim = {}  # corpus -> fairseq-agg-analyze's --word-sim flags

    def prepare(self, corpus, budget):
        """The corpus's preparation (cached in WORK/_data/CORPUS), once per corpus; then what its
        runs' evaluation needs: the test set scored (translation) or the word lists."""
        if corpus.name in self.data:
            return
        quiet_fairseq_logging()
        a = self.a
        ns = corpus.namespace(a)
        os.makedirs(ns.work_dir, exist_ok=True)
        say(f"{TAG} preparing the {corpus.owner}'s data in {ns.work_dir}")
        try:
            path, info = corpus.prepare(ns, self.env)
        except DataUnavailable as e:
            raise SystemExit(f"{TAG} the {corpus.name.upper()} corpus is not available on this system: {e}")
        self.data[corpus.name] = (corpus.data_bin(a.work_dir), info)
        if corpus.test_subset:
            test_max = budget.get("test_max")
            self.eval_dir = corpus.test_subset(path, test_max, self.env) if test_max else path
        if corpus.word_sim_flags:
            # the LM demo's word lists (fetched once; None after a one-line notice when they cannot be)
            # and the --word-sim ones, as the corpus's tokens need them
            lists = ([] if a.no_word_sim else wordsim.fetch_word_sim_files(a.cache_dir, log=say) or []) + a.word_sim
            self.word_sim[corpus.name] = corpus.word_sim_flags(lists, ns.work_dir)


def train(ctx, part, budget, spec, directory, cmd, key):
    """fairseq-train of one run; returns its attempts (``attempts.json``). A run that an earlier
    invocation left unfinished resumes where it can (store.resumable_attempts: the same flags, an
    intact checkpoint) from its newest validation checkpoint (store.resume_checkpoint), its log
    continuing in train.log; any other starts from scratch."""
    attempts = store.resumable_attempts(directory, key, readable_checkpoint)
    ckpt = os.path.join(directory, store.LAST_CHECKPOINT)
    if attempts is None:
        attempts = []
        store.start_clean(directory)
        data_bin, stamp = ctx.data[spec.corpus.name]
        store.write_json_atomic(os.path.join(directory, store.RUN_JSON), {
            "part": part.name, "run_id": spec.run_id, "name": spec.name, "seed": spec.seed, "group": spec.group,
            "what": spec.method.get("what"), "budget": ctx.a.budget, "updates": budget["updates"], "command": cmd,
            "key": key, "data": {"data_bin": data_bin, "stamp": stamp}, "git": store.git_state(),
            "started": time.time(),
        })
    elif checkpoint_updates(ckpt) >= budget["updates"]:
        # trained to the end, stopped before its result: fairseq-train would take one more update
        # before it checks --max-update
        say(f"{TAG} {part.name}: {spec.run_id} was trained to the end; evaluating its {store.LAST_CHECKPOINT}")
        return attempts
    else:
        restore = store.resume_checkpoint(directory, readable_checkpoint)
        say(f"{TAG} {part.name}: {spec.run_id} resumes from its {os.path.basename(restore)} (attempt {len(attempts) + 1})")
        cmd = [*cmd, "--restore-file", restore]
    attempts.append({"started": time.time(), "ended": None})
    store.write_json_atomic(os.path.join(directory, store.ATTEMPTS_JSON), attempts)
    log = os.path.join(directory, "train.log")
    rc, lines, _ = run_logged(cmd, log, f"[{part.name}/{spec.run_id}] ", ctx.env, show=ctx.a.verbose,
                              append=len(attempts) > 1)
    attempts[-1]["ended"] = time.time()
    store.write_json_atomic(os.path.join(directory, store.ATTEMPTS_JSON), attempts)
    if rc != 0 or not os.path.isfile(ckpt):
        tail = "\n".join(lines[-20:])
        raise RuntimeError(f"fairseq-train failed for {part.name}/{spec.run_id} (log {log}):\n{tail}")
    return attempts


def execute(ctx, part, budget, spec, directory, cmd, key):
    """One run: run.json, fairseq-train (:func:`train`), the evaluation, result.json."""
    attempts = train(ctx, part, budget, spec, directory, cmd, key)
    ckpt = os.path.join(directory, store.LAST_CHECKPOINT)
    with open(os.path.join(directory, "train.log"), encoding="utf-8") as f:  # every attempt's lines, each update once
        lines = resumed_log(f.read().splitlines(), " ".join(cmd))
    seconds = [a["ended"] - a["started"] for a in attempts]
    evaluation_started = time.time()
    stats = last_train_stats(lines)
    result = {
        "part": part.name, "run_id": spec.run_id, "name": spec.name, "seed": spec.seed, "group": spec.group,
        "updates": budget["updates"], "attempts": len(attempts), "train_wall_seconds": sum(seconds),
        # fairseq's own training time of the last attempt, plus the whole time of the killed ones
        "train_seconds": sum(seconds[:-1]) + (done_seconds(lines) or seconds[-1]),
        "rare_tokens": float(stats["agg_rare"]) if "agg_rare" in stats else None, "last_train": stats,
        # train_loss is what the criterion optimises (its spikes); train_nll the plain cross-entropy
        # the figures compare ([] where a stock criterion logs no nll_loss: its loss is that)
        "curves": {"train_loss": train_curve(lines, "loss"), "train_nll": train_curve(lines, "nll_loss"),
                   "gnorm": train_curve(lines, "gnorm"), "valid_ppl": valid_curve(lines, "ppl"),
                   "valid_loss": valid_curve(lines, "loss")},
    }
    result["metrics"] = part.evaluate(ctx, spec, budget, directory, ckpt, lines)
    if part.corpus.language_model:
        result["metrics"]["valid_ppl"] = result["curves"]["valid_ppl"][-1][1] if result["curves"]["valid_ppl"] else None
    result["wall_seconds"] = sum(seconds) + time.time() - evaluation_started
    if ctx.a.epoch_checkpoints and part.groupings:  # the run's trajectory over its epochs, before result.json
        store.write_json_atomic(os.path.join(directory, TJ.TRAJECTORY_JSON), TJ.trajectory(directory))
    store.write_json_atomic(os.path.join(directory, store.RESULT_JSON), result)
    store.remove_interval_checkpoints(directory)
    return result


def run_part(ctx, part, budget, entries):
    """Trains and evaluates the part's unfinished runs, ``--jobs`` at a time, and records the
    invocation's wall time (store.record_invocation); returns the failures."""
    started = time.time()
    pending = [e for e in entries if e[4] is None]
    done = len(entries) - len(pending)
    if done:
        say(f"{TAG} {part.name}: {done} of {len(entries)} runs already finished (skipped)")
    if not pending:
        return []
    ctx.prepare(part.corpus, budget)
    lanes = min(ctx.a.jobs, len(pending))
    say(f"{TAG} {part.name}: {len(pending)} run(s) of {budget['updates']} updates to do, {lanes} at a time")
    t0, failures, finished = time.time(), [], 0

    def one(entry):
        spec, d, cmd, key, _ = entry
        say(f"{TAG} {part.name}: start {spec.run_id} ({spec.method.get('what')})")
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
                say(f"{TAG} {part.name}: FAILED {spec.run_id}: {str(e).splitlines()[0]}")
                continue
            eta = (time.time() - t0) / finished * (len(pending) - finished)
            say(f"{TAG} {part.name}: done {spec.run_id} ({finished} of {len(pending)}) in {res['wall_seconds']:.0f} s: "
                f"{R.headline(part, res)}; about {minutes(eta)} left in this part")
    store.record_invocation(os.path.join(ctx.a.work_dir, part.name), time.time() - started, len(pending))
    return failures
