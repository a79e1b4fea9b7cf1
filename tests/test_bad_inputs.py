"""The bad-input sweep (issue #23, "No traceback, nothing lost"): every refusal of the plugin, as a
user hits it, is ONE line ``PROG: error: MESSAGE`` naming the flag or file and what is allowed, with
exit status 2, no traceback, and nothing written.

Each case runs the command's own entry point (``fairseq-train``'s ``cli_main``, ``fairseq-agg``'s
``main``) on the tiny data-bin inside the test process (tests/support/in_process.py): the same
parsing, task, model, criterion and optimizer set-up and checkpoint loading a process would do,
and the same exit status and stderr, without a process start per case. Each channel a refusal
takes also runs once as a real subprocess here (``test_each_refusal_channel_in_a_real_process``):
argparse's own error, the plugin's invalid choice, a start-up check of the plugin, each command
of fairseq-agg; a refused checkpoint load is a real process in tests/test_faults_checkpoints.py.
``fairseq-train`` prints its own log and warnings first, so there the error is the last line of
stderr; the plugin's own commands print nothing else but, for analyze, its INFO progress lines.
Covered elsewhere in the same form: ``--optimizer coupled_adam``'s refusals
(tests/test_coupled_adam.py) and the output, duplicate and unreadable-input refusals of
average-checkpoints (tests/test_average_checkpoints.py).
"""
import importlib.util
import os
import re

import pytest
import torch

import in_process
from fairseq_runs import TINY_LM_ARGS, USER_DIR, run_cli

AGG = ["--criterion", "cross_entropy_agg"]
AUG = ["--criterion", "augmented_loss"]
UL = ["--criterion", "cross_entropy_unlikelihood"]
COSREG = ["--criterion", "cross_entropy_cosreg"]
FACE = ["--criterion", "cross_entropy_face"]
AFL = ["--criterion", "cross_entropy_antifocal"]
STATS = ["--criterion", "cross_entropy_with_stats"]
MLRA = ["--arch", "transformer_lm_mlra"]
HUGE_WINDOW = str(10 ** 12)  # 10^12 updates x V one-byte counts: petabytes, refused before anything is allocated

# (case id, extra fairseq-train arguments, text the error line must contain: one string, or a tuple
# of strings, e.g. both flags of a dependent pair)
TRAIN_CASES = [
    # --- AGG
    ("agg-alpha-zero", AGG + ["--agg-alpha", "0"], "--agg-alpha"),
    ("agg-alpha-negative", AGG + ["--agg-alpha", "-0.1"], "--agg-alpha"),
    ("agg-alpha-above-one-code-g1", AGG + ["--agg-alpha", "1.5"], "--agg-alpha"),
    ("agg-alpha-inf", AGG + ["--agg-alpha", "inf"], "--agg-alpha"),
    ("agg-alpha-nan", AGG + ["--agg-alpha", "nan"], "--agg-alpha"),
    ("agg-alpha-inf-normalized", AGG + ["--agg-alpha", "inf", "--agg-g1-mode", "normalized"], "--agg-alpha"),
    ("agg-window-negative", AGG + ["--agg-window", "-1"], "--agg-window"),
    ("agg-window-huge", AGG + ["--agg-window", HUGE_WINDOW],
     ("--agg-window must be <= ", f"got {HUGE_WINDOW}", "K x V one-byte counts", "8 GiB")),
    ("agg-ref-tokens-negative", AGG + ["--agg-ref-tokens", "-1"], "--agg-ref-tokens"),
    ("agg-g1-mode-unknown", AGG + ["--agg-g1-mode", "sqrt"], "--agg-g1-mode"),
    ("agg-threshold-mode-unknown", AGG + ["--agg-threshold-mode", "tokens"], "--agg-threshold-mode"),
    ("agg-label-smoothing-one", AGG + ["--label-smoothing", "1.0"], "--label-smoothing"),
    ("agg-label-smoothing-negative", AGG + ["--label-smoothing", "-0.1"], "--label-smoothing"),
    ("agg-label-smoothing-inf", AGG + ["--label-smoothing", "inf"], "--label-smoothing"),
    ("agg-label-smoothing-nan", AGG + ["--label-smoothing", "nan"], "--label-smoothing"),
    ("agg-chunk-zero", AGG + ["--output-chunk-tokens", "0"], "--output-chunk-tokens"),
    ("agg-aug-alpha-negative", AGG + ["--aug-alpha", "-1"], "--aug-alpha"),
    ("agg-aug-alpha-inf", AGG + ["--aug-alpha", "inf"], "--aug-alpha"),
    # a model the criterion cannot train: refused in task.begin_epoch, before fairseq could write crash.pt
    ("agg-adaptive-softmax", AGG + ["--adaptive-softmax-cutoff", "50,100"], "--adaptive-softmax-cutoff"),
    # AGG's dependent flags: each refusal names both
    ("agg-freeze-set-without-freeze-rare", AGG + ["--agg-freeze-set", "group"],
     ("--agg-freeze-set", "--agg-freeze-rare")),
    ("agg-freeze-until-without-freeze-rare", AGG + ["--agg-freeze-until-update", "5"],
     ("--agg-freeze-until-update", "--agg-freeze-rare")),
    ("agg-ref-tokens-per-update", AGG + ["--agg-ref-tokens", "100", "--agg-threshold-mode", "per-update"],
     ("--agg-ref-tokens", "--agg-threshold-mode")),
    ("agg-aug-gate-not-detached", AGG + ["--aug-alpha", "0.5", "--aug-gate-with-agg", "--no-aug-detach-target"],
     ("--aug-gate-with-agg", "--no-aug-detach-target")),
    ("agg-aug-gate-alpha-zero", AGG + ["--aug-gate-with-agg", "--aug-alpha", "0"],
     ("--aug-gate-with-agg", "--aug-alpha")),
    # --- augmented loss
    ("aug-alpha-negative", AUG + ["--aug-alpha", "-0.5"], "--aug-alpha"),
    ("aug-alpha-inf", AUG + ["--aug-alpha", "inf"], "--aug-alpha"),
    ("aug-alpha-nan", AUG + ["--aug-alpha", "nan"], "--aug-alpha"),
    ("aug-temperature-zero", AUG + ["--aug-temperature", "0"], "--aug-temperature"),
    ("aug-temperature-negative", AUG + ["--aug-temperature", "-2"], "--aug-temperature"),
    ("aug-temperature-inf", AUG + ["--aug-temperature", "inf"], "--aug-temperature"),
    ("aug-temperature-nan", AUG + ["--aug-temperature", "nan"], "--aug-temperature"),
    ("aug-warmup-negative", AUG + ["--aug-warmup-updates", "-3"], "--aug-warmup-updates"),
    ("aug-chunk-negative", AUG + ["--output-chunk-tokens", "-5"], "--output-chunk-tokens"),
    ("aug-label-smoothing-above-one", AUG + ["--label-smoothing", "1.5"], "--label-smoothing"),
    ("aug-scale-unknown", AUG + ["--aug-scale", "cube"], "--aug-scale"),
    ("aug-embed-unknown", AUG + ["--aug-embed", "both"], "--aug-embed"),
    ("aug-gate-without-agg", AUG + ["--aug-gate-with-agg"], ("--aug-gate-with-agg", "--criterion cross_entropy_agg")),
    # --- the fused output layer's kernel
    ("agg-output-kernel-unknown", AGG + ["--output-kernel", "triton"], "--output-kernel"),
    ("aug-output-kernel-torch", AUG + ["--aug-alpha", "0.5", "--output-kernel", "torch"],
     ("--output-kernel torch", "augmented loss")),
    ("agg-aug-output-kernel-torch", AGG + ["--aug-alpha", "0.5", "--output-kernel", "torch"],
     ("--output-kernel torch", "augmented loss")),
    ("ul-output-kernel-torch", UL + ["--output-kernel", "torch"], ("--output-kernel torch", "unlikelihood")),
    ("face-output-kernel-torch", FACE + ["--output-kernel", "torch"], ("--output-kernel torch", "FACE")),
    ("antifocal-output-kernel-torch", AFL + ["--output-kernel", "torch"], ("--output-kernel torch", "anti-focal")),
    ("antifocal-gamma-negative", AFL + ["--antifocal-gamma", "-1"], "--antifocal-gamma must be >= 0"),
    # --- unlikelihood, CosReg, FACE
    ("ul-alpha-inf", UL + ["--ul-alpha", "inf"], "--ul-alpha"),
    ("ul-alpha-nan", UL + ["--ul-alpha", "nan"], "--ul-alpha"),
    ("ul-clamp-inf", UL + ["--ul-clamp", "inf"], "--ul-clamp"),
    ("ul-clamp-nan", UL + ["--ul-clamp", "nan"], "--ul-clamp"),
    ("cosreg-gamma-inf", COSREG + ["--cosreg-gamma", "inf"], "--cosreg-gamma"),
    ("cosreg-gamma-nan", COSREG + ["--cosreg-gamma", "nan"], "--cosreg-gamma"),
    # FACE's one numeric flag is an integer: fairseq's parser refuses inf and nan itself
    ("face-window-inf", FACE + ["--face-counting", "window", "--face-window", "inf"], "--face-window"),
    ("face-window-nan", FACE + ["--face-counting", "window", "--face-window", "nan"], "--face-window"),
    ("face-window-huge", FACE + ["--face-counting", "window", "--face-window", HUGE_WINDOW],
     ("--face-window must be <= ", "8 GiB")),
    ("face-window-without-window-counting", FACE + ["--face-window", "10"],
     ("--face-window", "--face-counting window")),
    # --- statistics
    ("stats-interval-negative", STATS + ["--embed-stats-interval", "-1"], "--embed-stats-interval"),
    ("stats-interval-not-integer", STATS + ["--embed-stats-interval", "2.5"], "--embed-stats-interval"),
    ("stats-isotropy-interval-negative", STATS + ["--embed-stats-interval", "2", "--embed-isotropy-interval", "-4"],
     "--embed-isotropy-interval"),
    ("stats-fractions-sum", STATS + ["--embed-group-fractions", "0.5,0.5,0.5"], "--embed-group-fractions"),
    ("stats-fractions-not-numbers", STATS + ["--embed-group-fractions", "a,b,c"], "--embed-group-fractions"),
    ("stats-fractions-two", STATS + ["--embed-group-fractions", "0.5,0.5"], "--embed-group-fractions"),
    ("stats-tev-init-std-zero", STATS + ["--tev-init-std", "0"], "--tev-init-std"),
    ("stats-tev-init-std-inf", STATS + ["--embed-stats-interval", "2", "--tev-init-std", "inf"], "--tev-init-std"),
    ("stats-tev-init-std-nan", STATS + ["--embed-stats-interval", "2", "--tev-init-std", "nan"], "--tev-init-std"),
    ("stats-iso-rows-unknown", STATS + ["--iso-rows", "some"], "--iso-rows"),
    ("stats-tev-matrices-unknown", STATS + ["--tev-matrices", "hidden"], "--tev-matrices"),
    ("stats-on-agg-fractions", AGG + ["--embed-group-fractions", "0.9,0.2,0.1"], "--embed-group-fractions"),
    # a statistics flag without effect: while the statistics are off, or a TEV flag while only the
    # isotropy is logged (each names the flag and --embed-stats-interval)
    ("stats-groups-while-off", STATS + ["--embed-stats-groups"], ("--embed-stats-groups", "--embed-stats-interval")),
    ("stats-tev-effective-while-off", STATS + ["--tev-effective"], ("--tev-effective", "--embed-stats-interval")),
    ("stats-isotropy-interval-while-off", STATS + ["--embed-isotropy-interval", "0"],
     ("--embed-isotropy-interval 0", "--embed-stats-interval")),
    ("stats-preset-on-agg-while-off", AGG + ["--embed-group-preset", "wikitext103-official"],
     ("--embed-group-preset", "--embed-stats-interval")),
    # the official WikiText-103 groups need more than 36,000 types (the fixture has a few hundred)
    ("stats-preset-too-small-vocabulary", STATS + ["--embed-stats-interval", "2", "--embed-stats-groups",
                                                   "--embed-group-preset", "wikitext103-official"],
     ("--embed-group-preset", "more than 36000")),
    ("freeze-group-preset-too-small-vocabulary", AGG + ["--agg-freeze-rare", "--agg-freeze-set", "group",
                                                        "--embed-group-preset", "wikitext103-official"],
     ("--embed-group-preset", "more than 36000")),
    ("stats-tev-flag-with-isotropy-only", STATS + ["--embed-isotropy-interval", "5", "--tev-exclude-unseen"],
     ("--tev-exclude-unseen", "--embed-stats-interval")),
    # --- MLRA
    ("mlra-rank-zero", MLRA + ["--attention-rank", "0"], "--attention-rank"),
    ("mlra-rank-above-dim", MLRA + ["--attention-rank", "64"], "--attention-rank"),
    ("mlra-targets-unknown", MLRA + ["--attention-rank", "8", "--mlra-targets", "q,x"], "--mlra-targets"),
    ("mlra-mode-unknown", MLRA + ["--attention-rank", "8", "--mlra-mode", "diagonal"], "--mlra-mode"),
    ("mlra-init-unknown", MLRA + ["--attention-rank", "8", "--mlra-init", "ones"], "--mlra-init"),
    # --- statistics on, not split by group: the group definition would be ignored (issue #49)
    ("stats-preset-without-groups", STATS + ["--embed-stats-interval", "2", "--embed-group-preset",
                                             "wikitext103-official"], ("--embed-group-preset", "--embed-stats-groups")),
    ("stats-fractions-without-groups", AGG + ["--embed-isotropy-interval", "2", "--embed-group-fractions",
                                              "0.2,0.5,0.3"], ("--embed-group-fractions", "--embed-stats-groups")),
]

# a foreign kernel that is not installed here is refused with the package to install
TRAIN_CASES += [
    (f"agg-output-kernel-{kernel}-missing", AGG + ["--output-kernel", kernel], (f"--output-kernel {kernel} needs", "pip install"))
    for kernel, module in (("liger", "liger_kernel"), ("cce", "cut_cross_entropy"))
    if importlib.util.find_spec(module) is None
]

# FSDP is refused by the criterion, which fairseq-train builds inside FSDP's wrapping context: without
# fairscale, fairseq itself stops before that (its ImportError, with a traceback), so these run only
# with fairscale; tests/test_agg_reliability.py checks the criterion's refusal in-process
FSDP_CASES = [
    ("agg-fsdp", AGG + ["--ddp-backend", "fully_sharded"], "fully_sharded"),
    ("aug-fsdp", AUG + ["--ddp-backend", "fully_sharded"], "fully_sharded"),
]
NEEDS_FAIRSCALE = pytest.mark.skipif(
    importlib.util.find_spec("fairscale") is None,
    reason="fairseq-train refuses --ddp-backend fully_sharded itself without fairscale")

# an INFO line of the plugin's logging (analyze's progress), the one kind of line analyze may print
# before its error
INFO_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} \| INFO \| ")


def _base_args(data, save_dir, extra):
    # the arch given by a case replaces the tiny LM's transformer_lm
    base = list(TINY_LM_ARGS)
    if "--arch" in extra:
        i = base.index("--arch")
        del base[i:i + 2]
    return [data, "--user-dir", USER_DIR, "--save-dir", save_dir, "--max-update", "2"] + base + extra


def _assert_nothing_written(directory):
    left = os.listdir(directory) if os.path.isdir(directory) else []
    assert left == [], f"{directory} holds {left}"


def _assert_refused_in_one_line(proc, prog, expected=(), may_precede=lambda line: True):
    """A refused command: exit status 2, no traceback, exactly one ``PROG: error: ...`` line, the
    last of stderr, containing every ``expected`` text, and every line before it one that
    ``may_precede`` allows."""
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith(f"{prog}: error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], proc.stderr[-3000:]
    assert all(may_precede(line) for line in lines[:-1]), proc.stderr[-3000:]
    for text in (expected,) if isinstance(expected, str) else expected:
        assert text in errors[0], errors[0]


def _params(cases, marks=()):
    return [pytest.param(extra, expected, id=case_id, marks=marks) for case_id, extra, expected in cases]


@pytest.mark.parametrize("extra,expected", _params(TRAIN_CASES) + _params(FSDP_CASES, NEEDS_FAIRSCALE))
def test_refused_at_start_up(lm_data_bin, tmp_path, extra, expected):
    # fairseq-train logs and warns before the plugin's checks run; argparse's own refusals print
    # the usage first
    save_dir = str(tmp_path / "ckpt")
    proc = in_process.fairseq_train(_base_args(lm_data_bin, save_dir, extra))
    _assert_refused_in_one_line(proc, "fairseq-train", expected)
    _assert_nothing_written(save_dir)


@pytest.fixture(scope="module")
def trained_checkpoint(lm_data_bin, tmp_path_factory):
    save_dir = str(tmp_path_factory.mktemp("good"))
    run_cli("fairseq-train", _base_args(lm_data_bin, save_dir, ["--no-epoch-checkpoints"]))
    return os.path.join(save_dir, "checkpoint_last.pt")


# --- fairseq-agg-analyze


def _analyze_cases(checkpoint, tmp):
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
def test_analyze_refuses_with_one_line(trained_checkpoint, tmp_path, case):
    args, expected = _analyze_cases(trained_checkpoint, str(tmp_path))[case]
    out_dir = str(tmp_path / "report")
    proc = in_process.fairseq_agg_analyze(args + ["--out", out_dir])
    # before the error, at most analyze's progress lines (INFO); a warning, a second error or a
    # traceback fails
    _assert_refused_in_one_line(proc, "fairseq-agg-analyze", expected, may_precede=INFO_LINE.match)
    assert proc.stdout == ""
    _assert_nothing_written(out_dir)


# --- fairseq-agg average-checkpoints (the refusals tests/test_average_checkpoints.py does not cover)


def _reshaped_copy(checkpoint, path):
    """A checkpoint of another model: ``checkpoint`` with its first matrix one row shorter."""
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    name = next(k for k, v in state["model"].items() if v.dim() == 2)
    state["model"][name] = state["model"][name][1:].clone()
    torch.save(state, path)
    return name


def _average_cases(checkpoint, tmp):
    directory = os.path.dirname(checkpoint)  # trained with --no-epoch-checkpoints: no checkpointN.pt
    other_model = os.path.join(tmp, "other_model.pt")
    reshaped = _reshaped_copy(checkpoint, other_model)
    return {
        "files-with-num-checkpoints": (["--inputs", checkpoint, other_model, "--num-update-checkpoints", "2"],
                                       ("--inputs must be one checkpoint directory", "--num-*-checkpoints")),
        "too-few-checkpoints": (["--inputs", directory, "--num-epoch-checkpoints", "2"],
                                f"--num-epoch-checkpoints 2: only 0 epoch checkpoints in {directory}"),
        "upper-bound-without-num": (["--inputs", checkpoint, other_model, "--checkpoint-upper-bound", "3"],
                                    ("--checkpoint-upper-bound", "--num-epoch-checkpoints")),
        "different-models": (["--inputs", checkpoint, other_model],
                             f"--inputs: {other_model}: {reshaped} has shape"),
    }


AVERAGE_IDS = ["files-with-num-checkpoints", "too-few-checkpoints", "upper-bound-without-num", "different-models"]


@pytest.mark.parametrize("case", AVERAGE_IDS)
def test_average_checkpoints_refuses_with_one_line(trained_checkpoint, tmp_path, case):
    args, expected = _average_cases(trained_checkpoint, str(tmp_path))[case]
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    proc = in_process.fairseq_agg_command(["average-checkpoints"] + args + ["--output", out_dir / "avg.pt"])
    _assert_refused_in_one_line(proc, "fairseq-agg average-checkpoints", expected, may_precede=lambda line: False)
    assert proc.stdout == ""
    _assert_nothing_written(str(out_dir))


# --- an invalid choice of one of the plugin's flags: one line, not after fairseq's usage text

CHOICE_CASES = [
    (AGG + ["--agg-g1-mode", "sqrt"], "--agg-g1-mode must be one of code, normalized, got 'sqrt'"),
    (AGG + ["--agg-threshold-mode", "tokens"],
     "--agg-threshold-mode must be one of auto, relative, per-update, got 'tokens'"),
    (STATS + ["--iso-rows", "some"], "--iso-rows must be one of all, no-pad-madeup, no-special, got 'some'"),
    (COSREG + ["--cosreg-normalizer=x"], "--cosreg-normalizer must be one of paper, pairs, got 'x'"),
    (["--optimizer", "coupled_adam", "--coupled-adam-matrices", "foo"],
     "--coupled-adam-matrices must be one of input, output, all, got 'foo'"),
]


@pytest.mark.parametrize("extra,line", CHOICE_CASES, ids=[case[0][-2] if len(case[0]) > 2 else case[0][-1] for case in CHOICE_CASES])
def test_an_invalid_choice_of_a_plugin_flag_is_its_only_line(lm_data_bin, tmp_path, extra, line):
    save_dir = str(tmp_path / "ckpt")
    proc = in_process.fairseq_train(_base_args(lm_data_bin, save_dir, extra))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"fairseq-train: error: {line}"], proc.stderr[-3000:]
    _assert_nothing_written(save_dir)


def _assert_argparse_usage_kept(proc):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and lines[0].startswith("usage: fairseq-train")
    assert lines[-1].startswith("fairseq-train: error: argument --criterion: invalid choice: 'nonexistent'")


def test_an_invalid_choice_of_a_fairseq_flag_keeps_argparse_usage(lm_data_bin, tmp_path):
    _assert_argparse_usage_kept(
        in_process.fairseq_train(_base_args(lm_data_bin, str(tmp_path / "ckpt"), ["--criterion", "nonexistent"])))


# --- each channel once as a real process: the console scripts and the plugin's hooks as a fresh
# process installs them (the cases above run their entry points in this process)

def test_each_refusal_channel_in_a_real_process(lm_data_bin, trained_checkpoint, tmp_path):
    # argparse's own error keeps its usage text
    _assert_argparse_usage_kept(run_cli("fairseq-train", _base_args(lm_data_bin, str(tmp_path / "a"),
                                                                    ["--criterion", "nonexistent"]), expect_ok=False))
    # the plugin's invalid choice is its only line
    extra, line = CHOICE_CASES[0]
    proc = run_cli("fairseq-train", _base_args(lm_data_bin, str(tmp_path / "b"), extra), expect_ok=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [f"fairseq-train: error: {line}"]
    # a start-up check of the plugin (raised inside fairseq's main, printed by the plugin's hook)
    for case_id, extra, expected in TRAIN_CASES:
        if case_id in ("agg-alpha-zero", "agg-adaptive-softmax"):
            save_dir = str(tmp_path / case_id)
            _assert_refused_in_one_line(run_cli("fairseq-train", _base_args(lm_data_bin, save_dir, extra),
                                                expect_ok=False), "fairseq-train", expected)
            _assert_nothing_written(save_dir)
    # each command of fairseq-agg
    args, expected = _analyze_cases(trained_checkpoint, str(tmp_path))["bad-rows"]
    proc = run_cli("fairseq-agg-analyze", args + ["--out", tmp_path / "report"], expect_ok=False)
    _assert_refused_in_one_line(proc, "fairseq-agg-analyze", expected, may_precede=INFO_LINE.match)
    args, expected = _average_cases(trained_checkpoint, str(tmp_path))["upper-bound-without-num"]
    proc = run_cli("fairseq-agg", ["average-checkpoints"] + args + ["--output", tmp_path / "avg.pt"], expect_ok=False)
    _assert_refused_in_one_line(proc, "fairseq-agg average-checkpoints", expected, may_precede=lambda line: False)
    _assert_nothing_written(str(tmp_path / "report"))
    assert not (tmp_path / "avg.pt").exists()
