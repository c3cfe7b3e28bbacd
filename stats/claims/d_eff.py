"""Claim 9 (abstract; §1 finding 5): d_eff follows the calibration budget rather than the true
rank, over a --calib-tokens sweep (claim_d_eff).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from .framework import (ClaimResult, _aligned, _equivalent, _family, _headline, _holding, _result, _standard_verdict,
                        lacking, paired_row)

RANK_MARGIN = 0.05           # claim 9: d_eff "equals" a value within ±max(0.5, 5 %) (TOST)


def claim_d_eff(calibration: pd.DataFrame | None, targets: dict) -> ClaimResult:
    """Claim 9 on a --calib-tokens sweep. targets: {(scenario, dim): true rank}, the value a
    participation ratio recovers with unlimited calibration (the population's). Per scenario with
    a target, d and tensor (d_eff_k, d_eff_v): part `follows budget`: d_eff at the largest minus
    the smallest n_cal (paired: calibration sizes share K, V, Q), expected to differ (equivalence
    within ±max(0.5, RANK_MARGIN·target) counts against); part `not the true rank`: d_eff at the
    largest n_cal minus the target (one-sample Wilcoxon), expected to differ (equivalence within
    the same margin counts against: d_eff recovers the true rank). The comparisons split by
    scenario where d_eff follows n_cal on one and recovers the rank on another: `partly`, the
    scenarios named (framework rule 4), the headline taken where the claim holds."""
    test = ("squ-kv's stored d_eff_k, d_eff_v over the --calib-tokens sweep (same K, V, Q): largest minus smallest "
            "n_cal (paired Wilcoxon) and, at the largest n_cal, minus the true rank (the population's participation "
            "ratio; one-sample Wilcoxon); TOST within +-max(0.5, 5 %) of the true rank decides 'no change' and "
            "'recovers the rank'; Holm")
    if calibration is None or calibration.empty or calibration.calib_tokens.nunique() < 2:
        return lacking(9, test, "paired", "a --calib-tokens sweep with two or more sizes")
    rows, notes = [], []
    for (scenario, dim, _scheme), g in calibration.groupby(["scenario", "dim", "scheme"], sort=True):
        target = targets.get((scenario, int(dim)))
        if target is None or g[["d_eff_k", "d_eff_v"]].isna().all().all():
            continue
        sizes = sorted(g.calib_tokens.unique())
        g = g[g.budget == g.budget.min()]
        small = g[g.calib_tokens == sizes[0]].set_index("trial").sort_index()
        large = g[g.calib_tokens == sizes[-1]].set_index("trial").sort_index()
        margin = max(0.5, RANK_MARGIN * target)
        where = dict(scenario=scenario, dim=int(dim), budget=int(g.budget.iloc[0]))
        for col in ("d_eff_k", "d_eff_v"):
            x, y = _aligned(large, small, col)
            row = paired_row(x, y, f"{col} n_cal={sizes[-1]} - n_cal={sizes[0]}, {scenario} d={dim}",
                             part="follows budget", expect="differs", **where)
            row["equivalent"] = _equivalent(x, y, margin, paired=True)
            rows.append(row)
            row = paired_row(x, np.full(len(x), float(target)), f"{col} n_cal={sizes[-1]} - true rank {target}, "
                             f"{scenario} d={dim}", part="not the true rank", expect="differs", **where)
            row["equivalent"] = _equivalent(x, np.full(len(x), float(target)), margin, paired=True)
            rows.append(row)
            means = g.groupby("calib_tokens")[col].mean()
            notes.append(f"{scenario} d={dim} {col}: " + ", ".join(f"{means[n]:.1f}" for n in sizes)
                         + f" at n_cal = {', '.join(map(str, sizes))} (true rank {target})")
    tests = _family(rows, 9)
    verdict, reason = _standard_verdict(tests, "comparisons")
    reason += ". Mean d_eff: " + "; ".join(notes)
    gaps = _holding(tests, verdict)
    gaps = gaps[gaps.part == "not the true rank"].assign(gap=lambda t: t.estimate.abs())
    head = _headline(gaps, "min", key="gap") if len(gaps) else None
    return _result(9, test, "paired", tests, (verdict, reason), head,
                   "d_eff at the largest n_cal minus the true rank, closest")
