"""The survey's baselines: group quantisation, KIVI, H2O, StreamingLLM and low-rank SVD.

Shapes: k, v (B, H, S, d); q (B, H, Nq, d); logits (B, H, Nq, S). Every stored float is fp16
after a per-trial power-of-two shift (schemes/fp16.py): ordinary data (|x| in [2^-8, 2^14]) gets
shift 0 and is stored as plain fp16, bit for bit; 1e30- or 1e-30-sized data is shifted
exactly into range first (fp16 overflows at 65504). The int16 shift is stored and counted.

Budget semantics (ISSUE 5): `int8`/`int4` have their width in the name and ignore the
budget (the ledger reports the truth, 8 or 4 bits plus scales); `kivi` quantises at
`budget` bits; the eviction (`h2o`, `streaming`) and low-rank (`svd`) schemes store about
budget/16 of the fp16 cache, so every family is compared at equal measured storage.

Ledger (DESIGN.md `bits`): all per cache. Every stored tensor (codes, group minima and scales,
KIVI's per-channel scales, fp16 tokens, kept indices, SVD factors, shifts) is a function of the
cache's own tokens; nothing data-independent is stored, so no baseline has model bits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .base import Encoded, PerTensorScheme, Scheme
from .fp16 import half_shift, shift_down, shift_up
from .packing import pack_bits, unpack_bits
from .registry import register_variant
from kvcommon.threads import small_linalg

# --- asymmetric uniform group quantisation along the last dim ----------------------------
def _pad_last(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """Pad the last dim to a multiple by repeating its last entry (group min/max unchanged)."""
    n = x.shape[-1]
    extra = -n % multiple
    if extra == 0 or n == 0:
        return x
    return torch.cat((x, x[..., -1:].expand(*x.shape[:-1], extra)), dim=-1)


@dataclass(frozen=True)
class GroupCodes:
    """codes: packed uint8 (..., ceil(n_pad·bits/8)); minimum, scale: fp16 (..., n_pad/group)."""
    codes: torch.Tensor
    minimum: torch.Tensor
    scale: torch.Tensor


def quantize_groups(x: torch.Tensor, bits: int, group: int) -> GroupCodes:
    """Asymmetric uniform quantisation of x (..., n) in groups of `group` along the last dim:
    x ≈ code·scale + min, code in 0..2^bits−1, scale = (max − min)/(2^bits − 1), stored fp16.
    x must already be in fp16 range (see half_shift). A constant group has scale 0 and
    decodes to its minimum exactly (no division by zero)."""
    levels = (1 << bits) - 1
    padded = _pad_last(x, group)
    grouped = padded.reshape(*padded.shape[:-1], -1, group)
    lo = grouped.amin(-1, keepdim=True).half()
    hi = grouped.amax(-1, keepdim=True)
    scale = ((hi - lo.to(x.dtype)) / levels).half()
    scale_w = scale.to(x.dtype)
    safe = torch.where(scale_w > 0, scale_w, torch.ones_like(scale_w))
    codes = torch.round((grouped - lo.to(x.dtype)) / safe).clamp_(0, levels)
    codes = torch.where(scale_w > 0, codes, torch.zeros_like(codes))
    flat = codes.reshape(padded.shape).to(torch.int64)
    return GroupCodes(pack_bits(flat, bits), lo.squeeze(-1), scale.squeeze(-1))


def dequantize_groups(gc: GroupCodes, bits: int, group: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of quantize_groups: (..., n) in dtype."""
    n_pad = gc.minimum.shape[-1] * group
    codes = unpack_bits(gc.codes, bits, n_pad).to(dtype)
    grouped = codes.reshape(*codes.shape[:-1], -1, group)
    x = grouped * gc.scale.to(dtype)[..., None] + gc.minimum.to(dtype)[..., None]
    return x.reshape(*codes.shape[:-1], n_pad)[..., :n]


def _store_groups(enc: Encoded, prefix: str, gc: GroupCodes) -> None:
    enc.codes[f"{prefix}.codes"] = gc.codes
    enc.codes[f"{prefix}.min"] = gc.minimum
    enc.codes[f"{prefix}.scale"] = gc.scale


def _load_groups(enc: Encoded, prefix: str) -> GroupCodes:
    return GroupCodes(enc.codes[f"{prefix}.codes"], enc.codes[f"{prefix}.min"], enc.codes[f"{prefix}.scale"])


def _check_positive(name: str, value: int, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: {what}={value!r} must be a positive integer")


# --- int8 / int4 -----------------------------------------------------------------------
@dataclass
class GroupQuant(PerTensorScheme):
    """Group-wise asymmetric uniform quantisation of every token vector along d, `width` bits,
    fp16 min and scale per group of `group_size` channels. The budget is ignored: the width
    is the scheme's name (int8, int4)."""
    width: int = 8
    group_size: int = 32

    def validate(self) -> None:
        super().validate()
        _check_positive(self.name, self.group_size, "group_size")

    def encode_tensor(self, x, prefix, enc):
        shift = half_shift(x)
        enc.codes[f"{prefix}.shift"] = shift
        _store_groups(enc, prefix, quantize_groups(shift_down(x, shift), self.width, self.group_size))

    def decode_tensor(self, enc, prefix):
        d = enc.shape[-1]
        return shift_up(dequantize_groups(_load_groups(enc, prefix), self.width, self.group_size, d, enc.dtype),
                        enc.codes[f"{prefix}.shift"])


# --- KIVI ------------------------------------------------------------------------------
@dataclass
class Kivi(PerTensorScheme):
    """KIVI (arXiv 2402.02750): K quantised per channel in groups of `group_size` tokens, V
    per token in groups of `group_size` channels, both at `budget` bits; the most recent
    `residual` tokens stay fp16. A last, partial token group of K is padded by repeating its
    last token (the padding codes are stored and counted)."""
    group_size: int = 32
    residual: int = 32

    def validate(self) -> None:
        super().validate()
        _check_positive(self.name, self.group_size, "group_size")
        if isinstance(self.residual, bool) or not isinstance(self.residual, int) or self.residual < 0:
            raise ValueError(f"{self.name}: residual={self.residual!r} must be a non-negative integer")

    def _split(self, s: int) -> int:
        """Number of quantised (oldest) tokens."""
        return max(0, s - self.residual)

    def encode_tensor(self, x, prefix, enc):
        n_q = self._split(x.shape[2])
        shift = half_shift(x)
        xs = shift_down(x, shift)
        enc.codes[f"{prefix}.shift"] = shift
        enc.codes[f"{prefix}.residual"] = xs[:, :, n_q:].half()
        if n_q:
            old = xs[:, :, :n_q]
            # K: per-channel groups over tokens (KIVI §3.2), i.e. quantise K^T along tokens
            target = old.transpose(-1, -2) if prefix == "k" else old
            _store_groups(enc, prefix, quantize_groups(target, self.budget, self.group_size))

    def decode_tensor(self, enc, prefix):
        _, _, s, d = enc.shape
        n_q = self._split(s)
        parts = []
        if n_q:
            n = n_q if prefix == "k" else d
            old = dequantize_groups(_load_groups(enc, prefix), self.budget, self.group_size, n, enc.dtype)
            parts.append(old.transpose(-1, -2) if prefix == "k" else old)
        parts.append(enc.codes[f"{prefix}.residual"].to(enc.dtype))
        return shift_up(torch.cat(parts, dim=2), enc.codes[f"{prefix}.shift"])


# --- eviction: streaming and H2O ---------------------------------------------------------
def kept_tokens(s: int, budget: int) -> int:
    """Tokens an eviction scheme keeps at budget b: round(S·b/16), at least 1 (b/16 of fp16)."""
    return max(1, min(s, round(s * budget / 16)))


@dataclass
class Eviction(Scheme):
    """Keeps a subset of tokens in fp16 and evicts the rest. `kept` names the kept tokens;
    attention over the cache is the softmax over them alone, as a real evicting cache computes
    it (stats.metrics). Evicted tokens decode to zero, so `score` (q·k̂ᵀ/√d) gives them the
    logit 0, which that softmax never reads."""

    def kept_index(self, k: torch.Tensor, enc: Encoded) -> torch.Tensor:
        """Kept token positions (B, H, n_keep), ascending; may store what it needs in enc."""
        raise NotImplementedError

    def stored_index(self, enc: Encoded) -> torch.Tensor:
        raise NotImplementedError

    def encode(self, k, v):
        enc = Encoded(tuple(k.shape), k.dtype)
        self.store_kept(enc, k, v, self.kept_index(k, enc))
        return enc

    @staticmethod
    def store_kept(enc: Encoded, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor) -> None:
        """Store the tokens at idx (B, H, n_keep) of k and v in fp16 after a per-trial shift."""
        gather_idx = idx[..., None].expand(-1, -1, -1, k.shape[-1])
        for prefix, x in (("k", k), ("v", v)):
            shift = half_shift(x)
            enc.codes[f"{prefix}.shift"] = shift
            enc.codes[f"{prefix}.kept"] = torch.gather(shift_down(x, shift), 2, gather_idx).half()

    def decode(self, enc):
        idx = self.stored_index(enc)
        out = []
        for prefix in ("k", "v"):
            kept = enc.codes[f"{prefix}.kept"].to(enc.dtype)
            full = torch.zeros(enc.shape, dtype=enc.dtype, device=kept.device)
            full.scatter_(2, idx[..., None].expand(-1, -1, -1, enc.shape[-1]), kept)
            out.append(shift_up(full, enc.codes[f"{prefix}.shift"]))
        return tuple(out)

    def kept(self, enc):
        idx = self.stored_index(enc)
        mask = torch.zeros(enc.shape[:3], dtype=torch.bool, device=idx.device)
        return mask.scatter_(2, idx, True)


@dataclass
class Streaming(Eviction):
    """StreamingLLM (arXiv 2309.17453): `n_sinks` attention-sink tokens plus the most recent
    window, fp16; the window is sized so kept tokens = round(S·budget/16). Positions are
    implied by S, so no index is stored."""
    n_sinks: int = 4

    def _index(self, b: int, h: int, s: int, device) -> torch.Tensor:
        n_keep = kept_tokens(s, self.budget)
        sinks = min(self.n_sinks, n_keep)
        idx = torch.cat((torch.arange(sinks), torch.arange(s - (n_keep - sinks), s))).to(device)
        return idx.expand(b, h, -1)

    def kept_index(self, k, enc):
        return self._index(*k.shape[:3], k.device)

    def stored_index(self, enc):
        return self._index(*enc.shape[:3], enc.codes["k.kept"].device)


@dataclass
class HeavyHitter(Eviction):
    """H2O (arXiv 2306.14048): per head keep the `recent` share of the kept tokens as a recent
    window and the rest as heavy hitters — the tokens with the largest attention accumulated
    from an observation window, s_i = Σ_j α_{j,i} (survey §4.1.2). The evaluated queries are
    not the scheme's to see, so the last `n_observe` keys act as the observing queries, as
    H2O's online accumulation over generated tokens does. Each observer attends only to the
    tokens before it (strictly causal): a proxy query equal to its own key would give itself
    the logit ‖k‖²/√d (≈ √d; 8 at d = 64), a self-similarity no real query has, and the
    observation window's own tokens would take every heavy-hitter slot. Kept indices are
    stored (int16/int32, counted)."""
    n_observe: int = 32
    recent: float = 0.5

    def kept_index(self, k, enc):
        b, h, s, d = k.shape
        n_keep = kept_tokens(s, self.budget)
        n_recent = min(s, int(n_keep * self.recent))
        xs = shift_down(k, half_shift(k))            # logits of 1e30-sized keys would overflow
        n_obs = min(self.n_observe, s - 1)           # an observer needs a token before it
        obs_pos = torch.arange(s - n_obs, s, device=k.device)
        logits = xs[:, :, s - n_obs:] @ xs.transpose(-1, -2) / math.sqrt(d)     # (B, H, n_obs, S)
        causal = torch.arange(s, device=k.device)[None, :] < obs_pos[:, None]   # excludes itself
        logits = logits.masked_fill(~causal, float("-inf"))
        score = torch.softmax(logits, dim=-1).sum(-2)                            # (B, H, S)
        score[..., s - n_recent:] = float("inf")                                 # the recent window
        idx = torch.topk(score, n_keep, dim=-1, sorted=False).indices.sort(-1).values
        dtype = torch.int16 if s <= torch.iinfo(torch.int16).max else torch.int32
        enc.codes["index"] = idx.to(dtype)
        return idx

    def stored_index(self, enc):
        return enc.codes["index"].to(torch.int64)


# --- low-rank SVD ------------------------------------------------------------------------
def svd_rank(s: int, d: int, budget: int) -> int:
    """Rank r with 16·r·(S + d) ≈ budget·S·d bits per (trial, head) tensor, within 0..min(S, d)."""
    return max(0, min(s, d, (budget * s * d) // (16 * (s + d))))


@dataclass
class LowRankSVD(PerTensorScheme):
    """Per (trial, head) truncated SVD X ≈ A Wᵀ (Eckart–Young): fp16 coefficients A (S, r) and
    basis W (d, r), r from the budget (svd_rank)."""

    def encode_tensor(self, x, prefix, enc):
        b, h, s, d = x.shape
        r = svd_rank(s, d, self.budget)
        # a coefficient is at most the token's norm ≤ √d·peak: scale by that bound (in float64,
        # so the bound itself cannot overflow), not the peak, or fp16 coefficients overflow
        bound = x.abs().amax(dim=(-1, -2)).double() * math.sqrt(d)
        shift = half_shift(bound, n_lead=2)
        xs = shift_down(x, shift)
        with small_linalg():
            _, _, vh = torch.linalg.svd(xs, full_matrices=False)
        basis = vh[..., :r, :].transpose(-1, -2).half()                    # (B, H, d, r), |entries| <= 1
        coeff = (xs @ basis.to(x.dtype)).half()                           # (B, H, S, r)
        enc.codes.update({f"{prefix}.shift": shift, f"{prefix}.basis": basis, f"{prefix}.coeff": coeff})

    def decode_tensor(self, enc, prefix):
        return shift_up(enc.codes[f"{prefix}.coeff"].to(enc.dtype) @ enc.codes[f"{prefix}.basis"].to(enc.dtype)
                        .transpose(-1, -2), enc.codes[f"{prefix}.shift"])


# --- registration ------------------------------------------------------------------------
_BASELINES = [
    ("int8", GroupQuant, "int8 group-wise asymmetric uniform quantisation (group 32 along d, fp16 min/scale)",
     {"width": 8}),
    ("int4", GroupQuant, "int4 group-wise asymmetric uniform quantisation (group 32 along d, fp16 min/scale)",
     {"width": 4}),
    ("kivi", Kivi, "KIVI: per-channel K / per-token V quantisation at b bits, fp16 residual of 32 recent tokens",
     {}),
    ("h2o", HeavyHitter, "H2O heavy-hitter eviction: keep b/16 of tokens (heavy hitters + recent window) in fp16",
     {}),
    ("streaming", Streaming, "StreamingLLM: 4 fp16 sink tokens + a recent fp16 window, b/16 of tokens kept", {}),
    ("svd", LowRankSVD, "per-head truncated SVD, fp16 basis and coefficients, rank from the budget", {}),
]

for _name, _cls, _doc, _fixed in _BASELINES:
    register_variant(_name, _cls, _doc, **_fixed)
