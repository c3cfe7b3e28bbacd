"""Throughput measured in one run, reported as figures and ratios (never asserted as times).

- runner: trials/s of the batched cell runner vs a per-trial loop (same cells, same data)
  vs the independent reference implementation;
- schemes: encode+decode vectors/s per scheme;
- attention: achieved fraction of the machine's measured matmul throughput in the metrics'
  attention step (q kᵀ and softmax · v as batched matmuls);
- grid (`--grid NAME`): the wall time of a whole preset grid, every cell run by the runner's
  own chunk loop on a sample of its trials, extrapolated to the grid's trial count.
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
    batched = _best_time(lambda: run_cell_chunk(scheme, data), shape.repeats)
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
    ref = _best_time(lambda: run_cell_chunk(ref_scheme, data), 1)
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


def grid_time(name: str, sample_trials: int, device: torch.device) -> dict:
    """Wall time of the preset grid `name` (as `run --grid NAME` would run it, without the store):
    every cell on `sample_trials` trials, then scaled by grid trials / sample_trials. Fixed
    per-cell costs (scheme set-up, codebooks, calibration of a chunk) are scaled too, so the
    extrapolation errs high. Also per scheme family and per head dimension, and the largest
    peak memory of a cell."""
    preset = grid(name)
    config = SweepConfig(**{**preset, "trials": sample_trials, "device": device.type})
    config.validate()
    cells: dict[Cell, tuple[float, float]] = {}
    t0 = time.perf_counter()
    _run_serial(config, config.cells(), device, torch.float32, None,
                lambda cell, rows, wall, peak_mb: cells.__setitem__(cell, (wall, peak_mb)))
    measured = time.perf_counter() - t0
    scale = preset["trials"] / sample_trials
    by_family: dict[str, float] = {}
    by_dim: dict[int, float] = {}
    for cell, (wall, _) in cells.items():
        family = cell.scheme.split("-")[0]
        by_family[family] = by_family.get(family, 0.0) + wall * scale
        by_dim[cell.dim] = by_dim.get(cell.dim, 0.0) + wall * scale
    return {"grid": name, "cells": len(cells), "sample_trials": sample_trials, "grid_trials": preset["trials"],
            "measured_s": measured, "estimated_grid_s": measured * scale,
            "sample_trials_per_s": len(cells) * sample_trials / measured,
            "estimated_s_by_family": by_family, "estimated_s_by_dim": by_dim,
            "peak_mem_mb_max": max((peak for _, peak in cells.values()), default=0.0)}
