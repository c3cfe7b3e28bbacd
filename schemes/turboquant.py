"""The TurboQuant family (arXiv 2504.19874) and its QJL variants, from one grammar.

Each tensor X ∈ {K, V} of shape (B, H, S, d) is coded per token vector x:
  1. store ‖x‖ (float32) and work on u = x/‖x‖;
  2. rotate y = H(s ⊙ u)/√d with random signs s per trial and head (skipped for plain-kv);
  3. quantise every coordinate of y with the Lloyd–Max codebook of the exact Beta marginal
     of a rotated unit vector in R^d (b bits, or b−1 when X is sketched);
  4. optionally sketch the residual e = y − ŷ with 1-bit QJL (an RHT or a dense Rademacher
     projection, m = d) and store ‖e‖ (float32).
Decode adds the QJL correction √(π/2)/m·‖e‖·Pᵀsign(Pe) (arXiv 2406.03482); a QJL-sketched K
scores with the asymmetric estimator ⟨q, k̂_mse⟩ + √(π/2)/m·‖e‖·⟨Pq, sign(Pe)⟩ on the codes,
which equals ⟨q, decode(K)⟩ (the tests check it). Budget 1 on a sketched tensor is a pure
sketch. Names: prefix `tq-` (rotated) or `plain-` (no rotation); before `k`/`v`, `q` marks an
RHT sketch of that tensor, `f` a FULL Rademacher sketch.

Randomness (the signs s, the RHT sketch's signs, the FULL sketch's matrix): drawn per trial and
head, trial b of a batch from the stream (scheme seed, tensor, purpose, trial index), the trial
indices being those given to fit(k_cal, v_cal, trials=...) (the runner passes the cell's trial
indices) or, without them, 0..B−1 of the batch. So the trials of a cell replicate the rotation
and sketch draw, as they replicate the data, and a trial's draw does not depend on which other
trials share its batch. The signs are stored packed (one bit each) with the codes, (B, H, ...).

Ledger (schemes/base.py, DESIGN.md `bits`): per cache the norms, codes, residual norms and
sketches (functions of the cache's tokens); per model the rotation signs, the sketch signs or
matrices and the Lloyd–Max codebooks (data-independent: drawn from the seed or solved from d
and b, the same for every cache of a layer-head; each trial stands for a deployment of its own
and is charged its own draw, d bits per head for signs, d² for a FULL matrix).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from . import hadamard, qjl, scalar_quantizer
from .base import Capabilities, Encoded, PerTensorScheme
from .hadamard import check_power_of_two, rht, rht_inverse
from .lloyd_max import beta_codebook
from .packing import pack_bits, unpack_codes
from .unit_rows import unit_rows
from .registry import register_variant
from kvcommon import compiled
from kvcommon.memo import IdentityMemo
from kvcommon.rng import generator, packed_rademacher

_SKETCH_OF_MARK = {"": None, "q": "rht", "f": "full"}
_SIGNS = IdentityMemo(8)   # a chunk's unpacked rotation signs, sketch projections and sketches
_STAGES = IdentityMemo(16)  # rotations, codes, residuals, dequantised codes of K and V at one budget (12)


@functools.lru_cache(maxsize=1 << 14)
def _trial_signs(rng: str, seed: int, tensor: str, purpose: str, trial: int, rows: tuple[int, ...], dim: int) -> np.ndarray:
    """One trial's packed signs from its stream (TurboQuant.draw_signs), remembered: they are the
    model's constants for that trial (the cells of a sweep, and every call of a benchmark, code the
    same trial indices again), and a fresh stream costs ~45 µs, a fifth of a d = 128 cache's coding
    at 1024 tokens. Read-only: np.stack copies it."""
    drawn = packed_rademacher(generator(rng, seed, tensor, purpose, "trial", trial), rows, dim)
    drawn.flags.writeable = False
    return drawn


def _packed_signs(rng: str, seed: int, tensor: str, purpose: str, trials, rows: tuple[int, ...], dim: int) -> torch.Tensor:
    """The trials' packed signs (B, *rows, ⌈d/8⌉), trial b from _trial_signs (a fresh tensor)."""
    return torch.from_numpy(_stacked_signs(rng, seed, tensor, purpose, tuple(trials), rows, dim).copy())


@functools.lru_cache(maxsize=32)
def _stacked_signs(rng: str, seed: int, tensor: str, purpose: str, trials: tuple[int, ...], rows: tuple[int, ...],
                   dim: int) -> np.ndarray:
    """_trial_signs of the trials, stacked, remembered for the tuple of trials (a cell's, a
    benchmark's: coded again each call). Read-only."""
    drawn = [_trial_signs(rng, seed, tensor, purpose, t, rows, dim) for t in trials]
    stacked = np.stack(drawn) if drawn else np.zeros((0, *rows, (dim + 7) // 8), np.uint8)
    stacked.flags.writeable = False
    return stacked


@functools.lru_cache(maxsize=64)
def _rotation_sign_values(rng: str, seed: int, tensor: str, trials: tuple[int, ...], n_heads: int, dim: int,
                          dtype: torch.dtype) -> torch.Tensor:
    """The trials' rotation signs as ±1 (B, H, d) in dtype, remembered by value for the fused
    encode, which draws them afresh each call (unpacking them anew cost ~0.1 ms of each call's
    ~0.3 ms fixed cost). Shared: read, never written."""
    return unpack_codes(_packed_signs(rng, seed, tensor, "rotation", trials, (n_heads,), dim), 1, dim).to(dtype) * 2 - 1


@dataclass
class TurboQuant(PerTensorScheme):
    """Norm + (optional) randomized Hadamard rotation + Beta Lloyd–Max, with optional QJL sketches."""
    rotate: bool = True
    sketch_k: str | None = None
    sketch_v: str | None = None
    trials: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    def validate(self) -> None:
        super().validate()
        if self.dim < 2:
            raise ValueError(f"head dimension {self.dim} is too small; TurboQuant needs d >= 2")
        if self.rotate or "rht" in (self.sketch_k, self.sketch_v):
            check_power_of_two(self.dim)

    def fit(self, k_cal: torch.Tensor | None, v_cal: torch.Tensor | None,
            trials: torch.Tensor | None = None) -> "TurboQuant":
        """Nothing to calibrate (data-independent); k_cal, v_cal (B, H, n_cal, d) are ignored.
        trials (B,): the trial indices of the batch encode codes next: trial b's signs are drawn
        for index trials[b], so they do not depend on the batch it shares (the runner passes
        them). Without them (trials=None, or no fit at all, as in direct use) encode draws for
        indices 0..B−1 of its batch: every batch position is then a replicate of its own, and
        the same position of two batches gets the same draw."""
        if trials is None:
            self.trials = None
            return self
        trials = torch.as_tensor(trials, dtype=torch.int64).cpu()
        n = k_cal.shape[0] if k_cal is not None else trials.numel()
        if trials.shape != (n,):
            raise ValueError(f"trials must hold one index per calibration trial, shape ({n},); "
                             f"got {tuple(trials.shape)}")
        self.trials = trials
        return self

    def _trial_indices(self, n_trials: int) -> list[int]:
        if self.trials is None:
            return list(range(n_trials))
        if self.trials.numel() != n_trials:
            raise ValueError(f"fitted for {self.trials.numel()} trial indices but asked to encode B = {n_trials} "
                             f"trials; fit with the trial indices of the batch to encode")
        return self.trials.tolist()

    # --- randomness owned by the scheme: a function of (seed, tensor, trial index, head) -----
    def draw_signs(self, tensor: str, purpose: str, trials: list[int], n_heads: int) -> torch.Tensor:
        """Packed ±1 signs, uint8 (B, H, ⌈d/8⌉) (purpose "rotation", "sketch") or (B, H, d, ⌈d/8⌉)
        ("sketch-matrix": row i of head h's P), trial b from the stream (seed, tensor, purpose,
        "trial", trials[b]), its heads one after the other."""
        rows = (n_heads, self.dim) if purpose == "sketch-matrix" else (n_heads,)
        return _packed_signs(self.rng, self.seed, tensor, purpose, trials, rows, self.dim)

    def _store_signs(self, tensor: str, trials: list[int], n_heads: int, enc: Encoded, device,
                     rotation_signs: torch.Tensor | None) -> None:
        """Rotation signs (given: drawn by _rotated) and sketch projection of one tensor, packed one
        bit per sign, stored per trial with the codes and tagged per model."""
        draws = {} if rotation_signs is None else {"rotation_signs": rotation_signs}
        kind = self.sketch_k if tensor == "k" else self.sketch_v
        if kind == "rht":
            draws["sketch_signs"] = self.draw_signs(tensor, "sketch", trials, n_heads)
        elif kind == "full":
            draws["sketch_matrix"] = self.draw_signs(tensor, "sketch-matrix", trials, n_heads)
        for name, packed in draws.items():
            enc.codes[f"{tensor}.{name}"] = packed.to(device)
            enc.model.add(f"{tensor}.{name}")

    def _mse_bits(self, kind: str | None) -> int:
        return self.budget - 1 if kind else self.budget

    @staticmethod
    def _unpack_signs(packed: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
        """±1 (..., n) in dtype from the packed bits (..., ⌈n/8⌉), remembered for the very packed
        tensor (_SIGNS): encode, decode and score of a coding unpack its signs and sketch once."""
        return _SIGNS.get_or_compute((packed,), lambda: unpack_codes(packed, 1, n).to(dtype) * 2 - 1, (n, dtype))

    def _projection(self, enc: Encoded, prefix: str, kind: str, dtype) -> torch.Tensor:
        """The sketch of one tensor: signs (B, H, d) for "rht", the matrix P (B, H, m, d) for "full"."""
        name = "sketch_signs" if kind == "rht" else "sketch_matrix"
        return self._unpack_signs(enc.codes[f"{prefix}.{name}"], self.dim, dtype)

    # --- one tensor -----------------------------------------------------------------------
    def _sketch_of(self, prefix: str) -> str | None:
        return self.sketch_k if prefix == "k" else self.sketch_v

    def coding_key(self, prefix: str) -> tuple:
        """What a tensor's coding depends on besides the tensor: variants with the same seed (one
        family, budget and d: registry.codec_seed) that code it alike share it."""
        trials = None if self.trials is None else tuple(self.trials.tolist())
        return self.rng, self.seed, self.budget, self.dim, self.rotate, self._sketch_of(prefix), trials

    def _stage_tag(self, prefix: str, trials: list[int], *rest) -> tuple:
        """What a stage of the coding of `prefix` depends on besides its input tensors: the rotation
        signs' stream (rng, seed, trial indices) and d; not the sketch kind, so the variants of
        one budget that code a tensor with the same MSE bits (tq-kv and tq-kqv on K; tq-qkv and
        tq-fkv on K) share the rotation, codes and residual (_STAGES), bit for bit."""
        return (type(self), self.rng, self.seed, self.dim, self.rotate, prefix, tuple(trials), *rest)

    def _rotated(self, u: torch.Tensor, prefix: str, trials: list[int]) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(packed rotation signs (B, H, ⌈d/8⌉) or None, y (B, H, S, d)): u rotated with signs drawn
        for the trials, or u itself for plain-kv."""
        if not self.rotate:
            return None, u

        def rotate():
            signs = self.draw_signs(prefix, "rotation", trials, u.shape[1]).to(u.device)
            return signs, rht(u, self._unpack_signs(signs, self.dim, u.dtype).unsqueeze(-2))
        return _STAGES.get_or_compute((u,), rotate, self._stage_tag(prefix, trials, "rotation"))

    def _quantized(self, y: torch.Tensor, prefix: str, trials: list[int], bits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed codes, uint8 codes (B, H, S, d)) of y with the b-bit Beta Lloyd–Max codebook: the
        same as bucketize on its thresholds (schemes/scalar_quantizer.py)."""
        return _STAGES.get_or_compute((y,), lambda: scalar_quantizer.quantize_pack(y, beta_codebook(self.dim, bits).thresholds, bits),
                                  self._stage_tag(prefix, trials, "codes", bits))

    def _residual(self, y: torch.Tensor, codes: torch.Tensor | None, prefix: str, trials: list[int],
                  bits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(e = y − ŷ (B, H, S, d), ‖e‖ float32 (B, H, S)): what the QJL sketch codes."""
        def residual():
            if codes is None:
                return y, torch.linalg.vector_norm(y, dim=-1).to(torch.float32)
            y_hat = beta_codebook(self.dim, bits).tensors(y.device, y.dtype)[0].index_select(
                0, codes.reshape(-1).to(torch.int32)).view(codes.shape)
            e = y - y_hat
            return e, torch.linalg.vector_norm(e, dim=-1).to(torch.float32)
        return _STAGES.get_or_compute((y,) if codes is None else (y, codes), residual,
                                  self._stage_tag(prefix, trials, "residual", bits))

    def _fused_passes(self, device: torch.device, dtype: torch.dtype, kind: str | None):
        """schemes.turboquant_cpu when its fused passes code this tensor with the chain's bits (on
        the CPU in float32/float64, rotated, no sketch or an RHT one; turboquant_cpu.takes), else
        None. They are this module's rht, quantiser and rht_inverse in one: a caller who swaps
        the rotation here (harness.bench's dense-rotation reference) gets the chain, with its swap."""
        if device.type != "cpu" or dtype not in compiled.DTYPES or not self.rotate or \
                kind == "full" or rht is not hadamard.rht or rht_inverse is not hadamard.rht_inverse:
            return None
        from . import turboquant_cpu
        return turboquant_cpu if turboquant_cpu.takes(self.dim, dtype) else None

    def _encode_fused(self, passes, x: torch.Tensor, prefix: str, enc: Encoded, kind: str | None,
                      trials: list[int]) -> None:
        """encode_tensor's entries by the fused CPU pass (the same bits, in the same order)."""
        n_heads, d = x.shape[1], x.shape[3]
        signs = self.draw_signs(prefix, "rotation", trials, n_heads)
        self._store_signs(prefix, trials, n_heads, enc, x.device, signs)
        values = _rotation_sign_values(self.rng, self.seed, prefix, tuple(trials), n_heads, d, x.dtype)
        _SIGNS.put((signs,), values, (d, x.dtype))       # what decode's _unpack_signs of the stored signs gives
        bits = self._mse_bits(kind)
        book = beta_codebook(d, bits) if bits >= 1 else None
        entries = passes.encode(x, values, bits, book, self._projection(enc, prefix, kind, x.dtype) if kind else None)
        enc.codes[f"{prefix}.norm"] = entries["norm"]
        if bits >= 1:
            enc.codes[f"{prefix}.codes"] = entries["codes"]
            enc.side[f"codebook.{bits}bit"] = torch.tensor(book.centroids, dtype=torch.float32)
            enc.model.add(f"codebook.{bits}bit")
        if kind:
            enc.codes[f"{prefix}.residual_norm"], enc.codes[f"{prefix}.sketch"] = entries["residual_norm"], entries["sketch"]

    def encode_tensor(self, x: torch.Tensor, prefix: str, enc: Encoded) -> None:
        kind = self._sketch_of(prefix)
        n_trials, n_heads, _, d = x.shape
        trials = self._trial_indices(n_trials)
        passes = self._fused_passes(x.device, x.dtype, kind)
        if passes is not None:
            self._encode_fused(passes, x, prefix, enc, kind, trials)
            return
        u, norms = unit_rows(x)
        signs, y = self._rotated(u, prefix, trials)
        self._store_signs(prefix, trials, n_heads, enc, x.device, signs)
        enc.codes[f"{prefix}.norm"] = norms.to(torch.float32, copy=True)   # not the shared tensor
        bits = self._mse_bits(kind)
        codes = None
        if bits >= 1:
            enc.codes[f"{prefix}.codes"], codes = self._quantized(y, prefix, trials, bits)
            # one table per width, shared by K and V: stored (and counted) once
            enc.side[f"codebook.{bits}bit"] = torch.tensor(beta_codebook(d, bits).centroids, dtype=torch.float32,
                                                           device=x.device)
            enc.model.add(f"codebook.{bits}bit")
        if kind:
            residual, enc.codes[f"{prefix}.residual_norm"] = self._residual(y, codes, prefix, trials, bits)
            proj = self._projection(enc, prefix, kind, x.dtype)
            enc.codes[f"{prefix}.sketch"] = pack_bits((qjl.project(residual, kind, proj) >= 0).to(torch.uint8), 1)

    def _rotation(self, enc: Encoded, prefix: str, dtype) -> torch.Tensor:
        """The rotation signs (B, H, 1, d), broadcast over the tokens."""
        return self._unpack_signs(enc.codes[f"{prefix}.rotation_signs"], self.dim, dtype).unsqueeze(-2)

    def _mse_part(self, enc: Encoded, prefix: str, kind: str | None) -> torch.Tensor:
        """ŷ, the rotated-domain MSE reconstruction of the unit vectors (B, H, S, d)."""
        bits = self._mse_bits(kind)
        b, h, s, d = enc.shape
        if bits < 1:
            return torch.zeros(enc.shape, dtype=enc.dtype, device=enc.codes[f"{prefix}.norm"].device)
        packed = enc.codes[f"{prefix}.codes"]
        return _STAGES.get_or_compute((packed,), lambda: scalar_quantizer.dequantize_packed(
            packed, enc.side[f"codebook.{bits}bit"].to(enc.dtype), bits, d), ("decoded", bits, d, enc.dtype))

    def _sketch_signs(self, enc: Encoded, prefix: str) -> torch.Tensor:
        return self._unpack_signs(enc.codes[f"{prefix}.sketch"], self.dim, enc.dtype)

    def decode_tensor(self, enc: Encoded, prefix: str) -> torch.Tensor:
        kind = self._sketch_of(prefix)
        norms = enc.codes[f"{prefix}.norm"]
        passes = self._fused_passes(norms.device, enc.dtype, kind)
        if passes is not None:
            bits = self._mse_bits(kind)
            sketch = (enc.codes[f"{prefix}.sketch"], enc.codes[f"{prefix}.residual_norm"],
                      self._projection(enc, prefix, kind, enc.dtype)) if kind else None
            return passes.decode((*norms.shape, self.dim), enc.dtype, norms,
                                 self._unpack_signs(enc.codes[f"{prefix}.rotation_signs"], self.dim, enc.dtype),
                                 bits, enc.codes.get(f"{prefix}.codes"), enc.side.get(f"codebook.{bits}bit"), sketch)
        y_hat = self._mse_part(enc, prefix, kind)
        if kind:
            proj = self._projection(enc, prefix, kind, enc.dtype)
            r = enc.codes[f"{prefix}.residual_norm"].to(enc.dtype).unsqueeze(-1)
            y_hat = y_hat + qjl.sketch_scale(self.dim) * r * qjl.project_transpose(
                self._sketch_signs(enc, prefix), kind, proj)
        norms = enc.codes[f"{prefix}.norm"].to(enc.dtype)
        if self.rotate:
            return rht_inverse(y_hat, self._rotation(enc, prefix, enc.dtype), scale=norms)
        return y_hat * norms.unsqueeze(-1)

    # --- protocol --------------------------------------------------------------------------
    @property
    def capabilities(self) -> Capabilities:
        """Rotation signs and sketches drawn per trial index (fit's trials); a sketched K scores on its codes."""
        return Capabilities(fit_trials=True, scores_on_codes=self.sketch_k is not None)

    def score(self, q: torch.Tensor, enc: Encoded) -> torch.Tensor:
        if not self.sketch_k:
            return super().score(q, enc)
        return self.memoized_score(q, enc, self._score_on_codes)

    def _score_on_codes(self, q: torch.Tensor, enc: Encoded) -> torch.Tensor:
        # Asymmetric QJL estimator on the codes: q is rotated like the keys, never quantised.
        q_rot = rht(q, self._rotation(enc, "k", q.dtype)) if self.rotate else q
        mse = q_rot @ self._mse_part(enc, "k", self.sketch_k).transpose(-1, -2)
        proj = self._projection(enc, "k", self.sketch_k, q.dtype)
        q_proj = qjl.project(q_rot, self.sketch_k, proj)                                  # (B,H,Nq,m)
        r = enc.codes["k.residual_norm"].to(q.dtype).unsqueeze(-2)                         # (B,H,1,S)
        correction = qjl.sketch_scale(self.dim) * r * (q_proj @ self._sketch_signs(enc, "k").transpose(-1, -2))
        norms = enc.codes["k.norm"].to(q.dtype).unsqueeze(-2)
        return (mse + correction) * norms / math.sqrt(self.dim)


_VARIANTS = {
    "plain-kv": "per-coordinate Beta Lloyd–Max on the raw normalised coordinates, norm stored, no rotation",
    "tq-kv": "RHT rotation + Beta Lloyd–Max codebook on K and V, norm stored",
    "tq-qkv": "tq-kv with a 1-bit QJL residual sketch (RHT projection) on K; b−1 MSE bits on K",
    "tq-fkv": "tq-kv with a 1-bit QJL residual sketch (dense Rademacher projection) on K",
    "tq-kqv": "tq-kv with a 1-bit QJL residual sketch (RHT projection) on V",
    "tq-qkqv": "tq-kv with 1-bit QJL residual sketches (RHT projection) on K and V",
    "tq-kfv": "tq-kv with a 1-bit QJL residual sketch (dense Rademacher projection) on V",
    "tq-fkfv": "tq-kv with 1-bit QJL residual sketches (dense Rademacher projection) on K and V",
}


def _parse(name: str) -> dict:
    """plain-kv / tq-[q|f]k[q|f]v -> constructor options."""
    prefix, body = name.split("-")
    k_mark, v_mark = body.split("k")[0], body.split("k")[1][:-1]
    return {"rotate": prefix == "tq", "sketch_k": _SKETCH_OF_MARK[k_mark], "sketch_v": _SKETCH_OF_MARK[v_mark]}


for _name, _description in _VARIANTS.items():
    register_variant(_name, TurboQuant, _description, family=_name.split("-")[0], **_parse(_name))
