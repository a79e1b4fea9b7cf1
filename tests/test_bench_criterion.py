"""The output-layer benchmark (``python -m scripts.bench_criterion``; benchmarks/criterion/) in a CPU
smoke run at tiny sizes: every variant of its default selection measured on both kernels, the
equivalence check, the ratios it prints (issue #46's item 7 on the path ``auto`` picks, the
augmented loss against its own floor) read back against its raw measurements, and its refusals.
The times mean nothing here; the benchmark itself measures, the tests check its bookkeeping."""
import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--tokens", "96", "--dim", "16", "--vocab", "301", "--chunk-size", "32", "--torch-chunk-sizes", "48",
        "--ul-seq-len", "24", "--warmup", "0", "--repeats", "2", "--quiet"]
DEFAULT_KEYS = ("stock+ls", "agg+ls", "agg_ref+ls", "al", "stock", "al_ref", "fused_ce", "freeze", "cosreg", "face",
                "ul", "fused_ce+ls", "torch_ref", "torch_auto", "torch_chunk@48", "torch_ref+ls", "floor", "al_floor",
                "agg+ls:torch", "fused_ce:torch")
PACKAGE = ("agg+ls", "al", "fused_ce", "freeze", "cosreg", "face", "ul", "fused_ce+ls")


def _bench(args, timeout=1800):
    env = dict(os.environ, OMP_NUM_THREADS="2")
    return subprocess.run([sys.executable, "-m", "scripts.bench_criterion", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    raw = tmp_path_factory.mktemp("bench_criterion") / "raw.json"
    proc = _bench([*TINY, "--json", str(raw)])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout, json.loads(raw.read_text()), proc.stderr


def _row(stdout, label):
    """The wall ratio of the report's row ``label``, and its verdicts."""
    found = re.search(rf"^{re.escape(label)}\s+([0-9.]+)x .*?((?:PASS|MISS| )*)$", stdout, re.M)
    assert found, f"no row {label!r} in:\n{stdout}"
    return float(found.group(1)), found.group(2).split()


def test_every_default_variant_is_measured_on_both_kernels(smoke):
    _, raw, _ = smoke
    expected = set(DEFAULT_KEYS) | {f"{k}:eager" for k in PACKAGE}
    assert set(raw["variants"]) == expected
    assert raw["kernels"] == ["auto", "eager"]
    for key in expected:
        assert len(raw["times_s"][key]) == 2 and min(raw["times_s"][key]) > 0, key
        assert raw["first_call_s"][key] > 0 and raw["peak_bytes"][key] > 0, key
    assert raw["variants"]["agg+ls:eager"] == {"name": "agg", "smoothed": True, "kernel": "eager", "chunk": None,
                                               "label": "AGG, fused_linear_loss + gates [eps 0.1] [eager]"}


def test_the_variants_compute_the_same_thing(smoke):
    _, raw, _ = smoke
    compared = {line.split(": loss")[0] for line in raw["checks"]}
    for pair in ("agg+ls vs agg_ref+ls", "al vs al_ref", "fused_ce vs stock", "fused_ce+ls vs torch_ref+ls",
                 "fused_ce vs torch_auto", "agg+ls:torch vs agg+ls", "ul:eager vs ul"):
        assert pair in compared, raw["checks"]
    for line in raw["checks"]:
        for value in re.findall(r"rel ([0-9.e+-]+)", line):
            assert float(value) < 1e-5, line  # fp32 against fp32 and float64-free references


def test_item_7_and_the_augmented_loss_floor_are_printed_from_the_measurements(smoke):
    stdout, raw, _ = smoke
    median = raw["median_s"]
    assert "-- issue #46, item 7: on the path auto picks here (compiled chunk body" in stdout \
        or "-- issue #46, item 7: on the path auto picks here (eager chunk body" in stdout
    for label, a, b, limit in (("fused_ce / floor", "fused_ce", "floor", 1.07),
                               ("agg+ls / floor", "agg+ls", "floor", 1.05),
                               ("fused_ce / torch_auto", "fused_ce", "torch_auto", 1.0)):
        section = stdout.split("-- issue #46")[1].split("\n-- ")[0]
        ratio, verdict = _row(section, label)
        assert ratio == pytest.approx(median[a] / median[b], abs=1e-3)
        assert verdict == ["PASS" if median[a] / median[b] <= limit else "MISS"], (label, ratio)
    ratio, _ = _row(stdout, "al / al_floor (the fused CE's limit)")
    assert ratio == pytest.approx(median["al"] / median["al_floor"], abs=1e-3)
    # the floor of the augmented loss holds the three matmuls and the teacher's: it costs more
    assert raw["peak_bytes"]["al_floor"] > raw["peak_bytes"]["floor"]


def test_it_prints_no_debug_or_profiler_lines(smoke):
    """fairseq's import sets the root logger to DEBUG (filelock's lines under torch.compile) and
    kineto announces every profile ("USDT: ... profiler_start"): the command keeps both out (issue #57)."""
    stdout, _, stderr = smoke
    noise = [line for line in (stdout + stderr).splitlines() if line.startswith(("DEBUG:", "USDT:", "STAGE:"))]
    assert not noise, noise[:5]


def test_a_sweep_and_a_variant_list_of_keys(tmp_path):
    raw = tmp_path / "raw.json"
    # V = 4,096: every chunk's logits and W.grad above glibc's 64 KiB mmap threshold, so each fresh
    # process's RSS grows by what the step allocates
    proc = _bench([*TINY, "--vocab", "4096", "--variants", "agg+ls:eager,floor", "--kernels", "eager",
                   "--chunk-sizes", "16", "--memory", "rss", "--no-check", "--json", str(raw)])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads(raw.read_text())
    assert set(data["variants"]) == {"agg+ls:eager", "agg+ls:eager@16", "floor", "floor@16"}
    # each from a fresh process's RSS: at least the gradient W.grad (V x d fp32) that the step leaves behind
    assert all(peak >= 4096 * 16 * 4 for peak in data["peak_bytes"].values()), data["peak_bytes"]
    assert "-- issue #46" not in proc.stdout  # auto was not measured


def test_a_first_kernel_other_than_auto_checks_the_package_variants_only(tmp_path):
    # the floor runs on no kernel of the package: it has no twin on eager to be checked against
    proc = _bench([*TINY, "--variants", "fused_ce,floor", "--kernels", "eager,auto", "--json", str(tmp_path / "r.json")])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert re.search(r"fused_ce vs fused_ce:eager: loss rel [0-9.e+-]+, dH rel [0-9.e+-]+, dW rel", proc.stdout), proc.stdout


@pytest.mark.parametrize("args, flag", [(["--variants", "fce"], "--variants"),
                                        (["--variants", "freeze+ls"], "--variants"),
                                        (["--variants", "floor:eager"], "--variants"),
                                        (["--kernels", "torch"], "--kernels"),
                                        (["--tokens", "0"], "--tokens")])
def test_bad_input_is_refused_in_one_line(args, flag):
    proc = _bench([*TINY, *args], timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and flag in proc.stderr, proc.stderr


def test_run_as_a_file_it_says_how_to_run_it():
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench_criterion.py"), "--help"],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "python -m scripts.bench_criterion" in proc.stderr
