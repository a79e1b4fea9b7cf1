"""Reference constructions, written for clarity, not speed: the test oracle and benchmark baseline.

``reference_output_loss`` is the official AGG construction (Yu et al. 2022; spec agg.md §4.4, §5.1):
three cross-entropy terms over the same logit values,

* a feature term CE(H sg(W)^T): gradients to the hidden states only, un-gated;
* an embedding term for the contexts with a non-rare target and one for the contexts with a rare
  target, CE(sg(H) W^T) with the logits gated as z~ = G*z + (1-G)*sg(z), so that dz~/dz = G;

with the reference code's bugs fixed (every term pad-masked, the returned value is 1x CE). With a
teacher it adds the augmented loss by its definition, KL(y~ || softmax(z / tau)) from materialised
distributions (spec augmented_loss.md §2.1).
"""
from typing import Optional

import torch
import torch.nn.functional as F

from .fused_linear_loss import TokenGates


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
