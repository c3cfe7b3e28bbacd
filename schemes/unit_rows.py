"""Unit rows and norms of a cache, x (..., d) -> (x/‖x‖, ‖x‖), shared by the codecs that code
directions and norms apart (TurboQuant, SpectralQuant)."""
from __future__ import annotations

import torch

from kvcommon.memo import IdentityMemo

_UNIT_ROWS = IdentityMemo(4)   # K and V of the current chunk: every cell coding them shares one


def unit_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(u (..., d), ‖x‖ (...)): the unit rows of x and their norms; a zero row stays zero. Scaled
    by the largest entry first so ‖x‖² cannot overflow or underflow (|x| ~ 1e30 in float32). A
    function of x alone, so it is remembered for the very tensor (IdentityMemo): the cells of a
    chunk normalise its K and V once. Both results are shared: never write them in place, and
    store a copy."""
    known = _UNIT_ROWS.get((x,))
    if known is not None:
        return known
    peak = x.abs().amax(dim=-1, keepdim=True)
    peak = torch.where(peak > 0, peak, torch.ones_like(peak))
    scaled = x / peak
    scaled_norms = torch.linalg.vector_norm(scaled, dim=-1, keepdim=True)
    u = scaled.div_(torch.where(scaled_norms > 0, scaled_norms, torch.ones_like(scaled_norms)))
    return _UNIT_ROWS.put((x,), (u, (peak * scaled_norms).squeeze(-1)))
