"""The tail part's report (docs/study.md, "Part tail"): the section that :func:`study.report.make_report`
adds for it (:func:`section`), from the finished runs' result.json files and the data report alone.

* the claims table (study/tail_claims.py);
* every run's word similarity with its interval, convergence of every run and seed, the part's wall
  time at this budget, and the data: vocabulary, coverage and ``<unk>`` rate per split, the
  frequency groups, and AGG's rare set at a window of one full epoch (study/tail_tables.py, which
  also holds the part's columns and two tables);
* the figures (study/tail_figures.py): learning curves with one panel per group of methods, test
  PPL per frequency group under both groupings, the size of AGG's rare set over training, and
  isotropy against the rare set.

With ``--compare-budget``, the comparison with the same runs at another budget is
study/tail_budget.py's.
"""
import os

from study.report import Report, Section
from study.tail_claims import claims, claims_table
from study.tail_figures import figure_curves, figure_group_ppl, figure_isotropy_vs_rare, figure_rare_set, tail_styles
from study.tail_tables import convergence_section, data_section, timing_section, word_similarity_section


def section(r: Report) -> Section:
    """The tail part's own lines of table.md, figures (its learning curves included) and
    results.json entries (claims, the data report, AGG's window of every run)."""
    found = claims(r.summary)
    lines = claims_table(found) + word_similarity_section(r.names, r.by_name) + convergence_section(r.names, r.by_name)
    lines += timing_section(r.results, r.planned, r.a.jobs) + data_section(r.data_report)
    groups = (r.data_report or {}).get("groups")
    styles = tail_styles(r.names)  # one per run for every figure below
    figures = {"curves": figure_curves(r.by_name, r.names, os.path.join(r.out_dir, "learning_curves.png"),
                                       os.path.dirname(r.out_dir), styles),
               "group_ppl": figure_group_ppl(r.summary, r.names, os.path.join(r.out_dir, "group_ppl.png"), groups,
                                             styles)}
    rare = figure_rare_set(r.by_name, r.names, os.path.join(r.out_dir, "agg_rare.png"), styles)
    if rare:
        figures["agg_rare"] = rare
    static = (groups or {}).get("demo", {}).get("rare")  # the 30/50/20 rare group
    iso = figure_isotropy_vs_rare(r.by_name, r.names, os.path.join(r.out_dir, "isotropy_vs_rare.png"), static, styles)
    if iso:
        figures["isotropy_vs_rare"] = iso
    windows = {res["run_id"]: res["metrics"].get("agg_window") for res in r.results}
    return Section(lines, figures, {"claims": found, "data": r.data_report, "agg_window": windows})
