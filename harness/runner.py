"""The cell runner: data → scheme → metrics → rows → store, trials batched in bounded chunks.

Seeds are data (STYLE.md §4): trial t of a cell draws from the streams
(seed, "data", scenario, dim, seq_len, queries, heads, t, tensor, head), shared by every scheme
and budget; a scheme's own randomness comes from (seed, "scheme", name, budget, dim). So a
row depends only on (configuration, seed), never on chunking, order or resumption.
"""
from __future__ import annotations

import inspect
import itertools
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

import scenarios
import schemes
from schemes.base import BitLedger
from schemes.rng import generator, seed_sequence
from stats.metrics import exact_logits, trial_metrics

from .devices import available_memory_bytes, resolve_device, resolve_dtype
from .memory import peak_bytes, reset_peak
from .provenance import now, provenance
from .store import DIAGNOSTIC_COLUMNS, RunStore
from .sweep import Cell, SweepConfig, implementation

DEFAULT_MEMORY_BUDGET = 1 << 28  # bytes of working tensors per chunk; 256 MiB measured fastest on 2 cores (cache, allocator reuse)


class RunConflict(ValueError):
    """The output directory holds something other than this run."""


@dataclass(frozen=True)
class RunResult:
    n_cells_run: int
    n_cells_skipped: int
    wall_s: float


def scheme_seed(root_seed: int, name: str, budget: int, dim: int) -> int:
    return int(seed_sequence(root_seed, "scheme", name, budget, dim).generate_state(1)[0])


def bytes_per_trial(config: SweepConfig, cell: Cell) -> int:
    """A generous estimate of the working memory one trial needs (tensors and temporaries)."""
    item = 8 if config.dtype == "float64" else 4
    cache = config.heads * cell.seq_len * cell.dim
    attention = config.heads * cell.queries * cell.seq_len
    calib = config.heads * config.calib_tokens * cell.dim
    return item * (12 * cache + 2 * calib + 2 * config.heads * cell.queries * cell.dim) + 8 * 8 * attention


def chunk_size(config: SweepConfig, cell: Cell, device: torch.device, budget: int | None = None) -> int:
    budget = budget or min(DEFAULT_MEMORY_BUDGET, available_memory_bytes(device) // 4)
    return max(1, min(config.trials, budget // bytes_per_trial(config, cell)))


def draw_trials(config: SweepConfig, cell: Cell, trials: range, device, dtype) -> dict[str, torch.Tensor]:
    """The scenario's data for the given trials, stacked to (B, H, n, d) tensors on device."""
    scenario = scenarios.create(cell.scenario, **config.scenario_params.get(cell.scenario, {}))
    shape = scenarios.TrialShape(config.heads, cell.seq_len, cell.queries, cell.dim, config.calib_tokens)
    draws = []
    for t in trials:
        def streams(*labels, _t=t):
            return generator(config.rng, config.seed, "data", cell.scenario, cell.dim, cell.seq_len,
                             cell.queries, config.heads, _t, *labels)
        draws.append(scenario.draw(streams, shape))
    out = {name: torch.from_numpy(np.stack([d[name] for d in draws])).to(device=device, dtype=dtype)
           for name in ("k", "v", "q", "k_cal", "v_cal")}
    out["positions"] = torch.from_numpy(draws[0]["positions"]).to(device)
    return out


def run_cell_chunk(scheme: schemes.Scheme, data: dict[str, torch.Tensor]) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Fit, encode, decode and score one chunk; per-trial metrics and measured bits/element (B,)."""
    scheme.fit(data["k_cal"], data["v_cal"])
    # Schemes that undo RoPE (Shard) take the tokens' positions; the rest ignore them.
    takes_positions = "positions" in inspect.signature(scheme.encode).parameters
    enc = scheme.encode(data["k"], data["v"], **({"positions": data["positions"]} if takes_positions else {}))
    k_hat, v_hat = scheme.decode(enc)
    logits_hat = scheme.score(data["q"], enc) if scheme.scores_on_codes else exact_logits(data["q"], k_hat)
    metrics = trial_metrics(data["k"], data["v"], data["q"], k_hat, v_hat, logits_hat)
    metrics.update({k: v for k, v in scheme.diagnostics().items() if k in DIAGNOSTIC_COLUMNS})
    return ({name: m.cpu().numpy() for name, m in metrics.items()},
            BitLedger.per_trial_bits_per_element(enc).numpy())


def create_scheme(config: SweepConfig, cell: Cell) -> schemes.Scheme:
    """The cell's scheme from the chosen implementation (torch, or the independent reference)."""
    seed = scheme_seed(config.seed, cell.scheme, cell.budget, cell.dim)
    return implementation(config.impl)(cell.scheme, budget=cell.budget, dim=cell.dim, rng=config.rng, seed=seed)


def _rows(config: SweepConfig, cell: Cell, device: torch.device, trials: range,
          metrics: dict[str, np.ndarray], bits: np.ndarray):
    for i, t in enumerate(trials):
        row = dict(zip(("scenario", "scheme", "budget", "dim", "seq_len", "queries"), cell.key))
        row.update(trial=t, seed=config.seed, impl=config.impl, device=device.type, dtype=config.dtype,
                   rng=config.rng, heads=config.heads, calib_tokens=config.calib_tokens,
                   bits_per_element=float(bits[i]))
        row.update({name: float(values[i]) for name, values in metrics.items()})
        yield row


def prepare_store(config: SweepConfig, store: RunStore, *, resume: bool) -> None:
    """Check the directory against this run (RunConflict when it holds another) and write the manifest."""
    manifest = store.read_manifest()
    if manifest is not None or store.path.exists():
        if not resume:
            raise RunConflict(f"{store.directory} already holds a run; pass --resume to finish it "
                              f"or choose another --out")
        if manifest is None or manifest.get("config") != config.to_json():
            differing = sorted(k for k, v in config.to_json().items()
                               if manifest is None or manifest.get("config", {}).get(k) != v)
            raise RunConflict(f"{store.directory} holds a different run (differs in: "
                              f"{', '.join(differing)}); choose another --out")
        manifest.setdefault("resumed_at", []).append(now())
        manifest["finished_at"] = None
        store.write_manifest(manifest)
        return
    store.write_manifest({"config": config.to_json(), "provenance": provenance(resolve_device(config.device)),
                          "started_at": now(), "finished_at": None})


def compute_cell(config: SweepConfig, cell: Cell, memory_budget: int | None = None):
    """One cell on its own (the distributed path): (rows, wall_s, peak_mem_mb)."""
    device, dtype = resolve_device(config.device), resolve_dtype(config.dtype)
    size = chunk_size(config, cell, device, memory_budget)
    scheme = create_scheme(config, cell)
    rows, wall, peak = [], 0.0, 0
    for start in range(0, config.trials, size):
        trials = range(start, min(start + size, config.trials))
        data = draw_trials(config, cell, trials, device, dtype)
        t0 = time.perf_counter()
        reset_peak(device)
        metrics, bits = run_cell_chunk(scheme, data)
        peak = max(peak, peak_bytes(device) or 0)
        rows.extend(_rows(config, cell, device, trials, metrics, bits))
        wall += time.perf_counter() - t0
    return rows, wall, peak / 2 ** 20


def _run_serial(config: SweepConfig, todo: list[Cell], device, dtype, memory_budget, on_cell) -> None:
    """Cells that share data are run together on each chunk of drawn trials; a cell is handed to
    on_cell as soon as its last chunk is done."""
    for _, group in itertools.groupby(todo, key=lambda c: c.data_key):
        group = list(group)
        size = chunk_size(config, group[0], device, memory_budget)
        chunks = [range(i, min(i + size, config.trials)) for i in range(0, config.trials, size)]
        cell_schemes = {cell: create_scheme(config, cell) for cell in group}
        rows = {cell: [] for cell in group}
        wall = dict.fromkeys(group, 0.0)
        peak = dict.fromkeys(group, 0)
        for n_chunk, trials in enumerate(chunks):
            data = draw_trials(config, group[0], trials, device, dtype)
            for cell in group:
                t0 = time.perf_counter()
                reset_peak(device)
                metrics, bits = run_cell_chunk(cell_schemes[cell], data)
                peak[cell] = max(peak[cell], peak_bytes(device) or 0)
                rows[cell].extend(_rows(config, cell, device, trials, metrics, bits))
                wall[cell] += time.perf_counter() - t0
                if n_chunk == len(chunks) - 1:
                    on_cell(cell, rows.pop(cell), wall[cell], peak[cell] / 2 ** 20)


def run_sweep(config: SweepConfig, store: RunStore, *, resume: bool = False, progress: bool | None = None,
              memory_budget: int | None = None, workers: int | None = None,
              scheduler: str | None = None) -> RunResult:
    """Run every cell of the sweep not yet in the store; each finished cell is committed at once.
    With workers (a local Dask cluster) or scheduler (an existing one) cells run as Dask tasks."""
    start = time.perf_counter()
    device, dtype = resolve_device(config.device), resolve_dtype(config.dtype)
    prepare_store(config, store, resume=resume)
    done = store.finished_cells()
    todo = [c for c in config.cells() if c.key not in done]
    if progress is None:
        progress = sys.stderr.isatty()
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(todo), unit="cell", file=sys.stderr)

    def on_cell(cell: Cell, rows: list, wall: float, peak_mb: float) -> None:
        store.write_cell(cell.key, rows, wall_s=wall, finished_at=now(), peak_mem_mb=peak_mb)
        if bar:
            bar.update(1)

    try:
        if workers or scheduler:
            from .distributed import run_distributed
            run_distributed(config, todo, workers=workers, scheduler=scheduler, memory_budget=memory_budget,
                            on_cell=on_cell)
        else:
            _run_serial(config, todo, device, dtype, memory_budget, on_cell)
    finally:
        if bar:
            bar.close()
    manifest = store.read_manifest()
    manifest["finished_at"] = now()
    manifest["peak_mem_mb_per_cell"] = store.peak_memory_mb()
    store.write_manifest(manifest)
    return RunResult(len(todo), len(done), time.perf_counter() - start)
