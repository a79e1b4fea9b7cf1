"""The fused output-layer Function of AGG (Yu et al., ACL 2022, §4; docs/agg.md (A5)-(A6)).

Two kinds of checks:

* the fused, chunked Function against the official three-CE construction
  (``reference_output_loss`` of tests/support/reference_constructions.py): loss, dL/dH and dL/dW, fp32, <= 1e-6
  relative, for eps in {0, 0.1}, rare and very-rare targets, tied and untied W, several chunk sizes;
* independent checks of the gate semantics themselves, against a gate matrix written out by hand
  and against fairseq's own ``label_smoothed_nll_loss`` / torch autograd, because the fused function
  and the reference could share a bug.

Padding is removed by the criterion before the fused function is called; the criterion-level
padding test is in test_agg_criterion.py.
"""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss

from fairseq_agg.ops.agg import TokenGates, agg_gates
from fairseq_agg.ops.fused_linear_loss import LossRequest, fused_linear_loss
from reference_constructions import gate_matrix, reference_output_loss

torch.set_num_threads(2)


def rel_err(a, b):
    """max |a - b| / max |b|."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


# ---------------------------------------------------------------------------------------------
# A random problem with every kind of target: special, frequent, rare (count above the rare-group
# mean, g2 = 1), very rare (g2 < 1) and never seen (count 0, g1 = g2 = 0).
V, D, NSPECIAL, ALPHA, UPDATES = 48, 12, 4, 1.0, 10
FREQUENT = list(range(4, 20))
RARE = list(range(20, 34))  # counts 1..9 < alpha * updates
UNSEEN = list(range(34, 48))


def window_counts():
    g = torch.Generator().manual_seed(7)
    counts = torch.zeros(V, dtype=torch.int64)
    counts[:NSPECIAL] = torch.tensor([30, 0, 25, 0])  # specials: never rare, even with count 0
    counts[FREQUENT] = torch.randint(12, 200, (len(FREQUENT),), generator=g)
    counts[RARE] = torch.randint(1, 10, (len(RARE),), generator=g)
    return counts


def problem_gates():
    gates = agg_gates(window_counts(), UPDATES, ALPHA, NSPECIAL)
    # guard the premise of the tests below: all kinds of tokens are present
    assert not gates.rare[:NSPECIAL].any()
    assert gates.rare[RARE].all() and gates.rare[UNSEEN].all() and not gates.rare[FREQUENT].any()
    very_rare = gates.rare & (gates.g2 < 1)
    assert very_rare[RARE].any() and (~very_rare[RARE]).any()
    return gates


def problem_targets(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    pools = [[2], FREQUENT, RARE, UNSEEN]
    picks = [pools[i % 4][int(torch.randint(len(pools[i % 4]), (1,), generator=g))] for i in range(n)]
    perm = torch.randperm(n, generator=g)
    return torch.tensor(picks)[perm]


def run_fused(hidden_fn, params, target, eps, gates, chunk):
    out = fused_linear_loss(*hidden_fn(*params), target, LossRequest(eps, terms=(gates,), chunk_size=chunk))
    loss, nll = out.loss, out.nll
    loss.backward()
    return loss.detach(), nll.detach(), [p.grad.clone() for p in params]


def run_reference(hidden_fn, params, target, eps, gates):
    loss, nll, _ = reference_output_loss(*hidden_fn(*params), target, eps, gates=gates)
    loss.backward()
    return loss.detach(), nll.detach(), [p.grad.clone() for p in params]


def untied_problem(n, seed):
    g = torch.Generator().manual_seed(100 + seed)
    hidden = torch.randn(n, D, generator=g)
    weight = torch.randn(V, D, generator=g) * 0.5

    def fn(h, w):
        return h, w

    return fn, (hidden, weight)


def tied_problem(n, seed):
    """H = tanh(W[x] A): W is both the input embedding and the output projection."""
    g = torch.Generator().manual_seed(200 + seed)
    weight = torch.randn(V, D, generator=g) * 0.5
    mix = torch.randn(D, D, generator=g) / D**0.5
    inputs = torch.randint(0, V, (n,), generator=g)

    def fn(w, a):
        return torch.tanh(w[inputs] @ a) * 3.0, w

    return fn, (weight, mix)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_fused_equals_reference_construction(tied, eps):
    n = 37
    target = problem_targets(n, seed=int(tied))
    gates = problem_gates()
    make = tied_problem if tied else untied_problem
    fn, base = make(n, seed=int(eps * 10))

    def fresh():
        return [p.clone().requires_grad_() for p in base]

    ref_loss, ref_nll, ref_grads = run_reference(fn, fresh(), target, eps, gates)
    plain_loss, _, plain_grads = run_reference(fn, fresh(), target, eps, None)
    # the gates must actually change dW here, otherwise this test would prove nothing
    w_index = 0 if tied else 1
    assert rel_err(ref_grads[w_index], plain_grads[w_index]) > 1e-2
    assert torch.allclose(ref_loss, plain_loss)  # AGG never changes the loss value

    for chunk in (1, 5, 16, n, 4 * n):
        loss, nll, grads = run_fused(fn, fresh(), target, eps, gates, chunk)
        assert rel_err(loss, ref_loss) <= 1e-6, chunk
        assert rel_err(nll, ref_nll) <= 1e-6, chunk
        for got, want in zip(grads, ref_grads):
            assert rel_err(got, want) <= 1e-6, (chunk, rel_err(got, want))


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_ungated_matches_fairseq_label_smoothed_loss_and_autograd(eps):
    """Without gates the fused function is (label-smoothed) CE: value and gradient of fairseq's loss."""
    n = 29
    target = problem_targets(n, seed=3)
    fn, base = untied_problem(n, seed=3)
    h0, w0 = (p.clone().requires_grad_() for p in base)
    lprobs = F.log_softmax(h0 @ w0.t(), dim=-1)
    want_loss, want_nll = label_smoothed_nll_loss(lprobs, target, eps, ignore_index=None, reduce=True)
    want_loss.backward()

    for chunk in (1, 7, 1000):
        h, w = (p.clone().requires_grad_() for p in base)
        out = fused_linear_loss(h, w, target, LossRequest(eps, chunk_size=chunk))
        loss, nll = out.loss, out.nll
        loss.backward()
        assert rel_err(loss, want_loss) <= 1e-6
        assert rel_err(nll, want_nll) <= 1e-6
        assert rel_err(h.grad, h0.grad) <= 1e-6
        assert rel_err(w.grad, w0.grad) <= 1e-6


def test_gates_all_one_equal_ungated():
    n = 20
    target = problem_targets(n, seed=5)
    ones = torch.ones(V)
    gates = TokenGates(g1=ones, g2=ones.clone(), rare=torch.zeros(V, dtype=torch.bool))
    fn, base = untied_problem(n, seed=5)
    _, _, g_gated = run_fused(fn, [p.clone().requires_grad_() for p in base], target, 0.1, gates, 6)
    _, _, g_plain = run_fused(fn, [p.clone().requires_grad_() for p in base], target, 0.1, None, 6)
    for a, b in zip(g_gated, g_plain):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# Gate semantics on a tiny example, with the gate matrix written out by hand (docs/agg.md (A3)-(A5)).
#
#   V = 8, nspecial = 2, counts c = [0, 0, 50, 40, 1, 3, 0, 2], 10 updates, alpha = 0.5
#   a = c / 10 = [0, 0, 5, 4, .1, .3, 0, .2]  ->  rare R = {4, 5, 6, 7} (0, 1 special)
#   g1 = a on R, else 1             = [1, 1, 1, 1, .1, .3, 0, .2]
#   mean of c over R = (1 + 3 + 0 + 2) / 4 = 1.5
#   g2 = min(c / 1.5, 1) on R, else 1 = [1, 1, 1, 1, 2/3, 1, 0, 1]
TINY_COUNTS = torch.tensor([0, 0, 50, 40, 1, 3, 0, 2])
TINY_G1 = [1, 1, 1, 1, 0.1, 0.3, 0, 0.2]
TINY_G2 = [1, 1, 1, 1, 2 / 3, 1, 0, 1]
TINY_RARE = [False, False, False, False, True, True, True, True]
TINY_TARGETS = torch.tensor([2, 4, 3, 6, 5, 7, 0])
_r = 2 / 3
TINY_GAMMA = np.array(
    [
        [1, 1, 1, 1, 0.1, 0.3, 0, 0.2],  # y = 2, not rare: g1
        [1, 1, 1, 1, 1, 1, 0, 1],  # y = 4, rare: g2, own column 1
        [1, 1, 1, 1, 0.1, 0.3, 0, 0.2],  # y = 3, not rare: g1
        [1, 1, 1, 1, _r, 1, 1, 1],  # y = 6, rare: g2, own column 1
        [1, 1, 1, 1, _r, 1, 0, 1],  # y = 5, rare: g2 (own column already 1)
        [1, 1, 1, 1, _r, 1, 0, 1],  # y = 7, rare: g2 (own column already 1)
        [1, 1, 1, 1, 0.1, 0.3, 0, 0.2],  # y = 0, special: g1
    ]
)


def tiny_gates():
    return agg_gates(TINY_COUNTS, 10, 0.5, 2)


def test_tiny_gates_are_the_hand_computed_ones():
    gates = tiny_gates()
    assert gates.rare.tolist() == TINY_RARE
    np.testing.assert_allclose(gates.g1.numpy(), TINY_G1, rtol=1e-6)
    np.testing.assert_allclose(gates.g2.numpy(), TINY_G2, rtol=1e-6)
    np.testing.assert_allclose(gate_matrix(TINY_TARGETS, gates).numpy(), TINY_GAMMA, rtol=1e-6)


def tiny_problem(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(len(TINY_TARGETS), 5, generator=g), torch.randn(8, 5, generator=g)


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_fused_gradients_equal_hand_built_gamma_formula(eps):
    """dH = G W and dW = (Gamma * G)^T H with G = softmax(Z) - Q, computed in numpy float64."""
    h0, w0 = tiny_problem(11)
    hn, wn, y = h0.double().numpy(), w0.double().numpy(), TINY_TARGETS.numpy()
    z = hn @ wn.T
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    q = np.full_like(p, eps / 7)  # fairseq: eps / (V - 1) off the target, 1 - eps on it
    q[np.arange(len(y)), y] = 1 - eps
    grad_logits = p - q
    want_dh = grad_logits @ wn
    want_dw = (TINY_GAMMA * grad_logits).T @ hn
    want_loss = -(q * np.log(p)).sum()

    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    loss = fused_linear_loss(h, w, TINY_TARGETS, LossRequest(eps, terms=(tiny_gates(),), chunk_size=3)).loss
    loss.backward()
    np.testing.assert_allclose(loss.item(), want_loss, rtol=1e-6)
    np.testing.assert_allclose(h.grad.numpy(), want_dh, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(w.grad.numpy(), want_dw, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_effective_gate_per_context(eps):
    """Measures the gate the fused function applies to each (context, token) entry.

    With a single row n, dW = outer(Gamma_n * G_n, h_n), so (dW h_n) / (dW_plain h_n) = Gamma_n.
    """
    h0, w0 = tiny_problem(12)
    gates = tiny_gates()
    rare = torch.tensor(TINY_RARE)
    for n in range(len(TINY_TARGETS)):
        y = TINY_TARGETS[n : n + 1]
        h_row = h0[n : n + 1]
        grads = {}
        for name, gt in (("gated", gates), ("plain", None)):
            h, w = h_row.clone().requires_grad_(), w0.clone().requires_grad_()
            fused_linear_loss(h, w, y, LossRequest(eps, terms=(gt,))).loss.backward()
            grads[name] = (h.grad.clone(), w.grad.clone())
        # hidden-state gradient: exactly the plain CE one
        assert torch.allclose(grads["gated"][0], grads["plain"][0], rtol=0, atol=1e-7)
        u = h_row[0] / h_row[0].dot(h_row[0])
        gamma_eff = (grads["gated"][1] @ u) / (grads["plain"][1] @ u)
        target = int(y)
        assert gamma_eff[target].item() == pytest.approx(1.0, abs=1e-5)  # own column never gated
        assert torch.allclose(gamma_eff[~rare], torch.ones(int((~rare).sum())), atol=1e-5)  # non-rare columns untouched
        gate = gates.g2 if TINY_RARE[target] else gates.g1
        for k in range(8):
            if k != target:
                assert gamma_eff[k].item() == pytest.approx(float(gate[k]), abs=1e-5), (n, k)
        np.testing.assert_allclose(gamma_eff.numpy(), TINY_GAMMA[n], atol=1e-5)


def test_rare_token_gradient_decomposition():
    """dW_r = (a) own contexts, ungated + g1_r * (b) non-rare contexts + g2_r * (c) other rare contexts."""
    h0, w0 = tiny_problem(13)
    gates = tiny_gates()
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    fused_linear_loss(h, w, TINY_TARGETS, LossRequest(0.0, terms=(gates,))).loss.backward()
    with torch.no_grad():
        p = torch.softmax(h0 @ w0.t(), dim=-1)
        grad_logits = p - F.one_hot(TINY_TARGETS, 8).float()
    rare_target = torch.tensor(TINY_RARE)[TINY_TARGETS]
    for r in (4, 5, 6, 7):
        own = TINY_TARGETS == r
        part_a = grad_logits[own, r] @ h0[own]
        part_b = grad_logits[~rare_target, r] @ h0[~rare_target]
        other = rare_target & ~own
        part_c = grad_logits[other, r] @ h0[other]
        want = part_a + gates.g1[r] * part_b + gates.g2[r] * part_c
        assert torch.allclose(w.grad[r], want, atol=1e-6), r
    # non-rare rows of dW: exactly plain CE
    plain = grad_logits.t() @ h0
    assert torch.allclose(w.grad[:4], plain[:4], atol=1e-6)


# ---------------------------------------------------------------------------------------------
# float64 gradcheck and low precision


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_gradcheck_float64_ungated(eps):
    """The ungated fused function's gradient is the true gradient of its value (float64).

    (The gated dW is by design not the gradient of the loss value; it is checked against the
    reference's autograd above.)
    """
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(7, 4, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(9, 4, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([0, 3, 3, 8, 1, 5, 2])
    for chunk in (1, 3, 100):
        def fn(hh, ww, chunk=chunk):
            return fused_linear_loss(hh, ww, target, LossRequest(eps, chunk_size=chunk)).loss

        assert torch.autograd.gradcheck(fn, (hidden, weight), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_gated_function_float64_matches_reference_autograd():
    """In float64 the gated fused gradients equal the reference construction's autograd ones."""
    g = torch.Generator().manual_seed(4)
    h0 = torch.randn(len(TINY_TARGETS), 5, generator=g, dtype=torch.float64)
    w0 = torch.randn(8, 5, generator=g, dtype=torch.float64)
    gates = tiny_gates()
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    fused_linear_loss(h, w, TINY_TARGETS, LossRequest(0.1, terms=(gates,), chunk_size=2)).loss.backward()
    hr, wr = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    reference_output_loss(hr, wr, TINY_TARGETS, 0.1, gates=gates)[0].backward()
    assert h.grad.dtype == torch.float64 and w.grad.dtype == torch.float64
    assert rel_err(h.grad, hr.grad) <= 1e-6
    assert rel_err(w.grad, wr.grad) <= 1e-6


def test_bf16_inputs_give_finite_loss_close_to_fp32():
    n = 64
    target = problem_targets(n, seed=8)
    gates = problem_gates()
    fn, base = untied_problem(n, seed=8)
    loss32, nll32, (dh32, dw32) = run_fused(fn, [p.clone().requires_grad_() for p in base], target, 0.1, gates, 16)
    low = [p.to(torch.bfloat16).requires_grad_() for p in base]
    loss16, nll16, (dh16, dw16) = run_fused(fn, low, target, 0.1, gates, 16)
    assert loss16.dtype == torch.float32  # the loss arithmetic runs in fp32
    assert dh16.dtype == torch.bfloat16 and dw16.dtype == torch.bfloat16
    assert torch.isfinite(loss16) and torch.isfinite(dh16.float()).all() and torch.isfinite(dw16.float()).all()
    assert abs(loss16.item() - loss32.item()) <= 1e-2 * abs(loss32.item())
    assert abs(nll16.item() - nll32.item()) <= 1e-2 * abs(nll32.item())
    assert rel_err(dh16.float(), dh32) <= 5e-2
    assert rel_err(dw16.float(), dw32) <= 5e-2


def test_no_grad_gives_the_same_loss():
    n = 15
    target = problem_targets(n, seed=9)
    fn, (h, w) = untied_problem(n, seed=9)
    with_grad = fused_linear_loss(h.clone().requires_grad_(), w.clone().requires_grad_(), target, LossRequest(0.1)).loss
    with torch.no_grad():
        without = fused_linear_loss(h.clone().requires_grad_(), w.clone().requires_grad_(), target, LossRequest(0.1)).loss
    assert torch.equal(with_grad.detach(), without)
