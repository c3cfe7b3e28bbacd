"""Scalar quantisation to uint8 codes at the same speed for every width 1–8: an exact
replacement for `torch.bucketize` on fixed thresholds, and decoding by byte tables.

`torch.bucketize` searches every element's cell by bisection, about 50 ns an element on the
2-core CPU, more than the rest of TurboQuant's encode together, and returns int64. Here the
thresholds t (ascending, in the data's dtype) are fixed per codebook, so a grid over them is
built once (`_Grid`): cells of width h, a power of two no larger than the smallest gap, so that
a cell holds at most one threshold. An element y, clamped to [lo, hi] (multiples of h strictly
outside the thresholds, so the count below it does not change), lies in cell
c = floor(y/h) − lo/h, computed without rounding (a power-of-two scale, a floor and an integer
subtraction), and

    #{j : t_j < y} = first[c] + [cand[c] < y],

with first[c] the count below the cell's left edge and cand[c] the threshold inside it (+inf if
none): the comparison `bucketize(y, t)` (right=False) makes, so the same index for every y,
including ±inf and NaN (NaN as +inf: the top index, as bucketize gives it). A codebook whose
thresholds no such grid of at most ~64 k cells separates (two equal thresholds, or gaps under
span/65536) falls back to bucketize.

Decoding a width that divides 8 looks up whole bytes: a (256, 8/width) table of centroids
turns each stored byte into its 8/width values in one `index_select` (no per-code indices);
other widths unpack to uint8 codes and look up the centroids with int32 indices.

On the CPU in float32/float64 (every harness run there) both directions are one compiled pass
over each row instead (schemes/scalar_quantizer_cpu.py): the same grid, comparison and byte layout, so the
same bits; the torch passes here serve the other devices and dtypes and check those loops.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from kvcommon import compiled
from .packing import pack_bits, packed_size, unpack_codes


@dataclass(frozen=True)
class _Grid:
    lo: float              # left edge of cell 0 and the clamp's lower bound (a multiple of h)
    hi: float              # left edge of the last cell and the clamp's upper bound
    inv_h: float           # 1 / cell width, a power of two
    origin: float          # lo · inv_h, an integer
    first: torch.Tensor    # (n_cells,) uint8: thresholds below the cell's left edge
    cand: torch.Tensor     # (n_cells,) the threshold inside the cell (+inf if none), data's dtype


@functools.lru_cache(maxsize=None)
def _grid(thresholds: tuple[float, ...], dtype: torch.dtype, device: str) -> _Grid:
    t = torch.tensor(thresholds, dtype=torch.float64).to(dtype)       # the very values bucketize compares
    if t.numel() > 255:
        raise ValueError(f"{t.numel()} thresholds do not fit uint8 codes (at most 255)")
    values = t.to(torch.float64).numpy()
    gaps = np.diff(values)
    gaps = gaps[gaps > 0]
    span = float(values[-1] - values[0])
    h = float(gaps.min()) if gaps.size else max(span, 1.0)
    h = 2.0 ** math.floor(math.log2(max(h, span / 65536, 2.0 ** -60)))  # ≤ the smallest gap, ~64 k cells at most
    lo = (math.floor(values[0] / h) - 1) * h                           # strictly below every threshold
    hi = (math.floor(values[-1] / h) + 1) * h                          # strictly above every threshold
    n_cells = int(round((hi - lo) / h)) + 1
    edges = lo + h * np.arange(n_cells, dtype=np.float64)
    first = np.searchsorted(values, edges, side="left")               # #{t < edge}
    inside = np.searchsorted(values, edges + h, side="left") - first   # thresholds in [edge, edge + h)
    if int(inside.max()) > 1:   # equal or too close thresholds: the slow exact search
        raise _Unsupported
    cand = np.where(inside == 1, values[np.minimum(first, len(values) - 1)], np.inf)
    return _Grid(lo, hi, 1.0 / h, lo / h, torch.tensor(first, dtype=torch.uint8, device=device),
                 torch.tensor(cand, dtype=torch.float64).to(dtype=dtype, device=device))


class _Unsupported(Exception):
    """Thresholds the grid cannot hold one to a cell (equal, or closer than span/65536)."""


def quantize(y: torch.Tensor, thresholds: np.ndarray) -> torch.Tensor:
    """uint8 codes #{j : t_j < y} (= torch.bucketize(y, t) with t the thresholds in y's dtype)
    for y (...), thresholds ascending (at most 255 of them)."""
    try:
        g = _grid(tuple(float(x) for x in thresholds), y.dtype, str(y.device))
    except _Unsupported:
        t = torch.tensor(np.asarray(thresholds, dtype=np.float64)).to(dtype=y.dtype, device=y.device)
        return torch.bucketize(y, t).to(torch.uint8)
    # NaN and ±inf to the clamp's bounds (NaN: the top index, as bucketize gives it); the clamped
    # value scaled by a power of two and floored is the exact cell: no rounding anywhere
    flat = torch.nan_to_num(y.reshape(-1), nan=g.hi, posinf=g.hi, neginf=g.lo).clamp_(g.lo, g.hi)
    cell = torch.mul(flat, g.inv_h).floor_().sub_(g.origin).to(torch.int32)
    codes = g.first.index_select(0, cell)
    codes += g.cand.index_select(0, cell) < flat
    return codes.reshape(y.shape)


@functools.lru_cache(maxsize=64)
def _byte_codes(width: int, device: str) -> torch.Tensor:
    """(256, 8 // width) int32: the codes a byte holds, the first in its most significant bits."""
    per_byte = 8 // width
    byte = torch.arange(256, dtype=torch.int32).unsqueeze(-1)
    shifts = 8 - width * torch.arange(1, per_byte + 1, dtype=torch.int32)
    return ((byte >> shifts) & ((1 << width) - 1)).to(device)


def dequantize_packed(packed: torch.Tensor, centroids: torch.Tensor, width: int, n: int) -> torch.Tensor:
    """Centroid values (..., n) of the codes packed by packing.pack_bits (..., bytes), in the
    centroids' dtype and device; the same values as centroids[unpack_bits(packed, width, n)]."""
    if packed.device.type == "cpu" and compiled.takes(centroids):
        from . import scalar_quantizer_cpu
        return scalar_quantizer_cpu.dequantize_packed(packed, centroids, width, n)
    lead = packed.shape[:-1]
    if 8 % width == 0:
        table = centroids[_byte_codes(width, str(centroids.device))]     # (256, 8 // width)
        need = -(-n // (8 // width))
        values = table.index_select(0, packed[..., :need].reshape(-1).to(torch.int32))
        return values.reshape(*lead, need * (8 // width))[..., :n]
    codes = unpack_codes(packed, width, n)
    return centroids.index_select(0, codes.reshape(-1).to(torch.int32)).reshape(*lead, n)


def cpu_grid(thresholds: np.ndarray, dtype: torch.dtype, count_max: int | None = None) -> _Grid | None:
    """The grid the CPU loops code by for these thresholds (ascending) in dtype, or None where
    they count the thresholds instead: at most count_max of them (default
    scalar_quantizer_cpu.COUNT_MAX_THRESHOLDS: counting is faster), or thresholds no grid holds one to a cell, or whose bounds dtype does not hold exactly (thresholds
    far from 0 for their spacing; never for a codebook on [-1, 1])."""
    from . import scalar_quantizer_cpu
    if len(thresholds) <= (scalar_quantizer_cpu.COUNT_MAX_THRESHOLDS if count_max is None else count_max):
        return None
    try:
        g = _grid(tuple(float(x) for x in thresholds), dtype, "cpu")
    except _Unsupported:
        return None
    kind = torch.empty(0, dtype=dtype).numpy().dtype.type      # the loops compute the cells in dtype:
    held = all(float(kind(v)) == v for v in (g.lo, g.hi, g.inv_h, g.origin))   # bounds it holds exactly
    return g if held else None


def quantize_pack(y: torch.Tensor, thresholds: np.ndarray, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 (..., packed_size(d, width)), codes uint8 (..., d)) of y (..., d)."""
    if compiled.takes(y):
        from . import scalar_quantizer_cpu
        n_bytes = packed_size(y.shape[-1], width)
        g = cpu_grid(thresholds, y.dtype)
        if g is None:
            t = torch.tensor(np.asarray(thresholds, dtype=np.float64)).to(y.dtype)
            return scalar_quantizer_cpu.count_pack(y, t, width, n_bytes)
        return scalar_quantizer_cpu.grid_pack(y, g.lo, g.hi, g.inv_h, g.origin, g.first, g.cand, width, n_bytes)
    codes = quantize(y, thresholds)
    return pack_bits(codes, width), codes
