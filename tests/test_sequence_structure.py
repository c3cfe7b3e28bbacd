"""stats/sequence_structure.py: each statistic against a brute-force loop or a closed form on a small
constructed case, and the cost at S = 2048, Nq = 256."""
import math
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from stats.sequence_structure import (attention_weights, distance_bins, distance_profile, heavy_share,
                                      lag1_correlation, logit_statistics, mean_cosine, recency_ratio, sink_share,
                                      structure_statistics, uniform_weights, visible)


def brute_attention(q, k, qpos, kpos):
    """softmax over the keys each query sees, one query and one key at a time."""
    out = np.zeros((len(q), len(k)))
    for i in range(len(q)):
        logits = {j: sum(q[i, c] * k[j, c] for c in range(q.shape[1])) / math.sqrt(q.shape[1])
                  for j in range(len(k)) if kpos[j] <= qpos[i]}
        top = max(logits.values())
        total = sum(math.exp(x - top) for x in logits.values())
        for j, x in logits.items():
            out[i, j] = math.exp(x - top) / total
    return out


def brute_per_key(weights, qpos, kpos, n_excluded):
    """[(query, [(distance, n_i·A'_ij) for each key it sees after the first n_excluded])]."""
    rows = []
    for i in range(len(qpos)):
        seen = [j for j in range(len(kpos)) if kpos[j] <= qpos[i] and j >= n_excluded]
        mass = sum(weights[i, j] for j in seen)
        if seen and mass > 0:
            rows.append([(qpos[i] - kpos[j], len(seen) * weights[i, j] / mass) for j in seen])
    return rows


def random_case(seed, n_q=5, n_k=12, d=4, causal=True):
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((n_q, d)) * 2, rng.standard_normal((n_k, d))
    kpos = np.arange(n_k)
    qpos = rng.integers(0, n_k, n_q) if causal else np.arange(n_k, n_k + n_q)
    return q, k, qpos, kpos


@pytest.mark.parametrize("causal", [True, False])
def test_attention_matches_a_loop_and_is_causal(causal):
    q, k, qpos, kpos = random_case(1, causal=causal)
    weights = attention_weights(q, k, qpos, kpos)
    np.testing.assert_allclose(weights, brute_attention(q, k, qpos, kpos), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(weights.sum(1), 1.0)
    assert (weights[~visible(qpos, kpos)] == 0).all()


def test_a_query_that_sees_no_key_is_refused():
    with pytest.raises(ValueError, match="query 0 at position 2 sees no key"):
        attention_weights(np.ones((1, 4)), np.ones((3, 4)), np.array([2]), np.array([5, 6, 7]))


def test_sink_share_of_a_built_attention_is_the_closed_form():
    """Sink keys with logit L, the others 0: each query puts n·e^L/(n·e^L + S − n) on the sinks."""
    s, n, d, logit = 40, 3, 4, 2.5
    k = np.zeros((s, d))
    k[:n, 0] = logit * math.sqrt(d) / 2
    q = np.zeros((6, d))
    q[:, 0] = 2.0
    weights = attention_weights(q, k, np.arange(s, s + 6), np.arange(s))
    expected = n * math.exp(logit) / (n * math.exp(logit) + s - n)
    assert sink_share(weights, n) == pytest.approx(expected, rel=1e-12)
    assert sink_share(uniform_weights(np.arange(s, s + 6), np.arange(s)), n) == pytest.approx(n / s)
    # a causal query at position 1 sees keys 0 and 1 only, both sinks
    assert sink_share(uniform_weights(np.array([1, 39]), np.arange(s)), n) == pytest.approx((1 + n / s) / 2)


def test_distance_bins_are_powers_of_two():
    assert distance_bins(np.array([0, 1, 2, 3, 4, 7, 8, 1023, 1024])).tolist() == [0, 1, 2, 2, 3, 3, 4, 10, 11]


@pytest.mark.parametrize("seed, causal, n_excluded", [(2, True, 0), (3, True, 2), (4, False, 3)])
def test_distance_profile_and_recency_ratio_match_loops(seed, causal, n_excluded):
    q, k, qpos, kpos = random_case(seed, n_q=7, n_k=20, causal=causal)
    weights = attention_weights(q, k, qpos, kpos)
    rows = brute_per_key(weights, qpos, kpos, n_excluded)
    profile = distance_profile(weights, qpos, kpos, n_excluded=n_excluded)
    for b, start in enumerate(profile.starts):
        end = 1 if start == 0 else 2 * start
        values = [x for row in rows for dist, x in row if start <= dist < end]
        assert profile.n_pairs[b] == len(values)
        if values:
            assert profile.mean[b] == pytest.approx(np.mean(values), rel=1e-12)
        else:
            assert np.isnan(profile.mean[b])
    ratios = []
    for row in rows:
        near = sorted(row, key=lambda pair: pair[0])[:math.ceil(len(row) / 16)]
        ratios.append(np.mean([x for _, x in near]))
    assert recency_ratio(weights, qpos, kpos, n_excluded=n_excluded) == pytest.approx(np.mean(ratios), rel=1e-12)


@given(st.integers(1, 40), st.integers(0, 5), st.lists(st.integers(0, 60), min_size=1, max_size=6))
def test_uniform_attention_is_flat(n_keys, n_excluded, query_positions):
    """Uniform attention over the keys a query sees: 1 in every bin, recency ratio 1."""
    kpos = np.arange(n_keys)
    qpos = np.array(query_positions)
    weights = uniform_weights(qpos, kpos)
    profile = distance_profile(weights, qpos, kpos, n_excluded=n_excluded)
    filled = profile.n_pairs > 0
    np.testing.assert_allclose(profile.mean[filled], 1.0)
    ratio = recency_ratio(weights, qpos, kpos, n_excluded=n_excluded)
    assert math.isnan(ratio) == (not filled.any()) and (math.isnan(ratio) or ratio == pytest.approx(1.0))


def test_recency_ratio_of_attention_on_the_nearest_key():
    """All of each query's mass on its nearest key: the nearest ⌈n/16⌉ keys hold it all, so the
    ratio is n/⌈n/16⌉ (32 keys: 16)."""
    kpos = np.arange(32)
    qpos = np.array([32, 40])
    weights = np.zeros((2, 32))
    weights[:, 31] = 1.0
    assert recency_ratio(weights, qpos, kpos) == pytest.approx(16.0)


def test_heavy_share_of_built_masses():
    weights = np.full((4, 205), 1.0)
    weights[:, 7] = 50.0       # one heavy key, summed over the four queries
    weights[:, 100] = 30.0
    weights[:, 0] = 1000.0     # a sink, left out
    weights /= weights.sum(1, keepdims=True)
    share = heavy_share(weights, n_excluded=5)   # 200 keys: the top 2
    assert share == pytest.approx((50 + 30) / (50 + 30 + 198))
    assert heavy_share(np.full((3, 50), 1 / 50)) == pytest.approx(1 / 50)   # at least one key
    assert math.isnan(heavy_share(np.zeros((2, 4))))


def test_lag1_correlation_closed_forms_and_a_loop():
    # an alternating sequence, centred at 0: (−1)·3 / 4
    assert lag1_correlation(np.array([[1.0], [-1.0], [1.0], [-1.0]])) == pytest.approx(-0.75)
    # a linear trend 0..3, centred −1.5..1.5: (−1.5·−0.5 + −0.5·0.5 + 0.5·1.5)/5 = 1.25/5
    assert lag1_correlation(np.arange(4.0)[:, None]) == pytest.approx(0.25)
    x = np.random.default_rng(5).standard_normal((9, 3))
    c = x - x.mean(0)
    num = sum(c[t, j] * c[t + 1, j] for t in range(8) for j in range(3))
    assert lag1_correlation(x) == pytest.approx(num / np.sum(c ** 2), rel=1e-12)
    assert math.isnan(lag1_correlation(np.ones((5, 2)))) and math.isnan(lag1_correlation(np.ones((1, 2))))


@pytest.mark.parametrize("rho", [0.0, 0.5, 0.9])
def test_lag1_correlation_of_an_ar1_sequence_is_rho(rho):
    """z_t = ρ z_{t−1} + √(1−ρ²) e_t: r within 4 sampling SDs (Bartlett, √((1−ρ²)/(S·d))) plus the
    estimator's bias (1 + 3ρ)/S."""
    s, d = 4000, 8
    e = np.random.default_rng(6).standard_normal((s, d))
    z = np.empty((s, d))
    z[0] = e[0]
    for t in range(1, s):
        z[t] = rho * z[t - 1] + math.sqrt(1 - rho ** 2) * e[t]
    tolerance = 4 * math.sqrt((1 - rho ** 2) / (s * d)) + (1 + 3 * rho) / s
    assert abs(lag1_correlation(z) - rho) < tolerance


def test_logit_statistics_and_mean_cosine_match_loops():
    q, k, qpos, kpos = random_case(7, n_q=6, n_k=10)
    pairs = [q[i] @ k[j] / 2 for i in range(6) for j in range(10) if kpos[j] <= qpos[i]]
    mean, std = logit_statistics(q, k, qpos, kpos)
    assert mean == pytest.approx(np.mean(pairs)) and std == pytest.approx(np.std(pairs))
    assert mean_cosine(np.array([[1.0, 0], [1, 2]]), np.array([[0.0, 3], [0, 1]])) == pytest.approx(1 / math.sqrt(2))
    assert math.isnan(mean_cosine(np.array([[1.0, 0], [-1, 0]]), np.ones((2, 2))))


def test_structure_statistics_gathers_the_functions_and_is_fast():
    """One call at S = 2048, Nq = 256, d = 128 takes well under a second."""
    rng = np.random.default_rng(8)
    s, n_q, d = 2048, 256, 128
    q, k, v = rng.standard_normal((n_q, d)), rng.standard_normal((s, d)), rng.standard_normal((s, d))
    qpos, kpos = np.arange(s, s + n_q), np.arange(s)
    start = time.perf_counter()
    result = structure_statistics(q, k, qpos, kpos, v=v, n_sinks=4)
    elapsed = time.perf_counter() - start
    weights = attention_weights(q, k, qpos, kpos)
    assert result.sink_share == sink_share(weights, 4) and result.sink_share_uniform == pytest.approx(4 / s)
    assert result.heavy_share == heavy_share(weights, n_excluded=4)
    assert result.recency_ratio == recency_ratio(weights, qpos, kpos, n_excluded=4)
    assert result.lag1_k == lag1_correlation(k) and result.lag1_v == lag1_correlation(v)
    assert set(result.as_row()) == {"n_sinks", "sink_share", "sink_share_uniform", "recency_ratio", "heavy_share",
                                    "heavy_share_uniform", "lag1_k", "lag1_v", "logit_mean", "logit_std",
                                    "qk_mean_cosine"}
    assert math.isnan(structure_statistics(q, k, qpos, kpos).lag1_v)
    assert elapsed < 1.0, f"structure_statistics took {elapsed:.2f} s at S = {s}, Nq = {n_q}"


def test_bidirectional_attention_sees_every_key_and_measures_distance_both_ways():
    """causal=False: the softmax over all keys (brute force), distances |Δ| (a key 3 after the query
    lands in the bin of a key 3 before it)."""
    from stats import sequence_structure as ss
    gen = np.random.default_rng(3)
    q, k = gen.standard_normal((5, 8)), gen.standard_normal((12, 8))
    qpos, kpos = np.array([0, 2, 5, 7, 11]), np.arange(12)
    weights = ss.attention_weights(q, k, qpos, kpos, causal=False)
    for i in range(5):
        logits = [q[i] @ k[j] / math.sqrt(8) for j in range(12)]
        expected = np.exp(logits - np.max(logits))
        np.testing.assert_allclose(weights[i], expected / expected.sum(), rtol=1e-12)
    one_hot = np.zeros((1, 12))
    one_hot[0, 8] = 1.0                               # the query at 5 attends the key 3 after it
    profile = ss.distance_profile(one_hot, np.array([5]), kpos, causal=False)
    # bin [2, 4) holds |Δ| 2 and 3: keys 2, 3, 7 and 8, one of them with all of the query's mass (12 per key)
    assert profile.mean[ss.distance_bins(np.array([3]))[0]] == pytest.approx(12 / 4)
    assert ss.uniform_weights(qpos, kpos, causal=False).sum(axis=1) == pytest.approx(np.ones(5))
