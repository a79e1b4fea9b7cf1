"""fairseq's copies to checkpoint_last.pt cannot be truncated by a kill, and a truncated one is one
line naming the checkpoint to resume from (issue #35; fairseq_agg/fairseq_facts/checkpoint_files.py).

Real ``fairseq-train`` subprocesses on the tiny LM: a run of 16 updates with a checkpoint every 8
(checkpoint_1_8.pt, checkpoint_1_16.pt, then their copy checkpoint_last.pt), and a straight run of
24 updates to compare a resume with.
"""
import os
import resource
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from fairseq_runs import TINY_LM_ARGS, USER_DIR, eager_unless_named, fairseq_bin, file_digests as digests, run_cli
from planted_pickle import RunsCodeWhenUnpickled


def train_args(data, save_dir, max_update, extra=()):
    return [data, "--user-dir", USER_DIR] + TINY_LM_ARGS + [
        "--criterion", "cross_entropy_agg", "--agg-alpha", "0.03", "--max-update", str(max_update),
        "--save-interval-updates", "8", "--save-dir", save_dir,
    ] + list(extra)


def load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


@pytest.fixture(scope="module")
def runs(lm_data_bin, tmp_path_factory):
    root = tmp_path_factory.mktemp("faults_checkpoints")
    interrupted, straight = str(root / "interrupted"), str(root / "straight")
    run_cli("fairseq-train", train_args(lm_data_bin, interrupted, 16))
    run_cli("fairseq-train", train_args(lm_data_bin, straight, 24))
    return {"interrupted": interrupted, "straight": straight, "data": lm_data_bin}


def dead_pid():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.mark.parametrize("kept_bytes", [0, 4096], ids=["empty", "truncated"])
def test_a_truncated_checkpoint_last_is_one_line_naming_the_checkpoint_to_resume_from(runs, tmp_path, kept_bytes):
    save_dir = str(tmp_path / "ckpt")
    shutil.copytree(runs["interrupted"], save_dir)
    last = os.path.join(save_dir, "checkpoint_last.pt")
    with open(last, "r+b") as f:  # what a kill during fairseq's plain copy left behind
        f.truncate(kept_bytes)
    before = digests(save_dir)

    proc = run_cli("fairseq-train", train_args(runs["data"], save_dir, 24), expect_ok=False, timeout=300)
    intact = os.path.join(save_dir, "checkpoint_1_16.pt")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"fairseq-train: error: checkpoint {last} is truncated or damaged ({kept_bytes} bytes, not a complete "
        f"torch archive): resume from the newest intact one with --restore-file {intact}")
    assert digests(save_dir) == before  # nothing changed, nothing added (no crash.pt)

    # the advice works: the resume from it ends where the straight run ends, bit for bit, and
    # removes the temporary copy a killed run left (its process is gone)
    stale = os.path.join(save_dir, f".checkpoint_last.pt.{dead_pid()}.x1y2z3_a.tmp")
    with open(stale, "wb") as f:
        f.write(b"partial copy")
    run_cli("fairseq-train", train_args(runs["data"], save_dir, 24, ["--restore-file", intact]))
    assert not os.path.exists(stale)
    resumed, straight = load(last), load(os.path.join(runs["straight"], "checkpoint_last.pt"))
    assert resumed["optimizer_history"][-1]["num_updates"] == 24
    for part in ("model", "criterion"):
        assert resumed[part].keys() == straight[part].keys()
        for key, value in straight[part].items():
            assert torch.equal(value, resumed[part][key]), (part, key)


COPY_UNDER_A_FILE_SIZE_LIMIT = """
import os, resource, signal, sys
import fairseq_agg
from fairseq.file_io import PathManager
fairseq_agg.register_with_fairseq()  # as --user-dir does: fairseq's checkpoint copies become atomic
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[3]), int(sys.argv[3])))
PathManager.copy(sys.argv[1], sys.argv[2], overwrite=True)
"""


def test_a_copy_that_fails_midway_leaves_the_previous_checkpoint_last(runs, tmp_path):
    """fairseq's own call (PathManager.copy, as checkpoint_utils.save_checkpoint makes it), cut
    off halfway by a file-size limit: the previous checkpoint_last.pt is kept whole, and no
    temporary copy is left."""
    save_dir = str(tmp_path / "ckpt")
    shutil.copytree(runs["interrupted"], save_dir)
    source = os.path.join(save_dir, "checkpoint_1_16.pt")
    last = os.path.join(save_dir, "checkpoint_last.pt")
    shutil.copyfile(os.path.join(save_dir, "checkpoint_1_8.pt"), last)  # the previous one
    before = digests(save_dir)

    limit = os.path.getsize(source) // 2
    proc = subprocess.run([sys.executable, "-c", COPY_UNDER_A_FILE_SIZE_LIMIT, source, last, str(limit)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0, proc.stderr[-3000:]
    # the plugin's UsageError (one line in a fairseq command; here the program's own call keeps its traceback)
    assert proc.stderr.strip().splitlines()[-1] == (
        f"fairseq_agg.errors.UsageError: file size limit exceeded writing {last}; the previous {last} is kept")
    assert digests(save_dir) == before

    proc = subprocess.run([sys.executable, "-c", COPY_UNDER_A_FILE_SIZE_LIMIT, source, last, str(2 ** 40)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    after = digests(save_dir)
    assert after["checkpoint_last.pt"] == before["checkpoint_1_16.pt"] and set(after) == set(before)


def test_a_checkpoint_save_that_runs_out_of_room_is_one_line_and_leaves_nothing(runs, tmp_path):
    """A real fairseq-train, resumed at update 16, saves checkpoint_1_24.pt under a file-size limit
    of half a checkpoint (what a full disk does to fairseq's first write of a checkpoint): one
    line naming the file, exit 2, the directory as it was (no NAME.tmp), and the same command
    without the limit then trains to the end."""
    save_dir = str(tmp_path / "ckpt")
    shutil.copytree(runs["interrupted"], save_dir)
    before = digests(save_dir)
    limit = os.path.getsize(os.path.join(save_dir, "checkpoint_last.pt")) // 2

    def under_the_limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    args = [fairseq_bin("fairseq-train")] + eager_unless_named("fairseq-train", train_args(runs["data"], save_dir, 24))
    env = dict(os.environ, OMP_NUM_THREADS="2")
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env, preexec_fn=under_the_limit)
    saved = os.path.join(save_dir, "checkpoint_1_24.pt")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"fairseq-train: error: file size limit exceeded writing {saved}; {saved} was not written")
    assert digests(save_dir) == before

    run_cli("fairseq-train", train_args(runs["data"], save_dir, 24))
    resumed, straight = load(saved), load(os.path.join(runs["straight"], "checkpoint_1_24.pt"))
    assert resumed["optimizer_history"][-1]["num_updates"] == 24
    for key, value in straight["model"].items():
        assert torch.equal(value, resumed["model"][key]), key


def test_ranking_the_checkpoints_for_the_advice_never_runs_their_code(tmp_path):
    """The advice of a truncated checkpoint ranks every checkpoint*.pt beside it by its updates
    (checkpoint_files.checkpoint_updates) with torch's safe loader, as fairseq loads checkpoints: a
    planted file whose unpickling would run code ranks last and runs nothing (issue #49)."""
    import argparse

    from fairseq_agg.fairseq_facts.checkpoint_files import checkpoint_updates, damaged_checkpoint_message

    save_dir, marker = tmp_path / "ckpt", tmp_path / "code-ran"
    save_dir.mkdir()
    planted = save_dir / "checkpoint_9_999.pt"  # claims the most updates
    torch.save({"optimizer_history": [{"num_updates": 999}], "extra": RunsCodeWhenUnpickled(str(marker))}, planted)
    intact = save_dir / "checkpoint_1_8.pt"  # a checkpoint's layout, fairseq's legacy Namespace included
    torch.save({"args": argparse.Namespace(arch="transformer_lm"), "model": {"w": torch.zeros(2)},
                "optimizer_history": [{"num_updates": 8}]}, intact)
    last = save_dir / "checkpoint_last.pt"
    last.write_bytes(b"truncated")

    assert checkpoint_updates(str(planted)) == -1 and checkpoint_updates(str(intact)) == 8
    assert damaged_checkpoint_message(str(last)).endswith(f"resume from the newest intact one with --restore-file "
                                                          f"{intact}")
    assert not marker.exists()
    torch.load(planted, weights_only=False)  # the unsafe loader would have run it
    assert marker.is_dir()
