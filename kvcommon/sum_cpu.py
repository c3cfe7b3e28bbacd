"""torch.sum's order over a contiguous row, in compiled loops (numba) with the bits of torch's CPU
kernel, for a pass that sums a row's products Σ a_i·b_i in the same pass as other work
(stats/metrics_cpu.py: the logits' slope, torch.sum(ŝ * s, dim=-1)).

torch's cascade sum (ATen's SumKernel.cpp, vectorized_inner_sum) of a contiguous row of n entries,
with vectors of `lanes` entries (n >= lanes; else the same with lanes 1): the row's first
⌊n/lanes⌋ vectors are read four at a time into four vector accumulators; the accumulators move up
a cascade of four levels every 2^p such steps, p = max(4, ⌈log2(steps)⌉ // 4) (level j's carried
into level j + 1 and cleared when the step count is a multiple of 2^(j·p)), and the levels are
added into the first at the end; the vectors left past a multiple of four go into the first
accumulator, the other three are added into it in order; then a scalar starting at 0 takes the
entries past the last whole vector one by one, and the first accumulator's lanes in order; the
output, filled with 0, is incremented by it. Each product a_i·b_i is rounded once, as torch's
product tensor holds it. Which `lanes` this build's kernel uses (32-byte vectors here: 8 float32, 4
float64) is found per dtype and n by probing torch.sum (`sum_order`); where none reproduces it,
the callers run torch's passes.

A *_cpu module: imported only where kvcommon.compiled.takes says the compiled loops take a tensor.
"""
from __future__ import annotations

import functools

import llvmlite.ir as ir
import numba
import numpy as np
import torch
from numba import types
from numba.core.extending import intrinsic

from .compiled import FLAT_JIT, JIT
from .vectors_cpu import load_vector, store_vector

# the vector widths (entries) sum_order tries, likeliest first
_SUM_LANES = (8, 4, 16)


@intrinsic(prefer_literal=True)
def _add_products(typingctx, acc, at, a, b, start, lanes):
    """acc[at:at + lanes] += a[start:start + lanes] * b[start:start + lanes] as one vector product
    and one vector sum (each rounded once, no contraction). lanes: a constant (a literal at the
    call); acc, a and b C-contiguous (typing fails otherwise)."""
    if not isinstance(lanes, types.IntegerLiteral) or any(t.layout != "C" for t in (acc, a, b)):
        return None
    n_lanes = lanes.literal_value

    def codegen(context, builder, signature, args):
        acc_v, a_v, b_v = (context.make_array(signature.args[k])(context, builder, args[k]) for k in (0, 2, 3))
        vector = ir.VectorType(context.get_value_type(signature.args[0].dtype), n_lanes)
        va, vb = (load_vector(context, builder, v, args[4], vector) for v in (a_v, b_v))
        total = builder.fadd(load_vector(context, builder, acc_v, args[1], vector), builder.fmul(va, vb))
        store_vector(context, builder, total, acc_v, args[1])
        return context.get_dummy_value()
    return types.none(acc, at, a, b, start, lanes), codegen


@numba.jit(**FLAT_JIT)
def _ceil_log2(x):  # pragma: no cover - compiled
    """ATen's utils::CeilLog2: 1 up to 2, else ⌈log2 x⌉."""
    if x <= 2:
        return 1
    n, p = x - 1, 0
    while n > 0:
        n >>= 1
        p += 1
    return p


@numba.jit(**FLAT_JIT)
def _sum_products(a, b, lanes, acc):  # pragma: no cover - compiled
    """Σ a_i·b_i over the row in a's dtype in torch.sum's order (the module docstring); acc: a
    scratch array of 16·lanes entries in a's dtype."""
    n = a.shape[0]
    acc[0] = 0
    zero = acc[0]                          # +0 in a's dtype
    width = lanes if n >= lanes else 1
    n_vectors = n // width
    steps = n_vectors // 4
    power = max(4, _ceil_log2(steps) // 4)
    step, mask = 1 << power, (1 << power) - 1
    level = 4 * width                      # one level: four accumulators of `width` lanes
    for t in range(4 * level):
        acc[t] = zero
    i = 0
    while i + step <= steps:
        for _ in range(step):
            base = i * level
            if width == 8:
                _add_products(acc, 0, a, b, base, 8)
                _add_products(acc, 8, a, b, base + 8, 8)
                _add_products(acc, 16, a, b, base + 16, 8)
                _add_products(acc, 24, a, b, base + 24, 8)
            elif width == 4:
                _add_products(acc, 0, a, b, base, 4)
                _add_products(acc, 4, a, b, base + 4, 4)
                _add_products(acc, 8, a, b, base + 8, 4)
                _add_products(acc, 12, a, b, base + 12, 4)
            elif width == 16:
                _add_products(acc, 0, a, b, base, 16)
                _add_products(acc, 16, a, b, base + 16, 16)
                _add_products(acc, 32, a, b, base + 32, 16)
                _add_products(acc, 48, a, b, base + 48, 16)
            else:
                for t in range(level):
                    acc[t] += a[base + t] * b[base + t]
            i += 1
        for j in range(1, 4):              # carry up the cascade
            for t in range(level):
                acc[j * level + t] += acc[(j - 1) * level + t]
                acc[(j - 1) * level + t] = zero
            if (i & (mask << (j * power))) != 0:
                break
    while i < steps:
        base = i * level
        for t in range(level):
            acc[t] += a[base + t] * b[base + t]
        i += 1
    for j in range(1, 4):
        for t in range(level):
            acc[t] += acc[j * level + t]
    for v in range(steps * 4, n_vectors):  # the vectors past a multiple of four, into the first
        for k in range(width):
            acc[k] += a[v * width + k] * b[v * width + k]
    for j in range(1, 4):
        for k in range(width):
            acc[k] += acc[j * width + k]
    if width == 1:
        return zero + acc[0]
    total = zero
    for t in range(n_vectors * width, n):
        total += a[t] * b[t]
    for k in range(width):
        total += acc[k]
    return zero + total


@numba.jit(**JIT)
def _product_sum_rows(x, y, lanes, out):  # pragma: no cover - compiled
    """out[r] = _sum_products(x[r], y[r]) (the probe of sum_order)."""
    acc = np.empty(16 * max(lanes, 1), x.dtype)
    for r in range(x.shape[0]):
        out[r] = _sum_products(x[r], y[r], lanes, acc)


@functools.lru_cache(maxsize=None)
def sum_order(dtype: torch.dtype, n: int) -> int | None:
    """The vector width (entries) with which torch.sum(a * b, dim=-1) sums rows of n entries in
    dtype on this CPU, or None if no candidate of _SUM_LANES reproduces it: the first whose sums
    give torch's bits on 256 rows of Gaussian products of scales 1e-3..1e3 (a wrong order changes
    some bit in most such rows)."""
    rng = np.random.default_rng(20251204)                     # the probe's own rows, not a stream of the harness
    a = torch.from_numpy(rng.standard_normal((256, n)) * 10.0 ** rng.uniform(-3, 3, (256, 1))).to(dtype)
    b = torch.from_numpy(rng.standard_normal((256, n))).to(dtype)
    want = torch.sum(b * a, dim=-1).numpy()
    got = np.empty_like(want)
    for lanes in _SUM_LANES:
        _product_sum_rows(a.numpy(), b.numpy(), lanes, got)
        if np.array_equal(got, want):
            return lanes
    return None
