"""Run-time device and dtype selection: CUDA only when asked for or found, never required.

torch is imported where a device or dtype is resolved, not with the module: the names
(DEVICES, DTYPES) are what a configuration is checked against (harness.sweep), and reading
a stored run (`harness report`) needs no torch."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("float32", "float64")   # the torch dtypes of these names


def resolve_device(name: str) -> torch.device:
    """'auto' → cuda when a GPU is visible, else cpu; ValueError for unknown or absent devices."""
    if name not in DEVICES:
        raise ValueError(f"unknown device {name!r}; valid: {', '.join(DEVICES)}")
    import torch
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda was requested but no CUDA GPU is available; valid here: auto, cpu")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; valid: {', '.join(DTYPES)}")
    import torch
    return getattr(torch, name)


def available_memory_bytes(device: torch.device) -> int:
    """Free memory on the device (CUDA) or available RAM (CPU, from /proc/meminfo)."""
    if device.type == "cuda":
        import torch
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30
