"""The progress line's time left (harness.progress.RemainingTime), replayed: on a recorded first
run of the main job (tests/data/progress_first_run.jsonl: every chunk's time, cell, trials and
own work, every numba compile, 24 codecs x 3 budgets, 50 trials in chunks of 2, 24, 24, on a
loaded 2-core machine) and on constructed runs whose remaining time is known exactly. The line
shows the compiling as what it is, and says `unknown` rather than guess."""
from __future__ import annotations

import io
import json
import math
from pathlib import Path

import numpy as np
import pytest

from harness.progress import CostHistory, Progress, RemainingTime

RECORDED = Path(__file__).parent / "data" / "progress_first_run.jsonl"


class _Clocks:
    """The replay's clock and a CompileClock-like view of the recorded compiles."""

    def __init__(self):
        self.now, self.total, self.since = 0.0, 0.0, None

    def __call__(self) -> float:
        return self.now

    def active(self) -> bool:
        return self.since is not None

    def seconds(self) -> float:
        return self.total + (self.now - self.since if self.since is not None else 0.0)


def _replay(events, n_trials: int, prior=None, lines=None):
    """(time, ETA, true time left) at each chunk of the events, through a Progress."""
    end = next(e["t"] for e in events if e["kind"] == "end")
    cells = sorted({tuple(e["cell"]) for e in events if e["kind"] == "chunk"})
    clocks = _Clocks()
    progress = Progress(len(cells), len(cells) * n_trials, mode=None if lines is None else "lines", stream=lines,
                        interval=0, trials_left=dict.fromkeys(cells, n_trials), prior=prior, compiling=clocks,
                        clock=clocks)
    seen = []
    for e in events:
        clocks.now = e["t"]
        if e["kind"] == "compile_start":
            clocks.since = e["t"]
        elif e["kind"] == "compile_end":
            clocks.total, clocks.since = clocks.total + e["t"] - clocks.since, None
        elif e["kind"] == "chunk":
            progress.advance(e["trials"], int(e["last"]), tuple(e["cell"]), e["wall"], e["start"])
            seen.append((e["t"], progress.eta(), end - e["t"]))
    return seen, progress


def _recorded():
    return [json.loads(line) for line in RECORDED.read_text().splitlines()]


def test_a_first_run_says_unknown_until_a_cell_runs_past_its_first_chunk_then_tracks_the_truth():
    events = _recorded()
    seen, _ = _replay(events, 50)
    first_later = next(i for i, e in enumerate([e for e in events if e["kind"] == "chunk"]) if e["start"] > 0)
    assert all(eta is None for _, eta, _ in seen[:first_later])   # the one-time work's size is not guessed
    ratios = np.array([eta / left for _, eta, left in seen[first_later:] if left > 1])
    # the recorded machine's load moved the truth itself by up to 2x between chunks of trials
    assert np.median(np.abs(np.log(ratios))) < math.log(1.5)
    assert np.abs(np.log(ratios)).max() < math.log(3)


def test_the_rate_and_the_line_leave_the_compiling_out_and_show_it():
    events = _recorded()
    compiled = sum(b["t"] - a["t"] for a, b in zip(events, events[1:]) if a["kind"] == "compile_start")
    stream = io.StringIO()
    _, progress = _replay(events, 50, lines=stream)
    end = next(e["t"] for e in events if e["kind"] == "end")
    assert progress.rate() == pytest.approx(progress.trials_done / (end - compiled))
    shown = stream.getvalue().splitlines()
    assert any(f"compiling {compiled:.0f} s" in line for line in shown[-3:])
    assert shown[0].startswith("[0/72 cells (1 under way), 2/3600 trials") and "ETA unknown" in shown[0]


def _constructed(seed: int, n_cells: int = 30, n_trials: int = 50, chunk: int = 16):
    """A serial sweep with known costs: each cell c a cost per trial p_c (log-normal, a 10-fold
    spread), a one-time cost on its first chunk, the data drawn once per chunk of trials (in the
    first cell's gap), chunks as cell.chunk_plan cuts them (the short one first). Events as
    recorded, and the exact time left after each chunk."""
    rng = np.random.default_rng(seed)
    p = np.exp(rng.normal(-3, 0.8, n_cells))
    setup = rng.uniform(0.2, 2.0, n_cells)
    draw = 0.004
    bounds = [0, n_trials % chunk or chunk]
    while bounds[-1] < n_trials:
        bounds.append(bounds[-1] + chunk)
    t, events = 1.0, []
    for a, b in zip(bounds, bounds[1:]):
        for c in range(n_cells):
            wall = (b - a) * p[c] + (setup[c] if a == 0 else 0.0)
            t += wall + (draw * (b - a) if c == 0 else 0.0)
            events.append({"kind": "chunk", "t": t, "cell": [f"codec{c}", 2], "start": a, "trials": b - a,
                           "wall": wall, "last": b == n_trials})
    events.append({"kind": "end", "t": t})
    return events, {(f"codec{c}", 2): float(p[c]) for c in range(n_cells)}


@pytest.mark.parametrize("seed", range(4))
def test_on_a_run_of_known_costs_the_eta_is_within_15_percent_once_each_cost_is_seen(seed):
    events, _ = _constructed(seed)
    seen, _ = _replay(events, 50)
    n_cells = 30
    # after the first chunk of trials and the first cell of the second: every cost either
    # measured or the mean of the measured ones; once all are measured, exact up to the draws
    for _, eta, left in seen[2 * n_cells:-1]:
        assert eta == pytest.approx(left, rel=0.15)
    assert all(eta is None for _, eta, _ in seen[:n_cells])


@pytest.mark.parametrize("seed", range(3))
def test_an_earlier_runs_costs_give_the_eta_from_the_first_chunk(seed):
    """With CostHistory's prior (an earlier run on this machine: each cost off by up to 30 %, and
    the whole 20 % slower), the ETA is known from the very first chunk, within 1.5x, and within
    15 % once this run's own costs are measured."""
    events, costs = _constructed(seed)
    noise = np.random.default_rng(seed + 100).uniform(0.7, 1.3, len(costs))
    prior = {cell: 1.2 * cost * k for (cell, cost), k in zip(costs.items(), noise)}
    seen, _ = _replay(events, 50, prior=prior)
    assert all(eta is not None for _, eta, _ in seen)
    assert all(1 / 1.5 <= eta / left <= 1.5 for _, eta, left in seen[:-1] if left > 0)
    for _, eta, left in seen[60:-1]:          # every cost measured on a later chunk
        assert eta == pytest.approx(left, rel=0.15)


def test_the_cost_history_round_trips_and_survives_a_damaged_file(tmp_path):
    history = CostHistory(tmp_path / "sub" / "costs.json")
    assert history.load() == {}
    history.save({"a": 0.5, "b": 1.25})
    history.save({"b": 2.0})
    assert history.load() == {"a": 0.5, "b": 2.0}
    (tmp_path / "sub" / "costs.json").write_text("[not a mapping")
    assert history.load() == {}


def test_a_run_fills_the_cost_history_that_the_next_run_reads(tmp_path, monkeypatch):
    from harness.runner import run_sweep
    from harness.store import RunStore
    from harness.sweep import SweepConfig

    path = tmp_path / "costs.json"
    monkeypatch.setenv("KVHARNESS_COST_HISTORY", str(path))
    monkeypatch.setenv("KVHARNESS_CHUNK_TRIALS", "2")
    config = SweepConfig(scenarios=("gaussian",), schemes=("tq-kv", "int4"), budgets=(2,), dims=(16,),
                         seq_lens=(32,), queries=(4,), calib_tokens=(32,), trials=5)
    run_sweep(config, RunStore(tmp_path / "a"), progress=False)
    stored = CostHistory(path).load()
    assert len(stored) == 2 and all(v > 0 for v in stored.values())
    assert {json.loads(k)[1] for k in stored} == {"tq-kv", "int4"}


def test_remaining_time_by_hand():
    """Two cells, 10 trials each: cell a's first chunk of 2 trials (1 s of its own work), then 4
    trials in 0.4 s of its own work and 0.1 s drawing; cell b's first chunk only: b costs what a
    costs per trial, the draws of the 4 trials still to draw and a's own 4 trials left."""
    left = RemainingTime({"a": 10, "b": 10})
    left.chunk("a", 2, 1.0, 1.0, 0)
    assert left.seconds() is None
    left.chunk("b", 2, 3.0, 3.0, 0)
    left.chunk("a", 4, 0.5, 0.4, 2)
    a, b, draws = 4 * 0.1, 8 * 0.1, (10 - 6) * 0.1 / 4
    assert left.seconds() == pytest.approx(a + b + draws)
