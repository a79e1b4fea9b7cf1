"""The pure-torch core's contract (fairseq_agg.ops; no fairseq used here):

* every method object validates its own arguments at construction: one-line UsageErrors naming
  the matching fairseq flag and its range, nan and inf refused, dependent arguments named together;
* the counting window's size has an upper bound derived from what it allocates;
* the fused output layer's per-token losses (``LossRequest(per_token=True)``, fairseq's
  ``reduce=False``): their sum is the summed loss, and their gradient for any per-token weights
  is the weighted sum of the single tokens' gradients (gates, teacher, FACE weights and the UL
  penalty included); the non-detached augmented KL per token against a materialised reference.
"""
import math
from dataclasses import replace

import pytest
import torch

from fairseq_agg.errors import UsageError
from fairseq_agg.ops import (
    AggLoss, AugmentedLoss, CosRegLoss, CumulativeCounts, FaceLoss, FaceWeights, FrozenRows, LossRequest, RareFreezing,
    RareTokenWindow, TokenGates, UnlikelihoodLoss, agg_gates, augmented_kl_direct, build_teacher,
    face_token_weights, fused_linear_loss, unlikelihood_candidates,
)
from fairseq_agg.ops.counting import MAX_WINDOW_BYTES, max_window

torch.set_num_threads(2)
V = 37


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: AggLoss(V, alpha=0.0), r"^--agg-alpha must be in \(0, 1\] with --agg-g1-mode code"),
        (lambda: AggLoss(V, alpha=math.nan), r"^--agg-alpha must be in \(0, 1\]"),
        (lambda: AggLoss(V, alpha=1.5), r"^--agg-alpha must be in \(0, 1\]"),
        (lambda: AggLoss(V, alpha=math.inf, g1_mode="normalized"), r"^--agg-alpha must be a finite number > 0"),
        (lambda: AggLoss(V, g1_mode="paper"), r"^--agg-g1-mode must be one of code, normalized, got 'paper'"),
        (lambda: AggLoss(V, threshold_mode="auto"), r"^--agg-threshold-mode must be one of relative, per-update"),
        (lambda: AggLoss(V, window=0), r"^--agg-window must be >= 1, got 0"),
        (lambda: AggLoss(V, window=2.5), r"^--agg-window must be an integer >= 1, got 2.5"),
        (lambda: AggLoss(V, ref_tokens=0), r"^--agg-ref-tokens must be >= 1, got 0"),
        (lambda: AggLoss(V, threshold_mode="per-update", ref_tokens=512),
         r"^--agg-ref-tokens needs --agg-threshold-mode relative"),
        (lambda: RareFreezing(V, until_update=-1), r"^--agg-freeze-until-update must be >= 0, got -1"),
        (lambda: RareFreezing(V, rare_set="group"), r"^--agg-freeze-set group needs the group's ids"),
        (lambda: RareFreezing(V, rare_set="all"), r"^--agg-freeze-set must be one of window, group"),
        (lambda: AugmentedLoss(alpha=-0.1), r"^--aug-alpha must be >= 0, got -0.1"),
        (lambda: AugmentedLoss(alpha=math.inf), r"^--aug-alpha must be >= 0, got inf"),
        (lambda: AugmentedLoss(temperature=0.0), r"^--aug-temperature must be > 0, got 0.0"),
        (lambda: AugmentedLoss(temperature=math.nan), r"^--aug-temperature must be > 0, got nan"),
        (lambda: AugmentedLoss(scale="cube"), r"^--aug-scale must be one of none, tau, tau2"),
        (lambda: AugmentedLoss(warmup_updates=-3), r"^--aug-warmup-updates must be >= 0, got -3"),
        (lambda: AugmentedLoss(alpha=0.0, gate_with_agg=True), r"^--aug-gate-with-agg needs --aug-alpha > 0"),
        (lambda: AugmentedLoss(gate_with_agg=True, detach_teacher=False),
         r"^--aug-gate-with-agg cannot be combined with --no-aug-detach-target"),
        (lambda: FaceLoss(V, window=4), r"^--face-window needs --face-counting window"),
        (lambda: FaceLoss(V, counting="window", window=0), r"^--face-window must be >= 1, got 0"),
        (lambda: FaceLoss(V, weighing="mid"), r"^--face-weighing must be one of pre, post"),
        (lambda: FaceLoss(V, counting="decayed"), r"^--face-counting must be one of cumulative, window"),
        (lambda: UnlikelihoodLoss(alpha=math.nan), r"^--ul-alpha must be >= 0, got nan"),
        (lambda: UnlikelihoodLoss(clamp=1.0), r"^--ul-clamp must be in \(0, 1\), got 1.0"),
        (lambda: CosRegLoss(gamma=-1.0), r"^--cosreg-gamma must be >= 0, got -1.0"),
        (lambda: CosRegLoss(normalizer="mean"), r"^--cosreg-normalizer must be one of paper, pairs"),
        (lambda: LossRequest(label_smoothing=1.0), r"^--label-smoothing must be in \[0, 1\), got 1.0"),
        (lambda: LossRequest(chunk_size=0), r"^--output-chunk-tokens must be >= 1, got 0"),
    ],
)
def test_each_method_object_refuses_bad_arguments_in_one_line(build, message):
    with pytest.raises(UsageError, match=message) as err:
        build()
    assert "\n" not in str(err.value)


def test_the_window_bound_is_what_the_ring_allocates():
    vocab = 50000
    bound = max_window(vocab)
    assert bound == MAX_WINDOW_BYTES // vocab  # one-byte counts, window x V
    assert AggLoss(vocab, window=bound).counter.window == bound  # allocated lazily by torch.zeros: cheap here
    with pytest.raises(UsageError, match=rf"^--agg-window must be <= {bound}, got {bound + 1}: a window of K updates"):
        AggLoss(vocab, window=bound + 1)
    with pytest.raises(UsageError, match=rf"^--face-window must be <= {bound}"):
        FaceLoss(vocab, counting="window", window=bound + 1)
    window = RareTokenWindow(vocab)
    with pytest.raises(UsageError, match="--agg-window must be <="):  # an epoch-sized window as well
        window.set_window(bound + 1)
    assert window.nbytes == 2 * 8 * vocab and RareTokenWindow(vocab, 10).nbytes == 10 * vocab + 2 * 8 * vocab


def test_defaults_and_counting_without_fairseq():
    agg = AggLoss(V, alpha=0.5, window=3, threshold_mode="per-update")
    assert agg.ref_tokens is None and AggLoss(V).ref_tokens == 32768
    with pytest.raises(UsageError, match="--agg-window is 0"):
        AggLoss(V).start_update(0)  # a window without a size cannot count
    targets = [torch.tensor([5, 5, 6, 9]), torch.tensor([5, 7]), torch.tensor([9, 9, 9])]
    for update_num, target in enumerate(targets):
        gates = agg.step(target, update_num)
    want = agg_gates(sum(torch.bincount(t, minlength=V) for t in targets), 3, 0.5, 4, threshold_mode="per-update")
    assert torch.equal(gates.rare, want.rare) and torch.equal(gates.g1, want.g1) and torch.equal(gates.g2, want.g2)
    face = FaceLoss(V)  # the released code's estimate: counts over the whole run
    assert face.counting == "cumulative" and isinstance(face.counter, CumulativeCounts)


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def problem(n=11, dim=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, dim, generator=g, dtype=torch.float64)
    weight = torch.randn(V, dim, generator=g, dtype=torch.float64)
    padded = torch.randint(4, 14, (2, 8), generator=g)  # few distinct ids: UL has candidates
    padded[1, 8 - (16 - n):] = 1  # padding at the end of the second sequence
    keep = padded.reshape(-1).ne(1).nonzero().squeeze(1)
    assert keep.numel() == n
    return hidden, weight, padded, keep


def gates_of(seed):
    g = torch.Generator().manual_seed(seed)
    rare = torch.rand(V, generator=g) < 0.5
    rare[:4] = False
    return TokenGates(g1=torch.where(rare, torch.rand(V, generator=g), torch.ones(V)),
                      g2=torch.where(rare, torch.rand(V, generator=g), torch.ones(V)), rare=rare)


def requests_for(padded, keep, target, rows):
    """Every term of the fused layer, for the token positions ``rows``."""
    counts = torch.randint(0, 20, (V,), generator=torch.Generator().manual_seed(3))
    candidates = unlikelihood_candidates(padded, keep, 1, alpha=0.7)
    candidates = replace(candidates, sequence=candidates.sequence[rows], position=candidates.position[rows])
    embedding = torch.randn(V, 5, generator=torch.Generator().manual_seed(4), dtype=torch.float64)

    def teacher(gate_with_agg):
        return build_teacher(embedding, target[rows], 2.0, 0.8, masked_columns=[1], gate_with_agg=gate_with_agg)

    return {
        "agg+al": LossRequest(0.1, terms=(gates_of(1), teacher(False)), chunk_size=3),
        "agg+al-gated": LossRequest(0.0, terms=(gates_of(2), teacher(True)), chunk_size=4),
        "face-pre": LossRequest(0.1, terms=(FaceWeights(token_weight=face_token_weights(counts).double()),)),
        "face-post": LossRequest(0.0, terms=(FaceWeights(counts=counts),), chunk_size=2),
        "ul+freeze": LossRequest(0.1, terms=(candidates, FrozenRows(gates_of(3).rare)), chunk_size=5),
    }


@pytest.mark.parametrize("case", ["agg+al", "agg+al-gated", "face-pre", "face-post", "ul+freeze"])
def test_per_token_losses_sum_to_the_loss_and_weight_each_tokens_gradient(case):
    hidden, weight, padded, keep = problem()
    target = padded.reshape(-1)[keep]
    n = target.numel()
    everything = torch.arange(n)
    summed = fused_linear_loss(hidden, weight, target, requests_for(padded, keep, target, everything)[case])
    request = requests_for(padded, keep, target, everything)[case]
    request.per_token = True
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    per_token = fused_linear_loss(h, w, target, request)
    assert per_token.loss.shape == per_token.nll.shape == (n,)
    assert rel_err(per_token.loss.sum(), summed.loss) <= 1e-12 and rel_err(per_token.nll.sum(), summed.nll) <= 1e-12
    assert ("augmented" in per_token.terms) == ("al" in case)
    assert per_token.terms.keys() == summed.terms.keys()
    for term, values in summed.terms.items():
        for name, value in values.items():
            assert rel_err(per_token.terms[term][name], value) <= 1e-12, (term, name)

    token_weights = torch.linspace(-1.0, 2.0, n, dtype=torch.float64)
    (token_weights * per_token.loss).sum().backward()
    want_h, want_w = torch.zeros_like(hidden), torch.zeros_like(weight)
    for row in range(n):  # each token alone, through the summed path, weighted
        rows = torch.tensor([row])
        hr, wr = hidden[rows].clone().requires_grad_(), weight.clone().requires_grad_()
        alone = fused_linear_loss(hr, wr, target[rows], requests_for(padded, keep, target, rows)[case])
        assert rel_err(alone.loss, per_token.loss[row]) <= 1e-12
        alone.loss.backward()
        want_h[row] = token_weights[row] * hr.grad[0]
        want_w += token_weights[row] * wr.grad
    assert rel_err(h.grad, want_h) <= 1e-10 and rel_err(w.grad, want_w) <= 1e-10


def test_per_token_direct_kl_against_a_materialised_reference():
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(9, 4, generator=g, dtype=torch.float64, requires_grad=True)
    embedding = torch.randn(V, 4, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.randint(4, V, (9,), generator=g)
    tau, weights = 1.5, torch.linspace(0.5, -1.0, 9, dtype=torch.float64)
    kl = augmented_kl_direct(hidden, embedding, embedding, target, tau, masked_columns=[1], chunk_size=4,
                             per_token=True)
    (weights * kl).sum().backward()
    got = hidden.grad.clone(), embedding.grad.clone()
    hidden.grad, embedding.grad = None, None
    s = (embedding[target] @ embedding.t()) / tau
    log_p = torch.log_softmax(s.index_fill(1, torch.tensor([1]), float("-inf")), -1)
    log_q = torch.log_softmax(hidden @ embedding.t() / tau, -1)
    p = log_p.exp()
    want = (p * torch.where(p > 0, log_p - log_q, torch.zeros_like(p))).sum(-1)
    assert rel_err(kl, want) <= 1e-12
    assert rel_err(augmented_kl_direct(hidden, embedding, embedding, target, tau, [1]), want.sum()) <= 1e-12
    (weights * want).sum().backward()
    assert rel_err(got[0], hidden.grad) <= 1e-10 and rel_err(got[1], embedding.grad) <= 1e-10


def test_per_token_losses_of_the_method_objects():
    """The objects pass ``per_token`` through: the augmented loss's non-detached KL is added per token."""
    hidden, weight, padded, keep = problem(seed=2)
    target = padded.reshape(-1)[keep]
    al = AugmentedLoss(alpha=0.5, temperature=2.0, detach_teacher=False)
    summed = al(hidden, weight, weight, target)
    per_token = al(hidden, weight, weight, target, request=LossRequest(per_token=True))
    assert per_token.loss.shape == (target.numel(),)
    kl, summed_kl = per_token.terms["augmented"]["kl"], summed.terms["augmented"]["kl"]
    assert rel_err(per_token.loss.sum(), summed.loss) <= 1e-12 and rel_err(kl, summed_kl) <= 1e-12
    ul = UnlikelihoodLoss(alpha=0.7)
    assert rel_err(ul(hidden, weight, padded, keep, LossRequest(per_token=True)).loss.sum(),
                   ul(hidden, weight, padded, keep).loss) <= 1e-12
