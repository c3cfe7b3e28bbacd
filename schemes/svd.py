"""Randomized SVD (Halko, Martinsson and Tropp 2011, Alg. 4.4), batched over trials."""
from __future__ import annotations

import torch

from kvcommon.threads import small_linalg


def randomized_svd(x: torch.Tensor, rank: int, n_iter: int, omega: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-`rank` right singular vectors (B, D, rank) and singular values (B, rank) of x (B, n, D),
    from the test matrix omega (D, l), l >= rank, shared by every trial; QR re-orthonormalises
    between power iterations (Halko et al. 2011, Alg. 4.4)."""
    if omega.shape[1] >= min(x.shape[-2:]):
        # the sketch spans the whole row space: the exact SVD is what the iteration converges to
        with small_linalg():
            _, s, vh = torch.linalg.svd(x, full_matrices=False)
        return vh[..., :rank, :].transpose(-1, -2), s[..., :rank]
    y = x @ omega
    with small_linalg():   # the QRs and the small SVD on one thread, the products x @ · on all
        q, _ = torch.linalg.qr(y)
    for _ in range(n_iter):
        y = x.transpose(-1, -2) @ q
        with small_linalg():
            z, _ = torch.linalg.qr(y)
        y = x @ z
        with small_linalg():
            q, _ = torch.linalg.qr(y)
    small = q.transpose(-1, -2) @ x                      # (B, l, D)
    with small_linalg():
        _, s, vh = torch.linalg.svd(small, full_matrices=False)
    return vh[..., :rank, :].transpose(-1, -2), s[..., :rank]
