"""Seeded NumPy generators with a selectable bit-generator family.

Every random draw in kvharness goes through `generator(family, seed, *labels)`: the
SeedSequence is keyed by the root seed and by labels (scenario, cell, trial, tensor ...),
so a stream depends only on what it is for, never on the order in which streams are made.
The family (PCG64, MT19937, Philox) is an experimental variable the statistics compare.
"""
from __future__ import annotations

import zlib

import numpy as np

RNG_FAMILIES = {"pcg64": np.random.PCG64, "mt19937": np.random.MT19937, "philox": np.random.Philox}


def check_family(family: str) -> None:
    if family not in RNG_FAMILIES:
        raise ValueError(f"unknown RNG family {family!r}; valid: {', '.join(RNG_FAMILIES)}")


def label_key(label: object) -> int:
    """A stable 32-bit integer for a label (crc32 of its text; Python's hash() is salted)."""
    if isinstance(label, int) and not isinstance(label, bool) and label >= 0:
        return label
    return zlib.crc32(str(label).encode())


def seed_sequence(seed: int, *labels: object) -> np.random.SeedSequence:
    return np.random.SeedSequence(entropy=seed, spawn_key=tuple(label_key(x) for x in labels))


def generator(family: str, seed: int, *labels: object) -> np.random.Generator:
    """A fresh Generator of the given family for the stream (seed, *labels)."""
    check_family(family)
    return np.random.Generator(RNG_FAMILIES[family](seed_sequence(seed, *labels)))


def packed_rademacher(gen: np.random.Generator, shape: tuple[int, ...], n: int) -> np.ndarray:
    """Independent ±1 signs (*shape, n) in the form they are stored: one bit each (1 = +1), the
    first sign in the most significant bit, each row of n padded with 0 bits to whole bytes, as
    schemes.packing.pack_bits(width 1) lays them out: uint8 (*shape, ceil(n/8)).

    A uniformly random byte is eight independent fair signs, so the stored form is drawn
    directly (generator bytes): 6x (d = 128 signs) to 17x (a 128×128 matrix) cheaper than drawing
    ±1 values and packing them (measured on the shared 2-core CPU, load 8)."""
    n_bytes = (n + 7) // 8
    count = int(np.prod(shape, dtype=np.int64)) * n_bytes
    packed = np.frombuffer(gen.bytes(count), dtype=np.uint8).reshape(*shape, n_bytes).copy()
    if n % 8:
        packed[..., -1] &= (0xFF << (8 - n % 8)) & 0xFF     # padding bits are 0, as pack_bits leaves them
    return packed
