"""The AGG threshold across tokens per update, and the window's denominator when fine-tuning.

* The default (relative) threshold gives the same rare set, g1 and g2 at the same point of the data
  whatever the tokens per update, with the default one-epoch window;
* ``--agg-threshold-mode per-update`` equals the released code's formula bit for bit;
* a window that starts at update 5001 (fine-tuning a checkpoint without counts) divides by the one
  update it recorded, as a fresh run does, in a unit test and through fairseq's Trainer.
"""
import logging
import os

import numpy as np
import pytest
import torch
from fairseq.trainer import Trainer

from fairseq_agg.ops.agg import agg_gates
from fairseq_agg.ops.agg_threshold import PAPER_TOKENS_PER_UPDATE, resolve_threshold
from fairseq_agg.ops.counting import RareTokenWindow
from fairseq_runs import TINY_LM_ARGS, TINY_MT_ARGS
from fairseq_runs import build_parts as build

torch.set_num_threads(2)

NSPECIAL = 4


def zipf_stream(rng, vocab, n_tokens):
    """A target stream with Zipfian frequencies (the specials never occur as targets but eos)."""
    weights = 1.0 / np.arange(1, vocab - NSPECIAL + 1) ** 1.1
    return torch.from_numpy(rng.choice(np.arange(NSPECIAL, vocab), size=n_tokens, p=weights / weights.sum()))


def gates_per_update(stream, vocab, tokens_per_update, updates_per_window, alpha, micro_batches=1):
    """(rare, g1, g2) after each optimizer update of ``tokens_per_update`` targets of ``stream``."""
    window = RareTokenWindow(vocab, updates_per_window)
    out = []
    chunk = tokens_per_update // micro_batches
    for t, start in enumerate(range(0, len(stream), tokens_per_update), start=1):
        window.start_update(t)
        for m in range(micro_batches):
            part = stream[start + m * chunk: start + (m + 1) * chunk]
            window.add(torch.bincount(part, minlength=vocab))
        mode, ref = resolve_threshold("auto", 0, translation=False)
        out.append(agg_gates(window.counts, window.recorded, alpha, NSPECIAL, threshold_mode=mode, ref_tokens=ref))
    return out


def test_default_gates_do_not_depend_on_the_tokens_per_update():
    """Same data order, one epoch of 131,072 targets per window: 512 vs 2,048 tokens per update."""
    vocab, epoch_tokens, alpha = 3000, 131072, 1.0  # rare below 4 occurrences per epoch of 131,072 targets
    stream = zipf_stream(np.random.default_rng(0), vocab, 3 * epoch_tokens)  # past two wrap-arounds
    small = gates_per_update(stream, vocab, 512, epoch_tokens // 512, alpha)
    large = gates_per_update(stream, vocab, 2048, epoch_tokens // 2048, alpha, micro_batches=2)
    assert len(small) == 4 * len(large)
    for i, big in enumerate(large):
        same_data = small[4 * i + 3]  # both have seen exactly the same targets
        assert 0 < int(big.rare.sum()) < vocab - NSPECIAL
        assert torch.equal(big.rare, same_data.rare), i
        assert torch.equal(big.g1, same_data.g1) and torch.equal(big.g2, same_data.g2), i
    assert (large[-1].g1[large[-1].rare] > 0).any()  # the full window has rare tokens that were seen

    # the released per-update counting differs between the two (4x stricter, fewer rare, at 2,048)
    def per_update(tpu):
        window = RareTokenWindow(vocab, epoch_tokens // tpu)
        for t, start in enumerate(range(0, len(stream), tpu), start=1):
            window.start_update(t)
            window.add(torch.bincount(stream[start: start + tpu], minlength=vocab))
        return agg_gates(window.counts, window.recorded, 0.5, NSPECIAL, threshold_mode="per-update")

    assert int(per_update(2048).rare.sum()) < int(per_update(512).rare.sum())


def released_formula(counts, step, window, alpha, nspecial):
    """The released code's gates, written out: a = counts / min(step, K) in float64 semantics."""
    a = counts.double() / min(step, window)
    rare = a < alpha
    rare[:nspecial] = False
    g1 = torch.ones(len(counts), dtype=torch.float64)
    g1[rare] = a[rare]
    mean_rare = counts.double()[rare].mean() if rare.any() else torch.tensor(0.0, dtype=torch.float64)
    g2 = torch.ones(len(counts), dtype=torch.float64)
    g2[rare] = torch.clamp(counts.double()[rare] / (mean_rare + 1e-7), max=1.0)
    return rare, g1.float(), g2.float()


def test_per_update_mode_equals_the_released_formula_bit_for_bit():
    vocab, k, alpha = 500, 6, 0.7
    rng = np.random.default_rng(3)
    stream = zipf_stream(rng, vocab, 11 * 400)
    window = RareTokenWindow(vocab, k)
    history = []
    for t in range(1, 12):
        window.start_update(t)
        hist = torch.bincount(stream[(t - 1) * 400: t * 400], minlength=vocab)
        window.add(hist)
        history.append(hist)
        gates = agg_gates(window.counts, window.recorded, alpha, NSPECIAL, threshold_mode="per-update")
        rare, g1, g2 = released_formula(sum(history[-k:]), t, k, alpha, NSPECIAL)
        assert rare.any()
        assert torch.equal(gates.rare, rare) and torch.equal(gates.g1, g1) and torch.equal(gates.g2, g2), t


def test_auto_resolves_to_the_papers_tokens_per_update():
    assert resolve_threshold("auto", 0, translation=False) == ("relative", 32768)
    assert resolve_threshold("auto", 0, translation=True) == ("relative", 65536)
    assert resolve_threshold("per-update", 0, translation=True) == ("per-update", 65536)
    assert resolve_threshold("relative", 1000, translation=False) == ("relative", 1000)
    assert PAPER_TOKENS_PER_UPDATE == {"language_modeling": 4 * 1024 * 8, "translation": 8192 * 8}


# ---------------------------------------------------------------------------------------------
# fine-tuning from a checkpoint without counts


def test_window_starting_at_update_5001_divides_by_one_update():
    vocab, alpha = 400, 1.0
    hist = torch.bincount(zipf_stream(np.random.default_rng(5), vocab, 600), minlength=vocab)
    fresh, finetune = RareTokenWindow(vocab, 500), RareTokenWindow(vocab, 500)
    fresh.start_update(1)
    finetune.start_update(5001)
    for w in (fresh, finetune):
        w.add(hist)
    assert fresh.recorded == finetune.recorded == 1
    a = agg_gates(fresh.counts, fresh.recorded, alpha, NSPECIAL, threshold_mode="per-update")
    b = agg_gates(finetune.counts, finetune.recorded, alpha, NSPECIAL, threshold_mode="per-update")
    assert 0 < int(a.rare.sum()) < vocab - NSPECIAL
    assert torch.equal(a.rare, b.rare) and torch.equal(a.g1, b.g1) and torch.equal(a.g2, b.g2)
    finetune.start_update(5002)  # then it grows one update at a time, as a fresh run's does
    assert finetune.recorded == 2
    for t in range(5003, 5003 + 600):
        finetune.start_update(t)
    assert finetune.recorded == 500


@pytest.mark.parametrize("mode", ["per-update", "relative"])
def test_agg_from_a_stock_checkpoint_at_update_5000(lm_data_bin, tmp_path, mode):
    """fairseq's Trainer: a cross_entropy checkpoint at update 5000, fine-tuned with AGG (K = 500),
    gets at its first update (5001) the rare set and gates of a fresh AGG run on the same batch."""
    agg = ["--criterion", "cross_entropy_agg", "--agg-window", "500", "--agg-alpha", "0.5",
           "--agg-threshold-mode", mode] + (["--agg-ref-tokens", "512"] if mode == "relative" else [])
    cfg, task, model, stock = build(lm_data_bin, TINY_LM_ARGS, ["--criterion", "cross_entropy"])
    stock_trainer = Trainer(cfg, task, model, stock)
    stock_trainer.set_num_updates(5000)
    checkpoint = str(tmp_path / "stock.pt")
    stock_trainer.consolidate_optimizer()  # what fairseq's checkpoint_utils does before saving
    stock_trainer.save_checkpoint(checkpoint, {})
    assert "window.ring" not in str(torch.load(checkpoint, map_location="cpu", weights_only=False).get("criterion"))

    def first_update_gates(restore):
        cfg, task, model, criterion = build(lm_data_bin, TINY_LM_ARGS, agg)
        trainer = Trainer(cfg, task, model, criterion)
        if restore:
            # fairseq-train needs --reset-optimizer to change the criterion, which restarts the update
            # count; the window must not depend on it, so the run carries on from update 5000 here
            trainer.load_checkpoint(checkpoint, reset_optimizer=True)
            assert criterion.window.recorded == 0 and not criterion.window.counts.any()
            trainer.set_num_updates(5000)
        batch = next(iter(trainer.get_train_iterator(epoch=1).next_epoch_itr(shuffle=False)))
        trainer.train_step([batch])
        assert criterion.window.recorded == 1
        return criterion.window.update_index, criterion.last_gates

    t_fresh, fresh = first_update_gates(False)
    t_tuned, tuned = first_update_gates(True)
    assert (t_fresh, t_tuned) == (1, 5001)
    assert 0 < int(fresh.rare.sum()) < len(fresh.rare) - NSPECIAL
    assert torch.equal(fresh.rare, tuned.rare)
    assert torch.equal(fresh.g1, tuned.g1) and torch.equal(fresh.g2, tuned.g2)


# ---------------------------------------------------------------------------------------------
# what the log says at start-up


@pytest.mark.parametrize(
    "args,extra,expected",
    [(TINY_LM_ARGS, [], "rare below 0.03 occurrences per 32768 target tokens"),
     (TINY_MT_ARGS, ["--agg-alpha", "0.08"], "rare below 0.08 occurrences per 65536 target tokens"),
     (TINY_LM_ARGS, ["--agg-threshold-mode", "per-update"], "rare below 0.03 occurrences per optimizer update")],
)
def test_the_log_says_once_what_the_threshold_means(lm_data_bin, mt_data_bin, caplog, args, extra, expected):
    data = lm_data_bin if args is TINY_LM_ARGS else mt_data_bin
    with caplog.at_level(logging.INFO, logger="fairseq_agg.criterions.agg"):
        cfg, task, model, criterion = build(data, args, ["--criterion", "cross_entropy_agg"] + extra)
        Trainer(cfg, task, model, criterion).get_train_iterator(epoch=1)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("AGG: a token is rare")]
    assert len(lines) == 1 and expected in lines[0]
    assert f"{criterion.window.window} updates per window" in lines[0]


# ---------------------------------------------------------------------------------------------
# the operating point (docs/agg.md, "The operating point"), by hand on a real one-epoch run


UPDATE_TOKENS = 512  # TINY_LM_ARGS: --max-tokens 512, 64-token blocks, one batch per update


@pytest.fixture(scope="module")
def exact_epoch_bin(lm_data_bin, tmp_path_factory):
    """The LM fixture's training text cut to exactly 16 updates of 512 tokens (one </s> per line),
    so that fairseq leaves no block out of the epoch; with its word counts, counted by hand."""
    import collections
    import shutil

    from fairseq_runs import run_cli

    raw = os.path.join(os.path.dirname(lm_data_bin), "lm_raw")
    total = 16 * UPDATE_TOKENS
    lines, tokens = [], 0
    for line in open(os.path.join(raw, "train.txt")):
        words = line.split()
        if tokens + len(words) + 1 > total - 2:
            break
        lines.append(words)
        tokens += len(words) + 1
    filler = [word for words in lines for word in words]
    lines.append(filler[: total - tokens - 1])  # the last line fills the epoch to the token
    root = tmp_path_factory.mktemp("exact")
    with open(root / "train.txt", "w") as f:
        f.writelines(" ".join(words) + "\n" for words in lines)
    shutil.copy(os.path.join(raw, "valid.txt"), root / "valid_source.txt")
    run_cli("fairseq-preprocess", ["--only-source", "--trainpref", root / "train.txt", "--validpref",
                                   root / "valid_source.txt", "--destdir", root / "bin", "--workers", "1"])
    counts = collections.Counter(word for words in lines for word in words)
    assert sum(len(words) + 1 for words in lines) == total
    return str(root / "bin"), counts, total


@pytest.mark.parametrize("mode, alpha, extra", [
    ("relative", 1.0, ["--agg-ref-tokens", "512"]),  # rare below alpha x T / 512 counts per epoch
    ("per-update", 0.5, ["--agg-threshold-mode", "per-update"]),  # below alpha x U counts per epoch
])
def test_the_operating_point_in_the_log_and_in_analyze_equals_the_hand_count(exact_epoch_bin, tmp_path, mode, alpha,
                                                                               extra):
    import json
    import re

    from fairseq.data import Dictionary

    import fairseq_agg_cli
    from fairseq_runs import USER_DIR, run_cli

    data, counts, tokens = exact_epoch_bin
    save = tmp_path / "ckpt"
    proc = run_cli("fairseq-train", [data, "--user-dir", USER_DIR, "--criterion", "cross_entropy_agg",
                                     "--agg-alpha", str(alpha), "--max-epoch", "1", "--save-dir", save,
                                     "--no-epoch-checkpoints"] + TINY_LM_ARGS + extra)
    log = proc.stdout + proc.stderr
    lines = [line for line in log.splitlines() if "AGG: operating point:" in line]
    assert len(lines) == 1, log[-3000:]
    updates = int(re.findall(r"num_updates[ =](\d+)", log)[-1])  # one epoch: all its updates
    assert updates == tokens // UPDATE_TOKENS
    below = alpha * tokens / 512 if mode == "relative" else alpha * updates
    share = below / updates
    found = re.search(r"rare below ([\d.e+]+) occurrences per epoch \(([\d,]+) target tokens in ([\d,]+) updates "
                      r"of about ([\d,]+)\); a type at that count is a target in at most ([\d.e+]+) %", lines[0])
    assert found, lines[0]
    assert float(found.group(1)) == pytest.approx(below, rel=5e-3)
    assert int(found.group(2).replace(",", "")) == tokens and int(found.group(3).replace(",", "")) == updates
    assert float(found.group(5)) == pytest.approx(100 * share, rel=5e-3)

    # analyze reads the same from the checkpoint's window: one epoch counted, so the same numbers,
    # and the rare set is every dictionary type counted fewer than `below` times in the epoch
    out = tmp_path / "report"
    assert fairseq_agg_cli.analyze_main([str(save / "checkpoint_last.pt"), "--data", data, "--out", str(out),
                                         "--no-ppl", "--no-figures", "--cpu"]) == 0
    agg = json.load(open(out / "report.json"))["checkpoints"][0]["agg"]
    assert agg["threshold_mode"] == mode and agg["window"] == agg["window_updates"] == agg["updates_per_epoch"] == updates
    assert agg["window_tokens"] == tokens
    assert agg["rare_below_per_epoch"] == pytest.approx(below) and agg["target_share"] == pytest.approx(share)
    dictionary = Dictionary.load(f"{data}/dict.txt")
    by_hand = sum(1 for i, word in enumerate(dictionary.symbols) if i >= dictionary.nspecial
                  and counts.get(word, 0) < below)
    assert agg["rare"] == by_hand and 0 < by_hand < len(dictionary)
    # its share of the analysed split's targets (--split valid: every word and each line's </s>)
    rare_words = {word for i, word in enumerate(dictionary.symbols) if i >= dictionary.nspecial
                  and counts.get(word, 0) < below}
    valid = [line.split() for line in open(os.path.join(os.path.dirname(data), "valid_source.txt"))]
    total = sum(len(words) + 1 for words in valid)
    assert agg["rare_target_share"] == pytest.approx(sum(w in rare_words for ws in valid for w in ws) / total)
    table = (out / "table.md").read_text()
    assert "| AGG rare below / epoch | AGG target share |" in table and "(`agg_target_share`)" in table


def test_the_papers_operating_point_is_alpha_times_its_updates_per_epoch():
    """The reference every run's operating-point line names (issue #57: the line said 110, docs/agg.md
    108): alpha 0.03 in the paper's WikiText-103 run, about 3,600 updates of 32,768 tokens per epoch,
    is rare below 0.03 x 3,600 = 108 counts per epoch, a target in 3 % of the updates, by either rule."""
    from fairseq_agg.ops import AggLoss
    from fairseq_agg.ops.agg_threshold import PAPER_OPERATING_POINT, operating_point

    assert PAPER_OPERATING_POINT.count_per_epoch == pytest.approx(108.0)
    assert PAPER_OPERATING_POINT.target_share == pytest.approx(0.03)
    assert operating_point(0.03, "per-update", 32768, 3600 * 32768, 3600).count_per_epoch == pytest.approx(108.0)
    line = AggLoss(10, alpha=0.03, window=5).describe_operating_point(1000.0, 10.0)
    assert line.endswith("(the paper's WikiText-103 LM: below about 108 per epoch, 3 % of the updates)"), line
