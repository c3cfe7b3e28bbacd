"""A permutation test's p-values under its null: uniform on {1, ..., P + 1} / (P + 1)."""
from __future__ import annotations

import numpy as np


def assert_uniform_pvalues(p: np.ndarray, n_permutations: int) -> None:
    """P(p ≤ α) = α at α = 0.05, 0.1, 0.5 within 3.5 binomial standard errors of len(p) draws,
    and no p below the smallest a permutation test can give, 1 / (P + 1)."""
    p = np.asarray(p)
    for alpha in (0.05, 0.1, 0.5):
        half = 3.5 * np.sqrt(alpha * (1 - alpha) / len(p))
        assert abs(np.mean(p <= alpha) - alpha) <= half, (alpha, np.mean(p <= alpha))
    assert p.min() >= 1 / (n_permutations + 1)
