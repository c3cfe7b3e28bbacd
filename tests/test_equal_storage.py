"""Comparisons at equal measured storage (stats.equal_storage) and paired tests (stats.paired):
placement rules against hand-worked cases, paired tests against brute-force enumeration, and
the paired-vs-unpaired difference the report relies on."""
import itertools
import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stats.findings import pairwise_tests, winners
from stats.dominance import crossovers
from stats.equal_storage import LEVEL, TOLERANCE, at_storage, default_levels, parse_levels, storage_column
from stats.paired import rank_biserial, two_sample, wilcoxon

SETTING = dict(scenario="gaussian", dim=16, seq_len=32, queries=4, calib_tokens=512, seed=0, rng="pcg64")


def frame(cells: dict[tuple[str, int], tuple[float, np.ndarray]], storage: str = "bits_per_element") -> pd.DataFrame:
    """Trial rows of one setting: cells {(scheme, budget): (bits, per-trial d2_t)}."""
    rows = []
    for (scheme, budget), (bits, values) in cells.items():
        for t, v in enumerate(values):
            rows.append({**SETTING, "scheme": scheme, "budget": budget, "trial": t, storage: bits, "d2_t": v})
    return pd.DataFrame(rows)


def test_measured_interpolated_and_absent():
    rng = np.random.default_rng(0)
    lo, hi = rng.uniform(0.2, 0.4, 10), rng.uniform(0.01, 0.1, 10)
    fixed = rng.uniform(0.05, 0.06, 10)
    trials = frame({("a", 2): (2.25, lo), ("a", 3): (3.25, hi), ("int8", 2): (9.0, fixed)})
    out = at_storage(trials, ["d2_t"], (2.3, 3.0, 3.5, 9.1)).sort_values([LEVEL, "scheme", "trial"])
    by = {(r[0], r[1]): g for r, g in out.groupby([LEVEL, "scheme"])}
    # 2.3 is within 2.5 % of 2.25: the measured cell, values untouched
    a23 = by[(2.3, "a")]
    assert (a23.source == "measured").all() and np.array_equal(a23.d2_t.to_numpy(), lo) and a23.storage.iloc[0] == 2.25
    # 3.0 lies between 2.25 and 3.25 at weight 0.75: log-linear, trial by trial
    a30 = by[(3.0, "a")]
    assert (a30.source == "interpolated").all() and a30.weight.iloc[0] == pytest.approx(0.75)
    expected = [math.exp(0.25 * math.log(x) + 0.75 * math.log(y)) for x, y in zip(lo, hi)]
    assert a30.d2_t.to_numpy() == pytest.approx(expected, rel=1e-12)
    # 3.5 is 7.7 % above a's richest cell and int8 is far: nobody, no extrapolation
    assert (3.5, "a") not in by and (3.5, "int8") not in by
    # the fixed-width codec appears only where its bits put it (9.1 is within 2.5 % of 9.0)
    assert set(out[out[LEVEL] == 9.1].scheme) == {"int8"}


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(1.0, 10.0), min_size=2, max_size=5, unique=True), st.floats(1.0, 10.0))
def test_values_compared_at_a_level_stand_within_the_tolerance(storages, level):
    """Whatever the cells, every value placed at a level is at storage within ±TOLERANCE/2 of it
    (measured) or exactly at it (interpolated), and interpolation never leaves the cells' range."""
    values = np.linspace(0.5, 0.05, len(storages))
    trials = frame({("a", b): (s, np.full(4, v)) for b, (s, v) in enumerate(zip(storages, values))})
    out = at_storage(trials, ["d2_t"], (level,))
    if out.empty:
        assert all(abs(s - level) > TOLERANCE / 2 * level for s in storages)
        assert level < min(storages) or level > max(storages)
        return
    assert abs(out.storage.iloc[0] - level) <= TOLERANCE / 2 * level + 1e-12
    assert values.min() - 1e-12 <= out.d2_t.min() and out.d2_t.max() <= values.max() + 1e-12


def test_storage_column_and_levels():
    trials = frame({("a", 2): (2.0, np.ones(3)), ("a", 4): (4.0, np.ones(3))})
    assert storage_column(trials) == "bits_per_element"
    trials["storage_bits_per_element"] = trials.bits_per_element + 1
    assert storage_column(trials) == "storage_bits_per_element"
    assert default_levels(trials) == (2.5, 4.5)
    assert parse_levels("3.5, 2.5,3.5") == (2.5, 3.5)
    for bad in ("x", "0", "-1", "nan"):
        with pytest.raises(ValueError, match="storage level"):
            parse_levels(bad)


def _exact_wilcoxon_p(d: np.ndarray) -> float:
    """Two-sided p of the signed-rank statistic by enumerating all 2^n sign patterns (no ties, no zeros)."""
    ranks = np.argsort(np.argsort(np.abs(d))) + 1
    observed = ranks[d > 0].sum()
    total = ranks.sum()
    stats = [sum(r for r, s in zip(ranks, signs) if s) for signs in itertools.product((0, 1), repeat=len(d))]
    centre = total / 2
    extreme = abs(observed - centre)
    return sum(abs(s - centre) >= extreme - 1e-9 for s in stats) / len(stats)


@pytest.mark.parametrize("seed", range(4))
def test_wilcoxon_matches_exhaustive_sign_flips(seed):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=12)
    b = a - rng.normal(0.4, 1.0, size=12)
    assert wilcoxon(a, b).p_value == pytest.approx(_exact_wilcoxon_p(a - b), rel=1e-9)


def test_rank_biserial_by_hand_and_edge_cases():
    a, b = np.array([3.0, 1.0, 4.0, 1.5]), np.array([1.0, 2.0, 1.0, 1.0])  # d = 2, -1, 3, 0.5
    # ranks of |d|: 2 -> 3, 1 -> 2, 3 -> 4, 0.5 -> 1; R+ = 8, R- = 2, r = 6/10
    assert rank_biserial(a, b) == pytest.approx(0.6)
    assert rank_biserial(b, a) == pytest.approx(-0.6)
    assert rank_biserial(a, a) == 0.0 and wilcoxon(a, a).p_value == 1.0
    with pytest.raises(ValueError, match="equal lengths"):
        wilcoxon(a, b[:3])


def test_paired_test_sees_what_the_unpaired_one_misses():
    """The situation of issue 13 §2: large trial-to-trial spread shared by both codecs and a
    small consistent advantage: Mann–Whitney calls it a tie, the paired test does not."""
    rng = np.random.default_rng(3)
    base = rng.lognormal(-2, 0.8, 20)
    a, b = base * 1.08 + rng.normal(0, 0.002, 20), base
    paired, r = two_sample(a, b, paired=True)
    unpaired, delta = two_sample(a, b, paired=False)
    assert paired.test == "wilcoxon-signed-rank" and unpaired.test == "mann-whitney"
    assert paired.p_value < 1e-3 < 0.05 < unpaired.p_value
    assert r > 0.9 and abs(delta) < 0.3


def test_report_tables_pair_and_rank_at_equal_storage():
    """Through the findings layer: the test is paired within a setting, the winner at a level is
    the lower interpolated mean, and the runner-up stands at the same storage."""
    rng = np.random.default_rng(5)
    base = rng.lognormal(-2, 0.8, 20)
    trials = frame({("a", 2): (2.2, base * 2.0), ("a", 3): (3.2, base * 1.0),
                    ("b", 2): (2.7, base * 1.3), ("b", 3): (3.0, base * 1.2)})
    equal = at_storage(trials, ["d2_t"], (2.7, 3.0))
    tests = pairwise_tests(equal)
    assert tests.paired.all() and set(tests.test) == {"wilcoxon-signed-rank"}
    wins = winners(equal, tests).set_index(LEVEL)
    # at 3.0 a is interpolated (w = 0.8 between 2.2 and 3.2): 2^0.2 · base ≈ 1.149 base < b's 1.2 base
    assert wins.loc[3.0, "winner"] == "a" and wins.loc[3.0, "winner_source"] == "b = 2–3 interpolated"
    # a consistent 4 % advantage (paired Holm p < 0.05) that is a small part of d2_t's trial-to-trial
    # spread (lognormal, sd ~ 90 % of the mean): significant, and shown inside half an sd
    assert wins.loc[3.0, "runner_up"] == "b" and wins.loc[3.0, "comparison"] == "negligible"
    # at 2.7: a at 2^0.5 · base ≈ 1.414 base loses to b's measured 1.3 base
    assert wins.loc[2.7, "winner"] == "b" and wins.loc[2.7, "winner_source"] == "b = 2"
    assert (abs(wins.winner_storage - wins.runner_up_storage) <= TOLERANCE * wins.index).all()


def test_winner_comparison_words_on_the_smallest_effect_of_interest():
    """'difference' needs significance and a mean difference beyond half a pooled sd; the same
    codecs with the runner-up 1e-9 worse are 'negligible'; independent draws of one distribution
    (other trials) 'equivalent' or 'inconclusive', never 'difference'."""
    rng = np.random.default_rng(8)
    base = rng.lognormal(-2, 0.3, 60)
    for runner, expected in ((base * 1.6, {"difference"}), (base * (1 + 1e-9), {"negligible"}),
                             (rng.lognormal(-2, 0.3, 60), {"equivalent", "inconclusive"})):
        trials = frame({("a", 3): (3.0, base), ("b", 3): (3.0, runner)})
        equal = at_storage(trials, ["d2_t"], (3.0,))
        wins = winners(equal, pairwise_tests(equal))
        assert wins["comparison"].iloc[0] in expected, (wins["comparison"].iloc[0], expected)


def test_crossovers_along_the_storage_axis():
    trials = frame({("a", 2): (2.0, np.full(8, 0.5)), ("a", 4): (4.0, np.full(8, 0.02)),
                    ("b", 2): (2.0, np.full(8, 0.3)), ("b", 4): (4.0, np.full(8, 0.1))})
    equal = at_storage(trials, ["d2_t"], (2.0, 3.0, 4.0))
    cross = crossovers(equal, error="d2_t", n_boot=50, axis=LEVEL)
    # a: 0.5, 0.1, 0.02; b: 0.3, 0.173, 0.1 -> a - b: +0.2, -0.073, -0.08: one flip between 2 and 3
    assert len(cross) == 1
    row = cross.iloc[0]
    assert (row[f"{LEVEL}_low"], row[f"{LEVEL}_high"], row.better_below) == (2.0, 3.0, "b") and row.confident


def test_findings_when_no_codec_reaches_a_storage_level():
    """A run whose codecs all sit away from every level (one budget at a small d) still has
    findings and a JSON object: fronts, and no winners rather than an error."""
    from kvcommon.rows import TRIAL_COLUMNS
    from stats.findings import analyse, to_json

    rng = np.random.default_rng(2)
    rows = [{**{c: rng.uniform(0.1, 0.5) for c in TRIAL_COLUMNS}, **SETTING, "scheme": name, "budget": 3,
             "trial": t, "impl": "torch", "device": "cpu", "dtype": "float32", "heads": 1,
             "bits_per_element": bits, "storage_bits_per_element": bits}
            for name, bits in (("tq-kv", 5.1), ("plain-kv", 5.0)) for t in range(4)]
    findings = analyse(pd.DataFrame(rows), n_permutations=20)
    assert findings.equal.empty and findings.winners.empty
    found = to_json(findings)
    assert found["winners"] == [] and found["verdicts"] == [] and len(found["fronts"]) == 1
