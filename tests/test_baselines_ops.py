"""The degeneration baselines' math (docs/baselines.md): CosReg, FACE, token-level UL, rare freezing.

* each method's own functions against hand-computed values and a direct construction from the
  paper's formula (tests/support/reference_constructions.py), float64 gradcheck;
* the fused, chunked output layer with each method against the direct reference on materialised
  logits: loss, dL/dH and dL/dW, fp32, <= 1e-6 relative, with padding, tied and untied, several
  chunk sizes, label smoothing 0 and 0.1.
"""
import math

import pytest
import torch

from fairseq_agg.ops.cosreg import cosine_regularizer
from fairseq_agg.ops.counting import CumulativeCounts
from fairseq_agg.ops.face import FaceWeights, counted_ids, face_post_weights, face_token_weights
from fairseq_agg.ops.freezing import FrozenRows
from fairseq_agg.ops.fused_linear_loss import LossRequest, fused_linear_loss
from fairseq_agg.ops.output_chunk import Tile
from fairseq_agg.ops.unlikelihood import UnlikelihoodCandidates, first_occurrences, unlikelihood_candidates
from reference_constructions import (
    frozen_rows,
    reference_candidate_sets,
    reference_cosreg,
    reference_face_loss,
    reference_face_weights,
    reference_unlikelihood_loss,
    smoothed_nll,
)

torch.set_num_threads(2)
PAD = 1


def rel_err(a, b):
    """max |a - b| / max |b|."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


# ------------------------------------------------------------------------------------------ CosReg


def test_cosreg_hand_cases():
    orthogonal = torch.tensor([[2.0, 0.0], [0.0, 3.0]], dtype=torch.float64, requires_grad=True)
    value, n = cosine_regularizer(orthogonal)
    assert value.item() == 0.0 and n.item() == 2
    value.backward()
    # dR/dw_1 = (2 / N^2) (s - (w^_1.s) w^_1) / ||w_1|| = (1/2) w^_2 / 2
    assert torch.allclose(orthogonal.grad[0], torch.tensor([0.0, 0.25], dtype=torch.float64))

    antipodal = torch.tensor([[1.0, 1.0], [-2.0, -2.0]])
    assert cosine_regularizer(antipodal)[0].item() == pytest.approx(-0.5)
    identical = torch.tensor([[0.3, -0.4, 1.0]]).repeat(5, 1)
    assert cosine_regularizer(identical)[0].item() == pytest.approx(4 / 5, rel=1e-6)
    assert cosine_regularizer(identical, normalizer="pairs")[0].item() == pytest.approx(1.0, rel=1e-6)


def random_matrix(v=23, d=7, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(v, d, generator=g, dtype=dtype) + 0.7  # a common direction: R well above 0
    w[PAD] = 0.0  # fairseq's zero padding row
    return w


@pytest.mark.parametrize("normalizer", ["paper", "pairs"])
@pytest.mark.parametrize("with_rows", [False, True])
def test_cosreg_value_and_gradient_against_the_explicit_pair_sum(normalizer, with_rows):
    base = random_matrix()
    rows = torch.tensor([0, 1, 2, 5, 6, 7, 11, 12, 20, 22]) if with_rows else None
    w = base.clone().requires_grad_()
    value, n = cosine_regularizer(w, rows, normalizer, block_rows=4)
    value.backward()
    w_ref = base.clone().requires_grad_()
    want = reference_cosreg(w_ref, rows, normalizer)
    want.backward()
    assert n.item() == (9 if with_rows else 22)  # the zero padding row is left out
    assert rel_err(value, want) < 1e-12
    assert rel_err(w.grad, w_ref.grad) < 1e-12
    assert torch.all(w.grad[PAD] == 0)
    if with_rows:
        outside = torch.ones(23, dtype=torch.bool)
        outside[rows] = False
        assert torch.all(w.grad[outside] == 0)


def test_cosreg_gradcheck_and_scale_invariance():
    w = random_matrix(v=9, d=4, seed=3)
    w[PAD] = 0.5  # no zero row: R is not differentiable where a row leaves zero
    w.requires_grad_()
    assert torch.autograd.gradcheck(lambda m: cosine_regularizer(m, block_rows=4)[0], (w,))
    scaled = w.detach().clone()
    scaled[4] *= 7.5
    assert cosine_regularizer(scaled)[0].item() == pytest.approx(cosine_regularizer(w)[0].item(), rel=1e-12)
    # the gradient of each row is orthogonal to the row (R depends on directions only)
    value, _ = cosine_regularizer(w)
    (grad,) = torch.autograd.grad(value, w)
    assert torch.allclose((grad * w).sum(1), torch.zeros(9, dtype=torch.float64), atol=1e-15)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cosreg_low_precision_weights_give_fp32(dtype):
    w = random_matrix(dtype=torch.float32).to(dtype).requires_grad_()
    value, _ = cosine_regularizer(w)
    assert value.dtype == torch.float32
    assert value.item() == pytest.approx(reference_cosreg(w.detach().float()).item(), rel=1e-5)
    value.backward()
    assert w.grad.dtype == dtype and torch.isfinite(w.grad.float()).all()


# -------------------------------------------------------------------------------------------- FACE


def test_face_pre_weights_closed_form_and_hand_vector():
    counts = torch.tensor([0, 10, 3, 0, 50, 7, 0, 30])
    w = face_token_weights(counts)
    want = [4 / 3, 16 / 15, 1.2533333, 4 / 3, 0.0, 1.1466667, 4 / 3, 8 / 15]
    assert w.tolist() == pytest.approx(want, rel=1e-6)
    assert w.mean().item() == pytest.approx(1.0, rel=1e-6)
    assert w[4].item() == 0.0  # the most counted token's loss is dropped
    assert torch.allclose(w.double(), reference_face_weights(counts, torch.arange(8), None, "pre").double(), rtol=1e-6)
    assert torch.equal(face_token_weights(torch.zeros(8, dtype=torch.long)), torch.ones(8))


def test_face_post_weights_against_the_definition():
    g = torch.Generator().manual_seed(1)
    counts = torch.randint(0, 40, (30,), generator=g)
    target = torch.randint(0, 30, (50,), generator=g)
    logits = torch.randn(50, 30, generator=g)
    got = face_post_weights(counts, target, logits.argmax(1))
    assert torch.allclose(got.double(), reference_face_weights(counts, target, logits, "post").double(), rtol=1e-6)
    assert (got >= 1).all() and (got > 1).any()
    assert torch.equal(face_post_weights(torch.zeros(30), target, logits.argmax(1)), torch.ones(50))


def test_face_counting_rules():
    ids = torch.tensor([5, 2, 7, 2, 5])
    assert counted_ids(ids, 2).tolist() == [5, 7, 5]  # eos (2) is never counted by default
    assert counted_ids(ids, None).tolist() == [5, 2, 7, 2, 5]
    counts = CumulativeCounts(9)
    counts.start_update(1)
    counts.add(torch.bincount(ids, minlength=9))
    counts.start_update(2)  # no decay
    counts.add(torch.bincount(ids, minlength=9))
    assert counts.counts.tolist() == [0, 0, 4, 0, 0, 4, 0, 2, 0]
    restored = CumulativeCounts(9)
    restored.load_state_dict(counts.state_dict())
    assert torch.equal(restored.counts, counts.counts)


# ---------------------------------------------------------------------------------------------- UL


def candidate_sets_of(cands: UnlikelihoodCandidates, target_flat):
    out = []
    ids, valid = cands.block_candidates(slice(0, target_flat.numel()), target_flat)
    for row_ids, row_valid in zip(ids.tolist(), valid.tolist()):
        kept = [c for c, v in zip(row_ids, row_valid) if v]
        assert len(kept) == len(set(kept)), "candidates must be distinct"
        out.append(set(kept))
    return out


def test_ul_candidates_hand_written_batch():
    # repeats (5, 7 twice; 6 after itself), padding at the end of a row and the target excluded
    target = torch.tensor([
        [5, 7, 5, 9, 7, 7, 4],
        [8, 5, 6, 6, 5, PAD, PAD],
        [PAD, 3, 3, 8, PAD, PAD, PAD],
    ])
    assert first_occurrences(target, PAD).tolist() == [
        [5, 7, -1, 9, -1, -1, 4],
        [8, 5, 6, -1, -1, -1, -1],
        [-1, 3, -1, 8, -1, -1, -1],
    ]
    keep = target.reshape(-1).ne(PAD).nonzero().squeeze(1)
    cands = unlikelihood_candidates(target, keep, PAD)
    got = candidate_sets_of(cands, target.reshape(-1)[keep])
    want = [
        set(), {5}, {7}, {5, 7}, {5, 9}, {5, 9}, {5, 7, 9},  # the example of docs/baselines.md
        set(), {8}, {8, 5}, {8, 5}, {8, 6},  # a target seen before is still excluded
        set(), set(), {3},  # a padding slot before a row's tokens adds nothing
    ]
    assert got == want
    reference = [s for row in reference_candidate_sets(target, PAD) for s in row if s is not None]
    assert got == reference


def test_ul_candidates_of_a_random_batch_match_the_definition():
    g = torch.Generator().manual_seed(5)
    target = torch.randint(2, 9, (4, 13), generator=g)  # small vocabulary: many repeats
    target[1, 9:] = PAD
    target[3, 4:] = PAD
    keep = target.reshape(-1).ne(PAD).nonzero().squeeze(1)
    cands = unlikelihood_candidates(target, keep, PAD)
    reference = [s for row in reference_candidate_sets(target, PAD) for s in row if s is not None]
    assert candidate_sets_of(cands, target.reshape(-1)[keep]) == reference
    # the same from any block of rows
    flat = target.reshape(-1)[keep]
    ids, valid = cands.block_candidates(slice(7, 20), flat[7:20])
    assert [set(i[v].tolist()) for i, v in zip(ids, valid)] == reference[7:20]


def ul_terms_of(logits, candidates, alpha=1.0, clamp=1e-5):
    """The UL tile term for one row of logits with the given candidate set: value, the dense
    gradient plus its sparse columns, and the number of candidates."""
    v = logits.numel()
    target = torch.tensor([0 if 0 not in candidates else max(candidates) + 1])  # never a candidate
    z = torch.cat([logits, torch.full((target.item() + 1 - v,), -1e30, dtype=logits.dtype)]) if target.item() >= v \
        else logits
    table = torch.tensor([list(candidates)])
    cands = UnlikelihoodCandidates(table, torch.tensor([0]), torch.tensor([len(candidates)]), alpha, clamp)
    tile = Tile(z.unsqueeze(0), target, logits.dtype, with_argmax=False)
    term = cands.tile(tile, cands.tile_inputs(slice(0, 1), target, logits.dtype))
    grad = term.grad[0].scatter_add(0, term.columns[0], term.column_grad[0])[:v]
    value, count = term.values
    return value[0], grad, int(count.sum())


def test_ul_hand_gradient_and_clamp():
    value, grad, n = ul_terms_of(torch.tensor([0.0, 0.0], dtype=torch.float64), [1])
    assert n == 1 and value.item() == pytest.approx(math.log(2))
    assert grad.tolist() == pytest.approx([-0.5, 0.5])
    # p_c ~ 1: 1 - p_c is clamped at 1e-5, the value is -log(1e-5) and there is no gradient
    value, grad, _ = ul_terms_of(torch.tensor([0.0, 30.0, 0.0], dtype=torch.float64), [1])
    assert value.item() == pytest.approx(-math.log(1e-5)) and value.item() == pytest.approx(11.513, abs=1e-3)
    assert torch.all(grad == 0)


def test_ul_row_gradient_against_autograd():
    z = torch.randn(11, dtype=torch.float64, generator=torch.Generator().manual_seed(2), requires_grad=True)
    candidates = [0, 3, 4, 9]
    want = -torch.log1p(-torch.softmax(z, 0)[candidates]).sum()
    (want_grad,) = torch.autograd.grad(want, z)
    value, grad, _ = ul_terms_of(z.detach(), candidates, alpha=0.7)
    assert value.item() == pytest.approx(want.item(), rel=1e-12)
    assert torch.allclose(grad, 0.7 * want_grad, rtol=1e-12, atol=1e-15)
    assert abs(grad.sum().item()) < 1e-14  # each row of the UL logit gradient sums to 0


# ------------------------------------------------------------- the fused output layer, each method

V, D = 40, 10


def padded_targets(seed=0):
    """(B, T) targets with repeats and trailing padding, as fairseq collates them."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(2, 14, (4, 9), generator=g)  # few types: many repeated candidates
    target[0, 6:] = PAD
    target[2, 3:] = PAD
    target[3, 0] = 20  # a token that is never repeated
    return target


def make_problem(tied, n_positions, seed):
    """(fn, params): fn(*params) = (H over all B*T positions, W); tied: H = tanh(W[x] A) * 3."""
    g = torch.Generator().manual_seed(100 + seed)
    weight = torch.randn(V, D, generator=g) * 0.5
    if not tied:
        hidden = torch.randn(n_positions, D, generator=g) * 1.5
        return (lambda h, w: (h, w)), (hidden, weight)
    mix = torch.randn(D, D, generator=g) / D**0.5
    inputs = torch.randint(0, V, (n_positions,), generator=g)
    return (lambda w, a: (torch.tanh(w[inputs] @ a) * 3.0, w)), (weight, mix)


def fresh(params):
    return [p.clone().requires_grad_() for p in params]


def grads_of(loss, params):
    loss.backward()
    return [p.grad.clone() for p in params]


CHUNKS = (1, 5, 16, 1000)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_fused_unlikelihood_equals_the_direct_reference(tied, eps):
    target = padded_targets(seed=int(tied))
    flat = target.reshape(-1)
    keep = flat.ne(PAD).nonzero().squeeze(1)
    fn, base = make_problem(tied, flat.numel(), seed=int(eps * 10))
    alpha = 0.8

    params = fresh(base)
    want_loss, want_nll, want_ul = reference_unlikelihood_loss(*fn(*params), target, PAD, alpha, eps)
    want_grads = grads_of(want_loss, params)
    plain = fresh(base)
    hidden, weight = fn(*plain)
    plain_grads = grads_of(fused_linear_loss(hidden[keep], weight, flat[keep], LossRequest(eps)).loss, plain)
    assert rel_err(want_grads[0], plain_grads[0]) > 1e-2  # the UL term really changes the gradients

    for chunk in CHUNKS:
        params = fresh(base)
        hidden, weight = fn(*params)
        cands = unlikelihood_candidates(target, keep, PAD, alpha)
        out = fused_linear_loss(hidden[keep], weight, flat[keep], LossRequest(eps, terms=(cands,), chunk_size=chunk))
        loss, nll = out.loss, out.nll
        grads = grads_of(loss, params)
        assert rel_err(loss, want_loss) <= 1e-6, chunk
        assert rel_err(nll, want_nll) <= 1e-6, chunk
        assert rel_err(out.terms["unlikelihood"]["penalty"], want_ul) <= 1e-6, chunk
        assert out.terms["unlikelihood"]["candidates"].item() == sum(
            len(s) for row in reference_candidate_sets(target, PAD) for s in row if s
        )
        for got, want in zip(grads, want_grads):
            assert rel_err(got, want) <= 1e-6, (chunk, rel_err(got, want))


def face_problem(seed=3):
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 60, (V,), generator=g)
    counts[torch.randint(0, V, (8,), generator=g)] = 0  # never-counted tokens
    return counts


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("weighing", ["pre", "post"])
def test_fused_face_equals_the_direct_reference(tied, eps, weighing):
    target = padded_targets(seed=2)
    flat = target.reshape(-1)
    keep = flat.ne(PAD).nonzero().squeeze(1)
    y = flat[keep]
    fn, base = make_problem(tied, flat.numel(), seed=7)
    counts = face_problem()

    params = fresh(base)
    hidden, weight = fn(*params)
    logits = (hidden[keep] @ weight.t()).detach()
    row_weight = reference_face_weights(counts, y, logits, weighing)
    assert row_weight.min() < 0.9 or row_weight.max() > 1.01  # the weights differ from plain CE's
    want_loss, want_nll = reference_face_loss(hidden[keep], weight, y, eps, row_weight)
    want_grads = grads_of(want_loss, params)

    for chunk in CHUNKS:
        params = fresh(base)
        hidden, weight = fn(*params)
        face = FaceWeights(
            token_weight=face_token_weights(counts) if weighing == "pre" else None,
            counts=counts if weighing == "post" else None,
        )
        request = LossRequest(eps, terms=(face,), chunk_size=chunk, record_argmax=True)
        out = fused_linear_loss(hidden[keep], weight, y, request)
        loss, nll = out.loss, out.nll
        grads = grads_of(loss, params)
        assert rel_err(loss, want_loss) <= 1e-6, chunk
        assert rel_err(nll, want_nll) <= 1e-6, chunk
        assert torch.equal(out.argmax, logits.argmax(1))  # the "out" counts of this micro-batch
        assert rel_err(out.terms["face"]["weight"], row_weight.sum()) <= 1e-6
        for got, want in zip(grads, want_grads):
            assert rel_err(got, want) <= 1e-6, (chunk, rel_err(got, want))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_fused_freezing_zeroes_rare_rows_and_keeps_everything_else(tied, eps):
    target = padded_targets(seed=4)
    flat = target.reshape(-1)
    keep = flat.ne(PAD).nonzero().squeeze(1)
    y = flat[keep]
    fn, base = make_problem(tied, flat.numel(), seed=5)
    rare = torch.zeros(V, dtype=torch.bool)
    rare[[5, 7, 11, 20, 30, 31, 39]] = True  # targets (5, 7, 11, 20) and tokens never a target
    assert rare[y].any()

    params = fresh(base)
    hidden, weight = fn(*params)
    ref_loss, _ = smoothed_nll(hidden[keep] @ frozen_rows(weight, rare).t(), y, eps)
    ref_grads = grads_of(ref_loss, params)
    for chunk in CHUNKS:
        runs = {}
        for name, frozen in (("plain", None), ("frozen", rare)):
            params = fresh(base)
            hidden, weight = fn(*params)
            weight_out = weight.view_as(weight)  # its own node: the output side's gradient alone
            terms = () if frozen is None else (FrozenRows(frozen),)
            loss = fused_linear_loss(hidden[keep], weight_out, y, LossRequest(eps, terms=terms, chunk_size=chunk)).loss
            out_grad, hidden_grad = torch.autograd.grad(loss, [weight_out, hidden], retain_graph=True)
            runs[name] = (loss.detach(), out_grad, hidden_grad, grads_of(loss, params))
        loss, out_grad, hidden_grad, grads = runs["frozen"]
        plain_loss, plain_out_grad, plain_hidden_grad, _ = runs["plain"]
        assert torch.equal(loss, plain_loss)
        assert torch.all(out_grad[rare] == 0) and plain_out_grad[rare].abs().sum() > 0
        assert torch.equal(out_grad[~rare], plain_out_grad[~rare])  # every other entry: plain CE's
        assert torch.equal(hidden_grad, plain_hidden_grad)
        if tied:  # the input-side lookup of a rare row still trains it
            assert grads[0][rare].abs().sum() > 0
        for got, want in zip(grads, ref_grads):
            assert rel_err(got, want) <= 1e-6, chunk


@pytest.mark.parametrize("method", ["ul", "face-pre", "face-post"])
def test_fused_gradcheck_float64(method):
    g = torch.Generator().manual_seed(11)
    target = torch.tensor([[3, 4, 3, 5, 4], [6, 3, 3, PAD, PAD]])
    flat = target.reshape(-1)
    keep = flat.ne(PAD).nonzero().squeeze(1)
    hidden = torch.randn(keep.numel(), 3, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(9, 3, generator=g, dtype=torch.float64, requires_grad=True)
    counts = torch.tensor([0, 0, 5, 9, 2, 0, 7, 1, 4])

    def loss_of(h, w):
        if method == "ul":
            term = unlikelihood_candidates(target, keep, PAD, alpha=0.7)
        elif method == "face-pre":
            term = FaceWeights(token_weight=face_token_weights(counts).double())
        else:
            term = FaceWeights(counts=counts)
        return fused_linear_loss(h, w, flat[keep], LossRequest(0.1, terms=(term,), chunk_size=3)).loss

    assert torch.autograd.gradcheck(loss_of, (hidden, weight))
