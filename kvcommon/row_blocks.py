"""Rows of a compiled loop split across this process's threads: the loops (numba, GIL released)
of schemes/cpu_loops.py run a large call as one block of rows per torch thread (the harness's
thread budget) on one shared pool; kept apart from the codecs so that any stage's compiled loop
can share it."""
from __future__ import annotations

import concurrent.futures
import os

import torch

# Rows split across threads when a call has at least this many elements (smaller ones do not pay
# for the hand-off).
THREADED_MIN_ELEMENTS = 1 << 16
_POOLS: dict[int, concurrent.futures.ThreadPoolExecutor] = {}


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    """This process's pool (a forked worker gets its own: the parent's threads do not follow a fork)."""
    pid = os.getpid()
    if pid not in _POOLS:
        _POOLS.clear()
        _POOLS[pid] = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvharness-loops")
    return _POOLS[pid]


def by_row_blocks(n_rows: int, n_elements: int, run) -> None:
    """run(start, stop) over contiguous blocks of rows, one per torch thread on the pool when the
    call is large enough to pay for the hand-off; blocks write disjoint rows, so the result does
    not depend on the split."""
    parts = min(torch.get_num_threads(), n_rows) if n_elements >= THREADED_MIN_ELEMENTS else 1
    if parts <= 1:
        run(0, n_rows)
        return
    bounds = [n_rows * i // parts for i in range(parts + 1)]
    for done in [_pool().submit(run, bounds[i], bounds[i + 1]) for i in range(parts)]:
        done.result()                                  # re-raises a block's exception here
