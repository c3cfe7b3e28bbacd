"""Wall times of calls for the benchmarks (harness/bench.py, harness/bandwidth.py), the GPU's
queued work included: a CUDA call returns before its kernels finish, so a timing that does not
wait for them measures the launches, not the work."""
from __future__ import annotations

import time

import torch


def sync(device: torch.device | None = None) -> None:
    """Wait for the GPU's queued work: on `device` where given (a CUDA one), else on the current
    device where torch has started CUDA."""
    if device is not None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    elif torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed(fn, device: torch.device | None = None) -> float:
    """Wall time (s) of one call, the GPU's work included."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def samples(fn, repeats: int, device: torch.device | None = None) -> list[float]:
    """Wall times (s) of `repeats` calls after one warm-up call."""
    fn()
    return [timed(fn, device) for _ in range(repeats)]
