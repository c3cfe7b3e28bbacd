"""Llama rotate-half rotary position embedding (RoPE), applied and undone exactly.

x: (..., S, d) with d even, positions: (S,) integer token positions. For token position p
and pair index i < d/2 the angle is θ_i·p with θ_i = base^(−2i/d) (Su et al., RoFormer,
arXiv 2104.09864; Llama's layout pairs channel i with channel i + d/2, "rotate half").
  apply: x ⊙ cos + rotate_half(x) ⊙ sin,   rotate_half([a, b]) = [−b, a]
  undo:  x ⊙ cos − rotate_half(x) ⊙ sin    (the transpose of the same rotation)
Angles are formed in float64 so that a position of 10^5 keeps its digits before the cast.
apply_rope_numpy is the same rotation in NumPy with a captured model's own frequencies and scaling.
"""
from __future__ import annotations

import numpy as np
import torch

DEFAULT_BASE = 10000.0


def check_even(dim: int) -> None:
    if dim < 2 or dim % 2:
        raise ValueError(f"head dimension {dim} must be even for rotate-half RoPE (d = 2, 4, 6, ...)")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[a, b] -> [−b, a] along the last dim (..., d)."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def cos_sin(positions: torch.Tensor, dim: int, *, base: float = DEFAULT_BASE,
            dtype: torch.dtype = torch.float32, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables (S, d) for the positions (S,), each half repeated (rotate-half layout)."""
    check_even(dim)
    pos = torch.as_tensor(positions).to(device=device, dtype=torch.float64)
    inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=pos.device) / dim)
    angles = pos[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, *, base: float = DEFAULT_BASE) -> torch.Tensor:
    """RoPE of x (..., S, d) at positions (S,); returns a new tensor of x's shape and dtype."""
    cos, sin = cos_sin(positions, x.shape[-1], base=base, dtype=x.dtype, device=x.device)
    return x * cos + rotate_half(x) * sin


def undo_rope(x: torch.Tensor, positions: torch.Tensor, *, base: float = DEFAULT_BASE) -> torch.Tensor:
    """Inverse of apply_rope at the same positions: x (..., S, d) -> (..., S, d)."""
    cos, sin = cos_sin(positions, x.shape[-1], base=base, dtype=x.dtype, device=x.device)
    return x * cos - rotate_half(x) * sin


def apply_rope_numpy(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, scaling: float = 1.0) -> np.ndarray:
    """RoPE (Su et al., arXiv 2104.09864, eq. 34 in the rotate-half layout) in NumPy, with a model's
    own frequencies inv_freq (r/2,) and attention scaling (a capture's: harness/capture.py reads them
    from the model, scenarios/fitted.py draws with them), of x (..., N, d) at positions (N,): the
    first r coordinates become (x·cos θ + rotate_half(x)·sin θ)·scaling, θ = position·inv_freq repeated
    over both halves of those r; the other d − r pass unchanged (partial RoPE, as GPT-NeoX's
    rotary_pct and Phi-3's partial_rotary_factor set it; r = d is full RoPE)."""
    r = 2 * inv_freq.shape[0]
    if not 0 < r <= x.shape[-1]:
        raise ValueError(f"rotary dim {r} must lie in [2, head_dim {x.shape[-1]}]")
    angles = np.asarray(positions, dtype=np.float64)[:, None] * np.asarray(inv_freq, dtype=np.float64)[None, :]
    angles = np.concatenate([angles, angles], axis=-1)
    part = x[..., :r]
    half = r // 2
    rotated = np.concatenate([-part[..., half:], part[..., :half]], axis=-1)   # rotate_half: [a, b] -> [-b, a]
    out = part * (np.cos(angles) * scaling) + rotated * (np.sin(angles) * scaling)
    return out if r == x.shape[-1] else np.concatenate([out, x[..., r:]], axis=-1)
