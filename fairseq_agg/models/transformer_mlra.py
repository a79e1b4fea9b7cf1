"""``transformer_mlra``: fairseq's TransformerModel (MT) with MLRA attention.

MLRA is the stability method of Chung et al. (2024, EMNLP, arXiv 2409.07787, §3), not the
KV-sharding MLRA of Liu et al. (2026). Only the attention modules change (``mlra_layers``): by
default every self-attention (encoder and decoder) is factorised; the encoder-decoder attention
only with ``--mlra-cross-attention``. Flags, defaults and architectures: docs/mlra.md.
"""
from typing import List

from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import (
    TransformerConfig,
    TransformerModel,
    base_architecture,
    transformer_iwslt_de_en,
    transformer_vaswani_wmt_en_de_big,
    transformer_wmt_en_de,
)

from fairseq_agg.models.mlra_budget import (
    StackBudget,
    log_mlra_summary,
    mha_baseline_params,
    rebalance_stack,
    stack_budget,
)
from fairseq_agg.models.mlra_layers import MLRATransformerDecoder, MLRATransformerEncoder
from fairseq_agg.models.mlra_config import TransformerMLRAConfig, fill_mlra_defaults
from fairseq_agg.modules.mlra_options import AttentionSite, MLRAOptions


def _attention_sites(cfg: TransformerConfig, options: MLRAOptions) -> List[AttentionSite]:
    """Every attention kind of the encoder-decoder model, and whether the flags factorise it."""
    enc, dec = cfg.encoder, cfg.decoder
    sites = [
        AttentionSite("encoder", "encoder self-attention", enc.embed_dim, enc.attention_heads, None,
                      options.self_attention_on("encoder")),
        AttentionSite("decoder", "decoder self-attention", dec.embed_dim, dec.attention_heads, None,
                      options.self_attention_on("decoder")),
    ]
    if not cfg.no_cross_attention:
        sites.append(AttentionSite("decoder", "encoder-decoder attention", dec.embed_dim,
                                   dec.attention_heads, enc.embed_dim, options.cross_attention))
    return sites


def _stack_budget(cfg: TransformerConfig, side: str) -> StackBudget:
    options = MLRAOptions.from_cfg(cfg)
    return stack_budget(cfg, options, side, _attention_sites(cfg, options))


@register_model("transformer_mlra")
class TransformerMLRAModel(TransformerModel):
    """TransformerModel whose attention is MLRA (Chung et al., 2024; stability method).

    All of TransformerModel's flags plus --attention-rank, --mlra-mode, --mlra-init,
    --mlra-targets, --mlra-cross-attention, --mlra-self-attention and --mlra-rebalance.
    """

    @classmethod
    def hub_models(cls):
        return {}

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        # defaults come from the architecture functions, as for the stock flags
        gen_parser_from_dataclass(parser, TransformerMLRAConfig(), delete_default=True)

    @classmethod
    def build_model(cls, args, task):
        base_mlra_architecture(args)
        cfg = TransformerConfig.from_namespace(args)
        options = MLRAOptions.from_cfg(cfg)
        options.validate(_attention_sites(cfg, options))
        model = super().build_model(args, task)
        cfg = TransformerConfig.from_namespace(args)  # as built (--*-layers-to-keep), not rebalanced
        stacks = [(_stack_budget(cfg, "encoder"), model.encoder.layers),
                  (_stack_budget(cfg, "decoder"), model.decoder.layers)]
        log_mlra_summary(model, mha_baseline_params(model, stacks), "transformer_mlra")
        return model

    @classmethod
    def build_encoder(cls, args, src_dict, embed_tokens):
        cfg = TransformerConfig.from_namespace(args)  # this model's own copy: free to rebalance
        rebalance_stack(cfg, MLRAOptions.from_cfg(cfg), _stack_budget(cfg, "encoder"))
        return MLRATransformerEncoder(cfg, src_dict, embed_tokens)

    @classmethod
    def build_decoder(cls, args, tgt_dict, embed_tokens):
        cfg = TransformerConfig.from_namespace(args)
        rebalance_stack(cfg, MLRAOptions.from_cfg(cfg), _stack_budget(cfg, "decoder"))
        return MLRATransformerDecoder(
            cfg, tgt_dict, embed_tokens, no_encoder_attn=cfg.no_cross_attention
        )


# ----------------------------------------------------------------------------------------------
# Architectures (mirroring the stock names)
# ----------------------------------------------------------------------------------------------


def base_mlra_architecture(args):
    fill_mlra_defaults(args, TransformerMLRAConfig)


@register_model_architecture("transformer_mlra", "transformer_mlra")
def transformer_mlra(args):
    base_mlra_architecture(args)
    base_architecture(args)


@register_model_architecture("transformer_mlra", "transformer_mlra_iwslt_de_en")
def transformer_mlra_iwslt_de_en(args):
    base_mlra_architecture(args)
    transformer_iwslt_de_en(args)


@register_model_architecture("transformer_mlra", "transformer_mlra_wmt_en_de")
def transformer_mlra_wmt_en_de(args):
    base_mlra_architecture(args)
    transformer_wmt_en_de(args)


# the "Attention Is All You Need" big model (Vaswani et al., 2017)
@register_model_architecture("transformer_mlra", "transformer_mlra_vaswani_wmt_en_de_big")
def transformer_mlra_vaswani_wmt_en_de_big(args):
    base_mlra_architecture(args)
    transformer_vaswani_wmt_en_de_big(args)
