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
"""
from __future__ import annotations

import contextlib
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
        if not self.path.exists():
            return set()
        with self._connect() as con:
            return {tuple(row) for row in con.execute(f"SELECT {', '.join(CELL_COLUMNS)} FROM cells")}

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
        each paid the opening and schema checks. Each chunk is still its own transaction."""
        con = self._connect()
        try:
            con.execute(_chunks_schema())
            con.commit()
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
        """Trials stored per cell, finished or not (cell key -> n): a cell's stored trials are
        always 0 .. n-1, its chunks being committed in order; CorruptStore where they are not."""
        if not self.path.exists():
            return {}
        with self._reading() as con:
            cols = ", ".join(CELL_COLUMNS)
            counts = con.execute(f"SELECT {cols}, COUNT(*), MIN(trial), MAX(trial) FROM trials GROUP BY {cols}")
            out = {}
            for *key, n, first, last in counts:
                if first != 0 or last != n - 1:
                    raise CorruptStore(f"{self.path}: cell {'/'.join(map(str, key))} holds {n} trials that are not "
                                       f"trials 0..{n - 1}; this store was not written by harness run alone")
                out[tuple(key)] = n
            return out

    def check_integrity(self) -> None:
        """CorruptStore (one line naming the file) unless PRAGMA quick_check finds the store sound;
        ForeignStore unless it is a regular file whose tables are a kvharness store's (or it has
        no table yet); nothing to check where there is no store yet."""
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
        when another process holds it. Creates the directory if needed. A run refused inside the
        block (one of `refusals`) removes the lock file when it made it, so a refusal leaves
        nothing in a directory; it unlinks the file while holding it, and a process that locked
        the file before it was unlinked sees that the path no longer names it and locks afresh."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / LOCK_FILE
        for _ in range(100):
            fd, created = self._open_lock(path)
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
            if created:
                path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)  # releases the lock

    def _open_lock(self, path: Path) -> tuple[int, bool]:
        """(a descriptor of the lock file, whether this call created it)."""
        for _ in range(100):
            try:
                return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
            except FileExistsError:
                pass
            except PermissionError as exc:   # a directory we may not write: only an existing lock file will do
                if not path.exists():
                    raise ReadOnlyStore(f"{self.directory} cannot be written ({exc.strerror}); "
                                        f"choose another --out") from None
            try:
                return os.open(path, os.O_RDWR), False
            except FileNotFoundError:   # removed in between: make it
                continue
            except PermissionError:   # another user's lock file: flock needs only a read descriptor
                try:
                    return os.open(path, os.O_RDONLY), False
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
        """Every stored trial of the finished cells (with unfinished=True also those of cells
        still missing chunks) as a frame, in a stable order."""
        if not self.path.exists():
            raise FileNotFoundError(f"{self.path} does not exist: not a kvharness run directory")
        with self._reading() as con:
            if not con.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'trials'").fetchone():
                raise ForeignStore(f"{self.path} holds no trials table (an empty file, or a run that never stored a "
                                   f"trial): nothing to read; give a run directory")
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
