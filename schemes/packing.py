"""Bit packing of 1–8-bit integer codes into uint8 bytes, batched over leading dims.

Codes (..., n) with values in [0, 2**width) become bytes (..., ceil(n*width/8)), big-endian:
the first code occupies the most significant bits of the first byte. Each row is padded
separately so a row (one token's vector) stays addressable on its own. Widths that divide 8
(1, 2, 4, 8) are packed byte by byte; the others in groups of eight codes, which are exactly
`width` bytes: byte j of a group is the OR of the (at most three) codes overlapping its bits,
each shifted into place. Everything stays in uint8 (no int64 words), so every width costs
about the same.

Two formats of codes of varying width: `pack_variable` (a width per trial, head and
coordinate: SpectralQuant's water-filled codes, one bit stream per trial, built byte-wise) and `pack_mixed` (a
width in {0, 2, 4, 6, 8} per trial and component: Shard's coefficients, as 2-bit digits).
"""
from __future__ import annotations


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
def _code_offsets(widths: torch.Tensor, n_tokens: int) -> tuple[torch.Tensor, int]:
    """Bit offset of every code in its trial's stream, (B, H, S, d), and the longest stream's
    length in bits. A trial's stream is head after head, token after token, each token its
    coordinates' codes in order (the low w bits of each, most significant first), no padding:
    code i of token s of head h starts at head_start[b, h] + s·T[b, h] + Σ_{j<i} w_j, with
    T[b, h] = Σ_j w_j the token's bits."""
    w = widths.to(torch.int64)
    per_token = w.sum(-1)                                                            # (B, H)
    head_bits = per_token * n_tokens
    length = int(head_bits.sum(-1).max()) if head_bits.numel() else 0
    dtype = torch.int32 if length + 16 < 2 ** 31 else torch.int64                  # halves the traffic
    token_start = (torch.cumsum(head_bits, -1) - head_bits).unsqueeze(-1) \
        + torch.arange(n_tokens, device=w.device) * per_token.unsqueeze(-1)         # (B, H, S)
    within = torch.cumsum(w, -1) - w                                                 # (B, H, d)
    return token_start.to(dtype).unsqueeze(-1) + within.to(dtype).unsqueeze(2), length


def _byte_fields(offsets: torch.Tensor, widths: torch.Tensor, row_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each code: the index of the first of the two bytes it touches in the flattened
    (B, row_bytes) stream, and the left shift that puts the code in place in the big-endian
    16-bit window of those two bytes (a code of ≤ 8 bits starting at bit r < 8 of a byte ends
    within the next one)."""
    b = offsets.shape[0]
    rows = (torch.arange(b, device=offsets.device, dtype=offsets.dtype) * row_bytes).view(b, 1, 1, 1)
    shift = 16 - (offsets & 7) - widths.to(offsets.dtype).unsqueeze(2)
    return ((offsets >> 3) + rows).reshape(-1).to(torch.int64), shift


def _block_fields(idx: torch.Tensor, widths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """pack_variable's byte indices and shifted codes (flat) and stream bytes n, for S a multiple of
    8: then every block of 8 tokens of a head starts on a byte (8·T bits, T the token's bits) and
    has the same layout, so a code's bit offset is the block's first byte (B, H, S/8) plus its place
    in the block (B, H, 8, d): the same fields as _code_offsets and _byte_fields give, from two
    small tables and one broadcast sum."""
    b, h, s, d = idx.shape
    w = widths.to(torch.int64)
    per_token = w.sum(-1)                                                            # (B, H) bits
    head_bits = per_token * s
    length = int(head_bits.sum(-1).max()) if head_bits.numel() else 0
    n = (length + 7) // 8
    dtype = torch.int32 if b * (n + 2) < 2 ** 31 else torch.int64
    inner = torch.arange(8, device=w.device).view(1, 1, 8, 1) * per_token.view(b, h, 1, 1) \
        + (torch.cumsum(w, -1) - w).unsqueeze(2)                                    # (B, H, 8, d) bits in block
    shift = (16 - (inner & 7) - w.unsqueeze(2)).to(torch.int32)
    first = (torch.arange(b, device=w.device) * (n + 2)).view(b, 1, 1) + ((torch.cumsum(head_bits, -1) - head_bits) // 8
             ).unsqueeze(-1) + torch.arange(s // 8, device=w.device) * per_token.unsqueeze(-1)   # (B, H, S/8) bytes
    where = (first.to(dtype).view(b, h, s // 8, 1, 1) + (inner >> 3).to(dtype).unsqueeze(2)).reshape(-1)
    field = (idx.reshape(b, h, s // 8, 8, d).to(torch.int32) << shift.unsqueeze(2)).reshape(-1)
    return where, field, n


def pack_variable(idx: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """Codes idx (B, H, S, d) of per-(trial, head, coordinate) widths (B, H, d) -> uint8 (B, bytes):
    each trial's stream (_code_offsets) packed 8 bits a byte, MSB first, zero-padded to the
    batch's longest. Each code is added, as its high and low byte, into the two bytes it spans:
    the codes' bits never overlap, so the sums are the bitwise ORs."""
    b, h, s, d = idx.shape
    if s % 8 == 0:
        where, field, n = _block_fields(idx, widths)
    else:
        offsets, length = _code_offsets(widths, s)
        n = (length + 7) // 8
        where, shift = _byte_fields(offsets, widths, n + 2)      # 2 spare bytes: a 0-bit code may start at bit `length`
        field = (idx.to(offsets.dtype) << shift).reshape(-1)
    if n == 0:
        return torch.zeros(b, 0, dtype=torch.uint8, device=idx.device)
    stream = torch.zeros(b * (n + 2), dtype=field.dtype, device=idx.device)
    stream.index_add_(0, where, field >> 8)
    stream.index_add_(0, where + 1, field & 255)
    return stream.view(b, n + 2)[:, :n].to(torch.uint8)


def unpack_variable(packed: torch.Tensor, widths: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """Inverse of pack_variable: int64 codes (B, H, S, d)."""
    b, h, d = widths.shape
    offsets, length = _code_offsets(widths, n_tokens)
    if length == 0:
        return torch.zeros(b, h, n_tokens, d, dtype=torch.int64, device=widths.device)
    stream = torch.cat((packed, packed.new_zeros(b, 2)), 1).to(offsets.dtype).reshape(-1)
    where, shift = _byte_fields(offsets, widths, packed.shape[1] + 2)
    window = ((stream.index_select(0, where) << 8) | stream.index_select(0, where + 1)).view(offsets.shape)
    mask = (1 << widths.to(offsets.dtype)) - 1
    return ((window >> shift) & mask.unsqueeze(2)).to(torch.int64)


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
