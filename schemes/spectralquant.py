"""The SpectralQuant family (AMD paper §2; SpectralQuant, Dynamis-Labs) from one grammar.

fit(k_cal, v_cal) calibrates, per trial and head and separately for K and V:
  1. C = XᵀX/n of the calibration tokens (float64, after dividing by the largest entry so
     |x| ~ 1e±30 neither overflows nor underflows); d_eff = round(tr(C)²/‖C‖_F²) straight
     from C; the top 2·d_eff + 8 eigenvectors (eigen.leading_basis), completed to a basis of
     R^d by Householder QR, each vector's sign canonical (largest entry positive). The option
     `eigensolver` says how the top block is found: "power", the paper's block power iteration
     (Rayleigh–Ritz after every product, until the leading d_eff + 1 residuals are below
     1e-9·λ_1), or "eigh", LAPACK's exact decomposition; "auto" (the default) takes eigh at
     d ≤ 512, where it is several times faster. The two agree on the leading d_eff + 1 pairs
     to the iteration's tolerance; the rest of the block is exact with eigh and partly
     converged with the iteration, so its coordinates' σ and widths differ slightly. The
     spectral gap at d_eff. A zero or non-finite C (no information) falls back to the
     identity basis and d_eff = d. (The NumPy reference builds the same basis from numpy's eigh
     and QR: the same leading block, completion and signs.)
  2. The basis is stored as int8 with one float32 scale per column (BASIS_BITS = 8); encoder
     and decoder both use Q = QR(dequantised basis), which is exactly orthonormal, so the
     coarse storage costs only a slight misalignment, never an inconsistency.
  3. σ_k, the RMS of coordinate k of the normalised calibration vectors in Q (the scale of a
     Gaussian Lloyd–Max codebook per coordinate), floored at SIGMA_FLOOR·max σ.
  4. Bit widths per coordinate: `sq-*` water-filling of Σ σ_k²·4^(−b_k) with Σ b_k = budget·d,
     b_tail = min(2, budget) ≤ b_k ≤ 8 (σ_k², not the raw eigenvalues, because σ_k² is the
     variance of what is quantised: the distortion of coordinate k is σ_k²·D(b_k), D ∝ 4^(−b));
     `squ-*` budget bits on the d_eff semantic (leading) coordinates and b_tail = min(2, budget)
     on the rest. A QJL-sketched tensor takes one bit from every semantic coordinate
     (b − 1 MSE bits, the paper's "b − 1 MSE bits + 1 sketch bit", §3.2) and spends
     m = 64 sketch bits per token plus a float32 residual norm; at budget 1 the semantic
     coordinates are a pure sketch.
encode(k, v): per token store ‖x‖ (float32), z = Qᵀx/‖x‖, quantise z_k/σ_k with the unit
Gaussian Lloyd–Max codebook of b_k bits. Selective QJL (a `q` before k or v): the residual
e restricted to the d_eff semantic coordinates is sketched as sign(S e), S an m×d matrix of
i.i.d. N(0, 1) entries per trial and head (Gaussian, as QJL Lemma 3.2 needs: ±1 entries over
a handful of semantic coordinates overshoot by 3–4 % at 1–2 bits); trial b's matrices are
drawn from a 63-bit seed of its own (a function of the scheme seed and the trial index given
to fit), stored as an int64 with the codes and redrawn from it by the decoder, so trials are
independent in the sketch draw as well; decode adds √(π/2)/m·‖e‖·Sᵀsign(S e) there. A
sketched K scores on the codes with the paper's asymmetric estimator
    score(q, k) = ‖k‖·(⟨q_Z, ẑ⟩ + √(π/2)/m·‖e‖·⟨S q_Z,sem, sign(S e)⟩)/√d,  q_Z = Qᵀq,
exact (unquantised q) on every coordinate, tail included; it equals q·decode(K)/√d.

Storage (codes, per trial; side, shared): the variable-width codes of all heads and tokens
of a trial as one bit stream (packed, padded to the longest stream in the batch; the per-trial
ledger counts each trial's own stream, and a side codebook only for the trials using its
width, so a trial's bits do not depend on its batch); norms; the int8
basis and its scales; σ (float32); the allocation table (4 bits per coordinate); for
sketched tensors d_eff (int16), the packed sketch, the residual norms and the sketch seed
(int64); side: the unit Gaussian codebooks of the widths in use (float32).
Ledger (DESIGN.md `bits`): per cache the norms, codes, residual norms and sketches (functions
of the cache's tokens); per model the basis and its scales, σ, the allocation table, d_eff,
the sketch seed and the codebooks (fitted on separate calibration tokens, or data-independent:
one set per layer-head, shared by every cache it stores), as the paper's storage formula counts.

Beside the codec: schemes/spectralquant_search.py (the centroid search over all widths at once),
schemes/spectralquant_memos.py (the memos of its stages, shared by the cells of a chunk),
schemes/spectralquant_cpu.py (its fused CPU passes).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from . import qjl
from .base import Capabilities, Encoded, PerTensorScheme, stored_bits
from .eigen import covariance, effective_dimension, leading_basis, resolve_eigensolver, spectral_gap
from .lloyd_max import gaussian_codebook
from kvcommon import compiled
from . import spectralquant_memos as memos
from .packing import MAX_BITS, pack_bits, unpack_bits, unpack_variable
from .registry import register_variant
from .unit_rows import unit_rows
from kvcommon.rng import generator, seed_sequence
from kvcommon.threads import by_matrix
from .waterfill import waterfill

BASIS_BITS = 8
TAIL_BITS = 2
N_PROJECTIONS = 64
SIGMA_FLOOR = 1e-4  # relative to the largest σ of the head: keeps z/σ finite on rank-deficient calibration
_TABLE_BITS = 4     # an allocation-table entry holds a width 0..8


@dataclass
class Calibration:
    """One tensor's fitted state, per trial and head (B, H, ...).

    basis_codes int8 (B, H, d, d) and basis_scale float32 (B, H, d): the stored basis;
    basis float64 (B, H, d, d): Q, its orthonormalisation (columns = coordinates);
    sigma float32 (B, H, d); widths int64 (B, H, d): MSE bits per coordinate;
    d_eff int64 (B, H); eigenvalues float64 (B, H, d), decreasing (power iteration: NaN past its
    block); gap float64 (B, H); iterations int64 (B, H): products the power iteration took (0
    for eigh).
    """
    basis_codes: torch.Tensor
    basis_scale: torch.Tensor
    basis: torch.Tensor
    sigma: torch.Tensor
    widths: torch.Tensor | None
    d_eff: torch.Tensor
    eigenvalues: torch.Tensor
    gap: torch.Tensor
    iterations: torch.Tensor


def _quantise_basis(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per column: u (..., d, d) -> codes int8, scale float32 (..., d)."""
    levels = 2 ** (BASIS_BITS - 1) - 1
    peak = u.abs().amax(-2)
    scale = torch.where(peak > 0, peak / levels, torch.ones_like(peak)).to(torch.float32)
    codes = torch.round(u / scale.to(u.dtype).unsqueeze(-2)).clamp(-levels, levels).to(torch.int8)
    return codes, scale


def _basis_from_codes(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Q = orthonormalised dequantised basis, float64 (..., d, d); the same on encode and decode
    (remembered for the very tensors it was computed from: memos.BASES)."""
    known = memos.BASES.get((codes, scale))
    if known is not None:
        return known
    u = codes.to(torch.float64) * scale.to(torch.float64).unsqueeze(-2)
    q, r = by_matrix(lambda m: tuple(torch.linalg.qr(m)), u)
    signs = torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))
    return memos.BASES.put((codes, scale), q * torch.where(signs == 0, torch.ones_like(signs), signs).unsqueeze(-2))


def _semantic_mask(d_eff: torch.Tensor, d: int) -> torch.Tensor:
    """(B, H, d) bool: the first d_eff coordinates of each head."""
    return torch.arange(d, device=d_eff.device) < d_eff.unsqueeze(-1)



@dataclass
class SpectralQuant(PerTensorScheme):
    """Calibrated eigenbasis + per-coordinate Gaussian Lloyd–Max + water-filling or uniform
    semantic/tail allocation, with optional selective QJL sketches on K and/or V."""
    allocation: str = "waterfill"   # "waterfill" (sq-*) or "uniform" (squ-*)
    sketch_k: bool = False
    sketch_v: bool = False
    n_projections: int = N_PROJECTIONS
    eigensolver: str = "auto"       # "power" (the paper's), "eigh", "auto" (eigh at d <= eigen.EIGH_MAX_DIM)
    calibration: dict[str, Calibration] = field(default_factory=dict, repr=False)
    trials: torch.Tensor | None = field(default=None, repr=False)   # (B,) trial indices of the last fit

    def validate(self) -> None:
        super().validate()
        if self.allocation not in ("waterfill", "uniform"):
            raise ValueError(f"allocation {self.allocation!r}; valid: waterfill, uniform")
        if isinstance(self.n_projections, bool) or not isinstance(self.n_projections, int) or self.n_projections < 1:
            raise ValueError(f"n_projections {self.n_projections!r} must be a positive integer")
        resolve_eigensolver(self.eigensolver, self.dim)

    @property
    def tail_bits(self) -> int:
        return min(TAIL_BITS, self.budget)

    # --- calibration ------------------------------------------------------------------------
    def _check(self, x: torch.Tensor, what: str) -> None:
        if x.dim() != 4 or x.shape[-1] != self.dim:
            raise ValueError(f"{what} must have shape (B, H, n, {self.dim}); got {tuple(x.shape)}")

    def _allocate(self, sigma: torch.Tensor, d_eff: torch.Tensor, sketched: bool) -> torch.Tensor:
        d = self.dim
        semantic = _semantic_mask(d_eff, d)
        if self.allocation == "waterfill":
            widths = waterfill(sigma.to(torch.float64) ** 2, self.budget * d, self.tail_bits)
        else:
            widths = torch.where(semantic, self.budget, self.tail_bits).to(torch.int64)
        if sketched:  # the sketch's bit comes from every semantic coordinate
            widths = widths - semantic.to(torch.int64)
        return widths

    def _calibrate(self, x: torch.Tensor, sketched: bool) -> Calibration:
        """The calibration of x (B, H, n, d): the data-dependent part from the memo when the same
        tensor was calibrated last (the cells of a sweep that share data), widths for this scheme."""
        tag = (self.rng, resolve_eigensolver(self.eigensolver, self.dim))
        shared = memos.CALIBRATIONS.get_or_compute((x,), lambda: self._spectrum(x), tag)
        return replace(shared, widths=self._allocate(shared.sigma, shared.d_eff, sketched))

    def _spectrum(self, x: torch.Tensor) -> Calibration:
        """Everything but the widths: a function of x, the eigensolver and (power iteration) the
        RNG family alone."""
        x64 = x.detach().to(torch.float64)
        peak = x64.abs().amax(dim=(-1, -2), keepdim=True)
        informative = torch.isfinite(peak) & (peak > 0)
        scaled = x64 / torch.where(informative, peak, torch.ones_like(peak))
        cov = covariance(scaled)
        eye = torch.eye(self.dim, dtype=torch.float64, device=x.device).expand_as(cov)
        ok = informative.squeeze(-1) & torch.isfinite(cov).all(-1).all(-1, keepdim=True)    # (B, H, 1)
        cov = torch.where(ok.unsqueeze(-1), cov, eye)
        d_eff = torch.where(ok.squeeze(-1), effective_dimension(cov), torch.full_like(ok.squeeze(-1), self.dim,
                                                                                      dtype=torch.int64))
        values, vectors, iterations = leading_basis(cov, d_eff, self._start_block(x.device),
                                                    solver=resolve_eigensolver(self.eigensolver, self.dim))
        vectors = torch.where(ok.unsqueeze(-1), vectors, eye)
        values = torch.where(ok, values.clamp_min(0), torch.zeros_like(values))
        codes, scale = _quantise_basis(vectors)
        basis = _basis_from_codes(codes, scale)
        u, _ = unit_rows(scaled)
        z = u @ basis
        sigma = torch.sqrt((z * z).mean(-2))
        top = sigma.amax(-1, keepdim=True)
        sigma = torch.where(top > 0, torch.maximum(sigma, SIGMA_FLOOR * top),
                            torch.full_like(sigma, 1 / math.sqrt(self.dim)))
        sigma = sigma.to(torch.float32)
        peak2 = torch.where(informative, peak, torch.ones_like(peak)).squeeze(-1) ** 2
        return Calibration(codes, scale, basis, sigma, None, d_eff, values * peak2, spectral_gap(values, d_eff),
                           iterations)

    def fit(self, k_cal: torch.Tensor, v_cal: torch.Tensor, trials: torch.Tensor | None = None) -> "SpectralQuant":
        """Calibrate on k_cal, v_cal (B, H, n_cal, d): trial b's encoder uses trial b's basis and
        the sketch seed of trial index trials[b] (B,) (default 0..B−1), so trials are independent
        replicates of the codec's randomness too."""
        self._check(k_cal, "k_cal")
        self._check(v_cal, "v_cal")
        b = k_cal.shape[0]
        trials = torch.arange(b) if trials is None else torch.as_tensor(trials, dtype=torch.int64).cpu()
        if trials.shape != (b,):
            raise ValueError(f"trials must hold one index per calibration trial, shape ({b},); got {tuple(trials.shape)}")
        self.trials = trials
        self.calibration = {"k": self._calibrate(k_cal, self.sketch_k), "v": self._calibrate(v_cal, self.sketch_v)}
        return self

    @property
    def d_eff(self) -> dict[str, torch.Tensor]:
        """d_eff (B, H) of the fitted K and V calibrations."""
        return {name: cal.d_eff for name, cal in self.calibration.items()}

    def diagnostics(self) -> dict[str, torch.Tensor]:
        """d_eff and spectral gap of K and V per trial (mean over heads), for the run store."""
        out = {}
        for name, cal in getattr(self, "calibration", {}).items():
            out[f"d_eff_{name}"] = cal.d_eff.double().mean(dim=-1)
            out[f"spectral_gap_{name}"] = cal.gap.double().mean(dim=-1)
        return out

    @property
    def eigenvalues(self) -> dict[str, torch.Tensor]:
        return {name: cal.eigenvalues for name, cal in self.calibration.items()}

    # --- randomness owned by the scheme: sketches a function of (seed, tensor, trial index, head);
    #     the power iteration's start block of the dimension alone ----------------------------------
    def _start_block(self, device) -> torch.Tensor:
        """The power iteration's start block (d, d): the same for every trial, head and scheme
        seed, so that a calibration is a function of the data and can be shared (the memo)."""
        gen = generator(self.rng, 0, "sq-power-start", self.dim)
        return torch.from_numpy(gen.standard_normal((self.dim, self.dim))).to(device)

    def _sketch_seeds(self, tensor: str, device) -> torch.Tensor:
        """The stored 63-bit seeds (B,) int64, one per trial, from which encoder and decoder draw
        the sketches: a function of (scheme seed, tensor, trial index)."""
        seeds = [int(seed_sequence(self.seed, tensor, "sq-sketch", int(t)).generate_state(1, np.uint64)[0]) >> 1
                 for t in self.trials]
        return torch.tensor(seeds, dtype=torch.int64, device=device)

    def _sketch_matrix(self, enc: Encoded, prefix: str, dtype) -> torch.Tensor:
        """S (B, H, m, d), i.i.d. N(0, 1) per trial and head, drawn from the stored seeds (once per
        seeds tensor: encode, decode and score of one cache share the draw, memos.SKETCHES)."""
        seeds = enc.codes[f"{prefix}.sketch_seed"]
        tag = (self.rng, enc.shape[1], self.n_projections, self.dim)
        drawn = memos.SKETCHES.get((seeds,), tag)
        if drawn is None:
            draws = [[generator(self.rng, int(seed), h).standard_normal((self.n_projections, self.dim))
                      for h in range(enc.shape[1])] for seed in seeds.tolist()]
            drawn = memos.SKETCHES.put((seeds,), torch.from_numpy(np.array(draws)).to(seeds.device), tag)
        return drawn.to(dtype)

    # --- one tensor ---------------------------------------------------------------------------
    def coding_key(self, prefix: str) -> tuple:
        """What a tensor's coding depends on besides the tensor and its calibration (coding_tensors):
        variants with the same seed (one family, budget and d) that code it alike share it."""
        trials = None if self.trials is None else tuple(self.trials.tolist())
        sketched = self.sketch_k if prefix == "k" else self.sketch_v
        return (self.rng, self.seed, self.budget, self.dim, self.allocation, sketched, self.n_projections,
                resolve_eigensolver(self.eigensolver, self.dim), trials)

    def coding_tensors(self, prefix: str) -> tuple[torch.Tensor, ...]:
        """The calibration's basis: one object per calibration (memos.CALIBRATIONS), hence per fitted data."""
        return (self.calibration[prefix].basis,) if prefix in self.calibration else ()

    def encode_tensor(self, x: torch.Tensor, prefix: str, enc: Encoded) -> None:
        sketched = self.sketch_k if prefix == "k" else self.sketch_v
        if prefix not in self.calibration:
            raise ValueError("SpectralQuant needs fit(k_cal, v_cal) before encode")
        cal = self.calibration[prefix]
        b, h, s, d = x.shape
        if tuple(cal.widths.shape[:2]) != (b, h):
            raise ValueError(f"fitted on (B, H) = {tuple(cal.widths.shape[:2])} but asked to encode "
                             f"(B, H) = {(b, h)}; fit on calibration data of the same trials")
        norms = memos.fused_unit_rows(x)[1]
        z = memos.coordinates(x, cal.basis)
        sigma = cal.sigma.to(device=x.device, dtype=x.dtype).unsqueeze(-2)
        widths = cal.widths.to(x.device)
        for width in torch.unique(widths).tolist():
            if width:
                key = f"codebook.{width}bit"          # shared by K and V: counted once for a trial using it
                book = enc.side[key] = torch.tensor(gaussian_codebook(width, 1.0).centroids, dtype=torch.float32,
                                                    device=x.device)
                needs = (widths == width).flatten(1).any(-1) * stored_bits(book)                    # (B,)
                enc.exact_bits[key] = torch.maximum(enc.exact_bits.get(key, torch.zeros_like(needs)), needs)
                enc.model.add(key)
        idx, packed = memos.quantised(z, cal.sigma.to(x.device), widths)
        enc.codes[f"{prefix}.norm"] = norms.to(torch.float32, copy=True)   # not the shared tensor
        enc.codes[f"{prefix}.codes"] = packed
        # each trial's own stream, in whole bytes (the batch pads to the longest one)
        enc.exact_bits[f"{prefix}.codes"] = (widths.sum(dim=(-1, -2)) * s + 7) // 8 * 8
        enc.codes[f"{prefix}.basis"] = cal.basis_codes.to(x.device)
        enc.codes[f"{prefix}.basis_scale"] = cal.basis_scale.to(x.device)
        enc.codes[f"{prefix}.sigma"] = cal.sigma.to(x.device)
        enc.codes[f"{prefix}.widths"] = pack_bits(widths.to(torch.uint8), _TABLE_BITS)
        memos.CODES.put((enc.codes[f"{prefix}.codes"], enc.codes[f"{prefix}.widths"]), idx)   # uint8
        enc.model.update(f"{prefix}.{name}" for name in ("basis", "basis_scale", "sigma", "widths"))
        if sketched:
            enc.codes[f"{prefix}.d_eff"] = cal.d_eff.to(device=x.device, dtype=torch.int16)
            enc.codes[f"{prefix}.sketch_seed"] = self._sketch_seeds(prefix, x.device)
            enc.model.update((f"{prefix}.d_eff", f"{prefix}.sketch_seed"))
            z_hat = self._dequantise(enc, idx, widths, sigma, x.dtype)
            cpu = memos.fused_passes(z)
            if cpu is not None and cpu.unit_rows_take(z):  # the selection and the norm in one pass, the same bits
                residual, enc.codes[f"{prefix}.residual_norm"] = cpu.residual(z, z_hat, cal.d_eff)
            else:
                mask = _semantic_mask(cal.d_eff.to(x.device), d).unsqueeze(-2)
                residual = torch.where(mask, z - z_hat, torch.zeros_like(z))
                enc.codes[f"{prefix}.residual_norm"] = torch.linalg.vector_norm(residual, dim=-1).to(torch.float32)
            proj = self._sketch_matrix(enc, prefix, x.dtype)
            sketch = residual @ proj.transpose(-1, -2) >= 0                               # (B, H, S, m)
            enc.codes[f"{prefix}.sketch"] = pack_bits(sketch.to(torch.uint8), 1)

    @staticmethod
    def _codebook_table(enc: Encoded, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, offsets): the concatenation [0, codebook(1 bit), codebook(2 bits), ...] of the
        stored codebooks in dtype, and the position of each width's book in it ((MAX_BITS + 1,)
        int32; 0 for width 0 and for widths not stored)."""
        table = [torch.zeros(1, dtype=dtype, device=device)]
        offsets = torch.zeros(MAX_BITS + 1, dtype=torch.int32, device=device)   # + uint8 codes: int32 indices
        position = 1
        for width in range(1, MAX_BITS + 1):
            key = f"codebook.{width}bit"
            if key in enc.side:
                offsets[width] = position
                table.append(enc.side[key].to(dtype))
                position += 2 ** width
        return torch.cat(table), offsets

    @staticmethod
    def _dequantise(enc: Encoded, idx: torch.Tensor, widths: torch.Tensor, sigma: torch.Tensor, dtype) -> torch.Tensor:
        """ẑ (B, H, S, d): σ_k · centroid; coordinates with 0 bits decode to 0 (the mean).

        One lookup in the concatenation [0, codebook(1 bit), codebook(2 bits), ...] of the
        stored codebooks, at the offset of each coordinate's width. Remembered for the very codes
        and the values of the widths and σ (memos.DEQUANTISED): a sketched coding's encode, decode and
        score, and the codings sharing its codes (memos.quantised), dequantise once."""
        def dequantise() -> torch.Tensor:
            values, offsets = SpectralQuant._codebook_table(enc, dtype, idx.device)
            if compiled.takes(values):   # the same values as the two passes below, in one
                from . import spectralquant_cpu
                return spectralquant_cpu.dequantise_variable(idx, widths, offsets, values, sigma)
            flat = (offsets[widths].unsqueeze(-2) + idx).reshape(-1)
            return values.index_select(0, flat).view(idx.shape) * sigma
        # not the set of stored books: each code reads its own width's book (Gaussian Lloyd–Max, fixed)
        tag = (dtype, *(memos.values_tag(t) for t in (widths.to(torch.uint8), sigma.to(dtype))))
        return memos.DEQUANTISED.get_or_compute((idx,), dequantise, tag)

    def _stored(self, enc: Encoded, prefix: str):
        """(Q (B, H, d, d), widths (B, H, d), σ (B, H, 1, d)) from the stored codes."""
        codes = enc.codes
        basis = _basis_from_codes(codes[f"{prefix}.basis"], codes[f"{prefix}.basis_scale"]).to(enc.dtype)
        widths = unpack_bits(codes[f"{prefix}.widths"], _TABLE_BITS, self.dim)
        return basis, widths, codes[f"{prefix}.sigma"].to(enc.dtype).unsqueeze(-2)

    @staticmethod
    def _codes(enc: Encoded, prefix: str, widths: torch.Tensor) -> torch.Tensor:
        """The stored codes of one tensor, (B, H, S, d): uint8 as encode remembered them (memos.CODES), or
        int64 unpacked from a stream seen for the first time."""
        stream, table = enc.codes[f"{prefix}.codes"], enc.codes[f"{prefix}.widths"]
        known = memos.CODES.get((stream, table))
        return known if known is not None else unpack_variable(stream, widths, enc.shape[2])

    def _z_hat(self, enc: Encoded, prefix: str, sketched: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(ẑ including the QJL correction (B, H, S, d), Q (B, H, d, d))."""
        basis, widths, sigma = self._stored(enc, prefix)
        stream, table = enc.codes[f"{prefix}.codes"], enc.codes[f"{prefix}.widths"]
        cpu = memos.fused_passes(torch.empty(0, dtype=enc.dtype, device=stream.device))
        if memos.CODES.get((stream, table)) is None and cpu is not None and cpu.takes(torch.empty(0, dtype=enc.dtype)):
            # a stream not coded here: read back, looked up and scaled in one pass (the same values)
            values, offsets = self._codebook_table(enc, enc.dtype, stream.device)
            z_hat = cpu.dequantised_stream(stream, widths, enc.shape[2], offsets, values, sigma)
        else:
            z_hat = self._dequantise(enc, self._codes(enc, prefix, widths), widths, sigma, enc.dtype)
        if sketched:
            signs = unpack_bits(enc.codes[f"{prefix}.sketch"], 1, self.n_projections).to(enc.dtype) * 2 - 1
            product = signs @ self._sketch_matrix(enc, prefix, enc.dtype)
            d_eff = enc.codes[f"{prefix}.d_eff"].to(torch.int64)
            cpu = memos.fused_passes(z_hat)
            if cpu is not None and cpu.takes(z_hat):      # product, selection and sum in one pass, the same bits
                return cpu.corrected(z_hat, product, enc.codes[f"{prefix}.residual_norm"],
                                                   qjl.sketch_scale(self.n_projections), d_eff), basis
            mask = _semantic_mask(d_eff, self.dim).unsqueeze(-2)
            r = enc.codes[f"{prefix}.residual_norm"].to(enc.dtype).unsqueeze(-1)
            correction = qjl.sketch_scale(self.n_projections) * r * product
            z_hat = z_hat + torch.where(mask, correction, torch.zeros_like(correction))
        return z_hat, basis

    def decode_tensor(self, enc: Encoded, prefix: str) -> torch.Tensor:
        z_hat, basis = self._z_hat(enc, prefix, self.sketch_k if prefix == "k" else self.sketch_v)
        # scaled in place: the product is a new tensor, so one (B, H, S, d) allocation less, the same values
        return (z_hat @ basis.transpose(-1, -2)).mul_(enc.codes[f"{prefix}.norm"].to(enc.dtype).unsqueeze(-1))

    # --- protocol -----------------------------------------------------------------------------
    def encode(self, k: torch.Tensor, v: torch.Tensor) -> Encoded:
        self._check(k, "k")
        self._check(v, "v")
        return super().encode(k, v)

    @property
    def capabilities(self) -> Capabilities:
        """Sketches drawn per trial index (fit's trials); a sketched K scores on its codes."""
        return Capabilities(fit_trials=True, scores_on_codes=bool(self.sketch_k))

    def score(self, q: torch.Tensor, enc: Encoded) -> torch.Tensor:
        if not self.sketch_k:
            return super().score(q, enc)
        return self.memoized_score(q, enc, self._score_on_codes)

    def _score_on_codes(self, q: torch.Tensor, enc: Encoded) -> torch.Tensor:
        # The asymmetric estimator in z-space (AMD paper eq. 1): q is projected, never quantised.
        basis, widths, sigma = self._stored(enc, "k")
        q_z = q @ basis.to(q.dtype)                                                      # (B, H, Nq, d)
        idx = self._codes(enc, "k", widths)
        mse = q_z @ self._dequantise(enc, idx, widths, sigma.to(q.dtype), q.dtype).transpose(-1, -2)
        mask = _semantic_mask(enc.codes["k.d_eff"].to(torch.int64), self.dim).unsqueeze(-2)
        q_proj = torch.where(mask, q_z, torch.zeros_like(q_z)) @ self._sketch_matrix(enc, "k", q.dtype).transpose(-1, -2)
        signs = unpack_bits(enc.codes["k.sketch"], 1, self.n_projections).to(q.dtype) * 2 - 1
        r = enc.codes["k.residual_norm"].to(q.dtype).unsqueeze(-2)                          # (B, H, 1, S)
        correction = qjl.sketch_scale(self.n_projections) * r * (q_proj @ signs.transpose(-1, -2))
        norms = enc.codes["k.norm"].to(q.dtype).unsqueeze(-2)
        return (mse + correction) * norms / math.sqrt(self.dim)


_VARIANTS = {
    "sq-kv": "SpectralQuant: calibrated per-head K and V eigenbases, per-coordinate Gaussian Lloyd–Max, "
             "water-filling bit allocation",
    "sq-qkv": "sq-kv with selective 1-bit QJL (m=64) on K's d_eff semantic coordinates, asymmetric scores",
    "sq-kqv": "sq-kv with selective 1-bit QJL (m=64) on V's d_eff semantic coordinates",
    "sq-qkqv": "sq-kv with selective 1-bit QJL (m=64) on the semantic coordinates of K and V",
    "squ-kv": "SpectralQuant uniform: b bits on the d_eff semantic coordinates, 2 on the tail, no water-filling",
    "squ-qkv": "squ-kv with selective 1-bit QJL (m=64) on K's d_eff semantic coordinates, asymmetric scores",
    "squ-kqv": "squ-kv with selective 1-bit QJL (m=64) on V's d_eff semantic coordinates",
    "squ-qkqv": "squ-kv with selective 1-bit QJL (m=64) on the semantic coordinates of K and V",
}


def _parse(name: str) -> dict:
    """sq[u]-[q]k[q]v -> constructor options."""
    prefix, body = name.split("-")
    k_mark, v_mark = body.split("k")
    return {"allocation": "uniform" if prefix == "squ" else "waterfill",
            "sketch_k": k_mark == "q", "sketch_v": v_mark == "qv"}


for _name, _description in _VARIANTS.items():
    register_variant(_name, SpectralQuant, _description, family=_name.split("-")[0], **_parse(_name))
