"""Walsh–Hadamard and randomized Hadamard transforms, batched over leading dims.

All functions act on the last dimension of a tensor of shape (..., d) with d a power of
two. The normalised transform H/sqrt(d) is orthogonal and symmetric, hence its own inverse.
"""
from __future__ import annotations

import functools

import torch


def check_power_of_two(dim: int, *, what: str = "head dimension") -> None:
    """Raise ValueError unless dim is a positive power of two (the Hadamard transform needs it)."""
    if dim < 1 or dim & (dim - 1):
        raise ValueError(f"{what} {dim} is not a power of two; the Hadamard transform needs "
                         f"d in 1, 2, 4, ..., 256, 512, ...")


# Up to this d a dense matmul with the cached Hadamard matrix beats log2(d) butterfly passes
# over memory (measured on a 2-core CPU: 5x at d = 64..128, 4x at d = 256).
DENSE_MAX_DIM = 512


def fwht(x: torch.Tensor, *, normalize: bool = True) -> torch.Tensor:
    """Walsh–Hadamard transform of x (..., d) along the last dim, Sylvester ordering.

    With normalize=True the result is H x / sqrt(d), orthogonal and its own inverse. A
    dense matmul for d <= DENSE_MAX_DIM, the O(d log d) butterflies above it.
    """
    d = x.shape[-1]
    check_power_of_two(d)
    if d <= DENSE_MAX_DIM:
        h = _dense(d, x.dtype, str(x.device), normalize)
        return x @ h
    return fwht_butterfly(x, normalize=normalize)


@functools.lru_cache(maxsize=None)
def _dense(d: int, dtype: torch.dtype, device: str, normalize: bool) -> torch.Tensor:
    h = hadamard_matrix(d)
    return (h / d ** 0.5 if normalize else h).to(dtype=dtype, device=device)


def fwht_butterfly(x: torch.Tensor, *, normalize: bool = True) -> torch.Tensor:
    """The fast transform: log2(d) butterfly passes, each vectorised over the leading dims."""
    d = x.shape[-1]
    check_power_of_two(d)
    lead = x.shape[:-1]
    y = x.reshape(-1, d)
    h = 1
    while h < d:
        y = y.view(-1, d // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    y = y.reshape(*lead, d)
    return y / d ** 0.5 if normalize else y


def hadamard_matrix(d: int, *, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The unnormalised Sylvester Hadamard matrix (d, d) with entries +-1 (for tests and dense paths)."""
    check_power_of_two(d)
    m = torch.ones(1, 1, dtype=dtype)
    while m.shape[0] < d:
        m = torch.cat((torch.cat((m, m), 1), torch.cat((m, -m), 1)), 0)
    return m


def rht(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """Randomized Hadamard transform y = H (s ⊙ x) / sqrt(d); signs (..., d) in {-1, +1} broadcast to x."""
    return fwht(x * signs)


def rht_inverse(y: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """Inverse of rht: x = s ⊙ H y / sqrt(d)."""
    return fwht(y) * signs
