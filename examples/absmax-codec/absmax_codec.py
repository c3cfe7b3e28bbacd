"""A whole codec in one file: per-token abs-max scale (float32), `budget`-bit mid-rise codes,
published under the entry-point group kvharness.schemes by this directory's pyproject.toml."""
import torch

from schemes.base import PerTensorScheme
from schemes.packing import pack_bits, unpack_bits


class AbsMax(PerTensorScheme):
    """Per-token abs-max scale (float32) and budget-bit mid-rise codes"""
    name = "absmax"
    def encode_tensor(self, x, prefix, enc):
        scale = x.abs().amax(-1, keepdim=True).float()
        unit = x / torch.where(scale > 0, scale, 1).to(x.dtype)            # in [-1, 1]
        codes = ((unit + 1) / 2 * 2 ** self.budget).floor().clamp(0, 2 ** self.budget - 1)
        enc.codes[f"{prefix}.codes"] = pack_bits(codes.to(torch.uint8), self.budget)
        enc.codes[f"{prefix}.scale"] = scale

    def decode_tensor(self, enc, prefix):
        codes = unpack_bits(enc.codes[f"{prefix}.codes"], self.budget, enc.shape[-1]).to(enc.dtype)
        return ((codes + 0.5) / 2 ** self.budget * 2 - 1) * enc.codes[f"{prefix}.scale"].to(enc.dtype)

