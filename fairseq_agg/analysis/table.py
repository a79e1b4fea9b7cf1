"""The comparison table of ``fairseq-agg-analyze`` (``table.md``, printed, and report.json's
``"table"``): one row per checkpoint and matrix, the statistics' columns, then those of the
perplexity, word similarity and AGG's window where any checkpoint has them."""
from fairseq_agg.stats import groups as G
from fairseq_agg.stats.metrics import ISOTROPY_FORMS

# the statistics of a set of rows, in report.json and as the table's first columns
METRIC_KEYS = ("tev_mu", "tev_sigma", "tev_mu_over_init", "mean_cos") + ISOTROPY_FORMS


def cell_text(v):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def word_sim_cell(score):
    """``ρ (pairs)`` of one word-similarity score, e.g. ``0.312 (120)``; ``- (0)`` without ρ."""
    rho = "-" if score["rho"] is None else f"{score['rho']:.3f}"
    return f"{rho} ({score['pairs']})"


# AGG's operating point at the checkpoint (agg_window.py): the rare set's size, the count per
# epoch below which a type is rare, and the share of updates in which a type at that count is a target
AGG_COLUMNS = {"agg_rare": "rare", "agg_rare_below_per_epoch": "rare_below_per_epoch",
               "agg_target_share": "target_share"}


# the drift along the mean direction in the table (report.json has all of DRIFT_KEYS)
DRIFT_COLUMNS = ("mean_norm_share", "drift_frequent", "drift_rare", "isotropy_centred")


def build_table(reports):
    cols = ["label", "matrix"] + list(METRIC_KEYS) + [f"isotropy_{g}" for g in G.GROUP_NAMES]
    with_drift = any(m.get("drift") for r in reports for m in r["matrices"].values())
    if with_drift:
        cols += list(DRIFT_COLUMNS)
    with_ppl = any(r.get("ppl") for r in reports)
    if with_ppl:
        cols += ["ppl"] + [f"ppl_{g}" for g in G.GROUP_NAMES]
    word_sim_files = next((list(r["word_similarity"]) for r in reports if r.get("word_similarity")), [])
    for stem in word_sim_files:
        cols += [f"ws_{stem}", f"ws_{stem}_sub"]
    with_agg = any(r.get("agg") for r in reports)
    if with_agg:
        cols += list(AGG_COLUMNS)
    rows = []
    for r in reports:
        for name, m in r["matrices"].items():
            row = [r["label"], name] + [m["all"].get(k) for k in METRIC_KEYS]
            row += [(m["groups"] or {}).get(g, {}).get("isotropy") for g in G.GROUP_NAMES]
            if with_drift:
                row += [(m.get("drift") or {}).get(k) for k in DRIFT_COLUMNS]
            if with_ppl:
                p = r.get("ppl") or {}
                row += [(p.get("total") or {}).get("ppl")]
                row += [((p.get("groups") or {}).get(g) or {}).get("ppl") for g in G.GROUP_NAMES]
            for stem in word_sim_files:
                score = r["word_similarity"][stem][name]
                row += [word_sim_cell(score["single"]), word_sim_cell(score["subword"])]
            if with_agg:
                row += [(r.get("agg") or {}).get(key) for key in AGG_COLUMNS.values()]
            rows.append(row)
    return {"columns": cols, "rows": rows}


def table_markdown(table):
    lines = ["| " + " | ".join(table["columns"]) + " |", "|" + "---|" * len(table["columns"])]
    lines += ["| " + " | ".join(cell_text(v) for v in row) + " |" for row in table["rows"]]
    return "\n".join(lines) + "\n"
