"""A long run's trajectory: the embedding and the test PPL at the end of every epoch.

A run trained with ``--epoch-checkpoints`` (study/run.py) keeps fairseq's checkpoint of each
epoch's end, ``checkpointE.pt``. Each is measured with the code of the run's own evaluation
(study/tail.py): fairseq-agg-analyze's statistics of the output embedding (I(W) in its three
forms, mean cosine, and the rows' drift along their mean direction, from
``fairseq_agg.stats.metrics.mean_direction_drift``) and the test PPL, in total and per frequency
group under the part's groupings, scored like ``fairseq-eval-lm --context-window``. A budget that
ends inside an epoch adds its last checkpoint.

    python -m study.trajectory WORK/tail/RUN_ID [...]            # writes RUN_ID/trajectory.json
    python -m study.trajectory --figure OUT.png --endpoints E.json T.json [...]

The JSON holds one point per checkpoint, in the order of its updates; it is small, so a study
keeps it beside its results (docs/data/) when the run directory, with its checkpoints, goes.
``--figure`` draws I(W) and the test PPL against updates, one line per trajectory, and the ends of
shorter runs of the same methods (``--endpoints``: {run name: [[updates, I(W), test PPL], ...]}; keys
starting with "_" are notes)
beside them as open markers.
"""
import argparse
import json
import os
import re
import sys
import tempfile
from typing import Dict, List

from fairseq_agg.fairseq_facts.checkpoint_files import checkpoint_updates
from study import store
from study.tail import GROUPINGS, group_perplexities, quiet_known_warnings
from study.harness.cli import exit_in_one_line

TRAJECTORY_JSON = "trajectory.json"
EPOCH_CHECKPOINT = re.compile(r"checkpoint(\d+)\.pt")
# what each point holds of the embedding (report.json's matrix entry: its "all" rows, its drift)
EMBEDDING_KEYS = ("isotropy", "isotropy_raw", "isotropy_fixed", "mean_cos")


def epoch_checkpoints(directory) -> List[str]:
    """The run's checkpoints of an epoch's end, by epoch, then its last checkpoint when that is
    newer than every one of them (a budget that ends inside an epoch)."""
    found = sorted((int(m.group(1)), name) for name in os.listdir(directory)
                   for m in [EPOCH_CHECKPOINT.fullmatch(name)] if m)
    paths = [os.path.join(directory, name) for _, name in found]
    last = os.path.join(directory, store.LAST_CHECKPOINT)
    if os.path.isfile(last) and (not paths or checkpoint_updates(last) > checkpoint_updates(paths[-1])):
        paths.append(last)
    return paths


def measure(checkpoint, data_bin, context_window) -> dict:
    """One point: the checkpoint's updates and epoch, its output embedding's statistics and drift,
    and the test PPL under every grouping of the part."""
    from fairseq_agg.analysis.analyze import analyze
    from study.evaluate import output_matrix

    with tempfile.TemporaryDirectory() as out:
        report = analyze([checkpoint], data=data_bin, split="test", out=os.path.join(out, "analysis"),
                         fractions=GROUPINGS["paper"], ppl=False, figures=False, device="cpu")
    entry = report["checkpoints"][0]
    matrix = entry["matrices"][output_matrix(entry)]
    with quiet_known_warnings():
        ppl = group_perplexities(checkpoint, data_bin, "test", context_window)
    # an epoch checkpoint's saved iterator already points at the next epoch: its name says which it ends
    ended = EPOCH_CHECKPOINT.fullmatch(os.path.basename(checkpoint))
    point = {"checkpoint": os.path.basename(checkpoint), "updates": entry["num_updates"],
             "epoch": int(ended.group(1)) if ended else entry["epoch"],
             **{k: matrix["all"][k] for k in EMBEDDING_KEYS}, **(matrix["drift"] or {}),
             "test_ppl": ppl["paper"]["total"]["ppl"], "test_tokens": ppl["paper"]["total"]["tokens"]}
    for grouping, scored in ppl.items():
        point[f"test_ppl_{grouping}"] = {g: v["ppl"] for g, v in scored["groups"].items()}
    return point


def trajectory(directory) -> dict:
    """Every point of the run in ``directory`` (its run.json names the data and the evaluation)."""
    run = store.read_json(os.path.join(directory, store.RUN_JSON))
    data_bin = run["data"]["data_bin"]
    context_window = run["key"]["evaluation"]["context_window"]
    paths = epoch_checkpoints(directory)
    return {"run_id": run["run_id"], "name": run["name"], "seed": run["seed"], "budget_updates": run["updates"],
            "data": run["data"]["stamp"], "context_window": context_window,
            "points": [measure(p, data_bin, context_window) for p in paths]}


def plot(trajectories: List[dict], endpoints: Dict[str, list], path):
    """I(W) and test PPL against updates: a line per trajectory, the shorter runs' ends as open
    markers of the same method's colour."""
    from fairseq_agg.analysis.plots import pyplot
    from fairseq_agg.files import atomic_output
    from study.harness.figures import save_study_figure
    from study.tail_figures import tail_styles

    endpoints = {name: ends for name, ends in endpoints.items() if not name.startswith("_")}  # "_about": notes
    names = list(dict.fromkeys([t["name"] for t in trajectories] + list(endpoints)))
    styles = tail_styles(names)  # each run's colour, marker and line style, as in the part's other figures
    order = list(styles)
    fig, axes = pyplot().subplots(1, 2, figsize=(10, 3.8))
    for t in sorted(trajectories, key=lambda t: order.index(t["name"])):
        x = [p["updates"] for p in t["points"]]
        label = f"{t['name']} (seed {t['seed']}, {t['budget_updates']:,} updates)"
        axes[0].plot(x, [p["isotropy"] for p in t["points"]], label=label, **styles[t["name"]])
        axes[1].plot(x, [p["test_ppl"] for p in t["points"]], label=label, **styles[t["name"]])
    for name, ends in endpoints.items():
        for k, (ax, values) in enumerate(zip(axes, ([e[1] for e in ends], [e[2] for e in ends]))):
            ax.scatter([e[0] for e in ends], values, marker=styles[name]["marker"], facecolors="none",
                       edgecolors=styles[name]["color"], s=70, zorder=3,
                       label=f"{name}, end of a 1- or 2-epoch run" if k == 0 else None)
    axes[0].set(xlabel="updates", ylabel="I(W) of the output embedding (sign-symmetric)",
                title="isotropy at each epoch's end")
    axes[1].set(xlabel="updates", ylabel="test PPL", title="test perplexity at each epoch's end")
    axes[0].legend(fontsize=7, loc="best")
    with atomic_output(path, flag="--figure") as handle:
        save_study_figure(fig, handle)
    return path


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m study.trajectory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="+", help="run directories to measure, or with --figure their trajectory.json files")
    p.add_argument("--figure", metavar="OUT.png", help="draw the trajectories (paths are trajectory.json files)")
    p.add_argument("--endpoints", metavar="JSON", help="with --figure: the ends of shorter runs, by run name")
    a = p.parse_args(argv)
    missing = [x for x in a.paths + ([a.endpoints] if a.endpoints else []) if not os.path.exists(x)]
    if missing:
        p.error(f"no such file or directory: {missing[0]}")
    if a.figure:
        trajectories = [store.read_json(x) for x in a.paths]
        plot(trajectories, store.read_json(a.endpoints) if a.endpoints else {}, a.figure)
        print(a.figure)
        return 0
    for directory in a.paths:  # every run checked before any is measured
        if not os.path.isfile(os.path.join(directory, store.RUN_JSON)):
            p.error(f"{directory}: not a study run directory (no {store.RUN_JSON})")
        if not epoch_checkpoints(directory):
            p.error(f"{directory}: no checkpoint of an epoch's end (train with --epoch-checkpoints)")
    for directory in a.paths:
        result = trajectory(directory)
        out = os.path.join(directory, TRAJECTORY_JSON)
        store.write_json_atomic(out, result)
        print(json.dumps({"written": out, "points": [(x["updates"], round(x["isotropy"], 4), round(x["test_ppl"], 2))
                                                     for x in result["points"]]}))
    return 0


if __name__ == "__main__":
    sys.exit(exit_in_one_line(main))
