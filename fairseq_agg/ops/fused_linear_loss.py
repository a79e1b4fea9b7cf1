"""Fused output projection + (label-smoothed) cross-entropy, with AGG gating and the augmented loss.

One chunked autograd Function serves every criterion of this package:

* plain CE / label-smoothed CE (fairseq's convention: the target gets 1 - eps, every other entry
  eps / (V - 1); ``label_smoothed_nll_loss`` in fairseq/criterions/label_smoothed_cross_entropy.py);
* AGG (Yu et al., ACL 2022): the output-embedding gradient of the CE part is gated per
  (context, token) entry; the hidden-state gradient is not (spec agg.md §5.1);
* the augmented loss of Inan et al. (ICLR 2017, eq. 3.2-3.3): ``coef * KL(teacher || softmax(z / tau))``
  per token, with a detached, per-type teacher (spec augmented_loss.md §5, §8.8).

The logits ``Z = H W^T`` are computed once, chunk by chunk over the tokens; in the same pass the
gradients ``dH = G W`` and ``dW = G_w^T H`` are formed and only they are kept, so no N x V tensor
outlives a chunk (the fused linear-cross-entropy pattern, spec agg.md §5.3). Backward only scales the
saved gradients by the incoming gradient. Softmax and all loss arithmetic run in fp32 whatever the
dtype of H and W; the matmuls run in the model dtype.
"""
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class TokenGates:
    """AGG gate vectors (length V each) for one micro-batch; see :func:`fairseq_agg.ops.rare_tokens.agg_gates`.

    ``g1`` scales the gradient of token k's logit in contexts whose target is not rare, ``g2`` in
    contexts whose target is rare; the target's own column is never gated.
    """

    g1: torch.Tensor
    g2: torch.Tensor
    rare: torch.Tensor  # bool


@dataclass
class TeacherTargets:
    """Augmented-loss teacher (Inan et al. eq. 3.7) for the unique targets of a batch.

    ``probs[u]`` is softmax(E e_u / tau) for the u-th unique target type (fp32, detached),
    ``entropy[u]`` its entropy, and ``index[n]`` the row of ``probs`` for token n.
    ``coef`` is alpha * scale(tau); ``gate_with_agg`` also applies the AGG gates to the AL part of dW.
    """

    probs: torch.Tensor
    entropy: torch.Tensor
    index: torch.Tensor
    tau: float
    coef: float
    gate_with_agg: bool = False


def _gate_rows_(grad, target, gates, rare_target_rows):
    """In-place AGG gating of a chunk's logit gradient (spec agg.md §4.2, §5.3).

    Rows with a non-rare target are scaled by g1 (g1 = 1 outside the rare group, so only rare
    columns change and the target column is untouched); rows with a rare target by g2, except in
    their own target column.
    """
    if rare_target_rows.numel():
        rare_rows = grad.index_select(0, rare_target_rows)
        keep = rare_rows.gather(1, target.index_select(0, rare_target_rows).unsqueeze(1))
        rare_rows.mul_(gates.g2.unsqueeze(0))
        rare_rows.scatter_(1, target.index_select(0, rare_target_rows).unsqueeze(1), keep)
    grad.mul_(gates.g1.unsqueeze(0))
    if rare_target_rows.numel():
        grad.index_copy_(0, rare_target_rows, rare_rows)


def _matmul_into(out, a, b, accumulate=False):
    """out (+)= a @ b with the matmul in b's dtype; in place (no temporary) when all dtypes agree."""
    if a.dtype == b.dtype == out.dtype:
        if accumulate:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)
    else:
        product = (a.to(b.dtype) @ b).to(out.dtype)
        if accumulate:
            out += product
        else:
            out.copy_(product)


# On a CPU, the element-wise work on a chunk's logits is done block by block, a block of rows small
# enough (~4 MiB) to stay in cache across the dozen operations it goes through, so each chunk x V
# buffer is read and written about once. On a GPU the whole chunk is one block (few kernel launches).
_CPU_BLOCK_BYTES = 1 << 22


def _block_rows(device, vocab, dtype, chunk_rows):
    if device.type != "cpu":
        return chunk_rows
    size = torch.empty((), dtype=dtype).element_size()
    return max(1, min(chunk_rows, _CPU_BLOCK_BYTES // (vocab * size)))


def _row_dot(a, b):
    """sum_i a[n, i] b[n, i] per row, without an element-wise product tensor."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


class _FusedLinearLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, epsilon, gates, teacher, chunk_size, compute_grad):
        n_rows, _ = hidden.shape
        vocab = weight.size(0)
        eps_i = epsilon / (vocab - 1) if epsilon > 0 else 0.0
        target_weight = 1.0 - epsilon - eps_i  # fairseq: loss = (1-eps-eps_i)*nll + eps_i*smooth
        needs_grad = compute_grad and (ctx.needs_input_grad[0] or ctx.needs_input_grad[1])

        # loss arithmetic in fp32 at least (fp16/bf16 inputs), in float64 for float64 inputs
        acc = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
        opts = dict(dtype=acc, device=hidden.device)
        grad_hidden = torch.empty(hidden.shape, **opts) if needs_grad else None
        grad_weight = torch.zeros(weight.shape, **opts) if needs_grad else None
        loss = torch.zeros((), **opts)
        nll_sum = torch.zeros((), **opts)
        aug_sum = torch.zeros((), **opts)
        rare_of_target = gates.rare.index_select(0, target) if gates is not None else None

        # Work buffers reused by every chunk, and every step below in place: on a CPU each fresh
        # chunk x V tensor costs more (page faults) than the arithmetic done on it.
        rows = min(chunk_size, n_rows)
        block = _block_rows(hidden.device, vocab, acc, rows)
        logits_buf = torch.empty((rows, vocab), **opts)
        # the AL gradient is kept apart from the CE one only when AGG gates the CE part alone (§8.8)
        separate_aug = teacher is not None and needs_grad and gates is not None and not teacher.gate_with_agg
        if teacher is not None:
            tempered_buf = torch.empty((rows if separate_aug else block, vocab), **opts)
            teacher_rows = torch.empty((block, vocab), **opts)
            inv_tau = 1.0 / teacher.tau
            aug_scale = teacher.coef * inv_tau  # coef * d KL / d z = coef * (softmax(z/tau) - t) / tau  (§4)
        weight_t = weight.t()

        for start in range(0, n_rows, chunk_size):
            stop = min(start + chunk_size, n_rows)
            h = hidden[start:stop]
            z_chunk = logits_buf[: stop - start]
            _matmul_into(z_chunk, h, weight_t)  # the only logits matmul

            for b in range(start, stop, block):
                e = min(b + block, stop)
                z = z_chunk[b - start : e - start]
                y = target[b:e]
                target_logit = z.gather(1, y.unsqueeze(1)).squeeze(1)
                row_max = z.amax(dim=1, keepdim=True)
                logit_sum = z.sum(dim=-1) if eps_i > 0 else None

                if teacher is not None:
                    index = teacher.index[b:e]
                    t = teacher_rows[: e - b]
                    if teacher.probs.dtype == acc:
                        torch.index_select(teacher.probs, 0, index, out=t)
                    else:
                        t.copy_(teacher.probs.index_select(0, index))
                    teacher_dot = _row_dot(t, z)  # t . z, before z is overwritten
                    # q = exp((z - max z) / tau): max(z / tau) = max(z) / tau, so one row max serves both
                    q = tempered_buf[b - start : e - start] if separate_aug else tempered_buf[: e - b]
                    torch.add(row_max * -inv_tau, z, alpha=inv_tau, out=q)
                    q.exp_()
                    q_sum = q.sum(dim=-1)
                    lse_tau = row_max.squeeze(1) * inv_tau + q_sum.log()
                    # KL(t || softmax(z/tau)) = lse(z/tau) - t.z/tau - H(t)   (augmented_loss.md §5, Trick 2)
                    kl = lse_tau - teacher_dot * inv_tau - teacher.entropy.index_select(0, index)
                    aug_sum += kl.sum()
                    loss += teacher.coef * kl.sum()

                z.sub_(row_max).exp_()  # z now holds exp(z - max z)
                z_sum = z.sum(dim=-1)
                lse = row_max.squeeze(1) + z_sum.log()
                nll = lse - target_logit
                nll_sum += nll.sum()
                if eps_i > 0:
                    smooth = vocab * lse - logit_sum  # sum_k -log p_k
                    loss += (target_weight * nll + eps_i * smooth).sum()
                else:
                    loss += nll.sum()
                if not needs_grad:
                    continue

                # G = softmax(Z) - Q with Q = (1-eps-eps_i) onehot + eps_i, in place on the logits
                z.mul_(z_sum.reciprocal().unsqueeze(1))
                if eps_i > 0:
                    z.sub_(eps_i)
                z.scatter_add_(
                    1, y.unsqueeze(1), torch.full((e - b, 1), -target_weight, dtype=z.dtype, device=z.device)
                )
                if teacher is not None:
                    q.mul_((aug_scale / q_sum).unsqueeze(1)).sub_(t, alpha=aug_scale)
                    if not separate_aug:
                        z.add_(q)  # one gradient for dH and dW

            if not needs_grad:
                continue
            grad = z_chunk
            if not separate_aug:
                _matmul_into(grad_hidden[start:stop], grad, weight)  # hidden states: un-gated
            else:
                # dH from the un-gated total, dW from the gated CE part plus the un-gated AL part
                # (augmented_loss.md §8.8): the AL buffer holds the total for the matmul, then G is
                # taken back out of it
                aug_grad = tempered_buf[: stop - start]
                aug_grad.add_(grad)
                _matmul_into(grad_hidden[start:stop], aug_grad, weight)
                aug_grad.sub_(grad)
            if gates is not None:
                y = target[start:stop]
                _gate_rows_(grad, y, gates, rare_of_target[start:stop].nonzero().squeeze(1))
            if separate_aug:
                grad.add_(aug_grad)
            _matmul_into(grad_weight, grad.t(), h, accumulate=True)

        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.input_dtypes = (hidden.dtype, weight.dtype)
        ctx.mark_non_differentiable(nll_sum, aug_sum)
        return loss, nll_sum, aug_sum

    @staticmethod
    def backward(ctx, grad_loss, _grad_nll, _grad_aug):
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.input_dtypes
        if grad_hidden is None:
            raise RuntimeError("fused_linear_loss was called without gradient tracking; it cannot be backpropagated")
        out_h = (grad_hidden * grad_loss).to(hidden_dtype) if ctx.needs_input_grad[0] else None
        out_w = (grad_weight * grad_loss).to(weight_dtype) if ctx.needs_input_grad[1] else None
        return out_h, out_w, None, None, None, None, None, None


def fused_linear_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    epsilon: float = 0.0,
    gates: Optional[TokenGates] = None,
    teacher: Optional[TeacherTargets] = None,
    chunk_size: int = 2048,
):
    """Summed loss of ``softmax(hidden @ weight.T)`` against ``target``.

    Args:
        hidden: (N, d) decoder features of the non-padding positions.
        weight: (V, d) output projection (no bias).
        target: (N,) target ids; padding must already be removed by the caller.
        epsilon: label smoothing in fairseq's convention, 0 <= epsilon < 1.
        gates: AGG gates; ``None`` = ungated (plain CE).
        teacher: augmented-loss teacher; ``None`` = no augmented loss.
        chunk_size: tokens per chunk; peak extra memory is O(chunk_size x V).

    Returns:
        ``(loss, nll, aug_kl)``: the differentiable summed loss (CE part + coef * KL), the summed
        NLL (for logging, no gradient) and the summed KL before ``coef`` (no gradient).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.size(1) != weight.size(1):
        raise ValueError(f"expected hidden (N, d) and weight (V, d), got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if target.shape != hidden.shape[:1]:
        raise ValueError(f"target must have shape ({hidden.size(0)},), got {tuple(target.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if teacher is not None and teacher.index.shape != target.shape:
        raise ValueError("teacher.index must have one entry per target")
    # Under torch.no_grad (validation) the gradients are not formed at all.
    compute_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _FusedLinearLoss.apply(
        hidden, weight, target, float(epsilon), gates, teacher, int(chunk_size), compute_grad
    )
