"""Scoped single-threading of small linear algebra (QR, eigh, SVD of matrices up to a few
hundred rows, in batches).

Why: a multi-threaded LAPACK call on a small matrix spends its time handing work between
threads, and on a shared, oversubscribed machine those hand-offs collapse (measured on the
2-core CPU under load 3: torch QR of a (40, 128, 48) float64 batch 6 ms on one thread, 1.7 s
on two; NumPy's QR of one 128×128 matrix 0.8 ms vs 12–62 ms). Large matmuls keep every
core, so single-threading the whole process is wrong (the paper grid's estimate grew from
100 to 173 min on a quiet machine with every library on one thread); only the small
linear algebra runs on one thread, inside `with small_linalg():` at its call sites.

What it changes: torch's intra-op threads (`torch.set_num_threads(1)`, which also sets MKL's
and OpenMP's) and the BLAS libraries NumPy and SciPy load (OpenBLAS, through threadpoolctl),
restored on exit, exceptions included; nesting is fine. It never sets environment variables
and leaves nothing changed after the block. The thread count is process-wide, so the block
is not meant for several Python threads computing at once (kvharness runs one cell at a
time per process; Dask workers are single-threaded processes).

Results: NumPy's OpenBLAS QR/eigh/SVD give the same bits on one thread as on two. MKL's
LAPACK (torch on the CPU) does not: its QR and eigh differ in the last bits between 1, 2, 3
and 4 threads. So torch's small linear algebra on one thread makes a calibrated codec's rows
independent of the machine's core count (before, they depended on it at rounding level).

`enabled(False)` switches the blocks off (a no-op context), for the bench's comparison and
for tests that compare rows with and without it.
"""
from __future__ import annotations

import contextlib
import functools

import torch

_ENABLED = [True]


@functools.lru_cache(maxsize=None)
def _blas_controller():
    """threadpoolctl's view of the BLAS libraries loaded now (NumPy's and SciPy's OpenBLAS),
    inspected once: a fresh `threadpool_limits` re-scans every loaded library (1.6 ms a
    call), the cached controller's `limit` costs ~40 µs. NumPy and SciPy's linalg are
    imported first so their libraries are in the scan. None without threadpoolctl."""
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:  # pragma: no cover - a declared dependency; degrade to torch only
        return None
    import numpy.linalg  # noqa: F401  (loads NumPy's BLAS)
    import scipy.linalg  # noqa: F401  (loads SciPy's BLAS)
    return ThreadpoolController()


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op threads at n for the block, the previous count restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def small_linalg():
    """Run the block's linear algebra on one thread (torch and NumPy/SciPy BLAS), restoring
    the previous thread counts afterwards. Also usable as a decorator: `@small_linalg()`."""
    if not _ENABLED[0]:
        yield
        return
    controller = _blas_controller()
    limiter = controller.limit(limits=1, user_api="blas") if controller is not None else None
    try:
        with torch_threads(1):
            yield
    finally:
        if limiter is not None:
            limiter.restore_original_limits()


def by_matrix(fn, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """fn(x) for a batch x (..., m, n) of small matrices, run as `small_linalg` runs it — each
    matrix on one thread — but with the batch split into contiguous blocks, one per torch thread
    at the call, computed at once (compiled.by_row_blocks; a block too small to pay for the
    hand-off stays whole). fn takes a (N, m, n) batch and returns a tuple of tensors whose first
    dimension is N, each matrix's results computed from that matrix alone (torch's batched
    LAPACK calls: a loop over the matrices), so the bits are one thread's on the whole batch
    whatever the count and the split (tests/test_threads.py); they come back with x's batch
    dimensions. On a 2-vCPU EPYC, 14-35 float64 covariances: eigh 1.37-1.81x and QR 1.08-1.67x
    one thread on the whole batch (d = 64..256)."""
    from . import compiled
    threads = torch.get_num_threads()
    flat = x.reshape(-1, *x.shape[-2:])
    blocks: dict[int, tuple] = {}

    def run(start: int, stop: int) -> None:
        with torch_threads(1):                           # OpenMP's count is per thread: the pool's too
            blocks[start] = fn(flat[start:stop])
    if _ENABLED[0]:
        with small_linalg():
            compiled.by_row_blocks(flat.shape[0], flat.numel(), run, threads=threads)
    parts = [blocks[start] for start in sorted(blocks)] or [fn(flat)]    # switched off, or empty: fn as torch runs it
    return tuple(torch.cat(out).reshape(*x.shape[:-2], *out[0].shape[1:]) for out in zip(*parts))


@contextlib.contextmanager
def enabled(on: bool):
    """Within the block, `small_linalg()` limits threads (on=True, the default state) or does
    nothing (on=False)."""
    before, _ENABLED[0] = _ENABLED[0], bool(on)
    try:
        yield
    finally:
        _ENABLED[0] = before
