"""The augmented loss of Inan, Khosravi & Socher (ICLR 2017), its math in one place; pure torch.

    J = CE + alpha * s(tau) * KL(y~ || y^),   y^ = softmax(W h / tau),   y~ = softmax(E e_y / tau)

(eq. 3.1-3.3 and 3.6-3.7 of arXiv 1611.01462v1; s(tau) and every default: docs/augmented_loss.md).

* :func:`aug_scale_factor`: s(tau);
* :func:`build_teacher`: the *detached* teacher y~, built once per unique target type of a batch
  (it depends on the type only), as a :class:`TeacherTargets` that the fused output layer
  (:mod:`fairseq_agg.ops.fused_linear_loss`) evaluates chunk by chunk through
  :meth:`TeacherTargets.block_kl` and :meth:`TeacherTargets.block_grad_`;
* :func:`augmented_kl_direct`: the *non-detached* variant, where gradients also flow into E
  through y~, as its own chunked autograd Function.
"""
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .fused_linear_loss import block_rows, check_output_layer_inputs, loss_dtype, row_dot

SCALES = ("none", "tau", "tau2")
MASKED_LOGIT = -1e30


def aug_scale_factor(scale: str, tau: float) -> float:
    """s(tau) in J = CE + alpha * s(tau) * KL (docs/augmented_loss.md, "The loss")."""
    if scale == "none":
        return 1.0
    if scale == "tau":
        return float(tau)
    if scale == "tau2":
        return float(tau) ** 2
    raise ValueError(f"unknown augmented-loss scale {scale!r} (choose from {', '.join(SCALES)})")


# --- the detached teacher, evaluated inside the fused output layer -------------------------------


@dataclass
class TeacherTargets:
    """Augmented-loss teacher (eq. 3.7) for the unique targets of a batch.

    ``probs[u]`` is softmax(E e_u / tau) for the u-th unique target type (fp32, detached),
    ``entropy[u]`` its entropy, and ``index[n]`` the row of ``probs`` for token n.
    ``coef`` is alpha * s(tau); ``gate_with_agg`` also applies the AGG gates to the AL part of dW.
    """

    probs: torch.Tensor
    entropy: torch.Tensor
    index: torch.Tensor
    tau: float
    coef: float
    gate_with_agg: bool = False

    def block_kl(self, z, row_max, rows: slice, teacher_out, tempered_out):
        """Per-token KL(y~ || softmax(z / tau)) of a block of logit rows ``z`` (left unchanged).

        Uses KL = lse(z / tau) - y~.z / tau - H(y~), exact and without a log of y~. ``row_max`` is
        max_k z (max z / tau = max(z) / tau, so it serves both softmaxes); ``rows`` the block's
        token positions. Fills ``teacher_out`` with the teacher rows of those tokens and
        ``tempered_out`` with exp((z - max z) / tau); returns the KL and the row sums of the latter.
        """
        index = self.index[rows]
        if self.probs.dtype == teacher_out.dtype:
            torch.index_select(self.probs, 0, index, out=teacher_out)
        else:
            teacher_out.copy_(self.probs.index_select(0, index))
        teacher_dot = row_dot(teacher_out, z)
        inv_tau = 1.0 / self.tau
        torch.add(row_max * -inv_tau, z, alpha=inv_tau, out=tempered_out)
        tempered_out.exp_()
        tempered_sum = tempered_out.sum(dim=-1)
        lse_tau = row_max.squeeze(1) * inv_tau + tempered_sum.log()
        kl = lse_tau - teacher_dot * inv_tau - self.entropy.index_select(0, index)
        return kl, tempered_sum

    def block_grad_(self, tempered, tempered_sum, teacher_rows):
        """Turns ``tempered`` (from :meth:`block_kl`) into coef * dKL/dz = coef (y^ - y~) / tau (eq. 3.4)."""
        scale = self.coef * (1.0 / self.tau)
        tempered.mul_((scale / tempered_sum).unsqueeze(1)).sub_(teacher_rows, alpha=scale)


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
        logits = logits.float()  # softmax and entropy in fp32 under fp16/bf16
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
    step = block_rows(logits.device, logits.size(1), logits.dtype, logits.size(0))
    for b in range(0, logits.size(0), step):
        x = logits[b : b + step]
        e = torch.exp(x)
        weighted[b : b + step] = row_dot(e, x)
        x.copy_(e)
    probs = logits
    norm = probs.sum(dim=-1)
    probs.mul_(norm.reciprocal().unsqueeze(1))
    entropy = norm.log() - weighted / norm
    return TeacherTargets(
        probs=probs, entropy=entropy, index=inverse, tau=float(tau), coef=float(coef), gate_with_agg=gate_with_agg
    )


# --- the non-detached teacher (--no-aug-detach-target) -----------------------------------------
#
#     KL_t = sum_i y~_ti (log y~_ti - log y^_ti),   y^_t = softmax(W h_t / tau),
#     y~_t = softmax(s_t / tau),   s_ti = <e_{y_t}, e_i>   (E unscaled)
#
# with the gradients (docs/augmented_loss.md, "Non-detached teacher"):
#
# * through the model logits z = W h:   dKL/dz = (y^ - y~) / tau   (eq. 3.4);
# * through the teacher logits s:        dKL/ds = (1 / tau) y~ * [(log y~ - log y^) - KL];
#   chained to E twice, since s_ti = <e_{y_t}, e_i>: row i receives sum_t dKL/ds_ti * e_{y_t}, and
#   the target row y_t receives sum_i dKL/ds_ti * e_i (a scatter-add over the target ids).
#
# Everything is formed chunk by chunk over the tokens, so memory is O(chunk x V) (the teacher rows
# of a chunk are recomputed from E for its tokens; there is no tokens x V tensor). Only the KL is
# computed here: the criterion adds it to the CE of the fused layer, which leaves the AL part of
# the output-embedding gradient un-gated under AGG.


def _chunk_kl(h, y, weight, embedding, tau, masked, acc):
    """Per-token KL of a chunk and the pieces its gradients need, in ``acc`` (fp32 or fp64)."""
    log_q = torch.log_softmax((h @ weight.t()).to(acc) / tau, dim=-1)  # log y^ (never masked)
    u = embedding.index_select(0, y)  # e_{y_t}: the embedding of the word being predicted (eq. 3.6)
    s = (u @ embedding.t()).to(acc) / tau
    if masked is not None:
        s.index_fill_(1, masked, float("-inf"))  # masked columns get no teacher mass, in y~ only
    log_p = torch.log_softmax(s, dim=-1)
    p = log_p.exp()
    diff = torch.where(p > 0, log_p - log_q, torch.zeros_like(log_p))  # 0 log 0 = 0
    kl = (p * diff).sum(dim=-1)
    return kl, log_q, p, diff, u


class _DirectAugmentedKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, embedding, target, tau, masked, chunk_size, compute_grad):
        need_h, need_w, need_e = ctx.needs_input_grad[:3]
        need_any = compute_grad and (need_h or need_w or need_e)
        acc = loss_dtype(hidden, weight, embedding)
        opts = dict(dtype=acc, device=hidden.device)
        grad_h = torch.zeros(hidden.shape, **opts) if need_any and need_h else None
        grad_w = torch.zeros(weight.shape, **opts) if need_any and need_w else None
        grad_e = torch.zeros(embedding.shape, **opts) if need_any and need_e else None
        total = torch.zeros((), **opts)

        for start in range(0, hidden.size(0), chunk_size):
            h = hidden[start : start + chunk_size]
            y = target[start : start + chunk_size]
            kl, log_q, p, diff, u = _chunk_kl(h, y, weight, embedding, tau, masked, acc)
            total += kl.sum()
            if not need_any:
                continue
            if grad_h is not None or grad_w is not None:
                g_z = log_q.exp_().sub_(p).div_(tau)  # (y^ - y~) / tau
                if grad_h is not None:
                    grad_h[start : start + chunk_size] = (g_z.to(weight.dtype) @ weight).to(acc)
                if grad_w is not None:
                    grad_w += (g_z.to(h.dtype).t() @ h).to(acc)
                del g_z
            if grad_e is not None:
                # dKL/ds (s unscaled) = y~ [(log y~ - log y^) - KL] / tau
                g_s = diff.sub_(kl.unsqueeze(1)).mul_(p).div_(tau)
                g_s = g_s.to(embedding.dtype)
                grad_e += (g_s.t() @ u).to(acc)  # row i: sum_t g_s[t, i] e_{y_t}
                grad_e.index_add_(0, y, (g_s @ embedding).to(acc))  # target rows: sum_i g_s[t, i] e_i
            del log_q, p, diff

        ctx.save_for_backward(grad_h, grad_w, grad_e)
        ctx.dtypes = (hidden.dtype, weight.dtype, embedding.dtype)
        ctx.computed = need_any
        return total

    @staticmethod
    def backward(ctx, grad_out):
        if not ctx.computed:
            raise RuntimeError("augmented_kl_direct was called without gradient tracking; it cannot be backpropagated")
        grad_h, grad_w, grad_e = ctx.saved_tensors
        outs = []
        for grad, dtype in zip((grad_h, grad_w, grad_e), ctx.dtypes):
            outs.append(None if grad is None else (grad * grad_out).to(dtype))
        return (*outs, None, None, None, None, None)


def augmented_kl_direct(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    embedding: torch.Tensor,
    target: torch.Tensor,
    tau: float,
    masked_columns: Optional[Sequence[int]] = None,
    chunk_size: int = 2048,
) -> torch.Tensor:
    """Summed KL(y~_t || softmax(W h_t / tau)) over the tokens, differentiable in H, W *and* E.

    Args:
        hidden: (N, d) decoder features of the non-padding positions.
        weight: (V, d) output projection W (no bias); pass the same tensor as ``embedding`` when tied.
        embedding: (V, d) unscaled teacher matrix E (the decoder input embedding). Gradients flow
            into it through the teacher unless it does not require grad (then this is the detached
            augmented loss, the same value and H/W gradients as the fused layer's).
        target: (N,) target ids, padding already removed.
        tau: temperature (> 0) of both softmaxes.
        masked_columns: ids that get no teacher mass (pad, madeupword rows, ...).
        chunk_size: tokens per chunk (>= 1); memory is O(chunk_size x V).

    Returns:
        The scalar sum (fp32, or fp64 for fp64 inputs) of the per-token KL, without the alpha * s(tau) weight.
    """
    check_output_layer_inputs(hidden, weight, target, chunk_size)
    if embedding.dim() != 2 or embedding.size(0) != weight.size(0):
        # its width may differ from W's: only inner products of its own rows are taken
        raise ValueError(f"expected embedding (V, d_E) with V = {weight.size(0)}, got {tuple(embedding.shape)}")
    if not tau > 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    masked = None
    if masked_columns is not None and len(masked_columns):
        masked = torch.as_tensor(list(masked_columns), dtype=torch.long, device=embedding.device)
    compute_grad = torch.is_grad_enabled() and (
        hidden.requires_grad or weight.requires_grad or embedding.requires_grad
    )
    return _DirectAugmentedKL.apply(
        hidden, weight, embedding, target, float(tau), masked, int(chunk_size), compute_grad
    )
