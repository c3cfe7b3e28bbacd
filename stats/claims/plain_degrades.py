"""Claim 4 (§4, Fig. 1 caption): plain-kv degrades with the head dim d on lowrank_aligned,
tq-kv does not (claim_plain_degrades).
"""
from __future__ import annotations

import pandas as pd

from .framework import (METRIC, ClaimResult, _equivalent, _family, _headline, _holding, _missing, _result, _standard_verdict,
                        lacking, unpaired_row)

DEGRADE_MARGIN = 0.10        # claim 4: "does not degrade" = within ±10 % of the small-d mean (TOST)


def claim_plain_degrades(trials: pd.DataFrame, scenario: str = "lowrank_aligned") -> ClaimResult:
    """Claim 4: on lowrank_aligned, per budget, d2(T) at the largest d minus at the smallest d
    (different draws: Mann–Whitney, unpaired bootstrap CI). plain-kv: expected greater (and
    equivalence within ±DEGRADE_MARGIN of its small-d mean counts against); tq-kv: expected not
    greater (a significant decrease or equivalence within ±DEGRADE_MARGIN is as claimed)."""
    test = (f"on {scenario}, d2(T) at the largest minus the smallest d per budget, plain-kv and tq-kv "
            f"(different draws: Mann-Whitney, Holm); 'does not degrade' = lower or within "
            f"+-{DEGRADE_MARGIN:.0%} (Welch TOST)")
    missing = _missing(trials, ("plain-kv", "tq-kv"), (scenario,))
    if missing:
        return lacking(4, test, "unpaired", f"{', '.join(missing)}")
    sub = trials[(trials.scenario == scenario) & trials.scheme.isin(("plain-kv", "tq-kv"))]
    dims = sorted(sub.dim.unique())
    if len(dims) < 2:
        return lacking(4, test, "unpaired", "two head dims (it has d = " + ", ".join(map(str, dims)) + ")")
    lo, hi = dims[0], dims[-1]
    rows = []
    for (scheme, budget), g in sub.groupby(["scheme", "budget"], sort=True):
        small, large = g[g.dim == lo][METRIC].to_numpy(float), g[g.dim == hi][METRIC].to_numpy(float)
        if len(small) < 2 or len(large) < 2:
            continue
        margin = DEGRADE_MARGIN * abs(small.mean())
        row = unpaired_row(large, small, f"{scheme} d={hi} - d={lo}, {scenario} b={budget}", part=scheme,
                           expect="greater" if scheme == "plain-kv" else "not greater", budget=int(budget),
                           scenario=scenario, dim=int(hi))
        row["equivalent"] = _equivalent(large, small, margin, paired=False)
        rows.append(row)
    tests = _family(rows, 4)
    verdict = _standard_verdict(tests, "comparisons across d")
    head = _headline(_holding(tests, verdict[0]), "min", part="plain-kv")
    return _result(4, test, "unpaired", tests, verdict, head,
                   f"plain-kv's smallest increase of d2(T) from d={lo} to d={hi}")
