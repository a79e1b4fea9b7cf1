"""``--optimizer coupled_adam``: fairseq's ``adam`` with Coupled Adam's shared second moment on the
token-embedding matrices (Stollenwerk & Stollenwerk, ACL 2025; docs/coupled_adam.md).

Same flags and defaults as ``adam`` (``--adam-betas``, ``--adam-eps``, ``--weight-decay``, the
learning rate and its schedulers; the update of every other parameter is adam's, bit for bit),
and the same ``--fp16`` / ``--memory-efficient-fp16`` / ``--amp`` support, plus
``--coupled-adam-matrices``, ``--coupled-adam-scale`` and ``--coupled-adam-decay`` (which parameters
``--weight-decay`` reaches). fairseq builds an optimizer from a bare
parameter list; which of those tensors are the embedding matrices is read from the model that
fairseq's Trainer is building the optimizer for (``fairseq_facts.optimizer_params.locate_model_parameters``), and
which tensors of the model are embedding matrices is the statistics' own rule
(``fairseq_agg.stats.matrices``): ``encoder.embed_tokens``, ``decoder.embed_tokens``,
``decoder.output_projection``, tied ones counted once.
"""
import logging
from dataclasses import dataclass, field

from fairseq_agg.requirements import require_fairseq

require_fairseq()  # without fairseq: one line saying what to install

from fairseq.dataclass import ChoiceEnum
from fairseq.optim import FairseqOptimizer, register_optimizer
from fairseq.optim.adam import FairseqAdam, FairseqAdamConfig

from ..errors import UsageError, check_choice, check_number
from ..fairseq_facts.optimizer_params import locate_model_parameters
from ..stats.matrices import MATRIX_CHOICES, embedding_matrices
from .coupled_adam import DECAY_CHOICES, CoupledAdam, CoupledBlock

logger = logging.getLogger(__name__)


@dataclass
class CoupledAdamConfig(FairseqAdamConfig):
    # adam's two implementation switches, kept so that adam's command lines carry over
    use_old_adam: bool = field(
        default=False, metadata={"help": "no effect: coupled_adam always runs its own torch implementation"}
    )
    fp16_adam_stats: bool = field(
        default=False, metadata={"help": "refused: fp16 statistics need fairseq's FusedAdam, which coupled_adam "
                                 "does not use"}
    )
    coupled_adam_matrices: ChoiceEnum(list(MATRIX_CHOICES)) = field(
        default="all",
        metadata={"help": "the embedding matrices whose second moment is averaged over the vocabulary: "
                  "input (encoder/decoder embed_tokens), output (the output projection) or all; a tied "
                  "matrix is one matrix, coupled when either of its roles is chosen"},
    )
    coupled_adam_scale: float = field(
        default=1.0,
        metadata={"help": "s: the coupled second moment is s times its mean over the rows (> 0; "
                  "avg_scale of the authors' code, default 1)"},
    )
    coupled_adam_decay: ChoiceEnum(list(DECAY_CHOICES)) = field(
        default="all",
        metadata={"help": "the parameters that --weight-decay reaches: all (as fairseq's adam) or "
                  "non-embedding-matrices (the authors' setting: the model's parameters of 2 or more dimensions "
                  "other than the coupled matrices; the coupled matrices and the model's 1-D parameters are not "
                  "decayed)"},
    )


@register_optimizer("coupled_adam", dataclass=CoupledAdamConfig)
class FairseqCoupledAdam(FairseqAdam):
    """Coupled Adam for fairseq: :class:`FairseqAdam`'s flags, learning-rate handling and BMUF
    averaging, with :class:`~fairseq_agg.optim.coupled_adam.CoupledAdam` as the torch optimizer
    (never fairseq's FusedAdam: the coupling needs the second moment before the division)."""

    def __init__(self, cfg: CoupledAdamConfig, params):
        FairseqOptimizer.__init__(self, cfg)  # not FairseqAdam's, which builds its own torch optimizer
        scale = check_number("coupled_adam_scale", cfg.coupled_adam_scale, 0, None, low_open=True)
        which = check_choice("coupled_adam_matrices", cfg.coupled_adam_matrices, MATRIX_CHOICES)
        decay = check_choice("coupled_adam_decay", cfg.coupled_adam_decay, DECAY_CHOICES)
        if cfg.fp16_adam_stats:
            raise UsageError("--fp16-adam-stats needs fairseq's FusedAdam; --optimizer coupled_adam keeps "
                             "fp32 statistics (drop the flag)")
        params = list(params)
        model, located = locate_model_parameters(params)
        coupled = coupled_matrices(model, located, which, scale)
        undecayed = undecayed_tensors(model, located, coupled) if decay == "non-embedding-matrices" else []
        self._optimizer = CoupledAdam(params, coupled=coupled, coupling_scale=scale, undecayed=undecayed,
                                      **self.optimizer_config)


def coupled_matrices(model, located, which, scale):
    """[(optimizer tensor, CoupledBlock)] of the ``model``'s ``which`` embedding matrices among the
    optimized tensors (``located``: ``locate_model_parameters``'s map); refuses set-ups where there
    are none or where they cannot be found."""
    if model is None:
        raise UsageError("--optimizer coupled_adam must be built by fairseq's Trainer (fairseq-train): it reads "
                         "the embedding matrices from the model being trained")
    matrices = [m for m in embedding_matrices(model, which) if m.weight.requires_grad]
    if not matrices:
        raise UsageError(f"--coupled-adam-matrices {which}: the model has no such trainable matrix (input: "
                         "encoder/decoder embed_tokens, output: decoder.output_projection; adaptive input and "
                         "adaptive softmax have none), so --optimizer coupled_adam has nothing to couple")
    coupled = []
    for matrix in matrices:
        if matrix.weight not in located:
            raise UsageError("--optimizer coupled_adam cannot find the embedding matrices among the optimized "
                             "tensors in this set-up (fully_sharded or pipeline parallelism); use --optimizer adam")
        tensor, offset = located[matrix.weight]
        rows, cols = matrix.weight.shape
        coupled.append((tensor, CoupledBlock(offset, rows, cols)))
        names = " = ".join([matrix.param] + matrix.tied)
        logger.info(f"coupled_adam: the {rows} rows of {names} ({rows} x {cols}) share one second moment "
                    f"per dimension, scale {scale:g}")
    return coupled


def undecayed_tensors(model, located, coupled):
    """[(optimizer tensor, CoupledBlock)] that weight decay skips in the authors' setting: the
    ``coupled`` matrices and the ``model``'s 1-D parameters (biases, layer-norm gains and biases)."""
    one_dimensional = [p for p in model.parameters() if p.requires_grad and p.dim() < 2 and p in located]
    blocks = [(located[p][0], CoupledBlock(located[p][1], p.numel(), 1)) for p in one_dimensional]
    logger.info(f"coupled_adam: weight decay skips the coupled matrices and {len(one_dimensional)} 1-D "
                "parameters (--coupled-adam-decay non-embedding-matrices)")
    return list(coupled) + blocks
