"""The compiled CPU loops (numba; kvcommon/compiled.py) of k-means (schemes/kmeans.py): the nearest
centroid of each point (from the products, or forming them in cache for a small point dimension)
and the k-means++ seeding, the same indices and picks as kmeans' torch passes (their sums with
kvcommon.vector_norm_cpu's fused multiply-add `_fma`). Rows split across the torch threads (compiled.by_row_blocks).
"""
from __future__ import annotations

import numba
import numpy as np
import torch

from kvcommon.compiled import JIT, by_row_blocks
from kvcommon.vector_norm_cpu import _fma

@numba.jit(nopython=True, nogil=True, cache=True, boundscheck=False, fastmath={"nnan", "nsz"})
def _smallest(values):  # pragma: no cover - compiled
    """min(values) for values without NaN (fast-math lets LLVM vectorise the reduction; a zero's
    sign may come out either way, which == ignores)."""
    m = values[0]
    for j in range(1, values.shape[0]):
        m = min(m, values[j])
    return m


@numba.jit(**JIT)
def _first_nearest(c, products, buf):  # pragma: no cover - compiled
    """argmin_j (c[j] − 2·products[j]) (buf: a scratch row): the first
    index of the minimum, or of the first NaN where there is one, as torch's min(dim).indices
    gives it. The differences are formed into the row buffer, its minimum found by a vectorised
    reduction, then its first index."""
    nan = False
    for j in range(c.shape[0]):
        v = c[j] - (products[j] + products[j])       # 2·products exactly, in their dtype
        buf[j] = v
        nan |= v != v
    at = 0
    if nan:
        while buf[at] == buf[at]:
            at += 1
    else:
        m = _smallest(buf)
        while buf[at] != m:
            at += 1
    return at


@numba.jit(**JIT)
def _argmin_rows(xc, c_sq, out):  # pragma: no cover - compiled
    """out[b, i] = argmin_j (c_sq[b, j] − 2·xc[b, i, j]) (_first_nearest)."""
    n_problems, n_points, k = xc.shape
    buf = np.empty(k, xc.dtype)
    for b in range(n_problems):
        for i in range(n_points):
            out[b, i] = _first_nearest(c_sq[b], xc[b, i], buf)


@numba.jit(**JIT)
def _nearest_rows(x, ct, c_sq, out):  # pragma: no cover - compiled
    """out[b, i] = argmin_j (c_sq[b, j] − 2·x[b, i]·c[b, j]) for points x (B, n, g) and centroids
    given as ct = cᵀ (B, g, k), without the (B, n, k) products: each point's dot products with
    all k centroids are formed in a row buffer by the chain fma(x_g-1, c_g-1, … fma(x_1, c_1,
    x_0·c_0)) — the order and single roundings of the GEMM micro-kernel that `x @ cᵀ` runs here
    (MKL, float32 and float64; tests) — then the minimum taken by _first_nearest."""
    n_problems, n_points, g = x.shape
    k = ct.shape[2]
    prod, buf = np.empty(k, x.dtype), np.empty(k, x.dtype)
    for b in range(n_problems):
        c, cb = c_sq[b], ct[b]
        for i in range(n_points):
            p = x[b, i]
            x0 = p[0]
            first = cb[0]
            for j in range(k):
                prod[j] = x0 * first[j]
            for t in range(1, g):
                xt, col = p[t], cb[t]
                for j in range(k):
                    prod[j] = _fma(xt, col[j], prod[j])
            out[b, i] = _first_nearest(c, prod, buf)


@numba.jit(**JIT)
def _squared_distance(x, c):  # pragma: no cover - compiled
    """Σ (x_t − c_t)² in x's dtype, the squares added in order (torch's sum over a last dim of <= 4)."""
    e = x[0] - c[0]
    s = e * e
    for t in range(1, x.shape[0]):
        e = x[t] - c[t]
        s = s + e * e
    return s


@numba.jit(**JIT)
def _kmeans_pp_rows(points, u, first, picks):  # pragma: no cover - compiled
    """k-means++ seeding of each problem b of points (B, n, g), g <= 4: picks[b, 0] = first, then
    picks[b, j] = the first index whose running sum of D² exceeds u[j]·ΣD² (upper bound, by the
    binary search torch.searchsorted(right=True) runs, clamped to n − 1; the index ⌊u[j]·n⌋ where
    ΣD² is not positive), D² each point's least squared distance to the picks so far — in
    torch's arithmetic: the squared differences summed in order in the points' dtype, then in
    float64, the running sum sequential, the minimum NaN-propagating."""
    n_problems, n, _ = points.shape
    k = picks.shape[1]
    d2 = np.empty(n, np.float64)
    cum = np.empty(n, np.float64)
    for b in range(n_problems):
        p = points[b]
        picks[b, 0] = first
        c = p[first]
        for i in range(n):
            d2[i] = _squared_distance(p[i], c)
        for j in range(1, k):
            acc = 0.0
            for i in range(n):
                acc += d2[i]
                cum[i] = acc
            total = cum[n - 1]
            target = u[j] * total
            lo, hi = 0, n
            while lo < hi:
                mid = lo + ((hi - lo) >> 1)
                if not (cum[mid] > target):
                    lo = mid + 1
                else:
                    hi = mid
            pick = min(lo, n - 1)
            if not (total > 0):   # every point covered (duplicates): the uniform pick
                pick = min(int(u[j] * n), n - 1)
            picks[b, j] = pick
            c = p[pick]
            for i in range(n):
                s64 = np.float64(_squared_distance(p[i], c))
                if s64 != s64 or d2[i] != d2[i]:
                    d2[i] = np.nan
                elif s64 < d2[i]:
                    d2[i] = s64


def nearest_centroids(xc: torch.Tensor, c_sq: torch.Tensor, out: torch.Tensor) -> None:
    """out (B, n) int64 = (c_sq[:, None, :] − 2·xc).min(-1).indices for xc (B, n, k) and c_sq (B, k),
    CPU tensors of one compiled.DTYPES dtype, without the (B, n, k) difference (the same values: the
    doubling is exact, the subtraction rounds once, as in torch)."""
    xc, c_sq = xc.contiguous(), c_sq.contiguous()
    if xc.numel():
        xn, cn, on = xc.numpy(), c_sq.numpy(), out.numpy()
        by_row_blocks(xn.shape[0], xc.numel(), lambda a, b: _argmin_rows(xn[a:b], cn[a:b], on[a:b]))


def nearest_points(points: torch.Tensor, centroids: torch.Tensor, c_sq: torch.Tensor, out: torch.Tensor) -> None:
    """out (B, n) int64 = (c_sq[:, None, :] − 2·points @ centroidsᵀ).min(-1).indices for points
    (B, n, g), centroids (B, k, g), c_sq (B, k), CPU tensors of one compiled.DTYPES dtype, the products
    formed per point in cache (_nearest_rows) instead of as a (B, n, k) matmul: for the small g
    of a vector quantiser (Shard: g = 4), whose matmul is all output traffic."""
    x, ct, c_sq = points.contiguous(), centroids.transpose(1, 2).contiguous(), c_sq.contiguous()
    if x.numel() and ct.numel():
        xn, tn, cn, on = x.numpy(), ct.numpy(), c_sq.numpy(), out.numpy()
        by_row_blocks(xn.shape[0], x.shape[0] * x.shape[1] * ct.shape[2],
                       lambda a, b: _nearest_rows(xn[a:b], tn[a:b], cn[a:b], on[a:b]))


def kmeans_pp_picks(points: torch.Tensor, uniforms: np.ndarray, first: int) -> torch.Tensor:
    """The k = len(uniforms) point indices (B, k) int64 that kmeans._init_kmeans_pp's torch passes
    pick for points (B, n, g), g <= 4, a CPU tensor of one compiled.DTYPES dtype (_kmeans_pp_rows): the
    same arithmetic, per problem in cache, instead of 2k passes over the (B, n) distances."""
    x = points.contiguous()
    picks = torch.empty(x.shape[0], len(uniforms), dtype=torch.int64)
    xn, u, pn = x.numpy(), np.ascontiguousarray(uniforms, dtype=np.float64), picks.numpy()
    by_row_blocks(xn.shape[0], x.numel() * len(uniforms), lambda a, b: _kmeans_pp_rows(xn[a:b], u, first, pn[a:b]))
    return picks
