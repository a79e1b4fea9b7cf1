"""MLRA attention against fairseq's MultiheadAttention (``python -m scripts.bench_attention``,
benchmarks/attention.py) in a CPU smoke run at a tiny width: every MLRA setting measured, the
parameter counts by their formulas. The times mean nothing here."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_smoke_measures_every_setting(tmp_path):
    raw = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, "-m", "scripts.bench_attention", "--dims", "64", "--head-dim", "32",
                           "--seq", "16", "--batch", "1", "--decode-batch", "2", "--decode-prefix", "4",
                           "--decode-steps", "2", "--repeats", "2", "--warmup", "0", "--threads", "2",
                           "--device", "cpu", "--json", str(raw)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = json.loads(raw.read_text())["rows"]
    d = 64
    # shared at d/16 .. d/2, O factorised too at d/4, per head at d_h/2 and d_h/4
    assert [(r["mode"], r["rank"], r["targets"]) for r in rows] == [
        ("shared", 4, "q,k,v"), ("shared", 8, "q,k,v"), ("shared", 16, "q,k,v"), ("shared", 32, "q,k,v"),
        ("shared", 16, "q,k,v,o"), ("per_head", 16, "q,k,v"), ("per_head", 8, "q,k,v")]
    for r in rows:
        assert r["heads"] == 2 and r["params_mha"] == 4 * (d * d + d)  # four d x d projections with biases
        for field in ("fwd_bwd_ms_mha", "fwd_bwd_ms_mlra", "decode_ms_mha", "decode_ms_mlra"):
            assert r[field] > 0, (field, r)
        assert r["fwd_bwd_ms_mha"] <= r["median_fwd_bwd_ms"][0]  # the best of the rounds
    # a shared rank r replaces Q, K, V's d x d weights by d x r and r x d factors
    shared = rows[0]
    assert shared["params_mlra"] < shared["params_mha"]
    assert f"d={d}: MultiheadAttention has {4 * (d * d + d):,} parameters" in proc.stdout


def test_run_as_a_file_it_says_how_to_run_it():
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench_attention.py"), "--help"],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "python -m scripts.bench_attention" in proc.stderr
