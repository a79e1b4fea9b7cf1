"""MLRA: multi-head low-rank attention, the stability method of Chung et al. (2024).

"Stable Language Model Pre-training by Reducing Embedding Variability" (EMNLP 2024,
arXiv 2409.07787), §3 "Mitigating TEV with Factorization": each of the Q, K, V projections is
replaced by a product of two thin matrices, W x ~= W_U (W_D x), with nothing in between. This is
*not* the KV-cache sharding method of Liu et al. (2026) that shares the name.

The file has two layers:

* pure-torch projection math, independent of fairseq: :class:`LowRankLinear` (shared or per-head
  factorisation), :class:`HeadwiseLinear`, the init schemes, the rank rules and the parameter
  formulas (project spec §3.3);
* :class:`MultiheadLowRankAttention`, a drop-in for fairseq's ``MultiheadAttention`` with the same
  constructor arguments, forward signature, return values and incremental-state layout (so beam
  search and cache reordering work unchanged). Attention runs through
  ``F.scaled_dot_product_attention`` unless attention weights are requested.
"""
import logging
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.models.fairseq_incremental_decoder import FairseqIncrementalDecoder
from fairseq.modules.fairseq_dropout import FairseqDropout
from fairseq.modules.multihead_attention import MultiheadAttention
from fairseq.modules.quant_noise import quant_noise

logger = logging.getLogger(__name__)

MLRA_MODES = ("shared", "per_head")
MLRA_INITS = ("gpt2", "matched")
MLRA_TARGETS = ("q", "k", "v", "o")
GPT2_INIT_STD = 0.02

_NAME = "MLRA (Chung et al., 2024, stability)"


@dataclass
class MLRAConfig(FairseqDataclass):
    """Command-line flags of the MLRA models (project spec §9)."""

    attention_rank: Optional[int] = field(
        default=None,
        metadata={
            "help": "MLRA (Chung et al., 2024, stability; not the KV-sharding MLRA) rank r of each "
            "factorised attention projection. Default: embed_dim/4 (shared) or head_dim/2 "
            "(per_head). Allowed: 1 <= r <= embed_dim (shared), 1 <= r <= head_dim (per_head)"
        },
    )
    mlra_mode: ChoiceEnum(MLRA_MODES) = field(
        default="shared",
        metadata={
            "help": "shared: one d_in x r down-projection whose up-projection output is split into "
            "heads; per_head: every head has its own rank-r factors"
        },
    )
    mlra_init: ChoiceEnum(MLRA_INITS) = field(
        default="gpt2",
        metadata={
            "help": "gpt2: both factors N(0, 0.02); matched: the product has the per-entry std of "
            "fairseq's dense (Xavier) init, which separates low rank from small init"
        },
    )
    mlra_targets: str = field(
        default="q,k,v",
        metadata={"help": "comma-separated subset of q,k,v,o: the projections to factorise"},
    )
    mlra_cross_attention: bool = field(
        default=False,
        metadata={"help": "also factorise the encoder-decoder (cross) attention of MT decoders"},
    )
    mlra_rebalance: ChoiceEnum(["none", "ffn", "depth"]) = field(
        default="none",
        metadata={
            "help": "spend the parameters MLRA saves: none; ffn (widen every FFN of the same "
            "stack); depth (add whole layers to the stack)"
        },
    )


# ----------------------------------------------------------------------------------------------
# Pure projection math (no fairseq)
# ----------------------------------------------------------------------------------------------


class HeadwiseLinear(nn.Module):
    """A block-diagonal linear map: head h maps its own in_per_head slice to out_per_head.

    weight: [num_heads, out_per_head, in_per_head]; y[..., h, :] = W[h] x[..., h, :] (+ bias).
    """

    def __init__(self, num_heads: int, in_per_head: int, out_per_head: int, bias: bool = False):
        super().__init__()
        self.num_heads = num_heads
        self.in_per_head = in_per_head
        self.out_per_head = out_per_head
        self.in_features = num_heads * in_per_head
        self.out_features = num_heads * out_per_head
        self.weight = nn.Parameter(torch.empty(num_heads, out_per_head, in_per_head))
        self.bias = nn.Parameter(torch.zeros(self.out_features)) if bias else None
        nn.init.normal_(self.weight, std=GPT2_INIT_STD)

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        xh = x.reshape(-1, self.num_heads, self.in_per_head).transpose(0, 1)  # H x N x in
        y = torch.bmm(xh, self.weight.transpose(1, 2))  # H x N x out
        y = y.transpose(0, 1).reshape(*lead, self.out_features)
        if self.bias is not None:
            y = y + self.bias
        return y

    def dense_weight(self) -> Tensor:
        """The equivalent [out_features, in_features] block-diagonal matrix."""
        return torch.block_diag(*self.weight.unbind(0))

    def extra_repr(self):
        return (
            f"num_heads={self.num_heads}, in_per_head={self.in_per_head}, "
            f"out_per_head={self.out_per_head}, bias={self.bias is not None}"
        )


class LowRankLinear(nn.Module):
    """y = U (D x) + b, a linear map of rank <= r with no nonlinearity between the factors.

    mode ``shared``: D in R^{r x d_in}, U in R^{d_out x r} (spec §3.3 "Shared mode").
    mode ``per_head``: every head h of size d_h = d_out / H has its own factors.
      * split ``out`` (Q, K, V: heads live on the output side): D^{(h)} in R^{r x d_in},
        U^{(h)} in R^{d_h x r}; implemented as a dense d_in -> H*r map and a head-wise r -> d_h map.
      * split ``in`` (O: heads live on the input side): D^{(h)} in R^{r x d_h} on head h's slice,
        U^{(h)} in R^{d_out x r}; the head contributions are summed by one dense H*r -> d_out map.
    The bias sits on the up-projection only; the down-projection is bias-free (spec §9).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rank: int,
        mode: str = "shared",
        num_heads: int = 1,
        split: str = "out",
        bias: bool = True,
    ):
        super().__init__()
        if mode not in MLRA_MODES:
            raise ValueError(f"--mlra-mode must be one of {MLRA_MODES}, got {mode!r}")
        if split not in ("in", "out"):
            raise ValueError(f"split must be 'in' or 'out', got {split!r}")
        self.in_features = in_features
        self.out_features = out_features
        self.rank = rank
        self.mode = mode
        self.num_heads = num_heads
        self.split = split
        if mode == "shared":
            self.down = nn.Linear(in_features, rank, bias=False)
            self.up = nn.Linear(rank, out_features, bias=bias)
        elif split == "out":
            if out_features % num_heads:
                raise ValueError(f"out_features {out_features} not divisible by {num_heads} heads")
            self.down = nn.Linear(in_features, num_heads * rank, bias=False)
            self.up = HeadwiseLinear(num_heads, rank, out_features // num_heads, bias=bias)
        else:
            if in_features % num_heads:
                raise ValueError(f"in_features {in_features} not divisible by {num_heads} heads")
            self.down = HeadwiseLinear(num_heads, in_features // num_heads, rank, bias=False)
            self.up = nn.Linear(num_heads * rank, out_features, bias=bias)
        self.reset_parameters("gpt2")

    @property
    def bias(self) -> Optional[Tensor]:
        return self.up.bias

    @property
    def latent_features(self) -> int:
        return self.down.out_features

    def forward(self, x: Tensor) -> Tensor:
        return self.up(self.down(x))

    def effective_weight(self) -> Tensor:
        """The dense [out_features, in_features] matrix W = U D with forward(x) = x W^T + b."""
        if self.mode == "shared":
            return self.up.weight @ self.down.weight
        if self.split == "out":
            d = self.down.weight.view(self.num_heads, self.rank, self.in_features)
            return torch.bmm(self.up.weight, d).reshape(self.out_features, self.in_features)
        u = self.up.weight.view(self.out_features, self.num_heads, self.rank).transpose(0, 1)
        w = torch.bmm(u, self.down.weight)  # H x d_out x d_h
        return w.transpose(0, 1).reshape(self.out_features, self.in_features)

    @torch.no_grad()
    def reset_parameters(self, init: str = "gpt2", dense_std: Optional[float] = None):
        """gpt2: U, D ~ N(0, 0.02). matched: sqrt(r) sigma_U sigma_D = dense_std (spec §3.3),
        with a variance-preserving sigma_D = fan_in^-1/2 and sigma_U = dense_std sqrt(fan_in / r)."""
        if init == "gpt2":
            std_d = std_u = GPT2_INIT_STD
        elif init == "matched":
            if dense_std is None:
                raise ValueError("matched init needs the dense baseline's std")
            fan_in = self.in_features if not (self.mode == "per_head" and self.split == "in") else (
                self.in_features // self.num_heads
            )
            std_d = fan_in ** -0.5
            std_u = dense_std * math.sqrt(fan_in / self.rank)
        else:
            raise ValueError(f"--mlra-init must be one of {MLRA_INITS}, got {init!r}")
        nn.init.normal_(self.down.weight, std=std_d)
        nn.init.normal_(self.up.weight, std=std_u)
        if self.up.bias is not None:
            nn.init.zeros_(self.up.bias)

    def extra_repr(self):
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, "
            f"mode={self.mode}, num_heads={self.num_heads}, split={self.split}"
        )


def xavier_std(fan_in: int, fan_out: int, gain: float = 1.0) -> float:
    """Std of nn.init.xavier_uniform_: gain * sqrt(2 / (fan_in + fan_out))."""
    return gain * math.sqrt(2.0 / (fan_in + fan_out))


def default_rank(mode: str, embed_dim: int, num_heads: int) -> int:
    """Spec §9: d/4 in shared mode, d_h/2 per head (both at least 1)."""
    if mode == "shared":
        return max(1, embed_dim // 4)
    return max(1, (embed_dim // num_heads) // 2)


def max_rank(mode: str, embed_dim: int, num_heads: int) -> int:
    """Largest useful rank: d (shared) or d_h (per head; a dense head block already has rank d_h)."""
    return embed_dim if mode == "shared" else embed_dim // num_heads


def break_even_rank(mode: str, embed_dim: int, num_heads: int) -> float:
    """The rank at which a factorised d x d projection has as many weights as the dense one."""
    if mode == "shared":
        return embed_dim / 2
    head_dim = embed_dim // num_heads
    return embed_dim * head_dim / (embed_dim + head_dim)


def parse_targets(targets) -> Tuple[str, ...]:
    """'q,k,v' -> ('q', 'k', 'v'); unknown names raise an error that names --mlra-targets."""
    if isinstance(targets, str):
        items = [t.strip().lower() for t in targets.split(",") if t.strip()]
    else:
        items = [str(t).strip().lower() for t in targets]
    bad = [t for t in items if t not in MLRA_TARGETS]
    if bad or not items:
        raise ValueError(
            f"--mlra-targets must be a non-empty comma-separated subset of "
            f"{','.join(MLRA_TARGETS)}; got {targets!r}"
        )
    return tuple(t for t in MLRA_TARGETS if t in items)


def resolve_rank(rank: Optional[int], mode: str, embed_dim: int, num_heads: int,
                 where: str = "attention") -> int:
    """Returns the rank to use; raises a clear error naming --attention-rank when out of range."""
    if mode not in MLRA_MODES:
        raise ValueError(f"--mlra-mode must be one of {','.join(MLRA_MODES)}; got {mode!r}")
    if rank is None:
        return default_rank(mode, embed_dim, num_heads)
    hi = max_rank(mode, embed_dim, num_heads)
    if isinstance(rank, bool) or int(rank) != rank or not 1 <= rank <= hi:
        what = "the embedding dim" if mode == "shared" else "the head dim"
        raise ValueError(
            f"--attention-rank {rank} is out of range for the {where} (embed dim {embed_dim}, "
            f"{num_heads} heads) with --mlra-mode {mode}: it must satisfy 1 <= r <= {hi} ({what})"
        )
    return int(rank)


def mha_param_count(embed_dim: int, kdim: Optional[int] = None, vdim: Optional[int] = None,
                    bias: bool = True, add_bias_kv: bool = False) -> int:
    """Parameters of fairseq's MultiheadAttention: q, k, v, out projections (+ bias_k/v)."""
    kdim = embed_dim if kdim is None else kdim
    vdim = embed_dim if vdim is None else vdim
    b = embed_dim if bias else 0
    n = (embed_dim * embed_dim + b) * 2 + (kdim * embed_dim + b) + (vdim * embed_dim + b)
    return n + (2 * embed_dim if add_bias_kv else 0)


def low_rank_param_count(d_in: int, d_out: int, rank: int, mode: str, num_heads: int,
                         split: str = "out", bias: bool = True) -> int:
    """Weights of one factorised projection (spec §3.3): shared r (d_in + d_out);
    per head H r (d_in + d_h) for Q/K/V (split out), H r (d_h + d_out) for O (split in)."""
    b = d_out if bias else 0
    if mode == "shared":
        return rank * (d_in + d_out) + b
    if split == "out":
        return num_heads * rank * (d_in + d_out // num_heads) + b
    return num_heads * rank * (d_in // num_heads + d_out) + b


# ----------------------------------------------------------------------------------------------
# The attention module
# ----------------------------------------------------------------------------------------------


class MultiheadLowRankAttention(FairseqIncrementalDecoder):
    """Drop-in for ``fairseq.modules.MultiheadAttention`` with low-rank Q/K/V(/O) projections.

    Same constructor arguments as MultiheadAttention plus ``rank``, ``mode``, ``init`` and
    ``targets``; the same ``forward`` signature and return values (``attn`` T x B x C and the
    weights: B x T x S averaged over heads, H x B x T x S with ``need_head_weights``, or the raw
    scores and values with ``before_softmax``); the same incremental state ("attn_state" with
    prev_key / prev_value of shape B x H x S x d_h, and prev_key_padding_mask), so fairseq's
    beam search and its cache reorder work unchanged. Every path goes through the factorised
    projections: there is no dense fast path (spec §3.4).
    """

    def __init__(
        self,
        embed_dim,
        num_heads,
        kdim=None,
        vdim=None,
        dropout=0.0,
        bias=True,
        add_bias_kv=False,
        add_zero_attn=False,
        self_attention=False,
        encoder_decoder_attention=False,
        dictionary=None,
        q_noise=0.0,
        qn_block_size=8,
        xformers_att_config: Optional[str] = None,
        rank: Optional[int] = None,
        mode: str = "shared",
        init: str = "gpt2",
        targets: Sequence[str] = ("q", "k", "v"),
        where: str = "attention",
    ):
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

        self.mode = mode
        self.init = init
        self.targets = parse_targets(targets)
        self.rank = resolve_rank(rank, mode, embed_dim, num_heads, where)
        if init not in MLRA_INITS:
            raise ValueError(f"--mlra-init must be one of {','.join(MLRA_INITS)}; got {init!r}")
        if q_noise > 0 and mode == "per_head":
            raise ValueError(
                "--quant-noise-pq > 0 is not supported with --mlra-mode per_head; "
                "use --mlra-mode shared or --quant-noise-pq 0"
            )
        self.use_bias = bias
        self.q_noise = q_noise

        def proj(name, d_in, d_out, split):
            if name in self.targets:
                p = LowRankLinear(d_in, d_out, self.rank, mode, num_heads, split, bias)
                if q_noise > 0:
                    p.down = quant_noise(p.down, q_noise, qn_block_size)
                    p.up = quant_noise(p.up, q_noise, qn_block_size)
                return p
            return quant_noise(nn.Linear(d_in, d_out, bias=bias), q_noise, qn_block_size)

        self.k_proj = proj("k", self.kdim, embed_dim, "out")
        self.v_proj = proj("v", self.vdim, embed_dim, "out")
        self.q_proj = proj("q", embed_dim, embed_dim, "out")
        self.out_proj = proj("o", embed_dim, embed_dim, "in")

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
        self._causal_cache: Optional[Tuple[Tensor, int, bool]] = None
        self._fused_cache: Dict[int, Tuple[tuple, Tensor]] = {}
        self.reset_parameters()
        self.init_incremental_state()

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
        return f"{_NAME}: rank={self.rank}, mode={self.mode}, init={self.init}, targets={','.join(self.targets)}"

    # -- projections ------------------------------------------------------------------------------

    def _project_group(self, x: Tensor, projs: List[nn.Module]) -> List[Tensor]:
        """Applies several projections to the same input, running their down-projections as one
        fused GEMM (d_in -> sum of latent dims; spec §3.3) when more than one is low-rank."""
        low = [p for p in projs if isinstance(p, LowRankLinear)]
        if not self._fuse or len(low) < 2:
            return [p(x) for p in projs]
        w = self._fused_down(low)
        z = F.linear(x, w).split([p.latent_features for p in low], dim=-1)
        lat = {id(p): zi for p, zi in zip(low, z)}
        return [p.up(lat[id(p)]) if id(p) in lat else p(x) for p in projs]

    def _fused_down(self, low: List["LowRankLinear"]) -> Tensor:
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

    # -- masks ------------------------------------------------------------------------------------

    def _is_causal_mask(self, attn_mask: Tensor) -> bool:
        """True when attn_mask is fairseq's square future mask (0 on and below the diagonal,
        masked above). The answer is cached per mask tensor so that the check, which needs a
        device sync, runs once; holding a reference keeps the storage from being reused."""
        if attn_mask.dim() != 2 or attn_mask.size(0) != attn_mask.size(1):
            return False
        c = self._causal_cache
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
        self._causal_cache = (attn_mask, attn_mask._version, ok)
        return ok

    @staticmethod
    def _combined_mask(attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor],
                       kv_bsz: int, dtype: torch.dtype) -> Optional[Tensor]:
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

    # -- forward ----------------------------------------------------------------------------------

    def forward(
        self,
        query: Tensor,
        key: Optional[Tensor],
        value: Optional[Tensor],
        key_padding_mask: Optional[Tensor] = None,
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
        need_weights: bool = True,
        static_kv: bool = False,
        attn_mask: Optional[Tensor] = None,
        before_softmax: bool = False,
        need_head_weights: bool = False,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        """Input shape: Time x Batch x Channel; arguments as MultiheadAttention.forward."""
        if need_head_weights:
            need_weights = True
        tgt_len, bsz, embed_dim = query.size()
        src_len = tgt_len
        if not self.skip_embed_dim_check:
            assert embed_dim == self.embed_dim, f"query dim {embed_dim} != {self.embed_dim}"
        if key is not None:
            src_len, key_bsz, _ = key.size()
            assert value is not None

        if incremental_state is not None:
            saved_state = self._get_input_buffer(incremental_state)
            if saved_state is not None and "prev_key" in saved_state and static_kv:
                # cached encoder keys/values: nothing to project again
                assert self.encoder_decoder_attention and not self.self_attention
                key = value = None
        else:
            saved_state = None

        k: Optional[Tensor]
        v: Optional[Tensor]
        if self.self_attention:
            q, k, v = self._project_group(query, [self.q_proj, self.k_proj, self.v_proj])
        elif self.encoder_decoder_attention:
            q = self.q_proj(query)
            if key is None:
                assert value is None
                k = v = None
            else:
                if self.beam_size > 1 and bsz == key.size(1):
                    # key is [S, bsz*beam, C]: every beam of a sentence shares it, keep one copy
                    key = key.view(key.size(0), -1, self.beam_size, key.size(2))[:, :, 0, :]
                    if key_padding_mask is not None:
                        key_padding_mask = key_padding_mask.view(
                            -1, self.beam_size, key_padding_mask.size(1))[:, 0, :]
                k, v = self._project_group(key, [self.k_proj, self.v_proj])
        else:
            assert key is not None and value is not None
            q = self.q_proj(query)
            if key is value:
                k, v = self._project_group(key, [self.k_proj, self.v_proj])
            else:
                k, v = self.k_proj(key), self.v_proj(value)

        if self.bias_k is not None:
            assert self.bias_v is not None and k is not None and v is not None
            k = torch.cat([k, self.bias_k.repeat(1, k.size(1), 1)])
            v = torch.cat([v, self.bias_v.repeat(1, v.size(1), 1)])
            key_padding_mask, attn_mask = self._pad_masks(key_padding_mask, attn_mask)

        H, dh = self.num_heads, self.head_dim
        # B x H x T x d_h: the layout of the cache and of scaled_dot_product_attention
        q = q.contiguous().view(tgt_len, bsz, H, dh).permute(1, 2, 0, 3)
        kv_bsz = bsz
        if k is not None:
            kv_bsz = k.size(1)
            k = k.contiguous().view(-1, kv_bsz, H, dh).permute(1, 2, 0, 3)
        if v is not None:
            v = v.contiguous().view(-1, kv_bsz, H, dh).permute(1, 2, 0, 3)

        if saved_state is not None:
            if "prev_key" in saved_state:
                prev_key = saved_state["prev_key"]
                assert prev_key is not None
                kv_bsz = prev_key.size(0)
                k = prev_key if static_kv else torch.cat([prev_key, k], dim=2)
                src_len = k.size(2)
            if "prev_value" in saved_state:
                prev_value = saved_state["prev_value"]
                assert prev_value is not None and prev_value.size(0) == kv_bsz
                v = prev_value if static_kv else torch.cat([prev_value, v], dim=2)
            prev_key_padding_mask: Optional[Tensor] = saved_state.get("prev_key_padding_mask")
            assert k is not None and v is not None
            key_padding_mask = self._append_prev_key_padding_mask(
                key_padding_mask=key_padding_mask,
                prev_key_padding_mask=prev_key_padding_mask,
                batch_size=kv_bsz,
                src_len=k.size(2),
                static_kv=static_kv,
            )
            saved_state["prev_key"] = k
            saved_state["prev_value"] = v
            saved_state["prev_key_padding_mask"] = key_padding_mask
            assert incremental_state is not None
            incremental_state = self._set_input_buffer(incremental_state, saved_state)
        assert k is not None and v is not None
        src_len = k.size(2)

        if key_padding_mask is not None and key_padding_mask.dim() == 0:
            key_padding_mask = None
        if key_padding_mask is not None:
            assert key_padding_mask.size(0) == kv_bsz and key_padding_mask.size(1) == src_len

        if self.add_zero_attn:
            zeros = k.new_zeros(k.shape[:2] + (1, dh))
            k = torch.cat([k, zeros], dim=2)
            v = torch.cat([v, zeros], dim=2)
            key_padding_mask, attn_mask = self._pad_masks(key_padding_mask, attn_mask)
            src_len += 1

        # enc-dec attention with beam search shares K/V per sentence: fold the beams into the
        # query length so that every beam attends to its sentence's single K/V copy
        beams = bsz // kv_bsz
        if beams > 1:
            q = q.reshape(kv_bsz, beams, H, tgt_len, dh).transpose(1, 2)
            q = q.reshape(kv_bsz, H, beams * tgt_len, dh)
            if attn_mask is not None:
                attn_mask = attn_mask.repeat(beams, 1)

        if before_softmax or need_weights:
            out, w = self._explicit_attention(q, k, v, attn_mask, key_padding_mask, kv_bsz,
                                              before_softmax)
            if before_softmax:
                # raw scores (B*H x T x S) and values (B*H x S x d_h), as MultiheadAttention
                w = self._unfold(w, kv_bsz, beams, tgt_len).reshape(bsz * H, tgt_len, src_len)
                return w, v.reshape(kv_bsz * H, src_len, dh)
        else:
            out = self._sdpa(q, k, v, attn_mask, key_padding_mask, kv_bsz, tgt_len, src_len, beams)
            w = None

        out = self._unfold(out, kv_bsz, beams, tgt_len)  # B x H x T x d_h
        out = out.permute(2, 0, 1, 3).reshape(tgt_len, bsz, self.embed_dim)
        out = self.out_proj(out)

        attn_weights: Optional[Tensor] = None
        if need_weights and w is not None:
            w = self._unfold(w, kv_bsz, beams, tgt_len).transpose(1, 0)  # H x B x T x S
            attn_weights = w if need_head_weights else w.mean(dim=0)
        return out, attn_weights

    @staticmethod
    def _unfold(x: Tensor, kv_bsz: int, beams: int, tgt_len: int) -> Tensor:
        """Inverse of the beam folding: [kv_bsz, H, beams*T, *] -> [kv_bsz*beams, H, T, *]."""
        if beams == 1:
            return x
        H, last = x.size(1), x.size(-1)
        x = x.reshape(kv_bsz, H, beams, tgt_len, last).transpose(1, 2)
        return x.reshape(kv_bsz * beams, H, tgt_len, last)

    def _dropout_p(self) -> float:
        m = self.dropout_module
        return m.p if (self.training or m.apply_during_inference) else 0.0

    def _sdpa(self, q, k, v, attn_mask, key_padding_mask, kv_bsz, tgt_len, src_len, beams):
        is_causal = (
            attn_mask is not None and key_padding_mask is None and beams == 1
            and tgt_len == src_len and self._is_causal_mask(attn_mask)
        )
        # is_causal lets the fused (flash) kernels run without materialising a mask
        mask = None if is_causal else self._combined_mask(attn_mask, key_padding_mask, kv_bsz, q.dtype)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self._dropout_p(), is_causal=is_causal,
            scale=self.scaling,
        )

    def _explicit_attention(self, q, k, v, attn_mask, key_padding_mask, kv_bsz, before_softmax):
        """Scores, fp32 softmax and dropout spelled out, for need_weights / before_softmax."""
        scores = torch.matmul(q * self.scaling, k.transpose(-1, -2))  # B x H x T x S
        if attn_mask is not None:
            if attn_mask.dtype in (torch.bool, torch.uint8):
                scores = scores.masked_fill(attn_mask.to(torch.bool), float("-inf"))
            else:
                scores = scores + attn_mask.to(scores.dtype)
        if key_padding_mask is not None:
            scores = scores.masked_fill(
                key_padding_mask.to(torch.bool).view(kv_bsz, 1, 1, -1), float("-inf"))
        if before_softmax:
            return None, scores
        probs_float = F.softmax(scores, dim=-1, dtype=torch.float32)
        probs = self.dropout_module(probs_float.type_as(scores))
        return torch.matmul(probs, v), probs_float
