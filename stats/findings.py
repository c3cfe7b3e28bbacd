"""What a run found, as tidy frames: per-cell estimates, the non-dominated (Pareto) cells on
measured storage, every scheme at common storage levels (stats.equal_storage), pairwise tests
and the winner at each storage level with its verdict, and crossovers along the storage axis.
The statistics themselves come from stats/ (equal_storage, paired, inference, dominance,
validation).

Everything is computed from the stored trial rows alone. A *setting* is one
(scenario, dim, seq_len, queries, calib_tokens) (kvcommon.rows): the cells of a setting share
their data trial by trial, so its schemes are compared on the same draws, with paired tests.
No headline compares values whose storage differs by more than stats.equal_storage.TOLERANCE
(5 %): winners are ranked at a storage level, never at a nominal budget.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from kvcommon.rows import CELL_COLUMNS, SETTING_COLUMNS, SIX_D
from .dominance import crossovers, pareto_front
from .equal_storage import LEVEL, TOLERANCE, at_storage, default_levels, storage_column
from .finite import finite_cells
from .inference import holm, mean_ci
from .paired import two_sample
from .margins import ALPHA, SMALLEST_EFFECT, SPREAD_MARGIN
from .validation import margin_p_values, mean_difference, same_data, validate_family

SETTING = SETTING_COLUMNS
CELL = CELL_COLUMNS  # = SETTING[:1] + ("scheme", "budget") + SETTING[1:]
PRIMARY = "d2_t"
ESTIMATED = ("d2_t", "d2_k", "d2_v", "rel_mse_t", "rel_mse_k", "rel_mse_v", "t_rel_mse_konly",
             "t_rel_mse_vonly", "logit_rel_mse", "logit_slope", "kl_attn", "ptcosine_k", "ptcosine_v",
             "evicted_mass")
N_BOOT = 1000  # bootstrap replicates of the Pareto-front confidence and the crossover intervals
SETTING_LEVEL = list(SETTING) + [LEVEL]


def cell_estimates(trials: pd.DataFrame, metrics=ESTIMATED) -> pd.DataFrame:
    """One row per cell: n_trials, bits_per_element (measured per-cache bits, mean over trials),
    storage (the storage the comparisons use, stats.equal_storage.storage_column) and, per
    metric, the mean with its Student-t 95% confidence interval (columns m, m_low, m_high)."""
    storage = storage_column(trials)
    records = []
    for key, group in trials.groupby(list(CELL), sort=True):
        rec = dict(zip(CELL, key), n_trials=len(group), bits_per_element=float(group["bits_per_element"].mean()),
                   storage=float(group[storage].mean()))
        for m in metrics:
            rec[m], rec[f"{m}_low"], rec[f"{m}_high"] = mean_ci(group[m])
        records.append(rec)
    return pd.DataFrame.from_records(records)


def _by_scheme(group: pd.DataFrame) -> dict[str, pd.DataFrame]:
    return {s: g.sort_values("trial") for s, g in group.groupby("scheme", sort=True)}


def pairwise_tests(equal: pd.DataFrame, metric: str = PRIMARY) -> pd.DataFrame:
    """Every pair of schemes at each (setting, storage level) of an equal-storage frame
    (stats.equal_storage.at_storage): paired Wilcoxon signed-rank test and rank-biserial r when
    the two ran on the same trials (stats.validation.same_data), else Mann–Whitney U and
    Cliff's δ; Holm-adjusted over every pair at every (setting, level): one family, as the
    report's verdicts. Rows: setting, storage_level,
    scheme_a, scheme_b, mean_a, mean_b, test, paired, p_value, p_holm, effect; effect < 0 means
    scheme_a has the smaller (better) error."""
    records = []
    for key, group in equal.groupby(SETTING_LEVEL, sort=True):
        frames = _by_scheme(group)
        names = sorted(frames)
        family = []
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                x, y = frames[a][metric].to_numpy(float), frames[b][metric].to_numpy(float)
                paired = same_data(frames[a], frames[b])
                test, effect = two_sample(x, y, paired, metric)
                family.append(dict(zip(SETTING_LEVEL, key), scheme_a=a, scheme_b=b, mean_a=float(np.nanmean(x)),
                                   mean_b=float(np.nanmean(y)), test=test.test, paired=paired,
                                   p_value=test.p_value, effect=effect))
        records.extend(family)
    for rec, adj in zip(records, holm([r["p_value"] for r in records])):
        rec["p_holm"] = float(adj)
    columns = SETTING_LEVEL + ["scheme_a", "scheme_b", "mean_a", "mean_b", "test", "paired", "p_value", "p_holm",
                               "effect"]
    return pd.DataFrame.from_records(records, columns=columns)


def _pair(tests: pd.DataFrame, key: tuple, a: str, b: str) -> dict:
    """The test of a vs b at one (setting, level), effect signed as a vs b."""
    sel = tests
    for col, val in zip(SETTING_LEVEL, key):
        sel = sel[sel[col] == val]
    row = sel[(sel.scheme_a == a) & (sel.scheme_b == b)]
    sign = 1.0
    if not len(row):
        row, sign = sel[(sel.scheme_a == b) & (sel.scheme_b == a)], -1.0
    r = row.iloc[0]
    return {"test": r.test, "paired": bool(r.paired), "p_holm": float(r.p_holm), "effect": sign * float(r.effect)}


def _placement(frame: pd.DataFrame) -> str:
    """How a scheme's values at a level were obtained, in words: 'b = 3' or 'b = 2–3 interpolated'."""
    r = frame.iloc[0]
    if r.source == "measured":
        return f"b = {r.budget_low}"
    return f"b = {r.budget_low}–{r.budget_high} interpolated"


def winners(equal: pd.DataFrame, tests: pd.DataFrame, metric: str = PRIMARY) -> pd.DataFrame:
    """Per (setting, storage level): the scheme with the lowest mean metric at that storage, the
    runner-up (the next scheme at the same level, so within the storage tolerance of the
    winner), their means with Student-t 95% intervals and storages, how each was placed at the
    level (measured cell or interpolation), the test of winner vs runner-up (paired when
    paired) with its Holm p-value (one family over the report, pairwise_tests) and effect, and
    `comparison` on the smallest effect of interest of stats.validation (half the metric's
    pooled trial-to-trial sd): 'difference' when significant and the mean difference beyond the
    margin (minimum-effect test, Holm over the report's winner rows), 'negligible' when
    significant and shown inside it, 'equivalent' when not significant and shown inside it
    (TOST), else 'inconclusive'."""
    records, margins = [], []
    for key, group in equal.groupby(SETTING_LEVEL, sort=True):
        frames = _by_scheme(group)
        means = sorted((float(np.nanmean(f[metric])), s) for s, f in frames.items())
        best = means[0][1]
        mean, low, high = mean_ci(frames[best][metric])
        rec = dict(zip(SETTING_LEVEL, key), winner=best, winner_mean=mean, winner_low=low, winner_high=high,
                   winner_storage=float(frames[best].storage.mean()), winner_source=_placement(frames[best]),
                   n_schemes=len(frames))
        if len(means) > 1:
            second = means[1][1]
            mean, low, high = mean_ci(frames[second][metric])
            test = _pair(tests, key, best, second)
            rec.update(runner_up=second, runner_up_mean=mean, runner_up_low=low, runner_up_high=high,
                       runner_up_storage=float(frames[second].storage.mean()),
                       runner_up_source=_placement(frames[second]), **test, significant=test["p_holm"] < ALPHA)
            x, y = frames[best][metric].to_numpy(float), frames[second][metric].to_numpy(float)
            margin = SMALLEST_EFFECT * np.sqrt((np.nanvar(x, ddof=1) + np.nanvar(y, ddof=1)) / 2)
            _, p_beyond, p_inside = margin_p_values(mean_difference(x, y, test["paired"]), margin)
            margins.append((len(records), p_beyond, p_inside))
        else:
            rec.update(runner_up=None, runner_up_mean=np.nan, runner_up_low=np.nan, runner_up_high=np.nan,
                       runner_up_storage=np.nan, runner_up_source=None, test=None, paired=False, p_holm=np.nan,
                       effect=np.nan, significant=False, comparison="only scheme")
        records.append(rec)
    for (i, _, p_inside), p_beyond in zip(margins, holm([m[1] for m in margins])):
        rec = records[i]
        inside = p_inside <= ALPHA
        if rec["significant"]:
            rec["comparison"] = ("difference" if p_beyond <= ALPHA else "negligible" if inside else "inconclusive")
        else:
            rec["comparison"] = "equivalent" if inside else "inconclusive"
    columns = SETTING_LEVEL + ["winner", "winner_mean", "winner_low", "winner_high", "winner_storage",
                               "winner_source", "n_schemes", "runner_up", "runner_up_mean", "runner_up_low",
                               "runner_up_high", "runner_up_storage", "runner_up_source", "test", "paired", "p_holm",
                               "effect", "significant", "comparison"]
    return pd.DataFrame.from_records(records, columns=columns)


def with_front(cells: pd.DataFrame, trials: pd.DataFrame, metric: str = PRIMARY) -> pd.DataFrame:
    """cells plus `on_front` (not dominated on (measured storage, mean metric) within its
    setting) and `p_front` (the paired-bootstrap confidence of being on the front), from
    stats.dominance.pareto_front."""
    front = pareto_front(trials, error=metric, n_boot=N_BOOT, bits=storage_column(trials))
    front = front[list(SETTING) + ["scheme", "budget", "non_dominated", "p_non_dominated"]].rename(
        columns={"non_dominated": "on_front", "p_non_dominated": "p_front"})
    return cells.merge(front, on=list(SETTING) + ["scheme", "budget"], how="left", validate="one_to_one")


def _samples(equal: pd.DataFrame) -> dict[tuple, pd.DataFrame]:
    """Each (setting, level, scheme)'s rows of an equal-storage frame, in trial order."""
    return {tuple(k): g.sort_values("trial") for k, g in equal.groupby(SETTING_LEVEL + ["scheme"], sort=True)}


def validations(equal: pd.DataFrame, winners_frame: pd.DataFrame, null_equal: pd.DataFrame | None,
                n_permutations: int) -> pd.DataFrame:
    """The verdict (stats.validation's rule) of the winner against the runner-up at each (setting,
    storage level), on their six-D errors at that storage, every level's tests one family (Holm).
    The implementation null is the same two schemes at the same level in `null_equal`, a second
    run that differs only in an implementation variable (RNG family, seed, impl, device, dtype);
    without one, a difference beyond the margin stays 'inconclusive' (nothing to attribute it to)."""
    main = _samples(equal)
    null = _samples(null_equal) if null_equal is not None else {}
    keys, cases = [], []
    for w in winners_frame.itertuples():
        if not isinstance(w.runner_up, str):
            continue
        key = tuple(getattr(w, c) for c in SETTING_LEVEL)
        key_a, key_b = key + (w.winner,), key + (w.runner_up,)
        keys.append(key)
        cases.append((main[key_a], main[key_b], [(main[k], null[k]) for k in (key_a, key_b) if k in null]))
    results = validate_family(cases, alpha=ALPHA, n_permutations=n_permutations) if cases else []
    records = [dict(zip(SETTING_LEVEL, key), validation=result.verdict, validation_reason=result.reason,
                    n_null=len(result.nulls), energy_p=result.main.energy.p_value,
                    validation_effects=result.effect_rows())
               for key, result in zip(keys, results)]
    columns = SETTING_LEVEL + ["validation", "validation_reason", "n_null", "energy_p", "validation_effects"]
    return pd.DataFrame.from_records(records, columns=columns)


@dataclass(frozen=True)
class Findings:
    """Everything the summary says, as frames (one row per cell, pair, storage level or crossover)."""
    trials: pd.DataFrame
    cells: pd.DataFrame       # cell_estimates + on_front, p_front
    equal: pd.DataFrame       # stats.equal_storage.at_storage: PRIMARY and the six-D errors at each level
    tests: pd.DataFrame       # pairwise_tests on PRIMARY at each storage level
    winners: pd.DataFrame     # winners per storage level + validation verdicts
    crossovers: pd.DataFrame  # stats.dominance.crossovers on PRIMARY along the storage levels
    levels: tuple = ()
    storage: str = "bits_per_element"  # the column storage is read from
    has_null: bool = False
    claims: pd.DataFrame | None = None  # a reproduction's claims (harness reproduce; its claims table), else None
    left_out: tuple[str, ...] = ()      # one line per cell left out, its values not finite (stats.finite)
    # the run's fit / predictivity / recommendation tables by name (harness.fit_tables.read), where it has them
    tables: dict = field(default_factory=dict)

    @property
    def settings(self) -> list[tuple]:
        return [tuple(k) for k in self.cells[list(SETTING)].drop_duplicates().itertuples(index=False)]

    @property
    def calib_sizes(self) -> list[int]:
        """The run's calibration sizes (calib_tokens), ascending; the report names a setting's
        calibration size only when there are several."""
        return sorted(int(n) for n in self.trials["calib_tokens"].unique())


def analyse(trials: pd.DataFrame, null_trials: pd.DataFrame | None = None, n_permutations: int = 1000,
            levels=None) -> Findings:
    """Findings of a run's trials at the storage levels `levels` (bits per element; default
    stats.equal_storage.default_levels); `null_trials`, optional, is a run of the same cells that
    differs only in an implementation variable, the null of the verdicts."""
    metrics = (PRIMARY,) + tuple(m for m in SIX_D if m != PRIMARY)
    trials, left_out = _usable(trials, metrics)
    if null_trials is not None:
        null_trials, null_left_out = _usable(null_trials, metrics)
        left_out += tuple(f"--null run: {line}" for line in null_left_out)
    levels = default_levels(trials) if levels is None else tuple(levels)
    cells = with_front(cell_estimates(trials), trials)
    equal = at_storage(trials, metrics, levels)
    tests = pairwise_tests(equal)
    wins = winners(equal, tests)
    null_equal = at_storage(null_trials, metrics, levels) if null_trials is not None else None
    wins = wins.merge(validations(equal, wins, null_equal, n_permutations), on=SETTING_LEVEL, how="left")
    cross = crossovers(equal, error=PRIMARY, n_boot=N_BOOT, axis=LEVEL)
    return Findings(trials, cells, equal, tests, wins, cross, levels, storage_column(trials),
                    null_trials is not None, left_out=left_out)


def _usable(trials: pd.DataFrame, metrics: tuple[str, ...]) -> tuple[pd.DataFrame, tuple[str, ...]]:
    """The trials of the cells finite in what the findings read (stats.finite), and the lines
    naming the others; ValueError when no cell is left."""
    required = metrics + ("bits_per_element", storage_column(trials))
    usable, left_out = finite_cells(trials, required, tuple(m for m in ESTIMATED if m not in required))
    if usable.empty:
        raise ValueError(f"no stored cell has finite values to report ({len(left_out)} left out; first "
                         f"{left_out[0].removeprefix('left out: ')})")
    return usable, left_out


def _records(frame: pd.DataFrame) -> list[dict]:
    """Rows as JSON-ready dicts: numpy scalars as Python numbers, NaN and None as null."""
    out = []
    for row in frame.to_dict(orient="records"):
        clean = {}
        for k, v in row.items():
            if isinstance(v, np.generic):
                v = v.item()
            if isinstance(v, float) and not np.isfinite(v):
                v = None
            clean[k] = v
        out.append(clean)
    return out


# report --json: its version (reports/report.schema.json describes it; a minor step adds optional
# keys only: 1.1 the tables of predictivity and recommend) and the units of its numbers
JSON_SCHEMA_VERSION = "1.1"
JSON_UNITS = {
    "d2_t": "distance of (snr_err_t, dir_err_t) from the origin: dimensionless, 0 = exact",
    "storage": "measured bits per cached element",
    "storage_level": "bits per cached element",
    "effect": "effect_kind: matched-pairs rank-biserial r (paired) or Cliff's delta, in [-1, 1]; < 0: the winner "
              "has the smaller error",
    "verdict_effects": "per test: location effects in the metric's units (mean_a - mean_b), spread effects as "
                       "log(sd_a / sd_b); margin in the same units",
}


def _placed_as(source) -> dict | None:
    """A placement's words ('b = 3', 'b = 2–3 interpolated') as {source, budget_low, budget_high}."""
    if not isinstance(source, str):
        return None
    budgets = [int(b) for b in source.split()[2].split("–")]
    return {"source": "interpolated" if source.endswith("interpolated") else "measured",
            "budget_low": budgets[0], "budget_high": budgets[-1]}


def to_json(findings: Findings) -> dict:
    """The findings as one JSON-ready object: the storage levels and how values are placed at
    them, the Pareto front of every setting, the best codec at each storage level with its
    runner-up, test and verdict, the crossovers along the storage axis, and `claims` (one
    record per claim) when the run is a reproduction."""
    front_columns = ["scheme", "budget", "storage", "bits_per_element", "d2_t", "d2_t_low", "d2_t_high", "p_front",
                     "n_trials"]
    fronts = []
    for setting in sorted(findings.settings):
        cells = findings.cells
        for col, val in zip(SETTING, setting):
            cells = cells[cells[col] == val]
        points = cells[cells.on_front].sort_values(["storage", "d2_t"])[front_columns]
        fronts.append({"setting": _records(pd.DataFrame([dict(zip(SETTING, setting))]))[0],
                       "points": _records(points)})
    wins = findings.winners.rename(columns={"validation": "verdict", "validation_reason": "verdict_reason",
                                            "validation_effects": "verdict_effects"})
    verdicts = wins[wins.runner_up.map(lambda r: isinstance(r, str)).astype(bool)][
        SETTING_LEVEL + ["winner", "runner_up", "comparison", "verdict", "verdict_reason", "verdict_effects"]]
    wins = wins.assign(
        winner_placed=wins.winner_source.map(_placed_as), runner_up_placed=wins.runner_up_source.map(_placed_as),
        effect_kind=[("matched-pairs rank-biserial r" if p else "Cliff's delta") if isinstance(r, str) else None
                     for p, r in zip(wins.paired, wins.runner_up)])
    return {"schema_version": JSON_SCHEMA_VERSION, "n_trials": int(len(findings.trials)),
            "n_cells": int(len(findings.cells)), "metric": PRIMARY, "units": JSON_UNITS, "alpha": ALPHA,
            "smallest_effect_sd": SMALLEST_EFFECT, "spread_margin": SPREAD_MARGIN,
            "storage": {"column": findings.storage, "levels": list(findings.levels), "tolerance": TOLERANCE,
                        "per_value_tolerance": TOLERANCE / 2,
                        "meaning": "a value enters a level within per_value_tolerance of it (relative), so two "
                                   "values compared at a level differ in storage by at most tolerance"},
            "has_null": findings.has_null, "fronts": fronts, "winners": _records(wins),
            "verdicts": _records(verdicts), "crossovers": _records(findings.crossovers),
            **({"left_out": list(findings.left_out)} if findings.left_out else {}),
            **({"claims": _records(findings.claims)} if findings.claims is not None else {})}
