"""The operating characteristics of the verdict rule (stats/operating.py, stats/validation.py):
simulated verdict rates on constructed six-D frames against the targets of issue #13.

R = 100 repetitions per cell and pairing (300 for the hardest cell), 199 energy permutations (the
smallest p-value, 1/200, still rejects at the first Holm step 0.05/7); about 30 s on one core. A
target is demonstrated by a one-sided 95 % Clopper–Pearson bound on the rate (≥ 80 % needs at
least 87 of 100; ≤ 10 % at most 21 of 300, pooled over the cells that share a claim), except
"no codec-difference without one ≤ 5 %", which the rule meets by construction at exactly α, so
the test checks that no count is significantly above it.
"""
import numpy as np
import pytest
import torch
from scipy import stats

from stats.operating import markdown, operating_characteristics
from stats.validation import VERDICTS

pytestmark = pytest.mark.slow   # a simulation of the verdict rule (15 s)

REPETITIONS = 100
TARGET_CELLS = [(0.0, 0.0), (1.0, 0.0), (2.0, 0.0), (3.0, 0.0), (1.0, 1.0), (2.0, 2.0), (3.0, 3.0)]


@pytest.fixture(scope="module")
def table():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny energy tests: thread hand-offs cost more than the work
    try:
        return operating_characteristics(TARGET_CELLS, repetitions=REPETITIONS, seed=2026).set_index(
            ["paired", "codec_shift", "impl_shift"])
    finally:
        torch.set_num_threads(before)


def upper(events, n):
    """One-sided 95 % Clopper–Pearson upper bound of a rate with `events` in n repetitions."""
    return 1.0 if events == n else float(stats.beta.ppf(0.95, events + 1, n - events))


def lower(events, n):
    """One-sided 95 % Clopper–Pearson lower bound."""
    return 0.0 if events == 0 else float(stats.beta.ppf(0.05, events, n - events + 1))


def events(table, cells, verdict):
    """The count of `verdict` in each of cells (paired, c, i)."""
    return [round(table.loc[cell, verdict] * REPETITIONS) for cell in cells]


def test_no_codec_difference_without_one(table):
    """A codec-difference needs the main family to reject, and Holm keeps that at most α = 5 % when
    A and B behave alike: the rate is at most 5 % by construction, so what a finite study can
    check is that no cell's count is significantly above 5 % (its 99 % binomial quantile at 5 %),
    and that the pooled rate is, with 95 % confidence, below 10 %."""
    cells = [(paired, 0.0, 0.0) for paired in (False, True)]
    found = events(table, cells, "codec-difference")
    assert max(found) <= stats.binom.ppf(0.99, REPETITIONS, 0.05), found
    assert upper(sum(found), REPETITIONS * len(cells)) <= 0.10, found


@pytest.mark.parametrize("paired", [False, True])
@pytest.mark.parametrize("shift", [2.0, 3.0])
def test_a_codec_difference_is_found(table, paired, shift):
    # a codec-difference needs the effect's CI beyond the margin (half an sd): at n = 40 a 1 sd
    # shift is found in about a third of repetitions unpaired (the CI's half-width is ~0.45 sd at
    # Holm's 0.05/12) and in ~85 % paired (correlation 0.7), so the target starts at 2 sd
    [found] = events(table, [(paired, shift, 0.0)], "codec-difference")
    assert lower(found, REPETITIONS) >= 0.80, found


@pytest.mark.parametrize("paired", [False, True])
def test_an_implementation_effect_of_the_same_size_is_recognised(table, paired):
    # from 2 sd, where the main effect is found beyond the margin (at 1 sd mostly not: no attribution needed)
    cells = [(paired, shift, shift) for shift in (2.0, 3.0)]
    false_alarms = events(table, cells, "codec-difference")
    recognised = events(table, cells, "implementation-variance")
    n = REPETITIONS * len(cells)
    assert upper(sum(false_alarms), n) <= 0.10, false_alarms
    assert lower(sum(recognised), n) >= 0.70, recognised
    assert max(false_alarms) <= stats.binom.ppf(0.99, REPETITIONS, 0.10), false_alarms
    assert min(recognised) >= stats.binom.ppf(0.01, REPETITIONS, 0.70), recognised


def test_table_has_every_verdict_rate(table):
    rates = table[list(VERDICTS)].to_numpy()
    assert np.allclose(rates.sum(axis=1), 1.0) and (table["repetitions"] == REPETITIONS).all()
    lines = markdown(table.reset_index()).splitlines()
    # a row per (pairing, c): 4 codec shifts, each pairing; columns i = 0, 1, 2, 3
    assert len(lines) == 2 + 2 * 4 and lines[0] == "| pairing | c \\ i | 0 | 1 | 2 | 3 |"
    row = table.loc[(False, 1.0, 1.0)]
    cell = " / ".join(f"{100 * row[v]:.0f}" for v in VERDICTS)
    assert lines[3].startswith("| unpaired | 1 | ") and lines[3].split(" | ")[3] == cell
    assert "–" in lines[2]  # c = 0 was computed at i = 0 only
