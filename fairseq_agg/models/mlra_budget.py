"""The parameter budget of the MLRA models (shared by the MT and LM models).

MLRA changes the parameter count of every factorised attention (docs/mlra.md, "Parameter
counts"). This file counts what a stack of layers saves against fairseq's MultiheadAttention,
spends it with ``--mlra-rebalance`` (wider FFNs or more layers), and logs the delta against the
same model with MultiheadAttention at build time.
"""
import logging
from typing import Iterable, NamedTuple, Sequence, Tuple

from fairseq_agg.modules.mlra import MultiheadLowRankAttention, mha_param_count, mlra_param_count
from fairseq_agg.modules.mlra_options import METHOD_NAME, AttentionSite, MLRAOptions

logger = logging.getLogger(__name__)


class StackBudget(NamedTuple):
    """Parameter counts of one stack as the config describes it, before any rebalancing."""

    side: str
    saved_per_layer: int  # what MLRA saves in one layer against MultiheadAttention
    layer_params: int  # parameters of one layer with MLRA
    layers: int
    ffn_embed_dim: int
    embed_dim: int


def stack_budget(cfg, options: MLRAOptions, side: str, sites: Sequence[AttentionSite]) -> StackBudget:
    """Counts one stack of a TransformerConfig: every layer holds the ``sites`` of this side, an
    FFN (2 d f + f + d) and one LayerNorm (2 d) per sub-layer (NormFormer extras not counted)."""
    sub = getattr(cfg, side)
    d, f = sub.embed_dim, sub.ffn_embed_dim
    mlra = dense = n_attention = 0
    for site in sites:
        if site.side != side:
            continue
        n_attention += 1
        mha = mha_param_count(site.embed_dim, site.kdim, site.kdim)
        dense += mha
        if site.factorised:
            rank = options.rank_for(site.embed_dim, site.num_heads, site.where)
            mlra += mlra_param_count(site.embed_dim, site.num_heads, rank, options.mode,
                                     options.targets, site.kdim, site.kdim)
        else:
            mlra += mha
    layer = mlra + 2 * d * f + f + d + 2 * d * (n_attention + 1)
    return StackBudget(side, dense - mlra, layer, sub.layers, f, d)


def rebalance_stack(cfg, options: MLRAOptions, budget: StackBudget) -> None:
    """Spends what MLRA saves in one stack (``--mlra-rebalance``) by editing ``cfg``, the model's
    own copy of the config (the saved command line stays unchanged): ``ffn`` widens every FFN by
    saved / (2 d + 1) units (fc1 and fc2 weights plus the fc1 bias per unit); ``depth`` adds
    floor(saved over the stack / one layer) layers."""
    sub = getattr(cfg, budget.side)
    saved = budget.saved_per_layer
    if options.rebalance == "ffn" and saved > 0:
        sub.ffn_embed_dim = budget.ffn_embed_dim + saved // (2 * budget.embed_dim + 1)
    elif options.rebalance == "depth" and saved > 0 and budget.layer_params > 0:
        sub.layers = budget.layers + (saved * budget.layers) // budget.layer_params


def _rebalance_extra_params(built_layers, budget: StackBudget) -> int:
    """Parameters a rebalance added to one built stack: the layers beyond the configured number
    (depth) plus the widening of the FFNs (ffn)."""
    extra = sum(p.numel() for layer in built_layers[budget.layers:] for p in layer.parameters())
    for layer in built_layers[: budget.layers]:
        fc1 = getattr(layer, "fc1", None)
        if fc1 is not None:
            extra += (fc1.out_features - budget.ffn_embed_dim) * (2 * budget.embed_dim + 1)
    return extra


def mha_baseline_params(model, stacks: Iterable[Tuple[StackBudget, Sequence]]) -> int:
    """Parameters of the same model with MultiheadAttention and no rebalancing: the built model's,
    plus what MLRA saved, minus what a rebalance added (measured on the built layers).

    stacks: (budget, built layers) of every stack."""
    n = sum(p.numel() for p in model.parameters())
    for budget, built_layers in stacks:
        n += budget.saved_per_layer * budget.layers - _rebalance_extra_params(list(built_layers), budget)
    return n


def log_mlra_summary(model, baseline_params: int, what: str):
    """Logs the parameter delta against the same model with fairseq's MultiheadAttention."""
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
        f"{METHOD_NAME} in {what}: {len(mods)} attention modules "
        f"factorised (mode {m0.mode}, rank {m0.rank}, targets {','.join(m0.targets)}, init "
        f"{m0.init}); their parameters {attn:,} vs {dense:,} with MultiheadAttention (delta "
        f"{attn - dense:+,}); model parameters {total:,} vs {baseline_params:,} "
        f"(delta {total - baseline_params:+,}, {pct:+.2f}%)"
    )
