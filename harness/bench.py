"""Throughput measured in one run, reported as figures and ratios (never asserted as times).

- runner: trials/s of the batched cell runner vs a per-trial loop (same cells, same data)
  vs the independent reference implementation;
- schemes: encode+decode vectors/s per scheme;
- attention: achieved fraction of the machine's measured matmul throughput in the metrics'
  attention step (q kᵀ and softmax · v as batched matmuls);
- grid (`--grid NAME`): the wall time of a whole preset grid, every cell run by the runner's
  own chunk loop on n and 2n trials, extrapolated linearly to the grid's trial count.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

import schemes

from .runner import _run_serial, create_scheme, draw_trials, run_cell_chunk
from .sweep import Cell, SweepConfig, grid, implementation


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


def _best_time(fn, repeats: int) -> float:
    """Minimum wall time over repeats (after one warm-up): the least disturbed measurement."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def runner_throughput(shape: BenchShape, device: torch.device) -> dict:
    config = SweepConfig(scenarios=(shape.scenario,), schemes=(shape.scheme,), budgets=(shape.budget,),
                         dims=(shape.dim,), seq_lens=(shape.seq_len,), queries=(shape.queries,),
                         trials=shape.trials, device=device.type)
    cell = Cell(shape.scenario, shape.scheme, shape.budget, shape.dim, shape.seq_len, shape.queries,
                config.calib_tokens[0])
    data = draw_trials(config, cell, range(shape.trials), device, torch.float32)
    scheme = create_scheme(config, cell)

    def one(i):
        return {k: (v[i:i + 1] if k != "positions" else v) for k, v in data.items()}

    def fresh():
        # new calibration tensors each call, so a calibrated scheme cannot reuse the previous
        # call's calibration (its memo keys on the tensors): the same work as the loop does
        return {**data, "k_cal": data["k_cal"].clone(), "v_cal": data["v_cal"].clone()}
    batched = _best_time(lambda: run_cell_chunk(scheme, fresh()), shape.repeats)
    loop = _best_time(lambda: [run_cell_chunk(scheme, one(i)) for i in range(shape.trials)], shape.repeats)
    out = {"cell": cell.key, "trials": shape.trials,
           "batched_trials_per_s": shape.trials / batched, "loop_trials_per_s": shape.trials / loop,
           "batched_over_loop": loop / batched}
    try:
        ref_scheme = implementation("reference")(shape.scheme, budget=shape.budget, dim=shape.dim,
                                                 seed=scheme.seed, rng=config.rng)
    except ValueError:
        out["reference_trials_per_s"] = None
        return out
    ref = _best_time(lambda: run_cell_chunk(ref_scheme, fresh()), 1)
    out["reference_trials_per_s"] = shape.trials / ref
    out["batched_over_reference"] = ref / batched
    return out


def scheme_throughput(shape: BenchShape, device: torch.device, names: list[str] | None = None,
                      budgets: tuple[int, ...] | None = None, impls: tuple[str, ...] = ("torch",)) -> dict:
    """Encode+decode vectors/s on (8, 1, S, d) Gaussian K and V (a vector is one token of K or V):
    {scheme: {impl: {budget: vectors/s}}}; schemes an implementation lacks are left out."""
    g = torch.Generator(device="cpu").manual_seed(0)
    k = torch.randn(8, 1, shape.seq_len, shape.dim, generator=g).to(device)
    v = torch.randn(8, 1, shape.seq_len, shape.dim, generator=g).to(device)
    result: dict = {}
    for name in names or schemes.available():
        for impl in impls:
            for budget in budgets or (shape.budget,):
                try:
                    s = implementation(impl)(name, budget=budget, dim=shape.dim)
                except ValueError:
                    continue  # not in this implementation, or this shape breaks its constraints
                s.fit(k, v)
                t = _best_time(lambda: s.decode(s.encode(k, v)), 1 if impl == "reference" else shape.repeats)
                result.setdefault(name, {}).setdefault(impl, {})[budget] = 2 * k.shape[0] * shape.seq_len / t
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


def run_bench(shape: BenchShape, device: torch.device, scheme_names: list[str] | None = None,
              budgets: tuple[int, ...] | None = None, impls: tuple[str, ...] = ("torch",)) -> dict:
    return {"device": str(device), "threads": torch.get_num_threads(), "shape": shape.__dict__,
            "runner": runner_throughput(shape, device),
            "schemes_vectors_per_s": scheme_throughput(shape, device, scheme_names, budgets, impls),
            "attention": attention_efficiency(shape, device)}


def _time_cells(config: SweepConfig, device: torch.device) -> tuple[float, dict[Cell, tuple[float, float]]]:
    """(wall time of the whole sweep, {cell: (its own wall time, peak MiB)}) by the runner's own
    chunk loop, nothing stored."""
    cells: dict[Cell, tuple[float, float]] = {}
    t0 = time.perf_counter()
    _run_serial(config, config.cells(), device, torch.float32, None,
                lambda cell, rows, wall, peak_mb: cells.__setitem__(cell, (wall, peak_mb)))
    return time.perf_counter() - t0, cells


def grid_time(name: str, sample_trials: int, device: torch.device) -> dict:
    """Wall time of the preset grid `name` (as `run --grid NAME` would run it, without the store),
    from two passes over every cell, on n = sample_trials and on 2n trials: time = a + b·trials
    per cell and in all, extrapolated to the grid's trial count (the fixed part a — scheme
    set-up, codebooks, per-cell Python — counted once, not scaled). Also per scheme family and
    head dimension, and the largest peak memory of a cell."""
    preset = grid(name)
    full = preset["trials"]
    passes = {}
    for n in (sample_trials, 2 * sample_trials):
        config = SweepConfig(**{**preset, "trials": n, "device": device.type})
        config.validate()
        passes[n] = _time_cells(config, device)
    (t1, cells1), (t2, cells2) = passes[sample_trials], passes[2 * sample_trials]

    def extrapolate(small: float, large: float) -> float:
        return small + (large - small) * (full - sample_trials) / sample_trials
    by_family: dict[str, float] = {}
    by_dim: dict[int, float] = {}
    for cell, (wall1, _) in cells1.items():
        estimate = extrapolate(wall1, cells2[cell][0])
        family = cell.scheme.split("-")[0]
        by_family[family] = by_family.get(family, 0.0) + estimate
        by_dim[cell.dim] = by_dim.get(cell.dim, 0.0) + estimate
    return {"grid": name, "cells": len(cells1), "sample_trials": [sample_trials, 2 * sample_trials],
            "grid_trials": full, "measured_s": [t1, t2], "estimated_grid_s": extrapolate(t1, t2),
            "fixed_s": 2 * t1 - t2, "per_trial_s": (t2 - t1) / sample_trials,
            "trials_per_s": len(cells1) * sample_trials / (t2 - t1) if t2 > t1 else float("inf"),
            "estimated_s_by_family": by_family, "estimated_s_by_dim": by_dim,
            "peak_mem_mb_max": max((peak for _, peak in list(cells1.values()) + list(cells2.values())), default=0.0)}


def workers_speedup(shape: BenchShape, device: torch.device, workers: int = 2) -> dict:
    """One sweep of 12 cells (heavy_tail; tq-kv, sq-kv, kivi, plain-kv; b = 2, 3, 4; the shape's
    d, S, Nq and trials) run serially and with `workers` local Dask workers, each into a fresh
    store as `harness run` does: wall times, their ratio serial/workers (> 1: the workers are
    faster), whether the rows are identical, and os.getloadavg() before, between and after (other
    processes on the machine change both times)."""
    import os
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
            run_sweep(config, store, progress=False, workers=n)
            wall[name] = time.perf_counter() - t0
            load.append(os.getloadavg())
            frames[name] = store.trials()
    return {"cells": len(config.cells()), "trials": shape.trials, "workers": workers, "serial_s": wall["serial"],
            "workers_s": wall["workers"], "serial_over_workers": wall["serial"] / wall["workers"],
            "rows_identical": bool(frames["serial"].equals(frames["workers"])),
            "loadavg": {"before": load[0], "between": load[1], "after": load[2]}}
