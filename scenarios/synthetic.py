"""The six synthetic scenarios of DESIGN.md, each isolating one codec assumption.

A1: sub-Gaussian calibration data; A2: K and V share a subspace; A3: eigenvalue decay
strong enough for water-filling. Every population is scaled so that E‖k‖² ≈ d, which fixes
the logit scale through the query temperature.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import register
from .base import Population, Scenario, power_law, random_orthonormal


@register
@dataclass(frozen=True)
class Gaussian(Scenario):
    """Isotropic N(0, I_d) keys and values: every assumption holds trivially."""
    name = "gaussian"
    description = "isotropic Gaussian K and V: the data-independent optimum"

    def population(self, gen, dim):
        return Population(np.eye(dim), np.eye(dim))


@dataclass(frozen=True)
class _PowerLaw(Scenario):
    """Covariance U diag(λ) Uᵀ with λ_i ∝ i^−alpha (sum d) and a Haar-random basis U per head,
    drawn independently for K and V."""
    alpha: float = 1.0

    def population(self, gen, dim):
        root = np.sqrt(power_law(dim, self.alpha))
        return Population(random_orthonormal(gen, dim, dim) * root, random_orthonormal(gen, dim, dim) * root)


@register
@dataclass(frozen=True)
class HeavyTail(_PowerLaw):
    """As spectral_decay (same alpha), but the latent coordinates are Student-t with `dof` degrees of freedom
    (scaled to unit variance). With dof ≤ 4 the fourth moment is infinite, so the 512-token
    calibration covariance is dominated by a few outlier tokens and its eigenvectors stray
    from the population ones: breaks A1."""
    name = "heavy_tail"
    description = "Student-t latent entries (dof 3) under a power-law covariance: breaks A1"
    dof: float = 3.0

    def validate(self):
        super().validate()
        if self.dof <= 2:
            raise ValueError(f"scenario heavy_tail: dof={self.dof} must exceed 2 (finite variance) and be finite")

    def latent(self, gen, shape):
        return gen.standard_t(self.dof, shape) * np.sqrt((self.dof - 2) / self.dof)


@register
@dataclass(frozen=True)
class LowRankAligned(Scenario):
    """K and V in one shared rank-r subspace plus isotropic noise: x = √(d/r)·U z + noise·ε.
    The rank is min(rank, d/2); A2 and A3 hold.

    basis="axes" (default) spans r coordinate channels chosen at random per head, so each
    token's energy sits on few coordinates — what makes a codebook without rotation
    (plain-kv) degrade as d grows (AMD paper, Fig. 1); basis="haar" draws a random
    orthonormal U, whose coordinates are already spread."""
    name = "lowrank_aligned"
    description = "K and V in one shared rank-r subspace plus noise: A2 and A3 hold"
    rank: int = 8
    noise: float = 0.1
    basis: str = "axes"

    def validate(self):
        super().validate()
        if self.basis not in ("axes", "haar"):
            raise ValueError(f"scenario {self.name}: basis={self.basis!r}; valid: axes, haar")

    def effective_rank(self, dim: int) -> int:
        return max(1, min(self.rank, dim // 2))

    def frame(self, gen, dim: int, n_columns: int) -> np.ndarray:
        """(dim, n_columns) orthonormal columns: coordinate axes or Haar-random."""
        if self.basis == "haar":
            return random_orthonormal(gen, dim, n_columns)
        return np.eye(dim)[:, gen.choice(dim, size=n_columns, replace=False)]

    def _mix(self, basis: np.ndarray, dim: int) -> np.ndarray:
        r = basis.shape[1]
        return np.hstack((basis * np.sqrt(dim / r), self.noise * np.eye(dim)))

    def population(self, gen, dim):
        mix = self._mix(self.frame(gen, dim, self.effective_rank(dim)), dim)
        return Population(mix, mix)


@register
@dataclass(frozen=True)
class LowRankMisaligned(LowRankAligned):
    """K and V each in a rank-r subspace plus noise, the two subspaces mutually orthogonal
    (drawn as one d×2r frame and split, axes or Haar as for lowrank_aligned): breaks A2."""
    name = "lowrank_misaligned"
    description = "K and V in orthogonal rank-r subspaces plus noise: breaks A2"

    def population(self, gen, dim):
        r = self.effective_rank(dim)
        frame = self.frame(gen, dim, 2 * r)
        return Population(self._mix(frame[:, :r], dim), self._mix(frame[:, r:], dim))


@register
@dataclass(frozen=True)
class SpectralDecay(_PowerLaw):
    """Power-law spectrum with Gaussian latents: alpha sweeps A3, d_eff = (Σλ)²/Σλ² falls as
    alpha grows."""
    name = "spectral_decay"
    description = "power-law eigenvalues λ_i ∝ i^-α in a random basis: sweeps A3"


@register
@dataclass(frozen=True)
class OutlierChannels(Scenario):
    """Gaussian keys whose `n_outliers` channels (random per head) have `outlier_scale` times
    the standard deviation of the others, as in real LLM keys; values isotropic. Keys are
    rescaled so E‖k‖² = d."""
    name = "outlier_channels"
    description = "a few key channels with large magnitude, as in real LLM keys"
    n_outliers: int = 4
    outlier_scale: float = 10.0

    def population(self, gen, dim):
        n_out = min(self.n_outliers, dim)
        scales = np.ones(dim)
        scales[gen.choice(dim, size=n_out, replace=False)] = self.outlier_scale
        scales *= np.sqrt(dim / np.square(scales).sum())
        return Population(np.diag(scales), np.eye(dim))

