"""What a part's table shows: its columns, each (key, header, digits, getter of a run's
result.json), and the legend under it (:class:`study.parts.Part`'s ``columns`` and ``notes``; the
tail part's are in study/tail_tables.py)."""
from examples.lm_demo.wordsim import DATASETS
from study.metrics import count_spikes

GROUPS = ("freq", "med", "rare")


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


# the legends under the tables (study.parts.Part.notes; the tail part's: study.tail_tables.NOTES)
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
