"""Peak memory of a stretch of work: resident set on the CPU (Linux VmHWM, reset through
/proc/self/clear_refs), allocator peak on CUDA.

glibc's allocator is left at its defaults on purpose: keeping freed heap for reuse (mallopt's
trim and mmap thresholds) made tq-kv's encode up to 2x faster, but then the resident set never
falls and every cell's peak reads as the largest so far; giving the heap back before each cell
(malloc_trim) restored the per-cell peak at a cost above the gain (README, Speed)."""
from __future__ import annotations

import torch

_STATUS, _CLEAR = "/proc/self/status", "/proc/self/clear_refs"


def _vm_hwm_bytes() -> int | None:
    try:
        with open(_STATUS) as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open(_CLEAR, "w") as f:
            f.write("5")  # Linux: reset the peak resident set size (VmHWM) to the current RSS
    except OSError:
        pass


def peak_bytes(device: torch.device) -> int | None:
    """Peak since the last reset_peak (process RSS on CPU, tensors allocated on CUDA); None if unknown."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return _vm_hwm_bytes()
