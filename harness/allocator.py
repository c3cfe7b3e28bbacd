"""The C allocator's policy for the CPU's large tensors: glibc serves them from its heap and keeps
what is freed, instead of mapping every large temporary afresh.

A codec's encode makes dozens of temporaries of a few MB each per chunk. glibc maps an
allocation above its mmap threshold (128 KiB at start, raised as large blocks are freed, but
reset by heap trimming) on its own, and the kernel zero-fills such a mapping page by page as it
is first touched (a page fault every 4 KiB), then unmaps it when freed. That cost tq-kv's encode,
decode and the metrics about half of their time (d = 128, 16 × 1024 tokens, 2-core CPU, two
alternations: encode 36–51 ms vs 23 ms, decode 15–16 vs 8, metrics 22–24 vs 13). No result
changes; the resident set keeps its high-water mark, which is what the store's peak_mem_mb
reports anyway. Kept light (no torch) so the command line sets it before anything allocates.
"""
from __future__ import annotations

import ctypes
import functools

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3       # glibc mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20    # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit): smaller blocks come from the heap
TRIM_THRESHOLD = 1 << 30     # free heap kept for reuse before any is given back to the system


def worker_environment() -> dict[str, str]:
    """The same policy for a process about to start (glibc reads MALLOC_*_ at start): Dask workers."""
    return {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}


@functools.lru_cache(maxsize=None)
def reuse_freed_memory() -> bool:
    """Set the policy in this process (once); whether the C library took it (glibc only:
    elsewhere, e.g. macOS or musl, nothing changes and False is returned)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt          # the C library the interpreter runs on
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
