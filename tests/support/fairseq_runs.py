"""Helpers for end-to-end tests: tiny corpora (synthetic_text.py, beside this file) made into
data-bins and real fairseq command-line subprocesses. Not part of the installed package: the tests
import it as ``fairseq_runs`` through pytest's ``pythonpath`` (pyproject.toml: tests/support).
"""
import dataclasses
import hashlib
import json
import os
import subprocess
import sys

import pytest
from synthetic_text import markov_sentences, write_lines

# The plugin's --user-dir: the fairseq_agg_plugin package beside fairseq_agg, wherever it is installed.
from fairseq_agg import USER_DIR

BIN_DIR = os.path.dirname(sys.executable)


def parse_config(data, base_args, extra):
    """The fairseq-train configuration of ``fairseq-train DATA --user-dir ... BASE_ARGS EXTRA`` (an
    output-layer criterion eager unless the arguments name a kernel, as in :func:`run_cli`)."""
    from fairseq import options, utils
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, eager_unless_named("fairseq-train", [data, "--user-dir", USER_DIR]
                                                                  + base_args + extra))
    cfg = convert_namespace_to_omegaconf(args)
    utils.import_user_module(cfg.common)
    return cfg


def build_parts(data, base_args, extra, splits=("train", "valid")):
    """(cfg, task, model, criterion) as fairseq-train builds them, with ``splits`` loaded."""
    from fairseq import tasks, utils

    cfg = parse_config(data, base_args, extra)
    utils.set_torch_seed(cfg.common.seed)
    task = tasks.setup_task(cfg.task)
    for split in splits:
        task.load_dataset(split)
    model = task.build_model(cfg.model)
    criterion = task.build_criterion(cfg.criterion)
    return cfg, task, model, criterion


def criterion_from_flags(task, data, base_args, extra):
    """Another criterion for an already built task, from fairseq-train flags."""
    return task.build_criterion(parse_config(data, base_args, extra).criterion)


def non_pad_features(model, sample, pad):
    """The decoder features and targets of the non-padding positions, (N, d) and (N,)."""
    features = model(**sample["net_input"], features_only=True)[0]
    target = model.get_targets(sample, None).reshape(-1)
    keep = target.ne(pad)
    return features.reshape(-1, features.size(-1))[keep], target[keep]


def first_batch(task, split="train", max_tokens=512):
    """The first batch of ``split`` in fairseq's own (unshuffled) batching."""
    itr = task.get_batch_iterator(
        dataset=task.dataset(split), max_tokens=max_tokens, seed=1, epoch=1, num_workers=0
    ).next_epoch_itr(shuffle=False)
    return next(itr)


def padded_batch(task, split="train", size=12):
    """Up to ``size`` examples of different target lengths, collated by the dataset's own collater
    (so the batch has target padding)."""
    dataset = task.dataset(split)
    lengths = getattr(dataset, "tgt_sizes", None)  # translation; a language-model dataset has sizes
    if lengths is None:
        lengths = dataset.sizes
    by_length = {}
    for i in range(len(dataset)):
        by_length.setdefault(int(lengths[i]), i)
    return dataset.collater([dataset[i] for i in list(by_length.values())[:size]])


def fairseq_bin(name):
    path = os.path.join(BIN_DIR, name)
    if not os.path.exists(path):
        pytest.fail(f"{name} not found next to {sys.executable}; run scripts/run_tests.sh")
    return path


# The plugin's criteria with the fused output layer: under the default --output-kernel auto each
# fairseq-train process compiles the chunk body at its first forward (about 4 s with a warm Inductor
# cache, 12 s cold), and an in-process criterion each new plan of terms. A run or criterion that is
# not about the kernel runs it eager; the tests about the kernel, and one real run per criterion
# (tests/test_output_kernel_e2e.py, test_baselines_e2e.py, test_augmented_criterion.py), name
# --output-kernel themselves and keep it.
def takes_output_kernel(criterion: str) -> bool:
    """Whether the registered ``criterion`` has the fused output layer (its dataclass has
    ``--output-kernel``), read from fairseq's registry as fairseq-train would build it."""
    from fairseq.criterions import CRITERION_DATACLASS_REGISTRY

    config = CRITERION_DATACLASS_REGISTRY.get(criterion)
    return config is not None and any(f.name == "output_kernel" for f in dataclasses.fields(config))


def eager_unless_named(name, args):
    """``args`` of a ``fairseq-train`` run of an output-layer criterion with ``--output-kernel eager``
    added, unless they name a kernel; every other command's args as they are."""
    args = [str(a) for a in args]
    if name != "fairseq-train" or "--output-kernel" in args or "--criterion" not in args:
        return args
    if not takes_output_kernel(args[args.index("--criterion") + 1]):
        return args
    return args + ["--output-kernel", "eager"]


def run_cli(name, args, cwd=None, expect_ok=True, timeout=900):
    """Runs a fairseq (or plugin) console script; returns the CompletedProcess. A fairseq-train
    run of an output-layer criterion that names no --output-kernel runs it eager (above)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "2")
    env["PYTHONUNBUFFERED"] = "1"
    cmd = [fairseq_bin(name)] + eager_unless_named(name, args)
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if expect_ok and proc.returncode != 0:
        raise AssertionError(
            f"command failed ({proc.returncode}): {' '.join(cmd)}\n--- stdout ---\n{proc.stdout[-6000:]}"
            f"\n--- stderr ---\n{proc.stderr[-6000:]}"
        )
    return proc


def make_lm_data(root, n_train=1200, n_valid=120, n_test=120, seed=0):
    """Raw text + fairseq-preprocess --only-source; returns the data-bin directory."""
    raw = os.path.join(root, "lm_raw")
    os.makedirs(raw, exist_ok=True)
    sents = markov_sentences(n_train + n_valid + n_test, seed=seed)
    write_lines(os.path.join(raw, "train.txt"), sents[:n_train])
    write_lines(os.path.join(raw, "valid.txt"), sents[n_train : n_train + n_valid])
    write_lines(os.path.join(raw, "test.txt"), sents[n_train + n_valid :])
    dest = os.path.join(root, "lm_bin")
    run_cli(
        "fairseq-preprocess",
        ["--only-source", "--trainpref", f"{raw}/train.txt", "--validpref", f"{raw}/valid.txt",
         "--testpref", f"{raw}/test.txt", "--destdir", dest, "--workers", "1"],
    )
    return dest


def make_mt_data(root, n_train=1200, n_valid=100, n_test=100, seed=1):
    """En->De-shaped parallel data: the "German" side is a word-by-word mapping with a local swap.

    Preprocessed with a joined dictionary; returns the data-bin directory.
    """
    raw = os.path.join(root, "mt_raw")
    os.makedirs(raw, exist_ok=True)
    src = markov_sentences(n_train + n_valid + n_test, n_words=200, seed=seed, max_len=12, prefix="en")
    tgt = []
    for s in src:
        toks = ["de" + w[2:] for w in s.split()]
        if len(toks) >= 3:  # a deterministic local reordering, as German verb placement
            toks[1], toks[2] = toks[2], toks[1]
        tgt.append(" ".join(toks))
    splits = {"train": (0, n_train), "valid": (n_train, n_train + n_valid),
              "test": (n_train + n_valid, n_train + n_valid + n_test)}
    for split, (a, b) in splits.items():
        write_lines(os.path.join(raw, f"{split}.en"), src[a:b])
        write_lines(os.path.join(raw, f"{split}.de"), tgt[a:b])
    dest = os.path.join(root, "mt_bin")
    run_cli(
        "fairseq-preprocess",
        ["--source-lang", "en", "--target-lang", "de", "--trainpref", f"{raw}/train",
         "--validpref", f"{raw}/valid", "--testpref", f"{raw}/test", "--destdir", dest,
         "--joined-dictionary", "--workers", "1"],
    )
    return dest


# Small but real model settings shared by the end-to-end tests.
TINY_LM_ARGS = [
    "--task", "language_modeling", "--arch", "transformer_lm", "--decoder-layers", "2",
    "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64", "--decoder-attention-heads", "2",
    "--tokens-per-sample", "64", "--sample-break-mode", "none", "--max-tokens", "512",
    "--optimizer", "adam", "--lr", "0.005", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "10",
    "--dropout", "0.0", "--seed", "1", "--cpu", "--num-workers", "0", "--log-interval", "1",
    "--no-progress-bar", "--share-decoder-input-output-embed",
]

TINY_MT_ARGS = [
    "--task", "translation", "--source-lang", "en", "--target-lang", "de",
    "--arch", "transformer", "--encoder-layers", "1", "--decoder-layers", "1",
    "--encoder-embed-dim", "32", "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
    "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
    "--share-all-embeddings", "--max-tokens", "600", "--optimizer", "adam", "--lr", "0.005",
    "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "10", "--dropout", "0.0", "--seed", "1",
    "--cpu", "--num-workers", "0", "--log-interval", "1", "--no-progress-bar",
]

# AGG flags that gate in the first update of the tiny runs: alpha 2.5 per update makes tokens seen
# fewer than 3 times in that update rare (alpha > 1 needs the normalized g1 = a / alpha to keep
# every gate <= 1)
STRONG_GATING = ["--agg-alpha", "2.5", "--agg-threshold-mode", "per-update", "--agg-g1-mode", "normalized"]


def read_json_log(stdout_and_stderr):
    """Parses the records of a --log-format json run: returns a list of dicts (train_inner etc.)."""
    records = []
    for line in stdout_and_stderr.splitlines():
        start = line.find("{")
        if start < 0:
            continue
        try:
            rec = json.loads(line[start:])
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            records.append(rec)
    return records


def file_digests(directory):
    """Every file of ``directory`` with its sha256: what a refused command must leave as it was."""
    found = {}
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            found[name] = hashlib.sha256(f.read()).hexdigest()
    return found
