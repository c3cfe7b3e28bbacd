"""Each scenario demonstrably does what it claims (DESIGN.md, Scenarios)."""
import numpy as np
import pytest

import scenarios
from scenarios.base import TrialShape, participation_ratio, power_law
from kvcommon.rng import generator

SHAPE = TrialShape(n_heads=1, seq_len=2048, n_queries=256, dim=64, n_calib=512)


def draw(name, seed=0, shape=SHAPE, **params):
    scenario = scenarios.create(name, **params)
    return scenario.draw(lambda *labels: generator("pcg64", seed, name, *labels), shape)


def top_subspace(x, r):
    """Top-r eigenvectors of the sample second moment of x (n, d)."""
    w, u = np.linalg.eigh(x.T @ x / len(x))
    return u[:, ::-1][:, :r]


def subspace_cosines(a, b):
    return np.linalg.svd(a.T @ b, compute_uv=False)


@pytest.mark.parametrize("name", scenarios.available())
def test_shapes_energy_and_independent_queries(name):
    out = draw(name)
    assert out["k"].shape == (1, 2048, 64) and out["q"].shape == (1, 256, 64)
    assert out["k_cal"].shape == (1, 512, 64)
    assert np.mean(np.sum(out["k"] ** 2, -1)) == pytest.approx(64, rel=0.15)   # E‖k‖² ≈ d
    assert not np.allclose(out["k"][0, :512], out["k_cal"][0])                 # separate calibration draw
    logits = out["q"][0] @ out["k"][0].T / 8
    # temperature 0.5: logit standard deviation ≈ 2, attention neither uniform nor one-hot
    assert np.std(logits) == pytest.approx(2.0, rel=0.2)
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    # heavy tails: outlier tokens of huge norm capture most queries' attention, by design
    assert 0.005 < p.max(1).mean() < (0.8 if name == "heavy_tail" else 0.5)
    corr = np.corrcoef(out["q"][0].ravel(), out["k"][0, :256].ravel())[0, 1]
    assert abs(corr) < 0.05                                                      # never Q = K


def test_same_seed_same_data_and_different_seed_differs():
    a, b, c = draw("gaussian", 1), draw("gaussian", 1), draw("gaussian", 2)
    assert np.array_equal(a["k"], b["k"]) and not np.array_equal(a["k"], c["k"])


def test_lowrank_aligned_shares_and_misaligned_separates_subspaces():
    r = 8
    aligned, misaligned = draw("lowrank_aligned"), draw("lowrank_misaligned")
    cos_a = subspace_cosines(top_subspace(aligned["k"][0], r), top_subspace(aligned["v"][0], r))
    cos_m = subspace_cosines(top_subspace(misaligned["k"][0], r), top_subspace(misaligned["v"][0], r))
    assert cos_a.min() > 0.99          # one shared subspace
    assert cos_m.max() < 0.1           # orthogonal subspaces
    # the rank-r signal carries all but the noise share of the energy
    w = np.linalg.eigvalsh(aligned["k"][0].T @ aligned["k"][0] / 2048)[::-1]
    assert w[:r].sum() / w.sum() > 0.98 and w[r] < 0.05 * w[r - 1]


@pytest.mark.parametrize("alpha", [0.5, 1.0, 2.0])
def test_spectral_decay_alpha_moves_d_eff_as_predicted(alpha):
    predicted = participation_ratio(power_law(64, alpha))
    out = draw("spectral_decay", shape=TrialShape(1, 8192, 1, 64, 8), alpha=alpha)
    measured = participation_ratio(np.linalg.eigvalsh(out["k"][0].T @ out["k"][0] / 8192))
    assert measured == pytest.approx(predicted, rel=0.1)


def test_heavy_tail_has_heavy_tails():
    kurt = lambda x: np.mean(x ** 4) / np.mean(x ** 2) ** 2  # noqa: E731
    heavy, gauss = draw("heavy_tail")["k"][0].ravel(), draw("gaussian")["k"][0].ravel()
    assert kurt(gauss) == pytest.approx(3, abs=0.2)   # Gaussian kurtosis
    assert kurt(heavy) > 5                             # Student-t(3) mixtures: infinite population kurtosis


def test_heavy_tail_destabilises_calibration():
    """Leading calibrated eigenvectors stray from the population far more than for Gaussian
    data with the same covariance (the AMD paper's A1)."""
    heavy = scenarios.create("heavy_tail")
    gauss_same_cov = scenarios.create("spectral_decay", alpha=heavy.alpha)
    errors = {"heavy": [], "gauss": []}
    shape = TrialShape(1, 1, 1, 64, 512)
    for seed in range(20):
        for key, scen in (("heavy", heavy), ("gauss", gauss_same_cov)):
            streams = lambda *labels, seed=seed: generator("pcg64", seed, "cal", *labels)  # noqa: E731
            pop = scen.population(streams("population", 0), 64)
            cal = scen.draw(streams, shape)["k_cal"][0]
            true_top = np.linalg.eigh(pop.cov_k)[1][:, ::-1][:, :4]
            errors[key].append(1 - subspace_cosines(true_top, top_subspace(cal, 4)).min())
    assert np.median(errors["heavy"]) > 3 * np.median(errors["gauss"])


def test_outlier_channels_are_few_and_large():
    k = draw("outlier_channels")["k"][0]
    std = k.std(0)
    big = np.sort(std)[::-1]
    assert big[3] > 5 * big[4]          # four outlier channels
    assert np.allclose(draw("outlier_channels")["v"][0].std(0), 1, atol=0.1)


def test_bad_parameters_are_clear_errors():
    with pytest.raises(ValueError, match="unknown scenario 'nope'; available: gaussian"):
        scenarios.create("nope")
    with pytest.raises(ValueError, match="unknown parameter"):
        scenarios.create("gaussian", rank=3)
    with pytest.raises(ValueError, match="must be positive"):
        scenarios.create("spectral_decay", alpha=-1.0)


def test_importing_scenarios_loads_no_codec():
    """The data stage stands before the codecs: `import scenarios` (and `kvcommon`, which both
    share) must not import the `schemes` package, whose import registers every codec."""
    import subprocess
    import sys
    code = ("import sys, scenarios, kvcommon.rng, kvcommon.rope, kvcommon.registry, kvcommon.threads; "
            "loaded = sorted(m for m in sys.modules if m == 'schemes' or m.startswith('schemes.')); "
            "print(loaded); sys.exit(1 if loaded else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"import scenarios loaded codec modules: {done.stdout}{done.stderr}"
