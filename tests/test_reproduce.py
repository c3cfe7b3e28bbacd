"""harness reproduce amd-paper end to end on the hidden test-sized grid (--size tiny): the runs,
the claims table in results.sqlite, the printed table, `report --json`, --resume, bad input."""
import contextlib
import io
import json
import re
import sqlite3

import numpy as np
import pandas as pd
import pytest

from harness.cli import main
from harness.reproduce import (FIRST_ORDER_TABLE, _encoded_chunks, allocation_config, allocation_rows, experiments,
                               first_order, first_order_rows, jensen_configs, ledger_rows, sizes, storage_config,
                               true_ranks)
from harness.runner import run_sweep
from harness.store import RunStore
from kvcommon.rows import CLAIMS_TABLE
from stats.findings import analyse, to_json
from stats.claims import CLAIM_COLUMNS, VERDICTS


@pytest.fixture(scope="module")
def reproduction(tmp_path_factory):
    return tmp_path_factory.mktemp("reproduce") / "amd"


@pytest.fixture(scope="module")
def first_run(reproduction):
    """The tiny reproduction, run once for the module: (exit status, its stdout)."""
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(["reproduce", "amd-paper", "--size", "tiny", "--out", str(reproduction), "--quiet"])
    return code, stdout.getvalue()


def test_reproduce_stores_and_prints_every_claim(reproduction, first_run):
    code, out = first_run
    assert code == 0
    claims = RunStore(reproduction).table(CLAIMS_TABLE)
    assert list(claims.columns) == list(CLAIM_COLUMNS)
    assert claims.id.tolist() == list(range(1, 14))
    assert set(claims.verdict) <= set(VERDICTS) and claims.reason.str.len().gt(0).all()
    lines = [line for line in out.splitlines() if re.match(r"^[ 1]\d  (reproduced|partly|refuted|inconclusive) ", line)]
    assert [int(line[:2]) for line in lines] == list(range(1, 14))
    assert re.search(r"^verdicts: \d+ reproduced, \d+ partly, \d+ refuted, \d+ inconclusive", out, re.M)
    assert "reduced from the paper" in out
    # the report is written before the claims table is printed, which ends the output
    assert (reproduction / "report.html").stat().st_size > 0 and (reproduction / "report.pdf").stat().st_size > 0
    assert out.index("report -> ") < out.index("claims (alpha")
    con = sqlite3.connect(reproduction / "results.sqlite")
    tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    con.close()
    assert {"trials", "cells", "claims", "claim_tests", "first_order", "storage_ledger", "allocation"} <= tables
    for sub in ("calibration", "null-rng", "null-impl"):
        assert not RunStore(reproduction / sub).trials().empty
    manifest = RunStore(reproduction).read_manifest()
    assert manifest["reproduction"]["size"] == "tiny" and manifest["finished_at"]


def test_report_json_includes_the_claims(reproduction, first_run, capsys):
    assert main(["report", str(reproduction), "--json", "--permutations", "50"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert [c["id"] for c in payload["claims"]] == list(range(1, 14))
    assert {"verdict", "reason", "effect", "estimate", "ci_low", "ci_high", "section", "test"} \
        <= set(payload["claims"][0])


def test_findings_of_a_run_without_claims_have_no_claims_key(reproduction, first_run):
    findings = analyse(RunStore(reproduction).trials(), n_permutations=20)   # analyse alone attaches no claims
    assert findings.claims is None and "claims" not in to_json(findings)


def test_resume_reuses_every_run(reproduction, first_run, capsys):
    before = RunStore(reproduction).table(CLAIMS_TABLE)
    assert main(["reproduce", "amd-paper", "--size", "tiny", "--out", str(reproduction), "--resume", "--quiet"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if " cells (" in line]
    assert len(lines) == len(experiments(sizes()["tiny"])) and all("(0 run," in line for line in lines)
    pd.testing.assert_frame_equal(RunStore(reproduction).table(CLAIMS_TABLE), before)   # the same claims, to the last digit


def test_rerun_without_resume_is_a_usage_error(reproduction, first_run, capsys):
    assert main(["reproduce", "amd-paper", "--size", "tiny", "--out", str(reproduction), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--resume" in err[0]


@pytest.mark.parametrize("args, message", [
    (["reproduce", "nope"], "invalid choice: 'nope'"),
    (["reproduce", "amd-paper", "--size", "huge"], "invalid choice: 'huge'"),
    (["reproduce", "amd-paper", "--quick", "--workers", "0"], "--workers 0"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, capsys, args, message):
    out = tmp_path / "never"
    assert main([*args, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not out.exists()


def test_sizes_quick_is_smaller_than_the_paper_grid_and_cells_are_shared():
    paper, quick = sizes()["paper"], sizes()["quick"]
    assert paper.trials == 200 and paper.dims == (64, 128, 256) and paper.budgets == tuple(range(2, 8))
    assert paper.seq_len == 1024 and len(paper.schemes) == 16
    assert quick.trials < paper.trials and quick.seq_len < paper.seq_len and "30 trials" in quick.reduced
    plan = experiments(quick)
    assert "dimension" in plan and "dimension" not in experiments(paper)   # claim 4 needs two head dims
    ablation = {c.key for c in plan[""].cells()}
    # claim 11's main rows come from the ablation: the null runs repeat cells the ablation has
    for name in ("null-rng", "null-impl"):
        assert {c.key for c in plan[name].cells()} <= ablation
    assert plan["null-rng"].rng == "mt19937" and plan["null-impl"].impl == "reference"


def test_true_ranks_are_the_population_participation_ratios():
    ranks = true_ranks(sizes()["quick"])
    assert ranks == {("gaussian", 64): 64, ("lowrank_aligned", 64): 8}


def test_first_order_v_path_matches_the_runners_stored_metrics(tmp_path):
    """The V-only output error and the V error of the first-order pass (float64, claims 5 and 12)
    against the runner's own t_rel_mse_vonly and rel_mse_v of the same cells (same draws, same codes)."""
    size = sizes()["tiny"]
    config = jensen_configs(size)[1.0]
    mine = first_order_rows(config, 1.0).set_index(["budget", "trial"]).sort_index()
    run_sweep(config, RunStore(tmp_path / "run"), progress=False)
    stored = RunStore(tmp_path / "run").trials().set_index(["budget", "trial"]).sort_index()
    for ours, theirs in (("t_rel_mse_vonly", "t_rel_mse_vonly"), ("v_rel_mse", "rel_mse_v"),
                         ("t_rel_mse_konly", "t_rel_mse_konly"), ("logit_rel_mse", "logit_rel_mse")):
        pd.testing.assert_series_equal(mine[ours], stored[theirs], check_names=False, rtol=1e-4)
    # the score variance: queries are drawn as z/T on the same draws, so it scales as 1/T^2 exactly
    hot = first_order_rows(jensen_configs(size)[0.25], 0.25).set_index(["budget", "trial"]).sort_index()
    np.testing.assert_allclose(hot.score_var / mine.score_var, 16.0, rtol=1e-9)


def test_ledger_rows_are_the_runners_bits_and_the_papers_code_formula(tmp_path):
    """The storage ledger of claim 13 at d = 128, b = 2, 3: everything stored per cache equals the
    runner's own bits_per_element × d of the same cells, and the code bits per token equal §3.2's
    formula with each trial's calibrated d_eff (TQ b·d; SQU b·d_eff + 2·(d − d_eff), K and V averaged)."""
    config = storage_config(sizes()["tiny"])
    mine = ledger_rows(config).set_index(["scheme", "budget", "trial"]).sort_index()
    run_sweep(config, RunStore(tmp_path / "run"), progress=False)
    stored = RunStore(tmp_path / "run").trials().set_index(["scheme", "budget", "trial"]).sort_index()
    np.testing.assert_array_equal(mine.stored_bits_per_token, stored.bits_per_element * 128)
    np.testing.assert_array_equal(mine.d_eff_k.fillna(-1), stored.d_eff_k.fillna(-1))
    b = mine.index.get_level_values("budget").to_numpy()
    squ = mine.index.get_level_values("scheme") == "squ-kv"
    per_tensor = [b * mine[c] + 2 * (128 - mine[c]) for c in ("d_eff_k", "d_eff_v")]
    expected = np.where(squ, (per_tensor[0] + per_tensor[1]) / 2, b * 128)
    np.testing.assert_array_equal(mine.code_bits_per_token, expected)
    assert (mine[squ].d_eff_k == 8).all()   # the rank-8 scenario calibrates the paper's d_eff


def _greedy_widths(variances: np.ndarray, budget: int, tail: int, top: int = 8) -> np.ndarray:
    """Water-filling by marginal analysis, one bit at a time (Fox 1966): start every coordinate at
    `tail` bits and give each of the budget·d − tail·d spare bits to the largest gain λ_k·4^(−b_k)
    (the lowest coordinate on a tie); (d,) variances -> (d,) widths."""
    widths = np.full(len(variances), tail)
    for _ in range((budget - tail) * len(variances)):
        gains = np.where(widths < top, variances * 4.0 ** -widths, -np.inf)
        widths[int(np.argmax(gains))] += 1
    return widths


def test_allocation_rows_are_the_stored_widths_against_uniform():
    """Claim 8's table from sq-kv's stored widths: a second computation, greedy water-filling of the
    stored σ² head by head, gives the same coordinates at b; every coordinate off b moves at least
    one of the b·d bits; isotropic data stays near uniform, a rank-8 spectrum does not."""
    config = allocation_config(sizes()["tiny"])
    assert config.budgets == (3,)   # b = 2 = b_tail is uniform by construction: not stored
    rows = allocation_rows(config).set_index(["scenario", "dim", "trial"]).sort_index()
    for cell, _, trials, _, enc in _encoded_chunks(config):
        for cache in ("k", "v"):
            sigma = enc.codes[f"{cache}.sigma"].double().cpu().numpy()   # (B, H, d)
            at = [np.mean([(_greedy_widths(s ** 2, cell.budget, 2) == cell.budget).sum() for s in heads])
                  for heads in sigma]
            np.testing.assert_array_equal(rows.loc[(cell.scenario, cell.dim), f"at_budget_{cache}"].loc[list(trials)],
                                          at)
    for cache in ("k", "v"):
        off = rows.index.get_level_values("dim") - rows[f"at_budget_{cache}"]
        assert (off <= rows[f"moved_{cache}"] * 2 * 3 * rows.index.get_level_values("dim") + 1e-9).all()
    share = 1 - rows.at_budget_k / rows.index.get_level_values("dim")
    assert share.loc["gaussian"].mean() < 0.1 and share.loc["lowrank_aligned"].mean() > 0.3


def test_resume_recomputes_a_first_order_table_stored_without_the_v_path(tmp_path):
    configs = jensen_configs(sizes()["tiny"])
    store = RunStore(tmp_path / "run")
    full = first_order(configs, store, resume=False)
    store.write_table(FIRST_ORDER_TABLE, full.drop(columns=["t_rel_mse_vonly", "v_rel_mse", "score_var"]))
    again = first_order(configs, store, resume=True)
    pd.testing.assert_frame_equal(again, full)
    pd.testing.assert_frame_equal(store.table(FIRST_ORDER_TABLE), full)
