"""The compiled CPU loops (numba; kvcommon/compiled.py) of the scalar quantiser
(schemes/scalar_quantizer.py): one pass over a row that quantises, packs and keeps the uint8 codes,
by counting the thresholds below each element or by the quantiser's grid, and one that unpacks and
looks up the centroids. The same bits as the quantiser's torch passes: the same cell arithmetic,
the same comparison, the same big-endian layout as packing.pack_bits. Rows split across the torch
threads (compiled.by_row_blocks).
"""
from __future__ import annotations


import llvmlite.ir
import numba
import numpy as np
import torch
from numba import types
from numba.core import cgutils
from numba.core.extending import intrinsic

from kvcommon.compiled import FLAT_JIT, JIT, by_row_blocks, row_view
from kvcommon.vectors_cpu import by_length, by_size, counted_loop, gather, halved, has_feature, joined, literal_sizes, load_vector, splat, store_vector

# Up to this many thresholds (5-bit codebooks) a row is coded by counting the thresholds below
# each element (_count_blocks: a block of 8 elements against each threshold in turn, the count in
# a register); above it by scalar_quantizer's grid: the exact cell and one comparison (two table
# lookups an element, not vectorised). One thread, 1 M float32 elements, on a 2-core AMD EPYC,
# counting one threshold at a time: 0.3 / 1.0 / 2.0 ms at 1 / 15 / 31 thresholds, 3.8 ms at 63;
# 3.3 ms by the grid at any count (by blocks, a row of 128 on the Xeon: 15 thresholds 151 -> 86 ns).
COUNT_MAX_THRESHOLDS = 31


@intrinsic
def _pack_groups(typingctx, q, groups, width, out):
    """out[g·width : (g + 1)·width] = the 8 codes q[8g : 8g + 8] (int32, `width` bits each, below
    2^width) packed big-endian, for g < groups: the group's bits gathered in one 64-bit word (the
    codes shifted in one vector, then or-ed together), its bytes in memory order by a byte swap,
    and stored as 8 bytes. The store runs past the group's `width` bytes into the next group's,
    which the next group overwrites: the caller packs its last group itself. q, out contiguous."""
    if q.layout != "C" or out.layout != "C":
        return None

    def codegen(context, builder, signature, args):
        qa, oa = (context.make_array(signature.args[k])(context, builder, args[k]) for k in (0, 3))
        w = args[2]
        int32, int64 = llvmlite.ir.IntType(32), llvmlite.ir.IntType(64)
        codes, words = llvmlite.ir.VectorType(int32, 8), llvmlite.ir.VectorType(int64, 8)
        reduce_or = cgutils.get_or_insert_function(builder.module, llvmlite.ir.FunctionType(int64, [words]),
                                                   "llvm.vector.reduce.or.v8i64")
        bswap = cgutils.get_or_insert_function(builder.module, llvmlite.ir.FunctionType(int64, [int64]), "llvm.bswap.i64")
        shifts = builder.mul(splat(builder, w, 8), llvmlite.ir.Constant(words, [7, 6, 5, 4, 3, 2, 1, 0]))  # code k at w·(7 − k)
        top = builder.sub(llvmlite.ir.Constant(int64, 64), builder.mul(w, llvmlite.ir.Constant(int64, 8)))
        with counted_loop(builder, args[1], 1, name="pack") as loop:
            v = load_vector(context, builder, qa, builder.mul(loop.index, llvmlite.ir.Constant(int64, 8)), codes)
            word = builder.call(reduce_or, [builder.shl(builder.zext(v, words), shifts)])
            word = builder.call(bswap, [builder.shl(word, top)])                # the first byte lowest in memory
            dest = builder.gep(oa.data, [builder.mul(loop.index, w)])
            builder.store(word, builder.bitcast(dest, int64.as_pointer()), align=1)
        return context.get_dummy_value()
    return types.void(q, types.int64, types.int64, out), codegen


def store_packed(builder, codes: list, width: int, at) -> None:
    """IR: the codes of a row held in registers (`codes`: vectors of 8 int32, each below 2^width,
    1 <= width <= 8) stored packed big-endian (packing.pack_bits' layout) from the byte pointer
    `at` on, exactly len(codes)·width bytes. 1-bit codes: a vector's 8 bits, lanes reversed (lane
    0 the highest), read as one byte. Wider: each vector's codes shifted into one word (32 bits
    for widths up to 4, else 64) and or-ed together, its bytes in memory order by a byte swap; the
    word stored whole (its bytes past the group's `width` are the next group's, which overwrites
    them) but for the last group, stored in pieces of 8, 4, 2 and 1 bytes. 8-bit codes: two
    vectors joined and truncated to 16 bytes (vpmovdb), stored as they are (one thread, encode of
    16 x 1024 rows on a Zen 4 EPYC against the words: 148.9 -> 140.9 ns a row at d = 128, 308.0
    -> 271.7 at d = 256)."""
    if width == 1:
        bits8 = llvmlite.ir.VectorType(llvmlite.ir.IntType(1), 8)
        reverse = llvmlite.ir.Constant(llvmlite.ir.VectorType(llvmlite.ir.IntType(32), 8), list(range(7, -1, -1)))
        for g, code in enumerate(codes):
            lanes = builder.trunc(code, bits8)
            byte = builder.bitcast(builder.shuffle_vector(lanes, lanes, reverse), llvmlite.ir.IntType(8))
            builder.store(byte, builder.gep(at, [llvmlite.ir.Constant(llvmlite.ir.IntType(64), g)]))
        return
    if width == 8:                                 # a code a byte: two groups' codes truncated to 16 bytes
        int8 = llvmlite.ir.IntType(8)
        for g in range(0, len(codes) - 1, 2):
            both = builder.trunc(joined(builder, codes[g:g + 2])[0], llvmlite.ir.VectorType(int8, 16))
            place = builder.gep(at, [llvmlite.ir.Constant(llvmlite.ir.IntType(64), 8 * g)])
            builder.store(both, builder.bitcast(place, both.type.as_pointer()), align=1)
        if len(codes) % 2:
            last = builder.trunc(codes[-1], llvmlite.ir.VectorType(int8, 8))
            place = builder.gep(at, [llvmlite.ir.Constant(llvmlite.ir.IntType(64), 8 * (len(codes) - 1))])
            builder.store(last, builder.bitcast(place, last.type.as_pointer()), align=1)
        return
    bits = 32 if 8 * width <= 32 else 64
    word_type = llvmlite.ir.IntType(bits)
    words = llvmlite.ir.VectorType(word_type, 8)
    reduce_or = cgutils.get_or_insert_function(builder.module, llvmlite.ir.FunctionType(word_type, [words]),
                                               f"llvm.vector.reduce.or.v8i{bits}")
    bswap = cgutils.get_or_insert_function(builder.module, llvmlite.ir.FunctionType(word_type, [word_type]), f"llvm.bswap.i{bits}")
    shifts = llvmlite.ir.Constant(words, [width * (7 - k) for k in range(8)])       # code k at w·(7 − k)
    top = llvmlite.ir.Constant(word_type, bits - 8 * width)
    for g, code in enumerate(codes):
        wide = code if bits == 32 else builder.zext(code, words)
        word = builder.call(bswap, [builder.shl(builder.call(reduce_or, [builder.shl(wide, shifts)]), top)])
        place = builder.gep(at, [llvmlite.ir.Constant(llvmlite.ir.IntType(64), g * width)])
        if g + 1 < len(codes):
            builder.store(word, builder.bitcast(place, word_type.as_pointer()), align=1)
            continue
        done = 0
        while done < width:                          # the last group's `width` bytes, the first lowest in the word
            piece = max(p for p in (8, 4, 2, 1) if p <= width - done and 8 * p <= bits)
            part = builder.trunc(builder.lshr(word, llvmlite.ir.Constant(word_type, 8 * done)), llvmlite.ir.IntType(8 * piece))
            target = builder.gep(place, [llvmlite.ir.Constant(llvmlite.ir.IntType(64), done)])
            builder.store(part, builder.bitcast(target, llvmlite.ir.IntType(8 * piece).as_pointer()), align=1)
            done += piece


@numba.jit(**FLAT_JIT)
def _pack_row(q, width, out):  # pragma: no cover - compiled
    """out[:] = the codes q (zero-padded to whole groups of 8), `width` bits each, big-endian:
    each group of 8 codes is `width` whole bytes; the last group's bytes past len(out) are dropped.
    A width that divides 8 fills each byte from its 8/width codes (a loop LLVM vectorises); other
    widths pack whole groups a word at a time (_pack_groups), the groups whose 8-byte store would
    pass the row's end one byte at a time. q, out contiguous."""
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
    groups = q.shape[0] // 8
    last = min(groups, (n_bytes - 8) // width + 1) if n_bytes >= 8 else 0    # groups whose 8-byte store stays in out
    _pack_groups(q, last, width, out)
    for g in range(last, groups):
        word = np.int64(0)
        for k in range(8):
            word = (word << width) | np.int64(q[8 * g + k])
        for b in range(width):
            at = g * width + b
            if at < n_bytes:
                out[at] = (word >> (8 * (width - 1 - b))) & 255


@intrinsic
def _count_blocks(typingctx, y, t, n, q):
    """q[i] = #{j : t[j] < y[i]} (NaN: len(t)) for the first n entries of y (a multiple of 8), a
    block of 8 in one LLVM vector: its count kept in a vector register over the thresholds (each
    broadcast and compared once). y, t, q contiguous; t in y's dtype, q int32."""
    if y.layout != "C" or t.layout != "C" or q.layout != "C":
        return None

    def codegen(context, builder, signature, args):
        ya, ta, qa = (context.make_array(signature.args[k])(context, builder, args[k]) for k in (0, 1, 3))
        int32 = llvmlite.ir.IntType(32)
        vector, counts = llvmlite.ir.VectorType(context.get_value_type(y.dtype), 8), llvmlite.ir.VectorType(int32, 8)
        n_t = builder.extract_value(ta.shape, 0)
        with counted_loop(builder, args[2], 8, name="count") as block:
            v = load_vector(context, builder, ya, block.index, vector)
            with counted_loop(builder, n_t, 1, [llvmlite.ir.Constant(counts, None)], "thresholds") as loop:
                below = builder.fcmp_ordered("<", splat(builder, builder.load(builder.gep(ta.data, [loop.index])), 8), v)
                loop.next = [builder.add(loop.carried[0], builder.zext(below, counts))]
            top = splat(builder, builder.trunc(n_t, int32), 8)
            codes = builder.select(builder.fcmp_unordered("uno", v, v), top, loop.carried[0])   # NaN: the top index
            store_vector(context, builder, codes, qa, block.index)
        return context.get_dummy_value()
    return types.void(y, t, n, q), codegen


def counts_in_registers(context, builder, ta, vectors: list) -> list:
    """IR: the codes #{j : t[j] < v} (NaN: len(t)) of each vector of 8 of `vectors` (a row held in
    registers), int32: the thresholds outer, each broadcast once and compared with every vector,
    the counts carried in registers across them. ta: the thresholds' array struct (vectors' dtype)."""
    int32 = llvmlite.ir.IntType(32)
    counts = llvmlite.ir.VectorType(int32, 8)
    n_t = builder.extract_value(ta.shape, 0)
    with counted_loop(builder, n_t, 1, [llvmlite.ir.Constant(counts, None)] * len(vectors), "thresholds") as loop:
        threshold = splat(builder, builder.load(builder.gep(ta.data, [loop.index])), 8)
        loop.next = [builder.add(c, builder.zext(builder.fcmp_ordered("<", threshold, value), counts))
                     for c, value in zip(loop.carried, vectors, strict=True)]
    top = splat(builder, builder.trunc(n_t, int32), 8)
    return [builder.select(builder.fcmp_unordered("uno", value, value), top, c)       # NaN: the top index
            for c, value in zip(loop.carried, vectors, strict=True)]


# The code widths whose codes a row in registers finds by a binary search over the thresholds
# (searches_in_registers) rather than by counting them or by the grid. One thread, a tq-kv encode
# of 8 x 1024 rows on a 2-vCPU AMD EPYC (Zen 3, AVX2), against counting (3, 4 bits) and the grid
# (5): d = 128 1.03-1.07x, 1.24x at 5 bits; d = 256 1.10 / 1.29 / 1.18x at 3 / 4 / 5 bits; at 6
# bits (32 candidates on the last level, four permutes) no faster than the grid. With AVX-512's
# two-table permutes, on a Zen 4 EPYC, 16 x 1024 rows against the grid: 6 bits 222 -> 176 ns a
# row at d = 128 and 416 -> 341 at d = 256 (vectors of 8), 7 bits 221 -> 175 at d = 128 and
# 466 -> 365 at d = 256 (vectors of 16: SEARCH_LANES), while 8 bits took 225 against 205 (since
# folded: FOLDED_WIDTHS). 2 bits (a broadcast and a select; the codes then packed in registers,
# turboquant_cpu) 125 -> 109 ns a row against counting, d = 128 (AVX2 code on the same CPU 148 ->
# 117).
SEARCHED_WIDTHS = (2, 3, 4, 5, 6, 7, 8) if has_feature("avx512vl") else (2, 3, 4, 5, 6)
# The widths whose search goes over the thresholds' positive half alone, one level fewer
# (searches_in_registers), where the codebook is symmetric about 0 as Lloyd–Max's of a symmetric
# density is; search_table declines any other. One thread, encode of 16 x 1024 rows of 128 on a
# Zen 4 EPYC (the searches level by level): 8 bits 164 ns a row by the full search, 156 folded,
# 189 by the grid; 6 bits 137 -> 144 folded, so not folded; 7 bits, with a NaN's key and
# unordered comparisons (no NaN check after the levels), 141.9 -> 136.7 (d = 64 86.0 -> 82.9,
# d = 256 288.3 -> 290.0). AVX2 code on the same CPU: 6 bits 193 by the full search, 173-176
# folded, about 190 by the grid; 7 bits folded 208-245 against the grid's 177-184.
FOLDED_WIDTHS = (7, 8) if has_feature("avx512vl") else (6,)


def mirrored(builder, c, upper, half: int):
    """IR: c xor h where `upper`, else c xor (h − 1), h = `half` (a power of two), lane by lane
    (int32 vectors): a count or code c < h of a folded half's upper side as c + h, of its lower
    side as h − 1 − c — the folded search's code, the folded lookup's index."""
    lanes = c.type
    return builder.xor(c, builder.select(upper, llvmlite.ir.Constant(lanes, [half] * lanes.count),
                                         llvmlite.ir.Constant(lanes, [half - 1] * lanes.count)))


def search_table(thresholds: np.ndarray) -> np.ndarray | None:
    """The 2^w − 1 thresholds of a width w in SEARCHED_WIDTHS (float32, ascending) as
    searches_in_registers reads them, level by level: level k = 1..w holds the 2^(k−1)
    thresholds t[(2j + 1)·2^(w−k) − 1] (j < 2^(k−1)) its comparisons can take, padded with zeros
    to at least SEARCH_LANES entries. At a width of FOLDED_WIDTHS, the levels of the w − 1 bits
    of the positive half t[h + 1:] (h = 2^(w−1) − 1), which must mirror the negative one exactly
    about t[h] = 0 (t[h + 1 + j] = −t[h − 1 − j]), all finite. None where the search does not
    apply: another count or dtype, thresholds out of order, a folded width's thresholds not so,
    or no AVX2 (permutes pick the candidates)."""
    width = len(thresholds).bit_length()
    if thresholds.dtype != np.float32 or len(thresholds) != (1 << width) - 1 or width not in SEARCHED_WIDTHS or \
            not np.all(thresholds[1:] >= thresholds[:-1]) or not has_feature("avx2"):
        return None
    if width in FOLDED_WIDTHS:
        h = len(thresholds) // 2
        if thresholds[h] != 0 or not np.all(np.isfinite(thresholds)) or \
                not np.array_equal(thresholds[h + 1:], -thresholds[:h][::-1]):
            return None
        thresholds, width = thresholds[h + 1:], width - 1
    levels = []
    for k in range(1, width + 1):
        step = 1 << (width - k)
        level = thresholds[np.arange(1 << (k - 1)) * 2 * step + step - 1]
        levels.append(np.concatenate([level, np.zeros(max(SEARCH_LANES - len(level), 0), np.float32)]))
    return np.concatenate(levels)


# The lanes of the vectors searches_in_registers compares: with AVX-512F two vectors of 8 joined
# into one of 16 (a zmm register), whose two-table permutes pick from 32 candidates at once, for
# widths from WIDE_SEARCH_MIN_WIDTH on (a level of 32 candidates or more). One thread, encode of
# 16 x 1024 rows of 128 on a Zen 4 EPYC against vectors of 8: 6 bits 163 -> 150 ns a row, 7
# bits 226 -> 175 (the grid's 221); 2-5 bits 1-3 % slower; 8 bits 225 against the grid's 205.
SEARCH_LANES = 16 if has_feature("avx512f") else 8
WIDE_SEARCH_MIN_WIDTH = 6


def searches_in_registers(context, builder, sa, vectors: list, width: int) -> list:
    """IR: counts_in_registers' codes #{j : t[j] < v} (NaN: len(t)) of each vector of 8 of
    `vectors` (float32), by a binary search: for thresholds in ascending order those below v are
    a prefix of them, and w halvings find its length. The code c starts at 0; level k = 1..w
    compares v with t[c + s − 1], s = 2^(w−k), and adds s where that threshold lies below v or v
    is NaN (an unordered comparison: a NaN adds every step, the top index, as counting gives it;
    search_table's thresholds are in order, so none is NaN). The
    candidates of level k, 2^(k−1) of them: one broadcast, two by a select on the first
    comparison, four and more by permutes (_permuted on c's high bits). With SEARCH_LANES 16, two
    vectors of 8 go as one of 16 (an even count of them, from WIDE_SEARCH_MIN_WIDTH bits on).
    Vectors of 16 go level by level, each level's steps for all of them in turn (vectors of 8 one
    after the other, all its levels before the next): every vector's search is a chain of w
    dependent steps (a shift, a permute, a comparison, an or), and the CPU runs independent ones
    side by side only as far as it sees ahead — one thread, a row of 128 on a Zen 4 EPYC, 7 bits
    164 -> 147 ns a row and 6 bits 145 -> 137 (vectors of 8 gain nothing: 5 bits 132 -> 136).
    At a width of FOLDED_WIDTHS the search goes over the positive half P of the thresholds
    (search_table's; the middle one 0, the halves mirrored), w − 1 levels, with a key in place of
    v: for v > 0, |v|, and the code 2^(w−1) + #{P < v} (every threshold ≤ 0 lies below v); for
    v ≤ 0, the next float above |v| (its bits + 1; +inf kept), #{P < next(|v|)} = #{P ≤ |v|},
    and the code #{P > |v|} = 2^(w−1) − 1 − #{P ≤ |v|} (t = −p lies below v exactly where p > −v);
    both an exclusive or of the count with 2^(w−1) or 2^(w−1) − 1. A NaN's key is +inf (the key's
    bits at most +inf's), taken as above 0: the top index, 2^(w−1) + 2^(w−1) − 1.
    sa: search_table's array struct for the width, a literal w in SEARCHED_WIDTHS."""
    int32, int64 = llvmlite.ir.IntType(32), llvmlite.ir.IntType(64)
    folded = width in FOLDED_WIDTHS
    width -= folded                 # the levels searched
    n_lanes = SEARCH_LANES if len(vectors) % 2 == 0 and width >= WIDE_SEARCH_MIN_WIDTH else 8
    lanes, vector = llvmlite.ir.VectorType(int32, n_lanes), llvmlite.ir.VectorType(llvmlite.ir.FloatType(), n_lanes)
    levels, start = [], 0
    for k in range(1, width + 1):
        n = 1 << (k - 1)
        if n <= 2:
            levels.append([splat(builder, builder.load(builder.gep(sa.data, [llvmlite.ir.Constant(int64, start + j)])), n_lanes)
                           for j in range(n)])
        else:
            levels.append([load_vector(context, builder, sa, llvmlite.ir.Constant(int64, start + n_lanes * m), vector)
                           for m in range(max(n // n_lanes, 1))])
        start += max(n, SEARCH_LANES)
    if n_lanes == 16:
        vectors = joined(builder, vectors)
    zero = llvmlite.ir.Constant(lanes, None)

    def constant(value):
        return llvmlite.ir.Constant(lanes, [value] * n_lanes)

    def keyed(v):
        """(the value the levels compare, whether v > 0 or NaN)."""
        if not folded:
            return v, None
        above = builder.fcmp_unordered(">", v, llvmlite.ir.Constant(vector, None))
        size = builder.add(builder.and_(builder.bitcast(v, lanes), constant(0x7FFFFFFF)),
                           builder.zext(builder.not_(above), lanes))
        infinity = constant(0x7F800000)
        return builder.bitcast(builder.select(builder.icmp_unsigned("<", size, infinity), size, infinity), vector), above
    out = []
    for block in ([vectors] if n_lanes == 16 else [[v] for v in vectors]):
        keys = [keyed(v) for v in block]
        codes = [zero] * len(block)
        for k, candidates in enumerate(levels, start=1):
            step = constant(1 << (width - k))
            for i, ((v, _), c) in enumerate(zip(keys, codes)):
                if k == 1:
                    threshold = candidates[0]
                elif k == 2:
                    threshold = builder.select(builder.icmp_unsigned("!=", c, zero), candidates[1], candidates[0])
                else:
                    index = builder.lshr(c, llvmlite.ir.Constant(lanes, [width - k + 1] * n_lanes))   # c / 2s
                    threshold = _permuted(builder, candidates, index, max(n_lanes, 1 << (k - 1)))
                codes[i] = builder.or_(c, builder.and_(builder.sext(builder.fcmp_unordered("<", threshold, v), lanes), step))
        if folded:
            codes = [mirrored(builder, c, above, 1 << width) for c, (_, above) in zip(codes, keys)]
        out += codes
    return halved(builder, out) if n_lanes == 16 else out


# the row lengths _count_in_registers holds in registers
COUNTED_ROWS = (64, 128, 256)


@intrinsic(prefer_literal=True)
def _count_in_registers(typingctx, y, n, t, q):
    """_count_blocks for a whole row of n entries, one of COUNTED_ROWS (any other: nothing is
    written), held in registers (counts_in_registers; code for each length: by_size). y, t, q
    contiguous; t in y's dtype."""
    if y.layout != "C" or t.layout != "C" or q.layout != "C":
        return None

    def codegen(context, builder, signature, args):
        ya, ta, qa = (context.make_array(signature.args[k])(context, builder, args[k]) for k in (0, 2, 3))
        vector = llvmlite.ir.VectorType(context.get_value_type(y.dtype), 8)

        def build(size):
            at = [llvmlite.ir.Constant(llvmlite.ir.IntType(64), 8 * k) for k in range(size // 8)]
            codes = counts_in_registers(context, builder, ta, [load_vector(context, builder, ya, i, vector) for i in at])
            for c, i in zip(codes, at, strict=True):
                store_vector(context, builder, c, qa, i)
            return []
        by_size(builder, args[1], literal_sizes(n, COUNTED_ROWS), build)
        return context.get_dummy_value()
    return types.void(y, n, t, q), codegen


@numba.jit(**FLAT_JIT)
def _count_row(y, n, t, q):  # pragma: no cover - compiled
    """q[i] = #{j : t[j] < y[i]} for the n elements of a row y (n = len(y), a literal where the caller's is; NaN: len(t), the top index
    bucketize gives it); q's entries past n are left alone. Rows of 64, 128 and 256 in registers
    (_count_in_registers), others in whole blocks of 8 by _count_blocks and the rest one by one.
    y, t, q contiguous."""
    if n == 64 or n == 128 or n == 256:                 # COUNTED_ROWS
        _count_in_registers(y, n, t, q)
        return
    blocks = n - n % 8
    _count_blocks(y, t, blocks, q)
    top = np.int32(t.shape[0])
    for i in range(blocks, n):
        c = top * np.int32(y[i] != y[i])        # NaN: the top index; no t[j] < NaN adds to it
        for j in range(t.shape[0]):
            c += np.int32(t[j] < y[i])
        q[i] = c


@numba.jit(**JIT)
def _count_rows(y, n, t, width, codes, packed):  # pragma: no cover - compiled
    """codes[r] = _count_row of y[r] and packed[r] the row's codes packed; n: y's row length (a
    literal: by_length)."""
    n_rows = y.shape[0]
    q = np.zeros(-(-n // 8) * 8, np.int32)
    for r in range(n_rows):
        _count_row(y[r], n, t, q)
        for i in range(n):
            codes[r, i] = q[i]
        _pack_row(q, width, packed[r])


_count_rows_by_length = by_length(_count_rows, 1)


class GridCodes:
    """IR: the codes of vectors of 8 float32 by scalar_quantizer._Grid: v clamped to [lo, hi] (NaN
    to hi), its cell floor(v·inv_h) − origin, and first[cell] + [cand[cell] < v] with both read by
    one 64-bit gather of grid_tables' combined entry (the count above, cand's float32 bits below;
    LLVM's masked gather: one vpgatherdq on AVX-512). lo, hi, inv_h float32 and origin int32
    scalars; entries: a pointer to the combined entries (int64)."""

    def __init__(self, builder, lo, hi, inv_h, origin, entries):
        int32, int64 = llvmlite.ir.IntType(32), llvmlite.ir.IntType(64)
        self.vector, self.cells, self.wide = (llvmlite.ir.VectorType(kind, 8) for kind in (llvmlite.ir.FloatType(), int32, int64))
        self.floor = cgutils.get_or_insert_function(builder.module, llvmlite.ir.FunctionType(self.vector, [self.vector]),
                                                    "llvm.floor.v8f32")
        self.pointers = llvmlite.ir.VectorType(int64.as_pointer(), 8)
        self.flags = llvmlite.ir.VectorType(llvmlite.ir.IntType(1), 8)
        self.gathered = cgutils.get_or_insert_function(
            builder.module, llvmlite.ir.FunctionType(self.wide, [self.pointers, int32, self.flags, self.wide]),
            "llvm.masked.gather.v8i64.v8p0")
        self.base = splat(builder, builder.ptrtoint(entries, int64), 8)
        self.low, self.high, self.scale, self.start = (splat(builder, value, 8) for value in (lo, hi, inv_h, origin))

    def codes(self, builder, v):
        """The codes (int32) of the vector v."""
        int32 = llvmlite.ir.IntType(32)
        clamped = builder.select(builder.fcmp_ordered("<", v, self.low), self.low, v)
        clamped = builder.select(builder.fcmp_ordered("<=", clamped, self.high), clamped, self.high)    # NaN to hi
        cell = builder.sub(builder.fptosi(builder.call(self.floor, [builder.fmul(clamped, self.scale)]), self.cells), self.start)
        at = builder.inttoptr(builder.add(self.base, builder.mul(builder.sext(cell, self.wide),
                                                                 llvmlite.ir.Constant(self.wide, [8] * 8))), self.pointers)
        entry = builder.call(self.gathered, [at, llvmlite.ir.Constant(int32, 8), llvmlite.ir.Constant(self.flags, [1] * 8),
                                             llvmlite.ir.Constant(self.wide, None)])
        below = builder.trunc(builder.lshr(entry, llvmlite.ir.Constant(self.wide, [32] * 8)), self.cells)
        inside = builder.fcmp_ordered("<", builder.bitcast(builder.trunc(entry, self.cells), self.vector), v)
        return builder.add(below, builder.zext(inside, self.cells))


@intrinsic
def _grid_blocks(typingctx, y, n, lo, hi, inv_h, origin, first, cand, q):
    """_grid_row's codes for the first n entries of y (a multiple of 8), 8 entries a vector
    (GridCodes). float32 rows only: returns the entries coded, n, or 0 (the caller codes the
    rest). first int64 (grid_tables), q int32; contiguous."""
    if y.layout != "C" or first.layout != "C" or cand.layout != "C" or q.layout != "C":
        return None
    vectorised = y.dtype == types.float32 and first.dtype == types.int64

    def codegen(context, builder, signature, args):
        int64 = llvmlite.ir.IntType(64)
        if not vectorised:
            return llvmlite.ir.Constant(int64, 0)
        ya, fa, qa = (context.make_array(signature.args[k])(context, builder, args[k]) for k in (0, 6, 8))
        vector = llvmlite.ir.VectorType(llvmlite.ir.FloatType(), 8)
        grid = GridCodes(builder, *args[2:6], fa.data)
        with counted_loop(builder, args[1], 8, name="grid") as block:
            store_vector(context, builder, grid.codes(builder, load_vector(context, builder, ya, block.index, vector)),
                         qa, block.index)
        return args[1]
    return types.int64(y, n, lo, hi, inv_h, origin, first, cand, q), codegen


@numba.jit(**FLAT_JIT)
def _grid_row(y, lo, hi, inv_h, origin, first, cand, q):  # pragma: no cover - compiled
    """The codes of _count_row by scalar_quantizer._Grid: y clamped to [lo, hi] (NaN to hi), its cell
    floor(y·inv_h) − origin, and first[cell] + [cand[cell] < y]. lo, hi and inv_h in y's dtype
    (held exactly: cpu_grid checks), origin an int32, first int64 (grid_tables: the count in its
    high 32 bits). Whole blocks of 8
    by _grid_blocks where it takes them; the rest in two passes: the cells (branch-free,
    vectorised), then the two table lookups; the comparison takes y itself, which gives the
    clamped value's answer (the outermost cells hold no threshold, cand = +inf)."""
    n = y.shape[0]
    done = _grid_blocks(y, n - n % 8, lo, hi, inv_h, origin, first, cand, q)
    for i in range(done, n):
        v = y[i]
        v = lo if v < lo else v
        v = v if v <= hi else hi                        # NaN to hi, the top cell
        q[i] = np.int32(np.floor(v * inv_h)) - origin   # exact: a power-of-two scale, integers
    for i in range(done, n):
        c = q[i]
        q[i] = np.int32(first[c] >> 32) + np.int32(cand[c] < y[i])


@numba.jit(**JIT)
def _grid_rows(y, lo, hi, inv_h, origin, first, cand, width, codes, packed):  # pragma: no cover - compiled
    """codes[r] = _grid_row of y[r] and packed[r] the row's codes packed."""
    n_rows, n = y.shape
    q = np.zeros(-(-n // 8) * 8, np.int32)
    for r in range(n_rows):
        _grid_row(y[r], lo, hi, inv_h, origin, first, cand, q)
        for i in range(n):
            codes[r, i] = q[i]
        _pack_row(q, width, packed[r])


def _permuted(builder, table, codes, entries):
    """IR: the vector of table[code] for the int32 codes (8 or 16 lanes), table the first
    `entries` (8, 16, 32, ...) of a float32 table held in vectors of as many lanes: 16 lanes by
    AVX-512F's two-table permute (vpermi2ps on zmm registers: the code's low 5 bits pick one of
    32 entries; a table of 16 given twice); 8 lanes with AVX-512VL by its two-table permute on
    ymm registers (low 4 bits, 16 entries), else by AVX2's vpermps (one permute a vector: the low
    3 bits pick the lane); then the code's higher bits pick among them (a tree of selects)."""
    n_lanes = codes.type.count
    vector, lanes = llvmlite.ir.VectorType(llvmlite.ir.FloatType(), n_lanes), codes.type
    parts = table[:max(entries // n_lanes, 1)]
    two_tables = "llvm.x86.avx512.vpermi2var.ps.512" if n_lanes == 16 else \
        "llvm.x86.avx512.vpermi2var.ps.256" if has_feature("avx512vl") and len(parts) >= 2 else None
    if two_tables:
        permute = cgutils.get_or_insert_function(builder.module, llvmlite.ir.FunctionType(vector, [vector, lanes, vector]),
                                                 two_tables)
        if len(parts) == 1:
            parts = parts * 2
        level = [builder.call(permute, [low, codes, high]) for low, high in zip(parts[::2], parts[1::2])]
        bit = 2 * n_lanes
    else:
        permute = cgutils.get_or_insert_function(builder.module, llvmlite.ir.FunctionType(vector, [vector, lanes]),
                                                 "llvm.x86.avx2.permps")
        level = [builder.call(permute, [part, codes]) for part in parts]
        bit = 8
    while len(level) > 1:
        upper = builder.icmp_unsigned("!=", builder.and_(codes, llvmlite.ir.Constant(lanes, [bit] * n_lanes)),
                                      llvmlite.ir.Constant(lanes, None))
        level = [builder.select(upper, high, low) for low, high in zip(level[::2], level[1::2])]
        bit *= 2
    return level[0]


class GroupReader:
    """IR: the values table[code] of the 8 codes of a group of a packed row (`width` bits each,
    big-endian): the group's bytes loaded as one 64-bit word (8 bytes from its first on; near the
    row's end the 8 ending there, shifted down; in a row of fewer than 8 bytes one byte at a time),
    byte-swapped so that its first byte is the highest, the 8 codes shifted out of it in one
    vector, then looked up: with `entries` 8..PERMUTED_MAX_ENTRIES, from the table's first `entries`
    held in registers (_permuted; the table at least that long), with 0 or more than
    PERMUTED_MAX_ENTRIES by AVX2's gather (float32: AVX2 code on a Zen 4 EPYC, one thread, decode
    of 16 x 1024 rows of 128, 7 / 8 bits 131.2 -> 101.4 and 179.7 -> 91.0 ns a row against
    permutes of 128 / 256 entries), or — in float64 or without AVX2 — by a load a code. pa, ta:
    the packed row's and the table's array structs; w the width (i64); element the values' LLVM
    type."""

    def __init__(self, context, builder, pa, ta, w, element, entries: int, float32: bool):
        int64 = llvmlite.ir.IntType(64)
        self.pa, self.ta, self.w, self.element = pa, ta, w, element
        self.held = entries if float32 and has_feature("avx2") and entries <= PERMUTED_MAX_ENTRIES else 0
        self.gathered = float32 and has_feature("avx2")
        words, self.vector = llvmlite.ir.VectorType(int64, 8), llvmlite.ir.VectorType(element, 8)
        self.bswap = cgutils.get_or_insert_function(builder.module, llvmlite.ir.FunctionType(int64, [int64]), "llvm.bswap.i64")
        self.shifts = builder.sub(llvmlite.ir.Constant(words, [64] * 8),
                                  builder.mul(splat(builder, w, 8), llvmlite.ir.Constant(words, list(range(1, 9)))))
        self.mask = splat(builder, builder.sub(builder.shl(llvmlite.ir.Constant(int64, 1), w), llvmlite.ir.Constant(int64, 1)), 8)
        self.halves = [load_vector(context, builder, ta, llvmlite.ir.Constant(int64, 8 * k), self.vector)
                       for k in range(self.held // 8)]
        self.n_bytes = builder.extract_value(pa.shape, 0)

    def _word(self, builder, start):
        """The group's bytes from `start` on as the low bytes of an i64 in memory order, from the 8
        bytes there or, near the row's end, the 8 ending there shifted down (a row of 8 bytes or more)."""
        int64 = llvmlite.ir.IntType(64)
        eight = llvmlite.ir.Constant(int64, 8)
        base = builder.select(builder.icmp_signed("<=", builder.add(start, eight), self.n_bytes), start,
                              builder.sub(self.n_bytes, eight))
        loaded = builder.load(builder.bitcast(builder.gep(self.pa.data, [base]), int64.as_pointer()), align=1)
        return builder.lshr(loaded, builder.mul(builder.sub(start, base), eight))

    def values(self, builder, start, long_row: bool = False):
        """The group's values, its bytes from `start` (i64) on; long_row: the caller knows the row
        holds 8 bytes or more."""
        return self.looked_up(builder, self.codes(builder, start, long_row))

    def codes(self, builder, start, long_row: bool = False):
        """The group's 8 codes (int32), as `values` reads them."""
        int32, int64 = llvmlite.ir.IntType(32), llvmlite.ir.IntType(64)
        eight = llvmlite.ir.Constant(int64, 8)
        if long_row:
            word = self._word(builder, start)
        else:
            with builder.if_else(builder.icmp_signed(">=", self.n_bytes, eight), likely=True) as (wide, short):
                with wide:
                    loaded = self._word(builder, start)
                    after_load = builder.block
                with short:                     # a row of fewer than 8 bytes: its group's bytes one at a time
                    source = builder.gep(self.pa.data, [start])
                    with counted_loop(builder, self.w, 1, [llvmlite.ir.Constant(int64, 0)], "bytes") as part:
                        byte = builder.zext(builder.load(builder.gep(source, [part.index])), int64)
                        part.next = [builder.or_(part.carried[0], builder.shl(byte, builder.mul(part.index, eight)))]
                    assembled = part.carried[0]
                    after_bytes = builder.block
            word = builder.phi(int64)
            word.add_incoming(loaded, after_load)
            word.add_incoming(assembled, after_bytes)
        word = builder.call(self.bswap, [word])
        codes = builder.trunc(builder.and_(builder.lshr(splat(builder, word, 8), self.shifts), self.mask),
                              llvmlite.ir.VectorType(int32, 8))
        return codes

    def looked_up(self, builder, codes):
        """The values table[code] of a vector of 8 codes."""
        int32 = llvmlite.ir.IntType(32)
        if self.held:
            return _permuted(builder, self.halves, codes, self.held)
        if self.gathered:
            return gather(builder, self.ta.data, codes, self.element, 4)
        v = llvmlite.ir.Constant(self.vector, None)
        for k in range(8):
            at = builder.extract_element(codes, llvmlite.ir.Constant(int32, k))
            v = builder.insert_element(v, builder.load(builder.gep(self.ta.data, [at])), llvmlite.ir.Constant(int32, k))
        return v


def looked_up_row(context, builder, reader, starts: list, folded: bool = False, bytewise: bool = False) -> list:
    """IR: the values of the groups of a row held in registers whose bytes start at `starts` (i64
    each; a row of 8 bytes or more): by the reader (GroupReader) one group at a time, or — with
    AVX-512F and a table of WIDE_LOOKUP_MIN_ENTRIES or more held in registers — two groups'
    codes joined into a vector of 16 and picked by zmm two-table permutes (32 entries each).
    folded: the reader's table is folded_table's positive half h = 2^(w−1) entries of codes of w
    bits; a code c ≥ h takes table[c − h], a code c < h −table[h − 1 − c] (the index c xor h or
    c xor (h − 1), the sign bit flipped after the lookup). bytewise: the codes are 8-bit, each
    vector's (of 8, or of 16 for two groups) zero-extended from its bytes (vpmovzxbd) instead of
    shifted out of a word (one thread, decode of 16 x 1024 rows on a Zen 4 EPYC, best of three
    alternating processes: 74.3 -> 56.9 ns a row at d = 128, 150.2 -> 119.2 at d = 256, 41.2 ->
    32.8 at d = 64)."""
    wide_lookup = has_feature("avx512f") and reader.held >= WIDE_LOOKUP_MIN_ENTRIES and len(starts) % 2 == 0
    if bytewise:
        int8, int32 = llvmlite.ir.IntType(8), llvmlite.ir.IntType(32)
        lanes = 16 if wide_lookup else 8
        codes = [builder.zext(builder.load(builder.bitcast(builder.gep(reader.pa.data, [start]),
                                                           llvmlite.ir.VectorType(int8, lanes).as_pointer()), align=1),
                              llvmlite.ir.VectorType(int32, lanes))
                 for start in starts[::lanes // 8]]
    else:
        codes = [reader.codes(builder, start, long_row=True) for start in starts]

    def looked_up(lookup, code):
        if not folded:
            return lookup(code)
        lanes = code.type
        n = lanes.count
        upper = builder.icmp_unsigned("!=", builder.and_(code, llvmlite.ir.Constant(lanes, [reader.held] * n)),
                                      llvmlite.ir.Constant(lanes, None))
        value = lookup(mirrored(builder, code, upper, reader.held))
        bits = 32 if isinstance(reader.element, llvmlite.ir.FloatType) else 64
        whole = llvmlite.ir.VectorType(llvmlite.ir.IntType(bits), n)
        sign = builder.select(upper, llvmlite.ir.Constant(whole, None), llvmlite.ir.Constant(whole, [-(1 << (bits - 1))] * n))
        return builder.bitcast(builder.xor(builder.bitcast(value, whole), sign), value.type)
    if not wide_lookup:
        return [looked_up(lambda c: reader.looked_up(builder, c), code) for code in codes]
    wide = llvmlite.ir.VectorType(reader.element, 16)
    table = [load_vector(context, builder, reader.ta, llvmlite.ir.Constant(llvmlite.ir.IntType(64), 16 * k), wide)
             for k in range(reader.held // 16)]
    return halved(builder, [looked_up(lambda c: _permuted(builder, table, c, reader.held), pair)
                            for pair in (codes if bytewise else joined(builder, codes))])


@intrinsic(prefer_literal=True)
def _lookup_groups(typingctx, packed, groups, width, table, entries, out):
    """out[8g + k] = table[code k of group g] for g < groups (GroupReader; `entries` a literal)."""
    if packed.layout != "C" or table.layout != "C" or out.layout != "C" or \
            not isinstance(entries, types.IntegerLiteral):
        return None

    def codegen(context, builder, signature, args):
        pa, ta, oa = (context.make_array(signature.args[k])(context, builder, args[k]) for k in (0, 3, 5))
        int64 = llvmlite.ir.IntType(64)
        reader = GroupReader(context, builder, pa, ta, args[2], context.get_value_type(out.dtype),
                             entries.literal_value, out.dtype == types.float32)
        with counted_loop(builder, args[1], 1, name="lookup") as loop:
            v = reader.values(builder, builder.mul(loop.index, args[2]))
            store_vector(context, builder, v, oa, builder.mul(loop.index, llvmlite.ir.Constant(int64, 8)))
        return context.get_dummy_value()
    return types.void(packed, types.int64, types.int64, table, entries, out), codegen


# Tables of up to this many float32 entries are looked up by permutes (GroupReader), longer ones by
# AVX2's gather. One thread, a tq-kv decode of 8 x 1024 rows of 128 on a 2-vCPU AMD EPYC (Zen 3):
# 5-bit codes (32 entries) 114 ns a row by four permutes against 134 by the gather; 6-bit (64) 149
# by eight permutes against 134. With AVX-512VL's two-table permutes, on a Zen 4 EPYC, 16 x 1024
# rows: 6-bit 90 -> 66 ns a row (four permutes), 7-bit (128, eight) 88 against the gather's 91;
# a row in registers with WIDE_LOOKUP_MIN_ENTRIES or more (looked_up_row: two groups as one
# vector of 16, zmm permutes of 32 entries) 6 / 7 / 8 bits 67 -> 62, 92 -> 70, 91 -> 78 ns a row
# at d = 128 (d = 256: 136 -> 128, 185 -> 136, 185 -> 162).
PERMUTED_MAX_ENTRIES = 256 if has_feature("avx512vl") else 32
WIDE_LOOKUP_MIN_ENTRIES = 64


# The code width whose lookups in registers take the positive half of a codebook symmetric about 0
# (looked_up_row's `folded`; folded_table): four zmm permutes a vector of 16 instead of eight. One
# thread, decode of 16 x 1024 rows on a Zen 4 EPYC: 77.2 -> 74.3 ns a row at d = 128, 160.6 -> 148.9
# at d = 256, 41.5 -> 41.3 at d = 64 (7 bits, 64 entries folded, would gain nothing: 7 bits take 68
# against 6 bits' 61).
FOLDED_LOOKUP_WIDTH = 8


def folded_table(table: np.ndarray) -> np.ndarray | None:
    """The positive half table[2^(w−1):] of a lookup_table of 2^w float32 centroids, w =
    FOLDED_LOOKUP_WIDTH, whose lower half mirrors it exactly (table[k] = −table[2^w − 1 − k]), as
    looked_up_row takes it folded (bit for bit: a zero's sign too); None for any other table, or
    without AVX-512VL (where the whole table is not held in registers either)."""
    half = 1 << (FOLDED_LOOKUP_WIDTH - 1)
    if table.dtype != np.float32 or len(table) != 2 * half or not has_feature("avx512vl") or \
            not np.array_equal(table[:half].view(np.uint32), (-table[half:][::-1]).view(np.uint32)):
        return None
    return table[half:].copy()


def lookup_table(centroids: np.ndarray) -> np.ndarray:
    """The centroids as _dequantize_row takes them: float32 ones padded with zeros to a multiple of
    8 entries where permutes pick from them (tables of at most PERMUTED_MAX_ENTRIES), else
    as they are."""
    if centroids.dtype != np.float32 or len(centroids) > PERMUTED_MAX_ENTRIES or not has_feature("avx2"):
        return centroids
    return np.concatenate([centroids, np.zeros(-len(centroids) % 8, np.float32)])


@numba.jit(**FLAT_JIT)
def _dequantize_row(packed, centroids, width, out):  # pragma: no cover - compiled
    """out[i] = centroids[code i of packed], the codes `width` bits each, big-endian: each whole
    group of 8 codes read from its `width` bytes as one word (no chain from code to code), the
    codes of a last partial group one after the other."""
    n = out.shape[0]
    mask = (1 << width) - 1
    groups = n // 8
    if width == 8:
        for i in range(n):
            out[i] = centroids[packed[i]]
        return
    if width <= 3 and centroids.shape[0] == 8:            # lookup_table's padded tables
        _lookup_groups(packed, groups, width, centroids, 8, out)
    elif width == 4 and centroids.shape[0] == 16:
        _lookup_groups(packed, groups, width, centroids, 16, out)
    elif width == 5 and centroids.shape[0] == 32:
        _lookup_groups(packed, groups, width, centroids, 32, out)
    elif width == 6 and centroids.shape[0] == 64:
        _lookup_groups(packed, groups, width, centroids, 64, out)
    elif width == 7 and centroids.shape[0] == 128:
        _lookup_groups(packed, groups, width, centroids, 128, out)
    else:
        _lookup_groups(packed, groups, width, centroids, 0, out)
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


@numba.jit(**JIT)
def _dequantize_rows(packed, centroids, width, out):  # pragma: no cover - compiled
    """out[r] = _dequantize_row of packed[r]."""
    for r in range(out.shape[0]):
        _dequantize_row(packed[r], centroids, width, out[r])


def grid_tables(first: torch.Tensor, cand: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """A grid's tables as _grid_row takes them: first as int64 entries holding the count in their
    high 32 bits and, for float32 grids, cand's bits in their low 32 (one 64-bit gather reads
    both: _grid_blocks), and cand."""
    c = cand.numpy()
    entries = first.numpy().astype(np.int64) << 32
    if c.dtype == np.float32:
        entries |= c.view(np.uint32).astype(np.int64)
    return entries, c


def grid_scalars(dtype: np.dtype, lo: float, hi: float, inv_h: float, origin: float) -> tuple:
    """A grid's bounds and scale in the rows' dtype, its origin int32, as _grid_row takes them."""
    kind = np.dtype(dtype).type
    return kind(lo), kind(hi), kind(inv_h), np.int32(origin)


def _outputs(y: torch.Tensor, packed_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(*y.shape[:-1], packed_bytes, dtype=torch.uint8),
            torch.empty(y.shape, dtype=torch.uint8))


def count_pack(y: torch.Tensor, thresholds: torch.Tensor, width: int,
               packed_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 (..., packed_bytes), codes uint8 (..., n)) of y (..., n), a CPU tensor in a
    compiled.DTYPES dtype, codes #{t < y} for thresholds ascending in y's dtype (at most
    COUNT_MAX_THRESHOLDS; equal ones allowed), by counting."""
    y = y.detach().contiguous()
    packed, codes = _outputs(y, packed_bytes)
    if y.numel():
        yr, t, cr, pr = row_view(y), thresholds.detach().contiguous().numpy(), row_view(codes), row_view(packed)
        by_row_blocks(yr.shape[0], y.numel(),
                       lambda a, b: _count_rows_by_length(yr[a:b], yr.shape[1], t, width, cr[a:b], pr[a:b]))
    return packed, codes


def grid_pack(y: torch.Tensor, lo: float, hi: float, inv_h: float, origin: float, first: torch.Tensor,
              cand: torch.Tensor, width: int, packed_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as count_pack by scalar_quantizer._Grid's fields (first uint8, cand in y's dtype), for
    codebooks of any size the grid holds."""
    y = y.detach().contiguous()
    packed, codes = _outputs(y, packed_bytes)
    if y.numel():
        yr, cr, pr = row_view(y), row_view(codes), row_view(packed)
        f, c = grid_tables(first, cand)
        lo, hi, inv_h, origin = grid_scalars(yr.dtype, lo, hi, inv_h, origin)
        by_row_blocks(yr.shape[0], y.numel(),
                       lambda a, b: _grid_rows(yr[a:b], lo, hi, inv_h, origin, f, c, width, cr[a:b], pr[a:b]))
    return packed, codes


def dequantize_packed(packed: torch.Tensor, centroids: torch.Tensor, width: int, n: int) -> torch.Tensor:
    """Centroid values (..., n) of the codes packed (..., bytes), both on the CPU, centroids in
    a compiled.DTYPES dtype."""
    packed = packed.contiguous()
    out = torch.empty(*packed.shape[:-1], n, dtype=centroids.dtype)
    if out.numel():
        pr, c, o = row_view(packed), lookup_table(centroids.detach().contiguous().numpy()), row_view(out)
        by_row_blocks(pr.shape[0], out.numel(), lambda a, b: _dequantize_rows(pr[a:b], c, width, o[a:b]))
    return out
