"""The MLRA options, parsed and validated in one place: the rank rules, the choices of each flag,
and the attention sites of a model.

MLRA is the stability method of Chung et al. (EMNLP 2024, arXiv 2409.07787, §3), not the
KV-sharding MLRA of Liu et al. (2026). The paper does not give its rank, factorisation, targets or
initialisation in the sources available to this project; the defaults here are the project's
choices, argued in ``docs/mlra.md`` ("Flags").

:class:`MLRAOptions` is built by :class:`~fairseq_agg.modules.mlra.MultiheadLowRankAttention` from
its keywords and by the models from their config (the flags: :mod:`fairseq_agg.models.mlra_config`).
A bad value raises one :class:`~fairseq_agg.errors.UsageError` (a ``ValueError``) that names the
flag and the allowed range; the models call :meth:`MLRAOptions.validate` on their
:class:`AttentionSite` list at build time, before anything is written.
"""
import logging
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Optional, Tuple

from fairseq.utils import safe_getattr

from fairseq_agg.errors import UsageError, check_choice, check_number
from fairseq_agg.modules.low_rank_linear import FACTORISATIONS, INITS

logger = logging.getLogger(__name__)

TARGETS = ("q", "k", "v", "o")
REBALANCE = ("none", "ffn", "depth")
SELF_ATTENTION_SCOPES = ("all", "encoder", "decoder", "none")
METHOD_NAME = "MLRA (Chung et al., 2024, stability)"


# -- rank rules (docs/mlra.md, "Flags" and "Parameter counts") ------------------------------------


def default_rank(mode: str, embed_dim: int, num_heads: int) -> int:
    """d/4 in shared mode, d_h/2 per head (both at least 1): clearly low rank, and half the Q/K/V
    parameters of MultiheadAttention in shared mode."""
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


# -- the one validation ---------------------------------------------------------------------------


def parse_targets(targets) -> Tuple[str, ...]:
    """'q,k,v' -> ('q', 'k', 'v'); unknown names raise an error that names --mlra-targets."""
    if isinstance(targets, str):
        items = [t.strip().lower() for t in targets.split(",") if t.strip()]
    else:
        items = [str(t).strip().lower() for t in targets]
    bad = [t for t in items if t not in TARGETS]
    if bad or not items:
        raise UsageError(
            f"--mlra-targets must be a non-empty comma-separated subset of "
            f"{','.join(TARGETS)}; got {targets!r}"
        )
    return tuple(t for t in TARGETS if t in items)


def _rank_in_range(rank, hi: int) -> bool:
    """Whether ``rank`` is an integer in [1, hi] (nan, inf and booleans are not)."""
    if isinstance(rank, bool):  # check_number would take True for 1
        return False
    try:
        check_number("attention_rank", rank, 1, hi, integer=True)
    except UsageError:
        return False
    return True


@dataclass(frozen=True)
class MLRAOptions:
    """The MLRA flags, validated on construction (each error names its flag and the allowed values).

    ``rank`` None means the default of the mode (:func:`default_rank`); whether a given rank fits
    an attention module depends on its width, so :meth:`rank_for` checks it per module.
    """

    rank: Optional[int] = None
    mode: str = "shared"
    init: str = "gpt2"
    targets: Tuple[str, ...] = ("q", "k", "v")
    rebalance: str = "none"
    cross_attention: bool = False
    self_attention: str = "all"

    def __post_init__(self):
        normalised = dict(
            mode=check_choice("mlra_mode", self.mode, FACTORISATIONS),
            init=check_choice("mlra_init", self.init, INITS),
            targets=parse_targets(self.targets),
            rebalance=check_choice("mlra_rebalance", self.rebalance, REBALANCE),
            self_attention=check_choice("mlra_self_attention", self.self_attention, SELF_ATTENTION_SCOPES),
            cross_attention=bool(self.cross_attention),
        )
        for name, value in normalised.items():
            object.__setattr__(self, name, value)

    @classmethod
    def from_cfg(cls, cfg) -> "MLRAOptions":
        """Reads the flags from a model config (Namespace, DictConfig or TransformerConfig)."""
        return cls(
            rank=safe_getattr(cfg, "attention_rank", None),
            mode=safe_getattr(cfg, "mlra_mode", "shared"),
            init=safe_getattr(cfg, "mlra_init", "gpt2"),
            targets=str(safe_getattr(cfg, "mlra_targets", "q,k,v")),
            rebalance=safe_getattr(cfg, "mlra_rebalance", "none"),
            cross_attention=safe_getattr(cfg, "mlra_cross_attention", False),
            self_attention=safe_getattr(cfg, "mlra_self_attention", "all"),
        )

    def rank_for(self, embed_dim: int, num_heads: int, where: str = "attention") -> int:
        """The rank of one attention module; raises a UsageError naming --attention-rank when it
        is not an integer in range for that module's width (nan and inf included)."""
        if self.rank is None:
            return default_rank(self.mode, embed_dim, num_heads)
        hi = max_rank(self.mode, embed_dim, num_heads)
        rank = self.rank
        if not _rank_in_range(rank, hi):
            # the range depends on the module, so the message names the module and its widths
            what = "the embedding dim" if self.mode == "shared" else "the head dim"
            raise UsageError(
                f"--attention-rank {rank} is out of range for the {where} (embed dim {embed_dim}, "
                f"{num_heads} heads) with --mlra-mode {self.mode}: it must be an integer 1 <= r <= {hi} ({what})"
            )
        return int(float(rank))

    def self_attention_on(self, side: str) -> bool:
        """Whether the self-attention of the ``encoder`` or ``decoder`` stack is factorised."""
        return self.self_attention in ("all", side)

    def attention_kwargs(self) -> dict:
        """The MLRA keywords of ``MultiheadLowRankAttention``."""
        return dict(rank=self.rank, mode=self.mode, init=self.init, targets=self.targets)

    def validate(self, sites: Iterable["AttentionSite"]) -> None:
        """Start-up check of the rank against every factorised attention of a model, before
        anything is built or written: raises a UsageError naming the flag; warns when the rank
        saves no parameters."""
        for site in sites:
            if not site.factorised:
                continue
            where, d, h = site.where, site.embed_dim, site.num_heads
            if d % h:
                raise UsageError(f"{where}: embed dim {d} is not divisible by {h} attention heads "
                                 "(--*-embed-dim must be a multiple of --*-attention-heads)")
            r = self.rank_for(d, h, where)
            if r >= break_even_rank(self.mode, d, h):
                logger.warning(
                    f"--attention-rank {r} with --mlra-mode {self.mode} saves no parameters in the "
                    f"{where} (break-even rank {break_even_rank(self.mode, d, h):g})"
                )


class AttentionSite(NamedTuple):
    """One attention module of every layer of a stack, and whether the flags factorise it."""

    side: str  # "encoder" or "decoder": the stack whose layers hold it
    where: str  # named in errors and logs
    embed_dim: int
    num_heads: int
    kdim: Optional[int]  # the key / value width when it is not embed_dim (encoder-decoder attention)
    factorised: bool
