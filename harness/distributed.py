"""Chunks of cells as independent Dask tasks, results gathered to the single writer of the store.

`--workers N` runs the sweep in N processes: this one and a local cluster of N - 1 worker
processes, started in the background while this one computes, once they pay (below);
`--scheduler ADDRESS` uses an existing cluster (its workers must have kvharness installed). A
task is one chunk of trials of the cells that share data (cell.chunk_plan): it draws the chunk
once and runs every cell on it, from (configuration, cells, trials) alone — seeds derive from
the cell and the trial, not the schedule — so the rows equal a serial run's. The writer
commits each cell's chunks in trial order as they arrive. A task whose worker dies is retried
elsewhere (dask reschedules it; `retries` covers exceptions), so a dead worker costs only its
chunk.

Speed. A worker is not free: it imports torch and the harness, loads the compiled loops and
builds its codecs (on a loaded 2-core machine 3-8 s, its start competing with this process for
the cores: a concurrent import alone cost a 12-s serial sweep 3 s), its chunks are smaller
(a chunk cut in three cost about a fifth more), and two one-thread processes on two cores
give 1.2-1.4x, not 2x, and nothing where other programs hold the cores. So `--workers N`
starts as the serial run does — this process, all its threads, the serial chunks — and
measures: the work left, its own one-time work and start-up, and, on one chunk run on the
threads each process would have, the speed-up N processes would give with the CPU time the
machine leaves idle (Gate). Workers are started only where that says they save more than
they cost; a connected worker has imported the harness (a preload) and gets tasks at once,
the chunks left are cut for N processes (split_tasks) and this process shares its threads out
(at least one each: on two cores, two one-thread processes rather than two two-thread ones,
whose four threads oversubscribed the cores); until then it keeps all of them. Stopping them
is 0.1 s, not 2 s (Helpers.close). Alternating, on a 2-core EPYC at load 3.5-6 (other test
runs beside it; docs/performance.md), sweeps of 13-37 s took 0.93-0.97x their serial time
with --workers 2 (the measures said: no workers), against 1.38x before. The paper grid's
gaussian and outlier_channels scenarios at 40 trials (576 cells) swept in 108.8 and 114.3 s
serially against 90.6 and 97.4 s on two one-thread processes (alternating; load 1.5-2.2;
measured before the Gate, with the worker started at once).
Rows do not depend on the thread count (every built-in codec at 1 and 3 threads,
tests/test_threads.py; the metrics at 1, 2 and 3, tests/test_metrics.py), so they equal a
serial run's; the manifest records the count this process started with (`torch_threads`). A remote
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
import signal
import time
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

# A sweep whose rough estimate (serial_estimate_s: a fixed cost per cell and the working bytes
# of its trials, cell.bytes_per_trial, at rates measured on one loaded 2-core machine, about
# 0.5 s a cell and 100 MB/s) is under SERIAL_BELOW_S runs serially from the start and says so
# (harness.runner): it is too small to measure. Past it, what decides is measured on this run
# (Gate); the estimate can be far off (a 12.6-s sweep at load 0.3 was estimated at 65 s).
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
def cluster(workers: int | None, scheduler: str | None, timeout: float = 10, *, spare: int = 0,
            threads: int | None = None):
    """A connected Dask client: a local cluster of `workers` - `spare` processes (spare: how many
    of the N workers the calling process stands in for, computing tasks itself), each running
    torch on `threads` threads (default: this process's count), or the scheduler at `scheduler`.
    The local workers start in the background (a task submitted before they are up waits for
    them) and are connected only once they have imported the harness (a preload), so that a
    connected worker is one ready to compute. They never see Ctrl-C: SIGINT is blocked in the
    cluster's threads, and so in every process they start (a signal mask is inherited across
    fork and exec); this process handles it, stopping them, so that a Ctrl-C sent to the whole
    process group while they are importing prints no traceback of theirs. A worker whose parent
    dies exits (dask's parent-alive pipe)."""
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
    settings = {"distributed.nanny.pre-spawn-environ": worker_environment(threads or torch.get_num_threads()),
                "distributed.worker.preload": [__name__]}
    try:
        with dask.config.set(settings), contextlib.ExitStack() as stack:
            # multiprocessing's resource tracker, started by the first worker's queue, unblocks
            # SIGINT in the thread that starts it, after it: started here first, it is not started there
            from multiprocessing import resource_tracker
            resource_tracker.ensure_running()
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:   # the cluster's event-loop thread is started here and inherits the mask
                with warnings.catch_warnings():
                    # the scheduler's HTTP endpoint moves off a busy port 8787 with a warning: not ours to report
                    warnings.filterwarnings("ignore", message="Port .* is already in use", category=UserWarning)
                    # only CRITICAL logs: a worker that loses its scheduler when the run is interrupted
                    # logs errors, where the run itself says it in one line (harness/__main__.py)
                    local = stack.enter_context(LocalCluster(n_workers=0, threads_per_worker=1, processes=True,
                                                             dashboard_address=None, silence_logs=50))
                client = stack.enter_context(Client(local))
            finally:   # a Ctrl-C that came meanwhile is raised here, the cluster closed by the stack
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            local.scale(max(0, workers - spare))
            yield client
    finally:
        for name in set(os.environ) - set(saved):
            del os.environ[name]
        os.environ.update({k: v for k, v in saved.items() if os.environ.get(k) != v})


def n_workers(client) -> int:
    """Workers connected to the scheduler now."""
    return len(client.nthreads())


def plan_tasks(config: SweepConfig, cells: list[Cell], start: dict[Cell, int], memory_bytes: int | None,
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
        size = chunk_size(config, group[0], device, memory_bytes)
        size = min(size, max(MIN_TASK_TRIALS, math.ceil(remaining / pieces)))
        size = math.ceil(remaining / math.ceil(remaining / size))  # as many tasks, of equal size
        tasks += chunk_plan(config, group, size, start)
    return tasks


def serial_plan(config: SweepConfig, cells: list[Cell], start: dict[Cell, int],
                memory_bytes: int | None) -> list[tuple[range, list[Cell]]]:
    """The serial runner's chunks (cell.run_serial's), as tasks: what this process runs alone
    until workers are ready (a chunk cut in three costs about a fifth more than whole: each
    chunk's draws, per-chunk fits and commit)."""
    from .devices import resolve_device
    device = resolve_device(config.device)
    tasks = []
    for _, group in itertools.groupby(cells, key=lambda c: c.data_key):
        group = list(group)
        tasks += chunk_plan(config, group, chunk_size(config, group[0], device, memory_bytes), start)
    return tasks


def split_tasks(tasks: list[tuple[range, list[Cell]]], workers: int) -> list[tuple[range, list[Cell]]]:
    """The tasks cut, once workers are ready, into at least TASKS_PER_WORKER per worker where
    their trials allow it (pieces of at least MIN_TASK_TRIALS trials, of equal size), in order.
    Every cell of a task takes each of its pieces (rows do not depend on chunking)."""
    target = TASKS_PER_WORKER * workers
    if len(tasks) >= target:
        return list(tasks)
    length = max(MIN_TASK_TRIALS, sum(len(trials) for trials, _ in tasks) // target)   # trials a piece
    out = []
    for trials, cells in tasks:
        n = max(1, min(len(trials) // MIN_TASK_TRIALS, math.ceil(len(trials) / length)))
        edges = [trials.start + round(i * len(trials) / n) for i in range(n + 1)]
        out += [(range(a, b), cells) for a, b in zip(edges, edges[1:])]
    return out


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class Helpers:
    """The N - 1 local worker processes of `--workers N` beside this one, started on demand
    (start(), in the background: cluster()); a block (context manager) that stops them on leaving."""

    def __init__(self, workers: int, threads: int):
        self.workers, self.threads = workers, threads
        self.client, self.started_at = None, None
        self._stack = contextlib.ExitStack()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def start(self) -> None:
        if self.client is None:
            self.started_at = time.perf_counter()
            self.client = self._stack.enter_context(cluster(self.workers, None, spare=1, threads=self.threads))

    def ready(self) -> int:
        """Workers connected and ready (their imports done); 0 while none is started."""
        return n_workers(self.client) if self.client is not None else 0

    def close(self) -> None:
        """Stop the workers: their processes terminated first, those being started too (a
        graceful close of each worker took 1.7-2.3 s at the end of every run, and waited for a
        worker still importing to connect first: 3.5 s; terminated, the cluster closes in 0.1 s),
        then the cluster, then any worker process still there waited for, killed if it must
        be, so that none outlives the run."""
        if self.client is None:
            return
        try:
            _stop_workers(wait=False)
            self._stack.close()
        finally:
            self.client = None
            _stop_workers(wait=True)


def _stop_workers(wait: bool, timeout: float = 5) -> None:
    """This process's multiprocessing children (dask's worker processes; not multiprocessing's
    resource tracker, which exits with this process) terminated; with wait, waited for, killed
    after `timeout` seconds."""
    try:
        import psutil   # a dask dependency
    except ImportError:
        return
    children = []
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process().children():
            with contextlib.suppress(psutil.Error):
                if "spawn_main" in " ".join(child.cmdline()):
                    children.append(child)
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.terminate()
    if wait:
        _, alive = psutil.wait_procs(children, timeout=timeout)
        for child in alive:
            with contextlib.suppress(psutil.Error):
                child.kill()
        psutil.wait_procs(alive, timeout=timeout)


class Gate:
    """Whether starting the workers now pays, from what this process measures as it runs the
    sweep's tasks alone (the module docstring's Speed): nothing assumed about the machine.

    After two tasks on all its threads it knows the seconds per unit of work (task_units; from
    the tasks after the first, which carries the process's one-time work), so R, the serial
    seconds left, and W, the first task's one-time work (loading compiled loops, building
    codecs: what a fresh worker pays again). A worker is ready after C = I + W, I this
    process's own start (`startup_s`: its imports and checks, where the command line measured
    them; else W again), and its start competes for the cores meanwhile. The workers save
    R (p - 1) / p at a speed-up p of the N processes over this one alone; they are started when
    that exceeds C and one task more (a worker's last task may end after this process's).

    p is measured: if even p = min(N, CPUs) could not pay, nothing more is measured; otherwise
    one task runs on the threads each process would have (`shared`), which gives this process's
    speed on them against all its threads, and the CPU time the machine left idle meanwhile
    against the CPU time this process used: how many processes like it the free cores would
    run (at most N - 1). A loaded machine has none to spare, however well one thread keeps up
    with two. The decision is made again before each task (decide)."""

    def __init__(self, workers: int, threads: int, shared: int, startup_s: float | None, cpus: int | None = None):
        self.workers, self.threads, self.shared = workers, threads, shared
        self.startup_s, self.cpus = startup_s, cpus or usable_cpus()
        self.full: list[tuple] = []        # (units, seconds, cpu_s, idle_s) of the tasks run on all threads
        self.probe: tuple | None = None    # the same of the task run on the shared threads
        self.reason = "too few tasks to measure"

    def ran(self, units: float, seconds: float, threads: int, cpu_s: float | None = None,
            idle_s: float | None = None) -> None:
        """A task of `units` took `seconds` here on `threads` threads (the workers not started),
        using cpu_s of this process's CPU time while the machine's CPUs were idle for idle_s
        (None: not known)."""
        if threads == self.threads:
            self.full.append((units, seconds, cpu_s, idle_s))
        elif self.probe is None:
            self.probe = (units, seconds, cpu_s, idle_s)

    def _room(self, tasks: list[tuple]) -> float:
        """How many more processes like this one the idle CPUs ran meanwhile, at most N - 1."""
        cpu = sum(t[2] or 0 for t in tasks)
        if any(t[2] is None or t[3] is None for t in tasks) or cpu <= 0:
            return self.workers - 1
        return min(self.workers - 1, sum(t[3] for t in tasks) / cpu)

    def decide(self, units_left: float, task_units: float, next_units: float = 0.0) -> str:
        """'start' the workers now, 'probe' (run the next task, of `next_units`, on the shared
        threads), or 'alone' (this process runs the next task on all its threads), with
        `units_left` of work not yet run, in tasks of about `task_units` once cut for workers."""
        measured = [t for t in self.full[1:] if t[0] > 0]
        if not measured:
            return "alone"
        rate = sum(t[1] for t in measured) / sum(t[0] for t in measured)      # seconds per unit, all threads
        first_units, first_s = self.full[0][:2]
        one_time = max(0.0, first_s - rate * first_units)
        cost = one_time + (self.startup_s if self.startup_s is not None else one_time)
        bound = max(1, min(self.workers, self.cpus))
        left = rate * units_left

        def pays(speedup: float, task_s: float, left: float = left) -> bool:
            return speedup > 1 and left * (speedup - 1) / speedup > cost + task_s

        self.reason = (f"about {left:.0f} s of serial work left against {cost:.0f} s for a worker to start "
                       f"({one_time:.0f} s of it one-time work), more than even a speed-up of {bound} would save")
        if self.shared < self.threads and self.probe is None:
            # the most the workers could give, after the probe: a perfect speed-up, each task on a
            # worker as fast as here; the probe may cost up to its task's time on fewer threads
            after = rate * max(0.0, units_left - next_units)
            penalty = rate * next_units * (self.threads / self.shared - 1)
            if not pays(bound, rate * task_units + penalty, after):
                return "alone"
            self.reason = (f"about {left:.0f} s of serial work left against {cost:.0f} s for a worker to start, "
                           f"too little once the speed-up was measured on the shared threads")
            return "probe"
        if self.probe is not None and self.probe[1] > 0:
            units, seconds = self.probe[:2]
            speed = rate * units / seconds                  # on the shared threads, against all of them
            speedup, task_s = min(bound, (1 + self._room([self.probe])) * speed), seconds / units * task_units
        else:   # this process already runs on one thread: the processes are all the parallelism
            speedup, task_s = min(bound, 1 + self._room(measured)), rate * task_units
        self.reason = (f"about {left:.0f} s of serial work left against {cost:.0f} s for a worker to start "
                       f"({one_time:.0f} s of it one-time work) at a measured speed-up of {speedup:.2f}")
        return "start" if pays(speedup, task_s) else "alone"


def cpu_sample() -> tuple[float, float, float | None]:
    """(wall, this process's CPU time, the machine's idle CPU time: None where psutil, a dask
    dependency, cannot say), in seconds."""
    try:
        import psutil
        idle = psutil.cpu_times().idle
    except Exception:
        idle = None
    return time.perf_counter(), time.process_time(), idle


def task_units(config: SweepConfig, trials: range, cells: list[Cell]) -> float:
    """A task's work in the Gate's units: its trials times its cells' working bytes per trial."""
    from .cell import bytes_per_trial
    return len(trials) * sum(bytes_per_trial(config, c) for c in cells) / 1e6


def run_distributed(client, config: SweepConfig, cells: list[Cell], *, memory_bytes: int | None,
                    on_chunk: Callable[[Cell, range, list, float, float], None],
                    start: dict[Cell, int] | None = None, workers: int | None = None,
                    compute_here: bool = False, helpers: Helpers | None = None, gate: Gate | None = None) -> bool:
    """Run every chunk of the cells as a task, on `client`'s workers and, with compute_here, in
    this process too (one of `workers`); hand each cell's chunks to on_chunk (the single writer)
    in trial order as they arrive. start: each cell's first missing trial. With helpers (a local
    cluster, this process computing), the workers are started when `gate` says they pay (None:
    at once); until then, and until one is ready, this process runs the tasks on all its threads,
    then on its share (Helpers.threads). Returns whether any task ran on a worker.

    The workers are kept several tasks deep; this process takes the next task whenever it is
    free, and when none is left, takes back the tasks queued for workers that have not started
    them (a result that comes anyway is ignored), so the run does not wait on workers that are
    starting or busy."""
    from collections import deque

    import torch

    from .devices import resolve_device, resolve_dtype
    from kvcommon.threads import torch_threads
    start = start or {}
    full = torch.get_num_threads()
    n_threads = helpers.threads if helpers is not None else full   # a worker's count
    config_json = config.to_json()
    if helpers is not None:
        compute_here = True
        workers = helpers.workers
        if gate is None:
            helpers.start()
    else:
        workers = workers or max(1, n_workers(client))
    if gate is not None:   # alone until the workers are ready: the serial chunks, cut when they are
        tasks = deque(serial_plan(config, cells, start, memory_bytes))
    else:
        tasks = deque(plan_tasks(config, cells, start, memory_bytes, workers))
    cut = gate is None
    units = {id(task): task_units(config, *task) for task in tasks}
    remote = workers - 1 if compute_here else workers
    following = {cell: start.get(cell, 0) for cell in cells}  # each cell's next trial to commit
    waiting: dict[Cell, dict[int, tuple]] = {cell: {} for cell in cells}
    pending: dict = {}  # future -> (trials, cells)
    used = False

    def connected() -> int:
        if helpers is not None:
            return helpers.ready()
        return n_workers(client)

    def deliver(trials: range, results) -> None:
        for key, rows, wall, peak in results:
            cell = Cell(*key)
            waiting[cell][trials.start] = (trials, rows, wall, peak)
            while following[cell] in waiting[cell]:
                chunk = waiting[cell].pop(following[cell])
                on_chunk(cell, *chunk)
                following[cell] = chunk[0].stop

    local_schemes = _Schemes()

    def here(task, threads: int) -> None:
        trials, task_cells = task
        before = cpu_sample() if gate is not None and helpers.client is None else None
        with torch_threads(threads):
            results = [(cell.key, rows, wall, peak) for cell, rows, wall, peak in
                       run_chunk(config, task_cells, trials, resolve_device(config.device),
                                 resolve_dtype(config.dtype), local_schemes.of(config, task_cells))]
        if before is not None:
            after = cpu_sample()
            idle = after[2] - before[2] if None not in (after[2], before[2]) else None
            gate.ran(units[id(task)], after[0] - before[0], threads, after[1] - before[1], idle)
        deliver(trials, results)

    while tasks or pending:
        alone = full
        if gate is not None and helpers.client is None and tasks:
            left = sum(units[id(t)] for t in tasks)
            step = gate.decide(left, left / max(len(tasks), TASKS_PER_WORKER * workers), units[id(tasks[0])])
            if step == "start":
                helpers.start()
            elif step == "probe":
                alone = n_threads
        ready = connected()
        if ready and not cut:
            tasks, cut = deque(split_tasks(list(tasks), workers)), True
        if helpers is None or ready:
            depth = QUEUED_WHILE_COMPUTING * remote if compute_here else QUEUED * max(1, ready)
            sender = helpers.client if helpers is not None else client
            while tasks and len(pending) < depth:
                trials, task_cells = tasks.popleft()
                future = sender.submit(compute_chunk_task, config_json, [c.key for c in task_cells], trials.start,
                                       trials.stop, n_threads, pure=False, retries=2)
                pending[future] = (trials, task_cells)
        for future in [f for f in pending if f.done()]:
            trials, _ = pending.pop(future)
            deliver(trials, future.result())
            used = True
        if compute_here and tasks:
            here(tasks.popleft(), n_threads if ready else alone)
        elif compute_here and len(pending) > ready:
            # more tasks queued than workers up to run them (each runs one at a time, oldest
            # first): take back the newest, which none has started
            future = next(reversed(pending))
            future.cancel()
            here(pending.pop(future), n_threads if ready else full)
        elif pending:
            from dask.distributed import wait
            wait(list(pending), return_when="FIRST_COMPLETED")
    return used
