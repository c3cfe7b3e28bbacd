"""Walsh–Hadamard and randomized Hadamard transforms, batched over leading dims.

All functions act on the last dimension of a tensor of shape (..., d) with d a power of
two. The normalised transform H/sqrt(d) is orthogonal and symmetric, hence its own inverse.

On the CPU in float32/float64 (every harness run there) the transform is the O(d log d)
butterflies in one compiled pass over each vector (schemes/hadamard_cpu.py), the random signs,
the scale and the vector's norm applied in the same pass; elsewhere (CUDA, half precision) a
dense matmul with the cached Hadamard matrix up to d = 512 and torch butterflies above. The
butterflies add in a fixed order, so their result is the same on every CPU, whatever the BLAS
library, its kernels or the thread count, and closer to the exact transform (a float32
butterfly rounds log2(d) times per entry, a float32 dot product over d entries more).
"""
from __future__ import annotations

import functools

import torch

from kvcommon import compiled


def _vector_signs(signs: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether signs are one row per set of vectors of x, (..., 1, d), as the compiled pass takes them."""
    return x.dim() >= 2 and signs.dim() >= 2 and signs.shape[-2] == 1 and \
        torch.broadcast_shapes(signs.shape, x.shape) == x.shape


def check_power_of_two(dim: int, *, what: str = "head dimension") -> None:
    """Raise ValueError unless dim is a positive power of two (the Hadamard transform needs it)."""
    if dim < 1 or dim & (dim - 1):
        raise ValueError(f"{what} {dim} is not a power of two; the Hadamard transform needs "
                         f"d in 1, 2, 4, ..., 256, 512, ...")


# Off the compiled CPU path, up to this d a dense matmul with the cached Hadamard matrix beats
# log2(d) torch butterfly passes over memory (measured on a 2-core CPU: 5x at d = 64..128, 4x at d = 256).
DENSE_MAX_DIM = 512


def fwht(x: torch.Tensor, *, normalize: bool = True) -> torch.Tensor:
    """Walsh–Hadamard transform of x (..., d) along the last dim, Sylvester ordering.

    With normalize=True the result is H x / sqrt(d), orthogonal and its own inverse. A
    dense matmul for d <= DENSE_MAX_DIM, the O(d log d) butterflies above it.
    """
    d = x.shape[-1]
    check_power_of_two(d)
    if compiled.takes(x):
        from . import hadamard_cpu
        return hadamard_cpu.hadamard(x, normalize=normalize)
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


def rht(x: torch.Tensor, signs: torch.Tensor, *, mult: float = 1.0) -> torch.Tensor:
    """Randomized Hadamard transform y = H (s ⊙ x) / sqrt(d) (· mult); signs (..., d) in {-1, +1}
    broadcast to x."""
    check_power_of_two(x.shape[-1])
    if compiled.takes(x) and _vector_signs(signs, x):
        from . import hadamard_cpu
        return hadamard_cpu.hadamard(x, pre=signs, mult=mult)
    y = fwht(x * signs)
    return y * mult if mult != 1 else y


def rht_inverse(y: torch.Tensor, signs: torch.Tensor, *, mult: float = 1.0,
                scale: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of rht: x = s ⊙ H y / sqrt(d), times mult and then, given scale (...,) (one factor a
    vector, e.g. its norm), times scale[..., None]: the products in that order."""
    check_power_of_two(y.shape[-1])
    if compiled.takes(y) and _vector_signs(signs, y) and (scale is None or scale.shape == y.shape[:-1]):
        from . import hadamard_cpu
        return hadamard_cpu.hadamard(y, post=signs, mult=mult, scale=scale)
    x = fwht(y)
    x = x * mult if mult != 1 else x
    x = x * signs
    return x * scale.unsqueeze(-1) if scale is not None else x
