"""A ``--user-dir`` plugin of the tests: fairseq-agg's criteria, plus ``cross_entropy_zloss``,
(label-smoothed) cross-entropy with the toy term of ``term.py``, composed of the package's public
pieces (its output-layer criterion base and the fused layer) without editing the package.

    fairseq-train DATA --user-dir tests/support/zloss_plugin --criterion cross_entropy_zloss ...
"""
from dataclasses import dataclass, field

import fairseq_agg
from fairseq.criterions import register_criterion

from fairseq_agg.errors import check_number
from fairseq_agg.criterions.output_loss import OutputLossConfig, OutputLossCriterion, log_means
from fairseq_agg.ops import fused_linear_loss

from .zloss import ZLoss

fairseq_agg.register_with_fairseq()  # fairseq-agg's own criteria beside this one (the one registration line)


@dataclass
class ZLossConfig(OutputLossConfig):
    zloss_coef: float = field(default=1e-4, metadata={"help": "weight of coef * lse(z)^2 per token (>= 0)"})


@register_criterion("cross_entropy_zloss", dataclass=ZLossConfig)
class ZLossCriterion(OutputLossCriterion):
    """Cross-entropy plus coef * lse(z)^2 per token; logs ``zloss``, the mean lse^2 per token."""

    def __init__(self, task, cfg: ZLossConfig):
        super().__init__(task, cfg, "cross_entropy_zloss")
        self.coef = float(check_number("zloss_coef", cfg.zloss_coef, 0))
        self.refuse_output_kernel(ZLoss)

    def forward(self, model, sample, reduce=True):
        batch = self.io.batch(model, sample)
        request = self.request.with_terms(ZLoss(self.coef), per_token=not reduce)
        result = fused_linear_loss(batch.hidden, batch.weight, batch.target, request)
        extra = {"zloss": result.terms[ZLoss.name]["lse_squared"].data}
        return self.io.finish(model, batch, result.loss, result.nll, extra)

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        log_means(logging_outputs, "ntokens", {"zloss": 6})
