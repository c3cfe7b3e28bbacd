"""Reference TurboQuant family (arXiv 2504.19874) with QJL residual sketches (arXiv 2406.03482).

An independent second implementation of plain-kv and tq-[q|f]k[q|f]v, written for clarity:
NumPy/CuPy arrays (`xp`), float64 by default, its own Walsh–Hadamard matrix, Lloyd–Max
solver, bit packing and random draws. Per token vector x of K or V (B, H, S, d):

  norm = ‖x‖ (stored float32), u = x / ‖x‖
  y = H (s ⊙ u) / √d                     random signs s per trial and head (tq-; plain- skips it)
  idx = nearest centroid of the Lloyd–Max codebook of one coordinate of a uniform unit
        vector in R^d (TurboQuant Lemma 1), b bits, or b − 1 when the tensor is sketched
  e = y − ŷ, sketch = sign(P e) and ‖e‖ (float32), P = H diag(s₂) (RHT, ±1 entries) or a
        dense Rademacher ±1 matrix (FULL), m = d rows, s₂ and P per trial and head
  decode: ŷ + √(π/2)/m · ‖e‖ · Pᵀ sign(P e), rotated back and scaled by the norm
  score (sketched K): (⟨q_rot, ŷ⟩ + √(π/2)/m · ‖e‖ · ⟨P q_rot, sign(P e)⟩) · ‖k‖ / √d

The estimator's constant: for a row p of i.i.d. N(0, 1) entries E[⟨p, q⟩ sign⟨p, e⟩] =
√(2/π) ⟨q, e⟩/‖e‖ (QJL Lemma 3.2), so averaging m rows and rescaling by √(π/2)/m · ‖e‖ is
unbiased; with ±1 entries the same holds up to O(1/d).

Random draws: trial b's signs and projections come from this module's own streams (seed,
"reference", tensor, purpose, trial index, head), the trial indices those given to fit (default
0..B−1 of the batch): every trial replicates the draw, and a trial's draw does not depend on
its batch. They are stored per trial with the codes.

Who pays for what is stored (Encoded.model): a deployment keeps the signs, projections and
codebooks once per layer-head, since they follow from the seed, d and b alone (per model); each
trial stands for a deployment of its own. The norms, codes, residual norms and sketches describe
one cache's tokens (per cache).
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from types import ModuleType

import numpy as np
import torch
from scipy import optimize

from schemes.base import Capabilities, Encoded, Scheme
from kvcommon.rng import generator

from . import register
from .adapter import check_compute_dtype, resolve_namespace, to_array, to_tensor

# ---------------------------------------------------------------------------------------------
# Walsh–Hadamard: the Sylvester matrix from its closed form H[i, j] = (−1)^popcount(i AND j)
# ---------------------------------------------------------------------------------------------


def check_power_of_two(dim: int) -> None:
    if dim < 1 or dim & (dim - 1):
        raise ValueError(f"head dimension {dim} is not a power of two; the Walsh–Hadamard "
                         f"transform needs d in 1, 2, 4, ..., 128, 256, ...")


@functools.lru_cache(maxsize=None)
def _hadamard_numpy(dim: int) -> np.ndarray:
    check_power_of_two(dim)
    index = np.arange(dim)
    both = index[:, None] & index[None, :]
    parity = np.zeros((dim, dim), dtype=np.int64)
    for bit in range(max(dim.bit_length() - 1, 0)):
        parity ^= (both >> bit) & 1
    return 1.0 - 2.0 * parity


def hadamard_matrix(dim: int, xp: ModuleType = np, dtype: str = "float64"):
    """The unnormalised Sylvester–Hadamard matrix (dim, dim), entries ±1, symmetric, H Hᵀ = dim·I."""
    return xp.asarray(_hadamard_numpy(dim), dtype=dtype)


# ---------------------------------------------------------------------------------------------
# Bit packing: codes → their `width` bits, most significant first → bytes, one row at a time
# ---------------------------------------------------------------------------------------------


def packed_bytes(n_codes: int, width: int) -> int:
    return (n_codes * width + 7) // 8


def pack_codes(codes, width: int, xp: ModuleType = np):
    """Integer codes (..., n) in [0, 2**width) -> uint8 (..., ceil(n·width/8)), big-endian bit order."""
    if not 1 <= width <= 8:
        raise ValueError(f"code width {width} is outside 1..8 bits")
    codes = xp.asarray(codes).astype(xp.uint8)
    shifts = xp.arange(width - 1, -1, -1, dtype=xp.uint8)
    bits = ((codes[..., None] >> shifts) & 1).reshape(*codes.shape[:-1], -1)       # (..., n·width)
    n_bytes = packed_bytes(codes.shape[-1], width)
    pad = n_bytes * 8 - bits.shape[-1]
    if pad:
        bits = xp.concatenate([bits, xp.zeros((*bits.shape[:-1], pad), dtype=bits.dtype)], axis=-1)
    place = xp.asarray([128, 64, 32, 16, 8, 4, 2, 1], dtype=xp.uint8)
    return xp.sum(bits.reshape(*bits.shape[:-1], n_bytes, 8) * place, axis=-1, dtype=xp.uint8)


def unpack_codes(packed, width: int, n_codes: int, xp: ModuleType = np):
    """Inverse of pack_codes: uint8 (..., bytes) -> int64 codes (..., n_codes)."""
    if not 1 <= width <= 8:
        raise ValueError(f"code width {width} is outside 1..8 bits")
    packed = xp.asarray(packed).astype(xp.uint8)
    bits = (packed[..., None] >> xp.arange(7, -1, -1, dtype=xp.uint8)) & 1
    bits = bits.reshape(*packed.shape[:-1], -1)[..., : n_codes * width]
    bits = bits.reshape(*packed.shape[:-1], n_codes, width)
    place = xp.asarray([1 << i for i in range(width - 1, -1, -1)], dtype=xp.uint8)
    return xp.sum(bits * place, axis=-1, dtype=xp.int64)


# ---------------------------------------------------------------------------------------------
# Lloyd–Max codebook of the unit-sphere coordinate marginal, by numerical integration
# ---------------------------------------------------------------------------------------------
# One coordinate X of a uniform unit vector in R^d has density ∝ (1 − x²)^((d−3)/2) on [−1, 1]
# (TurboQuant Lemma 1). With x = −cos θ the mass element becomes ∝ sin^(d−2) θ dθ, smooth for
# every d ≥ 2 (no endpoint singularity at d = 2), so Gauss–Legendre quadrature on a uniform
# θ grid integrates it to machine precision. The density is even, so the optimum is symmetric
# (−c reflected) and only the positive half x ∈ [0, 1] ↔ θ ∈ [π/2, π] is solved for; tail
# integrals ∫_x^1 are tabulated so that small outer cells keep their digits.

_N_PANELS = 1 << 14
_GAUSS_X, _GAUSS_W = np.polynomial.legendre.leggauss(8)


class _SphereMarginalTails:
    """T_k(x) = ∫_x^1 t^k f(t) dt for k = 0, 1, 2 and x ∈ [0, 1], f the normalised density."""

    def __init__(self, dim: int):
        self.exponent = dim - 2
        self.edges = np.linspace(math.pi / 2, math.pi, _N_PANELS + 1)
        self.step = self.edges[1] - self.edges[0]
        panels = self._integrate(self.edges[:-1], self.edges[1:])                    # (3, n)
        tails = np.cumsum(panels[:, ::-1], axis=1)[:, ::-1]
        tails = np.concatenate([tails, np.zeros((3, 1))], axis=1)                     # at each edge
        self.scale = 1.0 / (2.0 * tails[0, 0])       # total mass 1 over both halves
        self.tails = tails * self.scale

    def _integrate(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Unnormalised ∫_lo^hi (−cos θ)^k sin^(d−2) θ dθ, k = 0, 1, 2, by 8-node Gauss–Legendre."""
        half = (hi - lo)[:, None] / 2
        theta = (hi + lo)[:, None] / 2 + half * _GAUSS_X
        weight = half * _GAUSS_W * np.exp(self.exponent * np.log(np.sin(theta)))
        x = -np.cos(theta)
        return np.stack([np.sum(weight, 1), np.sum(weight * x, 1), np.sum(weight * x * x, 1)])

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """(3, len(x)) tail integrals at the points x ∈ [0, 1]."""
        theta = np.arccos(-np.clip(np.asarray(x, dtype=np.float64), 0.0, 1.0))
        panel = np.clip(((theta - math.pi / 2) / self.step).astype(np.int64), 0, _N_PANELS - 1)
        return self._integrate(theta, self.edges[panel + 1]) * self.scale + self.tails[:, panel + 1]


@dataclass(frozen=True, eq=False)
class SphereCodebook:
    """2**bits centroids (ascending) and the 2**bits − 1 midpoint thresholds; `distortion` is
    E[(X − Q(X))²] per coordinate, `second_moment` E[X²] (= 1/d), both by quadrature."""
    dim: int
    bits: int
    centroids: np.ndarray
    thresholds: np.ndarray
    distortion: float
    second_moment: float
    max_residual: float  # largest |T(t) − t| of the Lloyd map at the solution

    @property
    def normalized_distortion(self) -> float:
        """Distortion relative to E[X²]: the relative MSE of a unit vector's reconstruction."""
        return self.distortion / self.second_moment


def _cell_moments(tails: _SphereMarginalTails, inner: np.ndarray) -> np.ndarray:
    """(3, K) zeroth, first and second moments of the K positive cells bounded by 0, inner, 1."""
    edges = np.concatenate([[0.0], inner, [1.0]])
    t = tails(edges)
    return t[:, :-1] - t[:, 1:]


def _lloyd_map(tails: _SphereMarginalTails, inner: np.ndarray) -> np.ndarray:
    """One Lloyd sweep (Lloyd 1957; Max 1960): centroids = cell means, thresholds = midpoints."""
    m = _cell_moments(tails, inner)
    c = m[1] / m[0]
    return (c[:-1] + c[1:]) / 2


def _gaps_to_thresholds(free: np.ndarray) -> np.ndarray:
    """Unconstrained parameters -> ordered thresholds in (0, 1): cumulative softmax of the gaps."""
    gaps = np.exp(np.concatenate([free, [0.0]]) - max(np.max(free, initial=0.0), 0.0))
    return np.cumsum(gaps)[:-1] / np.sum(gaps)


def _thresholds_to_gaps(inner: np.ndarray) -> np.ndarray:
    gaps = np.diff(np.concatenate([[0.0], inner, [1.0]]))
    return np.log(gaps[:-1]) - np.log(gaps[-1])


def _companding_start(dim: int, n_cells: int) -> np.ndarray:
    """Positive thresholds with equal mass under f^(1/3) (the high-resolution optimum, Panter &
    Dite 1951): in θ, f(x)^(1/3) dx ∝ sin^(d/3) θ dθ, tabulated by the trapezoid rule."""
    theta = np.linspace(math.pi / 2, math.pi, 20001)
    density = np.sin(theta) ** (dim / 3)
    cumulative = np.concatenate([[0.0], np.cumsum((density[1:] + density[:-1]) / 2)])
    cumulative /= cumulative[-1]
    return -np.cos(np.interp(np.arange(1, n_cells) / n_cells, cumulative, theta))


@functools.lru_cache(maxsize=None)
def sphere_codebook(dim: int, bits: int) -> SphereCodebook:
    """Lloyd–Max codebook for one coordinate of a uniform unit vector in R^dim (dim ≥ 2).

    The fixed point of the Lloyd map t = T(t) is found by Powell's hybrid method (MINPACK
    hybrj, central-difference Jacobian) on gap parameters that keep the thresholds ordered,
    from the f^(1/3) companding start; the density is log-concave, so the fixed point is the
    unique optimum (Fleischer 1964). Cached per (dim, bits).
    """
    if dim < 2:
        raise ValueError(f"the unit-sphere marginal needs dim >= 2, got {dim}")
    if not 1 <= bits <= 8:
        raise ValueError(f"codebook bits {bits} outside 1..8")
    tails = _SphereMarginalTails(dim)
    n_cells = 2 ** (bits - 1)  # positive half
    sigma = 1 / math.sqrt(dim)
    inner = np.empty(0)
    if n_cells > 1:
        def residual(free):
            t = _gaps_to_thresholds(free)
            return (_lloyd_map(tails, t) - t) / sigma

        def jacobian(free, step=1e-6):
            # Central differences with an absolute step: MINPACK's own steps scale with |free|
            # and vanish where a parameter is 0 (equal gaps, e.g. the uniform density at d = 3).
            columns = [(residual(free + step * e) - residual(free - step * e)) / (2 * step)
                       for e in np.eye(len(free))]
            return np.stack(columns, axis=1)
        solution = optimize.root(residual, _thresholds_to_gaps(_companding_start(dim, n_cells)),
                                 jac=jacobian, method="hybr", options={"xtol": 1e-14, "maxfev": 200 * n_cells})
        inner = _gaps_to_thresholds(solution.x)
    max_residual = float(np.max(np.abs(_lloyd_map(tails, inner) - inner), initial=0.0))
    if max_residual > 1e-11 * sigma:
        raise RuntimeError(f"Lloyd–Max fixed point not reached for d={dim}, {bits} bits "
                           f"(residual {max_residual:.2e})")
    m = _cell_moments(tails, inner)
    c = m[1] / m[0]
    # Σ over cells of ∫ (x − c)² f = m2 − 2 c m1 + c² m0, doubled for the negative half.
    distortion = 2 * float(np.sum(m[2] - 2 * c * m[1] + c * c * m[0]))
    second_moment = 2 * float(tails(np.zeros(1))[2, 0])
    centroids = np.concatenate([-c[::-1], c])
    return SphereCodebook(dim, bits, centroids, (centroids[1:] + centroids[:-1]) / 2,
                          distortion, second_moment, max_residual)


# ---------------------------------------------------------------------------------------------
# The family
# ---------------------------------------------------------------------------------------------

# Stored entries that are per-model constants (data-independent), by the last part of their key.
_PER_MODEL = {"rotation_signs", "sketch_signs", "sketch_matrix"}


def _rows_times(x, matrix):
    """x (..., d) @ matrix (d, d') as one 2-D product (BLAS is fastest on one tall matrix)."""
    return (x.reshape(-1, x.shape[-1]) @ matrix).reshape(*x.shape[:-1], matrix.shape[-1])


def _per_cache_times(x, matrices, xp: ModuleType):
    """x (B, H, n, d) @ matrices[b, h] (d, d') for each trial b and head h -> (B, H, n, d')."""
    return xp.matmul(x, matrices)


_NAME = re.compile(r"^(?P<prefix>tq|plain)-(?P<k>[qf]?)k(?P<v>[qf]?)v$")
_SKETCH_OF_MARK = {"": None, "q": "rht", "f": "full"}
QJL_SCALE = math.sqrt(math.pi / 2)  # divided by m: QJL Lemma 3.2


@dataclass
class ReferenceTurboQuant(Scheme):
    """TurboQuant / QJL in `xp` arrays. Options: xp (numpy | cupy), compute_dtype (float64 | float32)."""
    rotate: bool = True
    sketch_k: str | None = None
    sketch_v: str | None = None
    xp: object = None
    compute_dtype: str = "float64"
    scheme_name: str = field(default="", repr=False)
    trial_ids: list | None = field(default=None, init=False, repr=False)

    def validate(self) -> None:
        super().validate()  # RNG family
        check_compute_dtype(self.compute_dtype)
        resolve_namespace(self.xp)
        if self.dim < 2:
            raise ValueError(f"head dimension {self.dim} is too small; TurboQuant needs d >= 2")
        if self.rotate or "rht" in (self.sketch_k, self.sketch_v):
            check_power_of_two(self.dim)

    @property
    def ns(self) -> ModuleType:
        """The array namespace the work runs in."""
        return resolve_namespace(self.xp)

    @property
    def name(self) -> str:
        """The registry name this object was created under."""
        return self.scheme_name

    def fit(self, k_cal: torch.Tensor, v_cal: torch.Tensor, trials=None) -> "ReferenceTurboQuant":
        """Nothing is calibrated. trials (B,): the trial indices of the next batch to encode, for
        which the signs are drawn (default: 0..B−1 of that batch)."""
        self.trial_ids = None if trials is None else [int(t) for t in trials]
        if self.trial_ids is not None and len(self.trial_ids) != k_cal.shape[0]:
            raise ValueError(f"trials must hold one index per calibration trial ({k_cal.shape[0]}); "
                             f"got {len(self.trial_ids)}")
        return self

    def _trials_of(self, n_trials: int) -> list[int]:
        if self.trial_ids is None:
            return list(range(n_trials))
        if len(self.trial_ids) != n_trials:
            raise ValueError(f"fitted for {len(self.trial_ids)} trial indices but asked to encode "
                             f"B = {n_trials} trials; fit with the trial indices of the batch to encode")
        return self.trial_ids

    # --- randomness: a function of (rng family, seed, tensor, purpose, trial, head) only ------
    def draw_signs(self, tensor: str, purpose: str, shape: tuple[int, ...], trials: list[int],
                   n_heads: int) -> np.ndarray:
        """±1 (len(trials), n_heads, *shape) from this scheme's own streams, one per (trial, head)."""
        return np.array([[2.0 * generator(self.rng, self.seed, "reference", tensor, purpose, t, h)
                          .integers(0, 2, size=shape) - 1.0 for h in range(n_heads)] for t in trials]
                        ).reshape(len(trials), n_heads, *shape)

    def _sketch_kind(self, tensor: str) -> str | None:
        return self.sketch_k if tensor == "k" else self.sketch_v

    def _mse_bits(self, tensor: str) -> int:
        return self.budget - 1 if self._sketch_kind(tensor) else self.budget

    def _store_signs(self, tensor: str, n_trials: int, n_heads: int, codes: dict, device) -> None:
        """Rotation signs and the sketch projection of every trial, packed one bit per ±1, stored
        with the codes (B, H, ...)."""
        d, xp = self.dim, self.ns
        trials = self._trials_of(n_trials)
        draws = {}
        if self.rotate:
            draws["rotation_signs"] = self.draw_signs(tensor, "rotation", (d,), trials, n_heads)
        kind = self._sketch_kind(tensor)
        if kind == "rht":
            draws["sketch_signs"] = self.draw_signs(tensor, "sketch", (d,), trials, n_heads)
        elif kind == "full":
            draws["sketch_matrix"] = self.draw_signs(tensor, "sketch-matrix", (d, d), trials, n_heads)
        for key, signs in draws.items():
            bits = xp.asarray(signs > 0, dtype=xp.int64)
            codes[f"{tensor}.{key}"] = to_tensor(pack_codes(bits, 1, xp), xp, device=device)

    def _signs_from(self, packed: torch.Tensor, n: int):
        return 2.0 * unpack_codes(to_array(packed, self.ns), 1, n, self.ns).astype(self.compute_dtype) - 1.0

    def _rotation_signs(self, codes: dict, tensor: str):
        """(B, H, 1, d) ±1 for broadcasting over (B, H, n, d)."""
        return self._signs_from(codes[f"{tensor}.rotation_signs"], self.dim)[:, :, None, :]

    def _projection(self, codes: dict, tensor: str):
        """The sketch matrices P (B, H, m, d), m = d, written out densely for clarity."""
        kind, d = self._sketch_kind(tensor), self.dim
        if kind == "rht":  # P = H diag(s₂): column j of H times s₂[j]
            signs = self._signs_from(codes[f"{tensor}.sketch_signs"], d)                 # (B, H, d)
            p = hadamard_matrix(d, self.ns, self.compute_dtype) * signs[:, :, None, :]
        else:
            p = self._signs_from(codes[f"{tensor}.sketch_matrix"], d)                     # (B, H, m, d)
        return p

    def _rotate(self, x, signs):
        """y = H (s ⊙ x)/√d on row vectors (H symmetric); x (B, H, n, d), signs (B, H, 1, d)."""
        return _rows_times(x * signs, hadamard_matrix(self.dim, self.ns, self.compute_dtype)) / math.sqrt(self.dim)

    def _unrotate(self, y, signs):
        """x = s ⊙ H y/√d (the rotation is orthogonal)."""
        return _rows_times(y, hadamard_matrix(self.dim, self.ns, self.compute_dtype)) / math.sqrt(self.dim) * signs

    # --- one tensor -----------------------------------------------------------------------------
    def _encode_tensor(self, x_torch: torch.Tensor, tensor: str, enc: Encoded) -> None:
        xp, d = self.ns, self.dim
        device = x_torch.device
        x = to_array(x_torch, xp, self.compute_dtype)                                     # (B, H, S, d)
        self._store_signs(tensor, x.shape[0], x.shape[1], enc.codes, device)
        # Divide by the largest entry before squaring so ‖x‖² cannot overflow.
        peak = xp.max(xp.abs(x), axis=-1, keepdims=True)
        peak = xp.where(peak > 0, peak, 1.0)
        scaled_norm = xp.sqrt(xp.sum((x / peak) ** 2, axis=-1, keepdims=True))
        u = (x / peak) / xp.where(scaled_norm > 0, scaled_norm, 1.0)
        enc.codes[f"{tensor}.norm"] = to_tensor((peak * scaled_norm)[..., 0].astype(xp.float32), xp, device=device)
        y = self._rotate(u, self._rotation_signs(enc.codes, tensor)) if self.rotate else u
        y_hat = xp.zeros_like(y)
        bits = self._mse_bits(tensor)
        if bits >= 1:
            book = sphere_codebook(d, bits)
            index = xp.searchsorted(xp.asarray(book.thresholds, dtype=self.compute_dtype), y)
            enc.codes[f"{tensor}.codes"] = to_tensor(pack_codes(index, bits, xp), xp, device=device)
            stored_centroids = xp.asarray(book.centroids, dtype=xp.float32)
            enc.side[f"codebook.{bits}bit"] = to_tensor(stored_centroids, xp, device=device)  # shared by K and V
            y_hat = stored_centroids.astype(self.compute_dtype)[index]  # what decode will read back
        if self._sketch_kind(tensor):
            residual = y - y_hat
            enc.codes[f"{tensor}.residual_norm"] = to_tensor(
                xp.sqrt(xp.sum(residual ** 2, axis=-1)).astype(xp.float32), xp, device=device)
            projected = _per_cache_times(residual, xp.swapaxes(self._projection(enc.codes, tensor), -1, -2), xp)  # P e
            enc.codes[f"{tensor}.sketch"] = to_tensor(
                pack_codes(xp.asarray(projected >= 0, dtype=xp.int64), 1, xp), xp, device=device)

    def _mse_part(self, enc: Encoded, tensor: str):
        """ŷ (B, H, S, d) from the stored codes and the stored (float32) codebook; 0 for a pure sketch."""
        xp, bits = self.ns, self._mse_bits(tensor)
        if bits < 1:
            return xp.zeros(enc.shape, dtype=self.compute_dtype)
        centroids = to_array(enc.side[f"codebook.{bits}bit"], xp, self.compute_dtype)
        return centroids[unpack_codes(to_array(enc.codes[f"{tensor}.codes"], xp), bits, self.dim, xp)]

    def _sketch_part(self, enc: Encoded, tensor: str):
        """(sign(P e) as ±1 (B, H, S, m), ‖e‖ (B, H, S)) from the stored codes."""
        xp = self.ns
        signs = self._signs_from(enc.codes[f"{tensor}.sketch"], self.dim)
        return signs, to_array(enc.codes[f"{tensor}.residual_norm"], xp, self.compute_dtype)

    def _decode_tensor(self, enc: Encoded, tensor: str):
        xp = self.ns
        y_hat = self._mse_part(enc, tensor)
        if self._sketch_kind(tensor):
            signs, residual_norm = self._sketch_part(enc, tensor)
            # QJL reconstruction: √(π/2)/m · ‖e‖ · Pᵀ sign(P e)  (m = d)
            back_projected = _per_cache_times(signs, self._projection(enc.codes, tensor), xp)  # Pᵀ sign(P e)
            y_hat = y_hat + QJL_SCALE / self.dim * residual_norm[..., None] * back_projected
        u_hat = self._unrotate(y_hat, self._rotation_signs(enc.codes, tensor)) if self.rotate else y_hat
        return u_hat * to_array(enc.codes[f"{tensor}.norm"], xp, self.compute_dtype)[..., None]

    # --- protocol (torch at the boundary) ---------------------------------------------------------
    def encode(self, k: torch.Tensor, v: torch.Tensor) -> Encoded:
        """k, v (B, H, S, d) -> the stored cache (packed uint8 codes, float32 norms, packed signs)."""
        enc = Encoded(tuple(k.shape), k.dtype)
        self._encode_tensor(k, "k", enc)
        self._encode_tensor(v, "v", enc)
        enc.model = {key for key in [*enc.codes, *enc.side]
                     if key.startswith("codebook.") or key.split(".")[-1] in _PER_MODEL}
        return enc

    def decode(self, enc: Encoded) -> tuple[torch.Tensor, torch.Tensor]:
        """(k̂, v̂) (B, H, S, d) in the encoded dtype, on the codes' device."""
        device = enc.codes["k.norm"].device
        return tuple(to_tensor(self._decode_tensor(enc, t), self.ns, dtype=enc.dtype, device=device)
                     for t in ("k", "v"))

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(fit_trials=True, scores_on_codes=self.sketch_k is not None)

    def score(self, q: torch.Tensor, enc: Encoded) -> torch.Tensor:
        """Logits (B, H, Nq, S) from q (B, H, Nq, d); the asymmetric QJL estimator for a sketched K."""
        xp, d = self.ns, self.dim
        q_arr = to_array(q, xp, self.compute_dtype)
        if not self.sketch_k:
            k_hat = self._decode_tensor(enc, "k")
            logits = q_arr @ xp.swapaxes(k_hat, -1, -2) / math.sqrt(d)
        else:
            q_rot = self._rotate(q_arr, self._rotation_signs(enc.codes, "k")) if self.rotate else q_arr
            mse = q_rot @ xp.swapaxes(self._mse_part(enc, "k"), -1, -2)                     # (B,H,Nq,S)
            q_projected = _per_cache_times(q_rot, xp.swapaxes(self._projection(enc.codes, "k"), -1, -2), xp)  # P q
            signs, residual_norm = self._sketch_part(enc, "k")
            correction = QJL_SCALE / d * residual_norm[:, :, None, :] * (q_projected @ xp.swapaxes(signs, -1, -2))
            norms = to_array(enc.codes["k.norm"], xp, self.compute_dtype)[:, :, None, :]
            logits = (mse + correction) * norms / math.sqrt(d)
        return to_tensor(logits, xp, dtype=q.dtype, device=q.device)


_DESCRIPTIONS = {
    "plain-kv": "reference: Beta Lloyd–Max on the raw normalised coordinates, norm stored, no rotation",
    "tq-kv": "reference: RHT rotation + Beta Lloyd–Max on K and V, norm stored",
    "tq-qkv": "reference: tq-kv + 1-bit QJL residual sketch (RHT projection) on K",
    "tq-fkv": "reference: tq-kv + 1-bit QJL residual sketch (dense Rademacher projection) on K",
    "tq-kqv": "reference: tq-kv + 1-bit QJL residual sketch (RHT projection) on V",
    "tq-qkqv": "reference: tq-kv + 1-bit QJL residual sketches (RHT projection) on K and V",
    "tq-kfv": "reference: tq-kv + 1-bit QJL residual sketch (dense Rademacher projection) on V",
    "tq-fkfv": "reference: tq-kv + 1-bit QJL residual sketches (dense Rademacher projection) on K and V",
}


def parse_name(name: str) -> dict:
    """'tq-qkfv' -> {rotate: True, sketch_k: 'rht', sketch_v: 'full'}; ValueError otherwise."""
    match = _NAME.match(name)
    if not match:
        raise ValueError(f"{name!r} is not a TurboQuant variant name (plain-kv or tq-[q|f]k[q|f]v)")
    return {"rotate": match["prefix"] == "tq", "sketch_k": _SKETCH_OF_MARK[match["k"]],
            "sketch_v": _SKETCH_OF_MARK[match["v"]]}


def _factory(name: str):
    grammar = parse_name(name)

    def make(*, budget: int, dim: int, seed: int = 0, **options) -> ReferenceTurboQuant:
        return ReferenceTurboQuant(budget=budget, dim=dim, seed=seed, scheme_name=name,
                                   **grammar, **options)
    make.__doc__ = _DESCRIPTIONS[name]
    return make


for _name, _description in _DESCRIPTIONS.items():
    register(_name, _factory(_name), _description)
