"""``transformer_lm_mlra``: fairseq's TransformerLanguageModel with MLRA self-attention.

The paper's own setting (Chung et al., 2024, arXiv 2409.07787): a Pre-LN GPT-2-style decoder
whose Q, K, V projections are rank-r products (§3). Not the KV-sharding MLRA of Liu et al. (2026).
Architectures mirror the stock names; ``transformer_lm_mlra_wiki103`` is the shape of
``transformer_lm_wiki103`` without adaptive input / adaptive softmax.
"""
import logging
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

from fairseq_agg.models.transformer_mlra import (
    MLRATransformerDecoder,
    check_mlra_config,
    fill_mlra_defaults,
    log_mlra_summary,
    mlra_attention_param_count,
    rebalance_extra_params,
    rebalanced_stack,
)
from fairseq_agg.modules.mlra import MLRAConfig, mha_param_count

logger = logging.getLogger(__name__)


@dataclass
class TransformerLMMLRAConfig(TransformerLanguageModelConfig, MLRAConfig):
    """fairseq's transformer_lm flags plus the MLRA flags (modules/mlra.py: MLRAConfig)."""


def _lm_layer_bookkeeping(cfg):
    """(saved per layer, params of one MLRA layer) for a decoder-only stack."""
    d, h, f = cfg.decoder.embed_dim, cfg.decoder.attention_heads, cfg.decoder.ffn_embed_dim
    mlra = mlra_attention_param_count(d, h, cfg)
    return mha_param_count(d) - mlra, mlra + 2 * d * f + f + d + 4 * d


@register_model("transformer_lm_mlra", dataclass=TransformerLMMLRAConfig)
class TransformerLanguageModelMLRA(TransformerLanguageModel):
    """TransformerLanguageModel whose decoder self-attention is MLRA (stability method)."""

    @classmethod
    def hub_models(cls):
        return {}

    @classmethod
    def build_model(cls, args, task):
        fill_mlra_defaults(args, TransformerLMMLRAConfig)
        check_mlra_config(
            args, [("decoder self-attention", args.decoder_embed_dim, args.decoder_attention_heads)]
        )
        # The stock builder makes the token embedding (plain, adaptive input or character CNN)
        # and runs its own checks; only its decoder is replaced, so build that one without layers.
        layers, keep = args.decoder_layers, args.decoder_layers_to_keep
        try:
            args.decoder_layers, args.decoder_layers_to_keep = 0, None
            stub = super().build_model(args, task)
        finally:
            args.decoder_layers, args.decoder_layers_to_keep = layers, keep
        if args.decoder_layers_to_keep:
            args.decoder_layers = len(args.decoder_layers_to_keep.split(","))

        cfg = TransformerConfig.from_namespace(args)  # a copy: rebalancing leaves args unchanged
        # from_namespace copies unknown keys of an argparse Namespace but not of a DictConfig
        for f in fields(TransformerLMMLRAConfig):
            if f.name.startswith("mlra_") or f.name == "attention_rank":
                value = safe_getattr(args, f.name, None)
                setattr(cfg, f.name, value if value is None or isinstance(value, (int, bool)) else str(value))
        saved, layer_params = _lm_layer_bookkeeping(cfg)
        n_layers, ffn = cfg.decoder.layers, cfg.decoder.ffn_embed_dim
        cfg.decoder.ffn_embed_dim, cfg.decoder.layers = rebalanced_stack(
            cfg, "decoder", saved, layer_params
        )
        decoder = MLRATransformerDecoder(
            cfg, task.target_dictionary, stub.decoder.embed_tokens, no_encoder_attn=True
        )
        model = cls(decoder)
        baseline = sum(p.numel() for p in model.parameters()) + saved * n_layers
        baseline -= rebalance_extra_params(list(decoder.layers), n_layers, ffn, cfg.decoder.embed_dim)
        log_mlra_summary(model, baseline, "transformer_lm_mlra")
        return model


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
