"""SpectralQuant's centroid search: the index of the nearest centroid of the unit Gaussian
Lloyd–Max codebook of each element's own width (0–8), for all widths at once. Block w of the
thresholds is shifted by SHIFT·w, an element of width w is looked up as clamp(u) + SHIFT·w, and a
lookup table over that axis (threshold_grid, or threshold_grid_float32 for float32 values) gives
torch.bucketize's count in one gather and one comparison. schemes/spectralquant_cpu.py runs the
same search in its fused pass.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch

from .lloyd_max import gaussian_codebook
from .packing import MAX_BITS

SHIFT = 64.0   # > 2·CLAMP + the largest |threshold| (3.9 at 8 bits): keeps the widths' blocks apart
CLAMP = 30.0


@functools.lru_cache(maxsize=None)
def all_thresholds(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(thresholds of the unit Gaussian codebooks of widths 1..8, block w shifted by SHIFT·w,
    float64; first[w] = the position of block w, (MAX_BITS + 1,) int64)."""
    blocks = [gaussian_codebook(w, 1.0).thresholds + SHIFT * w for w in range(1, MAX_BITS + 1)]
    first = np.concatenate(([0, 0], np.cumsum([len(b) for b in blocks])[:-1]))
    return (torch.tensor(np.concatenate(blocks), dtype=torch.float64, device=device),
            torch.tensor(first, dtype=torch.int64, device=device))


@functools.lru_cache(maxsize=None)
def threshold_grid(device: str) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """A lookup table over the shifted axis of all_thresholds, in cells of 1/per_unit (a power of
    two, fine enough that no cell holds two thresholds): for the cell starting at edge e, the
    final index of a value at e (the number of its block's thresholds below e; 0 in block 0,
    width 0) and the smallest threshold ≥ e (+inf if none in its block). A value y in the cell
    then has index table[c] + (next[c] < y): exactly torch.bucketize's count of the thresholds
    below y, in one gather and one comparison instead of a binary search."""
    thresholds, first = all_thresholds("cpu")
    per_unit = 256
    while True:
        origin = int(-CLAMP * per_unit)
        edges = torch.arange(origin, int((CLAMP + SHIFT * MAX_BITS) * per_unit) + 2, dtype=torch.float64) / per_unit
        below = torch.searchsorted(thresholds, edges)                        # thresholds < edge
        if int((below[1:] - below[:-1]).max()) <= 1:
            break
        per_unit *= 2
    block = torch.div(edges + CLAMP, SHIFT, rounding_mode="floor").to(torch.int64).clamp(0, MAX_BITS)
    table = torch.where(block > 0, below - first[block], torch.zeros_like(below))
    following = torch.cat((thresholds, thresholds.new_tensor([math.inf])))[below]
    following = torch.where(block > 0, following, torch.full_like(following, math.inf))
    return table.to(device), following.to(device), origin, per_unit


@functools.lru_cache(maxsize=None)
def threshold_grid_float32(device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """threshold_grid for float32 values, without leaving float32: (table uint8, last32 float32,
    block_cell (MAX_BITS + 1,) int32, per_unit). A float32 y ∈ [−CLAMP, CLAMP] of width w lies in
    cell c = floor(y·per_unit) + block_cell[w] of the table (per_unit a power of two: exact), and
    has index table[c] + (last32[c] < y), with last32[c] the largest float32 y that the float64
    search does not count past the cell's next threshold T (fl(y + SHIFT·w) ≤ T; found by
    bisection over the float32 values): the very index the float64 search gives, also where
    y + SHIFT·w rounds (|y| below ~1e-13 beside the threshold 0)."""
    table, following, origin, per_unit = threshold_grid("cpu")
    edges = (torch.arange(len(table), dtype=torch.float64) + origin) / per_unit
    shift = (SHIFT * torch.div(edges + CLAMP, SHIFT, rounding_mode="floor").clamp(0, MAX_BITS)).numpy()
    bound = following.numpy()
    top = np.int64(np.array(np.finfo(np.float32).max, np.float32).view(np.int32))

    def value(key):   # float32 of an order-preserving integer key (the bits; negatives mirrored)
        return np.where(key >= 0, key, -key | np.int64(1 << 31)).astype(np.uint32).view(np.float32)
    lo, hi = np.full(bound.shape, -top), np.full(bound.shape, top)     # not counted at lo, counted at hi
    while (hi - lo > 1).any():
        mid = (lo + hi) // 2
        kept = value(mid).astype(np.float64) + shift <= bound
        lo, hi = np.where(kept, mid, lo), np.where(kept, hi, mid)
    last = np.where(np.isfinite(bound), value(lo), np.float32(np.inf))
    block_cell = (SHIFT * per_unit * torch.arange(MAX_BITS + 1) - origin).to(torch.int32)
    return (table.to(device=device, dtype=torch.uint8), torch.from_numpy(last).to(device), block_cell.to(device),
            per_unit)


def nearest_centroids(u: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """Index (uint8) of the nearest centroid of the unit Gaussian Lloyd–Max codebook of each
    element's width (0: index 0), for u (..., d) and widths broadcasting to it: one search for all
    widths, element of width w looked up as clamp(u) + SHIFT·w among the shifted blocks
    (threshold_grid; in float32 throughout for float32 u, threshold_grid_float32, with the
    same result). NaN takes the top index of its width, as a per-width search would."""
    if u.dtype == torch.float32:
        table, following, block_cell, per_unit = threshold_grid_float32(str(u.device))
        y = torch.nan_to_num(u, nan=CLAMP).clamp_(-CLAMP, CLAMP)
        shape = torch.broadcast_shapes(y.shape, widths.shape)
        cell = (torch.mul(y, per_unit).floor_().to(torch.int32) + block_cell[widths]).expand(shape).reshape(-1)
        idx = table.index_select(0, cell)
        idx += following.index_select(0, cell) < y.expand(shape).reshape(-1)
        return idx.view(shape)
    table, following, origin, per_unit = threshold_grid(str(u.device))
    shifted = torch.nan_to_num(u.to(torch.float64), nan=CLAMP).clamp_(-CLAMP, CLAMP) + SHIFT * widths
    cell = (shifted * per_unit).floor_().to(torch.int64).sub_(origin).view(-1)
    # index_select, not table[cell]: 2-3x faster on the CPU for a flat index
    return (table.index_select(0, cell) + (following.index_select(0, cell) < shifted.view(-1))).view(
        shifted.shape).to(torch.uint8)
