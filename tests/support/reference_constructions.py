"""Reference constructions, written for clarity, not speed: the test oracle and benchmark baseline.

The tests' oracle, which the benchmark (scripts/bench_criterion.py) and the GPU check
(scripts/gpu_check.py) also time and check the fused layer against. One copy, in tests/support/,
outside the installed package; tests/support/output_layer_problem.py says how each side imports it.

``reference_output_loss`` is the AGG construction of the released code (Yu et al. 2022; docs/agg.md):
three cross-entropy terms over the same logit values,

* a feature term CE(H sg(W)^T): gradients to the hidden states only, un-gated;
* an embedding term for the contexts with a non-rare target and one for the contexts with a rare
  target, CE(sg(H) W^T) with the logits gated as z~ = G*z + (1-G)*sg(z), so that dz~/dz = G;

with the reference code's bugs fixed (every term pad-masked, the returned value is 1x CE). With a
teacher it adds the augmented loss by its definition, KL(y~ || softmax(z / tau)) from materialised
distributions (Inan et al. 2017, eq. 3.2; docs/augmented_loss.md).
"""
from typing import Optional

import torch
import torch.nn.functional as F

from fairseq_agg.ops.agg import TokenGates


def smoothed_nll(logits, target, epsilon):
    """Summed label-smoothed NLL in fairseq's convention, and the summed plain NLL."""
    lprobs = F.log_softmax(logits.float(), dim=-1)
    nll = -lprobs.gather(1, target.unsqueeze(1)).squeeze(1)
    if epsilon == 0:
        return nll.sum(), nll.sum()
    eps_i = epsilon / (lprobs.size(-1) - 1)
    smooth = -lprobs.sum(dim=-1)
    return ((1.0 - epsilon - eps_i) * nll + eps_i * smooth).sum(), nll.sum()


def gate_matrix(target, gates: TokenGates):
    """Gamma (N x V): g1 rows for non-rare targets, g2 rows for rare targets, 1 in the target column."""
    rare_target = gates.rare[target]
    gamma = torch.where(rare_target.unsqueeze(1), gates.g2.unsqueeze(0), gates.g1.unsqueeze(0)).clone()
    gamma.scatter_(1, target.unsqueeze(1), 1.0)
    return gamma


def kl_to_teacher(logits, teacher_probs, tau):
    """Summed KL(teacher || softmax(logits / tau)) by definition (0 log 0 = 0)."""
    log_q = F.log_softmax(logits.float() / tau, dim=-1)
    log_p = torch.where(teacher_probs > 0, teacher_probs.log(), torch.zeros_like(teacher_probs))
    return (teacher_probs * (log_p - log_q)).sum()


def reference_teacher(embedding, target, tau, masked_columns=None):
    """Materialised N x V teacher softmax(E e_y / tau), detached."""
    with torch.no_grad():
        logits = (embedding[target] @ embedding.t()).float() / tau
        if masked_columns:
            logits[:, list(masked_columns)] = float("-inf")
        return torch.softmax(logits, dim=-1)


def reference_output_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    epsilon: float = 0.0,
    gates: Optional[TokenGates] = None,
    teacher_probs: Optional[torch.Tensor] = None,
    tau: float = 1.0,
    coef: float = 0.0,
    gate_aug_with_agg: bool = False,
):
    """Returns (loss, nll, kl) like :func:`fairseq_agg.ops.fused_linear_loss.fused_linear_loss`."""
    # Feature term: hidden-state gradients, W held constant.
    z_feat = hidden @ weight.detach().t()
    loss_feat, nll = smoothed_nll(z_feat, target, epsilon)
    kl = torch.zeros((), dtype=torch.float32, device=hidden.device)
    if teacher_probs is not None:
        kl_feat = kl_to_teacher(z_feat, teacher_probs, tau)
        loss_feat = loss_feat + coef * kl_feat
        kl = kl_feat.detach()

    # Embedding terms: output-embedding gradients, H held constant.
    z_emb = hidden.detach() @ weight.t()
    if gates is not None:
        gamma = gate_matrix(target, gates).to(z_emb.dtype)
        z_gated = gamma * z_emb + (1.0 - gamma) * z_emb.detach()
        rare_target = gates.rare[target]
        loss_nr, _ = smoothed_nll(z_gated[~rare_target], target[~rare_target], epsilon)
        loss_r, _ = smoothed_nll(z_gated[rare_target], target[rare_target], epsilon)
        loss_emb = loss_nr + loss_r
    else:
        z_gated = z_emb
        loss_emb, _ = smoothed_nll(z_emb, target, epsilon)
    if teacher_probs is not None:
        loss_emb = loss_emb + coef * kl_to_teacher(z_gated if gate_aug_with_agg else z_emb, teacher_probs, tau)

    # Value of the feature term only (1x the loss), gradients of both.
    loss = loss_feat + (loss_emb - loss_emb.detach())
    return loss, nll.detach(), kl


# --- the degeneration baselines of docs/baselines.md, each from its formula on materialised logits


def frozen_rows(weight, rare):
    """``weight`` with the rows in ``rare`` (bool, V) held constant: rare-token freezing (AGG paper
    §3, Table 1) as the output projection sees it; a tied input lookup still trains every row."""
    return torch.where(rare.unsqueeze(1), weight.detach(), weight)


def reference_cosreg(weight, rows=None, normalizer="paper"):
    """Gao et al. (ICLR 2019) §5: (1 / Z) sum_{i != j} cos(w_i, w_j) over the selected non-zero rows,
    from the explicit N x N cosine matrix; Z = N^2 ("paper") or N (N - 1) ("pairs")."""
    w = weight if rows is None else weight[rows]
    w = w[w.detach().norm(dim=1) >= 1e-12]
    unit = w / w.norm(dim=1, keepdim=True)
    cos = unit @ unit.t()
    n = w.size(0)
    off_diagonal = cos.sum() - cos.diagonal().sum()
    return off_diagonal / (n * n if normalizer == "paper" else n * (n - 1))


def smoothed_nll_per_token(logits, target, epsilon):
    """Per-token label-smoothed NLL in fairseq's convention."""
    lprobs = F.log_softmax(logits.float(), dim=-1)
    nll = -lprobs.gather(1, target.unsqueeze(1)).squeeze(1)
    if epsilon == 0:
        return nll
    eps_i = epsilon / (lprobs.size(-1) - 1)
    return (1.0 - epsilon - eps_i) * nll + eps_i * (-lprobs.sum(dim=-1))


def reference_face_weights(counts, target, logits, weighing):
    """FACE's per-token weights by the released code's definitions, with plain loops over the
    vocabulary: pre = V u_k / sum u with u_k = 1 - RF_k / max RF; post = 1 + max(0, f[argmax] - f[y]) / sum f."""
    f = [float(c) for c in counts.tolist()]
    total = sum(f)
    if weighing == "pre":
        if total == 0:
            return torch.ones(target.numel())
        rf = [c / total for c in f]
        u = [1.0 - r / max(rf) for r in rf]
        return torch.tensor([len(f) * u[int(y)] / sum(u) for y in target])
    predicted = logits.argmax(dim=1)
    return torch.tensor([1.0 + max(0.0, f[int(p)] - f[int(y)]) / max(total, 1.0) for p, y in zip(predicted, target)])


def reference_face_loss(hidden, weight, target, epsilon, row_weight):
    """(sum_n w_n CE_n, summed plain NLL) on materialised logits; CE label-smoothed, w without gradient."""
    logits = hidden @ weight.t()
    per_token = smoothed_nll_per_token(logits, target, epsilon)
    _, nll = smoothed_nll(logits, target, 0.0)
    return (row_weight.to(per_token.dtype) * per_token).sum(), nll.detach()


def reference_candidate_sets(target, pad):
    """Welleck et al. (ICLR 2020) §5.1 by the letter, per sequence: C_t = {y_j : j < t} minus {y_t},
    padding excluded; one Python set per position (None for a padding target)."""
    sets = []
    for row in target.tolist():
        row_sets = []
        for t, y in enumerate(row):
            row_sets.append(None if y == pad else {c for c in row[:t] if c != pad and c != y})
        sets.append(row_sets)
    return sets


def reference_unlikelihood_loss(hidden, weight, target, pad, alpha, epsilon=0.0, clamp=1e-5):
    """CE + alpha * sum_{c in C_t} -log(max(1 - p_c, clamp)) over the non-padding positions of the
    (B, T) ``target``, with ``hidden`` (B*T, d); the candidates as a dense N x V mask.

    Returns (loss, nll, ul): the differentiable total and the summed NLL and UL (no gradient)."""
    sets = reference_candidate_sets(target, pad)
    flat = target.reshape(-1)
    keep = flat.ne(pad)
    logits = hidden[keep] @ weight.t()
    mask = torch.zeros(logits.shape, dtype=torch.bool)
    row = 0
    for row_sets in sets:
        for candidates in row_sets:
            if candidates is None:
                continue
            for c in candidates:
                mask[row, c] = True
            row += 1
    probs = torch.softmax(logits.float(), dim=-1)
    ul_terms = torch.where(mask, -torch.log(torch.clamp(1.0 - probs, min=clamp)), torch.zeros_like(probs))
    ul = ul_terms.sum()
    ce, nll = smoothed_nll(logits, flat[keep], epsilon)
    return ce + alpha * ul, nll.detach(), ul.detach()
