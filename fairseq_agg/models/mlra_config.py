"""The command-line flags of the MLRA models (docs/mlra.md, "Flags").

* :class:`MLRAConfig` / :class:`TransformerMLRAConfig`: the flags (the LM model adds the first to
  fairseq's ``transformer_lm`` flags, the MT model both to ``transformer``'s); their values are
  validated by :class:`~fairseq_agg.modules.mlra_options.MLRAOptions`, beside the attention that
  uses them.
* :func:`fill_mlra_defaults` / :func:`copy_mlra_flags`: the architecture functions' helpers.
"""
from dataclasses import dataclass, field, fields
from typing import Optional

from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.utils import safe_getattr

from fairseq_agg.modules.low_rank_linear import FACTORISATIONS, INITS
from fairseq_agg.modules.mlra_options import REBALANCE, SELF_ATTENTION_SCOPES


@dataclass
class MLRAConfig(FairseqDataclass):
    """MLRA flags of every MLRA model (docs/mlra.md, "Flags")."""

    attention_rank: Optional[int] = field(
        default=None,
        metadata={
            "help": "MLRA (Chung et al., 2024, stability; not the KV-sharding MLRA) rank r of each "
            "factorised attention projection; unset: embed_dim/4 (shared) or head_dim/2 "
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
