"""Claim 11 (abstract; §1): implementation differences (RNG family, reference vs production
implementation) are separable from codec differences, by stats.validation's verdicts
(claim_separable).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ..margins import ALPHA
from ..validation import FLAGGED, TESTS, same_data, validate_samples
from .framework import (METRIC, ClaimResult, _aligned, _describe, _family, _result, _standard_verdict, lacking,
                        paired_row, unpaired_row)

SHOWN_INSIDE = ("equivalent", "negligible")          # every mean and spread effect placed inside the margin (TOST)
SHOWN = SHOWN_INSIDE + ("implementation-variance",)  # ... or beyond it, but explained by another implementation change


def _verdict_counts(rows: pd.DataFrame) -> str:
    """'2 equivalent, 1 negligible': the validation verdicts of some comparisons (from their labels)."""
    return ", ".join(f"{n} {v}" for v, n in rows.label.str.rsplit(": ", n=1).str[-1].value_counts(sort=False).items())


def claim_separable(main: pd.DataFrame | None, by_variable: dict[str, pd.DataFrame], cell: dict,
                    codecs: tuple[str, str], n_permutations: int = 1000) -> ClaimResult:
    """Claim 11 with stats.validation.validate_samples (its public API only). cell: the setting
    and budget {scenario, dim, budget}; codecs (A, B): a pair whose difference is a codec's;
    by_variable: {variable: rows of the same cells with only that implementation variable changed}
    (e.g. rng → --rng mt19937, impl → --impl reference). Comparisons: A vs B with every
    (X, X under a variable) as null, expected `codec-difference`; each X vs X under one variable
    with X under each other variable as null, expected shown not to be a `codec-difference`:
    `equivalent` or `negligible` (every mean and spread effect placed inside the margin by TOST) or
    `implementation-variance` (beyond it, but as large as another implementation change's).
    Outcomes: as claimed / opposite (A vs B: implementation-variance; X vs X′: codec-difference) /
    not significant (inconclusive, or equivalent for A vs B): by the framework's rule a validation
    that places nothing shows nothing, so `inconclusive` changes leave the claim `inconclusive`.
    Signs: validate_samples' Δ is mean(A) − mean(B) per six-D metric; the headline is B − A in
    d2(T), both stated in the reason."""
    a_name, b_name = codecs
    test = (f"{cell.get('scenario')} d={cell.get('dim')} b={cell.get('budget')}: stats.validation.validate_samples of "
            f"{a_name} vs {b_name} with the implementation nulls ({', '.join(by_variable)} changes of each), and of "
            f"each codec vs itself under one implementation change with the other change(s) as null; separable = "
            f"the codec pair is a codec-difference and every implementation change is shown not to be one "
            f"(equivalent or negligible: every mean and spread inside the margin by TOST; or implementation-variance); "
            f"an inconclusive validation shows nothing")
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
                               expect="equivalent", budget=cell["budget"], scenario=cell["scenario"], dim=cell["dim"])
            else:
                r = unpaired_row(changed[METRIC], base[METRIC], f"{scheme} {variable} changed: {res.verdict}",
                                 part="implementation", expect="equivalent", budget=cell["budget"],
                                 scenario=cell["scenario"], dim=cell["dim"])
            # counts for the claim only when shown: placed inside the margin (equivalent, negligible: every
            # mean and spread by TOST) or beyond it but explained by another implementation change
            # (implementation-variance); `inconclusive` (an effect the trials cannot place) shows nothing
            r.update(p_value=np.nan, equivalent=res.verdict in SHOWN_INSIDE,
                     outcome="opposite" if res.verdict in FLAGGED else "as claimed" if res.verdict in SHOWN
                     else "not significant")
            rows.append(r)
            unplaced = [t for t in TESTS if not res.main.p_inside[t] <= ALPHA]
            notes.append(f"{scheme} {variable} changed: {res.verdict}" + (
                f" (cannot place {', '.join(unplaced)} inside the margin)" if res.verdict == "inconclusive" and unplaced
                else ""))
    tests = _family(rows, 11)
    verdict, reason = _standard_verdict(tests, "validations")
    changes = tests[tests.part == "implementation"]
    shown, unshown = changes[changes.outcome == "as claimed"], changes[changes.outcome == "not significant"]
    pair = tests[tests.part == "codec pair"].iloc[0]
    pair_words = ("the codec pair is a codec-difference beyond the implementation null" if pair.outcome == "as claimed"
                  else f"the codec pair is not shown to be a codec-difference ({pair.label})")
    if verdict == "reproduced":
        reason = (f"{pair_words}, and each of the {len(changes)} implementation changes is shown not to be one "
                  f"({_verdict_counts(shown)})")
    elif verdict == "refuted":
        reason = "not separable: " + "; ".join(_describe(r) for r in tests[tests.outcome == "opposite"].to_dict("records"))
    elif len(unshown):
        one = len(unshown) == 1
        reason = (f"{pair_words}, but {len(unshown)} of {len(changes)} implementation changes "
                  f"{'is' if one else 'are'} not placed: {'its validation is' if one else 'their validations are'} "
                  f"inconclusive (an effect the trials cannot place inside the margin, none "
                  f"beyond it), and a test that shows nothing does not count for the claim"
                  + (f"; shown for {len(shown)} ({_verdict_counts(shown)})" if len(shown) else ""))
    reason += (f". Signs: each verdict's Δ is mean({a_name}) - mean({b_name}) on a six-D metric (below 0: {a_name}'s "
               f"error is the lower), the headline {b_name} - {a_name} in d2(T) (above 0: the same direction). "
               f"Verdicts: " + "; ".join(notes))
    head = pair
    return _result(11, test, "paired and unpaired", tests, (verdict, reason), head,
                   f"d2(T) difference of the codec pair, {b_name} minus {a_name} (the verdicts' Δ are {a_name} minus "
                   f"{b_name})")
