"""Adaptive Gradient Gating (Yu et al., ACL 2022, §4), the method's math in one place; pure torch.

* :func:`agg_gates` turns the window counts (:class:`fairseq_agg.ops.counting.RareTokenWindow`, the
  paper's dynamic rare-token grouping; docs/agg.md (A1)) into the rare group and the gate vectors g1, g2
  (docs/agg.md (A2)-(A4));
* :class:`TokenGates` is AGG's term of the fused output layer (:mod:`fairseq_agg.ops.terms`): the
  gate factor on a chunk of the logit gradient (docs/agg.md (A5)), with which the chunk body
  (:mod:`fairseq_agg.ops.output_chunk`) forms dH from the un-gated gradient and dW from the gated
  one (A6); the same gate in place after dH (on a CPU); and on another fused cross-entropy, the
  gated dW by algebra (docs/agg.md, "AGG on another kernel");
* :func:`check_alpha` keeps every gate <= 1; :func:`gate_statistics` is what AGG logs.

The formulas, the defaults and where this code departs from the released code are in
``docs/agg.md``.
"""
from dataclasses import dataclass
from typing import Dict, NamedTuple

import torch

from fairseq_agg.errors import UsageError, check_number

from .foreign_kernels import ForeignRows, target_and_summed_logits
from .terms import GATES_DW, Term, TermOut

G2_EPS = 1e-7  # the released code's guard in c_k / (mean_R c + eps)


@dataclass
class TokenGates(Term):
    """AGG gate vectors (length V each) for one micro-batch, from :func:`agg_gates`; the fused
    layer's term that gates dW (docs/agg.md (A5)-(A6)).

    ``g1`` scales the gradient of token k's logit in contexts whose target is not rare, ``g2`` in
    contexts whose target is rare; the target's own column is never gated.
    """

    g1: torch.Tensor
    g2: torch.Tensor
    rare: torch.Tensor  # bool

    name = "agg"
    role = GATES_DW
    gates_in_place = True
    foreign_refusal = None  # by algebra: :meth:`foreign_grad_weight`

    def to(self, device) -> "TokenGates":
        return TokenGates(g1=self.g1.to(device), g2=self.g2.to(device), rare=self.rare.to(device))

    def gate_inputs(self, target: torch.Tensor) -> "GateInputs":
        """The gate vectors and, per row of targets ``target``, whether its target is rare."""
        return GateInputs(g1=self.g1, g2=self.g2, rare_target=self.rare.index_select(0, target))

    def tile_inputs(self, rows: slice, target: torch.Tensor, acc: torch.dtype) -> "GateInputs":
        return self.gate_inputs(target)

    @staticmethod
    def tile(tile, inputs: "GateInputs") -> TermOut:
        """The (rows x V) factor Gamma with G_w = Gamma * G (docs/agg.md (A5)): rows with a non-rare
        target are scaled by g1 (1 outside the rare group, so the target's own column is
        untouched), rows with a rare target by g2 except in their own target column."""
        rare_rows = inputs.rare_target.unsqueeze(1)
        own_or_g2 = torch.where(tile.is_target, torch.ones_like(inputs.g2), inputs.g2.unsqueeze(0))
        return TermOut(factor=torch.where(rare_rows, own_or_g2, inputs.g1.unsqueeze(0)))

    @staticmethod
    def scale_rows_(grad: torch.Tensor, inputs: "GateInputs") -> None:
        """Every row of ``grad`` times its g1 or g2 vector, in place (the one pass over the chunk
        of :meth:`gate_in_place`)."""
        grad.mul_(torch.where(inputs.rare_target.unsqueeze(1), inputs.g2.unsqueeze(0), inputs.g1.unsqueeze(0)))

    def gate_in_place(self, grad: torch.Tensor, target: torch.Tensor, run=None) -> None:
        """G_w = Gamma * G over a written chunk gradient, in place: :meth:`scale_rows_` (through
        ``run(function, grad, inputs_of)`` where given: compiled, or block by block), then each
        row's own target column put back. A non-rare target's g1 is 1, so this is Gamma exactly,
        without the per-element comparison with the target, which halves the pass on a CPU."""
        own = grad.gather(1, target.unsqueeze(1))
        if run is None:
            self.scale_rows_(grad, self.gate_inputs(target))
        else:
            run(self.scale_rows_, grad, lambda rows: self.gate_inputs(target[rows]))
        grad.scatter_(1, target.unsqueeze(1), own)

    # --- on another fused cross-entropy (docs/agg.md, "AGG on another kernel")
    def foreign_row_classes(self, target: torch.Tensor):
        """The rows whose target is not rare (A) and those whose target is (B)."""
        rare_row = self.rare.index_select(0, target)
        return [(~rare_row).nonzero().squeeze(1), rare_row.nonzero().squeeze(1)]

    def foreign_grad_weight(self, rows: ForeignRows) -> torch.Tensor:
        """Row k of the gated dW from the un-gated dW of A and B (:meth:`foreign_row_classes`):

            dW_k = g1_k (G_A^T H_A)_k + g2_k (G_B^T H_B)_k + sum_{n in B, y_n = k} (1 - g2_k) G[n, k] h_n,

        the last sum restoring the target's own column, which is never gated
        (:func:`target_column_correction`). All of it is O(N d)."""
        acc = torch.float64 if rows.weight.dtype == torch.float64 else torch.float32
        rare_rows = rows.classes[1]
        grad_weight = (self.g1.to(acc).unsqueeze(1) * rows.parts[0].to(acc)
                       + self.g2.to(acc).unsqueeze(1) * rows.parts[1].to(acc))
        if rare_rows.numel():
            grad_weight += target_column_correction(
                rows.hidden.index_select(0, rare_rows), rows.weight, rows.target.index_select(0, rare_rows),
                rows.row_loss.index_select(0, rare_rows), rows.epsilon, self.g2,
                rows.grad_rows.index_select(0, rare_rows))
        return grad_weight


class GateInputs(NamedTuple):
    g1: torch.Tensor  # (V,)
    g2: torch.Tensor  # (V,)
    rare_target: torch.Tensor  # (rows,) bool


def target_column_correction(hidden_b, weight, target_b, row_loss_b, epsilon_torch, g2, row_scale_b=None):
    """The last sum of :meth:`TokenGates.foreign_grad_weight`: (V, d) with rows
    sum_{n in B, y_n = k} (1 - g2_k) G[n, k] h_n, from the rare-target rows' features, targets and
    per-row losses; O(N_B d). G[n, y_n] = p(y_n | h_n) - (1 - eps) needs only z_{n, y_n} and the
    row's log-sum-exp, which the kernel's per-row loss gives back exactly
    (:mod:`fairseq_agg.ops.foreign_kernels`)."""
    vocab = weight.size(0)
    acc = row_loss_b.dtype if row_loss_b.dtype == torch.float64 else torch.float32
    target_logit, logit_sum = target_and_summed_logits(hidden_b, weight, target_b, acc)
    lse = row_loss_b.to(acc) + (1 - epsilon_torch) * target_logit + (epsilon_torch / vocab) * logit_sum
    on_target = 1 - epsilon_torch + epsilon_torch / vocab  # Q at the target, = 1 - eps in fairseq's terms
    grad_at_target = torch.exp(target_logit - lse) - on_target
    coef = (1 - g2.to(acc).index_select(0, target_b)) * grad_at_target
    if row_scale_b is not None:
        coef = coef * row_scale_b.to(acc)
    return torch.zeros(weight.shape, dtype=acc, device=weight.device).index_add_(
        0, target_b, coef.unsqueeze(1) * hidden_b.to(acc))


# Tokens per optimizer update of the AGG paper's recipes (the released code's training commands;
# docs/agg.md, "Flags"): WikiText-103 LM --max-tokens 4096 x --update-freq 8 = 32,768 target tokens;
# WMT14 En-De --max-tokens 8192 x --update-freq 8 = 65,536 tokens (an upper bound, less padding).
PAPER_TOKENS_PER_UPDATE = {"language_modeling": 32768, "translation": 65536}
# The released per-update rule at alpha 0.03 in the paper's WikiText-103 run: about 3,600 updates of
# 32,768 tokens per epoch, so a type is rare below 0.03 x 3,600 = 108 counts per epoch, a target in
# at most 3 % of the updates (docs/agg.md, "The operating point").
PAPER_OPERATING_POINT = (110, 0.03)


def resolve_threshold(threshold_mode: str, ref_tokens: int, translation: bool):
    """(mode, B_ref) of a run: ``auto`` is ``relative``; B_ref 0 is the paper's tokens per update."""
    mode = "relative" if threshold_mode == "auto" else threshold_mode
    if ref_tokens == 0:
        ref_tokens = PAPER_TOKENS_PER_UPDATE["translation" if translation else "language_modeling"]
    return mode, ref_tokens


class OperatingPoint(NamedTuple):
    """Where AGG's threshold sits in a run, in the terms of the paper's analysis (Yu et al. 2022,
    §3): a rare token is a target in few updates and a pushed-away non-target in all the others.
    docs/agg.md, "The operating point", explains the two readings of alpha."""

    count_per_epoch: float  # a type counted fewer times than this in an epoch is rare
    target_share: float  # count_per_epoch / updates_per_epoch: at most this share of updates has it as a target
    tokens_per_update: float
    updates_per_epoch: float


def operating_point(alpha: float, threshold_mode: str, ref_tokens: int, tokens_per_epoch: float,
                    updates_per_epoch: float) -> OperatingPoint:
    """The count per epoch below which a type is rare, and the share of updates in which a type at
    that count is a target (at most one occurrence per update).

    relative: a_k = c_k x B_ref / (tokens in the window) < alpha, so over an epoch of T tokens a type
    is rare below alpha x T / B_ref counts; per-update: a_k = c_k / (updates in the window) < alpha,
    so below alpha x U counts over an epoch of U updates, a share alpha of the updates whatever
    their size."""
    mode = "relative" if threshold_mode == "auto" else threshold_mode
    tokens_per_epoch, updates_per_epoch = float(tokens_per_epoch), float(updates_per_epoch)
    if mode == "relative":
        count = alpha * tokens_per_epoch / ref_tokens
    elif mode == "per-update":
        count = alpha * updates_per_epoch
    else:
        raise ValueError(f"unknown threshold mode {threshold_mode!r}")
    return OperatingPoint(count_per_epoch=count, target_share=count / updates_per_epoch,
                          tokens_per_update=tokens_per_epoch / updates_per_epoch, updates_per_epoch=updates_per_epoch)


G1_MODES = ("code", "normalized")
THRESHOLD_MODES = ("relative", "per-update")


def alpha_allowed_range(g1_mode: str):
    """(allowed-range text, check) of ``alpha`` that keeps every gate <= 1 in ``g1_mode``.

    g2 is capped at 1 by its min(., 1). With ``code`` g1 = a_k on rare tokens, i.e. any value below
    alpha, in every threshold mode (a per-update mean or a count per B_ref tokens can both approach
    alpha), so alpha must be <= 1; with ``normalized`` g1 = a_k / alpha < 1 for every finite alpha.
    inf and nan are refused in both modes (every token would be rare, or none).
    """
    if g1_mode == "code":
        text, high = "in (0, 1] with --agg-g1-mode code (g1 = a_k < alpha must stay <= 1)", 1.0
    elif g1_mode == "normalized":
        text, high = "a finite number > 0", None
    else:
        raise ValueError(f"unknown g1 mode {g1_mode!r} (choose code or normalized)")

    def allowed(alpha) -> bool:
        try:
            check_number("agg_alpha", alpha, 0.0, high, low_open=True)
        except UsageError:
            return False
        return True

    return text, allowed


def check_alpha(alpha, g1_mode: str) -> float:
    """``alpha`` if every gate stays <= 1 with it (:func:`alpha_allowed_range`), else a UsageError."""
    text, allowed = alpha_allowed_range(g1_mode)
    if not allowed(alpha):
        raise UsageError(f"--agg-alpha must be {text}, got {alpha}")
    return float(alpha)


def agg_gates(
    counts: torch.Tensor,
    num_updates: int,
    alpha: float,
    nspecial: int,
    g1_mode: str = "code",
    threshold_mode: str = "per-update",
    ref_tokens: int = 32768,
) -> TokenGates:
    """The AGG gate vectors from the window counts (docs/agg.md (A2)-(A4)).

    * a_k = c_k / num_updates, the mean count per update ("per-update"), or
      a_k = B_ref * c_k / sum_j c_j, the count per update at a reference batch of B_ref tokens
      ("relative"; equal to per-update when every update has B_ref tokens, batch-size invariant);
    * rare <=> a_k < alpha, special ids (< nspecial) never rare;
    * g1_k = a_k on rare tokens (``g1_mode="code"``, the released code) or a_k / alpha
      (``"normalized"``), else 1;
    * g2_k = min(c_k / (mean of c over the rare group + 1e-7), 1) on rare tokens, else 1.
    An empty rare group gives all-ones gates.
    """
    # Masked arithmetic instead of boolean indexing: no host-device synchronisation per micro-batch.
    counts = counts.to(torch.float64)
    if threshold_mode == "per-update":
        if num_updates < 1:
            raise ValueError("num_updates must be >= 1")
        a = counts / num_updates
    elif threshold_mode == "relative":
        a = counts * (ref_tokens / counts.sum().clamp(min=1.0))
    else:
        raise ValueError(f"unknown threshold mode {threshold_mode!r} (choose per-update or relative)")
    rare = a < alpha
    rare[:nspecial] = False
    ones = torch.ones_like(a)
    if g1_mode == "code":
        g1 = torch.where(rare, a, ones)
    elif g1_mode == "normalized":
        g1 = torch.where(rare, a / alpha, ones)
    else:
        raise ValueError(f"unknown g1 mode {g1_mode!r} (choose code or normalized)")
    mean_rare = (counts * rare).sum() / rare.sum().clamp(min=1)
    g2 = torch.where(rare, torch.clamp(counts / (mean_rare + G2_EPS), max=1.0), ones)  # empty R: all ones
    return TokenGates(g1=g1.float(), g2=g2.float(), rare=rare)


def gate_statistics(gates: TokenGates) -> Dict[str, torch.Tensor]:
    """What AGG logs per micro-batch: |R|, the rare tokens with g2 < 1, and the mean g1 and g2 over R
    (1 for an empty R). Tensors, not Python numbers: no device synchronisation."""
    rare = gates.rare.float()
    n_rare = rare.sum()
    denom = n_rare.clamp(min=1)
    return {
        "agg_rare": n_rare,
        "agg_very_rare": ((gates.g2 < 1).float() * rare).sum(),
        "agg_g1": torch.where(n_rare > 0, (gates.g1 * rare).sum() / denom, torch.ones_like(n_rare)),
        "agg_g2": torch.where(n_rare > 0, (gates.g2 * rare).sum() / denom, torch.ones_like(n_rare)),
    }
