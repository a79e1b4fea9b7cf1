"""Unit tests of MLRA (Chung et al., 2024): the low-rank projection math and the attention module.

References are fairseq's own MultiheadAttention (with the same dense matrices), attention written
out head by head from the formulas in float64, and the closed-form parameter counts and init
statistics of docs/mlra.md.
"""
import math

import pytest
import torch
import torch.nn.functional as F
from fairseq.modules import MultiheadAttention

from fairseq_agg.modules.mlra_options import (
    MLRAOptions,
    break_even_rank,
    default_rank,
    parse_targets,
)
from fairseq_agg.modules.low_rank_linear import (
    GPT2_INIT_STD,
    HeadwiseLinear,
    LowRankLinear,
    low_rank_param_count,
    xavier_std,
)
from fairseq_agg.modules.mlra import MultiheadLowRankAttention, mha_param_count, mlra_param_count

torch.set_num_threads(1)


def nparams(m):
    return sum(p.numel() for p in m.parameters())


# ----------------------------------------------------------------------------------------------
# Projection math
# ----------------------------------------------------------------------------------------------

PROJ_CASES = [("shared", "out"), ("per_head", "out"), ("per_head", "in")]


@pytest.mark.parametrize("mode,split", PROJ_CASES)
def test_low_rank_linear_is_x_times_effective_weight(mode, split):
    torch.manual_seed(0)
    p = LowRankLinear(24, 16, rank=3, mode=mode, num_heads=4, split=split).double()
    with torch.no_grad():
        p.up.bias.normal_()
    x = torch.randn(5, 7, 24, dtype=torch.float64)
    w = p.effective_weight()
    assert w.shape == (16, 24)
    torch.testing.assert_close(p(x), x @ w.T + p.bias, rtol=1e-12, atol=1e-12)


def test_effective_weight_by_hand():
    """U D spelled out entry by entry for the per-head split-out case."""
    p = LowRankLinear(3, 4, rank=1, mode="per_head", num_heads=2, split="out", bias=False)
    with torch.no_grad():
        p.down.weight.copy_(torch.tensor([[1.0, 2.0, 3.0], [0.0, 1.0, -1.0]]))  # head 0, head 1
        p.up.weight.copy_(torch.tensor([[[2.0], [-1.0]], [[3.0], [1.0]]]))
    expected = torch.tensor(
        [[2.0, 4.0, 6.0], [-1.0, -2.0, -3.0], [0.0, 3.0, -3.0], [0.0, 1.0, -1.0]]
    )
    torch.testing.assert_close(p.effective_weight(), expected)


@pytest.mark.parametrize("mode,split,rank,bound", [
    ("shared", "out", 5, 5), ("per_head", "out", 2, 4 * 2), ("per_head", "in", 2, 4 * 2)])
def test_effective_weight_rank(mode, split, rank, bound):
    """Shared: rank(UD) <= r. Per head each d_h-block has rank <= r, so the whole <= H r."""
    torch.manual_seed(1)
    p = LowRankLinear(32, 32, rank=rank, mode=mode, num_heads=4, split=split).double()
    w = p.effective_weight().detach()  # the product itself in float64
    assert torch.linalg.matrix_rank(w).item() == bound
    if mode == "per_head":
        blocks = w.view(4, 8, 32) if split == "out" else w.view(32, 4, 8).transpose(0, 1)
        for b in blocks:
            assert torch.linalg.matrix_rank(b).item() == rank


def test_headwise_linear_equals_block_diagonal_matrix():
    torch.manual_seed(2)
    h = HeadwiseLinear(3, 4, 2, bias=True)
    with torch.no_grad():
        h.bias.normal_()
    x = torch.randn(6, 12)
    torch.testing.assert_close(h(x), x @ h.dense_weight().T + h.bias)
    assert h.dense_weight().shape == (6, 12)
    assert torch.count_nonzero(h.dense_weight()[:2, 4:]) == 0


# docs/mlra.md, "Parameter counts": GPT-2 small (d = 768, H = 12, d_h = 64), Q/K/V weights only
@pytest.mark.parametrize("mode,rank,expected", [
    ("shared", 128, 589_824), ("shared", 192, 884_736), ("shared", 256, 1_179_648),
    ("per_head", 16, 479_232), ("per_head", 32, 958_464), ("per_head", 48, 1_437_696),
    ("per_head", 64, 1_916_928)])
def test_param_counts_match_the_gpt2_small_numbers(mode, rank, expected):
    qkv = [LowRankLinear(768, 768, rank, mode, 12, "out", bias=False) for _ in range(3)]
    assert sum(nparams(p) for p in qkv) == expected
    assert 3 * low_rank_param_count(768, 768, rank, mode, 12, bias=False) == expected
    assert 3 * 768 * 768 == 1_769_472  # the dense reference of the same table


def test_break_even_ranks():
    assert break_even_rank("shared", 768, 12) == 384
    assert break_even_rank("per_head", 768, 12) == pytest.approx(768 * 64 / (768 + 64))
    # just below / above break-even in shared mode
    assert 3 * low_rank_param_count(768, 768, 383, "shared", 12, bias=False) < 3 * 768 ** 2
    assert 3 * low_rank_param_count(768, 768, 385, "shared", 12, bias=False) > 3 * 768 ** 2


@pytest.mark.parametrize("d,h,r,mode,targets,kdim", [
    (64, 4, 16, "shared", "q,k,v", None), (64, 4, 16, "shared", "q,k,v,o", None),
    (64, 8, 3, "per_head", "q,k,v", None), (64, 8, 3, "per_head", "q,k,v,o", None),
    (48, 4, 7, "shared", "k,v", 40), (48, 4, 5, "per_head", "q,v,o", 40)])
def test_module_param_count_matches_formulas(d, h, r, mode, targets, kdim):
    m = MultiheadLowRankAttention(d, h, kdim=kdim, vdim=kdim, encoder_decoder_attention=kdim is not None,
                                  self_attention=kdim is None, rank=r, mode=mode, targets=targets)
    kd = kdim or d
    dims = {"q": d, "k": kd, "v": kd, "o": d}
    # hand formulas: shared r (d_in + d_out) + d_out; per head H r (d_in + d_h) + d_out for Q/K/V,
    # H r (d_h + d_out) + d_out for O; a dense projection has d_in d_out + d_out
    expected = 0
    for t, d_in in dims.items():
        if t in targets:
            if mode == "shared":
                expected += r * (d_in + d) + d
            elif t == "o":
                expected += h * r * (d // h + d) + d
            else:
                expected += h * r * (d_in + d // h) + d
        else:
            expected += d_in * d + d
    assert nparams(m) == expected
    assert mlra_param_count(d, h, r, mode, parse_targets(targets), kdim, kdim) == expected
    ref = MultiheadAttention(d, h, kdim=kdim, vdim=kdim, encoder_decoder_attention=kdim is not None,
                             self_attention=kdim is None)
    assert m.dense_param_count() == nparams(ref) == mha_param_count(d, kdim, kdim)


def test_default_ranks():
    assert default_rank("shared", 512, 8) == 128  # d / 4
    assert default_rank("per_head", 512, 8) == 32  # d_h / 2
    m = MultiheadLowRankAttention(512, 8, self_attention=True)
    assert m.rank == 128 and m.mode == "shared" and m.targets == ("q", "k", "v")
    assert isinstance(m.out_proj, torch.nn.Linear)  # O stays dense by default


# ----------------------------------------------------------------------------------------------
# Initialisation (docs/mlra.md, "Initialisation")
# ----------------------------------------------------------------------------------------------


def test_gpt2_init_product_std():
    torch.manual_seed(3)
    d, r = 512, 64
    p = LowRankLinear(d, d, r, "shared")
    assert p.down.weight.std().item() == pytest.approx(GPT2_INIT_STD, rel=0.02)
    assert p.up.weight.std().item() == pytest.approx(GPT2_INIT_STD, rel=0.02)
    # Var(UD) = r sigma^4: std sqrt(64) * 0.02^2 = 0.0032
    assert p.effective_weight().std().item() == pytest.approx(math.sqrt(r) * GPT2_INIT_STD ** 2, rel=0.05)
    assert torch.count_nonzero(p.up.bias) == 0


@pytest.mark.parametrize("mode,target", [("shared", "q"), ("per_head", "q"), ("shared", "o"), ("per_head", "o")])
def test_matched_init_reproduces_fairseq_dense_std(mode, target):
    """matched: the product has the per-entry std of fairseq's Xavier-initialised dense matrix."""
    torch.manual_seed(4)
    d, h = 512, 8
    m = MultiheadLowRankAttention(d, h, self_attention=True, rank=16, mode=mode, init="matched",
                                  targets="q,k,v,o")
    stock = MultiheadAttention(d, h, self_attention=True)
    name = "out_proj" if target == "o" else "q_proj"
    stock_std = getattr(stock, name).weight.std().item()
    # closed form: (2d)^-1/2 for q (gain 1/sqrt 2), d^-1/2 for the output projection
    closed = (2 * d) ** -0.5 if target == "q" else d ** -0.5
    assert stock_std == pytest.approx(closed, rel=0.02)
    assert m.dense_std(target) == pytest.approx(closed, rel=1e-12)
    assert getattr(m, name).effective_weight().std().item() == pytest.approx(closed, rel=0.05)


def test_matched_init_encoder_decoder_dims():
    m = MultiheadLowRankAttention(32, 4, kdim=48, vdim=48, encoder_decoder_attention=True,
                                  init="matched", rank=8)
    assert m.dense_std("k") == pytest.approx(xavier_std(48, 32))  # gain 1 when dims differ


# ----------------------------------------------------------------------------------------------
# Equivalence with fairseq's MultiheadAttention at full rank
# ----------------------------------------------------------------------------------------------


def _proj(module, t):
    return getattr(module, "out_proj" if t == "o" else t + "_proj")


def copy_dense_into_factors(mlra, mha):
    """Sets every factorised projection to U D = the MHA matrix exactly (identity factors), and
    copies the dense ones and the biases."""
    with torch.no_grad():
        for t in ("q", "k", "v", "o"):
            dst, src = _proj(mlra, t), _proj(mha, t)
            if not isinstance(dst, LowRankLinear):
                dst.weight.copy_(src.weight)
                dst.bias.copy_(src.bias)
                continue
            w = src.weight
            if dst.mode == "shared":  # U = I (d x d), D = W (d x d_in)
                dst.up.weight.copy_(torch.eye(dst.rank))
                dst.down.weight.copy_(w)
            elif dst.split == "out":  # D = W's rows (head by head), U^(h) = I
                dst.down.weight.copy_(w)
                dst.up.weight.copy_(torch.eye(dst.rank).expand(dst.num_heads, -1, -1))
            else:  # D^(h) = I, U = W
                dst.down.weight.copy_(torch.eye(dst.rank).expand(dst.num_heads, -1, -1))
                dst.up.weight.copy_(w)
            dst.up.bias.copy_(src.bias)
            assert torch.equal(dst.effective_weight(), w)
        if mha.bias_k is not None:
            mlra.bias_k.copy_(mha.bias_k)
            mlra.bias_v.copy_(mha.bias_v)


def make_pair(d=16, h=4, mode="shared", targets="q,k,v", kdim=None, seed=0, **kw):
    torch.manual_seed(seed)
    enc_dec = kdim is not None
    common = dict(kdim=kdim, vdim=kdim, self_attention=not enc_dec, encoder_decoder_attention=enc_dec, **kw)
    mha = MultiheadAttention(d, h, **common)
    with torch.no_grad():  # a non-trivial attention pattern
        for p in mha.parameters():
            p.normal_(0, 0.4)
    rank = d if mode == "shared" else d // h
    mlra = MultiheadLowRankAttention(d, h, rank=rank, mode=mode, targets=targets, **common)
    copy_dense_into_factors(mlra, mha)
    return mha.eval(), mlra.eval()


def future_mask(t):
    # the mask fairseq's decoders pass (TransformerDecoderBase.buffered_future_mask)
    return torch.triu(torch.full((t, t), float("-inf")), 1)


MODES = [("shared", "q,k,v"), ("shared", "q,k,v,o"), ("per_head", "q,k,v"), ("per_head", "q,k,v,o")]


@pytest.mark.parametrize("mode,targets", MODES)
def test_self_attention_matches_fairseq(mode, targets):
    mha, mlra = make_pair(mode=mode, targets=targets)
    T, B = 7, 3
    x = torch.randn(T, B, 16)
    kpm = torch.zeros(B, T, dtype=torch.bool)
    kpm[1, -3:] = True
    for mask in (None, future_mask(T)):
        for pad in (None, kpm):
            ref, ref_w = mha(x, x, x, key_padding_mask=pad, attn_mask=mask, need_weights=True)
            out, w = mlra(x, x, x, key_padding_mask=pad, attn_mask=mask, need_weights=False)
            assert w is None
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
            out, w = mlra(x, x, x, key_padding_mask=pad, attn_mask=mask, need_weights=True)
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(w, ref_w, atol=1e-5, rtol=1e-5)
            assert w.shape == (B, T, T)


def test_head_weights_and_before_softmax_match_fairseq():
    mha, mlra = make_pair(mode="per_head")
    T, B = 5, 2
    x = torch.randn(T, B, 16)
    # MultiheadAttention returns per-head weights only on its explicit (incremental) path
    ref_out, ref_w = mha(x, x, x, attn_mask=future_mask(T), need_head_weights=True, incremental_state={})
    out, w = mlra(x, x, x, attn_mask=future_mask(T), need_head_weights=True)
    assert w.shape == (4, B, T, T)
    torch.testing.assert_close(w, ref_w, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    assert w.dtype == torch.float32
    torch.testing.assert_close(w.sum(-1), torch.ones(4, B, T))
    ref_s, ref_v = mha(x, x, x, attn_mask=future_mask(T), before_softmax=True, incremental_state={})
    s, v = mlra(x, x, x, attn_mask=future_mask(T), before_softmax=True)
    assert s.shape == ref_s.shape == (B * 4, T, T) and v.shape == ref_v.shape
    torch.testing.assert_close(s, ref_s, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v, ref_v, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["shared", "per_head"])
def test_encoder_decoder_attention_matches_fairseq(mode):
    mha, mlra = make_pair(d=16, h=4, mode=mode, targets="q,k,v,o", kdim=24)
    T, S, B = 4, 6, 3
    q = torch.randn(T, B, 16)
    enc = torch.randn(S, B, 24)
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[0, :2] = True  # left padding, as fairseq's source side
    for need in (False, True):
        ref, ref_w = mha(q, enc, enc, key_padding_mask=kpm, static_kv=True, need_weights=need)
        out, w = mlra(q, enc, enc, key_padding_mask=kpm, static_kv=True, need_weights=need)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        if need:
            torch.testing.assert_close(w, ref_w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kw", [{"add_bias_kv": True}, {"add_zero_attn": True}])
def test_bias_kv_and_zero_attn_match_fairseq(kw):
    mha, mlra = make_pair(**kw)
    x = torch.randn(5, 2, 16)
    kpm = torch.zeros(2, 5, dtype=torch.bool)
    kpm[0, -1] = True
    ref, ref_w = mha(x, x, x, key_padding_mask=kpm, need_weights=True)
    out, w = mlra(x, x, x, key_padding_mask=kpm, need_weights=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w, ref_w, atol=1e-5, rtol=1e-5)
    out2, _ = mlra(x, x, x, key_padding_mask=kpm, need_weights=False)
    torch.testing.assert_close(out2, ref, atol=1e-5, rtol=1e-5)


def test_output_depends_on_the_factors():
    """Guards against a dense fast path: the factors are what the forward uses."""
    mha, mlra = make_pair(targets="q,k,v,o")
    x = torch.randn(5, 2, 16)
    base, _ = mlra(x, x, x, need_weights=False)
    for t in ("q", "k", "v", "o"):
        p = _proj(mlra, t)
        assert not hasattr(p, "weight")
        with torch.no_grad():  # U (2 D) / 2 = U D: the same map, the same output
            p.down.weight.mul_(2.0)
            p.up.weight.mul_(0.5)
        out, _ = mlra(x, x, x, need_weights=False)
        torch.testing.assert_close(out, base, atol=1e-5, rtol=1e-5)
        with torch.no_grad():  # a different map: the output changes
            p.down.weight[0].add_(1.0)
        out, _ = mlra(x, x, x, need_weights=False)
        assert (out - base).abs().max() > 1e-3
        with torch.no_grad():
            p.down.weight[0].sub_(1.0)


def test_fused_weight_cache_follows_in_place_updates():
    """Without autograd the fused Q/K/V down-projection is cached; an optimizer-style in-place
    update of one factor must still change the output."""
    mha, mlra = make_pair(targets="q,k,v")
    x = torch.randn(5, 2, 16)
    with torch.no_grad():
        base, _ = mlra(x, x, x, need_weights=False)
        torch.testing.assert_close(base, mha(x, x, x)[0], atol=1e-5, rtol=1e-5)
        mlra.k_proj.down.weight.mul_(1.5)
        mha.k_proj.weight.mul_(1.5)
        out, _ = mlra(x, x, x, need_weights=False)
        assert (out - base).abs().max() > 1e-3
        torch.testing.assert_close(out, mha(x, x, x)[0], atol=1e-5, rtol=1e-5)


def test_gradients_equal_chain_rule_through_fairseq():
    """With U = I, D = W: dL/dD = dL/dW and dL/dU = dL/dW W^T, dL/dW from fairseq's module."""
    mha, mlra = make_pair(targets="q,k,v")
    mha.train(), mlra.train()  # dropout is 0: train mode only enables autograd-relevant paths
    x = torch.randn(6, 3, 16)
    target = torch.randn(6, 3, 16)
    mask = future_mask(6)
    F.mse_loss(mha(x, x, x, attn_mask=mask, need_weights=False)[0], target).backward()
    F.mse_loss(mlra(x, x, x, attn_mask=mask, need_weights=False)[0], target).backward()
    for t in ("q", "k", "v"):
        gw, w = _proj(mha, t).weight.grad, _proj(mha, t).weight
        p = _proj(mlra, t)
        torch.testing.assert_close(p.down.weight.grad, gw, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(p.up.weight.grad, gw @ w.detach().T, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(p.up.bias.grad, _proj(mha, t).bias.grad, atol=1e-6, rtol=1e-5)
        assert p.down.weight.grad.abs().sum() > 0 and p.up.weight.grad.abs().sum() > 0
    torch.testing.assert_close(mlra.out_proj.weight.grad, mha.out_proj.weight.grad, atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------------------------
# Rank r < d against attention written out from the formulas
# ----------------------------------------------------------------------------------------------


def project_by_formula(p, x):
    """P(x) = U_P (D_P x) + b_P with the factors of docs/mlra.md ("What it does"), head by head."""
    if not isinstance(p, LowRankLinear):
        return x @ p.weight.T + p.bias
    H, r = p.num_heads, p.rank
    if p.mode == "shared":  # D: r x d_in, U: d x r
        return (x @ p.down.weight.T) @ p.up.weight.T + p.bias
    if p.split == "out":  # head h: D^(h) r x d_in (rows h r .. h r + r of the down map), U^(h) d_h x r
        D = p.down.weight.view(H, r, -1)
        return torch.cat([(x @ D[h].T) @ p.up.weight[h].T for h in range(H)], dim=-1) + p.bias
    # O: head h's d_h slice through D^(h) r x d_h, then U^(h) d x r (columns h r .. h r + r), summed
    dh = x.size(-1) // H
    U = p.up.weight.view(-1, H, r)
    return sum((x[..., h * dh:(h + 1) * dh] @ p.down.weight[h].T) @ U[:, h].T for h in range(H)) + p.bias


def attention_by_formula(m, query, key, value, attn_mask=None, key_padding_mask=None):
    """softmax(q_h k_h^T / sqrt(d_h) + mask) v_h for every sentence b and head h, then O:
    returns the output (T x B x d) and the per-head weights (H x B x T x S)."""
    q = project_by_formula(m.q_proj, query) * m.head_dim ** -0.5
    k, v = project_by_formula(m.k_proj, key), project_by_formula(m.v_proj, value)
    T, B, _ = q.shape
    ctx = torch.zeros_like(q)
    weights = q.new_zeros(m.num_heads, B, T, k.size(0))
    for b in range(B):
        for h in range(m.num_heads):
            cols = slice(h * m.head_dim, (h + 1) * m.head_dim)
            scores = q[:, b, cols] @ k[:, b, cols].T
            if attn_mask is not None:
                scores = scores + attn_mask
            if key_padding_mask is not None:
                scores = scores.masked_fill(key_padding_mask[b], float("-inf"))
            weights[h, b] = torch.softmax(scores, dim=-1)
            ctx[:, b, cols] = weights[h, b] @ v[:, b, cols]
    return project_by_formula(m.out_proj, ctx), weights


def random_factors(m, seed):
    """Every weight and bias of m drawn anew (non-zero biases), in float64."""
    torch.manual_seed(seed)
    m.double()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.5)
    return m.eval()


@pytest.mark.parametrize("mode,rank", [("shared", 5), ("per_head", 2)])
@pytest.mark.parametrize("targets", ["q,k,v", "q,k,v,o", "k,v,o"])
def test_low_rank_self_attention_equals_formula(mode, rank, targets):
    """At rank r < d (shared) or r < d_h (per head), the SDPA path and the explicit path both equal
    attention computed by hand from the factors, with every mask fairseq passes."""
    m = random_factors(MultiheadLowRankAttention(16, 4, self_attention=True, rank=rank, mode=mode,
                                                 targets=targets), seed=11)
    assert all(torch.linalg.matrix_rank(_proj(m, t).effective_weight()).item() < 16
               for t in parse_targets(targets))
    T, B = 6, 3
    x = torch.randn(T, B, 16, dtype=torch.float64)
    kpm = torch.zeros(B, T, dtype=torch.bool)
    kpm[2, -2:] = True
    for mask in (None, future_mask(T).double()):
        for pad in (None, kpm):
            ref, ref_w = attention_by_formula(m, x, x, x, mask, pad)
            out, w = m(x, x, x, key_padding_mask=pad, attn_mask=mask, need_weights=False)
            assert w is None
            torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
            # the explicit path runs its softmax in fp32, as fairseq does
            out, w = m(x, x, x, key_padding_mask=pad, attn_mask=mask, need_head_weights=True)
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(w.double(), ref_w, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("mode,rank", [("shared", 3), ("per_head", 1)])
def test_low_rank_encoder_decoder_attention_equals_formula(mode, rank):
    m = random_factors(MultiheadLowRankAttention(16, 4, kdim=24, vdim=24, encoder_decoder_attention=True,
                                                 rank=rank, mode=mode, targets="q,k,v,o"), seed=12)
    q = torch.randn(4, 2, 16, dtype=torch.float64)
    enc = torch.randn(7, 2, 24, dtype=torch.float64)
    kpm = torch.zeros(2, 7, dtype=torch.bool)
    kpm[1, :3] = True  # left padding, as fairseq's source side
    ref, _ = attention_by_formula(m, q, enc, enc, key_padding_mask=kpm)
    for need, tol in ((False, 1e-10), (True, 1e-5)):  # the explicit path's softmax is fp32
        out, _ = m(q, enc, enc, key_padding_mask=kpm, static_kv=True, need_weights=need)
        torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


# ----------------------------------------------------------------------------------------------
# Incremental decoding and beam reorder
# ----------------------------------------------------------------------------------------------


def test_incremental_decoding_equals_causal_forward_and_cache_shapes():
    torch.manual_seed(5)
    m = MultiheadLowRankAttention(16, 4, self_attention=True, rank=3, mode="per_head").eval()
    mha = MultiheadAttention(16, 4, self_attention=True).eval()
    T, B = 6, 3
    x = torch.randn(T, B, 16)
    full, _ = m(x, x, x, attn_mask=future_mask(T), need_weights=False)
    state, mha_state = {}, {}
    for t in range(T):
        xt = x[t : t + 1]
        out, _ = m(xt, xt, xt, incremental_state=state, need_weights=False)
        torch.testing.assert_close(out[0], full[t], atol=1e-5, rtol=1e-5)
        mha(xt, xt, xt, incremental_state=mha_state, need_weights=False)
        buf, ref_buf = m._get_input_buffer(state), mha._get_input_buffer(mha_state)
        assert set(buf) == set(ref_buf) == {"prev_key", "prev_value", "prev_key_padding_mask"}
        assert buf["prev_key"].shape == ref_buf["prev_key"].shape == (B, 4, t + 1, 4)
        assert buf["prev_value"].shape == ref_buf["prev_value"].shape


def test_beam_reorder_equals_forward_on_reordered_history():
    torch.manual_seed(6)
    m = MultiheadLowRankAttention(16, 4, self_attention=True, rank=5).eval()
    B = 4
    hist = torch.randn(3, B, 16)
    state = {}
    for t in range(3):
        m(hist[t : t + 1], hist[t : t + 1], hist[t : t + 1], incremental_state=state)
    new_order = torch.tensor([2, 2, 0, 3])
    m.reorder_incremental_state(state, new_order)
    xt = torch.randn(1, B, 16)
    out, _ = m(xt, xt, xt, incremental_state=state, need_weights=False)
    seq = torch.cat([hist[:, new_order], xt])
    full, _ = m(seq, seq, seq, attn_mask=future_mask(4), need_weights=False)
    torch.testing.assert_close(out[0], full[-1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["shared", "per_head"])
def test_beam_search_state_matches_fairseq(mode):
    """A decoder step loop as fairseq's SequenceGenerator drives it (beam-shared encoder K/V,
    cache reorders, a finished sentence dropped from the batch): equal to MultiheadAttention."""
    sa_ref, sa = make_pair(mode=mode, targets="q,k,v,o", seed=7)
    ca_ref, ca = make_pair(mode=mode, targets="q,k,v", kdim=24, seed=8)
    beam, bsz, S = 2, 3, 5
    for mod in (ca_ref, ca):
        mod.set_beam_size(beam)
    enc = torch.randn(S, bsz, 24).repeat_interleave(beam, dim=1)  # as reorder_encoder_out
    enc_pad = torch.zeros(bsz, S, dtype=torch.bool)
    enc_pad[1, :2] = True
    enc_pad = enc_pad.repeat_interleave(beam, dim=0)
    states = ({}, {})
    n = bsz * beam
    for step in range(4):
        x = torch.randn(1, n, 16)
        outs = []
        for (s_mod, c_mod), st in zip(((sa_ref, ca_ref), (sa, ca)), states):
            h, _ = s_mod(x, x, x, incremental_state=st, need_weights=False)
            o, w = c_mod(h, enc, enc, key_padding_mask=enc_pad, incremental_state=st,
                         static_kv=True, need_weights=True)
            outs.append((o, w))
        torch.testing.assert_close(outs[1][0], outs[0][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(outs[1][1], outs[0][1], atol=1e-5, rtol=1e-5)
        buf = ca._get_input_buffer(states[1])
        assert buf["prev_key"].shape[0] == enc.size(1) // beam  # one K/V copy per sentence
        if step == 1:  # beams swap inside sentences
            order = torch.tensor([1, 0, 2, 2, 5, 4])
        elif step == 2:  # sentence 1 finished: drop it, as SequenceGenerator does
            order = torch.tensor([0, 1, 4, 5])
            enc, enc_pad = enc[:, order], enc_pad[order]
        else:
            order = torch.arange(n)
        for mod_pair, st in zip(((sa_ref, ca_ref), (sa, ca)), states):
            for mod in mod_pair:
                mod.reorder_incremental_state(st, order)
        n = order.numel()


@pytest.fixture
def sdpa_query_shapes(monkeypatch):
    """The query shape of every F.scaled_dot_product_attention call."""
    shapes = []
    real = F.scaled_dot_product_attention

    def spy(q, *args, **kwargs):
        shapes.append(tuple(q.shape))
        return real(q, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return shapes


@pytest.mark.parametrize("mode", ["shared", "per_head"])
def test_beam_folded_sdpa_equals_unfolded_computation(mode, sdpa_query_shapes):
    """Encoder-decoder attention in beam search keeps one K/V copy per sentence and folds the beams
    into the query length of one SDPA call. Its output equals the same module run without folding
    (beam size 1: every beam with its own K/V copy) and attention written out by hand, through
    cached decoding steps, beam reorders and a finished sentence dropped from the batch."""
    m = random_factors(MultiheadLowRankAttention(16, 4, kdim=24, vdim=24, encoder_decoder_attention=True,
                                                 rank=2, mode=mode, targets="q,k,v,o"), seed=13)
    beam, bsz, S, H, dh = 2, 3, 5, 4, 4
    enc = torch.randn(S, bsz, 24, dtype=torch.float64).repeat_interleave(beam, dim=1)
    enc_pad = torch.zeros(bsz, S, dtype=torch.bool)
    enc_pad[1, :2] = True
    enc_pad = enc_pad.repeat_interleave(beam, dim=0)

    # several target positions at once (no cache), with an additive alignment-style mask
    q = torch.randn(3, bsz * beam, 16, dtype=torch.float64)
    mask = torch.zeros(3, S, dtype=torch.float64)
    mask[0, -1] = float("-inf")
    ref, _ = attention_by_formula(m, q, enc, enc, mask, enc_pad)
    m.set_beam_size(beam)
    folded, w = m(q, enc, enc, key_padding_mask=enc_pad, attn_mask=mask, static_kv=True, need_weights=False)
    assert w is None and sdpa_query_shapes[-1] == (bsz, H, beam * 3, dh)
    m.set_beam_size(1)
    unfolded, _ = m(q, enc, enc, key_padding_mask=enc_pad, attn_mask=mask, static_kv=True, need_weights=False)
    assert sdpa_query_shapes[-1] == (bsz * beam, H, 3, dh)
    torch.testing.assert_close(folded, unfolded, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(folded, ref, atol=1e-10, rtol=1e-10)

    # cached decoding steps as SequenceGenerator drives them
    folded_state, unfolded_state = {}, {}
    n = bsz * beam
    for step in range(4):
        q = torch.randn(1, n, 16, dtype=torch.float64)
        m.set_beam_size(beam)
        folded, _ = m(q, enc, enc, key_padding_mask=enc_pad, incremental_state=folded_state,
                      static_kv=True, need_weights=False)
        assert sdpa_query_shapes[-1] == (n // beam, H, beam, dh)
        assert m._get_input_buffer(folded_state)["prev_key"].shape == (n // beam, H, S, dh)
        m.set_beam_size(1)
        unfolded, _ = m(q, enc, enc, key_padding_mask=enc_pad, incremental_state=unfolded_state,
                        static_kv=True, need_weights=False)
        assert m._get_input_buffer(unfolded_state)["prev_key"].shape == (n, H, S, dh)
        torch.testing.assert_close(folded, unfolded, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(folded, attention_by_formula(m, q, enc, enc, None, enc_pad)[0],
                                   atol=1e-10, rtol=1e-10)
        if step == 1:  # beams swap inside sentences
            order = torch.tensor([1, 0, 2, 2, 5, 4])
        elif step == 2:  # sentence 1 finished: dropped, as SequenceGenerator does
            order = torch.tensor([0, 1, 4, 5])
            enc, enc_pad = enc[:, order], enc_pad[order]
        else:
            order = torch.arange(n)
        m.set_beam_size(beam)
        m.reorder_incremental_state(folded_state, order)
        m.set_beam_size(1)
        m.reorder_incremental_state(unfolded_state, order)
        n = order.numel()


# ----------------------------------------------------------------------------------------------
# The SDPA path, masks, dtypes
# ----------------------------------------------------------------------------------------------


def test_sdpa_path_and_causal_flag(monkeypatch):
    calls = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    m = MultiheadLowRankAttention(16, 4, self_attention=True, rank=4, dropout=0.25)
    x = torch.randn(5, 2, 16)
    m.eval()
    m(x, x, x, attn_mask=future_mask(5), need_weights=False)
    assert calls[-1]["is_causal"] is True and calls[-1]["attn_mask"] is None
    assert calls[-1]["dropout_p"] == 0.0
    kpm = torch.zeros(2, 5, dtype=torch.bool)
    kpm[0, -1] = True
    m(x, x, x, attn_mask=future_mask(5), key_padding_mask=kpm, need_weights=False)
    assert calls[-1]["is_causal"] is False and calls[-1]["attn_mask"].shape == (2, 1, 5, 5)
    m.train()
    m(x, x, x, need_weights=False)
    assert calls[-1]["dropout_p"] == 0.25
    n = len(calls)
    m(x, x, x, need_weights=True)  # weights requested: the explicit path
    assert len(calls) == n


def test_causal_mask_detection_and_cache():
    m = MultiheadLowRankAttention(16, 4, self_attention=True, rank=4)
    mask = future_mask(6)
    assert m._is_causal_mask(mask)
    assert m._is_causal_mask(mask[:4, :4])  # the slice fairseq's buffered mask hands out
    assert m._is_causal_mask(torch.triu(torch.ones(5, 5, dtype=torch.bool), 1))
    window = mask.clone()
    window[3, 0] = float("-inf")  # a local-window mask is not causal
    assert not m._is_causal_mask(window)
    assert not m._is_causal_mask(torch.zeros(4, 6))
    assert m._is_causal_mask(mask)
    mask[5, 0] = float("-inf")  # edited in place: the cached answer must not be reused
    assert not m._is_causal_mask(mask)


def test_additive_encoder_style_mask_matches_fairseq():
    """TransformerEncoderLayer turns boolean masks into -1e8 additive ones."""
    mha, mlra = make_pair()
    x = torch.randn(5, 2, 16)
    mask = torch.zeros(5, 5)
    mask[:, 1] = -1e8
    torch.testing.assert_close(mlra(x, x, x, attn_mask=mask, need_weights=False)[0],
                               mha(x, x, x, attn_mask=mask)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_is_close_to_fp32(dtype):
    torch.manual_seed(9)
    m = MultiheadLowRankAttention(32, 4, self_attention=True, rank=8, init="matched").eval()
    x = torch.randn(6, 2, 32)
    ref, ref_w = m(x, x, x, attn_mask=future_mask(6), need_weights=True)
    mh = m.to(dtype)
    for need in (False, True):
        out, w = mh(x.to(dtype), x.to(dtype), x.to(dtype), attn_mask=future_mask(6).to(dtype),
                    need_weights=need)
        assert out.dtype == dtype and torch.isfinite(out).all()
        torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)
        if need:  # the softmax runs in fp32
            assert w.dtype == torch.float32
            torch.testing.assert_close(w, ref_w, atol=2e-2, rtol=2e-2)


# ----------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rank", [0, -1, 17, 2.5])
def test_shared_rank_out_of_range_names_flag_and_range(rank):
    with pytest.raises(ValueError, match=r"--attention-rank .* 1 <= r <= 16 \(the embedding dim\)"):
        MultiheadLowRankAttention(16, 4, self_attention=True, rank=rank)


def test_per_head_rank_out_of_range_names_flag_and_range():
    with pytest.raises(ValueError, match=r"--attention-rank 5 .*per_head.* 1 <= r <= 4 \(the head dim\)"):
        MLRAOptions(rank=5, mode="per_head").rank_for(16, 4, "decoder self-attention")
    assert MLRAOptions(rank=4, mode="per_head").rank_for(16, 4) == 4


def test_bad_targets_and_mode():
    with pytest.raises(ValueError, match="--mlra-targets"):
        parse_targets("q,x")
    with pytest.raises(ValueError, match="--mlra-targets"):
        parse_targets("")
    assert parse_targets("v, Q") == ("q", "v")
    with pytest.raises(ValueError, match="--mlra-mode"):
        MultiheadLowRankAttention(16, 4, self_attention=True, mode="blocks")
    with pytest.raises(ValueError, match="--mlra-init"):
        MultiheadLowRankAttention(16, 4, self_attention=True, init="xavier")
