"""The Hugging Face benchmark (``python -m scripts.bench_hf``, benchmarks/hf.py) at its quick sizes, as
the command it is: both paths (transformers' own loss and ``apply(model, method="ce" / "agg")``)
and Liger's step reported, with their ratios to stock, the same loss from the stock and the fused
path, and a bad flag refused in one line. The times mean nothing here: no timing is asserted."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_bench(args):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "scripts.bench_hf", *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


def test_quick_reports_both_paths_and_their_ratios(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_bench(["--quick", "--vocabs", "1500", "--json", out])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    assert (row["V"], row["N"], row["d"]) == (1500, 256, 32)
    for key in ("stock", "ce", "agg"):
        entry = row["variants"][key]
        assert entry["median_ms"] > 0 and entry["peak_mib"] > 0, key
        assert f"| {key} | " in proc.stdout
    for name in ("ce_time_vs_stock", "agg_time_vs_stock", "ce_memory_vs_stock", "agg_memory_vs_stock"):
        assert row["ratios"][name] > 0, name
    # the fused path keeps no tokens x V logits: less memory than stock's, whose logits alone are N x V x 4 bytes
    assert row["variants"]["ce"]["peak_mib"] < row["variants"]["stock"]["peak_mib"]
    assert row["variants"]["stock"]["peak_mib"] * 2**20 > 256 * 1500 * 4
    # one loss, two paths: the fused cross-entropy is transformers' own
    assert row["loss_rel_diff_ce_vs_stock"] < 1e-5
    liger = row["variants"]["liger"]
    assert "median_ms" in liger or "liger_kernel" in liger["skipped"]


def test_a_bad_flag_is_one_line(tmp_path):
    proc = run_bench(["--quick", "--tokens", "100", "--seq", "64"])
    assert proc.returncode == 2
    assert proc.stderr.strip() == "bench_hf: error: --tokens must be a multiple of --seq (64), got 100"


def test_the_gpu_checks_hf_part_runs_in_its_cpu_smoke_mode(tmp_path):
    """Part 5 of the GPU check (``--parts hf``, benchmarks/gpu_check/hf.py) at the smoke plan's sizes,
    so that it cannot rot while no accelerator is lent: recorded and rendered with both paths."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "scripts.gpu_check", "--cpu-smoke", "--parts", "hf", "--out", tmp_path],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    part = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]["hf"]
    assert part["status"] == "ok" and part["dtype"] == "fp32"
    import transformers  # the report names the transformers that ran (the accelerator machine may have its own)

    assert part["transformers"] == transformers.__version__
    (row,) = part["rows"]
    assert row["V"] == 500 and set(row["ratios"]) >= {"ce_time_vs_stock", "agg_time_vs_stock"}
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert "## 5. Hugging Face" in markdown and "| stock | " in markdown and "| agg | " in markdown
    assert f"transformers {transformers.__version__}" in markdown
