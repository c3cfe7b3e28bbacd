"""Dominance, crossover and amplification analyses of a run's trials, as tidy frames for the
reports.

Input: a trial frame (columns as kvcommon/rows.py TRIAL_COLUMNS). A *group* is one setting
(kvcommon.rows): (scenario, dim, seq_len, queries, calib_tokens). Its cells share their data
trial by trial, so bootstrap resamples draw trial indices once per replicate and apply them to
every cell of the group (a paired bootstrap that keeps the comparison between schemes on the
same draws).
"""
from __future__ import annotations

import itertools

import numpy as np
import pandas as pd

from kvcommon.rows import SETTING_COLUMNS
from .inference import as_generator

GROUP = SETTING_COLUMNS
POINT = ("scheme", "budget")


def _check(trials: pd.DataFrame, columns) -> None:
    missing = [c for c in columns if c not in trials.columns]
    if missing:
        raise ValueError(f"trial frame lacks column(s) {', '.join(missing)}")


def _paired_matrix(group: pd.DataFrame, metric: str, keys=POINT) -> tuple[list[tuple], np.ndarray]:
    """(cells, values): values[t, c] is `metric` of trial t in cell c (NaN where missing)."""
    wide = group.pivot_table(index="trial", columns=list(keys), values=metric, aggfunc="mean")
    return list(wide.columns), wide.to_numpy(dtype=float)


def _bootstrap_means(values: np.ndarray, n_boot: int, gen: np.random.Generator) -> np.ndarray:
    """(n_boot, cells) means over trials resampled with replacement, the same trials for every
    cell (paired)."""
    idx = gen.integers(0, values.shape[0], size=(n_boot, values.shape[0]))
    with np.errstate(invalid="ignore"):
        return np.nanmean(values[idx], axis=1)


def _non_dominated(bits: np.ndarray, err: np.ndarray) -> np.ndarray:
    """Boolean mask over points (last axis): no other point has bits ≤ and err ≤ with one
    strict. err may carry leading batch axes (bootstrap replicates)."""
    b_le = bits[None, :] <= bits[:, None]            # [i, j]: point j has bits ≤ point i
    b_lt = bits[None, :] < bits[:, None]
    e_le = err[..., None, :] <= err[..., :, None]
    e_lt = err[..., None, :] < err[..., :, None]
    dominated_by = b_le & e_le & (b_lt | e_lt)
    return ~dominated_by.any(axis=-1)


def pareto_front(trials: pd.DataFrame, error: str = "d2_t", level: float = 0.95, n_boot: int = 1000,
                 seed: int | np.random.Generator = 0, bits: str = "bits_per_element") -> pd.DataFrame:
    """Per group (scenario, dim, seq_len, queries, calib_tokens), every (scheme, budget) point
    with its mean measured storage (column `bits`, reported as bits_per_element), the mean of
    `error` (default d2_t) with a paired percentile bootstrap interval, `non_dominated` (on the
    observed means: no other point has bits ≤ and error ≤, one strict) and `p_non_dominated`,
    the fraction of bootstrap replicates in which the point is non-dominated (its confidence of
    being on the front)."""
    _check(trials, GROUP + POINT + ("trial", bits, error))
    gen = as_generator(seed, "pareto")
    tail = (1 - level) / 2
    out = []
    for key, group in trials.groupby(list(GROUP), sort=True):
        cells, values = _paired_matrix(group, error)
        storage = group.groupby(list(POINT))[bits].mean().reindex(cells).to_numpy()
        means = np.nanmean(values, axis=0)
        reps = _bootstrap_means(values, n_boot, gen)
        low, high = np.nanquantile(reps, [tail, 1 - tail], axis=0)
        front = _non_dominated(storage, means)
        p_front = _non_dominated(storage, reps).mean(axis=0)
        for c, (scheme, budget) in enumerate(cells):
            out.append(dict(zip(GROUP, key), scheme=scheme, budget=budget, bits_per_element=storage[c],
                            metric=error, mean=means[c], low=low[c], high=high[c],
                            n_trials=int(np.count_nonzero(~np.isnan(values[:, c]))),
                            non_dominated=bool(front[c]), p_non_dominated=float(p_front[c])))
    return pd.DataFrame(out)


def crossovers(trials: pd.DataFrame, error: str = "d2_t", level: float = 0.95, n_boot: int = 1000,
               seed: int | np.random.Generator = 0, axis: str = "budget") -> pd.DataFrame:
    """Where one scheme stops beating another along an axis: the nominal budget, or (axis =
    "storage_level", on a stats.equal_storage frame) the measured storage.

    Per group and scheme pair (a, b) with a < b by name, the paired mean difference
    Δ(u) = mean(error_a − error_b) with a paired bootstrap interval is computed at every value u
    of the axis both schemes have; each pair of consecutive values where Δ changes sign is one
    row: {axis}_low/{axis}_high, delta_low/delta_high, `{axis}_cross` (linear interpolation
    of Δ = 0), `better_below` (the scheme with the lower error below the crossover) and
    `confident` (both intervals exclude zero)."""
    point = ("scheme", axis)
    _check(trials, GROUP + point + ("trial", error))
    gen = as_generator(seed, "crossover")
    tail = (1 - level) / 2
    out = []
    for key, group in trials.groupby(list(GROUP), sort=True):
        cells, values = _paired_matrix(group, error, point)
        column = {cell: c for c, cell in enumerate(cells)}
        idx = gen.integers(0, values.shape[0], size=(n_boot, values.shape[0]))
        names = sorted({s for s, _ in cells})
        budgets = sorted({b for _, b in cells})
        for a, b in itertools.combinations(names, 2):
            shared = [u for u in budgets if (a, u) in column and (b, u) in column]
            stats = []
            for u in shared:
                diff = values[:, column[(a, u)]] - values[:, column[(b, u)]]
                with np.errstate(invalid="ignore"):
                    boot = np.nanmean(diff[idx], axis=1)
                lo, hi = np.nanquantile(boot, [tail, 1 - tail])
                stats.append((u, float(np.nanmean(diff)), float(lo), float(hi)))
            for (u0, d0, lo0, hi0), (u1, d1, lo1, hi1) in zip(stats, stats[1:]):
                if np.sign(d0) * np.sign(d1) >= 0:
                    continue
                cross = u0 + (u1 - u0) * d0 / (d0 - d1)
                out.append({**dict(zip(GROUP, key)), "scheme_a": a, "scheme_b": b, "metric": error,
                            f"{axis}_low": u0, f"{axis}_high": u1, "delta_low": d0, "delta_high": d1,
                            f"{axis}_cross": float(cross), "better_below": a if d0 < 0 else b,
                            "confident": bool((lo0 > 0 or hi0 < 0) and (lo1 > 0 or hi1 < 0))})
    columns = list(GROUP) + ["scheme_a", "scheme_b", "metric", f"{axis}_low", f"{axis}_high", "delta_low",
                             "delta_high", f"{axis}_cross", "better_below", "confident"]
    return pd.DataFrame(out, columns=columns)


def amplification(trials: pd.DataFrame) -> pd.DataFrame:
    """Per cell: how logit error turns into attention-output error (the AMD paper's Jensen
    argument: softmax is convex in the logits, so zero-mean logit noise — QJL's unbiased but
    noisier K estimate — still raises the T error; E[exp(s + e)] ≥ exp(s)).

    Columns: n_trials; logit_rel_mse mean and variance; logit_slope mean (1 = unbiased,
    < 1 = shrinking MSE quantiser); t_rel_mse_konly / t_rel_mse_vonly means (T error with only
    K resp. only V compressed) and `k_share` = konly / (konly + vonly); rel_mse_t mean and
    variance; `k_amplification` = mean t_rel_mse_konly / mean logit_rel_mse (T error per unit
    logit error); `v_amplification` = mean t_rel_mse_vonly / mean rel_mse_v; and
    `logit_t_spearman`, the rank correlation over trials of logit_rel_mse and t_rel_mse_konly."""
    cell = GROUP[:1] + POINT + GROUP[1:]
    needed = ("logit_rel_mse", "logit_slope", "t_rel_mse_konly", "t_rel_mse_vonly", "rel_mse_t", "rel_mse_v")
    _check(trials, cell + needed)
    out = []
    for key, g in trials.groupby(list(cell), sort=True):
        konly, vonly = g["t_rel_mse_konly"].mean(), g["t_rel_mse_vonly"].mean()
        logit, rel_v = g["logit_rel_mse"].mean(), g["rel_mse_v"].mean()
        rho = g["logit_rel_mse"].corr(g["t_rel_mse_konly"], method="spearman") if len(g) > 2 else np.nan
        out.append(dict(zip(cell, key), n_trials=len(g),
                        logit_rel_mse_mean=logit, logit_rel_mse_var=g["logit_rel_mse"].var(),
                        logit_slope_mean=g["logit_slope"].mean(),
                        t_rel_mse_konly_mean=konly, t_rel_mse_vonly_mean=vonly,
                        k_share=konly / (konly + vonly) if konly + vonly > 0 else np.nan,
                        rel_mse_t_mean=g["rel_mse_t"].mean(), rel_mse_t_var=g["rel_mse_t"].var(),
                        k_amplification=konly / logit if logit > 0 else np.nan,
                        v_amplification=vonly / rel_v if rel_v > 0 else np.nan,
                        logit_t_spearman=rho))
    return pd.DataFrame(out)
