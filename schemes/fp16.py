"""fp16 storage of any float data with a per-trial power-of-two exponent, shared by the codecs that
store fp16 values (the baselines, Shard, the kvpress bridge): ordinary data (peak |x| in
[2^-8, 2^14]) gets shift 0 and is stored as plain fp16, bit for bit; 1e30- or 1e-30-sized data
is shifted exactly into range first (fp16 overflows at 65504). The int16 shift is stored and
counted by the codec that uses it."""
from __future__ import annotations

import torch

FP16_HIGH, FP16_LOW = 2.0 ** 14, 2.0 ** -8  # peaks outside this range are shifted by a power of two


def half_shift(x: torch.Tensor, n_lead: int = 1) -> torch.Tensor:
    """Per-leading-index power-of-two exponent e (int16, shape x.shape[:n_lead]) such that
    x·2^−e has its peak below 1 when the peak lies outside [FP16_LOW, FP16_HIGH], else 0."""
    flat = x.reshape(*x.shape[:n_lead], -1)
    if flat.shape[-1] == 0:
        return torch.zeros(x.shape[:n_lead], dtype=torch.int16, device=x.device)
    peak = flat.abs().amax(-1)
    _, exponent = torch.frexp(peak)           # peak = m·2^e, m in [0.5, 1)
    outside = (peak > FP16_HIGH) | ((peak < FP16_LOW) & (peak > 0))
    return torch.where(outside, exponent, torch.zeros_like(exponent)).to(torch.int16)


def _expand(shift: torch.Tensor, ndim: int, dtype: torch.dtype) -> torch.Tensor:
    return shift.to(dtype).reshape(*shift.shape, *([1] * (ndim - shift.ndim)))


def shift_down(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """x·2^−shift (exact: a power of two), shift broadcast over x's trailing dims."""
    return torch.ldexp(x, -_expand(shift, x.ndim, x.dtype))


def shift_up(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    return torch.ldexp(x, _expand(shift, x.ndim, x.dtype))
