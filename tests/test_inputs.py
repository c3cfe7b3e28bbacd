"""Inputs that used to break a run late or with a traceback (issue 17): each is refused up front
in one line with exit 2 and nothing written, or handled as the help text says."""
import sqlite3

import pytest

import scenarios
import schemes
from harness.cli import main

TINY = ["run", "--dim", "16", "--seq-len", "16", "--queries", "4", "--trials", "2", "--budget", "2", "--quiet"]


@pytest.mark.parametrize("flags, message", [
    (["--scenario", "gaussian", "--scheme", "tq-kv", "--budget", "2,2"], "2 is given twice"),
    (["--scenario", "gaussian", "--scheme", "tq-kv,tq-kv"], "tq-kv is given twice"),
    (["--scenario", "gaussian,gaussian", "--scheme", "tq-kv"], "gaussian is given twice"),
    (["--scenario", "gaussian", "--scheme", "tq-kv", "--trials", "1"], "--trials 1 must be at least 2"),
    (["--scenario", "gaussian", "--scheme", "all,-nope"], "exclusions -NAME of known names, not '-nope'"),
    (["--scenario", "gaussian", "--scheme", "all,tq-kv"], "'tq-kv' is already part of 'all'"),
    (["--scenario", "gaussian", "--scheme", "all,nope"], "unknown name 'nope' after 'all'"),
    (["--scenario", "gaussian", "--scheme", "all,-" + ",-".join(schemes.registry.all_schemes())], "excludes every name"),
    (["--scenario", "heavy_tail:dof=x", "--scheme", "tq-kv"], "dof='x' is not a float"),
    (["--scenario", "heavy_tail:nope=1", "--scheme", "tq-kv"], "unknown parameter 'nope'; valid: alpha, dof"),
    (["--scenario", "heavy_tail:dof=-1", "--scheme", "tq-kv"], "must be positive"),
    (["--scenario", "gaussian", "--scheme", "tq-kv", "--dim", "12"], "not a power of two"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, flags, message):
    out = tmp_path / "never"
    assert main([*TINY, *flags, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()


def test_all_plus_a_name_outside_all_runs_both(tmp_path):
    """'all,NAME' adds a known name that all leaves out (a kvpress press: asked for by name)."""
    pytest.importorskip("kvpress")
    out = tmp_path / "run"
    assert main([*TINY, "--scenario", "gaussian", "--scheme", "all,-shard,-shard-pca-decode,kvpress:KnormPress",
                 "--seq-len", "32", "--out", str(out)]) == 0
    with sqlite3.connect(out / "results.sqlite") as con:
        stored = {s for (s,) in con.execute("SELECT DISTINCT scheme FROM trials")}
    assert stored == set(schemes.registry.all_schemes()) - {"shard", "shard-pca-decode"} | {"kvpress:KnormPress"}


def test_all_skips_the_codecs_a_dim_excludes_and_says_which(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*TINY, "--scenario", "gaussian", "--scheme", "all,-shard-pca-decode", "--dim", "12",
                 "--out", str(out)]) == 0
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if "skipping" in x]
    with sqlite3.connect(out / "results.sqlite") as con:
        stored = {s for (s,) in con.execute("SELECT DISTINCT scheme FROM trials")}
    skipped = {n for n in ("tq-kv", "tq-qkv", "plain-kv", "shard", "sq-kv") if n in line}
    assert {"tq-kv", "tq-qkv", "shard"} <= skipped and not skipped & stored
    assert "shard-pca-decode" not in stored and "shard-pca-decode" not in line     # excluded, not skipped
    assert stored and "int8" not in line and "not a power of two" in line


def test_scenario_parameters_from_the_name_reach_the_rows(tmp_path):
    """heavy_tail:dof=30 is its own scenario in the rows, with its own draws (not heavy_tail's)."""
    out = tmp_path / "run"
    assert main([*TINY, "--scenario", "heavy_tail,heavy_tail:dof=30", "--scheme", "tq-kv", "--out", str(out)]) == 0
    with sqlite3.connect(out / "results.sqlite") as con:
        rows = dict(con.execute("SELECT scenario, SUM(rel_mse_k) FROM trials GROUP BY scenario"))
    assert set(rows) == {"heavy_tail", "heavy_tail:dof=30"} and rows["heavy_tail"] != rows["heavy_tail:dof=30"]
    assert scenarios.create("heavy_tail:dof=30").dof == 30.0
    assert scenarios.create("lowrank_aligned:rank=4:noise=0.05").rank == 4


def test_dollar_signs_in_names_are_text_not_math(tmp_path):
    """A run directory named with $ (matplotlib math delimiters) still gets its HTML and PDF."""
    out = tmp_path / "price_$5_vs_$10"
    assert main([*TINY, "--scenario", "gaussian", "--scheme", "tq-kv,plain-kv", "--budget", "2,3",
                 "--out", str(out)]) == 0
    assert main(["report", str(out), "--permutations", "20"]) == 0
    assert (out / "report.pdf").stat().st_size > 0 and "price_$5_vs_$10" in (out / "report.html").read_text()
