"""Paired tests: stats/energy.py's sign-flip energy test against brute-force enumeration of the
sign flips and its type-I error, and stats/inference.py's Wilcoxon signed-rank helper against
scipy column by column."""
import itertools

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from stats.energy import energy_distance_squared, paired_energy_test
from stats.inference import wilcoxon_signed_rank
from uniformity import assert_uniform_pvalues


pytestmark = pytest.mark.usefixtures("one_torch_thread")   # tests/conftest.py


def brute_force(x, y, signs, statistic):
    """The statistic of the swapped (pairs) or sign-flipped (differences) samples with explicit
    double loops (stats/energy.py module doc)."""
    def mean_dist(a, b):
        return np.mean([np.linalg.norm(p - q) for p, q in itertools.product(a, b)])
    if statistic == "pairs":
        xs = np.where(signs[:, None] > 0, x, y)
        ys = np.where(signs[:, None] > 0, y, x)
        return 2 * mean_dist(xs, ys) - mean_dist(xs, xs) - mean_dist(ys, ys)
    d = signs[:, None] * (x - y)
    return 2 * mean_dist(d, -d) - mean_dist(d, d) - mean_dist(-d, -d)


@pytest.mark.parametrize("statistic", ["pairs", "differences"])
def test_statistic_matches_brute_force(statistic):
    gen = np.random.default_rng(5)
    x = gen.normal(size=(7, 3))
    y = x + gen.normal(0.4, 1.0, size=(7, 3))
    observed = paired_energy_test(x, y, 10, statistic=statistic).statistic
    assert observed == pytest.approx(brute_force(x, y, np.ones(7), statistic), rel=1e-12)
    # the identities of the module doc: E(x, y) itself, and E(D, −D)
    reference = energy_distance_squared(x, y) if statistic == "pairs" else energy_distance_squared(x - y, y - x)
    assert observed == pytest.approx(reference, rel=1e-12)


@pytest.mark.parametrize("statistic", ["pairs", "differences"])
def test_pvalue_matches_the_enumerated_sign_flips(statistic):
    # n = 8: all 256 sign vectors by brute force give the exact permutation p-value; the
    # Monte Carlo p-value with P random flips has standard error sqrt(p(1 − p)/P)
    gen = np.random.default_rng(6)
    x = gen.normal(size=(8, 2))
    y = x + gen.normal(0.5, 1.0, size=(8, 2)) * np.array([1.0, 2.0])
    observed = brute_force(x, y, np.ones(8), statistic)
    replicates = np.array([brute_force(x, y, np.array(s), statistic)
                           for s in itertools.product([1.0, -1.0], repeat=8)])
    exact = np.mean(replicates >= observed - 1e-12)
    n_perm = 4000
    r = paired_energy_test(x, y, n_perm, seed=1, statistic=statistic)
    assert 0.05 < exact < 0.95  # a p-value the check can see move
    assert abs(r.p_value - exact) <= 4 * np.sqrt(exact * (1 - exact) / n_perm) + 1 / n_perm
    assert r.test == f"sign-flip {statistic}" and r.n_x == r.n_y == 8
    assert paired_energy_test(x, y, n_perm, seed=1, statistic=statistic) == r  # seeded


@pytest.mark.parametrize("statistic", ["pairs", "differences"])
def test_type_one_error_under_exchangeable_pairs(statistic):
    # pairs sharing a per-trial component (correlation 0.7), exchangeable within each pair:
    # the p-value is uniform, so P(p ≤ alpha) = alpha within 3.5 binomial standard errors
    gen = np.random.default_rng(23)
    n_reps, n_perm = 600, 199
    p = []
    for r in range(n_reps):
        shared = gen.normal(size=(20, 6))
        x = np.sqrt(0.7) * shared + np.sqrt(0.3) * gen.normal(size=(20, 6))
        y = np.sqrt(0.7) * shared + np.sqrt(0.3) * gen.normal(size=(20, 6))
        p.append(paired_energy_test(x, y, n_perm, seed=r, statistic=statistic).p_value)
    assert_uniform_pvalues(np.array(p), n_perm)


def test_pairs_sees_a_change_of_spread_that_differences_cannot():
    # x = shared + noise, y = shared + 5 × noise: the same centre, twice the spread. The
    # differences x − y are symmetric about 0, so E(D, −D) has nothing to see; the swapped
    # two-sample statistic sees the spread. A shift is seen by both.
    gen = np.random.default_rng(24)
    shared = gen.normal(size=(60, 6))
    x = 0.5 * shared + 0.2 * gen.normal(size=(60, 6))
    y = 0.5 * shared + 1.0 * gen.normal(size=(60, 6))
    assert paired_energy_test(x, y, 499, seed=2, statistic="pairs").p_value == 1 / 500
    assert paired_energy_test(x, y, 499, seed=2, statistic="differences").p_value > 0.05
    for statistic in ("pairs", "differences"):
        assert paired_energy_test(x, x + 0.3, 499, seed=2, statistic=statistic).p_value == 1 / 500
    same = paired_energy_test(x, x.copy(), 99)
    assert same.statistic == pytest.approx(0, abs=1e-12) and same.p_value == 1.0


def test_paired_energy_input_errors():
    with pytest.raises(ValueError, match="equal shapes"):
        paired_energy_test(np.zeros((3, 2)), np.zeros((4, 2)))
    with pytest.raises(ValueError, match="valid: pairs, differences"):
        paired_energy_test(np.zeros((3, 2)), np.zeros((3, 2)), statistic="ranks")
    with pytest.raises(ValueError, match="n_permutations"):
        paired_energy_test(np.zeros(3), np.zeros(3), 0)
    with pytest.raises(ValueError, match="finite"):
        paired_energy_test(np.array([0.0, np.nan]), np.zeros(2))


def test_wilcoxon_matches_scipy_per_column():
    gen = np.random.default_rng(7)
    a = pd.DataFrame(gen.normal(size=(30, 4)), columns=list("abcd"))
    b = a + gen.normal(0.3, 1.0, size=(30, 4))
    b["c"] = a["c"]                     # identical: every difference zero
    b.loc[3, "d"] = a.loc[3, "d"]       # one zero difference (dropped, as scipy's 'wilcox')
    a.loc[5, "b"] = np.nan              # one missing pair
    table = wilcoxon_signed_rank(a, b).set_index("metric")
    for m in "abd":
        d = (a[m] - b[m]).dropna().to_numpy()
        expected = stats.wilcoxon(d, zero_method="wilcox")
        assert table.at[m, "p_value"] == pytest.approx(expected.pvalue, rel=1e-12)
        assert table.at[m, "statistic"] == pytest.approx(expected.statistic)
    assert table.at["c", "p_value"] == 1.0 and table.at["c", "statistic"] == 0.0
    assert table.at["b", "n_a"] == 29 and (table["test"] == "wilcoxon").all()
    with pytest.raises(ValueError, match="equal lengths"):
        wilcoxon_signed_rank(a, b.iloc[:-1])
