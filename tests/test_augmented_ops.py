"""Unit tests of the augmented-loss math (Inan et al., ICLR 2017; docs/augmented_loss.md).

* the fused, chunked output layer (``fused_linear_loss`` with a ``TeacherTargets``) against the
  direct reference (materialised teacher and tempered prediction, KL by definition), fp32, 1e-6;
* float64 gradchecks, the τ = 1 identity (docs/augmented_loss.md, "The loss") computed in numpy, the scale modes,
  ``build_teacher`` against numpy, masked columns, bf16;
* the AGG + AL gradient (docs/augmented_loss.md, "Combination with AGG") written out in numpy;
* the non-detached variant (``augmented_kl_direct``) against autograd through a materialised teacher
  and against central finite differences, float64.
"""
import importlib
import math

import numpy as np
import pytest
import torch

from fairseq_agg.ops.agg import TokenGates
from fairseq_agg.ops.augmented import SCALES, TeacherTargets, aug_scale_factor, augmented_kl_direct, build_teacher
from fairseq_agg.ops.fused_linear_loss import LossRequest, fused_linear_loss
from reference_constructions import gate_matrix, reference_output_loss, reference_teacher


def fused(hidden, weight, target, epsilon, gates=None, teacher=None, **options):
    """(loss, nll, the augmented loss's KL, 0 without a teacher) of the fused layer with label
    smoothing ``epsilon``, AGG's ``gates`` and the ``teacher``."""
    request = LossRequest(epsilon, **options).with_terms(gates, teacher)
    out = fused_linear_loss(hidden, weight, target, request)
    assert ("augmented" in out.terms) == (teacher is not None)
    return out.loss, out.nll, out.terms.get("augmented", {}).get("kl", torch.zeros((), dtype=out.nll.dtype))

torch.set_num_threads(2)


def rel_err(a, b):
    """max |a - b| / max |b| (a scale-aware relative error that tolerates exact zeros in b)."""
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    scale = b.abs().max().clamp(min=1e-30)
    return float((a - b).abs().max() / scale)


def problem(n=37, vocab=29, dim=12, tied=True, seed=0, dtype=torch.float32, scale=0.8):
    g = torch.Generator().manual_seed(seed)
    emb = (torch.randn(vocab, dim, generator=g, dtype=torch.float64) * scale).to(dtype)
    weight = emb if tied else (torch.randn(vocab, dim, generator=g, dtype=torch.float64) * scale).to(dtype)
    hidden = torch.randn(n, dim, generator=g, dtype=torch.float64).to(dtype)
    # ids 0-3 play fairseq's specials; repeated types so that the per-type teacher is shared
    target = torch.randint(4, vocab, (n,), generator=g)
    target[: n // 3] = target[n // 3 : 2 * (n // 3)]
    return hidden, weight, emb, target


def random_gates(vocab, seed):
    """AGG gates with about half the non-special types rare and random g1, g2 in (0, 1) on them."""
    g = torch.Generator().manual_seed(seed)
    rare = torch.rand(vocab, generator=g) < 0.5
    rare[:4] = False
    return TokenGates(
        g1=torch.where(rare, torch.rand(vocab, generator=g), torch.ones(vocab)),
        g2=torch.where(rare, torch.rand(vocab, generator=g), torch.ones(vocab)),
        rare=rare,
    )


def run_with_grads(fn, hidden, weight, tied):
    """Calls fn(h, W) -> (loss, nll, kl) on fresh leaves; returns values and dH, dW."""
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    loss, nll, kl = fn(h, w)
    loss.backward()
    return loss.detach(), nll.detach(), kl.detach(), h.grad, w.grad


# --------------------------------------------------------------------------------------------
# fused == direct reference (materialised y~ and y^, KL by definition), fp32, 1e-6 relative


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("epsilon", [0.0, 0.1], ids=["ce", "ls0.1"])
@pytest.mark.parametrize("masked", [None, (0, 1, 27)], ids=["nomask", "masked"])
def test_fused_matches_reference_fp32(tied, epsilon, masked):
    hidden, weight, emb, target = problem(tied=tied, seed=3)
    tau, alpha = 2.0, 0.7
    coef = alpha * aug_scale_factor("tau", tau)
    probs = reference_teacher(emb, target, tau, masked)
    ref = run_with_grads(
        lambda h, w: reference_output_loss(h, w, target, epsilon, teacher_probs=probs, tau=tau, coef=coef),
        hidden, weight, tied,
    )
    for chunk in (1, 5, 16, 1000):
        teacher = build_teacher(emb, target, tau, coef, masked)
        out = run_with_grads(
            lambda h, w: fused(h, w, target, epsilon, teacher=teacher, chunk_size=chunk),
            hidden, weight, tied,
        )
        for name, a, b in zip(("loss", "nll", "kl", "dH", "dW"), out, ref):
            assert rel_err(a, b) <= 1e-6, (name, chunk, rel_err(a, b))
    # the augmented loss really is in there: without the teacher the gradients differ clearly
    plain = run_with_grads(lambda h, w: fused(h, w, target, epsilon), hidden, weight, tied)
    assert rel_err(plain[3], ref[3]) > 1e-2
    assert float(ref[2]) > 0


def test_fused_loss_is_ce_plus_coef_times_kl_for_every_scale():
    """loss = CE + alpha * s(tau) * KL with s in {1, tau, tau^2} (docs/augmented_loss.md, "The loss")."""
    hidden, weight, emb, target = problem(tied=False, seed=5)
    tau, alpha = 3.0, 0.4
    ce, _, _ = fused(hidden, weight, target, 0.1)
    assert aug_scale_factor("none", tau) == 1.0
    assert aug_scale_factor("tau", tau) == tau
    assert aug_scale_factor("tau2", tau) == tau * tau
    kls = set()
    for scale in SCALES:
        coef = alpha * aug_scale_factor(scale, tau)
        teacher = build_teacher(emb, target, tau, coef)
        loss, _, kl = fused(hidden, weight, target, 0.1, teacher=teacher)
        assert math.isclose(float(loss), float(ce) + coef * float(kl), rel_tol=1e-6)
        kls.add(round(float(kl), 4))
    assert len(kls) == 1  # the KL itself does not depend on the scale convention
    with pytest.raises(ValueError, match="none, tau, tau2"):
        aug_scale_factor("tau3", tau)


# --------------------------------------------------------------------------------------------
# τ = 1: CE + α KL = (1+α) CE(q || softmax z) − α H(y~),  gradient (1+α)(softmax − q)   (docs/augmented_loss.md)


def _np_softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_tau_one_is_label_smoothing_toward_the_teacher(tied):
    hidden, weight, emb, target = problem(tied=tied, seed=7, scale=1.0)
    alpha, masked = 0.6, (0, 1)
    H, W, E = (t.double().numpy() for t in (hidden, weight, emb))
    y = target.numpy()
    # independent float64 computation of the identity
    s = E[y] @ E.T
    s[:, list(masked)] = -np.inf
    teach = _np_softmax(s)
    with np.errstate(divide="ignore", invalid="ignore"):
        ent = -np.where(teach > 0, teach * np.log(teach), 0.0).sum(-1)
    onehot = np.eye(E.shape[0])[y]
    q = (onehot + alpha * teach) / (1 + alpha)
    z = H @ W.T
    logp = z - z.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    loss_np = ((1 + alpha) * -(q * logp).sum(-1) - alpha * ent).sum()
    g = (1 + alpha) * (np.exp(logp) - q)
    dH_np, dW_np = g @ W, g.T @ H
    for scale in SCALES:  # at τ = 1 every convention has c = 1
        teacher = build_teacher(emb, target, 1.0, alpha * aug_scale_factor(scale, 1.0), masked)
        loss, _, _, dH, dW = run_with_grads(
            lambda h, w: fused(h, w, target, 0.0, teacher=teacher, chunk_size=8), hidden, weight, tied
        )
        assert rel_err(loss, torch.tensor(loss_np)) <= 2e-6
        assert rel_err(dH, torch.from_numpy(dH_np)) <= 2e-6
        assert rel_err(dW, torch.from_numpy(dW_np)) <= 2e-6


# --------------------------------------------------------------------------------------------
# float64 gradchecks


def _teacher64(emb, target, tau, coef, masked=None):
    """A float64 TeacherTargets (build_teacher's fields, computed at float64)."""
    uniq, inv = torch.unique(target, return_inverse=True)
    s = (emb[uniq] @ emb.t()).double() / tau
    if masked:
        s[:, list(masked)] = float("-inf")
    logp = torch.log_softmax(s, -1)
    p = logp.exp()
    ent = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)
    return TeacherTargets(probs=p.detach(), entropy=ent.detach(), index=inv, tau=tau, coef=coef)


@pytest.mark.parametrize("epsilon", [0.0, 0.1], ids=["ce", "ls0.1"])
def test_fused_gradcheck_float64(epsilon):
    """The fused Function in float64 passes torch.autograd.gradcheck."""
    hidden, weight, emb, target = problem(n=9, vocab=11, dim=5, tied=False, seed=11, dtype=torch.float64)
    teacher = _teacher64(emb, target, 2.0, 1.3, masked=(0,))
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda h, w: fused(h, w, target, epsilon, teacher=teacher, chunk_size=4)[0], (h, w)
    )


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_direct_gradcheck_float64(tied):
    """The non-detached direct KL: gradients into H, W and E (through the teacher)."""
    hidden, weight, emb, target = problem(n=8, vocab=10, dim=4, tied=tied, seed=13, dtype=torch.float64)
    h = hidden.clone().requires_grad_(True)
    e = emb.clone().requires_grad_(True)
    if tied:
        fn = lambda h, e: augmented_kl_direct(h, e, e, target, 1.7, masked_columns=(0, 1), chunk_size=3)  # noqa: E731
        assert torch.autograd.gradcheck(fn, (h, e))
    else:
        w = weight.clone().requires_grad_(True)
        fn = lambda h, w, e: augmented_kl_direct(h, w, e, target, 1.7, masked_columns=(0, 1), chunk_size=3)  # noqa: E731
        assert torch.autograd.gradcheck(fn, (h, w, e))


# --------------------------------------------------------------------------------------------
# non-detached teacher: direct op vs autograd through a materialised teacher, and vs finite differences


def _materialised_kl(h, w, e, target, tau, masked):
    """KL(softmax(E e_y / tau) || softmax(W h / tau)) summed, by definition, all differentiable."""
    s = (e[target] @ e.t()) / tau
    if masked:
        s = s.index_fill(1, torch.tensor(list(masked)), float("-inf"))
    logp = torch.log_softmax(s, -1)
    logq = torch.log_softmax((h @ w.t()) / tau, -1)
    p = logp.exp()
    return (p * torch.where(p > 0, logp - logq, torch.zeros_like(logp))).sum()


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_direct_matches_materialised_autograd(tied):
    hidden, weight, emb, target = problem(n=23, vocab=17, dim=6, tied=tied, seed=17, dtype=torch.float64)
    masked, tau = (0, 1, 16), 1.5

    def grads(fn):
        h = hidden.clone().requires_grad_(True)
        e = emb.clone().requires_grad_(True)
        w = e if tied else weight.clone().requires_grad_(True)
        val = fn(h, w, e)
        val.backward()
        return [val.detach(), h.grad, e.grad] + ([] if tied else [w.grad])

    ref = grads(lambda h, w, e: _materialised_kl(h, w, e, target, tau, masked))
    for chunk in (1, 4, 100):
        out = grads(lambda h, w, e: augmented_kl_direct(h, w, e, target, tau, masked, chunk_size=chunk))
        for a, b in zip(out, ref):
            assert rel_err(a, b) <= 1e-12


def test_direct_finite_differences_on_the_embedding():
    """Central differences on individual entries of E (tied), including a masked row and a target row."""
    hidden, _, emb, target = problem(n=12, vocab=9, dim=4, tied=True, seed=19, dtype=torch.float64)
    masked, tau = (0,), 1.2
    e = emb.clone().requires_grad_(True)
    augmented_kl_direct(hidden, e, e, target, tau, masked, chunk_size=5).backward()
    step = 1e-6
    for row, col in [(0, 1), (int(target[0]), 2), (int(target[5]), 0), (3, 3)]:
        plus, minus = emb.clone(), emb.clone()
        plus[row, col] += step
        minus[row, col] -= step
        fd = (
            float(augmented_kl_direct(hidden, plus, plus, target, tau, masked))
            - float(augmented_kl_direct(hidden, minus, minus, target, tau, masked))
        ) / (2 * step)
        assert math.isclose(float(e.grad[row, col]), fd, rel_tol=1e-6, abs_tol=1e-9), (row, col)


def test_direct_detached_equals_fused_and_teacher_path_matters():
    """With E not requiring grad the direct op is the fused AL term; with it, E gets an extra gradient."""
    hidden, weight, emb, target = problem(n=30, vocab=21, dim=8, tied=False, seed=23)
    tau, coef, masked = 2.0, 0.9, (0, 1)
    base = run_with_grads(lambda h, w: fused(h, w, target, 0.0), hidden, weight, False)
    teacher = build_teacher(emb, target, tau, coef, masked)
    full = run_with_grads(lambda h, w: fused(h, w, target, 0.0, teacher=teacher), hidden, weight, False)
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    kl = augmented_kl_direct(h, w, emb, target, tau, masked, chunk_size=7)
    (coef * kl).backward()
    assert rel_err(kl, full[2]) <= 1e-6
    assert rel_err(h.grad, full[3] - base[3]) <= 1e-5
    assert rel_err(w.grad, full[4] - base[4]) <= 1e-5
    e = emb.clone().requires_grad_(True)
    augmented_kl_direct(hidden, weight, e, target, tau, masked).backward()
    assert e.grad.abs().max() > 1e-3


def test_direct_validates_its_arguments():
    hidden, weight, emb, target = problem(n=4, vocab=8, dim=3, tied=True)
    with pytest.raises(ValueError, match="tau must be > 0"):
        augmented_kl_direct(hidden, weight, emb, target, 0.0)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        augmented_kl_direct(hidden, weight, emb, target, 1.0, chunk_size=0)
    with pytest.raises(ValueError, match="target must have shape"):
        augmented_kl_direct(hidden, weight, emb, target[:2], 1.0)


# --------------------------------------------------------------------------------------------
# build_teacher against numpy; masked columns


def test_build_teacher_matches_numpy():
    hidden, _, emb, target = problem(n=31, vocab=19, dim=7, tied=True, seed=29)
    tau, coef, masked = 1.7, 0.35, (1, 2)
    e = emb.clone().requires_grad_(True)
    teacher = build_teacher(e, target, tau, coef, masked)
    E, y = emb.double().numpy(), target.numpy()
    uniq, inv = np.unique(y, return_inverse=True)
    s = E[uniq] @ E.T / tau
    s[:, list(masked)] = -np.inf
    p = _np_softmax(s)
    with np.errstate(divide="ignore", invalid="ignore"):
        ent = -np.where(p > 0, p * np.log(p), 0.0).sum(-1)
    assert teacher.probs.shape == (len(uniq), E.shape[0])
    assert not teacher.probs.requires_grad and teacher.probs.dtype == torch.float32
    assert torch.equal(teacher.index, torch.from_numpy(inv).long())
    assert rel_err(teacher.probs, torch.from_numpy(p)) <= 1e-6
    assert rel_err(teacher.entropy, torch.from_numpy(ent)) <= 1e-6
    assert teacher.tau == tau and teacher.coef == coef
    # masked columns get exactly zero mass, the rest sums to one
    assert torch.all(teacher.probs[:, list(masked)] == 0)
    assert torch.allclose(teacher.probs.sum(-1), torch.ones(len(uniq)), atol=1e-6)
    # the self term is kept (eq. 3.7 runs over the whole vocabulary): a type's own column has teacher logit ‖e‖² / τ
    own = teacher.probs[torch.arange(len(uniq)), torch.from_numpy(uniq).long()]
    assert torch.all(own > 0)


def test_masked_columns_carry_no_teacher_gradient():
    """A masked column's dW row gets only the model part softmax(z/τ)/τ (no −y~ pull), in fused and reference."""
    hidden, weight, emb, target = problem(n=20, vocab=13, dim=5, tied=False, seed=31)
    tau, coef = 2.0, 1.0
    teacher = build_teacher(emb, target, tau, coef, masked_columns=(2,))
    base = run_with_grads(lambda h, w: fused(h, w, target, 0.0), hidden, weight, False)
    full = run_with_grads(lambda h, w: fused(h, w, target, 0.0, teacher=teacher), hidden, weight, False)
    model_part = torch.softmax((hidden @ weight.t()).double() / tau, -1)[:, 2] / tau * coef
    expect = model_part.unsqueeze(1).mul(hidden.double()).sum(0)
    assert rel_err(full[4][2] - base[4][2], expect) <= 1e-5


# --------------------------------------------------------------------------------------------
# AGG + AL (docs/augmented_loss.md, "Combination with AGG"): dW = (Γ ⊙ G_CE + G_AL)^T H, dH = (G_CE + G_AL) W


@pytest.mark.parametrize("gate_aug", [False, True], ids=["al-ungated", "al-gated"])
def test_agg_gates_the_ce_part_only(gate_aug):
    hidden, weight, emb, target = problem(n=26, vocab=15, dim=6, tied=True, seed=37)
    gates = random_gates(15, seed=1)
    assert gates.rare[target].any() and (~gates.rare[target]).any()
    tau, coef, eps = 2.0, 1.1, 0.1
    teacher = build_teacher(emb, target, tau, coef, (0,), gate_with_agg=gate_aug)
    _, _, _, dH, dW = run_with_grads(
        lambda h, w: fused(h, w, target, eps, gates=gates, teacher=teacher, chunk_size=6),
        hidden, weight, True,
    )
    # numpy float64
    H, W, y = hidden.double().numpy(), weight.double().numpy(), target.numpy()
    V = W.shape[0]
    z = H @ W.T
    eps_i = eps / (V - 1)
    Q = np.full((len(y), V), eps_i)
    Q[np.arange(len(y)), y] = 1 - eps
    g_ce = _np_softmax(z) - Q
    t = reference_teacher(emb, target, tau, (0,)).double().numpy()
    g_al = coef / tau * (_np_softmax(z / tau) - t)
    gamma = gate_matrix(target, gates).double().numpy()
    g_w = gamma * (g_ce + g_al) if gate_aug else gamma * g_ce + g_al
    assert rel_err(dH, torch.from_numpy((g_ce + g_al) @ W)) <= 2e-6
    assert rel_err(dW, torch.from_numpy(g_w.T @ H)) <= 2e-6
    # and the lead's reference agrees
    ref = run_with_grads(
        lambda h, w: reference_output_loss(
            h, w, target, eps, gates=gates, teacher_probs=torch.from_numpy(t).float(), tau=tau, coef=coef,
            gate_aug_with_agg=gate_aug,
        ),
        hidden, weight, True,
    )
    assert rel_err(dW, ref[4]) <= 1e-6 and rel_err(dH, ref[3]) <= 1e-6


# --------------------------------------------------------------------------------------------
# CPU row blocks: the element-wise work of a chunk runs block by block (a few MiB at a time); with
# the test's small vocabularies a chunk is a single block, so blocks are forced small here


@pytest.mark.parametrize("block_rows", [1, 3], ids=["block1", "block3"])
@pytest.mark.parametrize("mode", ["ce", "agg", "al", "agg+al", "agg+al-gated"])
def test_row_blocks_smaller_than_the_chunk_give_the_same_result(monkeypatch, block_rows, mode):
    fused_module = importlib.import_module("fairseq_agg.ops.fused_linear_loss")

    hidden, weight, emb, target = problem(n=41, vocab=23, dim=8, tied=True, seed=53)
    monkeypatch.setattr(fused_module, "_CPU_BLOCK_BYTES", block_rows * 23 * 4)  # fp32 rows of V = 23
    assert fused_module.block_rows(torch.device("cpu"), 23, torch.float32, 16) == block_rows
    gates = random_gates(23, seed=5) if "agg" in mode else None
    tau, coef, eps = 3.0, 0.9, 0.1
    gate_aug = mode.endswith("gated")
    probs = reference_teacher(emb, target, tau, (1,)) if "al" in mode else None
    ref = run_with_grads(
        lambda h, w: reference_output_loss(
            h, w, target, eps, gates=gates, teacher_probs=probs, tau=tau, coef=coef, gate_aug_with_agg=gate_aug
        ),
        hidden, weight, True,
    )
    for chunk in (5, 16):
        teacher = build_teacher(emb, target, tau, coef, (1,), gate_with_agg=gate_aug) if "al" in mode else None
        if teacher is not None:  # the teacher itself is also built block by block
            assert rel_err(teacher.probs[teacher.index], probs) <= 1e-6
        out = run_with_grads(
            lambda h, w: fused(h, w, target, eps, gates=gates, teacher=teacher, chunk_size=chunk),
            hidden, weight, True,
        )
        for name, a, b in zip(("loss", "nll", "kl", "dH", "dW"), out, ref):
            if name == "kl" and teacher is None:
                continue
            assert rel_err(a, b) <= 1e-6, (mode, chunk, name, rel_err(a, b))


# --------------------------------------------------------------------------------------------
# bf16


def test_bf16_inputs_are_finite_and_close_to_fp32():
    hidden, weight, emb, target = problem(n=64, vocab=40, dim=16, tied=True, seed=41)
    tau, coef = 2.0, 1.0
    t32 = build_teacher(emb, target, tau, coef, (0,))
    ref = run_with_grads(lambda h, w: fused(h, w, target, 0.1, teacher=t32), hidden, weight, True)
    hb, wb = hidden.bfloat16(), weight.bfloat16()
    t16 = build_teacher(wb, target, tau, coef, (0,))
    assert t16.probs.dtype == torch.float32  # the teacher softmax is fp32 even from bf16 rows
    h = hb.clone().requires_grad_(True)
    w = wb.clone().requires_grad_(True)
    loss, nll, kl = fused(h, w, target, 0.1, teacher=t16, chunk_size=16)
    loss.backward()
    assert loss.dtype == torch.float32 and h.grad.dtype == torch.bfloat16
    for v in (loss, nll, kl):
        assert torch.isfinite(v).all()
    assert torch.isfinite(h.grad.float()).all() and torch.isfinite(w.grad.float()).all()
    assert rel_err(loss, ref[0]) <= 1e-2
    assert rel_err(kl, ref[2]) <= 5e-2
    assert rel_err(h.grad, ref[3]) <= 3e-2
    assert rel_err(w.grad, ref[4]) <= 3e-2
    # the non-detached direct path in bf16
    e = wb.clone().requires_grad_(True)
    kl_d = augmented_kl_direct(hb, e, e, target, tau, (0,))
    kl_d.backward()
    assert kl_d.dtype == torch.float32 and torch.isfinite(e.grad.float()).all()
    assert rel_err(kl_d, ref[2]) <= 5e-2
