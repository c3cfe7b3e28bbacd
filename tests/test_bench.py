"""harness bench reports figures and ratios measured in one run (values are not asserted as times)."""
import json

from harness.cli import main


def test_bench_json_has_every_figure(capsys):
    code = main(["bench", "--json", "--dim", "16", "--seq-len", "32", "--queries", "4", "--trials", "4",
                 "--repeats", "1", "--schemes", "tq-kv,plain-kv", "--budgets", "2,4", "--reference"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    r = result["runner"]
    assert r["batched_trials_per_s"] > 0 and r["loop_trials_per_s"] > 0
    assert abs(r["batched_over_loop"] - r["batched_trials_per_s"] / r["loop_trials_per_s"]) < 1e-9 * r["batched_over_loop"]
    table = result["schemes_vectors_per_s"]
    assert set(table) == {"tq-kv", "plain-kv"}
    assert set(table["tq-kv"]) == {"torch", "reference"} and set(table["tq-kv"]["torch"]) == {"2", "4"}
    assert all(rate > 0 for by_impl in table.values() for by_b in by_impl.values() for rate in by_b.values())
    assert 0 < result["attention"]["attention_fraction_of_matmul"]


def test_bench_bad_input(capsys):
    assert main(["bench", "--trials", "0"]) == 2
    assert main(["bench", "--scheme", "nope"]) == 2
    assert "unknown scheme 'nope'" in capsys.readouterr().err


def test_bench_grid_times_every_cell_and_extrapolates(capsys, monkeypatch):
    from harness import sweep
    monkeypatch.setitem(sweep.GRIDS, "tiny", {
        "scenarios": ("gaussian", "lowrank_aligned"), "schemes": ("tq-kv", "sq-kv"), "budgets": (2, 3),
        "dims": (16,), "seq_lens": (32,), "queries": (4,), "trials": 12, "calib_tokens": (32,)})
    assert main(["bench", "--grid", "tiny", "--trials", "3", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["cells"] == 2 * 2 * 2 and result["sample_trials"] == [3, 6] and result["grid_trials"] == 12
    (t1, t2), estimate = result["measured_s"], result["estimated_grid_s"]
    # the line through (3, t1) and (6, t2), at 12 trials
    assert abs(estimate - (t1 + (t2 - t1) * 3)) < 1e-9 * max(abs(estimate), 1)
    assert abs(result["fixed_s"] + result["per_trial_s"] * 3 - t1) < 1e-9 * max(t1, 1)
    assert abs(sum(result["estimated_s_by_family"].values()) - sum(result["estimated_s_by_dim"].values())) < 1e-6
    assert set(result["estimated_s_by_family"]) == {"tq", "sq"} and result["peak_mem_mb_max"] >= 0
    assert main(["bench", "--grid", "tiny", "--trials", "3"]) == 0
    assert "estimated at 12 trials" in capsys.readouterr().out
