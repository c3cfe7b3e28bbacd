"""schemes.fastquant: the grid quantiser gives bucketize's indices exactly (uint8), byte-table
decoding gives the centroids of the unpacked codes, and the uint8 group packing the bytes of
the int64-word packing it replaced."""
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from schemes.fastquant import dequantize_packed, quantize, quantize_pack
from schemes.lloyd_max import beta_codebook, gaussian_codebook
from schemes.packing import pack_bits, unpack_bits, unpack_codes


def _edge_values(thresholds: torch.Tensor) -> torch.Tensor:
    """The thresholds themselves, their float neighbours, ±0, ±inf, NaN and far-out values."""
    up, down = torch.full_like(thresholds, 10.0), torch.full_like(thresholds, -10.0)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.0, -1.0, 3e38, -3e38])
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


@given(width=st.integers(1, 8), n=st.integers(1, 70), rows=st.integers(1, 3), seed=st.integers(0, 2 ** 31))
def test_dequantize_packed_equals_the_unpacked_lookup(width, n, rows, seed):
    gen = np.random.default_rng(seed)
    codes = torch.from_numpy(gen.integers(0, 2 ** width, size=(rows, 2, n)))
    packed = pack_bits(codes, width)
    assert torch.equal(unpack_codes(packed, width, n), codes.to(torch.uint8))
    assert torch.equal(unpack_bits(packed, width, n), codes)
    centroids = torch.from_numpy(np.sort(gen.standard_normal(2 ** width)))
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
