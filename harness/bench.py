"""Throughput measured in one run, reported as figures and ratios (never asserted as times).

- runner: trials/s of the batched cell runner vs a per-trial loop (same cells, same data)
  vs the independent reference implementation;
- schemes: encode+decode vectors/s per scheme, the least bytes each encode+decode moves per
  vector and the fraction of the machine's memory bandwidth (a STREAM triad in the same run)
  it reaches (harness/bandwidth.py);
- attention: achieved fraction of the machine's measured matmul throughput in the metrics'
  attention step (q kᵀ and softmax · v as batched matmuls);
- rotation: tq-kv's encode+decode with its randomized Hadamard transform vs the same codec
  rotating with a dense d×d orthogonal matrix, timed alternately in the same run;
- threads: an SQ cell with its small linear algebra on one thread (kvcommon/threads.py) vs on
  every thread, and SQ's calibration with the eigh vs the power-iteration eigensolver;
- grid (`--grid NAME`): the wall time of a whole preset grid, every cell run by the runner's
  own chunk loop (its rows written to a scratch store) on n trials, 2n trials and 2n trials in
  two chunks, modelled per cell and data group as a fixed part + a part per chunk + a part per
  trial, at the grid's trial count and chunks.

Every timing keeps its raw samples (seconds, after one warm-up call) beside the figure made
from their minimum, and the result carries the machine's load average (os.getloadavg) before
and after: on a shared machine the ratios of figures timed alternately are what carries over.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import os
import time
from dataclasses import dataclass
from unittest import mock

import torch

import schemes
from kvcommon import threads
from schemes import turboquant

from . import timing
from .bandwidth import codec_traffic, fraction_of_bandwidth, memory_bandwidth
from .cell import (CellFailure, bytes_per_trial, create_scheme, draw_trials, run_cell_chunk, run_serial,
                   trial_memory_bytes)
from .sweep import Cell, SweepConfig, grid


@dataclass(frozen=True)
class BenchShape:
    scenario: str = "gaussian"
    scheme: str = "tq-kv"
    budget: int = 3
    dim: int = 128
    seq_len: int = 1024
    queries: int = 64
    trials: int = 32
    repeats: int = 3


def _unremembered(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies no memo keeps (inference tensors: kvcommon.memo.IdentityMemo skips them), so every
    timed repeat does a codec's whole work (calibration, unit rows, coding, decoding) instead of
    reusing what the previous repeat computed from the very same tensors."""
    with torch.inference_mode():
        return {name: t.clone() for name, t in tensors.items()}


def _best_time(fn, repeats: int) -> float:
    """Minimum wall time over repeats (after one warm-up): the least disturbed measurement."""
    return min(timing.samples(fn, repeats))


def _alternate(fns: dict, repeats: int) -> dict[str, list[float]]:
    """Samples of several variants timed in turn (a, b, a, b, ...) after one warm-up each, so a
    change of the machine's load hits them alike."""
    for fn in fns.values():
        fn()
    out = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            out[name].append(timing.timed(fn))
    return out


def runner_cell(shape: BenchShape, device: torch.device) -> tuple[SweepConfig, Cell]:
    """The one-cell sweep of the runner comparison and its cell."""
    config = SweepConfig(scenarios=(shape.scenario,), schemes=(shape.scheme,), budgets=(shape.budget,),
                         dims=(shape.dim,), seq_lens=(shape.seq_len,), queries=(shape.queries,),
                         trials=shape.trials, device=device.type)
    return config, Cell(shape.scenario, shape.scheme, shape.budget, shape.dim, shape.seq_len, shape.queries,
                        config.calib_tokens[0])


def memory_needed(shape: BenchShape, device: torch.device) -> int:
    """Bytes the bench holds at once, at least: the runner comparison's trials in one batch (the
    scheme table's 8 when there are fewer), each as a sweep's trial (cell.trial_memory_bytes)."""
    config, cell = runner_cell(shape, device)
    return trial_memory_bytes(config, cell) + (max(shape.trials, 8) - 1) * bytes_per_trial(config, cell)


def runner_throughput(shape: BenchShape, device: torch.device) -> dict:
    config, cell = runner_cell(shape, device)
    data = _unremembered(draw_trials(config, cell, range(shape.trials), device, torch.float32))
    scheme = create_scheme(config, cell)

    def one(i):
        return {k: (v[i:i + 1] if k != "positions" else v) for k, v in data.items()}
    samples = {"batched": timing.samples(lambda: run_cell_chunk(scheme, data), shape.repeats),
               "loop": timing.samples(lambda: [run_cell_chunk(scheme, one(i)) for i in range(shape.trials)], shape.repeats)}
    batched, loop = min(samples["batched"]), min(samples["loop"])
    out = {"cell": cell.key, "trials": shape.trials,
           "batched_trials_per_s": shape.trials / batched, "loop_trials_per_s": shape.trials / loop,
           "batched_over_loop": loop / batched, "samples_s": samples}
    try:
        ref_scheme = schemes.create(shape.scheme, budget=shape.budget, dim=shape.dim, seed=scheme.seed,
                                    rng=config.rng, impl="reference")
    except ValueError:
        out["reference_trials_per_s"] = None
        return out
    samples["reference"] = timing.samples(lambda: run_cell_chunk(ref_scheme, data), 1)
    ref = min(samples["reference"])
    out["reference_trials_per_s"] = shape.trials / ref
    out["batched_over_reference"] = ref / batched
    return out


def _gaussian_caches(shape: BenchShape, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V (8, 1, S, d), i.i.d. N(0, 1), unremembered."""
    g = torch.Generator(device="cpu").manual_seed(0)
    caches = {name: torch.randn(8, 1, shape.seq_len, shape.dim, generator=g).to(device) for name in ("k", "v")}
    return tuple(_unremembered(caches).values())


def scheme_throughput(shape: BenchShape, device: torch.device, names: list[str] | None = None,
                      budgets: tuple[int, ...] | None = None, impls: tuple[str, ...] = ("torch",),
                      samples: dict | None = None, traffic: dict | None = None) -> dict:
    """Encode+decode vectors/s on (8, 1, S, d) Gaussian K and V (a vector is one token of K or V):
    {scheme: {impl: {budget: vectors/s}}}; schemes an implementation lacks are left out. Every
    codec and width is timed in turn, repeat after repeat (`_alternate`; the slow reference
    implementation once), so a change of the machine's load hits them alike and one run's widths
    compare. The raw samples (s) go to `samples` in the same layout, and the least bytes each
    encode+decode moves (bandwidth.codec_traffic, from the measured ledger of its stored tensors) to
    `traffic`."""
    k, v = _gaussian_caches(shape, device)
    made: dict[tuple, tuple] = {}          # (scheme, its first coding, the timed call)
    for name in names or schemes.registry.all_schemes():
        for impl in impls:
            for budget in budgets or (shape.budget,):
                try:
                    s = schemes.create(name, budget=budget, dim=shape.dim, impl=impl)
                except ValueError:
                    continue  # not in this implementation, or this shape breaks its constraints
                s.fit(k, v)
                first: dict = {}

                def code(s=s, first=first):
                    enc = s.encode(k, v)
                    out = s.decode(enc)
                    first.setdefault("enc", enc)
                    first.setdefault("out", out)
                made[name, impl, budget] = s, first, code
    times = _alternate({key: m[2] for key, m in made.items() if key[1] != "reference"}, shape.repeats)
    times.update((key, timing.samples(m[2], 1)) for key, m in made.items() if key[1] == "reference")
    result: dict = {}
    for (name, impl, budget), (_, first, _) in made.items():
        result.setdefault(name, {}).setdefault(impl, {})[budget] = (
            2 * k.shape[0] * shape.seq_len / min(times[name, impl, budget]))
        if samples is not None:
            samples.setdefault(name, {}).setdefault(impl, {})[budget] = times[name, impl, budget]
        if traffic is not None:   # from the untimed warm-up call's coding
            traffic.setdefault(name, {}).setdefault(impl, {})[budget] = codec_traffic(k, first["enc"], first["out"])
    return result


def attention_efficiency(shape: BenchShape, device: torch.device) -> dict:
    """GFLOP/s of the attention step vs a large square matmul on the same device."""
    n = 2048
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    peak = 2 * n ** 3 / _best_time(lambda: a @ b, shape.repeats) / 1e9
    bsz = shape.trials
    q = torch.randn(bsz, 1, shape.queries, shape.dim, device=device)
    k = torch.randn(bsz, 1, shape.seq_len, shape.dim, device=device)
    v = torch.randn(bsz, 1, shape.seq_len, shape.dim, device=device)

    def attention():
        return torch.softmax(q @ k.transpose(-1, -2) / shape.dim ** 0.5, dim=-1) @ v
    flops = 2 * 2 * bsz * shape.queries * shape.seq_len * shape.dim
    achieved = flops / _best_time(attention, shape.repeats) / 1e9
    return {"matmul_gflops": peak, "attention_gflops": achieved, "attention_fraction_of_matmul": achieved / peak}


@contextlib.contextmanager
def _dense_rotation(dim: int, device: torch.device):
    """TurboQuant rotating with a dense d×d Haar-orthogonal matrix (y = u M, û = ŷ Mᵀ) in place
    of its randomized Hadamard transform, for the comparison only."""
    gen = torch.Generator().manual_seed(0)
    q, r = torch.linalg.qr(torch.randn(dim, dim, generator=gen, dtype=torch.float64))
    m = q * torch.sign(torch.diagonal(r))
    cast = {}

    def matrix(dtype):
        return cast.setdefault(dtype, m.to(device=device, dtype=dtype))
    def inverse(y, signs, *, scale=None):
        x = y @ matrix(y.dtype).T
        return x if scale is None else x * scale.unsqueeze(-1)     # the norms, as rht_inverse applies them
    with mock.patch.object(turboquant, "rht", lambda x, signs: x @ matrix(x.dtype)), \
            mock.patch.object(turboquant, "rht_inverse", inverse):
        yield


def rotation_comparison(shape: BenchShape, device: torch.device) -> dict:
    """tq-kv encode+decode vectors/s at shape.budget with its randomized Hadamard transform and
    with a dense matmul rotation, timed alternately; fast_over_dense > 1 when the Hadamard path is
    faster. (run_bench times it at the --budget and at each of --budgets: the rotation's share of
    the coding changes with the width.)"""
    k, v = _gaussian_caches(shape, device)
    s = schemes.create("tq-kv", budget=shape.budget, dim=shape.dim)

    def dense():
        with _dense_rotation(shape.dim, device):
            s.decode(s.encode(k, v))
    samples = _alternate({"hadamard": lambda: s.decode(s.encode(k, v)), "dense": dense}, shape.repeats)
    n_vectors = 2 * k.shape[0] * shape.seq_len
    return {"scheme": "tq-kv", "budget": shape.budget, "hadamard_vectors_per_s": n_vectors / min(samples["hadamard"]),
            "dense_vectors_per_s": n_vectors / min(samples["dense"]),
            "fast_over_dense": min(samples["dense"]) / min(samples["hadamard"]), "samples_s": samples}


def threads_comparison(shape: BenchShape, device: torch.device, n_trials: int = 8) -> dict:
    """An sq-kv cell (run_cell_chunk on n_trials trials of spectral_decay) with the small linear
    algebra on one thread vs on every thread, and SQ's calibration (fit) with the eigh vs the
    power-iteration eigensolver, each pair timed alternately on unremembered data (no memo serves
    a repeat)."""
    config = SweepConfig(scenarios=("spectral_decay",), schemes=("sq-kv",), budgets=(shape.budget,),
                         dims=(shape.dim,), seq_lens=(shape.seq_len,), queries=(shape.queries,), trials=n_trials,
                         device=device.type)
    cell = Cell("spectral_decay", "sq-kv", shape.budget, shape.dim, shape.seq_len, shape.queries,
                config.calib_tokens[0])
    data = _unremembered(draw_trials(config, cell, range(n_trials), device, torch.float32))
    scheme = create_scheme(config, cell)

    def cell_with(on: bool):
        def run():
            with threads.enabled(on):
                run_cell_chunk(scheme, data)
        return run
    cells = _alternate({"small_linalg_one_thread": cell_with(True), "all_threads": cell_with(False)}, shape.repeats)
    fits = {}
    for solver in ("eigh", "power"):
        fitted = schemes.create("sq-kv", budget=shape.budget, dim=shape.dim, eigensolver=solver)
        fits[solver] = (lambda f=fitted: f.fit(data["k_cal"], data["v_cal"]))
    fit_samples = _alternate(fits, shape.repeats)
    return {"cell": cell.key, "trials": n_trials,
            "one_thread_over_all_threads": min(cells["all_threads"]) / min(cells["small_linalg_one_thread"]),
            "eigh_over_power": min(fit_samples["power"]) / min(fit_samples["eigh"]),
            "samples_s": {"cell": cells, "fit": fit_samples}}


def run_bench(shape: BenchShape, device: torch.device, scheme_names: list[str] | None = None,
              budgets: tuple[int, ...] | None = None, impls: tuple[str, ...] = ("torch",),
              triad_bytes: int | None = None) -> dict:
    """Every figure of `harness bench` but the grid's and the workers'; triad_bytes: each array of
    the bandwidth triad (None: bandwidth.triad_array_bytes)."""
    load_before = os.getloadavg()
    samples: dict = {}
    traffic: dict = {}
    result = {"device": str(device), "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
              # torch's OpenMP threads spin after each parallel region unless PASSIVE: on a shared
              # or busy machine that slows whatever runs next (docs/performance.md)
              "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
              "shape": shape.__dict__, "runner": runner_throughput(shape, device),
              "bandwidth": memory_bandwidth(device, triad_bytes, max(5, shape.repeats)),
              "schemes_vectors_per_s": scheme_throughput(shape, device, scheme_names, budgets, impls, samples,
                                                         traffic),
              "schemes_samples_s": samples}
    gb_per_s = result["bandwidth"]["gb_per_s"]
    result["schemes_bytes_per_vector"] = _per_codec(traffic, lambda t, _: t["bytes_per_vector"])
    result["schemes_code_bytes_per_vector"] = _per_codec(traffic, lambda t, _: t["code_bytes_per_vector"])
    result["schemes_fraction_of_bandwidth"] = _per_codec(
        traffic, lambda t, rate: fraction_of_bandwidth(rate, t["bytes_per_vector"], gb_per_s),
        result["schemes_vectors_per_s"])
    rotations = {b: rotation_comparison(dataclasses.replace(shape, budget=b), device)
                 for b in dict.fromkeys((shape.budget, *(budgets or ())))}
    result.update(attention=attention_efficiency(shape, device), rotation=rotations[shape.budget],
                  rotation_by_budget=rotations, threads_comparison=threads_comparison(shape, device))
    result["load_average"] = {"before": list(load_before), "after": list(os.getloadavg())}
    return result


def _per_codec(traffic: dict, figure, rates: dict | None = None) -> dict:
    """{scheme: {impl: {budget: figure(traffic entry, its vectors/s)}}}."""
    return {name: {impl: {b: figure(t, rates[name][impl][b] if rates else None) for b, t in by_b.items()}
                   for impl, by_b in by_impl.items()} for name, by_impl in traffic.items()}


def _time_cells(config: SweepConfig, device: torch.device, chunk_trials: int | None = None
                ) -> tuple[float, dict[Cell, tuple[float, float]], dict[tuple, float]]:
    """(wall time of the whole sweep, {cell: (its own wall time, peak MiB)}, {data key: wall time
    of its data group}) by the runner's own chunk loop, each cell's chunk written to a
    scratch store as `harness run` writes it (RunStore.write_chunk), in chunks of chunk_trials
    trials (None: the run's own chunk size). A group's wall time is everything its run pays:
    drawing, the exact attention, the cells and the store."""
    import tempfile

    from .cell import bytes_per_trial
    from .store import RunStore
    cells: dict[Cell, tuple[float, float]] = {}
    groups: dict[tuple, float] = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvharness-bench-") as tmp, RunStore(tmp).writing() as store:

        def write(cell, trials, rows, wall, peak_mb):
            if isinstance(rows, CellFailure):   # a timing of a sweep that stores nothing is no timing
                raise RuntimeError(rows.reason)
            store.write_chunk(cell.key, rows, first_trial=trials.start, n_trials_cell=config.trials, wall_s=wall,
                              finished_at="", peak_mem_mb=peak_mb)
        for _, group in itertools.groupby(config.cells(), key=lambda c: c.data_key):
            group = list(group)
            budget = None if chunk_trials is None else chunk_trials * bytes_per_trial(config, group[0])
            g0 = time.perf_counter()
            run_serial(config, group, device, torch.float32, budget,
                       lambda cell, rows, wall, peak_mb: cells.__setitem__(cell, (wall, peak_mb)), on_chunk=write)
            groups[group[0].data_key] = time.perf_counter() - g0
    return time.perf_counter() - t0, cells, groups


def _time_chunk_pass(preset: dict, device: torch.device, trials_of: dict[tuple, int]
                     ) -> tuple[float, dict[Cell, tuple[float, float]], dict[tuple, float]]:
    """_time_cells over every data group of the preset, group `key` on trials_of[key] trials in
    one chunk (the run's own chunk size): the three results of _time_cells, summed and merged."""
    total, cells, groups = 0.0, {}, {}
    for key, trials in trials_of.items():
        scenario, dim, seq_len, queries, calib = key
        config = _config(preset, trials, device, scenarios=(scenario,), dims=(dim,), seq_lens=(seq_len,),
                         queries=(queries,), calib_tokens=(calib,))
        t, c, g = _time_cells(config, device, trials)
        total += t
        cells.update(c)
        groups.update(g)
    return total, cells, groups


def grid_time(name: str, sample_trials: int, device: torch.device, repeats: int = 2) -> dict:
    """Wall time of the preset grid `name` as `run --grid NAME` runs it (its rows written to a
    scratch store), from three kinds of pass over every cell, after a warm-up pass (one trial of
    the first scenario's cells; its time added once): n = sample_trials trials in one chunk; one
    chunk of the run's own size (cell.chunk_size at the grid's trials; at least 2n) for each data
    group; 2n trials in two chunks of n; alternating, `repeats` of each, every cell and data group
    keeping its fastest. Each cell and each data group is modelled as time = g + c·chunks +
    b·trials — g what it pays once (scheme set-up), c what every chunk pays (drawing, Python per
    call, the store's commits), b per trial: b from the n-trial pass and the run-sized chunk, so
    the per-trial cost is measured on the chunks the run computes (working set, caches), c from
    the two-chunk pass — and the model evaluated at the grid's trial count and the number of
    chunks the run cuts them into. Also per scheme family and head dimension (the cells' own
    time), per (scenario, dim) slice (what `run --grid NAME --scenario S --dim d` runs: its whole
    wall time, and the cells' own), and the largest peak memory of a cell."""
    from .cell import chunk_size
    preset = grid(name)
    full = preset["trials"]
    n = sample_trials
    load_before = os.getloadavg()
    # What a run pays once (numba loading its compiled loops, the Lloyd–Max codebooks of every d
    # and width, lazy imports) lands in a warm-up pass on one trial of the first scenario's cells,
    # not in the first timed pass, whose excess the differencing would extrapolate as a negative
    # per-trial cost; the estimate counts the warm-up once, as the run pays it.
    warmup_s = _time_cells(_config(preset, 1, device, scenarios=preset["scenarios"][:1]), device)[0]
    full_config = _config(preset, full, device)
    chunks, big = {}, {}   # data key -> the run's number of chunks; the run-sized pass's trials (>= 2n)
    for key, group in itertools.groupby(full_config.cells(), key=lambda c: c.data_key):
        size = chunk_size(full_config, next(group), device)
        chunks[key], big[key] = math.ceil(full / size), max(size, 2 * n)
    # The passes alternate, `repeats` times each, and each cell, group and pass total keeps its
    # fastest: a pause of the machine or a slow spell hits one sample, not the differences that
    # are extrapolated.
    passes = {"n": lambda: _time_cells(_config(preset, n, device), device, n),
              "chunk": lambda: _time_chunk_pass(preset, device, big),
              "2n in 2": lambda: _time_cells(_config(preset, 2 * n, device), device, n)}
    samples: dict[str, list] = {kind: [] for kind in passes}
    for _ in range(repeats):
        for kind, timed in passes.items():
            samples[kind].append(timed())
    fastest = {kind: (min(total for total, _, _ in runs),
                      {cell: min((cells[cell] for _, cells, _ in runs), key=lambda c: c[0]) for cell in runs[0][1]},
                      {key: min(groups[key] for _, _, groups in runs) for key in runs[0][2]})
               for kind, runs in samples.items()}

    def parts(one: float, chunk: float, two_in_two: float, key: tuple) -> tuple[float, float, float]:
        """(g, c, b) of a cell or group from its n-trial, run-sized and two-chunk times."""
        per_trial = (chunk - one) / (big[key] - n)
        per_chunk = two_in_two - one - per_trial * n
        return one - per_chunk - per_trial * n, per_chunk, per_trial

    def at_grid(g_c_b: tuple[float, float, float], key: tuple) -> float:
        once, per_chunk, per_trial = g_c_b
        return once + per_chunk * chunks[key] + per_trial * full
    (t1, cells1, groups1), (tc, cellsc, groupsc), (t3, cells3, groups3) = fastest.values()
    group_parts = {key: parts(groups1[key], groupsc[key], groups3[key], key) for key in chunks}
    cell_parts = {cell: parts(wall1, cellsc[cell][0], cells3[cell][0], cell.data_key)
                  for cell, (wall1, _) in cells1.items()}
    by_family: dict[str, float] = {}
    by_dim: dict[int, float] = {}
    by_slice: dict[str, float] = {}           # "scenario/dim": a slice's whole run
    by_cells_slice: dict[str, float] = {}     # ... and its cells' own time
    for key, g_c_b in group_parts.items():
        where = f"{key[0]}/{key[1]}"
        by_slice[where] = by_slice.get(where, 0.0) + at_grid(g_c_b, key)
    for cell, g_c_b in cell_parts.items():
        estimate = at_grid(g_c_b, cell.data_key)
        family, where = cell.scheme.split("-")[0], f"{cell.scenario}/{cell.dim}"
        by_family[family] = by_family.get(family, 0.0) + estimate
        by_dim[cell.dim] = by_dim.get(cell.dim, 0.0) + estimate
        by_cells_slice[where] = by_cells_slice.get(where, 0.0) + estimate
    per_trial_cells = sum(b for _, _, b in cell_parts.values())
    return {"grid": name, "cells": len(cells1), "sample_trials": n,
            "chunk_trials_by_scenario_dim": {f"{key[0]}/{key[1]}": size for key, size in big.items()},
            "grid_trials": full, "repeats": repeats, "warmup_s": warmup_s, "measured_s": [t1, tc],
            "measured_in_two_chunks_s": t3,
            "samples_s": {"n": [total for total, _, _ in samples["n"]],
                          "chunk": [total for total, _, _ in samples["chunk"]]},
            "samples_in_two_chunks_s": [total for total, _, _ in samples["2n in 2"]],
            "estimated_grid_s": warmup_s + sum(by_slice.values()),
            "fixed_s": sum(g for g, _, _ in group_parts.values()),
            "per_trial_s": sum(b for _, _, b in group_parts.values()),
            "per_chunk_s": sum(c for _, c, _ in group_parts.values()),
            "chunks_at_grid_trials": sum(chunks.values()),
            "trials_per_s": len(cells1) / per_trial_cells if per_trial_cells > 0 else float("inf"),
            "estimated_s_by_family": by_family, "estimated_s_by_dim": by_dim,
            "estimated_s_by_scenario_dim": by_slice,
            "estimated_cell_s_by_scenario_dim": by_cells_slice,
            "peak_mem_mb_max": max((peak for _, cells, _ in fastest.values() for _, peak in cells.values()),
                                   default=0.0),
            "load_average": {"before": list(load_before), "after": list(os.getloadavg())}}


def _config(preset: dict, trials: int, device: torch.device, **fields) -> SweepConfig:
    """The preset on `trials` trials and the device, with `fields` replaced; validated."""
    config = SweepConfig(**{**preset, **fields, "trials": trials, "device": device.type})
    config.validate()
    return config


def workers_speedup(shape: BenchShape, device: torch.device, workers: int = 2) -> dict:
    """One sweep of 12 cells (heavy_tail; tq-kv, sq-kv, kivi, plain-kv; b = 2, 3, 4; the shape's
    d, S, Nq and trials) run serially and with `workers` local Dask workers, each into a fresh
    store as `harness run` does: wall times, their ratio serial/workers (> 1: the workers are
    faster), whether the rows are identical, and os.getloadavg() before, between and after (other
    processes on the machine change both times)."""
    import tempfile
    from pathlib import Path

    from .runner import run_sweep
    from .store import RunStore
    config = SweepConfig(scenarios=("heavy_tail",), schemes=("tq-kv", "sq-kv", "kivi", "plain-kv"), budgets=(2, 3, 4),
                         dims=(shape.dim,), seq_lens=(shape.seq_len,), queries=(shape.queries,), trials=shape.trials,
                         device=device.type)
    load, wall, frames = [os.getloadavg()], {}, {}
    with tempfile.TemporaryDirectory(prefix="kvharness-bench-") as tmp:
        for name, n in (("serial", None), ("workers", workers)):
            store = RunStore(Path(tmp) / name)
            t0 = time.perf_counter()
            run_sweep(config, store, progress=False, workers=n, serial_below_s=0)
            wall[name] = time.perf_counter() - t0
            load.append(os.getloadavg())
            frames[name] = store.trials()
    return {"cells": len(config.cells()), "trials": shape.trials, "workers": workers, "serial_s": wall["serial"],
            "workers_s": wall["workers"], "serial_over_workers": wall["serial"] / wall["workers"],
            "rows_identical": bool(frames["serial"].equals(frames["workers"])),
            "loadavg": {"before": load[0], "between": load[1], "after": load[2]}}
