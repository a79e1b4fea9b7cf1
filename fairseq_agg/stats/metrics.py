"""Token-embedding statistics as pure torch functions (formulas and precision: docs/stats.md).

Every function takes an embedding matrix ``W`` of shape ``[V, d]`` (any dtype, any device) and an
optional 1-D index tensor ``rows`` selecting the rows to use. Rows are processed in chunks, so no
full-size float64 copy of ``W`` and no ``V x V`` matrix is ever built; low-precision weights are
upcast chunk by chunk.

* :func:`tev_stats` - token embedding variability (Chung et al., EMNLP 2024, §2 "Pre-training
  Stability Proxy"): TEV_i is the population std of row i over its d coordinates, in fp32;
  µTEV / σTEV are its mean and population std over the rows.
* :func:`isotropy` - I(W) = min_c Z(c) / max_c Z(c), Z(c) = Σ_i exp(cᵀw_i), C = unit eigenvectors
  of WᵀW (Mu & Viswanath, ICLR 2018; the isotropy of Yu et al., ACL 2022, Table 1), float64 and
  log-sum-exp. An eigenvector's sign is arbitrary (each solver, device and summation order may
  return either), so no form uses it: the headline value is the sign-symmetric form over C ∪ −C;
  the paper's form ("raw") takes each c with the sign :func:`canonical_signs` gives it, and the
  sign-fixed form turns each c towards mean(W).
* :func:`mean_pairwise_cosine` - mean over i ≠ j of cos(w_i, w_j) = (‖Σŵ_i‖² − Σ‖ŵ_i‖²) / (n(n−1))
  (the quantity CosReg of Gao et al., ICLR 2019, regularises), exact and O(V·d).
* :func:`embedding_spectrum` - singular values and right-singular directions (float64).
* :func:`mean_direction_drift` - how far the rows have moved together along their common mean
  direction u = m/‖m‖, m = mean(W): ‖m‖ / mean ‖w_i‖, the mean projection wᵀu of the frequent and
  the rare half of the rows (dictionary order is frequency order), each also as a share of its
  half's mean row norm, and I(W) of the centred rows (the isotropy left without the common offset).

Per-group perplexity is in :mod:`fairseq_agg.analysis.perplexity`.
"""
import math
from typing import Dict, NamedTuple, Optional

import torch

DEFAULT_CHUNK_ROWS = 8192
# Relative size below which two coordinates of a unit vector count as equally large, and a
# direction as orthogonal to the mean row (relative to the rows' RMS norm), in the sign rules:
# far above the ~1e-15 by which two eigensolvers' fp64 eigenvectors differ, far below any
# difference that means something.
SIGN_TIE_RTOL = 1e-9
# the three forms :func:`isotropy` returns
ISOTROPY_FORMS = ("isotropy", "isotropy_raw", "isotropy_fixed")


def _check_matrix(W: torch.Tensor) -> None:
    if not torch.is_tensor(W) or W.dim() != 2:
        raise ValueError(f"expected a 2-D embedding matrix [V, d], got {getattr(W, 'shape', type(W))}")


def _as_rows(W: torch.Tensor, rows: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if rows is None:
        return None
    rows = torch.as_tensor(rows, dtype=torch.long, device=W.device).reshape(-1)
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= W.size(0)):
        raise ValueError(f"row index out of range for a matrix with {W.size(0)} rows")
    return rows


def _num_rows(W, rows) -> int:
    return W.size(0) if rows is None else rows.numel()


def _iter_chunks(W, rows, dtype, chunk_rows):
    """Yields ``W[rows]`` in chunks of at most ``chunk_rows`` rows, cast to ``dtype``."""
    n = _num_rows(W, rows)
    for start in range(0, n, chunk_rows):
        if rows is None:
            block = W[start : start + chunk_rows]
        else:
            block = W.index_select(0, rows[start : start + chunk_rows])
        yield block.detach().to(dtype)


def _require_rows(W, rows, what):
    if _num_rows(W, rows) == 0:
        raise ValueError(f"{what}: no rows selected")


@torch.no_grad()
def tev_per_token(
    W: torch.Tensor,
    rows: Optional[torch.Tensor] = None,
    scale: float = 1.0,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> torch.Tensor:
    """TEV_i = sqrt((1/d) Σ_j (e_ij − ē_i)²) of every selected row (fp32, population std)."""
    _check_matrix(W)
    rows = _as_rows(W, rows)
    out = [
        torch.std(block, dim=1, correction=0) * scale
        for block in _iter_chunks(W, rows, torch.float32, chunk_rows)
    ]
    return torch.cat(out) if out else W.new_zeros(0, dtype=torch.float32)


@torch.no_grad()
def tev_stats(
    W: torch.Tensor,
    rows: Optional[torch.Tensor] = None,
    scale: float = 1.0,
    init_std: Optional[float] = None,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> Dict[str, float]:
    """µTEV, σTEV and µTEV / (init_std · scale) of the selected rows.

    ``scale`` multiplies the weights first (an embedding multiplier such as fairseq's
    ``embed_scale``, to get the TEV of the *effective* embedding). ``init_std`` defaults to
    fairseq's embedding init std d^-½; the ratio is then ≈ 1 at initialisation.
    Returns ``{"mu", "sigma", "mu_over_init", "n"}``.
    """
    _check_matrix(W)
    _require_rows(W, _as_rows(W, rows), "tev_stats")
    tev = tev_per_token(W, rows, scale=scale, chunk_rows=chunk_rows).double()
    if init_std is None:
        init_std = W.size(1) ** -0.5
    mu = tev.mean().item()
    return {
        "mu": mu,
        "sigma": tev.std(correction=0).item(),
        "mu_over_init": mu / (init_std * scale),
        "n": tev.numel(),
    }


class Spectrum(NamedTuple):
    """Eigen-decomposition of XᵀX for the selected rows X (float64)."""

    singular_values: torch.Tensor  # [d], descending (sqrt of the eigenvalues of XᵀX); 0 beyond n
    directions: torch.Tensor  # [d, d], row k = unit right-singular vector of singular value k, signed
    # by canonical_signs (so the same for every solver, device and row order)
    mean: torch.Tensor  # [d], mean row
    n: int


@torch.no_grad()
def embedding_spectrum(
    W: torch.Tensor, rows: Optional[torch.Tensor] = None, chunk_rows: int = DEFAULT_CHUNK_ROWS
) -> Spectrum:
    """Singular values / right-singular vectors of W[rows] from the d×d Gram matrix (float64).

    The Gram matrix costs one O(n·d²) pass and keeps memory at O(d² + chunk·d); in float64 the
    squared condition number costs accuracy only for singular values below ~1e-7·σ_max.
    """
    _check_matrix(W)
    rows = _as_rows(W, rows)
    _require_rows(W, rows, "embedding_spectrum")
    d = W.size(1)
    gram = torch.zeros(d, d, dtype=torch.float64, device=W.device)
    total = torch.zeros(d, dtype=torch.float64, device=W.device)
    for block in _iter_chunks(W, rows, torch.float64, chunk_rows):
        gram.addmm_(block.t(), block)
        total += block.sum(0)
    evals, evecs = torch.linalg.eigh(gram)  # ascending
    evals = evals.flip(0).clamp_min(0.0)
    evecs = evecs.flip(1)
    n = _num_rows(W, rows)
    if n < d:
        evals[n:] = 0.0  # rank <= n: the rest is round-off of the Gram matrix
    return Spectrum(evals.sqrt(), canonical_signs(evecs.t()), total / n, n)


def canonical_signs(directions: torch.Tensor) -> torch.Tensor:
    """``directions`` (rows) with each row's sign chosen by the row alone, not by the solver that
    produced it: the first coordinate of largest magnitude is positive (scikit-learn's
    ``svd_flip`` convention). Coordinates within :data:`SIGN_TIE_RTOL` of the largest magnitude
    count as tied and the first of them decides, so the ~1e-15 by which two solvers' eigenvectors
    differ does not flip a row (|c| = (1, 1)/√2 up to round-off is (+, ·) whatever the solver)."""
    magnitude = directions.abs()
    near_top = magnitude >= magnitude.max(dim=1, keepdim=True).values * (1 - SIGN_TIE_RTOL)
    first = near_top.to(torch.int8).argmax(dim=1, keepdim=True)  # argmax: the first of the ties
    sign = torch.where(directions.gather(1, first) < 0, -1.0, 1.0).to(directions.dtype)
    return (directions * sign).contiguous()


def singular_values(W: torch.Tensor, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Descending singular values of W[rows] (float64)."""
    return embedding_spectrum(W, rows).singular_values


@torch.no_grad()
def isotropy(
    W: torch.Tensor,
    rows: Optional[torch.Tensor] = None,
    directions: Optional[torch.Tensor] = None,
    spectrum: Optional[Spectrum] = None,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> Dict[str, float]:
    """Isotropy I(W) in three forms (see the module docstring), float64 and log-sum-exp.

    ``directions`` ([k, d], rows = unit vectors) replaces the eigenvectors of WᵀW; with repeated
    eigenvalues the eigenbasis is not unique, so tests pass the basis they reason about. The signs
    of ``directions`` (or of the solver's eigenvectors) never change a result.
    Returns ``{"isotropy" (sign-symmetric, C ∪ −C), "isotropy_raw" (the paper's form, each c
    signed by :func:`canonical_signs`), "isotropy_fixed" (each c turned so that cᵀ·mean(W) > 0;
    canonical where |cᵀ·mean(W)| ≤ SIGN_TIE_RTOL × the rows' RMS norm), "n"}``.
    """
    _check_matrix(W)
    rows = _as_rows(W, rows)
    _require_rows(W, rows, "isotropy")
    if directions is None:
        if spectrum is None:
            spectrum = embedding_spectrum(W, rows, chunk_rows)
        C, mean = spectrum.directions, spectrum.mean
    else:
        C = torch.as_tensor(directions, device=W.device).to(torch.float64)
        if C.dim() != 2 or C.size(1) != W.size(1):
            raise ValueError(f"directions must be [k, {W.size(1)}], got {tuple(C.shape)}")
        C = canonical_signs(C)
        mean = None
    # log Z(c) = logsumexp_i cᵀw_i, accumulated over chunks; raw exp overflows for norms ~10
    neg_inf = torch.full((C.size(0),), -math.inf, dtype=torch.float64, device=W.device)
    log_zpos, log_zneg = neg_inf.clone(), neg_inf.clone()
    total = torch.zeros(W.size(1), dtype=torch.float64, device=W.device)
    squares = torch.zeros((), dtype=torch.float64, device=W.device)
    for block in _iter_chunks(W, rows, torch.float64, chunk_rows):
        proj = block @ C.t()  # [chunk, k], entry (i, j) = c_jᵀ w_i
        log_zpos = torch.logaddexp(log_zpos, torch.logsumexp(proj, dim=0))
        log_zneg = torch.logaddexp(log_zneg, torch.logsumexp(-proj, dim=0))
        squares += block.square().sum()
        if mean is None:
            total += block.sum(0)
    n = _num_rows(W, rows)
    if mean is None:
        mean = total / n
    both = torch.cat([log_zpos, log_zneg])
    # towards the mean; a direction orthogonal to it up to round-off keeps its canonical sign
    away_from_mean = C @ mean < -SIGN_TIE_RTOL * (squares / n).sqrt()
    fixed = torch.where(away_from_mean, log_zneg, log_zpos)
    return {
        "isotropy": math.exp((both.min() - both.max()).item()),
        "isotropy_raw": math.exp((log_zpos.min() - log_zpos.max()).item()),
        "isotropy_fixed": math.exp((fixed.min() - fixed.max()).item()),
        "n": n,
    }


@torch.no_grad()
def mean_pairwise_cosine(
    W: torch.Tensor, rows: Optional[torch.Tensor] = None, chunk_rows: int = DEFAULT_CHUNK_ROWS
) -> float:
    """Mean of cos(w_i, w_j) over ordered pairs i ≠ j, exact, without a V×V matrix.

    With unit rows ŵ_i and s = Σ ŵ_i: Σ_{i≠j} ŵ_iᵀŵ_j = ‖s‖² − Σ‖ŵ_i‖². A zero row (fairseq's
    padding row) has no direction; it counts as cosine 0 with every other row.
    """
    _check_matrix(W)
    rows = _as_rows(W, rows)
    n = _num_rows(W, rows)
    if n < 2:
        raise ValueError("mean_pairwise_cosine: need at least two rows")
    s = torch.zeros(W.size(1), dtype=torch.float64, device=W.device)
    sq = torch.zeros((), dtype=torch.float64, device=W.device)
    for block in _iter_chunks(W, rows, torch.float64, chunk_rows):
        norms = block.norm(dim=1, keepdim=True)
        unit = torch.where(norms > 0, block / norms.clamp_min(1e-300), torch.zeros_like(block))
        s += unit.sum(0)
        sq += (unit * unit).sum()
    return ((s @ s - sq) / (n * (n - 1))).item()


# the keys :func:`mean_direction_drift` returns
DRIFT_KEYS = ("mean_norm_share", "drift_frequent", "drift_rare", "drift_frequent_share", "drift_rare_share",
              "isotropy_centred")


@torch.no_grad()
def mean_direction_drift(
    W: torch.Tensor, rows: Optional[torch.Tensor] = None, chunk_rows: int = DEFAULT_CHUNK_ROWS,
    centred: bool = True,
) -> Dict[str, Optional[float]]:
    """The rows' drift along their common mean (docs/stats.md, "Drift along the mean direction").

    With m = mean_i w_i over ``rows`` (in the order given; a fairseq dictionary's order is
    frequency order) and u = m / ‖m‖: ``mean_norm_share`` = ‖m‖ / mean_i ‖w_i‖; ``drift_frequent``
    and ``drift_rare`` = the mean of w_iᵀu over the first ⌈n/2⌉ and the last ⌊n/2⌋ rows, and
    ``*_share`` each divided by its half's mean ‖w_i‖; ``isotropy_centred`` = the sign-symmetric
    I(W) of the rows w_i − m (left out, None, with ``centred=False``: it costs an eigendecomposition,
    the rest O(V·d)). float64. ``None`` where undefined (fewer than two rows, m = 0, a half of zero rows).
    """
    _check_matrix(W)
    rows = _as_rows(W, rows)
    n = _num_rows(W, rows)
    out = dict.fromkeys(DRIFT_KEYS)
    if n < 2:
        return out
    total = torch.zeros(W.size(1), dtype=torch.float64, device=W.device)
    norms = []
    for block in _iter_chunks(W, rows, torch.float64, chunk_rows):
        total += block.sum(0)
        norms.append(block.norm(dim=1))
    mean, norms = total / n, torch.cat(norms)
    mean_norm = mean.norm()
    if norms.mean() > 0:
        out["mean_norm_share"] = (mean_norm / norms.mean()).item()
    if mean_norm > 0:
        u = mean / mean_norm
        proj = torch.cat([block @ u for block in _iter_chunks(W, rows, torch.float64, chunk_rows)])
        half = (n + 1) // 2
        for name, part in (("frequent", slice(0, half)), ("rare", slice(half, n))):
            out[f"drift_{name}"] = proj[part].mean().item()
            if norms[part].mean() > 0:
                out[f"drift_{name}_share"] = (proj[part].mean() / norms[part].mean()).item()
    if not centred:
        return out
    selected = W if rows is None else W.index_select(0, rows)
    # the centred copy in W's own precision (float32 at most for a low-precision W): isotropy
    # upcasts it chunk by chunk
    dtype = torch.promote_types(selected.dtype, torch.float32)
    offset_free = selected.to(dtype) - mean.to(dtype)
    out["isotropy_centred"] = isotropy(offset_free, chunk_rows=chunk_rows)["isotropy"]
    return out
