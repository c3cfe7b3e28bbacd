"""Shard (Garg & Sathananthan 2026, "Shard — 10x KV cache compression"; seeds/shard-blog.zh.txt).

One layer's cache k, v (B, H, S, d) is split per trial into 4 fp16 sink tokens, a middle
segment and a 64-token fp16 recent window (write-up §7). The middle is compressed:
- K (§5): undo RoPE exactly at the token positions, flatten to (n_mid, H·d), centre,
  randomized SVD of rank `rank` with `n_iter` power iterations (Halko, Martinsson & Tropp
  2011, Alg. 4.4; the write-up uses torch.svd_lowrank(q=192, niter=24)), components in groups
  of 64 (at most half the rank, so every budget has its own allocation: Shard._group_sizes)
  with a DP bit allocation over {0, 2, 4, 6, 8} bits minimising the modelled error
  (group variance / (3·4^b), a dropped group's variance × drop_penalty = 4) under
  `budget` bits per component on average (budget 4 = the write-up's int4 coefficients);
  int8 basis with per-column fp16 scales; symmetric b-bit coefficients in
  [−(2^(b−1)−1), 2^(b−1)−1] ([−7, 7] at 4 bits) with per-component fp16 steps chosen by
  MSE-optimal clipping (coefficient_scales);
- V (§6): normalised Walsh–Hadamard rotation per head, per-channel max-abs normalisation,
  k-means VQ of 4-channel groups with 256 centroids (8-bit indices: 2 bits per element). The
  VQ depends on the cache alone (k-means draws from the RNG family's own stream, not the scheme
  seed), so every budget and both variants code V alike and share one k-means per chunk.
The cache scores through decode (q·k̂ᵀ/√d): the keys carry RoPE again, so a query cannot be
projected onto the coefficients once for all positions.

Decode tokens (§8): `encode_decode_tokens` compresses tokens that arrive after the prefill.
`shard` uses the data-independent randomized Hadamard + Beta Lloyd–Max quantiser (the tq-kv
codec at `decode_bits`): no drift. `shard-pca-decode` projects them on the prefill PCA basis
and VQ codebook, the naive choice whose error grows when the decode distribution drifts.

Ledger (DESIGN.md `bits`): the prefill is all per cache, basis, VQ codebook, scales and means
included (fitted on the cache itself); `shard`'s decode tokens keep the tq-kv split (their
Lloyd–Max codebook and Hadamard signs per model: data-independent), `shard-pca-decode`'s are
per cache (they are read against the prefill's basis and codebook).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from .base import Capabilities, Encoded, Scheme
from .bit_allocation import allocate_bits
from .clipping import coefficient_scales, quantize_symmetric, symmetric_levels
from .fp16 import half_shift, shift_down, shift_up
from .hadamard import check_power_of_two, fwht
from .kmeans import INITS, assign, kmeans
from kvcommon.memo import IdentityMemo
from .packing import mixed_exact_bits, pack_bits, pack_mixed, unpack_bits, unpack_mixed
from .registry import register_variant
from .svd import randomized_svd
from kvcommon.rng import generator
from kvcommon import rope
from kvcommon.rope import DEFAULT_BASE
from .turboquant import TurboQuant

_VQ_CODES = IdentityMemo(2)   # V's VQ codes of the current chunk (Shard._encode_v)


# --- the width of every component, from its group's bits ----------------------------------
def _widths(alloc: tuple[int, ...], sizes: list[int]) -> list[int]:
    return [b for b, size in zip(alloc, sizes) for _ in range(size)]


def _peak_shift(x: torch.Tensor) -> torch.Tensor:
    """Per-trial exponent e (int16) with max|x|·2^−e in [0.5, 1) (0 for all-zero trials)."""
    peak = x.reshape(x.shape[0], -1).abs().amax(-1)
    return torch.frexp(peak)[1].to(torch.int16)


def _store_positions(enc: Encoded, pos: torch.Tensor, start: int) -> None:
    """Store RoPE positions only when they are not the implied start, start+1, ... (a real
    cache knows its tokens' indices; custom positions cost 32 bits a token, counted)."""
    implied = torch.arange(start, start + enc.shape[2], device=pos.device)
    if not torch.equal(pos.to(torch.int64), implied):
        enc.codes["positions"] = pos.to(torch.int32)[None].expand(enc.shape[0], -1).contiguous()


def _load_positions(enc: Encoded, start: int) -> torch.Tensor:
    if "positions" in enc.codes:
        return enc.codes["positions"][0].to(torch.int64)
    device = next(iter(enc.codes.values())).device
    return torch.arange(start, start + enc.shape[2], device=device)


@dataclass(frozen=True)
class Segments:
    n_sinks: int
    n_middle: int
    n_window: int


@dataclass
class Shard(Scheme):
    """PCA on RoPE-free K + Hadamard/k-means VQ on V for the middle tokens, fp16 sinks and window."""
    # the tokens' RoPE positions (undone before the PCA), the decode-token codec's rotation signs
    # per trial index (fit's trials), and a path of its own for the tokens after the prefill
    capabilities: ClassVar[Capabilities] = Capabilities(fit_trials=True, positions=True, decode_tokens=True)
    rank: int = 192
    n_iter: int = 24
    oversample: int = 8
    group_components: int = 64
    drop_penalty: float = 4.0
    n_sinks: int = 4
    window: int = 64
    vq_group: int = 4
    vq_centroids: int = 256
    kmeans_iter: int = 25
    kmeans_fit_points: int = 32768   # 128 points per centroid (FAISS trains on <= 256)
    kmeans_init: str = "k-means++"
    decode_bits: int = 4
    rope_base: float = DEFAULT_BASE
    pca_decode: bool = False
    undo_rope: bool = True         # False: PCA on the keys as they are (to measure what undoing RoPE buys)
    trials: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)   # fit's trial indices

    def validate(self) -> None:
        super().validate()
        check_power_of_two(self.dim)
        for name in ("rank", "group_components", "vq_group", "vq_centroids", "kmeans_fit_points", "decode_bits"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{self.name}: {name}={value!r} must be a positive integer")
        for name in ("n_iter", "oversample", "n_sinks", "window", "kmeans_iter"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{self.name}: {name}={value!r} must be a non-negative integer")
        if self.dim < 2 or self.dim % self.vq_group:
            raise ValueError(f"{self.name}: head dimension {self.dim} must be even and a multiple of "
                             f"vq_group={self.vq_group}")
        if self.vq_centroids > 256 or self.decode_bits > 8:
            raise ValueError(f"{self.name}: vq_centroids <= 256 and decode_bits <= 8 (codes are <= 8 bits)")
        if self.kmeans_init not in INITS:
            raise ValueError(f"{self.name}: kmeans_init={self.kmeans_init!r}; valid: {', '.join(INITS)}")
        if not self.drop_penalty > 0:
            raise ValueError(f"{self.name}: drop_penalty={self.drop_penalty} must be positive")

    def segments(self, s: int) -> Segments:
        sinks = min(self.n_sinks, s)
        window = min(self.window, s - sinks)
        return Segments(sinks, s - sinks - window, window)

    @staticmethod
    def _positions(positions, s: int, device) -> torch.Tensor:
        if positions is None:
            return torch.arange(s, device=device)
        positions = torch.as_tensor(positions, device=device)
        if positions.shape != (s,):
            raise ValueError(f"positions must have shape ({s},), got {tuple(positions.shape)}")
        return positions

    # --- K path ---------------------------------------------------------------------------
    def _unrotate(self, k: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return rope.undo_rope(k, pos, base=self.rope_base) if self.undo_rope else k

    def _rank(self, n_mid: int, total: int) -> int:
        return min(self.rank, n_mid, total)

    def _group_sizes(self, r: int) -> list[int]:
        """Component groups of the DP: `group_components` (the write-up's 64) components each, but
        at most r // 2, so that there are at least two. The DP's costs are sums of size × {0, 2, 4,
        6, 8}, steps of 2·g bits for groups of g; one budget step is r bits (one per component).
        With 2·g <= r every budget b reaches a cost in ((b−1)·r, b·r] that b − 1 cannot (exactly
        b·r when the groups are equal), so each budget has an allocation of its own: one group of 64 at H = 1, d = 64 gave b = 3 the
        allocation of b = 2 (and b = 1 nothing). At the write-up's rank 192 the groups stay 64."""
        g = max(1, min(self.group_components, r // 2))
        return [min(g, r - start) for start in range(0, r, g)]

    def _encode_k(self, k_mid: torch.Tensor, pos: torch.Tensor, enc: Encoded) -> None:
        b, h, n, d = k_mid.shape
        total = h * d
        work = torch.float64 if k_mid.dtype == torch.float64 else torch.float32
        flat = self._unrotate(k_mid.to(work), pos).transpose(1, 2).reshape(b, n, total)
        shift = _peak_shift(flat)
        flat = shift_down(flat, shift)
        mean = flat.mean(1).half()                                         # (B, D)
        centred = flat - mean.to(work)[:, None, :]
        r = self._rank(n, total)
        width = min(total, r + self.oversample)
        omega = torch.from_numpy(generator(self.rng, self.seed, "shard", "rsvd").standard_normal((total, width)))
        basis, sv = randomized_svd(centred, r, self.n_iter, omega.to(device=k_mid.device, dtype=work))
        # int8 basis, per-column fp16 scale (write-up §5.4)
        col_scale = (basis.abs().amax(1) / 127).half()                    # (B, r)
        safe = torch.where(col_scale > 0, col_scale, torch.ones_like(col_scale)).to(work)
        basis_q = torch.round(basis / safe[:, None, :]).clamp_(-127, 127).to(torch.int8)
        basis_hat = basis_q.to(work) * col_scale.to(work)[:, None, :]
        coeff = centred @ basis_hat                                          # (B, n, r)
        variance = (sv ** 2 / n).cpu().numpy()
        sizes = self._group_sizes(r)
        bounds = np.cumsum([0] + sizes)
        allocs = [allocate_bits([variance[i, a:z].sum() for a, z in zip(bounds[:-1], bounds[1:])], sizes,
                                self.budget * r, drop_penalty=self.drop_penalty) for i in range(b)]
        widths = [_widths(a, sizes) for a in allocs]
        levels = torch.tensor([[symmetric_levels(w) for w in ws] for ws in widths], dtype=work, device=k_mid.device)
        coeff_scale = coefficient_scales(coeff, levels)
        signed = quantize_symmetric(coeff, coeff_scale.to(work), levels)
        unsigned = (signed + levels[:, None, :]).to(torch.int64)
        enc.codes.update({
            "k.shift": shift, "k.mean": mean, "k.basis": basis_q, "k.basis_scale": col_scale,
            "k.alloc": torch.tensor(allocs, dtype=torch.uint8, device=k_mid.device).reshape(b, len(sizes)),
            "k.coeff_scale": coeff_scale, "k.coeff": pack_mixed(list(unsigned), widths)})
        enc.exact_bits["k.coeff"] = mixed_exact_bits(widths, n, k_mid.device)

    def _basis_hat(self, enc: Encoded, dtype) -> torch.Tensor:
        return enc.codes["k.basis"].to(dtype) * enc.codes["k.basis_scale"].to(dtype)[:, None, :]

    def _k_widths(self, enc: Encoded) -> list[list[int]]:
        r = enc.codes["k.basis"].shape[-1]
        sizes = self._group_sizes(r)
        return [_widths(tuple(row), sizes) for row in enc.codes["k.alloc"].tolist()]

    def _k_from_coeff(self, enc: Encoded, coeff_codes: list[torch.Tensor], pos: torch.Tensor, dtype) -> torch.Tensor:
        """Keys (B, H, n, d) with RoPE from unsigned coefficient codes (per trial (n, r))."""
        b, h, _, d = enc.shape
        widths = self._k_widths(enc)
        levels = torch.tensor([[symmetric_levels(w) for w in ws] for ws in widths], dtype=dtype, device=pos.device)
        signed = torch.stack(coeff_codes).to(dtype) - levels[:, None, :]
        coeff = signed * enc.codes["k.coeff_scale"].to(dtype)[:, None, :]
        flat = enc.codes["k.mean"].to(dtype)[:, None, :] + coeff @ self._basis_hat(enc, dtype).transpose(1, 2)
        flat = shift_up(flat, enc.codes["k.shift"])
        n = flat.shape[1]
        keys = flat.reshape(b, n, h, d).transpose(1, 2)
        return rope.apply_rope(keys, pos, base=self.rope_base) if self.undo_rope else keys

    # --- V path ---------------------------------------------------------------------------
    def _vq_points(self, v_rot: torch.Tensor, shift: torch.Tensor, ch_max: torch.Tensor) -> torch.Tensor:
        b, h, n, d = v_rot.shape
        safe = torch.where(ch_max > 0, ch_max, torch.ones_like(ch_max)).to(torch.float32)
        y = shift_down(v_rot.to(torch.float32), shift) / safe[:, :, None, :]
        return y.reshape(b, h * n * d // self.vq_group, self.vq_group)

    def _index_width(self) -> int:
        return max(1, (self.vq_centroids - 1).bit_length())

    def _encode_v(self, v: torch.Tensor, mid: slice, enc: Encoded) -> None:
        """The VQ codes of V's middle segment v[:, :, mid]. They depend on the cache and the VQ
        options alone, not on the budget or the scheme seed (k-means draws from a stream of the RNG
        family only), so that the budgets and both variants of a sweep code V identically (common
        random numbers: a budget comparison is one of K's coding) and share one k-means per chunk
        of trials (_VQ_CODES, keyed on the very tensor v)."""
        tag = (self.rng, mid.start, mid.stop, self.vq_group, self.vq_centroids, self.kmeans_iter,
               self.kmeans_init, self.kmeans_fit_points)
        codes = _VQ_CODES.get((v,), tag)
        if codes is None:
            v_mid = v[:, :, mid]
            b, h, n, d = v_mid.shape
            v_rot = fwht(v_mid)
            shift = _peak_shift(v_rot)
            ch_max = shift_down(v_rot, shift).abs().amax(2).half()              # (B, H, d), per channel
            points = self._vq_points(v_rot, shift, ch_max)
            fit = kmeans(points, self.vq_centroids, gen=generator(self.rng, 0, "shard", "vq"),
                         n_iter=self.kmeans_iter, init=self.kmeans_init, max_fit_points=self.kmeans_fit_points)
            centroids = fit.centroids.half()
            index, _ = assign(points, centroids.to(torch.float32))
            codes = _VQ_CODES.put((v,), {"v.shift": shift, "v.channel_max": ch_max, "v.centroids": centroids,
                                         "v.index": pack_bits(index.reshape(b, h, n, d // self.vq_group),
                                                              self._index_width())}, tag)
        enc.codes.update(codes)

    def _v_from_index(self, enc: Encoded, packed: torch.Tensor, dtype) -> torch.Tensor:
        b, h, n, groups = packed.shape[0], packed.shape[1], packed.shape[2], self.dim // self.vq_group
        index = unpack_bits(packed, self._index_width(), groups).reshape(b, -1)
        centroids = enc.codes["v.centroids"].to(dtype)
        y = torch.gather(centroids, 1, index[..., None].expand(-1, -1, self.vq_group)).reshape(b, h, n, self.dim)
        y = y * enc.codes["v.channel_max"].to(dtype)[:, :, None, :]
        return fwht(shift_up(y, enc.codes["v.shift"]))

    # --- protocol -------------------------------------------------------------------------
    def encode(self, k: torch.Tensor, v: torch.Tensor, *, positions=None) -> Encoded:
        """k, v (B, H, S, d); positions (S,) the tokens' RoPE positions (default 0..S−1)."""
        b, h, s, d = k.shape
        pos = self._positions(positions, s, k.device)
        seg = self.segments(s)
        enc = Encoded(tuple(k.shape), k.dtype)
        _store_positions(enc, pos, 0)
        mid = slice(seg.n_sinks, seg.n_sinks + seg.n_middle)
        for prefix, x in (("k", k), ("v", v)):
            for part, piece in (("sinks", x[:, :, :seg.n_sinks]), ("window", x[:, :, s - seg.n_window:])):
                shift = half_shift(piece)
                enc.codes[f"{prefix}.{part}"] = shift_down(piece, shift).half()
                enc.codes[f"{prefix}.{part}_shift"] = shift
        if seg.n_middle:
            self._encode_k(k[:, :, mid], pos[mid], enc)
            self._encode_v(v, mid, enc)
        return enc

    def decode(self, enc: Encoded) -> tuple[torch.Tensor, torch.Tensor]:
        _, _, s, _ = enc.shape
        seg = self.segments(s)
        pos = _load_positions(enc, 0)
        middle = {}
        if seg.n_middle:
            coeff = unpack_mixed(enc.codes["k.coeff"], self._k_widths(enc))
            middle["k"] = self._k_from_coeff(enc, coeff, pos[seg.n_sinks:seg.n_sinks + seg.n_middle], enc.dtype)
            middle["v"] = self._v_from_index(enc, enc.codes["v.index"], enc.dtype)
        out = []
        for prefix in ("k", "v"):
            parts = [shift_up(enc.codes[f"{prefix}.sinks"].to(enc.dtype), enc.codes[f"{prefix}.sinks_shift"])]
            if seg.n_middle:
                parts.append(middle[prefix])
            parts.append(shift_up(enc.codes[f"{prefix}.window"].to(enc.dtype), enc.codes[f"{prefix}.window_shift"]))
            out.append(torch.cat(parts, dim=2))
        return tuple(out)

    # --- decode tokens (write-up §8) ------------------------------------------------------
    def fit(self, k_cal: torch.Tensor, v_cal: torch.Tensor, trials: torch.Tensor | None = None) -> "Shard":
        """Nothing to calibrate (the prefill is fitted on the cache itself); trials (B,), the trial
        indices of the batch, go to the decode tokens' TurboQuant codec, which draws its rotation
        signs per trial index (schemes/turboquant.py; default 0..B−1 of the batch)."""
        self.trials = trials
        return self

    def _token_codec(self) -> TurboQuant:
        codec = TurboQuant(budget=self.decode_bits, dim=self.dim, seed=self.seed, rng=self.rng)
        codec.validate()
        return codec.fit(None, None, trials=self.trials)

    def encode_decode_tokens(self, k_new: torch.Tensor, v_new: torch.Tensor, enc: Encoded, *,
                             positions=None) -> Encoded:
        """Compress N tokens generated after the prefill: k_new, v_new (B, H, N, d) with RoPE at
        positions (N,) (default S, S+1, ...). Each token is coded on its own, so the result is
        the same whether they arrive one at a time or together. Returns an Encoded of shape
        (B, H, N, d) whose ledger is the decode segment's storage."""
        if not self.pca_decode:
            return self._token_codec().encode(k_new, v_new)
        b, h, n, d = k_new.shape
        s = enc.shape[2]
        if self.segments(s).n_middle == 0:
            raise ValueError(f"{self.name}: the prefill of {s} tokens has no compressed middle segment "
                             f"(needs more than n_sinks + window = {self.n_sinks + self.window}) to project on")
        pos = self._positions(positions, n, k_new.device) if positions is not None else \
            torch.arange(s, s + n, device=k_new.device)
        work = torch.float64 if k_new.dtype == torch.float64 else torch.float32
        total = h * d
        flat = self._unrotate(k_new.to(work), pos).transpose(1, 2).reshape(b, n, total)
        centred = shift_down(flat, enc.codes["k.shift"]) - enc.codes["k.mean"].to(work)[:, None, :]
        coeff = centred @ self._basis_hat(enc, work)
        widths = self._k_widths(enc)
        levels = torch.tensor([[symmetric_levels(w) for w in ws] for ws in widths], dtype=work, device=k_new.device)
        signed = quantize_symmetric(coeff, enc.codes["k.coeff_scale"].to(work), levels)
        out = Encoded((b, h, n, d), k_new.dtype)
        _store_positions(out, pos, s)
        out.codes["k.coeff"] = pack_mixed(list((signed + levels[:, None, :]).to(torch.int64)), widths)
        out.exact_bits["k.coeff"] = mixed_exact_bits(widths, n, k_new.device)
        points = self._vq_points(fwht(v_new), enc.codes["v.shift"], enc.codes["v.channel_max"])
        index, _ = assign(points, enc.codes["v.centroids"].to(torch.float32))
        out.codes["v.index"] = pack_bits(index.reshape(b, h, n, d // self.vq_group), self._index_width())
        return out

    def decode_decode_tokens(self, dec: Encoded, enc: Encoded) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode tokens (B, H, N, d) from `encode_decode_tokens` (enc: the prefill's Encoded)."""
        if not self.pca_decode:
            return self._token_codec().decode(dec)
        pos = _load_positions(dec, enc.shape[2])
        coeff = unpack_mixed(dec.codes["k.coeff"], self._k_widths(enc))
        prefill_shape = Encoded(dec.shape, dec.dtype, enc.codes)
        k_hat = self._k_from_coeff(prefill_shape, coeff, pos, dec.dtype)
        v_hat = self._v_from_index(enc, dec.codes["v.index"], dec.dtype)
        return k_hat, v_hat


_SHARD_DOC = ("Shard: RoPE-undone PCA on K (DP bits, int8 basis) + Hadamard/k-means VQ on V, fp16 sinks and "
              "window, data-independent Lloyd-Max decode tokens")
_PCA_DECODE_DOC = "Shard with decode tokens projected on the prefill PCA basis and VQ codebook (the naive variant)"
register_variant("shard", Shard, _SHARD_DOC)
register_variant("shard-pca-decode", Shard, _PCA_DECODE_DOC, pca_decode=True)
