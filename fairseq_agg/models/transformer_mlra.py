"""``transformer_mlra``: fairseq's TransformerModel (MT) with MLRA attention.

MLRA is the stability method of Chung et al. (2024, EMNLP, arXiv 2409.07787, §3), not the
KV-sharding MLRA of Liu et al. (2026). This file only swaps the attention modules: the encoder /
decoder / layer classes are fairseq's, subclassed at their ``build_*`` hooks, so every stock flag
keeps working and checkpoints load in stock ``fairseq-generate --user-dir``. By default every
self-attention (encoder and decoder) is factorised; the encoder-decoder attention only with
``--mlra-cross-attention``.

The helpers here (options from the config, validation, parameter bookkeeping, rebalancing) are
shared with ``transformer_lm_mlra``.
"""
import logging
from dataclasses import dataclass, field, fields
from typing import List, Optional, Tuple

from fairseq.dataclass import ChoiceEnum
from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.distributed import fsdp_wrap
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import (
    TransformerConfig,
    TransformerDecoderBase,
    TransformerEncoderBase,
    TransformerModel,
    base_architecture,
    transformer_iwslt_de_en,
    transformer_vaswani_wmt_en_de_big,
    transformer_wmt_en_de,
)
from fairseq.modules.checkpoint_activations import checkpoint_wrapper
from fairseq.modules.transformer_layer import (
    TransformerDecoderLayerBase,
    TransformerEncoderLayerBase,
)
from fairseq.utils import safe_getattr

from fairseq_agg.modules.mlra import (
    MLRAConfig,
    MultiheadLowRankAttention,
    break_even_rank,
    low_rank_param_count,
    mha_param_count,
    parse_targets,
    resolve_rank,
)

logger = logging.getLogger(__name__)

MLRA_SELF_ATTENTION = ("all", "encoder", "decoder", "none")


@dataclass
class TransformerMLRAConfig(MLRAConfig):
    """MLRA flags of the MT model (added to fairseq's TransformerModel flags)."""

    mlra_self_attention: ChoiceEnum(MLRA_SELF_ATTENTION) = field(
        default="all",
        metadata={"help": "which self-attention stacks to factorise: all, encoder, decoder, none"},
    )


# ----------------------------------------------------------------------------------------------
# Shared glue (also used by transformer_lm_mlra)
# ----------------------------------------------------------------------------------------------


def fill_mlra_defaults(args, config_cls=TransformerMLRAConfig):
    """Architecture-function helper: sets every MLRA flag the user did not give to its default."""
    for f in fields(config_cls):
        if f.name.startswith("mlra_") or f.name == "attention_rank":
            default = f.default.value if hasattr(f.default, "value") else f.default
            setattr(args, f.name, safe_getattr(args, f.name, default))


def mlra_options(cfg):
    """Constructor keywords of MultiheadLowRankAttention, read from a model config."""
    return dict(
        rank=safe_getattr(cfg, "attention_rank", None),
        mode=str(safe_getattr(cfg, "mlra_mode", "shared")),
        init=str(safe_getattr(cfg, "mlra_init", "gpt2")),
        targets=parse_targets(str(safe_getattr(cfg, "mlra_targets", "q,k,v"))),
    )


def mlra_attention_param_count(embed_dim: int, num_heads: int, cfg, kdim: Optional[int] = None,
                               vdim: Optional[int] = None) -> int:
    """Parameters of one MultiheadLowRankAttention with the config's options (spec §3.3)."""
    o = mlra_options(cfg)
    rank = resolve_rank(o["rank"], o["mode"], embed_dim, num_heads)
    dims = {"q": embed_dim, "k": kdim or embed_dim, "v": vdim or embed_dim, "o": embed_dim}
    n = 0
    for t, d_in in dims.items():
        if t in o["targets"]:
            n += low_rank_param_count(d_in, embed_dim, rank, o["mode"], num_heads,
                                      "in" if t == "o" else "out")
        else:
            n += d_in * embed_dim + embed_dim
    return n


def check_mlra_config(cfg, stacks: List[Tuple[str, int, int]]):
    """Startup validation, before anything is built: raises a ValueError naming the flag.

    stacks: (where, embed_dim, num_heads) of every attention kind that will be factorised.
    """
    o = mlra_options(cfg)  # parses --mlra-targets
    mode = o["mode"]
    if o["init"] not in ("gpt2", "matched"):
        raise ValueError(f"--mlra-init must be one of gpt2,matched; got {o['init']!r}")
    rebalance = str(safe_getattr(cfg, "mlra_rebalance", "none"))
    if rebalance not in ("none", "ffn", "depth"):
        raise ValueError(f"--mlra-rebalance must be one of none,ffn,depth; got {rebalance!r}")
    for where, d, h in stacks:
        if d % h:
            raise ValueError(f"{where}: embed dim {d} is not divisible by {h} attention heads")
        r = resolve_rank(o["rank"], mode, d, h, where)
        if r >= break_even_rank(mode, d, h):
            logger.warning(
                f"--attention-rank {r} with --mlra-mode {mode} saves no parameters in the {where} "
                f"(break-even rank {break_even_rank(mode, d, h):g})"
            )


def rebalanced_stack(cfg, side: str, saved_per_layer: int, layer_params: int):
    """Spends the parameters MLRA saves in one stack (spec §3.3 "rebalance"): returns the new
    (ffn_embed_dim, layers). ffn widens every FFN by saved / (2 d + 1) units (fc1 and fc2 weights
    plus the fc1 bias per unit); depth adds floor(saved over the stack / one layer) layers."""
    sub = getattr(cfg, side)
    how = str(safe_getattr(cfg, "mlra_rebalance", "none"))
    ffn, layers = sub.ffn_embed_dim, sub.layers
    if how == "ffn" and saved_per_layer > 0:
        ffn += saved_per_layer // (2 * sub.embed_dim + 1)
    elif how == "depth" and saved_per_layer > 0 and layer_params > 0:
        layers += (saved_per_layer * layers) // layer_params
    return ffn, layers


def log_mlra_summary(model, baseline_params: int, what: str):
    """Prints the parameter delta vs the same model with fairseq's MultiheadAttention."""
    mods = [m for m in model.modules() if isinstance(m, MultiheadLowRankAttention)]
    total = sum(p.numel() for p in model.parameters())
    if not mods:
        logger.warning(f"{what}: no attention module is factorised (check --mlra-self-attention "
                       f"and --mlra-cross-attention)")
        return
    attn = sum(p.numel() for m in mods for p in m.parameters())
    dense = sum(m.dense_param_count() for m in mods)
    m0 = mods[0]
    pct = 100.0 * (total - baseline_params) / max(baseline_params, 1)
    logger.info(
        f"MLRA (Chung et al., 2024, stability) in {what}: {len(mods)} attention modules "
        f"factorised (mode {m0.mode}, rank {m0.rank}, targets {','.join(m0.targets)}, init "
        f"{m0.init}); their parameters {attn:,} vs {dense:,} with MultiheadAttention (delta "
        f"{attn - dense:+,}); model parameters {total:,} vs {baseline_params:,} "
        f"(delta {total - baseline_params:+,}, {pct:+.2f}%)"
    )


def _wrap_layer(layer, cfg):
    # the same activation-checkpointing and FSDP wrapping as fairseq's build_*_layer hooks
    checkpoint = cfg.checkpoint_activations
    if checkpoint:
        layer = checkpoint_wrapper(layer, offload_to_cpu=cfg.offload_activations)
    min_params_to_wrap = cfg.min_params_to_wrap if not checkpoint else 0
    return fsdp_wrap(layer, min_num_params=min_params_to_wrap)


def _self_attention_on(cfg, side: str) -> bool:
    which = str(safe_getattr(cfg, "mlra_self_attention", "all"))
    return which == "all" or which == side


# ----------------------------------------------------------------------------------------------
# Layers, encoder, decoder
# ----------------------------------------------------------------------------------------------


class MLRATransformerEncoderLayer(TransformerEncoderLayerBase):
    def build_self_attention(self, embed_dim, cfg):
        if not _self_attention_on(cfg, "encoder"):
            return super().build_self_attention(embed_dim, cfg)
        return MultiheadLowRankAttention(
            embed_dim,
            cfg.encoder.attention_heads,
            dropout=cfg.attention_dropout,
            self_attention=True,
            q_noise=self.quant_noise,
            qn_block_size=self.quant_noise_block_size,
            xformers_att_config=cfg.encoder.xformers_att_config,
            where="encoder self-attention",
            **mlra_options(cfg),
        )


class MLRATransformerDecoderLayer(TransformerDecoderLayerBase):
    def build_self_attention(self, embed_dim, cfg, add_bias_kv=False, add_zero_attn=False):
        if not _self_attention_on(cfg, "decoder"):
            return super().build_self_attention(embed_dim, cfg, add_bias_kv, add_zero_attn)
        return MultiheadLowRankAttention(
            embed_dim,
            cfg.decoder.attention_heads,
            dropout=cfg.attention_dropout,
            add_bias_kv=add_bias_kv,
            add_zero_attn=add_zero_attn,
            self_attention=not cfg.cross_self_attention,
            q_noise=self.quant_noise,
            qn_block_size=self.quant_noise_block_size,
            xformers_att_config=cfg.decoder.xformers_att_config,
            where="decoder self-attention",
            **mlra_options(cfg),
        )

    def build_encoder_attention(self, embed_dim, cfg):
        if not safe_getattr(cfg, "mlra_cross_attention", False):
            return super().build_encoder_attention(embed_dim, cfg)
        return MultiheadLowRankAttention(
            embed_dim,
            cfg.decoder.attention_heads,
            kdim=cfg.encoder.embed_dim,
            vdim=cfg.encoder.embed_dim,
            dropout=cfg.attention_dropout,
            encoder_decoder_attention=True,
            q_noise=self.quant_noise,
            qn_block_size=self.quant_noise_block_size,
            xformers_att_config=cfg.encoder.xformers_att_config,
            where="encoder-decoder attention",
            **mlra_options(cfg),
        )


class MLRATransformerEncoder(TransformerEncoderBase):
    def build_encoder_layer(self, cfg):
        return _wrap_layer(MLRATransformerEncoderLayer(cfg, return_fc=self.return_fc), cfg)


class MLRATransformerDecoder(TransformerDecoderBase):
    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        return _wrap_layer(MLRATransformerDecoderLayer(cfg, no_encoder_attn), cfg)


# ----------------------------------------------------------------------------------------------
# Parameter bookkeeping of the encoder-decoder model
# ----------------------------------------------------------------------------------------------


def _mt_savings(cfg) -> Tuple[int, int, int, int]:
    """(saved per encoder layer, saved per decoder layer, encoder layer params, decoder layer
    params), all with MLRA, from the config (attention biases included, NormFormer extras not)."""
    de, he, fe = cfg.encoder.embed_dim, cfg.encoder.attention_heads, cfg.encoder.ffn_embed_dim
    dd, hd, fd = cfg.decoder.embed_dim, cfg.decoder.attention_heads, cfg.decoder.ffn_embed_dim
    enc_self = _self_attention_on(cfg, "encoder")
    dec_self = _self_attention_on(cfg, "decoder")
    cross = not cfg.no_cross_attention
    mlra_cross = cross and bool(safe_getattr(cfg, "mlra_cross_attention", False))

    def attn(d, h, on, kdim=None):
        dense = mha_param_count(d, kdim, kdim)
        return (mlra_attention_param_count(d, h, cfg, kdim, kdim) if on else dense), dense

    e_attn, e_dense = attn(de, he, enc_self)
    d_attn, d_dense = attn(dd, hd, dec_self)
    c_attn, c_dense = attn(dd, hd, mlra_cross, de) if cross else (0, 0)
    ffn = lambda d, f: 2 * d * f + f + d  # noqa: E731
    enc_layer = e_attn + ffn(de, fe) + 4 * de
    dec_layer = d_attn + c_attn + ffn(dd, fd) + (6 if cross else 4) * dd
    return e_dense - e_attn, (d_dense - d_attn) + (c_dense - c_attn), enc_layer, dec_layer


def _mt_stacks(args) -> List[Tuple[str, int, int]]:
    stacks = []
    if _self_attention_on(args, "encoder"):
        stacks.append(("encoder self-attention", args.encoder_embed_dim, args.encoder_attention_heads))
    if _self_attention_on(args, "decoder"):
        stacks.append(("decoder self-attention", args.decoder_embed_dim, args.decoder_attention_heads))
    if safe_getattr(args, "mlra_cross_attention", False) and not safe_getattr(args, "no_cross_attention", False):
        stacks.append(("encoder-decoder attention", args.decoder_embed_dim, args.decoder_attention_heads))
    return stacks


# ----------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------


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
        check_mlra_config(args, _mt_stacks(args))
        model = super().build_model(args, task)
        cfg = TransformerConfig.from_namespace(args)  # the architecture before any rebalancing
        se, sd, _, _ = _mt_savings(cfg)
        baseline = sum(p.numel() for p in model.parameters())
        baseline += se * cfg.encoder.layers + sd * cfg.decoder.layers
        # parameters a rebalance added on top (wider FFNs or more layers) are not MHA's
        baseline -= _rebalance_extra(model, cfg)
        log_mlra_summary(model, baseline, "transformer_mlra")
        return model

    @classmethod
    def build_encoder(cls, args, src_dict, embed_tokens):
        cfg = TransformerConfig.from_namespace(args)
        se, _, el, _ = _mt_savings(cfg)
        # cfg is this model's own copy: rebalancing it leaves the saved command line unchanged
        cfg.encoder.ffn_embed_dim, cfg.encoder.layers = rebalanced_stack(cfg, "encoder", se, el)
        return MLRATransformerEncoder(cfg, src_dict, embed_tokens)

    @classmethod
    def build_decoder(cls, args, tgt_dict, embed_tokens):
        cfg = TransformerConfig.from_namespace(args)
        _, sd, _, dl = _mt_savings(cfg)
        cfg.decoder.ffn_embed_dim, cfg.decoder.layers = rebalanced_stack(cfg, "decoder", sd, dl)
        return MLRATransformerDecoder(
            cfg, tgt_dict, embed_tokens, no_encoder_attn=cfg.no_cross_attention
        )


def rebalance_extra_params(layers, n_layers: int, ffn_dim: int, embed_dim: int) -> int:
    """Parameters a rebalance added to one stack of built layers: the layers beyond n_layers
    (depth) plus the widening of the FFNs beyond ffn_dim (ffn)."""
    extra = sum(p.numel() for l in layers[n_layers:] for p in l.parameters())
    for layer in layers[:n_layers]:
        fc1 = getattr(layer, "fc1", None)
        if fc1 is not None:
            extra += (fc1.out_features - ffn_dim) * (2 * embed_dim + 1)
    return extra


def _rebalance_extra(model, cfg) -> int:
    """Parameters added by --mlra-rebalance, measured on the built encoder and decoder."""
    extra = 0
    for side, stack in (("encoder", model.encoder), ("decoder", model.decoder)):
        sub = getattr(cfg, side)
        extra += rebalance_extra_params(list(stack.layers), sub.layers, sub.ffn_embed_dim,
                                        sub.embed_dim)
    return extra


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

