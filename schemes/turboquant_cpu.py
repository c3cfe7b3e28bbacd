"""TurboQuant's coding of a token vector in one compiled pass each way on the CPU (numba), in
place of the chain of whole-tensor passes (unit_rows, hadamard.rht, scalar_quantizer.quantize_pack,
the residual, its norm and QJL sketch; back: scalar_quantizer.dequantize_packed, the QJL correction,
hadamard.rht_inverse), each of which reads and writes every element once more.

Encode, one row x (d, a power of two) of K or V at a time, in cache:
  1. p = max|x| (1 where not > 0), σ = ‖x/p‖, u = (x/p)/σ (σ: 1 where not > 0), ‖x‖ = p·σ
     (float32), as schemes/unit_rows.py computes them;
  2. y = H(s ⊙ u)/√d, s the trial's and head's rotation signs (the butterflies of hadamard_cpu);
  3. the codes #{j : t_j < y_i} against the b-bit Lloyd–Max thresholds, packed big-endian
     (packing.pack_bits);
  4. with an RHT QJL sketch: e = y − c[code] (e = y at 0 MSE bits), ‖e‖ (float32) and the bits
     [H(s' ⊙ e)/√d·√d ≥ 0], packed one a bit.
Decode: ŷ = c[code] (0 at 0 MSE bits), plus the QJL correction √(π/2)/d·‖e‖ ·
(H(2·bit − 1)/√d·√d ⊙ s'); then s ⊙ H(ŷ)/√d · ‖x‖.

The same bits as the chain: every element goes through the same operations in the same order
and dtype, each rounded once, as there. The one reduction, ‖·‖, is torch.linalg.vector_norm's,
summed in the order of torch's CPU kernel that kvcommon/vector_norm_cpu.py's norm_order finds on
this build; where no candidate order reproduces it, the fused passes are not used (`takes`), and
the codec runs its chain.

Steps 1 and 2, and 3's counting, run with the row in registers (_unit_rotated_rows: loaded once,
y stored once, two rows side by side where both fit in the registers: paired_rows) for rows of
8..256 entries where vector_norm sums in 8 lanes; single rows of float32 with 2- to 6-bit codes
(2- to 8-bit with AVX-512: scalar_quantizer_cpu.SEARCHED_WIDTHS) find them by a binary search
instead of counting or the grid, and those of 6 to 8 bits that are not searched take the grid's
codes in registers, both packed there (_packed_rows: step 1 of the next row, _unit_row, taken
before steps 2 and 3 of this one, _coded_row, u handed over in a scratch row); a decode without
a sketch of a row of 64..256, likewise (_decoded_row). The divisions are IEEE division's bits by a reciprocal
and two fma's (kvcommon/quotients_cpu.py). Rows are split across the torch thread budget like the
other loops, K's and V's in one hand-off (compiled.by_row_blocks, deferred to the scheme's
compiled.batched).
"""
from __future__ import annotations

import functools
import math

import llvmlite.ir
import numba
import numpy as np
import torch
from numba import types
from numba.core import cgutils
from numba.core.extending import intrinsic

from kvcommon import compiled
from kvcommon.compiled import FLAT_JIT, by_row_blocks
from kvcommon.quotients_cpu import divide, in_range_sums, quotients, reciprocal, scaled
from kvcommon.vectors_cpu import by_length, by_size, intrinsic_name, literal_sizes, lane_total, load_vector, splat, store_vector, vector_registers
from kvcommon.vector_norm_cpu import _sum_squares, norm_order

from . import qjl, scalar_quantizer
from .hadamard_cpu import REGISTER_ROW_MAX, REGISTER_ROWS, _butterflies, stages_in_registers, transform
from .scalar_quantizer_cpu import GridCodes, GroupReader, counts_in_registers, looked_up_row, store_packed, _count_row, _dequantize_row, _grid_row, _pack_row, \
    folded_table, grid_scalars, grid_tables, lookup_table, search_table, searches_in_registers

# the dtypes the fused passes take (tests empty it to run TurboQuant's chain of passes on the CPU
# instead; emptying compiled.DTYPES turns off every compiled loop)
FUSED_DTYPES = (torch.float32, torch.float64)

# Up to this many thresholds the fused encode counts them, above it looks them up on the grid (one
# thread, a row of 128 float32: counting 7 / 15 thresholds 60 / 86 ns, the grid 130 at any count).
COUNT_MAX_THRESHOLDS = 15

@numba.jit(**FLAT_JIT)
def _largest_magnitude(bits, mask):  # pragma: no cover - compiled
    """max_i (bits_i & mask) for a row's float bits (as signed integers of its width) and mask
    clearing the sign bit: the bits of max|x| — the order of non-negative floats is their bits'
    order — or of a NaN if there is one (NaN's bits lie above +inf's), as amax gives it. An
    integer reduction LLVM vectorises, which a float maximum with NaN's rules is not."""
    m = bits[0] & mask
    for i in range(1, bits.shape[0]):
        m = max(m, bits.dtype.type(bits[i] & mask))   # kept at the bits' width (numba widens &), twice the lanes
    return m


@intrinsic(prefer_literal=True)
def _unit_rotated_rows(typingctx, x, first, count, d, signs, s0, s1, div, one, y, t, q, width):
    """Steps 1 and 2 of the module docstring for `count` (a literal, 1 or 2) rows first, first + 1
    of x (n, d: d one of hadamard_cpu.REGISTER_ROWS, each with its own code: by_size; any other d
    writes nothing and returns zeros), each held in registers, loaded once
    as d/8 vectors of 8 and its y stored once into y's row k: the peak (an integer maximum of
    the bits with the sign cleared: NaN's above +inf, as amax gives it; 1 where not > 0), u = x/p
    (quotients_cpu.quotient), Σu² in vector_norm's order for 8 lanes (the caller checks
    norm_order), σ = √Σ, then y = H((u/σ') ⊙ s)/div with σ' = σ (1 where not > 0) and s the row
    s0 (s1) of signs: every operation that of _scaled_row and the chain; with thresholds t (not
    None) also step 3's codes into q's row k from the row still in registers: at `width` 0 by
    counting them (scalar_quantizer_cpu's counts_in_registers); at `width` 1 (a literal, t its one
    threshold) q is the packed rows (uint8), the 1-bit codes packed in registers into its rows
    first, first + 1 (scalar_quantizer_cpu.store_packed), and y is not stored. Two rows go step
    by step side by side: a row's chain of dependent
    steps (its norm's sum is 23 additions in a fixed order) leaves the CPU's units idle that the
    other row's steps fill. Returns (p, σ) of each row, flattened. x,
    signs, y, q C-contiguous 2-d arrays, t contiguous; x, signs, y, t of one dtype; div, one
    scalars of it."""
    if not isinstance(count, types.IntegerLiteral) or not isinstance(width, types.IntegerLiteral) or \
            x.layout != "C" or signs.layout != "C" or y.layout != "C" or q.layout != "C":
        return None
    counted = t is not types.none
    bits = width.literal_value
    packs = q.dtype == types.uint8           # q the packed rows: 1-bit codes packed there
    if bits not in (0, 1) or packs != (bits == 1) or (packs and not counted) or isinstance(t, types.BaseTuple):
        return None
    rows = count.literal_value

    def codegen(context, builder, signature, args):
        xa, sa, ya, qa = (context.make_array(signature.args[k])(context, builder, args[k]) for k in (0, 4, 9, 11))
        div, one = args[7], args[8]
        int64 = llvmlite.ir.IntType(64)
        element = context.get_value_type(x.dtype)
        vector = llvmlite.ir.VectorType(element, 8)

        def build(size):
            """The rows' steps for rows of `size` entries (size/8 vectors): [p, σ] a row."""
            n = size // 8
            def places(array, row):
                return _row_places(builder, array, row, n)
            rows_of = [args[1]] + ([builder.add(args[1], llvmlite.ir.Constant(int64, 1))] if rows == 2 else [])
            x_at = [places(xa, r) for r in rows_of]
            s_at = [places(sa, r) for r in (args[5], args[6])[:rows]]
            y_at = [places(ya, llvmlite.ir.Constant(int64, k)) for k in range(rows)]
            v = [[load_vector(context, builder, xa, i, vector) for i in at] for at in x_at]
            peaks, u, sigmas = _unit_steps(builder, v, one)

            def stored(r, k, value):  # y is read after the pass only where the codes are not packed here
                if not packs:
                    store_vector(context, builder, value, ya, y_at[r][k])
            rotated = _rotated_steps(builder, u, sigmas, lambda r, k: load_vector(context, builder, sa, s_at[r][k], vector),
                                     div, one, stored)
            if counted:
                codes_of = _code_finder(context, builder, t, args[10], bits)
                for r in range(rows):
                    codes = codes_of(rotated[r])
                    if packs:                   # into the packed row first + r
                        start = builder.mul(rows_of[r], builder.extract_value(qa.shape, 1))
                        store_packed(builder, codes, bits, builder.gep(qa.data, [start]))
                        continue
                    q_at = places(qa, llvmlite.ir.Constant(int64, r))
                    for code, i in zip(codes, q_at, strict=True):
                        store_vector(context, builder, code, qa, i)
            return [value for r in range(rows) for value in (peaks[r], sigmas[r])]
        zero = llvmlite.ir.Constant(element, 0.0)
        values = by_size(builder, args[3], literal_sizes(d, REGISTER_ROWS), build, [zero] * (2 * rows))
        return context.make_tuple(builder, signature.return_type, values)
    return types.UniTuple(x.dtype, 2 * rows)(x, first, count, d, signs, s0, s1, div, one, y, t, q, width), codegen


def _row_places(builder, array, row, n: int) -> list:
    """IR: the element indices of row `row`'s n vectors of 8 in a C-contiguous 2-d array."""
    int64 = llvmlite.ir.IntType(64)
    start = builder.mul(row, builder.extract_value(array.shape, 1))
    return [builder.add(start, llvmlite.ir.Constant(int64, 8 * k)) for k in range(n)]


@intrinsic(prefer_literal=True)
def _unit_row(typingctx, x, r, d, one, u, slot):
    """Step 1 of the module docstring for row r of x (n, d: d one of hadamard_cpu.REGISTER_ROWS,
    else nothing is written and zeros returned), held in registers as _unit_rotated_rows holds
    it: u's row `slot` = x/p, returns (p, σ). x, u C-contiguous 2-d arrays of one dtype; one a
    scalar of it."""
    if x.layout != "C" or u.layout != "C" or x.dtype != u.dtype:
        return None

    def codegen(context, builder, signature, args):
        xa, ua = (context.make_array(signature.args[k])(context, builder, args[k]) for k in (0, 4))
        element = context.get_value_type(x.dtype)
        vector = llvmlite.ir.VectorType(element, 8)

        def build(size):
            v = [load_vector(context, builder, xa, i, vector) for i in _row_places(builder, xa, args[1], size // 8)]
            peaks, unit, sigmas = _unit_steps(builder, [v], args[3])
            for value, i in zip(unit[0], _row_places(builder, ua, args[5], size // 8), strict=True):
                store_vector(context, builder, value, ua, i)
            return [peaks[0], sigmas[0]]
        zero = llvmlite.ir.Constant(element, 0.0)
        return context.make_tuple(builder, signature.return_type, by_size(builder, args[2], literal_sizes(d, REGISTER_ROWS), build, [zero] * 2))
    return types.UniTuple(x.dtype, 2)(x, r, d, one, u, slot), codegen


@intrinsic(prefer_literal=True)
def _coded_row(typingctx, u, slot, d, signs, s, sigma, div, one, t, q, r, width):
    """Steps 2 and 3 of the module docstring for u's row `slot` (x/p from _unit_row, σ its norm;
    d as there), held in registers as _unit_rotated_rows holds it: y = H((u/σ') ⊙ s)/div with s
    the row s of signs, its codes found (_code_finder: a `width` of 1 with t its one threshold, of
    scalar_quantizer_cpu.SEARCHED_WIDTHS with t its search_table, or t the grid's (scalars,
    entries) tuple of _packed_rows, float32) and packed in registers into q's row r
    (scalar_quantizer_cpu.store_packed); y is not stored. u, signs, q (uint8) C-contiguous 2-d
    arrays; u, signs of one dtype, sigma, div, one scalars of it; width a literal."""
    if not isinstance(width, types.IntegerLiteral) or width.literal_value < 1 or u.layout != "C" or \
            signs.layout != "C" or q.layout != "C" or q.dtype != types.uint8 or \
            (isinstance(t, types.BaseTuple) and u.dtype != types.float32):
        return None
    bits = width.literal_value

    def codegen(context, builder, signature, args):
        ua, sa, qa = (context.make_array(signature.args[k])(context, builder, args[k]) for k in (0, 3, 9))
        vector = llvmlite.ir.VectorType(context.get_value_type(u.dtype), 8)

        def build(size):
            n = size // 8
            unit = [load_vector(context, builder, ua, i, vector) for i in _row_places(builder, ua, args[1], n)]
            s_at = _row_places(builder, sa, args[4], n)
            rotated = _rotated_steps(builder, [unit], [args[5]], lambda _, k: load_vector(context, builder, sa, s_at[k], vector),
                                     args[6], args[7])
            codes = _code_finder(context, builder, t, args[8], bits)(rotated[0])
            start = builder.mul(args[10], builder.extract_value(qa.shape, 1))
            store_packed(builder, codes, bits, builder.gep(qa.data, [start]))
            return []
        by_size(builder, args[2], literal_sizes(d, REGISTER_ROWS), build)
        return context.get_dummy_value()
    return types.void(u, slot, d, signs, s, sigma, div, one, t, q, r, width), codegen


def _unit_steps(builder, v, one) -> tuple[list, list, list]:
    """IR: step 1 for rows held in registers side by side (v: each row's vectors of 8; one the
    dtype's 1): (the peaks p, the rows u = x/p, the norms σ = √Σu²), as _unit_rotated_rows
    describes them, each step taken for every row in turn."""
    rows, n = len(v), len(v[0])
    vector = v[0][0].type
    element = vector.element
    whole = llvmlite.ir.IntType(32 if isinstance(element, llvmlite.ir.FloatType) else 64)   # the float's bits as an integer
    as_int = llvmlite.ir.VectorType(whole, 8)
    # the peaks: the integer maximum of the bits with the sign cleared, a tree log2(d/8) deep
    sign_off = llvmlite.ir.Constant(as_int, [(1 << (whole.width - 1)) - 1] * 8)
    reduce_max = cgutils.get_or_insert_function(builder.module, llvmlite.ir.FunctionType(whole, [as_int]),
                                                intrinsic_name("llvm.vector.reduce.smax", as_int))
    peaks = []
    for row in v:
        level = [builder.and_(builder.bitcast(value, as_int), sign_off) for value in row]
        while len(level) > 1:
            level = [builder.select(builder.icmp_signed(">", a, b), a, b) for a, b in zip(level[::2], level[1::2])]
        peak = builder.bitcast(builder.call(reduce_max, [level[0]]), element)
        peaks.append(builder.select(builder.fcmp_ordered(">", peak, llvmlite.ir.Constant(element, 0.0)), peak, one))
    # u = x / peak and its sum of squares in 8 accumulators, then added in order, row by row side by side
    inverse = [reciprocal(builder, p) for p in peaks]
    u = [[None] * n for _ in range(rows)]
    acc = [llvmlite.ir.Constant(vector, None)] * rows
    for k in range(n):
        for r in range(rows):
            u[r][k] = quotients(builder, [v[r][k]], peaks[r], inverse[r])[0]
            acc[r] = builder.fadd(acc[r], builder.fmul(u[r][k], u[r][k]))   # no contraction: two roundings
    sqrt = cgutils.get_or_insert_function(builder.module, llvmlite.ir.FunctionType(element, [element]),
                                          intrinsic_name("llvm.sqrt", element))
    return peaks, u, [builder.call(sqrt, [lane_total(builder, a, 8)]) for a in acc]


def _rotated_steps(builder, u, sigmas, signs, div, one, each=None) -> list:
    """IR: step 2 for rows held side by side: y = H((u/σ') ⊙ s)/div, σ' = σ (1 where not > 0),
    s's vector k of row r `signs(r, k)` (loaded where it is used), as _unit_rotated_rows describes
    it; each(r, k, y's vector k of row r) as it is made, where given."""
    rows, n = len(u), len(u[0])
    element = u[0][0].type.element
    held = [builder.select(builder.fcmp_ordered(">", sg, llvmlite.ir.Constant(element, 0.0)), sg, one) for sg in sigmas]
    inverse = [reciprocal(builder, h) for h in held]
    w = [[None] * n for _ in range(rows)]
    for k in range(n):
        for r in range(rows):
            w[r][k] = builder.fmul(quotients(builder, [u[r][k]], held[r], inverse[r])[0], signs(r, k))
    stages = [stages_in_registers(builder, row) for row in w]
    rd = reciprocal(builder, div)
    rotated = [[None] * n for _ in range(rows)]
    for k in range(n):
        for r in range(rows):
            rotated[r][k] = quotients(builder, [stages[r][k]], div, rd)[0]
            if each is not None:
                each(r, k, rotated[r][k])
    return rotated


def _code_finder(context, builder, t, value, width: int):
    """IR: a function from a rotated row held in registers to its codes (vectors of 8 int32), by
    step 3 as _unit_rotated_rows says: t the Numba type of the thresholds argument and value its
    LLVM value; width 1 (one threshold), a searched width (t its search_table) or 0 (counting)."""
    if isinstance(t, types.BaseTuple):     # the grid's (lo, hi, inv_h, origin as float32; combined entries)
        int64 = llvmlite.ir.IntType(64)
        scalars, entries = (context.make_array(kind)(context, builder, builder.extract_value(value, k))
                            for k, kind in enumerate(t.types))
        lo, hi, inv_h, origin = (builder.load(builder.gep(scalars.data, [llvmlite.ir.Constant(int64, k)])) for k in range(4))
        grid = GridCodes(builder, lo, hi, inv_h, builder.fptosi(origin, llvmlite.ir.IntType(32)), entries.data)
        return lambda row: [grid.codes(builder, v) for v in row]
    ta = context.make_array(t)(context, builder, value)
    if width == 1:                          # one threshold: the code is [t < v], 1 for NaN (the top index)
        threshold = splat(builder, builder.load(ta.data), 8)
        codes = llvmlite.ir.VectorType(llvmlite.ir.IntType(32), 8)
        return lambda row: [builder.zext(builder.fcmp_unordered("<", threshold, v), codes) for v in row]
    if width:
        return lambda row: searches_in_registers(context, builder, ta, row, width)
    return lambda row: counts_in_registers(context, builder, ta, row)


def _in_registers(lanes: int, fma_tail: bool, d: int) -> bool:
    """Whether the encode holds a row in registers (_unit_rotated_rows): rows of 8..256 entries
    whose norm vector_norm sums in 8 lanes without an fma tail (norm_order)."""
    return lanes == 8 and not fma_tail and 8 <= d <= REGISTER_ROW_MAX


@functools.lru_cache(maxsize=None)
def paired_rows(d: int, itemsize: int) -> bool:
    """Whether the encode holds two rows of d entries of `itemsize` bytes in registers side by side
    (_unit_rotated_rows): short rows (d ≤ 64: 8 vectors of 8 or fewer) where both fit in the CPU's
    vector registers (vectors_cpu.vector_registers). A short row's chain of steps leaves units
    idle that the other row's fill; a row of 16 vectors or more fills them itself, and two of them
    fill or overflow the registers. One thread, float32, encode of 16 x 1024 rows: on an AVX2 CPU
    (16 registers) pairs took 0.89–0.96x the time of single rows at d = 64, 1.01–1.10x at d = 128
    and 1.03–1.09x at d = 256; on an AVX-512 Zen 4 (32 registers) 0.62–0.91x at d = 64 (b = 0..4,
    6..8) but at d = 128 0.96–1.06x at b = 0..2 and 6..8, and 1.22–1.41x the searched single rows
    at b = 3..5."""
    return d <= 64 and 2 * (d // 8) <= vector_registers(itemsize)


# the row lengths _decoded_row holds in registers (each holds 8 bytes of codes or more)
DECODED_ROWS = (64, 128, REGISTER_ROW_MAX)


@intrinsic(prefer_literal=True)
def _decoded_row(typingctx, packed, d, width, table, entries, folded, div, signs, m, out):
    """out[:] = ((H ŷ) / div ⊙ signs) · m for ŷ the centroids of the packed row's codes, with the
    row in registers: the d/8 groups of codes looked up into vectors (scalar_quantizer_cpu's
    GroupReader; entries a literal as there; folded, a literal: table is folded_table's half, as
    looked_up_row takes it), the butterflies (hadamard_cpu.stages_in_registers),
    the quotient (zero lanes kept: a few centroids' butterflies cancel to exact zeros; unchecked:
    the caller has checked the table with quotients_cpu.in_range_sums, and div = √d is in range)
    and the products, each rounded once, stored once — _dequantize_row then transform in one. d
    one of DECODED_ROWS (any other: nothing is written); packed, table, signs, out contiguous."""
    if not isinstance(entries, types.IntegerLiteral) or not isinstance(folded, types.BooleanLiteral) or \
            packed.layout != "C" or table.layout != "C" or signs.layout != "C" or out.layout != "C":
        return None

    def codegen(context, builder, signature, args):
        pa, ta, sa, oa = (context.make_array(signature.args[k])(context, builder, args[k]) for k in (0, 3, 7, 9))
        w, div, m = args[2], args[6], args[8]
        int64 = llvmlite.ir.IntType(64)
        element = context.get_value_type(out.dtype)
        vector = llvmlite.ir.VectorType(element, 8)

        def build(size):
            reader = GroupReader(context, builder, pa, ta, w, element, entries.literal_value, out.dtype == types.float32)
            v = looked_up_row(context, builder, reader, [builder.mul(llvmlite.ir.Constant(int64, g), w)   # d·w/8 ≥ 8
                                                         for g in range(size // 8)], folded.literal_value,
                              bytewise=folded.literal_value or entries.literal_value == 256)   # 8-bit codes
            v = quotients(builder, stages_in_registers(builder, v), div, reciprocal(builder, div), zeros=True, checked=False)
            for g, value in enumerate(v):
                at = llvmlite.ir.Constant(int64, 8 * g)
                store_vector(context, builder, scaled(builder, value, load_vector(context, builder, sa, at, vector), m), oa, at)
            return []
        by_size(builder, args[1], literal_sizes(d, DECODED_ROWS), build)
        return context.get_dummy_value()
    return types.void(packed, d, width, table, entries, folded, div, signs, m, out), codegen


@numba.jit(**FLAT_JIT)
def _decoded(packed, d, width, table, div, signs, m, out):  # pragma: no cover - compiled
    """_decoded_row with the table's literal entries as _dequantize_row chooses them (lookup_table's
    padded tables), or folded_table's half of 128 entries at 8 bits."""
    if width <= 3 and table.shape[0] == 8:
        _decoded_row(packed, d, width, table, 8, False, div, signs, m, out)
    elif width == 4 and table.shape[0] == 16:
        _decoded_row(packed, d, width, table, 16, False, div, signs, m, out)
    elif width == 5 and table.shape[0] == 32:
        _decoded_row(packed, d, width, table, 32, False, div, signs, m, out)
    elif width == 6 and table.shape[0] == 64:
        _decoded_row(packed, d, width, table, 64, False, div, signs, m, out)
    elif width == 7 and table.shape[0] == 128:
        _decoded_row(packed, d, width, table, 128, False, div, signs, m, out)
    elif width == 8 and table.shape[0] == 128:          # folded_table's half (FOLDED_LOOKUP_WIDTH 8)
        _decoded_row(packed, d, width, table, 128, True, div, signs, m, out)
    elif width == 8 and table.shape[0] == 256:
        _decoded_row(packed, d, width, table, 256, False, div, signs, m, out)
    else:
        _decoded_row(packed, d, width, table, 0, False, div, signs, m, out)


@numba.jit(**FLAT_JIT)
def _scaled_row(xr, bits, mask, held, held_bits, one, lanes, fma_tail, acc, out):  # pragma: no cover - compiled
    """unit_rows' first steps on one row xr: its peak p = max|xr| (NaN if any, as amax gives it;
    1 where not > 0), out = xr / p, and σ = ‖out‖ in vector_norm's order: (p, σ). bits is xr as
    signed integers of its width, mask their sign bit cleared, held and held_bits one scratch
    element viewed as xr's dtype and as those integers; acc _sum_squares' scratch."""
    held_bits[0] = _largest_magnitude(bits, mask)
    peak = held[0]
    if not peak > 0:
        peak = one
    divide(xr, peak, None, None, out)
    return peak, np.sqrt(_sum_squares(out, lanes, fma_tail, acc))


@numba.jit(**FLAT_JIT)
def _encode_rows(x, d, x_bits, mask, held, held_bits, first_row, per_sign, signs, one, div, lanes, fma_tail,
                 in_registers, paired,
                 width, t, use_grid, lo, hi, inv_h, origin, g_first, g_cand, centroids,
                 sketch, sketch_signs, mult,
                 norms, packed, residual_norms, sketch_bits, y, e, acc, q, bits):  # pragma: no cover - compiled
    """Rows x (n, d) coded as the module docstring says: norms[r] (float32), packed[r] the codes
    of `width` bits (none at width 0) by counting thresholds t or by the grid (use_grid: lo, hi,
    inv_h, origin, g_first, g_cand, scalar_quantizer._Grid's fields); with `sketch` also
    residual_norms[r] (float32) and sketch_bits[r], the residual taken against `centroids`.
    Row r uses the sign rows s = (first_row + r) // per_sign of signs and sketch_signs (±1, in
    x's dtype); one, div = √d and mult = √d are scalars of x's dtype; x_bits is x viewed as
    signed integers of its width, mask their sign bit cleared, held and held_bits one scratch
    element viewed as x's dtype and as those integers; y (2, d) and e (d) in x's dtype, acc
    (lanes), q (2, d rounded up to 8) and bits (d rounded up to 8) int32: the caller's scratch (one
    set a thread: the loop allocates nothing). Rows are held in registers where `in_registers`
    (_in_registers), two at a time where `paired` (paired_rows), else one at a time
    (_unit_rotated_rows); 1-bit codes of such rows without a sketch are packed there too. d: x's row
    length (a literal: by_length)."""
    n_rows = x.shape[0]
    counted = width >= 1 and not use_grid
    packs_bits = in_registers and width == 1 and not sketch
    r = 0
    while r < n_rows:
        s = (first_row + r) // per_sign
        count = 2 if paired and in_registers and r + 1 < n_rows else 1
        if in_registers and count == 2:
            # 1 and 2 for two rows side by side in registers, and 3's codes where counted
            s_next = (first_row + r + 1) // per_sign
            if packs_bits:
                peak, sigma, peak_next, sigma_next = _unit_rotated_rows(x, r, 2, d, signs, s, s_next, div, one, y, t, packed, 1)
            elif counted:
                peak, sigma, peak_next, sigma_next = _unit_rotated_rows(x, r, 2, d, signs, s, s_next, div, one, y, t, q, 0)
            else:
                peak, sigma, peak_next, sigma_next = _unit_rotated_rows(x, r, 2, d, signs, s, s_next, div, one, y, None, q, 0)
            norms[r] = np.float32(peak * sigma)
            norms[r + 1] = np.float32(peak_next * sigma_next)
        elif in_registers:
            if packs_bits:
                peak, sigma = _unit_rotated_rows(x, r, 1, d, signs, s, s, div, one, y, t, packed, 1)
            elif counted:
                peak, sigma = _unit_rotated_rows(x, r, 1, d, signs, s, s, div, one, y, t, q, 0)
            else:
                peak, sigma = _unit_rotated_rows(x, r, 1, d, signs, s, s, div, one, y, None, q, 0)
            norms[r] = np.float32(peak * sigma)
        else:
            # 1. unit_rows: the peak (NaN if any, as amax gives it), the scaled row, its norm
            yr = y[0]
            peak, sigma = _scaled_row(x[r], x_bits[r], mask, held, held_bits, one, lanes, fma_tail, acc, yr)
            norms[r] = np.float32(peak * sigma)
            if not sigma > 0:
                sigma = one
            # 2. rht: the unit row with its signs, the butterflies, the normalisation
            divide(yr, sigma, signs[s], None, yr)
            transform(yr, d, div, None, None, yr)
        for k in range(count):
            row, yr, qr = r + k, y[k], q[k]
            # 3. the codes, packed
            if width >= 1 and not packs_bits:
                if use_grid:
                    _grid_row(yr, lo, hi, inv_h, origin, g_first, g_cand, qr)
                elif not in_registers:
                    _count_row(yr, d, t, qr)
                _pack_row(qr, width, packed[row])
            if sketch:
                # 4. the residual, its norm, its signs under the sketch's RHT (×√d: the ±1 H)
                if width >= 1:
                    for i in range(d):
                        e[i] = yr[i] - centroids[qr[i]]
                else:
                    for i in range(d):
                        e[i] = yr[i]
                residual_norms[row] = np.float32(np.sqrt(_sum_squares(e, lanes, fma_tail, acc)))
                ss = sketch_signs[(first_row + row) // per_sign]
                for i in range(d):
                    e[i] = e[i] * ss[i]
                _butterflies(e, d)
                for i in range(d):
                    bits[i] = np.int32((e[i] / div) * mult >= 0)
                _pack_row(bits, 1, sketch_bits[row])
        r += count


@numba.jit(**FLAT_JIT)
def _packed_rows(x, d, first_row, per_sign, signs, one, div, width, table, norms, packed, u):  # pragma: no cover - compiled
    """_encode_rows for rows held one at a time in registers (d one of REGISTER_ROWS, no sketch)
    whose codes are found and packed in registers: norms[r] and packed[r]. 1-bit codes by their
    one threshold, table the thresholds (x's dtype); codes of a width in SEARCHED_WIDTHS (2..6;
    2..8 with AVX-512) by a binary search over the thresholds, table their search_table; codes of
    6 to 8 bits that are not searched by the grid (scalar_quantizer_cpu.GridCodes), table = (lo,
    hi, inv_h, origin as float32; grid_tables' combined entries); both float32. Row r + 1's step
    1 (_unit_row, into u's row (r + 1) mod 2) comes before row r's steps 2 and 3 (_coded_row):
    the norm's chain of dependent additions, a square root and a division then overlap the
    previous row's work instead of stalling its own (one thread, 16 x 1024 rows of a Zen 4 EPYC
    against the row's steps in turn: d = 128 8 / 4 bits 156 -> 149 and 115 -> 108 ns a row, d = 64
    103 -> 89 and 74 -> 59; d = 256, whose rows spill from the registers anyway, 359 -> 312 and
    241 -> 229 with u through memory). u (2, d): scratch in x's dtype. A loop of its own: one compiled with _encode_rows' other paths ran those up to 1.3x
    slower (one thread, d = 128, 1- and 2-bit codes, on an AVX2 EPYC), the tables held across the
    whole loop. d: x's row length (a literal: by_length)."""
    n = x.shape[0]
    if n == 0:
        return
    peak, sigma = _unit_row(x, 0, d, one, u, 0)
    for r in range(n):
        peak_next, sigma_next = one, one
        if r + 1 < n:
            peak_next, sigma_next = _unit_row(x, r + 1, d, one, u, (r + 1) % 2)
        s, slot = (first_row + r) // per_sign, r % 2
        if width == 1:
            _coded_row(u, slot, d, signs, s, sigma, div, one, table, packed, r, 1)
        elif width == 2:
            _coded_row(u, slot, d, signs, s, sigma, div, one, table, packed, r, 2)
        elif width == 3:
            _coded_row(u, slot, d, signs, s, sigma, div, one, table, packed, r, 3)
        elif width == 4:
            _coded_row(u, slot, d, signs, s, sigma, div, one, table, packed, r, 4)
        elif width == 5:
            _coded_row(u, slot, d, signs, s, sigma, div, one, table, packed, r, 5)
        elif width == 6:
            _coded_row(u, slot, d, signs, s, sigma, div, one, table, packed, r, 6)
        elif width == 7:
            _coded_row(u, slot, d, signs, s, sigma, div, one, table, packed, r, 7)
        else:
            _coded_row(u, slot, d, signs, s, sigma, div, one, table, packed, r, 8)
        norms[r] = np.float32(peak * sigma)
        peak, sigma = peak_next, sigma_next


@numba.jit(**FLAT_JIT)
def _decode_rows(packed, d, centroids, lookup, width, norms, first_row, per_sign, signs, one, div,
                 sketch, sketch_bits, residual_norms, sketch_signs, scale, mult, out, y, c, held, fused):  # pragma: no cover - compiled
    """out[r] (d) = s ⊙ H(ŷ)/√d · norms[r] with ŷ the centroids of packed[r]'s codes (0 at width
    0), plus with `sketch` the correction (scale·residual_norms[r]) · (H(2·bit − 1 of
    sketch_bits[r])/√d · mult ⊙ s') — qjl's and hadamard.rht_inverse's products in their order.
    Signs as in _encode_rows; one, div = √d, scale = √(π/2)/d and mult = √d in out's dtype; y, c
    (d) and held (2: the float32 norms in out's dtype, as .to(dtype) gives them) the caller's
    scratch; fused: rows of 64..256 without a sketch may take _decoded (the codebook passed
    quotients_cpu.in_range_sums), with `lookup` as their table (the centroids, or their folded_table). d: out's row length (a literal: by_length)."""
    n_rows = out.shape[0]
    zero, minus_one = one - one, -one
    in_registers = fused and width >= 1 and not sketch and 64 <= d <= REGISTER_ROW_MAX
    for r in range(n_rows):
        s = (first_row + r) // per_sign
        if in_registers:
            held[1] = norms[r]
            _decoded(packed[r], d, width, lookup, div, signs[s], held[1], out[r])
            continue
        if width >= 1:
            _dequantize_row(packed[r], centroids, width, y)
        else:
            for i in range(d):
                y[i] = zero
        if sketch:
            b = sketch_bits[r]
            for i in range(d):
                c[i] = one if (b[i >> 3] >> (7 - (i & 7))) & 1 else minus_one
            _butterflies(c, d)
            ss = sketch_signs[s]
            held[0] = residual_norms[r]
            factor = scale * held[0]
            for i in range(d):
                y[i] = y[i] + factor * (((c[i] / div) * mult) * ss[i])
        held[1] = norms[r]
        transform(y, d, div, signs[s], held[1], out[r])


_encode_rows_by_length, _packed_rows_by_length, _decode_rows_by_length = (
    by_length(loop, 1) for loop in (_encode_rows, _packed_rows, _decode_rows))


def takes(dim: int, dtype: torch.dtype) -> bool:
    """Whether the fused passes code rows of dim (a power of two) in dtype with the chain's bits
    (and the compiled loops are on: emptying compiled.DTYPES routes every codec to its torch passes)."""
    return dtype in FUSED_DTYPES and dtype in compiled.DTYPES and dim >= 2 and not dim & (dim - 1) and \
        norm_order(dtype, dim) is not None


def _sign_rows(signs: torch.Tensor | None, dtype: torch.dtype, d: int) -> np.ndarray:
    """±1 signs (B, H, d) as rows (B·H, d) in dtype; an empty (0, d) array when there are none."""
    if signs is None:
        return _nothing(_numpy_dtype(dtype), (0, d))
    return signs.to(dtype).reshape(-1, d).contiguous().numpy()


@functools.lru_cache(maxsize=None)
def _numpy_dtype(dtype: torch.dtype) -> type:
    return torch.empty(0, dtype=dtype).numpy().dtype.type


@functools.lru_cache(maxsize=None)
def _nothing(kind: type, shape: tuple[int, ...]) -> np.ndarray:
    """An array standing for an absent input or output of the row loops (empty, or never read;
    writable like the arrays it stands for, so the loops see one type)."""
    return np.zeros(shape, kind)


@functools.lru_cache(maxsize=64)
def _encode_tables(book, dtype: torch.dtype, d: int) -> tuple:
    """The arguments of _encode_rows that depend on the codebook (a lloyd_max.Codebook, or None at
    0 MSE bits), the dtype and d alone, remembered per codebook (never written): t (the thresholds in
    dtype, as torch rounds them), whether the grid codes (use_grid), the grid's scalars and
    tables, the centroids in dtype, and the scalars one, √d (as div and as mult), lanes, fma_tail,
    the integer view's type and mask; and the thresholds' search_table (None where the search
    does not apply)."""
    kind = _numpy_dtype(dtype)
    lanes, fma_tail = norm_order(dtype, d)
    if book is None:
        t, c, grid, searched = _nothing(kind, (0,)), np.zeros(1, kind), None, None
    else:
        t = torch.tensor(book.thresholds, dtype=torch.float64).to(dtype).numpy()
        c = book.tensors("cpu", dtype)[0].numpy().copy()
        grid = scalar_quantizer.cpu_grid(book.thresholds, dtype, COUNT_MAX_THRESHOLDS)
        searched = search_table(t)
    if grid is None:
        g = (*grid_scalars(kind, 0.0, 0.0, 1.0, 0.0), np.zeros(1, np.int64), np.zeros(1, kind))
    else:
        g = (*grid_scalars(kind, grid.lo, grid.hi, grid.inv_h, grid.origin), *grid_tables(grid.first, grid.cand))
    as_int = np.int32 if kind == np.float32 else np.int64
    root = kind(math.sqrt(d))
    # the grid as the register pass reads it (_packed_rows), float32 rows
    register_grid = (np.array(g[:4], np.float32), g[4]) if grid is not None and kind == np.float32 else None
    return t, grid is not None, g, c, kind(1), root, lanes, fma_tail, as_int, as_int(np.iinfo(as_int).max), searched, \
        register_grid


def encode(x: torch.Tensor, signs: torch.Tensor, width: int, book, sketch_signs: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """TurboQuant's entries of x (B, H, S, d), a CPU tensor in a FUSED_DTYPES dtype with takes(d, dtype):
    "norm" float32 (B, H, S); at width >= 1 "codes" uint8 (B, H, S, packed_size(d, width)); with
    sketch_signs (±1, (B, H, d): an RHT QJL sketch) "residual_norm" float32 (B, H, S) and "sketch"
    uint8 (B, H, S, ⌈d/8⌉). signs (B, H, d) ±1; book the width's Lloyd–Max codebook (None at
    width 0): its thresholds code, its centroids in x's dtype are the residual's reconstruction."""
    b, h, n, d = x.shape
    t, use_grid, g, c, one, root, lanes, fma_tail, as_int, mask, searched, register_grid = _encode_tables(book, x.dtype, d)
    x = x.detach().contiguous()
    rows = b * h * n
    sketch = sketch_signs is not None
    norms = torch.empty(rows, dtype=torch.float32)
    packed = torch.empty(rows, (d * width + 7) // 8, dtype=torch.uint8)
    out = {"norm": norms.view(b, h, n)}
    if width >= 1:
        out["codes"] = packed.view(b, h, n, packed.shape[1])
    if sketch:
        residual_norms = torch.empty(rows, dtype=torch.float32)
        bits = torch.empty(rows, (d + 7) // 8, dtype=torch.uint8)
        out["residual_norm"], out["sketch"] = residual_norms.view(b, h, n), bits.view(b, h, n, bits.shape[1])
        rr, br = residual_norms.numpy(), bits.numpy()
    else:
        rr, br = _nothing(np.float32, (0,)), _nothing(np.uint8, (0, (d + 7) // 8))
    if not rows:
        return out
    xr, pr, nr = x.reshape(rows, d).numpy(), packed.numpy(), norms.numpy()
    sr, kr = _sign_rows(signs, x.dtype, d), _sign_rows(sketch_signs, x.dtype, d)
    in_registers, paired = _in_registers(lanes, fma_tail, d), paired_rows(d, x.element_size())
    # rows one at a time in registers (_packed_rows) whose codes a search finds, even where pairs
    # are held (one thread, 16 x 1024 rows on a Zen 4 EPYC, b = 2 / 3 / 4 against pairs that
    # count: d = 64 59.7 / 78.6 / 72.8 -> 54.3 / 57.3 / 61.0 ns a row, d = 32 0.68-0.89x, d = 8
    # 0.53-0.60x); whose codes of 6 to 8 bits the grid finds there; and 1-bit rows where no pairs
    # are held (d = 128 96.1 -> 84.2; pairs of 64 46.5 against 49.1 alone)
    searching = searched is not None and not sketch and in_registers
    gridding = not searching and register_grid is not None and not sketch and in_registers and not paired and width >= 6
    one_bit = width == 1 and not sketch and in_registers and not paired

    def run(start, stop):
        if searching or gridding or one_bit:
            _packed_rows_by_length(xr[start:stop], d, start, n, sr, one, root, width,
                         t if one_bit else searched if searching else register_grid,
                         nr[start:stop], pr[start:stop], np.empty((2, d), xr.dtype))
            return
        held = np.zeros(1, xr.dtype)                        # one per thread
        _encode_rows_by_length(xr[start:stop], d, xr[start:stop].view(as_int), mask, held, held.view(as_int),
                     start, n, sr, one, root, lanes, fma_tail, in_registers, paired,
                     width, t, use_grid, *g, c, sketch, kr, root,
                     nr[start:stop], pr[start:stop], rr[start:stop] if sketch else rr,
                     br[start:stop] if sketch else br, np.empty((2, d), xr.dtype), np.empty(d, xr.dtype),
                     np.empty(max(lanes, 1), xr.dtype), np.zeros((2, -(-d // 8) * 8), np.int32),
                     np.zeros(-(-d // 8) * 8, np.int32))
    by_row_blocks(rows, x.numel(), run, deferred=True)   # read after the scheme's encode
    return out


@functools.lru_cache(maxsize=64)
def _decode_tables(centroids: bytes, stored: str, dtype: torch.dtype, d: int) -> tuple:
    """The arguments of _decode_rows that depend on the stored codebook (its bytes, of NumPy dtype
    `stored`; none at 0 MSE bits), the dtype and d alone, remembered (never written): the centroids as
    _decoded_row looks them up (lookup_table, in dtype), whether its unchecked quotients hold for
    them (quotients_cpu.in_range_sums), its table (their folded_table where there is one, else
    them), and the scalars one and √d. (The sketch's scale is read
    from qjl.sketch_scale on each call, never remembered.)"""
    kind = _numpy_dtype(dtype)
    if centroids:
        c = lookup_table(torch.from_numpy(np.frombuffer(centroids, np.dtype(stored)).copy()).to(dtype).numpy())
        fused = in_range_sums(c, d)
        half = folded_table(c)
    else:
        c, fused, half = np.zeros(1, kind), False, None
    return c, fused, c if half is None else half, kind(1), kind(math.sqrt(d))


def decode(shape: tuple[int, int, int, int], dtype: torch.dtype, norms: torch.Tensor, signs: torch.Tensor,
           width: int, packed: torch.Tensor | None, centroids: torch.Tensor | None,
           sketch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The decoded tensor (B, H, S, d) = shape in dtype (FUSED_DTYPES, takes(d, dtype)) of encode's
    entries: norms float32 (B, H, S), signs ±1 (B, H, d), at width >= 1 the packed codes and the
    centroids (2^width,) (the stored codebook); sketch = (bits, residual norms, sketch signs
    (B, H, d)) for an RHT-sketched tensor."""
    b, h, n, d = shape
    out = torch.empty(shape, dtype=dtype)
    if not out.numel():
        return out
    o = out.reshape(-1, d).numpy()
    nr = norms.contiguous().reshape(-1).numpy()
    sr = _sign_rows(signs, dtype, d)
    if width >= 1:
        pr = packed.contiguous().reshape(-1, packed.shape[-1]).numpy()
        stored = centroids.detach().contiguous().numpy()
        c, fused, lookup, one, root = _decode_tables(stored.tobytes(), stored.dtype.str, dtype, d)
    else:
        pr = _nothing(np.uint8, (0, 1))
        c, fused, lookup, one, root = _decode_tables(b"", "", dtype, d)
    scale = _numpy_dtype(dtype)(qjl.sketch_scale(d))   # rounded to dtype as torch's product rounds it
    if sketch is not None:
        bits, residual_norms, sketch_signs = sketch
        br = bits.contiguous().reshape(-1, bits.shape[-1]).numpy()
        rr = residual_norms.contiguous().reshape(-1).numpy()
        kr = _sign_rows(sketch_signs, dtype, d)
    else:
        br, rr, kr = _nothing(np.uint8, (0, 1)), _nothing(np.float32, (0,)), _sign_rows(None, dtype, d)

    def run(start, stop):
        _decode_rows_by_length(pr[start:stop] if width >= 1 else pr, d, c, lookup, width, nr[start:stop], start, n, sr, one, root,
                     sketch is not None, br[start:stop] if sketch is not None else br,
                     rr[start:stop] if sketch is not None else rr, kr, scale, root, o[start:stop],
                     np.empty(d, o.dtype), np.empty(d, o.dtype), np.empty(2, o.dtype), fused)
    by_row_blocks(o.shape[0], out.numel(), run, deferred=True)   # read after the scheme's decode
    return out
