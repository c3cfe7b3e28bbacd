"""Reference SpectralQuant family (AMD paper §2), NumPy, written for clarity.

An independent second implementation of sq-[q]k[q]v and squ-[q]k[q]v: float64 NumPy, one
(trial, head) at a time, with its own exact eigendecomposition (numpy.linalg.eigh), its own
greedy water-filling (a heap of marginal gains), its own Gaussian Lloyd–Max solver (plain
Lloyd iteration), its own bit packing (numpy.packbits) and its own random streams. The codec
it implements is the one schemes/spectralquant.py documents:

  fit, per trial b and head h, for K and V separately:
    C = XᵀX/n (X scaled by its largest entry), eigenvectors by decreasing eigenvalue,
    d_eff = round(tr(C)²/‖C‖_F²) ∈ 1..d; the leading 2·d_eff + 8 (in multiples of 8, at most d)
    completed to a basis of R^d by Householder QR, each column's largest entry positive
    (eigenbasis); a zero or non-finite C gives the identity, d_eff = d;
    basis stored int8 per column (scale = max|column|/127, float32), Q = QR(dequantised);
    σ_k = RMS of coordinate k of the normalised calibration vectors in Q, ≥ 1e-4·max σ;
    widths: sq- greedy water-filling of σ_k²·4^(−b_k), Σ b_k = budget·d,
      min(2, budget) ≤ b_k ≤ 8; squ- budget bits on the d_eff leading coordinates,
      min(2, budget) on the rest; a sketched tensor's semantic coordinates give up one bit.
  encode: norm (float32), z = Qᵀ x/‖x‖, index of the nearest centroid of σ_k·(unit Gaussian
    Lloyd–Max codebook of b_k bits); sketch: sign(S e_sem), S ∈ R^{m×d} i.i.d. N(0, 1) per
    trial and head (columns beyond d_eff unused) drawn from a stored int64 seed per trial, e_sem the residual on
    the semantic coordinates, ‖e_sem‖ (float32).
  decode: ẑ + √(π/2)/m·‖e‖·Sᵀsign(S e) on the semantic coordinates, x̂ = ‖x‖·Q ẑ.
  score (sketched K): ‖k‖·(⟨Qᵀq, ẑ⟩ + √(π/2)/m·‖e‖·⟨S (Qᵀq)_sem, sign(S e)⟩)/√d.

Only the NumPy namespace is supported (no CuPy path).

Who pays for what is stored (Encoded.model): everything fit() derives from the calibration
tokens (basis, its scales, σ, widths, d_eff), the sketch seed and the codebooks is kept once per
layer-head (per model); the norms, code stream, residual norms and sketches are one cache's.
"""
from __future__ import annotations

import functools
import heapq
import math
import re
from dataclasses import dataclass, field

import numpy as np
import torch
from scipy import optimize, stats

from schemes.base import Capabilities, Encoded, Scheme
from kvcommon.rng import generator
from kvcommon.threads import small_linalg

from . import register
from .adapter import to_array, to_tensor

_NAME = re.compile(r"^(?P<family>sq|squ)-(?P<k>q?)k(?P<v>q?)v$")
QJL_SCALE = math.sqrt(math.pi / 2)   # divided by m: QJL Lemma 3.2
MAX_WIDTH = 8
TAIL_WIDTH = 2
PROJECTIONS = 64
SIGMA_FLOOR = 1e-4
PER_CACHE = ("norm", "codes", "residual_norm", "sketch")   # every other stored entry is per model


# --- Gaussian Lloyd–Max by plain Lloyd iteration (Lloyd 1957 / Max 1960) -----------------------
def _lloyd_step(centroids: np.ndarray) -> np.ndarray:
    """One Lloyd iteration for N(0, 1): thresholds at midpoints, centroids at cell means."""
    edges = np.concatenate(([-np.inf], (centroids[1:] + centroids[:-1]) / 2, [np.inf]))
    mass = np.diff(stats.norm.cdf(edges))
    moment = stats.norm.pdf(edges[:-1]) - stats.norm.pdf(edges[1:])   # E[X; a < X < b] = φ(a) − φ(b)
    return moment / mass


@functools.lru_cache(maxsize=None)
def unit_gaussian_codebook(bits: int) -> np.ndarray:
    """Centroids (2**bits,) ascending of the MSE-optimal quantiser of N(0, 1).

    Solves the fixed point c = Lloyd(c) with scipy's hybrid Powell root finder, started at
    the high-resolution optimum (point density ∝ φ^(1/3), i.e. N(0, 3); Panter & Dite 1951);
    plain Lloyd iteration converges far too slowly at 6–8 bits.
    """
    levels = 2 ** bits
    centroids = math.sqrt(3) * stats.norm.ppf((np.arange(levels) + 0.5) / levels)
    solution = optimize.root(lambda c: _lloyd_step(c) - c, centroids, method="hybr", tol=1e-13)
    # converged = a fixed point to 1e-10, whatever hybr's own verdict: its relative-step test at
    # 1e-13 sits at float64's rounding of the cdf differences, and at 8 bits it stops with "not
    # making good progress" at a residual of 4.5e-12 on some CPUs (AMD EPYC, MKL) and not others
    residual = np.max(np.abs(_lloyd_step(solution.x) - solution.x))
    if not (residual <= 1e-10 and np.all(np.diff(solution.x) > 0)):
        raise RuntimeError(f"Gaussian Lloyd–Max did not converge for {bits} bits (fixed-point residual {residual:.3g})")
    centroids = solution.x
    return (centroids - centroids[::-1]) / 2   # exact antisymmetry of an even density


# --- greedy water-filling with a heap ------------------------------------------------------------
def greedy_widths(weights: np.ndarray, total: int, low: int, high: int = MAX_WIDTH) -> np.ndarray:
    """Give each further bit to the coordinate whose next bit lowers Σ λ_k 4^(−b_k) most."""
    widths = np.full(len(weights), low, dtype=np.int64)
    heap = [(-w * 4.0 ** -low * 0.75, low, k) for k, w in enumerate(weights) if low < high]
    heapq.heapify(heap)
    for _ in range(total - low * len(weights)):
        _, level, k = heapq.heappop(heap)
        widths[k] += 1
        if widths[k] < high:
            heapq.heappush(heap, (-weights[k] * 4.0 ** -widths[k] * 0.75, int(widths[k]), k))
    return widths


@dataclass
class _HeadFit:
    basis_codes: np.ndarray   # int8 (d, d)
    basis_scale: np.ndarray   # float32 (d,)
    basis: np.ndarray         # Q float64 (d, d)
    sigma: np.ndarray         # float32 (d,)
    widths: np.ndarray        # int64 (d,)
    d_eff: int
    eigenvalues: np.ndarray


def block_width(d_eff: int, d: int) -> int:
    """Exact eigenvectors the basis keeps: 2·d_eff + 8, rounded up to a multiple of 8, at most d."""
    return min(-(-(2 * d_eff + 8) // 8) * 8, d)


def eigenbasis(vectors: np.ndarray, d_eff: int) -> np.ndarray:
    """The codec's basis (d, d) from the exact eigenvectors (d, d), by decreasing eigenvalue: the
    leading block_width(d_eff) of them, completed to a basis of R^d by Householder QR
    (numpy.linalg.qr, mode "complete"), each column's entry of largest magnitude positive (the
    first one on a tie).

    Not all d eigenvectors: the exact tail of a sample covariance over-fits the calibration
    sample (its variances spread per Marchenko–Pastur), so σ of the smallest ones underestimates
    what fresh tokens put there and their codebooks clip; on lowrank_aligned (d = 64, b = 4) the
    full eigenbasis costs 5 % in K and V error, a different codec from the one documented."""
    d = vectors.shape[0]
    k = block_width(d_eff, d)
    if k < d:
        with small_linalg():
            complete = np.linalg.qr(vectors[:, :k], mode="complete")[0]
        vectors = np.concatenate((vectors[:, :k], complete[:, k:]), axis=1)
    peak = vectors[np.argmax(np.abs(vectors), axis=0), np.arange(d)]
    return vectors * np.where(peak < 0, -1.0, 1.0)[None, :]


def _orthonormal_from_codes(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    with small_linalg():
        q, r = np.linalg.qr(codes.astype(np.float64) * scale.astype(np.float64)[None, :])
    signs = np.sign(np.diag(r))
    return q * np.where(signs == 0, 1.0, signs)[None, :]


def _unit_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    peak = np.max(np.abs(x), axis=-1, keepdims=True)
    peak = np.where(peak > 0, peak, 1.0)
    norm = np.sqrt(np.sum((x / peak) ** 2, axis=-1, keepdims=True))
    return (x / peak) / np.where(norm > 0, norm, 1.0), (peak * norm)[..., 0]


@dataclass
class ReferenceSpectralQuant(Scheme):
    uniform: bool = False
    sketch_k: bool = False
    sketch_v: bool = False
    scheme_name: str = field(default="", repr=False)
    fits: dict = field(default_factory=dict, repr=False)
    trial_ids: list = field(default_factory=list, repr=False)

    @property
    def name(self) -> str:
        return self.scheme_name

    @property
    def d_eff(self) -> dict[str, np.ndarray]:
        return {t: np.array([[f.d_eff for f in row] for row in rows]) for t, rows in self.fits.items()}

    def _sketched(self, tensor: str) -> bool:
        return self.sketch_k if tensor == "k" else self.sketch_v

    def diagnostics(self) -> dict[str, torch.Tensor]:
        """Per trial, the mean over heads of d_eff and of the relative gap (λ_k − λ_{k+1})/λ_1 at
        k = d_eff (λ_{d+1} = 0), for the run store."""
        out = {}
        for tensor, rows in self.fits.items():
            gaps = [[float((np.append(f.eigenvalues, 0.0)[f.d_eff - 1] - np.append(f.eigenvalues, 0.0)[f.d_eff])
                           / f.eigenvalues[0]) if f.eigenvalues[0] > 0 else 0.0 for f in row] for row in rows]
            out[f"d_eff_{tensor}"] = torch.tensor([np.mean([f.d_eff for f in row]) for row in rows], dtype=torch.float64)
            out[f"spectral_gap_{tensor}"] = torch.tensor(np.mean(gaps, axis=1), dtype=torch.float64)
        return out

    # --- calibration -----------------------------------------------------------------------------
    def _fit_head(self, x: np.ndarray, sketched: bool) -> _HeadFit:
        d = self.dim
        peak = np.max(np.abs(x)) if x.size else 0.0
        if np.isfinite(peak) and peak > 0:
            scaled = x / peak
            cov = scaled.T @ scaled / len(scaled)
            with small_linalg():
                values, vectors = np.linalg.eigh(cov)
            values, vectors = values[::-1], vectors[:, ::-1]
            d_eff = int(min(max(round(np.trace(cov) ** 2 / np.sum(cov ** 2)), 1), d))
        else:
            scaled, values, vectors, d_eff = np.zeros((1, d)), np.zeros(d), np.eye(d), d
        vectors = eigenbasis(vectors, d_eff)
        column_peak = np.max(np.abs(vectors), axis=0)
        scale = np.where(column_peak > 0, column_peak / 127, 1.0).astype(np.float32)
        codes = np.clip(np.round(vectors / scale.astype(np.float64)), -127, 127).astype(np.int8)
        basis = _orthonormal_from_codes(codes, scale)
        z = _unit_rows(scaled)[0] @ basis
        sigma = np.sqrt(np.mean(z ** 2, axis=0))
        sigma = np.maximum(sigma, SIGMA_FLOOR * sigma.max()) if sigma.max() > 0 else np.full(d, d ** -0.5)
        sigma = sigma.astype(np.float32)
        tail = min(TAIL_WIDTH, self.budget)
        if self.uniform:
            widths = np.where(np.arange(d) < d_eff, self.budget, tail).astype(np.int64)
        else:
            widths = greedy_widths(sigma.astype(np.float64) ** 2, self.budget * d, tail)
        if sketched:
            widths[:d_eff] -= 1
        return _HeadFit(codes, scale, basis, sigma, widths, d_eff, values * peak ** 2 if peak > 0 else values)

    def fit(self, k_cal: torch.Tensor, v_cal: torch.Tensor, trials=None) -> "ReferenceSpectralQuant":
        """k_cal, v_cal (B, H, n, d): one calibration per trial and head; trial b's sketches are
        drawn for trial index trials[b] (default b)."""
        self.trial_ids = list(range(k_cal.shape[0])) if trials is None else [int(t) for t in trials]
        if len(self.trial_ids) != k_cal.shape[0]:
            raise ValueError(f"trials must hold one index per calibration trial ({k_cal.shape[0]}); "
                             f"got {len(self.trial_ids)}")
        for tensor, x in (("k", k_cal), ("v", v_cal)):
            if x.dim() != 4 or x.shape[-1] != self.dim:
                raise ValueError(f"{tensor}_cal must have shape (B, H, n, {self.dim}); got {tuple(x.shape)}")
            arr = to_array(x, np, "float64")
            self.fits[tensor] = [[self._fit_head(arr[b, h], self._sketched(tensor)) for h in range(arr.shape[1])]
                                 for b in range(arr.shape[0])]
        return self

    def _sketch_seed(self, tensor: str, trial: int) -> int:
        return int(generator(self.rng, self.seed, "reference", "spectralquant", tensor, trial).integers(0, 2 ** 63))

    def _sketch_matrix(self, seed: int, head: int) -> np.ndarray:
        return generator(self.rng, seed, "reference-sketch", head).standard_normal((PROJECTIONS, self.dim))

    # --- one tensor ----------------------------------------------------------------------------
    def _encode_tensor(self, x_torch: torch.Tensor, tensor: str, enc: Encoded) -> None:
        if tensor not in self.fits:
            raise ValueError("SpectralQuant needs fit(k_cal, v_cal) before encode")
        x = to_array(x_torch, np, "float64")
        n_trials, n_heads, n_tokens, d = x.shape
        fits = self.fits[tensor]
        if (len(fits), len(fits[0])) != (n_trials, n_heads):
            raise ValueError(f"fitted on (B, H) = {(len(fits), len(fits[0]))}, asked to encode "
                             f"{(n_trials, n_heads)}; fit on calibration data of the same trials")
        sketched = self._sketched(tensor)
        seeds = [self._sketch_seed(tensor, t) for t in self.trial_ids]
        streams, norms, residual_norms, sketches = [], np.zeros(x.shape[:3]), np.zeros(x.shape[:3]), []
        used_widths = set()
        for b in range(n_trials):
            bits, sketch_rows = [], []
            for h in range(n_heads):
                f = fits[b][h]
                u, norms[b, h] = _unit_rows(x[b, h])
                z = u @ f.basis
                z_hat = np.zeros_like(z)
                for k in range(d):
                    w = int(f.widths[k])
                    if w == 0:
                        continue
                    used_widths.add(w)
                    book = unit_gaussian_codebook(w).astype(np.float32).astype(np.float64)
                    index = np.searchsorted((book[1:] + book[:-1]) / 2, z[:, k] / f.sigma[k])
                    z_hat[:, k] = book[index] * np.float64(f.sigma[k])
                    # w bits per code, most significant first
                    bits.append(((index[:, None] >> np.arange(w - 1, -1, -1)) & 1).astype(np.uint8))
                if sketched:
                    e = np.where(np.arange(d) < f.d_eff, z - z_hat, 0.0)
                    residual_norms[b, h] = np.sqrt(np.sum(e ** 2, axis=-1))
                    sketch_rows.append(np.packbits(e @ self._sketch_matrix(seeds[b], h).T >= 0, axis=-1))
            streams.append(np.packbits(np.concatenate([np.ravel(a) for a in bits])) if bits else np.zeros(0, np.uint8))
            sketches.append(sketch_rows)
        length = max(len(s) for s in streams)
        stream = np.zeros((n_trials, length), dtype=np.uint8)
        for b, s in enumerate(streams):
            stream[b, :len(s)] = s
        device = x_torch.device

        def put(key: str, array: np.ndarray) -> None:
            enc.codes[f"{tensor}.{key}"] = to_tensor(np.ascontiguousarray(array), np, device=device)
        put("norm", norms.astype(np.float32))
        put("codes", stream)
        put("basis", np.array([[f.basis_codes for f in row] for row in fits]))
        put("basis_scale", np.array([[f.basis_scale for f in row] for row in fits]))
        put("sigma", np.array([[f.sigma for f in row] for row in fits]))
        widths = np.array([[f.widths for f in row] for row in fits]).astype(np.uint8)
        table_bits = (widths[..., None] >> np.arange(3, -1, -1)) & 1                    # 4 bits per entry
        put("widths", np.packbits(table_bits.reshape(*widths.shape[:2], -1), axis=-1))
        # per-trial ledger: a trial's own stream in whole bytes, and the codebooks of the widths it uses
        enc.exact_bits[f"{tensor}.codes"] = torch.tensor([8 * len(s) for s in streams], dtype=torch.int64)
        for w in sorted(used_widths):
            key = f"codebook.{w}bit"
            enc.side[key] = torch.from_numpy(unit_gaussian_codebook(w).astype(np.float32)).to(device)
            uses = np.array([any(int(v) == w for f in row for v in f.widths) for row in fits])
            earlier = enc.exact_bits[key].numpy() if key in enc.exact_bits else 0
            enc.exact_bits[key] = torch.from_numpy(np.maximum(uses * 32 * 2 ** w, earlier).astype(np.int64))
        if sketched:
            put("d_eff", np.array([[f.d_eff for f in row] for row in fits]).astype(np.int16))
            put("sketch", np.array(sketches))
            put("residual_norm", residual_norms.astype(np.float32))
            put("sketch_seed", np.array(seeds, dtype=np.int64))

    def _z_hat(self, enc: Encoded, tensor: str, b: int, h: int, stream_bits: np.ndarray, start: int):
        """(ẑ (S, d) with the QJL correction, Q (d, d), next stream position) of one (trial, head)."""
        n_tokens, d = enc.shape[2], self.dim
        codes = lambda key: to_array(enc.codes[f"{tensor}.{key}"], np)
        widths_bits = np.unpackbits(codes("widths")[b, h])[: 4 * d].reshape(d, 4)
        widths = (widths_bits * (1 << np.arange(3, -1, -1))).sum(-1)
        sigma = codes("sigma")[b, h].astype(np.float64)
        basis = _orthonormal_from_codes(codes("basis")[b, h], codes("basis_scale")[b, h])
        z_hat = np.zeros((n_tokens, d))
        for k in range(d):
            w = int(widths[k])
            if w == 0:
                continue
            chunk = stream_bits[start: start + n_tokens * w].reshape(n_tokens, w).astype(np.int64)
            start += n_tokens * w
            index = (chunk * (1 << np.arange(w - 1, -1, -1))).sum(-1)
            z_hat[:, k] = to_array(enc.side[f"codebook.{w}bit"], np, "float64")[index] * sigma[k]
        if self._sketched(tensor):
            d_eff = int(codes("d_eff")[b, h])
            signs = np.unpackbits(codes("sketch")[b, h], axis=-1)[:, :PROJECTIONS] * 2.0 - 1.0
            matrix = self._sketch_matrix(int(codes("sketch_seed")[b]), h)
            residual_norm = codes("residual_norm")[b, h].astype(np.float64)
            correction = QJL_SCALE / PROJECTIONS * residual_norm[:, None] * (signs @ matrix)
            z_hat[:, :d_eff] += correction[:, :d_eff]
        return z_hat, basis, start

    def _each_head(self, enc: Encoded, tensor: str):
        stream = to_array(enc.codes[f"{tensor}.codes"], np)
        for b in range(enc.shape[0]):
            bits, start = np.unpackbits(stream[b]), 0
            for h in range(enc.shape[1]):
                z_hat, basis, start = self._z_hat(enc, tensor, b, h, bits, start)
                yield b, h, z_hat, basis

    def _decode_tensor(self, enc: Encoded, tensor: str) -> np.ndarray:
        out = np.zeros(enc.shape)
        norms = to_array(enc.codes[f"{tensor}.norm"], np, "float64")
        for b, h, z_hat, basis in self._each_head(enc, tensor):
            out[b, h] = (z_hat @ basis.T) * norms[b, h][:, None]
        return out

    # --- protocol --------------------------------------------------------------------------------
    def encode(self, k: torch.Tensor, v: torch.Tensor) -> Encoded:
        enc = Encoded(tuple(k.shape), k.dtype)
        self._encode_tensor(k, "k", enc)
        self._encode_tensor(v, "v", enc)
        enc.model = {key for key in [*enc.codes, *enc.side] if key.split(".", 1)[1] not in PER_CACHE}
        return enc

    def decode(self, enc: Encoded) -> tuple[torch.Tensor, torch.Tensor]:
        device = enc.codes["k.norm"].device
        return tuple(to_tensor(self._decode_tensor(enc, t), np, dtype=enc.dtype, device=device) for t in ("k", "v"))

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(fit_trials=True, scores_on_codes=bool(self.sketch_k))

    def score(self, q: torch.Tensor, enc: Encoded) -> torch.Tensor:
        """Logits (B, H, Nq, S); the asymmetric estimator on the codes for a sketched K."""
        q_arr = to_array(q, np, "float64")
        logits = np.zeros((*q_arr.shape[:3], enc.shape[2]))
        norms = to_array(enc.codes["k.norm"], np, "float64")
        for b, h, z_hat, basis in self._each_head(enc, "k"):
            # ẑ already holds the sketch's correction: ⟨q_Z, ẑ + c⟩ = ⟨q_Z, ẑ⟩ + ⟨S q_Z,sem, sign⟩·scale
            logits[b, h] = (q_arr[b, h] @ basis) @ z_hat.T * norms[b, h][None, :] / math.sqrt(self.dim)
        return to_tensor(logits, np, dtype=q.dtype, device=q.device)


_DESCRIPTIONS = {
    "sq-kv": "reference: calibrated eigenbases, Gaussian Lloyd–Max per coordinate, water-filling",
    "sq-qkv": "reference: sq-kv + selective QJL (m=64) on K's semantic coordinates",
    "sq-kqv": "reference: sq-kv + selective QJL (m=64) on V's semantic coordinates",
    "sq-qkqv": "reference: sq-kv + selective QJL (m=64) on K and V",
    "squ-kv": "reference: b bits on the d_eff semantic coordinates, 2 on the tail",
    "squ-qkv": "reference: squ-kv + selective QJL (m=64) on K's semantic coordinates",
    "squ-kqv": "reference: squ-kv + selective QJL (m=64) on V's semantic coordinates",
    "squ-qkqv": "reference: squ-kv + selective QJL (m=64) on K and V",
}


def _factory(name: str):
    match = _NAME.match(name)
    grammar = {"uniform": match["family"] == "squ", "sketch_k": match["k"] == "q", "sketch_v": match["v"] == "q"}

    def make(*, budget: int, dim: int, seed: int = 0, **options) -> ReferenceSpectralQuant:
        return ReferenceSpectralQuant(budget=budget, dim=dim, seed=seed, scheme_name=name, **grammar, **options)
    make.__doc__ = _DESCRIPTIONS[name]
    return make


for _name, _description in _DESCRIPTIONS.items():
    register(_name, _factory(_name), _description)
