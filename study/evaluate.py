"""A finished run's numbers, the ``evaluate`` of its :class:`study.parts.Part`: fairseq-agg-analyze
(and Uniq where the part has it) for a language model, beam search and sacreBLEU for translation
(the tail part's own: :func:`study.tail.evaluate`). Each is
``evaluate(ctx, spec, budget, directory, checkpoint, log lines)`` -> result.json's "metrics";
``ctx`` is what one invocation of study/run.py shares (its ``Context``: the flags ``a``, the
child processes' ``env``, each corpus's prepared ``data`` and ``word_sim`` flags, ``eval_dir``).
"""
import os

from examples.lm_demo import run as lm_demo
from examples.mt_demo import run as mt_demo
from study import report as R


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
    out = {"analysis_flags": extra, **R.analysis_numbers(analyze(ctx, spec, data_bin, directory, ckpt, extra))}
    if spec.part.uniq:
        out["uniq"] = uniq_numbers(ctx, spec, data_bin, ckpt)
    return out


def evaluate_mt(ctx, spec, budget, directory, ckpt, lines):
    """The MT demo's beam search and sacreBLEU, and the frequency-group shares of the tokens."""
    res = mt_demo.evaluate(spec.run_id, ckpt, ctx.eval_dir, directory, ctx.env, ctx.a.cpu)
    res["valid_nll"] = mt_demo.final_valid_nll(lines)
    res["token_groups"] = R.generated_group_shares(os.path.join(directory, "generate.out"),
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
