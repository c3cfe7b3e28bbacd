"""SpectralQuant: water-filling, eigen-analysis, calibration and the codec's own properties.

Reference values come from independent sources: brute-force enumeration (water-filling),
torch.linalg.eigh / numpy (power iteration, d_eff), the scenario's planted subspace, the
paper's storage formula counted by hand (ledger).
"""
import functools
import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import scenarios
import schemes
from scenarios.base import TrialShape
from schemes.eigen import covariance, effective_dimension, eigh_descending, participation_ratio, spectral_gap, \
    top_eigenvectors
from schemes.base import BitLedger, Encoded
from kvcommon.rng import generator
from schemes.packing import pack_variable, unpack_variable
from schemes.spectralquant import BASIS_BITS, N_PROJECTIONS, SpectralQuant
from schemes.waterfill import distortion, waterfill
from test_turboquant_cpu import _cache, _same

SQ_NAMES = [f"{p}-{k}k{v}v" for p in ("sq", "squ") for k in ("", "q") for v in ("", "q")]


def _draw(scenario: str, n_trials=4, seq_len=128, dim=64, n_calib=512, seed=0, **params):
    sc = scenarios.create(scenario, **params)
    shape = TrialShape(1, seq_len, 16, dim, n_calib)
    draws = [sc.draw(lambda *labels, _t=t: generator("pcg64", seed, "sq-test", _t, *labels), shape)
             for t in range(n_trials)]
    return {k: torch.from_numpy(np.stack([d[k] for d in draws])) for k in ("k", "v", "q", "k_cal", "v_cal")}


# --- water-filling ----------------------------------------------------------------------------
def _brute_force(weights, total, lo, hi=8):
    best = math.inf
    for widths in itertools.product(range(lo, hi + 1), repeat=len(weights)):
        if sum(widths) == total:
            best = min(best, sum(w * 4.0 ** -b for w, b in zip(weights, widths)))
    return best


@given(st.lists(st.floats(0, 100, allow_nan=False), min_size=1, max_size=4), st.integers(0, 2), st.data())
def test_waterfill_matches_brute_force(weights, lo, data):
    d = len(weights)
    total = data.draw(st.integers(lo * d, 8 * d))
    widths = waterfill(torch.tensor(weights, dtype=torch.float64), total, lo)
    assert int(widths.sum()) == total and int(widths.min()) >= lo and int(widths.max()) <= 8
    got = float(distortion(torch.tensor(weights, dtype=torch.float64), widths))
    assert got == pytest.approx(_brute_force(weights, total, lo), rel=1e-12, abs=1e-300)


def test_waterfill_batched_five_coordinates_against_brute_force():
    gen = np.random.default_rng(5)
    weights = torch.from_numpy(gen.exponential(size=(3, 5)) ** 3)
    for total in (10, 14, 19, 27):
        widths = waterfill(weights, total, 2)
        for row, w in zip(weights.tolist(), widths):
            got = float(distortion(torch.tensor(row, dtype=torch.float64), w))
            assert got == pytest.approx(_brute_force(row, total, 2), rel=1e-12)


@pytest.mark.parametrize("budget", [2, 3, 5, 8])
def test_waterfill_isotropic_is_uniform(budget):
    widths = waterfill(torch.full((2, 16), 0.7), budget * 16, min(2, budget))
    assert torch.equal(widths, torch.full((2, 16), budget))


def test_waterfill_rejects_infeasible_total():
    with pytest.raises(ValueError, match="valid"):
        waterfill(torch.ones(4), 3, 1)


# --- eigen-analysis ---------------------------------------------------------------------------
def _planted_covariance(gen, batch, d, spectrum):
    q, _ = np.linalg.qr(gen.standard_normal((*batch, d, d)))
    return torch.from_numpy(q @ (np.asarray(spectrum)[:, None] * np.swapaxes(q, -1, -2)))


def test_power_iteration_matches_eigh():
    gen = np.random.default_rng(1)
    d, k = 32, 6
    spectrum = np.concatenate((np.linspace(10, 5, k), np.linspace(1, 0.1, d - k)))
    cov = _planted_covariance(gen, (3, 2), d, spectrum)
    start = torch.from_numpy(np.random.default_rng(2).standard_normal((d, k)))
    values, vectors, n_iter = top_eigenvectors(cov, k, start)
    exact_values, exact_vectors = eigh_descending(cov)
    # the block's leading pairs converge like (λ_7/λ_6)^t = 0.2^t: 1e-9 takes ~13 products
    assert int(n_iter.max()) < 30
    assert torch.allclose(values, exact_values[..., :k], rtol=1e-9)
    # Principal angles between the subspaces: all cosines 1.
    cosines = torch.linalg.svdvals(exact_vectors[..., :k].transpose(-1, -2) @ vectors)
    assert float((1 - cosines).abs().max()) < 1e-10
    # Individual eigenvectors up to sign (the eigenvalues are distinct).
    overlap = (exact_vectors[..., :k] * vectors).sum(-2).abs()
    assert float((1 - overlap).abs().max()) < 1e-8


def test_power_iteration_on_power_law_spectrum_with_oversampling():
    """Only the leading n_converge pairs must converge; the oversampled rest of the block
    sets the rate (λ_{k+1}/λ_j), as the codec uses it."""
    gen = np.random.default_rng(5)
    d = 64
    cov = _planted_covariance(gen, (4,), d, np.arange(1, d + 1, dtype=float) ** -1.0)
    need = torch.tensor([4, 8, 12, 16])
    start = torch.from_numpy(gen.standard_normal((d, 32)))
    values, vectors, n_iter = top_eigenvectors(cov, 32, start, n_converge=need, tol=1e-10)
    exact_values, exact_vectors = eigh_descending(cov)
    for i, m in enumerate(need.tolist()):
        assert torch.allclose(values[i, :m], exact_values[i, :m], rtol=1e-9)
        overlap = (exact_vectors[i, :, :m] * vectors[i, :, :m]).sum(-2).abs()
        assert float((1 - overlap).max()) < 1e-8
    assert n_iter.tolist() == sorted(n_iter.tolist())       # more pairs to converge, more products


def test_power_iteration_result_does_not_depend_on_the_batch():
    gen = np.random.default_rng(6)
    d, k = 24, 10
    spectra = [np.linspace(5, 0.1, d), np.r_[np.full(3, 9.0), np.linspace(1, 0.5, d - 3)], np.linspace(1, 0.999, d)]
    cov = torch.cat([_planted_covariance(gen, (1,), d, sp) for sp in spectra])
    start = torch.from_numpy(gen.standard_normal((d, k)))
    together = top_eigenvectors(cov, k, start, n_converge=torch.tensor([4, 3, 2]), max_iter=50)
    for i in range(3):
        alone = top_eigenvectors(cov[i:i + 1], k, start, n_converge=torch.tensor([[4, 3, 2][i]]), max_iter=50)
        assert torch.equal(alone[0][0], together[0][i]) and torch.equal(alone[1][0], together[1][i])
        assert int(alone[2][0]) == int(together[2][i])
    assert int(together[2][2]) == 50        # gaps of 4e-5: the cap stops it


def test_covariance_is_uncentred_second_moment():
    x = np.random.default_rng(4).standard_normal((2, 3, 10, 5)) + 1.0
    expected = np.einsum("bhni,bhnj->bhij", x, x) / 10
    assert np.allclose(covariance(torch.from_numpy(x)).numpy(), expected)


@pytest.mark.parametrize("rank", [1, 3, 7, 16])
def test_effective_dimension_of_projector_is_rank(rank):
    d = 16
    spectrum = [1.0] * rank + [0.0] * (d - rank)
    cov = _planted_covariance(np.random.default_rng(rank), (2,), d, spectrum)
    assert effective_dimension(cov).tolist() == [rank, rank]


def test_participation_ratio_matches_definition_on_known_spectra():
    gen = np.random.default_rng(3)
    for _ in range(5):
        spectrum = gen.exponential(size=12) ** 2
        cov = _planted_covariance(gen, (1,), 12, spectrum)
        expected = spectrum.sum() ** 2 / (spectrum ** 2).sum()
        assert float(participation_ratio(cov)) == pytest.approx(expected, rel=1e-10)
        assert int(effective_dimension(cov)) == round(expected)
    assert int(effective_dimension(torch.zeros(1, 5, 5))) == 5  # no information: every coordinate counts


def test_spectral_gap_on_known_spectrum():
    values = torch.tensor([[4.0, 3.0, 1.0, 0.5]])
    assert spectral_gap(values, torch.tensor([2])).tolist() == [pytest.approx(0.5)]
    assert spectral_gap(values, torch.tensor([4])).tolist() == [pytest.approx(0.125)]


# --- calibration on scenarios -----------------------------------------------------------------
def test_lowrank_aligned_recovers_planted_subspace_and_rank():
    dim, rank, n_trials = 64, 8, 3
    sc = scenarios.create("lowrank_aligned", rank=rank, basis="haar")
    data = _draw("lowrank_aligned", n_trials=n_trials, dim=dim, rank=rank, basis="haar")
    scheme = schemes.create("sq-kv", budget=3, dim=dim).fit(data["k_cal"], data["v_cal"])
    assert scheme.d_eff["k"].flatten().tolist() == [rank] * n_trials
    for t in range(n_trials):
        pop = sc.population(generator("pcg64", 0, "sq-test", t, "population", 0), dim)
        planted = torch.from_numpy(np.linalg.qr(pop.mix_k[:, :rank])[0])
        recovered = scheme.calibration["k"].basis[t, 0, :, :rank]
        cosines = torch.linalg.svdvals(planted.T @ recovered)
        assert float(cosines.min()) > 0.995, cosines


def test_isotropic_data_gets_uniform_allocation():
    """With ample calibration the sample variances of an isotropic population stay within a
    factor 4 of each other, so no marginal gain of a second extra bit beats a first one: the
    allocation is exactly uniform (the paper's finding). With n_cal = 512 at d = 64 the
    Marchenko–Pastur spread ((1 + √(d/n))/(1 − √(d/n)))² ≈ 4.4 exceeds 4, and a few extreme
    coordinates move by one bit — never more."""
    ample = _draw("gaussian", n_trials=2, dim=32, n_calib=8192)
    scarce = _draw("gaussian", n_trials=2, dim=64, n_calib=512)
    for budget in (3, 4, 6):
        scheme = schemes.create("sq-kv", budget=budget, dim=32).fit(ample["k_cal"], ample["v_cal"])
        for cal in scheme.calibration.values():
            assert torch.equal(cal.widths, torch.full_like(cal.widths, budget))
        scheme = schemes.create("sq-kv", budget=budget, dim=64).fit(scarce["k_cal"], scarce["v_cal"])
        for cal in scheme.calibration.values():
            deviation = (cal.widths - budget).abs()
            assert int(deviation.max()) <= 1 and float((deviation > 0).double().mean()) < 0.1


def test_degenerate_calibration_falls_back_to_identity():
    scheme = schemes.create("squ-qkv", budget=3, dim=8).fit(torch.zeros(2, 1, 10, 8), torch.zeros(2, 1, 10, 8))
    cal = scheme.calibration["k"]
    assert torch.allclose(cal.basis, torch.eye(8, dtype=torch.float64).expand(2, 1, 8, 8))
    assert cal.d_eff.flatten().tolist() == [8, 8]


def test_encode_before_fit_or_on_other_trials_is_an_error():
    k = torch.randn(2, 1, 5, 8, generator=torch.Generator().manual_seed(5))
    with pytest.raises(ValueError, match="fit"):
        schemes.create("sq-kv", budget=2, dim=8).encode(k, k)
    scheme = schemes.create("sq-kv", budget=2, dim=8).fit(k, k)
    with pytest.raises(ValueError, match="same trials"):
        scheme.encode(k[:1], k[:1])


# --- storage ----------------------------------------------------------------------------------
@given(st.integers(1, 3), st.integers(1, 2), st.integers(1, 17), st.integers(1, 9), st.integers(0, 2 ** 31))
def test_variable_width_packing_roundtrips(b, h, s, d, seed):
    gen = torch.Generator().manual_seed(seed)
    widths = torch.randint(0, 9, (b, h, d), generator=gen)
    idx = (torch.rand(b, h, s, d, generator=gen) * (2.0 ** widths.unsqueeze(2))).to(torch.int64)
    packed = pack_variable(idx, widths)
    assert packed.shape == (b, (s * int(widths.sum((1, 2)).max()) + 7) // 8)
    assert torch.equal(unpack_variable(packed, widths, s), idx)


@pytest.mark.parametrize("name", ["sq-kv", "squ-qkqv"])
def test_decoding_a_copy_of_the_stored_codes_gives_the_same_cache(name):
    """decode and score read the codes encode remembered for its very streams (CODES); a copy
    of the stored tensors (as another process would hold) is unpacked instead: same values."""
    from schemes.base import Encoded
    from schemes.spectralquant_memos import CODES
    data = _draw("spectral_decay", n_trials=3, seq_len=40, dim=32, n_calib=128)
    scheme = schemes.create(name, budget=3, dim=32).fit(data["k_cal"], data["v_cal"])
    enc = scheme.encode(data["k"], data["v"])
    assert CODES.get((enc.codes["k.codes"], enc.codes["k.widths"])) is not None
    copy = Encoded(enc.shape, enc.dtype, codes={n: t.clone() for n, t in enc.codes.items()},
                   side=dict(enc.side), exact_bits=dict(enc.exact_bits), model=set(enc.model))
    assert CODES.get((copy.codes["k.codes"], copy.codes["k.widths"])) is None
    for a, b in zip(scheme.decode(enc), scheme.decode(copy)):
        assert torch.equal(a, b)
    assert torch.equal(scheme.score(data["q"], enc), scheme.score(data["q"], copy))


@pytest.mark.parametrize("seed, s", [(0, 5), (1, 5), (2, 5), (0, 16), (1, 24), (2, 8)])   # S % 8 == 0: 8-token blocks
def test_variable_width_stream_is_laid_out_as_documented(seed, s):
    """pack_variable against a bit-by-bit packer written from its documented layout: per trial,
    head after head, token after token, coordinate after coordinate, the low w bits of each code
    most significant first; the stream packed 8 bits a byte, MSB first, trials padded to the
    longest. Uniform and per-(trial, head) varying widths."""
    gen = torch.Generator().manual_seed(seed)
    b, h, d = 3, 2, 6
    widths = torch.randint(0, 9, (b, h, d), generator=gen)
    if seed == 0:
        widths = widths[:1, :1].expand(b, h, d).contiguous()          # the same widths everywhere
    idx = (torch.rand(b, h, s, d, generator=gen) * (2.0 ** widths.unsqueeze(2))).to(torch.int64)
    streams = []
    for i in range(b):
        bits = [(int(idx[i, j, t, c]) >> p) & 1 for j in range(h) for t in range(s) for c in range(d)
                for p in reversed(range(int(widths[i, j, c])))]
        streams.append(bits)
    n_bytes = (max(len(x) for x in streams) + 7) // 8
    expected = torch.tensor([[int("".join(map(str, (x + [0] * (8 * n_bytes))[8 * y:8 * y + 8])), 2)
                              for y in range(n_bytes)] for x in streams], dtype=torch.uint8)
    packed = pack_variable(idx, widths)
    assert torch.equal(packed, expected)
    assert torch.equal(unpack_variable(packed, widths, s), idx)


@pytest.mark.parametrize("budget", [2, 3, 5])
def test_squ_ledger_by_hand(budget):
    h, s, d = 2, 40, 32
    data = _draw("lowrank_aligned", n_trials=1, seq_len=s, dim=d)
    k, v = data["k"].expand(1, h, s, d).contiguous(), data["v"].expand(1, h, s, d).contiguous()
    k_cal, v_cal = data["k_cal"].expand(1, h, -1, d).contiguous(), data["v_cal"].expand(1, h, -1, d).contiguous()
    scheme = schemes.create("squ-kv", budget=budget, dim=d).fit(k_cal, v_cal)
    enc = scheme.encode(k, v)
    ledger = scheme.bits(enc).components
    tail = min(2, budget)
    for x in ("k", "v"):
        d_eff = scheme.d_eff[x][0].tolist()
        payload = sum((budget * e + tail * (d - e)) * s for e in d_eff)   # the paper's formula, §3.2
        assert ledger[f"codes.{x}.codes"] == 8 * math.ceil(payload / 8)
        assert ledger[f"codes.{x}.norm"] == 32 * h * s
        assert ledger[f"codes.{x}.basis"] == BASIS_BITS * h * d * d
        assert ledger[f"codes.{x}.basis_scale"] == 32 * h * d
        assert ledger[f"codes.{x}.sigma"] == 32 * h * d
        assert ledger[f"codes.{x}.widths"] == 4 * h * d
    widths_used = {budget, tail}
    assert {key for key in ledger if key.startswith("side.")} == {f"side.codebook.{w}bit" for w in widths_used}
    assert sum(ledger[f"side.codebook.{w}bit"] for w in widths_used) == 32 * sum(2 ** w for w in widths_used)
    if budget > 2:  # the point of squ: fewer payload bits than b·d per token
        assert ledger["codes.k.codes"] < budget * d * s * h


def test_sketched_ledger_counts_sketch_and_residual_norm():
    data = _draw("lowrank_aligned", n_trials=1, seq_len=24, dim=32)
    scheme = schemes.create("squ-qkv", budget=3, dim=32).fit(data["k_cal"], data["v_cal"])
    ledger = scheme.bits(scheme.encode(data["k"], data["v"])).components
    d_eff = int(scheme.d_eff["k"])
    assert ledger["codes.k.codes"] == 8 * math.ceil(((3 - 1) * d_eff + 2 * (32 - d_eff)) * 24 / 8)
    assert ledger["codes.k.sketch"] == N_PROJECTIONS * 24
    assert ledger["codes.k.residual_norm"] == 32 * 24
    assert ledger["codes.k.sketch_seed"] == 64       # per trial: its Gaussian sketches are drawn from it
    assert "codes.v.sketch" not in ledger


# --- quality ----------------------------------------------------------------------------------
def test_selective_qjl_logit_slope_near_one():
    """The asymmetric estimator with Gaussian projections is unbiased (QJL Lemma 3.2): over
    16 trials × 10 sketch seeds the slope of estimated on exact logits was 1.013 ± 0.008 at
    budget 1, 1.005 ± 0.003 at 2, 1.000 ± 0.001 at 3 (±1 projections over these d_eff = 8
    coordinates gave 1.031, 1.040, 1.008). One seed's slope has sd ≈ 0.024 at budget 1, so
    the mean of 4 is held to 0.04; MSE-only coding shrinks (slope < 1)."""
    data = _draw("lowrank_aligned", n_trials=4, seq_len=64, dim=64, seed=3)
    exact = data["q"] @ data["k"].transpose(-1, -2) / 8
    for budget in (1, 3):
        slopes = []
        for seed in range(4):
            scheme = schemes.create("squ-qkv", budget=budget, dim=64, seed=seed).fit(data["k_cal"], data["v_cal"])
            est = scheme.score(data["q"], scheme.encode(data["k"], data["v"]))
            slopes.append(float((est * exact).sum() / (exact * exact).sum()))
        assert abs(np.mean(slopes) - 1) < 0.04, (budget, slopes)
        mse_only = schemes.create("squ-kv", budget=budget, dim=64).fit(data["k_cal"], data["v_cal"])
        est = mse_only.score(data["q"], mse_only.encode(data["k"], data["v"]))
        assert float((est * exact).sum() / (exact * exact).sum()) < 1


def test_sq_beats_tq_on_lowrank_aligned_at_budget_3():
    data = _draw("lowrank_aligned", n_trials=3, dim=64)
    errors = {}
    for name in ("tq-kv", "sq-kv"):
        scheme = schemes.create(name, budget=3, dim=64).fit(data["k_cal"], data["v_cal"])
        k_hat, _ = scheme.decode(scheme.encode(data["k"], data["v"]))
        errors[name] = float(((k_hat - data["k"]) ** 2).sum() / (data["k"] ** 2).sum())
    assert errors["sq-kv"] < errors["tq-kv"] / 5, errors


@pytest.mark.parametrize("name", SQ_NAMES)
def test_all_eight_registered_with_descriptions(name):
    spec = schemes.registry.specs()[name]
    assert spec.description and schemes.create(name, budget=2, dim=16).name == name


# --- the NumPy reference implementation ------------------------------------------------------
def test_reference_building_blocks_agree_with_torch_ones():
    from schemes.lloyd_max import gaussian_codebook
    from schemes.reference.spectralquant_ref import greedy_widths, unit_gaussian_codebook
    for bits in range(1, 9):   # plain Lloyd iteration vs the Newton solver
        assert np.allclose(unit_gaussian_codebook(bits), gaussian_codebook(bits, 1.0).centroids, atol=1e-9)
    gen = np.random.default_rng(11)
    for _ in range(20):        # heap greedy vs batched sort, identical tie-breaking
        weights = gen.exponential(size=7) ** 2
        total = int(gen.integers(2 * 7, 8 * 7 + 1))
        assert greedy_widths(weights, total, 2).tolist() == waterfill(torch.from_numpy(weights), total, 2).tolist()


@pytest.mark.parametrize("name", ["sq-kv", "squ-kqv", "sq-qkqv"])
@pytest.mark.parametrize("scenario", ["lowrank_aligned", "spectral_decay"])
def test_reference_agrees_with_torch(name, scenario):
    """The torch codec and the reference (both: top block by eigh at this d, completed by QR)
    share d_eff, the leading eigenpairs and the ledger exactly; an unsketched tensor is then
    the same coding (relative error equal to 1e-6), a sketched one agrees in distribution: the
    mean relative error over scheme seeds within 4 standard errors of the difference (the two
    draw their sketches independently)."""
    data = _draw(scenario, n_trials=3, seq_len=32, dim=64)
    errors = {"torch": [], "reference": []}
    for seed in range(4):
        fitted = {}
        for impl, make in (("torch", schemes.create), ("reference", functools.partial(schemes.create, impl="reference"))):
            scheme = fitted[impl] = make(name, budget=3, dim=64, seed=seed).fit(data["k_cal"], data["v_cal"])
            enc = scheme.encode(data["k"], data["v"])
            k_hat, v_hat = scheme.decode(enc)
            errors[impl].append([float(((x_hat - data[x]) ** 2).sum() / (data[x] ** 2).sum())
                                 for x, x_hat in (("k", k_hat), ("v", v_hat))] +
                                [(scheme.bits(enc).components, sorted(enc.model),
                                  BitLedger.per_trial(enc).cache.tolist(), BitLedger.per_trial(enc).model.tolist())])
        for x in ("k", "v"):
            d_eff = fitted["torch"].d_eff[x]
            assert d_eff.tolist() == [[int(f.d_eff) for f in row] for row in fitted["reference"].fits[x]]
            exact = torch.tensor(np.array([[f.eigenvalues for f in row] for row in fitted["reference"].fits[x]]))
            power = fitted["torch"].eigenvalues[x]
            lead = torch.arange(64) <= d_eff.unsqueeze(-1)          # the d_eff + 1 converged pairs
            assert torch.allclose(power[lead], exact[lead], rtol=1e-7, atol=1e-12 * float(exact.max()))
        diagnostics = [fitted[impl].diagnostics() for impl in ("torch", "reference")]
        assert diagnostics[0].keys() == diagnostics[1].keys()
        for key in diagnostics[0]:                                   # what the run store records
            assert torch.allclose(diagnostics[0][key], diagnostics[1][key], rtol=1e-6), key
    for (_, _, bits_t), (_, _, bits_r) in zip(errors["torch"], errors["reference"]):
        assert bits_t == bits_r
    for i, sketched in enumerate((fitted["torch"].sketch_k, fitted["torch"].sketch_v)):
        err_t = np.array([e[i] for e in errors["torch"]])
        err_r = np.array([e[i] for e in errors["reference"]])
        if not sketched:
            np.testing.assert_allclose(err_r, err_t, rtol=1e-6, err_msg=str(i))
            continue
        # the sketches are independent draws in the two implementations: their means differ by
        # sampling error, whose standard error (Welch, over the seeds) sets the bound
        se = np.sqrt(err_t.var(ddof=1) / len(err_t) + err_r.var(ddof=1) / len(err_r))
        assert abs(err_r.mean() - err_t.mean()) < 4 * se, (i, err_r, err_t)


@pytest.mark.parametrize("budget", [3, 4])
def test_reference_builds_the_torch_basis_on_a_degenerate_tail(budget):
    """lowrank_aligned at d = 64: 8 large eigenvalues and 56 tiny, nearly equal ones (d_eff = 8,
    so the basis keeps 24 exact eigenvectors and completes them by QR). The reference once kept
    all 64 exact eigenvectors: the same widths histogram, but σ of its sample-selected tail
    eigenvectors spread per Marchenko–Pastur and underestimated fresh tokens, and its K and V
    errors were ~5 % higher (about 1 sd per trial, hence p ~ 1e-9 in `validate --vary impl`).

    1. The step itself against an independent check: the reference's basis is orthonormal, its
       leading 2·d_eff + 8 columns are eigenvectors of C (residual ‖Cv − λv‖ at rounding), each
       column's largest entry is positive.
    2. Both implementations then code alike: K and V errors equal to 1e-6 relative, equal widths
       (elementwise), σ and basis to float rounding — the two differ only by rounding
       in float64 eigh/QR (~1e-15), so 1e-6 leaves room for that and is 4 orders of magnitude
       below the 5 % the exact tail costs."""
    from schemes.reference.spectralquant_ref import block_width, eigenbasis
    data = _draw("lowrank_aligned", n_trials=4, seq_len=64, dim=64)
    x = data["k_cal"][0, 0].numpy()
    x = x / np.abs(x).max()
    cov = x.T @ x / len(x)
    values, vectors = np.linalg.eigh(cov)
    d_eff = int(round(np.trace(cov) ** 2 / np.sum(cov ** 2)))
    k = block_width(d_eff, 64)
    assert d_eff == 8 and k == 24
    basis = eigenbasis(vectors[:, ::-1], d_eff)
    np.testing.assert_allclose(basis.T @ basis, np.eye(64), atol=1e-12)
    lead = basis[:, :k]
    np.testing.assert_allclose(cov @ lead, lead * values[::-1][:k], atol=1e-12 * values[-1] + 1e-13 * values.max())
    assert (basis[np.abs(basis).argmax(0), np.arange(64)] > 0).all()

    torch_sq = schemes.create("sq-kv", budget=budget, dim=64, seed=0).fit(data["k_cal"], data["v_cal"])
    ref_sq = schemes.create("sq-kv", impl="reference", budget=budget, dim=64, seed=0).fit(data["k_cal"], data["v_cal"])
    errors = {}
    for impl, scheme in (("torch", torch_sq), ("reference", ref_sq)):
        k_hat, v_hat = scheme.decode(scheme.encode(data["k"], data["v"]))
        errors[impl] = [float(((x_hat - data[x]) ** 2).sum() / (data[x] ** 2).sum())
                        for x, x_hat in (("k", k_hat), ("v", v_hat))]
    np.testing.assert_allclose(errors["reference"], errors["torch"], rtol=1e-6)
    for name in ("k", "v"):
        cal, fits = torch_sq.calibration[name], ref_sq.fits[name]
        assert cal.widths.tolist() == [[f.widths.tolist() for f in row] for row in fits]
        np.testing.assert_allclose(cal.sigma.numpy(), np.array([[f.sigma for f in row] for row in fits]), rtol=1e-6)
        np.testing.assert_allclose(cal.basis.numpy(), np.array([[f.basis for f in row] for row in fits]), atol=1e-9)


def test_run_stores_d_eff_per_trial_and_it_tracks_the_calibration_budget(tmp_path):
    """d_eff self-calibrates to the calibration budget (AMD paper): stored per trial, NULL for TQ."""
    from harness.cli import main
    from harness.store import RunStore
    d_eff = {}
    for n_cal in (16, 256):
        out = tmp_path / f"cal{n_cal}"
        assert main(["run", "--scenario", "spectral_decay", "--scheme", "sq-kv,tq-kv", "--budget", "3", "--dim", "32",
                     "--seq-len", "32", "--queries", "4", "--trials", "6", "--calib-tokens", str(n_cal),
                     "--quiet", "--out", str(out)]) == 0
        frame = RunStore(out).trials()
        assert frame.loc[frame.scheme == "tq-kv", "d_eff_k"].isna().all()
        sq = frame[frame.scheme == "sq-kv"]
        assert sq["d_eff_k"].between(1, 32).all() and sq["spectral_gap_k"].notna().all()
        d_eff[n_cal] = sq["d_eff_k"].mean()
    # with few calibration tokens the sample covariance is spikier: smaller participation ratio
    assert d_eff[16] < d_eff[256]


def test_calibration_memo_shares_only_the_same_unmodified_tensor():
    data = _draw("spectral_decay", n_trials=2, seq_len=16, dim=32)
    first = schemes.create("sq-kv", budget=3, dim=32, seed=1).fit(data["k_cal"], data["v_cal"])
    again = schemes.create("squ-qkv", budget=2, dim=32, seed=7).fit(data["k_cal"], data["v_cal"])
    assert again.calibration["k"].basis is first.calibration["k"].basis              # shared
    assert not torch.equal(again.calibration["k"].widths, first.calibration["k"].widths)
    copy = data["k_cal"].clone()
    fresh = schemes.create("sq-kv", budget=3, dim=32).fit(copy, data["v_cal"])
    assert fresh.calibration["k"].basis is not first.calibration["k"].basis          # recomputed ...
    assert torch.equal(fresh.calibration["k"].basis, first.calibration["k"].basis)   # ... to the same
    copy[..., 0].mul_(5)                                                              # in place: a new version
    changed = schemes.create("sq-kv", budget=3, dim=32).fit(copy, data["v_cal"])
    assert not torch.equal(changed.calibration["k"].basis, fresh.calibration["k"].basis)
    # the power iteration converged on every head, well inside its cap of 500 products
    power = schemes.create("sq-kv", budget=3, dim=32, eigensolver="power").fit(data["k_cal"], data["v_cal"])
    assert 0 < int(power.calibration["k"].iterations.max()) < 500
    assert int(first.calibration["k"].iterations.max()) == 0                          # auto: eigh at d = 32


@given(st.integers(0, 2 ** 32 - 1), st.floats(0.1, 1e6))
def test_one_search_finds_the_nearest_centroid_of_every_width(seed, spread):
    """The shifted single search against a brute-force argmin over each width's centroids."""
    from schemes.lloyd_max import gaussian_codebook
    from schemes.spectralquant_search import nearest_centroids
    gen = np.random.default_rng(seed)
    u = torch.from_numpy(gen.standard_normal((40, 9)) * np.where(gen.random((40, 9)) < 0.1, spread, 1.0))
    widths = torch.arange(9).expand(40, 9)
    u[0] = float("nan")                      # NaN: the top index of each width, never out of range
    idx = nearest_centroids(u, widths).long()
    assert idx[0].tolist() == [0] + [2 ** w - 1 for w in range(1, 9)]
    u, idx = u[1:], idx[1:]
    assert (idx[:, 0] == 0).all()
    for w in range(1, 9):
        centroids = torch.tensor(gaussian_codebook(w, 1.0).centroids, dtype=torch.float64)
        distance = (u[:, w:w + 1] - centroids).abs()
        assert torch.allclose(distance.gather(1, idx[:, w:w + 1]), distance.min(1, keepdim=True).values,
                              rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_lookup_table_equals_a_binary_search_on_every_threshold(dtype):
    """nearest_centroids' table lookup against torch.bucketize over the shifted thresholds (the
    search it replaces), on every threshold of every width, its floating-point neighbours, the
    cell edges around it, random values and the clamp's limits."""
    from schemes.spectralquant_search import CLAMP, SHIFT, all_thresholds, nearest_centroids
    thresholds, first = all_thresholds("cpu")
    values, widths = [], []
    for w in range(1, 9):
        t = (thresholds[first[w]:first[w] + 2 ** w - 1] - SHIFT * w)
        near = torch.cat((t, torch.nextafter(t, t + 1), torch.nextafter(t, t - 1), torch.floor(t * 256) / 256,
                          torch.ceil(t * 256) / 256, torch.tensor([-CLAMP, CLAMP, -1e30, 1e30, 0.0],
                                                                   dtype=torch.float64)))
        if dtype == torch.float32:   # the float32 path: each threshold's float32 rounding and its neighbours
            t32 = t.to(torch.float32)
            near = torch.cat((near, torch.cat((t32, torch.nextafter(t32, t32 + 1), torch.nextafter(t32, t32 - 1))).double()))
        values.append(near)
        widths.append(torch.full_like(near, w, dtype=torch.int64))
    gen = torch.Generator().manual_seed(3)
    rand = torch.randn(4000, generator=gen, dtype=torch.float64) * 2
    values = torch.cat(values + [rand]).to(dtype)
    widths = torch.cat(widths + [torch.randint(0, 9, (4000,), generator=gen)])
    # ±inf, NaN, and values so small that y + SHIFT·w rounds beside the threshold 0 (the search's
    # float64 sum, which the float32 path reproduces)
    tiny = [2.0 ** -44, 2.0 ** -47, 1e-45, 3e-14, 6e-14, 1e-13, 1e-30]
    special = [math.inf, -math.inf, math.nan] + tiny + [-x for x in tiny]
    values = torch.cat((values, torch.tensor(special, dtype=dtype).repeat(8)))
    widths = torch.cat((widths, torch.arange(1, 9).repeat_interleave(len(special))))
    shifted = torch.nan_to_num(values.to(torch.float64), nan=CLAMP).clamp(-CLAMP, CLAMP) + SHIFT * widths
    expected = torch.where(widths > 0, torch.bucketize(shifted, thresholds) - first[widths], 0)
    found = nearest_centroids(values, widths)
    assert found.dtype == torch.uint8 and torch.equal(found.long(), expected)
    # in the codec's layout: widths (B, H, 1, d) broadcast over the tokens
    grid = values[:3960].view(2, 3, 20, 33)
    per_coordinate = torch.randint(0, 9, (2, 3, 1, 33), generator=gen)
    assert torch.equal(nearest_centroids(grid, per_coordinate),
                       nearest_centroids(grid.reshape(-1), per_coordinate.expand(grid.shape).reshape(-1)).view(grid.shape))


@pytest.mark.parametrize("impl", ["torch", "reference"])
def test_sketches_are_drawn_per_trial_index(impl):
    """A trial's sketches depend on its index, not on the batch it is coded in; two trials
    with the same data but other indices get other sketches."""
    make = schemes.create if impl == "torch" else functools.partial(schemes.create, impl="reference")
    data = _draw("spectral_decay", n_trials=2, seq_len=16, dim=32)
    both = make("sq-qkqv", budget=3, dim=32).fit(data["k_cal"], data["v_cal"], trials=torch.tensor([5, 6]))
    enc = both.encode(data["k"], data["v"])
    one = {x: data[x][1:] for x in ("k", "v", "k_cal", "v_cal")}
    alone = make("sq-qkqv", budget=3, dim=32).fit(one["k_cal"], one["v_cal"], trials=torch.tensor([6]))
    enc_alone = alone.encode(one["k"], one["v"])
    for key in ("k.sketch", "v.sketch", "k.sketch_seed"):
        assert torch.equal(enc.codes[key][1:], enc_alone.codes[key])
    moved = make("sq-qkqv", budget=3, dim=32).fit(one["k_cal"], one["v_cal"], trials=torch.tensor([7]))
    assert not torch.equal(moved.encode(one["k"], one["v"]).codes["k.sketch_seed"], enc_alone.codes["k.sketch_seed"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(2, 3, 20, 33), (3, 1, 64, 16), (9, 2, 64, 64)])
def test_the_fused_division_search_and_pack_equal_the_torch_passes(shape, dtype):
    """spectralquant_cpu.codes (the CPU path) gives the codes of nearest_centroids(z / σ) and
    pack_variable's stream, in float32 and float64, on the thresholds' neighbours in the dtype
    (after the division by σ), ±inf, NaN, values beyond the clamp, σ of every scale, tokens not a
    multiple of 8 and a batch large enough to be split across threads."""
    from schemes import spectralquant_cpu
    from schemes.packing import pack_variable
    from schemes.spectralquant_search import CLAMP, SHIFT, all_thresholds, nearest_centroids
    thresholds, first = all_thresholds("cpu")
    t = torch.cat([(thresholds[first[w]:first[w] + 2 ** w - 1] - SHIFT * w) for w in range(1, 9)]).to(dtype)
    edges = torch.cat((t, torch.nextafter(t, t + 1), torch.nextafter(t, t - 1),
                       torch.tensor([math.inf, -math.inf, math.nan, CLAMP, -CLAMP, 1e30, -1e30, 0.0, -0.0, 1e-30],
                                    dtype=dtype)))
    gen = torch.Generator().manual_seed(11)
    y = (torch.randn(shape, generator=gen, dtype=torch.float64) * 2).to(dtype)
    y.view(-1)[:edges.numel()] = edges[:y.numel()]
    sigma = (10.0 ** (torch.rand(shape[0], shape[1], shape[3], generator=gen, dtype=torch.float64) * 8 - 4)).to(
        torch.float32)
    sigma[0] = 1.0                                  # trial 0 (where the edges lie) divided by 1: kept as they are
    z = y * sigma.to(dtype).unsqueeze(-2)           # z / σ lands on (or, rounded, beside) the edges
    widths = torch.randint(0, 9, (shape[0], shape[1], shape[3]), generator=gen)
    codes, stream = spectralquant_cpu.codes(z, sigma, widths)
    expected = nearest_centroids(z / sigma.to(dtype).unsqueeze(-2), widths.unsqueeze(-2))
    assert codes.dtype == torch.uint8 and torch.equal(codes, expected)
    assert torch.equal(stream, pack_variable(expected, widths))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("codes_dtype", [torch.uint8, torch.int64])
def test_the_compiled_dequantise_equals_the_torch_passes(dtype, codes_dtype, monkeypatch):
    """SpectralQuant's ẑ by spectralquant_cpu.dequantise_variable (the CPU path) equals the gather and
    product of its torch passes, for remembered uint8 and unpacked int64 codes of every width 0–8,
    on a batch large enough to be split across threads."""
    from kvcommon import compiled
    from schemes.lloyd_max import gaussian_codebook
    gen = torch.Generator().manual_seed(12)
    b, h, s_, d = 9, 2, 64, 64
    widths = torch.randint(0, 9, (b, h, d), generator=gen)
    idx = (torch.rand(b, h, s_, d, generator=gen) * (2 ** widths.unsqueeze(-2))).to(torch.int64).to(codes_dtype)
    sigma = (torch.rand(b, h, 1, d, generator=gen, dtype=torch.float64) * 3).to(dtype)
    enc = Encoded((b, h, s_, d), dtype)
    for w in range(1, 9):
        enc.side[f"codebook.{w}bit"] = torch.tensor(gaussian_codebook(w, 1.0).centroids, dtype=torch.float32)
    fast = SpectralQuant._dequantise(enc, idx.clone(), widths, sigma, dtype)
    monkeypatch.setattr(compiled, "DTYPES", ())
    slow = SpectralQuant._dequantise(enc, idx.clone(), widths, sigma, dtype)
    assert fast.dtype == dtype and torch.equal(fast, slow)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", ["sq-kv", "sq-qkv", "squ-kqv"])
def test_the_fused_passes_store_and_decode_the_torch_passes_bits(name, dtype, monkeypatch):
    """A cache coded with the fused CPU passes (spectralquant_cpu) and with the torch passes
    (spectralquant_cpu.FUSED_DTYPES emptied) stores the same codes, stream, norms and sketches and
    decodes to the same bits, at every budget the sweep runs, with a zero row and a row of NaN."""
    from schemes import spectralquant_cpu
    data = _draw("spectral_decay", n_trials=3, seq_len=24, dim=32)
    k, v = data["k"].to(dtype), data["v"].to(dtype)
    k[0, 0, 0] = 0
    v[1, 0, 3, 5] = math.nan
    for budget in (2, 3, 4):
        scheme = schemes.create(name, budget=budget, dim=32).fit(data["k_cal"].to(dtype), data["v_cal"].to(dtype))
        fused = scheme.encode(k, v)
        fused_out = scheme.decode(fused)
        with monkeypatch.context() as m:
            m.setattr(spectralquant_cpu, "FUSED_DTYPES", ())
            plain = scheme.encode(k.clone(), v.clone())      # fresh tensors: nothing remembered from the fused run
            plain_out = scheme.decode(plain)
        assert fused.codes.keys() == plain.codes.keys()
        for key in fused.codes:                              # NaN (v's norm, its decoded row) as 7
            assert torch.equal(fused.codes[key].nan_to_num(7.0), plain.codes[key].nan_to_num(7.0)), key
        for a, b in zip(fused_out, plain_out):
            assert a.dtype == dtype and torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(2, 3, 40, 33), (9, 2, 64, 128), (1, 1, 7, 16)])
def test_the_fused_unit_rows_equal_the_torch_passes(shape, dtype):
    """spectralquant_cpu.unit_rows gives schemes/unit_rows.py's unit rows and norms bit for bit, on
    rows of scales 1e-20..1e20, a zero row, a row holding NaN, one holding +inf, a constant row,
    a row of one huge entry, subnormal entries, row lengths off the vector width, and a batch
    large enough to be split across threads."""
    from schemes import spectralquant_cpu
    from schemes.unit_rows import unit_rows
    x = _cache(shape, dtype, 13)
    assert spectralquant_cpu.unit_rows_take(x)
    u, norms = spectralquant_cpu.unit_rows(x)
    want_u, want_norms = unit_rows(x.clone())
    assert _same(u, want_u) and _same(norms, want_norms)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(2, 3, 21, 33), (9, 2, 64, 64)])
def test_the_fused_stream_decode_equals_unpacking_and_the_lookup(shape, dtype):
    """spectralquant_cpu.dequantised_stream reads the codes unpack_variable reads (widths 0–8,
    tokens not a multiple of 8, trials of unequal stream lengths, a batch split across threads)
    and gives the lookup and product of SpectralQuant's torch passes."""
    from schemes import spectralquant_cpu
    from schemes.lloyd_max import gaussian_codebook
    gen = torch.Generator().manual_seed(14)
    b, h, s_, d = shape
    widths = torch.randint(0, 9, (b, h, d), generator=gen)
    idx = (torch.rand(b, h, s_, d, generator=gen) * (2 ** widths.unsqueeze(-2))).to(torch.int64)
    stream = pack_variable(idx, widths)
    assert torch.equal(unpack_variable(stream, widths, s_), idx)
    sigma = (torch.rand(b, h, 1, d, generator=gen, dtype=torch.float64) * 3).to(dtype)
    enc = Encoded((b, h, s_, d), dtype)
    for w in range(1, 9):
        enc.side[f"codebook.{w}bit"] = torch.tensor(gaussian_codebook(w, 1.0).centroids, dtype=torch.float32)
    values, offsets = SpectralQuant._codebook_table(enc, dtype, "cpu")
    fused = spectralquant_cpu.dequantised_stream(stream, widths, s_, offsets, values, sigma)
    expected = values[(offsets[widths].unsqueeze(-2) + idx).to(torch.int64)] * sigma
    assert fused.dtype == dtype and torch.equal(fused, expected)


@pytest.mark.parametrize("name", ["sq-kv", "sq-qkv"])
def test_a_stream_coded_elsewhere_decodes_to_the_same_bits(name, monkeypatch):
    """Decoding a copy of the stored codes (not remembered from encode: read back from the stream
    by the fused pass) gives the decode of the original, and that of the torch passes."""
    from schemes import spectralquant_cpu
    data = _draw("spectral_decay", n_trials=3, seq_len=20, dim=32)
    scheme = schemes.create(name, budget=3, dim=32).fit(data["k_cal"], data["v_cal"])
    enc = scheme.encode(data["k"], data["v"])
    warm = scheme.decode(enc)
    copy = Encoded(enc.shape, enc.dtype)
    copy.codes = {key: t.clone() for key, t in enc.codes.items()}
    copy.side = dict(enc.side)
    cold = scheme.decode(copy)
    monkeypatch.setattr(spectralquant_cpu, "FUSED_DTYPES", ())
    copy.codes = {key: t.clone() for key, t in enc.codes.items()}
    plain = scheme.decode(copy)
    for a, b, c in zip(warm, cold, plain):
        assert torch.equal(a, b) and torch.equal(a, c)
