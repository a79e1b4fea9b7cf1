"""The Hugging Face demo's numbers of one trained model, computed by the analysis code of
``fairseq-agg-analyze`` (what the LM demo's table reads): perplexity in total and per frequency
group of the target token (:func:`fairseq_agg.analysis.perplexity.group_nll_sums`), and µTEV, σTEV,
mean cosine and isotropy I(W) of the tied embedding, over all rows and per group
(:func:`fairseq_agg.analysis.analyze.matrix_report`, with the same row rule and 30 % / 50 % / 20 %
groups as the fairseq demo).

A split is scored in the training blocks of 128 tokens, each block on its own: a token is
predicted from the tokens before it in its block (the model's own label shift, so a block's first
token is context only); the padded tail of the last block is not scored.
"""
import torch

from fairseq_agg.analysis.analyze import matrix_report
from fairseq_agg.analysis.perplexity import group_nll_sums, perplexity
from fairseq_agg.stats import groups as G


@torch.no_grad()
def token_nll(model, rows, pad, batch_rows=32):
    """(the NLL in nats of every scored token of ``rows``, its target id), from the model's logits
    (the forward without labels, which ``apply`` leaves as it is), softmax in fp32."""
    model.eval()
    device = next(model.parameters()).device
    nlls, targets = [], []
    for batch in rows.split(batch_rows):
        batch = batch.to(device)
        logits = model(input_ids=batch).logits[:, :-1].float()
        target = batch[:, 1:]
        nll = -torch.log_softmax(logits, dim=-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
        scored = target != pad
        nlls.append(nll[scored].cpu())
        targets.append(target[scored].cpu())
    return torch.cat(nlls), torch.cat(targets)


def split_perplexity(model, rows, vocabulary):
    """{"total": ppl, "freq": ppl, "med": ppl, "rare": ppl, "tokens": n} of a split."""
    nll, target = token_nll(model, rows, vocabulary.pad())
    groups = G.frequency_groups(vocabulary)
    sums, counts = group_nll_sums(nll, target, G.group_lookup(groups, len(vocabulary)), len(groups))
    out = {"total": perplexity(float(nll.double().sum()), nll.numel()), "tokens": int(nll.numel())}
    out.update({g: perplexity(float(sums[k]), float(counts[k])) for k, g in enumerate(groups)})
    return out


def embedding_numbers(model, vocabulary):
    """The fairseq demo's matrix report of the tied embedding: {"all": {...}, "groups": {...}}."""
    weight = model.get_input_embeddings().weight.detach().float().cpu()
    report, _ = matrix_report(weight, vocabulary)
    return report


def table_row(valid, test, report, train_seconds):
    """The keys of the LM demo's table (examples/lm_demo/run.py, ``COLUMNS``) that this demo fills."""
    row = {"valid_ppl": valid["total"], "test_ppl": test["total"], "train_seconds": train_seconds}
    for g in G.GROUP_NAMES:
        row[f"valid_ppl_{g}"], row[f"test_ppl_{g}"] = valid[g], test[g]
        row[f"isotropy_{g}"] = (report["groups"] or {}).get(g, {}).get("isotropy")
    row.update({k: report["all"][k] for k in ("isotropy", "tev_mu", "tev_sigma", "mean_cos")})
    return row
