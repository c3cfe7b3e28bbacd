"""Multivariate energy distance with a permutation p-value, in torch (CPU or GPU).

The statistic is the SQUARED energy distance of the two empirical distributions
(Székely & Rizzo 2004, V-statistic form: the i = j zero pairs are included in the means):

    E(x, y) = 2 mean_ij |x_i − y_j| − mean_ij |x_i − x_j| − mean_ij |y_i − y_j|   (≥ 0)

with |·| the Euclidean norm. scipy.stats.energy_distance (one-dimensional only) returns its
square root: scipy(u, v) = sqrt(E(u, v)). sqrt(E) is a metric on distributions.

Permutation test: the pooled distance matrix D (N × N, N = n_x + n_y) is computed once; a
relabelling is an indicator vector a ∈ {0, 1}^N with n_x ones, and with s = D·1, T = 1ᵀD1:
    S_xx = aᵀDa,  S_xy = aᵀs − S_xx,  S_yy = T − S_xx − 2 S_xy,
so all permutations are one (P × N) @ (N × N) product. p = (1 + #{E_perm ≥ E_obs}) / (1 + P).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

from .inference import as_generator


@dataclass(frozen=True)
class EnergyResult:
    """statistic: squared energy distance E (V-statistic); p_value: permutation p-value;
    critical: the (1 − alpha) quantile of the permutation distribution of E."""
    statistic: float
    p_value: float
    critical: float
    alpha: float
    n_x: int
    n_y: int
    n_permutations: int

    def to_row(self) -> dict:
        return asdict(self)


def _points(x, device, dtype) -> torch.Tensor:
    t = torch.as_tensor(np.asarray(x, dtype=np.float64) if not isinstance(x, torch.Tensor) else x)
    t = t.to(device=device, dtype=dtype)
    if t.ndim == 1:
        t = t[:, None]
    if t.ndim != 2:
        raise ValueError(f"points must be (n,) or (n, dims), got shape {tuple(t.shape)}")
    if not torch.isfinite(t).all():
        raise ValueError("points must be finite (drop NaN/inf rows first)")
    return t


def _energy_from_sums(s_xx, s_xy, s_yy, n_x: int, n_y: int):
    return 2 * s_xy / (n_x * n_y) - s_xx / n_x ** 2 - s_yy / n_y ** 2


def energy_distance_squared(x, y) -> float:
    """E(x, y) of module doc for points x (n_x, dims), y (n_y, dims) (1-D arrays: dims = 1)."""
    x, y = _points(x, "cpu", torch.float64), _points(y, "cpu", torch.float64)
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"x has {x.shape[1]} dimensions, y has {y.shape[1]}")
    def pair_sum(a, b):
        return torch.cdist(a, b, compute_mode="donot_use_mm_for_euclid_dist").sum()
    return float(_energy_from_sums(pair_sum(x, x), pair_sum(x, y), pair_sum(y, y), len(x), len(y)))


def energy_test(x, y, n_permutations: int = 1000, seed: int | np.random.Generator = 0, *,
                standardize: bool = False, alpha: float = 0.05, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float64) -> EnergyResult:
    """Energy-distance two-sample test of x (n_x, dims) vs y (n_y, dims).

    standardize=True divides every coordinate by its pooled standard deviation (a function of
    the pooled sample, so the permutation test stays exact); use it when coordinates have
    different scales. Permutations come from an explicit Generator (seed int or Generator);
    the same seed gives the same p-value on any device."""
    if n_permutations < 1:
        raise ValueError(f"n_permutations {n_permutations!r} must be a positive integer")
    xt, yt = _points(x, device, dtype), _points(y, device, dtype)
    if xt.shape[1] != yt.shape[1]:
        raise ValueError(f"x has {xt.shape[1]} dimensions, y has {yt.shape[1]}")
    n_x, n_y = len(xt), len(yt)
    if n_x < 1 or n_y < 1:
        raise ValueError(f"both samples need points (got {n_x} and {n_y})")
    z = torch.cat([xt, yt])
    if standardize:
        scale = z.std(dim=0, correction=0)  # population standard deviation (ddof 0)
        z = z / torch.where(scale > 0, scale, torch.ones_like(scale))
    n = n_x + n_y
    # the exact pairwise differences, not the |a|²+|b|²−2ab matmul form, which loses digits for
    # near points (and gives nonzero self-distances)
    dist = torch.cdist(z, z, compute_mode="donot_use_mm_for_euclid_dist")
    row = dist.sum(dim=1)
    total = row.sum()

    gen = as_generator(seed, "energy-permutation")
    # row p is a uniformly random relabelling: the first n_x entries of a random permutation
    perms = gen.permuted(np.broadcast_to(np.arange(n), (n_permutations + 1, n)).copy(), axis=1)
    labels = torch.from_numpy(perms < n_x).to(device=device, dtype=dtype)
    labels[0] = torch.cat([torch.ones(n_x), torch.zeros(n_y)]).to(device=device, dtype=dtype)  # observed
    ad = labels @ dist
    s_xx = (ad * labels).sum(dim=1)
    s_xy = labels @ row - s_xx
    s_yy = total - s_xx - 2 * s_xy
    energies = _energy_from_sums(s_xx, s_xy, s_yy, n_x, n_y).cpu().numpy()
    observed, permuted = float(energies[0]), energies[1:]
    # tolerance: a relabelling equal to the observed one must count as ≥ despite rounding
    tol = 1e-9 * max(abs(observed), float(total.cpu()) / n ** 2)
    p_value = (1 + int(np.count_nonzero(permuted >= observed - tol))) / (1 + n_permutations)
    critical = float(np.quantile(permuted, 1 - alpha))
    return EnergyResult(observed, p_value, critical, alpha, n_x, n_y, n_permutations)
