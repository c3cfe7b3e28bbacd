"""Scalar quantisation to uint8 codes at the same speed for every width 1–8: an exact
replacement for `torch.bucketize` on fixed thresholds, and decoding by byte tables.

`torch.bucketize` searches every element's cell by bisection, about 50 ns an element on the
2-core CPU, more than the rest of TurboQuant's encode together, and returns int64. Here the
thresholds t (ascending, in the data's dtype) are fixed per codebook, so a uniform grid over
them is built once (`_Grid`): cell width h = half the smallest gap, so that any three
neighbouring cells hold at most W (≤ 2 in practice) thresholds. For an element y in computed
cell c (c may be off by one from the exact floor((y − lo)/h) through rounding, which the
tables allow for), every threshold below the lower edge of cell c − 1 is below y and every
threshold above the upper edge of cell c + 1 is above it, so

    #{j : t_j < y} = first[c] + Σ_w [cand[c, w] < y],

with first[c] that count below and cand[c, ·] the ≤ W thresholds in between (+inf padding):
the same comparisons `bucketize(y, t)` (right=False) makes, so the same index, for every y
including ±inf and NaN (treated as +inf: the top index, as bucketize gives it).

Decoding a width that divides 8 looks up whole bytes: a (256, 8/width) table of centroids
turns each stored byte into its 8/width values in one `index_select` (no per-code indices);
other widths unpack to uint8 codes and look up the centroids with int32 indices.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from .packing import pack_bits, unpack_codes


@dataclass(frozen=True)
class _Grid:
    lo: float              # left edge of cell 0
    inv_h: float           # 1 / cell width
    n_cells: int
    first: torch.Tensor    # (n_cells,) uint8: thresholds surely below any y of the cell
    cand: tuple[torch.Tensor, ...]   # W tables (n_cells,): thresholds to compare with (+inf padded), data's dtype


@functools.lru_cache(maxsize=None)
def _grid(thresholds: tuple[float, ...], dtype: torch.dtype, device: str) -> _Grid:
    t = torch.tensor(thresholds, dtype=torch.float64).to(dtype)       # the very values bucketize compares
    if t.numel() > 255:
        raise ValueError(f"{t.numel()} thresholds do not fit uint8 codes (at most 255)")
    values = t.to(torch.float64).numpy()
    gaps = np.diff(values)
    gaps = gaps[gaps > 0]
    span = float(values[-1] - values[0])
    h = float(gaps.min()) / 2 if gaps.size else max(span, 1.0)
    h = max(h, span / 65536, np.finfo(np.float64).tiny)                # at most ~64 k cells
    n_cells = int(math.ceil(span / h)) + 5
    lo = float(values[0]) - 2 * h
    edges = lo + h * np.arange(n_cells + 1, dtype=np.float64)
    lower = np.concatenate(([-np.inf], edges[:n_cells - 1]))           # lower edge of cell c − 1
    upper = np.concatenate((edges[2:], [np.inf]))                      # upper edge of cell c + 1
    first = np.searchsorted(values, lower, side="left")               # #{t < lower}
    last = np.searchsorted(values, upper, side="left")                # #{t < upper}
    width = max(int((last - first).max()), 1)
    cand = np.full((n_cells, width), np.inf)
    for w in range(width):
        j = first + w
        ok = j < last
        cand[ok, w] = values[j[ok]]
    return _Grid(lo, 1.0 / h, n_cells, torch.tensor(first, dtype=torch.uint8, device=device),
                 tuple(torch.tensor(cand[:, w], dtype=torch.float64).to(dtype=dtype, device=device)
                       for w in range(width)))


def quantize(y: torch.Tensor, thresholds: np.ndarray) -> torch.Tensor:
    """uint8 codes #{j : t_j < y} (= torch.bucketize(y, t) with t the thresholds in y's dtype)
    for y (...), thresholds ascending (at most 255 of them)."""
    g = _grid(tuple(float(x) for x in thresholds), y.dtype, str(y.device))
    flat = torch.nan_to_num(y.reshape(-1), nan=math.inf, posinf=math.inf, neginf=-math.inf)
    # any rounding of the cell position is fine (the tables allow ±1 cell): in place
    cell = torch.mul(flat, g.inv_h).sub_(g.lo * g.inv_h).clamp_(0, g.n_cells - 1).to(torch.int32)
    codes = g.first.index_select(0, cell)
    for cand in g.cand:      # W one-dimensional lookups: a (N, W) gather and sum cost 5x more
        codes += cand.index_select(0, cell) < flat
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
    lead = packed.shape[:-1]
    if 8 % width == 0:
        table = centroids[_byte_codes(width, str(centroids.device))]     # (256, 8 // width)
        need = -(-n // (8 // width))
        values = table.index_select(0, packed[..., :need].reshape(-1).to(torch.int32))
        return values.reshape(*lead, need * (8 // width))[..., :n]
    codes = unpack_codes(packed, width, n)
    return centroids.index_select(0, codes.reshape(-1).to(torch.int32)).reshape(*lead, n)


def quantize_pack(y: torch.Tensor, thresholds: np.ndarray, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 (..., packed_size(d, width)), codes uint8 (..., d)) of y (..., d)."""
    codes = quantize(y, thresholds)
    return pack_bits(codes, width), codes
