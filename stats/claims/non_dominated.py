"""Claim 1 (abstract; §4): only three of the eight TQ variants are non-dominated (plain-kv,
tq-kv, tq-qkv), judged in d2(T) at no more measured storage (claim_non_dominated).
"""
from __future__ import annotations

import pandas as pd

from ..equal_storage import storage_column
from .framework import (METRIC, STORAGE_SLACK, ClaimResult, _aligned, _cells, _describe, _family, _headline, _missing,
                        _name, _no_comparison, _result, _settings, _where, lacking, paired_row)
from .paper import ELIMINATED, SURVIVORS, TQ_VARIANTS


def claim_non_dominated(trials: pd.DataFrame) -> ClaimResult:
    """Claim 1. Part `eliminated`: at each setting and budget, each eliminated variant against the
    survivor with the lowest mean d2(T) among those storing no more (measured storage, at most
    STORAGE_SLACK above); the claim expects the survivor lower. Part `survivor`: each survivor at
    each setting and budget against the best other TQ point (any variant, any budget) storing no
    more; the claim expects it not to be significantly worse somewhere.
    Verdict: refuted if an eliminated variant is significantly better than every survivor storing
    no more somewhere (`opposite` in part eliminated), or a survivor is significantly dominated at
    every setting and budget; reproduced if every eliminated point is significantly dominated and
    every survivor is not significantly dominated somewhere; inconclusive otherwise."""
    test = ("per setting (scenario, d) and budget, on d2(T) with measured storage: each of tq-fkv, tq-kqv, "
            "tq-qkqv, tq-kfv, tq-fkfv vs the best survivor (plain-kv, tq-kv, tq-qkv) storing no more (+2.5 %); "
            "each survivor vs the best other TQ point storing no more; paired Wilcoxon signed-rank, Holm")
    missing = _missing(trials, TQ_VARIANTS)
    if missing:
        return lacking(1, test, "paired", f"the TQ variant(s) {', '.join(missing)}")
    storage = storage_column(trials)
    cells = _cells(trials[trials.scheme.isin(TQ_VARIANTS)])
    rows = []
    for setting in _settings(cells):
        here = {k[1:]: c for k, c in cells.items() if k[0] == setting}
        store = {k: float(c[storage].mean()) for k, c in here.items()}
        mean = {k: float(c[METRIC].mean()) for k, c in here.items()}
        for budget in sorted({b for _, b in here}):
            for e in ELIMINATED:
                if (e, budget) not in here:
                    continue
                cands = [(s, budget) for s in SURVIVORS if (s, budget) in here
                         and store[(s, budget)] <= store[(e, budget)] * (1 + STORAGE_SLACK)]
                label = f"{e} vs best survivor, {_name(setting, budget)}"
                if not cands:
                    rows.append(_no_comparison(label, part=f"eliminated {e}", expect="greater", budget=budget,
                                               **_where(setting)))
                    continue
                best = min(cands, key=mean.get)
                x, y = _aligned(here[(e, budget)], here[best], METRIC)
                rows.append(paired_row(x, y, f"{e} - {best[0]}, {_name(setting, budget)}", part=f"eliminated {e}",
                                       expect="greater", budget=budget, **_where(setting)))
            for s in SURVIVORS:
                if (s, budget) not in here:
                    continue
                rivals = [k for k in here if k != (s, budget) and store[k] <= store[(s, budget)] * (1 + STORAGE_SLACK)]
                if not rivals:   # nothing stores as little: non-dominated by construction
                    rows.append(dict(_no_comparison(f"{s} (no TQ point stores less), {_name(setting, budget)}",
                                                    part=f"survivor {s}", expect="not greater", budget=budget,
                                                    **_where(setting)), outcome="as claimed"))
                    continue
                best = min(rivals, key=mean.get)
                x, y = _aligned(here[(s, budget)], here[best], METRIC)
                rows.append(paired_row(x, y, f"{s} - {best[0]} b={best[1]}, {_name(setting, budget)}",
                                       part=f"survivor {s}", expect="not greater", budget=budget, **_where(setting)))
    tests = _family(rows, 1)
    elim = tests[tests.part.str.startswith("eliminated ")]
    of = {s: tests[tests.part == f"survivor {s}"] for s in SURVIVORS}
    dominated_everywhere = [s for s in SURVIVORS if len(of[s]) and (of[s].outcome == "opposite").all()]
    free_somewhere = [s for s in SURVIVORS if (of[s].outcome != "opposite").any()]
    bad = elim[elim.outcome == "opposite"]
    n_elim, n_dom = len(elim), int((elim.outcome == "as claimed").sum())
    if len(bad) or dominated_everywhere:
        parts = []
        if dominated_everywhere:
            for s in dominated_everywhere:
                worst = _headline(of[s], "min")
                parts.append(f"{s} is significantly dominated at every setting and budget "
                             f"(weakest: {_describe(worst)})")
        if len(bad):
            parts.append(f"{len(bad)} eliminated point(s) beat every survivor storing no more: "
                         + "; ".join(_describe(r) for r in bad.head(3).to_dict("records")))
        verdict = ("refuted", "; ".join(parts) + f"; {n_dom} of {n_elim} eliminated points are dominated")
        if dominated_everywhere:
            s = dominated_everywhere[0]
            head = _headline(of[s], "min")
            return _result(1, test, "paired", tests, verdict, head,
                           f"d2(T) of survivor {s} minus the best TQ point storing no more, weakest domination")
        return _result(1, test, "paired", tests, verdict, _headline(bad, "min"),
                       "d2(T) of an eliminated variant minus the best survivor storing no more")
    head = _headline(elim, "min")
    effect = "d2(T) of an eliminated variant minus the best survivor storing no more, weakest domination"
    if n_dom == n_elim and len(free_somewhere) == len(SURVIVORS):
        why = (f"all {n_elim} eliminated points are significantly dominated by a survivor storing no more, and each "
               f"survivor is undominated somewhere")
        return _result(1, test, "paired", tests, ("reproduced", why), head, effect)
    notes = []
    if n_dom < n_elim:
        notes.append(f"{n_elim - n_dom} of {n_elim} eliminated points not significantly dominated")
    missing_free = [s for s in SURVIVORS if s not in free_somewhere]
    if missing_free:
        notes.append(f"no comparison for {', '.join(missing_free)}")
    return _result(1, test, "paired", tests, ("inconclusive", "; ".join(notes)), head, effect)
