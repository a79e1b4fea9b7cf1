"""A toy term of the fused output layer, added from outside the package: the z-loss, which pulls
each row's log-partition towards 0,

    loss_n = coef * lse(z_n)^2,   d loss_n / d z_n = 2 coef lse(z_n) softmax(z_n)

(an auxiliary loss of large language models, e.g. PaLM's ``z_loss``). It is written only against
the public interface of :class:`fairseq_agg.ops.Term`, and no file of ``fairseq_agg/ops/`` names
it: the tests (tests/test_toy_term.py) run it eagerly, compiled and in a real ``fairseq-train``.
"""
import torch

from fairseq_agg.ops import ADDS_LOSS, Term, TermOut


class ZLoss(Term):
    """coef * lse(z)^2 per token, logged as ``zloss`` / ``lse_squared`` (before ``coef``)."""

    name = "zloss"
    role = ADDS_LOSS
    value_names = ("lse_squared",)
    foreign_refusal = "the z-loss (--zloss-coef)"

    def __init__(self, coef: float):
        self.coef = float(coef)
        self._coef = {}  # 0-d tensor per (dtype, device): a changing coef never recompiles the body

    def tile_inputs(self, rows: slice, target: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
        key = (acc, target.device)
        if key not in self._coef:
            self._coef[key] = torch.tensor(self.coef, dtype=acc, device=target.device)
        return self._coef[key]

    @staticmethod
    def tile(tile, coef: torch.Tensor) -> TermOut:
        lse = tile.lse.squeeze(1)
        squared = lse * lse
        grad = (2 * coef) * tile.lse * tile.probs()
        return TermOut(loss=coef * squared, grad=grad, values=(squared,))
