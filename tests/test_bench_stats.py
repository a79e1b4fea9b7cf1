"""The statistics' cost (``python -m scripts.bench_stats``, benchmarks/stats.py) in a CPU smoke run at
tiny sizes: every metric timed, and two real fairseq-train runs in the shared worker
(benchmarks/train_worker.py), with and without the statistics, whose time inside
``EmbeddingStats.log`` the worker records. The times mean nothing here."""
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METRICS = ("tev_stats (fp32)", "mean_pairwise_cosine (fp64)", "embedding_spectrum (fp64 Gram + eigh)",
           "isotropy incl. spectrum (fp64)", "isotropy, spectrum given", "isotropy of the 3 frequency groups",
           "live step: TEV + mean_cos", "live step: isotropy", "live step: all, with groups")


def test_smoke_times_every_metric_and_the_live_logging():
    env = dict(os.environ, OMP_NUM_THREADS="2")
    proc = subprocess.run([sys.executable, "-m", "scripts.bench_stats", "--vocab", "500", "--dim", "16",
                           "--repeats", "1", "--updates", "3", "--max-tokens", "256", "--device", "cpu"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for metric in METRICS:
        found = re.search(rf"^\| {re.escape(metric)}\s+\|\s+([0-9.]+) \|$", proc.stdout, re.M)
        assert found and float(found.group(1)) >= 0, metric
    calls = {name: int(n) for name, n in re.findall(r"run 1 (off|stats)\s*: .* over (\d+) calls", proc.stdout)}
    # the criterion calls the statistics' log on every step, also with them off (it returns at once)
    assert set(calls) == {"off", "stats"} and calls["off"] > 0 and calls["stats"] > 0
    assert re.search(r"\| wall-time ratio on / off\s+\|\s+[0-9.]+ \|", proc.stdout)
