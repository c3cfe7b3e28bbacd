"""Trial columns added after the first store version (kvcommon.rows.ADDED_COLUMNS: ptcosine_k,
ptcosine_v, evicted_mass): a store written without them still reads, reports and resumes."""
import sqlite3

import numpy as np
import pandas as pd

from harness.cli import main
from kvcommon.rows import ADDED_COLUMNS, TRIAL_COLUMNS
from harness.store import RESULTS_FILE, RunStore
from old_stores import rewrite_as_old_store

ARGS = ["run", "--scenario", "gaussian", "--scheme", "tq-kv,streaming", "--budget", "4", "--dim", "16",
        "--seq-len", "32", "--queries", "4", "--trials", "3", "--quiet"]


def _columns(path):
    with sqlite3.connect(path) as con:
        return [row[1] for row in con.execute("PRAGMA table_info(trials)")]


def test_new_columns_end_the_table_and_hold_what_each_codec_measures(tmp_path):
    out = tmp_path / "new"
    assert main([*ARGS, "--out", str(out)]) == 0
    assert _columns(out / RESULTS_FILE) == list(TRIAL_COLUMNS) and TRIAL_COLUMNS[-len(ADDED_COLUMNS):] == ADDED_COLUMNS
    frame = RunStore(out).trials().set_index("scheme")
    assert frame[["ptcosine_k", "ptcosine_v"]].notna().all().all()
    assert frame.loc["tq-kv", "evicted_mass"].isna().all()                 # keeps every token: NULL
    assert (frame.loc["streaming", "evicted_mass"].between(0, 1, inclusive="neither")).all()


def test_store_without_the_new_columns_reads_reports_and_resumes(tmp_path, capsys):
    """A run directory as the previous version wrote it (no ADDED_COLUMNS), interrupted after its
    tq-kv cell: reading gives the new columns as NaN without touching the file, the report
    renders, and --resume adds the columns (NULL in the old rows) and runs the missing cell,
    whose rows equal a clean run's."""
    out = tmp_path / "old"
    assert main([*ARGS, "--out", str(out)]) == 0
    clean = RunStore(out).trials()
    old = [c for c in TRIAL_COLUMNS if c not in ADDED_COLUMNS]
    rewrite_as_old_store(out, old, "tq-kv")
    before = RunStore(out).trials()
    assert _columns(out / RESULTS_FILE) == old                           # reading does not migrate
    assert list(before.columns) == list(TRIAL_COLUMNS) and before[list(ADDED_COLUMNS)].isna().all().all()
    pd.testing.assert_frame_equal(before[old], clean[clean.scheme == "tq-kv"][old].reset_index(drop=True))
    assert main(["report", str(out), "--permutations", "20"]) == 0 and (out / "report.html").exists()

    capsys.readouterr()
    assert main([*ARGS, "--out", str(out), "--resume"]) == 0
    assert capsys.readouterr().out.strip().startswith("1 cells run, 1 already stored")
    assert _columns(out / RESULTS_FILE) == list(TRIAL_COLUMNS)
    resumed = RunStore(out).trials()
    assert list(resumed.columns) == list(TRIAL_COLUMNS)
    expected = clean.copy()
    expected.loc[expected.scheme == "tq-kv", list(ADDED_COLUMNS)] = np.nan  # not measured by the old version
    pd.testing.assert_frame_equal(resumed, expected, check_exact=False, rtol=1e-12)
    assert resumed.loc[resumed.scheme == "streaming", "evicted_mass"].notna().all()
