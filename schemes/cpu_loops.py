"""Compiled CPU loops (numba) for the per-element work of the codecs: for scalar quantisation,
one pass over a row that quantises, packs and keeps the uint8 codes, and one that unpacks and
looks up the centroids; for the Walsh–Hadamard transform, the O(d log d) butterflies of one
vector in cache with its random signs, scale and norm applied in the same pass. They replace
chains of whole-tensor torch passes (clamp, scale, floor, two gathers, compare, shifts, ORs: a
dozen reads and writes of every element; a dense d×d matmul and two products for a rotation)
that run elsewhere (CUDA, half precision). The quantisers give the same bits as those passes:
the same cell arithmetic, the same comparison, the same big-endian layout as packing.pack_bits;
the butterflies the same bits as hadamard.fwht_butterfly.

Each loop runs over rows (..., n) made contiguous, a large call's rows split into one block per
torch thread (the harness's thread budget); numba compiles a loop once per dtype on first use
(cached on disk beside this file, or in numba's user cache where that is not writable).
"""
from __future__ import annotations

import concurrent.futures
import math
import os

import llvmlite.ir
import numba
import numpy as np
import torch
from numba.core.extending import intrinsic

_JIT = {"nopython": True, "nogil": True, "cache": True, "boundscheck": False}

# numba takes CPU tensors as NumPy views: the dtypes it can read and write in place
SUPPORTED = (torch.float32, torch.float64)


# Up to this many thresholds (5-bit codebooks) a row is coded by counting the thresholds below
# each element, one vectorised compare-and-add pass over the row per threshold; above it by
# fastquant's grid: the exact cell and one comparison (two table lookups an element, not
# vectorised). One thread, 1 M float32 elements, on a 2-core AMD EPYC: 0.3 / 1.0 / 2.0 ms at
# 1 / 15 / 31 thresholds by counting, 3.8 ms at 63; 3.3 ms by the grid at any count.
COUNT_MAX_THRESHOLDS = 31

# Rows split across threads (the kernels release the GIL) when a call has at least this many elements.
_THREADED_MIN_ELEMENTS = 1 << 16
_POOLS: dict[int, concurrent.futures.ThreadPoolExecutor] = {}


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    """This process's pool (a forked worker gets its own: the parent's threads do not follow a fork)."""
    pid = os.getpid()
    if pid not in _POOLS:
        _POOLS.clear()
        _POOLS[pid] = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvharness-loops")
    return _POOLS[pid]

@numba.jit(**_JIT)
def _pack_row(q, width, out):  # pragma: no cover - compiled
    """out[:] = the codes q (zero-padded to whole groups of 8), `width` bits each, big-endian:
    each group of 8 codes is `width` whole bytes; the last group's bytes past len(out) are dropped.
    A width that divides 8 fills each byte from its 8/width codes (a loop LLVM vectorises)."""
    n_bytes = out.shape[0]
    if q.shape[0] * width == 8 * n_bytes:       # no partial group: the widths dividing 8 byte by byte
        if width == 1:
            for at in range(n_bytes):
                byte = 0
                for k in range(8):
                    byte |= q[8 * at + k] << (7 - k)
                out[at] = byte
            return
        if width == 2:
            for at in range(n_bytes):
                byte = 0
                for k in range(4):
                    byte |= q[4 * at + k] << (6 - 2 * k)
                out[at] = byte
            return
        if width == 4:
            for at in range(n_bytes):
                out[at] = (q[2 * at] << 4) | q[2 * at + 1]
            return
        if width == 8:
            for at in range(n_bytes):
                out[at] = q[at]
            return
    for g in range(q.shape[0] // 8):
        word = np.int64(0)
        for k in range(8):
            word = (word << width) | np.int64(q[8 * g + k])
        for b in range(width):
            at = g * width + b
            if at < n_bytes:
                out[at] = (word >> (8 * (width - 1 - b))) & 255


@numba.jit(**_JIT)
def _count_row(y, t, q):  # pragma: no cover - compiled
    """q[i] = #{j : t[j] < y[i]} for the n = len(y) elements of a row (NaN: len(t), the top index
    bucketize gives it); q's entries past n are left alone."""
    n = y.shape[0]
    top = np.int32(t.shape[0])
    for i in range(n):
        q[i] = top * np.int32(y[i] != y[i])        # NaN: the top index; no t[j] < NaN adds to it
    for j in range(t.shape[0]):
        tj = t[j]
        for i in range(n):
            q[i] += np.int32(tj < y[i])


@numba.jit(**_JIT)
def _count_rows(y, t, width, codes, packed):  # pragma: no cover - compiled
    """codes[r] = _count_row of y[r] and packed[r] the row's codes packed."""
    n_rows, n = y.shape
    q = np.zeros(-(-n // 8) * 8, np.int32)
    for r in range(n_rows):
        _count_row(y[r], t, q)
        for i in range(n):
            codes[r, i] = q[i]
        _pack_row(q, width, packed[r])


@numba.jit(**_JIT)
def _grid_row(y, lo, hi, inv_h, origin, first, cand, q):  # pragma: no cover - compiled
    """The codes of _count_row by fastquant._Grid: y clamped to [lo, hi] (NaN to hi), its cell
    floor(y·inv_h) − origin, and first[cell] + [cand[cell] < y]. Two passes over the row: the
    cells (branch-free, vectorised), then the two table lookups; the comparison takes y itself,
    which gives the clamped value's answer (the outermost cells hold no threshold, cand = +inf)."""
    n = y.shape[0]
    for i in range(n):
        v = np.float64(y[i])
        v = lo if v < lo else v
        v = v if v <= hi else hi                        # NaN to hi, the top cell
        q[i] = np.int32(math.floor(v * inv_h) - origin)   # exact: a power-of-two scale, integers
    for i in range(n):
        c = q[i]
        q[i] = np.int32(first[c]) + np.int32(cand[c] < y[i])


@numba.jit(**_JIT)
def _grid_rows(y, lo, hi, inv_h, origin, first, cand, width, codes, packed):  # pragma: no cover - compiled
    """codes[r] = _grid_row of y[r] and packed[r] the row's codes packed."""
    n_rows, n = y.shape
    q = np.zeros(-(-n // 8) * 8, np.int32)
    for r in range(n_rows):
        _grid_row(y[r], lo, hi, inv_h, origin, first, cand, q)
        for i in range(n):
            codes[r, i] = q[i]
        _pack_row(q, width, packed[r])


@numba.jit(**_JIT)
def _dequantize_row(packed, centroids, width, out):  # pragma: no cover - compiled
    """out[i] = centroids[code i of packed], the codes `width` bits each, big-endian: each whole
    group of 8 codes read from its `width` bytes as one word (no chain from code to code), the
    codes of a last partial group one after the other."""
    n = out.shape[0]
    mask = (1 << width) - 1
    groups = n // 8
    for g in range(groups):
        word = np.int64(0)
        for b in range(width):
            word = (word << 8) | np.int64(packed[g * width + b])
        for k in range(8):
            out[8 * g + k] = centroids[(word >> (width * (7 - k))) & mask]
    acc = 0
    held = 0
    j = groups * width
    for i in range(8 * groups, n):
        if held < width:
            acc = (acc << 8) | np.int64(packed[j])
            held += 8
            j += 1
        held -= width
        out[i] = centroids[(acc >> held) & mask]
        acc &= (1 << held) - 1


@numba.jit(**_JIT)
def _dequantize_rows(packed, centroids, width, out):  # pragma: no cover - compiled
    """out[r] = _dequantize_row of packed[r]."""
    for r in range(out.shape[0]):
        _dequantize_row(packed[r], centroids, width, out[r])


@numba.jit(**_JIT)
def _butterflies(buf, d):  # pragma: no cover - compiled
    """buf[:] = H buf (unnormalised Walsh–Hadamard, Sylvester ordering) by log2(d) butterfly
    stages h = 1, 2, 4, ..., each pair (i, i + h) of a block of 2h becoming (a + b, a − b): the
    additions hadamard.fwht_butterfly makes, in its order. The stages h = 1, 2, 4 run on each
    block of 8 in registers; each later stage is a loop LLVM vectorises."""
    h = 1
    if d >= 8:
        for j in range(0, d, 8):
            a0, a1, a2, a3 = buf[j], buf[j + 1], buf[j + 2], buf[j + 3]
            a4, a5, a6, a7 = buf[j + 4], buf[j + 5], buf[j + 6], buf[j + 7]
            b0, b1, b2, b3 = a0 + a1, a0 - a1, a2 + a3, a2 - a3
            b4, b5, b6, b7 = a4 + a5, a4 - a5, a6 + a7, a6 - a7
            c0, c1, c2, c3 = b0 + b2, b1 + b3, b0 - b2, b1 - b3
            c4, c5, c6, c7 = b4 + b6, b5 + b7, b4 - b6, b5 - b7
            buf[j], buf[j + 1], buf[j + 2], buf[j + 3] = c0 + c4, c1 + c5, c2 + c6, c3 + c7
            buf[j + 4], buf[j + 5], buf[j + 6], buf[j + 7] = c0 - c4, c1 - c5, c2 - c6, c3 - c7
        h = 8
    while h < d:
        for start in range(0, d, 2 * h):
            lo = buf[start:start + h]
            hi = buf[start + h:start + 2 * h]
            for i in range(h):
                a = lo[i]
                b = hi[i]
                lo[i] = a + b
                hi[i] = a - b
        h *= 2


@numba.jit(**_JIT)
def _hadamard_rows(x, first_row, pre, post, per_sign, div, mult, scale, out):  # pragma: no cover - compiled
    """out[r] = H(x[r] ⊙ pre[s]) / div · mult ⊙ post[s] · scale[r], s = (first_row + r) // per_sign,
    each factor only where given (an empty pre, post or scale: none; mult 1: none), in that order
    of operations (the signs' products are exact)."""
    n_rows, d = x.shape
    buf = np.empty(d, x.dtype)
    use_pre, use_post, use_scale, use_mult = pre.shape[0] > 0, post.shape[0] > 0, scale.shape[0] > 0, mult != 1
    for r in range(n_rows):
        s = (first_row + r) // per_sign
        if use_pre:
            for i in range(d):
                buf[i] = x[r, i] * pre[s, i]
        else:
            for i in range(d):
                buf[i] = x[r, i]
        _butterflies(buf, d)
        for i in range(d):
            v = buf[i] / div
            if use_mult:
                v = v * mult
            if use_post:
                v = v * post[s, i]
            if use_scale:
                v = v * scale[r]
            out[r, i] = v


@numba.jit(nopython=True, nogil=True, cache=True, boundscheck=False, fastmath={"nnan", "nsz"})
def _smallest(values):  # pragma: no cover - compiled
    """min(values) for values without NaN (fast-math lets LLVM vectorise the reduction; a zero's
    sign may come out either way, which == ignores)."""
    m = values[0]
    for j in range(1, values.shape[0]):
        m = min(m, values[j])
    return m


@numba.jit(**_JIT)
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


@numba.jit(**_JIT)
def _argmin_rows(xc, c_sq, out):  # pragma: no cover - compiled
    """out[b, i] = argmin_j (c_sq[b, j] − 2·xc[b, i, j]) (_first_nearest)."""
    n_problems, n_points, k = xc.shape
    buf = np.empty(k, xc.dtype)
    for b in range(n_problems):
        for i in range(n_points):
            out[b, i] = _first_nearest(c_sq[b], xc[b, i], buf)


@intrinsic
def _fma(typingctx, a, b, c):
    """a·b + c rounded once (LLVM's fma: the CPU's instruction where it has one, else exact in software)."""
    def codegen(context, builder, signature, args):
        ty = args[0].type
        fma = builder.module.declare_intrinsic("llvm.fma", [ty], llvmlite.ir.FunctionType(ty, [ty, ty, ty]))
        return builder.call(fma, args)
    return a(a, b, c), codegen


@numba.jit(**_JIT)
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


@numba.jit(**_JIT)
def _squared_distance(x, c):  # pragma: no cover - compiled
    """Σ (x_t − c_t)² in x's dtype, the squares added in order (torch's sum over a last dim of <= 4)."""
    e = x[0] - c[0]
    s = e * e
    for t in range(1, x.shape[0]):
        e = x[t] - c[t]
        s = s + e * e
    return s


@numba.jit(**_JIT)
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


@numba.jit(**_JIT)
def _dequantise_variable(idx, widths, offsets, table, sigma, out):  # pragma: no cover - compiled
    """out[b, h, s, i] = table[offsets[widths[b, h, i]] + idx[b, h, s, i]] · sigma[b, h, i]."""
    n_trials, n_heads, n_tokens, d = idx.shape
    base = np.empty(d, np.int32)                 # offsets[widths] of a head, looked up once (0.87 -> 0.66 ms, 1 M codes)
    for b in range(n_trials):
        for h in range(n_heads):
            w, sg = widths[b, h], sigma[b, h]
            for i in range(d):
                base[i] = offsets[w[i]]
            for t in range(n_tokens):
                codes, row = idx[b, h, t], out[b, h, t]
                for i in range(d):
                    row[i] = table[base[i] + np.int32(codes[i])] * sg[i]


def _rows(t: torch.Tensor) -> np.ndarray:
    """A 2-D NumPy view (rows, last dim) of a contiguous CPU tensor."""
    return t.reshape(-1, t.shape[-1]).numpy()


def _by_row_blocks(n_rows: int, n_elements: int, run) -> None:
    """run(start, stop) over contiguous blocks of rows, one per torch thread (the harness's
    thread budget) on the loops' pool when the call is large enough to pay for the hand-off;
    blocks write disjoint rows, so the result does not depend on the split."""
    parts = min(torch.get_num_threads(), n_rows) if n_elements >= _THREADED_MIN_ELEMENTS else 1
    if parts <= 1:
        run(0, n_rows)
        return
    bounds = [n_rows * i // parts for i in range(parts + 1)]
    others = [_pool().submit(run, bounds[i], bounds[i + 1]) for i in range(parts - 1)]
    try:
        run(bounds[-2], bounds[-1])                    # the last block here, not waiting idle
    finally:
        for done in others:
            done.result()                              # every block finished before leaving; re-raises


def _outputs(y: torch.Tensor, packed_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(*y.shape[:-1], packed_bytes, dtype=torch.uint8),
            torch.empty(y.shape, dtype=torch.uint8))


def count_pack(y: torch.Tensor, thresholds: torch.Tensor, width: int,
               packed_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 (..., packed_bytes), codes uint8 (..., n)) of y (..., n), a CPU tensor in a
    SUPPORTED dtype, codes #{t < y} for thresholds ascending in y's dtype (at most
    COUNT_MAX_THRESHOLDS; equal ones allowed), by counting."""
    y = y.detach().contiguous()
    packed, codes = _outputs(y, packed_bytes)
    if y.numel():
        yr, t, cr, pr = _rows(y), thresholds.detach().contiguous().numpy(), _rows(codes), _rows(packed)
        _by_row_blocks(yr.shape[0], y.numel(),
                       lambda a, b: _count_rows(yr[a:b], t, width, cr[a:b], pr[a:b]))
    return packed, codes


def grid_pack(y: torch.Tensor, lo: float, hi: float, inv_h: float, origin: float, first: torch.Tensor,
              cand: torch.Tensor, width: int, packed_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as count_pack by fastquant._Grid's fields (first uint8, cand in y's dtype), for
    codebooks of any size the grid holds."""
    y = y.detach().contiguous()
    packed, codes = _outputs(y, packed_bytes)
    if y.numel():
        yr, f, c, cr, pr = _rows(y), first.numpy(), cand.numpy(), _rows(codes), _rows(packed)
        _by_row_blocks(yr.shape[0], y.numel(),
                       lambda a, b: _grid_rows(yr[a:b], lo, hi, inv_h, origin, f, c, width, cr[a:b], pr[a:b]))
    return packed, codes


def dequantize_packed(packed: torch.Tensor, centroids: torch.Tensor, width: int, n: int) -> torch.Tensor:
    """Centroid values (..., n) of the codes packed (..., bytes), both on the CPU, centroids in
    a SUPPORTED dtype."""
    packed = packed.contiguous()
    out = torch.empty(*packed.shape[:-1], n, dtype=centroids.dtype)
    if out.numel():
        pr, c, o = _rows(packed), centroids.detach().contiguous().numpy(), _rows(out)
        _by_row_blocks(pr.shape[0], out.numel(), lambda a, b: _dequantize_rows(pr[a:b], c, width, o[a:b]))
    return out


def _sign_rows(signs: torch.Tensor | None, shape: torch.Size, dtype: torch.dtype) -> np.ndarray:
    """Signs (..., 1, d) broadcast over the (..., n, d) vectors of a tensor of `shape`, as rows
    (one per n vectors, d) in dtype; an empty (0, d) array when there are none."""
    d = shape[-1]
    if signs is None:
        return torch.empty(0, d, dtype=dtype).numpy()
    return signs.to(dtype).expand(*shape[:-2], 1, d).reshape(-1, d).contiguous().numpy()


def hadamard(x: torch.Tensor, *, normalize: bool = True, pre: torch.Tensor | None = None,
             post: torch.Tensor | None = None, mult: float = 1.0, scale: torch.Tensor | None = None) -> torch.Tensor:
    """H(x ⊙ pre)/√d · mult ⊙ post · scale for x (..., n, d) (d a power of two) on the CPU in a
    SUPPORTED dtype: pre and post ±1 signs (..., 1, d) broadcast over the n vectors, scale (..., n)
    one factor a vector; without normalize no division. The same bits as
    hadamard.fwht_butterfly((x * pre)) / √d, then the products one after the other in torch."""
    shape, d = x.shape, x.shape[-1]
    x = x.detach().contiguous()
    out = torch.empty_like(x)
    if x.numel():
        xr, o = _rows(x), _rows(out)
        kind = xr.dtype.type
        p, q = _sign_rows(pre, shape, x.dtype), _sign_rows(post, shape, x.dtype)
        sc = np.empty(0, dtype=xr.dtype) if scale is None else scale.to(x.dtype).reshape(-1).contiguous().numpy()
        per_sign, div, m = shape[-2] if x.dim() >= 2 else 1, kind(math.sqrt(d) if normalize else 1.0), kind(mult)
        _by_row_blocks(xr.shape[0], x.numel(), lambda a, b: _hadamard_rows(
            xr[a:b], a, p, q, per_sign, div, m, sc[a:b] if sc.shape[0] else sc, o[a:b]))
    return out


def nearest_centroids(xc: torch.Tensor, c_sq: torch.Tensor, out: torch.Tensor) -> None:
    """out (B, n) int64 = (c_sq[:, None, :] − 2·xc).min(-1).indices for xc (B, n, k) and c_sq (B, k),
    CPU tensors of one SUPPORTED dtype, without the (B, n, k) difference (the same values: the
    doubling is exact, the subtraction rounds once, as in torch)."""
    xc, c_sq = xc.contiguous(), c_sq.contiguous()
    if xc.numel():
        xn, cn, on = xc.numpy(), c_sq.numpy(), out.numpy()
        _by_row_blocks(xn.shape[0], xc.numel(), lambda a, b: _argmin_rows(xn[a:b], cn[a:b], on[a:b]))


def nearest_points(points: torch.Tensor, centroids: torch.Tensor, c_sq: torch.Tensor, out: torch.Tensor) -> None:
    """out (B, n) int64 = (c_sq[:, None, :] − 2·points @ centroidsᵀ).min(-1).indices for points
    (B, n, g), centroids (B, k, g), c_sq (B, k), CPU tensors of one SUPPORTED dtype, the products
    formed per point in cache (_nearest_rows) instead of as a (B, n, k) matmul: for the small g
    of a vector quantiser (Shard: g = 4), whose matmul is all output traffic."""
    x, ct, c_sq = points.contiguous(), centroids.transpose(1, 2).contiguous(), c_sq.contiguous()
    if x.numel() and ct.numel():
        xn, tn, cn, on = x.numpy(), ct.numpy(), c_sq.numpy(), out.numpy()
        _by_row_blocks(xn.shape[0], x.shape[0] * x.shape[1] * ct.shape[2],
                       lambda a, b: _nearest_rows(xn[a:b], tn[a:b], cn[a:b], on[a:b]))


def kmeans_pp_picks(points: torch.Tensor, uniforms: np.ndarray, first: int) -> torch.Tensor:
    """The k = len(uniforms) point indices (B, k) int64 that kmeans._init_kmeans_pp's torch passes
    pick for points (B, n, g), g <= 4, a CPU tensor of one SUPPORTED dtype (_kmeans_pp_rows): the
    same arithmetic, per problem in cache, instead of 2k passes over the (B, n) distances."""
    x = points.contiguous()
    picks = torch.empty(x.shape[0], len(uniforms), dtype=torch.int64)
    xn, u, pn = x.numpy(), np.ascontiguousarray(uniforms, dtype=np.float64), picks.numpy()
    _by_row_blocks(xn.shape[0], x.numel() * len(uniforms), lambda a, b: _kmeans_pp_rows(xn[a:b], u, first, pn[a:b]))
    return picks


def dequantise_variable(idx: torch.Tensor, widths: torch.Tensor, offsets: torch.Tensor, table: torch.Tensor,
                        sigma: torch.Tensor) -> torch.Tensor:
    """SpectralQuant's ẑ (B, H, S, d) in table's (SUPPORTED) dtype: table[offsets[widths] + idx] · σ
    for codes idx (B, H, S, d), widths (B, H, d), σ (B, H, 1, d) — the gather and the product of
    spectralquant's torch passes (the same values) in one pass on the CPU."""
    idx = idx.contiguous()
    out = torch.empty(idx.shape, dtype=table.dtype)
    if out.numel():
        i, w, o = idx.numpy(), widths.contiguous().numpy(), out.numpy()
        off, tb = offsets.contiguous().numpy(), table.contiguous().numpy()
        sg = sigma.to(table.dtype).reshape(idx.shape[0], idx.shape[1], idx.shape[3]).contiguous().numpy()
        _by_row_blocks(i.shape[0], out.numel(), lambda a, b: _dequantise_variable(i[a:b], w[a:b], off, tb, sg[a:b], o[a:b]))
    return out
