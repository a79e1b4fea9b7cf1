"""AGG's threshold alpha at start-up (Yu et al., ACL 2022, §4; docs/agg.md, "Flags" and "The
operating point"): which counting mode and reference batch a run uses, the range of alpha that
keeps every gate <= 1, and where alpha puts the rare set in a run's terms. Pure Python; the gates
of every step are :mod:`fairseq_agg.ops.agg`.
"""
from typing import NamedTuple

from fairseq_agg.errors import UsageError, check_number

# Tokens per optimizer update of the AGG paper's recipes (the released code's training commands;
# docs/agg.md, "Flags"): WikiText-103 LM --max-tokens 4096 x --update-freq 8 = 32,768 target tokens;
# WMT14 En-De --max-tokens 8192 x --update-freq 8 = 65,536 tokens (an upper bound, less padding).
PAPER_TOKENS_PER_UPDATE = {"language_modeling": 32768, "translation": 65536}
# The paper's WikiText-103 run has about 3,600 updates per epoch (about 118M GPT-2 tokens / 32,768);
# the paper states no count, so its operating point is derived (PAPER_OPERATING_POINT, below).
PAPER_UPDATES_PER_EPOCH = 3600


def resolve_threshold(threshold_mode: str, ref_tokens: int, translation: bool):
    """(mode, B_ref) of a run: ``auto`` is ``relative``; B_ref 0 is the paper's tokens per update."""
    mode = "relative" if threshold_mode == "auto" else threshold_mode
    if ref_tokens == 0:
        ref_tokens = PAPER_TOKENS_PER_UPDATE["translation" if translation else "language_modeling"]
    return mode, ref_tokens


class OperatingPoint(NamedTuple):
    """Where AGG's threshold sits in a run, in the terms of the paper's analysis (Yu et al. 2022,
    §3): a rare token is a target in few updates and a pushed-away non-target in all the others.
    docs/agg.md, "The operating point", explains the two readings of alpha."""

    count_per_epoch: float  # a type counted fewer times than this in an epoch is rare
    target_share: float  # count_per_epoch / updates_per_epoch: at most this share of updates has it as a target
    tokens_per_update: float
    updates_per_epoch: float


def operating_point(alpha: float, threshold_mode: str, ref_tokens: int, tokens_per_epoch: float,
                    updates_per_epoch: float) -> OperatingPoint:
    """The count per epoch below which a type is rare, and the share of updates in which a type at
    that count is a target (at most one occurrence per update).

    relative: a_k = c_k x B_ref / (tokens in the window) < alpha, so over an epoch of T tokens a type
    is rare below alpha x T / B_ref counts; per-update: a_k = c_k / (updates in the window) < alpha,
    so below alpha x U counts over an epoch of U updates, a share alpha of the updates whatever
    their size."""
    mode = "relative" if threshold_mode == "auto" else threshold_mode
    tokens_per_epoch, updates_per_epoch = float(tokens_per_epoch), float(updates_per_epoch)
    if mode == "relative":
        count = alpha * tokens_per_epoch / ref_tokens
    elif mode == "per-update":
        count = alpha * updates_per_epoch
    else:
        raise ValueError(f"unknown threshold mode {threshold_mode!r}")
    return OperatingPoint(count_per_epoch=count, target_share=count / updates_per_epoch,
                          tokens_per_update=tokens_per_epoch / updates_per_epoch, updates_per_epoch=updates_per_epoch)


# alpha 0.03 there: a type is rare below 0.03 x 3,600 = 108 counts per epoch, a target in at most 3 %
# of the updates (both rules agree, as its updates hold B_ref tokens; docs/agg.md, "The operating point")
PAPER_OPERATING_POINT = operating_point(0.03, "relative", PAPER_TOKENS_PER_UPDATE["language_modeling"],
                                        PAPER_UPDATES_PER_EPOCH * PAPER_TOKENS_PER_UPDATE["language_modeling"],
                                        PAPER_UPDATES_PER_EPOCH)

G1_MODES = ("code", "normalized")
THRESHOLD_MODES = ("relative", "per-update")


def alpha_allowed_range(g1_mode: str):
    """(allowed-range text, check) of ``alpha`` that keeps every gate <= 1 in ``g1_mode``.

    g2 is capped at 1 by its min(., 1). With ``code`` g1 = a_k on rare tokens, i.e. any value below
    alpha, in every threshold mode (a per-update mean or a count per B_ref tokens can both approach
    alpha), so alpha must be <= 1; with ``normalized`` g1 = a_k / alpha < 1 for every finite alpha.
    inf and nan are refused in both modes (every token would be rare, or none).
    """
    if g1_mode == "code":
        text, high = "in (0, 1] with --agg-g1-mode code (g1 = a_k < alpha must stay <= 1)", 1.0
    elif g1_mode == "normalized":
        text, high = "a finite number > 0", None
    else:
        raise ValueError(f"unknown g1 mode {g1_mode!r} (choose code or normalized)")

    def allowed(alpha) -> bool:
        try:
            check_number("agg_alpha", alpha, 0.0, high, low_open=True)
        except UsageError:
            return False
        return True

    return text, allowed


def check_alpha(alpha, g1_mode: str) -> float:
    """``alpha`` if every gate stays <= 1 with it (:func:`alpha_allowed_range`), else a UsageError."""
    text, allowed = alpha_allowed_range(g1_mode)
    if not allowed(alpha):
        raise UsageError(f"--agg-alpha must be {text}, got {alpha}")
    return float(alpha)
