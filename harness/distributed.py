"""Cells as independent Dask tasks, results gathered to the single writer of the store.

`--workers N` starts a local cluster of N single-threaded worker processes; `--scheduler
ADDRESS` uses an existing cluster (its workers must have kvharness installed). A task
computes one cell from (configuration, cell) alone — seeds derive from the cell, not the
schedule — so the rows equal a serial run's. A task whose worker dies is retried elsewhere
(dask reschedules it; `retries` covers exceptions), so a dead worker costs only its cell.
"""
from __future__ import annotations

import contextlib
import os
from typing import Callable

from .sweep import Cell, SweepConfig

# Resilience-test hook: when this variable names a file that does not exist yet, the first
# task to see it creates the file and kills its own worker process.
FAULT_ENV = "KVHARNESS_FAULT_KILL_WORKER_ONCE"


def _maybe_inject_fault() -> None:
    marker = os.environ.get(FAULT_ENV)
    if marker:
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.close(fd)
        os._exit(13)


def compute_cell_task(config_json: dict, cell_key: tuple, memory_budget: int | None, n_threads: int):
    """Run on a worker: every chunk of one cell; returns (rows, wall_s, peak_mem_mb)."""
    import torch

    from .runner import compute_cell
    torch.set_num_threads(n_threads)
    _maybe_inject_fault()
    return compute_cell(SweepConfig.from_json(config_json), Cell(*cell_key), memory_budget)


@contextlib.contextmanager
def cluster(workers: int | None, scheduler: str | None, timeout: float = 10):
    """A connected Dask client: a local cluster of `workers` single-threaded processes, or the
    scheduler at `scheduler`. Connect before anything is written, so an unreachable scheduler
    leaves no half-made run directory."""
    try:
        from dask.distributed import Client, LocalCluster
    except ImportError:
        raise ValueError("distributed sweeps need dask: pip install 'kvharness[distributed]'") from None
    if scheduler:
        try:
            client, local = Client(scheduler, timeout=timeout), None
        except OSError as exc:
            raise ConnectionError(f"no Dask scheduler answered at {scheduler} within {timeout:.0f} s ({exc})") from None
    else:
        local = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                             dashboard_address=None, silence_logs=40)
        client = Client(local)
    try:
        yield client
    finally:
        client.close()
        if local is not None:
            local.close()


def run_distributed(client, config: SweepConfig, cells: list[Cell], *, memory_budget: int | None,
                    on_cell: Callable[[Cell, list, float, float], None]) -> None:
    """Submit every cell as a task on `client` and hand each finished one to on_cell (the single writer)."""
    from dask.distributed import as_completed

    import torch
    n_threads = torch.get_num_threads()  # the serial run's thread count: same reduction order, same rows
    futures = {client.submit(compute_cell_task, config.to_json(), cell.key, memory_budget, n_threads,
                             pure=False, retries=2): cell for cell in cells}
    for future in as_completed(futures):
        rows, wall, peak = future.result()
        on_cell(futures[future], rows, wall, peak)
