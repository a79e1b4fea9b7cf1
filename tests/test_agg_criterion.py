"""The ``cross_entropy_agg`` criterion inside real fairseq (docs/agg.md, and its list of departures from the released code).

The criterion is built through fairseq's registry, with real ``language_modeling`` and
``translation`` tasks on the tiny data-bins, and driven by fairseq's own ``Trainer`` (training,
dummy batches, validation) or by a real ``fairseq-train --update-freq 2`` subprocess.
"""
import math

import numpy as np
import pytest
import torch
from fairseq import metrics, tasks
from fairseq.criterions import CRITERION_REGISTRY
from fairseq.data import iterators
from fairseq.trainer import Trainer

from fairseq_agg.criterions.agg import AggCriterion
from reference_constructions import reference_output_loss
from fairseq_runs import STRONG_GATING, TINY_LM_ARGS, TINY_MT_ARGS, USER_DIR, read_json_log, run_cli
from fairseq_runs import build_parts as build
from fairseq_runs import criterion_from_flags, non_pad_features
from fairseq_runs import parse_config as parse

torch.set_num_threads(2)


def first_batches(task, split, n, max_tokens):
    itr = task.get_batch_iterator(
        dataset=task.dataset(split), max_tokens=max_tokens, seed=1, epoch=1, num_workers=0
    ).next_epoch_itr(shuffle=False)
    return [next(itr) for _ in range(n)]


def padded_batch(task, split, size=12):
    """A batch of sentences of different lengths, collated by the dataset's own collater."""
    dataset = task.dataset(split)
    by_length = {}
    for i in range(len(dataset)):
        by_length.setdefault(int(dataset.tgt_sizes[i]), i)
    chosen = list(by_length.values())[:size]
    return dataset.collater([dataset[i] for i in chosen])


def non_pad_histogram(sample, pad, vocab):
    target = sample["target"].reshape(-1)
    return torch.bincount(target[target.ne(pad)], minlength=vocab)


def window_state(criterion):
    return {k: v.clone() for k, v in criterion.window.state_dict().items()}


def reduced(criterion_cls, logging_output):
    with metrics.aggregate(new_root=True) as agg:
        criterion_cls.reduce_metrics([logging_output])
        return agg.get_smoothed_values()


def forward_backward(model, criterion, sample):
    model.zero_grad()
    loss, sample_size, log = criterion(model, sample)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), sample_size, log, grads


def test_registered_in_fairseq_registry(lm_data_bin):
    assert CRITERION_REGISTRY["cross_entropy_agg"] is AggCriterion
    _, _, _, criterion = build(lm_data_bin, TINY_LM_ARGS, ["--criterion", "cross_entropy_agg"])
    assert isinstance(criterion, AggCriterion)


def compare_with_stock(model, agg, stock, sample, weight_name):
    """AGG vs a stock fairseq criterion on the same model and batch; returns AGG's gates and gradients."""
    model.train()
    agg.set_update_num(0)
    loss_a, size_a, log_a, grads_a = forward_backward(model, agg, sample)
    gates = agg.last_gates
    loss_s, size_s, log_s, grads_s = forward_backward(model, stock, sample)

    # logged values mean the same thing
    assert size_a == size_s and log_a["ntokens"] == log_s["ntokens"]
    assert loss_a.item() == pytest.approx(loss_s.item(), rel=1e-5)
    assert log_a["loss"].item() == pytest.approx(log_s["loss"].item(), rel=1e-5)
    assert log_a["nll_loss"].item() == pytest.approx(log_s.get("nll_loss", log_s["loss"]).item(), rel=1e-5)
    values_a, values_s = reduced(type(agg), log_a), reduced(type(stock), log_s)
    for key in ("loss", "nll_loss", "ppl"):
        if key in values_s:
            assert values_a[key] == pytest.approx(values_s[key], abs=2e-3), key
    assert values_a["ppl"] == pytest.approx(2 ** values_a["nll_loss"], rel=2e-3)  # 1x CE, not 2x

    # every parameter but the output embedding gets exactly the stock gradient (dH is un-gated) ...
    assert set(grads_a) == set(grads_s)
    for name in grads_s:
        if name != weight_name:
            torch.testing.assert_close(grads_a[name], grads_s[name], rtol=1e-4, atol=1e-6, msg=name)
    # ... and so do the output-embedding rows of non-rare tokens; rare rows are gated
    assert gates is not None and gates.rare.any()
    keep = ~gates.rare
    torch.testing.assert_close(grads_a[weight_name][keep], grads_s[weight_name][keep], rtol=1e-4, atol=1e-6)
    assert not torch.allclose(grads_a[weight_name][gates.rare], grads_s[weight_name][gates.rare], atol=1e-6)
    return gates, grads_a


def test_lm_logged_loss_and_gradients_match_stock_cross_entropy(lm_data_bin):
    # alpha 2.5 per update: tokens seen fewer than 3 times in this first update are rare, so gating
    # happens (alpha > 1 needs the normalized g1 = a / alpha to keep every gate <= 1)
    cfg, task, model, agg = build(lm_data_bin, TINY_LM_ARGS, ["--criterion", "cross_entropy_agg"] + STRONG_GATING)
    stock = criterion_from_flags(task, lm_data_bin, TINY_LM_ARGS, ["--criterion", "cross_entropy"])
    sample = first_batches(task, "train", 1, 512)[0]
    gates, _ = compare_with_stock(model, agg, stock, sample, "decoder.embed_tokens.weight")
    target = sample["target"].reshape(-1)
    assert gates.rare[target].any() and (~gates.rare[target]).any()  # contexts of both kinds


def test_mt_padding_masked_and_matches_stock_label_smoothed(mt_data_bin):
    extra = ["--criterion", "cross_entropy_agg", "--label-smoothing", "0.1", "--agg-window", "10"] + STRONG_GATING
    cfg, task, model, agg = build(mt_data_bin, TINY_MT_ARGS, extra)
    stock = criterion_from_flags(
        task, mt_data_bin, TINY_MT_ARGS, ["--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1"]
    )
    sample = padded_batch(task, "train")
    pad = task.target_dictionary.pad()
    assert sample["target"].eq(pad).any(), "the batch must contain target padding"
    weight_name = "encoder.embed_tokens.weight"  # --share-all-embeddings: one matrix
    gates, grads = compare_with_stock(model, agg, stock, sample, weight_name)

    # the window counted the non-pad targets only
    hist = non_pad_histogram(sample, pad, len(task.target_dictionary))
    assert torch.equal(agg.window.counts, hist) and agg.window.counts[pad] == 0

    # all gradients equal the reference construction on the pad-free rows, with the same gates
    model.zero_grad()
    hidden, target = non_pad_features(model, sample, pad)
    loss, _, _ = reference_output_loss(
        hidden, model.decoder.output_projection.weight, target, 0.1,
        gates=gates,
    )
    loss.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def make_trainer(data, base_args, extra):
    cfg, task, model, criterion = build(data, base_args, extra)
    trainer = Trainer(cfg, task, model, criterion)
    epoch_itr = trainer.get_train_iterator(epoch=1)  # configures the window (K = updates per epoch)
    return cfg, task, trainer, criterion, epoch_itr


def test_window_size_is_updates_per_epoch(lm_data_bin):
    _, task, trainer, criterion, epoch_itr = make_trainer(
        lm_data_bin, TINY_LM_ARGS, ["--criterion", "cross_entropy_agg", "--update-freq", "3"]
    )
    assert criterion.window.window == math.ceil(len(epoch_itr) / 3)
    _, _, _, explicit, _ = make_trainer(lm_data_bin, TINY_LM_ARGS, ["--criterion", "cross_entropy_agg", "--agg-window", "5"])
    assert explicit.window.window == 5


def test_trainer_steps_dummy_batches_and_validation(lm_data_bin):
    """Real Trainer: micro-batches of one update share a row, dummy batches and validation add nothing."""
    cfg, task, trainer, criterion, epoch_itr = make_trainer(lm_data_bin, TINY_LM_ARGS, ["--criterion", "cross_entropy_agg"])
    vocab, pad = len(task.target_dictionary), task.target_dictionary.pad()
    batches = list(epoch_itr.next_epoch_itr(shuffle=False))[:3]
    hists = [non_pad_histogram(b, pad, vocab) for b in batches]

    trainer.train_step([batches[0], batches[1]])  # one update of two micro-batches
    w = criterion.window
    assert w.update_index == 1 and w.recorded == 1
    assert torch.equal(w.counts, hists[0] + hists[1]) and torch.equal(w.current, hists[0] + hists[1])

    trainer.train_step([batches[2], {}])  # {} -> fairseq's dummy batch, ignore_grad=True
    assert w.update_index == 2 and w.recorded == 2
    assert torch.equal(w.current, hists[2])  # the dummy batch (a copy of a real batch) added nothing
    assert torch.equal(w.counts, hists[0] + hists[1] + hists[2])
    assert torch.equal(w.ring[1 % w.window].long(), hists[0] + hists[1])

    before = window_state(criterion)
    valid = list(trainer.get_valid_iterator("valid").next_epoch_itr(shuffle=False))
    for sample in valid:
        trainer.valid_step(sample)  # model.eval() + torch.no_grad()
    after = window_state(criterion)
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key

    # neither an eval-mode forward with gradients nor a train-mode forward without them counts
    model = trainer.model
    model.eval()
    criterion(model, valid[0])
    model.train()
    with torch.no_grad():
        criterion(model, valid[0])
    for key, value in window_state(criterion).items():
        assert torch.equal(before[key], value), key


def test_training_forward_without_update_number_is_refused(lm_data_bin):
    _, task, model, criterion = build(lm_data_bin, TINY_LM_ARGS, ["--criterion", "cross_entropy_agg", "--agg-window", "4"])
    model.train()
    with pytest.raises(RuntimeError, match="update number"):
        criterion(model, first_batches(task, "train", 1, 512)[0])


@pytest.mark.parametrize(
    "flag,value,allowed",
    [("--agg-alpha", "0", "(0, 1]"), ("--agg-alpha", "-0.5", "(0, 1]"), ("--agg-window", "-1", ">= 1"),
     ("--agg-ref-tokens", "-1", ">= 1"), ("--output-chunk-tokens", "0", ">= 1"),
     ("--label-smoothing", "1.0", "in [0, 1)"), ("--label-smoothing", "-0.1", "in [0, 1)")],
)
def test_bad_values_name_the_flag(lm_data_bin, flag, value, allowed):
    cfg = parse(lm_data_bin, TINY_LM_ARGS, ["--criterion", "cross_entropy_agg", flag, value])
    task = tasks.setup_task(cfg.task)
    with pytest.raises(ValueError) as err:
        task.build_criterion(cfg.criterion)
    assert flag in str(err.value) and allowed in str(err.value)


# ---------------------------------------------------------------------------------------------
# A real fairseq-train run with --update-freq 2, checked against brute-force counts


UF_ALPHA = 0.5


def replay_updates(data, base_args, extra, max_update):
    """The target histograms of every micro-batch, grouped per update, in fairseq-train's order.

    Uses fairseq's own Trainer.get_train_iterator / next_epoch_itr / GroupedIterator the way
    fairseq_cli/train.py does, with a stock criterion (nothing is trained here).
    """
    cfg, task, model, _ = build(data, base_args, extra)
    stock = criterion_from_flags(task, data, base_args, ["--criterion", "cross_entropy"])
    trainer = Trainer(cfg, task, model, stock)
    vocab, pad = len(task.target_dictionary), task.target_dictionary.pad()
    epoch_itr = trainer.get_train_iterator(epoch=1)
    batches_epoch1 = len(epoch_itr)
    updates = []
    while len(updates) < max_update:
        itr = epoch_itr.next_epoch_itr(shuffle=epoch_itr.next_epoch_idx > cfg.dataset.curriculum)
        for group in iterators.GroupedIterator(itr, cfg.optimization.update_freq[0]):
            updates.append([non_pad_histogram(b, pad, vocab) for b in group])
            if len(updates) == max_update:
                break
        else:
            epoch_itr = trainer.get_train_iterator(epoch_itr.next_epoch_idx, load_dataset=False)
    return updates, batches_epoch1, task.target_dictionary.nspecial


def test_fairseq_train_update_freq_2_window_equals_brute_force(lm_data_bin, tmp_path):
    from fairseq_agg.ops.agg import agg_gates

    max_update = 18  # one epoch is 14 updates here: the window wraps around, across the epoch boundary
    extra = ["--criterion", "cross_entropy_agg", "--agg-alpha", str(UF_ALPHA), "--update-freq", "2",
             "--agg-threshold-mode", "per-update"]  # the released code's counting, checked by brute force
    save_dir = tmp_path / "ckpt"
    proc = run_cli(
        "fairseq-train",
        [lm_data_bin, "--user-dir", USER_DIR] + TINY_LM_ARGS + extra
        + ["--max-update", max_update, "--save-dir", save_dir, "--log-format", "json", "--no-epoch-checkpoints"],
    )
    state = torch.load(save_dir / "checkpoint_last.pt", map_location="cpu", weights_only=False)["criterion"]
    window, update_index, recorded = state["window.meta"].tolist()

    updates, batches, nspecial = replay_updates(lm_data_bin, TINY_LM_ARGS, extra, max_update)
    assert window == math.ceil(batches / 2) and window < max_update
    assert update_index == max_update and recorded == min(max_update, window)
    assert any(len(u) == 1 for u in updates)  # the odd last batch of epoch 1 is an update of its own

    per_update = [sum(u) for u in updates]
    brute = sum(per_update[max_update - window :])
    assert torch.equal(state["window.counts"], brute)
    assert torch.equal(state["window.current"], per_update[-1])
    assert torch.equal(state["window.counts"], state["window.ring"].long().sum(0) + state["window.current"])
    for t in range(max_update - window + 1, max_update):  # the K - 1 committed updates, one ring row each
        assert torch.equal(state["window.ring"][t % window].long(), per_update[t - 1]), t
    assert not state["window.ring"][max_update % window].any()

    # the logged rare-token statistics of every update equal the ones recomputed from brute force
    records = [r for r in read_json_log(proc.stdout + proc.stderr) if "num_updates" in r and "agg_rare" in r]
    logged = {int(r["num_updates"]): r for r in records}
    assert sorted(logged) == list(range(1, max_update + 1))
    for t in range(1, max_update + 1):
        previous = per_update[max(0, t - window) : t - 1]
        base = sum(previous) if previous else torch.zeros_like(brute)
        n_rare, n_very, g1 = [], [], []
        partial = torch.zeros_like(brute)
        for hist in updates[t - 1]:
            partial = partial + hist
            gates = agg_gates(base + partial, min(t, window), UF_ALPHA, nspecial)
            rare = gates.rare
            n_rare.append(int(rare.sum()))
            n_very.append(int((gates.g2[rare] < 1).sum()))
            g1.append(float(gates.g1[rare].mean()) if rare.any() else 1.0)
        rec = logged[t]
        assert float(rec["agg_rare"]) == pytest.approx(np.mean(n_rare), abs=0.051), t
        assert float(rec["agg_very_rare"]) == pytest.approx(np.mean(n_very), abs=0.051), t
        assert float(rec["agg_g1"]) == pytest.approx(np.mean(g1), abs=6e-5), t
