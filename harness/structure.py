"""The sequence structure of a scenario's windows, measured as stats/sequence_structure.py defines it.

`harness fit` records it on a capture and `harness predictivity` compares a fitted scenario's draws
with the replayed real windows at the sweep's window length. A window is one head's S tokens: its
keys (post-RoPE, as attention sees them) at positions 0..S−1, and the window tokens' own queries
(q_prefill) at the same positions, causal for a decoder and bidirectional for an encoder.
"""
from __future__ import annotations

import numpy as np

import scenarios
from kvcommon.rng import generator
from scenarios.base import TrialShape
from stats.sequence_structure import structure_statistics

# the statistics compared, each a mean over heads and windows (sink_share over the first N_SINKS keys)
STATISTICS = ("sink_share", "recency_ratio", "heavy_share", "lag1_k", "lag1_v", "logit_std")
N_SINKS = 4


def _row(q, k, v, positions, causal: bool) -> list[float]:
    """STATISTICS of one head's window: q (n, d), k and v (n, d) at positions (n,)."""
    stats = structure_statistics(q, k, positions, positions, v=v, n_sinks=N_SINKS, causal=causal)
    return [getattr(stats, name) for name in STATISTICS]


def _means(rows: list) -> dict[str, float]:
    return dict(zip(STATISTICS, np.nanmean(np.asarray(rows, dtype=float), axis=0).tolist())) if rows else {}


def segment_statistics(k: np.ndarray, v: np.ndarray, q: np.ndarray, positions: np.ndarray, segments: np.ndarray,
                       *, causal: bool) -> dict[str, float]:
    """Means over heads and segments of STATISTICS for one layer of a capture: k, v (Hkv, n, d) and
    q (Hq, n, d) as attention receives them, positions and segment ids (n,); query head h reads
    key/value head h // (Hq / Hkv). Each segment is a window (a forward pass of the model)."""
    group = q.shape[0] // k.shape[0]
    rows = []
    for segment in np.unique(segments):
        span = np.flatnonzero(segments == segment)
        if span.size <= N_SINKS + 1:
            continue
        rows += [_row(q[h, span], k[h // group, span], v[h // group, span], positions[span], causal)
                 for h in range(q.shape[0])]
    return _means(rows)


def window_statistics(scenario: str, *, dim: int, seq_len: int, n_windows: int = 16, n_heads: int = 4,
                      causal: bool, seed: int = 0) -> dict[str, float]:
    """Means over n_windows trials × n_heads heads of STATISTICS on the scenario's windows of
    seq_len tokens (module doc), drawn from streams of their own (seed, "structure", scenario)."""
    built = scenarios.create(scenario)
    shape = TrialShape(n_heads=n_heads, seq_len=seq_len, n_queries=1, dim=dim, n_calib=1, prefill_queries=True)
    positions = np.arange(seq_len)
    rows = []
    for trial in range(n_windows):
        draw = built.draw(lambda *labels, _t=trial: generator("pcg64", seed, "structure", scenario, _t, *labels),
                          shape)
        rows += [_row(draw["q_prefill"][h], draw["k"][h], draw["v"][h], positions, causal) for h in range(n_heads)]
    return _means(rows)
