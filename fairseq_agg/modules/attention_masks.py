"""The attention masks of :class:`~fairseq_agg.modules.mlra.MultiheadLowRankAttention` in the form
``F.scaled_dot_product_attention`` takes them: recognising fairseq's future mask (so that SDPA can
run its causal kernels without a mask) and merging an attention mask with a key-padding mask."""
from typing import Optional, Tuple

import torch
from torch import Tensor


class FutureMaskCheck:
    """Tells whether attn_mask is fairseq's square future mask (0 on and below the diagonal, masked
    above). The answer is cached per mask tensor so that the check, which needs a device sync, runs
    once; holding a reference keeps the storage from being reused."""

    def __init__(self):
        self._last: Optional[Tuple[Tensor, int, bool]] = None

    def __call__(self, attn_mask: Tensor) -> bool:
        if attn_mask.dim() != 2 or attn_mask.size(0) != attn_mask.size(1):
            return False
        c = self._last
        if (c is not None and c[0].data_ptr() == attn_mask.data_ptr()
                and c[0].shape == attn_mask.shape and c[0].stride() == attn_mask.stride()
                and c[0].dtype == attn_mask.dtype and c[1] == attn_mask._version):
            return c[2]
        with torch.no_grad():
            if attn_mask.dtype == torch.bool:
                upper = torch.triu(attn_mask, 1)
                ok = bool(torch.equal(upper, torch.triu(torch.ones_like(attn_mask), 1))
                          and not torch.tril(attn_mask).any())
            else:
                m = attn_mask.float()
                strict = torch.triu(torch.ones_like(m, dtype=torch.bool), 1)
                ok = bool((m[strict] == float("-inf")).all() and (m[~strict] == 0).all())
        self._last = (attn_mask, attn_mask._version, ok)
        return ok


def combined_mask(attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor], kv_bsz: int,
                  dtype: torch.dtype) -> Optional[Tensor]:
    """One mask for [kv_bsz, H, T, S] scores: bool (True = attend) when no additive mask is
    involved, else additive float in the scores' dtype. attn_mask [T, S] is additive if float
    (as fairseq's future mask), or True = masked if bool/uint8 (as F.multi_head_attention_forward).
    key_padding_mask [kv_bsz, S]: nonzero = padding."""
    kpm = None
    if key_padding_mask is not None:
        kpm = key_padding_mask.to(torch.bool).view(kv_bsz, 1, 1, -1)
    if attn_mask is None:
        return None if kpm is None else ~kpm
    if attn_mask.dtype in (torch.bool, torch.uint8):
        keep = ~attn_mask.to(torch.bool)
        return keep if kpm is None else keep & ~kpm
    m = attn_mask.to(dtype)
    if kpm is not None:
        m = m.masked_fill(kpm, float("-inf"))
    return m
