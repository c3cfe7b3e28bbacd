"""Claim 6 (abstract): heavy tails are catastrophic for eigenbasis methods: SQ's loss against
tq-kv on heavy_tail does not recover with budget (claim_heavy_tail).
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from ..margins import SMALLEST_EFFECT
from .framework import (METRIC, ClaimResult, _cells, _family, _headline, _missing, _name, _not_below, _pooled_sd,
                        _holding, _result, _settings, _standard_verdict, _where, lacking, paired_row, unpaired_row)
from .paper import SQ_CODECS


def claim_heavy_tail(trials: pd.DataFrame, heavy: str = "heavy_tail", control: str = "spectral_decay") -> ClaimResult:
    """Claim 6. Per SQ codec (sq-kv, squ-kv) and d, ρ = log d2(T)[SQ] − log d2(T)[tq-kv] per trial
    (paired). Parts: `loss`: ρ on heavy_tail at the largest budget > 0; `no recovery`: ρ at the
    largest minus the smallest budget not < 0 (paired: budgets share the draws): shown by a
    significant increase (Wilcoxon, Holm) or by non-inferiority, the one-sided half of a paired
    TOST: the mean change lies above −SMALLEST_EFFECT·σ (σ the pooled trial-to-trial sd of ρ at
    the two budgets, the margin of stats.validation's verdicts) at ALPHA. A change neither
    significant nor shown inside that margin is `not significant` ("not shown"), never as
    claimed; `heavy-tail specific`: ρ on heavy_tail > ρ on spectral_decay at the largest budget
    (the same power-law spectrum with Gaussian latents; different draws, Mann–Whitney)."""
    test = (f"per SQ codec (sq-kv, squ-kv) and d: rho = log d2(T)[SQ] - log d2(T)[tq-kv] per trial; rho > 0 on "
            f"{heavy} at the largest b (Wilcoxon); rho not falling from the smallest to the largest b: a significant "
            f"rise (paired Wilcoxon) or a fall shown smaller than {SMALLEST_EFFECT} pooled sd of rho (paired one-sided "
            f"TOST), else not shown; rho larger on {heavy} than on {control} (same spectrum, Gaussian latents; "
            f"Mann-Whitney), Holm")
    missing = _missing(trials, ("tq-kv",), (heavy, control))
    sq = [s for s in SQ_CODECS if s in set(trials.scheme)]
    if missing or not sq:
        return lacking(6, test, "paired and unpaired", ", ".join(missing + ([] if sq else ["an SQ codec"])))
    cells = _cells(trials[trials.scheme.isin(("tq-kv",) + tuple(sq)) & trials.scenario.isin((heavy, control))])

    def rho(setting, scheme, budget):
        if (setting, scheme, budget) not in cells or (setting, "tq-kv", budget) not in cells:
            return None
        a, b = cells[(setting, scheme, budget)], cells[(setting, "tq-kv", budget)]
        shared = a.index.intersection(b.index)
        return pd.Series(np.log(a.loc[shared, METRIC].to_numpy(float)) - np.log(b.loc[shared, METRIC].to_numpy(float)),
                         index=shared)

    rows = []
    for setting in _settings(cells):
        if setting[0] != heavy:
            continue
        budgets = sorted({k[2] for k in cells if k[0] == setting})
        control_setting = (control,) + setting[1:]
        for scheme in sq:
            top, bottom = rho(setting, scheme, budgets[-1]), rho(setting, scheme, budgets[0])
            if top is None:
                continue
            where = dict(budget=budgets[-1], **_where(setting))
            rows.append(paired_row(top.to_numpy(), np.zeros(len(top)), f"rho {scheme}, {_name(setting, budgets[-1])}",
                                   part="loss", expect="greater", **where))
            if bottom is not None and len(budgets) > 1:
                shared = top.index.intersection(bottom.index)
                x, y = top[shared].to_numpy(), bottom[shared].to_numpy()
                row = paired_row(x, y, f"rho {scheme} b={budgets[-1]} - b={budgets[0]}, {_name(setting)}",
                                 part="no recovery", expect="not less", **where)
                row["equivalent"] = _not_below(x, y, SMALLEST_EFFECT * _pooled_sd(x, y))
                rows.append(row)
            ctrl = rho(control_setting, scheme, budgets[-1])
            if ctrl is not None:
                rows.append(unpaired_row(top.to_numpy(), ctrl.to_numpy(),
                                         f"rho {scheme} {heavy} - {control}, d={setting[1]} b={budgets[-1]}",
                                         part="heavy-tail specific", expect="greater", **where))
    tests = _family(rows, 6)
    verdict = _standard_verdict(tests, "comparisons")
    return _result(6, test, "paired and unpaired", tests, verdict, _headline(_holding(tests, verdict[0]), "min", part="loss"),
                   "d2(T) ratio SQ / tq-kv on heavy_tail at the largest budget (geometric mean), smallest",
                   transform=math.exp)
