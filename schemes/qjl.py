"""1-bit QJL residual sketches (Zandieh et al., arXiv 2406.03482; TurboQuant_prod, arXiv 2504.19874).

A sketch of a residual e ∈ R^d is sign(P e) with P an m×d matrix of unit-variance entries
(m = d here). For Gaussian P, E[⟨P q, sign(P e)⟩] = m·√(2/π)·⟨q, e⟩/‖e‖, so

    ⟨q, e⟩ ≈ √(π/2)/m · ‖e‖ · ⟨P q, sign(P e)⟩                       (QJL Lemma 3.2)

is unbiased; equivalently the reconstruction correction is Δ = √(π/2)/m · ‖e‖ · Pᵀ sign(P e).
Two projections:
- "rht": P = H·diag(s) with H the ±1 Walsh–Hadamard matrix and s random signs, applied in
  O(d log d) (the AMD paper's RHT sketch, Δ = √(π/2)/d · ‖e‖ · s ⊙ WHT(b));
- "full": P a dense Rademacher ±1 matrix (the paper's FULL variants).
Neither is Gaussian, so unbiasedness holds only approximately (the CLT over d entries); the
tests measure how close.
"""
from __future__ import annotations

import math

import torch

from .hadamard import rht, rht_inverse

PROJECTIONS = ("rht", "full")


def project(x: torch.Tensor, kind: str, proj: torch.Tensor) -> torch.Tensor:
    """P x for x (B, H, n, d). proj: signs (..., H, d) for "rht", the matrix (..., H, m, d) for
    "full", one per head (and per trial with a leading B), broadcast over the n vectors."""
    if kind == "rht":
        return rht(x, proj.unsqueeze(-2), mult=math.sqrt(x.shape[-1]))       # √d·H/√d = the ±1 H
    return x @ proj.transpose(-1, -2)


def project_transpose(y: torch.Tensor, kind: str, proj: torch.Tensor) -> torch.Tensor:
    """Pᵀ y for y (B, H, n, m), proj as in `project`."""
    if kind == "rht":
        return rht_inverse(y, proj.unsqueeze(-2), mult=math.sqrt(y.shape[-1]))
    return y @ proj


def sketch_scale(m: int) -> float:
    """√(π/2)/m, the QJL estimator's constant."""
    return math.sqrt(math.pi / 2) / m
