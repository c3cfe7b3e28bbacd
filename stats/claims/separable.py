"""Claim 11 (abstract; §1): implementation differences (RNG family, reference vs production
implementation) are separable from codec differences, by stats.validation's verdicts
(claim_separable).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ..margins import ALPHA
from ..validation import same_data, validate_samples
from .framework import (METRIC, ClaimResult, _aligned, _describe, _family, _result, _standard_verdict, lacking,
                        paired_row, unpaired_row)


def claim_separable(main: pd.DataFrame | None, by_variable: dict[str, pd.DataFrame], cell: dict,
                    codecs: tuple[str, str], n_permutations: int = 1000) -> ClaimResult:
    """Claim 11 with stats.validation.validate_samples (its public API only). cell: the setting
    and budget {scenario, dim, budget}; codecs (A, B): a pair whose difference is a codec's;
    by_variable: {variable: rows of the same cells with only that implementation variable changed}
    (e.g. rng → --rng mt19937, impl → --impl reference). Comparisons: A vs B with every
    (X, X under a variable) as null, expected `codec-difference`; each X vs X under one variable
    with X under each other variable as null, expected not `codec-difference` (`equivalent` or
    `implementation-variance`). Outcomes: as claimed / opposite (A vs B: implementation-variance;
    X vs X′: codec-difference) / not significant (inconclusive, or equivalent for A vs B)."""
    a_name, b_name = codecs
    test = (f"{cell.get('scenario')} d={cell.get('dim')} b={cell.get('budget')}: stats.validation.validate_samples of "
            f"{a_name} vs {b_name} with the implementation nulls ({', '.join(by_variable)} changes of each), and of "
            f"each codec vs itself under one implementation change with the other change(s) as null; separable = "
            f"the codec pair is a codec-difference and no implementation change is")
    if main is None or not by_variable or any(f is None or f.empty for f in by_variable.values()):
        return lacking(11, test, "paired and unpaired", "the implementation-null runs")

    def pick(frame, scheme):
        sel = frame[(frame.scheme == scheme) & (frame.scenario == cell["scenario"]) & (frame.dim == cell["dim"])
                    & (frame.budget == cell["budget"])]
        return sel.sort_values("trial")

    a, b = pick(main, a_name), pick(main, b_name)
    variants = {v: {s: pick(f, s) for s in codecs} for v, f in by_variable.items()}
    if a.empty or b.empty or any(x.empty for d in variants.values() for x in d.values()):
        return lacking(11, test, "paired and unpaired", f"the cells {a_name}/{b_name} at {cell} in every run")
    rows, notes = [], []
    nulls = [(x, variants[v][s]) for s, x in ((a_name, a), (b_name, b)) for v in variants]
    result = validate_samples(a, b, nulls, alpha=ALPHA, n_permutations=n_permutations, seed=11)
    x, y = _aligned(b.set_index("trial"), a.set_index("trial"), METRIC)
    row = paired_row(x, y, f"{b_name} - {a_name}: {result.verdict}", part="codec pair", expect="greater",
                     budget=cell["budget"], scenario=cell["scenario"], dim=cell["dim"])
    row.update(p_value=np.nan, outcome={"codec-difference": "as claimed", "implementation-variance": "opposite"}.get(
        result.verdict, "not significant"))
    rows.append(row)
    notes.append(f"{a_name} vs {b_name}: {result.verdict} ({result.reason})")
    for i, (variable, frames) in enumerate(variants.items()):
        for scheme, base in ((a_name, a), (b_name, b)):
            other = [(base, variants[w][scheme]) for w in variants if w != variable]
            changed = frames[scheme]
            res = validate_samples(base, changed, other, alpha=ALPHA, n_permutations=n_permutations, seed=12 + i)
            paired = same_data(base, changed)
            if paired:
                x, y = _aligned(changed.set_index("trial"), base.set_index("trial"), METRIC)
                r = paired_row(x, y, f"{scheme} {variable} changed: {res.verdict}", part="implementation",
                               expect="differs", budget=cell["budget"], scenario=cell["scenario"], dim=cell["dim"])
            else:
                r = unpaired_row(changed[METRIC], base[METRIC], f"{scheme} {variable} changed: {res.verdict}",
                                 part="implementation", expect="differs", budget=cell["budget"],
                                 scenario=cell["scenario"], dim=cell["dim"])
            # not a codec difference: equivalent, negligible, explained by the other changes, or no
            # effect beyond the margin found (inconclusive only because the trials cannot place it inside)
            harmless = res.verdict in ("equivalent", "negligible", "implementation-variance") or (
                res.verdict == "inconclusive" and not res.beyond_margin)
            r.update(p_value=np.nan, outcome="opposite" if res.verdict == "codec-difference" else
                     "as claimed" if harmless else "not significant")
            rows.append(r)
            notes.append(f"{scheme} {variable} changed: {res.verdict}")
    tests = _family(rows, 11)
    verdict, reason = _standard_verdict(tests, "validations")
    reason = {"reproduced": "the codec pair is a codec-difference beyond the implementation null and no "
                            "implementation change is one",
              "refuted": "not separable: " + "; ".join(_describe(r) for r in
                                                       tests[tests.outcome == "opposite"].to_dict("records")),
              }.get(verdict, reason) + ". Verdicts: " + "; ".join(notes)
    head = tests[tests.part == "codec pair"].iloc[0]
    return _result(11, test, "paired and unpaired", tests, (verdict, reason), head,
                   "d2(T) difference of the codec pair")
