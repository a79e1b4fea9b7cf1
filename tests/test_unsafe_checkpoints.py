"""A checkpoint from elsewhere runs no code on any path that loads the plugin (issue #56, item 6).

Each test plants a ``checkpoint*.pt`` whose unpickling would create a marker directory, sets
``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` (which turns torch's safe loader off wherever a caller does
not name ``weights_only``, as fairseq's ``load_checkpoint_to_cpu`` does not), and runs a command
that reads it: fairseq-train (``--restore-file``, a resume, ``--finetune-from-model``),
fairseq-eval-lm, fairseq-generate, ``fairseq-agg analyze`` and ``average-checkpoints``. Each ends
in one line naming the file, exit status 2, and no marker. Most run in this process
(tests/support/in_process.py, the environment variable set for the test); one real fairseq-train
process covers the variable as a fresh process sees it.
"""
import os

import pytest
import torch

import fairseq_runs
from fairseq_runs import TINY_LM_ARGS, TINY_MT_ARGS, USER_DIR
from in_process import fairseq_agg_analyze, fairseq_agg_command, fairseq_train, run_in_process
from planted_pickle import RunsCodeWhenUnpickled


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """(a checkpoint*.pt with a payload, the marker its payload would create); the unsafe loading
    forced on through the environment."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    marker = tmp_path / "code-ran"
    path = tmp_path / "elsewhere" / "checkpoint_9_999.pt"
    path.parent.mkdir()
    torch.save({"model": {"w": torch.zeros(2)}, "optimizer_history": [{"num_updates": 999}],
                "extra_state": RunsCodeWhenUnpickled(str(marker))}, path)
    return path, marker


def refusal(path):
    return (f"checkpoint {path} holds objects that a safe load (torch.load with weights_only=True) does not run; "
            "load it yourself, with weights_only=False, only if you trust its source")


def assert_refused(outcome, prog, path, marker):
    lines = outcome.stderr.strip().splitlines()
    assert outcome.returncode == 2, outcome.stderr[-3000:]
    assert "Traceback" not in outcome.stderr
    assert lines[-1] == f"{prog}: error: {refusal(path)}"
    assert not [line for line in lines[:-1] if "error" in line.lower()]  # one line
    assert not marker.exists()


def test_the_planted_file_would_run_its_code_unsafely(planted):
    """The payload is real: torch's unsafe loader, which the environment forces here, runs it."""
    path, marker = planted
    torch.load(path)  # names no weights_only, as fairseq's loader does not
    assert marker.is_dir()


def train_args(data, save_dir, extra):
    return [data, "--user-dir", USER_DIR, *TINY_LM_ARGS, "--criterion", "cross_entropy_agg", "--max-update", "2",
            "--save-dir", save_dir, "--output-kernel", "eager", *extra]


@pytest.mark.parametrize("how", ["restore-file", "resume", "finetune-from-model"])
def test_fairseq_train_refuses_it_in_one_line(planted, lm_data_bin, tmp_path, how):
    path, marker = planted
    save_dir = tmp_path / "save"
    if how == "resume":  # the planted file is the run's own checkpoint_last.pt
        save_dir.mkdir()
        path = path.rename(save_dir / "checkpoint_last.pt")
        extra = []
    else:
        extra = [f"--{how}", str(path)]
    outcome = fairseq_train(train_args(lm_data_bin, str(save_dir), extra))
    assert_refused(outcome, "fairseq-train", path, marker)
    assert not (save_dir / "crash.pt").exists() and not (save_dir / "checkpoint_1_2.pt").exists()


def test_fairseq_train_process_refuses_it_in_one_line(planted, lm_data_bin, tmp_path):
    """A fresh process, with the environment variable it inherits."""
    path, marker = planted
    proc = fairseq_runs.run_cli("fairseq-train", train_args(lm_data_bin, str(tmp_path / "save"),
                                                            ["--restore-file", str(path)]), expect_ok=False, timeout=300)
    assert_refused(proc, "fairseq-train", path, marker)


def test_eval_lm_and_generate_refuse_it_in_one_line(planted, lm_data_bin, mt_data_bin):
    import fairseq_agg
    from fairseq_cli import eval_lm, generate

    fairseq_agg.register_with_fairseq()  # what their --user-dir does in a process
    path, marker = planted
    outcome = run_in_process("fairseq-eval-lm", eval_lm.cli_main,
                             [lm_data_bin, "--user-dir", USER_DIR, "--path", path, "--cpu", "--max-tokens", "512"])
    assert_refused(outcome, "fairseq-eval-lm", path, marker)
    outcome = run_in_process("fairseq-generate", generate.cli_main,
                             [mt_data_bin, "--user-dir", USER_DIR, "--path", path, "--cpu", "--source-lang", "en",
                              "--target-lang", "de", "--max-tokens", "600", "--beam", "1"])
    assert_refused(outcome, "fairseq-generate", path, marker)


def test_the_plugins_own_readers_refuse_it_in_one_line(planted, tmp_path):
    path, marker = planted
    outcome = fairseq_agg_analyze([path, "--out", tmp_path / "analysis", "--cpu"])
    assert_refused(outcome, "fairseq-agg-analyze", path, marker)
    assert not (tmp_path / "analysis").exists()
    other = path.parent / "checkpoint_8_998.pt"
    torch.save({"model": {"w": torch.zeros(2)}}, other)
    outcome = fairseq_agg_command(["average-checkpoints", "--inputs", path, other, "--output", tmp_path / "avg.pt"])
    assert outcome.returncode == 2 and not marker.exists() and not (tmp_path / "avg.pt").exists()
    assert outcome.stderr.strip().splitlines()[-1] == f"fairseq-agg average-checkpoints: error: --inputs: {refusal(path)}"


def test_the_resume_advice_never_proposes_it(planted, lm_data_bin, tmp_path):
    """A damaged checkpoint_last.pt beside the planted file only: no file is proposed; beside an
    intact one too: the intact one, although the planted file claims more updates."""
    path, marker = planted
    save_dir = path.parent
    last = save_dir / "checkpoint_last.pt"
    last.write_bytes(b"truncated")
    outcome = fairseq_train(train_args(lm_data_bin, str(save_dir), []))
    assert outcome.returncode == 2 and not marker.exists()
    assert outcome.stderr.strip().splitlines()[-1] == (
        f"fairseq-train: error: checkpoint {last} is truncated or damaged (9 bytes, not a complete torch archive): "
        "no intact checkpoint that loads safely is beside it; remove it to start afresh")

    from fairseq_agg.fairseq_facts.checkpoint_files import damaged_checkpoint_message

    intact = save_dir / "checkpoint_1_8.pt"
    torch.save({"model": {"w": torch.zeros(2)}, "optimizer_history": [{"num_updates": 8}]}, intact)
    assert damaged_checkpoint_message(str(last)).endswith(f"--restore-file {intact}")
    assert not marker.exists()
