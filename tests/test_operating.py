"""The operating-characteristics study on resampled real rows (stats/operating.py) and the
stored rows it reads (tests/data/operating_rows.npz, harness/operating_rows.py)."""
import numpy as np
import pytest
import torch
from scipy import stats

from kvcommon.rows import SIX_D
from stats.operating import (EFFECTS, HARMLESS, NULL_OF, ROWS, T_ONLY, Pair, inject, load_pairs, resample, samples,
                             study, table_markdown, trials_for_power)
from stats.validation import VERDICTS


@pytest.fixture(scope="module")
def pairs():
    return load_pairs()




# --- the stored rows ------------------------------------------------------------------------
def test_stored_rows_hold_every_harmless_change_and_its_null(pairs):
    assert ROWS.stat().st_size < 600_000
    by_change = {c: [p for p in pairs if p.change == c] for c in HARMLESS}
    # six codecs x b = 2, 3; the reference implementation has tq-kv and sq-kv only
    assert {c: len(v) for c, v in by_change.items()} == {"seed": 12, "rng": 12, "dtype": 12, "impl": 4, "threads": 12}
    # like for like: a change that keeps the data has a paired null, one that draws other data an unpaired one
    assert {c: {(p.y_paired, p.z_paired) for p in v} for c, v in by_change.items()} == {
        "seed": {(False, False)}, "rng": {(False, False)}, "dtype": {(True, True)}, "impl": {(True, True)},
        "threads": {(True, True)}}
    for p in pairs:
        assert p.x.shape == p.y.shape == p.z.shape == (400, len(SIX_D))
        assert np.isfinite(p.x).all() and np.isfinite(p.y).all() and np.isfinite(p.z).all()
    # one base run in every pair of a cell; the seed change's rows are the rng change's null
    base = {(p.codec, p.budget): p for p in by_change["seed"]}
    assert all(np.array_equal(p.x, base[p.codec, p.budget].x) for p in pairs)
    assert all(np.array_equal(p.z, base[p.codec, p.budget].y) for p in by_change["rng"])
    assert not any(np.array_equal(p.z, p.y) for p in by_change["seed"])  # seed 2, not seed 1
    # rows do not depend on the torch thread count (harness/distributed.py): a zero difference
    assert all(np.array_equal(p.x, p.y) for p in by_change["threads"])
    # float64 changes the rows, by little: the mean paired difference is far below the between-trial
    # spread, and so is nearly every trial's (shard's float64 k-means on V ends elsewhere in 34 of 400)
    for p in by_change["dtype"]:
        sd = p.x.std(axis=0)
        assert (np.abs((p.y - p.x).mean(axis=0)) <= 1e-2 * sd).all()
        assert (np.abs(p.y - p.x) > 1e-2 * sd).any(axis=1).sum() <= 40
    # the codec's own seed moves tq-kv's rows (its rotation) in every trial; the others here draw
    # nothing from it (sq-kv and shard calibrate on the data), so their paired null is no change at all
    moved = {p.codec: (p.z != p.x).any(axis=1).sum() for p in by_change["dtype"] if not np.array_equal(p.z, p.x)}
    assert moved == {"tq-kv": 400}


# --- resampling and injection ---------------------------------------------------------------
@pytest.mark.parametrize("y_paired, z_paired", [(True, True), (False, False), (True, False)])
def test_resample_keeps_pairing(y_paired, z_paired):
    gen = np.random.default_rng(1)
    i, j, k = resample(gen, 400, 200, y_paired, z_paired)
    assert all(len(idx) == 200 and len(set(idx.tolist())) == 200 and idx.max() < 400 for idx in (i, j, k))
    assert np.array_equal(i, j) == y_paired and np.array_equal(i, k) == z_paired
    rows = np.arange(400 * len(SIX_D), dtype=float).reshape(400, len(SIX_D))
    pair = Pair("dtype" if y_paired else "seed", "tq-kv", 2, rows, rows + 0.5, rows + 0.25, y_paired, z_paired)
    x, y, z = samples(pair, (i, j, k))
    assert (x.key == y.key) == y_paired and (x.key == z.key) == z_paired
    assert np.array_equal(x.values, rows[i]) and np.array_equal(y.values, rows[j] + 0.5)
    assert np.array_equal(z.values, rows[k] + 0.25)
    if y_paired:  # the same trial on both sides of a pair
        assert np.array_equal(y.values - x.values, np.full_like(x.values, 0.5))
    injected = samples(pair, (i, j, k), rows * 2)
    assert np.array_equal(injected[1].values, 2 * rows[j]) and np.array_equal(injected[2].values, z.values)
    with pytest.raises(ValueError, match="must lie in 1..400"):
        resample(gen, 400, 401, y_paired, z_paired)


def test_subsamples_without_replacement_keep_a_tests_level_where_a_bootstrap_does_not():
    """Module doc: each repetition is a fresh experiment. Welch's test of two 200-trial
    subsamples of two 400-trial pools of one distribution rejects at its level α = 5 %; drawn
    with replacement it sees the pools' own difference as well (about 11 %)."""
    gen = np.random.default_rng(7)
    n_pools, n = 4000, 200
    x, y = gen.standard_normal((2, n_pools, 2 * n))
    rows = np.arange(n_pools)[:, None]
    sub = stats.ttest_ind(x[rows, gen.permuted(np.tile(np.arange(2 * n), (n_pools, 1)), axis=1)[:, :n]],
                          y[rows, gen.permuted(np.tile(np.arange(2 * n), (n_pools, 1)), axis=1)[:, :n]],
                          axis=1, equal_var=False).pvalue
    boot = stats.ttest_ind(x[rows, gen.integers(2 * n, size=(n_pools, n))], y[rows, gen.integers(2 * n, size=(n_pools, n))],
                           axis=1, equal_var=False).pvalue
    level = (sub <= 0.05).mean()
    assert stats.binomtest(int((sub <= 0.05).sum()), n_pools, 0.05).pvalue > 0.001, level
    assert (boot <= 0.05).mean() > 0.08


def test_a_shift_of_one_sd_moves_each_mean_by_its_sd(pairs):
    for p in pairs[:12]:
        out = inject(p.y, "shift 1 sd")
        np.testing.assert_allclose(out.mean(axis=0) - p.y.mean(axis=0), p.y.std(axis=0), rtol=1e-9)
        np.testing.assert_allclose(out.std(axis=0), p.y.std(axis=0), rtol=1e-9)


@pytest.mark.parametrize("effect", [e for e in EFFECTS if EFFECTS[e][0] == "shift"])
def test_an_injected_shift_moves_the_mean_by_its_fraction_and_keeps_the_spread(pairs, effect):
    _, delta, columns = EFFECTS[effect]
    for p in pairs[:12]:
        out = inject(p.y, effect)
        moved = out.mean(axis=0) - p.y.mean(axis=0)
        expected = np.zeros(len(SIX_D))
        chosen = list(range(len(SIX_D))) if columns is None else list(columns)
        expected[chosen] = delta * p.y.mean(axis=0)[chosen]
        np.testing.assert_allclose(moved, expected, rtol=1e-9, atol=1e-12 * np.abs(p.y).max())
        np.testing.assert_allclose(out.std(axis=0), p.y.std(axis=0), rtol=1e-9)
        assert np.array_equal(out[:, [j for j in range(len(SIX_D)) if j not in chosen]],
                              p.y[:, [j for j in range(len(SIX_D)) if j not in chosen]])
    assert T_ONLY == (SIX_D.index("snr_err_t"), SIX_D.index("dir_err_t"))


def test_an_injected_spread_change_keeps_the_mean_and_scales_the_sd(pairs):
    _, factor, _ = EFFECTS["spread x1.5"]
    for p in pairs[:12]:
        out = inject(p.y, "spread x1.5")
        np.testing.assert_allclose(out.mean(axis=0), p.y.mean(axis=0), rtol=1e-9)
        np.testing.assert_allclose(out.std(axis=0, ddof=1) / p.y.std(axis=0, ddof=1), factor, rtol=1e-9)
        # the trials keep their order: the injected rows are a monotone map of the originals
        assert (np.argsort(out, axis=0, kind="stable") == np.argsort(p.y, axis=0, kind="stable")).all()


# --- the study and its table ----------------------------------------------------------------
def test_trials_for_power_is_the_smallest_n_reaching_80_percent():
    power = [{"effect": "e", "change": "seed", "n": n, "repetitions": 10, "codec_difference": k}
             for n, k in ((30, 5), (60, 8), (100, 7), (200, 10))]
    power += [{"effect": "e", "change": "dtype", "n": n, "repetitions": 10, "codec_difference": 7} for n in (30, 200)]
    assert trials_for_power(power) == [
        {"effect": "e", "change": "seed", "n": 60, "largest_n": 200, "rate_at_largest_n": 1.0},
        {"effect": "e", "change": "dtype", "n": None, "largest_n": 200, "rate_at_largest_n": 0.7}]


def test_a_tiny_study_runs_and_its_table_has_every_verdict(pairs, one_torch_thread):
    payload = study(pairs, ns=(30,), repetitions=2, effects=("shift 5 %", "spread x1.5"), changes=("seed", "dtype"),
                    n_permutations=19)
    assert [(r["change"], r["design"], r["null"], r["n"]) for r in payload["null"]] == [
        ("seed", "unpaired", "seed2", 30), ("dtype", "paired", "scheme_seed", 30)]
    assert NULL_OF["seed"] == "seed2"
    assert all(sum(r["counts"].values()) == 2 and set(r["counts"]) <= set(payload["verdicts"]) for r in payload["null"])
    # repetition r uses cell r mod 12: the first two cells, tq-kv at b = 2 and 3
    assert [(c["codec"], c["budget"]) for c in payload["null"][0]["cells"]] == [("tq-kv", 2), ("tq-kv", 3)]
    lines = table_markdown(payload).splitlines()
    assert lines[0] == "| harmless change | design | n | " + " | ".join(VERDICTS) + " |"
    row = payload["null"][1]
    assert lines[3] == "| dtype | paired | 30 | " + " | ".join(
        f"{100 * row['counts'].get(v, 0) / 2:.0f}" for v in VERDICTS) + " |"
    assert lines[5] == "| injected effect | seed | dtype |" and len(lines) == 5 + 2 + 2
    needed = {(r["effect"], r["change"]): r for r in payload["trials_for_power"]}
    cell = lines[7].split(" | ")[1]
    assert lines[7].startswith("| shift 5 % |")
    assert cell == ("30" if needed["shift 5 %", "seed"]["n"] == 30
                    else f"> 30 ({100 * needed['shift 5 %', 'seed']['rate_at_largest_n']:.0f} %)")


@pytest.mark.slow
def test_on_real_rows_a_seed_change_is_rarely_a_codec_difference_and_a_5_percent_shift_is_found(pairs,
                                                                                                one_torch_thread):
    """24 repetitions (two per codec and budget) of the seed change at n = 60 (about 10 s).
    Holm keeps the main family's false rejections at α = 5 %, so codec-differences are at most
    the 99 % binomial quantile of 24 at 5 %. A 5 % shift of every mean is 1.2 to 2 between-trial
    standard deviations of some metric in eight of the twelve cells (tq-kv, int4, kivi, h2o:
    their K or V spread is 2.5 to 4 % of the mean), which 60 trials a side find nearly always:
    at least 14 of those cells' 16 repetitions, whatever the other four cells give."""
    payload = study(pairs, ns=(60,), repetitions=24, effects=("shift 5 %",), changes=("seed",), n_permutations=99)
    [null] = payload["null"]
    assert null["counts"].get("codec-difference", 0) <= stats.binom.ppf(0.99, 24, 0.05), null["counts"]
    [power] = payload["power"]
    assert power["codec_difference"] >= 14, power


@pytest.mark.parametrize("argv, message", [
    (["--ns", "30,x"], "--ns '30,x' must be comma-separated integers"),
    (["--ns", "30,401"], "--ns 30,401: every n must lie in 3..400"),
    (["--repetitions", "0"], "--repetitions 0 must be at least 1"),
    (["--rows", "missing.npz"], "--rows missing.npz does not exist"),
])
def test_bad_options_are_one_line_usage_errors_that_write_nothing(tmp_path, capsys, argv, message):
    from stats.operating import main
    out = tmp_path / "operating.json"
    assert main(argv + ["--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"python -m stats.operating: {message}") and err.count("\n") == 1
    assert not out.exists()


def test_main_writes_the_json_with_its_command_and_machine_and_prints_its_table(tmp_path, capsys):
    import json

    from stats.operating import main
    before = torch.get_num_threads()
    out = tmp_path / "operating.json"
    try:
        assert main(["--repetitions", "1", "--ns", "30", "--permutations", "19", "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(before)
    payload = json.loads(out.read_text())
    assert payload["command"] == f"python -m stats.operating --repetitions 1 --ns 30 --permutations 19 --json {out}"
    assert payload["repetitions"] == 1 and payload["permutations"] == 19 and payload["ns"] == [30]
    assert payload["rows"] == "tests/data/operating_rows.npz" and len(payload["git_sha"]) == 40
    assert payload["machine"]["cores"] >= 1 and "load average" in payload["machine"]["uptime"]
    assert [r["change"] for r in payload["null"]] == list(HARMLESS)
    assert capsys.readouterr().out.endswith(table_markdown(payload) + "\n")


def test_the_study_counts_per_cell_add_up(pairs, one_torch_thread):
    payload = study(pairs, ns=(30,), repetitions=14, effects=("shift 5 %",), changes=("seed",), n_permutations=19)
    [null], [power] = payload["null"], payload["power"]
    # 14 repetitions over 12 cells: tq-kv gets two at each budget, the others one
    assert {(c["codec"], c["budget"]): sum(c["counts"].values()) for c in null["cells"]} == {
        (c, b): 2 if c == "tq-kv" else 1 for c in ("tq-kv", "sq-kv", "int4", "kivi", "shard", "h2o") for b in (2, 3)}
    assert sum(c["codec_difference"] for c in power["cells"]) == power["codec_difference"]
    assert all(c["repetitions"] == (2 if c["codec"] == "tq-kv" else 1) for c in power["cells"])
