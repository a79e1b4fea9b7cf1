"""The anti-focal loss, AFL (Raunak, Dalmia, Gupta and Metze, "On Long-Tailed Phenomena in Neural
Machine Translation", Findings of EMNLP 2020), its math in one place; pure torch.

Each token's cross-entropy is weighted by w = (1 + p_t)^gamma, p_t = softmax(z)_t the model's
probability of the target, gamma >= 0 (0: plain cross-entropy). The opposite of focal loss's
(1 - p_t)^gamma: confident tokens keep a larger share of the loss, reported to help rare words.
Two readings (docs/baselines.md, "Anti-focal loss"):

* **the formula** (the default): w carries gradient. With dw / d log p_t = gamma (1 + p_t)^(gamma - 1) p_t
  and d log p_t / dz = e_t - P, the logit gradient of w * CE is
  w (P - Q) - CE * gamma (1 + p_t)^(gamma - 1) p_t (P - e_t);
* **the released code** (``constant_weight=True``): w is computed from a detached copy of the
  probabilities, so the gradient is w (P - Q), the cross-entropy's scaled by a constant.

Label smoothing (which neither the paper nor the released code uses) is supported: w scales the
whole label-smoothed row loss of fairseq, loss = w * CE_eps, with w still from p_t, and the
gradient is that loss's exact derivative in either reading (Q the smoothed target).

:class:`AntiFocalWeights` is the fused output layer's term that weights rows
(:class:`fairseq_agg.ops.term.Term`): it gives the factor and, in the formula's reading,
its derivative ``slope``; the chunk body forms the rows x V gradient. :class:`AntiFocalLoss` is the
method for a training loop.
"""
from dataclasses import dataclass
from typing import Optional

import torch

from fairseq_agg.errors import check_number

from .fused_linear_loss import LossRequest, LossResult, fused_linear_loss
from .term import WEIGHTS_ROWS, Term, TermOut


@dataclass
class AntiFocalWeights(Term):
    """The anti-focal factor (1 + p_t)^gamma of every row, logged as ``antifocal`` / ``weight``;
    ``constant_weight`` reads it as the released code does (no gradient through p_t)."""

    gamma: float
    constant_weight: bool = False

    name = "antifocal"
    role = WEIGHTS_ROWS
    value_names = ("weight",)
    foreign_refusal = "the anti-focal weights (--antifocal-gamma)"

    def tile_inputs(self, rows: slice, target: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
        """gamma as a 0-d tensor: another gamma never recompiles the body."""
        return self.scalars(acc, target.device, self.gamma)[0]

    @property
    def tile(self):
        return _constant_weight if self.constant_weight else _weight_and_slope


def _weight_and_slope(tile, gamma: torch.Tensor) -> TermOut:
    """w = (1 + p_t)^gamma and dw / d log p_t = gamma w p_t / (1 + p_t)."""
    p = torch.exp(tile.target_logprob())
    weight = torch.pow(1.0 + p, gamma)
    return TermOut(factor=weight, slope=gamma * weight * p / (1.0 + p), values=(weight,))


def _constant_weight(tile, gamma: torch.Tensor) -> TermOut:
    weight = torch.pow(1.0 + torch.exp(tile.target_logprob()), gamma)
    return TermOut(factor=weight, values=(weight,))


class AntiFocalLoss:
    """The anti-focal loss for any training loop.

    Args:
        gamma: the exponent of (1 + p_t) (``--antifocal-gamma``, >= 0; 0 = cross-entropy).
        constant_weight: the released code's reading, the factor without gradient
            (``--antifocal-constant-weight``).
    """

    def __init__(self, *, gamma: float = 1.0, constant_weight: bool = False):
        self.gamma = float(check_number("antifocal_gamma", gamma, 0))
        self.constant_weight = bool(constant_weight)

    def weights(self) -> AntiFocalWeights:
        return AntiFocalWeights(self.gamma, self.constant_weight)

    def __call__(self, hidden, weight, target, request: Optional[LossRequest] = None,
                 training: bool = True) -> LossResult:
        """The weighted fused loss; ``training=False`` (validation, as the released code's) is plain
        (label-smoothed) cross-entropy. ``LossResult.nll`` is plain NLL either way."""
        request = LossRequest() if request is None else request
        return fused_linear_loss(hidden, weight, target, request.with_terms(self.weights() if training else None))
