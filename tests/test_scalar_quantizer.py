"""schemes.scalar_quantizer (and its loops, schemes.scalar_quantizer_cpu): the grid quantiser gives bucketize's indices exactly (uint8), byte-table
decoding gives the centroids of the unpacked codes, and the uint8 group packing the bytes of
the int64-word packing it replaced."""
import llvmlite.ir
import numba
import numba.extending
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvcommon import compiled
from kvcommon.vectors_cpu import load_vector, store_vector
from schemes import scalar_quantizer_cpu
from schemes.scalar_quantizer import cpu_grid, dequantize_packed, quantize, quantize_pack
from schemes.lloyd_max import beta_codebook, gaussian_codebook
from schemes.packing import pack_bits, unpack_bits, unpack_codes


def _edge_values(thresholds: torch.Tensor) -> torch.Tensor:
    """The thresholds themselves, their float neighbours, ±0, ±inf, NaN and far-out values."""
    up, down = torch.full_like(thresholds, 10.0), torch.full_like(thresholds, -10.0)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.0, -1.0, 3e38, -3e38,
                            1e-45, -1e-45, 1e-39, -1e-39])      # subnormal in float32
    return torch.cat((thresholds, torch.nextafter(thresholds, up), torch.nextafter(thresholds, down),
                      special.to(thresholds.dtype)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("book", ["beta-32", "beta-128", "beta-512", "gaussian"])
def test_quantize_equals_bucketize(book, bits, dtype):
    kind, _, dim = book.partition("-")
    cb = beta_codebook(int(dim), bits) if kind == "beta" else gaussian_codebook(bits, 1.0)
    thresholds = torch.tensor(cb.thresholds, dtype=torch.float64).to(dtype)
    scale = float(np.sqrt(cb.second_moment))
    y = torch.cat((torch.randn(20000, generator=torch.Generator().manual_seed(bits), dtype=dtype) * 2 * scale,
                   _edge_values(thresholds)))
    codes = quantize(y, cb.thresholds)
    assert codes.dtype == torch.uint8
    assert torch.equal(codes.to(torch.int64), torch.bucketize(y, thresholds))


@given(width=st.integers(1, 8), n=st.integers(1, 70), rows=st.integers(1, 3), seed=st.integers(0, 2 ** 31),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_dequantize_packed_equals_the_unpacked_lookup(width, n, rows, seed, dtype):
    """Rows of every length up to 70 (whole groups of 8 codes, a partial last one, rows of fewer
    than 8 bytes), float32 (codebooks of up to 16 picked by a permute in registers) and float64."""
    gen = np.random.default_rng(seed)
    codes = torch.from_numpy(gen.integers(0, 2 ** width, size=(rows, 2, n)))
    packed = pack_bits(codes, width)
    assert torch.equal(unpack_codes(packed, width, n), codes.to(torch.uint8))
    assert torch.equal(unpack_bits(packed, width, n), codes)
    centroids = torch.from_numpy(np.sort(gen.standard_normal(2 ** width))).to(dtype)
    assert torch.equal(dequantize_packed(packed, centroids, width, n), centroids[codes])


@given(width=st.integers(1, 8), n=st.integers(1, 40), seed=st.integers(0, 2 ** 31))
def test_group_packing_matches_the_bit_string(width, n, seed):
    """The bytes are the big-endian bit string of the codes, each row padded with zeros."""
    codes = np.random.default_rng(seed).integers(0, 2 ** width, size=(2, n))
    bits = ((codes[..., None] >> np.arange(width - 1, -1, -1)) & 1).reshape(2, -1)
    expected = np.packbits(bits, axis=-1)
    assert np.array_equal(pack_bits(torch.from_numpy(codes), width).numpy(), expected)
    assert np.array_equal(pack_bits(torch.from_numpy(codes).to(torch.uint8), width).numpy(), expected)


def test_quantize_pack_returns_both():
    cb = beta_codebook(64, 3)
    y = torch.randn(4, 64, generator=torch.Generator().manual_seed(3)) / 8
    packed, codes = quantize_pack(y, cb.thresholds, 3)
    assert torch.equal(packed, pack_bits(torch.bucketize(y, torch.tensor(cb.thresholds, dtype=torch.float32)), 3))
    assert torch.equal(codes.to(torch.int64), torch.bucketize(y, torch.tensor(cb.thresholds, dtype=torch.float32)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_equal_thresholds_fall_back_to_bucketize(dtype):
    """Two equal thresholds cannot sit one to a cell; such a codebook is searched by bucketize."""
    thresholds = np.array([-0.5, 0.0, 0.0, 0.25])
    y = torch.cat((torch.linspace(-1, 1, 101, dtype=dtype), torch.tensor([float("nan"), 0.0, -0.0], dtype=dtype)))
    assert torch.equal(quantize(y, thresholds).to(torch.int64),
                       torch.bucketize(y, torch.tensor(thresholds, dtype=dtype)))


# --- the compiled CPU loops (schemes/scalar_quantizer_cpu.py) against bucketize, pack_bits and the torch passes ---
def _torch_passes(monkeypatch):
    """Route scalar_quantizer through its torch passes (the path of CUDA and half precision)."""
    monkeypatch.setattr(compiled, "DTYPES", ())  # scalar_quantizer reads it on every call


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [64, 128, 256, 45])
def test_compiled_loops_quantize_pack_equal_bucketize_and_the_torch_passes(bits, dtype, n, monkeypatch):
    """Both of the loops' methods (counting up to 31 thresholds, the grid above) give bucketize's
    codes and pack_bits' bytes, on rows split across threads (≥ 64 k elements) or not."""
    cb = beta_codebook(128, bits)
    thresholds = torch.tensor(cb.thresholds, dtype=torch.float64).to(dtype)
    gen = torch.Generator().manual_seed(bits)
    for rows in (3, 2000):
        y = torch.randn(rows, n, generator=gen, dtype=dtype) * 2 * float(np.sqrt(cb.second_moment))
        edges = _edge_values(thresholds)
        y.view(-1)[:edges.numel()] = edges[: y.numel()]
        expected = torch.bucketize(y, thresholds).to(torch.uint8)
        packed, codes = quantize_pack(y, cb.thresholds, bits)
        assert torch.equal(codes, expected)
        assert torch.equal(packed, pack_bits(expected, bits))
        centroids = torch.tensor(cb.centroids, dtype=dtype)
        assert torch.equal(dequantize_packed(packed, centroids, bits, n), centroids[expected.to(torch.int64)])
        with monkeypatch.context() as m:
            _torch_passes(m)
            assert torch.equal(quantize_pack(y, cb.thresholds, bits)[0], packed)
            assert torch.equal(dequantize_packed(packed, centroids, bits, n), centroids[expected.to(torch.int64)])


@given(thresholds=st.lists(st.floats(-4, 4, allow_nan=False, width=32), min_size=1, max_size=40),
       n=st.integers(1, 20), seed=st.integers(0, 2 ** 31))
def test_compiled_loops_count_any_sorted_thresholds(thresholds, n, seed):
    """Any ascending thresholds, equal ones included (where the grid gives up), are counted
    exactly as bucketize searches them."""
    t = np.sort(np.asarray(thresholds, dtype=np.float32))
    gen = torch.Generator().manual_seed(seed)
    y = torch.cat((torch.randn(3, n, generator=gen) * 3, torch.from_numpy(np.resize(t, (1, n)))))
    width = max(1, int(np.ceil(np.log2(len(t) + 1))))
    expected = torch.bucketize(y, torch.from_numpy(t)).to(torch.uint8)
    packed, codes = quantize_pack(y, t.astype(np.float64), width)
    assert torch.equal(codes, expected)
    assert torch.equal(packed, pack_bits(expected, width))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_grid_bounds_the_dtype_cannot_hold_fall_back_to_counting(dtype):
    """The loops compute a grid's cells in the rows' dtype: thresholds whose clamp bound float32
    cannot hold (−2²⁴ − 1 below −2²⁴ at a spacing of 1) are counted there, and float64 keeps the
    grid; either way the codes are bucketize's."""
    thresholds = np.array([-16777216.0, -16777215.0, -16777214.0])
    grid = cpu_grid(thresholds, dtype, count_max=0)
    assert (grid is None) == (dtype == torch.float32)
    y = torch.tensor([-16777218.0, -16777216.0, -16777215.5, -16777215.0, -16777214.0, 0.0, float("nan")], dtype=dtype)
    rows = y.unsqueeze(0).expand(1000, -1).contiguous()
    expected = torch.bucketize(y, torch.tensor(thresholds, dtype=dtype)).to(torch.uint8).expand(1000, -1)
    assert torch.equal(quantize_pack(rows, thresholds, 2)[1], expected)
    if grid is not None:
        g = grid
        assert torch.equal(scalar_quantizer_cpu.grid_pack(rows, g.lo, g.hi, g.inv_h, g.origin, g.first, g.cand, 2, 2)[1],
                           expected)


def test_compiled_loops_split_does_not_change_the_result(monkeypatch):
    """The same bytes with the rows on one thread and split across two."""
    cb = beta_codebook(64, 6)
    y = torch.randn(4096, 64, generator=torch.Generator().manual_seed(5)) / 8
    with monkeypatch.context() as m:
        m.setattr(torch, "get_num_threads", lambda: 1)
        one = quantize_pack(y, cb.thresholds, 6)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    two = quantize_pack(y, cb.thresholds, 6)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("width", range(1, 9))
def test_dequantize_packed_at_every_width_and_row_end(width, dtype):
    """Every width, in both dtypes, at lengths around the groups of 8 codes and the rows' last
    8 bytes (where the whole-word loads stop): the centroids of the unpacked codes."""
    gen = np.random.default_rng(width)
    centroids = torch.from_numpy(np.sort(gen.standard_normal(2 ** width))).to(dtype)
    for n in (1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 128, 256):
        codes = torch.from_numpy(gen.integers(0, 2 ** width, size=(5, n)))
        assert torch.equal(dequantize_packed(pack_bits(codes, width), centroids, width, n), centroids[codes]), n


@numba.extending.intrinsic(prefer_literal=True)
def _searched_block(typingctx, y, table, width, q):
    """q[:64] = searches_in_registers' codes of y[:64] (float32) at the literal width, the block
    held as 8 vectors of 8 as a row in registers is."""
    if not isinstance(width, numba.types.IntegerLiteral):
        return None

    def codegen(context, builder, signature, args):
        ya, sa, qa = (context.make_array(signature.args[k])(context, builder, args[k]) for k in (0, 1, 3))
        vector = llvmlite.ir.VectorType(llvmlite.ir.FloatType(), 8)
        at = [llvmlite.ir.Constant(llvmlite.ir.IntType(64), 8 * k) for k in range(8)]
        codes = scalar_quantizer_cpu.searches_in_registers(
            context, builder, sa, [load_vector(context, builder, ya, i, vector) for i in at], width.literal_value)
        for code, i in zip(codes, at):
            store_vector(context, builder, code, qa, i)
        return context.get_dummy_value()
    return numba.types.void(y, table, width, q), codegen


@numba.njit
def _searched(y, table, width, q):
    for start in range(0, y.shape[0], 64):
        if width == 2:
            _searched_block(y[start:start + 64], table, 2, q[start:start + 64])
        elif width == 3:
            _searched_block(y[start:start + 64], table, 3, q[start:start + 64])
        elif width == 4:
            _searched_block(y[start:start + 64], table, 4, q[start:start + 64])
        elif width == 5:
            _searched_block(y[start:start + 64], table, 5, q[start:start + 64])
        elif width == 6:
            _searched_block(y[start:start + 64], table, 6, q[start:start + 64])
        elif width == 7:
            _searched_block(y[start:start + 64], table, 7, q[start:start + 64])
        else:
            _searched_block(y[start:start + 64], table, 8, q[start:start + 64])


@pytest.mark.skipif(not scalar_quantizer_cpu.has_feature("avx2"), reason="the search's permutes are AVX2's")
@pytest.mark.parametrize("width", scalar_quantizer_cpu.SEARCHED_WIDTHS)
@pytest.mark.parametrize("book", ["beta-128", "gaussian", "ties"])
def test_the_binary_search_gives_the_count_of_thresholds_below(book, width):
    """searches_in_registers' codes are #{j : t_j < y} (NaN: the top index), bucketize's, on the
    thresholds themselves, their neighbours, ±0, ±inf, NaN, subnormal and far-out values, and on
    Gaussian values: for a Lloyd–Max codebook and for ascending thresholds with runs of equal ones
    (at a folded width mirrored about 0, zeros in the middle run); and search_table declines
    thresholds out of order, other counts and float64, and at a folded width (FOLDED_WIDTHS)
    thresholds not mirrored exactly or not finite."""
    folded = width in scalar_quantizer_cpu.FOLDED_WIDTHS
    if book == "ties" and folded:                            # mirrored about 0: runs of zeros, in the middle, at the ends
        p = np.sort(np.abs(np.random.default_rng(width).normal(size=(1 << (width - 1)) - 1))).astype(np.float32)
        p[0], p[-2], p[len(p) // 2 + 1] = 0, p[-1], p[len(p) // 2]
        t = np.concatenate([-p[::-1], [np.float32(0)], p])
    elif book == "ties":
        t = np.sort(np.random.default_rng(width).normal(size=(1 << width) - 1)).astype(np.float32)
        t[1], t[-2] = t[0], t[-1]                            # runs of two at both ends, of three in the middle
        t[len(t) // 2 - 1:len(t) // 2 + 2] = t[len(t) // 2]
    else:
        cb = beta_codebook(128, width) if book == "beta-128" else gaussian_codebook(width, 1.0)
        t = torch.tensor(cb.thresholds, dtype=torch.float64).to(torch.float32).numpy()
    thresholds = torch.from_numpy(t)
    y = torch.cat((_edge_values(thresholds), torch.randn(3000, generator=torch.Generator().manual_seed(width)) * 2))
    y = torch.cat((y, torch.zeros(-len(y) % 64))).numpy()
    q = np.zeros(len(y), np.int32)
    _searched(y, scalar_quantizer_cpu.search_table(t), width, q)
    assert np.array_equal(q, torch.bucketize(torch.from_numpy(y), thresholds).numpy())
    out_of_order = t.copy()
    out_of_order[0] = t[-1] + 1                               # above the next one, whatever ties t holds
    assert scalar_quantizer_cpu.search_table(out_of_order) is None
    assert scalar_quantizer_cpu.search_table(t[1:]) is None
    assert scalar_quantizer_cpu.search_table(t.astype(np.float64)) is None
    if folded:
        low, high = t.copy(), t.copy()
        low[0] = np.nextafter(t[0], np.float32(-np.inf))            # the lowest one an ulp off its mirror
        high[0], high[-1] = -np.inf, np.inf                         # mirrored, the ends not finite
        for lopsided in (t + np.float32(1e-3), low, high):          # shifted: the middle one not 0
            assert np.all(lopsided[1:] >= lopsided[:-1]) and scalar_quantizer_cpu.search_table(lopsided) is None


@pytest.mark.skipif(not scalar_quantizer_cpu.has_feature("avx512vl"), reason="tables are folded with AVX-512VL only")
def test_folded_table_takes_only_a_table_mirrored_bit_for_bit():
    """folded_table is the upper half of an 8-bit Lloyd–Max lookup table, whose lower half is its
    mirror; None where one entry differs from its mirror by an ulp or by a zero's sign, for
    another length and for float64."""
    c = scalar_quantizer_cpu.lookup_table(torch.tensor(beta_codebook(128, 8).centroids, dtype=torch.float64)
                                          .to(torch.float32).numpy())
    assert np.array_equal(scalar_quantizer_cpu.folded_table(c), c[128:])
    off = c.copy()
    off[3] = np.nextafter(off[3], np.float32(0))
    zeros = np.concatenate([-c[129:][::-1], [np.float32(0.0), np.float32(0.0)], c[129:]]).astype(np.float32)
    assert np.array_equal(zeros[:128], -zeros[128:][::-1])             # equal as values, not as bits
    for table in (off, zeros, c[:128], c.astype(np.float64)):
        assert scalar_quantizer_cpu.folded_table(table) is None


@numba.extending.intrinsic(prefer_literal=True)
def _stored_packed(typingctx, q, groups, width, out):
    """store_packed of the first `groups` vectors of 8 codes of q (int32; literals groups, width)
    into out from its first byte on."""
    if not isinstance(groups, numba.types.IntegerLiteral) or not isinstance(width, numba.types.IntegerLiteral):
        return None

    def codegen(context, builder, signature, args):
        qa, oa = (context.make_array(signature.args[k])(context, builder, args[k]) for k in (0, 3))
        lanes = llvmlite.ir.VectorType(llvmlite.ir.IntType(32), 8)
        codes = [load_vector(context, builder, qa, llvmlite.ir.Constant(llvmlite.ir.IntType(64), 8 * g), lanes)
                 for g in range(groups.literal_value)]
        scalar_quantizer_cpu.store_packed(builder, codes, width.literal_value, oa.data)
        return context.get_dummy_value()
    return numba.types.void(q, groups, width, out), codegen


def _store_packed(q, groups, width, out):
    """_stored_packed with groups and width compiled in (numba takes a closure's ints as literals)."""
    @numba.njit
    def run(q, out):
        _stored_packed(q, groups, width, out)
    run(q, out)


@pytest.mark.parametrize("width", range(1, 9))
@pytest.mark.parametrize("groups", [1, 2, 3, 16])
def test_codes_packed_in_registers_are_pack_bits_bytes_and_stay_in_their_row(groups, width):
    """store_packed writes pack_bits' bytes of a row held in registers, exactly its groups·width
    bytes: the byte after the row (a neighbour's, perhaps another thread's) is left alone."""
    codes = np.random.default_rng(groups * 10 + width).integers(0, 2 ** width, size=8 * groups).astype(np.int32)
    codes[:8] = 2 ** width - 1                                 # a group of all ones: every bit of its word set
    out = np.full(groups * width + 8, 0xA5, np.uint8)
    _store_packed(codes, groups, width, out)
    assert np.array_equal(out[:groups * width], pack_bits(torch.from_numpy(codes.astype(np.int64)), width).numpy())
    assert np.all(out[groups * width:] == 0xA5)
