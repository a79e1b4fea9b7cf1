"""``cross_entropy_antifocal``: the anti-focal loss (Raunak et al., "On Long-Tailed Phenomena in
Neural Machine Translation", Findings of EMNLP 2020).

Each target token's (label-smoothed) cross-entropy is weighted by (1 + p_t)^gamma inside the
shared fused output layer (:class:`fairseq_agg.ops.antifocal.AntiFocalLoss`): by default the
formula, whose weight carries gradient; with ``--antifocal-constant-weight`` the released code's
constant weight. Training forwards only: validation's ``loss``, like ``nll_loss`` always, is plain
cross-entropy (as the released code's). Logged: ``antifocal_weight``, the mean weight per target
token of the training batches. The departures from the released code: docs/baselines.md,
"Anti-focal loss".
"""
from dataclasses import dataclass, field

import torch
from fairseq.criterions import register_criterion

from fairseq_agg.ops.antifocal import AntiFocalLoss, AntiFocalWeights

from .output_loss import OutputLossConfig, OutputLossCriterion, log_means


@dataclass
class AntiFocalConfig(OutputLossConfig):
    antifocal_gamma: float = field(
        default=1.0,
        metadata={"help": "gamma of the weight (1 + p_t)^gamma on each token's cross-entropy (>= 0; 0 = plain "
                  "cross-entropy; the released code's --gamma, an integer there)"},
    )
    antifocal_constant_weight: bool = field(
        default=False,
        metadata={"help": "treat the weight as a constant, without gradient through p_t, as the released code "
                  "does (default: the paper's formula, the weight differentiated)"},
    )


@register_criterion("cross_entropy_antifocal", dataclass=AntiFocalConfig)
class AntiFocalCriterion(OutputLossCriterion):
    """Anti-focal-weighted (label-smoothed) cross-entropy; see the module docstring."""

    def __init__(self, task, cfg: AntiFocalConfig):
        super().__init__(task, cfg, "cross_entropy_antifocal")
        self.antifocal = AntiFocalLoss(gamma=cfg.antifocal_gamma, constant_weight=cfg.antifocal_constant_weight)
        self.refuse_output_kernel(AntiFocalWeights)

    def forward(self, model, sample, reduce=True):
        batch = self.io.batch(model, sample)
        training = model.training and torch.is_grad_enabled()
        result = self.antifocal(batch.hidden, batch.weight, batch.target, self.request.with_terms(per_token=not reduce),
                                training=training)
        extra = {}
        if training:
            extra = {"antifocal_weight": result.terms[AntiFocalWeights.name]["weight"].data,
                     "antifocal_tokens": batch.target.numel()}
        return self.io.finish(model, batch, result.loss, result.nll, extra)

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        log_means(logging_outputs, "antifocal_tokens", {"antifocal_weight": 4})
