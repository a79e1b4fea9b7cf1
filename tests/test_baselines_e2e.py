"""End-to-end: each baseline criterion (docs/baselines.md) in real ``fairseq-train`` LM runs with
``--user-dir``, resumable bit-equal.

Per method, one run of 2N updates saves a checkpoint after N (``--save-interval-updates N``); a
second run restores that checkpoint in another directory and trains to 2N. The per-update logs of
updates N+1 .. 2N, the final model and the criterion's saved state must be identical. The runs are
tiny (CPU, 2 layers, d = 32); the statistics flags ride along on the CosReg run.
"""
import os

import pytest
import torch

from fairseq_agg.stats.groups import frequency_groups
from fairseq_runs import TINY_LM_ARGS, USER_DIR, read_json_log, run_cli

N = 6
VOLATILE = {"wps", "ups", "wall", "train_wall", "gb_free"}  # timing fields of the json log
LM_UNTIED = [a for a in TINY_LM_ARGS if a != "--share-decoder-input-output-embed"]

METHODS = {
    "cosreg": (TINY_LM_ARGS, ["--criterion", "cross_entropy_cosreg", "--embed-stats-interval", "3"], "cosreg"),
    "face": (TINY_LM_ARGS, ["--criterion", "cross_entropy_face", "--face-counting", "window", "--face-window", "4"],
             "face_weight"),
    "ul": (TINY_LM_ARGS, ["--criterion", "cross_entropy_unlikelihood"], "ul_loss"),
    # untied, static set: the frozen output rows can be checked in the checkpoints
    "freeze": (LM_UNTIED, ["--criterion", "cross_entropy_agg", "--agg-freeze-rare", "--agg-freeze-set", "group"],
               "agg_frozen"),
}


def train(data, base, extra, save_dir, restore=None):
    args = [data, "--user-dir", USER_DIR] + base + extra + [
        "--max-update", 2 * N, "--save-interval-updates", N, "--no-epoch-checkpoints",
        "--save-dir", save_dir, "--log-format", "json",
        "--output-kernel", "auto",  # the default, compiled here: each criterion's one compiled real run
    ]
    if restore:
        args += ["--restore-file", restore]
    return run_cli("fairseq-train", args)


def train_inner(proc):
    return [r for r in read_json_log(proc.stdout + proc.stderr) if "num_updates" in r and "loss" in r
            and not any(k.startswith("valid_") for k in r)]


def load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_train_and_resume_bit_equal(lm_data_bin, tmp_path, method):
    base, extra, key = METHODS[method]
    straight_dir, resumed_dir = str(tmp_path / "straight"), str(tmp_path / "resumed")
    straight = train(lm_data_bin, base, extra, straight_dir)
    middle = os.path.join(straight_dir, f"checkpoint_1_{N}.pt")
    resumed = train(lm_data_bin, base, extra, resumed_dir, restore=middle)

    records = train_inner(straight)
    assert [int(r["num_updates"]) for r in records] == list(range(1, 2 * N + 1))
    assert all(key in r for r in records), key  # the method logs its own term
    losses = [float(r["loss"]) for r in records]
    assert sum(losses[-3:]) < sum(losses[:3])

    resumed_records = train_inner(resumed)
    assert [int(r["num_updates"]) for r in resumed_records] == list(range(N + 1, 2 * N + 1))
    by_update = {int(r["num_updates"]): r for r in records}
    for rec in resumed_records:
        want = by_update[int(rec["num_updates"])]
        assert {k: v for k, v in rec.items() if k not in VOLATILE} == {
            k: v for k, v in want.items() if k not in VOLATILE
        }, rec["num_updates"]

    final_straight = load(os.path.join(straight_dir, "checkpoint_last.pt"))
    final_resumed = load(os.path.join(resumed_dir, "checkpoint_last.pt"))
    for name, value in final_straight["model"].items():
        assert torch.equal(value, final_resumed["model"][name]), name
    criterion_state = final_straight.get("criterion") or {}
    assert criterion_state.keys() == (final_resumed.get("criterion") or {}).keys()
    for name, value in criterion_state.items():
        assert torch.equal(value, final_resumed["criterion"][name]), name

    if method == "cosreg":
        assert any("mean_cos" in r for r in records)  # combines with the statistics flags
    if method == "face":
        assert criterion_state["counter.counts"].sum() > 0  # the counting window is checkpointed
    if method == "freeze":
        # the rare group's output rows never moved: Adam keeps a row with zero gradients in place
        from fairseq.data import Dictionary

        rare = frequency_groups(Dictionary.load(os.path.join(lm_data_bin, "dict.txt")))["rare"]
        first = load(middle)["model"]["decoder.output_projection.weight"]
        last = final_straight["model"]["decoder.output_projection.weight"]
        assert torch.equal(first[rare], last[rare]) and not torch.equal(first, last)
