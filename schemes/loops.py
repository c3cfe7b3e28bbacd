"""The gate to the compiled CPU loops (schemes/cpu_loops.py): whether they take a computation's
floating-point tensor, and the module itself, imported on first use (numba's import costs most
of a second, and a run on CUDA never needs it)."""
from __future__ import annotations

import torch


def taking(t: torch.Tensor):
    """schemes.cpu_loops when its loops take t — on the CPU, in a dtype they read in place
    (cpu_loops.SUPPORTED, which tests empty to route around them) — else None."""
    if t.device.type != "cpu" or t.dtype not in (torch.float32, torch.float64):
        return None
    from . import cpu_loops
    return cpu_loops if t.dtype in cpu_loops.SUPPORTED else None
