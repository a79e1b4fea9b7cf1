"""The steps that the benchmarks (benchmarks/variants.py names them for the criterion benchmark and the
GPU check) time on the output-layer problem (output_layer_problem.py): one forward and backward pass of the
package's fused function for CE, AGG, the augmented loss and the remedies of docs/baselines.md, on
any of its kernels, and of the reference constructions it is checked against. The stock criteria,
PyTorch's op and the three-matmul floor are output_layer_problem.py's ``stock_loss``,
``torch_linear_ce`` and ``matmul_floor``.

A step is ``step(p, chunk, kernel[, eps])`` on a :class:`StepProblem`: ``chunk`` and ``kernel`` as
in ``LossRequest``, ``eps`` the label smoothing where the variant takes one. It returns the loss
without its graph and leaves H.grad and W.grad behind. What a criterion does per micro-batch
(AGG's histogram and gates, the teacher, UL's candidates, FACE's counts) happens inside the step,
so inside the timed region. benchmarks/variants.py holds the one table of variant names over these
steps, and at which smoothing each runs.

The benchmarks import it as ``tests.support.output_layer_steps`` (output_layer_problem.py says why).
"""
import torch
import torch.nn.functional as F

from fairseq import utils as fairseq_utils

from fairseq_agg.ops.augmented import build_teacher
from fairseq_agg.ops.cosreg import cosine_regularizer
from fairseq_agg.ops.counting import target_histogram
from fairseq_agg.ops.face import FaceWeights, face_token_weights
from fairseq_agg.ops.freezing import FrozenRows, frozen_rare_rows
from fairseq_agg.ops.fused_linear_loss import LossRequest, fused_linear_loss
from fairseq_agg.ops.unlikelihood import unlikelihood_candidates

from tests.support.output_layer_problem import PAD, OutputProblem
from tests.support.reference_constructions import kl_to_teacher, reference_output_loss, reference_teacher


class StepProblem(OutputProblem):
    """An :class:`OutputProblem` with the settings of the steps: the label smoothing of the
    smoothed variants (``eps``), the augmented loss's temperature and coefficient (alpha times its
    scale factor), the sequence length UL cuts the tokens into, and the rows CosReg regularises
    (every one but padding, made here so that no step pays for it)."""

    def __init__(self, tokens, dim, vocab, eps=0.0, aug_tau=10.0, aug_coef=0.0, ul_seq_len=512, **problem):
        super().__init__(tokens, dim, vocab, **problem)
        self.eps, self.aug_tau, self.aug_coef, self.ul_seq_len = eps, aug_tau, aug_coef, ul_seq_len
        self.cosreg_rows = torch.cat([torch.arange(PAD), torch.arange(PAD + 1, vocab)]).to(self.device)


def backward(loss):
    """Every step's end: the backward pass, then the loss without its graph."""
    loss.backward()
    return loss.detach()


def fused(p: StepProblem, request: LossRequest):
    """The package's fused output layer on the problem under ``request``, forward and backward."""
    return backward(fused_linear_loss(p.hidden, p.weight, p.target, request).loss)


# --------------------------------------------------------------------------- the package's fused function
def fused_ce(p, chunk, kernel, eps=0.0):
    """Cross-entropy, label-smoothed at ``eps``."""
    return fused(p, LossRequest(eps, chunk_size=chunk, kernel=kernel))


def fused_agg(p, chunk, kernel, eps=0.0):
    """AGG: the window's histogram and the gates, then the gated layer."""
    return fused(p, LossRequest(eps, terms=(p.gates(),), chunk_size=chunk, kernel=kernel))


def fused_al(p, chunk, kernel, eps=0.0):
    """The augmented loss: the per-type teacher (``build_teacher``), then the layer with it."""
    teacher = build_teacher(p.weight.detach(), p.target, p.aug_tau, p.aug_coef, masked_columns=[PAD])
    return fused(p, LossRequest(eps, terms=(teacher,), chunk_size=chunk, kernel=kernel))


def fused_freeze(p, chunk, kernel):
    """Rare-token freezing: CE with AGG's rare rows of dW zeroed."""
    frozen = frozen_rare_rows(p.vocab, gates=p.gates())
    return fused(p, LossRequest(terms=(FrozenRows(frozen),), chunk_size=chunk, kernel=kernel))


def fused_cosreg(p, chunk, kernel):
    """CE + N * CosReg(W) over the non-pad rows (gamma = 1, sample_size = N)."""
    loss = fused_linear_loss(p.hidden, p.weight, p.target, LossRequest(chunk_size=chunk, kernel=kernel)).loss
    regulariser, _ = cosine_regularizer(p.weight, p.cosreg_rows)
    return backward(loss + p.target.numel() * regulariser)


def fused_face(p, chunk, kernel):
    """FACE pre-weighting from the window counts, the argmax recorded in the pass and counted."""
    face = FaceWeights(token_weight=face_token_weights(p.window_counts.to(p.device)))
    request = LossRequest(terms=(face,), chunk_size=chunk, record_argmax=True, kernel=kernel)
    result = fused_linear_loss(p.hidden, p.weight, p.target, request)
    target_histogram(result.argmax, p.vocab)  # the counts of the next micro-batch
    return backward(result.loss)


def fused_ul(p, chunk, kernel):
    """Token-level unlikelihood (alpha = 1): the tokens as sequences of ``p.ul_seq_len``, their
    candidates built, then the layer with the penalty."""
    n = p.target.numel()
    width = p.ul_seq_len
    sequences = p.target.new_full((-(-n // width) * width,), PAD)
    sequences[:n] = p.target
    candidates = unlikelihood_candidates(sequences.view(-1, width), torch.arange(n, device=p.device), PAD, 1.0)
    return fused(p, LossRequest(terms=(candidates,), chunk_size=chunk, kernel=kernel))


# --------------------------------------------------------------------------- the reference constructions
def reference_agg(p, eps=0.0):
    """AGG by the three-CE construction of the released code (``reference_output_loss``)."""
    loss, _nll, _ = reference_output_loss(p.hidden, p.weight, p.target, eps, gates=p.gates())
    return backward(loss)


def reference_al(p):
    """The augmented loss by its definition: stock CE + coef * KL to a materialised N x V teacher."""
    teacher = reference_teacher(p.weight.detach(), p.target, p.aug_tau, masked_columns=[PAD])
    logits = F.linear(p.hidden, p.weight)
    lprobs = fairseq_utils.log_softmax(logits, dim=-1)
    loss = F.nll_loss(lprobs, p.target, ignore_index=PAD, reduction="sum")
    return backward(loss + p.aug_coef * kl_to_teacher(logits, teacher, p.aug_tau))
