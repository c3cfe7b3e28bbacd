"""Inputs and accidents that used to end in a traceback, a wrong answer or a leftover: a damaged
store, a trial too large for memory, a failed export, two runs started in the same second.
Each gives exit 0 or 2 with one line, and nothing half-written."""
import json
from datetime import datetime

import pandas as pd
import pytest

from harness.cli import main
from harness.store import RESULTS_FILE, RunStore
from interrupting import interrupt_at_chunk

ARGS = ["--scenario", "gaussian", "--scheme", "tq-kv,plain-kv", "--budget", "2,3,4", "--dim", "16",
        "--seq-len", "32", "--queries", "4", "--trials", "20", "--quiet"]


def _one_line(err: str, *words: str) -> None:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for word in words:
        assert word in err, err


@pytest.fixture
def damaged(tmp_path):
    """A finished run whose results.sqlite has its last pages overwritten (a torn write or a bad
    disk): the cells table still reads, the trials do not."""
    out = tmp_path / "run"
    assert main(["run", *ARGS, "--out", str(out)]) == 0
    path = out / RESULTS_FILE
    data = bytearray(path.read_bytes())
    data[-3000:-1000] = bytes(range(256)) * 7 + bytes(208)
    path.write_bytes(bytes(data))
    return out


def test_a_damaged_store_is_refused_in_one_line_and_its_manifest_is_kept(damaged, capsys):
    manifest = (damaged / "manifest.json").read_bytes()
    assert json.loads(manifest)["finished_at"]
    capsys.readouterr()
    for argv in (["run", *ARGS, "--out", str(damaged), "--resume"], ["report", str(damaged)],
                 ["export", str(damaged)], ["export", str(damaged), "--format", "parquet"],
                 ["compare", str(damaged), str(damaged)]):
        assert main(argv) == 2, argv
        _one_line(capsys.readouterr().err, str(damaged / RESULTS_FILE), "is damaged", "new --out")
    assert (damaged / "manifest.json").read_bytes() == manifest     # never marked unfinished
    assert sorted(p.name for p in damaged.iterdir()) == ["manifest.json", RESULTS_FILE]   # a refusal leaves no .lock


def test_a_file_that_is_no_database_is_refused_the_same_way(tmp_path, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / RESULTS_FILE).write_text("garbage")
    assert main(["export", str(bad)]) == 2
    _one_line(capsys.readouterr().err, "file is not a database", str(bad / RESULTS_FILE))


def test_a_resume_that_is_refused_leaves_the_manifest_alone(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", *ARGS, "--out", str(out)]) == 0
    manifest = (out / "manifest.json").read_bytes()
    assert main(["run", *ARGS, "--out", str(out), "--resume", "--seed", "3"]) == 2   # another run
    assert main(["run", *ARGS, "--out", str(out), "--resume"]) == 0                  # nothing left to do
    assert (out / "manifest.json").read_bytes() == manifest


def test_a_trial_larger_than_memory_is_refused_up_front(tmp_path, capsys):
    out = tmp_path / "huge"
    assert main(["run", "--scenario", "gaussian", "--scheme", "plain-kv", "--dim", "100000", "--trials", "2",
                 "--seq-len", "64", "--queries", "4", "--out", str(out)]) == 2
    _one_line(capsys.readouterr().err, "one trial of d = 100000", "GiB available", "lower --dim")
    assert not out.exists()
    assert main(["run", "--scenario", "gaussian", "--scheme", "plain-kv", "--dim", "100000", "--trials", "2",
                 "--seq-len", "64", "--queries", "4", "--out", str(out)]) == 2      # nothing blocks a retry
    capsys.readouterr()
    cwd_runs = tmp_path / "cwd"
    cwd_runs.mkdir()
    import os
    old = os.getcwd()
    os.chdir(cwd_runs)
    try:   # without --out: no default directory is made either
        assert main(["run", "--scenario", "gaussian", "--scheme", "plain-kv", "--dim", "100000", "--trials", "2",
                     "--seq-len", "64", "--queries", "4"]) == 2
    finally:
        os.chdir(old)
    assert not (cwd_runs / "runs").exists()


def test_a_run_that_fails_before_storing_anything_leaves_no_directory(tmp_path, monkeypatch, capsys):
    from harness import cell as engine

    def broken(*args, **kwargs):
        raise RuntimeError("the scenario broke")
    monkeypatch.setattr(engine, "draw_trials", broken)
    out = tmp_path / "run"
    assert main(["run", *ARGS, "--out", str(out)]) == 1
    _one_line(capsys.readouterr().err, "the scenario broke")
    assert not out.exists()


def test_a_failed_export_leaves_no_temporary_file(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    assert main(["run", *ARGS, "--out", str(out)]) == 0
    before = sorted(p.name for p in out.iterdir())
    real = pd.DataFrame.to_csv

    def full_disk(self, path, **kwargs):
        real(self.head(3), path, **kwargs)       # half the file written, then the disk is full
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(pd.DataFrame, "to_csv", full_disk)
    assert main(["export", str(out)]) == 1
    _one_line(capsys.readouterr().err, "No space left on device")
    assert sorted(p.name for p in out.iterdir()) == before            # no .tmp, no half results.csv
    monkeypatch.undo()
    (out / "sub").mkdir()
    assert main(["export", str(out), "--output", str(out / "sub")]) == 2   # a directory as the output
    _one_line(capsys.readouterr().err, "is a directory")
    assert main(["export", str(out), "--output", str(tmp_path / "no" / "x.csv")]) == 2
    _one_line(capsys.readouterr().err, "does not exist")
    assert sorted(p.name for p in out.iterdir()) == before + ["sub"]


def test_runs_started_in_the_same_second_get_their_own_directories(tmp_path, monkeypatch):
    from harness.commands import run as run_command
    from harness.sweep import SweepConfig

    class Frozen(datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime(2026, 1, 2, 3, 4, 5, 678901)
    monkeypatch.setattr(run_command, "datetime", Frozen)
    config = SweepConfig(scenarios=("gaussian",), schemes=("tq-kv",))
    first, second = (run_command.default_out(config, tmp_path / "runs") for _ in range(2))
    assert first.name == "gaussian-20260102-030405-678901" and second.name == first.name + "-2"
    assert first.is_dir() and second.is_dir()


def test_unfinished_cells_are_neither_reported_nor_exported(tmp_path, capsys, monkeypatch):
    """A run stopped mid-sweep: export and the summary hold only the finished cells, completion
    counts them against the configuration's (the report's "incomplete: n of m cells" notice is
    checked in tests/test_report.py)."""
    from harness import cell as engine, runner
    monkeypatch.setenv(engine.CHUNK_TRIALS_ENV, "7")      # chunks of trials 0-5, 6-12, 13-19
    interrupt_at_chunk(monkeypatch, 14)
    out = tmp_path / "run"
    assert main(["run", *ARGS, "--out", str(out)]) == 130
    store = RunStore(out)
    assert len(store.trials(unfinished=True)) == 6 * 13 + 7     # two chunks of 6 cells, the first cell's last
    assert len(store.finished_cells()) == 1 and len(store.trials()) == 20
    assert runner.completion(store) == (1, 6)
    assert main(["export", str(out)]) == 0
    exported = pd.read_csv(out / "results.csv")
    assert len(exported) == 20 and set(exported.scheme) == {"tq-kv"} and set(exported.budget) == {2}
