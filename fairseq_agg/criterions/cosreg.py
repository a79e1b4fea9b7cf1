"""``cross_entropy_cosreg``: cosine regularisation, CosReg (Gao et al., ICLR 2019, "Representation
Degeneration Problem in Training Natural Language Generation Models", §5).

    loss = CE + gamma * R(W),   R = (1 / N^2) sum_{i != j} cos(w_i, w_j)

The cross-entropy is the shared fused output layer's (label smoothing a parameter, LM and MT alike);
R is exact and O(V d) (:class:`fairseq_agg.ops.CosRegLoss`). fairseq divides the summed loss by
``sample_size``, so gamma * R * ``sample_size`` is added in every micro-batch and the optimised
objective is mean CE + gamma * R (with ``reduce=False`` that term is spread evenly over the target
tokens, so the per-token losses sum to the loss). Logged: ``cosreg`` = R before gamma. Defaults and
the choices the paper leaves open: docs/baselines.md, "CosReg".
"""
from dataclasses import dataclass, field

from fairseq.criterions import register_criterion
from fairseq.dataclass import ChoiceEnum

from fairseq_agg.errors import UsageError
from fairseq_agg.ops import CosRegLoss, fused_linear_loss
from fairseq_agg.ops.cosreg import NORMALIZERS
from fairseq_agg.stats.groups import ROW_POLICIES, row_mask

from fairseq_agg.fairseq_facts.output_layer import output_projection_weight

from .output_loss import OutputLossConfig, OutputLossCriterion, log_means

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
        metadata={"help": "matrix regularised: output = the output projection (the shared matrix when tied), "
                  "input = the decoder input embedding, both = each distinct matrix of the two once"},
    )


@register_criterion("cross_entropy_cosreg", dataclass=CosRegConfig)
class CosRegCriterion(OutputLossCriterion):
    """(Label-smoothed) cross-entropy plus gamma * CosReg; see the module docstring."""

    def __init__(self, task, cfg: CosRegConfig):
        super().__init__(task, cfg, "cross_entropy_cosreg")
        rows = row_mask(self.dictionary, cfg.cosreg_rows).nonzero().squeeze(1)
        self.cosreg = CosRegLoss(gamma=cfg.cosreg_gamma, normalizer=cfg.cosreg_normalizer, rows=rows)

    def check_model(self, model):
        weight = super().check_model(model)
        self.regularised_matrices(model)
        return weight

    def regularised_matrices(self, model):
        """The V x d matrices of --cosreg-matrix (a tied one counts once)."""
        matrices = []
        if self.cfg.cosreg_matrix in ("output", "both"):
            matrices.append(output_projection_weight(model))
        if self.cfg.cosreg_matrix in ("input", "both"):
            weight = getattr(getattr(model.decoder, "embed_tokens", None), "weight", None)
            if weight is None or weight.size(0) != len(self.dictionary):
                raise UsageError("--cosreg-matrix input needs a decoder input embedding with one row per target type")
            matrices.append(weight)
        return matrices

    def forward(self, model, sample, reduce=True):
        batch = self.io.batch(model, sample)
        request = self.request.with_terms(per_token=not reduce)
        result = fused_linear_loss(batch.hidden, batch.weight, batch.target, request)
        regulariser = self.cosreg.regularizer(*self.regularised_matrices(model))
        loss = result.loss
        if self.cosreg.gamma > 0:  # fairseq divides by sample_size: gamma * R per sample unit
            term = (self.cosreg.gamma * batch.sample_size) * regulariser
            loss = loss + (term if reduce else term / max(loss.numel(), 1))
        return self.io.finish(model, batch, loss, result.nll, {"cosreg": regulariser.detach(), "cosreg_steps": 1})

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        log_means(logging_outputs, "cosreg_steps", {"cosreg": 4})
