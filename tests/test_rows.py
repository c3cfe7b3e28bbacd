"""The row schema (kvcommon/rows.py) is what the engine fills and the store keeps: a cell's key
is named by CELL_COLUMNS, and the rows a cell gives hold the trial columns of TRIAL_COLUMNS."""
import dataclasses
import sqlite3

import torch

from harness import cell as engine
from harness.store import RESULTS_FILE, RunStore
from harness.sweep import Cell, SweepConfig
from kvcommon.rows import (ADDED_COLUMNS, CELL_COLUMNS, CONFIG_COLUMNS, DIAGNOSTIC_COLUMNS, EVICTION_METRIC_NAMES,
                           INTEGER_COLUMNS, METRIC_NAMES, TEXT_COLUMNS, TRIAL_COLUMNS)


def test_a_cells_key_is_named_by_the_cell_columns():
    assert tuple(f.name for f in dataclasses.fields(Cell)) == CELL_COLUMNS
    cell = Cell("gaussian", "tq-kv", 2, 32, 64, 8, 16)
    assert dict(zip(CELL_COLUMNS, cell.key)) == dataclasses.asdict(cell)


def test_the_rows_of_a_cell_hold_the_trial_columns_and_the_store_keeps_them_typed(tmp_path):
    config = SweepConfig(scenarios=("gaussian",), schemes=("tq-kv", "sq-kv"), budgets=(2,), dims=(16,), seq_lens=(32,),
                         queries=(4,), trials=2, calib_tokens=(32,))
    rows = []
    engine.run_serial(config, config.cells(), torch.device("cpu"), torch.float32, None,
                      lambda c, r, w, p: rows.extend(r))
    assert len(rows) == 4
    for row in rows:   # every column but a codec's optional facts: SQ's diagnostics, an evicting codec's mass
        optional = set(EVICTION_METRIC_NAMES) | (set() if row["scheme"] == "sq-kv" else set(DIAGNOSTIC_COLUMNS))
        assert set(row) == set(TRIAL_COLUMNS) - optional, row["scheme"]
    store = RunStore(tmp_path)
    store.write_cell(config.cells()[0].key, rows[:2], wall_s=0.0, finished_at="now")
    con = sqlite3.connect(tmp_path / RESULTS_FILE)
    declared = [(name, kind) for _, name, kind, *_ in con.execute("PRAGMA table_info(trials)")]
    con.close()
    assert [name for name, _ in declared] == list(TRIAL_COLUMNS)
    assert {name for name, kind in declared if kind == "TEXT"} == TEXT_COLUMNS
    assert {name for name, kind in declared if kind == "INTEGER"} == INTEGER_COLUMNS
    assert set(CELL_COLUMNS) <= set(CONFIG_COLUMNS) and set(METRIC_NAMES) <= set(TRIAL_COLUMNS)
    assert TRIAL_COLUMNS[-len(ADDED_COLUMNS):] == ADDED_COLUMNS   # columns added later end the table
