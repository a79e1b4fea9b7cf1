"""Cosine regularisation, CosReg (Gao et al., ICLR 2019, "Representation Degeneration Problem in
Training Natural Language Generation Models", §5), its math in one place; pure torch.

    L = L_MLE + gamma * R,   R = (1 / N^2) * sum_{i != j} w^_i . w^_j,   w^_i = w_i / ||w_i||

over the N rows w_i of the (tied) output-embedding matrix. With s = sum_i w^_i the sum over the
pairs is ||s||^2 - N, so R and its gradient are exact in O(N d) (docs/baselines.md, "CosReg"):

    R = (||s||^2 - N) / Z,   dR/dw_i = (2 / Z) (s - (w^_i . s) w^_i) / ||w_i||,

with Z = N^2 (the paper's normaliser) or N (N - 1) (``"pairs"``: R is then the mean pairwise cosine
the statistics log). Rows of norm below ``ZERO_NORM`` (fairseq's zero-initialised padding row) have
no direction: they are left out and not counted in N.

:func:`cosine_regularizer` is its own autograd Function: forward and backward run over row blocks
and keep only the inverse norms (V) and s (d), never a normalised V x d copy; all arithmetic in fp32
(fp64 for fp64 weights) whatever the dtype of W. :class:`CosRegLoss` is the method for a training
loop (and the object the fairseq criterion holds).
"""
from typing import Optional

import torch

from fairseq_agg.errors import check_choice, check_number


NORMALIZERS = ("paper", "pairs")
ZERO_NORM = 1e-12
_BLOCK_ROWS = 8192


def _accumulation_dtype(weight):
    return torch.float64 if weight.dtype == torch.float64 else torch.float32


class _CosineRegularizer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, included, normalizer, block_rows):
        acc = _accumulation_dtype(weight)
        # 1 / ||w_i|| on the rows used (selected and of non-zero norm), 0 elsewhere: unit rows are
        # then w_i * inv_norm_i, and the left-out rows drop out of every sum and gradient
        inv_norm = torch.empty(weight.size(0), dtype=acc, device=weight.device)
        s = torch.zeros(weight.size(1), dtype=acc, device=weight.device)
        for start in range(0, weight.size(0), block_rows):
            block = weight[start : start + block_rows].detach().to(acc)
            norm = block.norm(dim=1)
            used = norm >= ZERO_NORM
            if included is not None:
                used &= included[start : start + block_rows]
            inv = torch.where(used, 1.0 / torch.where(used, norm, torch.ones_like(norm)), torch.zeros_like(norm))
            inv_norm[start : start + block.size(0)] = inv
            s.addmv_(block.t(), inv)  # sum of the unit rows
        n = (inv_norm > 0).sum().to(acc)
        z = _normaliser(normalizer, n).clamp(min=1.0)  # fewer than two rows: R = 0
        value = torch.where(n >= 2, (s @ s - n) / z, torch.zeros_like(z))
        ctx.save_for_backward(weight, inv_norm, s, z, n)
        ctx.block_rows = block_rows
        ctx.mark_non_differentiable(n)
        return value, n

    @staticmethod
    def backward(ctx, grad_value, _grad_n):
        weight, inv_norm, s, z, n = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        acc = inv_norm.dtype
        grad = torch.empty(weight.shape, dtype=acc, device=weight.device)
        scale = torch.where(n >= 2, 2.0 * grad_value.to(acc) / z, torch.zeros_like(z))
        for start in range(0, weight.size(0), ctx.block_rows):
            block = weight[start : start + ctx.block_rows].detach().to(acc)
            inv = inv_norm[start : start + block.size(0)]
            # (s - (w^.s) w^) / ||w|| = inv * s - inv^3 (w.s) w: zero on the rows left out (inv = 0)
            rows_grad = grad[start : start + block.size(0)]
            torch.outer(inv, s, out=rows_grad)
            rows_grad.sub_(block * (inv.pow(3) * (block @ s)).unsqueeze(1))
            rows_grad.mul_(scale)
        return grad.to(weight.dtype), None, None, None


def _normaliser(normalizer: str, n: torch.Tensor) -> torch.Tensor:
    if normalizer == "paper":
        return n * n
    if normalizer == "pairs":
        return n * (n - 1)
    raise ValueError(f"unknown CosReg normaliser {normalizer!r} (choose from {', '.join(NORMALIZERS)})")


def cosine_regularizer(
    weight: torch.Tensor,
    rows: Optional[torch.Tensor] = None,
    normalizer: str = "paper",
    block_rows: int = _BLOCK_ROWS,
):
    """CosReg's R(W) and the number N of rows it used, differentiable in ``weight``.

    Args:
        weight: (V, d) embedding matrix (any float dtype).
        rows: 1-D ids of the rows to include, ``None`` = all; rows of zero norm are always left out.
        normalizer: ``"paper"`` (N^2) or ``"pairs"`` (N (N - 1), the mean pairwise cosine).
        block_rows: rows per block of the O(V d) passes.

    Returns:
        ``(R, N)``: R as a 0-dim tensor in fp32 (fp64 for fp64 weights), N (no gradient).
    """
    if weight.dim() != 2:
        raise ValueError(f"expected a (V, d) matrix, got {tuple(weight.shape)}")
    if normalizer not in NORMALIZERS:
        raise ValueError(f"unknown CosReg normaliser {normalizer!r} (choose from {', '.join(NORMALIZERS)})")
    included = None
    if rows is not None:
        rows = torch.as_tensor(rows, dtype=torch.long, device=weight.device).reshape(-1)
        included = torch.zeros(weight.size(0), dtype=torch.bool, device=weight.device)
        included[rows] = True
    return _CosineRegularizer.apply(weight, included, normalizer, int(block_rows))


class CosRegLoss:
    """gamma * R(W) for any loop; with several matrices, R summed over the distinct ones.

    Args:
        gamma: the weight (``--cosreg-gamma``, >= 0; 0 = off, R is still measured).
        normalizer: ``"paper"`` (N^2) or ``"pairs"`` (N (N - 1)).
        rows: 1-D ids of the rows in R (``None`` = all; zero rows are always left out).
    """

    def __init__(self, *, gamma: float = 1.0, normalizer: str = "paper", rows: Optional[torch.Tensor] = None):
        self.gamma = float(check_number("cosreg_gamma", gamma, 0))
        self.normalizer = check_choice("cosreg_normalizer", normalizer, NORMALIZERS)
        self.rows = None if rows is None else torch.as_tensor(rows, dtype=torch.long).reshape(-1)

    def regularizer(self, *matrices: torch.Tensor) -> torch.Tensor:
        """R summed over the distinct ``matrices`` (a tied matrix given twice counts once);
        differentiable only when gamma > 0 (R is then part of the loss)."""
        distinct = list({id(m): m for m in matrices}.values())
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.gamma > 0):
            return sum(
                cosine_regularizer(m, None if self.rows is None else self.rows.to(m.device), self.normalizer)[0]
                for m in distinct
            )

    def __call__(self, *matrices: torch.Tensor) -> torch.Tensor:
        """gamma * R: add it to a mean loss (the fairseq criterion adds gamma * R per sample unit)."""
        return self.gamma * self.regularizer(*matrices)
