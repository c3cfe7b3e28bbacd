"""The structured scenario (scenarios/structured.py) does what each knob says, measured with
stats/sequence_structure.py on its draws; it passes the scenario conformance checks, draws
deterministically from its labelled streams, and refuses parameters and shapes it cannot serve."""
import dataclasses
import functools
import math

import numpy as np
import pytest

import scenarios
from kvcommon.rng import generator
from kvcommon.rope import apply_rope_numpy
from scenarios.base import TrialShape
from scenarios.conformance import check_scenario
from stats.sequence_structure import (attention_weights, distance_profile, heavy_share, lag1_correlation,
                                      recency_ratio, sink_share, structure_statistics)

OFF = {"sink_logit": 0.0, "recency": 0.0, "heavy_logit": 0.0}   # every attention property off
SHAPE = TrialShape(n_heads=16, seq_len=256, n_queries=64, dim=64, n_calib=8)


def draw(params=None, shape=SHAPE, seed=0, name="structured"):
    """A trial as a sweep draws it (the streams of scenarios.conformance.draw)."""
    scenario = scenarios.create(name, **(params or {}))

    def streams(*labels):
        return generator("pcg64", seed, "data", name, shape.dim, shape.seq_len, shape.n_queries, shape.n_heads,
                         0, *labels)
    return scenario, scenario.draw(streams, shape)


def per_head(params, statistic, shape=SHAPE, seed=0):
    """statistic(weights, query positions, key positions) of each head's evaluated queries, (H,)."""
    scenario, out = draw(params, shape, seed)
    s = shape.seq_len
    qpos, kpos = np.arange(s, s + shape.n_queries), np.arange(s)
    return np.array([statistic(attention_weights(out["q"][h], out["k"][h], qpos, kpos), qpos, kpos)
                     for h in range(shape.n_heads)])


def pre_rope(x, positions, scenario):
    """Undo the scenario's RoPE: rotate back by the same angles."""
    return apply_rope_numpy(x, positions, -scenario.inv_freq(x.shape[-1]))


def within_noise(values, expected, n_se=4.0):
    """|mean − expected| below n_se standard errors of the mean over heads."""
    se = values.std(ddof=1) / math.sqrt(len(values))
    return abs(values.mean() - expected) < n_se * se


# --- the contract every scenario keeps ---------------------------------------------------------
@pytest.mark.parametrize("params", ["", ":sink_logit=0:recency=0:heavy_logit=0:rho=0:shared=0",
                                    ":sink_logit=4:rho=0.8:heavy_fraction=1:shared=1"])
def test_passes_the_conformance_checks(params):
    check_scenario(functools.partial(scenarios.create, f"structured{params}"))


def test_knobs_are_set_from_the_name():
    scenario = scenarios.create("structured:sink_logit=4:rho=0.8:n_sinks=2")
    assert (scenario.sink_logit, scenario.rho, scenario.n_sinks) == (4.0, 0.8, 2)
    assert "structured" in scenarios.available()


@pytest.mark.parametrize("key, value, words", [
    ("rho", 1.0, r"rho=1.0 must be a finite number in \[0, 1\)"),
    ("rho", -0.1, r"rho=-0.1 must be a finite number in \[0, 1\)"),
    ("sink_logit", -1.0, r"sink_logit=-1.0 must be a finite number in \[0, ∞\)"),
    ("heavy_fraction", 1.5, r"heavy_fraction=1.5 must be a finite number in \[0, 1\]"),
    ("shared", math.nan, r"shared=nan must be a finite number in \[0, 1\]"),
    ("n_sinks", 2.5, r"n_sinks=2.5 must be a whole number in \[0, ∞\)"),
    ("temperature", 0.0, r"temperature=0.0 must be a finite number in \(0, ∞\)"),
    ("rope_base", 1.0, r"rope_base=1.0 must be a finite number in \(1, ∞\)"),
])
def test_bad_parameters_are_one_line_errors_naming_the_range(key, value, words):
    with pytest.raises(ValueError, match=words) as info:
        scenarios.create("structured", **{key: value})
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("dim, params, words", [(5, {}, "must be even and at least 4"),
                                                (2, {}, "must be even and at least 4"),
                                                (16, {"recency": 4.0}, "recency=4.0 must be below √d = 4")])
def test_shapes_it_cannot_serve_are_refused(dim, params, words):
    scenario = scenarios.create("structured", **params)
    with pytest.raises(ValueError, match=words):
        scenario.check_shape(TrialShape(1, 8, 2, dim, 4))


def test_same_streams_same_arrays_and_the_prefill_ignores_other_sizes():
    shape = TrialShape(2, 40, 6, 16, 10)
    _, first = draw(shape=shape)
    _, again = draw(shape=shape)
    for name in first:
        assert np.array_equal(first[name], again[name])
    for other in (dataclasses.replace(shape, n_calib=3), dataclasses.replace(shape, n_calib=50),
                  dataclasses.replace(shape, n_decode=5, prefill_queries=True)):
        _, changed = draw(shape=other)
        for name in ("k", "v", "q"):
            assert np.array_equal(first[name], changed[name]), (name, other)
    _, seeded = draw(shape=shape, seed=1)
    assert not np.array_equal(first["k"], seeded["k"])


def test_positions_are_a_decoders():
    shape = TrialShape(1, 20, 3, 8, 4, n_decode=5, prefill_queries=True)
    _, out = draw(shape=shape)
    assert out["positions"].tolist() == list(range(20))
    assert out["positions_decode"].tolist() == list(range(20, 25))
    assert out["q_prefill"].shape == (1, 20, 8) and out["q_prefill_decode"].shape == (1, 5, 8)


def test_temperature_divides_every_logit():
    """Queries are divided by the temperature after everything else: halving it doubles q exactly."""
    _, warm = draw({"temperature": 0.5}, shape=TrialShape(2, 64, 8, 16, 4))
    _, cold = draw({"temperature": 0.25}, shape=TrialShape(2, 64, 8, 16, 4))
    np.testing.assert_allclose(cold["q"], 2 * warm["q"], rtol=1e-13)
    assert np.array_equal(cold["k"], warm["k"])


def test_defaults_keep_the_scale_conventions():
    """E‖k‖² ≈ d, ordinary logits of SD ≈ 1/temperature, as in every scenario."""
    scenario, out = draw(shape=TrialShape(4, 1024, 64, 64, 8))
    assert np.mean(np.sum(out["k"] ** 2, -1)) == pytest.approx(64, rel=0.05)
    assert np.mean(np.sum(out["v"] ** 2, -1)) == pytest.approx(64, rel=0.05)
    logits = np.einsum("hqd,hkd->hqk", out["q"], out["k"][:, scenario.n_sinks:]) / 8
    assert logits.std() == pytest.approx(1 / scenario.temperature, rel=0.1)


# --- each knob does what it says ---------------------------------------------------------------
def test_sink_share_rises_with_sink_logit_and_is_by_count_at_zero():
    values = {x: per_head({**OFF, "sink_logit": x}, lambda w, qp, kp: sink_share(w, 4)) for x in (0.0, 1.0, 2.0, 4.0)}
    means = [values[x].mean() for x in sorted(values)]
    assert all(a < b for a, b in zip(means, means[1:])), means
    assert within_noise(values[0.0], 4 / SHAPE.seq_len)           # sink_logit = 0: the first tokens are ordinary
    assert means[-1] > 0.5                                           # sink_logit = 4: most of the mass
    # switched off either way, the trial is the same
    assert np.array_equal(draw({**OFF, "sink_logit": 0.0})[1]["k"], draw({**OFF, "n_sinks": 0, "sink_logit": 3.0})[1]["k"])


def test_recency_ratio_rises_with_recency_and_is_flat_at_zero():
    ratio = functools.partial(recency_ratio, n_excluded=0)
    values = {x: per_head({**OFF, "recency": x}, ratio) for x in (0.0, 1.0, 2.0, 4.0)}
    means = [values[x].mean() for x in sorted(values)]
    assert all(a < b for a, b in zip(means, means[1:])), means
    assert within_noise(values[0.0], 1.0)
    assert means[-1] > 2.5
    # at recency = 0 every filled distance bin holds the mean attention per key, within its noise
    profiles = per_head({**OFF}, lambda w, qp, kp: distance_profile(w, qp, kp).mean)
    for b in range(profiles.shape[1]):
        column = profiles[:, b]
        if np.isfinite(column).all() and b >= 3:    # bins of Δ ≥ 4: several pairs per head
            assert within_noise(column, 1.0, n_se=4.5), (b, column.mean())


def test_heavy_share_rises_with_heavy_logit_and_either_zero_switches_it_off():
    share = lambda w, qp, kp: heavy_share(w)   # noqa: E731
    values = {x: per_head({**OFF, "heavy_logit": x}, share) for x in (0.0, 1.0, 2.0, 3.0)}
    means = [values[x].mean() for x in sorted(values)]
    assert all(a < b for a, b in zip(means, means[1:])), means
    assert means[-1] > 3 * means[0]
    off = draw({**OFF, "heavy_logit": 0.0})[1]
    assert np.array_equal(off["k"], draw({**OFF, "heavy_fraction": 0.0, "heavy_logit": 2.0})[1]["k"])


def test_heavy_hitters_are_the_tokens_many_queries_attend_to():
    """The keys with the most mass summed over queries are mostly planted heavy hitters (the
    scenario's own draw of them, stream "heavy"), never sinks."""
    params = {**OFF, "heavy_logit": 3.0, "sink_logit": 2.0}
    scenario, out = draw(params, shape=TrialShape(4, 256, 64, 64, 8))
    hits = 0
    for h in range(4):
        gen = generator("pcg64", 0, "data", "structured", 64, 256, 64, 4, 0, "heavy", h)
        planted = (gen.random(256) < scenario.heavy_fraction) & (np.arange(256) >= scenario.n_sinks)
        weights = attention_weights(out["q"][h], out["k"][h], np.arange(256, 320), np.arange(256))
        top = np.argsort(weights[:, 4:].sum(0))[::-1][:5] + 4
        hits += planted[top].sum()
    assert hits >= 16   # of 20; 5 % of tokens are planted, so chance alone gives 1


@pytest.mark.parametrize("rho", [0.0, 0.3, 0.6, 0.9])
def test_lag1_correlation_of_pre_rope_keys_and_of_values_is_rho(rho):
    """Measured on pre-RoPE keys and on values (no RoPE): ρ within 4 sampling SDs of the pooled
    estimator (Bartlett: √((1−ρ²)/(S·d)) per head, over H heads) plus its bias (1 + 3ρ)/S."""
    shape = TrialShape(4, 1024, 4, 32, 4)
    scenario, out = draw({**OFF, "rho": rho}, shape=shape)
    positions = np.arange(shape.seq_len)
    tolerance = 4 * math.sqrt((1 - rho ** 2) / (shape.seq_len * shape.dim * shape.n_heads)) + (1 + 3 * rho) / 1024
    for name in ("k", "v"):
        x = out[name] if name == "v" else pre_rope(out["k"], positions, scenario)
        measured = np.mean([lag1_correlation(x[h]) for h in range(shape.n_heads)])
        assert abs(measured - rho) < tolerance, (name, measured)
    # RoPE turns pair i by θ_i per token, so post-RoPE keys show ρ·mean_i cos θ_i
    post = np.mean([lag1_correlation(out["k"][h]) for h in range(shape.n_heads)])
    assert abs(post - rho * np.cos(scenario.inv_freq(shape.dim)).mean()) < tolerance


def test_decode_tokens_continue_the_window_by_the_drift():
    """At the seam the pre-RoPE lag-1 correlation is √(1−drift)·ρ: drift 0 continues the window's
    sequence, drift 1 starts an unrelated one."""
    shape = TrialShape(64, 8, 2, 64, 4, n_decode=1)
    for drift, expected in ((0.0, 0.8), (0.75, 0.4), (1.0, 0.0)):
        scenario, out = draw({**OFF, "rho": 0.8, "drift": drift}, shape=shape)
        last = pre_rope(out["k"][:, -1:], np.array([7]), scenario)
        first = pre_rope(out["k_decode"], np.array([8]), scenario)
        seam = float(np.sum(last * first) / np.sqrt(np.sum(last ** 2) * np.sum(first ** 2)))
        assert abs(seam - expected) < 4 * math.sqrt((1 + expected ** 2) / (64 * 64)), (drift, seam)


def test_queries_depend_on_keys_only_through_the_stated_maps():
    """Pre-RoPE, E[q_t k_sᵀ] = shared·ρ^|t−s|·A_q A_kᵀ/temperature (the window's own queries
    q_prefill against its keys, lags 0 and 1), within sampling error; 0 with shared = 0; q ≠ k."""
    s, d = 4096, 16
    shape = TrialShape(1, s, 2, d, 4, prefill_queries=True)
    positions = np.arange(s)
    for shared, rho in ((0.5, 0.5), (0.0, 0.5)):
        scenario, out = draw({**OFF, "shared": shared, "rho": rho}, shape=shape)
        assert not np.allclose(out["q_prefill"], out["k"] / scenario.temperature)
        q, k = pre_rope(out["q_prefill"][0], positions, scenario), pre_rope(out["k"][0], positions, scenario)
        pop = scenario.head_population(generator("pcg64", 0, "data", "structured", d, s, 2, 1, 0, "population", 0), d)
        stated = shared * pop.maps["q"] @ pop.maps["k"].T / scenario.temperature
        # sampling error of a cross-covariance of AR(1) series: (d² + Σc²)/(T²·S)·(1+ρ²)/(1−ρ²)
        error = math.sqrt((d * d + shared ** 2 * d) / (scenario.temperature ** 2 * s) * (1 + rho ** 2) / (1 - rho ** 2))
        for lag in (0, 1):
            measured = q[lag:].T @ k[: s - lag] / (s - lag)
            assert np.linalg.norm(measured - rho ** lag * stated) < 1.5 * error, (shared, lag)
        if shared:
            assert np.linalg.norm(stated) > 5 * error


def test_structure_statistics_of_the_defaults_show_every_property():
    """The defaults (docs/scenarios.md's table) give each property visibly, at S = 256, d = 64."""
    scenario, out = draw(shape=TrialShape(8, 256, 64, 64, 8, prefill_queries=True))
    qpos, kpos = np.arange(256, 320), np.arange(256)
    rows = [structure_statistics(out["q"][h], out["k"][h], qpos, kpos, v=out["v"][h]).as_row() for h in range(8)]
    mean = {key: np.mean([r[key] for r in rows]) for key in rows[0]}
    assert mean["sink_share"] > 5 * mean["sink_share_uniform"]
    assert mean["recency_ratio"] > 1.5
    assert mean["heavy_share"] > 5 * mean["heavy_share_uniform"]
    assert abs(mean["lag1_v"] - scenario.rho) < 0.05
    # the window's own queries, causal: every query sees itself and the keys before it
    causal = structure_statistics(out["q_prefill"][0], out["k"][0], kpos, kpos)
    assert np.isfinite(causal.recency_ratio) and causal.sink_share > causal.sink_share_uniform
