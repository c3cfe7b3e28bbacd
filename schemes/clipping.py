"""Symmetric uniform quantisation of coefficients with an MSE-optimal clipping step per
component (Shard's PCA coefficients)."""
from __future__ import annotations

import torch


def symmetric_levels(width: int) -> int:
    """Largest magnitude of a symmetric `width`-bit code: 2^(w−1) − 1 (7 at 4 bits)."""
    return (1 << (width - 1)) - 1 if width else 0


CLIP_GRID = tuple(i / 20 for i in range(2, 21))   # step = f·max|c|/L, f in 0.1..1


def quantize_symmetric(coeff: torch.Tensor, scale: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Signed codes round(c/scale) clipped to [−L, L]: coeff (B, n, r), scale and levels (B, r)."""
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    signed = torch.round(coeff / safe[:, None, :])
    return torch.maximum(torch.minimum(signed, levels[:, None, :]), -levels[:, None, :])


def coefficient_scales(coeff: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Per-component fp16 step (B, r) of the symmetric quantiser with levels L (B, r): the step
    f·max|c|/L with the smallest squared error over f in CLIP_GRID. Max-abs scaling (f = 1)
    wastes the few levels of a 2- or 4-bit code on the tails (at 2 bits, levels {−1, 0, 1}, its
    error exceeds the coefficient's variance); clipping at the MSE optimum is the usual fix
    (e.g. Banner et al., ACIQ, arXiv 1810.05723). Levels 0 (dropped) give step 0."""
    peak = coeff.abs().amax(1)
    best_scale = torch.zeros_like(peak).half()
    best_err = torch.full_like(peak, float("inf"))
    for f in CLIP_GRID:
        scale = (peak * f / levels.clamp(min=1)).half()
        step = scale.to(coeff.dtype)
        err = ((coeff - quantize_symmetric(coeff, step, levels) * step[:, None, :]) ** 2).sum(1)
        better = err < best_err
        best_scale = torch.where(better, scale, best_scale)
        best_err = torch.where(better, err, best_err)
    return torch.where(levels > 0, best_scale, torch.zeros_like(best_scale))
