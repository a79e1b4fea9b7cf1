"""The baseline criteria inside real fairseq (docs/baselines.md): ``cross_entropy_cosreg``,
``cross_entropy_face``, ``cross_entropy_unlikelihood`` and ``cross_entropy_agg --agg-freeze-rare``.

Built through fairseq's registry with real ``language_modeling`` / ``translation`` tasks on the tiny
data-bins; loss and every parameter's gradient against the direct reference on materialised logits
(padding in the MT batch, label smoothing 0.1), the counting rules, and the start-up refusals.
"""
import math

import pytest
import torch
from fairseq import metrics, tasks
from fairseq.criterions import CRITERION_REGISTRY
from fairseq.trainer import Trainer

from fairseq_agg.errors import UsageError
from fairseq_agg.ops.counting import target_histogram
from fairseq_agg.ops.face import face_token_weights
from fairseq_agg.stats.groups import frequency_groups, row_mask
import fairseq_runs
from fairseq_runs import TINY_LM_ARGS, TINY_MT_ARGS, first_batch
from fairseq_runs import build_parts as build
from fairseq_runs import parse_config as parse
from reference_constructions import (
    frozen_rows,
    reference_cosreg,
    reference_face_loss,
    reference_face_weights,
    reference_unlikelihood_loss,
    smoothed_nll,
)

torch.set_num_threads(2)
LM_UNTIED = [a for a in TINY_LM_ARGS if a != "--share-decoder-input-output-embed"]
MT_SMOOTHED = ["--label-smoothing", "0.1"]


def padded_batch(task, split="train"):
    sample = fairseq_runs.padded_batch(task, split)
    assert sample["target"].eq(task.target_dictionary.pad()).any()
    return sample


def criterion_step(model, criterion, sample):
    model.train()
    model.zero_grad()
    criterion.set_update_num(0)
    loss, sample_size, log = criterion(model, sample)
    loss.backward()
    return loss.detach(), sample_size, log, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def reference_grads(model, loss):
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def features_and_weight(model, sample):
    features = model(**sample["net_input"], features_only=True)[0]
    return features.reshape(-1, features.size(-1)), model.decoder.output_projection.weight


def assert_same_grads(got, want):
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


def reduced(criterion, logging_output):
    with metrics.aggregate(new_root=True) as agg:
        type(criterion).reduce_metrics([logging_output])
        return agg.get_smoothed_values()


@pytest.mark.parametrize("name", ["cross_entropy_cosreg", "cross_entropy_face", "cross_entropy_unlikelihood"])
def test_registered(name, lm_data_bin):
    _, _, _, criterion = build(lm_data_bin, TINY_LM_ARGS, ["--criterion", name])
    assert isinstance(criterion, CRITERION_REGISTRY[name])


# ------------------------------------------------------------------------------------------ CosReg


@pytest.mark.parametrize("normalizer", ["paper", "pairs"])
def test_cosreg_lm_loss_and_gradients(lm_data_bin, normalizer):
    extra = ["--criterion", "cross_entropy_cosreg", "--cosreg-gamma", "0.7", "--cosreg-normalizer", normalizer]
    _, task, model, criterion = build(lm_data_bin, TINY_LM_ARGS, extra)
    sample = first_batch(task)
    loss, sample_size, log, grads = criterion_step(model, criterion, sample)

    rows = row_mask(task.target_dictionary, "no-pad-madeup").nonzero().squeeze(1)
    hidden, weight = features_and_weight(model, sample)
    target = sample["target"].reshape(-1)
    keep = target.ne(task.target_dictionary.pad())
    ce, nll = smoothed_nll(hidden[keep] @ weight.t(), target[keep], 0.0)
    regulariser = reference_cosreg(weight, rows, normalizer)
    want = ce + 0.7 * sample_size * regulariser
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    assert log["cosreg"].item() == pytest.approx(regulariser.item(), rel=1e-5)
    assert log["nll_loss"].item() == pytest.approx(nll.item(), rel=1e-5)
    assert_same_grads(grads, reference_grads(model, want))
    values = reduced(criterion, log)
    assert values["cosreg"] == pytest.approx(regulariser.item(), abs=1e-4)
    # loss = mean CE + gamma R (fairseq logs it in bits)
    assert values["loss"] == pytest.approx(values["nll_loss"] + 0.7 * regulariser.item() / math.log(2), abs=2e-3)


def test_cosreg_both_matrices_of_an_untied_lm(lm_data_bin):
    extra = ["--criterion", "cross_entropy_cosreg", "--cosreg-matrix", "both", "--cosreg-rows", "all"]
    _, task, model, criterion = build(lm_data_bin, LM_UNTIED, extra)
    sample = first_batch(task)
    loss, sample_size, log, grads = criterion_step(model, criterion, sample)
    hidden, weight = features_and_weight(model, sample)
    target = sample["target"].reshape(-1)
    keep = target.ne(task.target_dictionary.pad())
    ce, _ = smoothed_nll(hidden[keep] @ weight.t(), target[keep], 0.0)
    both = reference_cosreg(weight) + reference_cosreg(model.decoder.embed_tokens.weight)
    assert log["cosreg"].item() == pytest.approx(both.item(), rel=1e-5)
    assert_same_grads(grads, reference_grads(model, ce + sample_size * both))


# -------------------------------------------------------------------------------------------- FACE


def test_face_mt_gt_counts_padding_and_label_smoothing(mt_data_bin):
    extra = ["--criterion", "cross_entropy_face", "--face-frequency", "gt", "--face-counting", "window", "--face-window", "10"] + MT_SMOOTHED
    _, task, model, criterion = build(mt_data_bin, TINY_MT_ARGS, extra)
    dictionary = task.target_dictionary
    sample = padded_batch(task)
    loss, _, log, grads = criterion_step(model, criterion, sample)

    target = sample["target"].reshape(-1)
    keep = target.ne(dictionary.pad())
    counted = target[keep & target.ne(dictionary.eos())]  # padding and eos are never counted
    counts = torch.bincount(counted, minlength=len(dictionary))
    assert torch.equal(criterion.counter.counts, counts)
    hidden, weight = features_and_weight(model, sample)
    row_weight = reference_face_weights(counts, target[keep], None, "pre")
    want, nll = reference_face_loss(hidden[keep], weight, target[keep], 0.1, row_weight)
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    assert log["nll_loss"].item() == pytest.approx(nll.item(), rel=1e-5)
    assert log["face_weight"].item() == pytest.approx(row_weight.sum().item(), rel=1e-5)
    assert_same_grads(grads, reference_grads(model, want))


def test_face_out_counts_the_argmax_after_the_pass_and_not_in_validation(lm_data_bin):
    extra = ["--criterion", "cross_entropy_face", "--face-counting", "window", "--face-window", "4", "--face-weighing", "post"]
    cfg, task, model, criterion = build(lm_data_bin, TINY_LM_ARGS, extra)
    dictionary = task.target_dictionary
    trainer = Trainer(cfg, task, model, criterion)
    batches = list(trainer.get_train_iterator(epoch=1).next_epoch_itr(shuffle=False))[:2]

    # first micro-batch: no counts yet, so every weight is 1 and the loss is plain CE
    model.train()
    criterion.set_update_num(0)
    with torch.no_grad():
        hidden, weight = features_and_weight(model, batches[0])
    target = batches[0]["target"].reshape(-1)
    keep = target.ne(dictionary.pad())
    logits = hidden[keep] @ weight.t()
    loss, _, log = criterion(model, batches[0])
    assert loss.item() == pytest.approx(log["nll_loss"].item(), rel=1e-6)
    predicted = logits.argmax(1)
    want = torch.bincount(predicted[predicted.ne(dictionary.eos())], minlength=len(dictionary))
    assert torch.equal(criterion.counter.counts, want)  # the argmax of this batch, counted after it

    # second micro-batch: post-weights from those counts
    criterion.set_update_num(1)
    model.zero_grad()
    loss, _, log = criterion(model, batches[1])
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    hidden, weight = features_and_weight(model, batches[1])
    target = batches[1]["target"].reshape(-1)
    keep = target.ne(dictionary.pad())
    row_weight = reference_face_weights(want, target[keep], (hidden[keep] @ weight.t()).detach(), "post")
    assert row_weight.max() > 1
    ref, _ = reference_face_loss(hidden[keep], weight, target[keep], 0.0, row_weight)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    assert_same_grads(grads, reference_grads(model, ref))

    before = criterion.counter.counts.clone()
    for sample in trainer.get_valid_iterator("valid").next_epoch_itr(shuffle=False):
        trainer.valid_step(sample)
    assert torch.equal(criterion.counter.counts, before)


def test_face_counts_are_checkpointed(lm_data_bin):
    extra = ["--criterion", "cross_entropy_face", "--face-frequency", "gt", "--face-counting", "window", "--face-window", "3"]
    _, task, model, criterion = build(lm_data_bin, TINY_LM_ARGS, extra)
    criterion_step(model, criterion, first_batch(task))
    assert len(list(criterion.parameters())) == 1  # the anchor: fairseq saves the criterion's state
    state = criterion.state_dict()
    _, _, _, restored = build(lm_data_bin, TINY_LM_ARGS, extra)
    restored.load_state_dict(state)
    assert torch.equal(restored.counter.counts, criterion.counter.counts)
    assert restored.counter.counts.sum() > 0


def test_counts_of_another_criterion_start_empty_and_own_counts_load_strictly(lm_data_bin):
    face_flags = ["--criterion", "cross_entropy_face", "--face-frequency", "gt", "--face-counting", "window", "--face-window", "3"]
    agg_flags = ["--criterion", "cross_entropy_agg", "--agg-window", "3"]
    _, task, model, agg = build(lm_data_bin, TINY_LM_ARGS, agg_flags)
    criterion_step(model, agg, first_batch(task))
    _, _, _, face = build(lm_data_bin, TINY_LM_ARGS, face_flags)
    criterion_step(model, face, first_batch(task))
    agg_state, face_state = agg.state_dict(), face.state_dict()
    assert any(k.startswith("window.") for k in agg_state) and any(k.startswith("counter.") for k in face_state)

    # fine-tuning from a checkpoint of AGG, of FACE or of a stock criterion (no state): counts start empty
    for fresh, foreign in ((face_flags, agg_state), (agg_flags, face_state), (face_flags, None)):
        _, _, _, restored = build(lm_data_bin, TINY_LM_ARGS, fresh)
        restored.load_state_dict(foreign)
        counts = restored.counter.counts if hasattr(restored, "counter") else restored.window.counts
        assert counts.sum() == 0

    # its own counts load as they were, and a damaged copy of them is refused
    _, _, _, restored = build(lm_data_bin, TINY_LM_ARGS, face_flags)
    restored.load_state_dict(face_state)
    assert torch.equal(restored.counter.counts, face.counter.counts) and face.counter.counts.sum() > 0
    damaged = {k: v for k, v in face_state.items() if k != "counter.meta"}
    with pytest.raises(UsageError, match="counter.meta missing"):
        restored.load_state_dict(damaged)


def test_face_cumulative_counts(lm_data_bin):
    extra = ["--criterion", "cross_entropy_face", "--face-frequency", "gt", "--face-count-eos"]  # cumulative: the default
    _, task, model, criterion = build(lm_data_bin, TINY_LM_ARGS, extra)
    sample = first_batch(task)
    for update in range(3):
        criterion.set_update_num(update)
        criterion(model, sample)
    target = sample["target"].reshape(-1)
    hist = target_histogram(target[target.ne(task.target_dictionary.pad())], len(task.target_dictionary))
    assert torch.equal(criterion.counter.counts, 3 * hist)  # no decay, eos counted
    assert face_token_weights(criterion.counter.counts)[task.target_dictionary.eos()] < 1


# ---------------------------------------------------------------------------------------------- UL


@pytest.mark.parametrize("data,base,extra", [("lm", TINY_LM_ARGS, []), ("mt", TINY_MT_ARGS, MT_SMOOTHED)])
def test_unlikelihood_loss_and_gradients(lm_data_bin, mt_data_bin, data, base, extra):
    data_bin = lm_data_bin if data == "lm" else mt_data_bin
    _, task, model, criterion = build(data_bin, base, ["--criterion", "cross_entropy_unlikelihood", "--ul-alpha", "0.5"] + extra)
    sample = padded_batch(task) if data == "mt" else first_batch(task)
    loss, sample_size, log, grads = criterion_step(model, criterion, sample)
    eps = 0.1 if extra else 0.0
    hidden, weight = features_and_weight(model, sample)
    want, nll, ul = reference_unlikelihood_loss(hidden, weight, sample["target"], task.target_dictionary.pad(), 0.5, eps)
    assert ul > 0
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    assert log["ul_loss"].item() == pytest.approx(ul.item(), rel=1e-5)
    assert log["nll_loss"].item() == pytest.approx(nll.item(), rel=1e-5)
    assert_same_grads(grads, reference_grads(model, want))
    values = reduced(criterion, log)
    assert values["ul_candidates"] > 0 and values["ul_loss"] > 0


# ---------------------------------------------------------------------------------------- freezing


def agg_freeze(data_bin, base, extra):
    return build(data_bin, base, ["--criterion", "cross_entropy_agg", "--agg-freeze-rare", "--agg-window", "4"] + extra)


def test_freezing_tied_lm_against_the_reference(lm_data_bin):
    # tokens seen fewer than 3 times in this first update are rare (g1 is not used when freezing)
    extra = ["--agg-threshold-mode", "per-update", "--agg-alpha", "2.5", "--agg-g1-mode", "normalized"]
    _, task, model, criterion = agg_freeze(lm_data_bin, TINY_LM_ARGS, extra)
    sample = first_batch(task)
    loss, _, log, grads = criterion_step(model, criterion, sample)
    rare = criterion.last_gates.rare  # --agg-freeze-set window: the rare group is frozen
    target = sample["target"].reshape(-1)
    keep = target.ne(task.target_dictionary.pad())
    assert rare[target[keep]].any() and (~rare[target[keep]]).any()
    assert log["agg_frozen"].item() == rare.sum().item()

    hidden, weight = features_and_weight(model, sample)
    ref, _ = smoothed_nll(hidden[keep] @ frozen_rows(weight, rare).t(), target[keep], 0.0)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    assert_same_grads(grads, reference_grads(model, ref))
    # the input side of a rare row that occurs in the batch still trains (tied matrix)
    inputs = sample["net_input"]["src_tokens"].reshape(-1)
    seen_rare = rare.clone()
    seen_rare[:] = False
    seen_rare[inputs] = True
    seen_rare &= rare
    assert seen_rare.any() and grads["decoder.embed_tokens.weight"][seen_rare].abs().sum() > 0


def test_freezing_untied_static_group_until_update(lm_data_bin):
    extra = ["--agg-freeze-set", "group", "--agg-freeze-until-update", "2"]
    _, task, model, criterion = agg_freeze(lm_data_bin, LM_UNTIED, extra)
    stock = task.build_criterion(parse(lm_data_bin, LM_UNTIED, ["--criterion", "cross_entropy"]).criterion)
    sample = first_batch(task)
    rare = torch.zeros(len(task.target_dictionary), dtype=torch.bool)
    rare[frequency_groups(task.target_dictionary)["rare"]] = True

    for update, frozen in ((0, True), (1, True), (2, False)):
        model.zero_grad()
        criterion.set_update_num(update)
        loss, _, _ = criterion(model, sample)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        stock_loss, _, _ = stock(model, sample)
        stock_loss.backward()
        assert loss.item() == pytest.approx(stock_loss.item(), rel=1e-6)
        for name, p in model.named_parameters():
            want = p.grad.clone()
            if frozen and name == "decoder.output_projection.weight":
                assert torch.all(grads[name][rare] == 0)
                want[rare] = 0
            torch.testing.assert_close(grads[name], want, rtol=1e-4, atol=1e-6, msg=(update, name))


# ------------------------------------------------------------------------------------ refused input


@pytest.mark.parametrize(
    "criterion,flag,value,allowed",
    [("cross_entropy_cosreg", "--cosreg-gamma", "-1", ">= 0"),
     ("cross_entropy_unlikelihood", "--ul-alpha", "-0.5", ">= 0"),
     ("cross_entropy_unlikelihood", "--ul-clamp", "0", "in (0, 1)"),
     ("cross_entropy_unlikelihood", "--ul-clamp", "1", "in (0, 1)"),
     ("cross_entropy_face", "--face-window", "-1", ">= 1"),
     ("cross_entropy_face", "--label-smoothing", "1.5", "in [0, 1)"),
     ("cross_entropy_agg", "--agg-freeze-until-update", "-1", ">= 0")],
)
def test_bad_values_name_the_flag(lm_data_bin, criterion, flag, value, allowed):
    cfg = parse(lm_data_bin, TINY_LM_ARGS, ["--criterion", criterion, flag, value])
    task = tasks.setup_task(cfg.task)
    with pytest.raises(ValueError) as err:
        task.build_criterion(cfg.criterion)
    assert flag in str(err.value) and allowed in str(err.value)


@pytest.mark.parametrize("name", ["cross_entropy_cosreg", "cross_entropy_face", "cross_entropy_unlikelihood"])
def test_adaptive_softmax_is_refused(lm_data_bin, name):
    _, _, model, criterion = build(lm_data_bin, LM_UNTIED, ["--criterion", name, "--adaptive-softmax-cutoff", "50,100"])
    with pytest.raises(ValueError, match="--adaptive-softmax-cutoff"):
        criterion.check_model(model)
