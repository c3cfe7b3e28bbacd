"""No lost work: a run commits a chunk of trials at a time, so Ctrl-C or a kill at any moment
loses at most the chunk in progress, --resume continues each cell from its first missing trial,
and the rows equal an uninterrupted run's. One directory, one writer (a lock); progress per chunk.

The sweep is one data group (every cell shares its draws: the case where a cell used to be
stored only when the whole group finished), cut into chunks of 3 trials; the runs hold at a
chosen chunk commit (tests/interrupting.py), so each case is deterministic."""
import json
import os
import random
import re
import sys
import time
import signal
import sqlite3

import pandas as pd
import pytest

from harness import cell as engine
from harness.cli import main
from harness.progress import INTERVAL_ENV
from harness.store import RESULTS_FILE, RunStore
from interrupting import start_held, stored_chunks, wait_for_hold

# heavy_tail only: one data group of 4 cells; sq-qkv draws a sketch per trial from the trial index
ARGS = ["--scenario", "heavy_tail", "--scheme", "tq-kv,sq-qkv", "--budget", "2,3", "--dim", "16",
        "--seq-len", "64", "--queries", "4", "--calib-tokens", "64", "--trials", "8", "--quiet"]
N_CELLS, N_TRIALS, CHUNK = 4, 8, 3          # chunks of trials 0-1, 2-4, 5-7: commits 1-4, 5-8, 9-12
CHUNK_SIZES = [2] * 4 + [3] * 4 + [3] * 4


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """The uninterrupted run, in one chunk per cell (rows do not depend on chunking)."""
    out = tmp_path_factory.mktemp("clean") / "run"
    assert main(["run", *ARGS, "--out", str(out)]) == 0
    return RunStore(out).trials()


@pytest.mark.parametrize("how,commit,phase", [
    ("SIGINT", 1, "before"),    # the first chunk computed, nothing stored yet
    ("SIGINT", 6, "during"),    # inside the transaction of a chunk of the second round
    ("SIGKILL", 3, "during"),
    ("SIGKILL", 7, "after"),
    ("SIGINT", 10, "after"),    # two cells finished, two still missing their last chunk
    ("SIGTERM", 6, "during"),   # a scheduler's stop: 143, as Ctrl-C's 130
])
def test_interrupted_one_group_sweep_loses_at_most_one_chunk_and_resumes_to_identical_rows(
        tmp_path, clean, how, commit, phase):
    out, marker = tmp_path / "run", tmp_path / "held"
    proc = start_held(["run", *ARGS, "--out", str(out)], marker, commit, phase, chunk_trials=CHUNK)
    wait_for_hold(proc, marker)
    proc.send_signal(getattr(signal, how))
    _, err = proc.communicate(timeout=120)
    if how in ("SIGINT", "SIGTERM"):
        assert proc.returncode == 128 + getattr(signal, how)
        assert err.strip().splitlines()[-1].startswith("interrupted: a run keeps every chunk") and "Traceback" not in err
    else:
        assert proc.returncode == -signal.SIGKILL

    kept = commit if phase == "after" else commit - 1          # the chunk in progress is the only loss
    if kept == 0:
        assert not out.exists()                                 # a new run that stored nothing leaves nothing
    else:
        assert stored_chunks(out, live=False) == kept
        partial = RunStore(out).trials(unfinished=True)
        assert len(partial) == sum(CHUNK_SIZES[:kept])
        finished = max(0, kept - 8)                             # cells whose last chunk (commits 9-12) is in
        assert len(RunStore(out).finished_cells()) == finished
        assert len(RunStore(out).trials()) == finished * N_TRIALS   # only finished cells are read
        with sqlite3.connect(out / RESULTS_FILE) as con:
            assert con.execute("PRAGMA quick_check").fetchone()[0] == "ok"

    assert main(["run", *ARGS, "--out", str(out), "--resume"]) == 0
    resumed = RunStore(out).trials()
    assert not resumed.duplicated(["scheme", "budget", "trial"]).any()
    pd.testing.assert_frame_equal(resumed, clean, check_exact=True)
    cells = RunStore(out).cells()
    assert len(cells) == N_CELLS and (cells.n_trials == N_TRIALS).all() and (cells.wall_s > 0).all()


def test_resume_computes_only_the_missing_trials(tmp_path, clean, monkeypatch):
    """After an interruption --resume draws and runs only the trials not stored, each cell from
    its own first missing trial."""
    out, marker = tmp_path / "run", tmp_path / "held"
    proc = start_held(["run", *ARGS, "--out", str(out)], marker, 6, "after", chunk_trials=CHUNK)
    wait_for_hold(proc, marker)
    proc.kill()
    proc.communicate(timeout=60)
    # a chunk runs its cells budget by budget: the budget-2 cells hold trials 0-4, the budget-3 cells 0-1
    assert stored_chunks(out, live=False) == 6
    seen = []
    real = engine.run_cell_chunk

    def spy(scheme, data):
        seen.append((scheme.name, scheme.budget, tuple(data["trials"].tolist())))
        return real(scheme, data)
    monkeypatch.setattr(engine, "run_cell_chunk", spy)
    monkeypatch.setenv(engine.CHUNK_TRIALS_ENV, str(CHUNK))
    assert main(["run", *ARGS, "--out", str(out), "--resume"]) == 0
    computed = {}
    for name, budget, trials in seen:
        computed.setdefault((name, budget), []).extend(trials)
    assert computed == {("tq-kv", 2): [5, 6, 7], ("sq-qkv", 2): [5, 6, 7],
                        ("tq-kv", 3): [2, 3, 4, 5, 6, 7], ("sq-qkv", 3): [2, 3, 4, 5, 6, 7]}
    pd.testing.assert_frame_equal(RunStore(out).trials(), clean, check_exact=True)


def test_a_second_run_into_a_directory_being_written_is_refused_at_once(tmp_path, capsys):
    out, marker = tmp_path / "run", tmp_path / "held"
    proc = start_held(["run", *ARGS, "--out", str(out)], marker, 1, "after", chunk_trials=CHUNK)
    try:
        wait_for_hold(proc, marker)
        manifest = (out / "manifest.json").read_bytes()
        for extra in ([], ["--resume"]):
            assert main(["run", *ARGS, "--out", str(out), *extra]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and "is being written by another harness run (pid" in err, err
            assert str(proc.pid) in err
        assert (out / "manifest.json").read_bytes() == manifest and stored_chunks(out) == 1
    finally:
        proc.kill()
        proc.communicate(timeout=60)
    assert main(["run", *ARGS, "--out", str(out), "--resume"]) == 0     # the lock died with its holder


_LINE = re.compile(r"^\[(\d+)/(\d+) cells(?: \(\d+ under way\))?, (\d+)/(\d+) trials, [0-9.e+]+ trials/s, "
                   r"ETA [^,\]]+(?:, compiling \d+ s(?: now)?)?\]$")


def test_progress_without_a_terminal_is_a_plain_line_per_interval(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(INTERVAL_ENV, "0")                  # a line at every chunk
    monkeypatch.setenv(engine.CHUNK_TRIALS_ENV, str(CHUNK))
    assert main(["run", *[a for a in ARGS if a != "--quiet"], "--out", str(tmp_path / "a")]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[")]
    counts = [tuple(map(int, _LINE.match(line).groups())) for line in lines]
    assert len(counts) == len(CHUNK_SIZES) + 1              # one per chunk commit, and the last again at the end
    assert [c[2] for c in counts[:-1]] == [sum(CHUNK_SIZES[:i + 1]) for i in range(len(CHUNK_SIZES))]
    assert counts[0] == (0, N_CELLS, CHUNK_SIZES[0], N_CELLS * N_TRIALS) and counts[-1][:3] == (N_CELLS, N_CELLS, 32)
    assert main(["run", *ARGS, "--out", str(tmp_path / "b")]) == 0
    assert not [line for line in capsys.readouterr().err.splitlines() if line.startswith("[")]   # --quiet


def test_progress_bar_on_a_terminal_advances_per_chunk(tmp_path, monkeypatch):
    """On a terminal the bar moves as each chunk is stored, long before the group's last cell."""
    from harness import progress
    calls = []
    real = progress.Progress.advance

    def spy(self, trials, cells=0, *cell_chunk):
        real(self, trials, cells, *cell_chunk)
        calls.append((self.mode, self.trials_done, self.cells_done))
    monkeypatch.setattr(progress.Progress, "advance", spy)
    monkeypatch.setattr("sys.stderr.isatty", lambda: True, raising=False)
    monkeypatch.setenv(engine.CHUNK_TRIALS_ENV, str(CHUNK))
    assert main(["run", *[a for a in ARGS if a != "--quiet"], "--out", str(tmp_path / "a")]) == 0
    assert {mode for mode, _, _ in calls} == {"bar"}
    assert [t for _, t, _ in calls] == [sum(CHUNK_SIZES[:i + 1]) for i in range(len(CHUNK_SIZES))]
    assert calls[0][2] == 0 and calls[7][2] == 0 and calls[-1][2] == N_CELLS


@pytest.mark.parametrize("schemes_, refused", [("tq-kv,int4", True), ("int4,kivi", False)])
def test_resume_refuses_a_run_written_under_the_earlier_seed_rule(tmp_path, capsys, schemes_, refused):
    """A run whose manifest predates the seed families (no seed_rule: scheme seeds keyed by name)
    is not resumed when the family-seeded codecs would draw otherwise: rows of two rules would mix.
    Codecs whose seed is their name either way resume as before."""
    out = tmp_path / "run"
    args = ["run", "--scenario", "gaussian", "--scheme", schemes_, "--budget", "3", "--dim", "16", "--seq-len", "32",
            "--queries", "4", "--calib-tokens", "32", "--trials", "2", "--quiet", "--out", str(out)]
    assert main(args) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["seed_rule"] == engine.SEED_RULE
    del manifest["seed_rule"]                                          # as written before the change
    (out / "manifest.json").write_text(json.dumps(manifest))
    before = (out / "manifest.json").read_bytes()
    capsys.readouterr()
    code = main([*args, "--resume"])
    if refused:
        err = capsys.readouterr().err.strip()
        assert code == 2 and "seed rule 1" in err and "tq-kv" in err and len(err.splitlines()) == 1
        assert (out / "manifest.json").read_bytes() == before             # nothing written
    else:
        assert code == 0


# the kvharness console script's form: what pyproject.toml's [project.scripts] makes of "harness.__main__:script"
SCRIPT = [sys.executable, "-c", "import sys; from harness.__main__ import script; sys.exit(script())"]


@pytest.mark.parametrize("signum,entry", [(signal.SIGINT, "module"), (signal.SIGTERM, "module"),
                                          (signal.SIGINT, "script")])
def test_a_signal_in_the_first_second_is_one_line_and_its_exit_status(tmp_path, signum, entry):
    """Ctrl-C or SIGTERM while the command line is still importing (torch, the commands): exit
    130 or 143 with one line, no traceback, nothing left in --out; from python -m harness and
    from the console script alike. The moments are counted from the first instruction (the
    handlers installed), before which the interpreter itself is starting."""
    from interrupting import start, wait_for_handlers
    rng = random.Random(signum)
    command = [sys.executable, "-m", "harness"] if entry == "module" else SCRIPT
    for delay in (0.0, 0.05, rng.uniform(0.1, 1.0)):
        out = tmp_path / f"run-{delay:.2f}"
        proc = start([*command, "run", *ARGS, "--out", str(out)])
        wait_for_handlers(proc)
        time.sleep(delay)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
        if proc.returncode == 0:      # the run was faster than the signal
            continue
        assert proc.returncode == 128 + signum, err
        assert len(err.strip().splitlines()) == 1 and err.startswith("interrupted"), err
        assert not out.exists() or not any(out.iterdir())


def test_the_console_script_is_the_early_entry():
    """pyproject.toml's kvharness script runs harness/__main__.py's script, which installs the
    handlers on import, as python -m harness does, not harness.cli.main (no handlers until its
    imports are done)."""
    from pathlib import Path
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    scripts = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    assert re.search(r'^kvharness\s*=\s*"harness\.__main__:script"', scripts, re.M), scripts


@pytest.mark.parametrize("moment", ["from the start", "after the first commit"])
def test_ctrl_c_to_the_group_with_workers_is_one_line_and_leaves_no_process(tmp_path, moment):
    """Ctrl-C as a terminal sends it, to the whole process group, with --workers: at a random
    moment of the first 6 s (imports, the cluster's start, the worker's start: importing torch
    and the harness takes it 3-5 s on a loaded 2-core machine) or of the 4 s after the first
    commit (the run holding there, its worker starting or waiting). The run exits 130 with one
    line, no traceback of its own or of a worker (they never see SIGINT), keeps what it stored,
    and no process of the group is left. The moment is in the message of a failure."""
    from harness.runner import SERIAL_BELOW_ENV
    from interrupting import start, wait_for_handlers, wait_until_gone
    pytest.importorskip("distributed")
    out, marker = tmp_path / "run", tmp_path / "held"
    argv = ["run", *ARGS, "--out", str(out), "--workers", "2"]
    env = {SERIAL_BELOW_ENV: 0}    # the workers started at once
    if moment == "from the start":
        proc = start([sys.executable, "-m", "harness", *argv, "--trials", "40"], env=env, group=True)
    else:
        proc = start_held(argv, marker, 1, "after", chunk_trials=CHUNK, env=env, group=True)
    try:
        if moment == "from the start":
            wait_for_handlers(proc)
            delay = random.uniform(0, 6)
        else:
            wait_for_hold(proc, marker)
            delay = random.uniform(0, 4)
        time.sleep(delay)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert wait_until_gone(proc.pid) == [], f"processes left after Ctrl-C at {delay:.2f} s"
    if proc.returncode == 0 and moment == "from the start":     # the run was faster than the signal
        return
    assert proc.returncode == 130, (delay, err)
    assert len(err.strip().splitlines()) == 1 and err.startswith("interrupted"), (delay, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, (delay, err)
    if moment == "after the first commit":
        assert stored_chunks(out, live=False) == 1
