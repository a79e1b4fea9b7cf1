"""The demos' result table stands alone (issue #57): full method names, an arrow on the columns with
a better direction, each method's change against the baseline in %, a verdict line per method and
the legend, all of it in table.txt. Built here from fabricated results whose changes are worked
out by hand."""
import json
import types

from examples import demo_common
from examples.lm_demo import run as lm_demo

COLUMNS = [("test_ppl", "test PPL", 2), ("isotropy", "I(W)", 3), ("rare_tokens", "rare tok", 0)]
BETTER = {"test_ppl": "down", "isotropy": "up"}
RESULTS = {  # two seeds each: the means are 200, 0.5 (baseline), 210, 0.6 (agg), 190.5, 0.5025 (al)
    "baseline": [{"test_ppl": 199.0, "isotropy": 0.49, "rare_tokens": None},
                 {"test_ppl": 201.0, "isotropy": 0.51, "rare_tokens": None}],
    "agg": [{"test_ppl": 209.0, "isotropy": 0.59, "rare_tokens": 12.0},
            {"test_ppl": 211.0, "isotropy": 0.61, "rare_tokens": 14.0}],
    "al": [{"test_ppl": 190.0, "isotropy": 0.500, "rare_tokens": None},
           {"test_ppl": 191.0, "isotropy": 0.505, "rare_tokens": None}],
}


def write_table(tmp_path):
    plan = types.SimpleNamespace(methods=["baseline", "agg", "al"], out_dir=str(tmp_path), mode="quick",
                                 updates=12, skipped=[], budget=None, t_start=0.0)
    a = types.SimpleNamespace(seeds=[1, 2])
    lm_demo.DEMO.write_results(a, plan, {}, RESULTS, COLUMNS, better=BETTER, legend=("the legend's own line",))
    return (tmp_path / "table.txt").read_text(encoding="utf-8"), json.loads((tmp_path / "results.json").read_text())


def test_the_table_says_who_won(tmp_path):
    text, results = write_table(tmp_path)
    lines = text.splitlines()
    # full names, arrows on the columns with a direction only
    assert [c.strip() for c in lines[0].split(" | ")] == ["method", "test PPL ↓", "I(W) ↑", "rare tok"]
    assert lines[2].startswith("baseline (stock cross-entropy) | 200.00±1.00 |")
    assert any(line.startswith("augmented loss (REAL) ") for line in lines) and "| al " not in text
    # Δ %, by hand: agg (210 - 200) / 200 = +5.0 %, (0.6 - 0.5) / 0.5 = +20.0 %;
    # al (190.5 - 200) / 200 = -4.75 %, (0.5025 - 0.5) / 0.5 = +0.5 %
    delta = lines.index(next(line for line in lines if line.startswith("Δ % vs baseline")))
    assert [c.strip() for c in lines[delta + 2].split("|")] == ["AGG (adaptive gradient gating)", "+5.0", "+20.0"]
    assert [c.strip() for c in lines[delta + 3].split("|")] == ["augmented loss (REAL)", "-4.8", "+0.5"]
    # the verdicts: agg's changes exceed both seed spreads; al's I(W) (0.0025 < 0.0025 + 0.01) does not
    assert "  AGG (adaptive gradient gating): better: I(W) +20.0 %; worse: test PPL +5.0 %" in lines
    assert "  augmented loss (REAL): better: test PPL -4.8 %; within the seed spread: I(W) +0.5 %" in lines
    # the legend is written into the file, with what Δ % and the arrows mean
    assert "the legend's own line" in lines and any(line.startswith("↓ / ↑: the better direction") for line in lines)
    assert "Δ % = (method − baseline) / baseline × 100" in text
    assert results["results"] == RESULTS and "| I(W) ↑ |" in results["markdown"]


def test_without_a_baseline_there_is_no_comparison(tmp_path):
    plan = types.SimpleNamespace(methods=["agg"], out_dir=str(tmp_path), mode="quick", updates=12, skipped=[],
                                 budget=None, t_start=0.0)
    lm_demo.DEMO.write_results(types.SimpleNamespace(seeds=[1]), plan, {}, {"agg": RESULTS["agg"]}, COLUMNS,
                               better=BETTER)
    text = (tmp_path / "table.txt").read_text(encoding="utf-8")
    assert "Δ % vs baseline" not in text and "Against the baseline" not in text and "I(W) ↑" in text


def test_rare_count_is_the_last_updates(tmp_path):
    """From the final checkpoint's window (the analysis' agg section), not the log's interval mean."""
    run = types.SimpleNamespace(rare_tokens=159.0)
    assert lm_demo.rare_at_last_update(run, {"agg": {"rare": 154}}) == 154.0
    assert lm_demo.rare_at_last_update(types.SimpleNamespace(rare_tokens=None), {"agg": None}) is None
    assert demo_common.BASELINE in lm_demo.METHODS
