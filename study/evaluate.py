"""A finished run's numbers, the ``evaluate`` of its :class:`study.parts.Part`: fairseq-agg-analyze
(and Uniq where the part has it) for a language model (:func:`analysis_numbers` of its report),
beam search and sacreBLEU for translation, with the frequency groups of the generated tokens
(:func:`generated_group_shares`); the tail part's own: :func:`study.tail.evaluate`. Each is
``evaluate(ctx, spec, budget, directory, checkpoint, log lines)`` -> result.json's "metrics";
``ctx`` is what one invocation of the study shares (study/training.py, ``Context``: the flags
``a``, the child processes' ``env``, each corpus's prepared ``data`` and ``word_sim`` flags,
``eval_dir``).
"""
import os

from examples.lm_demo import run as lm_demo
from examples.mt_demo import run as mt_demo
from study.columns import GROUPS
from study.metrics import group_shares


def uniq_numbers(ctx, spec, data_bin, checkpoint):
    """Uniq of the checkpoint on the test split at the part's settings (on ``ctx``'s threads)."""
    import torch

    from study.uniq import evaluate_uniq

    torch.set_num_threads(ctx.a.threads)
    return evaluate_uniq(checkpoint, data_bin, "test", **spec.part.uniq_settings(ctx.a))


def analyze(ctx, spec, data_bin, directory, checkpoint, flags):
    """The LM demo's fairseq-agg-analyze on the test split, with more of its ``flags``: the report."""
    return lm_demo.analyze([checkpoint], [spec.run_id], data_bin, "test", os.path.join(directory, "analysis"),
                           ctx.env, False, flags)[spec.run_id]


def evaluate_lm(ctx, spec, budget, directory, ckpt, lines):
    """fairseq-agg-analyze on the test split (with the budget's context window and the corpus's
    word lists), and Uniq for a part with ``uniq``."""
    data_bin = ctx.data[spec.corpus.name][0]
    extra = ["--context-window", str(budget["context_window"]), *ctx.word_sim.get(spec.corpus.name, [])]
    # the report draws the projections of all methods in one figure (projection_figure)
    out = {"analysis_flags": extra, **analysis_numbers(analyze(ctx, spec, data_bin, directory, ckpt, extra))}
    if spec.part.uniq:
        out["uniq"] = uniq_numbers(ctx, spec, data_bin, ckpt)
    return out


def evaluate_mt(ctx, spec, budget, directory, ckpt, lines):
    """The MT demo's beam search and sacreBLEU, and the frequency-group shares of the tokens."""
    res = mt_demo.evaluate(spec.run_id, ckpt, ctx.eval_dir, directory, ctx.env, ctx.a.cpu)
    res["valid_nll"] = mt_demo.final_valid_nll(lines)
    res["token_groups"] = generated_group_shares(os.path.join(directory, "generate.out"),
                                                   os.path.join(ctx.eval_dir, "data-bin", "dict.de.txt"))
    return res


def projection_figure(ctx, corpus):
    """make_report's ``projection``: fairseq-agg-analyze --no-ppl on the given checkpoints (with the
    corpus's dictionary, for the frequency groups) draws every one on shared axes; None when the
    data is not there (``--report`` on a copied work directory)."""
    data_bin = corpus.data_bin(ctx.a.work_dir)
    if not os.path.isdir(data_bin):
        return None

    def draw(labels, checkpoints, png):
        out_dir = os.path.splitext(png)[0]
        lm_demo.analyze(checkpoints, labels, data_bin, "test", out_dir, ctx.env, True, ["--no-ppl"])
        os.replace(os.path.join(out_dir, "projection.png"), png)
        return png

    return draw


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
