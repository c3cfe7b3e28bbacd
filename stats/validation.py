"""The implementation null and verdicts: is a difference between two configurations a property
of the codec or of the implementation (RNG family, seed, implementation, device, dtype)?

Samples are per-trial frames (columns as harness/store.py TRIAL_COLUMNS) of one cell each.

The test family of one comparison X vs Y: a two-sample KS test on each of the six error
coordinates (stats.metrics.SIX_D) and the energy-distance permutation test on the six-D
points (coordinates divided by one common scale: the pooled standard deviation over every
sample of the validation, so statistics of different comparisons are on the same footing);
Holm's correction over the 7 p-values. The family *rejects* when any Holm-adjusted p ≤ α.

Null comparisons X vs X′ differ from X only in an implementation variable (IMPLEMENTATION
VARIABLES). The decision rule (conservative: a codec difference needs evidence beyond both
sampling noise and implementation variance):

1. `codec-difference` iff the main family rejects AND at least one rejected test separates
   beyond the null: for a KS metric, D_main − max_null D > c (c: the asymptotic KS critical
   distance at α/7); for energy, √E_main − max_null √E > √q (q: the 1 − α/7 quantile of the
   main comparison's permutation distribution). KS distance and √E are metrics on
   distributions, so by the triangle inequality this means Y is separated at that level
   from every implementation variant X′ of X as well, not only from X.
2. `implementation-variance` iff the main family rejects but nothing separates beyond the
   null: the difference is of the size that implementation changes produce.
3. `equivalent` iff the main family does not reject AND a TOST on the mean of every six-D
   metric is inside ±margin·|pooled mean| (relative margin, default 10 %) at level α
   (intersection-union test: no multiplicity correction needed). The TOST is paired (on
   per-trial differences) when both samples ran on the same data (`same_data`), else Welch.
4. `inconclusive` otherwise: no detected difference but equivalence not shown, or a
   detected difference with no null comparison to attribute it to (without a null, a
   difference cannot be called a codec difference: e.g. the FULL-projection TQ variants
   change their one fixed projection matrix with the seed, which alone separates runs).

The KS and energy tests assume independent samples; configurations evaluated on the same
data (same seed: schemes A and B of one run, or impl/device/dtype variants) are positively
correlated trial by trial, which in practice makes them conservative (fewer rejections).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from .cells import CELL_COLUMNS
from .energy import EnergyResult, energy_test
from .inference import holm, ks_critical_value, ks_tests, tost
from .metrics import SIX_D

IMPLEMENTATION_VARIABLES = ("impl", "rng", "seed", "device", "dtype")
VERDICTS = ("codec-difference", "implementation-variance", "equivalent", "inconclusive")
DEFAULT_MARGIN = 0.10  # TOST margin, relative to the pooled mean of each metric


def six_d_points(frame: pd.DataFrame) -> np.ndarray:
    """The six-D error points (n, 6) of a trial frame, rows with a non-finite coordinate dropped."""
    missing = [c for c in SIX_D if c not in frame.columns]
    if missing:
        raise ValueError(f"trial frame lacks six-D column(s) {', '.join(missing)}")
    x = frame[list(SIX_D)].to_numpy(dtype=float)
    return x[np.isfinite(x).all(axis=1)]


def common_scale(samples) -> np.ndarray:
    """Per-coordinate pooled standard deviation over every sample (zeros replaced by 1)."""
    pooled = np.concatenate([six_d_points(s) for s in samples])
    scale = pooled.std(axis=0) if len(pooled) > 1 else np.ones(len(SIX_D))
    return np.where(scale > 0, scale, 1.0)


@dataclass(frozen=True)
class Comparison:
    """The test family of one comparison X vs Y (see module doc)."""
    label: str
    n_a: int
    n_b: int
    ks_statistic: dict
    ks_p: dict
    energy: EnergyResult
    p_holm: dict          # Holm-adjusted p-values of the family: the six metrics and "energy"
    alpha: float

    @property
    def rejects(self) -> bool:
        return bool(np.nanmin(list(self.p_holm.values())) <= self.alpha)

    @property
    def family_size(self) -> int:
        return len(self.p_holm)

    def to_json(self) -> dict:
        return {"label": self.label, "n_a": self.n_a, "n_b": self.n_b, "rejects": self.rejects,
                "ks": dict(self.ks_p), "ks_statistic": dict(self.ks_statistic),
                "energy": {"statistic": self.energy.statistic, "p_value": self.energy.p_value,
                           "critical": self.energy.critical, "n_permutations": self.energy.n_permutations},
                "p_holm": dict(self.p_holm)}


def compare_samples(a: pd.DataFrame, b: pd.DataFrame, *, scale: np.ndarray | None = None, alpha: float = 0.05,
                    n_permutations: int = 1000, seed: int | np.random.Generator = 0, label: str = "") -> Comparison:
    """KS per six-D metric + energy test on the six-D points (divided by `scale`, default the
    pooled standard deviation of a and b), Holm over the family."""
    ks = ks_tests(a, b, SIX_D).set_index("metric")
    xa, xb = six_d_points(a), six_d_points(b)
    if len(xa) < 2 or len(xb) < 2:
        raise ValueError(f"comparison {label or 'X vs Y'} needs at least 2 finite trials per side "
                         f"(got {len(xa)} and {len(xb)})")
    if scale is None:
        scale = common_scale([a, b])
    family = len(SIX_D) + 1
    energy = energy_test(xa / scale, xb / scale, n_permutations, seed, alpha=alpha / family)
    pvalues = list(ks["p_value"]) + [energy.p_value]
    adjusted = holm(pvalues)
    names = list(SIX_D) + ["energy"]
    return Comparison(label, len(a), len(b), {m: float(ks.at[m, "statistic"]) for m in SIX_D},
                      {m: float(ks.at[m, "p_value"]) for m in SIX_D}, energy,
                      dict(zip(names, map(float, adjusted))), alpha)


@dataclass(frozen=True)
class Validation:
    """A verdict with its evidence: the main comparison, the null comparisons, the TOST
    results (one per six-D metric) and the tests that separate beyond the null."""
    verdict: str
    reason: str
    main: Comparison
    nulls: tuple = ()
    equivalence: tuple = ()
    separated: tuple = ()
    margin: float = DEFAULT_MARGIN
    alpha: float = 0.05

    def to_json(self) -> dict:
        return {"verdict": self.verdict, "reason": self.reason, "alpha": self.alpha, "margin": self.margin,
                "ks": dict(self.main.ks_p), "ks_statistic": dict(self.main.ks_statistic),
                "energy": {"statistic": self.main.energy.statistic, "p_value": self.main.energy.p_value,
                           "critical": self.main.energy.critical,
                           "n_permutations": self.main.energy.n_permutations, "squared": True},
                "p_holm": dict(self.main.p_holm), "separated_beyond_null": list(self.separated),
                "equivalence": {e["metric"]: {"difference": e["difference"], "margin": e["margin"], "paired": e["paired"],
                                              "p_value": e["p_value"], "equivalent": e["equivalent"]}
                                for e in self.equivalence},
                "null": [c.to_json() for c in self.nulls]}

    def to_row(self) -> dict:
        row = {"verdict": self.verdict, "reason": self.reason, "n_a": self.main.n_a, "n_b": self.main.n_b,
               "n_null": len(self.nulls), "energy_statistic": self.main.energy.statistic,
               "energy_p": self.main.energy.p_value, "min_p_holm": float(np.nanmin(list(self.main.p_holm.values())))}
        row.update({f"ks_p_{m}": p for m, p in self.main.ks_p.items()})
        return row


def _beyond_null(main: Comparison, nulls: list[Comparison]) -> list[str]:
    """The rejected tests of `main` that separate beyond every null comparison (rule 1)."""
    family = main.family_size
    c = ks_critical_value(main.n_a, main.n_b, main.alpha / family)
    out = []
    for m in SIX_D:
        null_d = max(n.ks_statistic[m] for n in nulls)
        if main.p_holm[m] <= main.alpha and main.ks_statistic[m] - null_d > c:
            out.append(m)
    q = np.sqrt(max(main.energy.critical, 0.0))
    null_e = max(np.sqrt(max(n.energy.statistic, 0.0)) for n in nulls)
    if main.p_holm["energy"] <= main.alpha and np.sqrt(max(main.energy.statistic, 0.0)) - null_e > q:
        out.append("energy")
    return out


def decide(main: Comparison, nulls: list[Comparison], a: pd.DataFrame, b: pd.DataFrame,
           margin: float = DEFAULT_MARGIN) -> Validation:
    """Apply the decision rule of the module doc to a main comparison and its null comparisons."""
    nulls = list(nulls)
    if main.rejects and not nulls:
        return Validation("inconclusive", f"rejected at Holm-corrected alpha {main.alpha} (min adjusted p "
                          f"{min(main.p_holm.values()):.3g}), but there is no implementation null to attribute "
                          f"the difference to; give null comparisons", main, (), (), (), margin, main.alpha)
    if main.rejects:
        separated = _beyond_null(main, nulls)
        if separated:
            return Validation("codec-difference", f"rejected at Holm-corrected alpha {main.alpha} and beyond the "
                              f"implementation null ({len(nulls)} null comparison(s)) on {', '.join(separated)}",
                              main, tuple(nulls), (), tuple(separated), margin, main.alpha)
        return Validation("implementation-variance", f"rejected at Holm-corrected alpha {main.alpha}, but no test "
                          f"separates beyond the implementation null ({len(nulls)} null comparison(s))",
                          main, tuple(nulls), (), (), margin, main.alpha)
    equivalence = []
    paired = same_data(a, b)
    if paired:
        a, b = a.sort_values("trial"), b.sort_values("trial")
    for m in SIX_D:
        pooled = np.concatenate([a[m].to_numpy(float), b[m].to_numpy(float)])
        pooled = pooled[np.isfinite(pooled)]
        size = abs(pooled.mean()) if len(pooled) else np.nan
        # an exactly reproduced tensor has zero error: then only a zero difference is equivalent
        absolute = margin * size if np.isfinite(size) and size > 0 else 1e-300
        equivalence.append({"metric": m, "paired": paired, **tost(a[m].to_numpy(float), b[m].to_numpy(float),
                                                                   absolute, main.alpha, paired=paired).to_row()})
    if all(e["equivalent"] for e in equivalence):
        return Validation("equivalent", f"no test rejects at Holm-corrected alpha {main.alpha} and every six-D mean "
                          f"is within +-{margin:.0%} (TOST)", main, tuple(nulls), tuple(equivalence), (), margin,
                          main.alpha)
    failing = [e["metric"] for e in equivalence if not e["equivalent"]]
    return Validation("inconclusive", f"no test rejects at Holm-corrected alpha {main.alpha}, but equivalence within "
                      f"+-{margin:.0%} is not shown for {', '.join(failing)}", main, tuple(nulls),
                      tuple(equivalence), (), margin, main.alpha)


def same_data(a: pd.DataFrame, b: pd.DataFrame) -> bool:
    """True when a and b were evaluated on the same draws trial by trial: one root seed and one
    RNG family, equal in both, and the same set of trial indices (the runner derives a trial's
    K, V and Q from (seed, rng, scenario, dim, seq_len, queries, trial) alone: calib_tokens
    changes only the calibration sample)."""
    columns = ("trial", "seed", "rng", "scenario", "dim", "seq_len", "queries")
    if any(c not in a.columns or c not in b.columns for c in columns):
        return False
    for c in columns[1:]:
        if a[c].nunique() != 1 or b[c].nunique() != 1 or a[c].iloc[0] != b[c].iloc[0]:
            return False
    ta, tb = np.sort(a["trial"].to_numpy()), np.sort(b["trial"].to_numpy())
    return len(ta) == len(np.unique(ta)) and np.array_equal(ta, tb)


def validate_samples(a: pd.DataFrame, b: pd.DataFrame, null_pairs=(), *, alpha: float = 0.05,
                     margin: float = DEFAULT_MARGIN, n_permutations: int = 1000,
                     seed: int = 0) -> Validation:
    """The verdict for sample a vs sample b (trial frames of one cell each) against the
    implementation null given as pairs (x, x′) of trial frames that differ only in an
    implementation variable."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha {alpha!r} must lie in (0, 1)")
    if not margin > 0:
        raise ValueError(f"margin {margin!r} must be positive (a fraction of the pooled mean)")
    null_pairs = list(null_pairs)
    scale = common_scale([a, b] + [s for pair in null_pairs for s in pair])
    main = compare_samples(a, b, scale=scale, alpha=alpha, n_permutations=n_permutations, seed=seed, label="main")
    nulls = [compare_samples(x, y, scale=scale, alpha=alpha, n_permutations=n_permutations, seed=seed + 1 + i,
                             label=f"null {i}") for i, (x, y) in enumerate(null_pairs)]
    return decide(main, nulls, a, b, margin)


def differing_variables(frame_a: pd.DataFrame, frame_b: pd.DataFrame) -> list[str]:
    """The implementation variables whose values differ between two runs' frames."""
    return [v for v in IMPLEMENTATION_VARIABLES if v in frame_a.columns and v in frame_b.columns
            and set(frame_a[v].unique()) != set(frame_b[v].unique())]


def compare_runs(frame_a: pd.DataFrame, frame_b: pd.DataFrame, null: pd.DataFrame | None = None, *,
                 alpha: float = 0.05, margin: float = DEFAULT_MARGIN, n_permutations: int = 1000,
                 seed: int = 0) -> pd.DataFrame:
    """One verdict per cell present in both runs (matched on CELL_COLUMNS: scenario, scheme,
    budget, dim, seq_len, queries, calib_tokens). `null`, optional, is a third run whose cells
    differ from frame_a's only in an implementation variable: cell by cell, frame_a vs null is
    the null comparison; without it a detected difference is `inconclusive` (module doc, rule
    4). Returns the cell columns, verdict, reason, n_a, n_b, n_null, energy_statistic,
    energy_p, min_p_holm and ks_p_<metric> per six-D metric."""
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
    columns = keys + ["verdict", "reason", "n_a", "n_b", "n_null", "energy_statistic", "energy_p", "min_p_holm"] + \
        [f"ks_p_{m}" for m in SIX_D]
    return pd.DataFrame(rows, columns=columns)
