"""The implementation null and verdicts: is a difference between two configurations a codec
difference, implementation variance, or too small to matter?

Samples are per-trial frames (columns as kvcommon/rows.py TRIAL_COLUMNS) of one cell each.
Two samples are *paired* when they ran on the same data trial by trial (same_data: one seed,
RNG family, scenario, dim, seq_len and queries, the same trial indices); others are independent.

Tests of one comparison X vs Y, twelve, on the six-D metrics m (kvcommon.rows.SIX_D):
- location of m: Δ = mean(X) − mean(Y); paired, the mean of the per-trial differences with
  SE sd/√n (t, n − 1 df); unpaired, Welch's SE and Satterthwaite's df (location_effect);
- spread of m ("sd:m"): λ = log(s(X)/s(Y)), the log ratio of the trial-to-trial spreads, s the
  mean absolute deviation from the median (Brown & Forsythe 1974's robust scale: one trial of
  extreme error moves it far less than the standard deviation), with a delete-one-trial
  jackknife SE (Miller 1968's jackknife test of scale; a paired comparison deletes the trial
  from both samples at once, so their correlation enters the SE; spread_effect). A codec that
  became noisier at the same mean error, or flaky from trial to trial, moves λ and not Δ.
The rank tests (paired Wilcoxon signed-rank, or KS), the KS test and the six-D energy test
(sign-flip when paired, permutation otherwise) are computed and reported as information.

A difference that matters. Each test has a smallest effect of interest (the *margin*):
- location: δ·σ_m, σ_m = √((var X_m + var Y_m)/2) the metric's pooled trial-to-trial standard
  deviation and δ = `margin` (default SMALLEST_EFFECT = 0.5: half a standard deviation, Cohen's
  "medium" effect). A scale in standard deviations makes the margin equally reachable on every
  metric at a given trial count (the cache errors vary ~1 % of their mean between trials, the
  output's ~10 %: a margin in percent of the mean is ~9 sd on K and V and ~1 sd on T);
- spread: |λ| ≤ log(`spread_margin`) (default SPREAD_MARGIN = 1.25: a 25 % change of the spread).
For every test three p-values: p₀ (two-sided, effect = 0), p_beyond (minimum-effect test,
H0 |effect| ≤ margin: the effect's CI lies beyond the margin when it rejects) and p_inside
(TOST, H0 |effect| ≥ margin; Schuirmann 1987).

One family per question. A command's family is every test of every cell it judges (validate:
one cell, twelve tests; compare and the report: all matched cells × twelve): Holm's step-down
adjustment of p₀ and, separately, of p_beyond over the whole family controls the family-wise
rate of a false "significant" and of a false "beyond the margin" at α (no codec-difference
anywhere in a 30-cell seed-only compare in ≥ 95 % of repetitions). Equivalence is an
intersection-union test per cell (every TOST at α; no correction needed).

Nulls. A null comparison X vs X′ differs from X only in an implementation variable
(IMPLEMENTATION_VARIABLES) and is built with the same design as the comparison it judges:
paired on the same data when that is paired (`harness validate` changes only the codec's own
seed there, or dtype/impl/device which keep the data), unpaired when that is unpaired. A null
of the other design still enters, and the reason says it is not like for like. A test beyond
its margin is *explained* by a null when that null's own test of it is significant (Holm over
the null's twelve) AND the main effect is not shown to exceed the null's (location:
H0 |Δ_main| ≤ |Δ_null| by the intersection of two one-sided t-tests on Δ_main ∓ Δ_null with
the SE of the combination, samples on the same data combined trial by trial; spread: the same on
λ with the jackknife; Holm over the main's beyond tests, per null).

Verdicts of a cell:
1. `codec-difference`: some test is beyond its margin (family Holm) and no null explains it.
   Where the two sides are one codec by construction (`validate --vary` without `--against`: the
   harness changed only an implementation variable) such a difference is the implementations':
   `implementation-discrepancy`, whose reason names the variable changed and says whether a
   null exists; a degenerate null (both sides identical, a deterministic codec under its own
   seed) is stated as such and the difference judged against the margin alone. (`compare` of two
   runs of one codec name keeps `codec-difference`: the runs' code may differ.)
2. `implementation-variance`: some test is beyond its margin, and every such test is explained
   by a null.
3. `negligible`: no test beyond its margin, some test significant (family Holm), and every
   location effect and every spread effect shown inside its margin (TOST).
4. `equivalent`: no test significant, and every location effect and every spread effect shown
   inside its margin (TOST; a spread's on the log ratio of the two sides' spreads): equivalence
   places the whole distribution of each metric's trials, not only its mean.
5. `inconclusive` otherwise: a difference beyond the margin with no null to attribute it to (a
   run without a null cannot attribute), or an effect — a mean or a spread — whose size the
   trials cannot place; the reason names each one unplaced.

Storage. When the frames carry their measured storage, every verdict states both sides' bits
per element; when they differ by more than the equal-storage tolerance (stats.equal_storage,
5 %) the reason says that the comparison is at unequal storage.

Operating characteristics: stats/operating.py measures the rule on resampled real rows of
harmless-change pairs (false alarms) with known shifts and spread changes injected (power);
harness/known_answers.py runs bugs injected into real codecs and harmless changes through
`validate` and `compare`.
"""
from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from scipy import stats as _sps
from scipy.spatial.distance import cdist

from kvcommon.rows import CELL_COLUMNS, SIX_D
from .energy import EnergyResult, energy_test, paired_energy_test
from .equal_storage import TOLERANCE, storage_column
from .inference import holm, wilcoxon_signed_rank
from .margins import ALPHA, SMALLEST_EFFECT, SPREAD_MARGIN

IMPLEMENTATION_VARIABLES = ("impl", "rng", "seed", "device", "dtype")
VERDICTS = ("codec-difference", "implementation-variance", "negligible", "equivalent", "inconclusive",
            "implementation-discrepancy")
# the verdicts that say two sides differ beyond the margin by something no null explains: between two
# codecs a codec difference, between one codec's two implementations a discrepancy of theirs
FLAGGED = ("codec-difference", "implementation-discrepancy")
PAIRED_TESTS = "paired: t on the differences + jackknife scale"
UNPAIRED_TESTS = "unpaired: Welch t + jackknife scale"
# a trial's K, V and Q are a function of these and the trial index alone (harness/cell.py)
DATA_COLUMNS = ("seed", "rng", "scenario", "dim", "seq_len", "queries")


def six_d_points(frame: pd.DataFrame) -> np.ndarray:
    """The six-D error points (n, 6) of a trial frame, rows with a non-finite coordinate dropped."""
    missing = [c for c in SIX_D if c not in frame.columns]
    if missing:
        raise ValueError(f"trial frame lacks six-D column(s) {', '.join(missing)}")
    x = frame[list(SIX_D)].to_numpy(dtype=float)
    return x[np.isfinite(x).all(axis=1)]


def _data_key(frame: pd.DataFrame) -> tuple | None:
    """What the trials of `frame` were drawn from: the DATA_COLUMNS values and the trial
    indices, or None when a column is missing or not constant, or a trial index repeats."""
    if any(c not in frame.columns for c in DATA_COLUMNS + ("trial",)) or len(frame) == 0:
        return None
    values = []
    for c in DATA_COLUMNS:
        column = frame[c].to_numpy()
        if not (column == column[0]).all():
            return None
        values.append(column[0].item() if isinstance(column[0], np.generic) else column[0])
    trials = np.sort(frame["trial"].to_numpy())
    if (np.diff(trials) == 0).any():
        return None
    return tuple(values) + (tuple(trials.tolist()),)


def same_data(a: pd.DataFrame, b: pd.DataFrame) -> bool:
    """True when a and b were evaluated on the same draws trial by trial: one root seed and one
    RNG family, equal in both, and the same set of trial indices (the runner derives a trial's
    K, V and Q from (seed, rng, scenario, dim, seq_len, queries, trial) alone: calib_tokens
    changes only the calibration sample)."""
    key = _data_key(a)
    return key is not None and key == _data_key(b)


@dataclass(frozen=True, eq=False)
class TrialSample:
    """One sample's six-D values (n, 6) in trial order (NaN where a value is not finite) and
    the key of the data it ran on: samples with equal keys ran on the same draws trial by trial
    (same_data: correlated row by row); samples with different keys are independent."""
    key: tuple
    values: np.ndarray

    @classmethod
    def of(cls, frame) -> "TrialSample":
        """The TrialSample of a trial frame (or the TrialSample itself)."""
        if isinstance(frame, TrialSample):
            return frame
        missing = [c for c in SIX_D if c not in frame.columns]
        if missing:
            raise ValueError(f"trial frame lacks six-D column(s) {', '.join(missing)}")
        if "trial" in frame.columns:
            frame = frame.sort_values("trial", kind="stable")
        values = frame[list(SIX_D)].to_numpy(dtype=float)
        values = np.where(np.isfinite(values), values, np.nan)
        key = _data_key(frame)
        if key is None:
            # no provenance: only an identical sample is the same random variable
            key = ("content", hashlib.sha1(values.tobytes()).hexdigest(), values.shape)
        return cls(key, values)

    @property
    def finite(self) -> np.ndarray:
        """The rows (n, 6) without a non-finite coordinate."""
        return self.values[np.isfinite(self.values).all(axis=1)]


def common_scale(samples) -> np.ndarray:
    """Per-coordinate pooled standard deviation over every sample (trial frames or
    TrialSamples; zeros replaced by 1)."""
    pooled = np.concatenate([TrialSample.of(s).finite for s in samples])
    scale = pooled.std(axis=0) if len(pooled) > 1 else np.ones(len(SIX_D))
    return np.where(scale > 0, scale, 1.0)


# --- effects -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Effect:
    """An effect estimate, its standard error and degrees of freedom (inf: normal reference)."""
    estimate: float
    se: float
    df: float

    def p_positive(self) -> float:
        """One-sided p-value of H0: true value ≤ 0 (t with df degrees of freedom; zero
        standard error: 0 when the estimate is positive, else 1)."""
        if not np.isfinite(self.estimate):
            return 1.0
        if not self.se > 0:
            return 0.0 if self.estimate > 0 else 1.0
        return float(_sps.t.sf(self.estimate / self.se, self.df) if np.isfinite(self.df)
                     else _sps.norm.sf(self.estimate / self.se))

    def to_json(self) -> dict:
        """Plain JSON: non-finite numbers (df = inf: the normal reference; nan: no estimate) as null."""
        return {k: float(v) if np.isfinite(v) else None for k, v in
                (("estimate", self.estimate), ("se", self.se), ("df", self.df))}


def _groups(samples) -> dict:
    """Distinct samples (by identity) grouped by data key, in first-seen order."""
    groups: dict = {}
    for s in samples:
        members = groups.setdefault(s.key, [])
        if not any(s is m for m in members):
            members.append(s)
    return groups


def location_effect(terms, column: int) -> Effect:
    """Σ c · mean(sample[:, column]) over terms (c, TrialSample) (module doc, 'Effects').
    Samples on the same data (equal keys) are combined trial by trial, so their correlation
    (and a sample appearing in two comparisons) enters the standard error exactly; groups on
    different data are independent and their variances add, with Satterthwaite's degrees of
    freedom (for one sample per group this is Welch's test)."""
    coefs: dict = {}
    for coef, sample in terms:
        coefs[id(sample)] = coefs.get(id(sample), 0.0) + coef
    estimate, variance, df_denominator = 0.0, 0.0, 0.0
    for members in _groups([s for _, s in terms]).values():
        combo = sum(coefs[id(s)] * s.values[:, column] for s in members)
        combo = combo[np.isfinite(combo)]
        if len(combo) < 2:
            return Effect(np.nan, np.nan, np.nan)
        v = float(combo.var(ddof=1)) / len(combo)
        estimate += float(combo.mean())
        variance += v
        df_denominator += v ** 2 / (len(combo) - 1)
    df = variance ** 2 / df_denominator if df_denominator > 0 else np.inf
    return Effect(estimate, float(np.sqrt(variance)), float(df))


def energy_effect(terms, scale: np.ndarray) -> Effect:
    """Σ c · E_U(x, y) over terms (c, x, y) of TrialSamples (module doc, 'Effects'): E_U is the
    unbiased (U-statistic) squared energy distance of the six-D points divided by `scale`,
    leaving out the i = j cross pairs when x and y ran on the same data (they are correlated).
    Standard error: the delete-one-trial jackknife, a trial deleted from every sample on its
    data at once, summed over independent data groups; normal reference (df = inf)."""
    samples = [s for _, x, y in terms for s in (x, y)]
    groups = _groups(samples)
    # a trial enters only when every sample on its data has all six coordinates there
    keep = {key: np.logical_and.reduce([np.isfinite(s.values).all(axis=1) for s in members])
            for key, members in groups.items()}
    points = {id(s): s.values[keep[s.key]] / scale for s in samples}
    sizes = {key: int(k.sum()) for key, k in keep.items()}
    if min(sizes.values()) < 3:
        return Effect(np.nan, np.nan, np.nan)
    estimate, replicates = 0.0, {key: np.zeros(n) for key, n in sizes.items()}
    for coef, x, y in terms:
        full, leave_one_out = _energy_u(points[id(x)], points[id(y)], x.key, y.key)
        estimate += coef * full
        for key in replicates:
            replicates[key] += coef * leave_one_out.get(key, full)
    variance = sum((n - 1) / n * float(((r - r.mean()) ** 2).sum()) for n, r in
                   ((sizes[key], r) for key, r in replicates.items()))
    return Effect(float(estimate), float(np.sqrt(variance)), np.inf)


def _energy_u(x: np.ndarray, y: np.ndarray, key_x, key_y) -> tuple[float, dict]:
    """E_U(x, y) and, per data key of x and y, its values with one trial of that data left
    out (arrays over the trials)."""
    paired = key_x == key_y
    dxy, dxx, dyy = cdist(x, y), cdist(x, x), cdist(y, y)
    n_x, n_y = len(x), len(y)
    diag = np.diag(dxy) if paired else 0.0
    cross = dxy.sum() - (diag.sum() if paired else 0.0)
    n_cross = n_x * n_y - (n_x if paired else 0)
    within_x, within_y = dxx.sum(), dyy.sum()

    def energy(cross, n_cross, within_x, m_x, within_y, m_y):
        return 2 * cross / n_cross - within_x / (m_x * (m_x - 1)) - within_y / (m_y * (m_y - 1))
    full = float(energy(cross, n_cross, within_x, n_x, within_y, n_y))
    out = {}
    if paired:
        cross_t = cross - (dxy.sum(axis=1) - diag) - (dxy.sum(axis=0) - diag)
        out[key_x] = energy(cross_t, (n_x - 1) * (n_y - 1) - (n_x - 1), within_x - 2 * dxx.sum(axis=1), n_x - 1,
                            within_y - 2 * dyy.sum(axis=1), n_y - 1)
    else:
        out[key_x] = energy(cross - dxy.sum(axis=1), (n_x - 1) * n_y, within_x - 2 * dxx.sum(axis=1), n_x - 1,
                            within_y, n_y)
        out[key_y] = energy(cross - dxy.sum(axis=0), n_x * (n_y - 1), within_x, n_x,
                            within_y - 2 * dyy.sum(axis=1), n_y - 1)
    return full, out


# --- spread ----------------------------------------------------------------------------------
def _log_spread(x: np.ndarray) -> tuple[float, np.ndarray]:
    """log of x's spread — the mean absolute deviation from the median, Brown & Forsythe's (1974)
    robust scale — and its n delete-one values. A trial of extreme error moves it far less than
    the standard deviation, whose jackknife SE understates its variance on heavy-tailed errors
    (sd ratios of 0.26 between two seeds of h2o on heavy_tail at 30 trials: 2 false
    codec-differences in 20 seed-only compares of 30 cells). Zero spread gives −inf."""
    n = len(x)
    full = float(np.mean(np.abs(x - np.median(x))))
    rest = np.broadcast_to(x, (n, n))[~np.eye(n, dtype=bool)].reshape(n, n - 1)
    left = np.mean(np.abs(rest - np.median(rest, axis=1, keepdims=True)), axis=1)
    with np.errstate(divide="ignore"):
        return float(np.log(full)), np.log(np.maximum(left, np.finfo(float).tiny))


def spread_effect(terms, column: int) -> Effect:
    """Σ c · log(spread(x)/spread(y)) of six-D column `column` over terms (c, x, y) of TrialSamples
    (spread: _log_spread), with the delete-one-trial jackknife SE (Miller 1968): a trial is deleted
    from every sample on its
    data at once (samples on the same data are correlated trial by trial), the groups on
    different data are independent and their variances add; normal reference (df = inf). A
    sample of zero spread: a term 0 when both sides have none, else an infinite estimate."""
    coefs: dict = {}
    for c, x, y in terms:
        coefs[id(x)] = coefs.get(id(x), 0.0) + c
        coefs[id(y)] = coefs.get(id(y), 0.0) - c
    samples = [s for _, x, y in terms for s in (x, y)]
    estimate, pieces = 0.0, []
    for members in _groups(samples).values():
        members = [s for s in members if coefs[id(s)] != 0]
        if not members:
            continue
        keep = np.logical_and.reduce([np.isfinite(s.values[:, column]) for s in members])
        if keep.sum() < 3:
            return Effect(np.nan, np.nan, np.nan)
        logs = [(coefs[id(s)], *_log_spread(s.values[keep, column])) for s in members]
        pieces.append(logs)
    full = [(c, f) for logs in pieces for c, f, _ in logs]
    if any(np.isinf(f) for _, f in full):
        # zero spread somewhere: only the signs of the infinite parts are known
        infinite = sum(c * np.sign(f) for c, f in full if np.isinf(f))
        return Effect(0.0, 0.0, np.inf) if infinite == 0 else Effect(float(np.inf * np.sign(-infinite)), 0.0, np.inf)
    estimate = sum(c * f for c, f in full)
    variance = 0.0
    for logs in pieces:
        replicate = sum(c * loo for c, _, loo in logs)
        n = len(replicate)
        variance += (n - 1) / n * float(((replicate - replicate.mean()) ** 2).sum())
    return Effect(float(estimate), float(np.sqrt(variance)), np.inf)


def margin_p_values(effect: Effect, margin: float) -> tuple[float, float, float]:
    """(p₀, p_beyond, p_inside) of an effect (module doc): two-sided for effect = 0; the
    minimum-effect test of H0 |effect| ≤ margin (both tails at the boundary, so exact at
    margin 0 too); the TOST of H0 |effect| ≥ margin. Zero SE: 0 or 1 by the estimate alone."""
    estimate, se, df = effect.estimate, effect.se, effect.df
    if np.isnan(estimate):
        return np.nan, np.nan, np.nan
    a = abs(estimate)
    if not se > 0 or np.isinf(a):
        return (0.0 if a > 0 else 1.0, 0.0 if a > margin else 1.0, 0.0 if a < margin or a == 0 else 1.0)
    sf = (lambda z: float(_sps.t.sf(z, df))) if np.isfinite(df) else (lambda z: float(_sps.norm.sf(z)))
    return (min(1.0, 2 * sf(a / se)), min(1.0, sf((a - margin) / se) + sf((a + margin) / se)),
            sf((margin - a) / se))


def mean_difference(x, y, paired: bool) -> Effect:
    """mean(x) − mean(y) of two 1-D samples as an Effect: paired, the mean of the differences with
    SE sd/√n and n − 1 df (pairs with a NaN dropped); else Welch's SE and df (NaNs dropped)."""
    x, y = np.asarray(x, dtype=float).ravel(), np.asarray(y, dtype=float).ravel()
    if paired:
        key = ("paired", len(x))
        return location_effect([(1.0, TrialSample(key, x[:, None])), (-1.0, TrialSample(key, y[:, None]))], 0)
    return location_effect([(1.0, TrialSample(("x",), x[:, None])), (-1.0, TrialSample(("y",), y[:, None]))], 0)


def effect_ci(effect: Effect, level: float = 0.95) -> tuple[float, float]:
    """The two-sided confidence interval of an effect (t with its df, or normal)."""
    if not np.isfinite(effect.estimate) or not np.isfinite(effect.se):
        return (effect.estimate, effect.estimate) if np.isinf(effect.estimate) else (np.nan, np.nan)
    q = float(_sps.t.ppf((1 + level) / 2, effect.df) if np.isfinite(effect.df) else _sps.norm.ppf((1 + level) / 2))
    return effect.estimate - q * effect.se, effect.estimate + q * effect.se


# --- one comparison ------------------------------------------------------------------------
def spread_test(metric: str) -> str:
    """The name of the spread test of a six-D metric."""
    return f"sd:{metric}"


SPREAD_TESTS = tuple(spread_test(m) for m in SIX_D)
TESTS = SIX_D + SPREAD_TESTS


@dataclass(frozen=True)
class Comparison:
    """The tests of one comparison X vs Y (module doc). Per test (TESTS: the six location tests
    named by their metric, the six spread tests "sd:<metric>"): `estimates` (Δ or λ as Effects),
    `margins` (absolute: δ·σ_m, or log of the spread margin), `p_zero`, `p_beyond`, `p_inside`;
    `p_holm` Holm over this comparison's twelve p_zero (a null's own significance). Information:
    `p` (paired Wilcoxon or KS per metric), `ks_p`, `ks_statistic`, the energy test and
    `effects` (location effects and E_U under "energy"). `samples`: the two TrialSamples and the
    common scale, for effects that combine comparisons."""
    label: str
    n_a: int
    n_b: int
    paired: bool
    p: dict
    ks_statistic: dict
    ks_p: dict
    energy: EnergyResult
    effects: dict
    estimates: dict
    margins: dict
    sigma: dict
    means: dict
    p_zero: dict
    p_beyond: dict
    p_inside: dict
    p_holm: dict
    alpha: float
    samples: tuple = field(default=(), repr=False, compare=False)

    @property
    def tests(self) -> str:
        return PAIRED_TESTS if self.paired else UNPAIRED_TESTS

    @property
    def rejects(self) -> bool:
        """Some test significant, Holm over this comparison's twelve."""
        return any(p <= self.alpha for p in self.p_holm.values())

    def significant(self, test: str) -> bool:
        return self.p_holm[test] <= self.alpha

    def to_json(self) -> dict:
        return {"label": self.label, "n_a": self.n_a, "n_b": self.n_b, "paired": self.paired, "tests": self.tests,
                "rejects": self.rejects, "p": dict(self.p), "ks": dict(self.ks_p),
                "ks_statistic": dict(self.ks_statistic),
                "energy": {"statistic": self.energy.statistic, "p_value": self.energy.p_value,
                           "critical": self.energy.critical, "n_permutations": self.energy.n_permutations,
                           "test": self.energy.test},
                "p_holm": dict(self.p_holm), "effects": {t: e.to_json() for t, e in self.estimates.items()}}


def _ks(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """KS statistic and p-value per column of x (n_x, k) vs y (n_y, k), NaNs dropped per column
    (stats.inference.ks_tests, at once where no column has a NaN)."""
    with warnings.catch_warnings():
        # scipy warns when its exact recursion fails and it switches to the asymptotic
        # distribution (nearly identical samples); the fallback is the documented behaviour
        warnings.filterwarnings("ignore", "ks_2samp: Exact calculation unsuccessful", RuntimeWarning)
        if len(x) and len(y) and not (np.isnan(x).any() or np.isnan(y).any()):
            r = _sps.ks_2samp(x, y, axis=0)
            return np.asarray(r.statistic, dtype=float), np.asarray(r.pvalue, dtype=float)
        statistic, p = np.full(x.shape[1], np.nan), np.full(x.shape[1], np.nan)
        for j in range(x.shape[1]):
            u, v = x[:, j][~np.isnan(x[:, j])], y[:, j][~np.isnan(y[:, j])]
            if len(u) and len(v):
                r = _sps.ks_2samp(u, v)
                statistic[j], p[j] = r.statistic, r.pvalue
        return statistic, p


def _pooled_sd(x: np.ndarray, y: np.ndarray) -> float:
    """√((var x + var y)/2) of the finite values (ddof 1)."""
    x, y = x[np.isfinite(x)], y[np.isfinite(y)]
    if len(x) < 2 or len(y) < 2:
        return np.nan
    return float(np.sqrt((x.var(ddof=1) + y.var(ddof=1)) / 2))


def compare_samples(a, b, *, scale: np.ndarray | None = None, alpha: float = ALPHA, margin: float = SMALLEST_EFFECT,
                    spread_margin: float = SPREAD_MARGIN, n_permutations: int = 1000,
                    seed: int | np.random.Generator = 0, label: str = "") -> Comparison:
    """The tests of a vs b (trial frames or TrialSamples; module doc): paired when they ran on
    the same data, else unpaired. margin: the location margin in pooled standard deviations;
    spread_margin: the largest spread ratio of no interest. The six-D points are divided by `scale`
    (default the pooled standard deviation of a and b) before the energy test."""
    name = label or "X vs Y"
    sa, sb = TrialSample.of(a), TrialSample.of(b)
    if scale is None:
        scale = common_scale([sa, sb])
    paired = sa.key == sb.key and sa.key[0] != "content"
    ks_statistic, ks_p = _ks(sa.values, sb.values)
    if paired:
        # both in trial order: pair i is trial i of each
        p = wilcoxon_signed_rank(pd.DataFrame(sa.values, columns=list(SIX_D)),
                                 pd.DataFrame(sb.values, columns=list(SIX_D)), SIX_D)["p_value"].to_numpy()
        finite = np.isfinite(sa.values).all(axis=1) & np.isfinite(sb.values).all(axis=1)
        xa, xb = sa.values[finite], sb.values[finite]
        if len(xa) < 3:
            raise ValueError(f"comparison {name} needs at least 3 finite paired trials (got {len(xa)})")
        energy = paired_energy_test(xa / scale, xb / scale, n_permutations, seed, alpha=alpha)
    else:
        p = ks_p
        xa, xb = sa.finite, sb.finite
        if len(xa) < 3 or len(xb) < 3:
            raise ValueError(f"comparison {name} needs at least 3 finite trials per side "
                             f"(got {len(xa)} and {len(xb)})")
        energy = energy_test(xa / scale, xb / scale, n_permutations, seed, alpha=alpha)
    effects = {m: location_effect([(1.0, sa), (-1.0, sb)], j) for j, m in enumerate(SIX_D)}
    effects["energy"] = energy_effect([(1.0, sa, sb)], scale)
    estimates, margins, sigma, means = {}, {}, {}, {}
    for j, m in enumerate(SIX_D):
        sigma[m] = _pooled_sd(sa.values[:, j], sb.values[:, j])
        means[m] = (float(np.nanmean(sa.values[:, j])), float(np.nanmean(sb.values[:, j])))
        estimates[m], margins[m] = effects[m], margin * sigma[m] if np.isfinite(sigma[m]) else 0.0
        estimates[spread_test(m)] = spread_effect([(1.0, sa, sb)], j)
        margins[spread_test(m)] = float(np.log(spread_margin))
    p_zero, p_beyond, p_inside = {}, {}, {}
    for t in TESTS:
        p_zero[t], p_beyond[t], p_inside[t] = margin_p_values(estimates[t], margins[t])
    p_holm = dict(zip(TESTS, map(float, holm([p_zero[t] for t in TESTS]))))
    return Comparison(label, len(sa.values), len(sb.values), paired, dict(zip(SIX_D, map(float, p))),
                      dict(zip(SIX_D, map(float, ks_statistic))), dict(zip(SIX_D, map(float, ks_p))), energy,
                      effects, estimates, margins, sigma, means, p_zero, p_beyond, p_inside, p_holm, alpha,
                      (sa, sb, scale))


def exceeds_null(main: Comparison, null: Comparison, test: str) -> dict:
    """The test of H0 'the main effect is no larger than the null's' on one test (module doc,
    'Nulls'): with s = sign(main effect), the intersection of the one-sided tests of
    s(E_main − E_null) > 0 and s(E_main + E_null) > 0, p the larger of the two; E the location
    effect Δ or the log spread ratio λ, the combinations' SEs computed on the samples jointly."""
    (xm, ym, _), (xn, yn, _) = main.samples, null.samples
    s = float(np.sign(main.estimates[test].estimate))
    if test in SPREAD_TESTS:
        j = SIX_D.index(test[3:])
        minus = spread_effect([(s, xm, ym), (-s, xn, yn)], j)
        plus = spread_effect([(s, xm, ym), (s, xn, yn)], j)
    else:
        j = SIX_D.index(test)
        minus = location_effect([(s, xm), (-s, ym), (-s, xn), (s, yn)], j)
        plus = location_effect([(s, xm), (-s, ym), (s, xn), (-s, yn)], j)
    p = max(minus.p_positive(), plus.p_positive()) if s != 0 else 1.0
    return {"null": null.label, "effect_null": null.estimates[test].estimate, "minus": minus.to_json(),
            "plus": plus.to_json(), "p_value": p}


# --- the verdict ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Validation:
    """A verdict with its evidence: the main comparison, its nulls, the family-adjusted
    p-values (`p_holm`: of p₀; `p_holm_beyond`: of p_beyond; Holm over `family_size` tests),
    the beyond-null tests (one row per test beyond its margin), the tests no null explains
    (`separated`), and each side's measured storage (`storage`, or None)."""
    verdict: str
    reason: str
    main: Comparison
    nulls: tuple = ()
    p_holm: dict = field(default_factory=dict)
    p_holm_beyond: dict = field(default_factory=dict)
    family_size: int = len(TESTS)
    separated: tuple = ()
    beyond: tuple = ()
    storage: dict | None = None
    margin: float = SMALLEST_EFFECT
    spread_margin: float = SPREAD_MARGIN
    alpha: float = ALPHA

    @property
    def beyond_margin(self) -> list[str]:
        """The tests whose effect is beyond its margin (family-adjusted minimum-effect test)."""
        return [t for t in TESTS if self.p_holm_beyond.get(t, np.nan) <= self.alpha]

    def effect_rows(self) -> dict:
        """Per test: the effect, its 95 % CI, the margin, standardised and relative sizes and the
        three p-values (p₀ and p_beyond family-adjusted), as plain JSON."""
        main, out = self.main, {}
        for t in TESTS:
            e = main.estimates[t]
            low, high = effect_ci(e)
            row = {**e.to_json(), "ci95": [_plain(low), _plain(high)], "margin": _plain(main.margins[t]),
                   "p_zero_holm": _plain(self.p_holm.get(t)), "p_beyond_holm": _plain(self.p_holm_beyond.get(t)),
                   "p_inside": _plain(main.p_inside[t])}
            if t in SPREAD_TESTS:
                row["kind"], row["sd_ratio"] = "spread: log(s_a / s_b), s the mean absolute deviation from the median", \
                    _plain(np.exp(e.estimate))
            else:
                sigma, (mean_a, mean_b) = main.sigma[t], main.means[t]
                row["kind"] = "location: mean_a - mean_b"
                row["standardised"] = _plain(e.estimate / sigma if sigma > 0 else np.nan)
                row["relative_to_b"] = _plain(e.estimate / mean_b if mean_b != 0 else np.nan)
                row["means"] = [_plain(mean_a), _plain(mean_b)]
            out[t] = row
        return out

    def to_json(self) -> dict:
        main = self.main
        return {"verdict": self.verdict, "reason": self.reason, "alpha": self.alpha, "margin": self.margin,
                "margin_unit": "pooled trial-to-trial standard deviations of each metric",
                "spread_margin": self.spread_margin,
                "family": {"method": "holm", "size": self.family_size, "controls": "family-wise error rate"},
                "paired": main.paired, "tests": main.tests, "p": dict(main.p),
                "ks": dict(main.ks_p), "ks_statistic": dict(main.ks_statistic),
                "energy": {"statistic": main.energy.statistic, "p_value": main.energy.p_value,
                           "critical": main.energy.critical, "n_permutations": main.energy.n_permutations,
                           "test": main.energy.test, "squared": True,
                           "unbiased": main.effects["energy"].to_json()},
                "p_holm": dict(self.p_holm), "p_holm_beyond": dict(self.p_holm_beyond),
                "effects": self.effect_rows(), "storage": self.storage,
                "separated_beyond_null": list(self.separated),
                "beyond_null": {r["test"]: {k: v for k, v in r.items() if k != "test"} for r in self.beyond},
                "equivalence": {m: {"difference": main.estimates[m].estimate, "margin": main.margins[m],
                                    "paired": main.paired, "p_value": main.p_inside[m],
                                    "equivalent": bool(main.p_inside[m] <= self.alpha)} for m in TESTS},
                "null": [c.to_json() for c in self.nulls]}

    def to_row(self) -> dict:
        main = self.main
        row = {"verdict": self.verdict, "reason": self.reason, "tests": main.tests, "n_a": main.n_a,
               "n_b": main.n_b, "n_null": len(self.nulls), "energy_statistic": main.energy.statistic,
               "energy_p": main.energy.p_value, "min_p_holm": float(np.nanmin(list(self.p_holm.values()))),
               "min_p_holm_beyond": float(np.nanmin(list(self.p_holm_beyond.values())))}
        if self.storage:
            row.update(bits_a=self.storage["a"], bits_b=self.storage["b"])
        row.update({f"ks_p_{m}": p for m, p in main.ks_p.items()})
        row.update({f"p_{m}": p for m, p in main.p.items()})
        for t in TESTS:
            low, high = effect_ci(main.estimates[t])
            row.update({f"effect_{t}": main.estimates[t].estimate, f"effect_low_{t}": low, f"effect_high_{t}": high})
        return row


def _plain(x):
    return float(x) if x is not None and np.isfinite(x) else None


def _listed(values: dict) -> str:
    return ", ".join(f"{t} (p {p:.3g})" for t, p in values.items())


def _size(main: Comparison, test: str) -> str:
    """An effect in words: 'Δ 0.012 = 1.3 sd' or 'spread ratio 1.52'."""
    e = main.estimates[test].estimate
    if test in SPREAD_TESTS:
        return f"spread ratio {np.exp(e):.3g}"
    sigma = main.sigma[test]
    return f"Δ {e:.3g} = {e / sigma:.2g} sd" if sigma > 0 else f"Δ {e:.3g}"


def _degenerate(null: Comparison) -> bool:
    """A null whose two sides are identical trial by trial (every effect 0 with no error): a
    deterministic codec under a change of its own seed or RNG draws nothing to vary."""
    return all(null.estimates[t].estimate == 0 and not null.estimates[t].se for t in TESTS)


def decide(main: Comparison, nulls: list[Comparison], p_holm: dict, p_holm_beyond: dict, *, family_size: int,
           margin: float = SMALLEST_EFFECT, spread_margin: float = SPREAD_MARGIN, storage: dict | None = None,
           implementation: tuple[str, ...] | None = None) -> Validation:
    """Apply the decision rule of the module doc to a main comparison, its null comparisons and
    the main's family-adjusted p-values (p_holm of p₀, p_holm_beyond of p_beyond); implementation:
    the variables changed where both sides are one codec by construction (validate --vary), None
    where they may be two (another codec, or runs whose code may differ)."""
    nulls, alpha = list(nulls), main.alpha
    evidence = dict(main=main, nulls=tuple(nulls), p_holm=p_holm, p_holm_beyond=p_holm_beyond,
                    family_size=family_size, storage=storage, margin=margin, spread_margin=spread_margin,
                    alpha=alpha)
    family = f"Holm over a family of {family_size} tests"
    unequal = _storage_words(storage)
    significant = [t for t in TESTS if p_holm.get(t, np.nan) <= alpha]
    beyond_margin = Validation("", "", main, p_holm_beyond=p_holm_beyond, alpha=alpha).beyond_margin
    margins = f"margins {margin:g} sd, spread ratio {spread_margin:g}"
    if beyond_margin:
        found = (f"beyond the smallest effect of interest ({margins}; {family}) on "
                 + ", ".join(f"{t} ({_size(main, t)}, p {p_holm_beyond[t]:.3g})" for t in beyond_margin))
        changed = ", ".join(implementation) if implementation else "an implementation variable"
        if not nulls:
            if implementation is not None:   # one codec on both sides: the difference can only be the implementation's
                return Validation("implementation-discrepancy", f"a difference {found}; both sides are the same codec, "
                                  f"so it is the implementations' ({changed} changed), with no null to compare its size "
                                  f"with: judged against the margin alone" + unequal, separated=tuple(beyond_margin),
                                  **evidence)
            return Validation("inconclusive", f"a difference {found}, but there is no implementation null to "
                              f"attribute it to: without one a run cannot tell codec from implementation" + unequal,
                              **evidence)
        beyond = []
        for test in beyond_margin:
            rows = [exceeds_null(main, n, test) for n in nulls]
            beyond.append({"test": test, "effect": main.estimates[test].to_json(),
                           "p_value": max(r["p_value"] for r in rows), "nulls": rows})
        for row, q in zip(beyond, holm([r["p_value"] for r in beyond])):
            row["p_holm"] = float(q)
        for i in range(len(nulls)):  # each null's beyond-null p-values, Holm over the tests beyond the margin
            for row, q in zip(beyond, holm([r["nulls"][i]["p_value"] for r in beyond])):
                row["nulls"][i]["p_holm_within"] = float(q)
        beyond = tuple(beyond)
        explained = {r["test"]: [(n, row["p_value"]) for n, row in zip(nulls, r["nulls"])
                                 if n.significant(r["test"]) and row["p_holm_within"] > alpha] for r in beyond}
        unlike = [n.label for n in nulls if n.paired != main.paired]
        design = (f"; {', '.join(unlike)} {'is' if len(unlike) == 1 else 'are'} "
                  f"{'unpaired' if main.paired else 'paired'} while the main comparison is "
                  f"{'paired' if main.paired else 'unpaired'}: not a like-for-like null") if unlike else ""
        codec = [t for t in beyond_margin if not explained[t]]
        if codec and implementation is not None:
            degenerate = [n.label for n in nulls if _degenerate(n)]
            null_words = (f"the null{'s' if len(degenerate) > 1 else ''} {', '.join(degenerate)} "
                          f"{'are' if len(degenerate) > 1 else 'is'} degenerate (both sides identical trial by trial: a "
                          f"deterministic codec draws nothing to vary), so it is judged against the margin alone"
                          if len(degenerate) == len(nulls) else
                          f"no null ({len(nulls)}) shows one of that size on {', '.join(codec)}")
            return Validation("implementation-discrepancy", f"a difference {found}; both sides are the same codec, so "
                              f"it is the implementations' ({changed} changed), not the codec's; {null_words}"
                              + design + unequal, separated=tuple(codec), beyond=beyond, **evidence)
        if codec:
            return Validation("codec-difference", f"a difference {found}; no implementation change shows one of that "
                              f"size on {', '.join(codec)} ({len(nulls)} null comparison(s))" + design + unequal,
                              separated=tuple(codec), beyond=beyond, **evidence)
        said = "; ".join(f"{t}: {n.label} shows a significant effect ({_size(n, t)}) the main effect is not shown "
                         f"to exceed (p {p:.3g})" for t, rows in explained.items() for n, p in rows)
        return Validation("implementation-variance", f"a difference {found}, and a change of an implementation "
                          f"variable alone shows one of that size on each: {said}" + design + unequal,
                          beyond=beyond, **evidence)
    # every mean and every spread must be shown inside its margin (TOST; for a spread on the log
    # ratio of the two sides' spreads, jackknife SE) before a difference is called negligible or none
    unplaced = [t for t in TESTS if not main.p_inside[t] <= alpha]
    paired = "paired" if main.paired else "Welch"
    if not unplaced:
        if significant:
            return Validation("negligible", f"significant ({family}) on {_listed({t: p_holm[t] for t in significant})}"
                              f", but every mean and spread effect is shown inside its margin ({margins}; {paired} "
                              f"TOST at {alpha})" + unequal, **evidence)
        return Validation("equivalent", f"no test significant ({family}) and every mean difference shown inside "
                          f"{margin:g} sd and every spread ratio inside {spread_margin:g} ({paired} TOST at {alpha})"
                          + unequal, **evidence)
    start = (f"significant ({family}) on {', '.join(significant)} but not beyond the margin" if significant
             else f"no test significant ({family})")
    return Validation("inconclusive", f"{start}, and the trials cannot place {', '.join(unplaced)} inside the margin "
                      f"({margins}): more trials would decide" + unequal, **evidence)


def _storage_words(storage: dict | None) -> str:
    if not storage or storage.get("equal", True):
        return ""
    return (f"; at unequal storage: {storage['a']:.3g} vs {storage['b']:.3g} bits/element "
            f"({storage['relative_difference']:+.0%}, beyond the ±{TOLERANCE / 2:.1%} equal-storage tolerance): the "
            f"codecs are compared as configured, not at equal storage")


def measured_storage(a, b) -> dict | None:
    """Both sides' mean measured bits per element (stats.equal_storage.storage_column) and whether
    they are equal within the equal-storage tolerance; None when a frame does not carry them."""
    if not all(isinstance(f, pd.DataFrame) for f in (a, b)):
        return None
    if not all("bits_per_element" in f.columns for f in (a, b)):
        return None
    both = pd.concat([a, b])
    column = storage_column(both)
    bits_a, bits_b = float(a[column].mean()), float(b[column].mean())
    relative = (bits_b - bits_a) / bits_a if bits_a > 0 else np.nan
    return {"a": bits_a, "b": bits_b, "column": column, "relative_difference": relative,
            "equal": bool(abs(bits_b - bits_a) <= TOLERANCE / 2 * max(bits_a, bits_b)), "tolerance": TOLERANCE / 2}


def _check_levels(alpha: float, margin: float, spread_margin: float) -> None:
    if not 0 < alpha < 1:
        raise ValueError(f"alpha {alpha!r} must lie in (0, 1)")
    if not (np.isfinite(margin) and margin > 0):
        raise ValueError(f"margin {margin!r} must be a positive number of standard deviations")
    if not (np.isfinite(spread_margin) and spread_margin > 1):
        raise ValueError(f"spread margin {spread_margin!r} must be a finite spread ratio above 1")


def decide_family(items, *, margin: float = SMALLEST_EFFECT, spread_margin: float = SPREAD_MARGIN,
                  storages=None, implementations=None) -> list[Validation]:
    """Verdicts of several main comparisons judged as one family (module doc, 'One family per
    question'): items is a list of (main, nulls); Holm over every main's twelve p₀ and,
    separately, p_beyond; storages, optional, one measured_storage per item; implementations,
    optional, one implementation_change per item."""
    items = list(items)
    storages = list(storages) if storages is not None else [None] * len(items)
    implementations = list(implementations) if implementations is not None else [None] * len(items)
    keys = [(i, t) for i in range(len(items)) for t in TESTS]
    zero = holm([items[i][0].p_zero[t] for i, t in keys])
    beyond = holm([items[i][0].p_beyond[t] for i, t in keys])
    adjusted_zero, adjusted_beyond = {}, {}
    for (i, t), z, b in zip(keys, zero, beyond):
        adjusted_zero.setdefault(i, {})[t] = float(z)
        adjusted_beyond.setdefault(i, {})[t] = float(b)
    return [decide(main, nulls, adjusted_zero.get(i, {}), adjusted_beyond.get(i, {}), family_size=len(keys),
                   margin=margin, spread_margin=spread_margin, storage=storages[i], implementation=implementations[i])
            for i, (main, nulls) in enumerate(items)]


class _Samples:
    """One TrialSample per distinct frame (by identity), so a frame in two comparisons is one
    random variable."""

    def __init__(self):
        self.memo: dict = {}

    def __call__(self, frame) -> TrialSample:
        if id(frame) not in self.memo:
            self.memo[id(frame)] = (frame, TrialSample.of(frame))
        return self.memo[id(frame)][1]


def _comparisons(a, b, null_pairs, samples: _Samples, *, alpha, margin, spread_margin, n_permutations, seed):
    sa, sb = samples(a), samples(b)
    pairs = [(samples(x), samples(y)) for x, y in null_pairs]
    scale = common_scale([sa, sb] + [s for pair in pairs for s in pair])
    options = dict(scale=scale, alpha=alpha, margin=margin, spread_margin=spread_margin,
                   n_permutations=n_permutations)
    main = compare_samples(sa, sb, seed=seed, label="main", **options)
    nulls = [compare_samples(x, y, seed=seed + 1 + i, label=f"null {i}", **options) for i, (x, y) in enumerate(pairs)]
    return main, nulls


def validate_samples(a, b, null_pairs=(), *, alpha: float = ALPHA, margin: float = SMALLEST_EFFECT,
                     spread_margin: float = SPREAD_MARGIN, n_permutations: int = 1000, seed: int = 0,
                     implementation: tuple[str, ...] | None = None) -> Validation:
    """The verdict for sample a vs sample b (trial frames of one cell each, or TrialSamples)
    against the implementation null given as pairs (x, x′) of samples that differ only in an
    implementation variable; the family is this comparison's twelve tests. implementation: the
    variables changed where a and b are one codec by construction (decide)."""
    return validate_family([(a, b, null_pairs)], alpha=alpha, margin=margin, spread_margin=spread_margin,
                           n_permutations=n_permutations, seed=seed, implementations=[implementation])[0]


def validate_family(cases, *, alpha: float = ALPHA, margin: float = SMALLEST_EFFECT,
                    spread_margin: float = SPREAD_MARGIN, n_permutations: int = 1000, seed: int = 0,
                    implementations=None) -> list[Validation]:
    """The verdicts of several comparisons judged as one family (module doc): cases are
    (a, b, null_pairs) as for validate_samples, implementations (optional) one per case as there;
    case i draws its permutations from seed + 1000·i."""
    _check_levels(alpha, margin, spread_margin)
    items, storages = [], []
    for i, (a, b, null_pairs) in enumerate(cases):
        items.append(_comparisons(a, b, null_pairs, _Samples(), alpha=alpha, margin=margin,
                                  spread_margin=spread_margin, n_permutations=n_permutations, seed=seed + 1000 * i))
        storages.append(measured_storage(a, b))
    return decide_family(items, margin=margin, spread_margin=spread_margin, storages=storages,
                         implementations=implementations)


def differing_variables(frame_a: pd.DataFrame, frame_b: pd.DataFrame) -> list[str]:
    """The implementation variables whose values differ between two runs' frames."""
    return [v for v in IMPLEMENTATION_VARIABLES if v in frame_a.columns and v in frame_b.columns
            and set(frame_a[v].unique()) != set(frame_b[v].unique())]


ROW_COLUMNS = (["verdict", "reason", "tests", "n_a", "n_b", "n_null", "energy_statistic", "energy_p", "min_p_holm",
                "min_p_holm_beyond", "bits_a", "bits_b"] + [f"ks_p_{m}" for m in SIX_D] + [f"p_{m}" for m in SIX_D]
               + [f"effect{part}_{t}" for t in TESTS for part in ("", "_low", "_high")])


def compare_runs(frame_a: pd.DataFrame, frame_b: pd.DataFrame, null: pd.DataFrame | None = None, *,
                 alpha: float = ALPHA, margin: float = SMALLEST_EFFECT, spread_margin: float = SPREAD_MARGIN,
                 n_permutations: int = 1000, seed: int = 0) -> pd.DataFrame:
    """One verdict per cell present in both runs (matched on CELL_COLUMNS: scenario, scheme,
    budget, dim, seq_len, queries, calib_tokens), every cell's tests one family. `null`,
    optional, is a third run whose cells differ from frame_a's only in an implementation
    variable: cell by cell, frame_a vs null is the null comparison; without it a difference
    beyond the margin is `inconclusive` (module doc, rule 5). Returns the cell columns and
    ROW_COLUMNS: verdict, reason, the family used, sizes, the energy test, the smallest
    family-adjusted p-values, both sides' bits per element, per six-D metric ks_p_<metric> and
    p_<metric> (the rank test), and per test its effect with the 95 % CI (effect_<test>,
    effect_low_<test>, effect_high_<test>; the spread tests on log(sd_a/sd_b))."""
    _check_levels(alpha, margin, spread_margin)
    for name, frame in (("frame_a", frame_a), ("frame_b", frame_b)) + ((("null", null),) if null is not None else ()):
        missing = [c for c in CELL_COLUMNS + SIX_D if c not in frame.columns]
        if missing:
            raise ValueError(f"{name} lacks column(s) {', '.join(missing)}")
    keys = list(CELL_COLUMNS)
    groups_b = {k: g for k, g in frame_b.groupby(keys, sort=False)}
    groups_null = {k: g for k, g in null.groupby(keys, sort=False)} if null is not None else {}
    cells, cases = [], []
    for key, a in frame_a.groupby(keys, sort=True):
        if key in groups_b:
            cases.append((a, groups_b[key], [(a, groups_null[key])] if key in groups_null else []))
            cells.append(key)
    results = validate_family(cases, alpha=alpha, margin=margin, spread_margin=spread_margin,
                              n_permutations=n_permutations, seed=seed)
    rows = [{**dict(zip(keys, key)), **result.to_row()} for key, result in zip(cells, results)]
    return pd.DataFrame(rows, columns=keys + ROW_COLUMNS)
