"""The skeleton of the two offline demos (the LM demo ``examples.lm_demo.run`` and the MT demo
``examples.mt_demo.run``): their shared command line (:func:`build_parser`), the plan of one
invocation (:class:`Plan`: budget, methods, "run k of N" and the time left) and the shared steps
of a :class:`Demo`: fairseq-train runs side by side with their progress lines streamed to the
terminal (every line in each run's log file; all of them on the terminal with ``--verbose``), and
the result table with ``results.json``.

Each demo describes itself with a :class:`Demo` (methods, model, budget, training flags, time
estimates) and keeps only what is its own: its corpus, its evaluation and its table. The helpers
the demos share with the study (downloads, fairseq's processes and logs, progress, tables) are in
``study/harness/``.
"""
import argparse
import dataclasses
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional

from fairseq_agg.files import atomic_output

from study.harness.cli import VOCAB
from study.harness.corpus_cache import DataUnavailable, reuse_prepared
from study.harness.fairseq_logs import done_seconds, last_train_stats
from study.harness.fairseq_commands import (PROGRESS_LINES, Console, child_env, registered_methods, run_logged,
                                           train_command)
from study.harness.progress import Progress, minutes, say, time_left
from study.harness.tables import markdown_table, mean_spread, print_table, result_rows, write_json


BASELINE = "baseline"
ARROWS = {"down": " ↓", "up": " ↑"}
DELTA_LEGEND = ("Δ % = (method − baseline) / baseline × 100, of the means over seeds; a change no larger than "
                "the two half-ranges together is \"within the seed spread\"")


def comparison_text(methods, results, columns, better, names):
    """Each method's change against the baseline, in % of the baseline's mean, on the columns
    ``better`` gives a direction ("up" or "down"), and a verdict line per method from those changes."""
    keys = [(k, h) for k, h, _ in columns if k in better]
    base = {k: mean_spread([r.get(k) for r in results[BASELINE]]) for k, _ in keys}
    others = [m for m in methods if m != BASELINE]
    headers = ["Δ % vs baseline"] + [h + ARROWS[better[k]] for k, h in keys]
    rows, verdicts = [], []
    for m in others:
        row, words = [names[m]], {"better": [], "worse": [], "within the seed spread": []}
        for k, h in keys:
            mean, spread = mean_spread([r.get(k) for r in results[m]])
            b_mean, b_spread = base[k]
            if mean is None or not b_mean:
                row.append("-")
                continue
            delta = (mean - b_mean) / abs(b_mean) * 100.0
            row.append(f"{delta:+.1f}")
            if abs(mean - b_mean) <= (spread or 0.0) + (b_spread or 0.0):
                words["within the seed spread"].append(f"{h} {delta:+.1f} %")
            else:
                good = (delta > 0) == (better[k] == "up")
                words["better" if good else "worse"].append(f"{h} {delta:+.1f} %")
        rows.append(row)
        said = "; ".join(f"{w}: {', '.join(items)}" for w, items in words.items() if items)
        verdicts.append(f"{names[m]}: {said or 'no number to compare'}")
    return "\n".join([print_table(headers, rows, show=False), "", "Against the baseline:"] +
                     [f"  {v}" for v in verdicts])


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line, ``PROG: error: MESSAGE``, with exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser(prog, doc, methods, default_methods, work_dir, cache_dir, quick_help, fairseq_runs=True):
    """The options every demo takes; each demo adds those of its corpus. ``fairseq_runs``: the
    demo trains through fairseq-train processes (--jobs, --prepare-only, --verbose)."""
    p = OneLineParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--methods", nargs="+", default=list(default_methods), choices=list(methods),
                   help=f"methods to train (default: {' '.join(default_methods)})")
    p.add_argument("--seeds", nargs="+", type=int, default=[1], help="one run per method and seed (default: 1)")
    p.add_argument("--updates", type=int, help="updates per run (overrides the budget)")
    if fairseq_runs:
        p.add_argument("--jobs", type=int, default=max(1, min(2, os.cpu_count() or 1)),
                       help="fairseq-train runs at a time (default: min(2, cores))")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads per run (default 1: for models this small, one thread per core "
                        "beats several threads per run, by far so on a busy machine)")
    p.add_argument("--work-dir", default=work_dir, help="data, checkpoints and results")
    p.add_argument("--cache-dir", default=cache_dir, help="where the downloaded corpus is kept")
    p.add_argument("--vocab-size", type=int, default=VOCAB,
                   help=f"subword vocabulary size (default {VOCAB}; smaller for tiny test corpora)")
    if fairseq_runs:
        p.add_argument("--prepare-only", action="store_true", help="stop after fairseq-preprocess")
    p.add_argument("--cpu", action="store_true", help="train on the CPU even if a GPU is present")
    if fairseq_runs:
        p.add_argument("--verbose", action="store_true",
                       help="show every line of fairseq and the other tools, library warnings included (by "
                            "default only fairseq's progress lines; every run's full log is in its log file)")
    return p


@dataclasses.dataclass
class TrainedRun:
    """One finished fairseq-train run of a demo."""

    label: str  # METHOD-sSEED
    method: str
    seed: int
    save_dir: str
    checkpoint: str
    lines: List[str]  # fairseq's log
    wall_seconds: float  # of the fairseq-train process
    train_seconds: float  # fairseq's own training time
    last_train: Dict[str, str]  # the values of the last train line
    rare_tokens: Optional[float]  # AGG's rare set at the last update; None for other criteria


@dataclasses.dataclass
class Plan:
    """What one invocation of a demo does, decided before anything runs."""

    mode: str  # "quick" or "default"
    budget: dict  # the mode's budget
    updates: int  # per run
    env: Dict[str, str]  # of the fairseq processes
    methods: List[str]  # the requested methods that the plugin registers, in order
    skipped: Dict[str, str]  # requested methods it does not register, and why
    lanes: int  # runs at a time
    runs_dir: str  # WORK_DIR/runs-MODE: a directory per run
    out_dir: str  # WORK_DIR/results-MODE: tables, figures, results.json
    t_start: float
    progress: Progress  # run k of N, time left


@dataclasses.dataclass
class Demo:
    """What a demo trains and how long that takes; the shared steps read it."""

    tag: str  # the prefix of the demo's own log lines
    methods: Dict[str, dict]  # name -> criterion, arch, extra args, a description ("what")
    model: Dict[str, List[str]]  # mode -> architecture flags
    budget: Dict[str, dict]  # mode -> updates, max_tokens, warmup, ...
    train_flags: List[str]  # fairseq-train flags every run shares
    sec_per_update: Dict[str, float]  # measured on the development machine (2 shared cores);
    sec_per_run: Dict[str, float]  # used only for the up-front time estimate
    sec_prepare: float
    sec_after_run: float = 0.0  # per run, after all training (the LM demo's analysis)
    log_lines_per_run: int = 10  # about this many train_inner lines per run

    def plan(self, a):
        """The :class:`Plan` of the parsed arguments ``a`` (whose work_dir becomes absolute); prints
        it and the time it will take."""
        mode = "quick" if a.quick else "default"
        budget = self.budget[mode]
        a.work_dir = os.path.abspath(a.work_dir)
        updates = a.updates or budget["updates"]
        Console.verbose = a.verbose
        env = child_env(a.threads, quiet=not a.verbose)
        methods, skipped = self.runnable(a.methods)
        n_runs = len(methods) * len(a.seeds)
        progress = Progress(n_runs, a.jobs, updates, self.sec_per_update[mode], self.sec_per_run[mode],
                            after_seconds=self.sec_after_run * n_runs)
        self.announce(a, mode, budget, updates, methods, progress)
        return Plan(mode=mode, budget=budget, updates=updates, env=env, methods=methods, skipped=skipped,
                    lanes=progress.lanes, runs_dir=os.path.join(a.work_dir, f"runs-{mode}"),
                    out_dir=os.path.join(a.work_dir, f"results-{mode}"), t_start=time.time(), progress=progress)

    def runnable(self, requested):
        """(the requested methods whose criterion and architecture the plugin registers, in order,
        {skipped method: why}); says which are skipped; stops when none can run."""
        status = registered_methods({m: self.methods[m] for m in requested})
        for m in requested:
            if status[m] is not None:
                say(f"[{self.tag}] SKIPPING {m}: {status[m]} (that method's part of the plugin has not landed)")
        runnable = [m for m in requested if status[m] is None]
        if not runnable:
            raise SystemExit(f"[{self.tag}] no method can run: the plugin registers none of the requested "
                             "criteria/architectures")
        return runnable, {m: why for m, why in status.items() if why is not None}

    def announce(self, a, mode, budget, updates, methods, progress):
        """Prints the plan and the time it will take."""
        prepared = os.path.isfile(os.path.join(a.work_dir, "data", "done.json"))
        est = progress.seconds_left() + (0 if prepared else self.sec_prepare)
        say(f"[{self.tag}] {mode} budget: {len(methods)} methods x {len(a.seeds)} seed(s) = {progress.n_runs} "
            f"fairseq-train runs of {updates} updates ({budget['max_tokens']} tokens each), {progress.lanes} at a "
            f"time, {a.threads} thread(s) each")
        shown = "all of fairseq's output follows" if a.verbose else \
            "fairseq's progress lines follow (--verbose: everything; each run's full log is in its train.log)"
        say(f"[{self.tag}] this will take about {minutes(est)} on 2 CPU cores (measured on the development "
            f"machine); {shown}")

    def prepare_data(self, prepare, a, plan):
        """``prepare(a, env)``, the demo's data preparation; stops with a clear message when the
        corpus cannot be had on this machine."""
        try:
            return prepare(a, plan.env)
        except DataUnavailable as e:
            raise SystemExit(f"[{self.tag}] the corpus is not available on this system: {e}")

    def reuse_prepared(self, data_dir, source, vocab):
        """:func:`reuse_prepared` with the demo's tag."""
        return reuse_prepared(data_dir, source, vocab, self.tag)

    def train_command(self, method, data_bin, save_dir, seed, mode, updates, cpu, data_flags=()):
        """:func:`train_command` of the demo's method ``method`` (a name) at its ``mode``."""
        return train_command(self.methods[method], self.model[mode], self.train_flags, self.budget[mode], data_bin,
                             save_dir, seed, updates, cpu, data_flags, self.log_lines_per_run)

    def train(self, a, plan, method, seed, data_bin, data_flags=()):
        """One fairseq-train run in RUNS_DIR/METHOD-sSEED, its log lines shown with that label.
        Raises RuntimeError when it fails."""
        label = f"{method}-s{seed}"
        save_dir = os.path.join(plan.runs_dir, label)
        shutil.rmtree(save_dir, ignore_errors=True)
        os.makedirs(save_dir)
        run_k = plan.progress.start(label)
        say(f"[{self.tag}] {run_k} started: {label}, {self.methods[method]['what']}; "
            f"{time_left(plan.progress.seconds_left())} in all")
        cmd = self.train_command(method, data_bin, save_dir, seed, plan.mode, plan.updates, a.cpu, data_flags)
        rc, lines, wall = run_logged(cmd, os.path.join(save_dir, "train.log"), f"[{label}] ", plan.env,
                                     show=PROGRESS_LINES, on_line=lambda line: plan.progress.observe(label, line))
        ckpt = os.path.join(save_dir, "checkpoint_last.pt")
        if rc != 0 or not os.path.isfile(ckpt):
            tail = "\n".join(lines[-20:])
            raise RuntimeError(f"fairseq-train failed for {label} (log {save_dir}/train.log):\n{tail}")
        stats = last_train_stats(lines)
        rare = stats.get("agg_rare")
        return TrainedRun(label=label, method=method, seed=seed, save_dir=save_dir, checkpoint=ckpt, lines=lines,
                          wall_seconds=wall, train_seconds=done_seconds(lines) or wall, last_train=stats,
                          rare_tokens=float(rare) if rare is not None else None)

    def finished(self, plan, label, summary=""):
        """Says that run ``label`` and the work of its own that follows training (``summary``: its
        result in a few words) are done, with the time left."""
        run_k, seconds = plan.progress.finish(label)
        summary = f", {summary}" if summary else ""
        say(f"[{self.tag}] {run_k} finished: {label} in {seconds:.0f} s{summary}; "
            f"{time_left(plan.progress.seconds_left())}")

    def write_results(self, a, plan, info, results, columns, better=None, legend=(), **extra):
        """Prints the table of ``results`` ({method: [numbers of one seed]}) with ``columns``, each
        method by its full name; with ``better`` ({key: "up" or "down"}) an arrow on those
        columns, their change against the baseline and a verdict per method
        (:func:`comparison_text`); then ``legend``. Writes all of it to OUT_DIR/table.txt, and
        every number, the plan and ``extra`` to OUT_DIR/results.json."""
        names = {m: self.methods[m].get("name", m) for m in plan.methods}
        headers, rows = result_rows(plan.methods, results, columns)
        headers = headers[:1] + [h + ARROWS.get((better or {}).get(k), "") for h, (k, _, _) in zip(headers[1:], columns)]
        rows = [[names[r[0]]] + r[1:] for r in rows]
        text = [print_table(headers, rows)]
        if better and BASELINE in plan.methods:
            text.append(comparison_text(plan.methods, results, columns, better, names))
        legend = tuple(legend) + ((f"↓ / ↑: the better direction of a column; {DELTA_LEGEND}",) if better else ())
        if legend:
            text.append("\n".join(legend))
            say("\n".join(text[1:]))
        with atomic_output(os.path.join(plan.out_dir, "table.txt"), "w", flag="the demo's table") as f:
            f.write("\n\n".join(text) + "\n")
        write_json(os.path.join(plan.out_dir, "results.json"), {
            "mode": plan.mode, "updates": plan.updates, "seeds": a.seeds, "methods": plan.methods,
            "skipped": plan.skipped, "data": info, "budget": plan.budget, "model": self.model[plan.mode],
            "results": results, **extra, "markdown": markdown_table(headers, rows),
            "total_seconds": time.time() - plan.t_start,
        })
        say(f"[{self.tag}] table and numbers: {plan.out_dir}/table.txt, {plan.out_dir}/results.json")

    def run_side_by_side(self, one_run, a, plan):
        """``one_run(method, seed)`` for every seed and method, ``plan.lanes`` at a time
        (independent runs, one core each; their log lines carry the run's label); the results in
        that order."""
        jobs = [(m, s) for s in a.seeds for m in plan.methods]
        with ThreadPoolExecutor(max_workers=plan.lanes) as pool:
            try:
                return list(pool.map(lambda job: one_run(*job), jobs))
            except RuntimeError as e:
                raise SystemExit(f"[{self.tag}] {e}")
