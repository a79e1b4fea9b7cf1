"""Augmented loss with a *non-detached* teacher (Inan et al., ICLR 2017, eq. 3.2 and 3.6-3.7).

The fused output layer (:mod:`fairseq_agg.ops.fused_linear_loss`) treats the teacher
y~ = softmax(E e_y / tau) as a constant, the project's default (spec augmented_loss.md §2.4, §13).
The paper does not say whether gradients flow through y~, and the only public reimplementation lets
them flow; this module is that variant (``--no-aug-detach-target``), as its own chunked autograd
Function:

    KL_t = sum_i y~_ti (log y~_ti - log y^_ti),   y^_t = softmax(W h_t / tau),
    y~_t = softmax(s_t / tau),   s_ti = <e_{y_t}, e_i>                   (E unscaled, §8.3)

with the gradients of spec §4:

* through the model logits z = W h:    dKL/dz = (y^ - y~) / tau;
* through the teacher logits s:         dKL/ds = (1 / tau) y~ * [(log y~ - log y^) - KL];
  chained to E twice, since s_ti = <e_{y_t}, e_i>: row i receives sum_t dKL/ds_ti * e_{y_t}, and
  the target row y_t receives sum_i dKL/ds_ti * e_i (a scatter-add over the target ids).

Everything is formed chunk by chunk over the tokens, so memory is O(chunk x V) (the teacher rows of
a chunk are recomputed from E for its tokens; there is no tokens x V tensor). Only the KL term is
computed here; the criterion adds it to the CE part of the fused layer, which leaves the AL part of
the output-embedding gradient un-gated under AGG (spec §8.8). All softmax/KL arithmetic is fp32.
"""
from typing import Optional, Sequence

import torch


def _chunk_kl(h, y, weight, embedding, tau, masked, acc):
    """Per-token KL of a chunk and the pieces its gradients need, in ``acc`` (fp32 or fp64)."""
    log_q = torch.log_softmax((h @ weight.t()).to(acc) / tau, dim=-1)  # log y^ (never masked, §8.4)
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
        # fp32 arithmetic under fp16/bf16 (spec §7); float64 inputs stay float64 (gradcheck)
        acc = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
        acc = torch.promote_types(acc, embedding.dtype)
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
                g_z = log_q.exp_().sub_(p).div_(tau)  # (y^ - y~) / tau   (spec §4)
                if grad_h is not None:
                    grad_h[start : start + chunk_size] = (g_z.to(weight.dtype) @ weight).to(acc)
                if grad_w is not None:
                    grad_w += (g_z.to(h.dtype).t() @ h).to(acc)
                del g_z
            if grad_e is not None:
                # dKL/ds (s unscaled) = y~ [(log y~ - log y^) - KL] / tau   (spec §2.4, §4)
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
    if hidden.dim() != 2 or weight.dim() != 2 or embedding.dim() != 2:
        raise ValueError("expected hidden (N, d), weight (V, d) and embedding (V, d)")
    if hidden.size(1) != weight.size(1) or embedding.size(0) != weight.size(0):
        raise ValueError(
            f"shape mismatch: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, "
            f"embedding {tuple(embedding.shape)}"
        )
    if target.shape != hidden.shape[:1]:
        raise ValueError(f"target must have shape ({hidden.size(0)},), got {tuple(target.shape)}")
    if not tau > 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    masked = None
    if masked_columns is not None and len(masked_columns):
        masked = torch.as_tensor(list(masked_columns), dtype=torch.long, device=embedding.device)
    compute_grad = torch.is_grad_enabled() and (
        hidden.requires_grad or weight.requires_grad or embedding.requires_grad
    )
    return _DirectAugmentedKL.apply(
        hidden, weight, embedding, target, float(tau), masked, int(chunk_size), compute_grad
    )
