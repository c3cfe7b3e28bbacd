"""harness bench reports figures and ratios measured in one run (values are not asserted as times)."""
import json

import pytest

from harness.cli import main


def test_bench_json_has_every_figure(capsys):
    code = main(["bench", "--json", "--dim", "16", "--seq-len", "32", "--queries", "4", "--trials", "4",
                 "--repeats", "1", "--schemes", "tq-kv,plain-kv", "--budgets", "2,4", "--reference"])
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
    th = result["threads_comparison"]
    assert th["one_thread_over_all_threads"] > 0 and th["eigh_over_power"] > 0
    assert set(th["samples_s"]["fit"]) == {"eigh", "power"}
    assert len(result["load_average"]["before"]) == 3 and result["cpu_count"] >= 1


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


def test_bench_grid_times_every_cell_and_extrapolates(capsys, monkeypatch):
    """Every cell of the grid is run on n and 2n trials (alternating, twice each, after a warm-up on
    one trial of the first scenario); with cell times a + b·trials the estimate is the grid's
    a + b·12 per cell, summed, plus the warm-up, whatever a slow spell adds to one pass."""
    from harness import bench, sweep
    monkeypatch.setitem(sweep.GRIDS, "tiny", {
        "scenarios": ("gaussian", "lowrank_aligned"), "schemes": ("tq-kv", "sq-kv"), "budgets": (2, 3),
        "dims": (16,), "seq_lens": (32,), "queries": (4,), "trials": 12, "calib_tokens": (32,)})
    real = bench._time_cells
    seen, order = {}, []

    def synthetic(config, device):
        _, cells = real(config, device)                      # the cells really run ...
        seen[config.trials] = set(cells)
        order.append(config.trials)
        # the first pass on each trial count hits a slow spell: every cell 2 s slower
        pause = 2.0 if config.trials > 1 and order.count(config.trials) == 1 else 0.0
        fixed, per_trial = {"tq-kv": 0.5, "sq-kv": 2.0}, {"tq-kv": 0.1, "sq-kv": 0.3}
        timed = {c: (fixed[c.scheme] + per_trial[c.scheme] * config.trials + pause, 1.0) for c in cells}
        return sum(t for t, _ in timed.values()) + 1.0, timed   # ... timed as a + b·trials (+1 s of drawing)
    monkeypatch.setattr(bench, "_time_cells", synthetic)
    assert main(["bench", "--grid", "tiny", "--trials", "3", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert seen[3] == seen[6] and len(seen[3]) == result["cells"] == 2 * 2 * 2
    # the warm-up, then two alternating passes on each trial count, the fastest of each kept
    assert order == [1, 3, 6, 3, 6] and result["repeats"] == 2
    assert result["samples_s"]["3"][0] - result["samples_s"]["3"][1] == pytest.approx(2.0 * 8)
    order.clear()
    # the warm-up: one trial of the first scenario's cells, counted once in the estimate
    assert seen[1] == {c for c in seen[3] if c.scenario == "gaussian"}
    warmup = 2 * (0.5 + 0.1) + 2 * (2.0 + 0.3) + 1.0
    assert abs(result["warmup_s"] - warmup) < 1e-9
    assert result["sample_trials"] == [3, 6] and result["grid_trials"] == 12
    per_cell = {"tq": 0.5 + 0.1 * 12, "sq": 2.0 + 0.3 * 12}
    assert abs(result["estimated_grid_s"] - (4 * per_cell["tq"] + 4 * per_cell["sq"] + 1.0 + warmup)) < 1e-9
    assert result["estimated_s_by_family"] == pytest.approx({k: 4 * v for k, v in per_cell.items()})
    slice_s = 2 * per_cell["tq"] + 2 * per_cell["sq"]      # a scenario at d = 16: 2 schemes x 2 budgets
    assert result["estimated_cell_s_by_scenario_dim"] == pytest.approx({"gaussian/16": slice_s,
                                                                        "lowrank_aligned/16": slice_s})
    assert abs(result["per_trial_s"] - 4 * (0.1 + 0.3)) < 1e-12 and abs(result["fixed_s"] - (4 * 2.5 + 1)) < 1e-9
    assert main(["bench", "--grid", "tiny", "--trials", "3"]) == 0
    assert "estimated at 12 trials" in capsys.readouterr().out


def test_bench_times_a_sweep_serially_and_with_workers_in_one_run(capsys):
    """--workers N: the same 12-cell sweep serial and on N local Dask workers, the ratio, the rows
    compared, and the load average (which sways both times) recorded with them."""
    pytest.importorskip("distributed")
    argv = ["bench", "--dim", "16", "--seq-len", "32", "--queries", "4", "--trials", "4", "--repeats", "1",
            "--schemes", "tq-kv", "--workers", "2"]
    assert main([*argv, "--json"]) == 0
    w = json.loads(capsys.readouterr().out)["workers"]
    assert w["cells"] == 12 and w["workers"] == 2 and w["rows_identical"] is True
    assert w["serial_over_workers"] == pytest.approx(w["serial_s"] / w["workers_s"])
    assert all(len(w["loadavg"][k]) == 3 for k in ("before", "between", "after"))
    assert main(["bench", "--workers", "0"]) == 2
