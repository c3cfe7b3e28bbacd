"""The run store: DIR/results.sqlite (table `trials`, one row per trial, its columns those of
the row schema, kvcommon/rows.py; table `cells`, one row per finished cell; table `diagnostics`,
a codec's own per-trial facts that no trials column names, read back as columns of trials())
and DIR/manifest.json (configuration and provenance). A run may hold derived tables too
(RunStore.write_table / RunStore.table): a reproduction (harness reproduce) its `claims` table.

Work is committed a chunk of trials at a time: a chunk's rows and its `chunks` entry in one
transaction, and with a cell's last chunk also its `cells` row (write_chunk). An interruption at
any moment loses at most the chunk in progress; `--resume` continues each cell from its first
missing trial (stored_trials). A cell counts as finished, and its rows are read (trials), only
once its `cells` row exists. The store is checked on open for the commands that read or resume
it (check_integrity: PRAGMA quick_check), and one run at a time writes a directory (lock).
A store written before calib_tokens was part of a cell (its `cells` table lacks the column)
is migrated when opened for writing (RunStore._connect); one written before a column of
rows.ADDED_COLUMNS existed gains it (NULL in the old rows) on open, and reads back with it as NaN.

The store knows its own integrity (RunStore.damage): every trial row is accounted for by a commit
of the run — a finished cell holds trials 0 .. n_trials-1 of its `cells` row, each once; an
unfinished cell the trials of its `chunks` entries, each once; every cell is one of the
manifest's configuration. What a hand edit breaks is named per cell: *missing* trials (rows
deleted: the cell counts as unfinished, readers say so and `--resume` recomputes them),
*duplicated* and *orphaned* rows (a trial stored twice; a row no commit wrote; a cell the run
does not have). Readers refuse duplicated and orphaned rows of a finished cell (DamagedRows),
never averaging them in; a resume recomputes each damaged cell from its last sound chunk on
(stored_trials, writing). Text or blobs in a numeric column, a manifest whose config is not the
object a run writes, and a `.lock` that is no file are refused in one line as well.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import sqlite3
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import pandas as pd

from kvcommon.rows import (ADDED_COLUMNS, CELL_COLUMNS, CONFIG_COLUMNS, INTEGER_COLUMNS, TEXT_COLUMNS,
                           TRIAL_COLUMNS)

RESULTS_FILE = "results.sqlite"
MANIFEST_FILE = "manifest.json"
LOCK_FILE = ".lock"  # held (flock) by the run writing the directory, for the run's life

# A codec's diagnostics that no trials column names (a plug-in's own): long form, one row per
# (cell, trial, name, value); RunStore.trials() returns them as extra columns.
DIAGNOSTICS_TABLE = "diagnostics"
_OWN_TABLES = {"trials", "cells", DIAGNOSTICS_TABLE}  # written only through write_cell / write_chunk


# The columns each of the run's tables holds in every version a store can be read or resumed
# from (ADDED_COLUMNS and cells.calib_tokens are added on open): a table that lacks one is
# another program's.
_REQUIRED_COLUMNS = {
    "trials": tuple(c for c in TRIAL_COLUMNS if c not in ADDED_COLUMNS),
    "cells": tuple(c for c in CELL_COLUMNS if c != "calib_tokens") + ("n_trials", "wall_s", "finished_at"),
    "chunks": CELL_COLUMNS + ("first_trial", "n_trials", "wall_s", "finished_at"),
    DIAGNOSTICS_TABLE: CELL_COLUMNS + ("trial", "name", "value"),
}


def _sql_value(value):
    """A frame cell as sqlite stores it: numpy scalars as Python numbers, NaN, None and pd.NA (a
    nullable integer column's missing value) as NULL."""
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or value is pd.NA or (isinstance(value, float) and np.isnan(value)):
        return None
    return value


def _sql_type(column: str) -> str:
    return "TEXT" if column in TEXT_COLUMNS else "INTEGER" if column in INTEGER_COLUMNS else "REAL"


def _add_missing_columns(con: sqlite3.Connection) -> None:
    """ALTER TABLE trials ADD COLUMN for each column of ADDED_COLUMNS a store written before it
    lacks; old rows hold NULL there (the metric was not measured)."""
    present = {row[1] for row in con.execute("PRAGMA table_info(trials)")}
    missing = [c for c in ADDED_COLUMNS if c not in present]
    if missing:
        with con:
            for column in missing:
                con.execute(f"ALTER TABLE trials ADD COLUMN {column} {_sql_type(column)}")


class StoreError(Exception):
    """A run directory the store cannot read, resume or write as asked, in one line naming the
    file and what to do (the command line reports it as a usage error, exit status 2)."""


class CorruptStore(StoreError):
    """results.sqlite is damaged (PRAGMA quick_check, or sqlite itself, says so)."""


class StoreLocked(StoreError):
    """Another run holds the directory's lock."""


class CorruptManifest(StoreError):
    """manifest.json is not the JSON object a run writes."""


class ForeignStore(StoreError):
    """results.sqlite is not a kvharness store (another program's database, a directory)."""


class ReadOnlyStore(StoreError):
    """results.sqlite cannot be written (a --resume checks before it writes anything)."""


class DamagedRows(StoreError):
    """Rows a run never writes: duplicated or orphaned trials, text or a blob in a numeric column,
    a cell outside the run's configuration (RunStore.damage, module doc)."""


class LockFileError(StoreError):
    """The directory's .lock is not a file a run can lock (a directory, say)."""


class InputChanged(StoreError):
    """An input file of the run (a replay capture, a fitted spec) is not the one the run began
    with (harness.provenance.check_inputs)."""


class UnusableStore(StoreError):
    """The stored values cannot answer what a command asks (no finished cell with finite values;
    too few trials to test)."""


# A manifest field's annotation in harness.sweep.SweepConfig -> the words for what it must be.
_JSON_WORDS = {"int": "an integer", "str": "a string", "dict": "an object", "None": "null",
               "tuple[int, ...]": "a list of integers", "tuple[str, ...]": "a list of strings"}


def _json_fits(annotation: str, value) -> bool:
    """Whether a JSON value is what a SweepConfig field of this annotation (a string: the module
    uses postponed annotations) reads back: 'int', 'str | None', 'tuple[int, ...]', ...; an
    annotation of another form is not checked."""
    for option in (a.strip() for a in annotation.split("|")):
        if option == "None" and value is None:
            return True
        if option == "int" and isinstance(value, int) and not isinstance(value, bool):
            return True
        if option == "str" and isinstance(value, str):
            return True
        if option == "dict" and isinstance(value, dict) and all(isinstance(v, dict) for v in value.values()):
            return True
        if option.startswith("tuple[") and isinstance(value, list):
            if all(_json_fits(option[len("tuple["):].split(",")[0], x) for x in value):
                return True
        if option not in _JSON_WORDS and not option.startswith("tuple["):
            return True
    return False


def _manifest_problem(manifest: dict) -> str | None:
    """What makes a manifest's JSON object other than a run writes it (its config an object of
    SweepConfig's fields, each of its type; resumed_at a list; inputs an object), or None. A
    config written by an older version (fields added since absent, calib_tokens one integer)
    is what a run wrote."""
    from .sweep import SweepConfig
    for name, kind in (("resumed_at", list), ("inputs", dict)):
        if name in manifest and not isinstance(manifest[name], kind):
            return f"its {name} is a JSON {type(manifest[name]).__name__}, not {'a list' if kind is list else 'an object'}"
    if "config" not in manifest:
        return None
    config = manifest["config"]
    if not isinstance(config, dict):
        return f"its config is a JSON {'null' if config is None else type(config).__name__}, not an object"
    fields = {f.name: f for f in dataclasses.fields(SweepConfig)}
    unknown = sorted(set(config) - set(fields))
    if unknown:
        return f"its config holds the unknown field(s) {', '.join(unknown[:4])}; valid: {', '.join(fields)}"
    required = [n for n, f in fields.items() if f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING and n not in config]
    if required:
        return f"its config lacks the field(s) {', '.join(required)}"
    for name, value in SweepConfig.upgrade_json(config).items():
        annotation = str(fields[name].type)
        if not _json_fits(annotation, value):
            words = " or ".join(_JSON_WORDS.get(a.strip(), a.strip()) for a in annotation.split("|"))
            return f"its config field {name} is {json.dumps(value)[:40]}, not {words}"
    return None


# what sqlite's messages about a damaged file contain, and the message
_DAMAGED = {"malformed": "database disk image is malformed", "not a database": "file is not a database"}


def _insert_trials(con: sqlite3.Connection, rows: list[dict]) -> None:
    """The trial rows into `trials`; what a row holds beyond TRIAL_COLUMNS (a codec's own
    diagnostics, harness.cell._diagnostics) into `diagnostics`, one row per (trial, name)."""
    con.executemany(f"INSERT INTO trials ({', '.join(TRIAL_COLUMNS)}) VALUES ({', '.join('?' * len(TRIAL_COLUMNS))})",
                    [tuple(row.get(c) for c in TRIAL_COLUMNS) for row in rows])
    names = sorted(set().union(*(row.keys() for row in rows)) - set(TRIAL_COLUMNS))   # rows of a chunk share them
    if names:
        con.execute(f"CREATE TABLE IF NOT EXISTS {DIAGNOSTICS_TABLE} ({_cell_columns_sql()}, trial INTEGER NOT NULL, "
                    f"name TEXT NOT NULL, value REAL, PRIMARY KEY ({', '.join(CELL_COLUMNS)}, trial, name))")
        con.executemany(f"INSERT INTO {DIAGNOSTICS_TABLE} VALUES ({', '.join('?' * (len(CELL_COLUMNS) + 3))})",
                        [(*(row[c] for c in CELL_COLUMNS), row["trial"], name, _sql_value(row[name]))
                         for row in rows for name in names if name in row])


def _cell_columns_sql() -> str:
    """The cell's key columns as a table declares them."""
    return ", ".join(f"{c} {_sql_type(c)} NOT NULL" for c in CELL_COLUMNS)


def _chunks_schema() -> str:
    return (f"CREATE TABLE IF NOT EXISTS chunks ({_cell_columns_sql()}, first_trial INTEGER NOT NULL, n_trials INTEGER NOT NULL, "
            f"wall_s REAL NOT NULL, peak_mem_mb REAL, finished_at TEXT NOT NULL, "
            f"PRIMARY KEY ({', '.join(CELL_COLUMNS)}, first_trial))")


def cell_name(cell: tuple) -> str:
    """A cell key as one word, scenario/scheme/budget/dim/seq_len/queries/calib_tokens."""
    return "/".join(map(str, cell))


def _ranges(trials: Iterable[int], most: int = 6) -> str:
    """Trial indices as '3, 5, 7-9' (the first `most` runs, then '...')."""
    runs: list[list[int]] = []
    for t in sorted(trials):
        if runs and t == runs[-1][1] + 1:
            runs[-1][1] = t
        else:
            runs.append([t, t])
    words = [f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:most]]
    return ", ".join(words) + (", ..." if len(runs) > most else "")


@dataclasses.dataclass(frozen=True)
class CellDamage:
    """Trial rows of one cell that the run's commits do not account for (module doc): `kind`
    'missing' (trials of a finished cell, or of a committed chunk, without their row),
    'duplicated' (a trial with more than one row), 'orphaned' (a row no commit wrote: a trial
    outside the cell's finished range or its chunks) or 'outside' (the cell is not one of the
    manifest's configuration); `finished` whether the cell has its `cells` row."""
    cell: tuple
    kind: str
    trials: tuple[int, ...]
    finished: bool

    def __str__(self) -> str:
        n = len(self.trials)
        what = {"missing": f"lacks the row(s) of trial(s) {_ranges(self.trials)}",
                "duplicated": f"holds trial(s) {_ranges(self.trials)} more than once",
                "orphaned": f"holds row(s) of trial(s) {_ranges(self.trials)} that no commit of the run wrote",
                "outside": f"is not a cell of the run's configuration (manifest.json) yet holds rows of {n} trial(s)"}
        return f"cell {cell_name(self.cell)} {what[self.kind]}"


@dataclasses.dataclass(frozen=True)
class _Survey:
    """What the store holds, per cell key: `rows` (count, distinct trials, min, max of its trial
    rows), `finished` (its `cells` row's n_trials), `chunks` (its (first_trial, n_trials) entries
    in order), `per_trial` ({trial: rows} of the cells not sound or outside the configuration);
    `expected` the cells of the manifest's configuration and `n_trials` its trials per cell
    (None without a manifest config)."""
    rows: dict
    finished: dict
    chunks: dict
    per_trial: dict
    expected: frozenset | None
    n_trials: int | None

    def sound(self, key: tuple) -> bool:
        """A finished cell holding each of its trials 0..n-1 once and nothing else."""
        n = self.finished.get(key)
        count, distinct, first, last = self.rows.get(key, (0, 0, None, None))
        return n is not None and count == distinct == n and (n == 0 or (first == 0 and last == n - 1))

    def walk(self, key: tuple) -> tuple[int, list[int]]:
        """(k, the first_trial of each chunk entry up to k): trials 0..k-1 are whole chunks, in
        order from trial 0, each trial of them stored once; a resume keeps these and recomputes
        the rest of the cell. A cell that would be whole without its `cells` row (k = its trials)
        recomputes its last chunk, whose commit writes that row."""
        counts, k, kept = self.per_trial.get(key, {}), 0, []
        limit = self.n_trials if self.n_trials is not None else float("inf")
        for first, n in self.chunks.get(key, []):
            if first != k or n < 1 or first + n > limit or any(counts.get(t) != 1 for t in range(first, first + n)):
                break
            kept.append(first)
            k = first + n
        if k == limit:
            k = kept.pop()
        return k, kept


def _classify(survey: _Survey) -> list[CellDamage]:
    """The CellDamage of every cell the survey holds that is not sound (module doc), in cell order."""
    found = []
    for key in sorted(set(survey.rows) | set(survey.finished), key=lambda k: tuple(map(str, k))):
        counts = survey.per_trial.get(key, {})
        if survey.expected is not None and key not in survey.expected:
            if key in survey.rows:
                found.append(CellDamage(key, "outside", tuple(sorted(counts)), key in survey.finished))
            continue
        if survey.sound(key):
            continue
        finished = key in survey.finished
        if finished:
            n = survey.finished[key]
            orphaned = [t for t in counts if not 0 <= t < n]
            missing = [t for t in range(n) if t not in counts]
        else:
            covered = {t for first, n in survey.chunks.get(key, []) for t in range(first, first + n)}
            orphaned = [t for t in counts if t not in covered]
            missing = [t for t in covered if t not in counts]
        duplicated = [t for t, n in counts.items() if n > 1]
        for kind, trials in (("missing", missing), ("duplicated", duplicated), ("orphaned", orphaned)):
            if trials:
                found.append(CellDamage(key, kind, tuple(sorted(trials)), finished))
    return found


class RunStore:
    """Single writer of one run directory."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.path = self.directory / RESULTS_FILE
        self._writer: sqlite3.Connection | None = None   # held open by writing()

    # --- manifest ---------------------------------------------------------------------------
    def read_manifest(self) -> dict | None:
        """The manifest, None where there is none; CorruptManifest where it is not a JSON object."""
        path = self.directory / MANIFEST_FILE
        if not path.exists():
            return None
        try:
            manifest = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CorruptManifest(f"{path} cannot be read as JSON ({type(exc).__name__}: {str(exc)[:80]}); restore it "
                                  f"from a copy, or run again into a new --out") from None
        if not isinstance(manifest, dict):
            raise CorruptManifest(f"{path} holds a JSON {type(manifest).__name__}, not the object a run writes; "
                                  f"restore it from a copy, or run again into a new --out")
        problem = _manifest_problem(manifest)
        if problem:
            raise CorruptManifest(f"{path} is not what a run writes ({problem}); restore it from a copy, or run again "
                                  f"into a new --out")
        return manifest

    def write_manifest(self, manifest: dict) -> None:
        """Atomic replace, so a crash never leaves half a manifest."""
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.directory / (MANIFEST_FILE + ".tmp")
        try:
            tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
            os.replace(tmp, self.directory / MANIFEST_FILE)
        finally:   # a full disk: no half-written temporary file left either
            tmp.unlink(missing_ok=True)

    # --- results ----------------------------------------------------------------------------
    def _connect(self) -> sqlite3.Connection:
        self.directory.mkdir(parents=True, exist_ok=True)
        con = sqlite3.connect(self.path)
        cols = ", ".join(f"{c} {_sql_type(c)} NOT NULL" if c in CONFIG_COLUMNS else f"{c} {_sql_type(c)}"
                         for c in TRIAL_COLUMNS)
        con.execute(f"CREATE TABLE IF NOT EXISTS trials ({cols})")
        _add_missing_columns(con)
        schema = (f"({_cell_columns_sql()}, n_trials INTEGER NOT NULL, wall_s REAL NOT NULL, finished_at TEXT NOT NULL, "
                  f"peak_mem_mb REAL, PRIMARY KEY ({', '.join(CELL_COLUMNS)}))")
        present = [row[1] for row in con.execute("PRAGMA table_info(cells)")]
        if present and "calib_tokens" not in present:
            self._add_calib_tokens(con, schema, present)
        con.execute(f"CREATE TABLE IF NOT EXISTS cells {schema}")
        return con

    def _add_calib_tokens(self, con: sqlite3.Connection, schema: str, present: list[str]) -> None:
        """Rebuild a `cells` table written before calib_tokens was part of a cell, in one
        transaction: each cell's calib_tokens is that of its trials rows (one value per run
        then), or the manifest's where a cell has none; it joins the primary key."""
        config = (self.read_manifest() or {}).get("config") or {}
        fallback = config.get("calib_tokens")
        if isinstance(fallback, list):
            fallback = fallback[0] if len(fallback) == 1 else None
        old = [c for c in CELL_COLUMNS if c != "calib_tokens"]
        rest = [c for c in present if c not in CELL_COLUMNS]
        match = " AND ".join(f"t.{c} = cells_old.{c}" for c in old)
        con.execute("BEGIN IMMEDIATE")
        try:
            con.execute("ALTER TABLE cells RENAME TO cells_old")
            con.execute(f"CREATE TABLE cells {schema}")
            calib = f"COALESCE((SELECT MIN(t.calib_tokens) FROM trials t WHERE {match}), ?)"
            con.execute(f"INSERT INTO cells ({', '.join(old + ['calib_tokens'] + rest)}) "
                        f"SELECT {', '.join(old + [calib] + rest)} FROM cells_old", (fallback,))
            con.execute("DROP TABLE cells_old")
            con.commit()
        except BaseException:
            con.rollback()
            raise

    def finished_cells(self) -> set[tuple]:
        """The cells that are finished and sound: a `cells` row, and each of its trials stored once
        (module doc); a cell a hand edit damaged counts as unfinished, so a resume runs it again."""
        if not self.path.exists():
            return set()
        con = self._connect()
        try:
            survey = self._survey(con)
        finally:
            con.close()
        return {key for key in survey.finished if survey.sound(key)}

    def completion(self) -> tuple[int, int] | None:
        """(finished cells, cells of the run's configuration) from the manifest and the store; None
        when the directory has no manifest, or one without a config, to say which cells the run has.
        harness.runner.completion's answer, without the runner's imports (torch, the codecs):
        `harness report` reads it."""
        expected, _ = self._planned()
        if expected is None:
            return None
        return len(expected & self.finished_cells()), len(expected)

    # --- integrity of the rows (module doc) -----------------------------------------------------
    def _planned(self) -> tuple[frozenset | None, int | None]:
        """(the cells of the manifest's configuration, its trials per cell); (None, None) without
        a manifest or a config in it."""
        config = (self.read_manifest() or {}).get("config")
        if config is None:
            return None, None
        from .sweep import SweepConfig
        planned = SweepConfig.from_json(config)
        return frozenset(cell.key for cell in planned.cells()), planned.trials

    def _survey(self, con: sqlite3.Connection) -> _Survey:
        """What the store holds per cell (_Survey), read through `con`."""
        tables = {name: [row[1] for row in con.execute(f"PRAGMA table_info({name})")]
                  for (name,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        cols = ", ".join(CELL_COLUMNS)
        rows = {}
        if "trials" in tables:
            rows = {tuple(r[:-4]): tuple(r[-4:]) for r in con.execute(
                f"SELECT {cols}, COUNT(*), COUNT(DISTINCT trial), MIN(trial), MAX(trial) FROM trials GROUP BY {cols}")}
        finished = {}
        if "cells" in tables:
            keyed = [c for c in CELL_COLUMNS if c in tables["cells"]]
            stored = {tuple(key): n for *key, n in con.execute(f"SELECT {', '.join(keyed)}, n_trials FROM cells")}
            if len(keyed) == len(CELL_COLUMNS):
                finished = stored
            else:   # written before calib_tokens was part of a cell (one calibration size per run then)
                where = [CELL_COLUMNS.index(c) for c in keyed]
                finished = {key: stored[short] for key in rows
                            if (short := tuple(key[i] for i in where)) in stored}
        chunks: dict[tuple, list] = {}
        if "chunks" in tables:
            for *key, first, n in con.execute(f"SELECT {cols}, first_trial, n_trials FROM chunks "
                                              f"ORDER BY {cols}, first_trial"):
                chunks.setdefault(tuple(key), []).append((first, n))
        expected, n_trials = self._planned()
        survey = _Survey(rows, finished, chunks, {}, expected, n_trials)
        detail = [key for key in rows if not survey.sound(key) or (expected is not None and key not in expected)]
        per_trial: dict[tuple, dict] = {}
        width = "(" + ", ".join("?" * len(CELL_COLUMNS)) + ")"
        for i in range(0, len(detail), 100):   # sqlite's limit on bound parameters
            batch = detail[i:i + 100]
            for *cell, trial, n in con.execute(
                    f"SELECT {cols}, trial, COUNT(*) FROM trials WHERE ({cols}) IN (VALUES {', '.join([width] * len(batch))}) "
                    f"GROUP BY {cols}, trial", [x for key in batch for x in key]):
                per_trial.setdefault(tuple(cell), {})[trial] = n
        return dataclasses.replace(survey, per_trial=per_trial)

    def damage(self) -> list[CellDamage]:
        """Every cell whose rows the run's commits do not account for, one CellDamage per cell and
        kind (module doc); [] for a sound store or none."""
        if not self.path.exists():
            return []
        with self._reading() as con:
            return _classify(self._survey(con))

    def check_trials(self) -> list[str]:
        """DamagedRows (one line, the first damaged cell and how many more) where a finished cell
        holds duplicated or orphaned rows or a cell is outside the configuration: no reader may
        average them in. Otherwise the lines naming the finished cells whose trials are missing:
        they are read as unfinished (trials() leaves them out) and a --resume recomputes them."""
        found = self.damage()
        self._refuse(found)
        return [f"{d}: it is left out as unfinished; harness run ... --resume recomputes the missing trials"
                for d in found if d.finished and d.kind == "missing"]

    def check_reportable(self) -> None:
        """UnusableStore (one line naming the first cell) when no finished cell holds the finite
        values a report reads (stats.findings: the error point and the storage, every trial), so
        there is nothing to report; where some do, the report leaves the others out and names each."""
        from stats.equal_storage import storage_column
        from stats.findings import ESTIMATED, PRIMARY
        from stats.finite import finite_cells
        from kvcommon.rows import SIX_D
        trials = self.trials()
        if trials.empty:
            return
        required = (PRIMARY,) + tuple(m for m in SIX_D if m != PRIMARY) + ("bits_per_element", storage_column(trials))
        usable, left_out = finite_cells(trials, required, tuple(m for m in ESTIMATED if m not in required))
        if usable.empty:
            raise UnusableStore(f"{self.path}: no finished cell has finite values to report ({len(left_out)} left out; "
                                f"first {left_out[0].removeprefix('left out: ')}); a run stores finite metrics only: "
                                f"restore the store from a copy, or run again into a new --out")

    def _refuse(self, found: list[CellDamage]) -> None:
        bad = [d for d in found if d.kind == "outside" or (d.finished and d.kind in ("duplicated", "orphaned"))]
        if not bad:
            return
        more = f" (and {len(bad) - 1} more damaged cell(s))" if len(bad) > 1 else ""
        if bad[0].kind == "outside":
            advice = "remove its rows, or restore the store from a copy (a run cannot recompute a cell it does not have)"
        else:
            advice = ("no run writes that (a hand edit?); harness run ... --resume with the run's flags recomputes "
                      "the cell, or restore the store from a copy")
        raise DamagedRows(f"{self.path}: {bad[0]}{more}; {advice}")

    def _check_values(self, con: sqlite3.Connection) -> None:
        """DamagedRows (one line naming the column, cell and trial) where a numeric column of
        `trials` (or diagnostics' value) holds text or a blob: sqlite keeps what a REAL column
        cannot convert as it was given, and no run stores that."""
        for table, key in (("trials", CELL_COLUMNS + ("trial",)), (DIAGNOSTICS_TABLE, CELL_COLUMNS + ("trial", "name"))):
            present = [row[1] for row in con.execute(f"PRAGMA table_info({table})")]
            numeric = [c for c in present if c not in TEXT_COLUMNS and c != "name"]
            if not numeric or not all(c in present for c in key):
                continue
            bad = " OR ".join(f"typeof({c}) IN ('text', 'blob')" for c in numeric)
            found = con.execute(f"SELECT {', '.join(key)}, {', '.join(f'typeof({c})' for c in numeric)}, "
                                f"{', '.join(numeric)} FROM {table} WHERE {bad} LIMIT 1").fetchone()
            if found is None:
                continue
            n = con.execute(f"SELECT COUNT(*) FROM {table} WHERE {bad}").fetchone()[0]
            kinds, values = found[len(key):len(key) + len(numeric)], found[len(key) + len(numeric):]
            i = next(i for i, kind in enumerate(kinds) if kind in ("text", "blob"))
            shown = repr(values[i][:20]) if kinds[i] == "text" else f"{len(values[i])} bytes"
            where = f"trial {found[len(CELL_COLUMNS)]} of cell {cell_name(found[:len(CELL_COLUMNS)])}"
            if table == DIAGNOSTICS_TABLE:
                where = f"diagnostic {found[len(key) - 1]} of {where}"
            raise DamagedRows(f"{self.path}: column {numeric[i]} of {table} holds {kinds[i]} ({shown}) in {where}"
                              f"{f' and {n - 1} more row(s)' if n > 1 else ''}, not a number; a run stores numbers "
                              f"there: restore the store from a copy, or run again into a new --out")

    def write_cell(self, cell: tuple, rows: Iterable[dict], *, wall_s: float, finished_at: str,
                   peak_mem_mb: float | None = None) -> None:
        """All rows of one cell and its `cells` entry, in one transaction."""
        rows = list(rows)
        con = self._connect()
        try:
            with con:  # commits on success, rolls back on any exception
                _insert_trials(con, rows)
                con.execute(f"INSERT INTO cells VALUES ({', '.join('?' * (len(CELL_COLUMNS) + 4))})",
                            (*cell, len(rows), wall_s, finished_at, peak_mem_mb))
        finally:
            con.close()

    @contextlib.contextmanager
    def writing(self):
        """Within the block, write_chunk commits through one connection, opened (and the tables
        made or migrated) once, instead of one connection per chunk: a run's thousands of chunks
        each paid the opening and schema checks. Each chunk is still its own transaction. On
        entry the rows of damaged cells past their resume point go (_drop_unsound)."""
        con = self._connect()
        try:
            con.execute(_chunks_schema())
            con.commit()
            self._drop_unsound(con)
            self._writer = con
            yield self
        finally:
            self._writer = None
            con.close()

    def write_chunk(self, cell: tuple, rows: Iterable[dict], *, first_trial: int, n_trials_cell: int,
                    wall_s: float, finished_at: str, peak_mem_mb: float | None = None,
                    before_commit: Callable[[], None] | None = None) -> bool:
        """One chunk of one cell — its trial rows (trials first_trial, first_trial + 1, ...) and
        its `chunks` entry — in one transaction; when the cell then holds all n_trials_cell
        trials, its `cells` row too (wall time summed over its chunks, the largest peak memory),
        in the same transaction. Returns whether the cell is now finished. before_commit (tests:
        an interruption inside the transaction) is called after the writes, before the commit."""
        rows = list(rows)
        held = self._writer is not None
        con = self._writer if held else self._connect()
        try:
            with con:  # commits on success, rolls back on any exception
                if not held:
                    con.execute(_chunks_schema())
                match = " AND ".join(f"{c} = ?" for c in CELL_COLUMNS)
                # entries from this trial on whose rows are gone (a store edited by hand) are stale
                con.execute(f"DELETE FROM chunks WHERE {match} AND first_trial >= ?", (*cell, first_trial))
                _insert_trials(con, rows)
                con.execute(f"INSERT INTO chunks VALUES ({', '.join('?' * (len(CELL_COLUMNS) + 5))})",
                            (*cell, first_trial, len(rows), wall_s, peak_mem_mb, finished_at))
                stored, wall, peak = con.execute(
                    f"SELECT SUM(n_trials), SUM(wall_s), MAX(peak_mem_mb) FROM chunks WHERE {match}", cell).fetchone()
                finished = stored >= n_trials_cell
                if finished:
                    con.execute(f"INSERT INTO cells VALUES ({', '.join('?' * (len(CELL_COLUMNS) + 4))})",
                                (*cell, stored, wall, finished_at, peak))
                if before_commit is not None:
                    before_commit()
                return finished
        finally:
            if not held:
                con.close()

    def stored_trials(self) -> dict[tuple, int]:
        """Per cell holding rows, the trial a run continues it from: a sound finished cell's
        n_trials; any other cell's first trial after its whole, sound chunks (_Survey.walk), so
        a cell a hand edit damaged (rows missing, duplicated or orphaned; its `cells` row
        deleted) is recomputed from its last sound chunk on; writing() removes the rest of its rows
        before the first commit. Chunks are committed in order, so an interrupted cell continues
        from its first missing trial."""
        if not self.path.exists():
            return {}
        with self._reading() as con:
            survey = self._survey(con)
        return {key: survey.finished[key] if survey.sound(key) else survey.walk(key)[0] for key in survey.rows}

    def _drop_unsound(self, con: sqlite3.Connection) -> None:
        """In one transaction, of each cell of the configuration that is not sound, the rows,
        chunk entries and `cells` row past the trial stored_trials continues it from: what a
        resume then computes is all the cell lacks, and nothing it holds is counted twice."""
        survey = self._survey(con)
        match = " AND ".join(f"{c} = ?" for c in CELL_COLUMNS)
        extra = con.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?",
                            (DIAGNOSTICS_TABLE,)).fetchone()
        with con:
            for key in set(survey.rows) | set(survey.finished) | set(survey.chunks):
                if survey.sound(key) or (survey.expected is not None and key not in survey.expected):
                    continue
                k, kept = survey.walk(key)
                if any(not 0 <= t < k for t in survey.per_trial.get(key, {})):
                    for table in ("trials",) + ((DIAGNOSTICS_TABLE,) if extra else ()):
                        con.execute(f"DELETE FROM {table} WHERE {match} AND (trial >= ? OR trial < 0)", (*key, k))
                for first, _ in survey.chunks.get(key, []):
                    if first not in kept:
                        con.execute(f"DELETE FROM chunks WHERE {match} AND first_trial = ?", (*key, first))
                if key in survey.finished:
                    con.execute(f"DELETE FROM cells WHERE {match}", key)

    def check_integrity(self) -> None:
        """CorruptStore (one line naming the file) unless PRAGMA quick_check finds the store sound;
        ForeignStore unless it is a regular file whose tables are a kvharness store's (or it has
        no table yet); DamagedRows where a numeric column holds text or a blob, or trials belong
        to a cell outside the manifest's configuration; nothing to check where there is no store yet."""
        if not self.path.exists():
            return
        if not self.path.is_file():
            raise ForeignStore(f"{self.path} is not a regular file, so not a kvharness store; give a run directory "
                               f"(or, to run, another --out)")
        with self._reading() as con:
            found = [row[0] for row in con.execute("PRAGMA quick_check")]
            if found != ["ok"]:
                detail = " ".join(" ".join(found[:2]).replace("*** in database main ***", "").split())
                raise self._damaged(detail if len(detail) <= 120 else detail[:117] + "...")
            tables = {name: {row[1] for row in con.execute(f"PRAGMA table_info({name})")}
                      for (name,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if tables and "trials" not in tables:
            raise ForeignStore(f"{self.path} holds another program's tables ({', '.join(sorted(tables)[:4])}) and "
                               f"no trials table: not a kvharness store; give a run directory (or another --out)")
        for table, required in _REQUIRED_COLUMNS.items():
            missing = [c for c in required if table in tables and c not in tables[table]]
            if missing:
                raise ForeignStore(f"{self.path}: its {table} table lacks the column(s) {', '.join(missing[:4])}"
                                   f"{' ...' if len(missing) > 4 else ''}: another program's table, not a kvharness "
                                   f"store; nothing was changed; give a run directory (or another --out)")
        if "trials" not in tables:
            return
        with self._reading() as con:
            self._check_values(con)
            expected, _ = self._planned()
            if expected is None:
                return
            cols = ", ".join(CELL_COLUMNS)
            outside = [CellDamage(tuple(key), "outside", tuple(range(n)), False) for *key, n in
                       con.execute(f"SELECT {cols}, COUNT(DISTINCT trial) FROM trials GROUP BY {cols}")
                       if tuple(key) not in expected]
        self._refuse(outside)

    def check_writable(self) -> None:
        """ReadOnlyStore (one line) when sqlite cannot write results.sqlite (a read-only file,
        directory or file system), found by a write that is rolled back: the file is unchanged."""
        if not self.path.exists():
            return
        con = sqlite3.connect(self.path)
        try:
            con.execute("BEGIN IMMEDIATE")
            con.execute("CREATE TABLE kvharness_write_probe (x)")
        except sqlite3.OperationalError as exc:
            raise ReadOnlyStore(f"{self.path} cannot be written (sqlite: {exc}); make it and its directory "
                                f"writable, or run again into a new --out") from None
        finally:
            con.rollback()
            con.close()

    @contextlib.contextmanager
    def _reading(self):
        """A connection whose sqlite errors of a damaged file surface as CorruptStore."""
        try:
            con = sqlite3.connect(self.path)
            try:
                yield con
            finally:
                con.close()
        except (sqlite3.DatabaseError, pd.errors.DatabaseError) as exc:
            # pandas wraps sqlite's errors in its own DatabaseError ("Execution failed on sql ...")
            detail = next((message for word, message in _DAMAGED.items() if word in str(exc)), None)
            if detail is None:
                raise
            raise self._damaged(detail) from None

    def _damaged(self, detail: str) -> CorruptStore:
        return CorruptStore(f"{self.path} is damaged (sqlite: {detail}); it cannot be read or resumed: restore it "
                            f"from a copy, or run again into a new --out")

    @contextlib.contextmanager
    def lock(self, refusals: tuple[type[Exception], ...] = (StoreError, ValueError)):
        """Hold the directory's lock file (flock) for the life of the block: StoreLocked at once
        when another process holds it; LockFileError when the lock file is a directory or another
        thing no run can lock. Creates the directory if needed. A run refused inside the block (one
        of `refusals`) removes the lock file, whether it made it or an earlier run left it there,
        so a refusal leaves no lock behind; it unlinks the file while holding it, and a process that
        locked the file before it was unlinked sees that the path no longer names it and locks afresh."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / LOCK_FILE
        for _ in range(100):
            fd = self._open_lock(path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise StoreLocked(f"{self.directory} is being written by another harness run (pid {holder}); "
                                  f"wait for it to finish, or choose another --out") from None
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)   # unlinked by a refused run after we opened it: lock the file the path names now
        else:
            raise StoreLocked(f"{self.directory}: its lock file keeps changing; choose another --out")
        try:
            with contextlib.suppress(OSError):   # a read descriptor: the holder's pid goes unrecorded
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            yield
        except refusals:
            # held, so no run is writing: the file is only what a past run left (or this one made);
            # one in a directory this user may not write stays (the refusal is what matters)
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)  # releases the lock

    def _open_lock(self, path: Path) -> int:
        """A descriptor of the lock file, made here where there is none."""
        if path.is_dir() or (path.exists() and not path.is_file()):
            raise LockFileError(f"{path} is {'a directory' if path.is_dir() else 'not a regular file'}, not the lock "
                                f"file a run makes; remove it (a run makes it anew) and run again")
        for _ in range(100):
            try:
                return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                pass
            except PermissionError as exc:   # a directory we may not write: only an existing lock file will do
                if not path.exists():
                    raise ReadOnlyStore(f"{self.directory} cannot be written ({exc.strerror}); "
                                        f"choose another --out") from None
            try:
                return os.open(path, os.O_RDWR)
            except FileNotFoundError:   # removed in between: make it
                continue
            except PermissionError:   # another user's lock file: flock needs only a read descriptor
                try:
                    return os.open(path, os.O_RDONLY)
                except OSError as exc:
                    raise ReadOnlyStore(f"{self.directory} cannot be written ({exc.strerror}); "
                                        f"choose another --out") from None
        raise StoreLocked(f"{self.directory}: its lock file keeps changing; choose another --out")

    def cells(self) -> pd.DataFrame:
        """The finished cells with their trial count, wall time and peak memory."""
        con = self._connect()
        try:
            return pd.read_sql_query(f"SELECT * FROM cells ORDER BY {', '.join(CELL_COLUMNS)}", con)
        finally:
            con.close()

    def peak_memory_mb(self) -> dict[str, float]:
        """Peak memory (MiB) per finished cell, keyed 'scenario/scheme/b/d/S/Nq/n_cal', for the manifest."""
        return {"/".join(str(x) for x in row[: len(CELL_COLUMNS)]): row[-1]
                for row in self.cells()[list(CELL_COLUMNS) + ["peak_mem_mb"]].itertuples(index=False)}

    def trials(self, *, unfinished: bool = False) -> pd.DataFrame:
        """Every stored trial of the finished, sound cells (with unfinished=True every row, as
        stored) as a frame, in a stable order. DamagedRows where a numeric column holds text, or a
        finished cell holds duplicated or orphaned rows (module doc); a finished cell missing some
        of its trials is left out, as unfinished (check_trials names it)."""
        if not self.path.exists():
            raise FileNotFoundError(f"{self.path} does not exist: not a kvharness run directory")
        with self._reading() as con:
            if not con.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'trials'").fetchone():
                raise ForeignStore(f"{self.path} holds no trials table (an empty file, or a run that never stored a "
                                   f"trial): nothing to read; give a run directory")
            self._check_values(con)
            unsound = set()
            if not unfinished:   # duplicated or orphaned rows refused; a cell missing trials left out as unfinished
                survey = self._survey(con)
                self._refuse(_classify(survey))
                unsound = {key for key in survey.finished if not survey.sound(key)}
            order = ", ".join(CELL_COLUMNS + ("trial",))
            where = ""
            keyed = [c for c in CELL_COLUMNS if c in {row[1] for row in con.execute("PRAGMA table_info(cells)")}]
            if not unfinished and keyed:  # a cell is read only once its `cells` row exists
                match = " AND ".join(f"c.{k} = trials.{k}" for k in keyed)
                where = f" WHERE EXISTS (SELECT 1 FROM cells c WHERE {match})"
            frame = pd.read_sql_query(f"SELECT * FROM trials{where} ORDER BY {order}", con)
            has_extra = con.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?",
                                    (DIAGNOSTICS_TABLE,)).fetchone()
            extra = pd.read_sql_query(f"SELECT * FROM {DIAGNOSTICS_TABLE}", con) if has_extra else None
        if unsound:
            keep = [key not in unsound for key in frame[list(CELL_COLUMNS)].itertuples(index=False, name=None)]
            frame = frame[keep].reset_index(drop=True)
        # a column that is NULL throughout (no scheme of the run reports it) reads back as
        # None objects; make every numeric column float so NULL is NaN, as in CSV and Parquet
        for column in frame.columns:
            if column not in CONFIG_COLUMNS and frame[column].dtype == object:
                frame[column] = pd.to_numeric(frame[column]).astype(float)
        # a store written before a column was added lacks it (reading does not migrate): NaN
        for column in ADDED_COLUMNS:
            if column not in frame.columns:
                frame[column] = float("nan")
        if extra is not None and len(extra):   # a codec's own diagnostics, a column each (NaN elsewhere)
            keys = list(CELL_COLUMNS) + ["trial"]
            wide = extra.pivot(index=keys, columns="name", values="value").reset_index()
            wide.columns.name = None
            frame = frame.merge(wide.astype({c: frame[c].dtype for c in keys}), on=keys, how="left")
        return frame

    # --- derived tables (claims of a reproduction, per-trial extras) ------------------------
    def write_table(self, name: str, frame: pd.DataFrame) -> None:
        """Replace table `name` by `frame` in one transaction (write_tables with one table)."""
        self.write_tables({name: frame})

    def write_tables(self, frames: dict[str, pd.DataFrame]) -> None:
        """Replace each table `name` by its frame, all in one transaction (so a reader sees the old
        tables or the new ones, never some of them or half of one). The run's own tables (trials,
        cells) are not writable here."""
        plans = []
        for name, frame in frames.items():
            if name in _OWN_TABLES or not name.isidentifier():
                raise ValueError(f"table name {name!r} is reserved or not an identifier; "
                                 f"{', '.join(sorted(_OWN_TABLES))} are written by write_cell and write_chunk")
            columns = [str(c) for c in frame.columns]
            bad = [c for c in columns if not c.isidentifier()]
            if bad:
                raise ValueError(f"column name(s) {', '.join(bad)} of table {name} are not identifiers")
            types = {c: "INTEGER" if pd.api.types.is_integer_dtype(frame[c]) or pd.api.types.is_bool_dtype(frame[c])
                     else "REAL" if pd.api.types.is_float_dtype(frame[c]) else "TEXT" for c in columns}
            rows = [tuple(_sql_value(v) for v in row) for row in frame.itertuples(index=False, name=None)]
            plans.append((name, columns, types, rows))
        con = self._connect()
        con.isolation_level = None  # explicit transaction: DROP and CREATE are not auto-committed apart
        try:
            con.execute("BEGIN IMMEDIATE")
            try:
                for name, columns, types, rows in plans:
                    con.execute(f"DROP TABLE IF EXISTS {name}")
                    con.execute(f"CREATE TABLE {name} ({', '.join(f'{c} {types[c]}' for c in columns)})")
                    con.executemany(f"INSERT INTO {name} VALUES ({', '.join('?' * len(columns))})", rows)
                con.execute("COMMIT")
            except BaseException:
                con.execute("ROLLBACK")
                raise
        finally:
            con.close()

    def table(self, name: str) -> pd.DataFrame | None:
        """Table `name` of results.sqlite as a frame, or None where the store or the table is absent."""
        if not self.path.exists():
            return None
        con = sqlite3.connect(self.path)
        try:
            present = con.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,)).fetchone()
            return pd.read_sql_query(f"SELECT * FROM {name}", con) if present else None
        finally:
            con.close()
