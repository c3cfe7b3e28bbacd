"""What a run found, as tidy frames: per-cell estimates, pairwise scheme comparisons, winners
at each budget with their verdicts, the non-dominated (Pareto) cells and crossovers along the
budget axis. The statistics themselves come from stats/ (inference, dominance, validation).

Everything is computed from the stored trial rows alone. A *setting* is one
(scenario, dim, seq_len, queries, calib_tokens) (stats.cells): the cells of a setting share
their data trial by trial, so its schemes and budgets are compared on the same draws.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
from stats.cells import CELL_COLUMNS, SETTING_COLUMNS
from stats.dominance import crossovers, pareto_front
from stats.inference import cliffs_delta, holm, mann_whitney, tost
from stats.validation import validate_samples

from .summary import mean_ci

SETTING = SETTING_COLUMNS
CELL = CELL_COLUMNS  # = SETTING[:1] + ("scheme", "budget") + SETTING[1:]
PRIMARY = "d2_t"
ESTIMATED = ("d2_t", "d2_k", "d2_v", "rel_mse_t", "rel_mse_k", "rel_mse_v", "t_rel_mse_konly",
             "t_rel_mse_vonly", "logit_rel_mse", "logit_slope", "kl_attn")
ALPHA = 0.05
N_BOOT = 1000  # bootstrap replicates of the Pareto-front confidence and the crossover intervals
EQUIVALENCE_MARGIN = 0.05  # relative: "equivalent" means the means differ by less than 5% of the runner-up's


def cell_estimates(trials: pd.DataFrame, metrics=ESTIMATED) -> pd.DataFrame:
    """One row per cell: n_trials, bits_per_element (measured, mean over trials) and, per
    metric, the mean with its Student-t 95% confidence interval (columns m, m_low, m_high)."""
    records = []
    for key, group in trials.groupby(list(CELL), sort=True):
        rec = dict(zip(CELL, key), n_trials=len(group), bits_per_element=float(group["bits_per_element"].mean()))
        for m in metrics:
            rec[m], rec[f"{m}_low"], rec[f"{m}_high"] = mean_ci(group[m])
        records.append(rec)
    return pd.DataFrame.from_records(records)


def pairwise_tests(trials: pd.DataFrame, metric: str = PRIMARY) -> pd.DataFrame:
    """Every pair of schemes at each (setting, budget): two-sided Mann–Whitney U p-value on the
    per-trial metric, Holm-adjusted within the (setting, budget) family, and Cliff's δ (the
    effect size that matches U). Rows: setting, budget, scheme_a, scheme_b, mean_a, mean_b,
    p_value, p_holm, cliffs_delta; δ < 0 means scheme_a has the smaller (better) error."""
    records = []
    for key, group in trials.groupby(list(SETTING) + ["budget"], sort=True):
        frames = {s: g for s, g in group.groupby("scheme", sort=True)}
        names = sorted(frames)
        family = []
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                x, y = frames[a][metric].to_numpy(float), frames[b][metric].to_numpy(float)
                p = float(mann_whitney(frames[a], frames[b], [metric]).p_value.iloc[0])
                family.append(dict(zip(list(SETTING) + ["budget"], key), scheme_a=a, scheme_b=b,
                                   mean_a=float(x.mean()), mean_b=float(y.mean()), p_value=p,
                                   cliffs_delta=cliffs_delta(x, y)))
        if family:
            for rec, adj in zip(family, holm([r["p_value"] for r in family])):
                rec["p_holm"] = float(adj)
            records.extend(family)
    columns = list(SETTING) + ["budget", "scheme_a", "scheme_b", "mean_a", "mean_b", "p_value", "p_holm", "cliffs_delta"]
    return pd.DataFrame.from_records(records, columns=columns)


def _pair(tests: pd.DataFrame, key: tuple, a: str, b: str) -> tuple[float, float]:
    """(p_holm, δ of a vs b) for one pair at one (setting, budget); δ sign follows (a, b)."""
    sel = tests
    for col, val in zip(list(SETTING) + ["budget"], key):
        sel = sel[sel[col] == val]
    row = sel[(sel.scheme_a == a) & (sel.scheme_b == b)]
    if len(row):
        return float(row.p_holm.iloc[0]), float(row.cliffs_delta.iloc[0])
    row = sel[(sel.scheme_a == b) & (sel.scheme_b == a)]
    return float(row.p_holm.iloc[0]), -float(row.cliffs_delta.iloc[0])


def winners(trials: pd.DataFrame, cells: pd.DataFrame, tests: pd.DataFrame, metric: str = PRIMARY) -> pd.DataFrame:
    """Per (setting, budget): the scheme with the lowest mean metric, the runner-up, the Holm
    p-value and Cliff's δ of winner vs runner-up, `significant` (p_holm < ALPHA) and `comparison`:
    'difference' when significant; otherwise a TOST (Welch) of the means with the margin
    EQUIVALENCE_MARGIN × the runner-up's mean decides 'equivalent' or 'inconclusive'."""
    records = []
    for key, group in cells.groupby(list(SETTING) + ["budget"], sort=True):
        ranked = group.sort_values([metric, "scheme"])
        best = ranked.iloc[0]
        rec = dict(zip(list(SETTING) + ["budget"], key), winner=best.scheme, winner_mean=best[metric],
                   winner_low=best[f"{metric}_low"], winner_high=best[f"{metric}_high"],
                   winner_bits=best.bits_per_element, n_schemes=len(ranked))
        if len(ranked) > 1:
            second = ranked.iloc[1]
            p, delta = _pair(tests, key, best.scheme, second.scheme)
            rec.update(runner_up=second.scheme, runner_up_mean=second[metric],
                       runner_up_low=second[f"{metric}_low"], runner_up_high=second[f"{metric}_high"],
                       p_holm=p, cliffs_delta=delta, significant=p < ALPHA)
            if p < ALPHA:
                rec["comparison"] = "difference"
            else:
                pick = trials
                for col, val in zip(list(SETTING) + ["budget"], key):
                    pick = pick[pick[col] == val]
                x = pick[pick.scheme == best.scheme][metric]
                y = pick[pick.scheme == second.scheme][metric]
                margin = EQUIVALENCE_MARGIN * float(second[metric])
                equal = margin > 0 and tost(x, y, margin, ALPHA).equivalent
                rec["comparison"] = "equivalent" if equal else "inconclusive"
        else:
            rec.update(runner_up=None, runner_up_mean=np.nan, runner_up_low=np.nan, runner_up_high=np.nan,
                       p_holm=np.nan, cliffs_delta=np.nan, significant=False, comparison="only scheme")
        records.append(rec)
    return pd.DataFrame.from_records(records)


def with_front(cells: pd.DataFrame, trials: pd.DataFrame, metric: str = PRIMARY) -> pd.DataFrame:
    """cells plus `on_front` (not dominated on (measured bits per element, mean metric) within
    its setting) and `p_front` (the paired-bootstrap confidence of being on the front), from
    stats.dominance.pareto_front."""
    front = pareto_front(trials, error=metric, n_boot=N_BOOT)
    front = front[list(SETTING) + ["scheme", "budget", "non_dominated", "p_non_dominated"]].rename(
        columns={"non_dominated": "on_front", "p_non_dominated": "p_front"})
    return cells.merge(front, on=list(SETTING) + ["scheme", "budget"], how="left", validate="one_to_one")


def cell_samples(trials: pd.DataFrame) -> dict[tuple, pd.DataFrame]:
    """Each cell's trial rows, keyed by the CELL tuple."""
    return {tuple(k): g for k, g in trials.groupby(list(CELL), sort=True)}


def validations(trials: pd.DataFrame, winners_frame: pd.DataFrame, null_trials: pd.DataFrame | None,
                n_permutations: int) -> pd.DataFrame:
    """The codec-difference / implementation-variance verdict (stats.validation's rule) of the
    winner against the runner-up at each (setting, budget). The implementation null is the
    same two cells in `null_trials`, a second run that differs only in an implementation
    variable (RNG family, seed, impl, device, dtype); without one, a detected difference
    stays 'inconclusive' (nothing to attribute it to)."""
    main = cell_samples(trials)
    null = cell_samples(null_trials) if null_trials is not None else {}
    records = []
    for i, w in enumerate(winners_frame.itertuples()):
        if not isinstance(w.runner_up, str):
            continue
        setting = tuple(getattr(w, c) for c in SETTING)
        key_a = (setting[0], w.winner, w.budget) + setting[1:]
        key_b = (setting[0], w.runner_up, w.budget) + setting[1:]
        pairs = [(main[k], null[k]) for k in (key_a, key_b) if k in null]
        result = validate_samples(main[key_a], main[key_b], pairs, alpha=ALPHA,
                                  n_permutations=n_permutations, seed=i)
        records.append(dict(zip(list(SETTING) + ["budget"], setting + (w.budget,)), validation=result.verdict,
                            validation_reason=result.reason, n_null=len(pairs),
                            energy_p=result.main.energy.p_value))
    columns = list(SETTING) + ["budget", "validation", "validation_reason", "n_null", "energy_p"]
    return pd.DataFrame.from_records(records, columns=columns)


@dataclass(frozen=True)
class Findings:
    """Everything the summary says, as frames (one row per cell, pair, budget or crossover)."""
    trials: pd.DataFrame
    cells: pd.DataFrame       # cell_estimates + on_front, p_front
    tests: pd.DataFrame       # pairwise_tests on PRIMARY
    winners: pd.DataFrame     # winners + validation verdicts
    crossovers: pd.DataFrame  # stats.dominance.crossovers on PRIMARY
    has_null: bool = False

    @property
    def settings(self) -> list[tuple]:
        return [tuple(k) for k in self.cells[list(SETTING)].drop_duplicates().itertuples(index=False)]

    @property
    def calib_sizes(self) -> list[int]:
        """The run's calibration sizes (calib_tokens), ascending; the report names a setting's
        calibration size only when there are several."""
        return sorted(int(n) for n in self.trials["calib_tokens"].unique())


def analyse(trials: pd.DataFrame, null_trials: pd.DataFrame | None = None, n_permutations: int = 1000) -> Findings:
    """Findings of a run's trials; `null_trials`, optional, is a run of the same cells that
    differs only in an implementation variable, the null of the verdicts."""
    cells = with_front(cell_estimates(trials), trials)
    tests = pairwise_tests(trials)
    wins = winners(trials, cells, tests)
    wins = wins.merge(validations(trials, wins, null_trials, n_permutations), on=list(SETTING) + ["budget"],
                      how="left")
    return Findings(trials, cells, tests, wins, crossovers(trials, error=PRIMARY, n_boot=N_BOOT),
                    null_trials is not None)
