"""Inputs that ran to wrong numbers with exit 0, lost data, left files behind or ended in a raw
exception (issue 31): each is refused with exit 2 and one line naming what is wrong and what is
valid, before anything is written, or is completed as the help text says."""
import math

import numpy as np
import pytest

import scenarios
from harness.cli import main

TINY = ["run", "--dim", "32", "--seq-len", "64", "--queries", "8", "--trials", "2", "--budget", "2", "--quiet"]


def refused(capsys, argv, *words):
    """main(argv) exits 2 with one line on stderr holding every word, and no traceback."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for word in words:
        assert word in err, (word, err)
    return err


# ---------------------------------------------------------------- 1: scenario parameters

@pytest.mark.parametrize("scenario, words", [
    ("heavy_tail:dof=nan", ["dof=nan", "finite"]),
    ("heavy_tail:dof=inf", ["dof=inf", "finite"]),
    ("heavy_tail:alpha=nan", ["alpha=nan", "finite"]),
    ("spectral_decay:alpha=-inf", ["alpha=-inf", "finite"]),
    ("gaussian:drift=nan", ["drift=nan", "finite"]),
    ("gaussian:temperature=inf", ["temperature=inf", "finite"]),
    ("gaussian:temperature=1e-300", ["temperature=1e-300", "temperature must lie in ["]),
    ("rope_lowrank:temperature=1e300", ["temperature=1e+300", "temperature must lie in ["]),
    ("lowrank_aligned:noise=1e300", ["noise=1e+300", "outside ["]),
    ("rope_lowrank:noise=1e300", ["noise=1e+300", "draw fails"]),
    ("outlier_channels:outlier_scale=1e300", ["outlier_scale=1e+300", "outside ["]),
])
def test_a_parameter_that_is_not_finite_or_breaks_the_data_is_refused(tmp_path, capsys, scenario, words):
    out = tmp_path / "never"
    refused(capsys, [*TINY, "--scenario", scenario, "--scheme", "tq-kv,int4", "--out", str(out)], *words)
    assert not out.exists()


def test_the_carried_range_is_what_float32_squares_and_sums():
    """carried_range against float32 itself: at hi a logits row of S·d products of two entries
    squares and sums to a finite float32, at 2·hi to inf; at lo a relative error eps in a logit
    squares to a normal float32, at lo/2 no longer (independent: float32 arithmetic in NumPy)."""
    n = 64 * 32
    lo, hi = scenarios.base.carried_range(n)
    f32 = np.finfo(np.float32)
    for m, finite in ((hi * 0.999, True), (2 * hi, False)):
        logit = np.float32(m) * np.float32(m) * np.float32(math.sqrt(32))   # q·k/√d with every entry m
        with np.errstate(over="ignore"):
            row = np.sum(np.full(64, logit * logit, dtype=np.float32), dtype=np.float32)
        assert np.isfinite(row) == finite, m
    for m, normal in ((lo * 1.001, True), (lo / 2, False)):
        error = np.float32(f32.eps) * np.float32(m) * np.float32(m)
        assert (error * error >= f32.tiny) == normal, m


def test_the_temperature_range_it_names_is_the_one_it_enforces(tmp_path, capsys):
    """The range named for temperature: just inside it runs, just outside it is refused."""
    err = refused(capsys, [*TINY, "--scenario", "gaussian:temperature=1e-30", "--scheme", "int4",
                           "--out", str(tmp_path / "x")], "temperature must lie in")
    lo, hi = (float(x) for x in err.split("temperature must lie in [")[1].split("]")[0].split(", "))
    shape = scenarios.TrialShape(1, 64, 8, 32, 512)
    scenarios.create(f"gaussian:temperature={lo * 1.1}").check_data(shape)
    scenarios.create(f"gaussian:temperature={hi / 1.1}").check_data(shape)
    for bad in (lo / 1.1, hi * 1.1):
        with pytest.raises(ValueError, match="temperature must lie in"):
            scenarios.create(f"gaussian:temperature={bad}").check_data(shape)


def test_every_scenario_at_its_defaults_passes_the_probe():
    for name in scenarios.available():
        for dim, seq_len in ((16, 16), (256, 8192)):
            scenarios.create(name).check_data(scenarios.TrialShape(2, seq_len, 64, dim, 512, 16))


# ---------------------------------------------------------------- 2: replay files out of range

@pytest.mark.parametrize("dtype, factor, shown", [
    (np.float32, 1e30, "e+30"), (np.float64, 1e300, "e+300"), (np.float64, 1e-320, "e-320"),
    (np.float32, 1e-30, "e-30"), (np.float32, 0.0, "up to 0,"),
])
def test_a_replay_file_outside_what_float32_carries_is_refused(tmp_path, capsys, dtype, factor, shown):
    from test_capture_replay import synthetic_arrays, write_npz
    arrays, meta = synthetic_arrays(np.random.default_rng(0))
    for name in ("q", "k", "v"):
        arrays[name] = (arrays[name].astype(np.float64) * factor).astype(dtype)
    path = write_npz(tmp_path / "scaled.npz", arrays, meta)
    out = tmp_path / "never"
    refused(capsys, [*TINY, "--scenario", f"replay:{path}", "--scheme", "tq-kv,int4", "--out", str(out)],
            "scaled.npz", "tensor q holds magnitudes", shown, "outside [")
    assert not out.exists()


def test_a_replay_file_within_the_range_runs(tmp_path):
    """The same file scaled by 1e4 and 1e-4, both inside the range, runs; every metric finite."""
    from harness.store import RunStore
    from test_capture_replay import synthetic_arrays, write_npz
    for factor in (1e4, 1e-4):
        arrays, meta = synthetic_arrays(np.random.default_rng(0))
        for name in ("q", "k", "v"):
            arrays[name] = arrays[name] * np.float32(factor)
        path = write_npz(tmp_path / f"x{factor}.npz", arrays, meta)
        out = tmp_path / f"run{factor}"
        assert main([*TINY, "--scenario", f"replay:{path}", "--scheme", "int4", "--out", str(out)]) == 0
        rows = RunStore(out).trials()
        assert len(rows) == 2 and np.isfinite(rows[["rel_mse_k", "d2_t", "logit_rel_mse"]].to_numpy()).all()
        assert (rows["rel_mse_k"] > 0).all()


# ---------------------------------------------------------------- 5: export over the run's own files

@pytest.fixture
def tiny_run(tmp_path):
    out = tmp_path / "run"
    assert main([*TINY, "--scenario", "gaussian", "--scheme", "int4", "--out", str(out)]) == 0
    return out


def _snapshot(directory):
    """Every file of the directory with its bytes, but the lock file (a refused resume removes the
    one an earlier run left: test_a_refused_run_leaves_no_lock_file)."""
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file() and p.name != ".lock"}


@pytest.mark.parametrize("name", ["results.sqlite", "manifest.json", ".lock", "report.html"])
def test_export_refuses_the_runs_own_files(tiny_run, capsys, name):
    (tiny_run / "report.html").write_text("<html></html>")
    before = _snapshot(tiny_run)
    refused(capsys, ["export", str(tiny_run), "--output", str(tiny_run / name)], "is a file of the run")
    assert _snapshot(tiny_run) == before


def test_export_refuses_the_runs_files_under_another_name(tiny_run, tmp_path, capsys):
    before = _snapshot(tiny_run)
    (tmp_path / "link.csv").symlink_to(tiny_run / "results.sqlite")
    refused(capsys, ["export", str(tiny_run), "--output", str(tmp_path / "link.csv")], "is a file of the run")
    import os
    os.link(tiny_run / "manifest.json", tmp_path / "hard.csv")
    refused(capsys, ["export", str(tiny_run), "--output", str(tmp_path / "hard.csv")], "is a file of the run")
    other = tmp_path / "other"
    assert main([*TINY, "--scenario", "gaussian", "--scheme", "int4", "--out", str(other)]) == 0
    refused(capsys, ["export", str(tiny_run), "--output", str(other / "results.sqlite")], "is a file of the run")
    assert _snapshot(tiny_run) == before


def test_export_never_renames_over_a_file_that_is_not_regular(tiny_run, tmp_path, capsys):
    import os
    import stat
    fifo = tmp_path / "pipe.csv"
    os.mkfifo(fifo)
    refused(capsys, ["export", str(tiny_run), "--output", str(fifo)], "not a regular file")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_export_through_a_symlink_writes_the_file_it_points_to(tiny_run, tmp_path):
    import os
    target = tmp_path / "target.csv"
    target.write_text("old")
    (tmp_path / "link.csv").symlink_to(target)
    assert main(["export", str(tiny_run), "--output", str(tmp_path / "link.csv")]) == 0
    assert os.path.islink(tmp_path / "link.csv") and target.read_text().startswith("scenario,")
    assert main(["export", str(tiny_run)]) == 0 and (tiny_run / "results.csv").exists()   # the default is fine


# ---------------------------------------------------------------- 6: --resume checks before it writes

RESUME = [*TINY, "--scenario", "gaussian", "--scheme", "int4,tq-kv"]


def _interrupted_run(directory):
    """A run of RESUME whose int4 cell is stored and whose tq-kv cell is not (as if interrupted)."""
    import sqlite3
    assert main([*RESUME, "--out", str(directory)]) == 0
    with sqlite3.connect(directory / "results.sqlite") as con:
        for table in ("trials", "cells", "chunks"):
            con.execute(f"DELETE FROM {table} WHERE scheme = 'tq-kv'")
    manifest = directory / "manifest.json"
    import json
    data = json.loads(manifest.read_text())
    data["finished_at"] = None
    manifest.write_text(json.dumps(data))


def test_resume_on_another_programs_trials_table_changes_nothing(tmp_path, capsys):
    import sqlite3
    out = tmp_path / "run"
    _interrupted_run(out)
    (out / "results.sqlite").unlink()
    with sqlite3.connect(out / "results.sqlite") as con:
        con.execute("CREATE TABLE trials (id INTEGER PRIMARY KEY, name TEXT, score REAL)")
        con.execute("INSERT INTO trials (name, score) VALUES ('a', 1.5), ('b', 2.5)")
    before = _snapshot(out)
    refused(capsys, [*RESUME, "--out", str(out), "--resume"], "its trials table lacks the column(s) scenario",
            "another program's")
    assert _snapshot(out) == before
    for command in (["report", str(out), "--json"], ["export", str(out)]):
        refused(capsys, command, "another program's")
    assert _snapshot(out) == before


def test_resume_on_a_database_without_a_trials_table_changes_nothing(tmp_path, capsys):
    import sqlite3
    out = tmp_path / "run"
    _interrupted_run(out)
    (out / "results.sqlite").unlink()
    with sqlite3.connect(out / "results.sqlite") as con:
        con.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
    before = _snapshot(out)
    refused(capsys, [*RESUME, "--out", str(out), "--resume"], "no trials table")
    assert _snapshot(out) == before


@pytest.mark.parametrize("lock_mode", [0o666, 0o644])
def test_resume_on_a_read_only_store_changes_nothing(tmp_path, capsys, lock_mode):
    """As another user than the store's owner (root ignores file modes, so a root test runs the
    command as nobody): exit 2, one line, the manifest and the store unchanged; whether or not
    that user may write the lock file the run left."""
    import os
    import shutil
    import subprocess
    import sys
    import tempfile
    from pathlib import Path
    base = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        out = base / "run"
        _interrupted_run(out)
        (out / "results.sqlite").chmod(0o444)
        (out / ".lock").chmod(lock_mode)
        os.chmod(base, 0o755)
        os.chmod(out, 0o777)            # the directory writable: only the store is read-only
        before = _snapshot(out)
        argv = [*RESUME, "--out", str(out), "--resume"]
        if os.geteuid() != 0:
            refused(capsys, argv, "cannot be written")
        else:
            if shutil.which("setpriv") is None:
                pytest.skip("running as root without setpriv: no user for whom the store is read-only")
            root = Path(__file__).resolve().parents[1]
            (base / "numba").mkdir(mode=0o777)
            os.chmod(base / "numba", 0o777)
            done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable,
                                   "-m", "harness", *argv], capture_output=True, text=True, cwd=base,
                                  env={**os.environ, "PYTHONPATH": str(root), "HOME": str(base),
                                       "NUMBA_CACHE_DIR": str(base / "numba")})
            assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
            assert "cannot be written" in done.stderr and "Traceback" not in done.stderr
        assert _snapshot(out) == before
    finally:
        shutil.rmtree(base)


# ---------------------------------------------------------------- 7: nothing left behind

@pytest.mark.parametrize("where", ["store", "manifest"])
def test_a_new_run_on_a_full_disk_leaves_nothing(tmp_path, capsys, monkeypatch, where):
    """The disk fills as the store's tables are made (sqlite: 'database or disk is full', leaving
    an empty results.sqlite), or as the manifest is written (a half temporary file): the run
    exits 1 in one line and its directory is gone, lock file included."""
    import sqlite3

    from harness.store import RunStore
    if where == "store":
        real = RunStore._connect

        def full(self):
            self.path.touch()               # what sqlite leaves when the first page cannot be written
            raise sqlite3.OperationalError("database or disk is full")
        monkeypatch.setattr(RunStore, "_connect", full)
        assert real
    else:
        from pathlib import Path
        real_write = Path.write_text

        def full(self, text, *args, **kwargs):
            if self.name.startswith("manifest.json"):
                real_write(self, text[:10])
                raise OSError(28, "No space left on device")
            return real_write(self, text, *args, **kwargs)
        monkeypatch.setattr(Path, "write_text", full)
    out = tmp_path / "run"
    assert main([*TINY, "--scenario", "gaussian", "--scheme", "int4", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ("disk is full" in err or "No space left" in err), err
    assert not out.exists(), sorted(p.name for p in out.iterdir())


def test_a_full_disk_in_an_existing_empty_directory_leaves_it_empty(tmp_path, monkeypatch):
    import sqlite3

    from harness.store import RunStore

    def full(self):
        self.path.touch()
        raise sqlite3.OperationalError("database or disk is full")
    monkeypatch.setattr(RunStore, "_connect", full)
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main([*TINY, "--scenario", "gaussian", "--scheme", "int4", "--out", str(out)]) == 1
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("command", [["run", *TINY[1:], "--scenario", "gaussian", "--scheme", "int4"],
                                     ["export", "RUN"], ["validate", "--scheme", "tq-kv"],
                                     ["reproduce", "amd-paper", "--quick"], ["selftest", "--quick"],
                                     ["recommend", "cap.npz", "--bits", "3"],
                                     ["predictivity", "cap.npz", "--spec", "spec.json"], ["fit", "cap.npz"],
                                     ["capture"]], ids=lambda c: c[0])
def test_an_empty_out_is_refused(tmp_path, capsys, monkeypatch, command):
    """Every command's --out (export's --output) refuses the empty name, which would write into the
    current directory, in one line and before anything is written."""
    monkeypatch.chdir(tmp_path)
    flag = "--output" if command[0] == "export" else "--out"
    if command[0] == "export":
        assert main([*TINY, "--scenario", "gaussian", "--scheme", "int4", "--out", str(tmp_path / "RUN")]) == 0
    for name in ("cap.npz", "spec.json"):   # inputs that exist: the door refuses a missing one first
        (tmp_path / name).write_text("{}")
    before = sorted(p.name for p in tmp_path.iterdir())
    refused(capsys, [*command, flag, ""], flag, "empty")
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_refused_run_leaves_no_lock_file(tmp_path, capsys):
    """A directory holding another program's results.sqlite, or a run of other flags: refused, and
    no lock file is left, neither the one it made nor one an earlier run left (issue 47: every
    refused resume left one)."""
    import sqlite3
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    with sqlite3.connect(foreign / "results.sqlite") as con:
        con.execute("CREATE TABLE users (id INTEGER)")
    for resume in ([], ["--resume"]):
        refused(capsys, [*TINY, "--scenario", "gaussian", "--scheme", "int4", "--out", str(foreign), *resume])
        assert sorted(p.name for p in foreign.iterdir()) == ["results.sqlite"]
    other = tmp_path / "other"
    assert main([*TINY, "--scenario", "gaussian", "--scheme", "int4", "--out", str(other)]) == 0
    (other / ".lock").unlink()
    refused(capsys, [*TINY, "--scenario", "gaussian", "--scheme", "tq-kv", "--out", str(other), "--resume"],
            "holds a different run")
    assert ".lock" not in {p.name for p in other.iterdir()}
    (other / ".lock").write_text("")
    refused(capsys, [*TINY, "--scenario", "gaussian", "--scheme", "tq-kv", "--out", str(other), "--resume"])
    assert not (other / ".lock").exists()


def test_a_lock_unlinked_under_a_waiting_process_is_not_held_twice(tmp_path, monkeypatch):
    """A refused run removes the lock file it made. A process that opened that file before it was
    unlinked, and locks it after, holds a file no path names: it must lock the file the path names
    now, or a third process would lock that one too."""
    import fcntl
    import os

    from harness import store as store_module
    from harness.store import RunStore
    store = RunStore(tmp_path / "run")
    with pytest.raises(ValueError):
        with store.lock():
            raise ValueError("refused")
    assert not (tmp_path / "run" / ".lock").exists()     # the refused run's lock file is gone
    real, calls = fcntl.flock, []

    def flock_after_a_refusal(fd, flags):
        if not calls:   # between our open and our lock another run unlinked the file and made a new one
            (tmp_path / "run" / ".lock").unlink()
            (tmp_path / "run" / ".lock").write_text("")
        calls.append(fd)
        return real(fd, flags)
    monkeypatch.setattr(store_module.fcntl, "flock", flock_after_a_refusal)
    with store.lock():
        monkeypatch.setattr(store_module.fcntl, "flock", real)
        fd = os.open(tmp_path / "run" / ".lock", os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):        # the file the path names is the one held
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    assert len(calls) == 2


# ---------------------------------------------------------------- 8: killed before the manifest's last write

def test_resume_after_a_kill_between_the_last_commit_and_the_manifest_completes_it(tmp_path, capsys):
    import json
    import signal

    from harness.store import RunStore
    from interrupting import start_held, wait_for_hold
    args = [*TINY[1:], "--scenario", "gaussian", "--scheme", "int4,tq-kv"]
    out, marker = tmp_path / "run", tmp_path / "held"
    proc = start_held(["run", *args, "--out", str(out)], marker, 2, "after")     # 2 cells: commit 2 is the last
    wait_for_hold(proc, marker)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert json.loads((out / "manifest.json").read_text())["finished_at"] is None
    rows = RunStore(out).trials()
    assert main(["run", *args, "--out", str(out), "--resume"]) == 0
    assert "0 cells run, 2 already stored" in capsys.readouterr().out
    manifest = json.loads((out / "manifest.json").read_text())
    cells = RunStore(out).cells()
    assert manifest["finished_at"] == max(cells["finished_at"])             # when its last cell was stored
    from kvcommon.rows import CELL_COLUMNS
    assert set(manifest["peak_mem_mb_per_cell"]) == {"/".join(map(str, k)) for k in
                                                     cells[list(CELL_COLUMNS)].itertuples(index=False)}
    assert "resumed_at" not in manifest
    done = (out / "manifest.json").read_bytes()
    assert main(["run", *args, "--out", str(out), "--resume"]) == 0            # a complete manifest stays as it is
    assert (out / "manifest.json").read_bytes() == done
    import pandas as pd
    pd.testing.assert_frame_equal(RunStore(out).trials(), rows)


# ---------------------------------------------------------------- 11: raw exceptions become one line, exit 2

@pytest.mark.parametrize("seed", [str(2 ** 64), str(2 ** 63), "-1"])
def test_a_seed_beyond_64_bits_is_refused_before_anything_is_computed(tmp_path, capsys, monkeypatch, seed):
    from harness import cell as engine
    computed = []
    monkeypatch.setattr(engine, "run_cell_chunk", lambda *a: computed.append(a))
    out = tmp_path / "never"
    refused(capsys, [*TINY, "--scenario", "gaussian", "--scheme", "int4", "--seed", seed, "--out", str(out)],
            f"--seed {seed} must be an integer in 0..{2 ** 63 - 1}")
    assert not out.exists() and not computed


def test_the_largest_seed_runs_and_is_stored(tmp_path):
    from harness.store import RunStore
    out = tmp_path / "run"
    assert main([*TINY, "--scenario", "gaussian", "--scheme", "int4", "--seed", str(2 ** 63 - 1), "--out", str(out)]) == 0
    assert (RunStore(out).trials()["seed"] == 2 ** 63 - 1).all()


def _bad_stores(base):
    """Run directories whose results.sqlite is not a kvharness store, with the words that say so."""
    import sqlite3
    cases = {}
    for kind in ("zero", "schema", "other", "directory"):
        d = base / kind
        d.mkdir()
        if kind == "zero":
            (d / "results.sqlite").write_bytes(b"")
            cases[d] = "holds no trials table"
        elif kind == "directory":
            (d / "results.sqlite").mkdir()
            cases[d] = "is not a regular file"
        else:
            with sqlite3.connect(d / "results.sqlite") as con:
                con.execute("CREATE TABLE trials (id INTEGER)" if kind == "schema" else "CREATE TABLE users (id INTEGER)")
            cases[d] = "trials table lacks the column(s)" if kind == "schema" else "no trials table"
    return cases


def test_a_store_that_is_not_kvharness_is_refused_by_every_reader(tiny_run, tmp_path, capsys):
    for directory, words in _bad_stores(tmp_path).items():
        for argv in (["report", str(directory)], ["report", str(directory), "--json"], ["export", str(directory)],
                     ["compare", str(directory), str(tiny_run)], ["compare", str(tiny_run), str(directory)]):
            refused(capsys, argv, str(directory / "results.sqlite"), words)


@pytest.mark.parametrize("text, words", [("{not json", "cannot be read as JSON"), ("[1, 2]", "holds a JSON list")])
def test_a_corrupt_manifest_is_refused(tiny_run, capsys, text, words):
    (tiny_run / "manifest.json").write_text(text)
    for argv in (["report", str(tiny_run)], ["report", str(tiny_run), "--json"],
                 [*TINY, "--scenario", "gaussian", "--scheme", "int4", "--out", str(tiny_run), "--resume"]):
        refused(capsys, argv, "manifest.json", words)
    assert (tiny_run / "manifest.json").read_text() == text


def _capture_cases(base):
    import json
    import zipfile

    from test_capture_replay import synthetic_arrays, write_npz
    arrays, meta = synthetic_arrays(np.random.default_rng(0))
    cases = {}
    path = base / "listmeta.npz"
    np.savez(path, metadata=np.array(json.dumps([1, 2])), **arrays)
    cases[path] = "metadata is a JSON list, not an object"
    path = write_npz(base / "member.npz", arrays, meta)
    with zipfile.ZipFile(path, "a") as archive:
        archive.writestr("notes.txt", "not an array")
    cases[path] = "member 'notes.txt' is not a .npy array"
    empty, empty_meta = synthetic_arrays(np.random.default_rng(0))
    for name in ("q", "k", "v"):
        empty[name] = empty[name][:0]
    cases[write_npz(base / "nolayers.npz", empty, {**empty_meta, "layers": "0"})] = "empty capture"
    head = json.dumps({"__metadata__": [1], "k": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    path = base / "listmeta.safetensors"
    path.write_bytes(len(head).to_bytes(8, "little") + head + bytes(4))
    cases[path] = "__metadata__ is a JSON list"
    return cases


def test_a_capture_file_of_the_wrong_make_is_refused(tmp_path, capsys):
    for path, words in _capture_cases(tmp_path).items():
        out = tmp_path / f"never-{path.stem}"
        refused(capsys, [*TINY, "--scenario", f"replay:{path}", "--scheme", "int4", "--out", str(out)], path.name, words)
        assert not out.exists()


@pytest.mark.parametrize("address", ["not an address", "tcp://host-without-port", "localhost"])
def test_a_scheduler_that_is_no_address_is_refused(tmp_path, capsys, address):
    pytest.importorskip("distributed")
    out = tmp_path / "never"
    refused(capsys, [*TINY, "--scenario", "gaussian", "--scheme", "int4", "--scheduler", address, "--out", str(out)],
            "is not a Dask scheduler address")
    assert not out.exists()


@pytest.mark.parametrize("flags, words", [(["--margin", "inf"], "--margin inf must be a positive finite number"),
                                          (["--margin", "nan"], "--margin nan"),
                                          (["--seed", "-1"], "--seed -1 must be an integer in 0..")])
def test_compare_options_out_of_range_are_refused(tiny_run, capsys, flags, words):
    refused(capsys, ["compare", str(tiny_run), str(tiny_run), *flags], words)


def test_an_out_that_cannot_be_a_directory_is_refused(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    run = [*TINY, "--scenario", "gaussian", "--scheme", "int4"]
    refused(capsys, [*run, "--out", str(tmp_path / "afile" / "sub")], "lies under", "which is a file")
    refused(capsys, [*run, "--out", str(tmp_path / "afile" / "a" / "b")], "lies under", "which is a file")
    refused(capsys, [*run, "--out", str(tmp_path / "dangling")], "symbolic link", "does not exist")
    refused(capsys, ["validate", "--scenario", "gaussian", "--scheme", "int4", "--dim", "32", "--seq-len", "64",
                     "--trials", "3", "--out", str(tmp_path / "afile")], "--out", "is a file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "dangling"]
    assert (tmp_path / "afile").read_text() == "x"


def test_bench_refuses_a_shape_larger_than_memory_up_front(capsys, monkeypatch):
    from harness import bench
    ran = []
    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: ran.append(a))
    monkeypatch.setattr("harness.commands.bench.run_bench", lambda *a, **k: ran.append(a))
    refused(capsys, ["bench", "--seq-len", str(10 ** 9), "--trials", "2"], "GiB", "lower --trials, --seq-len")
    assert not ran


# ---------------------------------------------------------------- 13: accepted where they should not be

@pytest.mark.parametrize("flags, words", [
    (["--budget", "２"], "'２' is not a comma-separated list of integers"),
    (["--budget", "2,,3"], "'2,,3' has an empty item"),
    (["--budget", "2,3,"], "has an empty item"),
    (["--trials", "３"], "'３' is not a plain int"),
    (["--trials", "1_0"], "'1_0' is not a plain int"),
    (["--seed", "٣"], "is not a plain int"),                             # Arabic-Indic digit three
    (["--scenario", "gaussian,,heavy_tail"], "has an empty item"),
    (["--scenario", "heavy_tail:dof=３"], "dof='３' is not a plain float"),
])
def test_numbers_that_python_reads_but_a_command_line_should_not_are_refused(tmp_path, capsys, flags, words):
    out = tmp_path / "never"
    argv = [*TINY, "--scenario", "gaussian", "--scheme", "int4", "--out", str(out)]
    refused(capsys, [*argv, *flags], words)
    assert not out.exists()


@pytest.mark.parametrize("argv, words", [
    (["--storage-levels", "2.5", "--storage-levels", "3.5"], "--storage-levels: is given twice"),
    (["--storage-levels", "2.5,2.5"], "2.5 is given twice"),
    (["--storage-levels", "2.5,,3.5"], "has an empty item"),
    (["--storage-levels", "２.5"], "outside ASCII"),
    (["--permutations", "２０"], "is not a plain int"),
])
def test_report_options_given_twice_or_in_fullwidth_are_refused(tiny_run, capsys, argv, words):
    refused(capsys, ["report", str(tiny_run), "--json", *argv], words)


def test_ascii_numbers_still_parse():
    from harness.commands._args import comma_list, plain_number
    assert comma_list(int)(" 2, 3 ") == (2, 3) and plain_number(int)("-4") == -4
    assert plain_number(float)("2.5e-3") == 0.0025 and math.isinf(plain_number(float)("inf"))


def test_a_finished_report_prints_no_warning(tmp_path):
    """A run with one budget per codec (one-row series per codec in the scatter figures)."""
    import subprocess
    import sys
    from pathlib import Path
    out = tmp_path / "run"
    assert main([*TINY, "--scenario", "gaussian,outlier_channels", "--scheme", "int4,tq-kv", "--trials", "3",
                 "--out", str(out)]) == 0
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-W", "always", "-m", "harness", "report", str(out), "--permutations", "20"],
                          capture_output=True, text=True, env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0 and done.stderr == "", done.stderr[-2000:]


def test_a_null_that_shares_no_cell_is_refused(tmp_path, capsys):
    """A --null run of other cells (another scenario) would judge nothing: compare and report refuse
    it in one line naming the matching columns, instead of printing 'null: ...' as if it were used."""
    run, other, null = tmp_path / "run", tmp_path / "other", tmp_path / "null"
    for out, scenario, seed in ((run, "gaussian", "0"), (other, "gaussian", "1"), (null, "heavy_tail", "2")):
        assert main([*TINY, "--scenario", scenario, "--scheme", "int4", "--seed", seed, "--out", str(out)]) == 0
    capsys.readouterr()
    refused(capsys, ["compare", str(run), str(other), "--null", str(null)], "shares no cell", "scenario")
    refused(capsys, ["report", str(run), "--null", str(null), "--json"], "shares no cell", "scenario")
    assert not (run / "report.html").exists()
