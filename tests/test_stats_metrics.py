"""Unit tests of the pure-torch embedding statistics and the frequency groups.

Every expected value is computed by hand or with an independent numpy implementation.
"""
import math

import numpy as np
import pytest
import torch
from fairseq.data import Dictionary

from fairseq_agg.fairseq_facts.dictionary import madeupword_ids
from fairseq_agg.stats import groups as G
from fairseq_agg.stats.metrics import (
    mean_direction_drift,
    ISOTROPY_FORMS,
    canonical_signs,
    embedding_spectrum,
    isotropy,
    mean_pairwise_cosine,
    singular_values,
    tev_per_token,
    tev_stats,
)
from fairseq_agg.analysis.perplexity import group_nll_sums, perplexity


def _np_logsumexp(x, axis=0):
    m = x.max(axis=axis, keepdims=True)
    return (m + np.log(np.exp(x - m).sum(axis=axis, keepdims=True))).squeeze(axis)


def _np_isotropy(X, C):
    """Reference I(W) in numpy float64 for directions C (rows)."""
    P = X @ C.T
    lp, ln = _np_logsumexp(P, 0), _np_logsumexp(-P, 0)
    both = np.concatenate([lp, ln])
    fixed = np.where(C @ X.mean(0) >= 0, lp, ln)
    return {
        "isotropy": math.exp(both.min() - both.max()),
        "isotropy_raw": math.exp(lp.min() - lp.max()),
        "isotropy_fixed": math.exp(fixed.min() - fixed.max()),
    }


def _random(n, d, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=torch.float64).to(dtype)


# ------------------------------------------------------------------ TEV


def test_tev_closed_form():
    W = torch.tensor([[1.0, -1.0, 1.0, -1.0], [3.0, 3.0, 3.0, 3.0], [1.0, 2.0, 3.0, 4.0]])
    tev = tev_per_token(W)
    # population std: sqrt(mean((x - mean)^2)); Bessel would give sqrt(4/3) and sqrt(5/3)
    assert tev.tolist() == pytest.approx([1.0, 0.0, math.sqrt(1.25)], abs=1e-7)
    s = tev_stats(W, init_std=0.5)
    mu = (1.0 + 0.0 + math.sqrt(1.25)) / 3
    assert s["mu"] == pytest.approx(mu, rel=1e-7)
    assert s["sigma"] == pytest.approx(np.std([1.0, 0.0, math.sqrt(1.25)]), rel=1e-6)
    assert s["mu_over_init"] == pytest.approx(mu / 0.5, rel=1e-7)
    assert s["n"] == 3


def test_tev_matches_numpy_and_default_init_std():
    W = _random(50, 16, seed=1) * 0.3 + 0.1
    s = tev_stats(W)
    per_row = np.std(W.double().numpy(), axis=1)  # numpy default ddof=0 = population
    assert s["mu"] == pytest.approx(per_row.mean(), rel=1e-6)
    assert s["sigma"] == pytest.approx(per_row.std(), rel=1e-5)
    assert s["mu_over_init"] == pytest.approx(per_row.mean() / 16**-0.5, rel=1e-6)


def test_tev_scale_rows_and_chunks():
    W = _random(40, 8, seed=2)
    base = tev_stats(W)
    scaled = tev_stats(W, scale=3.5)
    assert scaled["mu"] == pytest.approx(3.5 * base["mu"], rel=1e-6)
    assert scaled["sigma"] == pytest.approx(3.5 * base["sigma"], rel=1e-6)
    assert scaled["mu_over_init"] == pytest.approx(base["mu_over_init"], rel=1e-6)  # scale-free
    rows = torch.tensor([0, 5, 7, 39])
    assert tev_stats(W, rows)["mu"] == pytest.approx(tev_stats(W[rows])["mu"], rel=1e-7)
    assert tev_stats(W, chunk_rows=3)["sigma"] == pytest.approx(base["sigma"], rel=1e-6)
    with pytest.raises(ValueError, match="out of range"):
        tev_stats(W, torch.tensor([40]))
    with pytest.raises(ValueError, match="no rows"):
        tev_stats(W, torch.tensor([], dtype=torch.long))


def test_tev_bf16_input_matches_float64_reference():
    W = (_random(64, 32, seed=3) * 0.05).to(torch.bfloat16)
    s = tev_stats(W)
    ref = np.std(W.double().numpy(), axis=1)
    assert s["mu"] == pytest.approx(ref.mean(), rel=1e-6)
    assert s["sigma"] == pytest.approx(ref.std(), rel=1e-4)


# ------------------------------------------------------------------ isotropy


def test_isotropy_plus_minus_identity_is_one():
    d = 6
    W = torch.cat([torch.eye(d), -torch.eye(d)])
    # WᵀW = 2I: every orthonormal basis is an eigenbasis; in the standard one Z(±e_j) is the same
    r = isotropy(W, directions=torch.eye(d))
    assert r["isotropy"] == pytest.approx(1.0, abs=1e-12)
    assert r["isotropy_raw"] == pytest.approx(1.0, abs=1e-12)
    assert r["isotropy_fixed"] == pytest.approx(1.0, abs=1e-12)
    # rows ±q_i of a random orthogonal Q, with C = Q: the same by rotation invariance
    Q, _ = torch.linalg.qr(_random(d, d, seed=4, dtype=torch.float64))
    r = isotropy(torch.cat([Q, -Q]), directions=Q)
    assert r["isotropy"] == pytest.approx(1.0, abs=1e-12)


def test_isotropy_closed_form_with_its_own_eigenvectors():
    # rows ±s_j e_j with distinct s_j: the eigenbasis of WᵀW = diag(2 s_j²) is unique up to sign,
    # and Z(±e_j) = 2 cosh(s_j) + 2 (d − 1)
    s = torch.tensor([0.5, 1.0, 1.5, 2.0], dtype=torch.float64)
    d = s.numel()
    W = torch.cat([torch.diag(s), -torch.diag(s)])
    z = 2 * torch.cosh(s) + 2 * (d - 1)
    expected = (z.min() / z.max()).item()
    r = isotropy(W)
    assert r["isotropy"] == pytest.approx(expected, rel=1e-10)
    assert r["isotropy_raw"] == pytest.approx(expected, rel=1e-10)


def test_isotropy_cone_is_far_below_one_and_cloud_is_near_one():
    g = torch.Generator().manual_seed(5)
    v = torch.randn(16, generator=g)
    v = 5.0 * v / v.norm()
    cone = v + 0.1 * torch.randn(500, 16, generator=g)
    cloud = 0.3 * torch.randn(5000, 16, generator=g)
    rc, rr = isotropy(cone), isotropy(cloud)
    # along the cone axis c: Z(c) ≈ n·e^5 and Z(−c) ≈ n·e^−5, the other directions give Z ≈ n
    assert rc["isotropy"] == pytest.approx(math.exp(-10), rel=0.2)
    assert rc["isotropy_fixed"] == pytest.approx(math.exp(-5), rel=0.2)
    assert rr["isotropy"] > 0.9
    assert rc["isotropy"] < rr["isotropy"]


def _np_canonical(C):
    """numpy version of the sign rule: each row's first largest-magnitude coordinate positive."""
    first = np.argmax(np.abs(C) >= np.abs(C).max(axis=1, keepdims=True) * (1 - 1e-9), axis=1)
    return C * np.where(C[np.arange(len(C)), first] < 0, -1.0, 1.0)[:, None]


def test_isotropy_matches_numpy_whatever_the_eigenvector_signs():
    W = _random(200, 8, seed=6) * torch.linspace(0.2, 1.5, 8) + 0.4  # distinct singular values
    X = W.double().numpy()
    _, _, Vt = np.linalg.svd(X, full_matrices=False)
    r = isotropy(W)
    ref = _np_isotropy(X, _np_canonical(Vt))
    for k in ("isotropy", "isotropy_raw", "isotropy_fixed"):
        assert r[k] == pytest.approx(ref[k], rel=1e-9), k
    # the common +0.4 direction makes Z(c) ≠ Z(−c): the raw form of the solver's signs would depend
    # on them; every reported form is the same for any signs of the same eigenvectors
    flips = -np.sign(Vt @ X.mean(0))  # every direction pointing away from the mean
    assert abs(_np_isotropy(X, Vt * flips[:, None])["isotropy_raw"] - _np_isotropy(X, -Vt * flips[:, None])[
        "isotropy_raw"]) > 0.1
    for signs in (flips, -flips, np.where(np.arange(8) % 3 == 0, -1.0, 1.0)):
        flipped = isotropy(W, directions=torch.from_numpy(Vt * signs[:, None]))
        for k in ("isotropy", "isotropy_raw", "isotropy_fixed"):
            assert flipped[k] == pytest.approx(r[k], rel=1e-12), (k, signs)


def test_isotropy_by_hand_when_signs_matter():
    # rows (−2, 0), (0, 1), (0, 1), (0, −2): WᵀW = diag(4, 6), so C = {±e2, ±e1}, eigenvalues apart;
    #   Z(e1) = e⁻² + 3,  Z(−e1) = e² + 3,  Z(e2) = 1 + 2e + e⁻²,  Z(−e2) = 1 + 2/e + e²;
    #   mean(W) = (−1/2, 0): −e1 points towards it, e2 is orthogonal to it (yet Z(e2) ≠ Z(−e2))
    W = torch.tensor([[-2.0, 0.0], [0.0, 1.0], [0.0, 1.0], [0.0, -2.0]], dtype=torch.float64)
    e = math.e
    z_e1, z_minus_e1, z_e2, z_minus_e2 = e**-2 + 3, e**2 + 3, 1 + 2 * e + e**-2, 1 + 2 / e + e**2
    expected = {
        "isotropy": z_e1 / z_minus_e1,  # over C ∪ −C: 3.1353 / 10.3891 = 0.30179
        "isotropy_raw": z_e1 / z_e2,  # canonical signs: +e1 and +e2 (largest coordinate positive): 0.47708
        "isotropy_fixed": z_e2 / z_minus_e1,  # −e1 towards the mean, e2 keeps its canonical sign: 0.63258
    }
    assert [round(expected[k], 5) for k in ISOTROPY_FORMS] == [0.30179, 0.47708, 0.63258]
    bases = ([[1.0, 0.0], [0.0, 1.0]], [[-1.0, 0.0], [0.0, -1.0]], [[0.0, -1.0], [1.0, 0.0]], [[-1.0, 0.0], [0.0, 1.0]])
    for result in [isotropy(W)] + [isotropy(W, directions=torch.tensor(b)) for b in bases]:
        for k in ISOTROPY_FORMS:
            assert result[k] == pytest.approx(expected[k], rel=1e-12), k


def test_isotropy_does_not_depend_on_row_order_chunks_or_solver_signs():
    """Row order and chunking change the Gram matrix by round-off, which may flip the signs the
    eigensolver returns; the reported values stay the same."""
    g = torch.Generator().manual_seed(8)
    W = torch.randn(500, 16, generator=g) * torch.linspace(0.1, 0.6, 16) + 0.3 * torch.randn(16, generator=g)
    r = isotropy(W)
    spec = embedding_spectrum(W)
    perm = torch.randperm(500, generator=g)
    for other in (isotropy(W[perm]), isotropy(W, chunk_rows=37), isotropy(W.double().flip(0)),
                  isotropy(W, directions=-spec.directions), isotropy(W, spectrum=spec)):
        for k in ISOTROPY_FORMS:
            assert other[k] == pytest.approx(r[k], rel=1e-9), k
    # the spectrum's own directions follow the sign rule: first largest coordinate positive
    top = spec.directions.abs().argmax(dim=1)
    assert (spec.directions.gather(1, top[:, None]) > 0).all()
    assert torch.equal(canonical_signs(-spec.directions), spec.directions)


def test_canonical_signs_rule_and_near_ties():
    C = torch.tensor([[0.6, -0.8], [-0.8, 0.6], [0.0, 0.0]], dtype=torch.float64)
    assert canonical_signs(C).tolist() == [[-0.6, 0.8], [0.8, -0.6], [0.0, 0.0]]
    # equal magnitudes up to round-off: the first of them decides, whichever is a hair larger
    h = 2**-0.5
    for row in ([h, -h * (1 + 1e-15)], [h * (1 + 1e-15), -h], [-h, h * (1 + 1e-15)]):
        signed = canonical_signs(torch.tensor([row], dtype=torch.float64))[0]
        assert signed[0] > 0 and signed[1] < 0, row


def test_isotropy_log_space_large_norms_rows_and_chunks():
    # rows ±s_j e_j with s_j = 1000 + j/2: e^{s_j} overflows float64, yet log Z(±e_j) = s_j up to
    # e^{-1000}, so every form of I(W) is exp(s_0 − s_{d−1}) = exp(−(d − 1)/2)
    d = 8
    s = 1000.0 + 0.5 * torch.arange(d, dtype=torch.float64)
    W = torch.cat([torch.diag(s), -torch.diag(s)])
    r = isotropy(W)
    for k in ("isotropy", "isotropy_raw", "isotropy_fixed"):
        assert r[k] == pytest.approx(math.exp(-(d - 1) / 2), rel=1e-9), k
    g = torch.Generator().manual_seed(7)
    W = 1000.0 * torch.randn(300, 8, generator=g)  # exp(cᵀw) overflows float64 directly
    r = isotropy(W)
    rows = torch.arange(0, 300, 3)
    assert isotropy(W, rows)["isotropy"] == pytest.approx(isotropy(W[rows])["isotropy"], rel=1e-9)
    assert isotropy(W, chunk_rows=7)["isotropy"] == pytest.approx(r["isotropy"], rel=1e-9)


# ------------------------------------------------------------------ mean cosine, spectrum


def test_mean_pairwise_cosine_matches_explicit_matrix():
    W = _random(30, 5, seed=8) + 0.5
    X = W.double().numpy()
    U = X / np.linalg.norm(X, axis=1, keepdims=True)
    C = U @ U.T
    n = len(X)
    expected = (C.sum() - np.trace(C)) / (n * (n - 1))
    assert mean_pairwise_cosine(W) == pytest.approx(expected, rel=1e-10)
    assert mean_pairwise_cosine(W, chunk_rows=4) == pytest.approx(expected, rel=1e-10)
    # a zero row (fairseq's padding row) has cosine 0 with every other row
    Wz = torch.cat([W, torch.zeros(1, 5)])
    nz = n + 1
    assert mean_pairwise_cosine(Wz) == pytest.approx((C.sum() - np.trace(C)) / (nz * (nz - 1)), rel=1e-10)
    rows = torch.arange(n)
    assert mean_pairwise_cosine(Wz, rows) == pytest.approx(expected, rel=1e-10)
    assert mean_pairwise_cosine(torch.ones(4, 3)) == pytest.approx(1.0, abs=1e-12)


def test_mean_direction_drift_by_hand():
    # rows (1,0), (1,0), (3,1), (3,-1): m = (2,0), u = (1,0), norms 1, 1, √10, √10
    W = torch.tensor([[1.0, 0.0], [1.0, 0.0], [3.0, 1.0], [3.0, -1.0]])
    d = mean_direction_drift(W)
    assert d["mean_norm_share"] == pytest.approx(2 / ((1 + math.sqrt(10)) / 2), rel=1e-12)
    assert d["drift_frequent"] == pytest.approx(1.0, rel=1e-12) and d["drift_rare"] == pytest.approx(3.0, rel=1e-12)
    assert d["drift_frequent_share"] == pytest.approx(1.0, rel=1e-12)
    assert d["drift_rare_share"] == pytest.approx(3 / math.sqrt(10), rel=1e-12)
    # centred rows (-1,0), (-1,0), (1,1), (1,-1): eigenvectors ±e1, ±e2 of [[4,0],[0,2]];
    # Z(±e1) = 2(e + 1/e), Z(±e2) = 2 + e + 1/e
    e = math.e
    assert d["isotropy_centred"] == pytest.approx((2 + e + 1 / e) / (2 * (e + 1 / e)), rel=1e-9)
    # the rows argument selects and orders (here: the rare rows first), chunks change nothing
    swapped = mean_direction_drift(W, rows=torch.tensor([2, 3, 0, 1]), chunk_rows=3)
    assert swapped["drift_frequent"] == pytest.approx(3.0) and swapped["drift_rare"] == pytest.approx(1.0)
    # an odd count: the frequent half takes the middle row
    odd = mean_direction_drift(torch.tensor([[2.0, 0.0], [1.0, 0.0], [0.0, 0.0]]))
    assert odd["drift_frequent"] == pytest.approx(1.5) and odd["drift_rare"] == pytest.approx(0.0)
    assert odd["drift_rare_share"] is None  # the rare half's one row is zero: no norm to share
    # undefined: a zero mean has no direction, one row no halves
    centred = mean_direction_drift(torch.tensor([[1.0, 2.0], [-1.0, -2.0]]))
    assert centred["drift_rare"] is None and centred["mean_norm_share"] == 0.0
    assert set(mean_direction_drift(W[:1]).values()) == {None}


def test_mean_direction_drift_of_low_precision_rows_matches_float64():
    W = torch.randn(50, 8, generator=torch.Generator().manual_seed(0)) + 0.5
    exact = mean_direction_drift(W.double())
    for dtype in (torch.float32, torch.bfloat16):
        low = mean_direction_drift(W.to(dtype).double())
        got = mean_direction_drift(W.to(dtype))
        assert got == pytest.approx(low, rel=1e-5)
    assert mean_direction_drift(W) == pytest.approx(exact, rel=1e-5)


def test_spectrum_matches_numpy_svd():
    W = _random(60, 7, seed=9) * torch.linspace(0.5, 3.0, 7)
    X = W.double().numpy()
    _, S, Vt = np.linalg.svd(X, full_matrices=False)
    spec = embedding_spectrum(W)
    assert spec.singular_values.numpy() == pytest.approx(S, rel=1e-9)
    for k in range(7):  # directions equal up to sign
        assert abs(float(spec.directions[k].numpy() @ Vt[k])) == pytest.approx(1.0, abs=1e-8)
    assert spec.mean.numpy() == pytest.approx(X.mean(0), rel=1e-12)
    # fewer rows than dimensions: the singular values past the rank are exactly zero
    sv = singular_values(W[:3])
    assert sv[:3].numpy() == pytest.approx(np.linalg.svd(X[:3], compute_uv=False), rel=1e-8)
    assert sv[3:].abs().max().item() == 0.0


# ------------------------------------------------------------------ per-group NLL


def test_group_nll_sums_and_perplexity():
    nll = torch.tensor([1.0, 2.0, 0.5, 4.0, 3.0])
    target = torch.tensor([4, 5, 4, 9, 2])
    lookup = torch.full((10,), -1, dtype=torch.long)
    lookup[4], lookup[5], lookup[9] = 0, 1, 1  # token 2 (eos) is in no group
    sums, counts = group_nll_sums(nll, target, lookup, 3)
    assert sums.tolist() == [1.5, 6.0, 0.0]
    assert counts.tolist() == [2.0, 2.0, 0.0]
    assert perplexity(1.5, 2) == pytest.approx(math.exp(0.75))
    assert perplexity(0.0, 0) is None


# ------------------------------------------------------------------ groups


def _dictionary(counts):
    """A real fairseq Dictionary built like fairseq-preprocess does (finalize + pad to 8)."""
    d = Dictionary()
    for word, c in counts.items():
        d.add_symbol(word, n=c)
    d.finalize(padding_factor=8)
    return d


COUNTS = {f"t{i}": 1000 - 50 * i for i in range(17)}  # t0 most frequent ... t16 least


def test_frequency_groups_on_a_real_dictionary(tmp_path):
    d = _dictionary(dict(reversed(list(COUNTS.items()))))  # insertion order must not matter
    assert len(d) == 24 and d.nspecial == 4  # 4 specials + 17 types + 3 madeupwords
    assert d.symbols[4:8] == ["t0", "t1", "t2", "t3"]
    assert madeupword_ids(d) == [21, 22, 23]
    grp = G.frequency_groups(d)
    # 17 eligible types: boundaries round(0.3*17) = 5 and round(0.8*17) = 14
    assert grp["freq"].tolist() == list(range(4, 9))
    assert grp["med"].tolist() == list(range(9, 18))
    assert grp["rare"].tolist() == list(range(18, 21))
    assert [d[i] for i in grp["rare"]] == ["t14", "t15", "t16"]
    grp2 = G.frequency_groups(d, fractions=(0.5, 0.25, 0.25))  # boundaries 9 (8.5 up) and 13 (12.75)
    assert [g.numel() for g in grp2.values()] == [9, 4, 4]
    # the same groups from the dict.txt fairseq-preprocess writes
    path = tmp_path / "dict.txt"
    d.save(str(path))
    loaded = Dictionary.load(str(path))
    assert {k: v.tolist() for k, v in G.frequency_groups(loaded).items()} == {k: v.tolist() for k, v in grp.items()}
    lookup = G.group_lookup(grp, len(d))
    assert lookup[4] == 0 and lookup[10] == 1 and lookup[20] == 2
    assert lookup[[0, 1, 2, 3, 21, 22, 23]].tolist() == [-1] * 7


def test_row_selection():
    d = _dictionary(COUNTS)
    assert G.select_rows(d, "all").tolist() == list(range(24))
    assert G.select_rows(d).tolist() == [0, 2, 3] + list(range(4, 21))  # no pad (1), no madeupwords
    assert G.select_rows(d, "no-special").tolist() == list(range(4, 21))
    d.add_symbol("never", n=0)  # a real type with count 0 (e.g. from --srcdict)
    assert 24 not in G.select_rows(d, exclude_unseen=True).tolist()
    assert 24 in G.select_rows(d).tolist()
    # without a dictionary: fairseq's layout, pad = 1
    assert G.select_rows(None, num_rows=6).tolist() == [0, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="row policy"):
        G.select_rows(d, "nonsense")
    with pytest.raises(ValueError, match="25 types"):
        G.select_rows(d, num_rows=30)


def test_preset_and_fraction_errors():
    d = _dictionary({f"w{i}": 40000 - i for i in range(36500)})
    grp = G.frequency_groups(d, preset="wikitext103-official")
    # by hand, from the authors' eval_lm.py (mask_high = tokens <= 13000, mask_low = tokens >= 36000,
    # mid the rest): ids 0..13000 frequent (13,001 ids, specials included), 13001..35999 medium
    # (22,999), 36000..V-1 rare
    assert grp["freq"].tolist() == list(range(13001))
    assert grp["med"].tolist() == list(range(13001, 36000))
    assert grp["rare"].tolist() == list(range(36000, len(d)))
    lookup = G.group_lookup(grp, len(d))
    assert lookup[[0, 12999, 13000, 13001, 35999, 36000]].tolist() == [0, 0, 0, 1, 1, 2]
    with pytest.raises(ValueError, match="--embed-group-preset.*more than 36000"):
        G.frequency_groups(_dictionary(COUNTS), preset="wikitext103-official")
    with pytest.raises(ValueError, match="--group-preset: unknown preset"):
        G.frequency_groups(d, preset="nope", flag="--group-preset")
    for bad in ("0.3,0.5", "0.3,0.5,0.3", "a,b,c", "-0.1,0.6,0.5"):
        with pytest.raises(ValueError, match="--embed-group-fractions"):
            G.parse_fractions(bad)
    assert G.parse_fractions("0.2, 0.6, 0.2") == (0.2, 0.6, 0.2)
