"""The output-layer problem that the benchmark (scripts/bench_criterion.py) and the GPU check
(scripts/gpu_check.py) measure and the tests check against: Zipfian targets, AGG window counts,
the leaves H and W, fairseq's stock criteria on them, the anchors outside this package (PyTorch's
``F.linear_cross_entropy``, the three-matmul floor), and the constants and timing helpers of the
measurements. The variants' steps on it are in output_layer_steps.py.

Why this code lives in tests/support/ and not in the package: the installed wheel holds only what
a user runs, so what the commands of scripts/ share with each other and with the tests (this
module, output_layer_steps.py, reference_constructions.py, synthetic_text.py, training_runs.py)
stays in the checkout, once each. The commands, run from the repository root as ``python -m
scripts.X``, import these modules as ``tests.support.X`` (tests/ and tests/support/ are namespace
packages), and so do these modules among themselves; the tests import them by their bare names
through pytest's ``pythonpath`` (pyproject.toml), run from the root too (scripts/run_tests.sh).
"""
import time

import torch
import torch.nn.functional as F

from fairseq import utils as fairseq_utils
from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss

from fairseq_agg.ops.agg import agg_gates
from fairseq_agg.ops.counting import target_histogram
from fairseq_agg.ops.foreign_kernels import torch_smoothing

PAD, NSPECIAL = 1, 4  # fairseq's Dictionary: <s>=0, <pad>=1, </s>=2, <unk>=3
MIB = float(1 << 20)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def zipf_unigram(vocab: int, exponent: float = 1.1) -> torch.Tensor:
    """Target distribution over the real-word ids (specials get no mass), ids sorted by frequency
    as in a fairseq dictionary."""
    ranks = torch.arange(1, vocab - NSPECIAL + 1, dtype=torch.float64)
    p = ranks.pow(-exponent)
    return torch.cat([torch.zeros(NSPECIAL, dtype=torch.float64), p / p.sum()])


class OutputProblem:
    """H (tokens x dim) and W (vocab x dim) leaves, Zipfian targets and the AGG window counts of
    ``window_updates`` earlier updates of ``tokens_per_update`` tokens (default: ``tokens``)."""

    def __init__(self, tokens, dim, vocab, dtype=torch.float32, device="cpu", seed=0, zipf=1.1,
                 window_updates=100, tokens_per_update=None, agg_alpha=0.08):
        self.tokens, self.dim, self.vocab = tokens, dim, vocab
        self.device, self.dtype = torch.device(device), dtype
        self.window_updates, self.agg_alpha = window_updates, agg_alpha
        g = torch.Generator().manual_seed(seed)
        unigram = zipf_unigram(vocab, zipf)
        window = torch.poisson(unigram * (window_updates * (tokens_per_update or tokens)), generator=g)
        self.window_counts = window.to(self.device, torch.int64)
        self.target = torch.multinomial(unigram.float(), tokens, replacement=True, generator=g).to(self.device)
        # fairseq's init of embeddings / output projections: N(0, d^-1/2); features ~ layer-normed.
        self.weight = (torch.randn(vocab, dim, generator=g) * dim**-0.5).to(self.device, dtype).requires_grad_(True)
        self.hidden = torch.randn(tokens, dim, generator=g).to(self.device, dtype).requires_grad_(True)

    def clear_grads(self):
        self.hidden.grad = None
        self.weight.grad = None

    def gates(self):
        """What the AGG criterion does per micro-batch: histogram into the window, then the gates."""
        counts = self.window_counts + target_histogram(self.target, self.vocab)
        return agg_gates(counts, self.window_updates + 1, self.agg_alpha, NSPECIAL)

    def target_stats(self):
        """How rare the targets are under the gates, and how many distinct ones there are."""
        gates = self.gates()
        rare_target = gates.rare[self.target]
        return {
            "rare_types": int(gates.rare.sum()),
            "rare_type_frac": float(gates.rare.double().mean()),
            "rare_target_frac": float(rare_target.double().mean()),
            "very_rare_target_frac": float((rare_target & (gates.g2[self.target] < 1)).double().mean()),
            "unique_targets": int(torch.unique(self.target).numel()),
        }


def stock_loss(p: OutputProblem, label_smoothing=None):
    """fairseq's stock criteria on materialised logits, forward and backward: the decoder's
    ``F.linear`` output layer, ``get_normalized_probs`` (utils.log_softmax in fp32), then
    ``cross_entropy``'s nll_loss (``label_smoothing`` None) or ``label_smoothed_nll_loss``."""
    lprobs = fairseq_utils.log_softmax(F.linear(p.hidden, p.weight), dim=-1)
    if label_smoothing is None:
        loss = F.nll_loss(lprobs, p.target, ignore_index=PAD, reduction="sum")
    else:
        loss, _ = label_smoothed_nll_loss(lprobs, p.target, label_smoothing, ignore_index=PAD, reduce=True)
    loss.backward()
    return loss.detach()


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (a scalar: |a - b| / |b|), in float64."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def synchronize(device):
    """Waits for the device's queued work, so that a clock read afterwards includes it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def wall_seconds(fn, device):
    """Wall-clock seconds of ``fn()``, the device's queued work finished before and after."""
    synchronize(device)
    started = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - started


def cuda_peak_bytes(fn):
    """Peak CUDA bytes allocated while ``fn()`` runs, above the allocation at its start (what it
    leaves behind, such as gradients, included)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


# --------------------------------------------------------------------------- anchors outside the package
def torch_label_smoothing(epsilon: float, vocab: int) -> float:
    """fairseq's label smoothing ``epsilon`` in PyTorch's convention. fairseq gives the target
    1 - eps and every other class eps / (V - 1) (``label_smoothed_nll_loss``); PyTorch mixes in the
    uniform distribution, eps' / V on every class, the target included. The same target
    distribution, and so the same loss and gradients, has eps' = eps V / (V - 1) (the package's
    own conversion for its foreign kernels)."""
    return torch_smoothing(epsilon, vocab)


def torch_linear_ce_missing():
    """Why this torch has no ``F.linear_cross_entropy`` with chunking options, or None."""
    if not hasattr(F, "linear_cross_entropy") or not hasattr(torch.nn, "LinearCrossEntropyOptions"):
        return f"torch {torch.__version__} has no F.linear_cross_entropy / nn.LinearCrossEntropyOptions"
    return None


def torch_chunking_options(chunking):
    """``options`` of ``F.linear_cross_entropy``: None (its reference path, the logits materialised),
    ``"auto"`` (its chunked path, the chunk size it picks) or a ``batch_chunk_size``."""
    if chunking is None:
        return None
    if chunking == "auto":
        return torch.nn.LinearCrossEntropyOptions()
    return torch.nn.LinearCrossEntropyOptions(batch_chunk_size=int(chunking))


def torch_auto_chunk(p: "OutputProblem"):
    """The chunk size (rows) and accumulation policy that torch's ``"auto"`` picks for this problem,
    or None where it cannot be read (``_adjust`` is torch's internal resolution of its options)."""
    try:
        options = torch.nn.LinearCrossEntropyOptions()._adjust(p.tokens, p.dim, p.vocab, p.dtype, p.device)
        return options.batch_chunk_size, options.acc_policy
    except Exception:
        return None


def torch_linear_ce(p: "OutputProblem", label_smoothing: float = 0.0, chunking=None):
    """PyTorch's own linear + cross-entropy op, ``F.linear_cross_entropy``, forward and backward,
    summed over the tokens like fairseq's criteria; ``label_smoothing`` in fairseq's convention
    (converted by :func:`torch_label_smoothing`), ``chunking`` as in :func:`torch_chunking_options`.
    Its chunked path takes no label smoothing (torch 2.13 falls back to the reference path, with a
    warning), so that combination is refused here rather than measured under a wrong name."""
    if chunking is not None and label_smoothing > 0:
        raise ValueError("F.linear_cross_entropy's chunked path takes no label smoothing")
    loss = F.linear_cross_entropy(p.hidden, p.weight, p.target, reduction="sum", ignore_index=PAD,
                                  label_smoothing=torch_label_smoothing(label_smoothing, p.vocab),
                                  options=torch_chunking_options(chunking))
    loss.backward()
    return loss.detach()


def matmul_floor(p: "OutputProblem", chunk: int):
    """The work every linear cross-entropy does and nothing else: its three matmuls, logits
    Z = H W^T, dH = G W and dW += G^T H (G = Z here), chunk by chunk over the tokens into reused
    buffers in the model dtype. A lower bound of the fused variants' time; like them it leaves
    H.grad and W.grad behind, and returns a zero loss."""
    hidden, weight = p.hidden.detach(), p.weight.detach()
    n_rows = hidden.size(0)
    grad_hidden = torch.empty_like(hidden)
    grad_weight = torch.zeros_like(weight)
    logits = torch.empty((min(chunk, n_rows), weight.size(0)), dtype=hidden.dtype, device=hidden.device)
    for start in range(0, n_rows, chunk):
        h = hidden[start : start + chunk]
        z = logits[: h.size(0)]
        torch.mm(h, weight.t(), out=z)
        torch.mm(z, weight, out=grad_hidden[start : start + chunk])
        grad_weight.addmm_(z.t(), h)
    p.hidden.grad, p.weight.grad = grad_hidden, grad_weight
    return logits.new_zeros(())
