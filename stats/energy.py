"""Multivariate energy distance with a permutation p-value, in NumPy (float64).

The statistic is the SQUARED energy distance of the two empirical distributions
(Székely & Rizzo 2004, V-statistic form: the i = j zero pairs are included in the means):

    E(x, y) = 2 mean_ij |x_i − y_j| − mean_ij |x_i − x_j| − mean_ij |y_i − y_j|   (≥ 0)

with |·| the Euclidean norm. scipy.stats.energy_distance (one-dimensional only) returns its
square root: scipy(u, v) = sqrt(E(u, v)). sqrt(E) is a metric on distributions.

Permutation test: the pooled distance matrix D (N × N, N = n_x + n_y) is computed once; a
relabelling is an indicator vector a ∈ {0, 1}^N with n_x ones, and with s = D·1, T = 1ᵀD1:
    S_xx = aᵀDa,  S_xy = aᵀs − S_xx,  S_yy = T − S_xx − 2 S_xy,
so all permutations are one (P × N) @ (N × N) product. p = (1 + #{E_perm ≥ E_obs}) / (1 + P).

Paired samples (x_i, y_i matched trial by trial, e.g. two codecs on the same draws): a
sign-flip test. H0: within each pair the two points are exchangeable (x_i, y_i) ~ (y_i, x_i),
which holds when both configurations behave alike on each draw; a flip s_i = −1 swaps pair i.
Two statistics, each a quadratic form in the signs s ∈ {±1}^n, so all P replicates are again
one (P × n) @ (n × n) product (Good 2005, ch. 3, for the one-sample sign-flip test):
- "pairs": the two-sample statistic E(x, y) of the swapped samples. Swapping pair i or pair j
  alone exchanges the cross and the within distances of the two pairs, so the (i, j) terms
  of E change sign with s_i s_j, and the i = j terms (2|x_i − y_i|) do not change:
      E_s = (1/n²) sᵀ M s,  M_ij = |x_i − y_j| + |y_i − x_j| − |x_i − x_j| − |y_i − y_j|.
  E_s at s = 1 is energy_distance_squared(x, y). It sees any difference of the marginal
  distributions: a shift, and also a change of spread around the same centre.
- "differences": the energy distance of D_i = x_i − y_i from its reflection,
      E(D, −D) = (2/n²) Σ_ij (|D_i + D_j| − |D_i − D_j|),  E_s = (2/n²) sᵀ M s,
      M_ij = |D_i + D_j| − |D_i − D_j|,
  zero iff D's empirical distribution is symmetric about 0 (H0: D symmetric). It is blind
  to a change of spread when the noise is symmetric (x = u + e, y = u + 2e' gives a
  symmetric D), which is why validation uses "pairs".
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from .inference import as_generator
from .margins import ALPHA


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
    test: str = "permutation"  # "permutation" (two samples) or "sign-flip pairs|differences" (paired)

    def to_row(self) -> dict:
        return asdict(self)


def _points(x) -> np.ndarray:
    t = np.asarray(x.detach().cpu().numpy() if hasattr(x, "detach") else x, dtype=np.float64)
    if t.ndim == 1:
        t = t[:, None]
    if t.ndim != 2:
        raise ValueError(f"points must be (n,) or (n, dims), got shape {tuple(t.shape)}")
    if not np.isfinite(t).all():
        raise ValueError("points must be finite (drop NaN/inf rows first)")
    return t


# rows of the first argument per block of _distances (bounds its (rows, n, dims) differences)
_BLOCK_ELEMENTS = 1 << 22


def _distances(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a_i − b_j| for every pair, from the exact differences, not the |a|²+|b|²−2ab product form,
    which loses digits for near points (and gives nonzero self-distances)."""
    out = np.empty((len(a), len(b)))
    step = max(1, _BLOCK_ELEMENTS // max(1, len(b) * a.shape[1]))
    for start in range(0, len(a), step):
        diff = a[start:start + step, None, :] - b[None, :, :]
        out[start:start + step] = np.sqrt(np.einsum("ijk,ijk->ij", diff, diff))
    return out


def _energy_from_sums(s_xx, s_xy, s_yy, n_x: int, n_y: int):
    return 2 * s_xy / (n_x * n_y) - s_xx / n_x ** 2 - s_yy / n_y ** 2


def energy_distance_squared(x, y) -> float:
    """E(x, y) of module doc for points x (n_x, dims), y (n_y, dims) (1-D arrays: dims = 1)."""
    x, y = _points(x), _points(y)
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"x has {x.shape[1]} dimensions, y has {y.shape[1]}")
    pair_sum = lambda a, b: _distances(a, b).sum()
    return float(_energy_from_sums(pair_sum(x, x), pair_sum(x, y), pair_sum(y, y), len(x), len(y)))


def energy_test(x, y, n_permutations: int = 1000, seed: int | np.random.Generator = 0, *,
                standardize: bool = False, alpha: float = ALPHA) -> EnergyResult:
    """Energy-distance two-sample test of x (n_x, dims) vs y (n_y, dims).

    standardize=True divides every coordinate by its pooled standard deviation (a function of
    the pooled sample, so the permutation test stays exact); use it when coordinates have
    different scales. Permutations come from an explicit Generator (seed int or Generator);
    the same seed gives the same p-value."""
    if n_permutations < 1:
        raise ValueError(f"n_permutations {n_permutations!r} must be a positive integer")
    xt, yt = _points(x), _points(y)
    if xt.shape[1] != yt.shape[1]:
        raise ValueError(f"x has {xt.shape[1]} dimensions, y has {yt.shape[1]}")
    n_x, n_y = len(xt), len(yt)
    if n_x < 1 or n_y < 1:
        raise ValueError(f"both samples need points (got {n_x} and {n_y})")
    z = np.concatenate([xt, yt])
    if standardize:
        scale = z.std(axis=0)  # population standard deviation (ddof 0)
        z = z / np.where(scale > 0, scale, 1.0)
    n = n_x + n_y
    dist = _distances(z, z)
    row = dist.sum(axis=1)
    total = row.sum()

    gen = as_generator(seed, "energy-permutation")
    # row p is a uniformly random relabelling: the first n_x entries of a random permutation
    perms = gen.permuted(np.broadcast_to(np.arange(n), (n_permutations + 1, n)).copy(), axis=1)
    labels = (perms < n_x).astype(np.float64)
    labels[0] = np.concatenate([np.ones(n_x), np.zeros(n_y)])  # observed
    s_xx = ((labels @ dist) * labels).sum(axis=1)
    s_xy = labels @ row - s_xx
    s_yy = total - s_xx - 2 * s_xy
    energies = _energy_from_sums(s_xx, s_xy, s_yy, n_x, n_y)
    # tolerance: a relabelling equal to the observed one must count as ≥ despite rounding
    p_value, critical = _permutation_p(energies, 1e-9 * max(abs(float(energies[0])), float(total) / n ** 2), alpha)
    return EnergyResult(float(energies[0]), p_value, critical, alpha, n_x, n_y, n_permutations)


def _permutation_p(energies: np.ndarray, tol: float, alpha: float) -> tuple[float, float]:
    """(p-value, 1 − alpha quantile) from the observed statistic energies[0] and its replicates
    energies[1:]; `tol` makes a replicate equal to the observed one count as ≥ despite rounding."""
    observed, replicates = energies[0], energies[1:]
    p_value = (1 + int(np.count_nonzero(replicates >= observed - tol))) / (1 + len(replicates))
    return p_value, float(np.quantile(replicates, 1 - alpha))


PAIRED_STATISTICS = ("pairs", "differences")


def paired_energy_test(x, y, n_permutations: int = 1000, seed: int | np.random.Generator = 0, *,
                       statistic: str = "pairs", alpha: float = ALPHA) -> EnergyResult:
    """Sign-flip energy test of paired points x (n, dims), y (n, dims), row i of x matched
    with row i of y (module doc): statistic "pairs" (E(x, y) under within-pair swaps) or
    "differences" (E(D, −D), D = x − y); p-value from n_permutations random sign vectors
    drawn from an explicit Generator (seed int or Generator; the same seed gives the same
    p-value). The result has n_x = n_y = n and test "sign-flip <statistic>"."""
    if statistic not in PAIRED_STATISTICS:
        raise ValueError(f"unknown statistic {statistic!r}; valid: {', '.join(PAIRED_STATISTICS)}")
    if n_permutations < 1:
        raise ValueError(f"n_permutations {n_permutations!r} must be a positive integer")
    xt, yt = _points(x), _points(y)
    if xt.shape != yt.shape:
        raise ValueError(f"paired points need equal shapes, got {tuple(xt.shape)} and {tuple(yt.shape)}")
    n = len(xt)
    if n < 1:
        raise ValueError("paired samples need points (got 0 pairs)")
    if statistic == "pairs":
        cross = _distances(xt, yt)
        m = (cross + cross.T - _distances(xt, xt) - _distances(yt, yt)) / n ** 2
        size = float(cross.sum()) / n ** 2  # mean |x_i − y_j|: the size of the entries of M
    else:
        d = xt - yt
        m = 2 * (_distances(d, -d) - _distances(d, d)) / n ** 2
        size = float(np.sqrt((d * d).sum(axis=1)).sum()) / n
    gen = as_generator(seed, "energy-sign-flip")
    signs = np.where(gen.integers(0, 2, size=(n_permutations + 1, n), dtype=np.int8) == 1, 1.0, -1.0)
    signs[0] = 1.0  # observed
    energies = ((signs @ m) * signs).sum(axis=1)
    p_value, critical = _permutation_p(energies, 1e-9 * max(abs(float(energies[0])), size), alpha)
    return EnergyResult(float(energies[0]), p_value, critical, alpha, n, n, n_permutations, f"sign-flip {statistic}")
