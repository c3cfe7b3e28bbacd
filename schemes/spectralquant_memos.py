"""SpectralQuant's remembered stages: the identity memos (kvcommon.memo.IdentityMemo) its codec
fills and reads, and the stages they remember — the unit rows, the coordinates z = Qᵀu, the codes
and their stream, the dequantised values, the orthonormalised basis, the sketch matrices, the
calibrations and the codes each encode stored — so that the cells of a chunk sharing an input
compute each once. Each memo holds its results for the very tensors they were computed from
(and the values of small tensors, values_tag).
"""
from __future__ import annotations

import torch

from kvcommon.memo import IdentityMemo
from kvcommon import compiled
from .packing import pack_variable
from .spectralquant_search import nearest_centroids
from .unit_rows import unit_rows

CALIBRATIONS = IdentityMemo(4)   # K and V of the current chunk, with room
BASES = IdentityMemo(4)
SKETCHES = IdentityMemo(4)
# The codes of a cache as its encode computed them, for the very stream and width table it stored:
# decode and score read them back without unpacking (unpack_variable(pack_variable(i, w), w, S) == i,
# tests/test_spectralquant.py); a stream seen for the first time (another process, a copy) is unpacked.
CODES = IdentityMemo(4)
COORDINATES = IdentityMemo(4)
UNIT_ROWS = IdentityMemo(4)    # K and V of the current chunk, with room
QUANTISED = IdentityMemo(16)   # the codes of K and V at a chunk's last budgets (4 codings each), with room
DEQUANTISED = IdentityMemo(8)


def values_tag(t: torch.Tensor) -> tuple:
    """A small tensor's shape, dtype and bytes: a memo tag that matches equal values."""
    return tuple(t.shape), t.dtype, t.detach().cpu().contiguous().numpy().tobytes()


def quantised(z: torch.Tensor, sigma: torch.Tensor, widths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 codes (B, H, S, d), their packed stream (B, bytes)) of the coordinates z divided by
    σ (B, H, d) at the widths (B, H, d): remembered for the very coordinates and the values of the
    widths and σ, so two codings that allocate alike share them (squ-qkv at budget b and squ-kv at
    b − 1 give K's semantic coordinates b − 1 bits and the tail 2 for b ≥ 3)."""
    tag = (values_tag(widths.to(torch.uint8)), values_tag(sigma.to(torch.float32)))
    return QUANTISED.get_or_compute((z,), lambda: search_and_pack(z, sigma, widths), tag)


def fused_passes(t: torch.Tensor):
    """schemes.spectralquant_cpu where the compiled loops take t (compiled.takes), else None:
    numba is imported only where a computation can use it (never on CUDA)."""
    if not compiled.takes(t):
        return None
    from . import spectralquant_cpu
    return spectralquant_cpu


def search_and_pack(z: torch.Tensor, sigma: torch.Tensor, widths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """z / σ, nearest_centroids and pack_variable: in one compiled pass on the CPU in float32 and
    float64 (schemes/spectralquant_cpu.py: the same operations, table, comparisons and stream), by
    torch passes elsewhere."""
    cpu = fused_passes(z)
    if cpu is not None and cpu.takes(z):
        return cpu.codes(z, sigma, widths)
    idx = nearest_centroids(z / sigma.to(z.dtype).unsqueeze(-2), widths.unsqueeze(-2))
    return idx, pack_variable(idx, widths)


def fused_unit_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """unit_rows(x): by the fused pass on the CPU (spectralquant_cpu.unit_rows, the same bits),
    remembered for the very x (UNIT_ROWS: encode's norms and coordinates, every cell of a chunk);
    by schemes/unit_rows.py's passes elsewhere. Shared: never written in place."""
    cpu = fused_passes(x)
    if cpu is None or not cpu.unit_rows_take(x):
        return unit_rows(x)
    return UNIT_ROWS.get_or_compute((x,), lambda: cpu.unit_rows(x))


def coordinates(x: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """z = Qᵀu (B, H, S, d): the coordinates every coding of x under one calibration quantises,
    whatever its budget, allocation or sketch (Q = basis, the calibration's: shared by the sq
    and squ cells of a chunk); remembered for the very x and basis."""
    return COORDINATES.get_or_compute(
        (x, basis), lambda: fused_unit_rows(x)[0] @ basis.to(device=x.device, dtype=x.dtype))
