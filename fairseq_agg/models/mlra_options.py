"""The command-line flags of the MLRA models and their one validation.

MLRA is the stability method of Chung et al. (EMNLP 2024, arXiv 2409.07787, §3), not the
KV-sharding MLRA of Liu et al. (2026). The paper does not give its rank, factorisation, targets or
initialisation in the sources available to this project; the defaults here are the project's
choices, argued in ``docs/mlra.md`` ("Flags").

* :class:`MLRAConfig` / :class:`TransformerMLRAConfig`: the flags (the LM model adds the first to
  fairseq's ``transformer_lm`` flags, the MT model both to ``transformer``'s).
* :class:`MLRAOptions`: the flags parsed and validated, in one place. A bad value raises one
  :class:`~fairseq_agg.errors.UsageError` (a ``ValueError``) that names the flag and the allowed
  range. The models build it from their config
  and call :meth:`MLRAOptions.validate` on their :class:`AttentionSite` list at build time, before
  anything is written; ``MultiheadLowRankAttention`` builds its options through the same class.
"""
import logging
from dataclasses import dataclass, field, fields
from typing import Iterable, NamedTuple, Optional, Sequence, Tuple

from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.utils import safe_getattr

from fairseq_agg.errors import UsageError, check_number
from fairseq_agg.modules.low_rank_linear import FACTORISATIONS, INITS

logger = logging.getLogger(__name__)

TARGETS = ("q", "k", "v", "o")
REBALANCE = ("none", "ffn", "depth")
SELF_ATTENTION_SCOPES = ("all", "encoder", "decoder", "none")
METHOD_NAME = "MLRA (Chung et al., 2024, stability)"


@dataclass
class MLRAConfig(FairseqDataclass):
    """MLRA flags of every MLRA model (docs/mlra.md, "Flags")."""

    attention_rank: Optional[int] = field(
        default=None,
        metadata={
            "help": "MLRA (Chung et al., 2024, stability; not the KV-sharding MLRA) rank r of each "
            "factorised attention projection. Default: embed_dim/4 (shared) or head_dim/2 "
            "(per_head). Allowed: 1 <= r <= embed_dim (shared), 1 <= r <= head_dim (per_head)"
        },
    )
    mlra_mode: ChoiceEnum(FACTORISATIONS) = field(
        default="shared",
        metadata={
            "help": "shared: one d_in x r down-projection whose up-projection output is split into "
            "heads; per_head: every head has its own rank-r factors"
        },
    )
    mlra_init: ChoiceEnum(INITS) = field(
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
    mlra_rebalance: ChoiceEnum(REBALANCE) = field(
        default="none",
        metadata={
            "help": "spend the parameters MLRA saves: none; ffn (widen every FFN of the same "
            "stack); depth (add whole layers to the stack)"
        },
    )


@dataclass
class TransformerMLRAConfig(MLRAConfig):
    """MLRA flags of the MT model (added to fairseq's TransformerModel flags)."""

    mlra_self_attention: ChoiceEnum(SELF_ATTENTION_SCOPES) = field(
        default="all",
        metadata={"help": "which self-attention stacks to factorise: all, encoder, decoder, none"},
    )


MLRA_FLAGS = tuple(f.name for f in fields(TransformerMLRAConfig))


def fill_mlra_defaults(args, config_cls=TransformerMLRAConfig):
    """Architecture-function helper: sets every MLRA flag the user did not give to its default."""
    for f in fields(config_cls):
        if f.name in MLRA_FLAGS:
            setattr(args, f.name, safe_getattr(args, f.name, f.default))


def copy_mlra_flags(src, dst, config_cls=TransformerMLRAConfig):
    """Copies the MLRA flags of ``src`` (a Namespace or DictConfig) onto ``dst`` as plain values
    (``TransformerConfig.from_namespace`` copies the unknown keys of a Namespace, not of a
    DictConfig)."""
    for f in fields(config_cls):
        if f.name in MLRA_FLAGS:
            value = safe_getattr(src, f.name, None)
            setattr(dst, f.name, value if value is None or isinstance(value, (int, bool)) else str(value))


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


def _choice(value, flag: str, allowed: Sequence[str]) -> str:
    value = str(value)
    if value not in allowed:
        raise UsageError(f"{flag} must be one of {','.join(allowed)}; got {value!r}")
    return value


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
            mode=_choice(self.mode, "--mlra-mode", FACTORISATIONS),
            init=_choice(self.init, "--mlra-init", INITS),
            targets=parse_targets(self.targets),
            rebalance=_choice(self.rebalance, "--mlra-rebalance", REBALANCE),
            self_attention=_choice(self.self_attention, "--mlra-self-attention", SELF_ATTENTION_SCOPES),
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
