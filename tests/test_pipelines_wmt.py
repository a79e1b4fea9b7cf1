"""examples/wmt14_en_de end to end on small fixtures in the real WMT raw formats.

prepare.sh --raw-dir reads extracted Europarl / Common Crawl / News Commentary plain-text pairs
and newstest2013/2014 as `sacrebleu --echo` prints them; train.sh trains a tiny model through
real fairseq-train; evaluate.sh averages its checkpoints, runs fairseq-generate and scores with
sacrebleu and fairseq-score (the community recipe's compound-split BLEU, checked against perl).
"""
import argparse
import os
import random
import re
import shutil
import subprocess
import sys

import pytest
import torch

from examples import textprep
import fairseq_runs


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
        "training/news-commentary-v9.de-en": parallel_pairs(100, 3),  # the default, the AGG paper's
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
    proc = run_script(recipe("prepare.sh"), ["--raw-dir", tmp_path, "--news-commentary", "v10"], expect_ok=False)
    assert proc.returncode == 2 and "--news-commentary must be v9 or v12, got 'v10'" in proc.stderr


def test_prepare_defaults_are_the_papers(recipe):
    """The AGG paper's data: fairseq's prepare-wmt14en2de.sh --icml17 (News Commentary v9, WMT14's
    own) with a joint BPE of 37,000 (its copy of that script)."""
    text = run_script(recipe("prepare.sh"), ["--help"]).stdout
    assert "(37000, the AGG paper's" in text and "default (v9)" in text


def test_train_sh_methods_and_hyperparameters(recipe):
    env = _env()
    env["DRY_RUN"] = "1"
    proc = run_script(recipe("train.sh"), ["agg", "big", "--", "--max-update", "7"], env=env)
    agg = proc.stdout
    for flag in ["--criterion cross_entropy_agg", "--label-smoothing 0.1", "--agg-alpha 0.08",
                 "--arch transformer_wmt_en_de_big", "--share-all-embeddings", "--lr 1e-3",
                 "--warmup-updates 4000", "--warmup-init-lr 1e-07", "--weight-decay 0.01", "--dropout 0.3",
                 "--max-tokens 8192 --update-freq 8 --distributed-world-size 1", "--save-interval-updates 2000",
                 "--keep-interval-updates 10", "--keep-last-epochs 10", "--stop-min-lr 1e-09"]:
        assert flag in agg, flag
    # fairseq flags after -- come last, so that they win over the recipe's values
    assert agg.rstrip().endswith("--max-update 7")
    assert "--fp16" in agg  # a dry run prints the recipe's precision, for the machine it is meant for
    assert "tokens per update = GPUs x --max-tokens x --update-freq = 1 x 8192 x 8 = 65536" in proc.stderr
    base = run_script(recipe("train.sh"), ["baseline"], env=env).stdout
    assert "--criterion label_smoothed_cross_entropy " in base and "--arch transformer_wmt_en_de " in base
    mlra = run_script(recipe("train.sh"), ["agg+mlra", "big"], env=env).stdout
    # transformer_wmt_en_de_big, the paper's big model, is the Vaswani big model with attention dropout 0.1
    from fairseq.models import ARCH_CONFIG_REGISTRY

    papers, vaswani = argparse.Namespace(), argparse.Namespace()
    ARCH_CONFIG_REGISTRY["transformer_wmt_en_de_big"](papers)
    ARCH_CONFIG_REGISTRY["transformer_vaswani_wmt_en_de_big"](vaswani)
    assert (papers.attention_dropout, vaswani.attention_dropout) == (0.1, 0.0)
    assert {k: v for k, v in vars(papers).items() if k != "attention_dropout"} == \
        {k: v for k, v in vars(vaswani).items() if k != "attention_dropout"}
    # the MLRA twin of the big model, with the attention dropout that transformer_wmt_en_de_big adds
    assert "--arch transformer_mlra_vaswani_wmt_en_de_big --attention-dropout 0.1 " in mlra
    assert "cross_entropy_agg" in mlra
    keep_all = run_script(recipe("train.sh"), ["agg", "--keep-last-epochs", "0"], env=env).stdout
    assert "--keep-last-epochs" not in keep_all
    bad = run_script(recipe("train.sh"), ["agg", "huge"], env=env, expect_ok=False)
    assert bad.returncode == 2 and "base or big" in bad.stderr and "'huge'" in bad.stderr
    bad = run_script(recipe("train.sh"), ["agg", "--keep-last-epochs", "-1"], env=env, expect_ok=False)
    assert bad.returncode == 2 and "--keep-last-epochs must be an integer >= 0" in bad.stderr


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
    proc = run_script(recipe("train.sh"), ["baseline", "base", "--"] + TINY, env=env)
    return {"save": save, "log": proc.stdout + proc.stderr}


def test_train_sh_trains_on_prepared_data(wmt_trained):
    for e in range(1, 7):  # the default --keep-last-epochs 10 keeps all six
        assert os.path.isfile(os.path.join(wmt_trained["save"], f"checkpoint{e}.pt"))
    assert "tokens per update = GPUs x --max-tokens x --update-freq = 1 x 800 x 1 = 800" in wmt_trained["log"]
    recs = [line for line in wmt_trained["log"].splitlines() if "| valid |" in line or "valid on 'valid'" in line]
    assert recs, wmt_trained["log"][-2000:]


def test_average_checkpoints_is_elementwise_mean(wmt_trained, tmp_path):
    from fairseq import checkpoint_utils

    import fairseq_agg_cli
    from fairseq_agg.tools import average_checkpoints

    out = str(tmp_path / "avg.pt")
    assert fairseq_agg_cli.run_command("average-checkpoints", ["--inputs", wmt_trained["save"], "--num-epoch-checkpoints", "2",
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
        fairseq_agg_cli.run_command("average-checkpoints", ["--inputs", wmt_trained["save"], "--num-epoch-checkpoints", "9", "--output", out])


def _lines(path):
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def test_evaluate_sh_defaults_label_every_bleu(wmt_prep, wmt_trained, recipe, repo_root):
    import sacrebleu
    import sentencepiece as spm

    out = os.path.join(wmt_prep["root"], "eval")
    # evaluate.sh's defaults after train.sh's default run: the last 5 of the 6 epoch checkpoints
    proc = run_script(recipe("evaluate.sh"),
                      ["--checkpoints", wmt_trained["save"], "--prep", wmt_prep["out"], "--out", out,
                       "--", "--cpu", "--max-len-a", "1.2", "--max-len-b", "10"])
    text = proc.stdout
    assert "[evaluate] averaging the last 5 epoch checkpoints" in text, text
    # every line that mentions BLEU says which BLEU it is; fairseq-generate's own is not printed
    bleu_lines = [line for line in text.splitlines()
                  if "BLEU" in line and not line.startswith(("[evaluate]", "chrF (detokenized sacreBLEU): chrF2|"))]
    assert len(bleu_lines) == 2 and all(line.startswith("BLEU (") for line in bleu_lines), text
    assert "Generate" not in text
    m = re.search(r"^BLEU \(detokenized sacreBLEU, headline\): BLEU\|nrefs:1\|case:mixed\|eff:no\|tok:13a\|"
                  r"smooth:exp\|version:[\d.]+ = ([\d.]+) ", text, re.M)
    assert m, text
    assert re.search(r"^chrF \(detokenized sacreBLEU\): chrF2\|nrefs:1\|.*= [\d.]+", text, re.M), text
    tok = re.search(r"^BLEU \(tokenized, compound-split, community recipe; fairseq-score\): BLEU4 = ([\d.]+), ",
                    text, re.M)
    assert tok, text
    assert _lines(os.path.join(out, "scores.txt")) == [line for line in text.splitlines()
                                                      if line.startswith(("BLEU (", "chrF ("))]

    hyps = _lines(os.path.join(out, "hyp.txt"))
    refs = _lines(os.path.join(wmt_prep["out"], "raw", "test.de"))
    assert len(hyps) == len(refs) == 50
    # the headline is sacreBLEU on these hypotheses against the raw references, in order
    assert float(m.group(1)) == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score, abs=0.01)
    # the tokenized number is unsmoothed corpus BLEU-4 on the compound-split tokens
    hyp_tok, ref_tok = _lines(os.path.join(out, "hyp.tok")), _lines(os.path.join(out, "ref.tok"))
    expected = sacrebleu.corpus_bleu(hyp_tok, [ref_tok], tokenize="none", smooth_method="none", force=True)
    assert float(tok.group(1)) == pytest.approx(expected.score, abs=0.01)
    # and so are its n-gram precisions and lengths (telling apart a zero BLEU from a broken one)
    stats = re.search(r"BLEU4 = [\d.]+, ([\d./]+) \(BP=[\d.]+, ratio=[\d.]+, syslen=(\d+), reflen=(\d+)\)", text)
    assert [float(p) for p in stats.group(1).split("/")] == pytest.approx(expected.precisions, abs=0.06)
    assert (int(stats.group(2)), int(stats.group(3))) == (expected.sys_len, expected.ref_len)
    assert expected.precisions[0] > 0
    n_hyphen = sum(r.count("-") for r in refs)
    assert n_hyphen > 0 and sum(r.count("##AT##-##AT##") for r in ref_tok) == n_hyphen

    # --post-process sentencepiece gives the text that decoding the pieces with spm.model gives
    plain = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "fairseq-generate"), os.path.join(wmt_prep["out"], "data-bin"),
         "--user-dir", os.path.join(repo_root, "fairseq_agg_plugin"),
         "--task", "translation", "--source-lang", "en", "--target-lang", "de",
         "--path", os.path.join(out, "averaged.pt"), "--gen-subset", "test", "--beam", "4", "--lenpen", "0.6",
         "--batch-size", "100", "--required-batch-size-multiple", "1", "--cpu", "--max-len-a", "1.2",
         "--max-len-b", "10"], capture_output=True, text=True, env=_env(), check=True).stdout
    gen = os.path.join(out, "plain.out")
    with open(gen, "w", encoding="utf-8") as f:
        f.write(plain)
    sp = spm.SentencePieceProcessor(model_file=os.path.join(wmt_prep["out"], "spm.model"))
    pieces = textprep.read_generate(gen, "H")
    assert any("\u2581" in p for p in pieces)  # they really are pieces
    assert [sp.decode_pieces(p.split()) for p in pieces] == hyps


def _ckpt_dir(tmp_path, save, names):
    d = tmp_path / "ckpts"
    d.mkdir()
    for src, dst in names:
        os.link(os.path.join(save, src), d / dst)
    return str(d)


@pytest.mark.parametrize("layout, notice", [
    # one epoch into a run: today's "only 1 epoch checkpoints" failure
    ([("checkpoint1.pt", "checkpoint1.pt"), ("checkpoint1.pt", "checkpoint_best.pt"),
      ("checkpoint1.pt", "checkpoint_last.pt")],
     "[evaluate] only 1 epoch checkpoint(s) in {d} (fewer than --num-checkpoints 5): averaging those"),
    # no numbered checkpoints at all (--no-epoch-checkpoints)
    ([("checkpoint6.pt", "checkpoint_best.pt"), ("checkpoint5.pt", "checkpoint_last.pt")],
     "[evaluate] no numbered checkpoints in {d}: using {d}/checkpoint_best.pt unaveraged"),
])
def test_evaluate_sh_default_falls_back(wmt_prep, wmt_trained, recipe, tmp_path, layout, notice):
    d = _ckpt_dir(tmp_path, wmt_trained["save"], layout)
    # DATA_BIN gives the data; --prep (here without a data-bin) the references
    prep = tmp_path / "prep_without_data"
    prep.mkdir()
    os.symlink(os.path.join(wmt_prep["out"], "raw"), prep / "raw")
    env = _env()
    env["DATA_BIN"] = os.path.join(wmt_prep["out"], "data-bin")
    proc = run_script(recipe("evaluate.sh"), ["--checkpoints", d, "--prep", prep, "--subset", "valid",
                                              "--", "--cpu", "--max-len-a", "1.2", "--max-len-b", "10"], env=env)
    assert notice.format(d=d) in proc.stdout.splitlines(), proc.stdout
    assert re.search(r"^BLEU \(detokenized sacreBLEU, headline\): BLEU\|", proc.stdout, re.M)
    assert len(_lines(os.path.join(d, "eval-valid", "hyp.txt"))) == 40
    assert os.path.isfile(os.path.join(d, "eval-valid", "averaged.pt")) == ("only 1" in notice)


def test_evaluate_sh_explicit_kind_needs_enough_checkpoints(wmt_prep, wmt_trained, recipe, tmp_path):
    out = tmp_path / "e"
    for args, msg in (
            (["--kind", "epoch", "--num-checkpoints", "9"], "--num-checkpoints 9: only 6 epoch checkpoints"),
            (["--kind", "epoch", "--upper-bound", "3", "--num-checkpoints", "4"],
             "--num-checkpoints 4: only 3 epoch checkpoints"),
            (["--kind", "update"], "--num-checkpoints 5: only 0 update checkpoints"),
            (["--kind", "last"], "--kind must be auto, epoch or update")):
        bad = run_script(recipe("evaluate.sh"), ["--checkpoints", wmt_trained["save"], "--prep", wmt_prep["out"],
                                                 "--out", out] + args, expect_ok=False)
        assert bad.returncode == 2 and msg in bad.stderr, (args, bad.stderr)
        assert not out.exists()  # refused before anything is written


# ---------------------------------------------------------------- the compound-split BLEU


def _perl_split(lines):
    """The community recipe's own substitution, run by perl on the UTF-8 bytes."""
    proc = subprocess.run(["perl", "-ple", r"s{(\S)-(\S)}{$1 ##AT##-##AT## $2}g"],
                          input="".join(line + "\n" for line in lines).encode("utf-8"),
                          capture_output=True, check=True)
    return proc.stdout.decode("utf-8").split("\n")[:-1]


needs_perl = pytest.mark.skipif(shutil.which("perl") is None, reason="perl is not installed")


@needs_perl
def test_compound_split_is_the_community_recipe(tmp_path):
    from sacremoses import MosesTokenizer

    tok = MosesTokenizer(lang="de")
    # by hand: Moses -l de keeps "2014-15" and "A-B-C-Waffen" whole (no aggressive hyphen
    # splitting) and splits the final period; perl's s///g then matches left to right without
    # overlap, so in "A-B-C-Waffen" the "B" of the first match cannot start a second one
    cases = {
        "ab 2014-15.": "ab 2014 ##AT##-##AT## 15 .",
        "A-B-C-Waffen": "A ##AT##-##AT## B-C ##AT##-##AT## Waffen",
        "Das Bundes-Innenministerium sagt: nein.": "Das Bundes ##AT##-##AT## Innenministerium sagt : nein .",
        'Er sagt "Top-Down" & geht.': "Er sagt &quot; Top ##AT##-##AT## Down &quot; &amp; geht .",
    }
    moses = [tok.tokenize(line, return_str=True) for line in cases]
    assert moses[:2] == ["ab 2014-15 .", "A-B-C-Waffen"]
    assert _perl_split(moses) == list(cases.values())
    assert [textprep.compound_split_line(tok, line) for line in cases] == list(cases.values())
    # the whole command, as evaluate.sh runs it
    src, dst = tmp_path / "in.txt", tmp_path / "out.txt"
    src.write_text("".join(line + "\n" for line in cases), encoding="utf-8")
    subprocess.run([sys.executable, textprep.__file__, "compound-split", "--lang", "de", "--input", str(src),
                    "--output", str(dst)], check=True)
    assert _lines(dst) == list(cases.values())


@needs_perl
def test_split_compounds_matches_perl_on_bytes():
    # perl -ple reads bytes: \S is any byte but ASCII whitespace, so a no-break space or a
    # multi-byte letter next to a hyphen is "non-space" to it, and a multi-byte character between
    # two hyphens is two or more "characters", one for each match
    lines = ["a-b-c-d-e", "x--y", "-a b- c-", "ü-ö 3-4-5", "x\u00a0-y", "a -b- c", "\t-\t", "a\u2009-\u2009b",
             "##AT##-##AT##", "Ost-West-Konflikt-Forschung e.V.-Mitglied", "TNF-α-Blocker", "x-é-y",
             "a-€-b-😀-c", "é-é-é", "x-\u00a0-y", "-é-"]
    assert [textprep.split_compounds(line) for line in lines] == _perl_split(lines)
    assert textprep.split_compounds("x\u00a0-y") == "x\u00a0 ##AT##-##AT## y"
    # by hand: on characters, the first match would take the "α" and leave "α-Blocker" whole
    assert textprep.split_compounds("TNF-α-Blocker") == "TNF ##AT##-##AT## α ##AT##-##AT## Blocker"
    assert textprep.split_compounds("x-é-y") == "x ##AT##-##AT## é ##AT##-##AT## y"
