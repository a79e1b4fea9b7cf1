"""AGG (Yu et al., ACL 2022, §4), the method's math in one place; pure torch. The fairseq criterion
``cross_entropy_agg`` is a thin user of the same objects.

* :class:`AggLoss` owns the counting window of the last K optimizer updates
  (:class:`~fairseq_agg.ops.counting.RareTokenWindow`, the paper's dynamic rare-token grouping;
  docs/agg.md (A1)) and turns it into the gates of every training micro-batch;
* :func:`agg_gates` is that step: the rare group and the gate vectors g1, g2 (docs/agg.md (A2)-(A4));
* :class:`TokenGates` is AGG's term of the fused output layer (:class:`~fairseq_agg.ops.term.Term`):
  the gate factor on a chunk of the logit gradient (docs/agg.md (A5)), with which the chunk body
  forms dH from the un-gated gradient and dW from the gated one (A6); the same gate in place after
  dH (on a CPU); and on another fused cross-entropy, the gated dW by algebra (docs/agg.md, "AGG on
  another kernel");
* :func:`gate_statistics` is what AGG logs.

What alpha means in a run, and its allowed range, is :mod:`fairseq_agg.ops.agg_threshold` (read at
start-up); rare-token freezing, which zeroes the rare tokens' rows instead, is
:mod:`fairseq_agg.ops.freezing`. The formulas, the defaults and where this code departs from the
released code are in ``docs/agg.md``.
"""
from dataclasses import dataclass
from typing import Dict, NamedTuple, Optional

import torch

from fairseq_agg.errors import UsageError, check_choice, check_integer

from .agg_threshold import (
    G1_MODES, PAPER_OPERATING_POINT, PAPER_TOKENS_PER_UPDATE, THRESHOLD_MODES, OperatingPoint, check_alpha,
    operating_point,
)
from .counting import CountsPerUpdate, RareTokenWindow
from .foreign_kernels import ForeignRows, target_and_summed_logits
from .fused_linear_loss import LossRequest, LossResult, fused_linear_loss
from .term import GATES_DW, Term, TermOut

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


class AggLoss(CountsPerUpdate):
    """Adaptive gradient gating of rare-token output embeddings.

    Args:
        vocab_size: V, the rows of the output projection.
        alpha: rare-token threshold (``--agg-alpha``): in (0, 1] with ``g1_mode="code"``, > 0 with
            ``"normalized"``.
        window: K, the optimizer updates counted (``--agg-window``); ``None``: set it later with
            :meth:`set_window` (fairseq sets one epoch of updates once the epoch's length is known).
        nspecial: the first ``nspecial`` ids are never rare (fairseq: bos, pad, eos, unk).
        g1_mode: ``"code"`` (g1 = a_k, the released code) or ``"normalized"`` (a_k / alpha).
        threshold_mode: ``"relative"`` (a_k = count per ``ref_tokens`` target tokens of the window,
            batch-size invariant) or ``"per-update"`` (mean count per update, the released code).
        ref_tokens: B_ref of the relative mode; ``None`` = 32,768, the paper's LM recipe. Refused
            in per-update mode, where it means nothing.
        all_reduce: sum the histograms over the data-parallel ranks of ``process_group`` (a no-op
            without torch.distributed); off = each rank counts its own targets.

    Counting is explicit: :meth:`start_update` with the number of optimizer updates completed so
    far (every micro-batch of an update passes the same number), then :meth:`count` per
    micro-batch; :meth:`step` does both and returns the gates. Validation never counts.
    """

    def __init__(self, vocab_size: int, *, alpha: float = 0.03, window: Optional[int] = None, nspecial: int = 4,
                 g1_mode: str = "code", threshold_mode: str = "relative", ref_tokens: Optional[int] = None,
                 all_reduce: bool = True, process_group=None):
        self.vocab_size = check_integer("vocab_size", vocab_size, 2)
        self.nspecial = check_integer("nspecial", nspecial, 0, self.vocab_size)
        self.g1_mode = check_choice("agg_g1_mode", g1_mode, G1_MODES)
        self.alpha = check_alpha(alpha, self.g1_mode)
        self.threshold_mode = check_choice("agg_threshold_mode", threshold_mode, THRESHOLD_MODES)
        if self.threshold_mode == "per-update" and ref_tokens is not None:
            raise UsageError("--agg-ref-tokens needs --agg-threshold-mode relative (or auto): per-update counting "
                             "has no reference batch")
        if self.threshold_mode == "relative":
            default = PAPER_TOKENS_PER_UPDATE["language_modeling"]
            ref_tokens = check_integer("agg_ref_tokens", default if ref_tokens is None else ref_tokens, 1)
        self.ref_tokens = ref_tokens
        self.counter = RareTokenWindow(self.vocab_size, window, flag="agg_window")
        self.window_flag = "--agg-window"
        self.all_reduce = bool(all_reduce)
        self.process_group = process_group

    def gates(self, device=None) -> TokenGates:
        """The gates from the window as it is now (docs/agg.md (A2)-(A4))."""
        gates = agg_gates(
            self.counter.counts, self.counter.recorded, self.alpha, self.nspecial, g1_mode=self.g1_mode,
            threshold_mode=self.threshold_mode, ref_tokens=self.ref_tokens or 0,
        )
        return gates if device is None else gates.to(device)

    def step(self, target: torch.Tensor, update_num: int) -> TokenGates:
        """One training micro-batch: opens its update, counts its targets, returns its gates."""
        self.start_update(update_num)
        self.count(target)
        return self.gates(target.device)

    def __call__(self, hidden, weight, target, update_num: Optional[int] = None,
                 request: Optional[LossRequest] = None) -> LossResult:
        """The fused loss with AGG's gates; with ``update_num`` (training) the targets are counted
        first, without it (validation) nothing is counted or gated. ``request`` adds other terms."""
        request = LossRequest() if request is None else request
        if update_num is not None:
            request = request.with_terms(self.step(target, update_num))
        return fused_linear_loss(hidden, weight, target, request)

    def describe(self) -> str:
        """What ``alpha`` means with these settings, in one line."""
        size = self.counter.window
        if self.threshold_mode == "relative":
            return (f"a token is rare below {self.alpha:g} occurrences per {self.ref_tokens} target tokens "
                    f"(relative frequency < {self.alpha / self.ref_tokens:.3g}, whatever the tokens per update); "
                    f"{size} updates per window")
        return (f"a token is rare below {self.alpha:g} occurrences per optimizer update (--agg-threshold-mode "
                f"per-update: the threshold scales with the tokens per update); {size} updates per window")

    def operating_point(self, tokens_per_epoch: float, updates_per_epoch: float) -> OperatingPoint:
        """The count per epoch below which a type is rare here, and the share of updates in which a
        type at that count is a target (:func:`~fairseq_agg.ops.agg_threshold.operating_point`)."""
        return operating_point(self.alpha, self.threshold_mode, self.ref_tokens or 0, tokens_per_epoch,
                               updates_per_epoch)

    def describe_operating_point(self, tokens_per_epoch: float, updates_per_epoch: float) -> str:
        """:meth:`operating_point` in one line, beside the paper's."""
        p = self.operating_point(tokens_per_epoch, updates_per_epoch)
        return (f"operating point: a type is rare below {p.count_per_epoch:.3g} occurrences per epoch "
                f"({tokens_per_epoch:,.0f} target tokens in {updates_per_epoch:,.0f} updates of about "
                f"{p.tokens_per_update:,.0f}); a type at that count is a target in at most {100 * p.target_share:.3g} % "
                f"of the updates (the paper's WikiText-103 LM: below about {PAPER_OPERATING_POINT.count_per_epoch:.3g} "
                f"per epoch, {100 * PAPER_OPERATING_POINT.target_share:.3g} % of the updates)")
