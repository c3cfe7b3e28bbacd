"""The implementation null and verdicts: is a difference between two configurations a property
of the codec or of the implementation (RNG family, seed, implementation, device, dtype)?

Samples are per-trial frames (columns as harness/store.py TRIAL_COLUMNS) of one cell each.
Two samples are *paired* when they ran on the same data trial by trial (same_data: one seed,
RNG family, scenario, dim, seq_len and queries, the same trial indices); others are independent.

The test family of one comparison X vs Y, seven tests, Holm's correction over them; the family
*rejects* when any Holm-adjusted p ≤ α:
- paired ("paired: Wilcoxon signed-rank + sign-flip energy"): a Wilcoxon signed-rank test on
  the per-trial differences of each six-D metric (stats.metrics.SIX_D; all differences zero:
  p = 1) and the sign-flip energy test on the six-D points (stats.energy.paired_energy_test,
  statistic "pairs": E(X, Y) under random swaps within pairs, which sees a change of spread as
  well as a shift; E(D, −D) on the differences would miss the spread);
- unpaired ("unpaired: KS + permutation energy"): a two-sample KS test per metric and the
  permutation energy test.
The six-D points are divided by one common scale, the pooled standard deviation over every
sample of the validation, so the statistics of all comparisons are on the same footing. KS
p-values are always computed and reported (`ks`), as information.

Effects. A metric's location effect of X vs Y is Δ = mean(X) − mean(Y): paired, the mean of
the per-trial differences with SE sd/√n; unpaired, Welch's SE. Effects of several comparisons
are combined the same way (location_effect): samples on the same data are combined trial by
trial, so the correlation of paired samples, and the sample that a main and a null comparison
share (A in A vs B and in A vs A′), enter the SE exactly; independent data groups add their
variances (Satterthwaite degrees of freedom). The six-D effect is E_U(X, Y), the unbiased
squared energy distance (i = j cross pairs left out when paired), with a delete-one-trial
jackknife SE (energy_effect); it carries differences that move no mean, such as a wider spread
(sq-qkv against sq-kv at d = 64).

Null comparisons X vs X′ differ from X only in an implementation variable (IMPLEMENTATION
VARIABLES). The decision rule asks, of each test on which the main comparison rejects, whether
an implementation change alone produces a difference of that size. A rejected test is
*explained* by a null comparison when that null's own family rejects (it shows an effect at
all) AND the main effect on the test is not shown to exceed the null's effect on it. "Shown to
exceed": for metric j, H0 |μ_main| ≤ |μ_null| rejected by the intersection of two one-sided
t-tests, s(Δ_main − Δ_null) > 0 and s(Δ_main + Δ_null) > 0 with s = sign(Δ_main) (together:
|Δ_main| − |Δ_null| > t·SE with the SE of whichever combination binds, so the null's noise counts
once, not twice); for energy, H0 E_main ≤ E_null, a one-sided z-test on E_U(main) − E_U(null);
Holm over the main's rejected tests, per null.

1. `codec-difference` iff the main family rejects AND some rejected test is explained by no null
   comparison: every null either rejects nothing or has an effect the main one exceeds.
2. `implementation-variance` iff the main family rejects AND every rejected test is explained by
   some null comparison: the nulls themselves show effects of the size of the main one.
3. `equivalent` iff the main family does not reject AND a TOST on the mean of every six-D
   metric is inside ±margin·|pooled mean| (relative margin, default 10 %) at level α
   (intersection-union test: no multiplicity correction needed). The TOST is paired (on
   per-trial differences) when the samples are paired, else Welch.
4. `inconclusive` otherwise: no detected difference but equivalence not shown, or a detected
   difference with no null comparison to attribute it to (without a null, a difference cannot
   be called a codec difference: e.g. the FULL-projection TQ variants change their one fixed
   projection matrix with the seed, which alone separates runs).

Operating characteristics (stats/operating.py; the full table is in README.md, printed by
`python -m stats.operating --repetitions 200`): six-D frames of n = 40 trials, N(10, 1) in every
coordinate; a codec shift c and an implementation shift i (in standard deviations) of one
coordinate; main comparison A vs B = A + c, null comparisons A vs A + i and B vs B + i;
unpaired (four independent draws) or paired (one data draw, correlation 0.7 between frames).
A codec-difference needs a main rejection, which Holm keeps at α when A and B behave alike; with
clean nulls nearly every main rejection is one (the nulls reject in about α and, when they do,
their effect is small); when a null's effect is as large as the main one the null rejects about
as often as the main comparison does and explains it. Measured (see README for every cell):
no codec and no implementation difference: codec-difference 2 % unpaired, 4 % paired (≤ α);
c = 1, i = 0: 92 % unpaired, 99 % paired; c ≥ 2: 100 %; i = c ≥ 1: codec-difference 0–4 %,
implementation-variance 84–100 %. The price of that power: between the two (e.g. c = 1,
i = 0.5) both verdicts occur, since a null shift half the codec shift is often detected and
not always shown to be smaller.
"""
from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from scipy import stats as _sps
from scipy.spatial.distance import cdist

from .cells import CELL_COLUMNS
from .energy import EnergyResult, energy_test, paired_energy_test
from .inference import holm, tost, wilcoxon_signed_rank
from .levels import ALPHA, EQUIVALENCE_MARGIN
from .metrics import SIX_D

IMPLEMENTATION_VARIABLES = ("impl", "rng", "seed", "device", "dtype")
VERDICTS = ("codec-difference", "implementation-variance", "equivalent", "inconclusive")
PAIRED_TESTS = "paired: Wilcoxon signed-rank + sign-flip energy"
UNPAIRED_TESTS = "unpaired: KS + permutation energy"
# a trial's K, V and Q are a function of these and the trial index alone (harness/cell.py)
DATA_COLUMNS = ("seed", "rng", "scenario", "dim", "seq_len", "queries")
TESTS = SIX_D + ("energy",)


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


# --- one comparison ------------------------------------------------------------------------
@dataclass(frozen=True)
class Comparison:
    """The test family of one comparison X vs Y (module doc): `p`, the per-metric p-values of
    the test used (Wilcoxon signed-rank when paired, KS otherwise), the energy test, Holm over
    the seven; KS is always computed, as information. `effects`: per metric the location
    effect mean(X) − mean(Y), and under "energy" E_U(X, Y). `samples`: the two TrialSamples
    and the common scale, for effects that combine comparisons."""
    label: str
    n_a: int
    n_b: int
    paired: bool
    p: dict
    ks_statistic: dict
    ks_p: dict
    energy: EnergyResult
    p_holm: dict          # Holm-adjusted p-values of the family: the six metrics and "energy"
    effects: dict
    alpha: float
    samples: tuple = field(default=(), repr=False, compare=False)

    @property
    def tests(self) -> str:
        return PAIRED_TESTS if self.paired else UNPAIRED_TESTS

    @property
    def rejects(self) -> bool:
        return bool(np.nanmin(list(self.p_holm.values())) <= self.alpha)

    @property
    def rejected(self) -> list[str]:
        """The tests (six-D metrics, then "energy") rejected at Holm-adjusted alpha."""
        return [m for m in TESTS if self.p_holm[m] <= self.alpha]

    @property
    def family_size(self) -> int:
        return len(self.p_holm)

    def to_json(self) -> dict:
        return {"label": self.label, "n_a": self.n_a, "n_b": self.n_b, "paired": self.paired, "tests": self.tests,
                "rejects": self.rejects, "p": dict(self.p), "ks": dict(self.ks_p),
                "ks_statistic": dict(self.ks_statistic),
                "energy": {"statistic": self.energy.statistic, "p_value": self.energy.p_value,
                           "critical": self.energy.critical, "n_permutations": self.energy.n_permutations,
                           "test": self.energy.test},
                "p_holm": dict(self.p_holm), "effects": {m: e.to_json() for m, e in self.effects.items()}}


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


def compare_samples(a, b, *, scale: np.ndarray | None = None, alpha: float = ALPHA, n_permutations: int = 1000,
                    seed: int | np.random.Generator = 0, label: str = "") -> Comparison:
    """The test family of a vs b (trial frames or TrialSamples; module doc): paired when they
    ran on the same data, else unpaired. The six-D points are divided by `scale` (default the
    pooled standard deviation of a and b) before the energy test. Holm over the seven."""
    name = label or "X vs Y"
    sa, sb = TrialSample.of(a), TrialSample.of(b)
    if scale is None:
        scale = common_scale([sa, sb])
    family = len(TESTS)
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
        energy = paired_energy_test(xa / scale, xb / scale, n_permutations, seed, alpha=alpha / family)
    else:
        p = ks_p
        xa, xb = sa.finite, sb.finite
        if len(xa) < 3 or len(xb) < 3:
            raise ValueError(f"comparison {name} needs at least 3 finite trials per side "
                             f"(got {len(xa)} and {len(xb)})")
        energy = energy_test(xa / scale, xb / scale, n_permutations, seed, alpha=alpha / family)
    # a metric without a p-value (no finite value) stays out of the family (holm keeps NaN)
    adjusted = holm(list(p) + [energy.p_value])
    effects = {m: location_effect([(1.0, sa), (-1.0, sb)], j) for j, m in enumerate(SIX_D)}
    effects["energy"] = energy_effect([(1.0, sa, sb)], scale)
    return Comparison(label, len(sa.values), len(sb.values), paired, dict(zip(SIX_D, map(float, p))),
                      dict(zip(SIX_D, map(float, ks_statistic))), dict(zip(SIX_D, map(float, ks_p))), energy,
                      dict(zip(TESTS, map(float, adjusted))), effects, alpha, (sa, sb, scale))


def exceeds_null(main: Comparison, null: Comparison, test: str) -> dict:
    """The test of H0 'the main effect is no larger than the null's' on one test of the family
    (module doc, rule 1). A metric: H0 |μ_main| ≤ |μ_null|, with s = sign(Δ_main) the
    intersection of the one-sided tests of s(Δ_main − Δ_null) > 0 and s(Δ_main + Δ_null) > 0,
    p the larger of the two. "energy": H0 E_main ≤ E_null, one-sided on E_U(main) − E_U(null)."""
    (xm, ym, scale), (xn, yn, _) = main.samples, null.samples
    if test == "energy":
        difference = energy_effect([(1.0, xm, ym), (-1.0, xn, yn)], scale)
        return {"null": null.label, "effect_null": null.effects[test].estimate,
                "difference": difference.to_json(), "p_value": difference.p_positive()}
    j = SIX_D.index(test)
    s = float(np.sign(main.effects[test].estimate))
    minus = location_effect([(s, xm), (-s, ym), (-s, xn), (s, yn)], j)
    plus = location_effect([(s, xm), (-s, ym), (s, xn), (-s, yn)], j)
    p = max(minus.p_positive(), plus.p_positive()) if s != 0 else 1.0
    return {"null": null.label, "effect_null": null.effects[test].estimate, "minus": minus.to_json(),
            "plus": plus.to_json(), "p_value": p}


# --- the verdict ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Validation:
    """A verdict with its evidence: the main comparison, the null comparisons, the TOST
    results (one per six-D metric), the beyond-null tests (one row per test the main family
    rejects) and the tests on which the main effect exceeds every null's (rule 1)."""
    verdict: str
    reason: str
    main: Comparison
    nulls: tuple = ()
    equivalence: tuple = ()
    separated: tuple = ()
    beyond: tuple = ()
    margin: float = EQUIVALENCE_MARGIN
    alpha: float = ALPHA

    def to_json(self) -> dict:
        main = self.main
        return {"verdict": self.verdict, "reason": self.reason, "alpha": self.alpha, "margin": self.margin,
                "paired": main.paired, "tests": main.tests, "p": dict(main.p),
                "ks": dict(main.ks_p), "ks_statistic": dict(main.ks_statistic),
                "energy": {"statistic": main.energy.statistic, "p_value": main.energy.p_value,
                           "critical": main.energy.critical, "n_permutations": main.energy.n_permutations,
                           "test": main.energy.test, "squared": True},
                "p_holm": dict(main.p_holm), "effects": {m: e.to_json() for m, e in main.effects.items()},
                "separated_beyond_null": list(self.separated),
                "beyond_null": {r["test"]: {k: v for k, v in r.items() if k != "test"} for r in self.beyond},
                "equivalence": {e["metric"]: {"difference": e["difference"], "margin": e["margin"], "paired": e["paired"],
                                              "p_value": e["p_value"], "equivalent": e["equivalent"]}
                                for e in self.equivalence},
                "null": [c.to_json() for c in self.nulls]}

    def to_row(self) -> dict:
        row = {"verdict": self.verdict, "reason": self.reason, "tests": self.main.tests, "n_a": self.main.n_a,
               "n_b": self.main.n_b, "n_null": len(self.nulls), "energy_statistic": self.main.energy.statistic,
               "energy_p": self.main.energy.p_value, "min_p_holm": float(np.nanmin(list(self.main.p_holm.values())))}
        row.update({f"ks_p_{m}": p for m, p in self.main.ks_p.items()})
        row.update({f"p_{m}": p for m, p in self.main.p.items()})
        return row


def _why_not_explained(null: Comparison, row: dict) -> str:
    if not null.rejects:
        return f"{null.label} rejects nothing (min Holm p {min(null.p_holm.values()):.3g})"
    return f"{null.label} rejects, but the main effect exceeds its effect (p {row['p_value']:.3g})"


def _listed(values: dict) -> str:
    return ", ".join(f"{m} (p {p:.3g})" for m, p in values.items())


def decide(main: Comparison, nulls: list[Comparison], margin: float = EQUIVALENCE_MARGIN) -> Validation:
    """Apply the decision rule of the module doc to a main comparison and its null comparisons."""
    nulls, alpha = list(nulls), main.alpha
    evidence = dict(main=main, nulls=tuple(nulls), margin=margin, alpha=alpha)
    rejected = (f"the main comparison ({main.tests}) rejects at Holm-corrected alpha {alpha} on "
                f"{_listed({m: main.p_holm[m] for m in main.rejected})}")
    if main.rejects and not nulls:
        # rule 4: nothing to attribute the difference to
        return Validation("inconclusive", f"{rejected}, but there is no implementation null to attribute the "
                          f"difference to; give null comparisons", **evidence)
    if main.rejects:
        beyond = []
        for test in main.rejected:
            rows = [exceeds_null(main, n, test) for n in nulls]
            beyond.append({"test": test, "effect": main.effects[test].to_json(),
                           "p_value": max(r["p_value"] for r in rows), "nulls": rows})
        for row, q in zip(beyond, holm([r["p_value"] for r in beyond])):
            row["p_holm"] = float(q)
        for i in range(len(nulls)):  # each null's beyond-null p-values, Holm over the rejected tests
            for row, q in zip(beyond, holm([r["nulls"][i]["p_value"] for r in beyond])):
                row["nulls"][i]["p_holm_within"] = float(q)
        beyond = tuple(beyond)
        # a rejected test is explained by a null whose own family rejects and whose effect on that
        # test the main effect is not shown to exceed; one no null explains is the codec's (rules 1, 2)
        explained = {r["test"]: [(n, row["p_value"]) for n, row in zip(nulls, r["nulls"])
                                 if n.rejects and row["p_holm_within"] > alpha] for r in beyond}
        codec = [r["test"] for r in beyond if not explained[r["test"]]]
        if codec:
            # rule 1
            words = "; ".join(f"{r['test']}: " + ", ".join(_why_not_explained(n, row)
                                                           for n, row in zip(nulls, r["nulls"]))
                              for r in beyond if r["test"] in codec)
            return Validation("codec-difference", f"{rejected}; no implementation change shows a difference of that "
                              f"size ({len(nulls)} null comparison(s)) on {', '.join(codec)}: {words}",
                              separated=tuple(codec), beyond=beyond, **evidence)
        # rule 2
        said = "; ".join(f"{test}: {n.label} ({n.tests}) rejects (min Holm p {min(n.p_holm.values()):.3g}) and the "
                         f"main effect is not shown to exceed its effect (p {p:.3g})"
                         for test, rows in explained.items() for n, p in rows)
        return Validation("implementation-variance", f"{rejected}, and a change of an implementation variable alone "
                          f"shows a difference of that size on every rejected test: {said}", beyond=beyond,
                          **evidence)
    xa, xb = (s.values for s in main.samples[:2])
    equivalence = []
    for j, m in enumerate(SIX_D):
        pooled = np.concatenate([xa[:, j], xb[:, j]])
        pooled = pooled[np.isfinite(pooled)]
        size = abs(pooled.mean()) if len(pooled) else np.nan
        # an exactly reproduced tensor has zero error: then only a zero difference is equivalent
        absolute = margin * size if np.isfinite(size) and size > 0 else 1e-300
        equivalence.append({"metric": m, "paired": main.paired,
                            **tost(xa[:, j], xb[:, j], absolute, alpha, paired=main.paired).to_row()})
    evidence["equivalence"] = tuple(equivalence)
    quiet = f"no test of the main comparison ({main.tests}) rejects at Holm-corrected alpha {alpha}"
    if all(e["equivalent"] for e in equivalence):
        # rule 3
        return Validation("equivalent", f"{quiet} and every six-D mean is within +-{margin:.0%} "
                          f"({'paired' if main.paired else 'Welch'} TOST)", **evidence)
    failing = [e["metric"] for e in equivalence if not e["equivalent"]]
    # rule 4
    return Validation("inconclusive", f"{quiet}, but equivalence within +-{margin:.0%} is not shown for "
                      f"{', '.join(failing)}", **evidence)


def validate_samples(a, b, null_pairs=(), *, alpha: float = ALPHA, margin: float = EQUIVALENCE_MARGIN,
                     n_permutations: int = 1000, seed: int = 0) -> Validation:
    """The verdict for sample a vs sample b (trial frames of one cell each, or TrialSamples)
    against the implementation null given as pairs (x, x′) of samples that differ only in an
    implementation variable."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha {alpha!r} must lie in (0, 1)")
    if not margin > 0:
        raise ValueError(f"margin {margin!r} must be positive (a fraction of the pooled mean)")
    # one TrialSample per distinct frame, so a frame in two comparisons is one random variable
    memo: dict = {}

    def sample(frame):
        if id(frame) not in memo:
            memo[id(frame)] = (frame, TrialSample.of(frame))
        return memo[id(frame)][1]
    sa, sb = sample(a), sample(b)
    null_pairs = [(sample(x), sample(y)) for x, y in null_pairs]
    scale = common_scale([sa, sb] + [s for pair in null_pairs for s in pair])
    main = compare_samples(sa, sb, scale=scale, alpha=alpha, n_permutations=n_permutations, seed=seed, label="main")
    nulls = [compare_samples(x, y, scale=scale, alpha=alpha, n_permutations=n_permutations, seed=seed + 1 + i,
                             label=f"null {i}") for i, (x, y) in enumerate(null_pairs)]
    return decide(main, nulls, margin)


def differing_variables(frame_a: pd.DataFrame, frame_b: pd.DataFrame) -> list[str]:
    """The implementation variables whose values differ between two runs' frames."""
    return [v for v in IMPLEMENTATION_VARIABLES if v in frame_a.columns and v in frame_b.columns
            and set(frame_a[v].unique()) != set(frame_b[v].unique())]


def compare_runs(frame_a: pd.DataFrame, frame_b: pd.DataFrame, null: pd.DataFrame | None = None, *,
                 alpha: float = ALPHA, margin: float = EQUIVALENCE_MARGIN, n_permutations: int = 1000,
                 seed: int = 0) -> pd.DataFrame:
    """One verdict per cell present in both runs (matched on CELL_COLUMNS: scenario, scheme,
    budget, dim, seq_len, queries, calib_tokens). `null`, optional, is a third run whose cells
    differ from frame_a's only in an implementation variable: cell by cell, frame_a vs null is
    the null comparison; without it a detected difference is `inconclusive` (module doc, rule
    4). Returns the cell columns, verdict, reason, tests (the family used: paired or unpaired),
    n_a, n_b, n_null, energy_statistic, energy_p, min_p_holm, and per six-D metric ks_p_<metric>
    and p_<metric> (the p-value of the test used)."""
    for name, frame in (("frame_a", frame_a), ("frame_b", frame_b)) + ((("null", null),) if null is not None else ()):
        missing = [c for c in CELL_COLUMNS + SIX_D if c not in frame.columns]
        if missing:
            raise ValueError(f"{name} lacks column(s) {', '.join(missing)}")
    keys = list(CELL_COLUMNS)
    groups_b = {k: g for k, g in frame_b.groupby(keys, sort=False)}
    groups_null = {k: g for k, g in null.groupby(keys, sort=False)} if null is not None else {}
    rows = []
    for i, (key, a) in enumerate(frame_a.groupby(keys, sort=True)):
        if key not in groups_b:
            continue
        pairs = [(a, groups_null[key])] if key in groups_null else []
        result = validate_samples(a, groups_b[key], pairs, alpha=alpha, margin=margin,
                                  n_permutations=n_permutations, seed=seed + 1000 * i)
        rows.append({**dict(zip(keys, key)), **result.to_row()})
    columns = keys + ["verdict", "reason", "tests", "n_a", "n_b", "n_null", "energy_statistic", "energy_p",
                      "min_p_holm"] + [f"ks_p_{m}" for m in SIX_D] + [f"p_{m}" for m in SIX_D]
    return pd.DataFrame(rows, columns=columns)
