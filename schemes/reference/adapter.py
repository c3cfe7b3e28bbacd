"""The boundary between the runner's torch tensors and the reference's array namespace `xp`.

The reference codecs compute on NumPy (or CuPy, where a GPU and CuPy exist) arrays; the
runner speaks torch. Conversions happen only here, at the edges of encode/decode/score:
inputs become `xp` arrays of the compute dtype (float64 by default), outputs become torch
tensors of the caller's dtype on the caller's device. Stored codes travel inside the torch
`Encoded` container so that the shared bit ledger measures what is really stored.
"""
from __future__ import annotations

import importlib
from types import ModuleType

import numpy as np
import torch

ARRAY_NAMESPACES = ("numpy", "cupy")
COMPUTE_DTYPES = ("float64", "float32")


def resolve_namespace(xp: ModuleType | str | None) -> ModuleType:
    """The array module named by `xp` (None -> numpy); ValueError when it cannot be used here."""
    if xp is None:
        return np
    if isinstance(xp, ModuleType):
        if xp.__name__ not in ARRAY_NAMESPACES:
            raise ValueError(f"array namespace {xp.__name__!r} is not supported; valid: {', '.join(ARRAY_NAMESPACES)}")
        return xp
    if xp not in ARRAY_NAMESPACES:
        raise ValueError(f"unknown array namespace {xp!r}; valid: {', '.join(ARRAY_NAMESPACES)}")
    try:
        return importlib.import_module(xp)
    except ImportError:
        raise ValueError(f"array namespace {xp!r} is not importable here; valid: numpy") from None


def check_compute_dtype(name: str) -> None:
    if name not in COMPUTE_DTYPES:
        raise ValueError(f"unknown compute dtype {name!r}; valid: {', '.join(COMPUTE_DTYPES)}")


def to_array(tensor: torch.Tensor, xp: ModuleType, dtype: str | None = None):
    """A torch tensor as an `xp` array (cast to `dtype` when given). NumPy reads CPU memory
    (copying from a GPU first); CuPy shares device memory through DLPack."""
    tensor = tensor.detach()
    if xp is np:
        array = tensor.cpu().numpy()
    else:
        array = xp.from_dlpack(tensor.contiguous())
    return array if dtype is None else xp.asarray(array, dtype=dtype)


def to_tensor(array, xp: ModuleType, *, dtype: torch.dtype | None = None,
              device: torch.device | str | None = None) -> torch.Tensor:
    """An `xp` array as a torch tensor, cast to `dtype` and moved to `device` when given."""
    if xp is np:
        tensor = torch.from_numpy(np.ascontiguousarray(array))
    else:
        tensor = torch.from_dlpack(xp.ascontiguousarray(array))
    return tensor.to(dtype=dtype or tensor.dtype, device=device or tensor.device)
