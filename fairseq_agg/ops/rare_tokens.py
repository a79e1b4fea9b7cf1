"""Dynamic rare-token grouping of AGG (Yu et al., ACL 2022, §3.2; spec agg.md §3-§4, §5.5, §6).

``RareTokenWindow`` counts how often each vocabulary id appears as a target over the last K
optimizer updates (a ring of K per-update histograms plus a running sum); ``agg_gates`` turns the
window counts into the gate vectors g1 and g2. Both are pure torch and know nothing of fairseq.
"""
from typing import Optional

import torch
import torch.distributed as dist

from .fused_linear_loss import TokenGates

G2_EPS = 1e-7  # the reference code's guard in c_k / (mean_R c + eps)


class RareTokenWindow(torch.nn.Module):
    """Target counts over a sliding window of the last ``window`` optimizer updates.

    The window holds the current (partial) update plus the ``window - 1`` previous ones, as the
    reference ring buffer does (agg.md §3.3). ``start_update(t)`` must be called with the update
    index before the histograms of that update are added; calling it again with the same t (every
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
        self.update_index = t
        self.recorded = min(self.recorded + steps, self.window)

    def add(self, histogram: torch.Tensor):
        """Adds one micro-batch's target histogram (length V, integer) to the current update."""
        histogram = histogram.to(torch.int64)
        if self.counts.device != histogram.device:
            self.counts = self.counts.to(histogram.device)
            self.current = self.current.to(histogram.device)
        self.counts += histogram
        self.current += histogram

    def total_tokens(self) -> int:
        return int(self.counts.sum())

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
        device = self.counts.device
        self.window = window
        self.ring = ring.to("cpu", torch.int32).clone()
        self.counts = state_dict[prefix + "counts"].to(device, torch.int64).clone()
        self.current = state_dict[prefix + "current"].to(device, torch.int64).clone()
        self.update_index = update_index
        self.recorded = recorded


def target_histogram(target: torch.Tensor, vocab_size: int, all_reduce: bool = False, group=None) -> torch.Tensor:
    """Histogram of the (already pad-free) target ids, summed over data-parallel ranks if asked.

    Every rank must call this the same number of times when ``all_reduce`` is on (fairseq gives
    all ranks the same number of micro-batches, using dummy batches with an empty target).
    """
    hist = torch.bincount(target.reshape(-1), minlength=vocab_size)
    if all_reduce and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(hist, group=group)
    return hist


def agg_gates(
    counts: torch.Tensor,
    num_updates: int,
    alpha: float,
    nspecial: int,
    g1_mode: str = "code",
    threshold_mode: str = "per-update",
    ref_tokens: int = 32768,
) -> TokenGates:
    """The AGG gate vectors from the window counts (agg.md §3.4, §4.1, §6).

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
