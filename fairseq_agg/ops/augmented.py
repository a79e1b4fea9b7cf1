"""Teacher distribution of the augmented loss (Inan et al., ICLR 2017, eq. 3.6-3.7).

For a target word y the teacher is softmax(E e_y / tau): the word's inner products with every row
of the (unscaled) input embedding E, tempered. It depends only on the target *type*, so it is built
once per unique target of a batch (spec augmented_loss.md §5, Trick 1), never per token.
"""
from typing import Optional, Sequence

import torch

from .fused_linear_loss import TeacherTargets, _block_rows, _row_dot

SCALES = ("none", "tau", "tau2")
MASKED_LOGIT = -1e30


def aug_scale_factor(scale: str, tau: float) -> float:
    """s(tau) in J = CE + alpha * s(tau) * KL (augmented_loss.md §2.5)."""
    if scale == "none":
        return 1.0
    if scale == "tau":
        return float(tau)
    if scale == "tau2":
        return float(tau) ** 2
    raise ValueError(f"unknown augmented-loss scale {scale!r} (choose from {', '.join(SCALES)})")


@torch.no_grad()
def build_teacher(
    embedding: torch.Tensor,
    target: torch.Tensor,
    tau: float,
    coef: float,
    masked_columns: Optional[Sequence[int]] = None,
    gate_with_agg: bool = False,
) -> TeacherTargets:
    """Detached per-type teacher for the (pad-free) targets.

    Args:
        embedding: (V, d) unscaled input-embedding rows (the paper's L^T).
        target: (N,) target ids.
        tau: temperature (> 0), the same on both sides of the KL.
        coef: alpha * s(tau), the weight of the KL in the loss.
        masked_columns: ids that get no teacher mass (pad, madeupword rows, ...).
    """
    uniq, inverse = torch.unique(target, return_inverse=True)
    logits = embedding.index_select(0, uniq) @ embedding.t()
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()  # softmax and entropy in fp32 under fp16/bf16 (spec §7)
    logits.mul_(1.0 / tau)
    if masked_columns is not None and len(masked_columns):
        # a large finite logit instead of -inf: the masked columns get exactly 0 mass and
        # 0 * log p stays 0 in the entropy, without extra masking temporaries
        cols = torch.as_tensor(list(masked_columns), dtype=torch.long, device=logits.device)
        logits.index_fill_(1, cols, MASKED_LOGIT)
    # In place, block by block (no second n_u x V tensor): x = s - max s, p = exp(x) / Z, and
    # H = -sum p log p = log Z - sum exp(x) x / Z.
    logits.sub_(logits.amax(dim=1, keepdim=True))
    weighted = torch.empty(logits.size(0), dtype=logits.dtype, device=logits.device)
    step = _block_rows(logits.device, logits.size(1), logits.dtype, logits.size(0))
    for b in range(0, logits.size(0), step):
        x = logits[b : b + step]
        e = torch.exp(x)
        weighted[b : b + step] = _row_dot(e, x)
        x.copy_(e)
    probs = logits
    norm = probs.sum(dim=-1)
    probs.mul_(norm.reciprocal().unsqueeze(1))
    entropy = norm.log() - weighted / norm
    return TeacherTargets(
        probs=probs, entropy=entropy, index=inverse, tau=float(tau), coef=float(coef), gate_with_agg=gate_with_agg
    )
