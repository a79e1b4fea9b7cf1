"""One measured ``fairseq-train`` run in a worker process, shared by the GPU check's training parts
and the whole-step benchmark (scripts/bench_training.py).

The worker, ``python -m benchmarks.train_worker RESULT_JSON -- FAIRSEQ_TRAIN_ARGS`` (from the
repository root: :func:`run_worker` starts it), runs fairseq-train's own entry point in its process
and then writes to RESULT_JSON the time at which every update ended (``Trainer.train_step``
returned), its wall seconds, its peak memory (max RSS; the CUDA allocator's peak on a GPU) and the
seconds spent inside the embedding statistics' ``EmbeddingStats.log`` (every call, also where the
statistics are off; scripts/bench_stats.py reads them).
``--user-dir`` is this process's own copy of the package: fairseq refuses a second, different
directory under the name it has already imported (the parent may run from a source tree).
"""
import json
import logging
import os
import resource
import subprocess
import sys
import time

from benchmarks import ROOT

MIB = float(1 << 20)


def _timed_train_steps(update_ends, started):
    """Makes fairseq's Trainer record when each update ended (seconds after ``started[0]``)."""
    from fairseq.trainer import Trainer

    train_step = Trainer.train_step

    def timed_train_step(self, *args, **kwargs):
        try:
            return train_step(self, *args, **kwargs)
        finally:
            update_ends.append(time.perf_counter() - started[0])

    Trainer.train_step = timed_train_step


def _timed_statistics(inside):
    """Makes the statistics' ``EmbeddingStats.log`` add its calls and seconds to ``inside``."""
    from fairseq_agg.stats import live

    log = live.EmbeddingStats.log

    def timed_log(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return log(self, *args, **kwargs)
        finally:
            inside["stats_log_calls"] += 1
            inside["stats_log_s"] += time.perf_counter() - started

    live.EmbeddingStats.log = timed_log


def train(result_path, argv):
    """fairseq-train ``argv`` in this process; the measurements into ``result_path``."""
    import torch
    from fairseq_cli import train as fairseq_train

    from fairseq_agg import USER_DIR

    update_ends, started = [], [time.perf_counter()]
    inside = {"stats_log_calls": 0, "stats_log_s": 0.0}
    _timed_train_steps(update_ends, started)
    _timed_statistics(inside)
    # fairseq_cli.train's logging.basicConfig (INFO to stdout) is a no-op when an earlier import has
    # already given the root logger a handler (a root-level warning does), and then no train_inner
    # record is printed: take the configuration over.
    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s", level=logging.INFO,
                        stream=sys.stdout, force=True)
    sys.argv = ["fairseq-train", "--user-dir", USER_DIR] + list(argv)
    started[0] = time.perf_counter()
    try:
        fairseq_train.cli_main()
    finally:
        result = {"wall_s": time.perf_counter() - started[0], "update_ends_s": update_ends,
                  "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, **inside}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            result["cuda_peak_mib"] = torch.cuda.max_memory_allocated() / MIB
        with open(result_path, "w") as f:
            json.dump(result, f)


def run_worker(result_path, train_args, env=None, timeout=None):
    """Runs the worker on ``train_args`` (every path in them absolute); returns the finished process
    and the worker's measurements (None where it wrote none)."""
    if os.path.exists(result_path):
        os.remove(result_path)
    cmd = [sys.executable, "-m", "benchmarks.train_worker", result_path, "--", *train_args]
    env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if not os.path.exists(result_path):
        return proc, None
    with open(result_path) as f:
        return proc, json.load(f)


def main(argv):
    if len(argv) < 2 or argv[1] != "--":
        sys.exit("usage: python -m benchmarks.train_worker RESULT_JSON -- FAIRSEQ_TRAIN_ARGS")
    train(argv[0], argv[2:])


if __name__ == "__main__":
    main(sys.argv[1:])
