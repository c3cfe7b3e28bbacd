"""--calib-tokens as a sweep axis: one cell per calibration size on the same K, V and Q draws,
resume, the migration of stores written before it, bad values and the report."""
import json
import sqlite3

import numpy as np
import pandas as pd
import pytest
import torch

from harness import cell as engine
from harness.cli import main
from kvcommon.rows import TRIAL_COLUMNS
from harness.store import RESULTS_FILE, RunStore
from harness.sweep import Cell, SweepConfig
from stats.metrics import METRIC_NAMES

RUN = ["run", "--scenario", "spectral_decay", "--scheme", "sq-kv,tq-kv", "--budget", "3", "--dim", "16",
       "--seq-len", "32", "--queries", "4", "--trials", "4", "--calib-tokens", "16,64", "--quiet"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("calib") / "run"
    assert main([*RUN, "--out", str(out)]) == 0
    return out


def test_one_cell_per_calibration_size_on_the_same_data(run_dir):
    store = RunStore(run_dir)
    assert {(c[1], c[-1]) for c in store.finished_cells()} == {(s, n) for s in ("sq-kv", "tq-kv") for n in (16, 64)}
    manifest = store.read_manifest()
    assert manifest["config"]["calib_tokens"] == [16, 64]
    assert sorted(k.rsplit("/", 1)[1] for k in manifest["peak_mem_mb_per_cell"]) == ["16", "16", "64", "64"]
    frame = store.trials()
    values = list(METRIC_NAMES) + ["bits_per_element"]

    def cell(scheme, n_cal):
        return frame[(frame.scheme == scheme) & (frame.calib_tokens == n_cal)].set_index("trial")[values]
    # tq-kv ignores calibration: the same K, V, Q give the same rows; sq-kv is fitted on the sample
    pd.testing.assert_frame_equal(cell("tq-kv", 16), cell("tq-kv", 64))
    assert not cell("sq-kv", 16)["d2_k"].equals(cell("sq-kv", 64)["d2_k"])
    config = SweepConfig.from_json(manifest["config"])
    small, large = (Cell("spectral_decay", "sq-kv", 3, 16, 32, 4, n) for n in (16, 64))
    assert Cell(*large.key) == large and small.data_key != large.data_key   # as a Dask task rebuilds it
    a, b = (engine.draw_trials(config, c, range(2), torch.device("cpu"), torch.float64) for c in (small, large))
    for name in ("k", "v", "q"):
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0)
    assert a["k_cal"].shape[2] == 16 and b["k_cal"].shape[2] == 64


def test_resume_after_a_finished_run_adds_nothing(run_dir, capsys):
    before = RunStore(run_dir).trials()
    assert main([*RUN, "--out", str(run_dir), "--resume"]) == 0
    assert capsys.readouterr().out.strip().startswith("0 cells run, 4 already stored")
    pd.testing.assert_frame_equal(RunStore(run_dir).trials(), before)


OLD_CELLS = ("CREATE TABLE cells (scenario TEXT NOT NULL, scheme TEXT NOT NULL, budget INTEGER NOT NULL, "
             "dim INTEGER NOT NULL, seq_len INTEGER NOT NULL, queries INTEGER NOT NULL, n_trials INTEGER NOT NULL, "
             "wall_s REAL NOT NULL, finished_at TEXT NOT NULL, peak_mem_mb REAL, "
             "PRIMARY KEY (scenario, scheme, budget, dim, seq_len, queries))")


def test_store_written_before_the_axis_migrates_and_resumes(tmp_path, capsys):
    """A run directory as the previous version wrote it (cells table without calib_tokens,
    trials with calib_tokens after heads, one int calib_tokens in the manifest), interrupted
    after its first cell: --resume migrates it, runs the missing cell and matches a clean run."""
    args = ["run", "--scenario", "gaussian", "--scheme", "tq-kv,plain-kv", "--budget", "2", "--dim", "16",
            "--seq-len", "32", "--queries", "4", "--trials", "3", "--calib-tokens", "24", "--quiet"]
    out = tmp_path / "old"
    assert main([*args, "--out", str(out)]) == 0
    clean = RunStore(out).trials()
    old_trials = [c for c in TRIAL_COLUMNS if c != "calib_tokens"]
    old_trials.insert(old_trials.index("heads") + 1, "calib_tokens")
    with sqlite3.connect(out / RESULTS_FILE) as con:
        con.execute(f"CREATE TABLE trials_old AS SELECT {', '.join(old_trials)} FROM trials WHERE scheme = 'plain-kv'")
        con.execute("CREATE TABLE cells_new AS SELECT * FROM cells WHERE scheme = 'plain-kv'")
        con.execute("DROP TABLE trials")
        con.execute("DROP TABLE cells")
        con.execute("ALTER TABLE trials_old RENAME TO trials")
        con.execute(OLD_CELLS)
        con.execute("INSERT INTO cells SELECT scenario, scheme, budget, dim, seq_len, queries, n_trials, wall_s, "
                    "finished_at, peak_mem_mb FROM cells_new")
        con.execute("DROP TABLE cells_new")
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["config"]["calib_tokens"] = 24
    manifest["peak_mem_mb_per_cell"] = {"gaussian/plain-kv/2/16/32/4": 100.0}
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert SweepConfig.from_json(manifest["config"]).calib_tokens == (24,)

    assert RunStore(out).finished_cells() == {("gaussian", "plain-kv", 2, 16, 32, 4, 24)}
    with sqlite3.connect(out / RESULTS_FILE) as con:
        info = {row[1]: row[5] for row in con.execute("PRAGMA table_info(cells)")}   # column -> position in the key
        assert info["calib_tokens"] == 7 and con.execute("SELECT peak_mem_mb FROM cells").fetchone() is not None
        assert not con.execute("SELECT name FROM sqlite_master WHERE name = 'cells_old'").fetchall()
    capsys.readouterr()
    assert main([*args, "--out", str(out), "--resume"]) == 0
    assert capsys.readouterr().out.strip().startswith("1 cells run, 1 already stored")
    resumed = RunStore(out).trials()
    pd.testing.assert_frame_equal(resumed[clean.columns], clean, check_exact=False, rtol=1e-12)
    assert RunStore(out).cells()[["scheme", "calib_tokens"]].values.tolist() == [["plain-kv", 24], ["tq-kv", 24]]


@pytest.mark.parametrize("value,message", [("16,0", "--calib-tokens 0 must be a positive integer"),
                                           ("8,x", "'8,x' is not a comma-separated list of integers")])
def test_bad_calibration_size_is_one_line_exit_2(tmp_path, capsys, value, message):
    out = tmp_path / "never"
    assert main([*RUN[:-3], "--calib-tokens", value, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()


@pytest.mark.slow
def test_report_separates_calibration_sizes(run_dir, capsys):
    import matplotlib.pyplot as plt

    from reports.figures import d_eff_figure, scheme_styles
    from stats.findings import analyse
    from reports.narrative import CELL_HEADER, WINNER_HEADER, cell_header, setting_summaries, winner_header

    assert main(["report", str(run_dir), "--permutations", "20"]) == 0
    page = (run_dir / "report.html").read_text(encoding="utf-8")
    assert "spectral_decay, d = 16, S = 32, Nq = 4, n_cal = 16." in page
    assert "spectral_decay, d = 16, S = 32, Nq = 4, n_cal = 64." in page
    trials = RunStore(run_dir).trials()
    level = float(trials[trials.scheme == "tq-kv"].bits_per_element.mean())  # a storage level tq-kv stands at
    findings = analyse(trials, n_permutations=20, levels=(level,))
    assert len(findings.settings) == 2 and sorted(findings.winners.calib_tokens) == [16, 64]
    assert cell_header(findings)[:7] == CELL_HEADER[:6] + ("n_cal",)
    assert winner_header(findings)[:5] == WINNER_HEADER[:4] + ("n_cal",)
    single = analyse(trials[trials.calib_tokens == 64], n_permutations=20)     # looks as before
    assert cell_header(single) == CELL_HEADER and winner_header(single) == WINNER_HEADER
    assert [s.label for s in setting_summaries(single)["spectral_decay"]] == ["spectral_decay, d = 16, S = 32, Nq = 4"]

    figure = d_eff_figure(findings, scheme_styles(trials.scheme.unique()))
    try:
        axes = [a for a in figure.figure.axes if a.get_visible()]
        assert [a.get_title() for a in axes] == ["spectral_decay, d = 16, n_cal = 16", "spectral_decay, d = 16, n_cal = 64"]
        assert axes[0].get_ylim() == axes[1].get_ylim()          # one axis per row: d_eff against n_cal
        for ax, n_cal in zip(axes, (16, 64)):
            stored = trials[(trials.scheme == "sq-kv") & (trials.calib_tokens == n_cal)]
            drawn = np.sort(np.concatenate([c.get_offsets()[:, 1] for c in ax.collections]))
            np.testing.assert_array_equal(drawn, np.sort(np.r_[stored.d_eff_k, stored.d_eff_v]))
    finally:
        plt.close(figure.figure)

    capsys.readouterr()
    assert main(["compare", str(run_dir), str(run_dir), "--permutations", "20"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("4 matched cells") and lines[1].startswith("spectral_decay sq-kv 3 16 32 4 n_cal=16:")


def test_calibration_figure_draws_each_scheme_against_n_cal(run_dir):
    """The points drawn are the cells' mean d₂(T) at each calibration size (tq-kv flat: it
    ignores calibration and sees the same draws); a one-size run says why the figure is absent."""
    import matplotlib.pyplot as plt

    from reports.figures import calibration_figure, scheme_styles
    from stats.findings import analyse
    trials = RunStore(run_dir).trials()
    findings = analyse(trials, n_permutations=20)
    styles = scheme_styles(trials.scheme.unique())
    figure = calibration_figure(findings, styles)
    try:
        axes = [a for a in figure.figure.axes if a.get_visible()]
        assert [a.get_title() for a in axes] == ["spectral_decay, d = 16, b = 3: TurboQuant",
                                                 "spectral_decay, d = 16, b = 3: SpectralQuant"]  # one panel per family
        rgba = plt.matplotlib.colors.to_rgba
        drawn = {}
        for name in ("sq-kv", "tq-kv"):
            (line,) = [ln for ax in axes for ln in ax.lines if rgba(ln.get_color()) == rgba(styles[name].colour)
                       and ln.get_marker() == styles[name].marker]           # not the error bars' caps
            expected = [trials[(trials.scheme == name) & (trials.calib_tokens == n)].d2_t.mean() for n in (16, 64)]
            np.testing.assert_allclose(np.asarray(line.get_xdata(), float), [16, 64])
            np.testing.assert_allclose(np.asarray(line.get_ydata(), float), expected, rtol=1e-12)
            drawn[name] = np.asarray(line.get_ydata(), float)
        assert drawn["tq-kv"][0] == pytest.approx(drawn["tq-kv"][1]) and drawn["sq-kv"][0] != drawn["sq-kv"][1]
    finally:
        plt.close(figure.figure)
    single = calibration_figure(analyse(trials[trials.calib_tokens == 64], n_permutations=20), styles)
    assert single.figure is None and "one calibration size (n_cal = 64)" in single.absent_reason
