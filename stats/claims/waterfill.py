"""Claim 8 (abstract; §1 finding 5): water-filling degenerates to uniform allocation: sq-kv
against squ-kv at equal measured storage (claim_waterfill_uniform).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from kvcommon.rows import SETTING_COLUMNS
from ..equal_storage import LEVEL, at_storage, storage_column
from .framework import (METRIC, ClaimResult, _aligned, _equivalent, _family, _headline, _missing, _name,
                        _no_comparison, _result, _standard_verdict, _where, lacking, paired_row)
from .paper import SQ_CODECS, TAIL_BITS

WATERFILL_MARGIN = 0.05      # claim 8: "degenerates to uniform" = d2(T) within ±5 % (paired TOST)


def _waterfill_rows(trials: pd.DataFrame) -> list[dict]:
    """Claim 8's comparisons: per setting, at every measured storage level of a sq-kv or squ-kv
    cell with b > TAIL_BITS, both codecs placed there by stats.equal_storage.at_storage (the
    closest cell within the tolerance, else per-trial interpolation between the codec's two
    budgets around the level; never extrapolated); a level one codec cannot reach is skipped, a
    setting with no level both reach is one `no comparison` row."""
    storage = storage_column(trials)
    rows = []
    for setting, group in trials[trials.scheme.isin(SQ_CODECS)].groupby(list(SETTING_COLUMNS), sort=True):
        where = _where(setting)
        cells = group[group.budget > TAIL_BITS].groupby(["scheme", "budget"])[storage].mean()
        levels = {}
        for (scheme, budget), level in cells.sort_index().items():
            levels.setdefault(round(float(level), 6), (scheme, int(budget)))
        placed = at_storage(group, [METRIC], sorted(levels))
        found, seen = False, set()
        for level, (source_scheme, budget) in sorted(levels.items()):
            here = placed[placed[LEVEL] == level]
            a, b = (here[here.scheme == s].set_index("trial").sort_index() for s in SQ_CODECS)
            if a.empty or b.empty:
                continue
            if max(a.budget_high.iloc[0], b.budget_high.iloc[0]) <= TAIL_BITS:
                continue   # both at b <= b_tail: the same allocation by construction
            cells_used = tuple((c.source.iloc[0], int(c.budget_low.iloc[0]), int(c.budget_high.iloc[0]))
                               for c in (a, b))
            if all(src == "measured" for src, _, _ in cells_used) and cells_used in seen:
                continue   # two levels within the tolerance of the same two measured cells: compared once
            seen.add(cells_used)
            found = True
            x, y = _aligned(a, b, METRIC)

            def how(c):
                lo, hi = int(c.budget_low.iloc[0]), int(c.budget_high.iloc[0])
                return f"b={lo} measured" if c.source.iloc[0] == "measured" else f"b={lo}-{hi} interpolated"

            row = paired_row(x, y, f"sq-kv - squ-kv at {level:.3g} b/el ({source_scheme} b={budget}; sq-kv {how(a)}, "
                                   f"squ-kv {how(b)}; d2 {x.mean():.4g} vs {y.mean():.4g}), {_name(setting)}",
                             part="equal storage", expect="equivalent", budget=budget, **where)
            row["equivalent"] = _equivalent(x, y, WATERFILL_MARGIN * abs(np.concatenate([x, y]).mean()), paired=True)
            rows.append(row)
        if not found:
            rows.append(_no_comparison(f"sq-kv and squ-kv reach no common storage level at b > {TAIL_BITS}, "
                                       f"{_name(setting)}", part="equal storage", expect="equivalent",
                                       budget=TAIL_BITS + 1, **where))
    return rows


def claim_waterfill_uniform(trials: pd.DataFrame) -> ClaimResult:
    """Claim 8 at equal storage. Water-filling (sq-kv: Σ b_k = b·d over the calibrated eigenbasis)
    against a uniform allocation over the same basis (squ-kv: b bits on the d_eff leading
    coordinates, b_tail on the rest), compared at the same *measured* storage (_waterfill_rows:
    at nominal budget they store different amounts, e.g. 3.5 vs 2.6 bits/element at b = 3 on
    lowrank_aligned, d = 64, so the same budget compares storage, not allocation). Expected
    equivalent per setting and level: paired TOST within ±WATERFILL_MARGIN of their mean d2(T);
    a significant paired Wilcoxon (Holm) not inside the margin counts against. At b <= b_tail both
    allocations are b bits everywhere by construction and are not compared."""
    test = (f"sq-kv (water-filling) vs squ-kv (uniform over the same eigenbasis: b bits on the d_eff leading "
            f"coordinates, 2 on the rest) in d2(T) per setting at every measured storage level of either codec at "
            f"b >= 3 (each placed there measured within 2.5 % or interpolated between its budgets, never "
            f"extrapolated); paired Wilcoxon, Holm, and paired TOST within +-{WATERFILL_MARGIN:.0%}")
    if _missing(trials, SQ_CODECS) or not (trials.budget > TAIL_BITS).any():
        return lacking(8, test, "paired", "sq-kv and squ-kv at b >= 3")
    tests = _family(_waterfill_rows(trials), 8)
    verdict, reason = _standard_verdict(tests, "equal-storage comparisons")
    if verdict == "refuted":
        bad = tests[tests.outcome == "opposite"]
        by = bad.assign(better=np.where(bad.estimate.astype(float) < 0, "water-filling", "uniform")) \
            .groupby(["scenario", "better"]).size()
        reason = ("at equal measured storage the allocations differ: "
                  + ", ".join(f"{better} better on {sc} ({n})" for (sc, better), n in by.items()) + ". " + reason)
    head = _headline(tests.assign(size=tests.estimate.astype(float).abs()), "max", key="size") if len(tests) else None
    return _result(8, test, "paired", tests, (verdict, reason), head,
                   "d2(T) sq-kv minus squ-kv at equal measured storage, largest difference")
