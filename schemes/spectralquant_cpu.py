"""SpectralQuant's coding of a cache on the CPU (numba) around the projection, which stays a
dense matmul (MKL's: at d = 128 it runs several times faster than a compiled per-row product,
and a per-row product would not sum in its order, so the codes would change).

Encode, after z = u @ Q (spectralquant_memos.coordinates): one pass over the coordinates of a trial,
head after head and token after token, that divides coordinate i by σ_i, finds the index of
the nearest centroid of the unit Gaussian Lloyd–Max codebook of its width b_i (the threshold
grid of spectralquant_search.threshold_grid_float32 in float32, threshold_grid in float64: one cell
lookup and one comparison) and appends it, b_i bits, to the trial's stream
(packing.pack_variable's layout) — in place of the division, the search and the packing as
three passes. Every element goes through the torch passes' operations in their order and
dtype, so the codes and the stream have their bits.

Before it, unit_rows(x) (the unit rows and norms the projection and the stored norms take) in
one pass per row in place of six (|x|, its maximum, the division, the norm, the second division):
the peak as turboquant_cpu finds it, the sum of squares in torch.linalg.vector_norm's order
(kvcommon/vector_norm_cpu.py's norm_order; where no order reproduces it, schemes/unit_rows.py's passes run).

Decode of a stream this process has not coded (its codes not remembered, spectralquant_memos.CODES):
the codes read back from the stream, looked up in the stored codebooks and scaled by σ in one
pass per trial (`dequantised_stream`), in place of unpack_variable's passes and the lookup.

With a QJL sketch (a `q` before k or v), the residual e = z − ẑ on the d_eff semantic
coordinates (0 past them) and its norm in one pass (`residual`), in place of the difference,
zeros, the selection and the norm; S·e stays a matmul. Decode adds the sketch's correction
(√(π/2)/m·‖e‖)·(Sᵀ sign) on the semantic coordinates to ẑ in one pass (`corrected`), in place of
the product, zeros, the selection and the sum; the back-projection stays a matmul.

Rows are split across the torch thread budget (the unit rows, residuals and corrections row by row; the codes by trial (compiled.by_row_blocks): a trial's
stream is one bit stream, so a trial is the unit that writes whole bytes of its own).
"""
from __future__ import annotations

import numba
import numpy as np
import torch

from kvcommon import compiled
from kvcommon.compiled import JIT, by_row_blocks
from kvcommon.vector_norm_cpu import _sum_squares, norm_order

from .packing import MAX_BITS
from .turboquant_cpu import _scaled_row

# the dtypes the fused pass reads and writes in place (tests empty it to run the torch passes)
FUSED_DTYPES = (torch.float32, torch.float64)

# IEEE division (x/0 = ±inf or NaN, as torch's), not Python's ZeroDivisionError: without the
# check on every divisor the division loop vectorises (one thread, 1 M float32: 1.2 against 2.7 ms)
_IEEE_JIT = {**JIT, "error_model": "numpy"}


@numba.jit(**_IEEE_JIT)
def _code_rows(z, sigma, widths, clamp, scale, offset, cell_of_width, table, bound, codes, stream):  # pragma: no cover - compiled
    """codes[b, h, s, i] = the index of the nearest centroid of width widths[b, h, i] for
    y = z[b, h, s, i] / sigma[b, h, i] (NaN → +clamp, then clamped to ±clamp): with
    v = y + offset·w (offset 0 in float32: the float32 grid has no shift), the cell
    c = floor(v·scale) + cell_of_width[w] and the index table[c] + [bound[c] < v]; stream[b]
    the codes of widths[b, h, i] bits each, head after head, token after token, most
    significant bit first, zero-padded (packing.pack_variable)."""
    n_trials, n_heads, n_tokens, d = z.shape
    n_bytes = stream.shape[1]
    lo, hi = -clamp, clamp
    cells = np.empty(d, np.int32)
    shifts = np.empty(d, z.dtype)
    inner = np.empty(d, np.int32)
    values = np.empty(d, z.dtype)
    for b in range(n_trials):
        acc = np.int64(0)
        held = 0
        at = 0
        for h in range(n_heads):
            w, sg = widths[b, h], sigma[b, h]
            for i in range(d):
                cells[i] = cell_of_width[w[i]]
                shifts[i] = offset * w[i]
            for t in range(n_tokens):
                row, out = z[b, h, t], codes[b, h, t]
                for i in range(d):                     # divided, clamped, shifted, its cell: vectorised
                    v = row[i] / sg[i]
                    v = hi if v != v else (lo if v < lo else (hi if v > hi else v))
                    v = v + shifts[i]
                    values[i] = v
                    inner[i] = np.int32(np.floor(v * scale)) + cells[i]
                for i in range(d):                     # the table's index and comparison
                    c = inner[i]
                    q = np.int64(table[c]) + np.int64(bound[c] < values[i])
                    inner[i] = q
                    out[i] = q
                for i in range(d):                     # the packing: 32 bits written at a time
                    wi = np.int64(w[i])
                    acc = (acc << wi) | inner[i]
                    held += wi
                    if held >= 32:
                        held -= 32
                        word = acc >> held
                        stream[b, at] = (word >> 24) & 255
                        stream[b, at + 1] = (word >> 16) & 255
                        stream[b, at + 2] = (word >> 8) & 255
                        stream[b, at + 3] = word & 255
                        acc &= (np.int64(1) << held) - 1
                        at += 4
        while held >= 8:
            held -= 8
            stream[b, at] = (acc >> held) & 255
            at += 1
        if held:
            stream[b, at] = (acc << (8 - held)) & 255
            at += 1
        for j in range(at, n_bytes):
            stream[b, j] = 0


@numba.jit(**_IEEE_JIT)
def _unit_rows(x, x_bits, mask, held, held_bits, one, lanes, fma_tail, u, norms):  # pragma: no cover - compiled
    """u[r] = (x[r]/p)/σ and norms[r] = p·σ in x's dtype, p = max|x[r]| (1 where not > 0: zero
    rows, NaN), σ = ‖x[r]/p‖ summed in vector_norm's order (1 where not > 0): unit_rows' values.
    x_bits is x viewed as signed integers of its width, mask their sign bit cleared, held and
    held_bits one scratch element viewed as x's dtype and as those integers."""
    n_rows, d = x.shape
    acc = np.empty(max(lanes, 1), x.dtype)
    for r in range(n_rows):
        ur = u[r]
        peak, sigma = _scaled_row(x[r], x_bits[r], mask, held, held_bits, one, lanes, fma_tail, acc, ur)
        norms[r] = peak * sigma
        if not sigma > 0:
            sigma = one
        for i in range(d):
            ur[i] = ur[i] / sigma


@numba.jit(**_IEEE_JIT)
def _residual_rows(z, z_hat, first_row, per_head, d_eff, lanes, fma_tail, e, norms):  # pragma: no cover - compiled
    """e[r, i] = z[r, i] − z_hat[r, i] for i < d_eff of row r's head (row first_row + r of per_head
    rows a head), +0 past it; norms[r] = ‖e[r]‖ summed in vector_norm's order, as float32."""
    n_rows, d = z.shape
    acc = np.empty(max(lanes, 1), z.dtype)
    zero = z.dtype.type(0)
    for r in range(n_rows):
        k = d_eff[(first_row + r) // per_head]
        zr, hr, er = z[r], z_hat[r], e[r]
        for i in range(d):
            er[i] = zr[i] - hr[i] if i < k else zero
        norms[r] = np.float32(np.sqrt(_sum_squares(er, lanes, fma_tail, acc)))


@numba.jit(**_IEEE_JIT)
def _corrected_rows(z_hat, product, residual_norms, scale, first_row, per_head, d_eff, out):  # pragma: no cover - compiled
    """out[r, i] = z_hat[r, i] + c with c = (scale·residual_norms[r])·product[r, i] for i < d_eff
    of row r's head, +0 past it: qjl's correction and its selection in torch's order and dtype."""
    n_rows, d = z_hat.shape
    held = np.empty(1, out.dtype)                 # the float32 norm in out's dtype, as .to(dtype) gives it
    zero = out.dtype.type(0)
    for r in range(n_rows):
        k = d_eff[(first_row + r) // per_head]
        held[0] = residual_norms[r]
        factor = scale * held[0]
        hr, pr, orow = z_hat[r], product[r], out[r]
        for i in range(d):
            orow[i] = hr[i] + (factor * pr[i] if i < k else zero)


@numba.jit(**JIT)
def _dequantised_stream(stream, widths, n_tokens, offsets, table, sigma, out):  # pragma: no cover - compiled
    """out[b, h, s, i] = table[offsets[w] + code] · sigma[b, h, i] with w = widths[b, h, i] and code
    the next w bits of stream[b] (head after head, token after token, most significant first:
    packing.pack_variable's layout; width 0: code 0)."""
    n_trials, n_heads, d = widths.shape
    base = np.empty(d, np.int32)
    for b in range(n_trials):
        acc = np.int64(0)
        held = 0
        at = 0
        for h in range(n_heads):
            w, sg = widths[b, h], sigma[b, h]
            for i in range(d):
                base[i] = offsets[w[i]]
            for t in range(n_tokens):
                row = out[b, h, t]
                for i in range(d):
                    wi = np.int64(w[i])
                    if held < wi:
                        acc = ((acc << 8) | stream[b, at]) & 0xFFFF
                        at += 1
                        held += 8
                    held -= wi
                    code = (acc >> held) & ((np.int64(1) << wi) - 1)
                    row[i] = table[base[i] + np.int32(code)] * sg[i]


def dequantised_stream(stream: torch.Tensor, widths: torch.Tensor, n_tokens: int, offsets: torch.Tensor,
                       table: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """ẑ (B, H, S, d) in table's dtype (takes(table)) of the stored stream (B, bytes) at widths
    (B, H, d) with n_tokens = S: table[offsets[widths] + code] · σ (σ (B, H, 1, d)), the codes
    unpack_variable reads, in one pass."""
    b, h, d = widths.shape
    out = torch.empty(b, h, n_tokens, d, dtype=table.dtype)
    if out.numel():
        st, w = stream.contiguous().numpy(), widths.to(torch.uint8).contiguous().numpy()
        off, tb = offsets.to(torch.int32).contiguous().numpy(), table.contiguous().numpy()
        sg = sigma.to(table.dtype).reshape(b, h, d).contiguous().numpy()
        o = out.numpy()
        by_row_blocks(b, out.numel(), lambda a, c: _dequantised_stream(st[a:c], w[a:c], n_tokens, off, tb, sg[a:c],
                                                                         o[a:c]))
    return out


def _heads(d_eff: torch.Tensor) -> np.ndarray:
    return d_eff.to(torch.int64).reshape(-1).contiguous().numpy()


def residual(z: torch.Tensor, z_hat: torch.Tensor, d_eff: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e (B, H, S, d), ‖e‖ float32 (B, H, S)) for the coordinates z and their reconstruction ẑ
    (B, H, S, d), CPU tensors with unit_rows_take(z), and d_eff (B, H): e = z − ẑ on the first
    d_eff coordinates of each head and +0 past them, spectralquant's torch.where and
    vector_norm in one pass."""
    b, h, n, d = z.shape
    z, z_hat = z.detach().contiguous(), z_hat.to(z.dtype).contiguous()
    e = torch.empty_like(z)
    norms = torch.empty(b, h, n, dtype=torch.float32)
    if z.numel():
        lanes, fma_tail = norm_order(z.dtype, d)
        zr, hr, er, nr, k = z.view(-1, d).numpy(), z_hat.view(-1, d).numpy(), e.view(-1, d).numpy(), \
            norms.view(-1).numpy(), _heads(d_eff)
        by_row_blocks(zr.shape[0], z.numel(), lambda a, c: _residual_rows(
            zr[a:c], hr[a:c], a, n, k, lanes, fma_tail, er[a:c], nr[a:c]))
    return e, norms


def corrected(z_hat: torch.Tensor, product: torch.Tensor, residual_norms: torch.Tensor, scale: float,
              d_eff: torch.Tensor) -> torch.Tensor:
    """ẑ + where(semantic, scale·‖e‖·product, 0) (B, H, S, d) for ẑ and product = sign(S e)·S
    (B, H, S, d), CPU tensors with takes(z_hat), the residual norms (B, H, S) (float32) and d_eff
    (B, H): spectralquant's correction (scale a Python float, rounded to ẑ's dtype as torch's
    product rounds it), its selection and the sum in one pass; a new tensor."""
    b, h, n, d = z_hat.shape
    z_hat, product = z_hat.contiguous(), product.to(z_hat.dtype).contiguous()
    out = torch.empty_like(z_hat)
    if out.numel():
        hr, pr, orow, k = z_hat.view(-1, d).numpy(), product.view(-1, d).numpy(), out.view(-1, d).numpy(), \
            _heads(d_eff)
        rn = residual_norms.to(torch.float32).contiguous().view(-1).numpy()
        kind = orow.dtype.type
        by_row_blocks(hr.shape[0], out.numel(), lambda a, c: _corrected_rows(
            hr[a:c], pr[a:c], rn[a:c], kind(scale), a, n, k, orow[a:c]))
    return out


def unit_rows_take(x: torch.Tensor) -> bool:
    """Whether unit_rows codes x with schemes/unit_rows.py's bits: takes(x) and a known order of
    vector_norm's sum for x's dtype and row length."""
    return takes(x) and x.shape[-1] >= 1 and norm_order(x.dtype, x.shape[-1]) is not None


def unit_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(u (..., d), ‖x‖ (...)) of x, a CPU tensor with unit_rows_take(x): schemes/unit_rows.py's
    unit_rows in one pass per row (new tensors, not remembered)."""
    d = x.shape[-1]
    x = x.detach().contiguous()
    u = torch.empty_like(x)
    norms = torch.empty(x.shape[:-1], dtype=x.dtype)
    if x.numel():
        lanes, fma_tail = norm_order(x.dtype, d)
        xr, ur, nr = x.reshape(-1, d).numpy(), u.view(-1, d).numpy(), norms.view(-1).numpy()
        as_int = np.int32 if xr.dtype == np.float32 else np.int64
        mask, one = as_int(np.iinfo(as_int).max), xr.dtype.type(1)

        def run(start, stop):
            held = np.zeros(1, xr.dtype)                        # one per thread
            _unit_rows(xr[start:stop], xr[start:stop].view(as_int), mask, held, held.view(as_int), one, lanes,
                       fma_tail, ur[start:stop], nr[start:stop])
        by_row_blocks(xr.shape[0], x.numel(), run)
    return u, norms


def takes(z: torch.Tensor) -> bool:
    """Whether the fused pass codes z: on the CPU in a FUSED_DTYPES dtype, the compiled loops on
    (emptying compiled.DTYPES routes every codec to its torch passes)."""
    return z.device.type == "cpu" and z.dtype in FUSED_DTYPES and z.dtype in compiled.DTYPES


def codes(z: torch.Tensor, sigma: torch.Tensor, widths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 codes (B, H, S, d), stream uint8 (B, bytes)) of the coordinates z (B, H, S, d), a CPU
    tensor with takes(z), divided by σ (B, H, d) at widths (B, H, d): the codes of
    spectralquant_search.nearest_centroids(z / σ) and packing.pack_variable's stream, in one pass."""
    from .spectralquant_search import CLAMP, SHIFT, threshold_grid, threshold_grid_float32
    z = z.detach().contiguous()
    kind = z.numpy().dtype.type
    sigma = sigma.to(z.dtype).reshape(widths.shape).contiguous()
    widths = widths.to(torch.uint8).contiguous()
    n_tokens = z.shape[2]
    longest = int(widths.to(torch.int64).sum((-1, -2)).max()) * n_tokens if widths.numel() else 0
    out = torch.empty(z.shape, dtype=torch.uint8)
    stream = torch.empty(z.shape[0], (longest + 7) // 8, dtype=torch.uint8)
    if z.dtype == torch.float32:
        table, bound, cell_of_width, per_unit = threshold_grid_float32("cpu")
        offset = 0.0
    else:
        table, bound, origin, per_unit = threshold_grid("cpu")
        cell_of_width, offset = torch.full((MAX_BITS + 1,), -origin, dtype=torch.int64), SHIFT
    if z.numel():
        zn, sn, wn, on, st = z.numpy(), sigma.numpy(), widths.numpy(), out.numpy(), stream.numpy()
        cw, tb, bd = cell_of_width.to(torch.int32).numpy(), table.numpy(), bound.numpy()
        by_row_blocks(zn.shape[0], z.numel(), lambda a, b: _code_rows(
            zn[a:b], sn[a:b], wn[a:b], kind(CLAMP), kind(per_unit), kind(offset), cw, tb, bd, on[a:b], st[a:b]))
    return out, stream


@numba.jit(**JIT)
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



def dequantise_variable(idx: torch.Tensor, widths: torch.Tensor, offsets: torch.Tensor, table: torch.Tensor,
                        sigma: torch.Tensor) -> torch.Tensor:
    """SpectralQuant's ẑ (B, H, S, d) in table's (compiled.DTYPES) dtype: table[offsets[widths] + idx] · σ
    for codes idx (B, H, S, d), widths (B, H, d), σ (B, H, 1, d) — the gather and the product of
    spectralquant's torch passes (the same values) in one pass on the CPU."""
    idx = idx.contiguous()
    out = torch.empty(idx.shape, dtype=table.dtype)
    if out.numel():
        i, w, o = idx.numpy(), widths.contiguous().numpy(), out.numpy()
        off, tb = offsets.contiguous().numpy(), table.contiguous().numpy()
        sg = sigma.to(table.dtype).reshape(idx.shape[0], idx.shape[1], idx.shape[3]).contiguous().numpy()
        by_row_blocks(i.shape[0], out.numel(), lambda a, b: _dequantise_variable(i[a:b], w[a:b], off, tb, sg[a:b], o[a:b]))
    return out
