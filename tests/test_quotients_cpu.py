"""kvcommon/quotients_cpu.py: the quotient by a reciprocal and two fma's has IEEE division's bits
(every float32 significand against many divisors, the edge values, float64 over its range), and
hadamard_cpu.transform's fused butterflies, quotient and products those of the separate steps."""
import numpy as np
import pytest
import torch

from kvcommon import quotients_cpu
from schemes import hadamard_cpu
from schemes.hadamard import fwht_butterfly


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint32 if a.dtype == np.float32 else np.uint64)


def _same(got: np.ndarray, want: np.ndarray) -> bool:
    """The same bits, NaN's aside (any NaN matches any NaN)."""
    nan = np.isnan(want)
    return bool(np.array_equal(np.isnan(got), nan) and np.array_equal(_bits(got)[~nan], _bits(want)[~nan]))


def test_every_float32_significand_divides_with_the_bits_of_division():
    """All 2^23 significands of [1, 2) (every dividend up to its power of two) over the divisors
    √d of the codecs and others of every kind of significand: no quotient differs from x / c."""
    x = (np.arange(1 << 23, dtype=np.uint32) | np.uint32(0x3F800000)).view(np.float32)
    got = np.empty_like(x)
    rng = np.random.default_rng(7)
    divisors = [np.sqrt(np.float32(d)) for d in (8, 32, 64, 128, 256, 1024)] + \
        [np.float32(v) for v in (3.0, 1.0000001, 1.9999999, 1.5, 1.1, 0.7071068)] + list((1 + rng.random(12)).astype(np.float32))
    for c in divisors:
        quotients_cpu.divide(x, c, None, None, got)
        assert np.array_equal(_bits(got), _bits(x / c)), c


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_edge_values_take_division(dtype):
    """Zeros of both signs, infinities, NaN, subnormals, the largest floats and the ends of the
    fast range, over divisors of the same kinds (0, ±inf, NaN, subnormal, negative): IEEE's answers."""
    info = np.finfo(dtype)
    limit = 50 if dtype == np.float32 else 500
    values = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, info.smallest_subnormal, -info.smallest_subnormal,
                       info.tiny, info.max, -info.max, 2.0 ** -limit, 2.0 ** (-limit - 1), 2.0 ** limit,
                       2.0 ** (limit + 1), 1.0, -1.0, 3.0, -0.3], dtype)
    for mix in range(4):                                     # each edge value beside ordinary ones, and alone
        row = np.random.default_rng(mix).standard_normal(len(values) * 3).astype(dtype)
        row[mix::4][:len(values)] = values[:len(row[mix::4])]
        got = np.empty_like(row)
        with np.errstate(all="ignore"):
            for c in np.array([1.0, -2.0, 3.0, 0.0, -0.0, np.inf, np.nan, info.smallest_subnormal, info.tiny,
                               info.max, 2.0 ** limit, 2.0 ** -limit, 1e-30], dtype):
                quotients_cpu.divide(row, c, None, None, got)
                assert _same(got, row / c), (c, row, got)


@pytest.mark.parametrize("dtype, scale", [(np.float32, 30), (np.float64, 300)])
def test_scaled_quotients_over_the_dtype_range(dtype, scale):
    """((x / c) · f) · m on rows of every length 1..40 (the tail past the vectors of 8) with
    magnitudes 10^±scale, against the three steps in NumPy."""
    rng = np.random.default_rng(scale)
    with np.errstate(all="ignore"):
        for n in range(1, 41):
            x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-scale, scale, n)).astype(dtype)
            f = rng.choice([-1.0, 1.0], n).astype(dtype)
            c, m = (dtype(rng.standard_normal() * 10.0 ** rng.uniform(-scale, scale)) for _ in range(2))
            got = np.empty_like(x)
            quotients_cpu.divide(x, c, f, m, got)
            assert _same(got, ((x / c) * f) * m)
            quotients_cpu.divide(x, c, None, None, got)
            assert _same(got, x / c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("d", [1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
def test_transform_is_the_butterflies_then_the_quotient_and_products(d, dtype):
    """transform(buf, d, c, f, m, out) in registers (8..256) or in memory: the bits of torch's
    butterflies, then / c, · f, · m one after the other, with any of them left out (None), on
    rows whose transform holds exact zeros of both signs (the quotient's zero lanes)."""
    gen = torch.Generator().manual_seed(d)
    for trial in range(24):
        x = torch.randn(d, generator=gen, dtype=dtype) * 10.0 ** float(torch.randint(-3, 4, (1,), generator=gen))
        if trial % 4 == 1:       # two values ±a, as a 1-bit code decodes: the butterflies cancel to exact zeros
            x = x.sign() * 0.75
        elif trial % 4 == 2:     # zeros of both signs, where x·(1/c) keeps the quotient's sign
            x = torch.where(x > 0, torch.zeros_like(x), -torch.zeros_like(x))
        f = (torch.randint(0, 2, (d,), generator=gen) * 2 - 1).to(dtype)
        c, m = (torch.rand((), generator=gen, dtype=dtype) * 20 + 0.1 for _ in range(2))
        h = fwht_butterfly(x, normalize=False)
        for args, want in (((c, f, m), h / c * f * m), ((c, None, None), h / c), ((None, None, None), h),
                           ((c, f, None), h / c * f), ((None, f, m), h * f * m)):
            buf, out = x.numpy().copy(), np.empty(d, x.numpy().dtype)
            scalar = [None if a is None else (a.numpy() if a.dim() else a.numpy()[()]) for a in args]
            hadamard_cpu.transform(buf, d, scalar[0], scalar[1], scalar[2], out)
            assert _same(out, want.numpy()), (d, [a is None for a in args])


def test_in_range_sums_admits_codebooks_and_refuses_what_could_leave_the_range():
    """Lloyd–Max codebooks pass; a table whose sums could fall below 2^-50 (a value of 1e-20), pass
    2^50 (3e38), or is not finite does not. And the claim behind it, brute force: every entry of
    the butterflies of rows drawn from a passing table is 0 or a multiple of the smallest value's
    ulp, at most d times the largest value."""
    from schemes.lloyd_max import beta_codebook
    for bits in range(1, 9):
        assert quotients_cpu.in_range_sums(np.asarray(beta_codebook(128, bits).centroids, np.float32), 128)
    for bad in (1e-20, 3e38, np.inf, np.nan):
        assert not quotients_cpu.in_range_sums(np.array([0.5, -0.25, bad], np.float32), 128)
    table = np.asarray(beta_codebook(128, 2).centroids, np.float32)
    quantum = np.spacing(np.abs(table).min())
    rows = torch.from_numpy(table[np.random.default_rng(0).integers(0, 4, (4000, 128))])
    sums = fwht_butterfly(rows, normalize=False).double().numpy()
    assert np.all((sums == 0) | (np.abs(sums) >= quantum))
    assert np.all(np.mod(sums, quantum) == 0) and np.abs(sums).max() <= 128 * np.abs(table).max()
    assert (sums == 0).any()                                 # zeros do occur: the quotient's zero lanes matter
