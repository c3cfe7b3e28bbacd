"""The cells of a stored run the report can use: every trial finite in the columns it compares.

A run written by this kvharness stores no trial whose metrics are not finite (harness.cell
refuses them); a store written by an older version or by another tool may hold NaN (read
back from NULL) or an infinity. Such a cell is left out of the findings, named in one line,
and the rest of the run is reported. `required` columns (the error point the comparisons
rank on, the storage) must be finite in every trial; an `optional` column may be absent from a
cell altogether (NaN in all its trials: evicted_mass of a codec that evicts nothing, a column
added after the store was written) but not in only some of its trials, and never infinite.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from kvcommon.rows import CELL_COLUMNS


def _cell_words(key: tuple) -> str:
    return "cell (" + ", ".join(f"{name} {value}" for name, value in zip(CELL_COLUMNS, key)) + ")"


def finite_cells(trials: pd.DataFrame, required: tuple[str, ...], optional: tuple[str, ...] = ()
                 ) -> tuple[pd.DataFrame, tuple[str, ...]]:
    """(the trials of the cells whose values are usable, one line per cell left out saying which
    columns are not finite in how many of its trials)."""
    columns = [c for c in dict.fromkeys(required + optional) if c in trials.columns]
    values = trials[columns].apply(pd.to_numeric, errors="coerce").to_numpy(dtype=float)
    finite = pd.DataFrame(np.isfinite(values), columns=columns, index=trials.index)
    bad_rows = pd.Series(False, index=trials.index)
    notes = []
    for key, index in trials.groupby(list(CELL_COLUMNS), sort=True).groups.items():
        ok = finite.loc[index]
        infinite = np.isinf(values[trials.index.get_indexer(index)])
        bad = [c for i, c in enumerate(columns)
               if infinite[:, i].any() or (c in required and not ok[c].all())
               or (c not in required and ok[c].any() and not ok[c].all())]
        if bad:
            n_bad = int((~ok[bad]).any(axis=1).sum())
            notes.append(f"left out: {_cell_words(key)}: {', '.join(bad)} not finite in {n_bad} of {len(index)} trials")
            bad_rows.loc[index] = True
    return trials[~bad_rows], tuple(notes)
