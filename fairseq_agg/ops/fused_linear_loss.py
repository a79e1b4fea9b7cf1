"""The fused, chunked output layer: ``softmax(H W^T)`` and its (label-smoothed) cross-entropy.

One autograd Function serves every criterion of this package. It is generic; the two methods plug
into it through the objects they pass:

* label smoothing in fairseq's convention: the target gets 1 - eps, every other entry
  eps / (V - 1) (``label_smoothed_nll_loss`` in fairseq/criterions/label_smoothed_cross_entropy.py);
* ``gates`` (AGG, :class:`fairseq_agg.ops.agg_gates.TokenGates`): gates the cross-entropy part of
  the output-embedding gradient; the hidden-state gradient is never gated (docs/agg.md (A6));
* ``teacher`` (augmented loss, :class:`fairseq_agg.ops.augmented.TeacherTargets`): adds
  ``coef * KL(teacher || softmax(z / tau))`` per token (Inan et al., ICLR 2017, eq. 3.2-3.3;
  docs/augmented_loss.md);
* ``row_weights`` (FACE, :class:`fairseq_agg.ops.face.FaceWeights`): one weight per token on its
  (smoothed) cross-entropy and therefore on its row of the logit gradient; gets the row's argmax
  when it asks for it (docs/baselines.md, "FACE");
* ``penalty`` (token-level unlikelihood, :class:`fairseq_agg.ops.unlikelihood.UnlikelihoodCandidates`):
  adds ``alpha * sum_c -log(1 - p_c)`` over a few candidate columns per token, whose logit gradient
  is a change of the softmax's row scale plus a scatter at those columns (docs/baselines.md, "UL");
* ``frozen_rows`` (rare-token freezing, :func:`fairseq_agg.ops.agg_gates.frozen_rare_rows`): rows of
  the output-embedding gradient set to zero after the chunk loop (docs/baselines.md).

The logits ``Z = H W^T`` are computed once, chunk by chunk over the tokens; in the same pass the
gradients ``dH = G W`` and ``dW = G_w^T H`` are formed and only they are kept, so no N x V tensor
outlives a chunk (the fused linear-cross-entropy pattern; docs/agg.md, "How it is computed").
Backward only scales the saved gradients by the incoming gradient. Softmax and all loss arithmetic
run in fp32 whatever the dtype of H and W; the matmuls run in the model dtype.
"""
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:  # the method modules import this one, not the other way round
    from .agg_gates import TokenGates
    from .augmented import TeacherTargets
    from .face import FaceWeights
    from .unlikelihood import UnlikelihoodCandidates


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


def block_rows(device, vocab, dtype, chunk_rows):
    """Rows of a V-wide block of element-wise work (see ``_CPU_BLOCK_BYTES``)."""
    if device.type != "cpu":
        return chunk_rows
    size = torch.empty((), dtype=dtype).element_size()
    return max(1, min(chunk_rows, _CPU_BLOCK_BYTES // (vocab * size)))


def row_dot(a, b):
    """sum_i a[n, i] b[n, i] per row, without an element-wise product tensor."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


def loss_dtype(*tensors) -> torch.dtype:
    """fp32 at least for softmax and loss arithmetic (fp16/bf16 inputs), float64 for float64 inputs."""
    dtype = torch.float32
    for tensor in tensors:
        dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


def check_output_layer_inputs(hidden, weight, target, chunk_size):
    """One clear error for inputs of the wrong shape or a chunk size below 1."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.size(1) != weight.size(1):
        raise ValueError(f"expected hidden (N, d) and weight (V, d), got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if target.shape != hidden.shape[:1]:
        raise ValueError(f"target must have shape ({hidden.size(0)},), got {tuple(target.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


class _FusedLinearLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, epsilon, gates, teacher, row_weights, penalty, frozen_rows,
                chunk_size, compute_grad):
        n_rows, _ = hidden.shape
        vocab = weight.size(0)
        eps_i = epsilon / (vocab - 1) if epsilon > 0 else 0.0
        target_weight = 1.0 - epsilon - eps_i  # fairseq: loss = (1-eps-eps_i)*nll + eps_i*smooth
        needs_grad = compute_grad and (ctx.needs_input_grad[0] or ctx.needs_input_grad[1])

        acc = loss_dtype(hidden, weight)
        opts = dict(dtype=acc, device=hidden.device)
        grad_hidden = torch.empty(hidden.shape, **opts) if needs_grad else None
        grad_weight = torch.zeros(weight.shape, **opts) if needs_grad else None
        loss = torch.zeros((), **opts)
        nll_sum = torch.zeros((), **opts)
        aug_sum = torch.zeros((), **opts)

        # Work buffers reused by every chunk, and every step below in place: on a CPU each fresh
        # chunk x V tensor costs more (page faults) than the arithmetic done on it.
        rows = min(chunk_size, n_rows)
        block = block_rows(hidden.device, vocab, acc, rows)
        logits_buf = torch.empty((rows, vocab), **opts)
        # The augmented-loss gradient is kept apart from the CE one only when AGG gates the CE part
        # alone (docs/augmented_loss.md, "Combination with AGG").
        separate_aug = teacher is not None and needs_grad and gates is not None and not teacher.gate_with_agg
        if teacher is not None:
            tempered_buf = torch.empty((rows if separate_aug else block, vocab), **opts)
            teacher_buf = torch.empty((block, vocab), **opts)
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
                predicted = None
                if row_weights is not None and row_weights.needs_argmax:
                    row_max, predicted = z.max(dim=1, keepdim=True)  # the argmax in the same pass
                    predicted = predicted.squeeze(1)
                else:
                    row_max = z.amax(dim=1, keepdim=True)
                row_weight = None
                if row_weights is not None:
                    row_weight = row_weights.block_row_weight(y, predicted, slice(b, e), n_rows).to(acc)
                logit_sum = z.sum(dim=-1) if eps_i > 0 else None

                if teacher is not None:  # before z is overwritten
                    t = teacher_buf[: e - b]
                    q = tempered_buf[b - start : e - start] if separate_aug else tempered_buf[: e - b]
                    kl, q_sum = teacher.block_kl(z, row_max, slice(b, e), t, q)
                    aug_sum += kl.sum()
                    loss += teacher.coef * kl.sum()

                z.sub_(row_max).exp_()  # z now holds exp(z - max z)
                z_sum = z.sum(dim=-1)
                lse = row_max.squeeze(1) + z_sum.log()
                nll = lse - target_logit
                nll_sum += nll.sum()
                if eps_i > 0:
                    smooth = vocab * lse - logit_sum  # sum_k -log p_k
                    ce = target_weight * nll + eps_i * smooth
                else:
                    ce = nll
                loss += ce.sum() if row_weight is None else row_weight.dot(ce)
                if penalty is not None:  # from exp(z - max z), before it is overwritten
                    penalty_value, penalty_rate, candidates, candidate_grad = penalty.block_terms(
                        z, z_sum, slice(b, e), y
                    )
                    loss += penalty.alpha * penalty_value.sum()
                if not needs_grad:
                    continue

                # G = w (softmax(Z) - Q) with Q = (1-eps-eps_i) onehot + eps_i and w the row weight
                # (1 without), in place on the logits; a penalty moves the softmax's row scale and
                # adds its own columns
                if row_weight is None and penalty is None:
                    z.mul_(z_sum.reciprocal().unsqueeze(1))
                else:
                    scale = torch.ones_like(z_sum) if row_weight is None else row_weight
                    if penalty is not None:
                        scale = scale - penalty.alpha * penalty_rate
                    z.mul_((scale / z_sum).unsqueeze(1))
                if eps_i > 0:
                    z.sub_(eps_i if row_weight is None else (eps_i * row_weight).unsqueeze(1))
                if row_weight is None:
                    target_grad = torch.full((e - b, 1), -target_weight, dtype=z.dtype, device=z.device)
                else:
                    target_grad = (-target_weight * row_weight).unsqueeze(1)
                z.scatter_add_(1, y.unsqueeze(1), target_grad)
                if penalty is not None:
                    z.scatter_add_(1, candidates, candidate_grad.mul_(penalty.alpha))
                if teacher is not None:
                    teacher.block_grad_(q, q_sum, t)
                    if not separate_aug:
                        z.add_(q)  # one gradient for dH and dW

            if not needs_grad:
                continue
            grad = z_chunk
            if not separate_aug:
                _matmul_into(grad_hidden[start:stop], grad, weight)  # hidden states: un-gated
            else:
                # dH from the un-gated total, dW from the gated CE part plus the un-gated AL part:
                # the AL buffer holds the total for the matmul, then G is taken back out of it
                aug_grad = tempered_buf[: stop - start]
                aug_grad.add_(grad)
                _matmul_into(grad_hidden[start:stop], aug_grad, weight)
                aug_grad.sub_(grad)
            if gates is not None:
                gates.gate_logit_grad_(grad, target[start:stop])
            if separate_aug:
                grad.add_(aug_grad)
            _matmul_into(grad_weight, grad.t(), h, accumulate=True)

        if needs_grad and frozen_rows is not None:
            grad_weight.masked_fill_(frozen_rows.unsqueeze(1), 0.0)  # all terms: the rows never move
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
        return out_h, out_w, None, None, None, None, None, None, None, None, None


def fused_linear_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    epsilon: float = 0.0,
    gates: Optional["TokenGates"] = None,
    teacher: Optional["TeacherTargets"] = None,
    row_weights: Optional["FaceWeights"] = None,
    penalty: Optional["UnlikelihoodCandidates"] = None,
    frozen_rows: Optional[torch.Tensor] = None,
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
        row_weights: FACE's per-token weights on the cross-entropy; ``None`` = all 1.
        penalty: unlikelihood candidates (their ``alpha`` included); ``None`` = no penalty. Its
            summed value (before alpha) is accumulated in the object.
        frozen_rows: (V,) bool; those rows of the output-embedding gradient are zero.
        chunk_size: tokens per chunk; peak extra memory is O(chunk_size x V).

    Returns:
        ``(loss, nll, aug_kl)``: the differentiable summed loss (CE part + coef * KL), the summed
        NLL (for logging, no gradient) and the summed KL before ``coef`` (no gradient).
    """
    check_output_layer_inputs(hidden, weight, target, chunk_size)
    if teacher is not None and teacher.index.shape != target.shape:
        raise ValueError("teacher.index must have one entry per target")
    if penalty is not None and penalty.position.shape != target.shape:
        raise ValueError("the unlikelihood candidates must have one position per target")
    if frozen_rows is not None and (frozen_rows.dtype != torch.bool or frozen_rows.shape != weight.shape[:1]):
        raise ValueError(f"frozen_rows must be a bool mask of shape ({weight.size(0)},)")
    # Under torch.no_grad (validation) the gradients are not formed at all.
    compute_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _FusedLinearLoss.apply(
        hidden, weight, target, float(epsilon), gates, teacher, row_weights, penalty, frozen_rows,
        int(chunk_size), compute_grad,
    )
