"""Hadamard transforms, bit packing and Lloyd–Max codebooks against theory and brute force."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st
from hypothesis.extra.numpy import arrays
from scipy import integrate, special

from schemes.hadamard import check_power_of_two, fwht, fwht_butterfly, hadamard_matrix, rht, rht_inverse
from schemes.lloyd_max import beta_codebook, gaussian_codebook, quantize
from schemes.packing import pack_bits, packed_size, unpack_bits
from kvcommon.rng import generator, packed_rademacher

DIMS = st.sampled_from([1, 2, 4, 8, 16, 64, 128, 1024])


@given(dim=DIMS, rows=st.integers(1, 5), data=st.data())
def test_fwht_is_orthogonal_and_self_inverse(dim, rows, data):
    x = torch.from_numpy(data.draw(arrays(np.float64, (rows, dim), elements=st.floats(-1e3, 1e3))))
    y = fwht(x)
    assert torch.allclose(fwht(y), x, atol=1e-9 * (1 + x.abs().max()))
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-9, atol=1e-9)
    # both code paths and the explicit Sylvester matrix agree
    assert torch.allclose(fwht_butterfly(x), y, atol=1e-9 * (1 + x.abs().max()))
    assert torch.allclose(x @ hadamard_matrix(dim) / math.sqrt(dim), y, atol=1e-9 * (1 + x.abs().max()))


@given(dim=DIMS, data=st.data())
def test_rht_inverse_round_trip(dim, data):
    x = torch.from_numpy(data.draw(arrays(np.float64, (3, dim), elements=st.floats(-10, 10))))
    signs = torch.from_numpy(data.draw(arrays(np.float64, (dim,), elements=st.sampled_from([-1.0, 1.0]))))
    assert torch.allclose(rht_inverse(rht(x, signs), signs), x, atol=1e-9)


# --- the compiled butterflies (schemes/hadamard_cpu.py) against the torch butterflies and the exact transform ---
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("dim", [1, 2, 4, 8, 16, 128, 256, 1024])
def test_compiled_butterflies_equal_the_torch_butterflies(dim, dtype):
    """fwht, rht and rht_inverse on the CPU (one compiled pass with the signs, the factor and the
    norms) give the bits of fwht_butterfly followed by the same products in torch, on rows split
    across threads (≥ 64 k elements) or not."""
    gen = torch.Generator().manual_seed(dim)
    for n in (3, 300):
        x = torch.randn(2, 3, n, dim, generator=gen, dtype=dtype)
        signs = (torch.randint(0, 2, (2, 3, 1, dim), generator=gen) * 2 - 1).to(dtype)
        norms = torch.rand(2, 3, n, generator=gen, dtype=dtype) * 10
        root = math.sqrt(dim)
        assert torch.equal(fwht(x), fwht_butterfly(x))
        assert torch.equal(fwht(x, normalize=False), fwht_butterfly(x, normalize=False))
        assert torch.equal(fwht(x[0, 0, 0]), fwht_butterfly(x[0, 0, 0]))              # one vector
        assert torch.equal(rht(x, signs), fwht_butterfly(x * signs))
        assert torch.equal(rht(x, signs, mult=root), fwht_butterfly(x * signs) * root)
        assert torch.equal(rht_inverse(x, signs, mult=root), fwht_butterfly(x) * root * signs)
        assert torch.equal(rht_inverse(x, signs, scale=norms), fwht_butterfly(x) * signs * norms.unsqueeze(-1))
        # signs of another shape (one row for all vectors) take the torch products, the same bits
        assert torch.equal(rht(x, signs[0, 0, 0]), fwht_butterfly(x * signs[0, 0, 0]))


@pytest.mark.parametrize("dim", [8, 64, 256, 1024])
def test_float32_butterflies_within_their_rounding_bound(dim):
    """Each of the log2(d) stages and the division rounds once, and every partial sum of an entry
    is at most Σ|x|, so |fwht(x) − Hx/√d| ≤ ((1 + u)^(log2 d + 1) − 1)·Σ|x|/√d entry-wise (u = 2^-24;
    the standard error analysis of a sum tree, e.g. Higham, Accuracy and Stability §4.2)."""
    x = torch.randn(500, dim, generator=torch.Generator().manual_seed(1))
    exact = x.double() @ hadamard_matrix(dim) / math.sqrt(dim)
    bound = ((1 + 2.0 ** -24) ** (math.log2(dim) + 1) - 1) * x.double().abs().sum(-1, keepdim=True) / math.sqrt(dim)
    error = (fwht(x).double() - exact).abs()
    assert bool((error <= bound).all())
    assert float((error / bound).max()) > 0.01           # the bound is not vacuous: errors come near it


def test_hadamard_matrix_is_orthogonal_up_to_scale():
    h = hadamard_matrix(16)
    assert torch.equal(h @ h.T, 16 * torch.eye(16, dtype=h.dtype))


@pytest.mark.parametrize("dim", [0, 3, 6, 100, 129])
def test_non_power_of_two_is_a_clear_error(dim):
    with pytest.raises(ValueError, match="not a power of two"):
        check_power_of_two(dim)
    if dim:
        with pytest.raises(ValueError, match="not a power of two"):
            fwht(torch.zeros(2, dim))


@given(width=st.integers(1, 8), n=st.integers(1, 70), rows=st.integers(1, 4), data=st.data())
def test_pack_unpack_round_trip(width, n, rows, data):
    codes = torch.from_numpy(data.draw(arrays(np.int64, (rows, n), elements=st.integers(0, 2 ** width - 1))))
    packed = pack_bits(codes, width)
    assert packed.dtype == torch.uint8 and packed.shape == (rows, packed_size(n, width))
    assert torch.equal(unpack_bits(packed, width, n), codes)


def test_packing_bit_order_by_hand():
    assert pack_bits(torch.tensor([[1, 0, 1, 1, 0, 0, 0, 1]]), 1).tolist() == [[0b10110001]]
    assert pack_bits(torch.tensor([[3, 0, 1, 2]]), 2).tolist() == [[0b11000110]]
    assert pack_bits(torch.tensor([[5, 2, 7]]), 3).tolist() == [[0b10101011, 0b10000000]]


@pytest.mark.parametrize("n", [1, 5, 8, 13, 128])
def test_packed_rademacher_is_stored_signs(n):
    """Drawn in the stored form: unpacked, fair independent ±1 signs that pack back to the same
    bytes (padding bits 0); the same stream gives the same signs."""
    packed = packed_rademacher(generator("pcg64", 1, "test", n), (40, 3), n)
    assert packed.dtype == np.uint8 and packed.shape == (40, 3, packed_size(n, 1))
    bits = unpack_bits(torch.from_numpy(packed), 1, n)
    assert torch.equal(pack_bits(bits, 1), torch.from_numpy(packed))
    assert np.array_equal(packed, packed_rademacher(generator("pcg64", 1, "test", n), (40, 3), n))
    ones = bits.sum().item()
    total = bits.numel()
    assert abs(ones - total / 2) < 4 * math.sqrt(total / 4)                       # fair: within 4 SE of 1/2
    assert len({tuple(row) for row in bits.reshape(40, -1).tolist()}) > 1                # rows differ


@pytest.mark.parametrize("width", [0, 9])
def test_pack_width_outside_range(width):
    with pytest.raises(ValueError, match="outside 1..8"):
        pack_bits(torch.zeros(1, 8, dtype=torch.int64), width)


# --- Lloyd–Max -------------------------------------------------------------------------------

# Max (1960), Table I: mean squared error of the optimum quantiser of N(0, 1), N = 2..32 levels.
MAX_1960 = {1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.009497}
# TurboQuant (arXiv 2504.19874, Thm. 1): D_mse of a unit vector ≈ 0.36, 0.117, 0.03, 0.009.
TURBOQUANT_DMSE = {1: 0.36, 2: 0.117, 3: 0.03, 4: 0.009}


@pytest.mark.parametrize("bits", sorted(MAX_1960))
def test_gaussian_distortion_matches_max_1960(bits):
    assert gaussian_codebook(bits).distortion == pytest.approx(MAX_1960[bits], rel=2e-3)


@pytest.mark.parametrize("bits", sorted(TURBOQUANT_DMSE))
def test_beta_distortion_matches_turboquant_figures(bits):
    # the published figures are rounded to the digits shown; at d = 128 and 256
    for dim in (128, 256):
        d_mse = beta_codebook(dim, bits).normalized_distortion
        digits = len(str(TURBOQUANT_DMSE[bits]).split(".")[1])
        assert abs(d_mse - TURBOQUANT_DMSE[bits]) <= 0.6 * 10 ** -digits + 0.006 * TURBOQUANT_DMSE[bits], d_mse


def _beta_pdf(dim):
    log_c = special.gammaln(dim / 2) - 0.5 * math.log(math.pi) - special.gammaln((dim - 1) / 2)
    return lambda x: math.exp(log_c) * (1 - x * x) ** ((dim - 3) / 2)


@pytest.mark.parametrize("dim,bits", [(4, 1), (8, 2), (16, 3), (64, 4), (128, 2), (128, 5), (256, 3)])
def test_beta_codebook_against_numerical_integration(dim, bits):
    """Centroids are the conditional means and the distortion is ∫(x − Q(x))² f, by quadrature."""
    book = beta_codebook(dim, bits)
    pdf = _beta_pdf(dim)
    edges = np.concatenate(([-1.0], book.thresholds, [1.0]))
    total = 0.0
    for c, lo, hi in zip(book.centroids, edges[:-1], edges[1:]):
        mass = integrate.quad(pdf, lo, hi, epsabs=1e-14, epsrel=1e-12)[0]
        mean = integrate.quad(lambda x: x * pdf(x), lo, hi, epsabs=1e-14, epsrel=1e-12)[0] / mass
        assert c == pytest.approx(mean, rel=1e-7, abs=1e-10)
        total += integrate.quad(lambda x, c=c: (x - c) ** 2 * pdf(x), lo, hi, epsabs=1e-16, epsrel=1e-12)[0]
    assert book.distortion == pytest.approx(total, rel=1e-7)
    assert book.second_moment == pytest.approx(1 / dim)


@pytest.mark.parametrize("bits", [1, 3, 5, 8])
def test_gaussian_codebook_against_numerical_integration(bits):
    book = gaussian_codebook(bits)
    pdf = lambda x: math.exp(-x * x / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    edges = np.concatenate(([-np.inf], book.thresholds, [np.inf]))
    total = sum(integrate.quad(lambda x, c=c: (x - c) ** 2 * pdf(x), lo, hi, epsabs=1e-16)[0]
                for c, lo, hi in zip(book.centroids, edges[:-1], edges[1:]))
    assert book.distortion == pytest.approx(total, rel=1e-6)


def test_beta_marginal_tends_to_gaussian():
    for bits in (1, 2, 3, 4):
        d = 4096
        beta = beta_codebook(d, bits).normalized_distortion
        gauss = gaussian_codebook(bits).distortion
        assert beta == pytest.approx(gauss, rel=2e-3)


@given(dim=st.sampled_from([2, 3, 8, 64, 256]), bits=st.integers(1, 8))
def test_codebooks_symmetric_and_monotone(dim, bits):
    for book in (beta_codebook(dim, bits), gaussian_codebook(bits)):
        c, t = book.centroids, book.thresholds
        assert len(c) == 2 ** bits and len(t) == 2 ** bits - 1
        assert np.all(np.diff(c) > 0) and np.all(np.diff(t) > 0)
        assert np.allclose(c, -c[::-1], atol=1e-15)
        assert np.all(c[:-1] < t) and np.all(t < c[1:])
        if book.density == "beta":
            assert -1 < c[0] and c[-1] < 1


def test_distortion_decreases_about_6db_per_bit():
    d = [gaussian_codebook(b).distortion for b in range(1, 9)]
    assert all(hi < lo for lo, hi in zip(d, d[1:]))
    # high-resolution theory (Panter–Dite): D ≈ (√3 π / 2) 4^−b for N(0, 1)
    assert d[-1] == pytest.approx(math.sqrt(3) * math.pi / 2 * 4.0 ** -8, rel=0.05)


@pytest.mark.parametrize("dim", [16, 128])
def test_quantize_picks_the_nearest_centroid(dim):
    book = beta_codebook(dim, 3)
    x = torch.linspace(-1, 1, 4001, dtype=torch.float64)
    idx = quantize(x, book)
    brute = torch.argmin((x[:, None] - torch.tensor(book.centroids)[None]).abs(), dim=1)
    assert torch.equal(idx, brute)


@given(st.integers(1, 8), st.integers(1, 21), st.integers(0, 2 ** 32 - 1))
def test_packing_matches_a_bit_string_built_by_hand(width, n, seed):
    """Both packing paths (int64 words; bytewise for widths dividing 8) against the row's bits
    written out as text, big-endian, zero-padded to whole bytes."""
    codes = torch.from_numpy(np.random.default_rng(seed).integers(0, 2 ** width, size=(3, n)))
    for row, packed in zip(codes.tolist(), pack_bits(codes, width).tolist()):
        text = "".join(format(c, f"0{width}b") for c in row)
        text += "0" * (-len(text) % 8)
        assert packed == [int(text[i:i + 8], 2) for i in range(0, len(text), 8)]
