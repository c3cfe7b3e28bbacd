"""Sequence-structure statistics of one attention head: sinks, recency, heavy hitters, neighbours.

The same functions measure a draw of `scenarios/structured.py` and a real capture (`harness fit`),
on one head's arrays: q (Nq, d) at query_positions (Nq,), k and v (S, d) at key_positions (S,),
integer token positions, keys in the order of their positions (a window's first keys are its
first tokens). Attention is computed explicitly, in float64,

    A = softmax(q kᵀ/√d) over the keys a query sees: a query at position p sees the keys at
        positions ≤ p (causal; queries after the window, as a decoder's next tokens, see all),
        or every key with causal=False (an encoder; distances are then |p_i − p_j|),

and every statistic is a plain function of A or of the arrays:

- sink_share: mean over queries of the mass on the first n keys (attention sinks, StreamingLLM
  arXiv 2309.17453); uniform attention gives n/S (n/(visible keys) for a causal query).
- distance_profile: the mean of n_i·A'_ij over the (query, key) pairs whose distance Δ = p_i − p_j
  falls in a log-spaced bin [0, 1), [1, 2), [2, 4), [4, 8), ...; A' is A over the keys after the
  first n_excluded (the sinks), renormalised per query, and n_i the number of such keys query i
  sees, so uniform attention gives 1 in every bin (a flat curve).
- recency_ratio: the scalar summary chosen for recency: mean over queries of the mean of n_i·A'_ij
  over the query's nearest ⌈n_i/16⌉ keys (the nearest 1/16 of its distances), i.e. the mean
  attention per key there over the mean attention per key overall. 1: no preference for near keys
  (uniform attention, or any attention that does not depend on distance, in expectation); above 1:
  near keys are favoured (RoPE's long-term decay, RoFormer arXiv 2104.09864). A ratio, not
  a fitted log-log slope: it needs no model of the curve's shape and stays finite when a bin is
  empty or its mass is 0.
- heavy_share: the share of the total attention mass (summed over queries) on the keys after the
  first n_excluded that their top 1 % (at least one key) receive (heavy hitters, H2O arXiv
  2306.14048); uniform attention gives top/n for queries after the window. Causal queries give
  early keys more mass (more queries see them), as H2O's accumulated score does.
- lag1_correlation: the lag-1 autocorrelation of the tokens x (S, d) centred per coordinate,
  r = Σ_{t<S−1} ⟨x̃_t, x̃_{t+1}⟩ / Σ_t ‖x̃_t‖²: the usual sample autocorrelation (Box & Jenkins,
  full-sum denominator) pooled over coordinates as a normalised inner product, i.e. the mean of
  the coordinates' own r weighted by their variances (coordinates of no variance weigh nothing).
  For a stationary AR(1) with coefficient ρ it estimates ρ, biased by about −(1 + 3ρ)/S, with a
  sampling SD of about √((1−ρ²)/(S·d)) for d independent coordinates (Bartlett). Pass pre-RoPE
  keys to measure the tokens' own correlation: RoPE turns pair i by θ_i per token, which
  multiplies a pair's lag-1 correlation by cos θ_i.
- logit_statistics: the mean and standard deviation (ddof 0) of the logits q·k/√d over the
  (query, key) pairs attention sees; mean_cosine: the cosine between the mean query and the mean key.

Cost: one (Nq, S) logit matrix and one row-wise sort: S = 2048, Nq = 256, d = 128 in 0.05–0.2 s on two
shared CPU cores.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

NEAR_FRACTION = 1 / 16   # recency_ratio: the nearest 1/16 of each query's distances
TOP_FRACTION = 0.01      # heavy_share: the top 1 % of keys (at least one)


def visible(query_positions: np.ndarray, key_positions: np.ndarray, causal: bool = True) -> np.ndarray:
    """(Nq, S) bool: query i sees key j (key position ≤ query position; every key when not causal,
    as an encoder's queries, and the harness metrics', see the whole window)."""
    if not causal:
        return np.ones((len(query_positions), len(key_positions)), dtype=bool)
    return np.asarray(key_positions)[None, :] <= np.asarray(query_positions)[:, None]


def attention_weights(q: np.ndarray, k: np.ndarray, query_positions: np.ndarray,
                      key_positions: np.ndarray, causal: bool = True) -> np.ndarray:
    """softmax(q kᵀ/√d) (Nq, S), float64, over the keys each query sees (0 on the others); a
    ValueError when a query sees no key. causal: as `visible`."""
    logits = _logits(q, k)
    seen = visible(query_positions, key_positions, causal)
    if not seen.any(axis=1).all():
        first = int(np.argmin(seen.any(axis=1)))
        raise ValueError(f"query {first} at position {int(np.asarray(query_positions)[first])} sees no key "
                         f"(keys at positions {int(np.min(key_positions))}..{int(np.max(key_positions))})")
    logits = np.where(seen, logits, -np.inf)
    weights = np.exp(logits - logits.max(axis=1, keepdims=True))
    return weights / weights.sum(axis=1, keepdims=True)


def uniform_weights(query_positions: np.ndarray, key_positions: np.ndarray, causal: bool = True) -> np.ndarray:
    """(Nq, S): uniform attention over the keys each query sees, the reference every statistic is
    read against (sink_share(uniform_weights(...), n) is the share n tokens have by count alone)."""
    seen = visible(query_positions, key_positions, causal).astype(float)
    return seen / np.maximum(seen.sum(axis=1, keepdims=True), 1.0)


def sink_share(weights: np.ndarray, n_sinks: int) -> float:
    """Mean over queries of the attention mass on the first n_sinks keys; weights (Nq, S)."""
    return float(weights[:, :n_sinks].sum(axis=1).mean())


@dataclass(frozen=True, eq=False)
class DistanceProfile:
    """Attention against distance: bins [starts[b], starts[b+1]) of Δ = query − key position,
    starts = 0, 1, 2, 4, 8, ...; mean (n_bins,): the mean normalised attention per key in the bin (1
    everywhere for uniform attention; NaN where no pair falls); n_pairs (n_bins,): pairs per bin."""
    starts: np.ndarray
    mean: np.ndarray
    n_pairs: np.ndarray


def _per_key(weights: np.ndarray, query_positions: np.ndarray, key_positions: np.ndarray,
             n_excluded: int, causal: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(n_i·A'_ij (Nq', S) with 0 where not seen, the seen mask (Nq', S), the distances (Nq', S);
    |Δ| when not causal) for the queries that see a key after the first n_excluded and give those
    keys some mass."""
    seen = visible(query_positions, key_positions, causal)
    seen[:, :n_excluded] = False
    mass = np.where(seen, weights, 0.0).sum(axis=1)
    rows = seen.any(axis=1) & (mass > 0)
    seen, mass = seen[rows], mass[rows]
    scaled = np.where(seen, weights[rows], 0.0) * (seen.sum(axis=1) / mass)[:, None]
    distance = np.asarray(query_positions)[rows, None] - np.asarray(key_positions)[None, :]
    return scaled, seen, distance if causal else np.abs(distance)


def distance_bins(distance: np.ndarray) -> np.ndarray:
    """Bin index of each distance Δ ≥ 0: 0 for Δ = 0, 1 + ⌊log₂ Δ⌋ otherwise."""
    distance = np.asarray(distance, dtype=np.int64)
    out = np.zeros(distance.shape, dtype=np.int64)
    positive = distance > 0
    out[positive] = np.floor(np.log2(distance[positive])).astype(np.int64) + 1
    return out


def distance_profile(weights: np.ndarray, query_positions: np.ndarray, key_positions: np.ndarray, *,
                     n_excluded: int = 0, causal: bool = True) -> DistanceProfile:
    """Mean attention per key against distance (module doc), the first n_excluded keys left out."""
    scaled, seen, distance = _per_key(weights, query_positions, key_positions, n_excluded, causal)
    bins = distance_bins(distance[seen])
    n_bins = int(bins.max()) + 1 if bins.size else 0
    n_pairs = np.bincount(bins, minlength=n_bins)
    total = np.bincount(bins, weights=scaled[seen], minlength=n_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(n_pairs > 0, total / n_pairs, np.nan)
    starts = np.array([0] + [2 ** b for b in range(max(0, n_bins - 1))], dtype=np.int64)
    return DistanceProfile(starts, mean, n_pairs)


def recency_ratio(weights: np.ndarray, query_positions: np.ndarray, key_positions: np.ndarray, *,
                  n_excluded: int = 0, fraction: float = NEAR_FRACTION, causal: bool = True) -> float:
    """Mean attention per key on each query's nearest ⌈n_i·fraction⌉ keys over the mean per key,
    averaged over queries (module doc); NaN when no query sees a key after the first n_excluded."""
    scaled, seen, distance = _per_key(weights, query_positions, key_positions, n_excluded, causal)
    if not len(scaled):
        return math.nan
    n_seen = seen.sum(axis=1)
    n_near = np.ceil(n_seen * fraction).astype(np.int64)
    order = np.argsort(np.where(seen, distance, np.iinfo(np.int64).max), axis=1, kind="stable")
    nearest = np.take_along_axis(scaled, order, axis=1)
    near = np.arange(scaled.shape[1])[None, :] < n_near[:, None]
    return float(((nearest * near).sum(axis=1) / n_near).mean())


def heavy_share(weights: np.ndarray, *, n_excluded: int = 0, top: float = TOP_FRACTION) -> float:
    """Share of the attention mass summed over queries, on the keys after the first n_excluded,
    that the top max(1, ⌊top·n⌋) of those n keys receive; NaN when they receive no mass."""
    mass = weights[:, n_excluded:].sum(axis=0)
    total = mass.sum()
    if not len(mass) or total <= 0:
        return math.nan
    n_top = max(1, math.floor(top * len(mass)))
    return float(np.sort(mass)[::-1][:n_top].sum() / total)


def lag1_correlation(x: np.ndarray) -> float:
    """Pooled lag-1 autocorrelation of tokens x (S, d) centred per coordinate (module doc); NaN
    for fewer than two tokens or tokens that do not vary."""
    x = np.asarray(x, dtype=np.float64)
    if x.shape[0] < 2:
        return math.nan
    centred = x - x.mean(axis=0)
    energy = float(np.sum(centred * centred))
    if energy <= 0:
        return math.nan
    return float(np.sum(centred[:-1] * centred[1:]) / energy)


def _logits(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    q, k = np.asarray(q, dtype=np.float64), np.asarray(k, dtype=np.float64)
    return q @ k.T / math.sqrt(q.shape[-1])


def logit_statistics(q: np.ndarray, k: np.ndarray, query_positions: np.ndarray,
                     key_positions: np.ndarray, causal: bool = True) -> tuple[float, float]:
    """(mean, standard deviation) of q·k/√d over the (query, key) pairs attention sees."""
    seen = visible(query_positions, key_positions, causal)
    values = _logits(q, k)[seen]
    if not values.size:
        return math.nan, math.nan
    return float(values.mean()), float(values.std())


def mean_cosine(q: np.ndarray, k: np.ndarray) -> float:
    """Cosine between the mean query and the mean key, q (Nq, d) and k (S, d); NaN if either is 0."""
    mean_q, mean_k = np.asarray(q, dtype=np.float64).mean(axis=0), np.asarray(k, dtype=np.float64).mean(axis=0)
    norms = float(np.linalg.norm(mean_q) * np.linalg.norm(mean_k))
    return float(mean_q @ mean_k / norms) if norms > 0 else math.nan


@dataclass(frozen=True, eq=False)
class StructureStatistics:
    """One head's sequence structure (module doc). *_uniform: the same statistic of uniform attention
    over the keys each query sees, the value without the property; lag1_v is NaN without v."""
    n_sinks: int
    sink_share: float
    sink_share_uniform: float
    recency_ratio: float
    heavy_share: float
    heavy_share_uniform: float
    lag1_k: float
    lag1_v: float
    logit_mean: float
    logit_std: float
    qk_mean_cosine: float
    profile: DistanceProfile

    def as_row(self) -> dict[str, float]:
        """The scalar statistics as a flat dict (the profile left out)."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "profile"}


def structure_statistics(q: np.ndarray, k: np.ndarray, query_positions: np.ndarray, key_positions: np.ndarray,
                         *, v: np.ndarray | None = None, n_sinks: int = 4, causal: bool = True) -> StructureStatistics:
    """Every statistic of one head (module doc) from one attention matrix; sinks are the first
    n_sinks keys, left out of the distance and heavy-hitter statistics; causal=False: every query
    sees every key (an encoder; distances |Δ|)."""
    weights = attention_weights(q, k, query_positions, key_positions, causal)
    uniform = uniform_weights(query_positions, key_positions, causal)
    logit_mean, logit_std = logit_statistics(q, k, query_positions, key_positions, causal)
    return StructureStatistics(
        n_sinks=n_sinks,
        sink_share=sink_share(weights, n_sinks), sink_share_uniform=sink_share(uniform, n_sinks),
        recency_ratio=recency_ratio(weights, query_positions, key_positions, n_excluded=n_sinks, causal=causal),
        heavy_share=heavy_share(weights, n_excluded=n_sinks),
        heavy_share_uniform=heavy_share(uniform, n_excluded=n_sinks),
        lag1_k=lag1_correlation(k), lag1_v=lag1_correlation(v) if v is not None else math.nan,
        logit_mean=logit_mean, logit_std=logit_std, qk_mean_cosine=mean_cosine(q, k),
        profile=distance_profile(weights, query_positions, key_positions, n_excluded=n_sinks, causal=causal))
