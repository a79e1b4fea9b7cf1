"""The whole-step benchmark (scripts/bench_training.py, benchmarks/training.py): its accounting of the
statistics' cost (the arithmetic is tests/support/training_runs.py's) on update times written by
hand, and a CPU smoke run; the benchmark itself measures, the tests only check its bookkeeping."""
import itertools
import json
import os
import subprocess
import sys

import pytest

from training_runs import in_run_share, updates_per_second

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ends(durations):
    """update_ends_s as the training worker records them: the end of update 1, 2, ... (seconds)."""
    return list(itertools.accumulate(durations))


def test_the_measuring_updates_excess_over_the_median_is_the_share():
    # 10 updates of 0.1 s, except updates 5 and 10 (interval 5) at 0.3 s. Counted: updates 3..10
    # (the first two have no full duration after the start); excess 2 x 0.2 s over 1.2 s.
    durations = [0.1] * 10
    durations[4] = durations[9] = 0.3
    assert in_run_share(_ends(durations), 0.0, 5) == pytest.approx(0.4 / 1.2)


def test_the_warm_up_is_left_out():
    # update 5 falls in the leading half: only update 10's 0.2 s excess counts, over updates 6..10
    durations = [0.1] * 10
    durations[4] = durations[9] = 0.3
    assert in_run_share(_ends(durations), 0.5, 5) == pytest.approx(0.2 / 0.7)


def test_no_share_without_statistics_and_none_when_all_updates_are_alike():
    ends = _ends([0.1] * 20)
    assert in_run_share(ends, 0.2, 0) is None
    assert in_run_share(ends, 0.2, 5) == pytest.approx(0.0, abs=1e-12)


def test_updates_per_second_after_the_warm_up():
    # 5 updates of 0.5 s then 5 of 0.25 s; from the end of update 5 to the end of update 10: 4 u/s
    ends = _ends([0.5] * 5 + [0.25] * 5)
    assert updates_per_second(ends, 0.4) == pytest.approx(5 / 1.25)


def _run(args, tmp_path):
    raw = tmp_path / "runs.json"
    env = dict(os.environ, OMP_NUM_THREADS="2")
    proc = subprocess.run([sys.executable, "-m", "scripts.bench_training", *args, "--json", str(raw)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout, json.loads(raw.read_text())


def test_smoke_trains_through_the_shared_worker(tmp_path):
    """A CPU smoke run: real fairseq-train processes in the shared worker (benchmarks/train_worker.py),
    stock CE with the statistics off and on, each update's end recorded."""
    stdout, data = _run(["--shape", "demo", "--updates", "5", "--repeats", "1", "--methods", "stock",
                         "--stats-methods", "stock", "--stats-interval", "2", "--log-interval", "1"], tmp_path)
    runs = data["runs"]["demo"]
    assert set(runs) == {"stock", "stock+stats"}
    for name, (run,) in runs.items():
        assert run["updates"] == 5 and run["ups"] > 0 and run["peak_rss_mib"] > 0, (name, run)
        assert run["loss_last"] is not None and run["loss_last"] > 0
    assert runs["stock"][0]["stats_share"] is None and runs["stock+stats"][0]["stats_share"] is not None
    assert "in-run share of the statistics" in stdout and "(<= 2 %:" in stdout


def test_bad_input_is_refused_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "scripts.bench_training", "--methods", "stock,speed"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "--methods" in proc.stderr and "speed" in proc.stderr
