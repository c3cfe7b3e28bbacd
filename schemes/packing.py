"""Bit packing of 1–8-bit integer codes into uint8 bytes, batched over leading dims.

Codes (..., n) with values in [0, 2**width) become bytes (..., ceil(n*width/8)), big-endian:
the first code occupies the most significant bits of the first byte. Each row is padded
separately so a row (one token's vector) stays addressable on its own. Widths that divide 8
(1, 2, 4, 8) are packed byte by byte; the others in groups of eight codes, which are exactly
`width` bytes: byte j of a group is the OR of the (at most three) codes overlapping its bits,
each shifted into place. Everything stays in uint8 (no int64 words), so every width costs
about the same.

Two formats of codes of varying width build on it: `pack_variable` (a width per trial, head and
coordinate: SpectralQuant's water-filled codes, one bit stream per trial) and `pack_mixed` (a
width in {0, 2, 4, 6, 8} per trial and component: Shard's coefficients, as 2-bit digits).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_BITS = 8   # the widest code (a uint8): codebooks and water-filled widths stop here too


def _check_width(width: int) -> None:
    if not 1 <= width <= MAX_BITS:
        raise ValueError(f"code width {width} is outside 1..{MAX_BITS} bits")


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


# --- variable widths per (trial, head, coordinate): SpectralQuant's code stream ----------------
_PLANES = torch.arange(MAX_BITS - 1, -1, -1)  # bit positions, most significant first


@dataclass(frozen=True)
class _StreamLayout:
    """Where each code bit of a trial goes. Within one token of head h the valid bits (the
    low w_k bits of each coordinate, MSB first) are `select[b, h, :T[b, h]]` of the d·8
    bit positions; the trial's stream is head after head, token after token, so token s of
    head h starts at offset[b, h] + s·T[b, h]. `dest` (B, H, S, T_max) is None when every
    (trial, head) has the same T: the stream is then a plain reshape."""
    select: torch.Tensor
    per_token: torch.Tensor
    length: int
    dest: torch.Tensor | None


def _layout(widths: torch.Tensor, n_tokens: int) -> _StreamLayout:
    b, h, d = widths.shape
    planes = _PLANES.to(widths.device)
    valid = (planes < widths.unsqueeze(-1)).reshape(b, h, d * MAX_BITS)
    per_token = widths.sum(-1)                                                       # (B, H)
    t_max = int(per_token.max()) if per_token.numel() else 0
    select = torch.sort((~valid).to(torch.uint8), dim=-1, stable=True).indices[..., :t_max]
    lengths = per_token.sum(-1) * n_tokens
    length = int(lengths.max()) if lengths.numel() else 0
    if bool((per_token == t_max).all()):
        return _StreamLayout(select, per_token, length, None)
    offset = torch.cumsum(per_token * n_tokens, -1) - per_token * n_tokens           # (B, H)
    s = torch.arange(n_tokens, device=widths.device).view(1, 1, -1, 1)
    j = torch.arange(t_max, device=widths.device).view(1, 1, 1, -1)
    dest = offset[..., None, None] + s * per_token[..., None, None] + j
    dest = torch.where(j < per_token[..., None, None], dest, torch.full_like(dest, length))
    return _StreamLayout(select, per_token, length, dest)


def pack_variable(idx: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """Codes idx (B, H, S, d) of per-(trial, head, coordinate) widths (B, H, d) -> uint8 (B, bytes)."""
    b, h, s, d = idx.shape
    layout = _layout(widths, s)
    if layout.length == 0:
        return torch.zeros(b, 0, dtype=torch.uint8, device=idx.device)
    planes = _PLANES.to(device=idx.device, dtype=torch.uint8)
    bits = ((idx.to(torch.uint8).unsqueeze(-1) >> planes) & 1).reshape(b, h, s, d * MAX_BITS)
    token_bits = bits.gather(-1, layout.select.unsqueeze(2).expand(-1, -1, s, -1))   # (B, H, S, T_max)
    if layout.dest is None:
        stream = token_bits.reshape(b, -1)
    else:
        stream = torch.zeros(b, layout.length + 1, dtype=torch.uint8, device=idx.device)
        stream.scatter_(-1, layout.dest.reshape(b, -1), token_bits.reshape(b, -1))
        stream = stream[:, :layout.length]
    return pack_bits(stream, 1)


def unpack_variable(packed: torch.Tensor, widths: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """Inverse of pack_variable: int64 codes (B, H, S, d)."""
    b, h, d = widths.shape
    layout = _layout(widths, n_tokens)
    if layout.length == 0:
        return torch.zeros(b, h, n_tokens, d, dtype=torch.int64, device=widths.device)
    stream = unpack_bits(packed, 1, layout.length).to(torch.uint8)
    if layout.dest is None:
        token_bits = stream.reshape(b, h, n_tokens, -1)
    else:
        stream = torch.cat((stream, torch.zeros_like(stream[:, :1])), -1)
        token_bits = stream.gather(-1, layout.dest.reshape(b, -1)).reshape(layout.dest.shape)
    bits = torch.zeros(b, h, n_tokens, d * MAX_BITS, dtype=torch.uint8, device=widths.device)
    # Positions past T[b, h] in `select` are bits outside every code; token_bits holds 0 there.
    bits.scatter_(-1, layout.select.unsqueeze(2).expand(-1, -1, n_tokens, -1), token_bits)
    bits = bits.reshape(b, h, n_tokens, d, MAX_BITS)
    idx = torch.zeros(b, h, n_tokens, d, dtype=torch.uint8, device=widths.device)
    for position in range(MAX_BITS):
        idx = idx | (bits[..., position] << (MAX_BITS - 1 - position))
    return idx.to(torch.int64)


# --- widths in {0, 2, 4, 6, 8} per (trial, component): Shard's coefficient stream of 2-bit digits ---
def pack_mixed(codes: list[torch.Tensor], widths: list[list[int]]) -> torch.Tensor:
    """Per trial b: codes[b] (n, r) unsigned, component j of widths[b][j] ∈ {0, 2, 4, 6, 8} bits.
    Every width is a multiple of 2, so a trial's row is the concatenation of its codes' 2-bit
    digits (most significant first); rows are padded to the batch's longest, packed 4 digits a
    byte: uint8 (B, n, ceil(max_digits/4))."""
    rows = []
    for c, w in zip(codes, widths):
        digits = []
        for j, width in enumerate(w):
            for shift in range(width - 2, -1, -2):
                digits.append((c[:, j] >> shift) & 3)
        rows.append(torch.stack(digits, -1) if digits else c.new_zeros(c.shape[0], 0))
    longest = max(r.shape[-1] for r in rows)
    rows = [torch.nn.functional.pad(r, (0, longest - r.shape[-1])) for r in rows]
    return pack_bits(torch.stack(rows), 2)


def mixed_exact_bits(widths: list[list[int]], n_rows: int, device) -> torch.Tensor:
    """Bits each trial's own rows occupy in pack_mixed's format (whole bytes per row), (B,):
    the ledger's per-trial count, free of the batch's padding."""
    return torch.tensor([n_rows * ((sum(w) // 2 + 3) // 4) * 8 for w in widths], device=device)


def unpack_mixed(packed: torch.Tensor, widths: list[list[int]]) -> list[torch.Tensor]:
    """Inverse of pack_mixed: per trial codes (n, r) int64 (0 where the width is 0)."""
    out = []
    longest = max(sum(w) // 2 for w in widths)
    digits = unpack_bits(packed, 2, longest) if longest else None
    for b, w in enumerate(widths):
        codes = torch.zeros(packed.shape[1], len(w), dtype=torch.int64, device=packed.device)
        pos = 0
        for j, width in enumerate(w):
            for _ in range(width // 2):
                codes[:, j] = (codes[:, j] << 2) | digits[b, :, pos]
                pos += 1
        out.append(codes)
    return out
