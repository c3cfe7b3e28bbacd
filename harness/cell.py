"""The cell engine: a chunk of trials of the cells that share data → drawn data → each cell's scheme
(fit, encode, decode, score) → metrics → rows. Pure: no store, no Dask, no progress bar
(harness/runner.py orchestrates; harness/distributed.py and harness/bench.py call this too).

Seeds are data (STYLE.md §4): trial t of a cell draws from the streams
(seed, "data", scenario, dim, seq_len, queries, heads, t, tensor, head), shared by every scheme
and budget, and by every calibration size (the calibration sample has labels of its own, so
cells that differ only in calib_tokens see the same K, V and Q); a scheme's own randomness
comes from (seed, "scheme", family, budget, dim) — family the scheme's name or, for the variants
of one codec family (tq-*, sq-*, squ-*), the family's, so that variants draw alike what they code
alike (schemes.registry.seed_family) — and, for a scheme whose fit takes them, from
the trial indices (TurboQuant's per-trial rotation signs and sketches, SpectralQuant's
per-trial sketches, Shard's decode-token codec). Two draws are deliberately common to every
scheme seed and budget, as functions of the data and the RNG family only, so that the cells
coding the same data share them: SpectralQuant's power-iteration start block and Shard's
k-means of V. So a row depends only on (configuration, seed), never on chunking, order or
resumption.

Decode phase (--decode-tokens N > 0): after the S prefill tokens, N tokens of a drifted
distribution arrive (scenario streams of their own, so the prefill data do not depend on N).
The metrics are those of the whole S+N cache against the exact concatenation. See
run_cell_chunk for how each kind of scheme compresses the N tokens.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import os
import time
import weakref
from dataclasses import dataclass

import numpy as np
import torch

import scenarios
import schemes
from schemes.base import BitLedger, TrialBits, codec_logits, encode_codec, fit_codec
from scenarios.conformance import expected_shapes
from schemes.conformance import (ConformanceError, in_project, require_decoded, require_encoding_of,
                                 require_scored)
from kvcommon.memo import IdentityMemo
from kvcommon.rng import generator
from kvcommon.rows import CELL_COLUMNS, DIAGNOSTIC_COLUMNS, EVICTION_METRIC_NAMES, METRIC_NAMES, TRIAL_COLUMNS
from stats.metrics import exact_attention, exact_logits, trial_metrics

from .devices import available_memory_bytes
from .memory import peak_bytes, reset_peak
from .sweep import Cell, SweepConfig

CHUNK_TRIALS_ENV = "KVHARNESS_CHUNK_TRIALS"
DEFAULT_MEMORY_BYTES = 1 << 28  # bytes of working tensors per chunk; 256 MiB measured fastest on 2 cores (cache, allocator reuse)


# How scheme seeds are derived, recorded in a run's manifest: 1, keyed by the scheme's name; 2, by its
# seed family (the variants of tq, sq, squ share draws). A run is resumed only under its own rule.
SEED_RULE = 2


def family_seeded(schemes_: tuple[str, ...]) -> list[str]:
    """The schemes whose seed the two rules derive differently (a seed family of their own name)."""
    return [name for name in schemes_ if schemes.registry.seed_family(name) != name]


def bytes_per_trial(config: SweepConfig, cell: Cell) -> int:
    """A generous estimate of the working memory one trial needs (tensors and temporaries)."""
    item = 8 if config.dtype == "float64" else 4
    tokens = cell.seq_len + config.decode_tokens
    cache = config.heads * tokens * cell.dim
    attention = config.heads * cell.queries * tokens
    calib = config.heads * cell.calib_tokens * cell.dim
    return item * (12 * cache + 2 * calib + 2 * config.heads * cell.queries * cell.dim) + 8 * 8 * attention

def trial_memory_bytes(config: SweepConfig, cell: Cell) -> int:
    """What one trial of the cell needs at least: its working tensors (bytes_per_trial) and the
    d × d float64 matrices of the scenario's population and of a codec's bases (4 per head)."""
    return bytes_per_trial(config, cell) + 4 * 8 * config.heads * cell.dim ** 2

def chunk_size(config: SweepConfig, cell: Cell, device: torch.device, memory_bytes: int | None = None) -> int:
    """Trials per chunk: as many as fit memory_bytes of working tensors (default: the smaller of
    DEFAULT_MEMORY_BYTES and a quarter of the device's memory); at most $KVHARNESS_CHUNK_TRIALS
    where that is set (tests interrupt runs between small chunks; rows do not depend on chunking)."""
    memory_bytes = memory_bytes or min(DEFAULT_MEMORY_BYTES, available_memory_bytes(device) // 4)
    size = max(1, min(config.trials, memory_bytes // bytes_per_trial(config, cell)))
    forced = os.environ.get(CHUNK_TRIALS_ENV)
    return min(size, max(1, int(forced))) if forced else size

class ScenarioError(ValueError):
    """A scenario drew something other than what was asked (a tensor missing or of another shape)."""


def _check_draw(draw: dict, shape: scenarios.TrialShape) -> None:
    """ScenarioError unless the draw has every tensor the trial shape asks for, with its shape."""
    for name, expected in expected_shapes(shape).items():
        got = np.shape(draw[name]) if name in draw else None
        if got != expected:
            raise ScenarioError(f"{name} has shape {got}, not {expected} (heads {shape.n_heads}, tokens "
                                f"{shape.seq_len}, dimension {shape.dim} asked)" if got is not None else
                                f"the draw lacks {name!r}")


def draw_trials(config: SweepConfig, cell: Cell, trials: range, device, dtype,
                prefill_queries: bool = False) -> dict[str, torch.Tensor]:
    """The scenario's data for the given trials, stacked to (B, H, n, d) tensors on device:
    k, v, q, k_cal, v_cal, positions (S,), trials (B,) (the trial indices, on the CPU); with config.decode_tokens = N > 0 also k_decode,
    v_decode (B, H, N, d) and positions_decode (N,). decode_tokens is not part of the streams'
    labels: the prefill data are the same whatever N is. With prefill_queries also q_prefill
    (B, H, S, d) (and q_prefill_decode (B, H, N, d)), from streams of their own: drawing them
    changes no other tensor."""
    scenario = scenarios.create(cell.scenario, **config.scenario_params.get(cell.scenario, {}))
    shape = scenarios.TrialShape(config.heads, cell.seq_len, cell.queries, cell.dim, cell.calib_tokens,
                                 config.decode_tokens, prefill_queries)
    draws = []
    for t in trials:
        def streams(*labels, _t=t):
            return generator(config.rng, config.seed, "data", cell.scenario, cell.dim, cell.seq_len,
                             cell.queries, config.heads, _t, *labels)
        draws.append(scenario.draw(streams, shape))
        _check_draw(draws[-1], shape)
    tensors = ("k", "v", "q", "k_cal", "v_cal") + (("k_decode", "v_decode") if config.decode_tokens else ()) + \
        tuple(name for name in ("q_prefill", "q_prefill_decode") if name in draws[0])
    out = {name: torch.from_numpy(np.stack([d[name] for d in draws])).to(device=device, dtype=dtype)
           for name in tensors}
    out["positions"] = torch.from_numpy(draws[0]["positions"]).to(device)
    out["trials"] = torch.tensor(list(trials), dtype=torch.int64)
    if config.decode_tokens:
        s = cell.seq_len
        decode_positions = draws[0].get("positions_decode", np.arange(s, s + config.decode_tokens))
        out["positions_decode"] = torch.from_numpy(decode_positions).to(device)
    return out

def _fit(scheme: schemes.Scheme, data: dict[str, torch.Tensor]) -> None:
    # Schemes that draw randomness per trial (TurboQuant's signs, SpectralQuant's sketches) declare
    # that they take the trial indices, so a trial's draw does not depend on the chunk it is in.
    fit_codec(scheme, data["k_cal"], data["v_cal"], data["trials"])

def run_cell_chunk(scheme: schemes.Scheme, data: dict[str, torch.Tensor]) -> tuple[dict[str, np.ndarray], TrialBits]:
    """Fit, encode, decode and score one chunk; per-trial metrics and measured bits (per cache and
    per model, schemes.base.TrialBits).

    With decode tokens in data (k_decode, v_decode (B, H, N, d)) the evaluated cache is the S+N
    tokens, against the exact concatenation K = [k, k_decode], V = [v, v_decode]:
    - a scheme with a decode path (Capabilities.decode_tokens: Shard's encode_decode_tokens /
      decode_decode_tokens) encodes
      the prefill as usual and the N tokens with that path. Deployment codes them one at a time
      as they arrive; Shard codes each token on its own, so passing all N at once gives the same
      codes (its docstring; tests/test_shard.py checks it) and is what is done here, for speed.
      Its logits are q·k̂ᵀ/√d over the concatenated decoded keys (Shard scores through decode);
      bits/element = (prefill bits + decode-token bits) / (2·H·(S+N)·d), per cache and per model;
    - every other scheme encodes the concatenated S+N cache with its ordinary encode. Most code
      each token independently, so this is the same as coding the N tokens as they arrive;
      calibrated and eviction schemes (sq-*, svd, h2o, streaming, kivi's residual window) see the
      decode tokens as part of the cache they summarise, i.e. the most favourable case for them.
    """
    _fit(scheme, data)
    exact = None
    if "k_decode" not in data:
        exact = data.get("exact")   # the chunk's exact attention, shared by the cells of the chunk (run_chunk)
        k, v = data["k"], data["v"]
        enc = _encoded(scheme, k, v, data["positions"], data.get("q_prefill"))
        k_hat, v_hat = _decoded(scheme, enc, k, v)
        logits_hat = codec_logits(scheme, data["q"], enc, k_hat, _logits)
        bits = BitLedger.per_trial(enc)
        kept = scheme.kept(enc)
    else:
        k = torch.cat((data["k"], data["k_decode"]), dim=2)
        v = torch.cat((data["v"], data["v_decode"]), dim=2)
        if scheme.capabilities.decode_tokens:
            enc = _encoded(scheme, data["k"], data["v"], data["positions"])
            dec = scheme.encode_decode_tokens(data["k_decode"], data["v_decode"], enc,
                                              positions=data["positions_decode"])
            require_encoding_of(dec, data["k_decode"], data["v_decode"])
            k_pre, v_pre = _decoded(scheme, enc, data["k"], data["v"])
            k_new, v_new = scheme.decode_decode_tokens(dec, enc)
            require_decoded((k_new, v_new), data["k_decode"], data["v_decode"])
            k_hat, v_hat = torch.cat((k_pre, k_new), dim=2), torch.cat((v_pre, v_new), dim=2)
            logits_hat = exact_logits(data["q"], k_hat)
            bits = BitLedger.per_trial(enc) + BitLedger.per_trial(dec)
            kept = scheme.kept(enc)
            if kept is not None:
                raise NotImplementedError(f"{scheme.name}: an evicting codec with a decode-token path")
        else:
            queries = torch.cat((data["q_prefill"], data["q_prefill_decode"]), dim=2) \
                if "q_prefill_decode" in data else None
            enc = _encoded(scheme, k, v, torch.cat((data["positions"], data["positions_decode"])), queries)
            k_hat, v_hat = _decoded(scheme, enc, k, v)
            logits_hat = codec_logits(scheme, data["q"], enc, k_hat, exact_logits)
            bits = BitLedger.per_trial(enc)
            kept = scheme.kept(enc)
    require_scored(logits_hat, kept, data["q"], k)
    metrics = trial_metrics(k, v, data["q"], k_hat, v_hat, logits_hat, kept, exact=exact)
    metrics.update(_diagnostics(scheme, len(k)))
    return {name: m.cpu().numpy() for name, m in metrics.items()}, bits

def _encoded(scheme: schemes.Scheme, k: torch.Tensor, v: torch.Tensor, positions, queries=None) -> schemes.Encoded:
    """encode_codec, and the encoding checked to code k and v (its shape, dtype and per-trial
    slices: what the ledger reads)."""
    enc = encode_codec(scheme, k, v, positions, queries)
    require_encoding_of(enc, k, v)
    return enc


def _decoded(scheme: schemes.Scheme, enc, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """scheme.decode, checked to return K and V exactly as the input's shape and dtype (a (1, H, S, d)
    K broadcast over the batch is refused, not measured)."""
    decoded = tuple(scheme.decode(enc))
    require_decoded(decoded, k, v)
    return decoded


_LOGITS = IdentityMemo(8)


def _logits(q: torch.Tensor, k_hat: torch.Tensor) -> torch.Tensor:
    """q·k̂ᵀ/√d, remembered for the very q and k̂: cells whose codecs decode K alike (one decoding,
    schemes.base.PerTensorScheme.decoded) share the logits, and so their score metrics."""
    return _LOGITS.get_or_compute((q, k_hat), lambda: exact_logits(q, k_hat))

def _diagnostics(scheme: schemes.Scheme, n_trials: int) -> dict[str, torch.Tensor]:
    """The scheme's per-trial diagnostics, every one kept: those named by DIAGNOSTIC_COLUMNS go
    to their trials column, any other to the store's `diagnostics` table (RunStore.write_chunk).
    A name that would overwrite a metric or a configuration column is refused."""
    out = {}
    for name, values in scheme.diagnostics().items():
        if not (isinstance(name, str) and name.isidentifier()) or (name in TRIAL_COLUMNS and name not in DIAGNOSTIC_COLUMNS):
            raise ValueError(f"{scheme.name}: diagnostic {name!r} is not an identifier or names a trials column "
                             f"that is not a diagnostic; valid: a new identifier or one of {', '.join(DIAGNOSTIC_COLUMNS)}")
        values = torch.as_tensor(values)
        if values.shape != (n_trials,):
            raise ValueError(f"{scheme.name}: diagnostic {name!r} has shape {tuple(values.shape)}; valid: ({n_trials},), "
                             f"one value per trial")
        out[name] = values.double()
    return out

def create_scheme(config: SweepConfig, cell: Cell) -> schemes.Scheme:
    """The cell's scheme from the chosen implementation (torch, or the independent reference)."""
    seed = schemes.registry.codec_seed(config.codec_seed, cell.scheme, cell.budget, cell.dim)
    return schemes.create(cell.scheme, budget=cell.budget, dim=cell.dim, seed=seed, rng=config.codec_rng,
                          impl=config.impl)

def _storage_columns(config: SweepConfig, bits: TrialBits) -> dict[str, np.ndarray]:
    """bits_per_element (per cache) and rows.STORAGE_COLUMNS, (B,) each: storage_bits_per_element
    charges the model constants amortised over config.model_caches caches (none when unset)."""
    return {"bits_per_element": bits.bits_per_element.numpy(), "model_bits": bits.model_bits.numpy(),
            "model_bits_per_element": bits.model_bits_per_element.numpy(),
            "storage_bits_per_element": bits.storage_bits_per_element(config.model_caches).numpy()}

def _rows(config: SweepConfig, cell: Cell, device: torch.device, trials: range,
          metrics: dict[str, np.ndarray], bits: TrialBits):
    storage = _storage_columns(config, bits)
    for i, t in enumerate(trials):
        row = dict(zip(CELL_COLUMNS, cell.key))
        row.update(trial=t, seed=config.seed, impl=config.impl, device=device.type, dtype=config.dtype,
                   rng=config.rng, heads=config.heads)
        row.update({name: float(values[i]) for name, values in storage.items()})
        row.update({name: float(values[i]) for name, values in metrics.items()})
        yield row

def chunk_plan(config: SweepConfig, group: list[Cell], size: int,
               start: dict[Cell, int] | None = None) -> list[tuple[range, list[Cell]]]:
    """The chunks of one data group, (trials, the cells that take them): ranges of at most `size`
    trials from the group's earliest missing trial (start: a cell's first missing trial, 0 when
    absent), cut also at each cell's own first missing trial, so that a cell takes a chunk whole
    or not at all and no stored trial is computed again. Between two cuts the short chunk comes
    first (50 trials in chunks of 24: 2, 24, 24): a cell's first chunk carries its one-time work,
    which a short one shows apart from the cost per trial (the progress line's time left;
    rows do not depend on chunking)."""
    start = start or {}
    first = {cell: start.get(cell, 0) for cell in group}
    cuts = sorted(set(first.values()) | {config.trials})
    plan, a = [], min(first.values())
    while a < config.trials:
        cut = next(c for c in cuts if c > a)
        b = a + ((cut - a) % size or size)
        plan.append((range(a, b), [cell for cell in group if first[cell] <= a]))
        a = b
    return plan

class NonFiniteData(ValueError):
    """A scenario drew a NaN or an infinity (a parameter at the edge of what floats carry)."""


@dataclass(frozen=True)
class CellFailure:
    """What run_chunk yields in place of a cell's rows when the chunk gave none to store: the
    reason in one line, naming the cell (the codec raised or broke the protocol; a trial's data,
    metrics or bits are not finite; the codec wrote its input; its sampled encoding does not
    stand alone; the scenario failed its checks)."""
    reason: str


def describe(cell: Cell) -> str:
    """The cell in words, for a message: 'cell (scenario gaussian, scheme tq-kv, budget 2, …)'."""
    return "cell (" + ", ".join(f"{name} {value}" for name, value in zip(CELL_COLUMNS, cell.key)) + ")"


def _trial_list(trials: range, bad: np.ndarray) -> str:
    shown = [str(trials[i]) for i in np.flatnonzero(bad)[:3]]
    return ("trial " if len(shown) == 1 else "trials ") + ", ".join(shown) + (", …" if bad.sum() > 3 else "")


def non_finite_data(data: dict[str, torch.Tensor], trials: range) -> str | None:
    """'K in trials 0, 1' for the first drawn tensor holding a NaN or an infinity; None when all
    are finite."""
    for name, x in data.items():
        if isinstance(x, torch.Tensor) and x.is_floating_point() and name not in ("positions", "positions_decode"):
            bad = ~torch.isfinite(x.reshape(x.shape[0], -1)).all(dim=1).cpu().numpy()
            if bad.any():
                return f"{name} not finite in {_trial_list(trials, bad)}"
    return None


def non_finite_columns(columns: dict[str, np.ndarray], trials: range) -> str | None:
    """'rel_mse_k, d2_t not finite in trial 2' for the metric and storage columns holding a NaN or
    an infinity (a non-evicting codec has no evicted_mass column here: its NULL is not checked;
    a codec's own diagnostics are its own facts and are not checked); None when all are finite."""
    checked = METRIC_NAMES + EVICTION_METRIC_NAMES + ("bits_per_element", "model_bits", "storage_bits_per_element")
    bad = {name: ~np.isfinite(columns[name]) for name in checked if name in columns}
    names = [name for name, mask in bad.items() if mask.any()]
    if not names:
        return None
    trials_bad = np.logical_or.reduce([bad[name] for name in names])
    return f"{', '.join(names[:4])}{', …' if len(names) > 4 else ''} not finite in {_trial_list(trials, trials_bad)}"


def _snapshot(data: dict) -> dict[str, torch.Tensor]:
    """A copy of every tensor of the chunk a codec is handed (all but the exact attention, which
    only the metrics read), taken once per chunk: what _written compares each cell's data to."""
    return {name: x.clone() for name, x in data.items() if isinstance(x, torch.Tensor)}


def _same(x: torch.Tensor, y: torch.Tensor) -> bool:
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    if x.device.type == "cpu":     # NumPy's comparison: a fraction of torch.equal's time on the CPU
        return bool(np.array_equal(x.detach().numpy(), y.numpy()))
    return torch.equal(x, y)


def _written(data: dict, before: dict[str, torch.Tensor]) -> list[str]:
    """The chunk's tensors whose contents differ from the snapshot `before`: a codec wrote them by
    any path (in place, through .data or a NumPy view, an out= argument), version counter bumped
    or not."""
    return [name for name, x in before.items() if not _same(data[name], x)]


def _chunk_data(config, cells, trials, device, dtype, prefill_queries) -> dict:
    data = draw_trials(config, cells[0], trials, device, dtype, prefill_queries)
    if len(cells) > 1 and not config.decode_tokens:
        data["exact"] = exact_attention(data["q"], data["k"], data["v"])  # shared by the chunk's cells
    return data


def sample_trial(config: SweepConfig, cell: Cell, scheme: schemes.Scheme, trials: range) -> int | None:
    """The trial of this chunk whose encoding is checked to stand alone (check_sample), or None:
    drawn from the seed, never always trial 0. A plug-in: a trial of every chunk of every cell,
    drawn from the stream (seed, "check", cell, first trial of the chunk), so a codec honest only
    on some chunks or at some budgets is found on the others. This repository's codecs (tested at
    every budget by the conformance suite): one cell of each codec among those sharing data, its
    budget drawn from the stream (seed, "check", data_key, codec), and one trial, the same for
    every codec, from (seed, "check", data_key), checked in whichever chunk holds it (so the check
    does not depend on chunking); the checks share that trial's codings as the cells share the
    chunk's (_check_memos)."""
    if in_project(scheme):
        labels = ("check", *cell.data_key)
        trial = int(generator(config.rng, config.seed, *labels).integers(config.trials))
        budget = config.budgets[int(generator(config.rng, config.seed, *labels, cell.scheme).integers(len(config.budgets)))]
        return trial if trial in trials and cell.budget == budget else None
    return trials[int(generator(config.rng, config.seed, "check", *cell.key, trials.start).integers(len(trials)))]


# The memos' entries of the checks (check_sample), kept apart from the chunk's while no check runs
_CHECK_ENTRIES: "weakref.WeakKeyDictionary[IdentityMemo, dict]" = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def _check_memos():
    """Every memo (kvcommon.memo.IdentityMemo) switched, for the block, to the entries of the
    checks: the codings of a check's one trial evict nothing the chunk's cells share (on a chunk
    of 24 trials that would be coded again), and the checks of the cells that share the trial
    (sample_trial) share its codings (Shard's k-means of V, SpectralQuant's calibration) as the
    cells share the chunk's. Entries whose tensors have died are dropped on each switch."""
    live = lambda entries: {key: entry for key, entry in entries.items() if all(r() is not None for r in entry[0])}
    chunk = {memo: memo.entries for memo in list(IdentityMemo._every)}
    for memo in chunk:
        memo.entries = live(_CHECK_ENTRIES.get(memo, {}))
    try:
        yield
    finally:
        for memo, entries in chunk.items():
            _CHECK_ENTRIES[memo] = memo.entries
            memo.entries = live(entries)


_TRIAL = {}   # the trial checked last: "data" (a weak reference to its chunk's K), "trial", "one" (its copy)


def _one_trial(data: dict, trial: int) -> dict:
    """The chunk's tensors of one trial, copied (a view would keep the whole chunk alive), the same
    objects for every cell of the chunk that checks that trial, so the memos recognise them;
    positions as the chunk has them."""
    held = _TRIAL.get("data")
    if held is None or held() is not data["k"] or _TRIAL["trial"] != trial:
        _TRIAL.update(data=weakref.ref(data["k"]), trial=trial, one=_trial_of(data, trial, copy=True))
    return _TRIAL["one"]


def _trial_of(data: dict, trial: int, copy: bool = False) -> dict:
    """The chunk's tensors of one trial as a batch of one: views of the chunk, or copies; its
    positions as the chunk has them (every trial's)."""
    i = int((data["trials"] == trial).nonzero()[0, 0])
    one = {name: x[i:i + 1].clone() if copy else x[i:i + 1] for name, x in data.items()
           if isinstance(x, torch.Tensor) and name not in ("positions", "positions_decode")}
    one["positions"] = data["positions"]
    return one


# How far a trial's metric coded alone may lie from its row in the chunk (relative): float
# arithmetic batched another way, not a codec coding a trial differently in company
ALONE_RTOL = 1e-3


def _unlike(alone: float, in_chunk: float) -> bool:
    if not (math.isfinite(alone) and math.isfinite(in_chunk)):
        return not (alone == in_chunk or (math.isnan(alone) and math.isnan(in_chunk)))
    return abs(alone - in_chunk) > ALONE_RTOL * max(abs(alone), abs(in_chunk)) + 1e-12


def _require_model_constants(scheme: schemes.Scheme, enc: schemes.Encoded, one: dict) -> None:
    """What a plug-in tags per model (Encoded.model: charged once per model, not per cache) is the
    same when the instance that coded the trial codes another cache (its tokens reversed and
    negated, at the same positions): ConformanceError where it is not, as for a codec that
    tags its codes per model to be charged less."""
    other = _encoded(scheme, -one["k"].flip(2), -one["v"].flip(2), one["positions"], one.get("q_prefill"))
    changed = sorted(enc.model ^ other.model)
    for key in sorted(enc.model & other.model):
        part = "codes" if key in enc.codes else "side"
        mine, theirs = getattr(enc, part).get(key), getattr(other, part).get(key)
        if not (isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor) and mine.shape == theirs.shape
                and mine.dtype == theirs.dtype and torch.equal(mine, theirs)):
            changed.append(f"{part}.{key}")
    if changed:
        raise ConformanceError(f"{', '.join(changed)} tagged per model (charged once per model, not per cache) "
                               f"change with the cache coded: only what every cache shares may be tagged so")


def check_sample(config: SweepConfig, cell: Cell, data: dict, bits: TrialBits, trial: int,
                 shared: bool = False, metrics: dict | None = None) -> None:
    """The conformance check of a stored encoding (schemes.conformance.require_standalone) on one
    trial of the chunk (sample_trial): coded alone by a new instance of the cell's codec, fitted as
    the sweep fits it, its ledger is what its tensors occupy and equals the trial's bits in the
    chunk, and another new instance decodes its stored bytes, twice, exactly as the encoder does:
    in this process for this repository's codecs, in a separate one for a plug-in
    (schemes.conformance.decode_elsewhere: no module-level state of the encoder travels); a
    plug-in's per-model entries do not change with the cache (_require_model_constants).
    ConformanceError where not. On new instances, so the cell's own scheme and its rows are
    untouched; the prefill's encoding where the sweep has decode tokens. metrics: the chunk's
    (run_cell_chunk), whose row of the trial must be what the trial coded alone measures (within
    ALONE_RTOL; not with decode tokens, whose rows measure the prefill and the tokens after it):
    a codec that codes a trial one way alone and another in a batch (honest only when checked) is
    found. shared: the trial's tensors are the copy the checks of the chunk's cells share
    (_one_trial; this repository's codecs), compared with the chunk's after the check, passed or
    failed (_require_unwritten)."""
    if not shared:   # a plug-in: views of the chunk, so a write in place reaches its data (_written)
        _check_standalone(config, cell, data, bits, trial, _trial_of(data, trial), metrics)
        return
    one = _one_trial(data, trial)
    try:
        _check_standalone(config, cell, data, bits, trial, one, metrics)
    except Exception:
        _require_unwritten(one, data, trial)
        raise
    _require_unwritten(one, data, trial)


def _require_unwritten(one: dict, data: dict, trial: int) -> None:
    """The shared copy of the checked trial (_one_trial) as the chunk holds it; where the codec
    wrote it, the copy is dropped (the next check takes a fresh one) and the write is the failure."""
    as_drawn = _trial_of(data, trial)
    wrote = [name for name, x in one.items() if name != "positions" and not _same(x, as_drawn[name])]
    if wrote:
        _TRIAL.clear()
        raise ConformanceError(f"coding trial {trial} alone, the codec wrote its input {', '.join(wrote)} "
                               f"in place") from None


def _check_standalone(config: SweepConfig, cell: Cell, data: dict, bits: TrialBits, trial: int, one: dict,
                      metrics: dict | None) -> None:
    """check_sample's checks on `one`, the trial's tensors."""
    from schemes.conformance import decode_elsewhere, decode_here, require_standalone
    i = int((data["trials"] == trial).nonzero()[0, 0])

    def fitted():
        scheme = create_scheme(config, cell)
        _fit(scheme, one)
        return scheme
    first = fitted()
    enc = _encoded(first, one["k"], one["v"], one["positions"], one.get("q_prefill"))
    reference = tuple(first.decode(enc)) + ((first.score(one["q"], enc),) if first.capabilities.scores_on_codes else ())
    if in_project(first):
        decodings = decode_here(fitted(), enc, one["q"])
    else:
        options = dict(budget=cell.budget, dim=cell.dim, rng=config.codec_rng, label=cell.scheme,
                       seed=schemes.registry.codec_seed(config.codec_seed, cell.scheme, cell.budget, cell.dim))
        decodings = decode_elsewhere(schemes.registry.spec(cell.scheme).factory, options,
                                     (one["k_cal"], one["v_cal"], one["trials"]), enc, one["q"])
        _require_model_constants(first, enc, one)
    require_standalone(enc, reference, decodings)
    if metrics is not None and not config.decode_tokens:
        logits = reference[2] if first.capabilities.scores_on_codes else exact_logits(one["q"], reference[0])
        exact = data.get("exact")   # the chunk's exact side, where its cells share it: the trial's slice
        exact = tuple(x[i:i + 1] for x in exact) if exact is not None else None
        measured = trial_metrics(one["k"], one["v"], one["q"], reference[0], reference[1], logits, first.kept(enc),
                                 exact=exact)
        for name, value in measured.items():
            alone_value, chunk_value = float(value[0]), float(metrics[name][i])
            if _unlike(alone_value, chunk_value):
                raise ConformanceError(f"trial {trial} coded alone measures {name} = {alone_value:.6g}, but "
                                       f"{chunk_value:.6g} coded with the {len(data['k'])} trials of its chunk: the "
                                       f"codec codes a trial differently in company (a trial's row must not depend "
                                       f"on the others)")
    alone = BitLedger.per_trial(enc)
    if not config.decode_tokens and (float(bits.cache[i]) != float(alone.cache[0]) or
                                     float(bits.model[i]) != float(alone.model[0])):
        raise ConformanceError(f"trial {trial} is charged {float(bits.cache[i]):.0f} + "
                               f"{float(bits.model[i]):.0f} bits in its chunk but {float(alone.cache[0]):.0f} + "
                               f"{float(alone.model[0]):.0f} coded alone")


def _failure(cell: Cell, exc: Exception, conformance: str) -> CellFailure:
    """The cell's failure for an exception of its codec: `conformance` says what a ConformanceError
    means here; any other exception is the codec raising."""
    what = conformance if isinstance(exc, ConformanceError) else f"the codec raised {type(exc).__name__}"
    return CellFailure(f"{describe(cell)}: {what}: {exc}".replace("\n", " "))


def _wrote(cell: Cell, written: list[str]) -> CellFailure:
    return CellFailure(f"{describe(cell)}: codec {cell.scheme} wrote its input {', '.join(written)} in place; "
                       f"a codec must leave the data it is given as it was")


def _run_one(config: SweepConfig, cell: Cell, scheme: schemes.Scheme, data: dict, trials: range, device,
             before: dict[str, torch.Tensor]):
    """The cell's rows on the chunk's data, or a CellFailure; and the data the codec wrote (the
    tensors differing from `before`, the chunk's snapshot, compared once the codec is done: the
    data are then drawn again). Where sample_trial draws one of this chunk's trials for the cell
    (a plug-in: every chunk; this repository's codecs: one cell each), it is checked as a stored
    encoding (check_sample)."""
    try:
        metrics, bits = run_cell_chunk(scheme, data)
    except Exception as exc:  # noqa: BLE001 - a codec's failure costs its own cell, named, not the sweep
        return _failure(cell, exc, "the codec breaks the protocol"), _written(data, before)
    bad = non_finite_columns({**metrics, **_storage_columns(config, bits)}, trials)
    failure = CellFailure(f"{describe(cell)}: {bad}") if bad else None
    trial = None if bad else sample_trial(config, cell, scheme, trials)
    if trial is not None:
        try:
            with _check_memos():
                check_sample(config, cell, data, bits, trial, shared=in_project(scheme), metrics=metrics)
        except Exception as exc:  # noqa: BLE001
            failure = _failure(cell, exc, f"the codec's encoding of trial {trial} does not stand alone")
    written = _written(data, before)
    if written:
        return _wrote(cell, written), written
    return failure or list(_rows(config, cell, device, trials, metrics, bits)), written


def scenario_fault(config: SweepConfig, cell: Cell, data: dict, trials: range, device, dtype,
                   prefill_queries: bool) -> str | None:
    """Why the scenario's data of this chunk cannot be measured, in words, or None: a plug-in
    scenario (not this repository's) must draw a trial identically twice (the determinism of
    scenarios.conformance.check_same_seed_same_trial), checked on a trial drawn from the seed
    before any row is stored. (draw_trials checks every scenario's shapes.)"""
    if in_project(scenarios.create(cell.scenario, **config.scenario_params.get(cell.scenario, {}))):
        return None
    trial = trials[int(generator(config.rng, config.seed, "check", cell.scenario, trials.start).integers(len(trials)))]
    i = trial - trials.start
    again = draw_trials(config, cell, range(trial, trial + 1), device, dtype, prefill_queries)
    differ = [name for name, x in again.items() if name not in ("positions", "positions_decode", "trials")
              and not _same(x, data[name][i:i + 1])]
    differ += [name for name in ("positions", "positions_decode") if name in again and not _same(again[name], data[name])]
    return f"trial {trial} drawn twice differs in {', '.join(differ)}" if differ else None


def run_chunk(config: SweepConfig, cells: list[Cell], trials: range, device, dtype, cell_schemes=None):
    """One chunk of cells that share data: the trials drawn once, then each cell run on them;
    yields (cell, rows, wall_s, peak_mem_mb) per cell (wall time and peak without the draw), with
    a CellFailure in place of rows for a cell whose chunk gave none to store: a codec that
    raised or broke the protocol, a trial whose metrics or bits are not finite, a scenario whose
    draw is not what was asked or not a function of its seed (every cell of the chunk, named as
    the scenario's). NonFiniteData when the drawn data are not finite. A codec that writes the
    data it is handed, by any path (found by comparing them with a snapshot taken once per chunk,
    after each cell; a copy per cell would cost as much and lose the sharing of codings and of
    the exact side's metrics by identity), fails, named, and the data are drawn again for the
    cells after it, so no codec's rows depend on its neighbours."""
    cell_schemes = cell_schemes if cell_schemes is not None else {c: create_scheme(config, c) for c in cells}
    prefill_queries = any(cell_schemes[c].capabilities.prefill_queries for c in cells)
    try:
        data = _chunk_data(config, cells, trials, device, dtype, prefill_queries)
        fault = scenario_fault(config, cells[0], data, trials, device, dtype, prefill_queries)
    except ScenarioError as exc:
        data, fault = None, str(exc)
    if fault:
        for cell in cells:
            yield cell, CellFailure(f"{describe(cell)}: scenario {cell.scenario} failed its checks: {fault}"), 0.0, 0.0
        return
    bad_data = non_finite_data(data, trials)
    # budget by budget: the variants of a family that code a tensor alike at one budget run one
    # after another, so the few codings and decodings they share are remembered (PerTensorScheme)
    if bad_data:   # no codec can be measured on it: the sweep stops here
        raise NonFiniteData(f"scenario {cells[0].scenario} drew data that are not finite ({bad_data}; dim "
                            f"{cells[0].dim}, seq_len {cells[0].seq_len}, queries {cells[0].queries}, calib_tokens "
                            f"{cells[0].calib_tokens}); no cell can be measured on them")
    before = _snapshot(data)
    for cell in sorted(cells, key=lambda c: c.budget):
        t0 = time.perf_counter()
        reset_peak(device)
        rows, written = _run_one(config, cell, cell_schemes[cell], data, trials, device, before)
        peak = peak_bytes(device) or 0
        if written:   # the data as drawn for the cells after this one
            data = _chunk_data(config, cells, trials, device, dtype, prefill_queries)
            before = _snapshot(data)
        yield cell, rows, time.perf_counter() - t0, peak / 2 ** 20

def run_serial(config: SweepConfig, todo: list[Cell], device, dtype, memory_bytes, on_cell=None, *,
                start: dict[Cell, int] | None = None, on_chunk=None) -> None:
    """Cells that share data are run together on each chunk of drawn trials. Each cell's chunk is
    handed to on_chunk(cell, trials, rows, wall_s, peak_mem_mb) as soon as it is done (rows a
    CellFailure where it failed: the cell's later chunks are then not run); with
    on_cell, a cell's rows of this call, summed wall time and peak memory go to
    on_cell(cell, rows, wall_s, peak_mem_mb) after its last chunk. start: each cell's first
    missing trial (chunk_plan)."""
    for _, group in itertools.groupby(todo, key=lambda c: c.data_key):
        group = list(group)
        size = chunk_size(config, group[0], device, memory_bytes)
        cell_schemes = {cell: create_scheme(config, cell) for cell in group}
        rows = {cell: [] for cell in group}
        wall = dict.fromkeys(group, 0.0)
        peak = dict.fromkeys(group, 0.0)
        failed = set()
        for trials, cells in chunk_plan(config, group, size, start):
            cells = [cell for cell in cells if cell not in failed]
            if not cells:
                continue
            for cell, chunk_rows, chunk_wall, chunk_peak in run_chunk(config, cells, trials, device, dtype,
                                                                      cell_schemes):
                if on_chunk is not None:
                    on_chunk(cell, trials, chunk_rows, chunk_wall, chunk_peak)
                if isinstance(chunk_rows, CellFailure):
                    failed.add(cell)
                    continue
                if on_cell is not None:
                    rows[cell].extend(chunk_rows)
                    wall[cell] += chunk_wall
                    peak[cell] = max(peak[cell], chunk_peak)
                    if trials.stop == config.trials:
                        on_cell(cell, rows.pop(cell), wall[cell], peak[cell])
