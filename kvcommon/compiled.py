"""The compiled CPU loops (numba) of the codecs' building blocks, and what they share: the switch
that turns them on (DTYPES), the gate every caller asks before using them (takes), the numba
options they are compiled with, and the split of a call's rows across the torch threads.

The loops themselves live beside the building block they serve, in a sibling module named
<block>_cpu.py: schemes/scalar_quantizer_cpu.py (quantise, pack, dequantise), schemes/hadamard_cpu.py
(the Walsh–Hadamard butterflies), schemes/kmeans_cpu.py (nearest centroids, k-means++ seeding), and
the fused per-codec passes schemes/turboquant_cpu.py and schemes/spectralquant_cpu.py; the
metrics' per-token pass stats/metrics_cpu.py; the sum of squares in torch.linalg.vector_norm's
order that several of them take, in kvcommon/vector_norm_cpu.py, torch.sum's, in kvcommon/sum_cpu.py,
and division by a scalar with IEEE division's bits at a fraction of its cost, in kvcommon/quotients_cpu.py.
They replace chains of whole-tensor torch passes (a dozen reads and writes of every element) with
one pass over each row in cache, with the same bits; the torch passes serve the other devices
(CUDA) and dtypes (half precision) and check the loops in the tests.

This module does not import numba (its import costs most of a second, and a run on CUDA never
needs it): a caller imports its <block>_cpu module only once takes(t) says yes. (schemes/__init__.py,
which imports every other module of the package to register codecs, leaves them out.) numba compiles a
loop once per dtype on first use (cached on disk beside its module, or in numba's user cache where
that is not writable).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
import time

import numpy as np
import torch

# The switch: the dtypes the compiled loops take (numba reads and writes CPU tensors of these as
# NumPy views in place). Tests empty it to route every codec through its torch passes.
DTYPES = (torch.float32, torch.float64)

# the numba options of every loop (numba.jit(**JIT))
JIT = {"nopython": True, "nogil": True, "cache": True, "boundscheck": False}
# the options of the loops that allocate nothing (their scratch comes from the caller): without
# numba's reference counting, which increments and decrements a counter atomically each time a loop
# takes a view of a row (x[r]) and hands it on — 30 % of TurboQuant's encode and decode in a
# profile (perf, one thread, d = 128), for views that never outlive the call
FLAT_JIT = {**JIT, "_nrt": False}

# Rows split across threads (the kernels release the GIL) when a call has at least this many elements.
_THREADED_MIN_ELEMENTS = 1 << 16
_POOLS: dict[int, concurrent.futures.ThreadPoolExecutor] = {}


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    """This process's pool (a forked worker gets its own: the parent's threads do not follow a fork)."""
    pid = os.getpid()
    if pid not in _POOLS:
        _POOLS.clear()
        _POOLS[pid] = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvharness-loops")
    return _POOLS[pid]


def takes(t: torch.Tensor) -> bool:
    """Whether the compiled loops take t: a CPU tensor in one of DTYPES."""
    return t.device.type == "cpu" and t.dtype in DTYPES


def row_view(t: torch.Tensor) -> np.ndarray:
    """A 2-D NumPy view (rows, last dim) of a contiguous CPU tensor."""
    return t.reshape(-1, t.shape[-1]).numpy()


def by_row_blocks(n_rows: int, n_elements: int, run, deferred: bool = False, threads: int | None = None) -> None:
    """run(start, stop) over contiguous blocks of rows, one per torch thread (the harness's
    thread budget; `threads` in its place where given, e.g. read before a block that runs torch
    on one thread) on the loops' pool when the call is large enough to pay for the hand-off;
    blocks write disjoint rows, so the result does not depend on the split. deferred: inside
    `batched`, the call is held and run with the others on leaving it (its outputs are not read
    before then)."""
    jobs = getattr(_BATCH, "jobs", None)
    if deferred and jobs is not None:
        jobs.append((n_rows, n_elements, run))
        return
    _run_jobs([(n_rows, n_elements, run)], threads)


# the calls by_row_blocks holds inside `batched`, per thread (None: not inside)
_BATCH = threading.local()


@contextlib.contextmanager
def batched():
    """Inside: the deferred calls of by_row_blocks are held, and run together on leaving — one
    hand-off to the pool for them all instead of one each (a codec's K and V: waking a pool
    thread and waiting for it costs ~0.1 ms a call on a 2-vCPU VM, a tenth of coding 8 × 1024
    vectors). Nested: the outermost runs them. Held calls run even when the body raised, so
    that nothing remembered (kvcommon/memo.py) keeps an output never written; if one of them
    raises, every memo is emptied."""
    if getattr(_BATCH, "jobs", None) is not None:
        yield
        return
    _BATCH.jobs = []
    try:
        yield
    finally:
        jobs, _BATCH.jobs = _BATCH.jobs, None
        try:
            _run_jobs(jobs)
        except BaseException:
            from .memo import IdentityMemo
            IdentityMemo.forget_all()
            raise


def _run_jobs(jobs: list, threads: int | None = None) -> None:
    """Each job (n_rows, n_elements, run) over all its rows: the rows of all the jobs, in order,
    split into one contiguous share per torch thread (or per `threads`) when they are large enough to pay for the
    hand-off (a share may cover the end of one job and the start of the next), the last share on
    the calling thread."""
    n_rows, n_elements = sum(job[0] for job in jobs), sum(job[1] for job in jobs)
    parts = min(threads or torch.get_num_threads(), n_rows) if n_elements >= _THREADED_MIN_ELEMENTS else 1
    if parts <= 1:
        for rows, _, run in jobs:
            if rows:
                run(0, rows)
        return
    bounds = [n_rows * i // parts for i in range(parts + 1)]

    def share(lo: int, hi: int) -> None:
        first = 0
        for rows, _, run in jobs:
            start, stop = max(lo - first, 0), min(hi - first, rows)
            if start < stop:
                run(start, stop)
            first += rows
    others = [_pool().submit(share, bounds[i], bounds[i + 1]) for i in range(parts - 1)]
    try:
        share(bounds[-2], bounds[-1])                  # the last share here, not waiting idle
    finally:
        for done in others:
            done.result()                              # every share finished before leaving; re-raises


class CompileClock:
    """The seconds this process has spent compiling (numba's compile events, the outermost of
    nested ones), and whether it is compiling now: the one-time work of a first run, which a
    progress line shows as such instead of folding it into the rate (harness/progress.py)."""

    def __init__(self):
        self._total, self._since, self._depth = 0.0, 0.0, 0
        self._lock = threading.Lock()

    def started(self) -> None:
        with self._lock:
            if self._depth == 0:
                self._since = time.monotonic()
            self._depth += 1

    def ended(self) -> None:
        with self._lock:
            self._depth = max(0, self._depth - 1)
            if self._depth == 0:
                self._total += time.monotonic() - self._since

    def active(self) -> bool:
        return self._depth > 0

    def seconds(self) -> float:
        with self._lock:
            return self._total + (time.monotonic() - self._since if self._depth else 0.0)


_CLOCK: CompileClock | None = None


def compile_clock() -> CompileClock:
    """This process's CompileClock, listening to numba's compile events from the first call on
    (numba imported here: a CPU run imports it anyway)."""
    global _CLOCK
    if _CLOCK is None:
        from numba.core import event

        clock = CompileClock()

        class _Listener(event.Listener):
            def on_start(self, ev):
                clock.started()

            def on_end(self, ev):
                clock.ended()
        event.register("numba:compile", _Listener())
        _CLOCK = clock
    return _CLOCK
