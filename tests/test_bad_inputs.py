"""The bad-input sweep: every refused setting fails at start-up with a message naming its flag, and
nothing is written.

Each case is a real ``fairseq-train`` (or ``fairseq-agg-analyze``) subprocess on the tiny data-bin;
the save directory must stay empty (no checkpoint, no crash.pt) and, for the plugin's own commands,
the exit status is 2 with one line on stderr.
"""
import os

import pytest

from fairseq_agg.testing.fairseq_runs import TINY_LM_ARGS, USER_DIR, run_cli

AGG = ["--criterion", "cross_entropy_agg"]
AUG = ["--criterion", "augmented_loss"]
STATS = ["--criterion", "cross_entropy_with_stats"]
MLRA = ["--arch", "transformer_lm_mlra"]

# (case id, extra fairseq-train arguments, text the error must contain)
TRAIN_CASES = [
    ("agg-alpha-zero", AGG + ["--agg-alpha", "0"], "--agg-alpha"),
    ("agg-alpha-negative", AGG + ["--agg-alpha", "-0.1"], "--agg-alpha"),
    ("agg-alpha-above-one-code-g1", AGG + ["--agg-alpha", "1.5"], "--agg-alpha"),
    ("agg-alpha-inf", AGG + ["--agg-alpha", "inf"], "--agg-alpha"),
    ("agg-alpha-nan", AGG + ["--agg-alpha", "nan"], "--agg-alpha"),
    ("agg-alpha-inf-normalized", AGG + ["--agg-alpha", "inf", "--agg-g1-mode", "normalized"], "--agg-alpha"),
    ("agg-window-negative", AGG + ["--agg-window", "-1"], "--agg-window"),
    ("agg-ref-tokens-negative", AGG + ["--agg-ref-tokens", "-1"], "--agg-ref-tokens"),
    ("agg-g1-mode-unknown", AGG + ["--agg-g1-mode", "sqrt"], "--agg-g1-mode"),
    ("agg-threshold-mode-unknown", AGG + ["--agg-threshold-mode", "tokens"], "--agg-threshold-mode"),
    ("agg-label-smoothing-one", AGG + ["--label-smoothing", "1.0"], "--label-smoothing"),
    ("agg-label-smoothing-negative", AGG + ["--label-smoothing", "-0.1"], "--label-smoothing"),
    ("agg-chunk-zero", AGG + ["--output-chunk-tokens", "0"], "--output-chunk-tokens"),
    ("agg-aug-alpha-negative", AGG + ["--aug-alpha", "-1"], "--aug-alpha"),
    ("agg-aug-gate-not-detached", AGG + ["--aug-alpha", "0.5", "--aug-gate-with-agg", "--no-aug-detach-target"],
     "--aug-gate-with-agg"),
    ("agg-fsdp", AGG + ["--ddp-backend", "fully_sharded"], "fully_sharded"),
    ("aug-alpha-negative", AUG + ["--aug-alpha", "-0.5"], "--aug-alpha"),
    ("aug-temperature-zero", AUG + ["--aug-temperature", "0"], "--aug-temperature"),
    ("aug-temperature-negative", AUG + ["--aug-temperature", "-2"], "--aug-temperature"),
    ("aug-warmup-negative", AUG + ["--aug-warmup-updates", "-3"], "--aug-warmup-updates"),
    ("aug-chunk-negative", AUG + ["--output-chunk-tokens", "-5"], "--output-chunk-tokens"),
    ("aug-label-smoothing-above-one", AUG + ["--label-smoothing", "1.5"], "--label-smoothing"),
    ("aug-scale-unknown", AUG + ["--aug-scale", "cube"], "--aug-scale"),
    ("aug-embed-unknown", AUG + ["--aug-embed", "both"], "--aug-embed"),
    ("aug-fsdp", AUG + ["--ddp-backend", "fully_sharded"], "fully_sharded"),
    ("stats-interval-negative", STATS + ["--embed-stats-interval", "-1"], "--embed-stats-interval"),
    ("stats-isotropy-interval-negative", STATS + ["--embed-stats-interval", "2", "--embed-isotropy-interval", "-4"],
     "--embed-isotropy-interval"),
    ("stats-fractions-sum", STATS + ["--embed-group-fractions", "0.5,0.5,0.5"], "--embed-group-fractions"),
    ("stats-fractions-not-numbers", STATS + ["--embed-group-fractions", "a,b,c"], "--embed-group-fractions"),
    ("stats-fractions-two", STATS + ["--embed-group-fractions", "0.5,0.5"], "--embed-group-fractions"),
    ("stats-tev-init-std-zero", STATS + ["--tev-init-std", "0"], "--tev-init-std"),
    ("stats-iso-rows-unknown", STATS + ["--iso-rows", "some"], "--iso-rows"),
    ("stats-tev-matrices-unknown", STATS + ["--tev-matrices", "hidden"], "--tev-matrices"),
    ("stats-on-agg-fractions", AGG + ["--embed-group-fractions", "0.9,0.2,0.1"], "--embed-group-fractions"),
    ("mlra-rank-zero", MLRA + ["--attention-rank", "0"], "--attention-rank"),
    ("mlra-rank-above-dim", MLRA + ["--attention-rank", "64"], "--attention-rank"),
    ("mlra-targets-unknown", MLRA + ["--attention-rank", "8", "--mlra-targets", "q,x"], "--mlra-targets"),
    ("mlra-mode-unknown", MLRA + ["--attention-rank", "8", "--mlra-mode", "diagonal"], "--mlra-mode"),
    ("mlra-init-unknown", MLRA + ["--attention-rank", "8", "--mlra-init", "ones"], "--mlra-init"),
]


def _base_args(data, save_dir, extra):
    # the arch given by a case replaces the tiny LM's transformer_lm
    base = list(TINY_LM_ARGS)
    if "--arch" in extra:
        i = base.index("--arch")
        del base[i:i + 2]
    return [data, "--user-dir", USER_DIR, "--save-dir", save_dir, "--max-update", "2"] + base + extra


def _assert_nothing_written(save_dir):
    left = os.listdir(save_dir) if os.path.isdir(save_dir) else []
    assert left == [], f"the save directory holds {left}"


@pytest.mark.parametrize("extra,expected", [c[1:] for c in TRAIN_CASES], ids=[c[0] for c in TRAIN_CASES])
def test_refused_at_start_up(lm_data_bin, tmp_path, extra, expected):
    save_dir = str(tmp_path / "ckpt")
    proc = run_cli("fairseq-train", _base_args(lm_data_bin, save_dir, extra), expect_ok=False, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    assert expected in output, output[-3000:]
    assert "Traceback" not in output or "Error" in output.splitlines()[-1], output[-3000:]
    _assert_nothing_written(save_dir)


@pytest.fixture(scope="module")
def trained_checkpoint(lm_data_bin, tmp_path_factory):
    save_dir = str(tmp_path_factory.mktemp("good"))
    run_cli("fairseq-train", _base_args(lm_data_bin, save_dir, ["--no-epoch-checkpoints"]))
    return os.path.join(save_dir, "checkpoint_last.pt")


def _analyze_cases(checkpoint, lm_data_bin, tmp):
    empty_dir = os.path.join(tmp, "empty")
    os.makedirs(empty_dir, exist_ok=True)
    not_a_checkpoint = os.path.join(tmp, "notes.txt")
    with open(not_a_checkpoint, "w") as f:
        f.write("not a checkpoint\n")
    return {
        "missing-checkpoint": ([os.path.join(tmp, "nope.pt")], "nope.pt"),
        "not-a-checkpoint": ([not_a_checkpoint], "notes.txt"),
        "data-dir-missing": ([checkpoint, "--data", os.path.join(tmp, "nodata")], "--data"),
        "data-dir-without-dictionary": ([checkpoint, "--data", empty_dir], "--data"),
        "bad-rows": ([checkpoint, "--rows", "some"], "--rows"),
    }


ANALYZE_IDS = ["missing-checkpoint", "not-a-checkpoint", "data-dir-missing", "data-dir-without-dictionary", "bad-rows"]


@pytest.mark.parametrize("case", ANALYZE_IDS)
def test_analyze_refuses_with_one_line(trained_checkpoint, lm_data_bin, tmp_path, case):
    args, expected = _analyze_cases(trained_checkpoint, lm_data_bin, str(tmp_path))[case]
    out_dir = str(tmp_path / "report")
    proc = run_cli("fairseq-agg-analyze", args + ["--out", out_dir], expect_ok=False, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    # one line saying what is wrong (argparse's own errors add its usage line before it)
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith(("usage:", " "))]
    assert len(lines) == 1 and expected in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    _assert_nothing_written(out_dir)

