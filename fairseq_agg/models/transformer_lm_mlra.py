"""``transformer_lm_mlra``: fairseq's TransformerLanguageModel with MLRA self-attention.

The paper's own setting (Chung et al., 2024, arXiv 2409.07787): a Pre-LN GPT-2-style decoder
whose Q, K, V projections are rank-r products (§3). Not the KV-sharding MLRA of Liu et al. (2026).
Architectures mirror the stock names; ``transformer_lm_mlra_wiki103`` is the shape of
``transformer_lm_wiki103`` without adaptive input / adaptive softmax. Flags and defaults:
docs/mlra.md.
"""
from dataclasses import dataclass, fields

from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import TransformerConfig
from fairseq.models.transformer_lm import (
    TransformerLanguageModel,
    TransformerLanguageModelConfig,
    transformer_lm_baevski_wiki103,
    transformer_lm_gpt,
    transformer_lm_gpt2_small,
)
from fairseq.utils import safe_getattr

from fairseq_agg.models.mlra_budget import log_mlra_summary, mha_baseline_params, rebalance_stack, stack_budget
from fairseq_agg.models.mlra_layers import MLRATransformerDecoder
from fairseq_agg.models.mlra_config import MLRAConfig, copy_mlra_flags, fill_mlra_defaults
from fairseq_agg.modules.mlra_options import AttentionSite, MLRAOptions


@dataclass
class TransformerLMMLRAConfig(TransformerLanguageModelConfig, MLRAConfig):
    """fairseq's transformer_lm flags plus the MLRA flags (models/mlra_config.py: MLRAConfig)."""


def _self_attention_site(embed_dim: int, num_heads: int) -> AttentionSite:
    """The one attention kind of a decoder-only model (always factorised)."""
    return AttentionSite("decoder", "decoder self-attention", embed_dim, num_heads, None, True)


@register_model("transformer_lm_mlra", dataclass=TransformerLMMLRAConfig)
class TransformerLanguageModelMLRA(TransformerLanguageModel):
    """TransformerLanguageModel whose decoder self-attention is MLRA (stability method)."""

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        # --arch transformer_lm_mlra gets a no-op architecture function from register_model, so
        # the parser carries the MLRA defaults (the other archs fill the same ones in)
        parser.set_defaults(**{f.name: f.default for f in fields(MLRAConfig)})

    @classmethod
    def build_model(cls, args, task):
        fill_mlra_defaults(args, TransformerLMMLRAConfig)
        options = MLRAOptions.from_cfg(args)
        options.validate([_self_attention_site(args.decoder_embed_dim, args.decoder_attention_heads)])
        stub = cls._build_stock_without_layers(args, task)
        if args.decoder_layers_to_keep:
            args.decoder_layers = len(args.decoder_layers_to_keep.split(","))
        cfg = TransformerConfig.from_namespace(args)  # a copy: rebalancing leaves args unchanged
        copy_mlra_flags(args, cfg, TransformerLMMLRAConfig)
        site = _self_attention_site(cfg.decoder.embed_dim, cfg.decoder.attention_heads)
        budget = stack_budget(cfg, options, "decoder", [site])
        rebalance_stack(cfg, options, budget)
        decoder = MLRATransformerDecoder(
            cfg, task.target_dictionary, stub.decoder.embed_tokens, no_encoder_attn=True
        )
        model = cls(decoder)
        log_mlra_summary(model, mha_baseline_params(model, [(budget, decoder.layers)]),
                         "transformer_lm_mlra")
        return model

    @classmethod
    def _build_stock_without_layers(cls, args, task):
        """The stock builder makes the token embedding (plain, adaptive input or character CNN)
        and runs its own checks; only its decoder is replaced, so it builds one without layers."""
        layers, keep = args.decoder_layers, args.decoder_layers_to_keep
        try:
            args.decoder_layers, args.decoder_layers_to_keep = 0, None
            return super().build_model(args, task)
        finally:
            args.decoder_layers, args.decoder_layers_to_keep = layers, keep

    @classmethod
    def hub_models(cls):
        return {}  # no pretrained MLRA models (the stock ones are not MLRA)


def base_lm_mlra_architecture(args):
    fill_mlra_defaults(args, TransformerLMMLRAConfig)


# --arch transformer_lm_mlra is registered by register_model (dataclass defaults, as the stock
# --arch transformer_lm)


@register_model_architecture("transformer_lm_mlra", "transformer_lm_mlra_gpt")
def transformer_lm_mlra_gpt(args):
    base_lm_mlra_architecture(args)
    transformer_lm_gpt(args)


@register_model_architecture("transformer_lm_mlra", "transformer_lm_mlra_gpt2_small")
def transformer_lm_mlra_gpt2_small(args):
    base_lm_mlra_architecture(args)
    transformer_lm_gpt2_small(args)


@register_model_architecture("transformer_lm_mlra", "transformer_lm_mlra_wiki103")
def transformer_lm_mlra_wiki103(args):
    """transformer_lm_wiki103's shape (16 layers, d 1024, FFN 4096, 8 heads, its dropouts, no final
    norm) with a plain token embedding and a plain softmax instead of the adaptive ones."""
    base_lm_mlra_architecture(args)
    args.adaptive_input = safe_getattr(args, "adaptive_input", False)
    args.tie_adaptive_weights = safe_getattr(args, "tie_adaptive_weights", False)
    args.tie_adaptive_proj = safe_getattr(args, "tie_adaptive_proj", False)
    # the stock function fills in "20000,60000" for unset cutoffs; keep what the user gave
    cutoffs = (safe_getattr(args, "adaptive_input_cutoff"), safe_getattr(args, "adaptive_softmax_cutoff"))
    transformer_lm_baevski_wiki103(args)
    args.adaptive_input_cutoff, args.adaptive_softmax_cutoff = cutoffs
