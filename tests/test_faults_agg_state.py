"""A checkpoint's counting state is checked when it is loaded, before the first update (issue #35;
fairseq_agg/ops/counting.py ``check_window_state`` / ``check_cumulative_state``, called from
``OutputLossCriterion.load_state_dict``).

Unit tests of the checks on windows driven through every kind of history (wrap-around, jumps,
resizes, an update number that goes back), then real ``fairseq-train`` subprocesses: one tiny AGG
run of 4 updates with a window of 3 (the ring has wrapped), whose checkpoint is copied and damaged
into a new directory per case and resumed from there with the same command.
"""
import os
import shutil

import pytest
import torch

from fairseq_agg.errors import UsageError
from fairseq_agg.ops.counting import CumulativeCounts, RareTokenWindow, check_cumulative_state, check_window_state
from fairseq_runs import TINY_LM_ARGS, USER_DIR, file_digests as digests, read_json_log, run_cli

VOCAB = 7


def driven(window, schedule, vocab=VOCAB):
    """A window fed one histogram per update index of ``schedule`` (a repeated index counts into the
    same update, a jump skips updates, a smaller index goes back)."""
    generator = torch.Generator().manual_seed(len(schedule))
    for t in schedule:
        window.start_update(t)
        window.add(torch.randint(0, 4, (vocab,), generator=generator))
    return window


HISTORIES = {
    "fresh": [],
    "first update": [1],
    "before wrap-around": [1, 2, 3],
    "wrapped": list(range(1, 12)),
    "repeated index": [1, 2, 2, 3, 3, 4],
    "jump": [1, 2, 9, 10],
    "jump past the window": [1, 2, 3, 40],
    "first update 5001 (fine-tuning a stock checkpoint)": [5001, 5002, 5003],
    # --finetune-from-model of an AGG checkpoint: fairseq's update number starts again at 0
    "update number goes back": list(range(1, 4)) + list(range(1, 3)),
    "goes back inside the window": list(range(1, 12)) + [3, 4],
}


@pytest.mark.parametrize("size", [1, 4, 16])
@pytest.mark.parametrize("history", list(HISTORIES))
def test_every_state_a_window_writes_passes_the_checks(history, size):
    window = driven(RareTokenWindow(VOCAB, size), HISTORIES[history])
    state = window.state_dict()
    assert check_window_state(state, VOCAB) == (size, window.update_index, window.recorded)
    for new in (1, 3, 20):  # and after a resize on resume
        resized = RareTokenWindow(VOCAB, new)
        resized.load_state_dict(state)
        check_window_state(resized.state_dict(), VOCAB)
        check_window_state(driven(resized, [window.update_index + 1]).state_dict(), VOCAB)


def test_an_update_number_that_goes_back_keeps_the_newest_updates_oldest_first():
    """fairseq restarts the update number at 0 on --finetune-from-model: the window goes on from the
    updates it holds, renumbered, so that the oldest of them still leaves first and the rows stay
    those of the updates before the open one (which the checks ask, issue #49)."""
    hist = {k: torch.full((VOCAB,), 2 ** k) for k in range(1, 9)}  # one bit each: the sum says which are held
    window = RareTokenWindow(VOCAB, 4)
    for t in range(1, 7):  # updates 1 to 6: the window holds 3, 4, 5 and 6
        window.start_update(t)
        window.add(hist[t])
    window.start_update(1)  # the update number starts again: update 3 leaves
    window.add(hist[7])
    assert window.counts.tolist() == [2 ** 4 + 2 ** 5 + 2 ** 6 + 2 ** 7] * VOCAB
    window.start_update(2)  # then update 4, the oldest
    window.add(hist[8])
    assert window.counts.tolist() == [2 ** 5 + 2 ** 6 + 2 ** 7 + 2 ** 8] * VOCAB  # 2^8 in the overflow table
    assert check_window_state(window.state_dict(), VOCAB) == (4, 2, 4)


def test_an_update_index_that_disagrees_with_the_filled_rows_is_refused():
    """Update 4 of a window of 8 (rows 1 to 3 finished, row 4 open) with its index set to 40: the
    rows of updates 37 to 39 would hold the finished counts, not rows 1 to 3 (issue #49)."""
    state = driven(RareTokenWindow(VOCAB, 8), [1, 2, 3, 4]).state_dict()
    assert check_window_state(state, VOCAB) == (8, 4, 4)
    with pytest.raises(UsageError, match=r"^row 1 of ring holds counts, but meta says update 40 with 4 updates "
                                         r"recorded: the rows of updates 37 to 39 \(mod 8\) may hold finished counts$"):
        check_window_state(edited(state, meta=set_at(1, 40)), VOCAB)


def test_the_update_index_is_the_checkpoints_update_count():
    """A full window (3 of 3) accepts any index whose open row is empty; the checkpoint's update
    count (fairseq's optimizer_history) tells update 4 from update 40 (issue #49)."""
    state = driven(RareTokenWindow(VOCAB, 3), [1, 2, 3, 4]).state_dict()
    assert check_window_state(state, VOCAB, saved_after=4) == (3, 4, 3)
    assert check_window_state(state, VOCAB, saved_after=3) == (3, 4, 3)  # update 4 skipped (fp16 overflow)
    damaged = edited(state, meta=set_at(1, 40))
    assert check_window_state(damaged, VOCAB) == (3, 40, 3)
    for saved_after in (4, 41):
        with pytest.raises(UsageError, match=rf"^meta says update 40, but the checkpoint was saved after {saved_after} "
                                             rf"updates \(expected update {saved_after}, or {saved_after + 1} after"):
            check_window_state(damaged, VOCAB, saved_after=saved_after)


def saved_window():
    """A wrapped window (4 rows, update 10: rows 3, 0, 1 finished, row 2 open), as saved."""
    return driven(RareTokenWindow(VOCAB, 4), list(range(1, 11))).state_dict()


def edited(state, **changes):
    state = {key: value.clone() for key, value in state.items()}
    for key, change in changes.items():
        if change is None:
            del state[key]
        elif callable(change):
            change(state[key])
        else:
            state[key] = change
    return state


def set_at(index, value):
    return lambda tensor: tensor.__setitem__(index, value)


@pytest.mark.parametrize("changes,message", [
    ({"counts": set_at(5, -1)}, "counts has negative entries"),
    ({"overflow": torch.tensor([[0, 5, 254]])},
     "overflow holds a count below 255 (those are kept in ring)"),
    ({"ring": set_at((0, 5), 255)}, "overflow does not list exactly the entries of ring that read 255"),
    ({"overflow": torch.tensor([[7, 5, 300]])}, "overflow has entries outside ring's 4 x 7 counts"),
    ({"current": set_at(2, 10**6)}, "counts is not the sum of ring and current"),
    ({"meta": set_at(1, 9)}, "row 1 of ring, the row of the update being counted (update 9 in meta), is not empty"),
    ({"meta": set_at(2, 2)}, "ring holds 3 finished updates, but meta says 2 updates recorded"),
    ({"meta": set_at(2, 5)}, "meta says update 10 with 5 updates recorded"),
    ({"meta": set_at(1, 0)}, "meta says update 0 with 4 updates recorded"),
    ({"meta": set_at(0, 3)}, "meta says a window of 3 updates, but ring has 4 rows"),
    ({"meta": set_at(0, 6)}, "meta says a window of 6 updates, but ring has 4 rows"),
    ({"meta": set_at(0, 0)}, "meta says a window of 0 updates (at least 1)"),
    ({"meta": set_at(0, -4)}, "meta has negative entries"),
    ({"meta": torch.tensor([4, 10])}, "meta has shape (2,), expected (3,)"),
    ({"counts": torch.zeros(VOCAB, dtype=torch.float32)}, "counts has dtype torch.float32, expected torch.int64"),
    ({"ring": torch.zeros(4, VOCAB + 2, dtype=torch.uint8)}, f"ring counts a vocabulary of {VOCAB + 2} tokens, the dictionary has {VOCAB}"),
    ({"counts": torch.zeros(VOCAB + 1, dtype=torch.int64)}, f"counts has shape ({VOCAB + 1},), expected ({VOCAB},)"),
    ({"ring": [[0] * VOCAB] * 4}, "ring is a list, not a tensor"),
    ({"current": None}, "current missing"),
    ({"ring": None, "meta": None, "extra": torch.zeros(1)}, "ring, meta missing; extra not expected"),
])
def test_a_damaged_window_fails_the_check_it_breaks(changes, message):
    with pytest.raises(UsageError) as error:
        check_window_state(edited(saved_window(), **changes), VOCAB)
    assert message in str(error.value)


def test_a_window_of_the_int32_format_is_checked_too():
    """Checkpoints from before the one-byte ring (an int32 ring, no overflow table) still load,
    and are checked the same way."""
    window = driven(RareTokenWindow(VOCAB, 4), list(range(1, 11)))
    state = {key: value for key, value in window.state_dict().items() if key != "overflow"}
    state["ring"] = torch.stack([window.row_counts(row) for row in range(4)]).to(torch.int32)
    assert check_window_state(state, VOCAB) == (4, 10, 4)
    damaged = edited(state, ring=set_at((0, 5), -3), counts=set_at(5, -1))
    with pytest.raises(UsageError, match="ring has negative entries"):
        check_window_state(damaged, VOCAB)


def test_nothing_may_be_counted_before_the_first_update():
    state = RareTokenWindow(VOCAB, 4).state_dict()
    state["counts"][3] = state["current"][3] = 2
    with pytest.raises(UsageError, match="counts holds counts before the first update"):
        check_window_state(state, VOCAB)


def test_a_refused_state_leaves_the_window_as_it_was():
    window = driven(RareTokenWindow(VOCAB, 4), [1, 2])
    before = window.state_dict()
    with pytest.raises(UsageError, match="meta says a window of 6 updates, but ring has 4 rows"):
        window.load_state_dict(edited(saved_window(), meta=set_at(0, 6)))
    after = window.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_the_messages_name_the_entries_as_the_checkpoint_does():
    state = {f"window.{key}": value for key, value in edited(saved_window(), counts=set_at(0, -1)).items()}
    with pytest.raises(UsageError, match="^window.counts has negative entries"):
        check_window_state(state, VOCAB, prefix="window.")


def test_cumulative_counts_are_checked():
    counts = CumulativeCounts(VOCAB)
    counts.add(torch.arange(VOCAB))
    state = counts.state_dict()
    check_cumulative_state(state, VOCAB)
    for damaged, message in [
        ({"counts": -state["counts"]}, "counts has negative entries"),
        ({"counts": torch.zeros(VOCAB + 3, dtype=torch.int64)}, f"a vocabulary of {VOCAB + 3} tokens"),
        ({"counts": state["counts"].float()}, "dtype torch.float32"),
        (saved_window(), "ring, overflow, current, meta not expected"),  # counted with --face-counting window
    ]:
        with pytest.raises(UsageError, match=message.replace("(", r"\(")):
            CumulativeCounts(VOCAB).load_state_dict(damaged)


# ---------------------------------------------------------------------------------------------
# fairseq-train resuming from a damaged checkpoint: refused before anything is written


def train_args(data, save_dir, max_update, extra=()):
    return [data, "--user-dir", USER_DIR] + TINY_LM_ARGS + [
        "--criterion", "cross_entropy_agg", "--agg-window", "3", "--max-update", str(max_update),
        "--save-dir", save_dir, "--no-epoch-checkpoints", "--log-format", "json",
    ] + list(extra)


def load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


@pytest.fixture(scope="module")
def trained(lm_data_bin, tmp_path_factory):
    """checkpoint_last.pt of 4 updates with a window of 3: update 4 open in row 1, updates 2 and 3
    finished in rows 2 and 0."""
    save_dir = str(tmp_path_factory.mktemp("agg_state"))
    run_cli("fairseq-train", train_args(lm_data_bin, save_dir, 4))
    path = os.path.join(save_dir, "checkpoint_last.pt")
    assert load(path)["criterion"]["window.meta"].tolist() == [3, 4, 3]
    return path


def resume_copy(trained, save_dir, damage=None):
    """A copy of the trained checkpoint_last.pt in a new save directory, ``damage`` applied to its
    criterion state (a function that edits the dict in place)."""
    os.makedirs(save_dir)
    path = os.path.join(save_dir, "checkpoint_last.pt")
    if damage is None:
        shutil.copyfile(trained, path)
    else:
        state = load(trained)
        damage(state["criterion"])
        torch.save(state, path)
    return path


def widen(criterion, columns=2):
    for key in ("window.ring", "window.counts", "window.current"):
        value = criterion[key]
        criterion[key] = torch.cat([value, torch.zeros(*value.shape[:-1], columns, dtype=value.dtype)], -1)


def delete(*keys):
    def damage(criterion):
        for key in keys:
            del criterion[key]
    return damage


DAMAGES = {
    "negative counts": (lambda c: c["window.counts"].__setitem__(5, -1), "window.counts has negative entries"),
    # saved after update 4: update 40's open row is the same row, but 40 is not the checkpoint's update
    "update index not the checkpoint's": (lambda c: c["window.meta"].__setitem__(1, 40),
                                          "window.meta says update 40, but the checkpoint was saved after 4 updates "
                                          "(expected update 4, or 5 after a skipped update)"),
    "update index not the ring's": (lambda c: c["window.meta"].__setitem__(1, 3),
                                    "row 0 of window.ring, the row of the update being counted (update 3 in "
                                    "window.meta), is not empty"),
    "window metadata smaller": (lambda c: c["window.meta"].__setitem__(0, 2),
                                "window.meta says a window of 2 updates, but window.ring has 3 rows"),
    "window metadata larger": (lambda c: c["window.meta"].__setitem__(0, 5),
                               "window.meta says a window of 5 updates, but window.ring has 3 rows"),
    "one key missing": (delete("window.current"), "window.current missing"),
    "wrong vocabulary": (widen, "window.ring counts a vocabulary of {wide} tokens, the dictionary has {vocab}"),
    "all counts deleted": (delete("window.ring", "window.overflow", "window.counts", "window.current", "window.meta"),
                           "was written by cross_entropy_agg but holds none of its counts (window.*): "
                           "--agg-restart-counts starts them empty"),
}


@pytest.mark.parametrize("case", list(DAMAGES))
def test_a_damaged_agg_state_is_refused_in_one_line_before_anything_is_written(trained, lm_data_bin, tmp_path, case):
    damage, check = DAMAGES[case]
    save_dir = str(tmp_path / "ckpt")
    path = resume_copy(trained, save_dir, damage)
    before = digests(save_dir)
    proc = run_cli("fairseq-train", train_args(lm_data_bin, save_dir, 6), expect_ok=False)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    vocab = load(trained)["criterion"]["window.counts"].numel()
    last_line = proc.stderr.strip().splitlines()[-1]
    assert last_line.startswith(f"fairseq-train: error: checkpoint {path}"), last_line
    assert check.format(wide=vocab + 2, vocab=vocab) in last_line
    assert "Traceback" not in proc.stderr
    assert digests(save_dir) == before  # the checkpoint unchanged, no crash.pt, no new checkpoint


def test_a_valid_checkpoint_still_resumes(trained, lm_data_bin, tmp_path):
    save_dir = str(tmp_path / "ckpt")
    resume_copy(trained, save_dir)
    proc = run_cli("fairseq-train", train_args(lm_data_bin, save_dir, 6))
    records = [r for r in read_json_log(proc.stdout + proc.stderr) if "num_updates" in r and "agg_rare" in r]
    assert [int(r["num_updates"]) for r in records] == [5, 6]
    assert load(os.path.join(save_dir, "checkpoint_last.pt"))["criterion"]["window.meta"].tolist() == [3, 6, 3]


def test_a_fine_tuned_agg_checkpoint_resumes(trained, lm_data_bin, tmp_path):
    """--finetune-from-model of an AGG checkpoint: fairseq's update number starts again at 0 and the
    window starts empty (tests/test_fine_tuning.py); the fine-tuned run's own checkpoint then resumes."""
    save_dir = str(tmp_path / "ckpt")
    run_cli("fairseq-train", train_args(lm_data_bin, save_dir, 2, ["--finetune-from-model", trained]))
    assert load(os.path.join(save_dir, "checkpoint_last.pt"))["criterion"]["window.meta"].tolist() == [3, 2, 2]
    run_cli("fairseq-train", train_args(lm_data_bin, save_dir, 3))
    assert load(os.path.join(save_dir, "checkpoint_last.pt"))["criterion"]["window.meta"].tolist() == [3, 3, 3]


def test_the_restart_flag_starts_missing_counts_empty(trained, lm_data_bin, tmp_path):
    save_dir = str(tmp_path / "ckpt")
    resume_copy(trained, save_dir, DAMAGES["all counts deleted"][0])
    proc = run_cli("fairseq-train", train_args(lm_data_bin, save_dir, 6, ["--agg-restart-counts"]))
    assert "--agg-restart-counts: the counts of cross_entropy_agg start empty" in proc.stdout + proc.stderr
    # updates 5 and 6 recorded: the denominator counts what the window has seen
    assert load(os.path.join(save_dir, "checkpoint_last.pt"))["criterion"]["window.meta"].tolist() == [3, 6, 2]


def test_a_stock_criterions_checkpoint_starts_the_counts_empty(lm_data_bin, tmp_path):
    stock_dir, agg_dir = str(tmp_path / "stock"), str(tmp_path / "agg")
    run_cli("fairseq-train", [lm_data_bin, "--save-dir", stock_dir, "--max-update", "2", "--no-epoch-checkpoints"]
            + TINY_LM_ARGS)
    proc = run_cli("fairseq-train", train_args(lm_data_bin, agg_dir, 1, [
        "--finetune-from-model", os.path.join(stock_dir, "checkpoint_last.pt")]))
    assert ("the checkpoint has no counts of cross_entropy_agg (written by another criterion): they start empty"
            in proc.stdout + proc.stderr)
    assert load(os.path.join(agg_dir, "checkpoint_last.pt"))["criterion"]["window.meta"].tolist() == [3, 1, 1]
