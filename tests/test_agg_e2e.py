"""End-to-end: real fairseq-train / fairseq-eval-lm / fairseq-generate subprocesses with --user-dir.

* LM (``language_modeling``, tied embeddings) and MT (``translation``, ``--share-all-embeddings``,
  label smoothing 0.1, ``--agg-alpha 0.08``): the loss goes down, checkpoints are written, and
  fairseq's own evaluation tools load them;
* resume: a straight run of 2N updates and a run of N updates resumed for N more give identical
  saved windows and identical per-update logs (N mid-epoch, the resumed half crossing an epoch
  boundary);
* bad input: a non-zero exit naming the flag, before any checkpoint is written;
* the ``fairseq-agg`` console script and ``python -m fairseq_agg_cli`` print the --user-dir path (the
  runs below use the printed paths).
"""
import os
import re
import subprocess
import sys

import pytest
import torch

import in_process
from fairseq_runs import TINY_LM_ARGS, TINY_MT_ARGS, USER_DIR, read_json_log, run_cli

N = 16  # resume point: mid-epoch (one epoch of the tiny LM data is 28 updates)
VOLATILE = {"wps", "ups", "wall", "train_wall", "gb_free"}  # timing fields of the json log


def checkpoints(save_dir):
    return sorted(f for f in os.listdir(save_dir) if f.endswith(".pt")) if os.path.isdir(save_dir) else []


def train_inner(proc):
    return [r for r in read_json_log(proc.stdout + proc.stderr) if "num_updates" in r and "loss" in r]


def records_of(proc, prefix):
    return [r for r in read_json_log(proc.stdout + proc.stderr) if f"{prefix}_loss" in r]


def load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


@pytest.fixture(scope="module")
def user_dirs():
    console = run_cli("fairseq-agg", []).stdout.strip()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    module = subprocess.run(
        [sys.executable, "-m", "fairseq_agg_cli"], capture_output=True, text=True, check=True, env=env
    ).stdout.strip()
    return {"console": console, "module": module}


def test_user_dir_commands_print_the_plugin_path(user_dirs):
    for path in user_dirs.values():
        assert os.path.isabs(path) and os.path.isfile(os.path.join(path, "__init__.py"))
        assert os.path.realpath(path) == os.path.realpath(USER_DIR)
    # the LM and MT runs below pass these printed paths to --user-dir


def lm_train(data, user_dir, save_dir, max_update, extra=()):
    args = [data, "--user-dir", user_dir] + TINY_LM_ARGS + [
        "--criterion", "cross_entropy_agg", "--agg-alpha", "0.03", "--max-update", max_update,
        "--save-dir", save_dir, "--log-format", "json",
        # fairseq-fixed's batch_by_size drops a last batch whose size is not a multiple of
        # --required-batch-size-multiple (default 8); 1 keeps every validation block, so the
        # validation loss below covers the same tokens as fairseq-eval-lm
        "--required-batch-size-multiple", "1",
    ] + list(extra)
    return run_cli("fairseq-train", args)


@pytest.fixture(scope="module")
def lm_runs(lm_data_bin, user_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("agg_lm")
    straight_dir, resumed_dir = str(root / "straight"), str(root / "resumed")
    straight = lm_train(lm_data_bin, user_dirs["console"], straight_dir, 2 * N)
    first = lm_train(lm_data_bin, user_dirs["console"], resumed_dir, N)
    first_ckpt = load(os.path.join(resumed_dir, "checkpoint_last.pt"))
    resumed = lm_train(lm_data_bin, user_dirs["console"], resumed_dir, 2 * N)
    return {"straight": straight, "straight_dir": straight_dir, "first": first, "first_ckpt": first_ckpt,
            "resumed": resumed, "resumed_dir": resumed_dir}


def test_lm_training_loss_goes_down_and_checkpoints_written(lm_runs):
    records = train_inner(lm_runs["straight"])
    assert [int(r["num_updates"]) for r in records] == list(range(1, 2 * N + 1))
    losses = [float(r["loss"]) for r in records]
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 1.0
    for r in records:  # 1x CE: loss and nll_loss are the same quantity for LM
        assert r["loss"] == r["nll_loss"]
        assert float(r["ppl"]) == pytest.approx(2 ** float(r["nll_loss"]), rel=5e-3)
        for key in ("agg_rare", "agg_very_rare", "agg_g1", "agg_g2"):
            assert key in r
    valid = records_of(lm_runs["straight"], "valid")
    assert len(valid) == 2 and float(valid[-1]["valid_loss"]) < float(valid[0]["valid_loss"])
    assert {"checkpoint_last.pt", "checkpoint_best.pt", "checkpoint1.pt"} <= set(
        checkpoints(lm_runs["straight_dir"])
    )
    state = load(os.path.join(lm_runs["straight_dir"], "checkpoint_last.pt"))
    assert state["cfg"]["criterion"]["_name"] == "cross_entropy_agg"
    window, update_index, recorded = state["criterion"]["window.meta"].tolist()
    updates_in_epoch1 = sum(1 for r in records if r["epoch"] == 1)
    assert N < updates_in_epoch1 < 2 * N  # the layout the resume test relies on
    assert window == updates_in_epoch1 and update_index == 2 * N and recorded == window


def test_eval_lm_loads_the_checkpoint(lm_runs, lm_data_bin, user_dirs):
    proc = run_cli(
        "fairseq-eval-lm",
        [lm_data_bin, "--path", os.path.join(lm_runs["straight_dir"], "checkpoint_last.pt"),
         "--user-dir", user_dirs["console"], "--gen-subset", "valid", "--tokens-per-sample", "64",
         "--max-tokens", "512", "--cpu", "--num-workers", "0"],
    )
    match = re.search(r"Loss \(base 2\): ([0-9.]+), Perplexity: ([0-9.]+)", proc.stdout + proc.stderr)
    assert match, proc.stderr[-2000:]
    loss = float(match.group(1))
    # the model is the trained one: its valid loss is the one fairseq-train's last validation reported
    last_valid = float(records_of(lm_runs["straight"], "valid")[-1]["valid_nll_loss"])
    assert loss == pytest.approx(last_valid, abs=1e-3)


def test_resume_gives_identical_windows_and_per_update_logs(lm_runs):
    first_window = lm_runs["first_ckpt"]["criterion"]["window.meta"].tolist()
    assert first_window[1] == N  # the first run stopped after N updates, mid-epoch 1
    assert lm_runs["first_ckpt"]["extra_state"]["train_iterator"]["epoch"] == 1

    resumed_records = train_inner(lm_runs["resumed"])
    assert [int(r["num_updates"]) for r in resumed_records] == list(range(N + 1, 2 * N + 1))  # really resumed
    straight_records = {int(r["num_updates"]): r for r in train_inner(lm_runs["straight"])}
    epochs = set()
    for rec in resumed_records:
        want = straight_records[int(rec["num_updates"])]
        got = {k: v for k, v in rec.items() if k not in VOLATILE}
        assert got == {k: v for k, v in want.items() if k not in VOLATILE}, rec["num_updates"]
        epochs.add(rec["epoch"])
    assert epochs == {1, 2}  # the resumed half crosses the epoch boundary

    straight = load(os.path.join(lm_runs["straight_dir"], "checkpoint_last.pt"))
    resumed = load(os.path.join(lm_runs["resumed_dir"], "checkpoint_last.pt"))
    assert straight["criterion"].keys() == resumed["criterion"].keys()
    for key, value in straight["criterion"].items():  # ring, counts, current, meta
        assert torch.equal(value, resumed["criterion"][key]), key
    for key, value in straight["model"].items():
        assert torch.equal(value, resumed["model"][key]), key


def test_mt_train_and_generate(mt_data_bin, user_dirs, tmp_path):
    save_dir = str(tmp_path / "mt")
    proc = run_cli(
        "fairseq-train",
        [mt_data_bin, "--user-dir", user_dirs["module"]] + TINY_MT_ARGS + [
            "--criterion", "cross_entropy_agg", "--label-smoothing", "0.1", "--agg-alpha", "0.08",
            "--max-update", "30", "--save-dir", save_dir, "--log-format", "json", "--no-epoch-checkpoints",
        ],
    )
    records = train_inner(proc)
    assert [int(r["num_updates"]) for r in records] == list(range(1, 31))
    losses = [float(r["loss"]) for r in records]
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 1.0
    # with label smoothing the optimised loss is above the plain CE, as for fairseq's stock criterion
    assert all(float(r["loss"]) > float(r["nll_loss"]) for r in records)
    assert {"checkpoint_last.pt", "checkpoint_best.pt"} <= set(checkpoints(save_dir))
    state = load(os.path.join(save_dir, "checkpoint_last.pt"))
    assert state["cfg"]["criterion"]["label_smoothing"] == 0.1 and state["cfg"]["criterion"]["agg_alpha"] == 0.08
    assert state["criterion"]["window.counts"].sum() > 0

    gen = run_cli(
        "fairseq-generate",
        [mt_data_bin, "--path", os.path.join(save_dir, "checkpoint_last.pt"), "--user-dir", user_dirs["module"],
         "--gen-subset", "test", "--beam", "2", "--max-len-a", "1", "--max-len-b", "5", "--max-tokens", "2000",
         "--required-batch-size-multiple", "1", "--cpu", "--num-workers", "0"],
    )
    out = gen.stdout + gen.stderr
    hypotheses = [line for line in gen.stdout.splitlines() if line.startswith("H-")]
    assert len(hypotheses) == 100  # every test sentence translated (see the batch-multiple note above)
    assert re.search(r"BLEU4? = [0-9.]+", out), out[-2000:]


LM_UNTIED = [a for a in TINY_LM_ARGS if a != "--share-decoder-input-output-embed"]
LSTM_LM = [
    "--task", "language_modeling", "--arch", "lstm_lm", "--decoder-layers", "1", "--decoder-embed-dim", "32",
    "--decoder-hidden-size", "32", "--decoder-out-embed-dim", "32", "--tokens-per-sample", "64",
    "--sample-break-mode", "none", "--max-tokens", "512", "--optimizer", "adam", "--lr", "0.005",
    "--seed", "1", "--cpu", "--num-workers", "0", "--no-progress-bar",
]


@pytest.mark.parametrize(
    "case,base,extra,needle",
    [
        ("alpha", TINY_LM_ARGS, ["--agg-alpha", "0"], "--agg-alpha"),
        ("window", TINY_LM_ARGS, ["--agg-window", "-1"], "--agg-window"),
        ("smoothing", TINY_LM_ARGS, ["--label-smoothing", "1.0"], "--label-smoothing"),
        ("adaptive", LM_UNTIED, ["--adaptive-softmax-cutoff", "50,100"], "--adaptive-softmax-cutoff"),
        ("no_projection", LSTM_LM, [], "output projection"),  # fairseq's LSTM decoder has none
    ],
)
def test_bad_input_fails_before_any_checkpoint(lm_data_bin, tmp_path, case, base, extra, needle):
    save_dir = str(tmp_path / case)
    # fairseq-train's entry point in this process (tests/support/in_process.py)
    proc = in_process.fairseq_train(
        [lm_data_bin, "--user-dir", USER_DIR] + base
        + ["--criterion", "cross_entropy_agg", "--max-update", "3", "--save-dir", save_dir] + extra)
    assert proc.returncode == 2
    assert needle in proc.stderr, proc.stderr[-3000:]
    assert checkpoints(save_dir) == []  # nothing written, not even fairseq's crash.pt
