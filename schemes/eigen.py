"""Eigen-analysis of per-head covariance matrices, batched over (B, H).

- `covariance`: C = XᵀX/n (uncentred, as SpectralQuant defines it, AMD paper §2);
- `eigh_descending`: the exact symmetric eigendecomposition, eigenvalues in decreasing order;
- `top_eigenvectors`: block power (subspace) iteration with Rayleigh–Ritz for the top-k
  eigenvectors (Golub & Van Loan, Matrix Computations, §8.2.4 "orthogonal iteration"), each
  matrix of the batch stopping on its own;
- `leading_basis`: SpectralQuant's basis: the leading block of eigenvectors by the power
  iteration or by `eigh` (faster at d ≤ EIGH_MAX_DIM, see `resolve_eigensolver`), completed by QR;
- `canonical_signs`: each eigenvector's sign fixed by its largest entry (LAPACK's is arbitrary);
- `participation_ratio` / `effective_dimension`: d_eff = round(tr(C)²/‖C‖_F²);
- `spectral_gap`: the relative gap (λ_k − λ_{k+1})/λ_1 at the d_eff boundary, which sets how
  fast the power iteration converges and how stable the semantic subspace is.
"""
from __future__ import annotations

import torch

from kvcommon.threads import by_matrix, small_linalg


def covariance(x: torch.Tensor) -> torch.Tensor:
    """C = xᵀx/n for x (..., n, d): (..., d, d)."""
    n = x.shape[-2]
    if n < 1:
        raise ValueError("the covariance needs at least one calibration token; got n = 0")
    return x.transpose(-1, -2) @ x / n


def eigh_descending(cov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues (..., d) in decreasing order and eigenvectors (..., d, d) as columns; each
    matrix on one thread, the batch shared between the threads (kvcommon.threads.by_matrix)."""
    values, vectors = by_matrix(lambda c: tuple(torch.linalg.eigh(c)), cov)
    return values.flip(-1), vectors.flip(-1)


def canonical_signs(vectors: torch.Tensor) -> torch.Tensor:
    """The columns of vectors (..., d, k), each multiplied by ±1 so that its entry of largest
    magnitude is positive (the first such entry on a tie). An eigenvector's sign is arbitrary:
    LAPACK's choice changes with the library, the device and even the thread count (MKL), and
    the sketch of the semantic coordinates (sign(S·e) with S drawn from a seed) is not
    invariant to it, so the basis is made a function of the subspaces alone."""
    peak = vectors.gather(-2, vectors.abs().argmax(dim=-2, keepdim=True))
    return vectors * torch.where(peak < 0, -1.0, 1.0).to(vectors.dtype)


def _orthonormalise(v: torch.Tensor) -> torch.Tensor:
    q, r = torch.linalg.qr(v)
    # Fix the sign of each column (diag(R) > 0) so the iteration does not flip directions.
    signs = torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))
    signs = torch.where(signs == 0, torch.ones_like(signs), signs)
    return q * signs.unsqueeze(-2)


@small_linalg()  # small matrices: one thread (kvcommon/threads.py)
def top_eigenvectors(cov: torch.Tensor, k: int, start: torch.Tensor, *, n_converge: torch.Tensor | None = None,
                     max_iter: int = 500, tol: float = 1e-9) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k eigenpairs of symmetric PSD cov (..., d, d) by block power (subspace) iteration with
    a Rayleigh–Ritz step after every product (Saad, Numerical Methods for Large Eigenvalue
    Problems, 2nd ed., Alg. 5.3): V ← orth(C V), then V ← V·eig(VᵀCV), Ritz values decreasing.

    start: the start block (d, k), the same for every matrix (or (..., d, k)); it is an explicit
    argument so that each matrix's result depends on that matrix alone. Each matrix stops on its
    own once its leading n_converge (..., default k) Ritz pairs have residuals
    ‖C v − θ v‖ ≤ tol·θ_1 (or after max_iter products, which the returned count shows); later
    products leave it untouched, so the answer does not depend on the other matrices of the
    batch (bit for bit on the CPU, where batched LAPACK/BLAS work matrix by matrix; a GPU may
    pick other kernels for other batch sizes, so there it agrees to rounding). Pair j converges like
    (λ_{k+1}/λ_j)^iterations, which is why callers ask for more vectors than they need.
    Returns (values (..., k), vectors (..., d, k), iterations (...,) int64).
    """
    *batch, d, _ = cov.shape
    if not 1 <= k <= d:
        raise ValueError(f"number of eigenvectors k={k} is outside 1..{d}")
    if start.shape[-2:] != (d, k):
        raise ValueError(f"start block has shape {tuple(start.shape)}; expected (..., {d}, {k})")
    flat = cov.reshape(-1, d, d)
    n, device = flat.shape[0], cov.device
    v = _orthonormalise(start.to(cov).expand(*batch, d, k).reshape(n, d, k))
    need = torch.full((n,), k, dtype=torch.int64, device=device) if n_converge is None else \
        n_converge.reshape(n).to(device=device, dtype=torch.int64).clamp(1, k)
    values = torch.zeros(n, k, dtype=cov.dtype, device=device)
    iterations = torch.zeros(n, dtype=torch.int64, device=device)
    leading = torch.arange(k, device=device).unsqueeze(0) < need.unsqueeze(-1)       # (n, k)
    active = torch.arange(n, device=device)
    cv = flat @ v
    for _ in range(max_iter):
        if active.numel() == 0:
            break
        c = flat[active]
        q = _orthonormalise(cv[active])
        cq = c @ q
        theta, y = eigh_descending(q.transpose(-1, -2) @ cq)
        ritz, c_ritz = q @ y, cq @ y
        residual = torch.linalg.vector_norm(c_ritz - ritz * theta.unsqueeze(-2), dim=-2)     # (n_active, k)
        scale = theta[:, :1].abs().clamp_min(torch.finfo(cov.dtype).tiny)
        done = ((residual <= tol * scale) | ~leading[active]).all(-1)
        v[active], values[active], cv[active] = ritz, theta, c_ritz
        iterations[active] += 1
        active = active[~done]
    return values.reshape(*batch, k), v.reshape(*batch, d, k), iterations.reshape(batch)


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


OVERSAMPLE = 8

# SpectralQuant's `eigensolver` option: how `leading_basis` finds the leading block: "power"
# (the paper's block power iteration), "eigh" (LAPACK's exact symmetric eigensolver, the block
# taken from the full decomposition), "auto" (eigh at d ≤ EIGH_MAX_DIM). On one thread a batched
# eigh of d×d covariances is 3–14x faster than the power iteration at d = 64..256
# (spectral_decay, lowrank_aligned, heavy_tail, gaussian; 2-core CPU); the iteration pays off
# only where eigh's O(d³) is large.
EIGENSOLVERS = ("power", "eigh", "auto")
EIGH_MAX_DIM = 512


def resolve_eigensolver(name: str, d: int) -> str:
    """"power" or "eigh": the solver `name` stands for at head dimension d."""
    if name not in EIGENSOLVERS:
        raise ValueError(f"eigensolver {name!r}; valid: {', '.join(EIGENSOLVERS)}")
    if name == "auto":
        return "eigh" if d <= EIGH_MAX_DIM else "power"
    return name



def block_width(d_eff: torch.Tensor, d: int) -> torch.Tensor:
    """Vectors the power iteration carries for a head of effective dimension d_eff: 2·d_eff + 8,
    in multiples of 8, at most d. The surplus makes the leading d_eff + 1 pairs converge like
    (λ_{2·d_eff+9}/λ_{d_eff+1})^t instead of stalling on a small gap at d_eff."""
    return ((2 * d_eff + OVERSAMPLE + 7) // 8 * 8).clamp(max=d)


def leading_basis(cov: torch.Tensor, d_eff: torch.Tensor, start: torch.Tensor, *, solver: str = "power",
                  max_iter: int = 500, tol: float = 1e-9) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An orthonormal basis (..., d, d) of R^d whose leading columns are the top
    `block_width(d_eff)` eigenvectors of cov (..., d, d), completed by an orthonormal basis of
    the complement (Householder QR), every column with its canonical sign (`canonical_signs`).

    solver "power": the block by `top_eigenvectors` (the leading d_eff + 1 pairs converged),
    matrices with the same block width iterated together; "eigh": the block taken from the
    exact decomposition (then every block vector is exact, not only the leading d_eff + 1).
    The completion is the same either way: the exact tail eigenvectors of a sample covariance
    over-fit the calibration sample (their variances spread per Marchenko–Pastur, and a codebook
    scaled by an underestimated σ clips fresh data), which costs SQ up to 2–3x in relMSE at
    d = 256, b = 4, so eigh replaces the iteration, not the basis it builds.

    start (d, d): the start block, its first columns used (by the power iteration). Returns
    (values (..., d): the block's Ritz values (eigenvalues for eigh), decreasing, NaN past the
    block; basis; iterations (...,) int64, 0 for eigh)."""
    *batch, d, _ = cov.shape
    flat, wanted = cov.reshape(-1, d, d), d_eff.reshape(-1).to(torch.int64)
    widths = block_width(wanted, d)
    basis = torch.empty_like(flat)
    values = torch.full(flat.shape[:-1], float("nan"), dtype=cov.dtype, device=cov.device)
    iterations = torch.zeros(flat.shape[0], dtype=torch.int64, device=cov.device)
    if solver == "eigh":
        exact_values, exact_vectors = eigh_descending(flat)
    elif solver != "power":
        raise ValueError(f"solver {solver!r}; valid: power, eigh")
    for k in torch.unique(widths).tolist():
        sel = torch.nonzero(widths == k).squeeze(-1)
        if solver == "eigh":
            vals, vecs, its = exact_values[sel, :k], exact_vectors[sel, :, :k], 0
        else:
            vals, vecs, its = top_eigenvectors(flat[sel], k, start[:, :k], n_converge=wanted[sel] + 1,
                                               max_iter=max_iter, tol=tol)
        if k < d:
            complete = by_matrix(lambda v: (torch.linalg.qr(v, mode="complete").Q,), vecs)[0]
            vecs = torch.cat((vecs, complete[..., k:]), -1)
        basis[sel], values[sel, :k], iterations[sel] = vecs, vals, its
    return values.reshape(*batch, d), canonical_signs(basis).reshape(*batch, d, d), iterations.reshape(batch)
