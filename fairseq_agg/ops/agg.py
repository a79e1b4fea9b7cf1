"""AGG (Yu et al., ACL 2022, §4) as an object for any training loop; the fairseq criterion
``cross_entropy_agg`` is a thin user of the same object.

:class:`AggLoss` owns the counting window of the last K optimizer updates and turns it into the
gates of every training micro-batch (docs/agg.md (A1)-(A5)), a term of the fused output layer
(:class:`~fairseq_agg.ops.agg_gates.TokenGates`) that forms the gated gradient (A6). Rare-token
freezing, which zeroes the rare tokens' rows instead, is :mod:`fairseq_agg.ops.freezing`.
"""
from typing import Optional

import torch

from fairseq_agg.errors import UsageError, check_choice, check_integer

from .agg_gates import (
    G1_MODES, PAPER_OPERATING_POINT, PAPER_TOKENS_PER_UPDATE, THRESHOLD_MODES, OperatingPoint, TokenGates,
    agg_gates, check_alpha, operating_point,
)
from .counting import CountsPerUpdate, RareTokenWindow
from .fused_linear_loss import LossRequest, LossResult, fused_linear_loss


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
        type at that count is a target (:func:`~fairseq_agg.ops.agg_gates.operating_point`)."""
        return operating_point(self.alpha, self.threshold_mode, self.ref_tokens or 0, tokens_per_epoch,
                               updates_per_epoch)

    def describe_operating_point(self, tokens_per_epoch: float, updates_per_epoch: float) -> str:
        """:meth:`operating_point` in one line, beside the paper's."""
        p = self.operating_point(tokens_per_epoch, updates_per_epoch)
        return (f"operating point: a type is rare below {p.count_per_epoch:.3g} occurrences per epoch "
                f"({tokens_per_epoch:,.0f} target tokens in {updates_per_epoch:,.0f} updates of about "
                f"{p.tokens_per_update:,.0f}); a type at that count is a target in at most {100 * p.target_share:.3g} % "
                f"of the updates (the paper's WikiText-103 LM: below about {PAPER_OPERATING_POINT[0]} per epoch, "
                f"{100 * PAPER_OPERATING_POINT[1]:g} % of the updates)")
