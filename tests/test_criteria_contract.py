"""The plugin's criteria inside real fairseq, after the core redesign:

* ``reduce=False`` (per-token losses) in every criterion, against fairseq's stock ``cross_entropy``
  / ``label_smoothed_cross_entropy`` per-token output where the method adds nothing, and summing
  to the reduced loss (with the same gradients) where it does;
* a flag given without the switch it needs is refused in one line naming both, also by a real
  ``fairseq-train`` (exit status 2, nothing written);
* the counting windows' upper bound, and the log line when the counts make checkpoints large;
* FACE counts over the whole run by default (the released code), the window being the option;
* each criterion holds at most one class of this package among its bases.
"""
import inspect
import logging
import os

import pytest
import torch
from fairseq import tasks

from fairseq_agg.criterions.output_loss import LARGE_STATE_BYTES
from fairseq_agg.errors import UsageError
from fairseq_agg.ops import CumulativeCounts
from fairseq_agg.ops.counting import max_window
from fairseq_runs import (
    TINY_LM_ARGS, TINY_MT_ARGS, USER_DIR, build_parts, criterion_from_flags, first_batch, padded_batch, parse_config,
    run_cli,
)

torch.set_num_threads(2)
LN = ["--label-smoothing", "0.1"]


def criterion_forward(model, criterion, sample, reduce, update_num=0, train=True):
    """A forward and backward of (the sum of) the loss; ``train=False``: eval mode, gradients on
    (nothing counted or gated, as in validation)."""
    model.train(train)
    model.zero_grad()
    if hasattr(criterion, "set_update_num"):
        criterion.set_update_num(update_num)
    loss, sample_size, log = criterion(model, sample, reduce=reduce)
    loss.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), sample_size, log, grads


# (criterion flags that make the method add nothing, then flags where it does add something)
NEUTRAL_AND_ACTIVE = {
    "cross_entropy_agg": (["--agg-window", "4"], ["--agg-window", "4", "--aug-alpha", "0.5"]),
    "augmented_loss": (["--aug-alpha", "0"], ["--aug-alpha", "0.5", "--aug-temperature", "2"]),
    "cross_entropy_cosreg": (["--cosreg-gamma", "0"], ["--cosreg-gamma", "50"]),  # R is small at init
    "cross_entropy_face": ([], ["--face-frequency", "gt"]),  # no counts yet: every weight is 1
    "cross_entropy_unlikelihood": (["--ul-alpha", "0"], ["--ul-alpha", "0.5"]),
}


@pytest.mark.parametrize("name", sorted(NEUTRAL_AND_ACTIVE))
@pytest.mark.parametrize("data", ["lm", "mt"])
def test_reduce_false_equals_fairseqs_stock_per_token_losses(lm_data_bin, mt_data_bin, name, data):
    data_bin, base, stock_flags = (lm_data_bin, TINY_LM_ARGS, ["--criterion", "cross_entropy"]) if data == "lm" else (
        mt_data_bin, TINY_MT_ARGS + LN, ["--criterion", "label_smoothed_cross_entropy"])
    neutral, _ = NEUTRAL_AND_ACTIVE[name]
    _, task, model, criterion = build_parts(data_bin, base, ["--criterion", name] + neutral)
    stock = criterion_from_flags(task, data_bin, base, stock_flags)
    sample = padded_batch(task) if data == "mt" else first_batch(task)
    # eval mode: AGG's gates, which change one gradient and no value, are left out of the comparison
    loss, size, log, grads = criterion_forward(model, criterion, sample, reduce=False, train=False)
    stock_loss, stock_size, stock_log, stock_grads = criterion_forward(model, stock, sample, reduce=False, train=False)
    positions = sample["target"].numel()
    assert loss.shape == (positions,) and stock_loss.reshape(-1).shape == (positions,)  # LSCE: (B x T, 1)
    pad = sample["target"].reshape(-1).eq(task.target_dictionary.pad())
    assert (data == "lm" or pad.any()) and torch.all(loss[pad] == 0)
    torch.testing.assert_close(loss, stock_loss.reshape(-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(log["loss"], stock_log["loss"].reshape(-1), rtol=1e-5, atol=1e-6)
    nll = stock_log.get("nll_loss", stock_log["loss"]).reshape(-1)
    torch.testing.assert_close(log["nll_loss"], nll, rtol=1e-5, atol=1e-6)
    assert size == stock_size
    for key in grads:
        torch.testing.assert_close(grads[key], stock_grads[key], rtol=1e-4, atol=1e-6, msg=key)


@pytest.mark.parametrize("name", sorted(NEUTRAL_AND_ACTIVE))
def test_reduce_false_sums_to_the_reduced_loss_with_its_gradients(mt_data_bin, name):
    _, active = NEUTRAL_AND_ACTIVE[name]
    flags = ["--criterion", name] + active + LN
    _, task, model, per_token = build_parts(mt_data_bin, TINY_MT_ARGS, flags)
    reduced = criterion_from_flags(task, mt_data_bin, TINY_MT_ARGS, flags)  # its own counts: same state
    sample = padded_batch(task)
    loss, _, log, grads = criterion_forward(model, per_token, sample, reduce=False)
    want, _, want_log, want_grads = criterion_forward(model, reduced, sample, reduce=True)
    assert loss.dim() == 1 and want.dim() == 0
    assert loss.sum().item() == pytest.approx(want.item(), rel=1e-5)
    assert log["nll_loss"].sum().item() == pytest.approx(want_log["nll_loss"].item(), rel=1e-5)
    with torch.no_grad():
        plain = criterion_from_flags(task, mt_data_bin, TINY_MT_ARGS,
                                     ["--criterion", "label_smoothed_cross_entropy"] + LN)
        assert abs(want.item() - plain(model, sample)[0].item()) > 1e-3 * abs(want.item())  # the method adds something
    for key in want_grads:
        torch.testing.assert_close(grads[key], want_grads[key], rtol=1e-4, atol=1e-6, msg=key)


# ------------------------------------------------------------------------------------------------
# dependent flags


def build_criterion(data, args):
    cfg = parse_config(data, TINY_LM_ARGS, args)
    return tasks.setup_task(cfg.task).build_criterion(cfg.criterion)


@pytest.mark.parametrize(
    "flags, switch, message",
    [
        (["--criterion", "cross_entropy_agg", "--agg-freeze-set", "group"], ["--agg-freeze-rare"],
         "--agg-freeze-set needs --agg-freeze-rare"),
        (["--criterion", "cross_entropy_agg", "--agg-freeze-until-update", "5"], ["--agg-freeze-rare"],
         "--agg-freeze-until-update needs --agg-freeze-rare"),
        (["--criterion", "cross_entropy_agg", "--agg-threshold-mode", "per-update", "--agg-ref-tokens", "512"],
         ["--agg-threshold-mode", "relative"], "--agg-ref-tokens needs --agg-threshold-mode relative"),
        (["--criterion", "cross_entropy_face", "--face-window", "4"], ["--face-counting", "window"],
         "--face-window needs --face-counting window"),
        (["--criterion", "cross_entropy_agg", "--aug-gate-with-agg"], ["--aug-alpha", "0.5"],
         "--aug-gate-with-agg needs --aug-alpha > 0"),
        (["--criterion", "augmented_loss", "--aug-gate-with-agg"], None,
         "--aug-gate-with-agg needs --criterion cross_entropy_agg"),
    ],
)
def test_a_flag_without_its_switch_is_refused_naming_both(lm_data_bin, flags, switch, message):
    with pytest.raises(UsageError) as err:
        build_criterion(lm_data_bin, flags)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
    if switch is not None:  # with the switch the same flag is accepted
        build_criterion(lm_data_bin, flags + switch)


def test_fairseq_train_prints_a_refusal_in_one_line(lm_data_bin, tmp_path):
    save_dir = tmp_path / "ckpt"
    proc = run_cli("fairseq-train", [lm_data_bin, "--user-dir", USER_DIR, "--save-dir", save_dir, "--max-update", "1",
                                     "--criterion", "cross_entropy_face", "--face-window", "4"] + TINY_LM_ARGS,
                   expect_ok=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "fairseq-train: error: --face-window needs --face-counting window: cumulative counts have no window")
    assert "Traceback" not in proc.stderr
    assert not save_dir.exists() or not any(save_dir.iterdir())


# ------------------------------------------------------------------------------------------------
# window sizes


def test_window_flags_are_bounded_by_what_they_allocate(lm_data_bin):
    _, task, _, _ = build_parts(lm_data_bin, TINY_LM_ARGS, ["--criterion", "cross_entropy"], ())
    bound = max_window(len(task.target_dictionary))
    for flags in (["--criterion", "cross_entropy_agg", "--agg-window"],
                  ["--criterion", "cross_entropy_face", "--face-counting", "window", "--face-window"]):
        with pytest.raises(UsageError, match=rf"^{flags[-1]} must be <= {bound}, got {bound + 1}"):
            build_criterion(lm_data_bin, flags + [str(bound + 1)])


def test_a_large_checkpoint_state_is_logged_once(lm_data_bin, caplog):
    _, task, _, _ = build_parts(lm_data_bin, TINY_LM_ARGS, ["--criterion", "cross_entropy"], ())
    vocab = len(task.target_dictionary)
    large = LARGE_STATE_BYTES // vocab + 1  # K x V one-byte counts just above the limit
    def warnings():
        return [r.getMessage() for r in caplog.records
                if r.levelno >= logging.WARNING and r.name.startswith("fairseq_agg")]

    with caplog.at_level(logging.WARNING, logger="fairseq_agg.criterions.output_loss"):
        small = build_criterion(lm_data_bin, ["--criterion", "cross_entropy_agg", "--agg-window", "10"])
        assert not warnings()
        criterion = build_criterion(lm_data_bin, ["--criterion", "cross_entropy_agg", "--agg-window", str(large)])
    lines = warnings()
    assert len(lines) == 1 and "cross_entropy_agg: its counts add" in lines[0] and "--agg-window" in lines[0]
    assert criterion.window.nbytes > LARGE_STATE_BYTES >= small.window.nbytes


# ------------------------------------------------------------------------------------------------
# FACE: cumulative counts by default


def test_face_counts_the_whole_run_by_default(lm_data_bin):
    _, task, model, criterion = build_parts(lm_data_bin, TINY_LM_ARGS, ["--criterion", "cross_entropy_face"])
    assert criterion.face.counting == "cumulative" and isinstance(criterion.counter, CumulativeCounts)
    sample = first_batch(task)
    eos = task.target_dictionary.eos()
    totals, want = [], torch.zeros(len(task.target_dictionary), dtype=torch.long)
    for update_num in range(5):  # more updates than any window would matter for: nothing is dropped
        model.train()
        criterion.set_update_num(update_num)
        with torch.no_grad():
            features = model(**sample["net_input"], features_only=True)[0]
            predicted = (features.reshape(-1, features.size(-1)) @ model.decoder.output_projection.weight.t()).argmax(1)
            predicted = predicted[sample["target"].reshape(-1).ne(task.target_dictionary.pad())]
        criterion(model, sample)[0].backward()
        want += torch.bincount(predicted[predicted.ne(eos)], minlength=want.numel())  # "out": the argmax, no eos
        totals.append(int(criterion.counter.counts.sum()))
    assert torch.equal(criterion.counter.counts, want)
    assert totals == sorted(totals) and totals[0] > 0
    assert set(criterion.state_dict()) == {"state_anchor", "counter.counts"}  # V counts in the checkpoint


# ------------------------------------------------------------------------------------------------
# composition


def test_each_criterion_has_at_most_one_base_class_of_this_package():
    from fairseq.criterions import CRITERION_REGISTRY

    import fairseq_agg.criterions as criterions

    ours = {name: cls for name, cls in CRITERION_REGISTRY.items() if cls.__module__.startswith("fairseq_agg.")}
    # every module of criterions/ but the shared base registers what it defines (no count to keep)
    folder = os.path.dirname(criterions.__file__)
    modules = {f"fairseq_agg.criterions.{f[:-3]}" for f in os.listdir(folder) if f.endswith(".py") and f[0] != "_"}
    assert {cls.__module__ for cls in ours.values()} == modules - {"fairseq_agg.criterions.output_loss"}
    for name, cls in ours.items():
        project_bases = [base for base in inspect.getmro(cls)[1:] if base.__module__.startswith("fairseq_agg.")]
        assert len(project_bases) <= 1, (name, project_bases)
