"""Run directories as an older kvharness wrote them, for the tests that a store still reads,
reports and resumes after columns were added to `trials`."""
from __future__ import annotations

import sqlite3
from pathlib import Path

from harness.store import RESULTS_FILE


def rewrite_as_old_store(out: Path, columns: list[str], scheme: str) -> None:
    """Rewrite out/results.sqlite as an older version's run interrupted after the cell of `scheme`:
    `trials` with only `columns` (in that order) and only that scheme's rows, `cells` with only
    its cell."""
    with sqlite3.connect(out / RESULTS_FILE) as con:
        con.execute(f"CREATE TABLE trials_old AS SELECT {', '.join(columns)} FROM trials WHERE scheme = ?", (scheme,))
        con.execute("DROP TABLE trials")
        con.execute("ALTER TABLE trials_old RENAME TO trials")
        con.execute("DELETE FROM cells WHERE scheme != ?", (scheme,))
