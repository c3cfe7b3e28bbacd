"""The Scenario protocol: a seeded generator of one trial's K, V, Q and calibration draw.

A scenario draws each trial from NumPy generators handed to it by label (`streams(label)`),
so a tensor's values depend only on (root seed, cell, trial, label): every scheme sees the
same data (paired comparisons), and changing the calibration size never changes K.
Shapes of one trial: k, v (H, S, d); q (H, Nq, d); k_cal, v_cal (H, n_cal, d); positions (S,).
With n_decode = N > 0 also k_decode, v_decode (H, N, d) and positions_decode (N,): the tokens
generated after the prefill, from a drifted population and their own labelled streams, so the
prefill (k, v, q, calibration) is the same whatever N is. With prefill_queries also q_prefill
(H, S, d) (and q_prefill_decode (H, N, d)): the queries of the cached tokens themselves, drawn
from the query law on streams of their own, for codecs that observe the prefill's attention
(kvpress's presses); q, the evaluated queries, stay a separate draw no codec sees.
"""
from __future__ import annotations

import functools
import inspect
import math
import zlib
from dataclasses import dataclass, fields
from typing import Callable, ClassVar

import numpy as np

from kvcommon.threads import small_linalg

Streams = Callable[..., np.random.Generator]

# float32: the narrowest dtype a run computes in (run --dtype, its default), so a range it carries
# is carried by float64 as well.
_FLOAT32 = np.finfo(np.float32)


def carried_range(n_summed: int) -> tuple[float, float]:
    """[lo, hi]: the largest entry magnitude M of a trial's q, k and v that float32 carries through
    the metrics, where n_summed = S·d (cached tokens times head dimension).

    The metrics square values and sum them, a row at a time in the run's dtype (stats/metrics.py).
    The largest such sum is a row of logits, Σ_s (q·k_s/√d)² ≤ S·(√d·M²)² = n_summed·M⁴: finite
    iff M ≤ (max/n_summed)^¼. At the other end a relative error of eps in the entries must still
    square to a normal number in a logit, (eps·M²)² ≥ tiny, i.e. M ≥ (tiny/eps²)^¼; below it
    the errors vanish into zeros and subnormals (an all-zero tensor stores rel_mse 0/0 = 0).
    float32: lo ≈ 9.6e-7; hi ≈ 1.5e8 at S·d = 6,400, 4.3e7 at 1024·256."""
    lo = (float(_FLOAT32.tiny) / float(_FLOAT32.eps) ** 2) ** 0.25
    hi = (float(_FLOAT32.max) / max(1, n_summed)) ** 0.25
    return lo, hi


def out_of_range(arrays: dict[str, np.ndarray], n_summed: int) -> tuple[str, float, str] | None:
    """(name, largest magnitude, one-line reason) of the first float array whose largest magnitude
    lies outside carried_range(n_summed) (or that holds NaN or inf), else None."""
    lo, hi = carried_range(n_summed)
    for name, x in arrays.items():
        if not (isinstance(x, np.ndarray) and x.dtype.kind == "f" and x.size):
            continue
        largest = max(abs(float(x.max())), abs(float(x.min())))   # no copy of x (captures run to GBs); NaN stays NaN
        if not lo <= largest <= hi:   # NaN fails both comparisons
            return name, largest, (f"{name} holds magnitudes up to {largest:.3g}, outside [{lo:.2g}, {hi:.2g}], the "
                                   f"range float32 carries through the metrics' squared sums over S·d = {n_summed}")
    return None


@dataclass(frozen=True)
class TrialShape:
    n_heads: int
    seq_len: int
    n_queries: int
    dim: int
    n_calib: int
    n_decode: int = 0   # tokens generated after the S prefill tokens (harness run --decode-tokens)
    prefill_queries: bool = False   # also draw q_prefill: the cached tokens' own queries


@dataclass(frozen=True)
class Population:
    """X = mix_X @ z per token, z with i.i.d. unit-variance entries of the scenario's law.

    mix_k, mix_v: (d, m) mixing matrices, so the population covariance is mix @ mixᵀ.
    """
    mix_k: np.ndarray
    mix_v: np.ndarray

    @property
    def cov_k(self) -> np.ndarray:
        return self.mix_k @ self.mix_k.T

    @property
    def cov_v(self) -> np.ndarray:
        return self.mix_v @ self.mix_v.T


@dataclass(frozen=True)
class Scenario:
    """Base of the synthetic generators. Subclasses define `population` and may change the law.

    temperature: queries are q ~ N(0, I/temperature²), independent of the keys; with the
        keys scaled so that E‖k‖² = d, the logits q·k/√d have standard deviation
        ≈ 1/temperature (0.5 → 2: attention neither uniform nor one-hot).
    drift: weight of the new population in the decode tokens (0: none, 1: all new); see `draw`.
    """
    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    temperature: float = 0.5
    drift: float = 0.5

    def validate(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"scenario {self.name}: parameter {f.name}={value} must be a finite number")
            if f.name == "drift":
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                    raise ValueError(f"scenario {self.name}: parameter drift={value!r} must lie in [0, 1]")
            elif isinstance(value, (int, float)) and not isinstance(value, bool) and value <= 0:
                raise ValueError(f"scenario {self.name}: parameter {f.name}={value} must be positive")

    def check_shape(self, shape: TrialShape) -> None:
        """ValueError (one line) when this scenario cannot produce trials of `shape`; the sweep
        calls it before anything is written. Synthetic generators serve any shape."""

    def check_data(self, shape: TrialShape) -> None:
        """ValueError (one line, naming the parameters set) when a probe draw of `shape` holds
        values float32 does not carry through the metrics (carried_range): parameters such as
        temperature=1e-300 or noise=1e300 that are finite but make the data overflow or vanish.
        The sweep calls it before anything is written. The probe draws from streams of its own
        (no trial's), at most 256 tokens and 64 queries of one head, so it costs milliseconds;
        the range is that of the full S + N tokens."""
        probe = TrialShape(1, min(shape.seq_len, 256), min(shape.n_queries, 64), shape.dim,
                           min(shape.n_calib, 256), min(shape.n_decode, 64))

        def streams(*labels):
            return np.random.default_rng(zlib.crc32(repr(("probe",) + labels).encode()))

        n_summed = (shape.seq_len + shape.n_decode) * shape.dim
        try:
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                wrong = out_of_range(self.draw(streams, probe), n_summed)
        except (OverflowError, FloatingPointError) as exc:
            wrong = ("", math.nan, f"its draw fails ({exc})")
        if wrong is None:
            return
        name, largest, reason = wrong
        given = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                          if f.name != "source" and getattr(self, f.name) != f.default) or "defaults"
        valid = "choose parameters that keep the data in range"
        if name.startswith("q") and 0 < largest < math.inf:   # the queries scale as 1/temperature
            lo, hi = carried_range(n_summed)
            valid = (f"temperature must lie in [{largest * self.temperature / hi:.2g}, "
                     f"{largest * self.temperature / lo:.2g}] here")
        raise ValueError(f"scenario {self.name} ({given}): {reason}; {valid}")

    def population(self, gen: np.random.Generator, dim: int, head: int = 0) -> Population:
        """The mixing matrices of key/value head `head` (0..H−1), from gen alone. An override may
        leave `head` out of its signature (a law the same for every head); one that names it gets
        the head it draws, for a per-head law (e.g. dof = dof0 + head·step from scalar parameters)."""
        raise NotImplementedError

    def latent(self, gen: np.random.Generator, shape, head: int = 0) -> np.ndarray:
        """i.i.d. unit-variance entries of the scenario's law for head `head` (standard normal by
        default); as population, an override may leave `head` out."""
        return gen.standard_normal(shape)

    def _population(self, gen: np.random.Generator, dim: int, head: int) -> Population:
        return self.population(gen, dim, head=head) if _takes_head(type(self).population) else \
            self.population(gen, dim)

    def _latent(self, gen: np.random.Generator, shape, head: int) -> np.ndarray:
        return self.latent(gen, shape, head=head) if _takes_head(type(self).latent) else self.latent(gen, shape)

    def draw(self, streams: Streams, shape: TrialShape) -> dict[str, np.ndarray]:
        """One trial, float64 arrays: k, v, q, k_cal, v_cal, positions; with shape.n_decode = N > 0
        also k_decode, v_decode (H, N, d) and positions_decode = S..S+N−1; with
        shape.prefill_queries also q_prefill (H, S, d) (and q_prefill_decode (H, N, d)).

        Drift model of the decode tokens: per head a second population (mix_new, from the stream
        "population-drift") is drawn independently of the first, and a decode token is
        x = √(1−drift)·mix·z1 + √(drift)·mix_new·z2 with z1, z2 independent latents of the
        scenario's law, so its covariance is (1−drift)·mix mixᵀ + drift·mix_new mix_newᵀ: the
        energy moves toward a new subspace while E‖x‖² stays the same. (Isotropic populations,
        gaussian, do not move: there is no subspace to drift from.)"""
        h, s, d = shape.n_heads, shape.seq_len, shape.dim
        out = {name: np.empty((h, n, d)) for name, n in
               (("k", s), ("v", s), ("q", shape.n_queries), ("k_cal", shape.n_calib), ("v_cal", shape.n_calib))}
        for head in range(h):
            pop = self._population(streams("population", head), d, head)
            for name, mix in (("k", pop.mix_k), ("v", pop.mix_v), ("k_cal", pop.mix_k), ("v_cal", pop.mix_v)):
                n = out[name].shape[1]
                out[name][head] = self._latent(streams(name, head), (n, mix.shape[1]), head) @ mix.T
            out["q"][head] = streams("q", head).standard_normal((shape.n_queries, d)) / self.temperature
            if shape.n_decode:
                self._draw_decode(streams, head, pop, shape, out)
            if shape.prefill_queries:
                for name, n in (("q_prefill", s), ("q_prefill_decode", shape.n_decode)):
                    if n:
                        queries = out.setdefault(name, np.empty((h, n, d)))
                        queries[head] = streams(name, head).standard_normal((n, d)) / self.temperature
        out["positions"] = np.arange(s)
        if shape.n_decode:
            out["positions_decode"] = np.arange(s, s + shape.n_decode)
        return out

    def _draw_decode(self, streams: Streams, head: int, pop: Population, shape: TrialShape,
                     out: dict[str, np.ndarray]) -> None:
        """Fill out["k_decode"], out["v_decode"] (H, N, d) at `head` from the drifted population."""
        new = self._population(streams("population-drift", head), shape.dim, head)
        for name, mix, mix_new in (("k", pop.mix_k, new.mix_k), ("v", pop.mix_v, new.mix_v)):
            z_old = self._latent(streams(f"{name}_decode", head), (shape.n_decode, mix.shape[1]), head)
            z_new = self._latent(streams(f"{name}_decode_drift", head), (shape.n_decode, mix_new.shape[1]), head)
            tokens = out.setdefault(f"{name}_decode", np.empty((shape.n_heads, shape.n_decode, shape.dim)))
            tokens[head] = np.sqrt(1 - self.drift) * z_old @ mix.T + np.sqrt(self.drift) * z_new @ mix_new.T


@functools.cache
def _takes_head(method) -> bool:
    """Whether a population or latent override takes the head (a parameter named `head`)."""
    return "head" in inspect.signature(method).parameters


def random_orthonormal(gen: np.random.Generator, dim: int, n_columns: int) -> np.ndarray:
    """A Haar-random (dim, n_columns) matrix with orthonormal columns (QR with sign fix)."""
    with small_linalg():  # a 128×128 QR on two contended threads costs 15–80x one thread's time
        q, r = np.linalg.qr(gen.standard_normal((dim, n_columns)))
    return q * np.sign(np.diag(r))


def power_law(dim: int, alpha: float) -> np.ndarray:
    """Eigenvalues λ_i ∝ i^−α scaled to sum to dim (so E‖x‖² = d)."""
    lam = np.arange(1, dim + 1, dtype=float) ** -alpha
    return lam * dim / lam.sum()


def participation_ratio(eigenvalues: np.ndarray) -> float:
    """(Σλ)²/Σλ² — the effective dimension d_eff before rounding."""
    lam = np.asarray(eigenvalues, dtype=float)
    return float(lam.sum() ** 2 / np.square(lam).sum())
