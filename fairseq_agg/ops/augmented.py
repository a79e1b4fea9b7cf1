"""The augmented loss of Inan, Khosravi & Socher (ICLR 2017), its math in one place; pure torch.

    J = CE + alpha * s(tau) * KL(y~ || y^),   y^ = softmax(W h / tau),   y~ = softmax(E e_y / tau)

(eq. 3.1-3.3 and 3.6-3.7 of arXiv 1611.01462v1; s(tau) and every default: docs/augmented_loss.md).

* :func:`aug_scale_factor`: s(tau);
* :func:`build_teacher`: the *detached* teacher y~, built once per unique target type of a batch
  (it depends on the type only), as a :class:`TeacherTargets`, the term
  (:class:`fairseq_agg.ops.term.Term`) that the fused output layer's chunk body evaluates on each logit
  tile (:mod:`fairseq_agg.ops.output_chunk`);
* :func:`augmented_kl_direct`: the *non-detached* variant, where gradients also flow into E
  through y~, as its own chunked autograd Function (summed, or per token);
* :class:`AugmentedLoss`: the method for a training loop (alpha's warm-up, the teacher, the fused
  call), the object the fairseq criteria hold.
"""
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Optional, Sequence

import torch

from fairseq_agg.errors import UsageError, check_choice, check_integer, check_number

from .fused_linear_loss import (
    LossRequest, LossResult, block_rows, check_output_layer_inputs, fused_linear_loss, loss_dtype,
)
from .term import ADDS_LOSS, Term, TermOut

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
class TeacherTargets(Term):
    """Augmented-loss teacher (eq. 3.7) for the unique targets of a batch; the fused layer's term
    that adds coef * KL(y~ || softmax(z / tau)) per token (logged as ``augmented`` / ``kl``).

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
    _scalars: Optional[tuple] = field(default=None, init=False, repr=False, compare=False)  # 1/tau, coef

    name = "augmented"
    role = ADDS_LOSS
    value_names = ("kl",)
    foreign_refusal = "the augmented loss (--aug-alpha)"

    @property
    def gated(self) -> bool:
        return self.gate_with_agg

    def check_inputs(self, target: torch.Tensor, vocab: int, request=None) -> None:
        if self.index.shape != target.shape:
            raise ValueError("teacher.index must have one entry per target")

    def tile_inputs(self, rows: slice, target: torch.Tensor, acc: torch.dtype) -> "TeacherInputs":
        """What the chunk body needs for the token positions ``rows``: the teacher matrix, each
        row's index into it and entropy, and 1 / tau and coef as 0-d tensors (a changing coef,
        alpha's warm-up, then never recompiles the body)."""
        index = self.index[rows]
        if self._scalars is None or self._scalars[0].dtype != acc:
            device = self.probs.device
            self._scalars = (torch.tensor(1.0 / self.tau, dtype=acc, device=device),
                             torch.tensor(self.coef, dtype=acc, device=device))
        inv_tau, coef = self._scalars
        return TeacherInputs(probs=self.probs, index=index, entropy=self.entropy.index_select(0, index),
                             inv_tau=inv_tau, coef=coef)

    @staticmethod
    def tile(tile, inputs: "TeacherInputs") -> TermOut:
        """coef * KL(y~ || softmax(z / tau)) per row of a logit tile, and its gradient coef (y^ - y~) / tau
        (eq. 3.4). KL = lse(z / tau) - y~.z / tau - H(y~), exact and without a log of y~; max(z / tau)
        = max(z) / tau, so the tile's row maximum serves both softmaxes."""
        z, inv_tau, coef = tile.z, inputs.inv_tau, inputs.coef
        teacher = inputs.probs.index_select(0, inputs.index).to(z.dtype)
        scaled_max = tile.row_max * inv_tau
        lse_tau = scaled_max + torch.exp(z * inv_tau - scaled_max).sum(dim=1, keepdim=True).log()
        kl = lse_tau.squeeze(1) - (teacher * z).sum(dim=1) * inv_tau - inputs.entropy
        grad = (coef * inv_tau) * (torch.exp(z * inv_tau - lse_tau) - teacher)
        return TermOut(loss=coef * kl, grad=grad, values=(kl,))


class TeacherInputs(NamedTuple):
    probs: torch.Tensor  # (types, V) the teacher rows
    index: torch.Tensor  # (rows,) each row's teacher row
    entropy: torch.Tensor  # (rows,) H(y~) of each row's teacher
    inv_tau: torch.Tensor  # 0-d
    coef: torch.Tensor  # 0-d


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
    cols = None
    if masked_columns is not None and len(masked_columns):
        cols = torch.as_tensor(list(masked_columns), dtype=torch.long, device=logits.device)
    # In place, block by block (no second n_u x V tensor, and each block's passes in cache):
    # x = s / tau - max, p = exp(x) / Z, and H = -sum p log p = log Z - sum exp(x) x / Z.
    n_types = logits.size(0)
    opts = dict(dtype=logits.dtype, device=logits.device)
    weighted, norm = torch.empty(n_types, **opts), torch.empty(n_types, **opts)
    step = block_rows(logits.device, logits.size(1), logits.dtype, n_types)
    exp_buf = torch.empty((min(step, n_types), logits.size(1)), **opts)
    for b in range(0, n_types, step):
        x = logits[b : b + step]
        x.mul_(1.0 / tau)
        if cols is not None:
            # a large finite logit instead of -inf: the masked columns get exactly 0 mass and
            # 0 * log p stays 0 in the entropy, without extra masking temporaries
            x.index_fill_(1, cols, MASKED_LOGIT)
        x.sub_(x.amax(dim=1, keepdim=True))
        e = torch.exp(x, out=exp_buf[: x.size(0)])
        weighted[b : b + step] = x.mul_(e).sum(dim=-1)
        norm[b : b + step] = e.sum(dim=-1)
        torch.mul(e, norm[b : b + step].reciprocal().unsqueeze(1), out=x)
    probs = logits
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


def _direct_kl_pass(hidden, weight, embedding, target, tau, masked, chunk_size, needs, per_token, row_scale=None):
    """The KL (summed, or per token) and, for the inputs ``needs`` = (H, W, E) asks for, its
    gradients, each token's row of them multiplied by ``row_scale[t]`` when given."""
    acc = loss_dtype(hidden, weight, embedding)
    opts = dict(dtype=acc, device=hidden.device)
    grad_h, grad_w, grad_e = (torch.zeros(x.shape, **opts) if need else None
                              for x, need in zip((hidden, weight, embedding), needs))
    values = torch.empty(hidden.size(0), **opts) if per_token else torch.zeros((), **opts)

    for start in range(0, hidden.size(0), chunk_size):
        rows = slice(start, start + chunk_size)
        h, y = hidden[rows], target[rows]
        kl, log_q, p, diff, u = _chunk_kl(h, y, weight, embedding, tau, masked, acc)
        if per_token:
            values[rows] = kl
        else:
            values += kl.sum()
        if not any(needs):
            continue
        scale = None if row_scale is None else row_scale[rows].to(acc).unsqueeze(1)
        if grad_h is not None or grad_w is not None:
            g_z = log_q.exp_().sub_(p).div_(tau)  # (y^ - y~) / tau
            if scale is not None:
                g_z.mul_(scale)
            if grad_h is not None:
                grad_h[rows] = (g_z.to(weight.dtype) @ weight).to(acc)
            if grad_w is not None:
                grad_w += (g_z.to(h.dtype).t() @ h).to(acc)
            del g_z
        if grad_e is not None:
            # dKL/ds (s unscaled) = y~ [(log y~ - log y^) - KL] / tau
            g_s = diff.sub_(kl.unsqueeze(1)).mul_(p).div_(tau)
            if scale is not None:
                g_s.mul_(scale)
            g_s = g_s.to(embedding.dtype)
            grad_e += (g_s.t() @ u).to(acc)  # row i: sum_t g_s[t, i] e_{y_t}
            grad_e.index_add_(0, y, (g_s @ embedding).to(acc))  # target rows: sum_i g_s[t, i] e_i
        del log_q, p, diff
    return values, (grad_h, grad_w, grad_e)


class _DirectAugmentedKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, embedding, target, tau, masked, chunk_size, per_token, compute_grad):
        needs = tuple(compute_grad and need for need in ctx.needs_input_grad[:3])
        # per-token values get a different gradient per token: formed in backward (see fused_linear_loss)
        values, grads = _direct_kl_pass(
            hidden, weight, embedding, target, tau, masked, chunk_size, (False,) * 3 if per_token else needs, per_token
        )
        ctx.args = (tau, masked, chunk_size, needs, per_token)
        ctx.save_for_backward(*((hidden, weight, embedding, target) if per_token else grads))
        ctx.dtypes = (hidden.dtype, weight.dtype, embedding.dtype)
        return values

    @staticmethod
    def backward(ctx, grad_out):
        tau, masked, chunk_size, needs, per_token = ctx.args
        if not any(needs):
            raise RuntimeError("augmented_kl_direct was called without gradient tracking; it cannot be backpropagated")
        if per_token:
            hidden, weight, embedding, target = ctx.saved_tensors
            _, grads = _direct_kl_pass(
                hidden, weight, embedding, target, tau, masked, chunk_size, needs, False, row_scale=grad_out
            )
        else:
            grads = [None if grad is None else grad * grad_out for grad in ctx.saved_tensors]
        outs = [None if grad is None else grad.to(dtype) for grad, dtype in zip(grads, ctx.dtypes)]
        return (*outs, None, None, None, None, None, None)


def augmented_kl_direct(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    embedding: torch.Tensor,
    target: torch.Tensor,
    tau: float,
    masked_columns: Optional[Sequence[int]] = None,
    chunk_size: int = 2048,
    per_token: bool = False,
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
        per_token: the (N,) per-token KL instead of its sum.

    Returns:
        The scalar sum (fp32, or fp64 for fp64 inputs) of the per-token KL, without the alpha * s(tau)
        weight; with ``per_token``, the (N,) KL of every token.
    """
    check_output_layer_inputs(hidden, weight, target)
    if not chunk_size >= 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
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
        hidden, weight, embedding, target, float(tau), masked, int(chunk_size), bool(per_token), compute_grad
    )


# --- the method object ---------------------------------------------------------------------------


class AugmentedLoss:
    """The augmented loss, J = CE + alpha * s(tau) * KL(y~ || softmax(z / tau)), for any loop.

    Args:
        alpha: its weight (``--aug-alpha``, >= 0; 0 = plain cross-entropy).
        temperature: tau of both softmaxes (``--aug-temperature``, > 0).
        scale: s(tau): ``"none"`` = 1, ``"tau"`` or ``"tau2"`` = tau^2 (``--aug-scale``).
        warmup_updates: alpha ramps linearly from 0 over this many updates (0 = none).
        detach_teacher: the teacher y~ is a constant (the default); off, gradients also flow into
            the embedding through it (a separate chunked pass, :func:`augmented_kl_direct`).
        gate_with_agg: with AGG's gates in the request, gate the KL's part of dW too.
        masked_columns: ids that get no teacher mass (padding, vocabulary fillers).
    """

    def __init__(self, *, alpha: float = 0.5, temperature: float = 10.0, scale: str = "tau", warmup_updates: int = 0,
                 detach_teacher: bool = True, gate_with_agg: bool = False,
                 masked_columns: Optional[Sequence[int]] = None):
        self.alpha = float(check_number("aug_alpha", alpha, 0))
        self.temperature = float(check_number("aug_temperature", temperature, 0, low_open=True))
        self.scale = check_choice("aug_scale", scale, SCALES)
        self.warmup_updates = check_integer("aug_warmup_updates", warmup_updates, 0)
        if gate_with_agg and not detach_teacher:
            raise UsageError("--aug-gate-with-agg cannot be combined with --no-aug-detach-target: the non-detached "
                             "augmented loss is computed outside the fused (gated) output layer")
        if gate_with_agg and self.alpha == 0:
            raise UsageError("--aug-gate-with-agg needs --aug-alpha > 0: without the augmented loss there is nothing "
                             "to gate")
        self.detach_teacher = bool(detach_teacher)
        self.gate_with_agg = bool(gate_with_agg)
        self.masked_columns = None if masked_columns is None else list(masked_columns)

    @property
    def fused_teacher(self) -> bool:
        """Whether the teacher is evaluated inside the fused output layer (alpha > 0, detached)."""
        return self.alpha > 0 and self.detach_teacher

    def alpha_at(self, update_num: Optional[int] = None) -> float:
        """alpha after the linear warm-up, in the update after ``update_num`` completed ones."""
        if self.alpha > 0 and self.warmup_updates > 0 and update_num is not None:
            return self.alpha * min(1.0, (update_num + 1) / self.warmup_updates)
        return self.alpha

    def coef(self, update_num: Optional[int] = None) -> float:
        """alpha * s(tau), the weight of the KL in the loss."""
        return self.alpha_at(update_num) * aug_scale_factor(self.scale, self.temperature)

    def teacher(self, embedding, target, update_num: Optional[int] = None) -> Optional[TeacherTargets]:
        """The detached teacher of these targets, a term for ``LossRequest.with_terms``; None when the
        augmented loss is off (alpha 0 in this update) or not detached."""
        if self.alpha_at(update_num) <= 0 or not self.detach_teacher:
            return None
        return build_teacher(embedding.detach(), target, self.temperature, self.coef(update_num),
                             self.masked_columns, gate_with_agg=self.gate_with_agg)

    def __call__(self, hidden, weight, embedding, target, update_num: Optional[int] = None,
                 request: Optional[LossRequest] = None) -> LossResult:
        """The fused loss plus the augmented loss; ``embedding`` (V, d_E) is the teacher matrix (the
        unscaled input embedding, or ``weight``), ``request`` the other terms (AGG's gates, ...)."""
        request = LossRequest() if request is None else request
        if self.alpha_at(update_num) <= 0:
            return fused_linear_loss(hidden, weight, target, request)
        if self.detach_teacher:
            teacher = self.teacher(embedding, target, update_num)
            return fused_linear_loss(hidden, weight, target, request.with_terms(teacher))
        result = fused_linear_loss(hidden, weight, target, request)
        kl = augmented_kl_direct(hidden, weight, embedding, target, self.temperature, self.masked_columns,
                                 chunk_size=request.chunk_size, per_token=request.per_token)
        return replace(result, loss=result.loss + self.coef(update_num) * kl,
                       terms={**result.terms, TeacherTargets.name: {"kl": kl.detach().sum()}})
