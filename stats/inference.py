"""Two-sample inference on per-trial metrics: KS and Mann-Whitney tests (batched over metrics),
the Wilcoxon signed-rank test for paired samples, Holm and Benjamini-Hochberg corrections,
Student-t and bootstrap confidence intervals, Cliff's delta and a TOST equivalence test.

Inputs are per-trial samples: a frame with one row per trial and one column per metric, or a
1-D array. Every random draw takes an explicit seed or numpy Generator (STYLE.md §4). Results
are small frozen dataclasses with `to_row()`; the batched functions return tidy frames.
"""
from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np
import pandas as pd
from scipy import special as _special
from scipy import stats as _sps

from kvcommon.rng import generator

from .margins import ALPHA

STATISTICS = ("mean", "median")


def as_generator(seed: int | np.random.Generator, *labels) -> np.random.Generator:
    """An explicit Generator: the one given, or a PCG64 stream keyed by (seed, *labels)."""
    if isinstance(seed, np.random.Generator):
        return seed
    return generator("pcg64", int(seed), *labels)


def _finite(values) -> np.ndarray:
    """A 1-D float64 array without NaN (±inf are kept: they order correctly in rank tests)."""
    x = np.asarray(values, dtype=np.float64).ravel()
    return x[~np.isnan(x)]


def _columns(a: pd.DataFrame, b: pd.DataFrame, metrics: Sequence[str] | None) -> list[str]:
    if metrics is None:
        metrics = [c for c in a.columns if c in b.columns and pd.api.types.is_numeric_dtype(a[c])]
    missing = [m for m in metrics if m not in a.columns or m not in b.columns]
    if missing:
        raise ValueError(f"metric(s) {', '.join(missing)} missing from a sample; "
                         f"valid: {', '.join(c for c in a.columns if c in b.columns)}")
    return list(metrics)


# --- rank tests ---------------------------------------------------------------------------
@dataclass(frozen=True)
class TestResult:
    """One two-sample test on one metric: the statistic, its p-value and the sample sizes."""
    test: str
    metric: str
    statistic: float
    p_value: float
    n_a: int
    n_b: int

    def to_row(self) -> dict:
        return asdict(self)


def ks_critical_value(n_a: int, n_b: int, alpha: float) -> float:
    """The asymptotic two-sided critical KS distance at level alpha for samples of n_a and
    n_b: K⁻¹(alpha) / sqrt(n_a n_b / (n_a + n_b)), K the Kolmogorov distribution
    (scipy.special.kolmogi). For n ≳ 30 it is within a few percent of the exact value."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha {alpha!r} must lie in (0, 1)")
    if n_a < 1 or n_b < 1:
        raise ValueError(f"sample sizes {n_a}, {n_b} must be positive")
    return float(_special.kolmogi(alpha) / np.sqrt(n_a * n_b / (n_a + n_b)))


def ks_tests(a: pd.DataFrame, b: pd.DataFrame, metrics: Sequence[str] | None = None) -> pd.DataFrame:
    """Two-sample KS test per metric (columns of a and b; every shared numeric column when
    metrics is None). NaNs are dropped per metric. Returns one row per metric: test, metric,
    statistic (KS distance D), p_value (scipy's exact distribution for n_a·n_b ≤ 10⁴, else
    asymptotic), n_a, n_b."""
    rows = []
    for m in _columns(a, b, metrics):
        x, y = _finite(a[m]), _finite(b[m])
        if len(x) == 0 or len(y) == 0:
            rows.append(TestResult("ks", m, np.nan, np.nan, len(x), len(y)).to_row())
            continue
        with warnings.catch_warnings():
            # scipy warns when its exact recursion fails and it switches to the asymptotic
            # distribution (nearly identical samples); the fallback is the documented behaviour
            warnings.filterwarnings("ignore", "ks_2samp: Exact calculation unsuccessful", RuntimeWarning)
            r = _sps.ks_2samp(x, y)
        rows.append(TestResult("ks", m, float(r.statistic), float(r.pvalue), len(x), len(y)).to_row())
    return pd.DataFrame(rows, columns=list(TestResult.__dataclass_fields__))


def mann_whitney(a: pd.DataFrame, b: pd.DataFrame, metrics: Sequence[str] | None = None) -> pd.DataFrame:
    """Two-sided Mann-Whitney U test per metric (tie-corrected normal approximation with
    continuity correction for n ≥ 8, exact otherwise — scipy's method='auto'). Columns as in
    ks_tests; statistic is U of sample a."""
    rows = []
    for m in _columns(a, b, metrics):
        x, y = _finite(a[m]), _finite(b[m])
        if len(x) == 0 or len(y) == 0 or np.ptp(np.concatenate([x, y])) == 0:
            # all values equal: no evidence of a shift (scipy would return NaN)
            p = np.nan if len(x) == 0 or len(y) == 0 else 1.0
            rows.append(TestResult("mann-whitney", m, len(x) * len(y) / 2, p, len(x), len(y)).to_row())
            continue
        r = _sps.mannwhitneyu(x, y, alternative="two-sided")
        rows.append(TestResult("mann-whitney", m, float(r.statistic), float(r.pvalue), len(x), len(y)).to_row())
    return pd.DataFrame(rows, columns=list(TestResult.__dataclass_fields__))


def wilcoxon_signed_rank(a: pd.DataFrame, b: pd.DataFrame, metrics: Sequence[str] | None = None) -> pd.DataFrame:
    """Two-sided Wilcoxon signed-rank test per metric on the paired differences a_i − b_i
    (rows of a and b matched by position: sort both by trial first; pairs with a NaN are
    dropped). Zero differences are discarded (Wilcoxon's original treatment, scipy's
    zero_method='wilcox'); scipy's method='auto' is exact for n ≤ 50 without ties or zeros,
    else the normal approximation. All differences zero: statistic 0, p = 1 (no evidence of a
    shift; scipy would warn and divide by zero). Columns as in ks_tests; statistic is the
    smaller of the signed-rank sums W+ and W−."""
    if len(a) != len(b):
        raise ValueError(f"paired samples need equal lengths, got {len(a)} and {len(b)}")
    metrics = _columns(a, b, metrics)
    d = a[metrics].to_numpy(dtype=np.float64) - b[metrics].to_numpy(dtype=np.float64)
    # columns without NaN and zeros go through scipy at once (the same numbers as one by one)
    plain = ~np.isnan(d).any(axis=0) & (d != 0).all(axis=0) & (len(d) > 0)
    statistic, p_value = np.full(len(metrics), np.nan), np.full(len(metrics), np.nan)
    if plain.any():
        r = _sps.wilcoxon(d[:, plain], zero_method="wilcox", alternative="two-sided", method="auto", axis=0)
        statistic[plain], p_value[plain] = r.statistic, r.pvalue
    rows = []
    for k, m in enumerate(metrics):
        x = d[:, k][~np.isnan(d[:, k])]
        if not plain[k] and len(x) > 0:
            if np.any(x != 0):
                r = _sps.wilcoxon(x, zero_method="wilcox", alternative="two-sided", method="auto")
                statistic[k], p_value[k] = r.statistic, r.pvalue
            else:
                statistic[k], p_value[k] = 0.0, 1.0
        rows.append(TestResult("wilcoxon", m, float(statistic[k]), float(p_value[k]), len(x), len(x)).to_row())
    return pd.DataFrame(rows, columns=list(TestResult.__dataclass_fields__))


# --- multiple testing --------------------------------------------------------------------
def _pvalue_array(pvalues) -> np.ndarray:
    p = np.asarray(pvalues, dtype=np.float64)
    if p.ndim != 1:
        raise ValueError(f"p-values must be one-dimensional, got shape {p.shape}")
    if np.any((p < 0) | (p > 1)):
        raise ValueError("p-values must lie in [0, 1]")
    return p


def _adjust(pvalues, adjust_sorted) -> np.ndarray:
    """Adjusted p-values of the non-NaN entries (the family, m of them), NaN kept:
    adjust_sorted(ascending p-values) -> their adjusted values, in the same order."""
    p = _pvalue_array(pvalues)
    out = np.full_like(p, np.nan)
    ok = ~np.isnan(p)
    q = p[ok]
    if len(q) == 0:
        return out
    order = np.argsort(q, kind="stable")
    adjusted = np.empty(len(q))
    adjusted[order] = adjust_sorted(q[order])
    out[ok] = adjusted
    return out


def holm(pvalues) -> np.ndarray:
    """Holm step-down adjusted p-values (controls the family-wise error rate). NaN entries
    are not part of the family and stay NaN. Reject H_i at level α iff adjusted p_i ≤ α.

    Adjusted p_(i) = max_{j ≤ i} min(1, (m − j + 1) p_(j)) over the sorted p-values."""
    def step_down(q):
        m = len(q)
        return np.maximum.accumulate(np.minimum(1.0, (m - np.arange(m)) * q))
    return _adjust(pvalues, step_down)


def benjamini_hochberg(pvalues) -> np.ndarray:
    """Benjamini-Hochberg adjusted p-values (controls the false discovery rate under
    independence or positive dependence). NaN entries stay NaN and are not counted.

    Adjusted p_(i) = min_{j ≥ i} min(1, m p_(j) / j) over the sorted p-values."""
    def step_up(q):
        m = len(q)
        return np.minimum.accumulate(np.minimum(1.0, q * m / np.arange(1, m + 1))[::-1])[::-1]
    return _adjust(pvalues, step_up)


# --- bootstrap ---------------------------------------------------------------------------
def mean_ci(values: pd.Series, level: float = 0.95) -> tuple[float, float, float]:
    """Mean and Student-t confidence interval of the mean."""
    x = np.asarray(values, dtype=float)
    mean = float(x.mean())
    if len(x) < 2:
        return mean, float("nan"), float("nan")
    half = float(_sps.t.ppf((1 + level) / 2, len(x) - 1) * x.std(ddof=1) / np.sqrt(len(x)))
    return mean, mean - half, mean + half


def bootstrap_ci(values, statistic: str = "mean", level: float = 0.95, n_boot: int = 2000,
                 seed: int | np.random.Generator = 0) -> tuple[float, float]:
    """Percentile bootstrap confidence interval (low, high) of the mean or median of values.

    n_boot resamples of size n with replacement, drawn at once from an explicit Generator
    (seed: an int keying a PCG64 stream, or a Generator). NaNs are dropped; an empty sample
    gives (nan, nan)."""
    if statistic not in STATISTICS:
        raise ValueError(f"unknown statistic {statistic!r}; valid: {', '.join(STATISTICS)}")
    if not 0 < level < 1:
        raise ValueError(f"level {level!r} must lie in (0, 1)")
    if n_boot < 1:
        raise ValueError(f"n_boot {n_boot!r} must be a positive integer")
    x = _finite(values)
    if len(x) == 0:
        return (np.nan, np.nan)
    gen = as_generator(seed, "bootstrap")
    samples = x[gen.integers(0, len(x), size=(n_boot, len(x)))]
    reps = samples.mean(axis=1) if statistic == "mean" else np.median(samples, axis=1)
    tail = (1 - level) / 2
    low, high = np.quantile(reps, [tail, 1 - tail])
    return float(low), float(high)


# --- effect size -------------------------------------------------------------------------
def cliffs_delta(a, b) -> float:
    """Cliff's δ = (#{a_i > b_j} − #{a_i < b_j}) / (n_a n_b) ∈ [−1, 1]; positive when a tends
    to exceed b. Counted with sorting and binary search, O((n_a + n_b) log n_b)."""
    x, y = _finite(a), _finite(b)
    if len(x) == 0 or len(y) == 0:
        return float("nan")
    y = np.sort(y)
    greater = np.searchsorted(y, x, side="left").sum()  # b_j strictly below each a_i
    less = (len(y) - np.searchsorted(y, x, side="right")).sum()  # b_j strictly above
    return float((greater - less) / (len(x) * len(y)))


# --- equivalence -------------------------------------------------------------------------
@dataclass(frozen=True)
class TostResult:
    """Two one-sided Welch t-tests of H0: |mean_a − mean_b| ≥ margin against H1: inside the
    margin. `equivalent` iff p_value = max(p_lower, p_upper) ≤ alpha."""
    difference: float
    margin: float
    p_lower: float
    p_upper: float
    p_value: float
    alpha: float
    equivalent: bool
    n_a: int
    n_b: int

    def to_row(self) -> dict:
        return asdict(self)


def tost(a, b, margin: float, alpha: float = ALPHA, paired: bool = False) -> TostResult:
    """TOST equivalence test for the difference of means with the stated absolute margin
    δ > 0 (in the metric's units): lower test H0: Δ ≤ −δ, upper test H0: Δ ≥ δ,
    Δ = mean_a − mean_b (Schuirmann 1987). Unpaired: Welch t (unequal variances, NaNs
    dropped). paired=True: a and b are matched trial by trial (same data), the t-test is on
    the differences a_i − b_i (pairs with a NaN dropped). Zero variance: equivalent iff
    |Δ| < δ (p = 0), else p = 1."""
    if not np.isfinite(margin) or margin <= 0:
        raise ValueError(f"margin {margin!r} must be a positive finite number")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha {alpha!r} must lie in (0, 1)")
    if paired:
        xa, xb = np.asarray(a, dtype=float).ravel(), np.asarray(b, dtype=float).ravel()
        if xa.shape != xb.shape:
            raise ValueError(f"paired samples need equal lengths, got {len(xa)} and {len(xb)}")
        d = xa - xb
        d = d[~np.isnan(d)]
        n_a = n_b = len(d)
        if n_a < 2:
            return TostResult(np.nan, margin, np.nan, np.nan, np.nan, alpha, False, n_a, n_b)
        diff, se, df = float(d.mean()), float(d.std(ddof=1) / np.sqrt(n_a)), n_a - 1
    else:
        x, y = _finite(a), _finite(b)
        n_a, n_b = len(x), len(y)
        if n_a < 2 or n_b < 2:
            return TostResult(np.nan, margin, np.nan, np.nan, np.nan, alpha, False, n_a, n_b)
        diff = float(x.mean() - y.mean())
        va, vb = x.var(ddof=1) / n_a, y.var(ddof=1) / n_b
        se = float(np.sqrt(va + vb))
        # Welch–Satterthwaite degrees of freedom
        df = (va + vb) ** 2 / (va ** 2 / (n_a - 1) + vb ** 2 / (n_b - 1)) if se > 0 else np.inf
    if not np.isfinite(diff):
        return TostResult(diff, float(margin), 1.0, 1.0, 1.0, alpha, False, n_a, n_b)
    if se == 0:
        p_lower = 0.0 if diff > -margin else 1.0
        p_upper = 0.0 if diff < margin else 1.0
    else:
        p_lower = float(_sps.t.sf((diff + margin) / se, df))
        p_upper = float(_sps.t.cdf((diff - margin) / se, df))
    p = max(p_lower, p_upper)
    return TostResult(diff, float(margin), p_lower, p_upper, p, alpha, p <= alpha, n_a, n_b)
