"""Adaptive Gradient Gating (Yu et al., ACL 2022, §4), the method's math in one place; pure torch.

* :class:`RareTokenWindow` counts how often each vocabulary id is a *target* over the last K
  optimizer updates (the paper's dynamic rare-token grouping; docs/agg.md (A1));
* :func:`agg_gates` turns the window counts into the rare group and the gate vectors g1, g2
  (docs/agg.md (A2)-(A4));
* :meth:`TokenGates.gate_logit_grad_` applies the gates to a chunk of the logit gradient
  (docs/agg.md (A5)); the fused output layer (:mod:`fairseq_agg.ops.fused_linear_loss`) calls it
  after forming the hidden-state gradient and before the output-embedding gradient (A6).
* :func:`frozen_rare_rows` is the gate variant of the paper's freezing analysis (§3, Table 1):
  g1 = g2 = 0 on the rare group *and* its own column zeroed too, i.e. the whole output-side rows
  of dW of the rare tokens are zero (docs/baselines.md, "Rare-token freezing").

The formulas, the defaults and where this code departs from the released code are in
``docs/agg.md``.
"""
import logging
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

G2_EPS = 1e-7  # the released code's guard in c_k / (mean_R c + eps)


@dataclass
class TokenGates:
    """AGG gate vectors (length V each) for one micro-batch, from :func:`agg_gates`.

    ``g1`` scales the gradient of token k's logit in contexts whose target is not rare, ``g2`` in
    contexts whose target is rare; the target's own column is never gated.
    """

    g1: torch.Tensor
    g2: torch.Tensor
    rare: torch.Tensor  # bool

    def to(self, device) -> "TokenGates":
        return TokenGates(g1=self.g1.to(device), g2=self.g2.to(device), rare=self.rare.to(device))

    def gate_logit_grad_(self, grad: torch.Tensor, target: torch.Tensor):
        """Gates the logit gradient ``grad`` (rows x V) of the rows with targets ``target``, in place.

        Rows with a non-rare target are scaled by g1 (g1 = 1 outside the rare group, so only rare
        columns change and the target column is untouched); rows with a rare target by g2, except
        in their own target column (docs/agg.md (A5)).
        """
        rare_target_rows = self.rare.index_select(0, target).nonzero().squeeze(1)
        if rare_target_rows.numel():
            rare_rows = grad.index_select(0, rare_target_rows)
            own_column = target.index_select(0, rare_target_rows).unsqueeze(1)
            keep = rare_rows.gather(1, own_column)
            rare_rows.mul_(self.g2.unsqueeze(0))
            rare_rows.scatter_(1, own_column, keep)
        grad.mul_(self.g1.unsqueeze(0))
        if rare_target_rows.numel():
            grad.index_copy_(0, rare_target_rows, rare_rows)


class RareTokenWindow(torch.nn.Module):
    """Target counts over a sliding window of the last ``window`` optimizer updates.

    The window holds the current (partial) update plus the ``window - 1`` previous ones, as the
    released code's ring buffer does. ``start_update(t)`` must be called with the update index
    before the histograms of that update are added; calling it again with the same t (every
    micro-batch of one update, or a repeated index after an fp16 overflow) is a no-op.

    Storage: the (window x V) ring of int32 rows stays in host memory (one row is touched per
    update); the running sum and the current update's histogram live on the device of the
    histograms. Everything is saved and restored through ``state_dict`` so a resumed run continues
    with identical counts.
    """

    def __init__(self, vocab_size: int, window: Optional[int] = None):
        super().__init__()
        self.vocab_size = int(vocab_size)
        self.window = None
        self.ring = None  # (window, V) int32, CPU
        self.counts = torch.zeros(self.vocab_size, dtype=torch.int64)  # running window sum S
        self.current = torch.zeros(self.vocab_size, dtype=torch.int64)  # histogram of update `update_index`
        self.update_index = 0  # t of the update being counted (0 = none yet)
        self.recorded = 0  # updates in the window, capped at `window` (the denominator)
        if window is not None:
            self.set_window(window)

    @property
    def is_configured(self) -> bool:
        return self.ring is not None

    def set_window(self, window: int):
        if window < 1:
            raise ValueError(f"the window must be >= 1 updates, got {window}")
        if self.ring is not None:
            if self.ring.size(0) != window:
                raise ValueError(f"window already set to {self.ring.size(0)} updates, cannot change it to {window}")
            return
        self.window = int(window)
        self.ring = torch.zeros(self.window, self.vocab_size, dtype=torch.int32)

    def _slot(self, t: int) -> int:
        return t % self.window

    def resize(self, window: int):
        """Changes the window to ``window`` updates, keeping the newest updates that both sizes hold.

        The current update and the ``min(old, new) - 1`` finished updates before it keep their
        counts; older rows are dropped (shrinking). Growing keeps every count and the window fills
        up from there: the denominator stays the number of updates held, capped at the new size.
        """
        if window < 1:
            raise ValueError(f"the window must be >= 1 updates, got {window}")
        if not self.is_configured or window == self.window:
            self.set_window(window)
            return
        t = self.update_index
        ring = torch.zeros(window, self.vocab_size, dtype=torch.int32)
        for s in range(max(t - min(window, self.window) + 1, 1), t):  # finished updates kept
            ring[s % window] = self.ring[self._slot(s)]
        self.ring, self.window = ring, int(window)
        self.counts = ring.sum(0).to(self.counts.device, torch.int64) + self.current
        self.recorded = min(self.recorded, self.window)

    def start_update(self, t: int):
        """Opens update t (= fairseq's update_num + 1): drops the update that is `window` updates old."""
        if not self.is_configured:
            raise RuntimeError("RareTokenWindow.set_window must be called before counting")
        if t == self.update_index:
            return
        if self.update_index > 0:  # commit the finished update to its ring row
            self.ring[self._slot(self.update_index)] = self.current.to("cpu", torch.int32)
        # Normally t = update_index + 1; a jump (or a restart from 0) drops every slot it passes.
        steps = t - self.update_index if t > self.update_index else 1
        for s in range(max(t - min(steps, self.window) + 1, 1), t + 1):
            old = self.ring[self._slot(s)]
            if old.any():
                self.counts -= old.to(self.counts.device, torch.int64)
            old.zero_()
        self.current.zero_()
        # The denominator counts updates since the first one this window saw (a run that starts,
        # or fine-tunes from a checkpoint without counts, at update 5001 has recorded 1, not K).
        first = self.update_index == 0 and self.recorded == 0
        self.update_index = t
        self.recorded = 1 if first else min(self.recorded + steps, self.window)

    def add(self, histogram: torch.Tensor):
        """Adds one micro-batch's target histogram (length V, integer) to the current update."""
        histogram = histogram.to(torch.int64)
        if self.counts.device != histogram.device:
            self.counts = self.counts.to(histogram.device)
            self.current = self.current.to(histogram.device)
        self.counts += histogram
        self.current += histogram

    # --- checkpointing: the ring is not a registered buffer (it stays on the CPU), so the module
    # writes and reads its own entries.
    _KEYS = ("ring", "counts", "current", "meta")

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if self.ring is None:
            return
        destination[prefix + "ring"] = self.ring.clone()
        destination[prefix + "counts"] = self.counts.detach().cpu().clone()
        destination[prefix + "current"] = self.current.detach().cpu().clone()
        destination[prefix + "meta"] = torch.tensor([self.window, self.update_index, self.recorded], dtype=torch.int64)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        present = [k for k in self._KEYS if prefix + k in state_dict]
        if not present:
            return  # a checkpoint without counts (e.g. from a stock criterion): start fresh
        if len(present) != len(self._KEYS):
            missing_keys.extend(prefix + k for k in self._KEYS if k not in present)
            return
        ring = state_dict[prefix + "ring"]
        if ring.size(1) != self.vocab_size:
            error_msgs.append(f"{prefix}ring has vocabulary size {ring.size(1)}, expected {self.vocab_size}")
            return
        window, update_index, recorded = (int(v) for v in state_dict[prefix + "meta"].tolist())
        configured_window = self.window  # this run's --agg-window (None: auto, the checkpoint's K stays)
        device = self.counts.device
        self.window = window
        self.ring = ring.to("cpu", torch.int32).clone()
        self.counts = state_dict[prefix + "counts"].to(device, torch.int64).clone()
        self.current = state_dict[prefix + "current"].to(device, torch.int64).clone()
        self.update_index = update_index
        self.recorded = recorded
        if configured_window is not None and configured_window != window:
            logger.warning(
                f"--agg-window {configured_window} differs from the checkpoint's window of {window} updates: "
                f"resizing it to {configured_window} (the newest updates keep their counts)"
            )
            self.resize(configured_window)


def target_histogram(target: torch.Tensor, vocab_size: int, all_reduce: bool = False, group=None) -> torch.Tensor:
    """Histogram of the (already pad-free) target ids, summed over data-parallel ranks if asked.

    Every rank must call this the same number of times when ``all_reduce`` is on (fairseq gives
    all ranks the same number of micro-batches, using dummy batches with an empty target).
    """
    hist = torch.bincount(target.reshape(-1), minlength=vocab_size)
    if all_reduce and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(hist, group=group)
    return hist


# Tokens per optimizer update of the AGG paper's recipes (the released code's training commands;
# docs/agg.md, "Flags"): WikiText-103 LM --max-tokens 4096 x --update-freq 8 = 32,768 target tokens;
# WMT14 En-De --max-tokens 8192 x --update-freq 8 = 65,536 tokens (an upper bound, less padding).
PAPER_TOKENS_PER_UPDATE = {"language_modeling": 32768, "translation": 65536}


def resolve_threshold(threshold_mode: str, ref_tokens: int, translation: bool):
    """(mode, B_ref) of a run: ``auto`` is ``relative``; B_ref 0 is the paper's tokens per update."""
    mode = "relative" if threshold_mode == "auto" else threshold_mode
    if ref_tokens == 0:
        ref_tokens = PAPER_TOKENS_PER_UPDATE["translation" if translation else "language_modeling"]
    return mode, ref_tokens


def alpha_allowed_range(g1_mode: str):
    """(allowed-range text, check) of ``alpha`` that keeps every gate <= 1 in ``g1_mode``.

    g2 is capped at 1 by its min(., 1). With ``code`` g1 = a_k on rare tokens, i.e. any value below
    alpha, in every threshold mode (a per-update mean or a count per B_ref tokens can both approach
    alpha), so alpha must be <= 1; with ``normalized`` g1 = a_k / alpha < 1 for every finite alpha.
    inf and nan are refused in both modes (every token would be rare, or none).
    """
    if g1_mode == "code":
        return "in (0, 1] with --agg-g1-mode code (g1 = a_k < alpha must stay <= 1)", \
            lambda alpha: math.isfinite(alpha) and 0 < alpha <= 1
    if g1_mode == "normalized":
        return "a finite number > 0", lambda alpha: math.isfinite(alpha) and alpha > 0
    raise ValueError(f"unknown g1 mode {g1_mode!r} (choose code or normalized)")


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


def frozen_rare_rows(vocab_size: int, gates: Optional[TokenGates] = None, group: Optional[torch.Tensor] = None,
                     device=None) -> torch.Tensor:
    """Rare-token freezing: the (V,) bool mask of output-embedding rows that get no gradient.

    Either AGG's rare group of this micro-batch (``gates.rare``, the window-and-threshold set) or a
    fixed group of ids (``group``, e.g. the static bottom 20 % of the dictionary). Zeroing these
    rows of dW is AGG's gating with g1 = g2 = 0 on them and the target's own column included; the
    fused output layer does it once per micro-batch, after its chunk loop.
    """
    if (gates is None) == (group is None):
        raise ValueError("frozen_rare_rows needs exactly one of gates and group")
    if gates is not None:
        return gates.rare.to(device=device, dtype=torch.bool)
    mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    mask[group.to(mask.device)] = True
    return mask
