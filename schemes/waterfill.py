"""Integer water-filling: the bit allocation of SpectralQuant.

Minimise Σ_k λ_k·4^(−b_k) over integers b_k with Σ_k b_k = B and lo ≤ b_k ≤ hi (AMD paper
§2, "注水法"; 4^(−b) is the high-resolution distortion of a b-bit scalar quantiser, 6 dB per
bit). The objective is separable and each term is convex and decreasing in b_k, so the
marginal gains λ_k·4^(−b)·3/4 of successive bits of one coordinate decrease; for such
problems the greedy rule "give the next bit to the largest marginal gain" is optimal
(Gross 1956; Fox 1966, "Discrete optimization via marginal analysis"). Greedy with R
spare bits therefore picks the R largest gains of the multiset {λ_k·4^(−b) : lo ≤ b < hi},
which is what `waterfill` computes in one batched sort.
"""
from __future__ import annotations

import torch

from .packing import MAX_BITS


def waterfill(weights: torch.Tensor, total_bits: int, min_bits: int, max_bits: int = MAX_BITS) -> torch.Tensor:
    """Integer bit widths (..., d) int64 minimising Σ λ_k 4^(−b_k), Σ b_k = total_bits.

    weights: λ (..., d), non-negative (the calibrated variances of the coordinates).
    Ties (equal gains) go to the lower level first, then to the lower coordinate index, so
    isotropic weights get a uniform allocation whenever total_bits is a multiple of d.
    """
    d = weights.shape[-1]
    if not 0 <= min_bits <= max_bits <= MAX_BITS:
        raise ValueError(f"bit bounds {min_bits}..{max_bits} are not within 0..{MAX_BITS}")
    if not min_bits * d <= total_bits <= max_bits * d:
        raise ValueError(f"total of {total_bits} bits cannot be split over {d} coordinates with "
                         f"{min_bits}..{max_bits} bits each; valid: {min_bits * d}..{max_bits * d}")
    lead = weights.shape[:-1]
    base = torch.full((*lead, d), min_bits, dtype=torch.int64, device=weights.device)
    spare = total_bits - min_bits * d
    if spare == 0:
        return base
    levels = torch.arange(min_bits, max_bits, device=weights.device, dtype=torch.float64)
    lam = weights.to(torch.float64).clamp_min(0)
    # gains[..., level, k]: the gain of raising coordinate k from `level` to level + 1; the
    # level-major flattening makes the stable sort break ties by level, then by coordinate.
    gains = lam.unsqueeze(-2) * torch.pow(4.0, -levels).unsqueeze(-1) * 0.75
    flat = gains.reshape(*lead, -1)
    order = torch.sort(-flat, dim=-1, stable=True).indices[..., :spare]
    chosen = torch.zeros_like(flat, dtype=torch.int64).scatter_(-1, order, 1)
    return base + chosen.reshape(*lead, max_bits - min_bits, d).sum(-2)


def distortion(weights: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """The objective Σ_k λ_k 4^(−b_k) (...,) for weights and widths (..., d)."""
    return (weights.to(torch.float64) * torch.pow(4.0, -widths.to(torch.float64))).sum(-1)
