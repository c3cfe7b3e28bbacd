"""Claims 2 and 3 (§4, Fig. 1): FULL sketches are worse than their RHT counterparts, and QJL on
the V path always hurts: each a set of (worse, better) codec pairs compared in d2(T) at every
setting and budget (_pairs_worse).
"""
from __future__ import annotations

import pandas as pd

from .framework import (METRIC, ClaimResult, _aligned, _cells, _family, _headline, _missing, _name, _result,
                        _holding, _standard_verdict, _where, lacking, paired_row)
from .paper import FULL_VS_RHT, V_QJL


def _pairs_worse(trials: pd.DataFrame, claim_id: int, pairs, what: str) -> ClaimResult:
    """For each (worse, better) pair, setting and budget: d2(T)[worse] − d2(T)[better] paired,
    expected > 0 everywhere (standard rule)."""
    test = (f"{', '.join(f'{a} - {b}' for a, b in pairs)} in d2(T) per setting (scenario, d) and budget; "
            f"paired Wilcoxon signed-rank, Holm; effect: mean paired difference, bootstrap 95 % CI")
    missing = _missing(trials, sorted({s for p in pairs for s in p}))
    if missing:
        return lacking(claim_id, test, "paired", f"the scheme(s) {', '.join(missing)}")
    cells = _cells(trials[trials.scheme.isin({s for p in pairs for s in p})])
    rows = []
    for (setting, scheme, budget), worse in cells.items():
        for a, b in pairs:
            if scheme != a or (setting, b, budget) not in cells:
                continue
            x, y = _aligned(worse, cells[(setting, b, budget)], METRIC)
            rows.append(paired_row(x, y, f"{a} - {b}, {_name(setting, budget)}", part=f"{a} vs {b}",
                                   expect="greater", budget=budget, **_where(setting)))
    tests = _family(rows, claim_id)
    verdict = _standard_verdict(tests, what)
    return _result(claim_id, test, "paired", tests, verdict, _headline(_holding(tests, verdict[0]), "min"),
                   "smallest mean paired difference in d2(T)")


def claim_full_worse(trials: pd.DataFrame) -> ClaimResult:
    """Claim 2: tq-fkv > tq-qkv, tq-fkfv > tq-qkqv, tq-kfv > tq-kqv in d2(T), every setting and budget."""
    return _pairs_worse(trials, 2, FULL_VS_RHT, "FULL-vs-RHT comparisons")


def claim_v_qjl_hurts(trials: pd.DataFrame) -> ClaimResult:
    """Claim 3: adding QJL on V raises d2(T): tq-kqv > tq-kv, tq-qkqv > tq-qkv, tq-kfv > tq-kv,
    tq-fkfv > tq-fkv, every setting and budget."""
    return _pairs_worse(trials, 3, V_QJL, "with-vs-without-V-QJL comparisons")
