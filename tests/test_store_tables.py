"""RunStore's derived tables (write_table, table): replaced whole in one transaction,
NaN stored as NULL, the run's own tables out of reach."""
import sqlite3

import numpy as np
import pandas as pd
import pytest

from harness.store import RunStore


def test_derived_tables_are_replaced_whole_and_read_back(tmp_path):
    store = RunStore(tmp_path / "run")
    assert store.table("claims") is None   # no store yet
    first = pd.DataFrame({"id": [1, 2], "estimate": [0.5, np.nan], "verdict": ["refuted", None], "paired": [True, False]})
    store.write_table("claims", first)
    back = store.table("claims")
    assert back.id.tolist() == [1, 2] and np.isnan(back.estimate[1]) and pd.isna(back.verdict[1])
    assert back.paired.tolist() == [1, 0]
    store.write_table("claims", pd.DataFrame({"id": [3], "estimate": [0.25], "verdict": ["reproduced"]}))
    assert store.table("claims").to_dict("records") == [{"id": 3, "estimate": 0.25, "verdict": "reproduced"}]
    assert store.table("nope") is None


@pytest.mark.parametrize("name", ["trials", "cells", "drop table x"])
def test_the_runs_own_tables_and_odd_names_are_refused(tmp_path, name):
    with pytest.raises(ValueError, match="reserved or not an identifier"):
        RunStore(tmp_path).write_table(name, pd.DataFrame({"a": [1]}))


def test_a_failed_write_keeps_the_old_table(tmp_path):
    store = RunStore(tmp_path)
    store.write_table("claims", pd.DataFrame({"id": [1]}))
    with pytest.raises(sqlite3.ProgrammingError):
        store.write_table("claims", pd.DataFrame({"id": [object()]}))   # sqlite cannot store it
    assert store.table("claims").id.tolist() == [1]


def test_chunks_committed_through_one_held_connection_as_one_by_one(tmp_path):
    """RunStore.writing() holds one connection for a run's commits: the same rows, chunks and
    finished cells as a connection per chunk, each chunk still its own transaction (one that fails
    before its commit leaves the others, and the connection, as they were), the connection closed
    after the block."""
    from kvcommon.rows import CELL_COLUMNS, TRIAL_COLUMNS
    cells = [("gaussian", scheme, 3, 16, 32, 4, 32) for scheme in ("tq-kv", "sq-kv")]

    def rows(cell, first, n):
        return [{**dict(zip(CELL_COLUMNS, cell)), "trial": t, "seed": 0, "impl": "torch", "device": "cpu",
                 "dtype": "float32", "rng": "pcg64", "heads": 1, "bits_per_element": 3.0 + t, "rel_mse_k": 0.1 * t}
                for t in range(first, first + n)]

    def write_all(store, fail_at=None):
        for i, (first, n) in enumerate(((0, 2), (2, 2), (4, 1))):
            for cell in cells:
                hook = None
                if (i, cell) == fail_at:
                    def hook():
                        raise KeyboardInterrupt
                try:
                    store.write_chunk(cell, rows(cell, first, n), first_trial=first, n_trials_cell=5, wall_s=1.0,
                                      finished_at="now", peak_mem_mb=2.0, before_commit=hook)
                except KeyboardInterrupt:
                    pass
    one_by_one, held = RunStore(tmp_path / "a"), RunStore(tmp_path / "b")
    write_all(one_by_one)
    with held.writing() as store:
        assert store is held and held._writer is not None
        write_all(held)
    assert held._writer is None
    for read in (lambda s: s.trials()[list(TRIAL_COLUMNS)], lambda s: s.cells().drop(columns="finished_at"),
                 lambda s: s.stored_trials()):
        a, b = read(one_by_one), read(held)
        assert a.equals(b) if isinstance(a, pd.DataFrame) else a == b
    assert len(held.trials()) == 10 and len(held.finished_cells()) == 2
    # a chunk interrupted inside its transaction: only it is missing, the next chunk still commits
    broken = RunStore(tmp_path / "c")
    with broken.writing():
        write_all(broken, fail_at=(2, cells[0]))
    assert broken.stored_trials() == {cells[0]: 4, cells[1]: 5} and broken.finished_cells() == {cells[1]}
    broken.check_integrity()


def test_several_tables_are_replaced_in_one_transaction(tmp_path):
    """write_tables: all the tables or none (a failing second table leaves the first as it was), and a
    nullable integer column (pd.NA) is an INTEGER column with NULL."""
    store = RunStore(tmp_path)
    store.write_tables({"a": pd.DataFrame({"x": [1]}), "b": pd.DataFrame({"y": ["old"]})})
    with pytest.raises(sqlite3.ProgrammingError):
        store.write_tables({"a": pd.DataFrame({"x": [2]}), "b": pd.DataFrame({"y": [object()]})})
    assert store.table("a").x.tolist() == [1] and store.table("b").y.tolist() == ["old"]
    store.write_tables({"a": pd.DataFrame({"layer": pd.array([3, None], dtype="Int64")})})
    con = sqlite3.connect(store.path)
    assert con.execute("SELECT type FROM pragma_table_info('a')").fetchall() == [("INTEGER",)]
    assert con.execute("SELECT layer FROM a").fetchall() == [(3,), (None,)]
    con.close()
