"""MLRA attention: fairseq's multi-head attention with low-rank factorised projections.

MLRA is the stability method of Chung et al., "Stable Language Model Pre-training by Reducing
Embedding Variability" (EMNLP 2024, arXiv 2409.07787), §3 "Mitigating TEV with Factorization":
each of the Q, K, V projections is a product of two thin matrices, W x ~= W_U (W_D x), with nothing
in between (:class:`~fairseq_agg.modules.low_rank_linear.LowRankLinear`). This is *not* the
KV-cache sharding method of Liu et al. (2026) that shares the name.

:class:`MultiheadLowRankAttention` is a drop-in for fairseq's ``MultiheadAttention``: the same
constructor arguments, forward signature, return values and incremental-state layout (so beam
search and cache reordering work unchanged). Attention runs through
``F.scaled_dot_product_attention`` (its masks: :mod:`fairseq_agg.modules.attention_masks`) unless
attention weights are requested. Design notes and the parameter formulas: ``docs/mlra.md``.
"""
import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fairseq.models.fairseq_incremental_decoder import FairseqIncrementalDecoder
from fairseq.modules.fairseq_dropout import FairseqDropout
from fairseq.modules.multihead_attention import MultiheadAttention
from fairseq.modules.quant_noise import quant_noise
from fairseq_agg.modules.attention_masks import FutureMaskCheck, combined_mask
from fairseq_agg.modules.low_rank_linear import LowRankLinear, low_rank_param_count, xavier_std
from fairseq_agg.modules.mlra_options import METHOD_NAME, MLRAOptions

IncrementalState = Dict[str, Dict[str, Optional[Tensor]]]


def mha_param_count(embed_dim: int, kdim: Optional[int] = None, vdim: Optional[int] = None,
                    bias: bool = True, add_bias_kv: bool = False) -> int:
    """Parameters of fairseq's MultiheadAttention: q, k, v, out projections (+ bias_k/v)."""
    kdim = embed_dim if kdim is None else kdim
    vdim = embed_dim if vdim is None else vdim
    b = embed_dim if bias else 0
    n = (embed_dim * embed_dim + b) * 2 + (kdim * embed_dim + b) + (vdim * embed_dim + b)
    return n + (2 * embed_dim if add_bias_kv else 0)


def mlra_param_count(embed_dim: int, num_heads: int, rank: int, mode: str, targets: Sequence[str],
                     kdim: Optional[int] = None, vdim: Optional[int] = None) -> int:
    """Parameters of one MultiheadLowRankAttention (with biases, without bias_k/v): the factorised
    targets by :func:`low_rank_param_count`, the others dense (docs/mlra.md, "Parameter counts")."""
    d_in = {"q": embed_dim, "k": kdim or embed_dim, "v": vdim or embed_dim, "o": embed_dim}
    n = 0
    for target, width in d_in.items():
        if target in targets:
            split = "in" if target == "o" else "out"
            n += low_rank_param_count(width, embed_dim, rank, mode, num_heads, split)
        else:
            n += width * embed_dim + embed_dim
    return n


class MultiheadLowRankAttention(FairseqIncrementalDecoder):
    """Drop-in for ``fairseq.modules.MultiheadAttention`` with low-rank Q/K/V(/O) projections.

    Same constructor arguments as MultiheadAttention plus ``rank``, ``mode``, ``init``,
    ``targets`` (the MLRA flags, validated by :class:`~fairseq_agg.modules.mlra_options.MLRAOptions`)
    and ``where`` (named in errors); the same ``forward`` signature and return values (``attn``
    T x B x C and the weights: B x T x S averaged over heads, H x B x T x S with
    ``need_head_weights``, or the raw scores and values with ``before_softmax``); the same
    incremental state ("attn_state" with prev_key / prev_value of shape B x H x S x d_h, and
    prev_key_padding_mask), so fairseq's beam search and its cache reorder work unchanged. Every
    path goes through the factorised projections: there is no dense fast path.
    """

    def __init__(self, embed_dim, num_heads, kdim=None, vdim=None, dropout=0.0, bias=True,
                 add_bias_kv=False, add_zero_attn=False, self_attention=False,
                 encoder_decoder_attention=False, dictionary=None, q_noise=0.0, qn_block_size=8,
                 xformers_att_config: Optional[str] = None, rank: Optional[int] = None,
                 mode: str = "shared", init: str = "gpt2", targets: Sequence[str] = ("q", "k", "v"),
                 where: str = "attention"):
        super().__init__(dictionary)
        if xformers_att_config is not None:
            raise ValueError("MLRA attention does not support --*-xformers-att-config")
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self.qkv_same_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.dropout_module = FairseqDropout(dropout, module_name=self.__class__.__name__)
        self.head_dim = embed_dim // num_heads
        assert self.head_dim * num_heads == self.embed_dim, "embed_dim must be divisible by num_heads"
        self.scaling = self.head_dim ** -0.5
        self.self_attention = self_attention
        self.encoder_decoder_attention = encoder_decoder_attention
        assert not self.self_attention or self.qkv_same_dim, (
            "Self-attention requires query, key and value to be of the same size"
        )

        options = MLRAOptions(rank=rank, mode=mode, init=init, targets=targets)
        self.mode, self.init, self.targets = options.mode, options.init, options.targets
        self.rank = options.rank_for(embed_dim, num_heads, where)
        if q_noise > 0 and self.mode == "per_head":
            raise ValueError(
                "--quant-noise-pq > 0 is not supported with --mlra-mode per_head; "
                "use --mlra-mode shared or --quant-noise-pq 0"
            )
        self.use_bias = bias
        self.q_noise = q_noise
        self.k_proj = self._build_projection("k", self.kdim, "out", qn_block_size)
        self.v_proj = self._build_projection("v", self.vdim, "out", qn_block_size)
        self.q_proj = self._build_projection("q", embed_dim, "out", qn_block_size)
        self.out_proj = self._build_projection("o", embed_dim, "in", qn_block_size)

        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.Tensor(1, 1, embed_dim))
            self.bias_v = nn.Parameter(torch.Tensor(1, 1, embed_dim))
        else:
            self.bias_k = self.bias_v = None
        self.add_zero_attn = add_zero_attn
        self.beam_size = 1
        self.use_xformers = False
        self.onnx_trace = False
        self.skip_embed_dim_check = False
        # quant-noise hooks act on the sub-modules' forward, so fusing weights would skip them
        self._fuse = q_noise <= 0
        self._is_causal_mask = FutureMaskCheck()
        self._fused_cache: Dict[int, Tuple[tuple, Tensor]] = {}
        self.reset_parameters()
        self.init_incremental_state()

    def _build_projection(self, target: str, d_in: int, split: str, qn_block_size: int) -> nn.Module:
        """A LowRankLinear when ``target`` is factorised, else MultiheadAttention's dense Linear;
        quant-noise (if any) wraps every linear map, as in MultiheadAttention."""
        d_out, q_noise = self.embed_dim, self.q_noise
        if target not in self.targets:
            return quant_noise(nn.Linear(d_in, d_out, bias=self.use_bias), q_noise, qn_block_size)
        p = LowRankLinear(d_in, d_out, self.rank, self.mode, self.num_heads, split, self.use_bias)
        if q_noise > 0:
            p.down = quant_noise(p.down, q_noise, qn_block_size)
            p.up = quant_noise(p.up, q_noise, qn_block_size)
        return p

    # -- bookkeeping shared with fairseq's MultiheadAttention ------------------------------------
    # The cache layout is MultiheadAttention's, so its cache helpers are reused as they are.
    reorder_incremental_state = MultiheadAttention.reorder_incremental_state
    set_beam_size = MultiheadAttention.set_beam_size
    _get_input_buffer = MultiheadAttention._get_input_buffer
    _set_input_buffer = MultiheadAttention._set_input_buffer
    _append_prev_key_padding_mask = staticmethod(MultiheadAttention._append_prev_key_padding_mask)
    _pad_masks = MultiheadAttention._pad_masks

    def prepare_for_onnx_export_(self):
        self.onnx_trace = True

    def _set_skip_embed_dim_check(self):
        self.skip_embed_dim_check = True

    def dense_std(self, name: str) -> float:
        """Per-entry std of fairseq's dense init of the same projection (reset_parameters of
        MultiheadAttention: Xavier-uniform, gain 1/sqrt(2) for q/k/v when the dims match)."""
        if name == "o":
            return xavier_std(self.embed_dim, self.embed_dim)
        d_in = {"q": self.embed_dim, "k": self.kdim, "v": self.vdim}[name]
        gain = 1 / math.sqrt(2) if self.qkv_same_dim else 1.0
        return xavier_std(d_in, self.embed_dim, gain)

    def reset_parameters(self):
        for name in ("q", "k", "v", "o"):
            p = getattr(self, "out_proj" if name == "o" else name + "_proj")
            if isinstance(p, LowRankLinear):
                p.reset_parameters(self.init, self.dense_std(name))
            elif name == "o":
                nn.init.xavier_uniform_(p.weight)
                if p.bias is not None:
                    nn.init.constant_(p.bias, 0.0)
            else:  # as MultiheadAttention.reset_parameters
                gain = 1 / math.sqrt(2) if self.qkv_same_dim else 1.0
                nn.init.xavier_uniform_(p.weight, gain=gain)
        if self.bias_k is not None:
            nn.init.xavier_normal_(self.bias_k)
        if self.bias_v is not None:
            nn.init.xavier_normal_(self.bias_v)

    def dense_param_count(self) -> int:
        """Parameters fairseq's MultiheadAttention would have with the same arguments."""
        return mha_param_count(self.embed_dim, self.kdim, self.vdim, self.use_bias,
                               self.bias_k is not None)

    def extra_repr(self):
        return (f"{METHOD_NAME}: rank={self.rank}, mode={self.mode}, init={self.init}, "
                f"targets={','.join(self.targets)}")

    # -- forward ----------------------------------------------------------------------------------

    def forward(
        self,
        query: Tensor,
        key: Optional[Tensor],
        value: Optional[Tensor],
        key_padding_mask: Optional[Tensor] = None,
        incremental_state: Optional[IncrementalState] = None,
        need_weights: bool = True,
        static_kv: bool = False,
        attn_mask: Optional[Tensor] = None,
        before_softmax: bool = False,
        need_head_weights: bool = False,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        """Input shape: Time x Batch x Channel; arguments and returns as MultiheadAttention.forward.

        The steps: project Q/K/V through the factors; add bias_k/v; split heads; merge with the
        cache; add the zero-attention slot; fold beams that share encoder K/V; attend (SDPA, or
        explicitly when weights are requested); unfold, merge heads and project out.
        """
        need_weights = need_weights or need_head_weights
        tgt_len, bsz, embed_dim = query.size()
        if not self.skip_embed_dim_check:
            assert embed_dim == self.embed_dim, f"query dim {embed_dim} != {self.embed_dim}"
        assert key is None or value is not None
        saved_state = None
        if incremental_state is not None:
            saved_state = self._get_input_buffer(incremental_state)
            if saved_state is not None and "prev_key" in saved_state and static_kv:
                # cached encoder keys/values: nothing to project again
                assert self.encoder_decoder_attention and not self.self_attention
                key = value = None

        q, k, v, key_padding_mask = self._project(query, key, value, key_padding_mask)
        if self.bias_k is not None:
            k, v, key_padding_mask, attn_mask = self._append_bias_kv(k, v, key_padding_mask, attn_mask)
        q, k, v = self._split_heads(q), self._split_heads(k), self._split_heads(v)
        k, v, key_padding_mask, attn_mask = self._cached_keys_and_values(
            k, v, key_padding_mask, attn_mask, incremental_state, saved_state, static_kv)

        beams = bsz // k.size(0)
        q, attn_mask = self._fold_beams(q, attn_mask, beams)
        if before_softmax:
            # raw scores (B*H x T x S) and values (B*H x S x d_h), as MultiheadAttention
            scores = self._unfold_beams(self._scores(q, k, attn_mask, key_padding_mask), beams, tgt_len)
            src_len = k.size(2)
            return scores.reshape(bsz * self.num_heads, tgt_len, src_len), v.reshape(-1, src_len, self.head_dim)
        if need_weights:
            out, probs = self._explicit_attention(q, k, v, attn_mask, key_padding_mask)
        else:
            out, probs = self._sdpa(q, k, v, attn_mask, key_padding_mask, beams), None
        out = self._unfold_beams(out, beams, tgt_len)  # B x H x T x d_h
        out = self.out_proj(out.permute(2, 0, 1, 3).reshape(tgt_len, bsz, self.embed_dim))
        if probs is None:
            return out, None
        probs = self._unfold_beams(probs, beams, tgt_len).transpose(1, 0)  # H x B x T x S
        return out, probs if need_head_weights else probs.mean(dim=0)

    # -- forward steps ------------------------------------------------------------------------------

    def _cached_keys_and_values(self, k: Optional[Tensor], v: Optional[Tensor], key_padding_mask: Optional[Tensor],
                                attn_mask: Optional[Tensor], incremental_state: Optional[IncrementalState],
                                saved_state, static_kv: bool):
        """K and V (B x H x S x d_h) merged with the incremental state's cache, and with the
        zero-attention slot when it is on; the padding and attention masks to match."""
        if saved_state is not None:
            assert incremental_state is not None
            k, v, key_padding_mask = self._merge_cache(
                incremental_state, saved_state, k, v, key_padding_mask, static_kv)
        assert k is not None and v is not None
        if key_padding_mask is not None and key_padding_mask.dim() == 0:
            key_padding_mask = None
        if key_padding_mask is not None:
            assert key_padding_mask.size(0) == k.size(0) and key_padding_mask.size(1) == k.size(2)
        if self.add_zero_attn:
            k, v, key_padding_mask, attn_mask = self._append_zero_attn(k, v, key_padding_mask, attn_mask)
        return k, v, key_padding_mask, attn_mask

    def _project(self, query: Tensor, key: Optional[Tensor], value: Optional[Tensor],
                 key_padding_mask: Optional[Tensor]):
        """Q, K, V (T/S x B x C) through the projections; K and V are None when the cache holds
        them. In beam search, encoder-decoder attention keeps one K/V copy per sentence (the
        beams of a sentence share the encoder output), as MultiheadAttention does."""
        if self.self_attention:
            q, k, v = self._project_group(query, [self.q_proj, self.k_proj, self.v_proj])
            return q, k, v, key_padding_mask
        q = self.q_proj(query)
        if key is None:
            assert self.encoder_decoder_attention and value is None
            return q, None, None, key_padding_mask
        assert value is not None
        if self.encoder_decoder_attention and self.beam_size > 1 and query.size(1) == key.size(1):
            # key is [S, bsz*beam, C]: every beam of a sentence shares it, keep one copy
            key = key.view(key.size(0), -1, self.beam_size, key.size(2))[:, :, 0, :]
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.view(
                    -1, self.beam_size, key_padding_mask.size(1))[:, 0, :]
        if self.encoder_decoder_attention or key is value:
            k, v = self._project_group(key, [self.k_proj, self.v_proj])
        else:
            k, v = self.k_proj(key), self.v_proj(value)
        return q, k, v, key_padding_mask

    def _project_group(self, x: Tensor, projs: List[nn.Module]) -> List[Tensor]:
        """Applies several projections to the same input, running their down-projections as one
        fused GEMM (d_in -> sum of latent dims) when more than one is low-rank."""
        low = [p for p in projs if isinstance(p, LowRankLinear)]
        if not self._fuse or len(low) < 2:
            return [p(x) for p in projs]
        w = self._fused_down(low)
        z = F.linear(x, w).split([p.latent_features for p in low], dim=-1)
        lat = {id(p): zi for p, zi in zip(low, z)}
        return [p.up(lat[id(p)]) if id(p) in lat else p(x) for p in projs]

    def _fused_down(self, low: List[LowRankLinear]) -> Tensor:
        """The concatenated down-projection weights. Without autograd (inference, decoding) the
        concatenation is cached until a weight changes (checked through the version counters),
        so that a decoding step does not copy the weights each time."""
        ws = [p.down.weight for p in low]
        if torch.is_grad_enabled():
            return torch.cat(ws, dim=0)
        key = tuple((w.data_ptr(), w._version, w.dtype, w.device) for w in ws)
        cached = self._fused_cache.get(len(ws))
        if cached is None or cached[0] != key:
            cached = (key, torch.cat(ws, dim=0))
            self._fused_cache[len(ws)] = cached
        return cached[1]

    def _append_bias_kv(self, k: Optional[Tensor], v: Optional[Tensor], key_padding_mask: Optional[Tensor],
                        attn_mask: Optional[Tensor]):
        """add_bias_kv: one learned key / value appended to every sequence (T x B x C layout)."""
        assert self.bias_k is not None and self.bias_v is not None and k is not None and v is not None
        k = torch.cat([k, self.bias_k.repeat(1, k.size(1), 1)])
        v = torch.cat([v, self.bias_v.repeat(1, v.size(1), 1)])
        key_padding_mask, attn_mask = self._pad_masks(key_padding_mask, attn_mask)
        return k, v, key_padding_mask, attn_mask

    def _append_zero_attn(self, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor],
                          attn_mask: Optional[Tensor]):
        """add_zero_attn: a zero key / value slot after the cache (B x H x S x d_h layout)."""
        zeros = k.new_zeros(k.shape[:2] + (1, self.head_dim))
        k, v = torch.cat([k, zeros], dim=2), torch.cat([v, zeros], dim=2)
        key_padding_mask, attn_mask = self._pad_masks(key_padding_mask, attn_mask)
        return k, v, key_padding_mask, attn_mask

    def _split_heads(self, x: Optional[Tensor]) -> Optional[Tensor]:
        """T x B x C -> B x H x T x d_h: the layout of the cache and of SDPA."""
        if x is None:
            return None
        return x.contiguous().view(x.size(0), x.size(1), self.num_heads, self.head_dim).permute(1, 2, 0, 3)

    def _merge_cache(self, incremental_state: IncrementalState, saved_state: Dict[str, Optional[Tensor]],
                     k: Optional[Tensor], v: Optional[Tensor], key_padding_mask: Optional[Tensor],
                     static_kv: bool) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        """Prepends the cached K/V (static encoder K/V replace them) and stores the result, in
        MultiheadAttention's layout."""
        if "prev_key" in saved_state:
            prev_key = saved_state["prev_key"]
            assert prev_key is not None
            k = prev_key if static_kv else torch.cat([prev_key, k], dim=2)
        if "prev_value" in saved_state:
            prev_value = saved_state["prev_value"]
            assert prev_value is not None and k is not None and prev_value.size(0) == k.size(0)
            v = prev_value if static_kv else torch.cat([prev_value, v], dim=2)
        assert k is not None and v is not None
        key_padding_mask = self._append_prev_key_padding_mask(
            key_padding_mask=key_padding_mask,
            prev_key_padding_mask=saved_state.get("prev_key_padding_mask"),
            batch_size=k.size(0),
            src_len=k.size(2),
            static_kv=static_kv,
        )
        saved_state["prev_key"] = k
        saved_state["prev_value"] = v
        saved_state["prev_key_padding_mask"] = key_padding_mask
        self._set_input_buffer(incremental_state, saved_state)
        return k, v, key_padding_mask

    def _fold_beams(self, q: Tensor, attn_mask: Optional[Tensor], beams: int):
        """Encoder-decoder attention in beam search keeps one K/V per sentence: the beams of a
        sentence are folded into the query length, [B*beams, H, T, d_h] -> [B, H, beams*T, d_h],
        so that every beam attends to its sentence's single K/V copy."""
        if beams == 1:
            return q, attn_mask
        kv_bsz, _, tgt_len, _ = q.shape
        kv_bsz //= beams
        q = q.reshape(kv_bsz, beams, self.num_heads, tgt_len, self.head_dim).transpose(1, 2)
        q = q.reshape(kv_bsz, self.num_heads, beams * tgt_len, self.head_dim)
        if attn_mask is not None:
            attn_mask = attn_mask.repeat(beams, 1)
        return q, attn_mask

    @staticmethod
    def _unfold_beams(x: Tensor, beams: int, tgt_len: int) -> Tensor:
        """Inverse of :meth:`_fold_beams`: [B, H, beams*T, *] -> [B*beams, H, T, *]."""
        if beams == 1:
            return x
        kv_bsz, heads, last = x.size(0), x.size(1), x.size(-1)
        x = x.reshape(kv_bsz, heads, beams, tgt_len, last).transpose(1, 2)
        return x.reshape(kv_bsz * beams, heads, tgt_len, last)

    # -- attention ---------------------------------------------------------------------------------

    def _dropout_p(self) -> float:
        m = self.dropout_module
        return m.p if (self.training or m.apply_during_inference) else 0.0

    def _sdpa(self, q, k, v, attn_mask, key_padding_mask, beams):
        is_causal = (
            attn_mask is not None and key_padding_mask is None and beams == 1
            and q.size(2) == k.size(2) and self._is_causal_mask(attn_mask)
        )
        # is_causal lets the fused (flash) kernels run without materialising a mask
        mask = None if is_causal else combined_mask(attn_mask, key_padding_mask, k.size(0), q.dtype)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self._dropout_p(), is_causal=is_causal,
            scale=self.scaling,
        )

    def _scores(self, q, k, attn_mask, key_padding_mask) -> Tensor:
        """Masked attention scores q k^T / sqrt(d_h), [B, H, T, S]."""
        scores = torch.matmul(q * self.scaling, k.transpose(-1, -2))
        if attn_mask is not None:
            if attn_mask.dtype in (torch.bool, torch.uint8):
                scores = scores.masked_fill(attn_mask.to(torch.bool), float("-inf"))
            else:
                scores = scores + attn_mask.to(scores.dtype)
        if key_padding_mask is not None:
            scores = scores.masked_fill(
                key_padding_mask.to(torch.bool).view(k.size(0), 1, 1, -1), float("-inf"))
        return scores

    def _explicit_attention(self, q, k, v, attn_mask, key_padding_mask):
        """Scores, fp32 softmax and dropout spelled out, for need_weights: (output, fp32 probs)."""
        scores = self._scores(q, k, attn_mask, key_padding_mask)
        probs_float = F.softmax(scores, dim=-1, dtype=torch.float32)
        probs = self.dropout_module(probs_float.type_as(scores))
        return torch.matmul(probs, v), probs_float
