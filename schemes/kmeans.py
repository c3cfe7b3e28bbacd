"""Batched k-means (Lloyd 1982) with k-means++ or random initialisation, in torch.

points: (B, N, g) — B independent problems (trials) of N points in R^g; centroids (B, k, g).
Every random choice is drawn once from an explicit NumPy generator and used identically for
each of the B problems, so a problem's result depends only on its own points and the seed,
never on which other problems share the batch. k-means++ seeding: Arthur & Vassilvitskii
(2007), each new centre drawn with probability ∝ D(x)², by inverse-CDF on one shared uniform.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvcommon import compiled

INITS = ("k-means++", "random")
_CHUNK_ELEMENTS = 1 << 20  # distance-matrix entries per chunk (4 MiB of float32: stays in cache)
# Up to this point dimension the CPU's assignment forms each point's products in cache instead of
# by matmul (kmeans_cpu.nearest_points): a matmul with so short an inner dimension is all output
# traffic. Shard's V points (g = 4), B = 17 trials of 32,768 points, 256 centroids: 87-104 ms vs
# 318-390 ms for the matmul and the compiled minimum (2-core AMD EPYC, one run, three repeats).
_FUSED_MAX_DIM = 16
# Up to this point dimension torch sums a point's squared differences in order, which the CPU's
# compiled k-means++ seeding reproduces (kmeans_cpu.kmeans_pp_picks; tests)
_SEEDING_MAX_DIM = 4


def compiled_loops(points: torch.Tensor):
    """schemes.kmeans_cpu when its compiled loops take points (compiled.takes), else None (tests
    replace it to run the torch passes)."""
    if not compiled.takes(points):
        return None
    from . import kmeans_cpu
    return kmeans_cpu


@dataclass(frozen=True)
class KMeansResult:
    """centroids (B, k, g); objective: per-iteration mean squared distance (B, n_steps),
    the first column after initialisation, non-increasing along each row."""
    centroids: torch.Tensor
    objective: torch.Tensor


def assign(points: torch.Tensor, centroids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest centroid of every point: indices (B, N) int64 and squared distances (B, N).

    The argmin uses ‖x‖² − 2x·c + ‖c‖² (per point in cache for small g on the CPU, else by matmul
    in chunks of points); the returned distance is recomputed
    exactly as ‖x − c‖² for the chosen centroid.
    """
    b, n, g = points.shape
    k = centroids.shape[1]
    c_sq = (centroids ** 2).sum(-1)                                   # (B, k)
    indices = torch.empty(b, n, dtype=torch.int64, device=points.device)
    loops = compiled_loops(points)
    if loops is not None and g <= _FUSED_MAX_DIM and centroids.dtype == points.dtype:
        # the same products and indices, each point's in cache (schemes/kmeans_cpu.py)
        loops.nearest_points(points, centroids, c_sq, indices)
    else:
        step = max(1, _CHUNK_ELEMENTS // max(1, b * k))
        for start in range(0, n, step):
            xc = points[:, start:start + step] @ centroids.transpose(1, 2)
            if loops is not None:   # the same indices in one compiled pass over xc (schemes/kmeans_cpu.py)
                loops.nearest_centroids(xc, c_sq, indices[:, start:start + step])
            else:                   # ‖x‖² is constant per row; argmin's indices (first of ties), 2x faster on CPU
                indices[:, start:start + step] = (c_sq[:, None, :] - 2 * xc).min(-1).indices
    chosen = torch.gather(centroids, 1, indices[..., None].expand(-1, -1, g))
    return indices, ((points - chosen) ** 2).sum(-1)


def _init_kmeans_pp(points: torch.Tensor, k: int, uniforms: np.ndarray) -> torch.Tensor:
    b, n, g = points.shape
    first = min(int(uniforms[0] * n), n - 1)
    loops = compiled_loops(points)
    if loops is not None and g <= _SEEDING_MAX_DIM:   # the same picks, each problem's in cache (schemes/kmeans_cpu.py)
        picks = loops.kmeans_pp_picks(points, uniforms[:k], first)
        return torch.gather(points, 1, picks[..., None].expand(-1, -1, g))
    u = torch.as_tensor(uniforms, dtype=torch.float64, device=points.device)
    centroids = points[:, first:first + 1].clone()
    d2 = ((points - centroids) ** 2).sum(-1).to(torch.float64)      # (B, N)
    for j in range(1, k):
        cum = d2.cumsum(-1)
        total = cum[:, -1:]
        pick = torch.searchsorted(cum, u[j] * total, right=True).clamp_(max=n - 1)
        # all points already covered (duplicates): fall back to a uniform pick
        uniform_pick = torch.full_like(pick, min(int(uniforms[j] * n), n - 1))
        pick = torch.where(total > 0, pick, uniform_pick)
        new = torch.gather(points, 1, pick[..., None].expand(-1, -1, g))
        centroids = torch.cat((centroids, new), dim=1)
        d2 = torch.minimum(d2, ((points - new) ** 2).sum(-1).to(torch.float64))
    return centroids


def kmeans(points: torch.Tensor, k: int, *, gen: np.random.Generator, n_iter: int = 25,
           init: str = "k-means++", max_fit_points: int | None = None) -> KMeansResult:
    """Fit k centroids to each of the B point sets (B, N, g); k is capped at N.

    max_fit_points: fit on a seeded uniform subsample of that many points (the same indices
    for every problem), as large-scale k-means does (FAISS trains on <= 256 points per
    centroid); assign the full set afterwards with `assign`.
    """
    if init not in INITS:
        raise ValueError(f"unknown k-means init {init!r}; valid: {', '.join(INITS)}")
    if k < 1 or n_iter < 0:
        raise ValueError(f"k-means needs k >= 1 and n_iter >= 0, got k={k}, n_iter={n_iter}")
    b, n, g = points.shape
    if n == 0:
        raise ValueError("k-means needs at least one point")
    if max_fit_points is not None and n > max_fit_points:
        subset = np.sort(gen.choice(n, size=max_fit_points, replace=False))
        points = points[:, torch.as_tensor(subset, device=points.device)]
        n = max_fit_points
    k = min(k, n)
    if init == "k-means++":
        centroids = _init_kmeans_pp(points, k, gen.random(k))
    else:
        pick = torch.as_tensor(np.sort(gen.choice(n, size=k, replace=False)), device=points.device)
        centroids = points[:, pick].clone()
    indices, d2 = assign(points, centroids)
    history = [d2.mean(-1)]
    ones = torch.ones(b, n, dtype=points.dtype, device=points.device)
    for _ in range(n_iter):
        sums = torch.zeros_like(centroids).scatter_add_(1, indices[..., None].expand(-1, -1, g), points)
        counts = torch.zeros(b, k, dtype=points.dtype, device=points.device).scatter_add_(1, indices, ones)
        # an empty cluster keeps its centre (the objective cannot rise)
        centroids = torch.where(counts[..., None] > 0, sums / counts.clamp(min=1)[..., None], centroids)
        new_indices, d2 = assign(points, centroids)
        history.append(d2.mean(-1))
        if torch.equal(new_indices, indices):
            break  # a fixed point for every problem: more sweeps change nothing
        indices = new_indices
    return KMeansResult(centroids, torch.stack(history, dim=-1))
