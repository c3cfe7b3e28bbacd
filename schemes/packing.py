"""Bit packing of 1–8-bit integer codes into uint8 bytes, batched over leading dims.

Codes (..., n) with values in [0, 2**width) become bytes (..., ceil(n*width/8)), big-endian:
the first code occupies the most significant bits of the first byte. Each row is padded
separately so a row (one token's vector) stays addressable on its own. Eight codes of
`width` bits are exactly `width` bytes, so packing works on groups of eight codes held in
one int64 word; widths that divide 8 (1, 2, 4, 8) are packed byte by byte in uint8, which is
several times faster and gives the same bytes.
"""
from __future__ import annotations

import torch


def _check_width(width: int) -> None:
    if not 1 <= width <= 8:
        raise ValueError(f"code width {width} is outside 1..8 bits")


def packed_size(n: int, width: int) -> int:
    """Bytes that one row of n codes of the given width occupies once packed."""
    return (n * width + 7) // 8


def _shifts(step: int, count: int, device) -> torch.Tensor:
    return torch.arange(count - 1, -1, -1, device=device, dtype=torch.int64) * step


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
    return torch.stack(parts, -1).reshape(*p.shape[:-1], need * per_byte)[..., :n].to(torch.int64)


def pack_bits(codes: torch.Tensor, width: int) -> torch.Tensor:
    """Pack integer codes (..., n) of `width` bits into uint8 (..., packed_size(n, width))."""
    _check_width(width)
    if 8 % width == 0:
        return _pack_bytewise(codes, width)
    lead, n = codes.shape[:-1], codes.shape[-1]
    groups = (n + 7) // 8
    c = codes.to(torch.int64)
    if groups * 8 != n:
        c = torch.nn.functional.pad(c, (0, groups * 8 - n))
    words = (c.view(*lead, groups, 8) << _shifts(width, 8, c.device)).sum(-1)   # 8·width bits
    packed = (words.unsqueeze(-1) >> _shifts(8, width, c.device)) & 0xFF          # (..., groups, width)
    return packed.to(torch.uint8).reshape(*lead, groups * width)[..., : packed_size(n, width)]


def unpack_bits(packed: torch.Tensor, width: int, n: int) -> torch.Tensor:
    """Inverse of pack_bits: uint8 (..., bytes) -> int64 codes (..., n)."""
    _check_width(width)
    if 8 % width == 0:
        return _unpack_bytewise(packed, width, n)
    lead = packed.shape[:-1]
    groups = (n + 7) // 8
    p = packed.to(torch.int64)
    if p.shape[-1] != groups * width:
        p = torch.nn.functional.pad(p, (0, groups * width - p.shape[-1]))
    words = (p.view(*lead, groups, width) << _shifts(8, width, p.device)).sum(-1)
    codes = (words.unsqueeze(-1) >> _shifts(width, 8, p.device)) & ((1 << width) - 1)
    return codes.reshape(*lead, groups * 8)[..., :n]
