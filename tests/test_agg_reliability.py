"""AGG's gates stay <= 1 whatever the flags, and a resumed run may change --agg-window."""
import math
import shutil

import pytest
import torch
from fairseq import tasks

from fairseq_agg.ops.agg import agg_gates
from fairseq_agg.ops.agg_threshold import alpha_allowed_range
from fairseq_agg.ops.counting import RareTokenWindow
from fairseq_runs import TINY_LM_ARGS
from fairseq_runs import parse_config as parse

G1_MODES = ["code", "normalized"]
THRESHOLD_MODES = ["per-update", "relative"]


@pytest.mark.parametrize("g1_mode", G1_MODES)
@pytest.mark.parametrize("threshold_mode", THRESHOLD_MODES)
def test_every_gate_is_at_most_one_for_every_allowed_alpha(g1_mode, threshold_mode):
    """Property: random windows (skewed counts, any number of updates), alphas spread over the
    allowed range up to its edge, small and large B_ref: g1 and g2 never exceed 1."""
    _, alpha_ok = alpha_allowed_range(g1_mode)
    generator = torch.Generator().manual_seed(7)
    alphas = [1e-6, 0.03, 0.5, 0.999, 1.0, 2.0, 50.0, 1e6]
    checked = 0
    for alpha in alphas:
        if not alpha_ok(alpha):
            continue
        for _ in range(25):
            vocab = int(torch.randint(5, 60, (1,), generator=generator))
            scale = float(10 ** torch.randint(0, 5, (1,), generator=generator))
            counts = (torch.rand(vocab, generator=generator) ** 4 * scale).round().to(torch.int64)
            updates = int(torch.randint(1, 9, (1,), generator=generator))
            ref_tokens = int(torch.randint(1, 70000, (1,), generator=generator))
            gates = agg_gates(counts, updates, alpha, 4, g1_mode=g1_mode,
                              threshold_mode=threshold_mode, ref_tokens=ref_tokens)
            assert float(gates.g1.max()) <= 1.0 and float(gates.g2.max()) <= 1.0
            assert float(gates.g1.min()) >= 0.0 and float(gates.g2.min()) >= 0.0
            checked += 1
    assert checked >= 100


def test_code_mode_alpha_above_one_would_amplify_and_is_refused():
    """The reason for the range: with g1 = a_k a rare token can get a gate up to alpha."""
    counts = torch.tensor([0, 0, 0, 0, 30, 1000])  # token 4: a_k = 30 per update < alpha = 40
    gates = agg_gates(counts, 1, 40.0, 4, g1_mode="code", threshold_mode="per-update")
    assert float(gates.g1[4]) == 30.0
    _, alpha_ok = alpha_allowed_range("code")
    assert not alpha_ok(40.0) and alpha_ok(1.0) and not alpha_ok(0.0)
    assert not alpha_ok(math.inf) and not alpha_ok(math.nan)
    _, alpha_ok = alpha_allowed_range("normalized")
    assert alpha_ok(40.0) and not alpha_ok(math.inf) and not alpha_ok(math.nan) and not alpha_ok(-1.0)


@pytest.mark.parametrize(
    "extra,allowed",
    [(["--agg-alpha", "1.5"], "(0, 1]"), (["--agg-alpha", "inf"], "(0, 1]"), (["--agg-alpha", "nan"], "(0, 1]"),
     (["--agg-alpha", "inf", "--agg-g1-mode", "normalized"], "finite number > 0"),
     (["--agg-alpha", "nan", "--agg-g1-mode", "normalized"], "finite number > 0")],
)
def test_alpha_out_of_range_is_refused_at_start_up(lm_data_bin, extra, allowed):
    cfg = parse(lm_data_bin, TINY_LM_ARGS, ["--criterion", "cross_entropy_agg"] + extra)
    task = tasks.setup_task(cfg.task)
    with pytest.raises(ValueError) as err:
        task.build_criterion(cfg.criterion)
    assert "--agg-alpha" in str(err.value) and allowed in str(err.value)


def test_alpha_above_one_is_accepted_with_normalized_g1(lm_data_bin):
    cfg = parse(lm_data_bin, TINY_LM_ARGS, ["--criterion", "cross_entropy_agg", "--agg-alpha", "3",
                                            "--agg-g1-mode", "normalized"])
    task = tasks.setup_task(cfg.task)
    assert task.build_criterion(cfg.criterion).cfg.agg_alpha == 3


def run_updates(window, histograms):
    """Feeds one histogram per update (update t = 1, 2, ...) into the window."""
    for t, hist in histograms:
        window.start_update(t)
        window.add(hist)
    return window


def brute_force(histograms, size, t):
    """Sum of the histograms of updates t - size + 1 .. t."""
    return sum(h for s, h in histograms if t - size < s <= t)


VOCAB = 6


def history(n):
    generator = torch.Generator().manual_seed(n)
    return [(t, torch.randint(0, 5, (VOCAB,), generator=generator)) for t in range(1, n + 1)]


@pytest.mark.parametrize("old,new", [(8, 3), (3, 8), (4, 1), (5, 5)])
def test_resume_with_changed_window_resizes_it(old, new):
    """Saved with K = old, resumed with --agg-window new: the window holds the newest min(old, new)
    updates, and from then on behaves as a window of `new` updates run from the start would once
    it has seen `new` updates (growing fills up, shrinking drops the oldest)."""
    past, future = history(10), [(t, h) for t, h in history(16) if t > 10]
    saved = run_updates(RareTokenWindow(VOCAB, old), past).state_dict()
    resumed = RareTokenWindow(VOCAB, new)
    resumed.load_state_dict(saved)
    assert resumed.window == new and resumed.ring.shape == (new, VOCAB)
    assert torch.equal(resumed.counts, brute_force(past, min(old, new), 10))
    assert resumed.recorded == min(old, new)
    everything = past + future
    for t, hist in future:
        run_updates(resumed, [(t, hist)])
        held = min(new, min(old, new) + t - 10)
        assert torch.equal(resumed.counts, brute_force(everything, held, t)), t
        assert resumed.recorded == held


def test_auto_window_keeps_the_checkpoints_size():
    saved = run_updates(RareTokenWindow(VOCAB, 4), history(6)).state_dict()
    resumed = RareTokenWindow(VOCAB)  # --agg-window 0: one epoch, set only when the size is unknown
    resumed.load_state_dict(saved)
    assert resumed.window == 4 and torch.equal(resumed.counts, brute_force(history(6), 4, 6))


def test_analyze_refuses_a_dictionary_that_does_not_match_the_checkpoint(lm_data_bin, tmp_path, capsys):
    """One clear line, exit status 2, nothing written: not fairseq's raw size-mismatch traceback."""
    import fairseq_agg_cli
    import fairseq_runs

    fairseq_runs.run_cli("fairseq-train", [lm_data_bin, "--save-dir", tmp_path / "ckpt", "--max-update", "1",
                                           "--no-epoch-checkpoints"] + TINY_LM_ARGS)
    other = tmp_path / "other_bin"
    shutil.copytree(lm_data_bin, other)
    with open(other / "dict.txt", "a") as f:
        f.write("unseenword1 1\nunseenword2 1\n")
    out = tmp_path / "report"
    with pytest.raises(SystemExit) as exc:
        fairseq_agg_cli.analyze_main([str(tmp_path / "ckpt" / "checkpoint_last.pt"), "--data", str(other), "--out", str(out), "--cpu"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"--data {other}" in err and "entries but" in err and "rows" in err
    assert "Traceback" not in err and "size mismatch" not in err
    assert not out.exists()


def test_agg_trains_with_sample_break_mode_eos(lm_data_bin, tmp_path):
    """fairseq's TokenBlockDataset with --sample-break-mode eos works with the numpy the set-up pins."""
    from fairseq_runs import USER_DIR, read_json_log, run_cli

    args = list(TINY_LM_ARGS)
    args[args.index("--sample-break-mode") + 1] = "eos"
    proc = run_cli("fairseq-train", [lm_data_bin, "--user-dir", USER_DIR, "--save-dir", tmp_path / "ckpt",
                                     "--criterion", "cross_entropy_agg", "--agg-window", "2", "--max-update", "3",
                                     "--no-epoch-checkpoints", "--log-format", "json"] + args)
    records = [r for r in read_json_log(proc.stdout + proc.stderr) if "num_updates" in r and "agg_rare" in r]
    assert [int(r["num_updates"]) for r in records] == [1, 2, 3]
    assert all(math.isfinite(float(r["loss"])) for r in records)
    assert (tmp_path / "ckpt" / "checkpoint_last.pt").exists()


@pytest.mark.parametrize("criterion", ["cross_entropy_agg", "augmented_loss"])
def test_fsdp_is_refused_at_start_up(lm_data_bin, criterion):
    extra = ["--aug-alpha", "0.1"] if criterion == "augmented_loss" else []
    cfg = parse(lm_data_bin, TINY_LM_ARGS, ["--criterion", criterion, "--ddp-backend", "fully_sharded"] + extra)
    task = tasks.setup_task(cfg.task)
    with pytest.raises(ValueError, match="--ddp-backend fully_sharded"):
        task.build_criterion(cfg.criterion)


def test_counts_of_an_update_skipped_for_overflow_stay_in_the_window():
    """fairseq's fp16 overflow path zeroes the gradients without advancing the update number, so the
    next micro-batches reach the criterion with the same update_num (start_update(t) again, a no-op):
    the skipped batch's counts stay in update t's row, beside those of the batch that completes
    update t, and the denominator still counts one update (README, "Guarantees")."""
    window = RareTokenWindow(VOCAB, 3)
    first, skipped, retried, after = (torch.full((VOCAB,), v) for v in (1, 10, 100, 1000))
    run_updates(window, [(1, first), (2, skipped)])  # update 2 overflows: fairseq skips the step
    run_updates(window, [(2, retried)])  # the retry is still update 2
    assert window.recorded == 2 and torch.equal(window.counts, first + skipped + retried)
    run_updates(window, [(3, after), (4, after)])  # update 1 leaves the window, update 2 stays whole
    assert window.recorded == 3 and torch.equal(window.counts, skipped + retried + 2 * after)
