"""Eigen-analysis of per-head covariance matrices, batched over (B, H).

- `covariance`: C = XᵀX/n (uncentred, as SpectralQuant defines it, AMD paper §2);
- `eigh_descending`: the exact symmetric eigendecomposition, eigenvalues in decreasing order;
- `top_eigenvectors`: block power (subspace) iteration for the top-k eigenvectors, with a QR
  orthonormalisation after every product and a Rayleigh–Ritz rotation at the end
  (Golub & Van Loan, Matrix Computations, §8.2.4 "orthogonal iteration");
- `participation_ratio` / `effective_dimension`: d_eff = round(tr(C)²/‖C‖_F²);
- `spectral_gap`: the relative gap (λ_k − λ_{k+1})/λ_1 at the d_eff boundary, which sets how
  fast the power iteration converges and how stable the semantic subspace is.
"""
from __future__ import annotations

import numpy as np
import torch


def covariance(x: torch.Tensor) -> torch.Tensor:
    """C = xᵀx/n for x (..., n, d): (..., d, d)."""
    n = x.shape[-2]
    if n < 1:
        raise ValueError("the covariance needs at least one calibration token; got n = 0")
    return x.transpose(-1, -2) @ x / n


def eigh_descending(cov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues (..., d) in decreasing order and eigenvectors (..., d, d) as columns."""
    values, vectors = torch.linalg.eigh(cov)
    return values.flip(-1), vectors.flip(-1)


def _orthonormalise(v: torch.Tensor) -> torch.Tensor:
    q, r = torch.linalg.qr(v)
    # Fix the sign of each column (diag(R) > 0) so the iteration does not flip directions.
    signs = torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))
    signs = torch.where(signs == 0, torch.ones_like(signs), signs)
    return q * signs.unsqueeze(-2)


def top_eigenvectors(cov: torch.Tensor, k: int, gen: np.random.Generator, *, max_iter: int = 1000,
                     tol: float = 1e-12) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Top-k eigenpairs of symmetric PSD cov (..., d, d) by block power iteration.

    gen: the generator of the random start block (an explicit stream, never global state).
    Returns (values (..., k) decreasing, vectors (..., d, k), iterations used). Stops when
    the residual ‖C V − V (VᵀCV)‖_F of every matrix in the batch is below tol·‖C‖_F.
    """
    d = cov.shape[-1]
    if not 1 <= k <= d:
        raise ValueError(f"number of eigenvectors k={k} is outside 1..{d}")
    start = torch.from_numpy(gen.standard_normal((*cov.shape[:-2], d, k))).to(cov.dtype).to(cov.device)
    v = _orthonormalise(start)
    scale = torch.linalg.matrix_norm(cov).clamp_min(torch.finfo(cov.dtype).tiny).unsqueeze(-1).unsqueeze(-1)
    iterations = 0
    for iterations in range(1, max_iter + 1):
        v = _orthonormalise(cov @ v)
        cv = cov @ v
        residual = cv - v @ (v.transpose(-1, -2) @ cv)
        if bool((torch.linalg.matrix_norm(residual / scale) <= tol).all()):
            break
    # Rayleigh–Ritz: rotate within the converged subspace onto the eigenvectors.
    ritz_values, ritz_vectors = eigh_descending(v.transpose(-1, -2) @ cov @ v)
    return ritz_values, v @ ritz_vectors, iterations


def participation_ratio(cov: torch.Tensor) -> torch.Tensor:
    """tr(C)²/‖C‖_F² (...,), in [1, d] for a non-zero PSD C; 0 for C = 0."""
    trace = torch.diagonal(cov, dim1=-2, dim2=-1).sum(-1)
    frob2 = (cov * cov).sum((-1, -2))
    return torch.where(frob2 > 0, trace * trace / torch.where(frob2 > 0, frob2, torch.ones_like(frob2)),
                       torch.zeros_like(frob2))


def effective_dimension(cov: torch.Tensor) -> torch.Tensor:
    """d_eff = round(tr(C)²/‖C‖_F²) (...,) int64, clipped to 1..d; d for a zero (uninformative) C."""
    d = cov.shape[-1]
    ratio = participation_ratio(cov)
    d_eff = torch.round(ratio).to(torch.int64).clamp(1, d)
    return torch.where(ratio > 0, d_eff, torch.full_like(d_eff, d))


def spectral_gap(values: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """(λ_k − λ_{k+1})/λ_1 (...,) for decreasing eigenvalues (..., d) and k (...,) in 1..d
    (λ_{d+1} = 0); 0 where λ_1 = 0."""
    padded = torch.cat((values, torch.zeros_like(values[..., :1])), -1)
    idx = (k.to(torch.int64) - 1).unsqueeze(-1)
    lam_k = padded.gather(-1, idx).squeeze(-1)
    lam_next = padded.gather(-1, idx + 1).squeeze(-1)
    top = values[..., 0]
    return torch.where(top > 0, (lam_k - lam_next) / torch.where(top > 0, top, torch.ones_like(top)),
                       torch.zeros_like(top))
