"""A part's tables, figures and numbers, made from its finished runs' result.json files alone
(so ``--report`` can remake them at any time, with other spike settings too).

Every cell is mean ± h over the seeds (h = half the range, :func:`examples.demo_common.fmt`);
a ``*`` marks a method whose difference to the baseline exceeds the spread
(:func:`study.metrics.compare_to_baseline`). What a part's report holds is said by its
:class:`study.parts.Part` (its columns, figures and sections), never by its name.
"""
import math
import os
import time

from examples.demo_common import fmt, markdown_table, mean_spread, save_study_figure, seed_band, train_curve, write_json
from examples.lm_demo.wordsim import DATASETS
from fairseq_agg.analysis.plots import pyplot
from study.figure_style import draw_series, group_bars, label_points, log_ticks, marks_of, method_styles, seeds_of
from study.figure_style import show_coinciding
from study.metrics import compare_to_baseline, convergence, count_spikes, group_shares

GROUPS = ("freq", "med", "rare")


# ---------------------------------------------------------------------------- one run's numbers


def output_matrix(report):
    """The analysed matrix the tables use: the output embedding (``out`` when untied, else the
    tied ``dec``), the matrix AGG's gates act on."""
    mats = report["matrices"]
    for name in ("out", "dec"):
        if name in mats:
            return name
    return next(iter(mats))


def analysis_numbers(report):
    """The numbers of one checkpoint's fairseq-agg-analyze report (report.json schema)."""
    name = output_matrix(report)
    stats = report["matrices"][name]["all"]
    out = {"matrix": name, "test_ppl": report["ppl"]["total"]["ppl"], "test_tokens": report["ppl"]["total"]["tokens"]}
    for g in GROUPS:
        out[f"test_ppl_{g}"] = report["ppl"]["groups"][g]["ppl"]
    for key in ("isotropy", "isotropy_raw", "isotropy_fixed", "tev_mu", "tev_sigma", "mean_cos"):
        out[key] = stats[key]
    out.update(report["matrices"][name].get("drift") or {})  # the rows' drift along their mean direction
    ws = report.get("word_similarity") or {}
    out["word_similarity"] = {stem: by_matrix.get(name) for stem, by_matrix in ws.items()}
    return out


def generated_group_shares(generate_out, dict_path):
    """{"hypothesis": {group: share}, "reference": {...}}: the frequency groups (the joined
    dictionary's, as fairseq-agg-analyze forms them) of the target pieces fairseq-generate wrote
    in its H and T lines; special symbols are not counted."""
    from fairseq.data import Dictionary

    from examples.textprep import read_generate
    from fairseq_agg.stats.groups import GROUP_NAMES, frequency_groups, group_lookup

    d = Dictionary.load(dict_path)
    lookup = group_lookup(frequency_groups(d), len(d)).tolist()
    out = {}
    for side, prefix in (("hypothesis", "H"), ("reference", "T")):
        seqs = [[d.index(piece) for piece in line.split()] for line in read_generate(generate_out, prefix)]
        out[side] = group_shares(seqs, lookup, GROUP_NAMES)
    return out


def headline(part, res):
    """One finished run of ``part`` in a few numbers (the console's "done" line)."""
    m = res["metrics"]
    if not part.corpus.language_model:
        return f"BLEU {m['bleu']:.2f}, chrF {m['chrf']:.2f}"
    text = f"test PPL {m['test_ppl']:.2f}, I(W) {m['isotropy']:.3f}"
    if part.by_depth:
        text += f", µTEV {m['tev_mu']:.4f}"
    if part.uniq:
        text += f", Uniq {m['uniq']['uniq']}"
    return text


# ---------------------------------------------------------------------------- the table


def _get(path):
    def get(res):
        v = res
        for k in path:
            if v is None:
                return None
            v = v.get(k) if isinstance(v, dict) else None
        return v
    return get


def _pct(path):
    get = _get(path)
    return lambda res: None if get(res) is None else 100.0 * get(res)


def metric(*keys):
    """The getter of result["metrics"][keys[0]][keys[1]]... (None where a key is missing)."""
    return _get(("metrics",) + keys)


# the columns every part's table may share: (key, header, digits, getter)
TEST_PPL = [("test_ppl", "test PPL", 2, metric("test_ppl"))] + [
    (f"test_ppl_{g}", f"test {g}", 1, metric(f"test_ppl_{g}")) for g in GROUPS]
ISOTROPY = [("isotropy", "I(W)", 3, metric("isotropy")), ("isotropy_raw", "I(W) paper", 3, metric("isotropy_raw"))]
TEV = [("tev_mu", "µTEV", 4, metric("tev_mu")), ("tev_sigma", "σTEV", 4, metric("tev_sigma"))]
RARE_TOKENS = ("rare_tokens", "rare tok", 0, _get(("rare_tokens",)))
TRAIN_SECONDS = ("train_seconds", "train s", 0, _get(("train_seconds",)))


# A part's columns: columns(m, results, spikes) -> [(key, header, digits, getter)], where m(*keys)
# is :func:`metric` (study.parts.Part.columns).
def lm_columns(m, results, spikes):
    cols = [("valid_ppl", "valid PPL", 2, m("valid_ppl"))] + TEST_PPL + ISOTROPY + TEV + [
        ("mean_cos", "mean cos", 3, m("mean_cos"))]
    stems = sorted({s for r in results for s in (r["metrics"].get("word_similarity") or {})})
    for stem in stems:
        shown = DATASETS.get(stem, stem)
        cols.append((f"ws_{stem}", f"ρ {shown}", 3, m("word_similarity", stem, "single", "rho")))
        cols.append((f"ws_{stem}_sub", f"ρ {shown} sub", 3, m("word_similarity", stem, "subword", "rho")))
    return cols + [("uniq", "Uniq", 0, m("uniq", "uniq")), TRAIN_SECONDS]


def alpha_columns(m, results, spikes):
    return [TEST_PPL[0], TEST_PPL[3]] + ISOTROPY + [("mean_cos", "mean cos", 3, m("mean_cos")), RARE_TOKENS,
                                                    TRAIN_SECONDS]


def depth_columns(m, results, spikes):
    return [TEST_PPL[0], *TEV,
            ("gnorm_spikes", "gnorm spikes", 1, lambda r: len(run_spikes(r, spikes)["gnorm"])),
            ("loss_spikes", "loss spikes", 1, lambda r: len(run_spikes(r, spikes)["loss"])),
            ("max_gnorm", "max gnorm", 2, lambda r: max((v for _, v in r["curves"]["gnorm"]), default=None)),
            TRAIN_SECONDS]


def mt_columns(m, results, spikes):
    return [("bleu", "BLEU", 2, m("bleu")), ("chrf", "chrF", 2, m("chrf")),
            ("bleu_ding", "BLEU Ding", 2, m("bleu_ding")), ("bleu_libreoffice", "BLEU LO", 2, m("bleu_libreoffice")),
            ("rare_share", "rare % hyp", 2, _pct(("metrics", "token_groups", "hypothesis", "rare"))),
            ("rare_share_ref", "rare % ref", 2, _pct(("metrics", "token_groups", "reference", "rare"))),
            ("valid_nll", "valid nll", 3, m("valid_nll")), RARE_TOKENS, TRAIN_SECONDS]


def run_spikes(res, spikes):
    """{"gnorm": [update, ...], "loss": [...]}: the spikes of one run's train_inner values."""
    out = {}
    for key, curve, factor in (("gnorm", "gnorm", spikes["gnorm_factor"]), ("loss", "train_loss", spikes["loss_factor"])):
        pts = res["curves"][curve]
        out[key] = [pts[i][0] for i in count_spikes([v for _, v in pts], factor, spikes["window"])]
    return out


def baseline_of(part, name, groups):
    """The run name a method is compared with: the baseline (at the same depth in a part by depth)."""
    if part.by_depth:
        return f"baseline-L{groups[name]['depth']}"
    return "baseline"


def summarise(part, names, by_name, cols, groups):
    """{name: {key: {"mean", "spread", "values", "exceeds_baseline"}}} and the table's rows."""
    summary, rows = {}, []
    for name in names:
        runs = by_name[name]
        base = by_name.get(baseline_of(part, name, groups), [])
        summary[name], row = {"seeds": [r["seed"] for r in runs]}, [name, str(len(runs))]
        for key, _, digits, get in cols:
            vals = [get(r) for r in runs]
            exceeds = None if name == baseline_of(part, name, groups) else compare_to_baseline(vals, [get(r) for r in base])
            mean, spread = mean_spread(vals)
            summary[name][key] = {"mean": mean, "spread": spread, "values": vals, "exceeds_baseline": exceeds}
            row.append(fmt(vals, digits) + (" *" if exceeds else ""))
        rows.append(row)
    return summary, rows


# ---------------------------------------------------------------------------- figures


def train_cross_entropy(res, runs_dir):
    """[(update, plain cross-entropy in bits per token)] of one run's train_inner lines.

    The plugin's criteria log ``loss`` as what they optimise (FACE's weighted loss, the CE plus the
    augmented or unlikelihood term) and the plain cross-entropy as ``nll_loss``; a stock criterion
    that logs no ``nll_loss`` logs the cross-entropy as ``loss``. A result.json written before the
    study kept the ``nll_loss`` curve has it read from the run's train.log in ``runs_dir``; [] when
    that is gone too (the run is then left out of the panel, not drawn on the wrong quantity)."""
    curves = res["curves"]
    if curves.get("train_nll"):
        return curves["train_nll"]
    if "nll_loss" not in (res.get("last_train") or {}):
        return curves.get("train_loss") or []
    log = os.path.join(runs_dir, res["run_id"], "train.log")
    if not os.path.isfile(log):
        return []
    with open(log, encoding="utf-8") as f:
        return train_curve(f.read().splitlines(), "nll_loss")


def valid_cross_entropy(res):
    """[(update, validation cross-entropy in bits per token)], from fairseq's logged validation
    perplexity (2 ** nll_loss for every criterion, label smoothing and the plugin's terms left out)."""
    return [(u, math.log2(ppl)) for u, ppl in res["curves"].get("valid_ppl") or []]


def over_seeds(seed_counts, several):
    """What a figure's values are: ``several`` (e.g. "mean over seeds; band: min-max") where runs
    have several seeds, "one seed" where every run has one."""
    counts = [c for c in seed_counts if c]
    if not counts or max(counts) == 1:
        return "one seed"
    if min(counts) == 1:
        return f"{several}; a run of one seed shows that seed"
    return several


def figure_curves(by_name, names, path, panels, styles=None):
    """Learning curves, one panel per (getter of a run's curve, y label, log scale): per run name
    the mean over seeds and a min-max band, in the run's style of the part (``styles``, by
    :func:`study.figure_style.method_styles`; default: of ``names``)."""
    plt = pyplot()
    styles = styles or method_styles(names)
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5))
    axes = [axes] if len(panels) == 1 else list(axes)
    for ax, (get, ylabel, log) in zip(axes, panels):
        for name in names:
            curves = [c for c in (get(r) for r in by_name[name]) if c]
            if not curves:
                continue
            u, mean, lo, hi = seed_band(curves)
            ax.plot(u, mean, label=name, markevery=max(1, len(u) // 8), markersize=4, **styles[name])
            if len(curves) > 1:
                ax.fill_between(u, lo, hi, color=styles[name]["color"], alpha=0.2)
        ax.set_xlabel("update")
        ax.set_ylabel(ylabel)
        if log:
            ax.set_yscale("log")
            log_ticks(ax)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small")
    fig.suptitle(f"learning curves ({over_seeds([len(by_name[n]) for n in names], 'mean over seeds; band: min-max')})")
    return save_study_figure(fig, path)


def figure_group_ppl(summary, names, path, styles=None):
    """Test PPL per frequency group: a run's bars in its colour of the part, the group by hatch
    and shade (:func:`study.figure_style.group_bars`)."""
    plt = pyplot()
    styles = styles or method_styles(names)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(names)), 4.5))
    handles = group_bars(ax, names, {g: [summary[n][f"test_ppl_{g}"] for n in names] for g in GROUPS},
                         [seeds_of(summary, n) for n in names], styles)
    ax.set_yscale("log")
    log_ticks(ax)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set_ylabel("test perplexity (log scale)")
    ax.set_title("test perplexity per frequency group "
                 f"({over_seeds([len(summary[n]['seeds']) for n in names], 'mean ± half range over seeds')})")
    ax.legend(handles=handles, title="group", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return save_study_figure(fig, path)


def figure_frontier(summary, names, groups, path, styles=None):
    """Test PPL against I(W) (headline and the paper's form): every run a point in its style of the
    part, AGG's alpha sweeps joined by grey lines and labelled with their α. A point on another is
    drawn open and larger around it, as the legend's title says; no label covers a point."""
    plt = pyplot()
    styles = styles or method_styles(names)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharey=True)
    drawn = {0: [], 1: []}  # per panel: (name, Line2D) of each point, in drawing order
    for k, (ax, key, label) in enumerate(((axes[0], "isotropy", "I(W), sign-symmetric (headline)"),
                                          (axes[1], "isotropy_raw",
                                           "I(W), AGG paper's form (eigenvector signs by a fixed rule)"))):
        for g1, dashes in (("code", "-"), ("normalized", "--")):
            sweep = [n for _, n in sorted((groups[n]["alpha"], n) for n in names if groups[n].get("g1") == g1)]
            if sweep:
                ax.plot([summary[n][key]["mean"] for n in sweep], [summary[n]["test_ppl"]["mean"] for n in sweep],
                        color="0.6", linestyle=dashes, linewidth=1, zorder=1, label=f"AGG's α sweep, g1 {g1}")
        for n in names:
            x, y = summary[n][key], summary[n]["test_ppl"]
            if x["mean"] is not None and y["mean"] is not None:
                drawn[k].append((n, draw_series(ax, [x["mean"]], [y["mean"]], [seeds_of(summary, n)],
                                                xerr=[x["spread"] or 0], yerr=[y["spread"] or 0], label=n,
                                                markersize=7, zorder=2, **dict(styles[n], linestyle="none"))))
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("test perplexity")
    overlaid = [show_coinciding(ax, [line for _, line in drawn[k]]) for k, ax in enumerate(axes)]
    axes[1].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small",
                   title="open, larger marker:\na point on another" if any(overlaid) else None, title_fontsize="small")
    fig.suptitle("perplexity vs isotropy of the output embedding "
                 f"({over_seeds([len(summary[n]['seeds']) for n in names], 'mean ± half range over seeds')})")
    for k, ax in enumerate(axes):
        label_points(ax, [(*line.get_xydata()[0], f"α={groups[n]['alpha']:g}", styles[n]["color"])
                          for n, line in drawn[k] if groups[n].get("g1")], marks_of([line for _, line in drawn[k]]))
    return save_study_figure(fig, path)


def figure_depth(summary, names, groups, path, spikes=None, styles=None):
    """µTEV, σTEV, test PPL and the largest gradient norm against the depth, one line per variant;
    a panel of gradient-norm spike counts only where some run had one (``spikes``: the settings,
    named in the title). A variant's line is in its style of the part (``styles``; default: of
    the variants)."""
    plt = pyplot()
    panels = [("tev_mu", "µTEV"), ("tev_sigma", "σTEV"), ("test_ppl", "test perplexity"),
              ("max_gnorm", "largest gradient norm")]
    counted = sum((summary[n].get(key) or {}).get("mean") or 0 for n in names for key in ("gnorm_spikes", "loss_spikes"))
    if counted:
        panels.append(("gnorm_spikes", "gradient-norm spikes (count)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.0 * len(panels), 4.2))
    variants = list(dict.fromkeys(groups[n]["method"] for n in names))
    styles = styles or method_styles(variants)
    for ax, (key, ylabel) in zip(axes, panels):
        for v in variants:
            pts = sorted((groups[n]["depth"], n) for n in names if groups[n]["method"] == v)
            draw_series(ax, [d for d, _ in pts], [summary[n][key]["mean"] for _, n in pts],
                        [seeds_of(summary, n) for _, n in pts], yerr=[summary[n][key]["spread"] or 0 for _, n in pts],
                        label=v, **styles[v])
        ax.set_xticks(sorted({groups[n]["depth"] for n in names}))
        ax.set_xlabel("decoder layers")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[-1].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    title = f"by depth ({over_seeds([len(summary[n]['seeds']) for n in names], 'mean ± half range over seeds')})"
    if not counted:
        rule = "" if spikes is None else (f" (a gradient norm above {spikes['gnorm_factor']:g} ×, or a loss above "
                                          f"{spikes['loss_factor']:g} ×, the median of the previous "
                                          f"{spikes['window']} train_inner values)")
        title += f"; no spike in any run{rule}"
    fig.suptitle(title)
    return save_study_figure(fig, path)


# ---------------------------------------------------------------------------- the report


# the legends under the tables (study.parts.Part.notes; the tail part's: study.tail_report.NOTES)
LM_NOTES = ("PPL per sentencepiece token on the test books (fairseq-agg-analyze); valid PPL = fairseq's last "
            "validation. freq / med / rare = the 30 % / 50 % / 20 % most / medium / least frequent types. I(W) = "
            "sign-symmetric isotropy (headline), I(W) paper = the AGG paper's form, over the eigenvectors each "
            "signed so that its largest coordinate is positive (a solver's signs are arbitrary), both of the "
            "output embedding (tied: the shared matrix; untied: the output projection). "
            "ρ = Spearman correlation of word similarity (single-token pairs; sub = all pairs, subword average). "
            "Uniq = distinct tokens in the greedy continuations of test prefixes.")
ALPHA_NOTES = ("AGG at several α (g1 code = the released code, normalized = a_k / α) beside the baseline, "
               "rare-token freezing and CosReg; columns as in the lm part; rare tok = AGG's rare set at the last "
               "update.")
DEPTH_NOTES = ("Narrow models at several depths: baseline vs MLRA (--mlra-init gpt2 and matched). µTEV / σTEV of the "
               "tied embedding; a spike is a train_inner value above factor × the median of the previous window "
               "values.")
MT_NOTES = ("The MT demo: sacreBLEU / chrF on the held-out test pairs (and BLEU per source); rare % = share of the "
            "generated (hyp) and reference (ref) target pieces in the rare frequency group (non-special pieces).")


def part_styles(part, names, groups):
    """The style of every planned run of ``part`` (:func:`study.figure_style.method_styles`): a run
    looks the same in every figure, however many runs have finished; the depth part's runs share
    their method's colour and marker."""
    return method_styles(names, (lambda n: groups[n]["method"]) if part.by_depth else None)


def make_report(part, a, budget, specs, results, out_dir, spikes, invocations, projection=None, data_report=None):
    """WORK/PART/report/: table.md, results.json and the figures of ``part`` (a
    :class:`study.parts.Part`); returns out_dir. ``invocations``: the records of the invocations
    that trained the part's runs (store.py). ``projection(labels, checkpoints, png)``, when given,
    draws the embedding projections of a part with ``projections`` (one panel per method, its first
    seed) into png: the one figure made from checkpoints, not from result.json; it is left out when
    a checkpoint is gone. ``data_report``: the corpus's own (the tail part's, tail_data.data_report),
    for the part's own ``section``."""
    os.makedirs(out_dir, exist_ok=True)
    names, groups = [], {}
    for s in specs:
        if s.name not in groups:
            names.append(s.name)
            groups[s.name] = s.group
    styles = part_styles(part, names, groups)
    by_name = {n: sorted((r for r in results if r["name"] == n), key=lambda r: r["seed"]) for n in names}
    names = [n for n in names if by_name[n]]
    cols = part.columns(metric, results, spikes)
    summary, rows = summarise(part, names, by_name, cols, groups)
    headers = ["run", "seeds"] + [h for _, h, _, _ in cols]
    lines = [f"# Study part `{part.name}`", "",
             f"Budget `{a.budget}`: {budget['updates']} updates per run; {len(results)} finished runs of "
             f"{len(specs)} planned. Cells: mean±h over the seeds (h = half the range); `*`: the difference to "
             "the baseline exceeds h + h_baseline (needs two seeds or more on both sides).", "",
             *(part.tables(headers, rows) if part.tables else [markdown_table(headers, rows)]), "",
             part.notes, ""]
    extra, figures = {}, {}
    if part.convergence:
        conv = {}
        for n in names:
            conv[n] = [convergence(r["curves"]["valid_ppl"], r["updates"]) for r in by_name[n]]
        extra["convergence"] = conv
        base = "baseline" if "baseline" in conv else next((n for n in names if n.startswith("baseline")), None)
        if base is not None:
            changes = [c for c in conv[base] if c is not None]
            if not changes:
                lines.append(f"Convergence: {base} validated too rarely to tell (needs two validations in the last "
                             "fifth of training).")
            else:
                worst = max(abs(c["change"]) for c in changes)
                ok = all(c["converged"] for c in changes)
                lines.append(f"Convergence: the {base} valid PPL changed by at most {100 * worst:.2f} % over the last "
                             f"fifth of training (criterion < 1 %): {'met' if ok else '**NOT MET**: not converged'}.")
            lines.append("")
    if part.uniq:
        refs = [r["metrics"]["uniq"]["uniq_reference"] for r in results if "uniq" in r["metrics"]]
        u = results[0]["metrics"].get("uniq") or {}
        if refs:
            lines.append(f"Uniq: {u.get('prefixes')} test prefixes of {u.get('prefix_len')} tokens, {u.get('length')} "
                         f"greedy tokens each; the reference continuations have {max(refs)} distinct tokens.")
            lines.append("")
    if part.word_similarity:
        ws = results[0]["metrics"].get("word_similarity") or {}
        pairs = [f"{DATASETS.get(stem, stem)} {v['single']['pairs']} single-token / {v['subword']['pairs']} all of "
                 f"{v['total_pairs']}" for stem, v in sorted(ws.items()) if v]
        if pairs:
            lines += ["Word-similarity pairs scored: " + "; ".join(pairs) + ".", ""]
    if part.section:
        more, figures, own = part.section(summary, names, by_name, results, len(specs), a.jobs, data_report, out_dir)
        lines += more
        extra.update(own)
    if part.by_depth:
        extra["spikes"] = {r["run_id"]: run_spikes(r, spikes) for r in results}
        lines.append(f"Spikes: window {spikes['window']}, gnorm factor {spikes['gnorm_factor']}, loss factor "
                     f"{spikes['loss_factor']}.")
        lines.append("")
    run_seconds = sum(r.get("wall_seconds") or 0.0 for r in results)
    trained = "; ".join(f"{r['seconds'] / 60:.1f} min ({r['runs_trained']} run{'' if r['runs_trained'] == 1 else 's'})"
                        for r in invocations)
    lines.append(f"Wall time: {run_seconds / 60:.1f} min of runs (sum over runs, training and evaluation); "
                 f"the invocations that trained them: {trained or 'none recorded'}.")
    if not part.section:  # a part's own section draws its own learning curves
        runs_dir = os.path.dirname(out_dir)
        # the same quantity for every criterion: the plain cross-entropy (a language model's
        # validation as its PPL, log scale), never a criterion's own optimised loss
        valid = ((lambda r: r["curves"].get("valid_ppl") or [], "valid PPL (plain cross-entropy)", True)
                 if part.corpus.language_model else
                 (valid_cross_entropy, "valid cross-entropy\n(nll_loss: no label smoothing; bits/token)", False))
        train = (lambda r: train_cross_entropy(r, runs_dir), "train cross-entropy (nll_loss, bits/token)", False)
        figures["curves"] = figure_curves(by_name, names, os.path.join(out_dir, "learning_curves.png"), [train, valid],
                                          styles)
    if part.group_ppl:
        figures["group_ppl"] = figure_group_ppl(summary, names, os.path.join(out_dir, "group_ppl.png"), styles)
    if part.projections:
        ckpts = [os.path.join(os.path.dirname(out_dir), by_name[n][0]["run_id"], "checkpoint_last.pt") for n in names]
        if projection is not None and all(os.path.isfile(c) for c in ckpts):
            figures["projections"] = projection(names, ckpts, os.path.join(out_dir, "projections.png"))
    if part.frontier:
        figures["frontier"] = figure_frontier(summary, names, groups, os.path.join(out_dir, "frontier.png"), styles)
    if part.by_depth:
        figures["depth"] = figure_depth(summary, names, groups, os.path.join(out_dir, "depth.png"), spikes, styles)
    lines += ["", "Figures: " + ", ".join(os.path.basename(f) for f in figures.values())]
    with open(os.path.join(out_dir, "table.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    write_json(os.path.join(out_dir, "results.json"), {
        "part": part.name, "budget": a.budget, "updates": budget["updates"], "planned_runs": len(specs),
        "finished_runs": len(results), "names": names, "groups": groups, "summary": summary,
        "spike_settings": spikes, **extra, "wall": {"run_seconds": run_seconds, "invocations": invocations},
        "figures": {k: os.path.basename(v) for k, v in figures.items()}, "made": time.time(),
    })
    return out_dir
