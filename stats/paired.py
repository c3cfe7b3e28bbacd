"""Tests of two samples that ran on the same data trial by trial (paired rows).

Rows of one setting share their K, V and Q draws (kvcommon.rows), so schemes, budgets and storage
levels of a setting are compared on per-trial differences: the Wilcoxon signed-rank test and
the matched-pairs rank-biserial correlation as its effect size (Kerby 2014), the paired
analogue of the Mann–Whitney U test and Cliff's δ used for unpaired samples.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
from scipy import stats as _sps

from .inference import TestResult, cliffs_delta, mann_whitney


def _differences(a, b) -> np.ndarray:
    x, y = np.asarray(a, dtype=float).ravel(), np.asarray(b, dtype=float).ravel()
    if x.shape != y.shape:
        raise ValueError(f"paired samples need equal lengths, got {len(x)} and {len(y)}")
    d = x - y
    return d[~np.isnan(d)]


def wilcoxon(a, b, metric: str = "") -> TestResult:
    """Two-sided Wilcoxon signed-rank test of the paired differences a_i − b_i (pairs with a NaN
    dropped; zero differences dropped, Wilcoxon's convention). scipy's method 'auto': the exact
    null distribution for n ≤ 50 without ties, else the normal approximation with tie
    correction. Every difference zero (or fewer than one left): p = 1, no evidence of a shift."""
    d = _differences(a, b)
    nonzero = d[d != 0]
    if len(nonzero) == 0:
        return TestResult("wilcoxon-signed-rank", metric, 0.0, 1.0 if len(d) else np.nan, len(d), len(d))
    r = _sps.wilcoxon(nonzero, zero_method="wilcox", alternative="two-sided")
    return TestResult("wilcoxon-signed-rank", metric, float(r.statistic), float(r.pvalue), len(d), len(d))


def rank_biserial(a, b) -> float:
    """Matched-pairs rank-biserial correlation r = (R₊ − R₋)/(R₊ + R₋) ∈ [−1, 1], R± the rank sums
    of |a_i − b_i| over positive and negative differences (zeros dropped): positive when a tends
    to exceed b; ±1 when every pair goes one way."""
    d = _differences(a, b)
    d = d[d != 0]
    if len(d) == 0:
        return 0.0
    ranks = _sps.rankdata(np.abs(d))
    return float((ranks[d > 0].sum() - ranks[d < 0].sum()) / ranks.sum())


def two_sample(a, b, paired: bool, metric: str = "") -> tuple[TestResult, float]:
    """(test, effect): Wilcoxon signed-rank and the rank-biserial r when paired, else Mann–Whitney
    U and Cliff's δ. Both effects lie in [−1, 1] and are positive when a tends to exceed b."""
    if paired:
        return wilcoxon(a, b, metric), rank_biserial(a, b)
    frame_a, frame_b = pd.DataFrame({metric or "x": a}), pd.DataFrame({metric or "x": b})
    row = mann_whitney(frame_a, frame_b).iloc[0]
    return (TestResult("mann-whitney", metric, float(row.statistic), float(row.p_value), int(row.n_a),
                       int(row.n_b)), cliffs_delta(a, b))
