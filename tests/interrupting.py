"""Runs of `python -m harness` in a subprocess that wait at a chosen chunk commit until the test
signals or kills them (harness.runner's KVHARNESS_TEST_HOLD hook): interruption tests that are
deterministic, with no race against the run's speed; and Ctrl-C at a chosen chunk in process
(interrupt_at_chunk)."""
from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from harness import cell as engine
from harness.cell import CHUNK_TRIALS_ENV
from harness.runner import HOLD_ENV
from harness.store import RESULTS_FILE

ROOT = Path(__file__).resolve().parents[1]


def interrupt_at_chunk(mp, n: int) -> None:
    """Through the monkeypatch mp, the n-th cell chunk computed from now on raises
    KeyboardInterrupt (Ctrl-C) instead of running; the others run as usual."""
    real, calls = engine.run_cell_chunk, {"n": 0}

    def run_or_stop(scheme, data):
        calls["n"] += 1
        if calls["n"] == n:
            raise KeyboardInterrupt
        return real(scheme, data)
    mp.setattr(engine, "run_cell_chunk", run_or_stop)


def harness_env(**extra) -> dict:
    """The environment of a harness subprocess: this checkout first on the path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop(HOLD_ENV, None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def start_held(args: list[str], marker: Path, commit: int, phase: str, chunk_trials: int | None = None,
               cwd: Path | None = None, env: dict | None = None, group: bool = False) -> subprocess.Popen:
    """`python -m harness ARGS` that holds at its commit-th chunk commit, `phase` 'before' (the
    chunk computed, not stored), 'during' (inside the transaction) or 'after' it; FILE = marker
    appears when it holds. env: more environment variables; group: in a process group of its
    own (the run and its workers, as a terminal's Ctrl-C reaches them: signal_group)."""
    extra = {HOLD_ENV: f"{commit}:{phase}:{marker}", **(env or {})}
    if chunk_trials:
        extra[CHUNK_TRIALS_ENV] = chunk_trials
    with _interruptible_children():
        return subprocess.Popen([sys.executable, "-m", "harness", *args], cwd=cwd or ROOT, env=harness_env(**extra),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=group)


def start(argv: list[str], env: dict | None = None, group: bool = False) -> subprocess.Popen:
    """ARGV (a command line) with this checkout first on the path, its stderr piped; group: in a
    process group of its own."""
    with _interruptible_children():
        return subprocess.Popen(argv, cwd=ROOT, env=harness_env(**(env or {})), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=group)


def wait_for_handlers(proc: subprocess.Popen, timeout: float = 60) -> None:
    """Until the process has installed harness/__main__.py's signal handlers (its first
    instruction; before it, the interpreter is still starting, and a Ctrl-C is Python's own:
    a traceback of its start-up imports, under load 50 ms and more). Read from /proc (SIGTERM
    caught: Python catches only SIGINT by itself); without /proc, at once."""
    status = Path(f"/proc/{proc.pid}/status")
    deadline = time.monotonic() + timeout
    while status.exists() and proc.poll() is None and time.monotonic() < deadline:
        caught = next((line.split()[1] for line in status.read_text().splitlines() if line.startswith("SigCgt:")), "0")
        if int(caught, 16) & (1 << (signal.SIGTERM - 1)):
            return
        time.sleep(0.005)


def group_processes(pgid: int) -> list[int]:
    """The processes of process group pgid still running (zombies, dead and waiting for their
    parent or init to collect them, are not), from /proc; [] without it."""
    alive = []
    for entry in Path("/proc").iterdir() if Path("/proc/self/stat").exists() else ():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(entry.name))
    return alive


def wait_until_gone(pgid: int, timeout: float = 10) -> list[int]:
    """The processes of group pgid left after up to `timeout` seconds ([] once none is)."""
    deadline = time.monotonic() + timeout
    while (left := group_processes(pgid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


@contextlib.contextmanager
def _interruptible_children():
    """Children started inside take SIGINT as a terminal's Ctrl-C delivers it (Python's
    KeyboardInterrupt), even where this process inherited SIGINT ignored — as commands started
    in the background of a shell without job control do (a CI runner's `cmd &`), and an ignored
    signal stays ignored across exec, where a handled one is reset to the default."""
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def wait_for_hold(proc: subprocess.Popen, marker: Path, timeout: float = 600) -> None:
    """Until the run holds (its marker exists); AssertionError with its output if it ends first."""
    deadline = time.monotonic() + timeout
    while not marker.exists():
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the run ended (exit {proc.returncode}) before holding: {err[-2000:]}")
        assert time.monotonic() < deadline, "the run did not reach its hold in time"
        time.sleep(0.05)


def stored_chunks(directory: Path, live: bool = True) -> int:
    """Chunk commits in the store: read-only while the run lives; after a kill with a normal
    connection, which rolls back the transaction the kill cut short (sqlite's hot journal)."""
    uri = f"file:{directory / RESULTS_FILE}" + ("?mode=ro" if live else "")
    with sqlite3.connect(uri, uri=True) as con:
        return con.execute("SELECT COUNT(*) FROM chunks").fetchone()[0]
