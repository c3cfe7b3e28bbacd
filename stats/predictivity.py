"""Does a synthetic scenario predict the codec ranking on real data? Kendall's τ at equal storage.

Input: the rows of one sweep in which the *reference* scenario (replay:FILE:layer=N, the real
windows) and the *candidate* scenarios (fitted:SPEC:layer=N, the generic families) ran the same
codecs at the same d, S, Nq, calibration size and budgets. Per scenario, each codec's mean
metric at each common storage level x (stats.equal_storage.at_storage: measured within ±2.5 %
or interpolated between the codec's own cells, never extrapolated) orders the codecs present at
x in both scenarios. Over every level and every pair {a, b} of codecs present in both at that
level, a pair is concordant when the two scenarios order a and b the same way, discordant
(a *flipped* pair) otherwise, and

    τ = (C − D) / (C + D)                                   (Kendall's τ_a over the pairs)

which is Kendall's τ of the two rankings at one level, and pools levels (and, for the pooled τ,
layers) by adding their pairs. Tied means (equal to the last digit) count in neither C nor D.

Uncertainty: a percentile bootstrap over trials, resampling each scenario's trials independently
(the two scenarios' trials are independent draws; within one scenario every codec ran on the
same trials, so a trial is resampled for all codecs at once), 2000 resamples, 95 % interval.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import combinations

import numpy as np
import pandas as pd

from .equal_storage import LEVEL, at_storage

N_BOOT = 2000


@dataclass(frozen=True)
class Table:
    """One scenario's per-trial metric at each storage level: values[(level, scheme)] (n_trials,),
    all of one trial order (the scenario's trials, sorted)."""
    scenario: str
    values: dict = field(repr=False)
    n_trials: int = 0

    def means(self, index: np.ndarray | None = None) -> dict:
        return {key: float(np.mean(v if index is None else v[index])) for key, v in self.values.items()}


def tables(trials: pd.DataFrame, metric: str, levels) -> dict[str, Table]:
    """A Table per scenario of the trial rows (one setting per scenario: d, S, Nq, n_cal fixed);
    a (level, scheme) enters only with every trial of its scenario."""
    placed = at_storage(trials, [metric], levels)
    out = {}
    for scenario, group in placed.groupby("scenario", sort=False):
        if group[["dim", "seq_len", "queries", "calib_tokens"]].drop_duplicates().shape[0] != 1:
            raise ValueError(f"scenario {scenario}: more than one setting (d, S, Nq, calibration) in the rows")
        trial_ids = np.sort(group["trial"].unique())
        values = {}
        for (level, scheme), g in group.groupby([LEVEL, "scheme"], sort=True):
            g = g.set_index("trial").reindex(trial_ids)
            if g[metric].notna().all():
                values[(float(level), scheme)] = g[metric].to_numpy(float)
        out[scenario] = Table(scenario, values, len(trial_ids))
    return out


def pair_signs(means_ref: dict, means_cand: dict, schemes=None) -> list[tuple]:
    """(level, a, b, sign_ref, sign_cand) for each level and codec pair a < b present in both;
    sign +1 when a's metric is lower (better) than b's, −1 when higher, 0 when equal."""
    out = []
    levels = sorted({lv for lv, _ in means_ref} & {lv for lv, _ in means_cand})
    for level in levels:
        present = sorted(s for lv, s in means_ref if lv == level and (level, s) in means_cand
                         and (schemes is None or s in schemes))
        for a, b in combinations(present, 2):
            out.append((level, a, b, int(np.sign(means_ref[level, b] - means_ref[level, a])),
                        int(np.sign(means_cand[level, b] - means_cand[level, a]))))
    return out


def concordance(signs: list[tuple]) -> tuple[int, int]:
    """(concordant, discordant) pairs of pair_signs' output."""
    products = [r * c for _, _, _, r, c in signs]
    return sum(p > 0 for p in products), sum(p < 0 for p in products)


def tau(concordant: int, discordant: int) -> float:
    total = concordant + discordant
    return (concordant - discordant) / total if total else float("nan")


@dataclass(frozen=True)
class Agreement:
    reference: str
    candidate: str
    tau: float
    ci_low: float
    ci_high: float
    n_pairs: int
    flipped: list   # (level, a, b, ref mean a, ref mean b, cand mean a, cand mean b)


def agreement(pairs: list[tuple[Table, Table]], schemes=None, *, n_boot: int = N_BOOT, seed: int = 0,
              level: float = 0.95) -> Agreement:
    """τ of each (reference, candidate) pair's rankings pooled over the pairs (one pair: per layer;
    several: pooled over layers), with its bootstrap interval and the flipped pairs (module doc)."""
    gen = np.random.default_rng(seed)
    flipped, c_all, d_all = [], 0, 0
    for ref, cand in pairs:
        m_ref, m_cand = ref.means(), cand.means()
        signs = pair_signs(m_ref, m_cand, schemes)
        c, d = concordance(signs)
        c_all, d_all = c_all + c, d_all + d
        flipped += [(lv, a, b, m_ref[lv, a], m_ref[lv, b], m_cand[lv, a], m_cand[lv, b])
                    for lv, a, b, r, s in signs if r * s < 0]
    boot = np.empty(n_boot)
    for i in range(n_boot):
        c_b = d_b = 0
        for ref, cand in pairs:
            signs = pair_signs(ref.means(gen.integers(ref.n_trials, size=ref.n_trials)),
                               cand.means(gen.integers(cand.n_trials, size=cand.n_trials)), schemes)
            c, d = concordance(signs)
            c_b, d_b = c_b + c, d_b + d
        boot[i] = tau(c_b, d_b)
    lo, hi = np.nanquantile(boot, [(1 - level) / 2, (1 + level) / 2]) if np.isfinite(boot).any() else (np.nan, np.nan)
    names = sorted({r.scenario for r, _ in pairs}), sorted({c.scenario for _, c in pairs})
    return Agreement(", ".join(names[0]), ", ".join(names[1]), tau(c_all, d_all), float(lo), float(hi),
                     c_all + d_all, flipped)


DIAGNOSTIC_METRICS = ("rel_mse_k", "rel_mse_v", "logit_rel_mse", "kl_attn", "t_rel_mse_konly", "t_rel_mse_vonly",
                      "d2_t")
# per codec: the ranked error, the logit error (quantisers' part) and the evicted attention mass
# (evicting codecs': NaN for the others, so absent from their ratios)
CODEC_METRICS = ("d2_t", "logit_rel_mse", "evicted_mass")


def codec_ratios(trials: pd.DataFrame, reference: str, candidate: str, levels, schemes,
                 metrics=CODEC_METRICS) -> dict[str, dict[str, float]]:
    """Per codec and metric, the geometric mean over the storage levels where the codec is placed
    in both scenarios of candidate mean / reference mean (error_ratios for one codec at a time);
    a metric a codec does not report (NaN, zero) is left out of its entry."""
    out = {}
    for scheme in schemes:
        ratios = error_ratios(trials, reference, candidate, levels, [scheme], metrics)
        out[scheme] = {m: r for m, r in ratios.items() if np.isfinite(r)}
    return out


def error_ratios(trials: pd.DataFrame, reference: str, candidate: str, levels, schemes,
                 metrics=DIAGNOSTIC_METRICS) -> dict[str, float]:
    """Per metric, the geometric mean over storage levels and the given codecs (those present at a
    level in both scenarios) of candidate mean / reference mean at equal storage: 1 where the
    synthetic world reproduces that part of the real error, > 1 where it overstates it. Which
    component is off says which statistic a fit misses (e.g. K and V errors right but the
    attention's response to them not: the query–key geometry)."""
    metrics = [m for m in metrics if m in trials.columns]
    rows = trials[trials["scenario"].isin([reference, candidate]) & trials["scheme"].isin(list(schemes))]
    placed = at_storage(rows, metrics, levels)
    means = placed.groupby(["scenario", LEVEL, "scheme"])[metrics].mean()
    out = {}
    for m in metrics:
        logs = []
        for (level, scheme), ref in means.loc[reference][m].items():
            if (candidate, level, scheme) in means.index:
                cand = means.loc[(candidate, level, scheme), m]
                if ref > 0 and cand > 0:
                    logs.append(np.log(cand / ref))
        out[m] = float(np.exp(np.mean(logs))) if logs else float("nan")
    return out
