"""The compiled CPU loops (numba; kvcommon/compiled.py) of the Walsh–Hadamard transform
(schemes/hadamard.py): the O(d log d) butterflies of one vector in cache, with its random signs,
scale and norm applied in the same pass, in place of a dense d×d matmul and two products. The same
bits as hadamard.fwht_butterfly. Rows split across the torch threads (compiled.by_row_blocks).
"""
from __future__ import annotations

import math

import llvmlite.ir
import numba
import numpy as np
import torch
from numba import types
from numba.core.extending import intrinsic

from kvcommon.compiled import JIT, by_row_blocks, row_view
from kvcommon.vectors_cpu import counted_loop, load_vector, store_vector

def _block_stages(builder, v):
    """IR: the stages h = 1, 2, 4 of the butterflies on the 8 lanes of v: for each stage the vector
    of the pairs' first entries and that of their second ones (shuffles), their sums kept where
    the pair's first entry sits and their differences where its second one does."""
    lanes = llvmlite.ir.VectorType(llvmlite.ir.IntType(32), 8)
    for h in (1, 2, 4):
        first = [k - (k & h) for k in range(8)]
        a = builder.shuffle_vector(v, v, llvmlite.ir.Constant(lanes, first))
        b = builder.shuffle_vector(v, v, llvmlite.ir.Constant(lanes, [k + h for k in first]))
        keep = [k if not k & h else 8 + k for k in range(8)]
        v = builder.shuffle_vector(builder.fadd(a, b), builder.fsub(a, b), llvmlite.ir.Constant(lanes, keep))
    return v


@intrinsic
def _first_three_stages(typingctx, buf, n):
    """The butterflies' stages h = 1, 2, 4 on each block of 8 of the first n entries (a multiple
    of 8) of the contiguous row buf, a block in one LLVM vector (_block_stages): the same
    additions, each rounded once, as the scalar butterflies."""
    if buf.layout != "C":
        return None

    def codegen(context, builder, signature, args):
        ba = context.make_array(signature.args[0])(context, builder, args[0])
        vector = llvmlite.ir.VectorType(context.get_value_type(buf.dtype), 8)
        with counted_loop(builder, args[1], 8, name="first_stages") as loop:
            store_vector(context, builder, _block_stages(builder, load_vector(context, builder, ba, loop.index, vector)),
                         ba, loop.index)
        return context.get_dummy_value()
    return types.void(buf, n), codegen


@intrinsic
def _paired_vectors(typingctx, buf, first, second, count):
    """buf[first + k], buf[second + k] = a + b, a − b for k < count (a multiple of 8), 8 entries a
    vector: one later stage's pairs of two blocks of buf (contiguous), the blocks not overlapping."""
    if buf.layout != "C":
        return None

    def codegen(context, builder, signature, args):
        ba = context.make_array(signature.args[0])(context, builder, args[0])
        lo, hi, count = args[1], args[2], args[3]
        vector = llvmlite.ir.VectorType(context.get_value_type(buf.dtype), 8)
        with counted_loop(builder, count, 8, name="paired") as loop:
            at_a, at_b = builder.add(lo, loop.index), builder.add(hi, loop.index)
            a, b = (load_vector(context, builder, ba, at, vector) for at in (at_a, at_b))
            store_vector(context, builder, builder.fadd(a, b), ba, at_a)
            store_vector(context, builder, builder.fsub(a, b), ba, at_b)
        return context.get_dummy_value()
    return types.void(buf, first, second, count), codegen


@numba.jit(**JIT)
def _butterflies(buf, d):  # pragma: no cover - compiled
    """buf[:] = H buf (unnormalised Walsh–Hadamard, Sylvester ordering) by log2(d) butterfly
    stages h = 1, 2, 4, ..., each pair (i, i + h) of a block of 2h becoming (a + b, a − b): the
    additions hadamard.fwht_butterfly makes, in its order. The stages h = 1, 2, 4 run on each
    block of 8 in one vector (_first_three_stages), each later stage on pairs of vectors of 8
    (_paired_vectors); d < 8 one pair at a time. buf contiguous."""
    h = 1
    if d >= 8:
        _first_three_stages(buf, d - d % 8)
        h = 8
        while h < d:
            for start in range(0, d, 2 * h):
                _paired_vectors(buf, start, start + h, h)
            h *= 2
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
