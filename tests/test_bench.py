"""harness bench reports figures and ratios measured in one run (values are not asserted as times)."""
import json
import os

import pytest

from harness.cli import main


def test_bench_json_has_every_figure(capsys):
    code = main(["bench", "--json", "--dim", "16", "--seq-len", "32", "--queries", "4", "--trials", "4",
                 "--repeats", "1", "--schemes", "tq-kv,plain-kv", "--budgets", "2,4", "--reference",
                 "--triad-mib", "1"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    r = result["runner"]
    assert r["batched_trials_per_s"] > 0 and r["loop_trials_per_s"] > 0
    # every figure is the best of its raw samples: rates from the fastest sample, ratios of those
    assert r["batched_trials_per_s"] == pytest.approx(4 / min(r["samples_s"]["batched"]))
    assert r["batched_over_loop"] == pytest.approx(min(r["samples_s"]["loop"]) / min(r["samples_s"]["batched"]))
    table = result["schemes_vectors_per_s"]
    assert set(table) == {"tq-kv", "plain-kv"}
    assert set(table["tq-kv"]) == {"torch", "reference"} and set(table["tq-kv"]["torch"]) == {"2", "4"}
    assert all(rate > 0 for by_impl in table.values() for by_b in by_impl.values() for rate in by_b.values())
    assert 0 < result["attention"]["attention_fraction_of_matmul"]
    # raw samples (asv-style) beside every figure, and the machine's load
    assert len(r["samples_s"]["batched"]) == 1 and min(r["samples_s"]["loop"]) > 0
    assert set(result["schemes_samples_s"]["tq-kv"]["torch"]) == {"2", "4"}
    rot = result["rotation"]
    assert rot["fast_over_dense"] == pytest.approx(min(rot["samples_s"]["dense"]) / min(rot["samples_s"]["hadamard"]))
    # the rotation compared at the --budget and at each of --budgets, the --budget's the same figure
    by_budget = result["rotation_by_budget"]
    assert set(by_budget) == {"3", "2", "4"} and by_budget["3"] == rot
    assert all(by_budget[b]["budget"] == int(b) for b in by_budget)
    th = result["threads_comparison"]
    assert th["one_thread_over_all_threads"] > 0 and th["eigh_over_power"] > 0
    assert set(th["samples_s"]["fit"]) == {"eigh", "power"}
    assert len(result["load_average"]["before"]) == 3 and result["cpu_count"] >= 1
    assert result["omp_wait_policy"] == os.environ.get("OMP_WAIT_POLICY")


def test_dense_rotation_is_a_rotation_and_only_while_asked():
    """The bench's baseline codes with a dense orthogonal matrix: the same error level as the
    Hadamard codec (both are random rotations), and the codec is itself again afterwards."""
    import torch

    import schemes
    from harness.bench import _dense_rotation
    from schemes import turboquant
    with torch.inference_mode():   # as the bench times it: no memo serves the second coding
        k = torch.randn(2, 1, 64, 32, generator=torch.Generator().manual_seed(0))
    s = schemes.create("tq-kv", budget=3, dim=32)
    fast = s.decode(s.encode(k, k))[0]
    with _dense_rotation(32, torch.device("cpu")):
        dense = s.decode(s.encode(k, k))[0]
    err = [float(((x - k) ** 2).sum() / (k ** 2).sum()) for x in (fast, dense)]
    assert abs(err[1] - err[0]) < 0.2 * err[0] and not torch.equal(fast, dense)
    assert turboquant.rht.__module__ == "schemes.hadamard"


def test_bench_bad_input(capsys):
    assert main(["bench", "--trials", "0"]) == 2
    assert main(["bench", "--scheme", "nope"]) == 2
    assert "unknown scheme 'nope'" in capsys.readouterr().err


def test_bench_grid_models_fixed_chunk_and_trial_parts(capsys, monkeypatch):
    """Every cell of the grid is run on n trials, on one chunk of the run's own size (each data
    group on its own) and on 2n trials in two chunks (alternating, twice each, after a warm-up on
    one trial of the first scenario); with cell and group times g + c·chunks + b·trials the
    estimate is each one's g + c·k + b·12, k the chunks the grid's own run cuts (here 3, of 5
    trials), summed, plus the warm-up, whatever a slow spell adds to one repeat; the passes' rows
    go to a store, as the run's do. Where the run's chunks are no larger than 2n, the sized pass
    takes 2n trials."""
    import math

    from harness import bench, cell as cell_engine, sweep
    from harness.store import RunStore
    monkeypatch.setitem(sweep.GRIDS, "tiny", {
        "scenarios": ("gaussian", "lowrank_aligned"), "schemes": ("tq-kv", "sq-kv"), "budgets": (2, 3),
        "dims": (16,), "seq_lens": (32,), "queries": (4,), "trials": 12, "calib_tokens": (32,)})
    config12 = sweep.SweepConfig(**sweep.grid("tiny"))
    monkeypatch.setattr(cell_engine, "DEFAULT_MEMORY_BYTES", 5 * cell_engine.bytes_per_trial(config12, config12.cells()[0]))
    real = bench._time_cells
    seen, order, written = {}, [], []
    real_write = RunStore.write_chunk

    def counting_write(self, cell, rows, **kw):
        written.append((cell, len(rows)))
        return real_write(self, cell, rows, **kw)
    monkeypatch.setattr(RunStore, "write_chunk", counting_write)
    fixed, per_chunk, per_trial = {"tq-kv": 0.5, "sq-kv": 2.0}, {"tq-kv": 0.2, "sq-kv": 0.4}, {"tq-kv": 0.1, "sq-kv": 0.3}
    draw_chunk = 0.25    # a group's draw, per chunk, beside its cells
    slow = {"calls": range(1, 5)}

    def synthetic(config, device, chunk_trials=None):
        total, cells, groups = real(config, device, chunk_trials)   # the cells really run ...
        chunks = math.ceil(config.trials / (chunk_trials or config.trials))
        seen.setdefault((config.trials, chunks), set()).update(cells)
        order.append((config.trials, chunks, len(cells)))
        # the first repeat (calls 1-4 after the warm-up: n, the sized pass's two groups, 2n in 2)
        # hits a slow spell: every cell 2 s slower
        pause = 2.0 if len(order) - 1 in slow["calls"] else 0.0
        timed = {c: (fixed[c.scheme] + per_chunk[c.scheme] * chunks + per_trial[c.scheme] * config.trials + pause, 1.0)
                 for c in cells}
        groups = {key: sum(t for c, (t, _) in timed.items() if c.data_key == key) + draw_chunk * chunks
                  for key in groups}
        return sum(groups.values()), timed, groups   # ... timed as g + c·chunks + b·trials
    monkeypatch.setattr(bench, "_time_cells", synthetic)
    assert main(["bench", "--grid", "tiny", "--trials", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert seen[(2, 1)] == seen[(5, 1)] == seen[(4, 2)] and len(seen[(2, 1)]) == result["cells"] == 2 * 2 * 2
    # every chunk of every cell of every pass was written (warm-up: 1 trial of 4 cells)
    assert len(written) == 4 + 2 * 8 * (1 + 1 + 2) and sum(n for _, n in written) == 4 + 2 * 8 * (2 + 5 + 4)
    # the warm-up, then the three kinds of pass alternating twice (the sized one group by group)
    assert order == [(1, 1, 4)] + [(2, 1, 8), (5, 1, 4), (5, 1, 4), (4, 2, 8)] * 2 and result["repeats"] == 2
    for samples in (result["samples_s"]["n"], result["samples_s"]["chunk"], result["samples_in_two_chunks_s"]):
        assert samples[0] - samples[1] == pytest.approx(2.0 * 8)
    # the warm-up: one trial of the first scenario's cells, counted once in the estimate
    assert seen[(1, 1)] == {c for c in seen[(2, 1)] if c.scenario == "gaussian"}
    warmup = 2 * (0.5 + 0.2 + 0.1) + 2 * (2.0 + 0.4 + 0.3) + draw_chunk
    assert result["warmup_s"] == pytest.approx(warmup)
    assert result["grid"] == "tiny" and result["sample_trials"] == 2 and result["grid_trials"] == 12
    assert result["chunk_trials_by_scenario_dim"] == {"gaussian/16": 5, "lowrank_aligned/16": 5}
    k = 3   # 12 trials in chunks of 5
    assert result["chunks_at_grid_trials"] == 2 * k
    per_cell = {family: fixed[f"{family}-kv"] + per_chunk[f"{family}-kv"] * k + per_trial[f"{family}-kv"] * 12
                for family in ("tq", "sq")}
    slice_cells = 2 * per_cell["tq"] + 2 * per_cell["sq"]      # a scenario at d = 16: 2 schemes x 2 budgets
    assert result["estimated_cell_s_by_scenario_dim"] == pytest.approx({"gaussian/16": slice_cells,
                                                                        "lowrank_aligned/16": slice_cells})
    slice_s = slice_cells + draw_chunk * k
    assert result["estimated_s_by_scenario_dim"] == pytest.approx({"gaussian/16": slice_s, "lowrank_aligned/16": slice_s})
    assert result["estimated_grid_s"] == pytest.approx(2 * slice_s + warmup)
    assert result["estimated_s_by_family"] == pytest.approx({k_: 4 * v for k_, v in per_cell.items()})
    assert result["per_trial_s"] == pytest.approx(4 * (0.1 + 0.3))
    assert result["trials_per_s"] == pytest.approx(8 / (4 * (0.1 + 0.3)))
    assert result["per_chunk_s"] == pytest.approx(4 * (0.2 + 0.4) + 2 * draw_chunk)
    assert result["fixed_s"] == pytest.approx(4 * (0.5 + 2.0))
    assert main(["bench", "--grid", "tiny", "--trials", "2"]) == 0
    out = capsys.readouterr().out
    assert "one chunk of the run's own size (5 trials)" in out and "estimated at 12 trials (6 chunks)" in out
    order.clear()
    slow["calls"] = range(0)
    assert main(["bench", "--grid", "tiny", "--trials", "3", "--repeats", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["chunk_trials_by_scenario_dim"] == {"gaussian/16": 6, "lowrank_aligned/16": 6}
    assert order == [(1, 1, 4), (3, 1, 8), (6, 1, 4), (6, 1, 4), (6, 2, 8)]
    assert result["estimated_s_by_scenario_dim"] == pytest.approx({"gaussian/16": slice_s, "lowrank_aligned/16": slice_s})


def test_bench_times_a_sweep_serially_and_with_workers_in_one_run(capsys):
    """--workers N: the same 12-cell sweep serial and on N local Dask workers, the ratio, the rows
    compared, and the load average (which sways both times) recorded with them."""
    pytest.importorskip("distributed")
    argv = ["bench", "--dim", "16", "--seq-len", "32", "--queries", "4", "--trials", "4", "--repeats", "1",
            "--schemes", "tq-kv", "--workers", "2", "--triad-mib", "1"]
    assert main([*argv, "--json"]) == 0
    w = json.loads(capsys.readouterr().out)["workers"]
    assert w["cells"] == 12 and w["workers"] == 2 and w["rows_identical"] is True
    assert w["serial_over_workers"] == pytest.approx(w["serial_s"] / w["workers_s"])
    assert all(len(w["loadavg"][k]) == 3 for k in ("before", "between", "after"))
    assert main(["bench", "--workers", "0"]) == 2


def test_timings_wait_for_the_gpu_where_cuda_is_started(monkeypatch):
    """A CUDA call returns before its kernels finish: every timed call is fenced by a synchronize
    on each side (the warm-up needs none), in timing.samples and bench._alternate alike."""
    import torch

    from harness import bench, timing
    events = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: events.append("sync"))
    assert len(timing.samples(lambda: events.append("call"), 2)) == 2
    assert events == ["call"] + ["sync", "call", "sync"] * 2
    events.clear()
    bench._alternate({"a": lambda: events.append("a"), "b": lambda: events.append("b")}, 1)
    assert events == ["a", "b", "sync", "a", "sync", "sync", "b", "sync"]


def test_codec_widths_are_timed_in_turn(monkeypatch):
    # a burst of load hits every width alike: the repeats of one run alternate between the widths
    # (after a warm-up each) instead of timing one width's repeats back to back
    import torch

    from harness import bench
    from schemes.turboquant import TurboQuant
    widths = []
    real = TurboQuant.encode_tensor

    def recorded(self, *args):
        if args[1] == "k":
            widths.append(self.budget)
        return real(self, *args)
    monkeypatch.setattr(TurboQuant, "encode_tensor", recorded)
    shape = bench.BenchShape(scheme="tq-kv", budget=3, dim=32, seq_len=16, queries=4, trials=2, repeats=3)
    samples: dict = {}
    rates = bench.scheme_throughput(shape, torch.device("cpu"), ["tq-kv"], (2, 4), samples=samples)
    assert widths == [2, 4] * (1 + shape.repeats)
    assert {b: len(t) for b, t in samples["tq-kv"]["torch"].items()} == {2: 3, 4: 3}
    assert rates["tq-kv"]["torch"][4] == 2 * 8 * 16 / min(samples["tq-kv"]["torch"][4])


class _UnderReporting:
    """tq-kv whose bits() claims one bit per cache: what a plug-in may override."""

    @staticmethod
    def factory(**options):
        import schemes
        from schemes.base import BitLedger
        scheme = schemes.create("tq-kv", **options)

        def bits(enc):
            return BitLedger({"codes.claimed": 1}, 2 * enc.shape[1] * enc.shape[2] * enc.shape[3])
        scheme.bits = bits
        return scheme


def test_bench_traffic_is_the_measured_ledger_whatever_bits_claims():
    """The codes' bytes per vector come from the stored tensors (the sweep's ledger): a codec
    whose bits() under-reports gets tq-kv's figure, not its claim."""
    import torch

    from harness import bench
    from schemes.base import BitLedger
    from schemes.registry import SchemeSpec, registered
    shape = bench.BenchShape(scheme="tq-kv", budget=3, dim=32, seq_len=16, queries=4, trials=2, repeats=1)
    traffic: dict = {}
    with registered([SchemeSpec("under-reporter", _UnderReporting.factory, "tq-kv claiming 1 bit")]):
        bench.scheme_throughput(shape, torch.device("cpu"), ["tq-kv", "under-reporter"], (3,), traffic=traffic)
    honest = traffic["tq-kv"]["torch"][3]["code_bytes_per_vector"]
    assert traffic["under-reporter"]["torch"][3]["code_bytes_per_vector"] == honest
    k = torch.randn(8, 1, 16, 32)
    enc = _UnderReporting.factory(budget=3, dim=32).encode(k, k)
    assert honest == float(BitLedger.per_trial(enc).cache.mean()) / 8 / (2 * 16) > 1 / 8 / (2 * 16)
