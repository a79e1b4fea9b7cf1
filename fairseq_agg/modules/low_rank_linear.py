"""The low-rank factorised linear map of MLRA, in pure torch (no fairseq import).

Chung et al., "Stable Language Model Pre-training by Reducing Embedding Variability" (EMNLP 2024,
arXiv 2409.07787), §3 "Mitigating TEV with Factorization", replace a dense projection
W x by a product of two thin matrices, W_U (W_D x), with nothing in between. This file holds that
map (:class:`LowRankLinear`, shared across heads or per head), its two initialisations and its
parameter count; the formulas and every choice the paper leaves open are in ``docs/mlra.md``.
"""
import math
from typing import Optional

import torch
from torch import Tensor, nn

FACTORISATIONS = ("shared", "per_head")
INITS = ("gpt2", "matched")
GPT2_INIT_STD = 0.02  # the N(0, 0.02) init of GPT-2, the paper's model family


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

    mode ``shared``: D in R^{r x d_in}, U in R^{d_out x r} (docs/mlra.md, "What it does").
    mode ``per_head``: every head h of size d_h = d_out / H has its own factors.
      * split ``out`` (Q, K, V: heads live on the output side): D^{(h)} in R^{r x d_in},
        U^{(h)} in R^{d_h x r}; implemented as a dense d_in -> H*r map and a head-wise r -> d_h map.
      * split ``in`` (O: heads live on the input side): D^{(h)} in R^{r x d_h} on head h's slice,
        U^{(h)} in R^{d_out x r}; the head contributions are summed by one dense H*r -> d_out map.
    The bias sits on the up-projection only, so the down-projection stays a pure linear bottleneck.
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
        self.in_features = in_features
        self.out_features = out_features
        self.rank = rank
        self.mode = mode
        self.num_heads = num_heads
        self.split = split
        if mode == "shared":
            self.down = nn.Linear(in_features, rank, bias=False)
            self.up = nn.Linear(rank, out_features, bias=bias)
        elif mode == "per_head" and split == "out":
            if out_features % num_heads:
                raise ValueError(f"out_features {out_features} not divisible by {num_heads} heads")
            self.down = nn.Linear(in_features, num_heads * rank, bias=False)
            self.up = HeadwiseLinear(num_heads, rank, out_features // num_heads, bias=bias)
        elif mode == "per_head" and split == "in":
            if in_features % num_heads:
                raise ValueError(f"in_features {in_features} not divisible by {num_heads} heads")
            self.down = HeadwiseLinear(num_heads, in_features // num_heads, rank, bias=False)
            self.up = nn.Linear(num_heads * rank, out_features, bias=bias)
        else:
            raise ValueError(f"mode must be one of {FACTORISATIONS} and split 'in' or 'out'; "
                             f"got mode={mode!r}, split={split!r}")
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
        """gpt2: U, D ~ N(0, 0.02). matched: sqrt(r) sigma_U sigma_D = dense_std, so that U D has
        the per-entry std of the dense matrix it replaces, with a variance-preserving
        sigma_D = fan_in^-1/2 and sigma_U = dense_std sqrt(fan_in / r) (docs/mlra.md, "Initialisation")."""
        if init == "gpt2":
            std_d = std_u = GPT2_INIT_STD
        elif init == "matched":
            if dense_std is None:
                raise ValueError("matched init needs the dense baseline's std")
            heads_on_input = self.mode == "per_head" and self.split == "in"
            fan_in = self.in_features // self.num_heads if heads_on_input else self.in_features
            std_d = fan_in ** -0.5
            std_u = dense_std * math.sqrt(fan_in / self.rank)
        else:
            raise ValueError(f"init must be one of {INITS}, got {init!r}")
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


def low_rank_param_count(d_in: int, d_out: int, rank: int, mode: str, num_heads: int,
                         split: str = "out", bias: bool = True) -> int:
    """Weights of one factorised projection (docs/mlra.md, "Parameter counts"): shared
    r (d_in + d_out); per head H r (d_in + d_h) for Q/K/V (split out), H r (d_h + d_out) for O
    (split in); plus d_out for the bias."""
    b = d_out if bias else 0
    if mode == "shared":
        return rank * (d_in + d_out) + b
    if split == "out":
        return num_heads * rank * (d_in + d_out // num_heads) + b
    return num_heads * rank * (d_in // num_heads + d_out) + b
