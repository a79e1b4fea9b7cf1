"""``cross_entropy_unlikelihood``: token-level unlikelihood training, UL (Welleck et al., ICLR 2020,
"Neural Text Generation with Unlikelihood Training").

    loss_t = CE_t + alpha * sum_{c in C_t} -log(1 - p(c)),   C_t = the distinct earlier targets of the
                                                             same sequence, minus the target itself

inside the shared fused output layer, without a tokens x V candidate mask
(:class:`fairseq_agg.ops.UnlikelihoodLoss`); label smoothing applies to the CE part. LM and MT
alike (in MT the earlier target-side tokens). Logged: ``ul_loss`` (the UL term before alpha, base 2,
per ``sample_size``, the released code's ``custom_loss``) and ``ul_candidates`` (mean |C_t| per
target token). Defaults: docs/baselines.md, "UL".
"""
import math
from dataclasses import dataclass, field

from fairseq import metrics
from fairseq.criterions import register_criterion

from fairseq_agg.ops import UnlikelihoodCandidates, UnlikelihoodLoss
from fairseq_agg.ops.unlikelihood import DEFAULT_CLAMP

from .output_loss import OutputLossConfig, OutputLossCriterion, log_means, logged_total


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
        super().__init__(task, cfg, "cross_entropy_unlikelihood")
        self.unlikelihood = UnlikelihoodLoss(alpha=cfg.ul_alpha, clamp=cfg.ul_clamp, pad=self.padding_idx)
        self.refuse_output_kernel(UnlikelihoodCandidates)

    def forward(self, model, sample, reduce=True):
        batch = self.io.batch(model, sample)
        result = self.unlikelihood(batch.hidden, batch.weight, batch.padded_target, batch.keep,
                                   self.request.with_terms(per_token=not reduce))
        values = result.terms[UnlikelihoodCandidates.name]
        extra = {"ul_loss": values["penalty"].data, "ul_candidates": values["candidates"].data}
        return self.io.finish(model, batch, result.loss, result.nll, extra)

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        total = logged_total(logging_outputs)
        sample_size = total("sample_size")
        if sample_size:
            metrics.log_scalar("ul_loss", total("ul_loss") / sample_size / math.log(2), sample_size, round=4)
        log_means(logging_outputs, "ntokens", {"ul_candidates": 2})
