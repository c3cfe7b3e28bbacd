"""Dask sweeps: rows identical to a serial run; a worker that dies costs only its cell."""
import pandas as pd
import pytest

from harness import distributed
from harness.cli import main
from harness.store import RunStore

pytest.importorskip("distributed")

ARGS = ["run", "--scenario", "gaussian,spectral_decay", "--scheme", "tq-kv,plain-kv", "--budget", "2,3",
        "--dim", "16", "--seq-len", "32", "--queries", "4", "--trials", "5", "--quiet"]


def test_distributed_rows_equal_serial_and_survive_a_dead_worker(tmp_path, monkeypatch):
    assert main(ARGS + ["--out", str(tmp_path / "serial")]) == 0
    monkeypatch.setenv(distributed.FAULT_ENV, str(tmp_path / "killed-once"))
    assert main(ARGS + ["--out", str(tmp_path / "dask"), "--workers", "2"]) == 0
    assert (tmp_path / "killed-once").exists()          # a worker really died mid-sweep
    serial, dask = RunStore(tmp_path / "serial").trials(), RunStore(tmp_path / "dask").trials()
    assert len(dask) == 2 * 2 * 2 * 5
    pd.testing.assert_frame_equal(serial, dask)


def test_workers_flag_errors(tmp_path, capsys):
    assert main(ARGS + ["--out", str(tmp_path / "x"), "--workers", "0"]) == 2
    assert main(ARGS + ["--out", str(tmp_path / "x"), "--workers", "2", "--scheduler", "tcp://127.0.0.1:1"]) == 2
    assert not (tmp_path / "x").exists()


def test_unreachable_scheduler_is_one_line_exit_1_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "never"
    assert main(ARGS + ["--out", str(out), "--scheduler", "tcp://127.0.0.1:9"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no Dask scheduler answered at tcp://127.0.0.1:9" in err
    assert not out.exists()
