"""``cross_entropy_unlikelihood``: token-level unlikelihood training, UL (Welleck et al., ICLR 2020,
"Neural Text Generation with Unlikelihood Training").

    loss_t = CE_t + alpha * sum_{c in C_t} -log(1 - p(c)),   C_t = the distinct earlier targets of the
                                                             same sequence, minus the target itself

inside the shared fused output layer, without a tokens x V candidate mask
(:mod:`fairseq_agg.ops.unlikelihood`); label smoothing applies to the CE part. LM and MT alike (in
MT the earlier target-side tokens). Logged: ``ul_loss`` (the UL term before alpha, base 2, per
``sample_size``, the released code's ``custom_loss``) and ``ul_candidates`` (mean |C_t| per
target token). Defaults: docs/baselines.md, "UL".
"""
import math
from dataclasses import dataclass, field

import torch
from fairseq import metrics
from fairseq.criterions import register_criterion

from fairseq_agg.ops.unlikelihood import DEFAULT_CLAMP, unlikelihood_candidates

from .output_loss import OutputLossConfig, OutputLossCriterion, check_range


@dataclass
class UnlikelihoodConfig(OutputLossConfig):
    ul_alpha: float = field(
        default=1.0,
        metadata={"help": "weight alpha of the token-level unlikelihood term (>= 0; 0 = plain "
                  "cross-entropy); the released code's --rank-alpha 1.0"},
    )
    ul_clamp: float = field(
        default=DEFAULT_CLAMP,
        metadata={"help": "lower bound of 1 - p(c) in -log(1 - p(c)), in (0, 1); a clamped candidate gets "
                  "no gradient (the released code: 1e-5)"},
    )


@register_criterion("cross_entropy_unlikelihood", dataclass=UnlikelihoodConfig)
class UnlikelihoodCriterion(OutputLossCriterion):
    """(Label-smoothed) cross-entropy plus alpha * token-level unlikelihood; see the module docstring."""

    def __init__(self, task, cfg: UnlikelihoodConfig):
        check_range("ul_alpha", cfg.ul_alpha, cfg.ul_alpha >= 0.0, ">= 0")
        check_range("ul_clamp", cfg.ul_clamp, 0.0 < cfg.ul_clamp < 1.0, "in (0, 1)")
        super().__init__(task, cfg)

    def output_loss(self, model, hidden, weight, target, gates):
        candidates = unlikelihood_candidates(
            self.batch.target, self.batch.keep, self.padding_idx, self.cfg.ul_alpha, self.cfg.ul_clamp
        )
        loss, nll, _ = self.output_layer(hidden, weight, target, gates, penalty=candidates)
        zero = torch.zeros((), device=target.device)
        value = candidates.value_sum if candidates.value_sum is not None else zero
        count = candidates.candidate_count if candidates.candidate_count is not None else zero
        return loss, nll, {"ul_loss": value.data, "ul_candidates": count.data}

    @classmethod
    def reduce_extra_metrics(cls, logging_outputs, total):
        super().reduce_extra_metrics(logging_outputs, total)
        sample_size, ntokens = total("sample_size"), total("ntokens")
        if sample_size:
            metrics.log_scalar("ul_loss", total("ul_loss") / sample_size / math.log(2), sample_size, round=4)
        if ntokens:
            metrics.log_scalar("ul_candidates", total("ul_candidates") / ntokens, ntokens, round=2)
