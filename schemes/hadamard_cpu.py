"""The compiled CPU loops (numba; kvcommon/compiled.py) of the Walsh–Hadamard transform
(schemes/hadamard.py): the O(d log d) butterflies of one vector in cache, with its random signs,
scale and norm applied in the same pass, in place of a dense d×d matmul and two products. The same
bits as hadamard.fwht_butterfly. Rows split across the torch threads (compiled.by_row_blocks).
"""
from __future__ import annotations

import math

import numba
import numpy as np
import torch

from kvcommon.compiled import JIT, by_row_blocks, row_view

@numba.jit(**JIT)
def _butterflies(buf, d):  # pragma: no cover - compiled
    """buf[:] = H buf (unnormalised Walsh–Hadamard, Sylvester ordering) by log2(d) butterfly
    stages h = 1, 2, 4, ..., each pair (i, i + h) of a block of 2h becoming (a + b, a − b): the
    additions hadamard.fwht_butterfly makes, in its order. The stages h = 1, 2, 4 run on each
    block of 8 in registers, several blocks a vector; each later stage is a loop LLVM vectorises."""
    h = 1
    if d >= 8:
        for block in range(d // 8):          # a unit step: LLVM vectorises the blocks (interleaved loads)
            j = 8 * block
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


@numba.jit(**JIT)
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
    compiled.DTYPES dtype: pre and post ±1 signs (..., 1, d) broadcast over the n vectors, scale (..., n)
    one factor a vector; without normalize no division. The same bits as
    hadamard.fwht_butterfly((x * pre)) / √d, then the products one after the other in torch."""
    shape, d = x.shape, x.shape[-1]
    x = x.detach().contiguous()
    out = torch.empty_like(x)
    if x.numel():
        xr, o = row_view(x), row_view(out)
        kind = xr.dtype.type
        p, q = _sign_rows(pre, shape, x.dtype), _sign_rows(post, shape, x.dtype)
        sc = np.empty(0, dtype=xr.dtype) if scale is None else scale.to(x.dtype).reshape(-1).contiguous().numpy()
        per_sign, div, m = shape[-2] if x.dim() >= 2 else 1, kind(math.sqrt(d) if normalize else 1.0), kind(mult)
        by_row_blocks(xr.shape[0], x.numel(), lambda a, b: _hadamard_rows(
            xr[a:b], a, p, q, per_sign, div, m, sc[a:b] if sc.shape[0] else sc, o[a:b]))
    return out
