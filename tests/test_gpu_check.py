"""The prepared accelerator check (scripts/device/gpu_check.sh) in its CPU smoke mode, so that it
cannot rot while no accelerator is lent: the same code paths at tiny shapes, real fairseq-train
subprocesses, and real comparisons of the fused output layer with the float64 reference. The check
runs as the command it is (``python -m scripts.gpu_check``, from the root), never imported."""
import importlib.util
import json
import math
import os
import subprocess
import sys
import types

import pytest

from training_runs import fairseq_precision_problem

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_CHECK = [sys.executable, "-m", "scripts.gpu_check"]
GPU_CHECK_SH = os.path.join(REPO, "scripts", "device", "gpu_check.sh")
PREPARE_SH = os.path.join(REPO, "scripts", "device", "prepare.sh")
# The sizes of the check's CPU smoke plan (CPU_SMOKE_PLAN in benchmarks/gpu_check/plan.py) that the tests
# below expect, and its tolerances against the float64 reference
PLAN = types.SimpleNamespace(shapes=("LM", "MT"), bench_dtypes=("bf16", "fp32"), repeats=2, chunk_sweep=(64, 256),
                             updates=4, train_mlra_arch="transformer_lm_mlra_gpt2_small", stats_shape=(2000, 64))
TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2}


def _run_check(args, extra_env=None, timeout=600):
    """``python -m scripts.gpu_check ARGS`` from the repository root."""
    env = dict(os.environ, OMP_NUM_THREADS="2")
    env.update(extra_env or {})
    return subprocess.run(GPU_CHECK + list(args), cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def _run_sh(script, args, out_dir, extra_env=None, timeout=600):
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(out_dir), OMP_NUM_THREADS="2")
    env.update(extra_env or {})
    return subprocess.run(["bash", script, *args], env=env, capture_output=True, text=True, timeout=timeout)


# On the accelerator machine an early import gave Python's root logger a handler, so fairseq's own
# logging.basicConfig did nothing, no train_inner line was printed and every training run was recorded
# as failed. This sitecustomize module does what that import did, in every process it reaches.
ROOT_LOGGER_FIRST = "import logging\nlogging.basicConfig(level=logging.WARNING)\n"


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """The CPU smoke run of every default part, once for the tests below, with the root logger
    configured before fairseq in the check and its fairseq-train workers (ROOT_LOGGER_FIRST; the
    training worker configures the logging itself)."""
    out = tmp_path_factory.mktemp("gpu_check_smoke")
    site = tmp_path_factory.mktemp("root_logger_site")
    (site / "sitecustomize.py").write_text(ROOT_LOGGER_FIRST)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    proc = _run_sh(GPU_CHECK_SH, ["--cpu-smoke", "--budget-s", "500"], out, {"PYTHONPATH": path})
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    with open(out / "gpu_check.json") as f:
        data = json.load(f)
    markdown = (out / "gpu_check.md").read_text()
    return data, markdown, out


def test_smoke_runs_every_part(smoke):
    data, _, out = smoke
    assert data["meta"]["mode"] == "cpu-smoke"
    assert set(data["parts"]) == {"correctness", "output_layer", "train", "stats"}
    for name, part in data["parts"].items():
        assert part["status"] == "ok", (name, part)
    assert data["install"]["status"] == "skipped"  # smoke mode uses the current environment
    assert (out / "gpu_check.log").read_text().count("[gpu_check] part") == 4


def test_fused_output_layer_matches_the_reference(smoke):
    part = smoke[0]["parts"]["correctness"]
    assert part["passed"] is True and part["tolerance"] == TOLERANCE
    cases = {(c["case"], c["dtype"]): c for c in part["cases"]}
    names = ("CE", "AGG eps=0", "AGG eps=0.1", "AL")
    assert set(cases) == {(case, dtype) for case in names for dtype in ("fp32", "bf16")}
    for (case, dtype), c in cases.items():
        for quantity in ("loss", "nll", "dH", "dW"):
            assert math.isfinite(c[quantity]) and c[quantity] <= TOLERANCE[dtype], (case, dtype, quantity, c)
    # fp32 agrees far more closely than bf16: the comparison is against float64, not against itself
    assert max(cases[("CE", "fp32")][q] for q in ("dH", "dW")) < 1e-5
    assert cases[("CE", "bf16")]["dW"] > cases[("CE", "fp32")]["dW"]
    # the AGG cases exercise the gates: rare targets, some with g2 < 1, and a dW that differs from CE's
    assert part["rare_target_fraction"] > 0.05
    assert part["g2_below_one_target_fraction"] > 0
    assert part["agg_vs_ce_dW_rel"] > 1e-3


def _key(entry, name, suffix=""):
    """A variant's key in a run (benchmarks/variants.py): ``+ls`` where the run's eps > 0 and the
    variant takes a smoothing (the floors and torch's chunked path take none)."""
    takes = name not in ("floor", "al_floor", "torch_auto", "torch_chunk", "cce")
    return name + ("+ls" if entry["eps"] > 0 and takes else "") + suffix


def test_output_layer_variants_compute_the_same_loss(smoke):
    part = smoke[0]["parts"]["output_layer"]
    assert set(part["runs"]) == {f"{s} {d}" for s in PLAN.shapes for d in PLAN.bench_dtypes}
    if importlib.util.find_spec("liger_kernel") is None:
        assert part["liger"].startswith("skipped: liger_kernel not importable")
    if importlib.util.find_spec("cut_cross_entropy") is None:
        assert part["cce"].startswith("skipped: cut_cross_entropy not importable")
    for key, entry in part["runs"].items():
        v = entry["variants"]
        smoothed = entry["eps"] > 0
        names = ("stock", "fused_ce", "agg", "al", "torch_ref", "torch_auto", "floor", "al_floor")
        assert {_key(entry, name) for name in names} <= set(v), key
        assert {_key(entry, name, ":eager") for name in ("fused_ce", "agg", "al")} <= set(v), key
        for name, m in v.items():
            if "skipped" in m:  # torch's chunked path (and CCE) take no label smoothing
                assert smoothed and name in ("torch_auto", "cce") and "label smoothing" in m["skipped"], (key, name, m)
                continue
            assert m["median_ms"] > 0 and len(m["ms"]) == PLAN.repeats, (key, name, m)
        # AGG changes gradients only; the stock criterion (fairseq's functions), the fused CE and
        # torch's op (the smoothing converted to its convention) give the same loss, on every path
        # of the package; AL adds coef * KL >= 0; the floors compute no loss
        loss = {name: v[_key(entry, name)].get("loss") for name in names}
        tol = 1e-5 if key.endswith("fp32") else 2e-2
        assert abs(loss["fused_ce"] - loss["stock"]) <= tol * abs(loss["stock"])
        for name in ("torch_ref",) if smoothed else ("torch_ref", "torch_auto"):
            assert abs(loss[name] - loss["stock"]) <= tol * abs(loss["stock"]), (key, name)
        for name in ("fused_ce", "agg", "al"):
            assert v[_key(entry, name, ":eager")]["loss"] == pytest.approx(loss[name], rel=tol)
        assert loss["agg"] == pytest.approx(loss["fused_ce"], rel=1e-6)
        assert loss["al"] > loss["fused_ce"]
        assert loss["floor"] == loss["al_floor"] == 0.0
        swept = ("agg", "al") if smoothed else ("agg", "al", "torch_chunk")
        assert set(entry["sweep"]) == {_key(entry, n, f"@{c}") for n in swept for c in PLAN.chunk_sweep}
        # ratios are rounded to 3 decimals: a small one (a disturbed CPU run) keeps few digits
        ms = {name: v[_key(entry, name)]["median_ms"] for name in ("stock", "fused_ce", "agg", "al", "floor", "al_floor")}
        assert entry["ratios"]["agg_time_vs_stock"] == pytest.approx(ms["agg"] / ms["stock"], rel=1e-2, abs=1e-3)
        assert entry["ratios"]["fused_ce_time_vs_floor"] == pytest.approx(ms["fused_ce"] / ms["floor"], rel=1e-2,
                                                                          abs=1e-3)
        assert entry["ratios"]["al_time_vs_al_floor"] == pytest.approx(ms["al"] / ms["al_floor"], rel=1e-2, abs=1e-3)
        assert entry["ratios"]["torch_best"].startswith("torch_")
        assert entry["rare_target_fraction"] > 0


def test_real_fairseq_train_runs(smoke):
    part = smoke[0]["parts"]["train"]
    runs = {r["name"]: r for r in part["runs"]}
    assert set(runs) == {"stock cross_entropy", "cross_entropy_agg", "augmented_loss", "MLRA"}
    for name, run in runs.items():
        assert run["returncode"] == 0 and "error" not in run, run
        assert run["num_updates"] == PLAN.updates
        assert run["wps"] > 0 and run["wpb"] > 0
        assert math.isfinite(run["loss_last"])
    assert runs["MLRA"]["arch"] == PLAN.train_mlra_arch
    assert set(part["ratios"]) == {"fp32 cross_entropy_agg", "fp32 augmented_loss", "fp32 MLRA"}


def test_wmt14_recipe_models_train_in_a_part_of_their_own(tmp_path):
    # not in the default parts (the GPU's time holds one of the two): --parts train_mt alone
    proc = _run_check(["--cpu-smoke", "--parts", "train_mt", "--out", str(tmp_path)])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert set(data["parts"]) == {"train_mt"}
    part = data["parts"]["train_mt"]
    assert part["status"] == "ok", part
    runs = {(r["size"], r["name"]): r for r in part["runs"]}
    assert list(runs) == [("base", "baseline"), ("base", "agg"), ("big", "baseline"), ("big", "agg"),
                          ("base", "aug"), ("base", "mlra")]
    for key, run in runs.items():
        assert run["returncode"] == 0 and "error" not in run, run
        assert run["num_updates"] == PLAN.updates and run["wps"] > 0 and math.isfinite(run["loss_last"]), key
    # the recipe's models and criteria (examples/wmt14_en_de/train.sh)
    assert runs[("big", "agg")]["arch"] == "transformer_wmt_en_de_big"
    assert runs[("base", "mlra")]["arch"] == "transformer_mlra_wmt_en_de"
    assert runs[("base", "baseline")]["flags"] == ["--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1"]
    assert runs[("base", "agg")]["flags"][:5] == ["--criterion", "cross_entropy_agg", "--label-smoothing", "0.1",
                                                  "--agg-alpha"]
    assert runs[("base", "agg")]["output_layer"] and runs[("base", "baseline")]["output_layer"] is None
    # each ratio is against the same size's baseline
    assert set(part["ratios"]) == {"fp32 base agg", "fp32 big agg", "fp32 base aug", "fp32 base mlra"}
    assert part["ratios"]["fp32 big agg"]["wps_vs_stock"] == pytest.approx(
        runs[("big", "agg")]["wps"] / runs[("big", "baseline")]["wps"], rel=1e-2)
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert "## 3b. fairseq-train, the WMT14 recipe's models" in markdown and "| fp32 | big | agg |" in markdown


def test_synthetic_translation_bin_is_what_fairseq_preprocess_writes(tmp_path):
    from fairseq.data import Dictionary, data_utils

    from training_runs import write_synthetic_translation_bin

    dest = write_synthetic_translation_bin(str(tmp_path / "bin"), 300, 50, 7, lengths=(3, 9))
    dictionaries = [Dictionary.load(os.path.join(dest, f"dict.{lang}.txt")) for lang in ("en", "de")]
    assert len(dictionaries[0]) == 300 and dictionaries[0].symbols == dictionaries[1].symbols  # joined
    for split, pairs in (("train", 50), ("valid", 7)):
        for lang in ("en", "de"):
            dataset = data_utils.load_indexed_dataset(os.path.join(dest, f"{split}.en-de.{lang}"), dictionaries[0])
            assert len(dataset) == pairs
            for item in dataset:
                assert 4 <= len(item) <= 9 and int(item[-1]) == dictionaries[0].eos()
                assert int(item[:-1].min()) >= dictionaries[0].nspecial and int(item.max()) < 300


def test_statistics_step(smoke):
    part = smoke[0]["parts"]["stats"]
    assert (part["V"], part["d"]) == PLAN.stats_shape
    assert part["tev_step_ms"] > 0 and part["isotropy_step_ms"] > 0
    assert 0 < part["values"]["isotropy"] <= 1
    assert part["values"]["tev_mu"] > 0
    assert part["share_of_training"] > 0  # against the smoke AGG run's seconds per update


def test_markdown_has_every_section(smoke):
    data, markdown, _ = smoke
    for header in ("## 1. Correctness", "## 2. Output layer", "## 3. fairseq-train", "## 4. Embedding statistics",
                   "## Targets"):
        assert header in markdown
    assert "| AGG eps=0.1 | bf16 |" in markdown
    assert "CPU smoke run" in markdown
    targets = {t["target"] for t in data["targets"]}
    assert "AGG output-layer time / stock fairseq" in targets
    assert {"fused CE time / three-matmul floor", "AGG time / three-matmul floor", "AL time / fused CE",
            "AL time / its own floor (the fused CE's limit)"} <= targets
    # every row's limit and source are the one table's (benchmarks/targets.py)
    agg = next(t for t in data["targets"] if t["target"] == "AGG output-layer time / stock fairseq")
    assert agg["limit"] == "<= 1.05" and "docs/benchmarks.md" in agg["source"]
    assert "fairseq-train words/s, AGG / stock" in targets


def test_a_failing_part_is_recorded_and_the_next_still_runs(tmp_path):
    # a sitecustomize module makes the correctness part raise in the check's process, at its start
    # (before any compilation): the report records the error, and the statistics part after it still runs
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "from benchmarks import ops\n"
        "def augmented_defaults(*args, **kwargs):\n"
        "    raise RuntimeError('out of memory')\n"
        "ops.augmented_defaults = augmented_defaults\n")
    path = os.pathsep.join(p for p in (str(site), REPO, os.environ.get("PYTHONPATH")) if p)
    proc = _run_check(["--cpu-smoke", "--parts", "correctness,stats", "--out", str(tmp_path / "broken")],
                      {"PYTHONPATH": path})
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-4000:]
    parts = json.loads((tmp_path / "broken" / "gpu_check.json").read_text())["parts"]
    assert parts["correctness"]["status"] == "error" and "out of memory" in parts["correctness"]["error"]
    assert parts["stats"]["status"] == "ok"
    # a part the time left cannot hold is recorded as skipped
    proc = _run_check(["--cpu-smoke", "--parts", "train", "--deadline", "1", "--out", str(tmp_path / "late")])
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-4000:]
    parts = json.loads((tmp_path / "late" / "gpu_check.json").read_text())["parts"]
    assert parts["train"]["status"] == "skipped" and "time budget" in parts["train"]["reason"]


def test_bad_arguments_are_refused_up_front(tmp_path):
    proc = _run_check(["--cpu-smoke", "--out", str(tmp_path), "--parts", "correctness,speed"])
    assert proc.returncode == 2 and "--parts" in proc.stderr and "speed" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "gpu_check.json").exists()
    # run as a file, the check cannot import its library: it says how to run it instead
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "gpu_check.py"), "--help"],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "python -m scripts.gpu_check" in proc.stderr
    proc = _run_sh(GPU_CHECK_SH, ["--budget-s", "ten"], tmp_path)
    assert proc.returncode == 2 and "--budget-s" in proc.stderr
    proc = _run_sh(PREPARE_SH, ["--python-version", "twelve"], tmp_path)
    assert proc.returncode == 2 and "--python-version" in proc.stderr


def test_missing_bundle_is_reported(tmp_path):
    proc = _run_sh(GPU_CHECK_SH, [], tmp_path, {"BUNDLE": str(tmp_path / "no_bundle")})
    assert proc.returncode == 1
    install = json.loads((tmp_path / "install.json").read_text())
    assert install["status"] == "error" and "scripts/device/prepare.sh" in install["note"]


def test_an_install_without_scikit_learn_stops_before_installing_anything(tmp_path):
    """The bundle no longer carries scikit-learn and scipy (the accelerator machine has both; fairseq
    imports them): where they do not import, gpu_check.sh says so before pip or a build runs."""
    bundle = tmp_path / "bundle"
    (bundle / "sdist").mkdir(parents=True)
    (bundle / "sdist" / "fairseq_fixed-0.12.3.1.tar.gz").write_bytes(b"not read before the check")
    subprocess.run("sha256sum sdist/* > SHA256SUMS", shell=True, cwd=bundle, check=True)
    (bundle / "INFO.txt").write_text("target: CPython %d.%d, manylinux x86-64\n" % sys.version_info[:2])
    blocker = tmp_path / "site" / "sklearn"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('scikit-learn is not installed here')\n")
    path = os.pathsep.join(p for p in (str(tmp_path / "site"), os.environ.get("PYTHONPATH")) if p)
    out = tmp_path / "out"
    proc = _run_sh(GPU_CHECK_SH, ["--install-only"], out, {"BUNDLE": str(bundle), "PYTHONPATH": path,
                                                           "GPU_CHECK_ENV": str(tmp_path / "env")})
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    install = json.loads((out / "install.json").read_text())
    assert install["status"] == "error" and "scikit-learn or scipy does not import" in install["note"]
    log = (out / "gpu_check.log").read_text()
    assert "pip could not install" not in log and "Processing" not in log and "fairseq-fixed" not in log


def test_precisions_fairseq_cannot_train_at_are_named():
    # fairseq-fixed's options turn --bf16 into --tpu (a TPU-only path); the GPU check records that
    # instead of spending accelerator time on runs that fail
    from fairseq import options

    args = options.parse_args_and_arch(
        options.get_training_parser(), ["data-bin", "--task", "language_modeling", "--arch", "transformer_lm", "--bf16"]
    )
    reason = fairseq_precision_problem("bf16")
    assert (reason is not None) == bool(args.tpu)
    if reason:
        assert "--tpu" in reason
    assert fairseq_precision_problem("fp16") is None


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without a GPU")
def test_without_a_gpu_the_output_says_so(tmp_path):
    proc = _run_check(["--out", str(tmp_path)])
    assert proc.returncode == 1
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert "no CUDA device" in data["error"] and data["parts"] == {}
    assert "Not run: no CUDA device" in (tmp_path / "gpu_check.md").read_text()


def test_training_records_survive_a_root_logger_configured_before_fairseq(smoke):
    """The smoke run's train part ran under ROOT_LOGGER_FIRST (the accelerator machine's failure,
    beside the fixture): every run still recorded its updates."""
    runs = smoke[0]["parts"]["train"]["runs"]
    assert len(runs) == 4
    for run in runs:
        assert "error" not in run and run["num_updates"] == PLAN.updates, run
