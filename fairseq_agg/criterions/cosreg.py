"""``cross_entropy_cosreg``: cosine regularisation, CosReg (Gao et al., ICLR 2019, "Representation
Degeneration Problem in Training Natural Language Generation Models", §5).

    loss = CE + gamma * R(W),   R = (1 / N^2) sum_{i != j} cos(w_i, w_j)

The cross-entropy is the shared fused output layer's (label smoothing a parameter, LM and MT alike);
R is exact and O(V d) (:mod:`fairseq_agg.ops.cosreg`). fairseq divides the summed loss by
``sample_size``, so gamma * R * ``sample_size`` is added in every micro-batch and the optimised
objective is mean CE + gamma * R. Logged: ``cosreg`` = R before gamma. Defaults and the choices
the paper leaves open: docs/baselines.md, "CosReg".
"""
from dataclasses import dataclass, field

import torch
from fairseq import metrics
from fairseq.criterions import register_criterion
from fairseq.dataclass import ChoiceEnum

from fairseq_agg.ops.cosreg import NORMALIZERS, cosine_regularizer
from fairseq_agg.stats.groups import ROW_POLICIES, row_mask

from .output_loss import OutputLossConfig, OutputLossCriterion, check_range, output_projection_weight

MATRICES = ("output", "input", "both")


@dataclass
class CosRegConfig(OutputLossConfig):
    cosreg_gamma: float = field(
        default=1.0,
        metadata={"help": "weight gamma of the cosine regulariser (>= 0; 0 = plain cross-entropy); "
                  "Gao et al. 2019 use 1"},
    )
    cosreg_normalizer: ChoiceEnum(list(NORMALIZERS)) = field(
        default="paper",
        metadata={"help": "paper: sum of cosines over pairs i != j divided by N^2 (Gao et al. 2019); "
                  "pairs: divided by N(N-1), the mean pairwise cosine"},
    )
    cosreg_rows: ChoiceEnum(list(ROW_POLICIES)) = field(
        default="no-pad-madeup",
        metadata={"help": "rows in R: all, no-pad-madeup (without the padding and madeupword rows) or "
                  "no-special; zero rows are always left out"},
    )
    cosreg_matrix: ChoiceEnum(list(MATRICES)) = field(
        default="output",
        metadata={"help": "matrix regularised: output projection (the shared matrix when tied), decoder "
                  "input embedding, or both (each distinct matrix once)"},
    )


@register_criterion("cross_entropy_cosreg", dataclass=CosRegConfig)
class CosRegCriterion(OutputLossCriterion):
    """(Label-smoothed) cross-entropy plus gamma * CosReg; see the module docstring."""

    def __init__(self, task, cfg: CosRegConfig):
        check_range("cosreg_gamma", cfg.cosreg_gamma, cfg.cosreg_gamma >= 0.0, ">= 0")
        super().__init__(task, cfg)
        self.rows = row_mask(self.dictionary, cfg.cosreg_rows).nonzero().squeeze(1)

    def check_model(self, model):
        weight = super().check_model(model)
        self.regularised_matrices(model)
        return weight

    def regularised_matrices(self, model):
        """The distinct V x d matrices of --cosreg-matrix."""
        matrices = []
        if self.cfg.cosreg_matrix in ("output", "both"):
            matrices.append(output_projection_weight(model))
        if self.cfg.cosreg_matrix in ("input", "both"):
            embed = getattr(model.decoder, "embed_tokens", None)
            weight = getattr(embed, "weight", None)
            if weight is None or weight.size(0) != len(self.dictionary):
                raise ValueError("--cosreg-matrix input needs a decoder input embedding with one row per target type")
            if not any(weight is m for m in matrices):
                matrices.append(weight)
        return matrices

    def output_loss(self, model, hidden, weight, target, gates):
        loss, nll, _ = self.output_layer(hidden, weight, target, gates)
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.cfg.cosreg_gamma > 0):
            regulariser = sum(
                cosine_regularizer(matrix, self.rows.to(matrix.device), self.cfg.cosreg_normalizer)[0]
                for matrix in self.regularised_matrices(model)
            )
        if self.cfg.cosreg_gamma > 0:  # fairseq divides by sample_size: gamma * R per sample unit
            loss = loss + (self.cfg.cosreg_gamma * self.batch.sample_size) * regulariser
        return loss, nll, {"cosreg": regulariser.detach(), "cosreg_steps": 1}

    @classmethod
    def reduce_extra_metrics(cls, logging_outputs, total):
        super().reduce_extra_metrics(logging_outputs, total)
        steps = total("cosreg_steps")
        if steps:
            metrics.log_scalar("cosreg", total("cosreg") / steps, steps, round=4)
