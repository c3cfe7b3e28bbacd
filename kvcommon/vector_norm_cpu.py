"""torch.linalg.vector_norm's sum of squares over a row, in compiled loops (numba) with the bits
of torch's CPU kernel, for the loops that take a row's norm in the same pass as other work (the
codecs' schemes/turboquant_cpu.py and schemes/spectralquant_cpu.py; the metrics' energies in
stats/metrics_cpu.py), and `_fma`, the fused multiply-add they (and schemes/kmeans_cpu.py) sum with.

The kernel sums the squares of a row in a vector of `lanes` accumulators (element i into
accumulator i mod lanes), adds the accumulators in order, then the tail left over past a
multiple of `lanes` one by one (on some builds with a fused multiply-add). Which `lanes` and tail
this torch build uses (32-byte vectors here: 8 float32, 4 float64) is found once per dtype and d
by probing vector_norm with rows drawn for the purpose (`norm_order`); where no candidate
reproduces it, the callers run their torch passes.

A *_cpu module: imported only where kvcommon.compiled.takes says the compiled loops take a tensor
(importing numba costs most of a second, and a run on CUDA never needs it).
"""
from __future__ import annotations

import functools

import llvmlite.ir
import numba
import numpy as np
import torch
from numba import types
from numba.core.extending import intrinsic

from .compiled import FLAT_JIT, JIT
from .vectors_cpu import counted_loop, fused_multiply_add, lane_total, load_vector

# (lanes, fused tail) orders of vector_norm's sum of squares tried by norm_order, likeliest first
_NORM_ORDERS = ((8, False), (4, False), (16, False), (8, True), (4, True), (16, True), (1, False), (1, True))


@intrinsic
def _fma(typingctx, a, b, c):
    """a·b + c rounded once (LLVM's fma: the CPU's instruction where it has one, else exact in software)."""
    def codegen(context, builder, signature, args):
        return fused_multiply_add(builder, *args)
    return a(a, b, c), codegen


@intrinsic(prefer_literal=True)
def _lane_squares(typingctx, x, full, lanes):
    """Σ x_i² over the first `full` entries (a multiple of lanes) of the contiguous row x, in
    `lanes` accumulators (i into accumulator i mod lanes: one LLVM vector of them, each product
    and sum rounded once, as torch's vector instructions round them) then added in order:
    vector_norm's order before its tail. lanes: a constant (a literal at the call)."""
    if not isinstance(lanes, types.IntegerLiteral) or x.layout != "C":
        return None
    n_lanes, dtype = lanes.literal_value, x.dtype

    def codegen(context, builder, signature, args):
        xa = context.make_array(signature.args[0])(context, builder, args[0])
        vector = llvmlite.ir.VectorType(context.get_value_type(dtype), n_lanes)
        with counted_loop(builder, args[1], n_lanes, [llvmlite.ir.Constant(vector, None)], "lane_squares") as loop:
            v = load_vector(context, builder, xa, loop.index, vector)
            loop.next = [builder.fadd(loop.carried[0], builder.fmul(v, v))]     # no contraction: two roundings
        return lane_total(builder, loop.carried[0], n_lanes)
    return dtype(x, full, lanes), codegen


@numba.jit(**FLAT_JIT)
def _sum_squares(v, lanes, fma_tail, acc):  # pragma: no cover - compiled
    """Σ v_i² in v's dtype in vector_norm's order: accumulator j of `lanes` += v_i² for i ≡ j
    (mod lanes) over the whole vectors, the accumulators added in order, then the tail one by one
    (rounded once a term with fma_tail). 4, 8 or 16 lanes in one vector register (_lane_squares),
    others in acc (a scratch array). v contiguous."""
    n = v.shape[0]
    full = n - n % lanes
    if lanes == 8:
        s = _lane_squares(v, full, 8)
    elif lanes == 4:
        s = _lane_squares(v, full, 4)
    elif lanes == 16:
        s = _lane_squares(v, full, 16)
    else:
        for j in range(lanes):
            acc[j] = 0
        for k in range(0, full, lanes):
            for j in range(lanes):
                acc[j] += v[k + j] * v[k + j]
        s = acc[0]
        for j in range(1, lanes):
            s = s + acc[j]
    for k in range(full, n):
        a = v[k]
        s = _fma(a, a, s) if fma_tail else s + a * a
    return s


@numba.jit(**JIT)
def _norm_rows(x, lanes, fma_tail, out):  # pragma: no cover - compiled
    """out[r] = √(_sum_squares(x[r])) (the probe of norm_order)."""
    acc = np.empty(max(lanes, 1), x.dtype)
    for r in range(x.shape[0]):
        out[r] = np.sqrt(_sum_squares(x[r], lanes, fma_tail, acc))



@functools.lru_cache(maxsize=None)
def norm_order(dtype: torch.dtype, d: int) -> tuple[int, bool] | None:
    """(lanes, fused tail) of the order in which torch.linalg.vector_norm sums the squares of a
    row of d entries in dtype on this CPU, or None if no candidate of _NORM_ORDERS reproduces
    it: the one whose sums give vector_norm's bits on 2048 rows of Gaussian entries of scales
    1e-3..1e3 (a wrong order changes some bit in about a third of such rows), with and without
    keepdim (unit_rows takes one, the residual norm the other). In three rows of four the entries
    before the last d mod 16 are 1e-9..1 times smaller (one factor a row), so that the tail
    past every candidate's vectors decides the sum's last bits: in a long row of like entries
    the tail's few terms rarely change them, and a wrong tail (fused or not) would pass the
    probe and then differ on rows whose tail matters (float64, d = 4099: 1 row in 31 of the
    metrics' test rows; float32, d = 65: 74 rows in 2000)."""
    rng = np.random.default_rng(20251203)                     # the probe's own rows, not a stream of the harness
    rows = rng.standard_normal((2048, d)) * 10.0 ** rng.uniform(-3, 3, (2048, 1))
    rows[512:, : d - d % 16] *= 10.0 ** rng.uniform(-9, 0, (1536, 1))
    probe = torch.from_numpy(rows).to(dtype)
    want = torch.linalg.vector_norm(probe, dim=-1).numpy()
    if not np.array_equal(want, torch.linalg.vector_norm(probe, dim=-1, keepdim=True).numpy()[:, 0]):
        return None
    got = np.empty_like(want)
    for lanes, fma_tail in _NORM_ORDERS:
        _norm_rows(probe.numpy(), lanes, fma_tail, got)
        if np.array_equal(got, want):
            return lanes, fma_tail
    return None
