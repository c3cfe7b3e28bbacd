"""Chunks of cells as independent Dask tasks, results gathered to the single writer of the store.

`--workers N` runs the sweep in N processes: this one and a local cluster of N - 1 worker
processes, started in the background while this one computes; `--scheduler ADDRESS` uses an
existing cluster (its workers must have kvharness installed). A task is one chunk of trials of
the cells that share data (cell.chunk_plan): it draws the chunk once and runs every cell on it,
from (configuration, cells, trials) alone — seeds derive from the cell and the trial, not the
schedule — so the rows equal a serial run's. The writer commits each cell's chunks in trial
order as they arrive. A task whose worker dies is retried elsewhere (dask reschedules it;
`retries` covers exceptions), so a dead worker costs only its chunk.

Speed. A local cluster shares this process's torch threads out over its processes (this one
among them; shared_threads): on two cores, two one-thread processes rather than two two-thread
ones, whose four threads oversubscribed the cores (1.06-1.14x over a serial run in earlier
measurements). The paper grid's gaussian and outlier_channels scenarios at 40 trials (576
cells) swept in 108.8 and 114.3 s serially against 90.6 and 97.4 s on two one-thread processes
(alternating; about 10 s of it the worker's start; load 1.5-2.2).
Rows do not depend on the thread count (every built-in codec at 1 and 3 threads,
tests/test_threads.py; the metrics at 1, 2 and 3, tests/test_metrics.py), so they equal a
serial run's; the manifest records the count a process ran with (`torch_threads`). A remote
cluster's workers run torch with this process's count. The
workers' environment is the serial process's, not dask's defaults: dask sets
MALLOC_TRIM_THRESHOLD_=65536, which stops glibc from raising its mmap threshold, so every large
tensor is mmap'ed, zero-filled and unmapped again (a serial cell took 7.0 s without it, 31.1 s
with it); and OpenMP threads sleep when idle (OMP_WAIT_POLICY=PASSIVE) instead of spinning,
which on a machine with more runnable threads than cores (any loaded machine) costs several
times the work.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import os
import warnings
from typing import Callable

from .cell import chunk_plan, chunk_size, create_scheme, run_chunk
from .sweep import Cell, SweepConfig

# Resilience-test hook: when this variable names a file that does not exist yet, the first
# task to see it creates the file and kills its own worker process.
FAULT_ENV = "KVHARNESS_FAULT_KILL_WORKER_ONCE"

# Tasks per worker a sweep is cut into at least (smaller chunks, where a sweep has few data
# groups), so that the workers finish together rather than one waiting on the last big chunk;
# but no task of fewer than MIN_TASK_TRIALS trials (each draws its data and runs every cell's
# fixed costs once).
TASKS_PER_WORKER, MIN_TASK_TRIALS = 3, 8

# Tasks kept queued per remote worker. This process hands out tasks only between its own, so
# where it computes too a worker's queue must outlast one of its tasks: a worker can finish
# several d = 64 tasks while this process runs a d = 256 one. With 2 queued, the worker of a
# two-process run sat idle for a third of the sweep (the 576 cells of the module docstring, one
# thread a process: 106-115 s in three runs, against 89 s with 8 queued); the tasks still queued
# when this process runs out of its own are taken back newest first (run_distributed), so a
# deep queue costs no tail.
QUEUED, QUEUED_WHILE_COMPUTING = 2, 8

# A local cluster pays for its start before it pays off: worker processes that import torch and
# dask, a scheduler, and their shutdown. On this 2-core machine (load 8-12) a sweep of 6 cells
# (tq-kv, int4, sq-kv at b = 2, 3; d = 64, S = 256, Nq = 16), alternating serial and --workers 2:
# 48 trials 36.3, 29.7 s serially against 65.5, 47.2 s on workers (17-30 s lost); 480 trials
# 54.2, 48.9 s against 42.0, 58.2 s (even). So --workers runs serially when the sweep's
# estimated serial compute is under SERIAL_BELOW_S. The estimate (serial_estimate_s) is a fixed
# cost per cell and the working bytes of its trials (cell.bytes_per_trial) at a rate measured on
# the same sweeps (about 0.5 s a cell and 100 MB/s under that load; the 480-trial sweep: 37 s).
SERIAL_BELOW_S = 30.0
CELL_S, BYTES_PER_S = 0.5, 1e8


def serial_estimate_s(config: SweepConfig, cells: list[Cell], start: dict[Cell, int] | None = None) -> float:
    """Seconds the cells' missing trials take serially, roughly (SERIAL_BELOW_S's comment)."""
    from .cell import bytes_per_trial
    start = start or {}
    return sum(CELL_S + (config.trials - start.get(c, 0)) * bytes_per_trial(config, c) / BYTES_PER_S for c in cells)


def _maybe_inject_fault() -> None:
    marker = os.environ.get(FAULT_ENV)
    if marker:
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.close(fd)
        os._exit(13)


class _Schemes:
    """A process's schemes, created once per cell as the serial runner does (the chunks of a cell
    share one scheme object), not once per task; those of the last GROUPS data groups are kept
    (tasks come group by group)."""

    GROUPS = 2

    def __init__(self):
        self.sweep, self.groups = None, {}

    def of(self, config: SweepConfig, cells: list[Cell]) -> dict:
        if self.sweep != config:
            self.sweep, self.groups = config, {}
        group = self.groups.pop(cells[0].data_key, {})
        self.groups[cells[0].data_key] = group          # the most recent last
        while len(self.groups) > self.GROUPS:
            del self.groups[next(iter(self.groups))]
        for cell in cells:
            if cell not in group:
                group[cell] = create_scheme(config, cell)
        return group


_SCHEMES = _Schemes()


def compute_chunk_task(config_json: dict, cell_keys: list[tuple], first: int, stop: int, n_threads: int):
    """Run on a worker: one chunk (trials first..stop-1) of cells that share data; returns
    [(cell key, rows, wall_s, peak_mem_mb)] per cell."""
    import torch

    from .devices import resolve_device, resolve_dtype
    if torch.get_num_threads() != n_threads:
        torch.set_num_threads(n_threads)
    _maybe_inject_fault()
    config = SweepConfig.from_json(config_json)
    cells = [Cell(*key) for key in cell_keys]
    return [(cell.key, rows, wall, peak) for cell, rows, wall, peak in
            run_chunk(config, cells, range(first, stop), resolve_device(config.device), resolve_dtype(config.dtype),
                      _SCHEMES.of(config, cells))]


def shared_threads(workers: int):
    """A block (context manager) with this process's torch threads shared out over the `workers`
    processes of a local cluster (this one among them), at least one each: the count every
    process of the run uses (compute_chunk_task, worker_environment); restored afterwards."""
    import torch

    from kvcommon.threads import torch_threads
    return torch_threads(max(1, torch.get_num_threads() // workers))


def worker_environment(n_threads: int) -> dict:
    """dask's pre-spawn environment for the workers, corrected (module docstring): no
    MALLOC_TRIM_THRESHOLD_, OpenMP threads that sleep when idle and as many as torch will use."""
    import dask
    env = dict(dask.config.get("distributed.nanny.pre-spawn-environ") or {})
    env["MALLOC_TRIM_THRESHOLD_"] = None  # dask: None unsets a variable it would set
    env["OMP_NUM_THREADS"] = str(n_threads)
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    return env


def check_address(scheduler: str) -> None:
    """ValueError (one line) unless `scheduler` is an address Dask can connect to: PROTOCOL://LOCATION
    or HOST:PORT, a tcp or tls address with a host and a port (checked by Dask's own parser)."""
    from distributed.comm.addressing import parse_address, parse_host_port
    try:
        protocol, location = parse_address(scheduler)
        if protocol in ("tcp", "tls"):
            host, _ = parse_host_port(location)
            if not host or any(c.isspace() for c in host):
                raise ValueError(f"bad host {host!r}")
    except (ValueError, TypeError) as exc:
        raise ValueError(f"--scheduler {scheduler!r} is not a Dask scheduler address ({exc}); give "
                         f"tcp://HOST:PORT or HOST:PORT") from None


@contextlib.contextmanager
def cluster(workers: int | None, scheduler: str | None, timeout: float = 10, *, spare: int = 0):
    """A connected Dask client: a local cluster of `workers` - `spare` processes (spare: how many
    of the N workers the calling process stands in for, computing tasks itself), or the
    scheduler at `scheduler`. The local workers start in the background (a task submitted
    before they are up waits for them), so starting them costs the caller no time."""
    try:
        import dask
        from dask.distributed import Client, LocalCluster
    except ImportError:
        raise ValueError("distributed sweeps need dask: pip install 'kvharness[distributed]'") from None
    if scheduler:
        try:
            client = Client(scheduler, timeout=timeout)
        except OSError as exc:
            raise ConnectionError(f"no Dask scheduler answered at {scheduler} within {timeout:.0f} s ({exc})") from None
        try:
            yield client
        finally:
            client.close()
        return
    import torch
    # the nanny copies its pre-spawn variables into this process's environment (and a worker
    # inherits this environment): keep them out of it, and restore it afterwards. The workers
    # start in the background, so the configuration holds for the cluster's life.
    saved = dict(os.environ)
    os.environ.pop("MALLOC_TRIM_THRESHOLD_", None)
    try:
        with dask.config.set({"distributed.nanny.pre-spawn-environ": worker_environment(torch.get_num_threads())}):
            with warnings.catch_warnings():
                # the scheduler's HTTP endpoint moves off a busy port 8787 with a warning: not ours to report
                warnings.filterwarnings("ignore", message="Port .* is already in use", category=UserWarning)
                # only CRITICAL logs: a worker that loses its scheduler when the run is interrupted
                # logs errors, where the run itself says it in one line (harness/__main__.py)
                local = LocalCluster(n_workers=0, threads_per_worker=1, processes=True, dashboard_address=None,
                                     silence_logs=50)
            with local, Client(local) as client:
                local.scale(max(0, workers - spare))
                yield client
    finally:
        for name in set(os.environ) - set(saved):
            del os.environ[name]
        os.environ.update({k: v for k, v in saved.items() if os.environ.get(k) != v})


def n_workers(client) -> int:
    """Workers connected to the scheduler now."""
    return len(client.nthreads())


def plan_tasks(config: SweepConfig, cells: list[Cell], start: dict[Cell, int], memory_budget: int | None,
               workers: int) -> list[tuple[range, list[Cell]]]:
    """The serial runner's chunks (cell.chunk_plan), made smaller where the sweep has too few
    of them to keep every worker busy: at least TASKS_PER_WORKER tasks per worker where the
    trials allow it (and MIN_TASK_TRIALS). Rows do not depend on chunking."""
    from .devices import resolve_device
    device = resolve_device(config.device)
    groups = [list(g) for _, g in itertools.groupby(cells, key=lambda c: c.data_key)]
    pieces = math.ceil(TASKS_PER_WORKER * workers / max(1, len(groups)))
    tasks = []
    for group in groups:
        remaining = config.trials - min(start.get(c, 0) for c in group)
        size = chunk_size(config, group[0], device, memory_budget)
        size = min(size, max(MIN_TASK_TRIALS, math.ceil(remaining / pieces)))
        size = math.ceil(remaining / math.ceil(remaining / size))  # as many tasks, of equal size
        tasks += chunk_plan(config, group, size, start)
    return tasks


def run_distributed(client, config: SweepConfig, cells: list[Cell], *, memory_budget: int | None,
                    on_chunk: Callable[[Cell, range, list, float, float], None],
                    start: dict[Cell, int] | None = None, workers: int | None = None,
                    compute_here: bool = False) -> None:
    """Run every chunk of the cells as a task, on `client`'s workers and, with compute_here, in
    this process too (one of `workers`); hand each cell's chunks to on_chunk (the single writer)
    in trial order as they arrive. start: each cell's first missing trial.

    The workers are kept two tasks deep; this process takes the next task whenever it is free,
    and when none is left, takes back the tasks queued for workers that have not started them
    (all of them while the workers are still starting; a result that comes anyway is ignored),
    so the run does not wait on workers that are starting or busy."""
    from collections import deque

    from dask.distributed import wait

    import torch

    from .devices import resolve_device, resolve_dtype
    start = start or {}
    n_threads = torch.get_num_threads()  # this process's count (shared_threads with a local cluster)
    config_json = config.to_json()
    workers = workers or max(1, n_workers(client))
    tasks = deque(plan_tasks(config, cells, start, memory_budget, workers))
    remote = workers - 1 if compute_here else workers
    following = {cell: start.get(cell, 0) for cell in cells}  # each cell's next trial to commit
    waiting: dict[Cell, dict[int, tuple]] = {cell: {} for cell in cells}
    pending: dict = {}  # future -> (trials, cells)

    def deliver(trials: range, results) -> None:
        for key, rows, wall, peak in results:
            cell = Cell(*key)
            waiting[cell][trials.start] = (trials, rows, wall, peak)
            while following[cell] in waiting[cell]:
                chunk = waiting[cell].pop(following[cell])
                on_chunk(cell, *chunk)
                following[cell] = chunk[0].stop

    local_schemes = _Schemes()

    def here(trials: range, task_cells: list[Cell]) -> None:
        deliver(trials, [(cell.key, rows, wall, peak) for cell, rows, wall, peak in
                         run_chunk(config, task_cells, trials, resolve_device(config.device),
                                   resolve_dtype(config.dtype), local_schemes.of(config, task_cells))])

    while tasks or pending:
        depth = QUEUED_WHILE_COMPUTING * remote if compute_here else QUEUED * max(1, n_workers(client))
        while tasks and len(pending) < depth:
            trials, task_cells = tasks.popleft()
            future = client.submit(compute_chunk_task, config_json, [c.key for c in task_cells], trials.start,
                                   trials.stop, n_threads, pure=False, retries=2)
            pending[future] = (trials, task_cells)
        for future in [f for f in pending if f.done()]:
            trials, _ = pending.pop(future)
            deliver(trials, future.result())
        if compute_here and tasks:
            here(*tasks.popleft())
        elif compute_here and len(pending) > n_workers(client):
            # more tasks queued than workers up to run them (each runs one at a time, oldest
            # first): take back the newest, which none has started
            future = next(reversed(pending))
            future.cancel()
            here(*pending.pop(future))
        elif pending:
            wait(list(pending), return_when="FIRST_COMPLETED")
