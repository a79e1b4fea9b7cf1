"""The tail part's tables and text sections: its columns and two tables (perplexity; embedding
and diversity), the legend, every run's word similarity with its interval, every run's and
seed's convergence (the calibration criterion), the part's wall time at this budget, and the
data (:func:`study.tail_data.data_report`)."""
from typing import List, Optional

from examples.lm_demo.wordsim import DATASETS
from study.columns import GROUPS
from study.harness.tables import markdown_table
from study.metrics import convergence, resolvable_difference, spearman_interval

# the legend under the part's tables
NOTES = ("Word-level LM on the Bibles, Shakespeare and Milton (vocabulary: train count >= 3, else <unk>). PPL per "
         "word or punctuation token on the held-out works and books, scored like fairseq-eval-lm with a context "
         "window; paper freq / med / rare = the AGG paper's groups by frequency rank (its 13,000 / 23,000 / 8,256 "
         "of 44,256 types as fractions of this vocabulary), 30/50/20 = the demo's. I(W) (sign-symmetric), I(W) "
         "paper (eigenvector signs by a fixed rule), TEV and mean cos: the tied embedding. ρ = Spearman's rho "
         "of word similarity over the pairs whose two words are in the vocabulary. Uniq = distinct tokens in "
         "greedy continuations of test prefixes. AGG rare = AGG's rare set at the last update (from the "
         "checkpoint's window; frozen rows for freeze), rare seen % = its share with non-zero window counts, rare "
         "test tok % = its share of the test targets; rare below /epoch and target share % = AGG's operating "
         "point (docs/agg.md): the count per epoch below which a type is rare, and the share of updates in which "
         "a type at that count is a target. freeze-group freezes the static bottom 20 % (30/50/20 groups), not "
         "the AGG rare set these columns show.")


def _percent(key):
    """100 x metrics.agg_window[key], or None."""
    def get(r):
        value = (r["metrics"].get("agg_window") or {}).get(key)
        return None if value is None else 100.0 * value
    return get


def columns(m, results, spikes=None):
    """The tail part's (key, header, digits, getter) columns; ``m(*path)`` reads result["metrics"]
    (the signature of every part's columns, :class:`study.parts.Part`; no spike columns here)."""
    ppl = [("valid_ppl", "valid PPL", 1, m("valid_ppl")), ("test_ppl", "test PPL", 1, m("test_ppl"))]
    ppl += [(f"test_ppl_{g}", f"paper {g}", 1, m(f"test_ppl_{g}")) for g in GROUPS]
    ppl += [(f"test_ppl_demo_{g}", f"30/50/20 {g}", 1, m(f"test_ppl_demo_{g}")) for g in GROUPS]
    emb = [("isotropy", "I(W)", 3, m("isotropy")), ("isotropy_raw", "I(W) paper", 3, m("isotropy_raw")),
           ("tev_mu", "µTEV", 4, m("tev_mu")), ("tev_sigma", "σTEV", 4, m("tev_sigma")),
           ("mean_cos", "mean cos", 3, m("mean_cos"))]
    stems = sorted({s for r in results for s in (r["metrics"].get("word_similarity") or {})})
    emb += [(f"ws_{stem}", f"ρ {DATASETS.get(stem, stem)}", 3, m("word_similarity", stem, "single", "rho"))
            for stem in stems]
    emb += [("uniq", "Uniq", 0, m("uniq", "uniq")), ("agg_rare", "AGG rare", 0, m("agg_window", "rare")),
            ("agg_rare_seen", "rare seen %", 1, _percent("rare_seen_fraction")),
            ("agg_rare_test", "rare test tok %", 2, _percent("rare_target_share")),
            ("agg_rare_below", "rare below /epoch", 3, m("agg_window", "rare_below_per_epoch")),
            ("agg_target_share", "target share %", 3, _percent("target_share")),
            ("train_seconds", "train s", 0, lambda r: r.get("train_seconds"))]
    return ppl + emb


def tables(headers, rows, n_ppl=8):
    """The two markdown tables of the part: perplexity, then embedding and diversity (the first
    two columns, run and seeds, in both)."""
    first = markdown_table(headers[:2 + n_ppl], [r[:2 + n_ppl] for r in rows])
    second = markdown_table(headers[:2] + headers[2 + n_ppl:], [r[:2] + r[2 + n_ppl:] for r in rows])
    return ["### Perplexity", "", first, "", "### Embedding, word similarity, diversity, AGG's rare set", "", second]


def word_similarity_section(names, by_name) -> List[str]:
    """Every run's and seed's rho with its 95 % interval (Fisher z over the pair count), and the
    smallest difference the pair sets can resolve."""
    stems = sorted({s for rs in by_name.values() for r in rs for s in (r["metrics"].get("word_similarity") or {})})
    if not stems:
        return []
    rows, pairs_of = [], {}
    for n in names:
        for r in by_name[n]:
            row = [n, r["seed"]]
            for stem in stems:
                score = ((r["metrics"].get("word_similarity") or {}).get(stem) or {}).get("single") or {}
                rho, pairs = score.get("rho"), score.get("pairs") or 0
                pairs_of[stem] = max(pairs_of.get(stem, 0), pairs)
                ci = spearman_interval(rho, pairs)
                row.append("-" if ci is None else f"{rho:.3f} [{ci[0]:.3f}, {ci[1]:.3f}] ({pairs})")
            rows.append(row)
    resolved = "; ".join(f"{DATASETS.get(stem, stem)} ({pairs_of[stem]} pairs): about "
                         f"{resolvable_difference(pairs_of[stem]):.2f}" for stem in stems
                         if resolvable_difference(pairs_of[stem]) is not None)
    return ["### Word similarity with 95 % intervals", "",
            markdown_table(["run", "seed"] + [f"ρ {DATASETS.get(stem, stem)} [95 %] (pairs)" for stem in stems], rows),
            "", "Interval: Fisher's z = atanh(ρ) with variance 1.06 / (pairs − 3) (Spearman's ρ). Two runs' ρ differ "
            f"beyond 1.96 standard errors of their difference (near ρ = 0, as if independent) only when they differ "
            f"by more than: {resolved}. Smaller differences cannot be resolved by these pair sets.", ""]


# ---------------------------------------------------------------------------- data and calibration


def data_section(report) -> List[str]:
    if not report:
        return ["### Data", "", "(no data report: the data directory WORK/_data/tail is not there)", ""]
    v, rows = report["vocabulary"], []
    for split, s in report["splits"].items():
        rows.append([split, s["lines"], s["tokens"], s["unk"], f"{100 * s['unk_rate']:.2f} %",
                     f"{100 * s['coverage']:.2f} %"])
    lines = ["### Data", "",
             f"Vocabulary ({v['rule']}, fairseq-preprocess --thresholdsrc): {v['size']} entries = {v['types']} types "
             f"+ {v['specials']} specials + {v['madeupwords']} madeupword fillers; the training split has "
             f"{v['train_types']} types, {v['train_types_at_min_count']} of them at least {v['min_train_count']} "
             "times. "
             f"Token coverage over all splits: {100 * report['coverage']:.2f} %.", "",
             markdown_table(["split", "lines", "tokens", "<unk>", "<unk> rate", "coverage"], rows), "",
             "Frequency groups (types): " + "; ".join(
                 f"{name} " + " / ".join(f"{g} {n}" for g, n in sizes.items())
                 for name, sizes in report["groups"].items()) + ".", ""]
    rare = [[f"{r['alpha']:g}", f"{r['count_threshold']:.2f}", r["rare"], r["rare_seen"], r["rare_unseen"],
             "-" if r["rare_seen_fraction"] is None else f"{100 * r['rare_seen_fraction']:.1f} %", r["very_rare"]]
            for r in report["agg_rare_full_window"]]
    lines += ["AGG's rare set over a window of one full epoch (every training target, relative threshold at "
              f"{report['agg_rare_full_window'][0]['ref_tokens']} tokens per update): a type is rare below the "
              "count threshold.", "",
              markdown_table(["α", "count threshold", "rare", "with counts", "never counted", "share with counts",
                              "g2 < 1"], rare), ""]
    return lines


CONVERGENCE_HEADERS = ["run", "seed", "valid PPL", "change", "converged"]


def convergence_section(names, by_name) -> List[str]:
    """Every run's valid PPL change over the last fifth, seed by seed (the calibration criterion)."""
    rows = [[n, r["seed"]] + convergence_cells(run_convergence(r)) for n in names for r in by_name[n]]
    return ["### Convergence of every run (valid PPL over the last fifth of training; criterion |change| < 1 %)", "",
            markdown_table(CONVERGENCE_HEADERS, rows), ""]


def run_convergence(result) -> Optional[dict]:
    """:func:`study.metrics.convergence` of one run's valid PPL."""
    return convergence(result["curves"]["valid_ppl"], result["updates"])


def convergence_cells(c) -> list:
    """The valid PPL, change and converged cells of a :func:`run_convergence` (None: too few validations)."""
    if c is None:
        return ["-", "-", "too few validations"]
    return [f"{c['from']:.2f} → {c['to']:.2f}", f"{100 * c['change']:+.2f} %", "yes" if c["converged"] else "**no**"]


def timing_section(results, planned, jobs) -> List[str]:
    """The mean wall time of the finished runs and what the planned runs take at that rate."""
    walls = [r.get("wall_seconds") for r in results if r.get("wall_seconds")]
    if not walls:
        return []
    mean = sum(walls) / len(walls)
    return [f"Per run: {mean / 60:.1f} min of wall time on average (training and evaluation, {len(walls)} runs); "
            f"the {planned} planned runs at that rate on {jobs} lane(s): about {planned * mean / jobs / 3600:.1f} h.",
            ""]
