"""examples/wmt14_en_de end to end on small fixtures in the real WMT raw formats.

prepare.sh --raw-dir reads extracted Europarl / Common Crawl / News Commentary plain-text pairs
and newstest2013/2014 as `sacrebleu --echo` prints them; train.sh trains a tiny model through
real fairseq-train; evaluate.sh averages its checkpoints, runs fairseq-generate and scores with
sacrebleu and fairseq-score.
"""
import argparse
import os
import random
import re
import subprocess
import sys

import pytest
import torch

from examples import textprep
from fairseq_agg.testing import fairseq_runs


@pytest.fixture(scope="session")
def recipe(repo_root):
    """The path of a script of the WMT14 recipe: recipe("prepare.sh")."""
    return lambda name: os.path.join(repo_root, "examples", "wmt14_en_de", name)


def _env():
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "2"
    env["PYTHON"] = sys.executable
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_script(script, args, env=None, expect_ok=True, timeout=900):
    proc = subprocess.run(["bash", script] + [str(a) for a in args], capture_output=True, text=True,
                          env=env or _env(), timeout=timeout)
    if expect_ok and proc.returncode != 0:
        raise AssertionError(f"{script} failed ({proc.returncode})\n--- stdout ---\n{proc.stdout[-5000:]}"
                             f"\n--- stderr ---\n{proc.stderr[-5000:]}")
    return proc


def parallel_pairs(n, seed):
    """English-like / German-like pairs: a word map, a local reordering, hyphenated compounds."""
    src = fairseq_runs.markov_sentences(n, n_words=150, seed=seed, max_len=12, prefix="en")
    rng = random.Random(seed)
    pairs = []
    for s in src:
        words = s.split()
        de = ["de" + w[2:] for w in words]
        if len(de) >= 3:
            de[1], de[2] = de[2], de[1]
        if len(de) >= 4 and rng.random() < 0.3:  # German compound written with a hyphen
            de[2:4] = [de[2] + "-" + de[3]]
        en_text = " ".join(words).capitalize() + "."
        de_text = " ".join(de).capitalize() + "."
        pairs.append((en_text, de_text))
    return pairs


N_BAD = 3  # pairs the cleaning step must drop


def write_wmt_raw(raw):
    """The WMT14 files as they are after extracting the archives (plus sacrebleu --echo test sets)."""
    corpora = {
        "training/europarl-v7.de-en": parallel_pairs(250, 1),
        "commoncrawl.de-en": parallel_pairs(150, 2),
        "training/news-commentary-v12.de-en": parallel_pairs(100, 3),
    }
    # Common Crawl style noise: a length-ratio outlier, an over-long pair, Windows line ends.
    corpora["commoncrawl.de-en"] += [
        ("Yes.", "Ja ja ja ja ja ja ja ja ja ja ja ja."),
        (" ".join(["en1"] * 300), " ".join(["de1"] * 300)),
        ("Click here.", " ".join(["de2 de3 de4 de5"] * 5)),
    ]
    for name, pairs in corpora.items():
        path = os.path.join(raw, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".en", "w", encoding="utf-8", newline="") as fe, \
                open(path + ".de", "w", encoding="utf-8", newline="") as fd:
            for i, (e, d) in enumerate(pairs):
                end = "\r\n" if name.startswith("commoncrawl") and i % 7 == 0 else "\n"
                fe.write(e + end)
                fd.write(d + end)
    for name, seed, n in (("newstest2013", 4, 40), ("newstest2014", 5, 50)):
        pairs = parallel_pairs(n, seed)
        fairseq_runs.write_lines(os.path.join(raw, name + ".en"), [p[0] for p in pairs])
        fairseq_runs.write_lines(os.path.join(raw, name + ".de"), [p[1] for p in pairs])
    return sum(len(p) for p in corpora.values())


@pytest.fixture(scope="module")
def wmt_prep(tmp_path_factory, recipe):
    root = tmp_path_factory.mktemp("wmt")
    raw = str(root / "raw")
    n_pairs = write_wmt_raw(raw)
    out = str(root / "prep")
    proc = run_script(recipe("prepare.sh"),
                      ["--raw-dir", raw, "--out", out, "--vocab-size", "300", "--workers", "1"])
    return {"root": str(root), "raw": raw, "out": out, "n_pairs": n_pairs, "log": proc.stdout + proc.stderr}


def _dataset_len(data_bin, split, lang, dictionary):
    from fairseq.data import data_utils

    ds = data_utils.load_indexed_dataset(os.path.join(data_bin, f"{split}.en-de.{lang}"), dictionary)
    return len(ds), ds


def test_prepare_writes_joined_data_bin(wmt_prep):
    from fairseq.data import Dictionary

    data_bin = os.path.join(wmt_prep["out"], "data-bin")
    with open(os.path.join(data_bin, "dict.en.txt")) as a, open(os.path.join(data_bin, "dict.de.txt")) as b:
        assert a.read() == b.read(), "--joined-dictionary must give one vocabulary"
    d = Dictionary.load(os.path.join(data_bin, "dict.de.txt"))
    n_train, _ = _dataset_len(data_bin, "train", "de", d)
    assert n_train == wmt_prep["n_pairs"] - N_BAD  # exactly the three bad pairs dropped
    n_valid, _ = _dataset_len(data_bin, "valid", "en", d)
    n_test, test_de = _dataset_len(data_bin, "test", "de", d)
    assert (n_valid, n_test) == (40, 50)  # valid/test are never cleaned
    # the references are kept untouched for sacrebleu and round-trip through the pieces
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=os.path.join(wmt_prep["out"], "spm.model"))
    with open(os.path.join(wmt_prep["raw"], "newstest2014.de"), encoding="utf-8") as f:
        refs = [line.rstrip("\n") for line in f]
    with open(os.path.join(wmt_prep["out"], "raw", "test.de"), encoding="utf-8") as f:
        assert [line.rstrip("\n") for line in f] == refs
    first = d.string(test_de[0][:-1])  # drop eos
    assert sp.decode_pieces(first.split()) == refs[0]
    assert "\r" not in open(os.path.join(data_bin, "dict.en.txt"), encoding="utf-8").read()


def test_prepare_reports_missing_raw_file(tmp_path, recipe):
    raw = tmp_path / "raw"
    write_wmt_raw(str(raw))
    os.remove(raw / "newstest2014.de")
    proc = run_script(recipe("prepare.sh"), ["--raw-dir", raw, "--out", tmp_path / "o"], expect_ok=False)
    assert proc.returncode == 2
    assert "--raw-dir" in proc.stderr and "newstest2014.de" in proc.stderr
    assert not (tmp_path / "o" / "data-bin").exists()


def test_prepare_rejects_bad_vocab_size(tmp_path, recipe):
    proc = run_script(recipe("prepare.sh"), ["--raw-dir", tmp_path, "--vocab-size", "5"], expect_ok=False)
    assert proc.returncode == 2 and "--vocab-size" in proc.stderr and ">= 100" in proc.stderr


def test_train_sh_methods_and_hyperparameters(recipe):
    env = _env()
    env["DRY_RUN"] = "1"
    agg = run_script(recipe("train.sh"), ["agg", "big", "--max-update", "7"], env=env).stdout
    for flag in ["--criterion cross_entropy_agg", "--label-smoothing 0.1", "--agg-alpha 0.08",
                 "--arch transformer_vaswani_wmt_en_de_big", "--share-all-embeddings", "--lr 1e-3",
                 "--warmup-updates 4000", "--warmup-init-lr 1e-07", "--weight-decay 0.01", "--dropout 0.3",
                 "--max-tokens 8192", "--update-freq 8", "--save-interval-updates 2000",
                 "--keep-interval-updates 10", "--stop-min-lr 1e-09"]:
        assert flag in agg, flag
    # extra flags come last so that they win over the recipe's values
    assert agg.rstrip().endswith("--max-update 7")
    assert ("--fp16" in agg) == torch.cuda.is_available()
    base = run_script(recipe("train.sh"), ["baseline"], env=env).stdout
    assert "--criterion label_smoothed_cross_entropy " in base and "--arch transformer_wmt_en_de " in base
    mlra = run_script(recipe("train.sh"), ["agg+mlra", "big"], env=env).stdout
    assert "--arch transformer_mlra_vaswani_wmt_en_de_big" in mlra and "cross_entropy_agg" in mlra
    bad = run_script(recipe("train.sh"), ["sgd"], env=env, expect_ok=False)
    assert bad.returncode == 2 and "METHOD must be one of" in bad.stderr and "agg+mlra" in bad.stderr


TINY = ["--arch", "transformer", "--encoder-layers", "1", "--decoder-layers", "1",
        "--encoder-embed-dim", "32", "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
        "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
        "--update-freq", "1", "--max-tokens", "800", "--lr", "0.01", "--warmup-updates", "10",
        "--warmup-init-lr", "1e-4", "--dropout", "0.1", "--max-epoch", "6", "--cpu", "--num-workers", "0",
        "--log-interval", "5", "--no-progress-bar"]


@pytest.fixture(scope="module")
def wmt_trained(wmt_prep, recipe):
    save = os.path.join(wmt_prep["root"], "ckpt")
    env = _env()
    env["DATA_BIN"] = os.path.join(wmt_prep["out"], "data-bin")
    env["SAVE_DIR"] = save
    proc = run_script(recipe("train.sh"), ["baseline", "base"] + TINY, env=env)
    return {"save": save, "log": proc.stdout + proc.stderr}


def test_train_sh_trains_on_prepared_data(wmt_trained):
    for e in range(1, 7):
        assert os.path.isfile(os.path.join(wmt_trained["save"], f"checkpoint{e}.pt"))
    recs = [line for line in wmt_trained["log"].splitlines() if "| valid |" in line or "valid on 'valid'" in line]
    assert recs, wmt_trained["log"][-2000:]


def test_average_checkpoints_is_elementwise_mean(wmt_trained, tmp_path):
    from fairseq import checkpoint_utils
    from fairseq_agg.tools import average_checkpoints

    out = str(tmp_path / "avg.pt")
    assert average_checkpoints.main(["--inputs", wmt_trained["save"], "--num-epoch-checkpoints", "2",
                                     "--output", out]) == 0
    torch.serialization.add_safe_globals([argparse.Namespace])
    newest = checkpoint_utils.load_checkpoint_to_cpu(os.path.join(wmt_trained["save"], "checkpoint6.pt"))
    s2 = checkpoint_utils.load_checkpoint_to_cpu(os.path.join(wmt_trained["save"], "checkpoint5.pt"))["model"]
    s3 = newest["model"]
    avg = torch.load(out, map_location="cpu", weights_only=False)
    assert "last_optimizer_state" not in avg
    # the newest checkpoint supplies everything except the weights
    assert avg["optimizer_history"][-1]["num_updates"] == newest["optimizer_history"][-1]["num_updates"]
    key = "encoder.layers.0.fc1.weight"
    assert not torch.equal(s2[key], s3[key])
    for k in s3:
        if s3[k].is_floating_point():
            torch.testing.assert_close(avg["model"][k], (s2[k].double() + s3[k].double()).div(2).float(),
                                       rtol=0, atol=1e-7)
    # upper bound: the two newest epochs at or below 2 are epochs 1 and 2
    paths = average_checkpoints.find_checkpoints(wmt_trained["save"], 2, "epoch", upper_bound=2)
    assert [os.path.basename(p) for p in paths] == ["checkpoint2.pt", "checkpoint1.pt"]
    with pytest.raises(SystemExit):
        average_checkpoints.main(["--inputs", wmt_trained["save"], "--num-epoch-checkpoints", "9", "--output", out])


def test_evaluate_sh_prints_sacrebleu_signature_and_tokenized_bleu(wmt_prep, wmt_trained, recipe):
    import sacrebleu

    out = os.path.join(wmt_prep["root"], "eval")
    proc = run_script(recipe("evaluate.sh"),
                      ["--checkpoints", wmt_trained["save"], "--prep", wmt_prep["out"], "--num-checkpoints", "2",
                       "--out", out, "--", "--cpu", "--max-len-a", "1.2", "--max-len-b", "10"])
    text = proc.stdout
    m = re.search(r"^\s*BLEU\|nrefs:1\|case:mixed\|eff:no\|tok:13a\|smooth:exp\|version:[\d.]+ = ([\d.]+) ", text, re.M)
    assert m, text
    assert re.search(r"^\s*chrF2\|nrefs:1\|.*= [\d.]+", text, re.M), text
    with open(os.path.join(out, "hyp.txt"), encoding="utf-8") as f:
        hyps = [line.rstrip("\n") for line in f]
    with open(os.path.join(wmt_prep["out"], "raw", "test.de"), encoding="utf-8") as f:
        refs = [line.rstrip("\n") for line in f]
    assert len(hyps) == len(refs) == 50
    # detokenised: sentencepiece's word-boundary marks are gone
    assert not any("\u2581" in h for h in hyps)
    # the printed number is sacrebleu on these hypotheses against the raw references, in order
    assert float(m.group(1)) == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score, abs=0.01)
    tok = re.search(r"^BLEU4 = ([\d.]+), ", text, re.M)
    assert tok, text
    assert 0.0 <= float(tok.group(1)) <= 100.0
    with open(os.path.join(out, "ref.tok"), encoding="utf-8") as f:
        ref_tok = f.read()
    n_hyphen = sum(r.count("-") for r in refs)
    assert n_hyphen > 0 and ref_tok.count("##AT##-##AT##") == n_hyphen


def test_compound_split_line():
    from sacremoses import MosesTokenizer

    tok = MosesTokenizer(lang="de")
    assert textprep.compound_split_line(tok, "Das Bundes-Innenministerium sagt: nein.", "de") == \
        "Das Bundes ##AT##-##AT## Innenministerium sagt : nein ."
