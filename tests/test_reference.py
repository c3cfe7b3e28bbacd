"""The independent reference TurboQuant family (schemes/reference) against theory, brute force
and the torch implementation.

The two implementations share no codec code: a different Lloyd–Max solver (quadrature + Powell
hybrid vs closed-form moments + Newton), Hadamard (popcount formula vs concatenation), packing
and random streams. Agreement is therefore evidence about both.
"""
import dataclasses
import functools
import math
import re

import numpy as np
import pytest
import scipy.linalg
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from scipy import integrate, stats

import schemes
from harness.cli import main
from harness.cell import draw_trials
from harness.runner import run_sweep
from harness.store import RunStore
from harness.sweep import Cell, SweepConfig
from schemes import reference
from schemes.registry import reference_specs
from schemes.base import BitLedger
from schemes.hadamard import hadamard_matrix as torch_hadamard
from schemes.lloyd_max import beta_codebook
from schemes.packing import pack_bits
from schemes.reference.turboquant_ref import (ReferenceTurboQuant, hadamard_matrix, pack_codes,
                                              sphere_codebook, unpack_codes)
from stats.metrics import trial_metrics
from stats.validation import validate_samples

NAMES = ("plain-kv", "tq-kv", "tq-qkv", "tq-fkv", "tq-kqv", "tq-qkqv", "tq-kfv", "tq-fkfv")


pytestmark = pytest.mark.usefixtures("one_torch_thread")   # tests/conftest.py


def gaussian(shape, seed, dtype=torch.float64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def rel_mse_per_trial(x, x_hat):
    return (((x - x_hat) ** 2).sum(dim=(1, 2, 3)) / (x ** 2).sum(dim=(1, 2, 3))).numpy()


# --- registry and validation --------------------------------------------------------------------

def test_registry_lists_the_family_and_rejects_bad_input():
    assert set(NAMES) <= set(reference_specs())
    with pytest.raises(ValueError, match="unknown scheme 'tq-xv'.*available: .*tq-kv"):
        schemes.create("tq-xv", impl="reference", budget=2, dim=16)
    for budget in (0, 9, 2.5, True):
        with pytest.raises(ValueError, match="outside 1..8"):
            schemes.create("tq-kv", impl="reference", budget=budget, dim=16)
    with pytest.raises(ValueError, match="not a power of two"):
        schemes.create("tq-kv", impl="reference", budget=2, dim=12)
    with pytest.raises(ValueError, match="not a power of two"):  # an RHT sketch needs it too
        ReferenceTurboQuant(budget=2, dim=12, rotate=False, sketch_k="rht").validate()
    schemes.create("plain-kv", impl="reference", budget=2, dim=12)  # no Hadamard, any d >= 2
    with pytest.raises(ValueError, match="unknown RNG family"):
        schemes.create("tq-kv", impl="reference", budget=2, dim=16, rng="xorshift")
    with pytest.raises(ValueError, match="array namespace"):
        schemes.create("tq-kv", impl="reference", budget=2, dim=16, xp="jax")
    with pytest.raises(ValueError, match="compute dtype"):
        schemes.create("tq-kv", impl="reference", budget=2, dim=16, compute_dtype="float16")
    with pytest.raises(ValueError, match="taken"):
        reference.register("tq-kv", lambda **kw: None)


# --- deterministic building blocks ----------------------------------------------------------------

@pytest.mark.parametrize("dim", [1, 2, 4, 8, 64, 256])
def test_hadamard_is_the_sylvester_matrix(dim):
    h = hadamard_matrix(dim)
    np.testing.assert_array_equal(h, scipy.linalg.hadamard(dim))
    np.testing.assert_array_equal(h, torch_hadamard(dim).numpy())
    np.testing.assert_array_equal(h @ h.T, dim * np.eye(dim))


@given(width=st.integers(1, 8), n_codes=st.integers(1, 40), rows=st.integers(1, 3), seed=st.integers(0, 2**31))
def test_packing_round_trips_and_matches_independent_packers(width, n_codes, rows, seed):
    codes = np.random.default_rng(seed).integers(0, 2 ** width, size=(rows, n_codes))
    packed = pack_codes(codes, width)
    assert packed.dtype == np.uint8 and packed.shape == (rows, (n_codes * width + 7) // 8)
    np.testing.assert_array_equal(unpack_codes(packed, width, n_codes), codes)
    bits = ((codes[..., None] >> np.arange(width - 1, -1, -1)) & 1).reshape(rows, -1)
    np.testing.assert_array_equal(packed, np.packbits(bits.astype(np.uint8), axis=-1))
    np.testing.assert_array_equal(packed, pack_bits(torch.from_numpy(codes), width).numpy())


# --- Lloyd–Max: two algorithms, one optimum ---------------------------------------------------------

@pytest.mark.parametrize("dim,max_bits", [(2, 6), (3, 6), (16, 8), (128, 8)])
def test_codebook_agrees_with_the_torch_solver(dim, max_bits):
    """Quadrature + Powell hybrid (reference) vs closed-form moments + Newton (torch). The torch
    `distortion` is E[X²] − Σ(2c·m1 − c²·m0), which cancels to ~1e-8 relative at 8 bits; its
    centroids stop at a 1e-10 residual."""
    for bits in range(1, max_bits + 1):
        ref, torch_book = sphere_codebook(dim, bits), beta_codebook(dim, bits)
        sigma = 1 / math.sqrt(dim)
        assert ref.max_residual < 1e-11 * sigma
        np.testing.assert_allclose(ref.centroids, torch_book.centroids, rtol=0, atol=1e-8 * sigma)
        assert ref.distortion == pytest.approx(torch_book.distortion, rel=1e-7)
        assert ref.second_moment == pytest.approx(1 / dim, rel=1e-12)  # ‖u‖² = 1 spread over d coordinates


def test_codebook_distortion_by_adaptive_quadrature():
    """A third computation: scipy.integrate.quad of (x − c)² f(x) over each cell."""
    dim, bits = 64, 3
    book = sphere_codebook(dim, bits)
    log_c = math.lgamma(dim / 2) - 0.5 * math.log(math.pi) - math.lgamma((dim - 1) / 2)

    def density(x):
        return math.exp(log_c + (dim - 3) / 2 * math.log1p(-x * x))
    edges = np.concatenate([[-1.0], book.thresholds, [1.0]])
    total = sum(integrate.quad(lambda x, c=c: (x - c) ** 2 * density(x), lo, hi, epsabs=0, epsrel=1e-12)[0]
                for c, lo, hi in zip(book.centroids, edges[:-1], edges[1:]))
    assert book.distortion == pytest.approx(total, rel=1e-9)
    # published TurboQuant figure (arXiv 2504.19874, Thm. 1): D_mse ≈ 0.03 at b = 3
    assert book.normalized_distortion == pytest.approx(0.03, abs=0.005)


@pytest.mark.parametrize("name", ["tq-kv", "plain-kv"])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_distortion_on_isotropic_data_equals_the_codebook_value(name, bits):
    """On isotropic data each unit vector's coordinates follow the sphere marginal, so the
    measured relative MSE is the codebook's normalised distortion (TurboQuant Thm. 1)."""
    dim = 64
    k = gaussian((12, 1, 256, dim), seed=1)
    scheme = schemes.create(name, impl="reference", budget=bits, dim=dim, seed=3)
    k_hat, _ = scheme.decode(scheme.encode(k, k))
    measured = rel_mse_per_trial(k, k_hat)
    expected = sphere_codebook(dim, bits).normalized_distortion
    se = measured.std(ddof=1) / math.sqrt(len(measured))
    # float32 norms and codebook add ~1e-7 relative: negligible next to 1e-3 at 8 bits
    assert abs(measured.mean() - expected) < 4 * se + 1e-3 * expected, (measured.mean(), expected, se)


# --- reference vs torch -------------------------------------------------------------------------------

def torch_signs(torch_scheme):
    """The torch scheme's per-trial rotation/sketch signs (B, H, *shape) as ±1, for draw_signs."""
    def draw(tensor, purpose, shape, trials, n_heads):
        packed = torch_scheme.draw_signs(tensor, purpose, list(trials), n_heads).numpy()
        return 2.0 * unpack_codes(packed, 1, shape[-1]) - 1.0
    return draw


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bits", [1, 3])
def test_same_signs_give_identical_codes_and_reconstructions(name, bits):
    """With the torch scheme's per-trial random signs injected (for the trial indices given to
    fit), the two implementations store the same bytes (packed codes, sketches, per-trial signs
    and sketch matrices) and decode/score to float64 precision; differences of ~1e-7 come only
    from float32 rounding of the stored codebook and residual norms."""
    shape = (3, 2, 40, 32)
    k, v, q = gaussian(shape, 0), gaussian(shape, 1), gaussian((3, 2, 5, 32), 2)
    trials = torch.tensor([7, 2, 11])
    t = schemes.create(name, budget=bits, dim=32, seed=5).fit(k, v, trials=trials)
    r = schemes.create(name, impl="reference", budget=bits, dim=32, seed=5).fit(k, v, trials=trials)
    r.draw_signs = torch_signs(t)
    enc_t, enc_r = t.encode(k, v), r.encode(k, v)
    assert enc_t.codes.keys() == enc_r.codes.keys() and enc_t.side.keys() == enc_r.side.keys()
    for key in enc_t.codes:
        if key.endswith(("codes", "sketch", "_signs", "sketch_matrix")):
            assert torch.equal(enc_t.codes[key], enc_r.codes[key]), key
    assert all(key.startswith("codebook") for key in enc_t.side)
    for a, b in zip(t.decode(enc_t), r.decode(enc_r)):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
    torch.testing.assert_close(r.score(q, enc_r), t.score(q, enc_t), rtol=0, atol=1e-6)
    assert r.capabilities == t.capabilities
    assert enc_r.model == enc_t.model
    assert r.bits(enc_r).bits_per_element == t.bits(enc_t).bits_per_element
    assert r.bits(enc_r).model_bits == t.bits(enc_t).model_bits


def per_trial_metrics(create, name, bits, n_trials=60, dim=32, seq_len=64, n_queries=8):
    """Metrics of n_trials gaussian trials, each coded by a scheme of its own seed, so the
    distribution integrates over the random signs as well as the data (one fixed FULL matrix
    would shift every trial's error alike). The metrics are computed in one batch."""
    config = SweepConfig(scenarios=("gaussian",), schemes=(name,), dims=(dim,), seq_lens=(seq_len,),
                         queries=(n_queries,), trials=n_trials, calib_tokens=(4,))
    data = draw_trials(config, Cell("gaussian", name, bits, dim, seq_len, n_queries, 4), range(n_trials),
                       torch.device("cpu"), torch.float64)
    k_hats, v_hats, logits = [], [], []
    for t in range(n_trials):
        scheme = create(name, budget=bits, dim=dim, seed=1000 + t)
        enc = scheme.encode(data["k"][t:t + 1], data["v"][t:t + 1])
        k_hat, v_hat = scheme.decode(enc)
        k_hats.append(k_hat)
        v_hats.append(v_hat)
        logits.append(scheme.score(data["q"][t:t + 1], enc))
    metrics = trial_metrics(data["k"], data["v"], data["q"], torch.cat(k_hats), torch.cat(v_hats), torch.cat(logits))
    return {m: metrics[m].numpy() for m in ("rel_mse_k", "rel_mse_v", "logit_slope")}


def same_distribution(a, b):
    """KS does not reject at 1e-3 and the means are within 4 standard errors."""
    se = math.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b))
    return stats.ks_2samp(a, b).pvalue > 1e-3 and abs(a.mean() - b.mean()) < 4 * se


@pytest.mark.parametrize("name", NAMES)
def test_metric_distributions_agree_with_torch(name):
    ref, tor = per_trial_metrics(functools.partial(schemes.create, impl="reference"), name, 3), per_trial_metrics(schemes.create, name, 3)
    for metric in ref:
        assert same_distribution(ref[metric], tor[metric]), (metric, stats.ks_2samp(ref[metric], tor[metric]))


def test_a_shifted_configuration_is_detected():
    """The same comparison has power: one bit less in the reference is rejected on every metric."""
    ref, tor = per_trial_metrics(functools.partial(schemes.create, impl="reference"), "tq-kv", 2), per_trial_metrics(schemes.create, "tq-kv", 3)
    for metric in ref:
        assert stats.ks_2samp(ref[metric], tor[metric]).pvalue < 1e-6, metric


IMPL_SCHEMES = ("tq-kv", "tq-qkv", "tq-fkv", "tq-kfv")


def impl_verdicts(root, seed, n_trials=40):
    """`harness validate --scenario gaussian --scheme S --vary impl` for each S of IMPL_SCHEMES at
    b = 3, d = 32, S = 64, Nq = 64 (the CLI's comparison: torch vs reference on the same data,
    paired; null: torch with the root seed + 1), sharing the three runs: {scheme: Validation}."""
    base = SweepConfig(scenarios=("gaussian",), schemes=IMPL_SCHEMES, budgets=(3,), dims=(32,), seq_lens=(64,),
                       queries=(64,), trials=n_trials, seed=seed, device="cpu")
    runs = {"base": base, "variant": dataclasses.replace(base, impl="reference"),
            "null": dataclasses.replace(base, seed=seed + 1)}
    frames = {}
    for name, config in runs.items():
        run_sweep(config, RunStore(root / name), progress=False)
        frames[name] = RunStore(root / name).trials()

    def cell(run, scheme):
        return frames[run][frames[run]["scheme"] == scheme]
    return {s: validate_samples(cell("base", s), cell("variant", s), [(cell("base", s), cell("null", s))], seed=seed)
            for s in IMPL_SCHEMES}


@pytest.mark.parametrize("seed", [1, 3])
def test_torch_vs_reference_is_no_codec_difference(tmp_path, seed):
    """The two implementations draw their signs from their own streams; with one draw per cell
    (before per-trial draws) every trial of a configuration shared it, so the paired test saw
    the two draws' fixed shift as a codec difference, which the unpaired seed-change null could
    not explain. On the parent commit (56a7c94), by `harness validate --scenario gaussian
    --scheme S --vary impl --dim 32 --seq-len 64 --trials 40 --seed s --json`:
      tq-fkv: codec-difference at seeds 1, 2, 3 (min Holm p 0.0034, 0.00058, 1.4e-9), equivalent at 0;
      tq-kfv: codec-difference at seed 3 (p 5.7e-9); the main test rejected at 0, 1, 2 as well
              (p 0.0053, 1.9e-5, 2.6e-8; implementation-variance, the null's own draw shifted too);
      tq-kv, tq-qkv: no rejection at seeds 0–3 (nor at the CLI defaults d = 128, S = 1024, 200
              trials, seed 0: equivalent), because on isotropic data an RHT rotation or RHT sketch
              (orthogonal, sign-symmetric) leaves the metrics' distribution unchanged whatever its
              signs; a FULL ±1 matrix is not orthogonal and its draw shifts every trial alike.
    With per-trial draws the trials replicate the draw: no main test rejects at seeds 0–3 for
    any of the four (min Holm p ≥ 0.12), verdicts equivalent (one inconclusive)."""
    verdicts = impl_verdicts(tmp_path, seed)
    for scheme, result in verdicts.items():
        assert result.verdict != "codec-difference", (scheme, result.reason)
    assert verdicts["tq-fkv"].verdict in ("equivalent", "inconclusive"), verdicts["tq-fkv"].reason


# --- QJL ------------------------------------------------------------------------------------------------

def slopes(name, bits, n_seeds=12, dim=128):
    k, q = gaussian((8, 1, 128, dim), 4), gaussian((8, 1, 8, dim), 5)
    exact = q @ k.transpose(-1, -2) / math.sqrt(dim)
    out = []
    for seed in range(n_seeds):
        s = schemes.create(name, impl="reference", budget=bits, dim=dim, seed=seed)
        est = s.score(q, s.encode(k, k))
        out.append(float((est * exact).sum() / (exact ** 2).sum()))
    return np.array(out)


@pytest.mark.parametrize("name", ["tq-qkv", "tq-fkv"])
@pytest.mark.parametrize("bits", [1, 3])
def test_qjl_score_is_nearly_unbiased(name, bits):
    """QJL (arXiv 2406.03482 Lemma 3.2) is unbiased for Gaussian projections; with ±1 entries a
    bias of order 1/(4d) remains, far below the MSE-only shrinkage it removes."""
    s = slopes(name, bits)
    se = s.std(ddof=1) / math.sqrt(len(s))
    assert abs(s.mean() - 1) < 1 / (2 * 128) + 4 * se, (s.mean(), se)
    assert abs(s.mean() - 1) < sphere_codebook(128, max(bits - 1, 1)).normalized_distortion / 20


def test_mse_quantiser_shrinks_logits_by_one_minus_distortion():
    """E[ŷ | y] of a Lloyd–Max quantiser shrinks: ⟨ŝ, s⟩/⟨s, s⟩ = 1 − D_mse."""
    s = slopes("tq-kv", 2, n_seeds=8)
    se = s.std(ddof=1) / math.sqrt(len(s))
    assert abs(s.mean() - (1 - sphere_codebook(128, 2).normalized_distortion)) < 4 * se + 1e-4, (s.mean(), se)


def test_score_on_codes_equals_the_decoded_inner_product():
    """The asymmetric estimator on codes is ⟨q, decode(K)⟩/√d: the correction is linear in Pᵀ sign."""
    k, q = gaussian((2, 2, 24, 16), 6), gaussian((2, 2, 3, 16), 7)
    for name in ("tq-qkv", "tq-fkfv"):
        s = schemes.create(name, impl="reference", budget=2, dim=16, seed=1)
        enc = s.encode(k, k)
        k_hat, _ = s.decode(enc)
        torch.testing.assert_close(s.score(q, enc), q @ k_hat.transpose(-1, -2) / 4, rtol=1e-10, atol=1e-12)


# --- bit ledger -------------------------------------------------------------------------------------------

def hand_count(name, bits, n_heads, n_tokens, dim):
    """Bits of one trial's cache counted from the format, as (per-cache bits per element, model
    bits per layer-head): per cache packed rows, float32 norms and residual norms, packed sketches;
    per model the packed signs and projections and one float32 codebook per code width in use (K
    and V share it)."""
    marks = re.fullmatch(r"(?:tq|plain)-([qf]?)k([qf]?)v", name).groups()  # sketch mark of K, V
    rotate = name.startswith("tq-")
    cache, model = 0, 0
    widths = set()
    for mark in marks:
        mse_bits = bits - 1 if mark else bits
        row_bytes = lambda width: (dim * width + 7) // 8  # noqa: E731
        cache += n_heads * n_tokens * 32                                          # norm
        if mse_bits:
            cache += n_heads * n_tokens * row_bytes(mse_bits) * 8
            widths.add(mse_bits)
        if rotate:
            model += n_heads * row_bytes(1) * 8
        if mark:
            cache += n_heads * n_tokens * (32 + row_bytes(1) * 8)                   # ‖e‖ and sign(Pe)
            model += n_heads * row_bytes(1) * 8 * (dim if mark == "f" else 1)       # P
    model += sum(32 * 2 ** w for w in widths)                                      # codebooks
    return cache / (2 * n_heads * n_tokens * dim), model / n_heads


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bits", [1, 3, 8])
def test_measured_bits_equal_the_hand_count(name, bits):
    dim = 16
    k = gaussian((3, 2, 5, dim), 8)
    s = schemes.create(name, impl="reference", budget=bits, dim=dim)
    enc = s.encode(k, k)
    ledger = s.bits(enc)
    assert (ledger.bits_per_element, ledger.model_bits) == hand_count(name, bits, 2, 5, dim)
    t = schemes.create(name, budget=bits, dim=dim)
    enc_t = t.encode(k, k)
    assert enc_t.model == enc.model
    assert (t.bits(enc_t).bits_per_element, t.bits(enc_t).model_bits) == (ledger.bits_per_element, ledger.model_bits)
    for part in ("cache", "model"):
        assert torch.equal(getattr(BitLedger.per_trial(enc_t), part), getattr(BitLedger.per_trial(enc), part))


def test_plain_kv_pads_rows_that_do_not_fill_a_byte():
    k = gaussian((2, 1, 7, 12), 9)
    s = schemes.create("plain-kv", impl="reference", budget=3, dim=12)  # 36 bits per row -> 5 bytes
    ledger = s.bits(s.encode(k, k))
    assert (ledger.bits_per_element, ledger.model_bits) == hand_count("plain-kv", 3, 1, 7, 12)


# --- protocol edges -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_round_trip_keeps_dtype_and_stays_finite_on_edge_inputs(dtype):
    k = gaussian((2, 1, 6, 16), 10, dtype)
    k[0, 0, 0] = 0           # zero vector
    k[0, 0, 1] = 3.0         # constant row
    k[1, 0, 2] *= 1e30       # huge magnitude
    for name in NAMES:
        s = schemes.create(name, impl="reference", budget=2, dim=16, seed=2)
        enc = s.encode(k, k)
        k_hat, v_hat = s.decode(enc)
        logits = s.score(gaussian((2, 1, 3, 16), 13, dtype), enc)
        assert k_hat.dtype == dtype and logits.dtype == dtype and k_hat.shape == k.shape
        assert torch.isfinite(k_hat).all() and torch.isfinite(logits).all(), name
        assert torch.equal(k_hat[0, 0, 0], torch.zeros(16, dtype=dtype))


@given(name=st.sampled_from(NAMES), bits=st.integers(1, 8),
       k=arrays(np.float32, (2, 1, 3, 8), elements=st.floats(-1e6, 1e6, width=32)))
def test_random_inputs_decode_finite_and_score_consistently(name, bits, k):
    """On arbitrary float32 caches: finite reconstructions no larger than the QJL bound, and the
    score on codes equals q·k̂ᵀ/√d (the asymmetric estimator is linear in the sketch)."""
    k = torch.from_numpy(k)
    q = gaussian((2, 1, 2, 8), 15, torch.float32)
    s = schemes.create(name, impl="reference", budget=bits, dim=8, seed=1)
    enc = s.encode(k, k)
    k_hat, v_hat = s.decode(enc)
    assert torch.isfinite(k_hat).all() and torch.isfinite(v_hat).all()
    # per unit vector: ‖ŷ_mse‖ ≤ √d (centroids in [−1, 1]), ‖e‖ ≤ 1 + √d, and the correction
    # √(π/2)/m·‖e‖·‖Pᵀ sign(Pe)‖ ≤ √(π/2)·√d·‖e‖ because ‖P‖₂ ≤ ‖P‖_F = d and ‖sign‖ = √m
    root_d = math.sqrt(8)
    bound = (root_d + math.sqrt(math.pi / 2) * root_d * (1 + root_d)) * k.double().norm(dim=-1) * (1 + 1e-6)
    assert (k_hat.double().norm(dim=-1) <= bound).all()
    expected = (q.double() @ k_hat.double().transpose(-1, -2) / math.sqrt(8))
    scale = q.double().norm(dim=-1)[..., None] * k.double().norm(dim=-1)[:, :, None, :] + 1e-30
    assert ((s.score(q, enc).double() - expected).abs() / scale).max() < 1e-5


def test_trials_do_not_interact():
    """Trial t's signs and codes follow from its data and its trial index, whatever batch it is
    coded in; two trials of one batch get different signs."""
    k = gaussian((4, 1, 10, 16), 11)
    s = schemes.create("tq-qkqv", impl="reference", budget=3, dim=16, seed=4)
    enc = s.fit(k, k, trials=torch.arange(4)).encode(k, k)
    whole, _ = s.decode(enc)
    part_enc = s.fit(k[2:3], k[2:3], trials=torch.tensor([2])).encode(k[2:3], k[2:3])
    part, _ = s.decode(part_enc)
    torch.testing.assert_close(whole[2:3], part, rtol=0, atol=0)
    for key in ("k.rotation_signs", "k.sketch_signs", "v.sketch_signs"):
        assert torch.equal(enc.codes[key][2:3], part_enc.codes[key]), key
        assert not torch.equal(enc.codes[key][0], enc.codes[key][1]), key


@pytest.mark.parametrize("family", ["pcg64", "mt19937", "philox"])
def test_rng_families_give_valid_distinct_rotations(family):
    k = gaussian((2, 1, 32, 16), 12)
    s = schemes.create("tq-fkv", impl="reference", budget=3, dim=16, seed=1, rng=family)
    enc = s.encode(k, k)
    again = schemes.create("tq-fkv", impl="reference", budget=3, dim=16, seed=1, rng=family).encode(k, k)
    assert all(torch.equal(enc.codes[key], again.codes[key]) for key in enc.codes)
    other = "pcg64" if family != "pcg64" else "philox"
    changed = schemes.create("tq-fkv", impl="reference", budget=3, dim=16, seed=1, rng=other).encode(k, k)
    assert not torch.equal(enc.codes["k.rotation_signs"], changed.codes["k.rotation_signs"])


# --- the CLI ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["pcg64", "philox"])
def test_cli_runs_the_reference_implementation(tmp_path, family):
    out = tmp_path / family
    code = main(["run", "--scenario", "gaussian", "--scheme", "tq-kv,tq-qkv", "--impl", "reference",
                 "--budget", "2", "--dim", "16", "--seq-len", "32", "--queries", "4", "--trials", "4",
                 "--rng", family, "--out", str(out), "--quiet"])
    assert code == 0
    frame = RunStore(out).trials()
    assert len(frame) == 2 * 4
    assert set(frame["impl"]) == {"reference"} and set(frame["rng"]) == {family}
    assert np.isfinite(frame["rel_mse_k"]).all()


def test_float32_compute_dtype_matches_float64_up_to_rounding():
    k = gaussian((2, 1, 64, 32), 14)
    fine, coarse = (schemes.create("tq-qkqv", impl="reference", budget=3, dim=32, seed=3, compute_dtype=c)
                    for c in ("float64", "float32"))
    k64, _ = fine.decode(fine.encode(k, k))
    k32, _ = coarse.decode(coarse.encode(k, k))
    assert rel_mse_per_trial(k64, k32).max() < 1e-4  # a few codes flip at cell edges, nothing else


def test_reference_shares_no_codec_code_with_the_torch_path():
    """The independence that makes agreement evidence: only protocol (base), rng and the
    package's own modules may be imported."""
    import ast
    import pathlib
    forbidden = {"turboquant", "hadamard", "lloyd_max", "packing", "qjl"}
    for path in pathlib.Path(reference.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                modules = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                if node.level >= 2 or (node.module or "").startswith("schemes"):
                    assert not any(part in forbidden for m in modules for part in m.split(".")), (path.name, modules)
            elif isinstance(node, ast.Import):
                assert not any(part in forbidden for a in node.names for part in a.name.split(".")[1:]), path.name
