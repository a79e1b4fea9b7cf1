"""examples/wikitext103 end to end on small files in the raw WikiText-103 token format
(` = Title = ` headings, blank lines, `@-@` / `@,@` / `@.@` escapes, `<unk>`), downloaded from a
local HTTP server that behaves like the dataset's mirror (it refuses Python's default User-Agent).

The paper's tokenizer, GPT-2's byte-level BPE, needs fairseq's encoder.json and vocab.bpe, which
cannot be downloaded here: the tests build a small pair in the same formats from the fixture's
text (a byte-level BPE with a few hundred merges, `tiny_gpt2_bpe`) and serve it as
dl.fbaipublicfiles.com would. fairseq's own GPT-2 BPE decodes what prepare.sh wrote back into the
text, which shows the pair is valid for fairseq's reader; it does not show anything about the real
files' vocabulary."""
import collections
import http.server
import io
import json
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.request
import zipfile

import pytest

from examples import textprep
import fairseq_runs


@pytest.fixture(scope="session")
def recipe(repo_root):
    """The path of a script of the WikiText-103 recipe: recipe("prepare.sh")."""
    return lambda name: os.path.join(repo_root, "examples", "wikitext103", name)


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHON=sys.executable, PYTHONUNBUFFERED="1",
               no_proxy="127.0.0.1,localhost", NO_PROXY="127.0.0.1,localhost")
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


def tiny_gpt2_bpe(lines, n_merges):
    """(encoder.json object, vocab.bpe text) of a byte-level BPE learnt on ``lines`` in GPT-2's
    formats: the 256 byte symbols of GPT-2's byte-to-unicode table, then one token per merge, then
    <|endoftext|>; vocab.bpe is "#version: 0.2" and one "left right" merge a line, by rank, ending
    with a newline (fairseq's reader drops the last line). Words are split with GPT-2's own
    pattern, taken from fairseq's encoder; ties between pairs go to the smaller pair."""
    from fairseq.data.encoders.gpt2_bpe_utils import Encoder, bytes_to_unicode

    byte_symbol = bytes_to_unicode()
    splitter = Encoder({}, [])
    words = collections.Counter()
    for line in lines:
        for piece in splitter.re.findall(splitter.pat, line.strip()):
            words[tuple(byte_symbol[b] for b in piece.encode("utf-8"))] += 1
    merges = []
    for _ in range(n_merges):
        pairs = collections.Counter()
        for word, n in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += n
        if not pairs:
            break
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        merges.append(best)
        merged = collections.Counter()
        for word, n in words.items():
            out, i = [], 0
            while i < len(word):
                if word[i:i + 2] == best:
                    out.append(best[0] + best[1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += n
        words = merged
    tokens = [byte_symbol[b] for b in range(256)]
    for left, right in merges:
        if left + right not in tokens:
            tokens.append(left + right)
    encoder = {token: i for i, token in enumerate(tokens + ["<|endoftext|>"])}
    vocab_bpe = "#version: 0.2\n" + "".join(f"{left} {right}\n" for left, right in merges)
    return encoder, vocab_bpe


@pytest.fixture(scope="module")
def gpt2_bpe_dir(raw_dir, tmp_path_factory):
    """encoder.json and vocab.bpe learnt on the fixture's training text (300 merges)."""
    d = tmp_path_factory.mktemp("gpt2_bpe")
    lines = (raw_dir / "wiki.train.tokens").read_text(encoding="utf-8").splitlines()
    encoder, vocab_bpe = tiny_gpt2_bpe(lines, 300)
    (d / "encoder.json").write_text(json.dumps(encoder), encoding="utf-8")
    (d / "vocab.bpe").write_text(vocab_bpe, encoding="utf-8")
    return d


def wikitext_zip(raw_dir):
    """wikitext-103-v1.zip in the release's layout: wikitext-103/wiki.{train,valid,test}.tokens."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for split in ("train", "valid", "test"):
            z.write(raw_dir / f"wiki.{split}.tokens", f"wikitext-103/wiki.{split}.tokens")
    return buf.getvalue()


@pytest.fixture(scope="module")
def mirror(raw_dir, gpt2_bpe_dir):
    """A local stand-in for https://wikitext.smerity.com and fairseq's GPT-2 files: 403 to urllib's
    default User-Agent (as the WikiText server answers it), the zip at /wikitext-103-v1.zip, an
    HTML page at /page.zip, encoder.json and vocab.bpe under /gpt2_bpe/ (an HTML page as
    /bad_bpe/encoder.json), 404 elsewhere. Records the User-Agent of every request."""
    files = {"/wikitext-103-v1.zip": wikitext_zip(raw_dir), "/page.zip": b"<html>moved</html>",
             "/gpt2_bpe/encoder.json": (gpt2_bpe_dir / "encoder.json").read_bytes(),
             "/gpt2_bpe/vocab.bpe": (gpt2_bpe_dir / "vocab.bpe").read_bytes(),
             "/bad_bpe/encoder.json": b"<html>moved</html>",
             "/bad_bpe/vocab.bpe": (gpt2_bpe_dir / "vocab.bpe").read_bytes()}
    agents = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            agent = self.headers.get("User-Agent", "")
            agents.append(agent)
            if agent.startswith("Python-urllib/"):
                self.send_error(403, "Forbidden")
                return
            body = files.get(self.path)
            if body is None:
                self.send_error(404, "Not Found")
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield {"url": f"http://127.0.0.1:{server.server_address[1]}", "files": files, "agents": agents}
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def gpt2_prep(mirror, tmp_path_factory, recipe):
    """prepare.sh with its defaults (--tokenizer gpt2 --gpt2-dict corpus), everything downloaded."""
    out = tmp_path_factory.mktemp("wt_gpt2")
    proc = run_script(recipe("prepare.sh"), ["--url", mirror["url"] + "/wikitext-103-v1.zip", "--out", out,
                                             "--bpe-url", mirror["url"] + "/gpt2_bpe", "--workers", "2"], env=_env())
    assert "[prepare] downloading " + mirror["url"] + "/wikitext-103-v1.zip" in proc.stdout
    return {"out": out, "log": proc.stdout}


@pytest.fixture(scope="module")
def spm_prep(raw_dir, tmp_path_factory, recipe):
    out = tmp_path_factory.mktemp("wt_spm")
    run_script(recipe("prepare.sh"), ["--raw-dir", raw_dir, "--out", out, "--tokenizer", "spm",
                                      "--vocab-size", "200", "--workers", "1"], env=_env())
    return out


def test_download_sends_its_own_user_agent_and_verifies_the_zip(mirror, gpt2_prep, gpt2_bpe_dir):
    import fairseq_agg

    out = gpt2_prep["out"]
    # the stand-in refuses urllib's default User-Agent, as the real mirror does
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(mirror["url"] + "/wikitext-103-v1.zip", timeout=10)
    assert e.value.code == 403
    assert f"fairseq-agg/{fairseq_agg.__version__}" in mirror["agents"]
    got = out / "orig" / "wikitext-103-v1.zip"
    assert got.read_bytes() == mirror["files"]["/wikitext-103-v1.zip"]
    assert (out / "orig" / "wikitext-103" / "wiki.train.tokens").is_file()
    assert not (out / "orig" / "wikitext-103-v1.zip.part").exists()
    # GPT-2's files, from --bpe-url, into OUT/gpt2_bpe
    for name in ("encoder.json", "vocab.bpe"):
        assert (out / "gpt2_bpe" / name).read_bytes() == (gpt2_bpe_dir / name).read_bytes()
    assert not (out / "gpt2_bpe" / "dict.txt").exists()  # only --gpt2-dict fairseq needs it


@pytest.mark.parametrize("path, bpe_path, message, local_flag", [
    ("/missing.zip", "/gpt2_bpe", "/missing.zip failed: HTTP 404 Not Found", "--raw-dir"),
    ("/page.zip", "/gpt2_bpe", "/page.zip is not a valid zip (18 bytes; bad member: (not a zip archive))", "--raw-dir"),
    ("/wikitext-103-v1.zip", "/missing", "/missing/encoder.json failed: HTTP 404 Not Found", "--bpe-dir"),
])
def test_download_failure_is_one_clear_error(mirror, recipe, tmp_path, path, bpe_path, message, local_flag):
    proc = run_script(recipe("prepare.sh"), ["--url", mirror["url"] + path, "--bpe-url", mirror["url"] + bpe_path,
                                             "--out", tmp_path / "o"], expect_ok=False)
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert lines == [f"textprep: error: download of {mirror['url']}{message} (or download the file yourself and "
                     f"pass its directory as the recipe's {local_flag})"], proc.stderr
    if local_flag == "--raw-dir":
        assert os.listdir(tmp_path / "o" / "orig") == []  # no zip, no partial file
    else:  # GPT-2's files come first: the large download has not started
        assert os.listdir(tmp_path / "o" / "gpt2_bpe") == [] and not (tmp_path / "o" / "orig").exists()
    assert not (tmp_path / "o" / "data-bin").exists()


def test_prepare_gpt2_as_the_paper(raw_dir, gpt2_prep, gpt2_bpe_dir):
    from fairseq.data import Dictionary, data_utils
    from fairseq.data.encoders.gpt2_bpe import GPT2BPE, GPT2BPEConfig

    out = gpt2_prep["out"]
    assert (out / "tokenizer.txt").read_text() == "tokenizer=gpt2 dictionary=corpus\n"
    d = Dictionary.load(str(out / "data-bin" / "dict.txt"))
    assert f"tokenizer=gpt2 dictionary=corpus, V = {len(d)} types" in gpt2_prep["log"]
    # the dictionary is the training split's, in falling count: ids are frequency ranks
    counts = d.count[d.nspecial:]
    assert counts == sorted(counts, reverse=True) and all(sym.isdigit() or sym.startswith("madeupword")
                                                          for sym in d.symbols[d.nspecial:])
    # every line of wiki.test.tokens, escapes and <unk> as they are, stripped: fairseq's GPT-2 BPE
    # (the registered --bpe gpt2) turns the binarised ids back into it; blank lines stay empty
    bpe = GPT2BPE(GPT2BPEConfig(gpt2_encoder_json=str(gpt2_bpe_dir / "encoder.json"),
                                gpt2_vocab_bpe=str(gpt2_bpe_dir / "vocab.bpe")))
    raw = (raw_dir / "wiki.test.tokens").read_text(encoding="utf-8").splitlines()
    ds = data_utils.load_indexed_dataset(str(out / "data-bin" / "test"), d)
    assert len(ds) == len(raw)
    decoded = [bpe.decode(d.string(ds[i][:-1])) for i in range(len(ds))]
    assert decoded == [line.strip() for line in raw]
    assert any("@-@" in line for line in decoded) and any("<unk>" in line for line in decoded)
    assert d.unk() not in ds[next(i for i, line in enumerate(raw) if "<unk>" in line)].tolist()


def test_gpt2_encode_matches_fairseqs_encoder_in_every_worker_count(raw_dir, gpt2_bpe_dir, tmp_path):
    from fairseq.data.encoders.gpt2_bpe_utils import get_encoder

    encoder = get_encoder(str(gpt2_bpe_dir / "encoder.json"), str(gpt2_bpe_dir / "vocab.bpe"))
    src = raw_dir / "wiki.valid.tokens"
    expected = [" ".join(map(str, encoder.encode(line.strip()))) for line in src.read_text().splitlines()]
    for workers in (1, 2):
        dst = tmp_path / f"valid.{workers}"
        proc = subprocess.run([sys.executable, textprep.__file__, "gpt2-encode", "--encoder-json",
                               str(gpt2_bpe_dir / "encoder.json"), "--vocab-bpe", str(gpt2_bpe_dir / "vocab.bpe"),
                               "--inputs", str(src), "--outputs", str(dst), "--workers", str(workers)],
                              check=True, capture_output=True, text=True)
        assert dst.read_text().splitlines() == expected
        # a progress line per tenth of the lines (issue #57: the training text takes minutes)
        assert proc.stderr.splitlines() == [f"gpt2-encode: wiki.valid.tokens {p} %" for p in range(10, 101, 10)]


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


def test_prepare_bad_input_is_one_line_before_anything_is_written(raw_dir, gpt2_bpe_dir, mirror, tmp_path, recipe):
    only_train = tmp_path / "only_train"
    only_train.mkdir()
    (only_train / "wiki.train.tokens").write_text("x\n")
    no_vocab = tmp_path / "no_vocab"
    no_vocab.mkdir()
    (no_vocab / "encoder.json").write_text("{}")
    not_json = tmp_path / "not_json"
    not_json.mkdir()
    (not_json / "encoder.json").write_text("<html>moved</html>")
    shutil.copy(gpt2_bpe_dir / "vocab.bpe", not_json / "vocab.bpe")
    out = tmp_path / "o"
    for args, message in (
            (["--tokenizer", "bpe"], "--tokenizer must be gpt2, spm or word, got 'bpe'"),
            (["--gpt2-dict", "gpt2"], "--gpt2-dict must be corpus or fairseq, got 'gpt2'"),
            (["--bpe-dir", tmp_path / "none"], f"--bpe-dir: no such directory: {tmp_path / 'none'}"),
            (["--bpe-dir", no_vocab], f"--bpe-dir {no_vocab} has no vocab.bpe (expected encoder.json vocab.bpe)"),
            (["--bpe-dir", gpt2_bpe_dir, "--gpt2-dict", "fairseq"], f"--bpe-dir {gpt2_bpe_dir} has no dict.txt"),
            (["--bpe-dir", gpt2_bpe_dir, "--tokenizer", "spm"], "--bpe-dir is for --tokenizer gpt2"),
            (["--bpe-dir", not_json], f"textprep: error: --encoder-json {not_json / 'encoder.json'} is not GPT-2's "
                                      "encoder.json (not JSON: "),
            (["--raw-dir", tmp_path / "none"], "--raw-dir: no such directory"),
            (["--raw-dir", only_train], "wiki.valid.tokens"),
            # an error page where encoder.json should be: the check before the encoding says so
            (["--raw-dir", raw_dir, "--bpe-url", mirror["url"] + "/bad_bpe"], "is not GPT-2's encoder.json")):
        p = run_script(recipe("prepare.sh"), ["--out", out] + args, expect_ok=False)
        lines = p.stderr.splitlines()
        assert p.returncode == 2 and len(lines) == 1 and message in lines[0], (args, p.stderr)
        if "bad_bpe" in str(args):  # the downloaded error page is not kept for the next run
            assert not (out / "gpt2_bpe" / "encoder.json").exists() and not (out / "tmp").exists()
        else:
            assert not out.exists(), args
        shutil.rmtree(out, ignore_errors=True)


def test_train_sh_recipe(recipe):
    proc = run_script(recipe("train.sh"), ["agg", "--", "--max-update", "3"], env=_env(DRY_RUN="1"))
    out = proc.stdout
    for flag in ["--arch transformer_lm_gpt2_small", "--criterion cross_entropy_agg", "--agg-alpha 0.03",
                 "--share-decoder-input-output-embed", "--lr 7e-4", "--warmup-updates 4000", "--tokens-per-sample 1024",
                 "--max-tokens 4096 --update-freq 8 --distributed-world-size 1", "--max-update 50000",
                 "--weight-decay 0.01"]:
        assert flag in out, flag
    assert out.rstrip().endswith("--max-update 3")
    assert "= 1 x 4096 x 8 = 32768 (the paper: 1 x 4096 x 8 = 32768)" in proc.stderr
    mlra = run_script(recipe("train.sh"), ["mlra"], env=_env(DRY_RUN="1")).stdout
    assert "--arch transformer_lm_mlra_gpt2_small" in mlra and "--criterion cross_entropy " in mlra
    bad = run_script(recipe("train.sh"), ["agg", "big"], env=_env(DRY_RUN="1"), expect_ok=False)
    assert bad.returncode == 2 and "unexpected argument 'big'" in bad.stderr


TINY_LM = ["--arch", "transformer_lm_gpt", "--decoder-layers", "1", "--decoder-embed-dim", "32",
           "--decoder-ffn-embed-dim", "64", "--decoder-attention-heads", "2", "--tokens-per-sample", "64",
           "--max-tokens", "512", "--update-freq", "1", "--warmup-updates", "5", "--cpu", "--num-workers", "0",
           "--no-progress-bar", "--log-interval", "5"]


def test_train_and_evaluate(gpt2_prep, tmp_path, recipe):
    """The paper's pipeline on the fixture: GPT-2 BPE with the corpus dictionary, train.sh, evaluate.sh
    with its defaults. The vocabulary is far below 36,000 types, so the default groups are the fractions."""
    prep = gpt2_prep["out"]
    save = tmp_path / "ckpt"
    env = _env(DATA_BIN=str(prep / "data-bin"), SAVE_DIR=str(save))
    run_script(recipe("train.sh"), ["agg", "--"] + TINY_LM + ["--max-update", "15"], env=env)
    ckpt = save / "checkpoint_best.pt"
    assert ckpt.is_file()
    out = tmp_path / "eval"
    # --checkpoint takes train.sh's save directory: its checkpoint_best.pt; DATA_BIN gives the data,
    # --prep (here without a data-bin) prepare.sh's tokenizer.txt
    meta = tmp_path / "prep_without_data"
    meta.mkdir()
    shutil.copy(prep / "tokenizer.txt", meta / "tokenizer.txt")
    proc = run_script(recipe("evaluate.sh"), ["--checkpoint", save, "--prep", meta, "--out", out,
                                              "--tokens-per-sample", "60", "--context-window", "0",
                                              "--", "--cpu"], env=_env(DATA_BIN=str(prep / "data-bin")))
    lines = proc.stdout.splitlines()
    assert f"[evaluate] --checkpoint {save}: using {ckpt}" in lines
    types = len(open(prep / "data-bin" / "dict.txt").read().splitlines()) + 4
    assert f"[evaluate] --group-preset auto: V = {types} is too small for the paper's groups (ids 13,000 / " \
           "36,000): using the fractions" in lines
    assert "[evaluate] frequency groups: fractions" in lines
    m = re.search(r"Loss \(base 2\): ([\d.]+), Perplexity: ([\d.]+)", proc.stdout)
    assert m, proc.stdout
    rep = json.load(open(out / "analysis" / "report.json"))["checkpoints"][0]
    assert set(rep["ppl"]["groups"]) == {"freq", "med", "rare"}
    # two independent scorers of the same blocks without context: fairseq-eval-lm and the analysis
    assert rep["ppl"]["total"]["ppl"] == pytest.approx(float(m.group(2)), rel=0.01)
    # both score every token of the test split, whose 60-token blocks are not a multiple of 8 (fairseq
    # drops a last batch that is not a multiple of --required-batch-size-multiple, 8 by default)
    from fairseq.data import Dictionary, data_utils

    split = data_utils.load_indexed_dataset(str(prep / "data-bin" / "test"),
                                            Dictionary.load(str(prep / "data-bin" / "dict.txt")))
    split_tokens = int(split.sizes.sum())
    assert -(-split_tokens // 60) % 8 != 0, split_tokens
    assert f"Evaluated {split_tokens:,} tokens" in proc.stdout, proc.stdout
    assert rep["ppl"]["total"]["tokens"] == split_tokens
    assert (out / "analysis" / "projection.png").stat().st_size > 1000
    # refusals, each one line before anything is written
    for args, message in (
            (["--tokens-per-sample", "64", "--context-window", "64"], "--context-window must be an integer in"),
            (["--group-preset", "wikitext103-official"],
             f"--group-preset wikitext103-official uses the id ranges [0,13001), [13001,36000), [36000,V) and "
             f"needs a vocabulary of more than 36000 types; this one has {types}"),
            (["--group-preset", "paper"], "--group-preset must be auto, fractions or wikitext103-official")):
        bad = run_script(recipe("evaluate.sh"), ["--checkpoint", ckpt, "--prep", prep, "--out", tmp_path / "bad"]
                         + args, expect_ok=False)
        errors = bad.stderr.splitlines()
        assert bad.returncode == 2 and len(errors) == 1 and errors[0].startswith("evaluate.sh: error: ") \
            and message in errors[0], (args, bad.stderr)
        assert not (tmp_path / "bad").exists()


def test_paper_groups_on_a_vocabulary_above_36000(raw_dir, gpt2_bpe_dir, tmp_path, recipe):
    """evaluate.sh --group-preset wikitext103-official on a GPT-2 vocabulary of more than 36,000 types.

    The fixture's text has a few hundred BPE types, so the dictionary here is a fairseq-format
    dict.txt of 36,204 entries (prepare.sh --gpt2-dict fairseq, as with fairseq's own GPT-2
    dict.txt), the fixture's ids spread over the three id ranges and the rest never seen. This
    proves that the recipe gives the analysis the paper's id ranges (13,001 / 22,999 / V - 36,000
    types: its eval_lm.py counts ids <= 13,000 as frequent) and scores targets in each, with eval-lm
    at the paper's 512 / 400; that these ids are WikiText-103 frequency ranks needs the real corpus
    (--gpt2-dict corpus, V = 44,256)."""
    bpe_dir = tmp_path / "bpe"
    shutil.copytree(gpt2_bpe_dir, bpe_dir)
    encoder = json.loads((bpe_dir / "encoder.json").read_text())
    real = [str(i) for i in sorted(encoder.values())]
    lines = [f"{100000 + i} 1" for i in range(36200)]
    # line i of dict.txt is dictionary id i + 4 (fairseq's specials come first): the medium and rare
    # ranges begin at lines 12,997 and 35,996; the fixture's ids go to the three ranges in turn
    starts = (0, 13001 - 4, 36000 - 4)
    for k, token in enumerate(real):
        lines[starts[k % 3] + k // 3] = f"{token} 1"
    (bpe_dir / "dict.txt").write_text("".join(line + "\n" for line in lines))
    prep = tmp_path / "prep"
    run_script(recipe("prepare.sh"), ["--raw-dir", raw_dir, "--out", prep, "--bpe-dir", bpe_dir,
                                      "--gpt2-dict", "fairseq", "--workers", "1"])
    assert (prep / "tokenizer.txt").read_text() == "tokenizer=gpt2 dictionary=fairseq\n"
    save = tmp_path / "ckpt"
    env = _env(DATA_BIN=str(prep / "data-bin"), SAVE_DIR=str(save))
    run_script(recipe("train.sh"), ["baseline", "--"] + TINY_LM + ["--max-update", "3", "--tokens-per-sample",
                                                                     "512", "--max-tokens", "1024"], env=env)
    out = tmp_path / "eval"
    proc = run_script(recipe("evaluate.sh"), ["--checkpoint", save, "--prep", prep, "--out", out,
                                              "--group-preset", "wikitext103-official", "--", "--cpu"])
    assert "[evaluate] frequency groups: wikitext103-official" in proc.stdout.splitlines()
    assert re.search(r"Loss \(base 2\): [\d.]+, Perplexity: [\d.]+", proc.stdout), proc.stdout
    rep = json.load(open(out / "analysis" / "report.json"))
    assert rep["settings"]["group_preset"] == "wikitext103-official"
    assert (rep["settings"]["tokens_per_sample"], rep["settings"]["context_window"]) == (512, 400)
    checkpoint = rep["checkpoints"][0]
    assert checkpoint["dictionary"]["size"] == 36204
    assert checkpoint["groups"] == {"freq": 13001, "med": 22999, "rare": 204}
    assert all(checkpoint["ppl"]["groups"][g]["tokens"] > 0 for g in ("freq", "med", "rare"))
