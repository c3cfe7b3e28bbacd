"""Bit packing of 1–8-bit integer codes into uint8 bytes, batched over leading dims.

Codes (..., n) with values in [0, 2**width) become bytes (..., ceil(n*width/8)), big-endian:
the first code occupies the most significant bits of the first byte. Each row is padded
separately so a row (one token's vector) stays addressable on its own. Widths that divide 8
(1, 2, 4, 8) are packed byte by byte; the others in groups of eight codes, which are exactly
`width` bytes: byte j of a group is the OR of the (at most three) codes overlapping its bits,
each shifted into place. Everything stays in uint8 (no int64 words), so every width costs
about the same.
"""
from __future__ import annotations

import torch


def _check_width(width: int) -> None:
    if not 1 <= width <= 8:
        raise ValueError(f"code width {width} is outside 1..8 bits")


def packed_size(n: int, width: int) -> int:
    """Bytes that one row of n codes of the given width occupies once packed."""
    return (n * width + 7) // 8


def _overlaps(width: int) -> list[tuple[int, int, int, int, int]]:
    """For a group of 8 codes of `width` bits in `width` bytes (big-endian): every (byte j,
    code i, right shift of the byte, mask, left shift into the code) where code i and byte j
    share bits; the shared bits are (byte_j >> r) & mask, at position l of the code."""
    out = []
    for i in range(8):
        start, stop = width * i, width * (i + 1)                  # the code's bits in the group
        for j in range(start // 8, (stop - 1) // 8 + 1):
            lo, hi = max(start, 8 * j), min(stop, 8 * j + 8)      # shared bits [lo, hi)
            out.append((j, i, 8 * j + 8 - hi, (1 << (hi - lo)) - 1, stop - hi))
    return out


def _pack_bytewise(codes: torch.Tensor, width: int) -> torch.Tensor:
    """pack_bits for width in (1, 2, 4, 8): 8/width codes per byte, the first most significant."""
    per_byte = 8 // width
    lead, n = codes.shape[:-1], codes.shape[-1]
    c = codes.to(torch.uint8)
    if n % per_byte:
        c = torch.nn.functional.pad(c, (0, per_byte - n % per_byte))
    c = c.view(*lead, -(-n // per_byte), per_byte)
    packed = c[..., 0] << (8 - width)
    for j in range(1, per_byte):
        packed |= c[..., j] << (8 - width * (j + 1))
    return packed


def _unpack_bytewise(packed: torch.Tensor, width: int, n: int) -> torch.Tensor:
    per_byte = 8 // width
    need = -(-n // per_byte)
    p = packed[..., :need]
    if p.shape[-1] < need:
        p = torch.nn.functional.pad(p, (0, need - p.shape[-1]))
    mask = (1 << width) - 1
    parts = [(p >> (8 - width * (j + 1))) & mask for j in range(per_byte)]
    return torch.stack(parts, -1).reshape(*p.shape[:-1], need * per_byte)[..., :n]


def _pack_groups(codes: torch.Tensor, width: int) -> torch.Tensor:
    """pack_bits for the other widths: groups of 8 codes -> `width` bytes, in uint8."""
    lead, n = codes.shape[:-1], codes.shape[-1]
    groups = (n + 7) // 8
    c = codes.to(torch.uint8)
    if groups * 8 != n:
        c = torch.nn.functional.pad(c, (0, groups * 8 - n))
    c = c.view(*lead, groups, 8)
    out = torch.zeros(*lead, groups, width, dtype=torch.uint8, device=codes.device)
    for j, i, right, mask, left in _overlaps(width):
        out[..., j] |= ((c[..., i] >> left) & mask) << right
    return out.reshape(*lead, groups * width)[..., : packed_size(n, width)]


def _unpack_groups(packed: torch.Tensor, width: int, n: int) -> torch.Tensor:
    lead = packed.shape[:-1]
    groups = (n + 7) // 8
    p = packed
    if p.shape[-1] != groups * width:
        p = torch.nn.functional.pad(p, (0, groups * width - p.shape[-1]))
    p = p.view(*lead, groups, width)
    out = torch.zeros(*lead, groups, 8, dtype=torch.uint8, device=packed.device)
    for j, i, right, mask, left in _overlaps(width):
        out[..., i] |= ((p[..., j] >> right) & mask) << left
    return out.reshape(*lead, groups * 8)[..., :n]


def pack_bits(codes: torch.Tensor, width: int) -> torch.Tensor:
    """Pack integer codes (..., n) of `width` bits into uint8 (..., packed_size(n, width))."""
    _check_width(width)
    if 8 % width == 0:
        return _pack_bytewise(codes, width)
    return _pack_groups(codes, width)


def unpack_codes(packed: torch.Tensor, width: int, n: int) -> torch.Tensor:
    """Inverse of pack_bits: uint8 (..., bytes) -> uint8 codes (..., n)."""
    _check_width(width)
    if 8 % width == 0:
        return _unpack_bytewise(packed, width, n)
    return _unpack_groups(packed, width, n)


def unpack_bits(packed: torch.Tensor, width: int, n: int) -> torch.Tensor:
    """Inverse of pack_bits: uint8 (..., bytes) -> int64 codes (..., n) (usable as indices)."""
    return unpack_codes(packed, width, n).to(torch.int64)
