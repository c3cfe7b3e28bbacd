"""The sweep's orchestration: which cells and trials are still to run, the run directory (lock,
manifest, integrity, a new run that stores nothing leaves nothing), the serial or Dask executor,
progress, and committing each chunk's rows as it arrives. The computation itself is the cell
engine (harness/cell.py); seeds and the decode phase are described there.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import sqlite3
import sys
import time
from dataclasses import dataclass

from .cell import SEED_RULE, CellFailure, family_seeded, run_serial, trial_memory_bytes
from .devices import available_memory_bytes, resolve_device, resolve_dtype
from .errors import UsageError
from .provenance import check_inputs, input_digests, now, provenance
from .store import LOCK_FILE, MANIFEST_FILE, RunStore, StoreError
from .sweep import Cell, SweepConfig

HOLD_ENV = "KVHARNESS_TEST_HOLD"
# run_sweep's serial_below_s where the caller gives none: 0 starts the workers of --workers N at once
SERIAL_BELOW_ENV = "KVHARNESS_SERIAL_BELOW_S"


class RunConflict(ValueError):
    """The output directory holds something other than this run."""


class RunTooLarge(UsageError):
    """One trial of the sweep cannot fit in the available memory."""


class CellsFailed(RuntimeError):
    """Some cells gave no rows to store (harness.cell.CellFailure); the others are stored."""

    def __init__(self, failures: dict, n_cells: int):
        self.failures = failures
        by_codec: dict[str, list] = {}
        for cell, reason in failures.items():
            by_codec.setdefault(cell.scheme, []).append(reason)
        words = "; ".join(f"codec {name}: {len(reasons)} cell(s), first {reasons[0]}" for name, reasons in by_codec.items())
        super().__init__(f"{len(failures)} of {n_cells} cells failed and are not stored ({words}); the other "
                         f"{n_cells - len(failures)} are stored")


@dataclass(frozen=True)
class RunResult:
    n_cells_run: int
    n_cells_skipped: int
    wall_s: float
    n_trials_kept: int = 0  # trials of the cells run that an earlier, interrupted run had stored


def stored_config(manifest: dict | None) -> dict | None:
    """The manifest's configuration in today's form: fields added since it was written
    (decode_tokens) at their defaults, a single calib_tokens as a list, so that an older run
    still resumes."""
    if manifest is None or "config" not in manifest:
        return None
    defaults = {f.name: list(f.default) if isinstance(f.default, tuple) else f.default
                for f in dataclasses.fields(SweepConfig) if f.default is not dataclasses.MISSING}
    return SweepConfig.upgrade_json({**{k: v for k, v in defaults.items() if k not in manifest["config"]},
                                     **manifest["config"]})

def check_store(config: SweepConfig, store: RunStore, *, resume: bool) -> None:
    """RunConflict when the directory holds a run and this is not its --resume, or holds another
    run; CorruptStore when its results.sqlite is damaged, ForeignStore when it is another program's,
    ReadOnlyStore when it cannot be written. Writes nothing."""
    manifest = store.read_manifest()
    if manifest is not None or store.path.exists():
        if not resume:
            raise RunConflict(f"{store.directory} already holds a run; pass --resume to finish it "
                              f"or choose another --out")
        stored = stored_config(manifest)
        if stored != config.to_json():
            differing = sorted(k for k, v in config.to_json().items() if stored is None or stored.get(k) != v)
            raise RunConflict(f"{store.directory} holds a different run (differs in: "
                              f"{', '.join(differing)}); choose another --out")
        rule = (manifest or {}).get("seed_rule", 1)
        changed = family_seeded(config.schemes)
        if rule != SEED_RULE and changed:
            raise RunConflict(f"{store.directory} was written under seed rule {rule} (scheme seeds keyed by name); "
                              f"this kvharness keys {', '.join(changed)} by family (rule {SEED_RULE}), so resuming "
                              f"would mix rows of two seed rules; choose another --out")
        check_inputs(manifest or {}, config.scenarios)   # InputChanged: a replay/fitted file is not the run's
        store.check_integrity()
        store.check_writable()

def prepare_store(config: SweepConfig, store: RunStore, *, resume: bool) -> None:
    """Check the directory against this run (RunConflict when it holds another) and write the manifest."""
    check_store(config, store, resume=resume)
    manifest = store.read_manifest()
    if manifest is not None:
        manifest.setdefault("resumed_at", []).append(now())
        manifest["finished_at"] = None
        store.write_manifest(manifest)
        return
    store.write_manifest({"config": config.to_json(), "provenance": provenance(resolve_device(config.device)),
                          "inputs": input_digests(config.scenarios),   # sha256 of replay/fitted files
                          "seed_rule": SEED_RULE, "started_at": now(), "finished_at": None})

def completion(store: RunStore) -> tuple[int, int] | None:
    """(finished cells, cells of the run's configuration); None when the directory has no manifest
    to say which cells the run has (RunStore.completion, which the report reads)."""
    return store.completion()

def check_memory(config: SweepConfig, device) -> None:
    """RunTooLarge (one line) when one trial of some cell cannot fit in the available memory."""
    available = available_memory_bytes(device)
    cell = max(config.cells(), key=lambda c: trial_memory_bytes(config, c))
    need = trial_memory_bytes(config, cell)
    if need > available:
        raise RunTooLarge(f"harness run: one trial of d = {cell.dim}, S = {cell.seq_len} (+{config.decode_tokens}), "
                          f"Nq = {cell.queries}, H = {config.heads} needs about {need / 2 ** 30:.1f} GiB, more than the "
                          f"{available / 2 ** 30:.1f} GiB available on {device.type}; lower --dim, --seq-len, --queries "
                          f"or --heads")

class DataOutOfRange(UsageError):
    """A scenario's parameters make its data overflow or vanish in the metrics."""


def check_data(config: SweepConfig) -> None:
    """DataOutOfRange (one line) when a scenario's parameters make its data overflow or vanish in
    the metrics (SweepConfig.check_data); after check_memory, since the probe draws a trial's population."""
    try:
        config.check_data()
    except ValueError as exc:
        raise DataOutOfRange(f"harness run: {exc}") from None

def run_sweep(config: SweepConfig, store: RunStore, *, resume: bool = False, progress: bool | None = None,
              memory_bytes: int | None = None, workers: int | None = None,
              scheduler: str | None = None, serial_below_s: float | None = None) -> RunResult:
    """Run every trial of the sweep not yet in the store, committed a chunk at a time (a cell's
    chunk in one transaction; RunStore.write_chunk). With workers N > 1 chunks run as Dask tasks
    in this process and on N - 1 local worker processes, started once what this process measures
    as it runs the first tasks says they pay for their start (distributed.Gate; the run says in
    one line when they did not), unless the sweep is estimated at less than serial_below_s
    seconds of serial work (default $KVHARNESS_SERIAL_BELOW_S, else distributed.SERIAL_BELOW_S),
    which runs serially from the start and says so in one line; serial_below_s 0: on workers
    started at once. With scheduler, on an existing cluster.

    Refused, with nothing written, when one trial cannot fit in memory (RunTooLarge), another run
    holds the directory (StoreLocked), or the directory holds another run or a damaged store
    (RunConflict, CorruptStore); a run with nothing left to do leaves its manifest as it was. A
    new run that fails or is interrupted before its first chunk is stored removes what it wrote."""
    start = time.perf_counter()
    device, dtype = resolve_device(config.device), resolve_dtype(config.dtype)
    check_memory(config, device)
    check_data(config)
    with contextlib.ExitStack() as stack:
        stack.enter_context(store.lock(refusals=(StoreError, UsageError, ValueError)))
        fresh = store.read_manifest() is None and not store.path.exists()
        check_store(config, store, resume=resume)
        done = store.finished_cells()
        todo = [c for c in config.cells() if c.key not in done]
        if not todo:
            _complete_manifest(store)
            return RunResult(0, len(done), time.perf_counter() - start)
        if serial_below_s is None:
            from .distributed import SERIAL_BELOW_S
            serial_below_s = float(os.environ.get(SERIAL_BELOW_ENV) or SERIAL_BELOW_S)
        if not scheduler and (workers or 1) > 1 and serial_below_s != 0:
            workers = _workers_worth_it(config, store, todo, workers, serial_below_s)
        try:
            client = helpers = gate = None
            if scheduler:
                from .distributed import cluster
                client = stack.enter_context(cluster(None, scheduler))
            elif (workers or 1) > 1:  # --workers 1 is the serial run
                import torch

                from .distributed import Gate, Helpers
                # a local cluster: this process is one of the N, their threads its own shared out
                threads = torch.get_num_threads()
                shared = max(1, threads // workers)
                helpers = stack.enter_context(Helpers(workers, shared))
                if serial_below_s != 0:
                    gate = Gate(workers, threads, shared, _startup_s(start))
            prepare_store(config, store, resume=resume)
            kept = _run_cells(config, store, todo, device, dtype, progress, memory_bytes, client,
                              None if scheduler else workers, helpers, gate)
        except BaseException:
            if fresh:
                _discard_if_empty(store)
            raise
    return RunResult(len(todo), len(done), time.perf_counter() - start, kept)

def _complete_manifest(store: RunStore) -> None:
    """A run whose every cell is stored but whose manifest was not completed (killed between its
    last commit and the manifest's final write): finished_at is set to the moment its last cell
    was stored (the cells table's latest finished_at), with the cells' peak memory, as the run
    itself would have written it. A completed manifest is left as it was."""
    manifest = store.read_manifest()
    if manifest is None or manifest.get("finished_at") is not None:
        return
    cells = store.cells()
    manifest["finished_at"] = max(cells["finished_at"]) if len(cells) else now()
    manifest["peak_mem_mb_per_cell"] = store.peak_memory_mb()
    store.write_manifest(manifest)


_STARTUP: list[float | None] = []


def _startup_s(now: float) -> float | None:
    """Seconds this process took from its first instruction to its first sweep's start, `now`
    for the first (its imports and the run's checks: about what a worker pays before its first
    task), where the command line recorded that moment (harness.cli.STARTED_AT); else None.
    Later sweeps of the process (harness reproduce runs several) take the first's."""
    if not _STARTUP:
        started = getattr(sys.modules.get("harness.cli"), "STARTED_AT", None)
        _STARTUP.append(now - started if started is not None and started <= now else None)
    return _STARTUP[0]


def _workers_worth_it(config: SweepConfig, store: RunStore, todo: list[Cell], workers: int,
                      serial_below_s: float | None) -> int:
    """workers, or 1 (said on stderr in one line) when the sweep is too small to pay for starting them."""
    from .distributed import SERIAL_BELOW_S, serial_estimate_s
    limit = SERIAL_BELOW_S if serial_below_s is None else serial_below_s
    stored = store.stored_trials()
    estimate = serial_estimate_s(config, todo, {c: stored[c.key] for c in todo if c.key in stored})
    if estimate >= limit:
        return workers
    print(f"harness run: running serially, not on {workers} workers: this sweep is about {estimate:.0f} s of serial "
          f"work, less than starting the workers costs (worth it from about {limit:.0f} s)", file=sys.stderr)
    return 1


def _test_hold(n_commit: int, phase: str) -> None:
    """Interruption tests: with $KVHARNESS_TEST_HOLD = "N:PHASE:FILE", the run creates FILE and
    waits (to be signalled or killed) at its N-th chunk commit, PHASE 'before' it (the chunk
    computed, not stored), 'during' it (inside the transaction) or 'after' it."""
    hold = os.environ.get(HOLD_ENV)
    if not hold:
        return
    n, when, marker = hold.split(":", 2)
    if int(n) != n_commit or when != phase:
        return
    open(marker, "a").close()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        time.sleep(0.05)

def _discard_if_empty(store: RunStore) -> None:
    """Remove what a new run wrote to its directory (manifest and its temporary file, the store
    and its side files, lock file, and the directory when nothing else is in it), unless a trial
    was stored. A store with no trials table (the disk filled as it was made) holds none."""
    if _holds_a_trial(store):
        return
    for name in (store.path.name, store.path.name + "-journal", store.path.name + "-wal", store.path.name + "-shm",
                 MANIFEST_FILE, MANIFEST_FILE + ".tmp", LOCK_FILE):
        (store.directory / name).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        store.directory.rmdir()

def _holds_a_trial(store: RunStore) -> bool:
    """Whether results.sqlite holds a trial row; True where it cannot be read (not ours to remove)."""
    if not store.path.exists():
        return False
    try:
        con = sqlite3.connect(store.path)
        try:
            if not con.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'trials'").fetchone():
                return False
            return con.execute("SELECT 1 FROM trials LIMIT 1").fetchone() is not None
        finally:
            con.close()
    except sqlite3.Error:
        return True

def _cost_key(config: SweepConfig, device, dtype):
    """A cell's key in CostHistory: the cell and what its cost per trial depends on besides."""
    def key(cell: Cell) -> str:
        return json.dumps([*cell.key, device.type, str(dtype), config.impl, config.heads, config.decode_tokens,
                           config.trials])
    return key


def _run_cells(config, store, todo, device, dtype, progress, memory_bytes, client, workers=None, helpers=None,
               gate=None) -> int:
    """The trials not yet stored, serially, as tasks on a Dask client, or as tasks here and on
    local workers (helpers, started as `gate` says: distributed.run_distributed), each chunk
    committed as it arrives; the manifest's finished_at once all are in. Returns the trials of
    these cells that were stored before. CellsFailed, after every other cell is stored, when
    some failed."""
    from .progress import CostHistory, Progress

    stored = store.stored_trials()
    start = {cell: stored[cell.key] for cell in todo if cell.key in stored}
    n_cells = len(config.cells())
    compiling = None
    if client is None and device.type == "cpu":   # a serial run compiles the CPU loops in this process
        from kvcommon.compiled import compile_clock
        compiling = compile_clock()
    history, cost_key = CostHistory(), _cost_key(config, device, dtype)
    known = history.load()
    bar = Progress.auto(progress, n_cells, n_cells * config.trials, cells_done=n_cells - len(todo),
                        trials_done=(n_cells - len(todo)) * config.trials + sum(start.values()),
                        trials_left={cell: config.trials - start.get(cell, 0) for cell in todo},
                        prior={cell: known[cost_key(cell)] for cell in todo if cost_key(cell) in known},
                        compiling=compiling)

    commits = itertools.count(1)
    failed: dict[Cell, str] = {}

    def on_chunk(cell: Cell, trials: range, rows: list, wall: float, peak_mb: float) -> None:
        if isinstance(rows, CellFailure) or cell in failed:   # a failed cell's later chunks are not stored either
            failed.setdefault(cell, getattr(rows, "reason", ""))
            return
        n = next(commits)
        _test_hold(n, "before")
        finished = store.write_chunk(cell.key, rows, first_trial=trials.start, n_trials_cell=config.trials,
                                     wall_s=wall, finished_at=now(), peak_mem_mb=peak_mb,
                                     before_commit=lambda: _test_hold(n, "during"))
        _test_hold(n, "after")
        bar.advance(len(rows), int(finished), cell, wall, trials.start)

    used = False   # whether a task ran on another process
    try:
        with store.writing():   # one connection for the run's commits
            if client is not None or helpers is not None:
                from .distributed import run_distributed
                used = run_distributed(client, config, todo, memory_bytes=memory_bytes, on_chunk=on_chunk,
                                       start=start, workers=workers, compute_here=workers is not None,
                                       helpers=helpers, gate=gate)
            else:
                run_serial(config, todo, device, dtype, memory_bytes, start=start, on_chunk=on_chunk)
    finally:
        bar.close()
        if client is None and not used:   # serial costs only: a cell's chunks on workers overlap
            history.save({cost_key(cell): cost for cell, cost in bar.measured().items()})
    if gate is not None and helpers.started_at is None:
        print(f"harness run: ran serially, not on {workers} workers: starting them did not pay ({gate.reason})",
              file=sys.stderr)
    manifest = store.read_manifest()
    if not failed:
        manifest["finished_at"] = now()
    manifest["peak_mem_mb_per_cell"] = store.peak_memory_mb()
    store.write_manifest(manifest)
    if failed:
        raise CellsFailed(failed, len(todo))
    return sum(start.values())
