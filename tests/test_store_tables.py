"""RunStore's derived tables (write_table, table, claims): replaced whole in one transaction,
NaN stored as NULL, the run's own tables out of reach."""
import sqlite3

import numpy as np
import pandas as pd
import pytest

from harness.store import RunStore


def test_derived_tables_are_replaced_whole_and_read_back(tmp_path):
    store = RunStore(tmp_path / "run")
    assert store.claims() is None and store.table("claims") is None   # no store yet
    first = pd.DataFrame({"id": [1, 2], "estimate": [0.5, np.nan], "verdict": ["refuted", None], "paired": [True, False]})
    store.write_table("claims", first)
    back = store.claims()
    assert back.id.tolist() == [1, 2] and np.isnan(back.estimate[1]) and pd.isna(back.verdict[1])
    assert back.paired.tolist() == [1, 0]
    store.write_table("claims", pd.DataFrame({"id": [3], "estimate": [0.25], "verdict": ["reproduced"]}))
    assert store.claims().to_dict("records") == [{"id": 3, "estimate": 0.25, "verdict": "reproduced"}]
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
    assert store.claims().id.tolist() == [1]
