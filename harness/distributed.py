"""Cells as independent Dask tasks, results gathered to the single writer of the store.

`--workers N` starts a local cluster of N single-threaded worker processes; `--scheduler
ADDRESS` uses an existing cluster (its workers must have kvharness installed). A task
computes one cell from (configuration, cell) alone — seeds derive from the cell, not the
schedule — so the rows equal a serial run's. A task whose worker dies is retried elsewhere
(dask reschedules it; `retries` covers exceptions), so a dead worker costs only its cell.
"""
from __future__ import annotations

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


def run_distributed(config: SweepConfig, cells: list[Cell], *, workers: int | None, scheduler: str | None,
                    memory_budget: int | None, on_cell: Callable[[Cell, list, float, float], None]) -> None:
    try:
        from dask.distributed import Client, LocalCluster, as_completed
    except ImportError:
        raise ValueError("distributed sweeps need dask: pip install 'kvharness[distributed]'") from None
    import torch
    n_threads = torch.get_num_threads()  # the serial run's thread count: same reduction order, same rows
    if scheduler:
        client, cluster = Client(scheduler), None
    else:
        cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                               dashboard_address=None, silence_logs=40)
        client = Client(cluster)
    try:
        futures = {client.submit(compute_cell_task, config.to_json(), cell.key, memory_budget, n_threads,
                                 pure=False, retries=2): cell for cell in cells}
        for future in as_completed(futures):
            rows, wall, peak = future.result()
            on_cell(futures[future], rows, wall, peak)
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
