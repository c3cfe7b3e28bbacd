"""Division by a scalar with the bits of IEEE division, at a fraction of its cost, for the
compiled loops that divide a row by its peak, its norm or √d (schemes/turboquant_cpu.py,
schemes/hadamard_cpu.py): a multiply by the reciprocal and two fused multiply-adds.

With r = RN(1/c), q = RN(x·r) lies within an ulp of x/c, the remainder x − q·c is a float that
one fma computes exactly, and RN(q + (x − q·c)·r) is the correctly rounded quotient RN(x/c)
(Markstein's theorem, applied to a divisor known in advance in J.-M. Muller, "Accelerating
floating-point division when the divisor is known in advance", LIP research report 2002-30), as
long as no step under- or overflows: x and c of magnitude 2^-e..2^e (_EXPONENT_LIMIT), where every
intermediate is a normal float (and a zero x, where asked, gives x·(1/c) = ±0). A vector with an
entry outside that range (a tiny or huge value, an infinity, a NaN; a zero unless asked), or a
divisor outside it, takes the division instead. On the 2-vCPU
AVX-512 Xeon, a row of 128 float32 in cache: 20 ns by division, 12 by `quotient`.

A *_cpu module: imported only by the compiled loops (llvmlite comes with numba).
"""
from __future__ import annotations

import llvmlite.ir as ir
import numba
import numpy as np
from numba import types
from numba.core import cgutils
from numba.core.extending import intrinsic

from .compiled import FLAT_JIT
from .vectors_cpu import counted_loop, fused_multiply_add, load_vector, splat, store_vector

# dividend and divisor magnitudes 2^-e..2^e where the fast quotient is exact, by dtype: float32's
# smallest normal is 2^-126 and the remainder sits 2^-48 below the dividend; float64 alike
_EXPONENT_LIMIT = {ir.FloatType: 50, ir.DoubleType: 500}
# (integer type, exponent bias, mantissa bits) of a float type's bit pattern
_LAYOUT = {ir.FloatType: (ir.IntType(32), 127, 23), ir.DoubleType: (ir.IntType(64), 1023, 52)}


def _magnitudes_fit(builder: ir.IRBuilder, x: ir.Value, zero_fits: bool = False) -> ir.Value:
    """i1 (or a vector of them): |x| within 2^-e..2^e — or, with zero_fits, x = ±0 — from its bits
    (a subtraction and an unsigned comparison; infinities and NaN's fall outside)."""
    kind = x.type.element if isinstance(x.type, ir.VectorType) else x.type
    whole, bias, mantissa = _LAYOUT[type(kind)]
    limit = _EXPONENT_LIMIT[type(kind)]
    lanes = x.type.count if isinstance(x.type, ir.VectorType) else None
    as_int = ir.VectorType(whole, lanes) if lanes else whole

    def constant(value):
        return ir.Constant(as_int, [value] * lanes if lanes else value)
    low, high = (bias - limit) << mantissa, (bias + limit) << mantissa
    size = builder.and_(builder.bitcast(x, as_int), constant((1 << (whole.width - 1)) - 1))
    fits = builder.icmp_unsigned("<=", builder.sub(size, constant(low)), constant(high - low))
    return builder.or_(fits, builder.icmp_unsigned("==", size, constant(0))) if zero_fits else fits


def _fast_quotient(builder: ir.IRBuilder, x: ir.Value, vc: ir.Value, vr: ir.Value,
                   zeros: bool) -> tuple[ir.Value, ir.Value]:
    """IR: (the quotient x / c by the reciprocal and two fma's, the lanes where it is exact) for
    c, 1/c spread over vectors. With `zeros`, a zero lane takes x·(1/c), exactly ±0 with the
    quotient's sign (the correction would turn −0 into +0), for rows where zeros are common (the
    butterflies of a few distinct centroids cancel to 0): three operations more a vector, but a
    zero no longer sends its vector to fdiv; without, a zero lane is outside the range."""
    product = builder.fmul(x, vr)
    q = fused_multiply_add(builder, fused_multiply_add(builder, builder.fneg(product), vc, x), vr, product)
    if zeros:
        q = builder.select(builder.fcmp_ordered("==", x, ir.Constant(x.type, None)), product, q)
    return q, _magnitudes_fit(builder, x, zero_fits=zeros)


def quotient(builder: ir.IRBuilder, x: ir.Value, c: ir.Value, reciprocal: ir.Value, zeros: bool = False,
             checked: bool = True) -> ir.Value:
    """IR: the vector x / c, correctly rounded lane by lane (fdiv's bits), for the scalar c and
    reciprocal = RN(1/c) (the module docstring's method; zeros: _fast_quotient's): where a lane of
    x, or c, lies outside the method's range, the vector takes fdiv (a check a vector: one for a
    whole row, which keeps every quotient live until the end, measured slower). Unchecked: the
    caller has proved every lane (zero, with `zeros`) and c inside the range."""
    lanes = x.type.count
    vc, vr = splat(builder, c, lanes), splat(builder, reciprocal, lanes)
    q, exact = _fast_quotient(builder, x, vc, vr, zeros)
    if not checked:
        return q
    flags = ir.VectorType(ir.IntType(1), lanes)
    every = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(1), [flags]),
                                           f"llvm.vector.reduce.and.v{lanes}i1")
    fits = builder.and_(builder.call(every, [exact]), _magnitudes_fit(builder, c))
    taken = builder.block
    with builder.if_then(builder.not_(fits), likely=False):
        divided = builder.fdiv(x, vc)
        slow = builder.block
    merged = builder.phi(x.type)
    merged.add_incoming(q, taken)
    merged.add_incoming(divided, slow)
    return merged


def quotients(builder: ir.IRBuilder, xs: list, c: ir.Value, reciprocal: ir.Value, zeros: bool = False,
              checked: bool = True) -> list:
    """IR: `quotient` of each vector of xs."""
    return [quotient(builder, x, c, reciprocal, zeros, checked) for x in xs]


def in_range_sums(values: np.ndarray, terms: int) -> bool:
    """Whether every sum and difference of up to `terms` of these values (finite floats), each
    rounded, is 0 or within the quotient's range: each is a multiple of the quantum of the
    smallest nonzero |value| (an ulp of it: exact sums are multiples, and rounding to a coarser
    grid keeps them so), and at most terms·max|value| — so quotients of them need no check."""
    kind = values.dtype.type
    size = np.abs(values[values != 0].astype(np.float64))
    if not np.all(np.isfinite(values)) or values.dtype not in (np.float32, np.float64):
        return False
    if not size.size:
        return True
    limit = 2.0 ** (50 if values.dtype == np.float32 else 500)
    quantum = float(np.spacing(kind(size.min())))
    return quantum >= 1 / limit and float(size.max()) * terms <= limit / 2


def reciprocal(builder: ir.IRBuilder, c: ir.Value) -> ir.Value:
    """IR: RN(1/c)."""
    return builder.fdiv(ir.Constant(c.type, 1.0), c)


def scaled(builder: ir.IRBuilder, v: ir.Value, factors: ir.Value | None, m: ir.Value | None) -> ir.Value:
    """IR: (v · factors) · m, each product rounded once; a None factor left out."""
    if factors is not None:
        v = builder.fmul(v, factors)
    if m is not None:
        v = builder.fmul(v, splat(builder, m, v.type.count))
    return v


@intrinsic
def _quotients(typingctx, src, n, c, factors, m, dst):
    """dst[i] = ((src[i] / c) · factors[i]) · m for i < n (a multiple of 8), 8 entries a vector,
    each operation rounded once (the quotient by `quotient`); factors or m None: left out. src,
    factors, dst contiguous, of one dtype; c, m scalars of it."""
    given = factors is not types.none
    if src.layout != "C" or dst.layout != "C" or (given and factors.layout != "C"):
        return None

    def codegen(context, builder, signature, args):
        sa, da = (context.make_array(signature.args[k])(context, builder, args[k]) for k in (0, 5))
        fa = context.make_array(signature.args[3])(context, builder, args[3]) if given else None
        c, m = args[2], args[4] if signature.args[4] is not types.none else None
        vector = ir.VectorType(context.get_value_type(src.dtype), 8)
        r = reciprocal(builder, c)
        with counted_loop(builder, args[1], 8, name="quotients") as loop:
            v = quotient(builder, load_vector(context, builder, sa, loop.index, vector), c, r)
            v = scaled(builder, v, load_vector(context, builder, fa, loop.index, vector) if given else None, m)
            store_vector(context, builder, v, da, loop.index)
        return context.get_dummy_value()
    return types.void(src, n, c, factors, m, dst), codegen


@numba.jit(**FLAT_JIT, error_model="numpy")       # the tail's x / 0 as IEEE's (and fdiv's), not an exception
def divide(src, c, factors, m, dst):  # pragma: no cover - compiled
    """dst[i] = ((src[i] / c) · factors[i]) · m, each operation rounded once (the quotient with
    IEEE division's bits); factors or m None: left out. Contiguous; dst may be src."""
    n = src.shape[0]
    whole = n - n % 8
    _quotients(src, whole, c, factors, m, dst)
    for i in range(whole, n):
        v = src[i] / c
        if factors is not None:
            v = v * factors[i]
        if m is not None:
            v = v * m
        dst[i] = v
