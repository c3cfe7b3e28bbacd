"""rope_lowrank: keys low-rank before RoPE, with Llama rotate-half RoPE applied at known positions.

Per trial the layer's keys, flattened to (S, H·d), are k = (√(D/r)·z Uᵀ + noise·ε)/√(1+noise²)
with D = H·d, U a Haar-random (D, r) frame (r = round(rank_fraction·D)) and z, ε standard
normal, so E‖k_head‖² ≈ d; RoPE is then applied per head at positions 0..S−1 (Shard's
observation on Llama-3.1-8B: 192 of 1024 components hold 99.5% of K's energy once RoPE is
undone, while RoPE spreads it). Values are i.i.d. N(0, 1): a flat spectrum. Queries are
drawn independently, q ~ N(0, I/temperature²), and get RoPE at the positions S, S+1, ...
(the tokens that follow the cache).

Decode tokens (n_decode = N > 0) sit at positions S..S+N−1 and drift: their pre-RoPE keys are
√(1−drift)·(a key of the prefill's frame U) + √(drift)·(a key of an independent frame U′, stream
"population-drift"), so their energy moves partly out of the prefill's rank-r subspace (the
drift Shard's write-up §8 warns of) at the same E‖k‖². Their values are i.i.d. N(0, 1) like the
prefill's: a flat spectrum has no subspace to drift from.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvcommon.rope import DEFAULT_BASE, apply_rope, undo_rope
from kvcommon.threads import small_linalg

from . import register
from .base import Scenario, random_orthonormal


def _rope_np(x: np.ndarray, positions: np.ndarray, base: float) -> np.ndarray:
    return apply_rope(torch.from_numpy(x), torch.from_numpy(positions), base=base).numpy()


@register
@dataclass(frozen=True)
class RopeLowRank(Scenario):
    name = "rope_lowrank"
    description = "keys low-rank (rank-r subspace of H·d) before Llama RoPE at positions 0..S-1; flat V"
    rank_fraction: float = 0.1875   # 192 of 1024, the write-up's Llama-3.1-8B layer
    noise: float = 0.05
    rope_base: float = DEFAULT_BASE

    def validate(self):
        super().validate()
        if self.rank_fraction > 1:
            raise ValueError(f"scenario {self.name}: rank_fraction={self.rank_fraction} must be in (0, 1]")

    def rank(self, n_heads: int, dim: int) -> int:
        return max(1, min(n_heads * dim, round(self.rank_fraction * n_heads * dim)))

    def _keys(self, gen_z, gen_noise, frame: np.ndarray, n: int, n_heads: int, dim: int) -> np.ndarray:
        """Pre-RoPE keys (H, n, d) from the planted frame (D, r)."""
        total, r = frame.shape
        flat = np.sqrt(total / r) * gen_z.standard_normal((n, r)) @ frame.T
        flat = (flat + self.noise * gen_noise.standard_normal((n, total))) / np.sqrt(1 + self.noise ** 2)
        return flat.reshape(n, n_heads, dim).transpose(1, 0, 2).copy()

    def draw(self, streams, shape):
        """One trial (float64): k, v (H, S, d); q (H, Nq, d); k_cal, v_cal (H, n_cal, d);
        positions (S,); k_cal is at positions 0..n_cal−1 of its own sequence. With
        shape.n_decode = N > 0 also k_decode, v_decode (H, N, d) and positions_decode (N,); with
        shape.prefill_queries also q_prefill (H, S, d) (and q_prefill_decode), at the tokens' positions."""
        h, s, d, n_cal = shape.n_heads, shape.seq_len, shape.dim, shape.n_calib
        if d % 2:
            raise ValueError(f"scenario {self.name}: head dimension {d} must be even for RoPE")
        frame = random_orthonormal(streams("population"), h * d, self.rank(h, d))
        positions = np.arange(s)
        k = _rope_np(self._keys(streams("k"), streams("k_noise"), frame, s, h, d), positions, self.rope_base)
        k_cal = _rope_np(self._keys(streams("k_cal"), streams("k_cal_noise"), frame, n_cal, h, d),
                         np.arange(n_cal), self.rope_base)
        q = streams("q").standard_normal((h, shape.n_queries, d)) / self.temperature
        q = _rope_np(q, np.arange(s, s + shape.n_queries), self.rope_base)
        out = {"k": k, "v": streams("v").standard_normal((h, s, d)), "q": q, "k_cal": k_cal,
               "v_cal": streams("v_cal").standard_normal((h, n_cal, d)), "positions": positions}
        if shape.n_decode:
            out.update(self._decode_tokens(streams, frame, shape))
        if shape.prefill_queries:  # the cached tokens' own queries, rotated at their positions
            for name, pos in (("q_prefill", positions), ("q_prefill_decode", np.arange(s, s + shape.n_decode))):
                if len(pos):
                    q_own = streams(name).standard_normal((h, len(pos), d)) / self.temperature
                    out[name] = _rope_np(q_own, pos, self.rope_base)
        return out

    def _decode_tokens(self, streams, frame: np.ndarray, shape) -> dict[str, np.ndarray]:
        """k_decode, v_decode (H, N, d) and positions_decode (N,) = S..S+N−1, keys drifted toward
        an independent frame of the same rank (see the module docstring)."""
        h, n, d = shape.n_heads, shape.n_decode, shape.dim
        new_frame = random_orthonormal(streams("population-drift"), h * d, frame.shape[1])
        old_part = self._keys(streams("k_decode"), streams("k_decode_noise"), frame, n, h, d)
        new_part = self._keys(streams("k_decode_drift"), streams("k_decode_drift_noise"), new_frame, n, h, d)
        positions = np.arange(shape.seq_len, shape.seq_len + n)
        keys = np.sqrt(1 - self.drift) * old_part + np.sqrt(self.drift) * new_part
        return {"k_decode": _rope_np(keys, positions, self.rope_base),
                "v_decode": streams("v_decode").standard_normal((h, n, d)), "positions_decode": positions}


def singular_value_decay(k: np.ndarray, positions: np.ndarray, *, base: float = DEFAULT_BASE) -> dict[str, np.ndarray]:
    """Plot-ready normalised singular values of one trial's keys k (H, S, d) flattened to
    (S, H·d): {"rope_applied": σ/σ_1, "rope_undone": σ/σ_1}, each of length min(S, H·d)."""
    out = {}
    for label, keys in (("rope_applied", k),
                        ("rope_undone", undo_rope(torch.from_numpy(k), torch.from_numpy(positions), base=base).numpy())):
        flat = keys.transpose(1, 0, 2).reshape(keys.shape[1], -1)
        with small_linalg():
            sv = np.linalg.svd(flat, compute_uv=False)
        out[label] = sv / sv[0]
    return out


def components_for_energy(sv: np.ndarray, share: float = 0.995) -> int:
    """How many leading singular values hold `share` of the Frobenius energy Σσ²."""
    energy = np.cumsum(sv ** 2) / np.sum(sv ** 2)
    return int(np.searchsorted(energy, share) + 1)
