"""examples/wikitext103 end to end on small files in the raw WikiText-103 token format
(` = Title = ` headings, blank lines, `@-@` / `@,@` / `@.@` escapes, `<unk>`), downloaded from a
local HTTP server that behaves like the dataset's mirror (it refuses Python's default User-Agent)."""
import http.server
import io
import json
import os
import random
import re
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


def wikitext_zip(raw_dir):
    """wikitext-103-v1.zip in the release's layout: wikitext-103/wiki.{train,valid,test}.tokens."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for split in ("train", "valid", "test"):
            z.write(raw_dir / f"wiki.{split}.tokens", f"wikitext-103/wiki.{split}.tokens")
    return buf.getvalue()


@pytest.fixture(scope="module")
def mirror(raw_dir):
    """A local stand-in for https://wikitext.smerity.com: 403 to urllib's default User-Agent
    (as the real server answers it), the zip at /wikitext-103-v1.zip, an HTML page at
    /page.zip, 404 elsewhere. Records the User-Agent of every request."""
    files = {"/wikitext-103-v1.zip": wikitext_zip(raw_dir), "/page.zip": b"<html>moved</html>"}
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
def spm_prep(mirror, tmp_path_factory, recipe):
    out = tmp_path_factory.mktemp("wt_spm")
    proc = run_script(recipe("prepare.sh"), ["--url", mirror["url"] + "/wikitext-103-v1.zip", "--out", out,
                                             "--vocab-size", "200", "--workers", "1"], env=_env())
    assert "[prepare] downloading " + mirror["url"] in proc.stdout
    return out


def test_download_sends_its_own_user_agent_and_verifies_the_zip(mirror, spm_prep):
    import fairseq_agg

    # the stand-in refuses urllib's default User-Agent, as the real mirror does
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(mirror["url"] + "/wikitext-103-v1.zip", timeout=10)
    assert e.value.code == 403
    assert f"fairseq-agg/{fairseq_agg.__version__}" in mirror["agents"]
    got = spm_prep / "orig" / "wikitext-103-v1.zip"
    assert got.read_bytes() == mirror["files"]["/wikitext-103-v1.zip"]
    assert (spm_prep / "orig" / "wikitext-103" / "wiki.train.tokens").is_file()
    assert not (spm_prep / "orig" / "wikitext-103-v1.zip.part").exists()


@pytest.mark.parametrize("path, message", [
    ("/missing.zip", "failed: HTTP 404 Not Found"),
    ("/page.zip", "is not a valid zip (18 bytes; bad member: (not a zip archive))"),
])
def test_download_failure_is_one_clear_error(mirror, recipe, tmp_path, path, message):
    url = mirror["url"] + path
    proc = run_script(recipe("prepare.sh"), ["--url", url, "--out", tmp_path / "o"], expect_ok=False)
    assert proc.returncode == 2
    assert f"textprep: error: download of {url} {message}" in proc.stderr, proc.stderr
    assert "--raw-dir" in proc.stderr and "Traceback" not in proc.stderr
    assert os.listdir(tmp_path / "o" / "orig") == []  # no zip, no partial file
    assert not (tmp_path / "o" / "data-bin").exists()


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


def test_train_and_evaluate(spm_prep, tmp_path, recipe):
    save = tmp_path / "ckpt"
    env = _env(DATA_BIN=str(spm_prep / "data-bin"), SAVE_DIR=str(save))
    tiny = ["--arch", "transformer_lm_gpt", "--decoder-layers", "1", "--decoder-embed-dim", "32",
            "--decoder-ffn-embed-dim", "64", "--decoder-attention-heads", "2", "--tokens-per-sample", "64",
            "--max-tokens", "512", "--update-freq", "1", "--warmup-updates", "5", "--max-update", "15",
            "--cpu", "--num-workers", "0", "--no-progress-bar", "--log-interval", "5"]
    run_script(recipe("train.sh"), ["agg", "--"] + tiny, env=env)
    ckpt = save / "checkpoint_best.pt"
    assert ckpt.is_file()
    out = tmp_path / "eval"
    # --checkpoint takes train.sh's save directory: its checkpoint_best.pt
    proc = run_script(recipe("evaluate.sh"), ["--checkpoint", save, "--prep", spm_prep, "--out", out,
                                              "--tokens-per-sample", "64", "--context-window", "0",
                                              "--", "--cpu"])
    assert f"[evaluate] --checkpoint {save}: using {ckpt}" in proc.stdout.splitlines()
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
