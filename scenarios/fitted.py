"""fitted:SPEC.json — synthetic K, V, Q drawn with the statistics `harness fit` measured on a capture.

A spec (format FORMAT, written by harness/fit.py) holds, per layer and per query head h (reading
key/value head h // g under grouped-query attention, g = Hq / Hkv), the first two moments of one
token's joint vector x = (k, v, q) ∈ R^{3d} — mean μ and covariance Σ = U diag(λ) Uᵀ — and two
descriptions of its tail: `scale2_quantiles`, the quantiles (probabilities 0, 1/64, ..., 1) of
s² = m / mean(m), m a token's squared Mahalanobis norm, and `dof`, the Student-t degrees of
freedom of the whitened coordinates (None: Gaussian). Keys and queries are the pre-RoPE ones
when the capture has RoPE; the spec then also holds the rotary frequencies and scaling measured
from the capture (`rope`), and draws apply that RoPE, as a cache stores keys.

A token is x = μ + U diag(√λ) z, with `tail`:
- "fitted" (default): each head's own choice, `tail` in the spec: the law under which the fit's
  whitened tokens are likelier (harness/fit.py, tail_law), "coordinate" for specs without one;
- "coordinate": z i.i.d. Student-t(dof) scaled to unit variance (as heavy_tail's latents);
- "token": z = s·g, g standard normal, s² drawn from the fitted quantiles (inverse CDF, linear
  between quantiles): an elliptical scale mixture whose token norms spread as the real ones do
  (real KV has tokens far larger than others in every direction at once);
- "gaussian": z standard normal.
Each has mean μ and covariance Σ (E s² = 1).

Sequence structure. Real tokens are not exchangeable: neighbours are alike, a query attends more
to keys near it (through position embeddings or RoPE, seen in the tokens as slowly varying
components), and which keys draw attention follows from that. With `order` "fitted" (default) and
a `transition` B in the spec, a head's tokens form a stationary VAR(1) along the sequence,
x_t − μ = B (x_{t−1} − μ) + η_t, η_t = R z_t with R Rᵀ = Σ − BΣBᵀ and z_t of the tail law, from
x_0 = μ + U diag(√λ) z_0: every token keeps mean μ and covariance Σ, and the lag-1
cross-covariance of (k, v, q) is BΣ, so E[q_i·k_j] depends on the distance i − j as the capture's
does — attention against distance, the heavy hitters that recency leaves, the neighbour
correlation. B is fitted across all 3d coordinates at once (harness/fit.py, `transition`), so it
can rotate as well as decay (position embeddings oscillate with distance, which no set of
per-coordinate decays expresses). order="iid", or a spec without a transition (written before
it), draws independent tokens, as before.

Position. Where a token's mean depends on its absolute position (learned position embeddings,
first tokens unlike the others) and the fit confirmed it on held-out segments, a head has a
`position_mean`: x_t = μ + m(p_t) + (the process above), m(p) = Σ_j W_j cos(π (p + ½) j / P) over
j = 1..c−1, P the positions the fit saw (harness/fit.py, position_profile); μ, Σ, B and the tail
are then those of the tokens around m(p). Such a spec draws each trial's window at positions
p0..p0+S−1, p0 uniform in [0, P − S] as replay's windows lie anywhere in a segment, and its
calibration tokens independently at uniform positions, as replay picks them. `:position=none`
leaves m out (every window at positions 0..S−1, as specs without it draw). Per trial, as replay:FILE draws: `shape.n_heads`
key/value heads of `layer` (heads="random": without replacement; "first": 0..H−1), a query head of
each one's group, S window tokens at positions 0..S−1, Nq evaluated queries — the q of window
tokens drawn at random, as replay takes real queries from the window — and n_cal calibration
tokens of their own draw (another sequence of the same law) at positions 0..n_cal−1.
`temperature` and `drift` are unused (queries come from the fit; no decode tokens).
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvcommon.rope import apply_rope_numpy
from kvcommon.threads import small_linalg

from . import register
from .base import Scenario

FORMAT = "kvharness-fitted/1"
N_SCALE_QUANTILES = 65
ORDERS = ("fitted", "iid")
POSITIONS = ("fitted", "none")
# a covariance's negative eigenvalues tolerated, relative to its largest: what rounding a positive
# semi-definite one to 7 significant digits (tril) can produce; beyond it the spec is not a law
COVARIANCE_TOLERANCE = 1e-5
TAILS = ("token", "coordinate", "gaussian")


def dct_basis(positions: np.ndarray, length: int, n: int) -> np.ndarray:
    """(len(positions), n) cosines cos(π (p + ½) j / length), j = 0..n−1: the DCT-II basis of
    functions on positions 0..length−1 (j = 0 the constant)."""
    return np.cos(np.pi * (np.asarray(positions, dtype=float)[:, None] + 0.5) * np.arange(n) / length)


def position_deviation(positions: np.ndarray, profile: tuple[int, np.ndarray]) -> np.ndarray:
    """(n, 3d) m(p) at positions (n,) of a profile (P, W (c − 1, 3d)): module docstring, "Position"."""
    length, weights = profile
    return dct_basis(positions, length, weights.shape[0] + 1)[:, 1:] @ weights


@dataclass(frozen=True)
class TokenModel:
    """One query head's joint token law: mean (3d,), covariance (3d, 3d), dof (None: Gaussian),
    scale2_quantiles (N_SCALE_QUANTILES,) of s² (module docstring); transition (3d, 3d): B of its
    order along the sequence (None: tokens independent, as specs written before it held); tail: the
    tail law the fit chose ("coordinate" where a spec names none)."""
    mean: np.ndarray
    cov: np.ndarray
    dof: float | None
    scale2_quantiles: np.ndarray
    transition: np.ndarray | None = None
    tail: str = "coordinate"
    position_mean: tuple[int, np.ndarray] | None = None   # (P, W (c − 1, 3d)): module docstring, "Position"

    def deviation(self, positions: np.ndarray) -> np.ndarray:
        """(n, 3d) m(p), the mean's deviation at each of the positions (n,) (zeros without a profile)."""
        if self.position_mean is None:
            return np.zeros((len(positions), self.mean.shape[0]))
        return position_deviation(positions, self.position_mean)

    @functools.cached_property
    def basis(self) -> tuple[np.ndarray, np.ndarray]:
        """(λ (3d,) ascending, clipped at 0; U (3d, 3d)): the covariance's eigen-decomposition."""
        with small_linalg():
            lam, vec = np.linalg.eigh(self.cov)
        return np.clip(lam, 0, None), vec

    @functools.cached_property
    def root(self) -> np.ndarray:
        """U diag(√λ) (3d, 3d) with negative rounding eigenvalues clipped to 0."""
        lam, vec = self.basis
        return vec * np.sqrt(lam)

    def _latent(self, gen: np.random.Generator, n: int, tail: str) -> np.ndarray:
        """(n, 3d) latent entries z of the `tail` law (module docstring), unit variance."""
        p = self.mean.shape[0]
        if tail == "coordinate" and self.dof is not None:
            return gen.standard_t(self.dof, (n, p)) * math.sqrt((self.dof - 2) / self.dof)
        z = gen.standard_normal((n, p))
        if tail == "token":
            probs = np.linspace(0, 1, self.scale2_quantiles.shape[0])
            z *= np.sqrt(np.interp(gen.random(n), probs, self.scale2_quantiles))[:, None]
        return z

    @functools.cached_property
    def innovation_root(self) -> np.ndarray:
        """A square root (3d, 3d) of the VAR(1) innovations' covariance Σ − BΣBᵀ (negative rounding
        eigenvalues clipped to 0), B the transition."""
        with small_linalg():
            lam, vec = np.linalg.eigh(self.cov - self.transition @ self.cov @ self.transition.T)
        return vec * np.sqrt(np.clip(lam, 0, None))

    def sample(self, gen: np.random.Generator, n: int, tail: str = "fitted", order: str = "fitted") -> np.ndarray:
        """(n, 3d) float64 tokens x = μ + root z, z of the `tail` law ("fitted": the head's own),
        independent (order="iid" or no transition fitted), else in sequence order (module docstring,
        "Sequence structure")."""
        z = self._latent(gen, n, self.tail if tail == "fitted" else tail)
        if order == "iid" or self.transition is None:
            return self.mean + z @ self.root.T
        centred = np.empty((n, self.mean.shape[0]))
        centred[0] = self.root @ z[0]
        noise = z[1:] @ self.innovation_root.T
        for t in range(1, n):
            centred[t] = self.transition @ centred[t - 1] + noise[t - 1]
        return self.mean + centred


@dataclass(frozen=True)
class Spec:
    path: str
    data: dict
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    rope: tuple[np.ndarray, float] | None   # (inv_freq (d/2,), scaling)
    _models: dict = field(default_factory=dict, compare=False, repr=False)
    _checked_layers: set = field(default_factory=set, compare=False, repr=False)

    @property
    def group_size(self) -> int:
        return self.n_heads // self.n_kv_heads

    def layer(self, index: int) -> dict:
        return self.data["layers"][index]

    def token_model(self, layer: int, query_head: int) -> TokenModel:
        """The token law of (layer, query head), built once per loaded spec."""
        key = (layer, query_head)
        if key not in self._models:
            self._models[key] = self._build(layer, query_head)
        return self._models[key]

    def check_covariances(self, layer: int) -> None:
        """ValueError (one line) unless every head of `layer` has a positive semi-definite covariance
        (eigenvalues above −COVARIANCE_TOLERANCE × the largest); checked once per layer of a loaded spec."""
        if layer in self._checked_layers:
            return
        for head in range(self.n_heads):
            with small_linalg():
                lam = np.linalg.eigvalsh(self.token_model(layer, head).cov)
            if lam.min() < -COVARIANCE_TOLERANCE * max(abs(lam.max()), 1e-300):
                raise ValueError(f"{self.path}: layer {layer} head {head}: its covariance is not positive "
                                 f"semi-definite (eigenvalue {lam.min():.3g} against the largest {lam.max():.3g}); "
                                 f"refit it with harness fit")
        self._checked_layers.add(layer)

    def _build(self, layer: int, query_head: int) -> TokenModel:
        return head_model(self.data["layers"][layer]["heads"][query_head])


def head_model(entry: dict) -> TokenModel:
    """The TokenModel of a spec's head entry (mean, the covariance's lower triangle, dof,
    scale2_quantiles, and the transition and tail where present), from the numbers as the spec stores them."""
    n = len(entry["mean"])
    cov = np.zeros((n, n))
    cov[np.tril_indices(n)] = entry["cov"]
    cov = cov + np.tril(cov, -1).T
    transition = entry.get("transition")
    profile = entry.get("position_mean")
    return TokenModel(np.asarray(entry["mean"], dtype=float), cov, entry["dof"],
                      np.asarray(entry["scale2_quantiles"], dtype=float),
                      None if transition is None else np.asarray(transition, dtype=float).reshape(n, n),
                      entry.get("tail", "coordinate"),
                      None if profile is None else (int(profile["length"]),
                                                    np.asarray(profile["coefficients"], dtype=float).reshape(-1, n)))


def tril(cov: np.ndarray) -> list[float]:
    """The lower triangle of a symmetric matrix, row by row (what a spec stores)."""
    return cov[np.tril_indices(cov.shape[0])].tolist()


def _check_spec(path: Path, data) -> Spec:
    def bad(why: str) -> ValueError:
        return ValueError(f"{path}: not a fitted scenario spec ({why})")
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise bad(f"format is {data.get('format') if isinstance(data, dict) else None!r}, expected {FORMAT!r}")
    try:
        dim, n_heads, n_kv = int(data["head_dim"]), int(data["heads"]), int(data["kv_heads"])
        layers = data["layers"]
        rope = data.get("rope")
        rope = None if rope is None else (np.asarray(rope["inv_freq"], dtype=float), float(rope["scaling"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise bad(f"missing or malformed {exc}") from None
    if dim < 1 or n_kv < 1 or n_heads % n_kv or not isinstance(layers, list) or not layers:
        raise bad(f"head_dim {dim}, heads {n_heads}, kv_heads {n_kv}, {len(layers) if isinstance(layers, list) else 0}"
                  f" layers")
    if rope is not None and not 0 < 2 * rope[0].shape[0] <= dim:
        raise bad(f"rope has {rope[0].shape[0]} frequencies for head_dim {dim} (at most {dim // 2})")
    n = 3 * dim
    for i, layer in enumerate(layers):
        heads = layer.get("heads") if isinstance(layer, dict) else None
        if not isinstance(heads, list) or len(heads) != n_heads:
            raise bad(f"layer {i} needs {n_heads} heads")
        for h, entry in enumerate(heads):
            try:
                scales = np.asarray(entry["scale2_quantiles"], dtype=float)
                ok = len(entry["mean"]) == n and len(entry["cov"]) == n * (n + 1) // 2 and \
                    (entry["dof"] is None or float(entry["dof"]) > 2) and scales.shape == (N_SCALE_QUANTILES,) \
                    and scales[0] >= 0 and np.all(np.diff(scales) >= 0)
                values = np.asarray(entry["mean"] + entry["cov"] + scales.tolist(), dtype=float)
            except (KeyError, TypeError, ValueError):
                ok, values = False, np.zeros(1)
            if not ok or not np.all(np.isfinite(values)):
                raise bad(f"layer {i} head {h}: mean of {n} numbers, cov of {n * (n + 1) // 2} (lower triangle), "
                          f"dof > 2 or null and {N_SCALE_QUANTILES} non-decreasing scale2_quantiles expected")
            transition = entry.get("transition")
            try:
                ok = transition is None or (len(transition) == n * n and np.all(np.isfinite(np.asarray(transition,
                                                                                                       dtype=float))))
            except (TypeError, ValueError):
                ok = False
            if not ok:
                raise bad(f"layer {i} head {h}: transition must be null or {n * n} finite numbers ({n} x {n}, row by row)")
            profile = entry.get("position_mean")
            try:
                coefficients = None if profile is None else np.asarray(profile["coefficients"], dtype=float)
                ok = profile is None or (int(profile["length"]) >= 1 and coefficients.ndim == 1
                                         and coefficients.size % n == 0 and np.all(np.isfinite(coefficients)))
            except (KeyError, TypeError, ValueError):
                ok = False
            if not ok:
                raise bad(f"layer {i} head {h}: position_mean must be null or a length >= 1 and coefficients, "
                          f"a multiple of {n} finite numbers")
            if entry.get("tail", "coordinate") not in TAILS:
                raise bad(f"layer {i} head {h}: tail {entry.get('tail')!r}; valid: {', '.join(TAILS)}")
    return Spec(str(path), data, dim, len(layers), n_heads, n_kv, rope)


def load_spec(path: str | Path) -> Spec:
    """The validated spec at `path`; ValueError (one line naming the file) otherwise."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such fitted scenario spec (write one with `harness fit CAPTURE --out {path}`)")
    stat = path.stat()
    return _load_cached(str(path.resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _load_cached(path: str, mtime_ns: int, size: int) -> Spec:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable JSON spec ({type(exc).__name__})") from None
    return _check_spec(Path(path), data)


def rope_np(x: np.ndarray, positions: np.ndarray, rope: tuple[np.ndarray, float]) -> np.ndarray:
    """The capture's RoPE (rotate-half, its inv_freq and scaling) of x (..., N, d) at positions (N,)."""
    return apply_rope_numpy(x, positions, rope[0], rope[1])


@register
@dataclass(frozen=True)
class Fitted(Scenario):
    name = "fitted"
    description = "K, V, Q drawn with the per-layer statistics `harness fit` measured on a capture"
    parametric = True
    source_hint = "SPEC.json"
    source: str = ""
    layer: int = -1
    heads: str = "random"
    tail: str = "fitted"
    order: str = "fitted"
    position: str = "fitted"

    def validate(self) -> None:
        if not self.source:
            raise ValueError("scenario fitted: give the spec as fitted:SPEC.json")
        if self.tail not in TAILS + ("fitted",):
            raise ValueError(f"scenario fitted: tail={self.tail!r}; valid: fitted, {', '.join(TAILS)}")
        if self.order not in ORDERS:
            raise ValueError(f"scenario fitted: order={self.order!r}; valid: {', '.join(ORDERS)}")
        if self.heads not in ("random", "first"):
            raise ValueError(f"scenario fitted: heads={self.heads!r}; valid: random, first")
        if self.position not in POSITIONS:
            raise ValueError(f"scenario fitted: position={self.position!r}; valid: {', '.join(POSITIONS)}")
        spec = load_spec(self.source)
        if isinstance(self.layer, bool) or not isinstance(self.layer, int) or not -1 <= self.layer < spec.n_layers:
            raise ValueError(f"scenario fitted: layer={self.layer!r}; valid: -1 (middle) or 0..{spec.n_layers - 1}")
        spec.check_covariances(self.layer_index(spec))

    def spec(self) -> Spec:
        return load_spec(self.source)

    def layer_index(self, spec: Spec) -> int:
        """Layer -1 is the middle one, L // 2, as for replay:FILE."""
        return spec.n_layers // 2 if self.layer == -1 else self.layer

    def check_shape(self, shape) -> None:
        spec = self.spec()
        if shape.n_decode:
            raise ValueError("fitted: --decode-tokens is not supported")
        if spec.dim != shape.dim:
            raise ValueError(f"{spec.path}: head_dim in spec is {spec.dim}, requested dim {shape.dim}")
        if shape.n_heads > spec.n_kv_heads:
            raise ValueError(f"{spec.path}: {shape.n_heads} heads requested, the spec has {spec.n_kv_heads} "
                             f"key/value heads")
        length = self.position_length(spec)
        if length is not None and shape.seq_len > length:
            raise ValueError(f"{spec.path}: seq_len {shape.seq_len} exceeds the {length} positions its layer "
                             f"{self.layer_index(spec)} was fitted on (the mean depends on position); lower --seq-len "
                             f"or draw with fitted:...:position=none")

    def position_length(self, spec: Spec) -> int | None:
        """P, the positions the layer's position profiles span, or None: no head of the layer has one,
        or position=none."""
        if self.position == "none":
            return None
        layer = self.layer_index(spec)
        lengths = [model.position_mean[0] for model in (spec.token_model(layer, h) for h in range(spec.n_heads))
                   if model.position_mean is not None]
        return max(lengths) if lengths else None

    def draw(self, streams, shape):
        """One trial, float64: k, v (H, S, d); q (H, Nq, d); k_cal, v_cal (H, n_cal, d); positions (S,);
        with shape.prefill_queries also q_prefill (H, S, d), the window tokens' own queries."""
        self.check_shape(shape)
        spec = self.spec()
        h, s, d, n_cal = shape.n_heads, shape.seq_len, spec.dim, shape.n_calib
        layer = self.layer_index(spec)
        if self.heads == "random":
            heads = streams("heads").choice(spec.n_kv_heads, size=h, replace=False)
        else:
            heads = np.arange(h)
        out = {"k": np.empty((h, s, d)), "v": np.empty((h, s, d)), "q": np.empty((h, shape.n_queries, d)),
               "k_cal": np.empty((h, n_cal, d)), "v_cal": np.empty((h, n_cal, d))}
        length = self.position_length(spec)
        positions = np.arange(s) if length is None else int(streams("start").integers(length - s + 1)) + np.arange(s)
        for i, head in enumerate(heads):
            query_head = int(head) * spec.group_size + int(streams("query_head", i).integers(spec.group_size))
            model = spec.token_model(layer, query_head)
            window = model.sample(streams("tokens", i), s, self.tail, self.order)
            if length is None:
                cal_positions = np.arange(n_cal)
                cal = model.sample(streams("calibration", i), n_cal, self.tail, self.order)
            else:   # as replay takes them: independent tokens at any position
                window += model.deviation(positions)
                cal_positions = streams("calibration_positions", i).integers(length, size=n_cal)
                cal = model.sample(streams("calibration", i), n_cal, self.tail, "iid") + model.deviation(cal_positions)
            k, v, q_own = window[:, :d], window[:, d:2 * d], window[:, 2 * d:]
            k_cal = cal[:, :d]
            if spec.rope is not None:
                k, q_own = rope_np(k, positions, spec.rope), rope_np(q_own, positions, spec.rope)
                k_cal = rope_np(k_cal, cal_positions, spec.rope)
            tokens = streams("queries", i).choice(s, size=shape.n_queries, replace=shape.n_queries > s)
            out["k"][i], out["v"][i], out["q"][i] = k, v, q_own[tokens]
            out["k_cal"][i], out["v_cal"][i] = k_cal, cal[:, d:2 * d]
            if shape.prefill_queries:
                out.setdefault("q_prefill", np.empty((h, s, d)))[i] = q_own
        out["positions"] = positions
        return out
