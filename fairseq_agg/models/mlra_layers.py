"""fairseq's Transformer layers, encoder and decoder with MLRA attention (shared by the MT and LM
models).

The classes are fairseq's, subclassed at their ``build_*`` hooks only, so every stock flag keeps
working and checkpoints load in stock ``fairseq-generate`` / ``fairseq-eval-lm`` with
``--user-dir``. Which attention is factorised follows the flags (docs/mlra.md, "Flags"): every
self-attention by default (``--mlra-self-attention`` narrows it for MT), the encoder-decoder
attention only with ``--mlra-cross-attention``.
"""
from fairseq.distributed import fsdp_wrap
from fairseq.models.transformer import TransformerDecoderBase, TransformerEncoderBase
from fairseq.modules.checkpoint_activations import checkpoint_wrapper
from fairseq.modules.transformer_layer import (
    TransformerDecoderLayerBase,
    TransformerEncoderLayerBase,
)

from fairseq_agg.modules.mlra_options import MLRAOptions
from fairseq_agg.modules.mlra import MultiheadLowRankAttention


def _mlra_attention(layer, cfg, embed_dim: int, num_heads: int, where: str, xformers_att_config,
                    **attention_kwargs) -> MultiheadLowRankAttention:
    """The MLRA attention a layer builds, with the arguments fairseq's own hook would pass."""
    return MultiheadLowRankAttention(
        embed_dim,
        num_heads,
        dropout=cfg.attention_dropout,
        q_noise=layer.quant_noise,
        qn_block_size=layer.quant_noise_block_size,
        xformers_att_config=xformers_att_config,
        where=where,
        **attention_kwargs,
        **MLRAOptions.from_cfg(cfg).attention_kwargs(),
    )


def _wrap_layer(layer, cfg):
    # the same activation-checkpointing and FSDP wrapping as fairseq's build_*_layer hooks
    checkpoint = cfg.checkpoint_activations
    if checkpoint:
        layer = checkpoint_wrapper(layer, offload_to_cpu=cfg.offload_activations)
    min_params_to_wrap = cfg.min_params_to_wrap if not checkpoint else 0
    return fsdp_wrap(layer, min_num_params=min_params_to_wrap)


class MLRATransformerEncoderLayer(TransformerEncoderLayerBase):
    def build_self_attention(self, embed_dim, cfg):
        if not MLRAOptions.from_cfg(cfg).self_attention_on("encoder"):
            return super().build_self_attention(embed_dim, cfg)
        return _mlra_attention(self, cfg, embed_dim, cfg.encoder.attention_heads,
                               "encoder self-attention", cfg.encoder.xformers_att_config,
                               self_attention=True)


class MLRATransformerDecoderLayer(TransformerDecoderLayerBase):
    def build_self_attention(self, embed_dim, cfg, add_bias_kv=False, add_zero_attn=False):
        if not MLRAOptions.from_cfg(cfg).self_attention_on("decoder"):
            return super().build_self_attention(embed_dim, cfg, add_bias_kv, add_zero_attn)
        return _mlra_attention(self, cfg, embed_dim, cfg.decoder.attention_heads,
                               "decoder self-attention", cfg.decoder.xformers_att_config,
                               add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn,
                               self_attention=not cfg.cross_self_attention)

    def build_encoder_attention(self, embed_dim, cfg):
        if not MLRAOptions.from_cfg(cfg).cross_attention:
            return super().build_encoder_attention(embed_dim, cfg)
        return _mlra_attention(self, cfg, embed_dim, cfg.decoder.attention_heads,
                               "encoder-decoder attention", cfg.encoder.xformers_att_config,
                               kdim=cfg.encoder.embed_dim, vdim=cfg.encoder.embed_dim,
                               encoder_decoder_attention=True)


class MLRATransformerEncoder(TransformerEncoderBase):
    def build_encoder_layer(self, cfg):
        return _wrap_layer(MLRATransformerEncoderLayer(cfg, return_fc=self.return_fc), cfg)


class MLRATransformerDecoder(TransformerDecoderBase):
    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        return _wrap_layer(MLRATransformerDecoderLayer(cfg, no_encoder_attn), cfg)
