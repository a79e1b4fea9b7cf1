"""examples/wikitext103 end to end on small files in the raw WikiText-103 token format
(` = Title = ` headings, blank lines, `@-@` / `@,@` / `@.@` escapes, `<unk>`)."""
import json
import os
import random
import re
import subprocess
import sys

import pytest

from examples import textprep
from fairseq_agg.testing import fairseq_runs


@pytest.fixture(scope="session")
def recipe(repo_root):
    """The path of a script of the WikiText-103 recipe: recipe("prepare.sh")."""
    return lambda name: os.path.join(repo_root, "examples", "wikitext103", name)


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHON=sys.executable, PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def run_script(script, args, env=None, expect_ok=True):
    proc = subprocess.run(["bash", script] + [str(a) for a in args], capture_output=True, text=True,
                          env=env or _env(), timeout=900)
    if expect_ok and proc.returncode != 0:
        raise AssertionError(f"{script} failed ({proc.returncode})\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def wikitext_lines(n_articles, seed):
    """Articles as in wiki.*.tokens: a blank line, ` = Title = `, sections, paragraphs."""
    rng = random.Random(seed)
    sents = fairseq_runs.markov_sentences(n_articles * 12, n_words=200, seed=seed)
    lines, k = [], 0
    for a in range(n_articles):
        lines += ["", f" = W{a} Article = ", ""]
        for s in range(2):
            lines += [f" = = Section {s} = = ", ""]
            para = []
            for _ in range(6):
                words = sents[k].split()
                k += 1
                if rng.random() < 0.4:
                    words.insert(1, "<unk>")
                if rng.random() < 0.5:
                    words[2:2] = ["1", "@,@", "000", "state", "@-@", "of", "3", "@.@", "5"]
                para.append(" ".join(words) + " .")
            lines += [" " + " ".join(para) + " ", ""]
    return lines


@pytest.fixture(scope="module")
def raw_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("wt") / "wikitext-103"
    d.mkdir()
    for split, n, seed in (("train", 40, 1), ("valid", 4, 2), ("test", 4, 3)):
        fairseq_runs.write_lines(str(d / f"wiki.{split}.tokens"), wikitext_lines(n, seed))
    return d


def test_wikitext_detok():
    assert textprep.wikitext_detok_line(" = Heading = ") == " = Heading = "
    assert textprep.wikitext_detok_line("in 1 @,@ 000 state @-@ of the 3 @.@ 5 <unk> art") == \
        "in 1,000 state-of the 3.5 <unk> art"


@pytest.fixture(scope="module")
def spm_prep(raw_dir, tmp_path_factory, recipe):
    out = tmp_path_factory.mktemp("wt_spm")
    run_script(recipe("prepare.sh"), ["--raw-dir", raw_dir, "--out", out, "--vocab-size", "200", "--workers", "1"])
    return out


def test_prepare_spm(raw_dir, spm_prep):
    import sentencepiece as spm
    from fairseq.data import Dictionary, data_utils

    d = Dictionary.load(str(spm_prep / "data-bin" / "dict.txt"))
    raw = open(raw_dir / "wiki.test.tokens", encoding="utf-8").read().splitlines()
    ds = data_utils.load_indexed_dataset(str(spm_prep / "data-bin" / "test"), d)
    assert len(ds) == len(raw)  # one fairseq sentence per line, blank lines included
    sp = spm.SentencePieceProcessor(model_file=str(spm_prep / "spm.model"))
    i = next(i for i, line in enumerate(raw) if "@,@" in line)
    decoded = sp.decode_pieces(d.string(ds[i][:-1]).split())
    assert "1,000 state-of" in decoded and "3.5" in decoded and "@" not in decoded
    # the literal <unk> of WikiText is fairseq's own <unk> entry, not three pieces
    j = next(i for i, line in enumerate(raw) if "<unk>" in line)
    assert d.unk() in ds[j].tolist()


def test_prepare_word_level(raw_dir, tmp_path, recipe):
    from fairseq.data import Dictionary

    run_script(recipe("prepare.sh"), ["--raw-dir", raw_dir, "--out", tmp_path, "--tokenizer", "word",
                                      "--workers", "1"])
    d = Dictionary.load(str(tmp_path / "data-bin" / "dict.txt"))
    assert d.index("@-@") != d.unk() and d.index("=") != d.unk()
    assert not (tmp_path / "spm.model").exists()


def test_prepare_bad_input(raw_dir, tmp_path, recipe):
    p = run_script(recipe("prepare.sh"), ["--raw-dir", raw_dir, "--tokenizer", "gpt2"], expect_ok=False)
    assert p.returncode == 2 and "--tokenizer must be spm or word" in p.stderr
    (tmp_path / "wiki.train.tokens").write_text("x\n")
    p = run_script(recipe("prepare.sh"), ["--raw-dir", tmp_path, "--out", tmp_path / "o"], expect_ok=False)
    assert p.returncode == 2 and "wiki.valid.tokens" in p.stderr


def test_train_sh_recipe(recipe):
    out = run_script(recipe("train.sh"), ["agg", "--max-update", "3"], env=_env(DRY_RUN="1")).stdout
    for flag in ["--arch transformer_lm_gpt2_small", "--criterion cross_entropy_agg", "--agg-alpha 0.03",
                 "--share-decoder-input-output-embed", "--lr 7e-4", "--warmup-updates 4000", "--tokens-per-sample 1024",
                 "--max-tokens 4096", "--update-freq 8", "--max-update 50000", "--weight-decay 0.01"]:
        assert flag in out, flag
    assert out.rstrip().endswith("--max-update 3")
    mlra = run_script(recipe("train.sh"), ["mlra"], env=_env(DRY_RUN="1")).stdout
    assert "--arch transformer_lm_mlra_gpt2_small" in mlra and "--criterion cross_entropy " in mlra
    bad = run_script(recipe("train.sh"), ["adam"], env=_env(DRY_RUN="1"), expect_ok=False)
    assert bad.returncode == 2 and "METHOD must be one of" in bad.stderr


def test_train_and_evaluate(spm_prep, tmp_path, recipe):
    save = tmp_path / "ckpt"
    env = _env(DATA_BIN=str(spm_prep / "data-bin"), SAVE_DIR=str(save))
    tiny = ["--arch", "transformer_lm_gpt", "--decoder-layers", "1", "--decoder-embed-dim", "32",
            "--decoder-ffn-embed-dim", "64", "--decoder-attention-heads", "2", "--tokens-per-sample", "64",
            "--max-tokens", "512", "--update-freq", "1", "--warmup-updates", "5", "--max-update", "15",
            "--cpu", "--num-workers", "0", "--no-progress-bar", "--log-interval", "5"]
    run_script(recipe("train.sh"), ["agg"] + tiny, env=env)
    ckpt = save / "checkpoint_last.pt"
    assert ckpt.is_file()
    out = tmp_path / "eval"
    proc = run_script(recipe("evaluate.sh"), ["--checkpoint", ckpt, "--prep", spm_prep, "--out", out,
                                              "--tokens-per-sample", "64", "--context-window", "0",
                                              "--", "--cpu"])
    m = re.search(r"Loss \(base 2\): ([\d.]+), Perplexity: ([\d.]+)", proc.stdout)
    assert m, proc.stdout
    rep = json.load(open(out / "analysis" / "report.json"))["checkpoints"][0]
    assert set(rep["ppl"]["groups"]) == {"freq", "med", "rare"}
    # two independent scorers of the same blocks without context: fairseq-eval-lm and the analysis
    assert rep["ppl"]["total"]["ppl"] == pytest.approx(float(m.group(2)), rel=0.01)
    assert (out / "analysis" / "projection.png").stat().st_size > 1000
    bad = run_script(recipe("evaluate.sh"), ["--checkpoint", ckpt, "--prep", spm_prep,
                                             "--tokens-per-sample", "64", "--context-window", "64"],
                     expect_ok=False)
    assert bad.returncode == 2 and "--context-window" in bad.stderr
