"""stats/inference.py: calibration and power of the rank tests, Holm/BH against hand-computed
values and the step-wise procedures, bootstrap coverage, Cliff's δ against pair counting and
TOST against shifted one-sided Welch tests (scipy)."""
import numpy as np
import pandas as pd
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from scipy import stats as sps

from stats.inference import (benjamini_hochberg, bootstrap_ci, cliffs_delta, holm, ks_critical_value, ks_tests,
                             mann_whitney, tost)

N_REPS = 400


def binomial_band(n: int, p: float, z: float = 3.5) -> tuple[float, float]:
    """Rejection-rate band: p ± z·sqrt(p(1-p)/n) (z = 3.5 keeps a flaky-test rate below 1e-3)."""
    half = z * np.sqrt(p * (1 - p) / n)
    return p - half, p + half


def null_frames(gen, n_a=30, n_b=25, shift=0.0):
    """N_REPS independent sample pairs as the columns ('metrics') of two frames."""
    cols = [f"m{i}" for i in range(N_REPS)]
    a = pd.DataFrame(gen.normal(size=(n_a, N_REPS)), columns=cols)
    b = pd.DataFrame(gen.normal(size=(n_b, N_REPS)) + shift, columns=cols)
    return a, b


@pytest.mark.parametrize("test", [ks_tests, mann_whitney])
def test_rank_tests_are_calibrated_under_the_null(test):
    a, b = null_frames(np.random.default_rng(11))
    p = test(a, b)["p_value"].to_numpy()
    assert len(p) == N_REPS and np.all((p >= 0) & (p <= 1))
    for alpha in (0.05, 0.10):
        low, high = binomial_band(N_REPS, alpha)
        rate = np.mean(p <= alpha)
        # the exact KS distribution is discrete and so slightly conservative: allow below the band
        assert rate <= high, (alpha, rate)
        assert rate >= (low if test is mann_whitney else low / 2), (alpha, rate)


@pytest.mark.parametrize("test", [ks_tests, mann_whitney])
def test_rank_tests_detect_a_known_shift(test):
    a, b = null_frames(np.random.default_rng(12), shift=1.0)
    power = np.mean(test(a, b)["p_value"].to_numpy() <= 0.05)
    assert power > 0.8  # theory: KS power ≈ 0.9, MW ≈ 0.97 for a 1-sd shift, n = 30/25


def test_ks_tests_match_scipy_and_drop_nans():
    gen = np.random.default_rng(3)
    a = pd.DataFrame({"x": gen.normal(size=20), "y": gen.exponential(size=20)})
    b = pd.DataFrame({"x": gen.normal(size=15) + 0.5, "y": gen.exponential(size=15)})
    a.loc[3, "x"] = np.nan
    out = ks_tests(a, b).set_index("metric")
    ref = sps.ks_2samp(a["x"].dropna(), b["x"])
    assert out.at["x", "statistic"] == pytest.approx(ref.statistic)
    assert out.at["x", "p_value"] == pytest.approx(ref.pvalue)
    assert out.at["x", "n_a"] == 19 and out.at["y", "n_a"] == 20
    with pytest.raises(ValueError, match="missing"):
        ks_tests(a, b, ["z"])


def test_ks_critical_value_is_the_rejection_threshold():
    # two samples at KS distance just above/below the critical value: scipy's asymptotic p-value
    # crosses alpha there (exactly, since both use the Kolmogorov limit distribution)
    n_a, n_b, alpha = 200, 150, 0.01
    c = ks_critical_value(n_a, n_b, alpha)
    en = np.sqrt(n_a * n_b / (n_a + n_b))
    assert sps.kstwobign.sf(c * en) == pytest.approx(alpha)


def test_holm_and_bh_hand_computed():
    p = [0.01, 0.04, 0.03, 0.005]
    # Holm: sorted 0.005, 0.01, 0.03, 0.04 -> 4·0.005, 3·0.01, 2·0.03, 1·0.04 = .02 .03 .06 .04,
    # running maximum .02 .03 .06 .06
    np.testing.assert_allclose(holm(p), [0.03, 0.06, 0.06, 0.02])
    # BH: 4p/rank = .02 .02 .04 .04, running minimum from the top: unchanged
    np.testing.assert_allclose(benjamini_hochberg(p), [0.02, 0.04, 0.04, 0.02])
    np.testing.assert_allclose(holm([0.5, np.nan, 0.01]), [0.5, np.nan, 0.02])
    with pytest.raises(ValueError):
        holm([1.5])


def holm_brute(p, alpha):
    """Holm's step-down procedure as written: reject p_(1), p_(2), ... while p_(i) ≤ α/(m−i+1)."""
    order = np.argsort(p, kind="stable")
    reject = np.zeros(len(p), bool)
    for i, j in enumerate(order):
        if p[j] > alpha / (len(p) - i):
            break
        reject[j] = True
    return reject


def bh_brute(p, alpha):
    """BH step-up: the largest k with p_(k) ≤ kα/m; reject the k smallest."""
    m = len(p)
    order = np.argsort(p, kind="stable")
    ks = [k for k in range(1, m + 1) if p[order[k - 1]] <= k * alpha / m]
    reject = np.zeros(m, bool)
    if ks:
        reject[order[:max(ks)]] = True
    return reject


@given(st.lists(st.floats(0, 1), min_size=1, max_size=12), st.sampled_from([0.01, 0.05, 0.1, 0.3]))
def test_adjusted_pvalues_reproduce_the_stepwise_procedures(pvalues, alpha):
    p = np.array(pvalues)
    # a p-value on a step's boundary (p = k·alpha/m, or alpha/(m − k + 1)) is decided by the last bit
    # of a product that is equal in exact arithmetic (0.05·6/3 = 0.1 + 2e-17): not a property of
    # either procedure
    m = len(p)
    steps = np.r_[np.arange(1, m + 1) * alpha / m, alpha / np.arange(1, m + 1)]
    assume(not np.any(np.isclose(p[:, None], steps[None, :], rtol=1e-9, atol=0) & (p[:, None] > 0)))
    np.testing.assert_array_equal(holm(p) <= alpha, holm_brute(p, alpha))
    np.testing.assert_array_equal(benjamini_hochberg(p) <= alpha, bh_brute(p, alpha))
    assert np.all(holm(p) >= p) and np.all(benjamini_hochberg(p) <= holm(p) + 1e-15)


@pytest.mark.parametrize("statistic,truth", [("mean", 0.0), ("median", 0.0)])
def test_bootstrap_coverage_is_near_nominal(statistic, truth):
    gen = np.random.default_rng(5)
    n_reps, level = 200, 0.9
    covered = 0
    for r in range(n_reps):
        low, high = bootstrap_ci(gen.normal(size=40), statistic, level=level, n_boot=400, seed=r)
        covered += low <= truth <= high
    lo, hi = binomial_band(n_reps, level)
    # the percentile bootstrap under-covers slightly at n = 40 (≈ 0.88 for the mean)
    assert lo - 0.03 <= covered / n_reps <= hi


def test_bootstrap_is_seeded_and_validates():
    x = np.random.default_rng(0).normal(size=50)
    assert bootstrap_ci(x, seed=4) == bootstrap_ci(x, seed=4)
    assert bootstrap_ci(x, seed=np.random.default_rng(1)) == bootstrap_ci(x, seed=np.random.default_rng(1))
    assert bootstrap_ci(x, seed=4) != bootstrap_ci(x, seed=5)
    low, high = bootstrap_ci(x)
    assert low < x.mean() < high
    with pytest.raises(ValueError, match="valid: mean, median"):
        bootstrap_ci(x, "mode")
    assert np.isnan(bootstrap_ci([np.nan])[0])


@given(st.lists(st.integers(-5, 5), min_size=1, max_size=30), st.lists(st.integers(-5, 5), min_size=1, max_size=30))
def test_cliffs_delta_matches_pair_counting(a, b):
    x, y = np.array(a, float), np.array(b, float)
    brute = np.sign(x[:, None] - y[None, :]).mean()
    assert cliffs_delta(x, y) == pytest.approx(brute, abs=1e-12)
    assert cliffs_delta(y, x) == pytest.approx(-brute, abs=1e-12)


def test_tost_matches_shifted_one_sided_welch_tests():
    gen = np.random.default_rng(8)
    a, b, margin = gen.normal(0.1, 1, 60), gen.normal(0, 1.5, 45), 0.5
    result = tost(a, b, margin)
    # H0: Δ ≤ −δ  ⇔  mean(a + δ) ≤ mean(b); H0: Δ ≥ δ  ⇔  mean(a − δ) ≥ mean(b)
    lower = sps.ttest_ind(a + margin, b, equal_var=False, alternative="greater").pvalue
    upper = sps.ttest_ind(a - margin, b, equal_var=False, alternative="less").pvalue
    assert result.p_lower == pytest.approx(lower) and result.p_upper == pytest.approx(upper)
    assert result.p_value == pytest.approx(max(lower, upper))
    paired = tost(a[:45], b, margin, paired=True)
    d = a[:45] - b
    assert paired.p_lower == pytest.approx(sps.ttest_1samp(d + margin, 0, alternative="greater").pvalue)
    assert paired.p_upper == pytest.approx(sps.ttest_1samp(d - margin, 0, alternative="less").pvalue)
    assert set(result.to_row()) >= {"difference", "margin", "p_value", "equivalent"}
    with pytest.raises(ValueError, match="margin"):
        tost(a, b, 0)


def test_tost_size_at_the_margin_and_power_inside():
    gen = np.random.default_rng(9)
    margin, n = 0.3, 40
    at_margin = [tost(gen.normal(margin, 1, n), gen.normal(0, 1, n), margin).equivalent for _ in range(300)]
    assert np.mean(at_margin) <= binomial_band(300, 0.05)[1]  # size ≤ α at the boundary of H0
    inside = [tost(gen.normal(0, 0.2, n), gen.normal(0, 0.2, n), margin).equivalent for _ in range(100)]
    assert np.mean(inside) > 0.95
    assert tost(np.ones(5), np.ones(5), 0.1).equivalent and not tost(np.ones(5), np.zeros(5), 0.1).equivalent
