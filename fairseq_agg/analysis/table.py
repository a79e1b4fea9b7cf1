"""The comparison table of ``fairseq-agg-analyze`` (``table.md``, printed, and report.json's
``"table"``): one row per checkpoint and matrix, the statistics' columns, then those of the
perplexity, word similarity and AGG's window where any checkpoint has them."""
import math

from fairseq_agg.stats import groups as G
from fairseq_agg.stats.metrics import ISOTROPY_FORMS

# the statistics of a set of rows, in report.json and as the table's first columns
METRIC_KEYS = ("tev_mu", "tev_sigma", "tev_mu_over_init", "mean_cos") + ISOTROPY_FORMS


def cell_text(v):
    """A number in one format: fixed-point, 4 significant digits (0.0001234, 0.5000, 13.27, 11026),
    never an exponent; ``-`` for none."""
    if v is None:
        return "-"
    if isinstance(v, float):
        if not math.isfinite(v) or v == 0.0:
            return f"{v:.4f}"
        return f"{v:.{max(0, 3 - math.floor(math.log10(abs(v))))}f}"
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


# table.md's header and legend line of each of build_table's keys (report.json keeps the keys);
# the names are docs/stats.md's
GROUP_WORDS = {"freq": "frequent", "med": "medium", "rare": "rare"}
HEADERS = {
    "label": ("checkpoint", "its --labels entry, else its file"),
    "matrix": ("matrix", "the embedding matrix (dec, enc, out; tied matrices once)"),
    "tev_mu": ("µTEV", "mean token-embedding variability"), "tev_sigma": ("σTEV", "its spread over the rows"),
    "tev_mu_over_init": ("µTEV / init std", "µTEV over fairseq's initial std d^-½ (≈ 1 at init)"),
    "mean_cos": ("mean cos", "mean pairwise cosine of the rows (lower: more isotropic)"),
    "isotropy": ("I(W)", "isotropy, 0 to 1 (higher: the directions used more evenly)"),
    "isotropy_raw": ("I(W) paper's form", "I(W) with each direction signed by its largest coordinate"),
    "isotropy_fixed": ("I(W) sign-fixed", "I(W) with each direction turned towards the mean row"),
    **{f"isotropy_{g}": (f"I(W) {g}", f"I(W) of the {w} group's rows") for g, w in GROUP_WORDS.items()},
    "mean_norm_share": ("mean norm share", "‖mean row‖ / mean ‖row‖"),
    "drift_frequent": ("drift frequent", "mean projection of the frequent half's rows on the mean direction"),
    "drift_rare": ("drift rare", "the same for the rare half"),
    "isotropy_centred": ("I(W) centred", "I(W) of the rows less their mean"),
    "ppl": ("PPL", "perplexity of --split"),
    **{f"ppl_{g}": (f"PPL {g}", f"perplexity of the {w} group's target tokens") for g, w in GROUP_WORDS.items()},
    "agg_rare": ("AGG rare", "the types AGG's window marks rare at the checkpoint"),
    "agg_rare_below_per_epoch": ("AGG rare below / epoch", "the count per epoch below which a type is rare"),
    "agg_target_share": ("AGG target share", "the most a type at that count is a target, as a share of the updates"),
}


def header_of(key):
    """(header, legend text) of a column; a word-similarity column ws_STEM[_sub] names its list."""
    if key.startswith("ws_") and key not in HEADERS:
        sub = key.endswith("_sub")
        stem = key[3:-4] if sub else key[3:]
        return (f"{stem}{' sub' if sub else ''} ρ (pairs)",
                "Spearman's ρ against the list (pairs scored)" + ("; words averaged over their pieces" if sub else ""))
    return HEADERS.get(key, (key, key))


def table_markdown(table):
    """table.md: readable headers, every number in :func:`cell_text`'s format, and a legend."""
    named = [header_of(key) for key in table["columns"]]
    lines = ["| " + " | ".join(h for h, _ in named) + " |", "|" + "---|" * len(named)]
    lines += ["| " + " | ".join(cell_text(v) for v in row) + " |" for row in table["rows"]]
    lines += ["", "Legend (docs/stats.md; report.json has every number at full precision under its key):", ""]
    lines += [f"* {h} (`{key}`): {text}" for key, (h, text) in zip(table["columns"], named)]
    lines += ["* numbers: fixed-point, 4 significant digits; `-`: not measured"]
    return "\n".join(lines) + "\n"
