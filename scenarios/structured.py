"""structured: the sequence structure real attention has and i.i.d. tokens lack, one knob per property.

Real attention is not over exchangeable tokens. A few first tokens take a large share of every
query's attention (attention sinks, StreamingLLM arXiv 2309.17453); a few tokens at no
particular position are attended by many queries (heavy hitters, H2O arXiv 2306.14048);
queries favour nearby keys (with RoPE, q·k of a shared component decays with distance: RoFormer's
long-term decay, arXiv 2104.09864); neighbouring tokens are correlated; and a token's query
and key are two maps of one hidden state. Evicting codecs (h2o, streaming, kvpress's presses) live
on where the attention mass sits; quantisers on the spread of the logits; codecs that code
differences between neighbours on their correlation. Each property here is a settable scalar, and
0 switches it off; `stats/sequence_structure.py` measures the same properties on a draw or on a
real capture.

One head, head dimension d (even, ≥ 4), P = d/2 RoPE pairs in the rotate-half layout (pair i =
channels i and i + P, frequency θ_i = rope_base^(−2i/d); pair P−1 turns slowest):

1. Hidden state and neighbours (`rho`, `shared`). h_t ∈ R^d is a stationary AR(1) process along
   the sequence, h_t = ρ·h_{t−1} + √(1−ρ²)·e_t with e_t ~ N(0, I) and h_{−1} ~ N(0, I), so every
   token has unit variance and lag-1 correlation ρ. Each of q, k and v has a random part
   x_t = √shared·A_x h_t + √(1−shared)·ε^x_t, with A_q, A_k, A_v independent Haar-orthogonal
   (d, d) maps (so q is never k) and ε^x an AR(1) process of its own with the same ρ (the
   token-private part), so every coordinate of the random parts keeps lag-1 correlation ρ and unit
   variance. q and k depend on each other only through h: E[q_t k_sᵀ] = shared·ρ^|t−s|·A_q A_kᵀ
   (before the scalings below), whose expected trace is 0, so it gives no systematic preference
   for near or for similar keys. rho = 0: i.i.d. tokens; shared = 0: independent q, k and v.
2. Recency (`recency`). Every query and key, pre-RoPE, carries the same vector m, with equal energy
   on each pair 0..P−2 (a random phase per pair) and ‖m‖² = recency·√d; the random parts are
   scaled by √(1−a), a = recency/√d, so the tokens keep their energy. After RoPE at positions p_q,
   p_k this adds to a logit m·R(p_k − p_q)·m/√d = recency·f(Δ), f(Δ) = mean_{i<P−1} cos(θ_i·Δ),
   Δ = p_q − p_k: f(0) = 1, and f falls about linearly in log Δ as the pairs dephase, fastest pairs
   first (RoFormer); f(1) ≈ 0.97, f(16) ≈ 0.59, f(256) ≈ 0.33 at d = 64, base 10⁴. Needs
   recency < √d (check_shape). recency = 0: no component, no distance preference.
3. Sinks and heavy hitters (`n_sinks`, `sink_logit`, `heavy_fraction`, `heavy_logit`). Pair P−1,
   which RoPE turns least, holds a unit direction u (random phase); every query carries √d/2 along
   u, the first n_sinks keys 2·sink_logit and each heavy hitter 2·heavy_logit, so such a key's logit
   rises by sink_logit·cos(θ_{P−1}·Δ) (heavy_logit·…); cos(θ_{P−1}·Δ) ≥ 0.95 for Δ ≤ 2300 at d = 64,
   base 10⁴. While either property is on, the random part of the keys is kept off pair P−1
   (rescaled by √(d/(d−2)), so E‖k‖² stays d) and ordinary keys take nothing from u. Heavy hitters
   are each token independently with probability heavy_fraction (a uniform draw of their own, so a
   larger fraction keeps the smaller fraction's tokens), never a sink. sink_logit = 0: the first
   tokens are ordinary; heavy_logit = 0 or heavy_fraction = 0: no heavy hitters.
4. Temperature. Queries are divided by the temperature after all of the above, so it divides every
   logit, as a softmax temperature: an ordinary logit has standard deviation ≈ 1/temperature (as in
   every scenario, base.Scenario), and the knobs' logits are in units of it (a sink's extra logit is
   sink_logit/temperature). Keys have E‖k‖² = d (sinks and heavy hitters 4·logit² more).

Positions are a decoder's: the window's keys (and their own queries, q_prefill) at 0..S−1, the
evaluated queries at S, S+1, ... with h continued from h_{S−1} (the tokens that follow the
window), RoPE (kvcommon.rope, `rope_base`) applied to q and k. The calibration draw is another
sequence of the same head (the same maps, m and u; its own streams) at positions 0..n_cal−1, sinks
first. Decode tokens (n_decode = N) at positions S..S+N−1 continue the window's processes (h and
the private parts) and drift as base.Scenario states: their random parts are
√(1−drift)·(the window's sequence, continued) + √drift·(the same law under a second set of maps,
stream "population-drift", and processes of their own), so at the seam the lag-1 correlation is
√(1−drift)·ρ; m, u, sinks and heavy hitters keep their law.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

from kvcommon.rope import DEFAULT_BASE, apply_rope_numpy

from . import register
from .base import Scenario, TrialShape, random_orthonormal

# (low, low included, high, high included) of each numeric parameter; temperature and rope_base
# have no upper end, rho stops short of 1 (a process that never moves has no stationary law)
_RANGES = {
    "temperature": (0.0, False, math.inf, False), "drift": (0.0, True, 1.0, True),
    "n_sinks": (0, True, math.inf, False), "sink_logit": (0.0, True, math.inf, False),
    "recency": (0.0, True, math.inf, False), "heavy_fraction": (0.0, True, 1.0, True),
    "heavy_logit": (0.0, True, math.inf, False), "rho": (0.0, True, 1.0, False),
    "shared": (0.0, True, 1.0, True), "rope_base": (1.0, False, math.inf, False),
}


def _interval(low, low_in, high, high_in) -> str:
    return f"{'[' if low_in else '('}{low:g}, {'∞' if math.isinf(high) else f'{high:g}'}{']' if high_in else ')'}"


def ar1(innovations: np.ndarray, rho: float) -> np.ndarray:
    """The stationary AR(1) z_t = ρ·z_{t−1} + √(1−ρ²)·e_t of innovations (n + 1, w): row 0 is
    z_{−1} (the state before the first token: an N(0, I) draw, or the last state of the sequence
    this one continues), rows 1..n the e_t; returns z (n, w). Unit-variance rows stay unit-variance."""
    n = innovations.shape[0] - 1
    scale = math.sqrt(1.0 - rho * rho)
    out = np.empty((n, innovations.shape[1]))
    state = innovations[0]
    for t in range(n):   # a loop over tokens of whole rows: 8192 × 256 values in about 50 ms
        state = rho * state + scale * innovations[t + 1]
        out[t] = state
    return out


@dataclass(frozen=True)
class HeadPopulation:
    """What every sequence of one head shares: maps {"q", "k", "v"} of the hidden state, each a
    (d, d) Haar-orthogonal matrix; the unit recency direction (d,) (m = its norm times it) with equal
    energy on pairs 0..P−2; the unit sink / heavy-hitter direction u (d,) in pair P−1."""
    maps: dict[str, np.ndarray]
    recency_direction: np.ndarray
    shared_direction: np.ndarray


@register
@dataclass(frozen=True)
class Structured(Scenario):
    name = "structured"
    description = ("sequence structure: attention sinks, RoPE recency, heavy hitters, AR(1) neighbours, "
                   "q and k from one hidden process")
    n_sinks: int = 4             # as many initial tokens as StreamingLLM keeps (and the streaming codec)
    sink_logit: float = 2.0      # extra logit of a sink key, in ordinary logit standard deviations
    recency: float = 2.0         # extra logit of a key at distance 0 from the shared component, same units
    heavy_fraction: float = 0.05
    heavy_logit: float = 1.0
    rho: float = 0.5             # lag-1 correlation of neighbouring tokens
    shared: float = 0.5          # share of q's, k's and v's variance from the hidden state they share
    rope_base: float = DEFAULT_BASE

    def validate(self) -> None:
        """Each parameter in its range (a one-line ValueError naming it); unlike base.Scenario's,
        0 is valid where it switches a property off."""
        for f in fields(self):
            value = getattr(self, f.name)
            low, low_in, high, high_in = _RANGES[f.name]
            whole = f.name != "n_sinks" or (isinstance(value, int) and not isinstance(value, bool))
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not (number and whole and math.isfinite(value) and (low <= value if low_in else low < value)
                    and (value <= high if high_in else value < high)):
                kind = "a whole number" if f.name == "n_sinks" else "a finite number"
                raise ValueError(f"scenario {self.name}: parameter {f.name}={value!r} must be {kind} in "
                                 f"{_interval(low, low_in, high, high_in)}")

    def check_shape(self, shape: TrialShape) -> None:
        d = shape.dim
        if d < 4 or d % 2:
            raise ValueError(f"scenario {self.name}: head dimension {d} must be even and at least 4 (RoPE pairs: "
                             f"one for sinks and heavy hitters, the others for recency)")
        if self.recency >= math.sqrt(d):
            raise ValueError(f"scenario {self.name}: recency={self.recency} must be below √d = {math.sqrt(d):.3g} "
                             f"at head dimension {d} (the shared component takes recency/√d of each token's energy)")

    # --- the population of a head ----------------------------------------------------------------
    def head_population(self, gen: np.random.Generator, dim: int) -> HeadPopulation:
        """One head's maps and directions from its "population" stream. What is drawn does not depend
        on the parameters, so draws that differ only in a knob share everything else."""
        maps = {name: random_orthonormal(gen, dim, dim) for name in ("q", "k", "v")}
        half = dim // 2
        phases = gen.uniform(0.0, 2 * math.pi, half)
        recency = np.zeros(dim)
        recency[: half - 1] = np.cos(phases[: half - 1])
        recency[half: dim - 1] = np.sin(phases[: half - 1])
        shared = np.zeros(dim)
        shared[half - 1], shared[dim - 1] = math.cos(phases[-1]), math.sin(phases[-1])
        return HeadPopulation(maps, recency / math.sqrt(half - 1), shared)

    def recency_share(self, dim: int) -> float:
        """a = recency/√d: the share of each query's and key's energy in the recency component."""
        return self.recency / math.sqrt(dim)

    def has_sinks(self) -> bool:
        return self.n_sinks > 0 and self.sink_logit > 0

    def reserves_direction(self) -> bool:
        """Whether pair P−1 carries the sink / heavy-hitter direction (and the keys' random part
        leaves it)."""
        return self.has_sinks() or (self.heavy_fraction > 0 and self.heavy_logit > 0)

    def inv_freq(self, dim: int) -> np.ndarray:
        """θ_i = rope_base^(−2i/d), i < d/2 (kvcommon.rope)."""
        return self.rope_base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)

    # --- one sequence's tokens -------------------------------------------------------------------
    def _random_part(self, tensor_map: np.ndarray, hidden: np.ndarray, private: np.ndarray) -> np.ndarray:
        """√shared·A_x h_t + √(1−shared)·ε_t for hidden, private (n, d)."""
        return math.sqrt(self.shared) * hidden @ tensor_map.T + math.sqrt(1 - self.shared) * private

    def _boost(self, positions: np.ndarray, heavy_draw: np.ndarray) -> np.ndarray:
        """Each key's coordinate along u (n,): 2·sink_logit on sinks, 2·heavy_logit on heavy hitters
        (α·β/√d = logit with the queries' α = √d/2)."""
        sinks = positions < self.n_sinks if self.has_sinks() else np.zeros(len(positions), dtype=bool)
        heavy = (heavy_draw < self.heavy_fraction) & ~sinks
        return 2 * self.sink_logit * sinks + 2 * self.heavy_logit * heavy

    def _keys(self, pop: HeadPopulation, k_random: np.ndarray, positions: np.ndarray,
              heavy_draw: np.ndarray) -> np.ndarray:
        """Post-RoPE keys (n, d) of random parts k_random (n, d) at positions (n,)."""
        d = k_random.shape[1]
        if self.reserves_direction():   # ordinary keys take nothing from u
            k_random = k_random.copy()
            k_random[:, [d // 2 - 1, d - 1]] = 0.0
            k_random *= math.sqrt(d / (d - 2))
        a = self.recency_share(d)
        keys = (math.sqrt(1 - a) * k_random + math.sqrt(self.recency * math.sqrt(d)) * pop.recency_direction
                + np.outer(self._boost(positions, heavy_draw), pop.shared_direction))
        return apply_rope_numpy(keys, positions, self.inv_freq(d))

    def _queries(self, pop: HeadPopulation, q_random: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Post-RoPE queries (n, d) of random parts q_random (n, d) at positions (n,), over the temperature."""
        d = q_random.shape[1]
        a = self.recency_share(d)
        queries = math.sqrt(1 - a) * q_random + math.sqrt(self.recency * math.sqrt(d)) * pop.recency_direction
        if self.reserves_direction():
            queries = queries + math.sqrt(d) / 2 * pop.shared_direction
        return apply_rope_numpy(queries / self.temperature, positions, self.inv_freq(d))

    def _sequence(self, streams, head: int, labels: dict[str, str], n: int, dim: int,
                  before: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """AR(1) processes (n, d) of one sequence: "hidden" and the private parts named in labels
        (process name -> stream label), each from its own stream; a process named in `before`
        continues from that state (d,), the others start stationary."""
        innovations = {name: streams(label, head).standard_normal((n + 1, dim)) for name, label in labels.items()}
        for name, state in (before or {}).items():
            innovations[name][0] = state
        names = list(innovations)
        joint = ar1(np.hstack([innovations[name] for name in names]), self.rho)   # one pass for all
        return {name: joint[:, i * dim:(i + 1) * dim] for i, name in enumerate(names)}

    # --- a trial ---------------------------------------------------------------------------------
    def draw(self, streams, shape):
        """One trial (float64): k, v (H, S, d); q (H, Nq, d) at positions S..S+Nq−1; k_cal, v_cal
        (H, n_cal, d) at positions 0..n_cal−1 of a sequence of their own; positions (S,); with
        shape.n_decode = N > 0 also k_decode, v_decode (H, N, d) and positions_decode = S..S+N−1;
        with shape.prefill_queries also q_prefill (H, S, d) (and q_prefill_decode (H, N, d)), the
        tokens' own queries at their positions (module doc)."""
        self.check_shape(shape)
        h, s, d, n_q, n_cal, n_dec = (shape.n_heads, shape.seq_len, shape.dim, shape.n_queries, shape.n_calib,
                                      shape.n_decode)
        positions, q_positions = np.arange(s), np.arange(s, s + n_q)
        cal_positions, dec_positions = np.arange(n_cal), np.arange(s, s + n_dec)
        out = {name: np.empty((h, n, d)) for name, n in
               (("k", s), ("v", s), ("q", n_q), ("k_cal", n_cal), ("v_cal", n_cal))}
        if n_dec:
            out.update(k_decode=np.empty((h, n_dec, d)), v_decode=np.empty((h, n_dec, d)))
        if shape.prefill_queries:
            out["q_prefill"] = np.empty((h, s, d))
            if n_dec:
                out["q_prefill_decode"] = np.empty((h, n_dec, d))
        for head in range(h):
            pop = self.head_population(streams("population", head), d)
            maps = pop.maps
            # the window: keys, values and (with prefill_queries) the tokens' own queries
            window_labels = {"hidden": "hidden", "k": "k", "v": "v"}
            if shape.prefill_queries:
                window_labels["q"] = "q_prefill"
            window = self._sequence(streams, head, window_labels, s, d)
            out["k"][head] = self._keys(pop, self._random_part(maps["k"], window["hidden"], window["k"]),
                                        positions, streams("heavy", head).random(s))
            out["v"][head] = self._random_part(maps["v"], window["hidden"], window["v"])
            if shape.prefill_queries:
                out["q_prefill"][head] = self._queries(
                    pop, self._random_part(maps["q"], window["hidden"], window["q"]), positions)
            last = {name: x[-1] for name, x in window.items()} if s else {}
            # the evaluated queries: the tokens that follow the window (their private part is a draw
            # of its own: the window's own queries, q_prefill, are not drawn in every trial)
            follow = self._sequence(streams, head, {"hidden": "q_hidden", "q": "q"}, n_q, d,
                                    before={"hidden": last["hidden"]} if s else None)
            out["q"][head] = self._queries(pop, self._random_part(maps["q"], follow["hidden"], follow["q"]),
                                           q_positions)
            # calibration: another sequence of the same head
            cal = self._sequence(streams, head, {"hidden": "hidden_cal", "k": "k_cal", "v": "v_cal"}, n_cal, d)
            out["k_cal"][head] = self._keys(pop, self._random_part(maps["k"], cal["hidden"], cal["k"]),
                                            cal_positions, streams("heavy_cal", head).random(n_cal))
            out["v_cal"][head] = self._random_part(maps["v"], cal["hidden"], cal["v"])
            if n_dec:
                self._draw_decode_tokens(streams, head, pop, shape, last, dec_positions, out)
        out["positions"] = positions
        if n_dec:
            out["positions_decode"] = dec_positions
        return out

    def _draw_decode_tokens(self, streams, head: int, pop: HeadPopulation, shape: TrialShape,
                            last: dict[str, np.ndarray], positions: np.ndarray, out: dict[str, np.ndarray]) -> None:
        """Fill k_decode, v_decode (and q_prefill_decode) at `head`: the window's processes continued
        from their last states `last` (hidden and private parts), the random parts drifted toward a
        second set of maps (module doc)."""
        n, d = shape.n_decode, shape.dim
        names = ("k", "v", "q") if shape.prefill_queries else ("k", "v")
        drifted = self.head_population(streams("population-drift", head), d).maps
        old = self._sequence(streams, head, {"hidden": "hidden_decode",
                                             **{x: f"{'q_prefill' if x == 'q' else x}_decode" for x in names}},
                             n, d, before=last)   # drift 0: the window's sequence goes on
        new = self._sequence(streams, head, {"hidden": "hidden_decode_drift",
                                             **{x: f"{'q_prefill' if x == 'q' else x}_decode_drift" for x in names}},
                             n, d)
        part = {x: math.sqrt(1 - self.drift) * self._random_part(pop.maps[x], old["hidden"], old[x])
                + math.sqrt(self.drift) * self._random_part(drifted[x], new["hidden"], new[x]) for x in names}
        out["k_decode"][head] = self._keys(pop, part["k"], positions, streams("heavy_decode", head).random(n))
        out["v_decode"][head] = part["v"]
        if shape.prefill_queries:
            out["q_prefill_decode"][head] = self._queries(pop, part["q"], positions)
