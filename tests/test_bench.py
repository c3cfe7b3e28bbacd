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
