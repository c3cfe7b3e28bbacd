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

from kvcommon.compiled import FLAT_JIT, JIT, by_row_blocks, row_view
from kvcommon.quotients_cpu import divide, quotients, reciprocal, scaled
from kvcommon.vectors_cpu import by_length, by_size, counted_loop, fused_multiply_add, literal_sizes, load_vector, store_vector

def _block_stages(builder, v):
    """IR: the stages h = 1, 2, 4 of the butterflies on the 8 lanes of v: for each stage v's lanes
    with each pair's two entries swapped (one shuffle), then fma(v, ±1, swapped): a + b where the
    pair's first entry sits, −b + a = a − b where its second does, each rounded once (the product
    by ±1 is exact) as the scalar butterflies' sum and difference are."""
    lanes = llvmlite.ir.VectorType(llvmlite.ir.IntType(32), 8)
    for h in (1, 2, 4):
        swapped = builder.shuffle_vector(v, v, llvmlite.ir.Constant(lanes, [k ^ h for k in range(8)]))
        signs = llvmlite.ir.Constant(v.type, [-1.0 if k & h else 1.0 for k in range(8)])
        v = fused_multiply_add(builder, v, signs, swapped)
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


# rows of up to this many entries run all their stages with the row in registers (_in_registers)
REGISTER_ROW_MAX = 256


def stages_in_registers(builder, vectors: list) -> list:
    """IR: every butterfly stage of a row held as vectors of 8 (a power-of-two count of them):
    h = 1, 2, 4 in each vector (_block_stages), the later ones between vectors; the vectors of H row."""
    v = [_block_stages(builder, x) for x in vectors]
    h = 1
    while h < len(v):
        for k in range(len(v)):
            if not k & h:
                v[k], v[k + h] = builder.fadd(v[k], v[k + h]), builder.fsub(v[k], v[k + h])
        h *= 2
    return v


# the row lengths held in registers (by_size writes code for each)
REGISTER_ROWS = (8, 16, 32, 64, 128, REGISTER_ROW_MAX)


@intrinsic(prefer_literal=True)
def _in_registers(typingctx, buf, d, c, factors, m, dst):
    """dst[:] = ((H buf) / c ⊙ factors) · m for the row buf of d entries, one of REGISTER_ROWS (any
    other: nothing is written): the row loaded once as d/8 vectors, the stages h = 1, 2, 4 in each
    vector (_block_stages), the later ones between vectors, then the quotient
    (quotients_cpu.quotient, IEEE division's bits) and the products, each rounded once, and
    stored once. c, factors or m None: left out. buf, factors, dst contiguous, of one dtype (dst
    may be buf)."""
    if buf.layout != "C" or dst.layout != "C":
        return None
    divided, given, multiplied = (t is not types.none for t in (c, factors, m))

    def codegen(context, builder, signature, args):
        ba, da = (context.make_array(signature.args[k])(context, builder, args[k]) for k in (0, 5))
        fa = context.make_array(signature.args[3])(context, builder, args[3]) if given else None
        vector = llvmlite.ir.VectorType(context.get_value_type(buf.dtype), 8)

        def build(size):
            at = [llvmlite.ir.Constant(llvmlite.ir.IntType(64), 8 * k) for k in range(size // 8)]
            v = stages_in_registers(builder, [load_vector(context, builder, ba, i, vector) for i in at])
            if divided:
                v = quotients(builder, v, args[2], reciprocal(builder, args[2]), zeros=True)   # decoded rows: many cancel
            for value, i in zip(v, at, strict=True):
                value = scaled(builder, value, load_vector(context, builder, fa, i, vector) if given else None,
                               args[4] if multiplied else None)
                store_vector(context, builder, value, da, i)
            return []
        by_size(builder, args[1], literal_sizes(d, REGISTER_ROWS), build)
        return context.get_dummy_value()
    return types.void(buf, d, c, factors, m, dst), codegen


@numba.jit(**FLAT_JIT)
def transform(buf, d, c, factors, m, dst):  # pragma: no cover - compiled
    """dst[:] = ((H buf) / c ⊙ factors) · m (H unnormalised, as _butterflies), each operation
    rounded once, the quotient IEEE division's; c, factors or m None: left out. Rows of 8 to
    REGISTER_ROW_MAX entries in registers (_in_registers), others by _butterflies in buf and
    then the products. buf, factors, dst contiguous (dst may be buf; buf is overwritten)."""
    if 8 <= d <= REGISTER_ROW_MAX and not d & (d - 1):
        _in_registers(buf, d, c, factors, m, dst)
    else:
        _stages_in_memory(buf, d)
        if c is None:
            for i in range(d):
                v = buf[i]
                if factors is not None:
                    v = v * factors[i]
                if m is not None:
                    v = v * m
                dst[i] = v
        else:
            divide(buf, c, factors, m, dst)


@numba.jit(**FLAT_JIT)
def _butterflies(buf, d):  # pragma: no cover - compiled
    """buf[:] = H buf (unnormalised Walsh–Hadamard, Sylvester ordering) by log2(d) butterfly
    stages h = 1, 2, 4, ..., each pair (i, i + h) of a block of 2h becoming (a + b, a − b): the
    additions hadamard.fwht_butterfly makes, in its order (transform without its products).
    buf contiguous."""
    transform(buf, d, None, None, None, buf)


@numba.jit(**FLAT_JIT)
def _stages_in_memory(buf, d):  # pragma: no cover - compiled
    """_butterflies on a row of any length in memory: the stages h = 1, 2, 4 on each block of 8
    in one vector (_first_three_stages), each later stage on pairs of vectors of 8
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
def _hadamard_rows(x, d, first_row, pre, post, per_sign, div, mult, scale, out):  # pragma: no cover - compiled
    """out[r] = H(x[r] ⊙ pre[s]) / div · mult ⊙ post[s] · scale[r], s = (first_row + r) // per_sign,
    each factor only where given (an empty pre, post or scale: none; mult 1: none), in that order
    of operations (the signs' products are exact). d: x's row length (a literal: by_length)."""
    n_rows = x.shape[0]
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


_hadamard_rows_by_length = by_length(_hadamard_rows, 1)


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
        by_row_blocks(xr.shape[0], x.numel(), lambda a, b: _hadamard_rows_by_length(
            xr[a:b], d, a, p, q, per_sign, div, m, sc[a:b] if sc.shape[0] else sc, o[a:b]))
    return out
