"""Fine-tuning a pretrained fairseq model with cross_entropy_agg (issue #56, item 2): the AGG
window starts empty, and says so in one log line, even where the pretraining ran the plugin and its
checkpoint holds counts.

A tiny Transformer is pretrained 3 updates with ``cross_entropy_agg``; it is fine-tuned 2 updates
on 8 other sentence pairs (one epoch of 2 batches), through ``--restore-file`` with
``--reset-optimizer --reset-dataloader --reset-meters`` and through ``--finetune-from-model``. The
fine-tuned run's window counts equal a hand count of the fine-tuning targets only. A tiny BART
(``--arch bart_base`` at the tiny sizes) is fine-tuned the way fairseq's BART recipes fine-tune one
(``--task translation --restore-file ... --reset-*``); fairseq 0.12.3.1's own
``translation_from_pretrained_bart`` task fails for every criterion (docs/usage.md).
"""
import os

import pytest
import torch

from fairseq_runs import TINY_MT_ARGS, USER_DIR, run_cli
from synthetic_text import write_lines

AGG = ["--criterion", "cross_entropy_agg", "--agg-window", "4"]


def criterion_state(save_dir):
    return torch.load(os.path.join(save_dir, "checkpoint_last.pt"), map_location="cpu", weights_only=False)["criterion"]


def model_args(arch):
    """The tiny translation model's flags with its architecture ``arch``."""
    args = list(TINY_MT_ARGS)
    args[args.index("--arch") + 1] = arch
    return args


def pretrain(mt_data_bin, root, arch):
    """A checkpoint of ``arch`` pretrained 3 updates by cross_entropy_agg, whose window holds counts."""
    run_cli("fairseq-train", [mt_data_bin, "--user-dir", USER_DIR] + model_args(arch) + AGG + [
        "--max-update", "3", "--save-dir", f"{root}/pre-{arch}", "--no-epoch-checkpoints"])
    assert criterion_state(f"{root}/pre-{arch}")["window.counts"].sum() > 0  # the pretraining's counts are there
    return f"{root}/pre-{arch}/checkpoint_last.pt"


@pytest.fixture(scope="module")
def pretrained(mt_data_bin, tmp_path_factory):
    """({arch: its pretraining's checkpoint}; the fine-tuning data-bin, in the pretraining's
    dictionary; the hand count of its training targets)."""
    root = str(tmp_path_factory.mktemp("fine_tuning"))
    checkpoints = {arch: pretrain(mt_data_bin, root, arch) for arch in ("transformer", "bart_base")}

    raw = os.path.join(os.path.dirname(mt_data_bin), "mt_raw")  # the fixture's test split: unseen pairs
    lines = {lang: open(f"{raw}/test.{lang}", encoding="utf-8").read().splitlines()[:12] for lang in ("en", "de")}
    os.makedirs(f"{root}/ft_raw")
    for lang, text in lines.items():
        write_lines(f"{root}/ft_raw/train.{lang}", text[:8])
        write_lines(f"{root}/ft_raw/valid.{lang}", text[8:])
    run_cli("fairseq-preprocess", ["--source-lang", "en", "--target-lang", "de", "--trainpref", f"{root}/ft_raw/train",
                                   "--validpref", f"{root}/ft_raw/valid", "--destdir", f"{root}/ft_bin", "--workers",
                                   "1", "--srcdict", f"{mt_data_bin}/dict.en.txt", "--tgtdict",
                                   f"{mt_data_bin}/dict.de.txt"])
    from fairseq.data import Dictionary

    dictionary = Dictionary.load(f"{mt_data_bin}/dict.de.txt")
    expected = torch.zeros(len(dictionary), dtype=torch.int64)
    for line in lines["de"][:8]:  # every target word, then the end of sentence
        for word in line.split() + [dictionary.eos_word]:
            expected[dictionary.index(word)] += 1
    return checkpoints, f"{root}/ft_bin", expected


@pytest.mark.parametrize("arch, how", [("transformer", "restore_file"), ("transformer", "finetune_from_model"),
                                       ("bart_base", "restore_file")])
def test_the_window_starts_fresh_when_fine_tuning(pretrained, tmp_path, arch, how):
    checkpoints, data, expected = pretrained
    checkpoint = checkpoints[arch]
    source = (["--restore-file", checkpoint, "--reset-optimizer", "--reset-dataloader", "--reset-meters"]
              if how == "restore_file" else ["--finetune-from-model", checkpoint])
    proc = run_cli("fairseq-train", [data, "--user-dir", USER_DIR] + model_args(arch) + AGG + source + [
        "--batch-size", "4", "--required-batch-size-multiple", "1", "--max-update", "2", "--save-dir", str(tmp_path),
        "--no-epoch-checkpoints"])
    log = proc.stdout + proc.stderr
    said = [line for line in log.splitlines() if "cross_entropy_agg: fine-tuning" in line]
    reason = "--reset-optimizer and --reset-dataloader" if how == "restore_file" else "--finetune-from-model"
    assert len(said) == 1 and f"fine-tuning ({reason}): the counts start empty" in said[0], log[-3000:]
    assert "num_updates 2" in log
    counts = criterion_state(tmp_path)["window.counts"]
    assert counts.sum() == expected.sum() > 0
    assert torch.equal(counts, expected)
