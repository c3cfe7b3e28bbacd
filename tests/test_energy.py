"""stats/energy.py: the squared energy distance against scipy (1-D, where scipy returns the
square root) and a brute-force double loop (6-D); the permutation p-value is uniform under
the null and small under a shift."""
import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from scipy.stats import energy_distance as scipy_energy_distance

from stats.energy import energy_distance_squared, energy_test
from uniformity import assert_uniform_pvalues



pytestmark = pytest.mark.usefixtures("one_torch_thread")   # tests/conftest.py


finite = st.floats(-100, 100, allow_nan=False, width=64)


@given(arrays(np.float64, st.integers(1, 25), elements=finite), arrays(np.float64, st.integers(1, 25), elements=finite))
def test_one_dimensional_statistic_is_scipys_squared(u, v):
    # scipy.stats.energy_distance(u, v) = sqrt(2E|U−V| − E|U−U'| − E|V−V'|): ours is its square
    expected = scipy_energy_distance(u, v) ** 2
    assert energy_distance_squared(u, v) == pytest.approx(expected, rel=1e-9, abs=1e-9)
    assert energy_test(u, v, n_permutations=5).statistic == pytest.approx(expected, rel=1e-9, abs=1e-9)


def brute_force(x, y):
    """The V-statistic of the module doc with explicit double loops."""
    def mean_dist(a, b):
        return np.mean([np.sqrt(np.sum((p - q) ** 2)) for p, q in itertools.product(a, b)])
    return 2 * mean_dist(x, y) - mean_dist(x, x) - mean_dist(y, y)


def test_six_dimensional_statistic_matches_a_double_loop():
    gen = np.random.default_rng(2)
    x, y = gen.normal(size=(13, 6)), gen.standard_t(3, size=(17, 6)) + 0.2
    expected = brute_force(x, y)
    assert energy_distance_squared(x, y) == pytest.approx(expected, rel=1e-12)
    assert energy_test(x, y, n_permutations=10).statistic == pytest.approx(expected, rel=1e-12)
    scale = np.concatenate([x, y]).std(axis=0)
    assert energy_test(x, y, 10, standardize=True).statistic == pytest.approx(brute_force(x / scale, y / scale),
                                                                              rel=1e-12)


def test_permutation_pvalue_is_uniform_under_the_null():
    gen = np.random.default_rng(21)
    n_reps, n_perm = 600, 199
    p = np.array([energy_test(gen.normal(size=(20, 6)), gen.normal(size=(20, 6)), n_perm, seed=r).p_value
                  for r in range(n_reps)])
    assert_uniform_pvalues(p, n_perm)


def test_permutation_pvalue_is_small_under_a_shift_and_seeded():
    gen = np.random.default_rng(22)
    x, y = gen.normal(size=(50, 6)), gen.normal(size=(50, 6)) + 0.8
    r = energy_test(x, y, n_permutations=499, seed=3)
    assert r.p_value == 1 / 500 and r.statistic > r.critical
    assert energy_test(x, y, 499, seed=3) == r
    same = energy_test(x, x.copy(), 99)
    assert same.statistic == pytest.approx(0, abs=1e-12) and same.p_value == 1.0
    # scale invariance of the standardised statistic
    assert energy_test(3 * x, 3 * y, 99, standardize=True).statistic == pytest.approx(
        energy_test(x, y, 99, standardize=True).statistic, rel=1e-10)


def test_energy_input_errors():
    with pytest.raises(ValueError, match="dimensions"):
        energy_test(np.zeros((3, 2)), np.zeros((3, 3)))
    with pytest.raises(ValueError, match="finite"):
        energy_test(np.array([0.0, np.nan]), np.zeros(2))
    with pytest.raises(ValueError, match="n_permutations"):
        energy_test(np.zeros(3), np.zeros(3), 0)
