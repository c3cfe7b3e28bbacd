"""stats/validation.py verdicts on constructed samples and on real small runs through
`harness validate` / `harness compare`; stats/dominance.py against brute force and known
constructions."""
import json

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from harness.cli import main
from harness.store import RunStore
from harness.sweep import SweepConfig, implementation
from harness.runner import run_sweep
from stats.dominance import amplification, crossovers, pareto_front
from stats.metrics import SIX_D
from stats.validation import VERDICTS, compare_runs, same_data, validate_samples

SMALL = ["--scenario", "gaussian", "--budget", "2", "--dim", "16", "--seq-len", "64", "--queries", "8",
         "--trials", "40", "--permutations", "499"]


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Small tensors: on the shared, oversubscribed 2-core machine torch's intra-op thread
    hand-offs cost tens of ms per call; one thread keeps the module fast."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --- constructed samples -------------------------------------------------------------------
def sample(gen, n=60, loc=0.3, sd=0.01, shift=0.0, seed=0, scheme="x"):
    """A trial frame of one cell with six-D columns drawn N(loc + shift, sd)."""
    frame = pd.DataFrame(gen.normal(loc + shift, sd, size=(n, len(SIX_D))), columns=list(SIX_D))
    frame["trial"] = np.arange(n)
    for column, value in dict(scenario="gaussian", scheme=scheme, budget=2, dim=16, seq_len=64, queries=8,
                              calib_tokens=512, seed=seed, rng="pcg64", impl="torch", device="cpu", dtype="float32").items():
        frame[column] = value
    return frame


def test_verdicts_on_constructed_samples():
    gen = np.random.default_rng(0)
    a, a2, a3 = sample(gen, seed=0), sample(gen, seed=1), sample(gen, seed=2)
    # same distribution, tight around its mean: no difference and TOST inside ±10 %
    assert validate_samples(a, a2, [(a, a3)], n_permutations=199).verdict == "equivalent"
    # a 5-sd shift of every coordinate against a null of pure seed noise
    far = sample(gen, shift=0.05, scheme="y")
    result = validate_samples(a, far, [(a, a2)], n_permutations=199)
    assert result.verdict == "codec-difference" and "energy" in result.separated
    # the same shift, but an implementation variable alone produces it too
    assert validate_samples(a, far, [(a, sample(gen, shift=0.05, seed=5))], n_permutations=199).verdict == \
        "implementation-variance"
    # a detected difference with no null cannot be attributed
    assert validate_samples(a, far, [], n_permutations=199).verdict == "inconclusive"
    # noisy and small: nothing detected, but equivalence within 10 % cannot be shown either
    noisy = validate_samples(sample(gen, n=8, sd=0.3), sample(gen, n=8, sd=0.3, seed=1),
                             [(sample(gen, n=8, sd=0.3), sample(gen, n=8, sd=0.3, seed=2))], n_permutations=199)
    assert noisy.verdict == "inconclusive"
    payload = json.loads(json.dumps(result.to_json(), default=float))
    assert payload["verdict"] in VERDICTS and set(payload["ks"]) == set(SIX_D)
    assert {"statistic", "p_value"} <= set(payload["energy"]) and payload["energy"]["squared"] is True


def test_same_data_detection_and_paired_equivalence():
    gen = np.random.default_rng(1)
    a = sample(gen, sd=0.2)
    # the same draws seen by a second implementation with a tiny per-trial perturbation:
    # Welch's TOST on sd 0.2 / n 60 cannot show ±10 %, the paired one can
    b = a.copy()
    b[list(SIX_D)] += gen.normal(0, 1e-3, size=(len(a), len(SIX_D)))
    b["impl"] = "reference"
    assert same_data(a, b) and not same_data(a, sample(gen, seed=1))
    result = validate_samples(a, b.sample(frac=1, random_state=0), [(a, sample(gen, sd=0.2, seed=1))],
                              n_permutations=199)
    assert result.verdict == "equivalent" and all(e["paired"] for e in result.equivalence)


def test_compare_runs_matches_cells():
    gen = np.random.default_rng(2)
    run_a = pd.concat([sample(gen, scheme="x"), sample(gen, scheme="y")])
    run_b = pd.concat([sample(gen, scheme="x", seed=1), sample(gen, scheme="y", seed=1, shift=0.05),
                       sample(gen, scheme="z", seed=1)])
    null = pd.concat([sample(gen, scheme="x", seed=2), sample(gen, scheme="y", seed=2)])
    table = compare_runs(run_a, run_b, null, n_permutations=199)
    assert list(table["scheme"]) == ["x", "y"]  # z is only in run_b
    assert list(table["verdict"]) == ["equivalent", "codec-difference"]
    assert (table["n_null"] == 1).all() and {f"ks_p_{m}" for m in SIX_D} <= set(table.columns)
    with pytest.raises(ValueError, match="lacks"):
        compare_runs(run_a.drop(columns=["snr_err_t"]), run_b)


# --- real small runs through the CLI ------------------------------------------------------
def validate_json(capsys, *args):
    code = main(["validate", *SMALL, *args, "--json"])
    out = capsys.readouterr().out
    assert code == 0
    return json.loads(out)


def check_payload(payload):
    assert payload["verdict"] in VERDICTS
    assert set(payload["ks"]) == set(SIX_D) and all(0 <= p <= 1 for p in payload["ks"].values())
    assert payload["energy"]["statistic"] >= 0 and 0 < payload["energy"]["p_value"] <= 1


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("validate")


@pytest.mark.parametrize("against", ["tq-fkfv", "tq-kqv"])
def test_validate_codec_difference(runs, capsys, against):
    payload = validate_json(capsys, "--scheme", "tq-kv", "--against", against, "--out", str(runs / f"kv-{against}"))
    check_payload(payload)
    # FULL dense sketches on K and V at 2 bits are far worse than the RHT codec, and a QJL bit
    # on V costs V one MSE bit (AMD paper): both separate beyond the seed null
    assert payload["verdict"] == "codec-difference"
    assert len(payload["null"]) == 2 and payload["against"] == against


@pytest.mark.parametrize("vary", ["seed", "rng", "dtype"])
def test_validate_implementation_variables_are_not_codec_differences(runs, capsys, vary):
    payload = validate_json(capsys, "--scheme", "tq-kv", "--vary", vary, "--out", str(runs / f"kv-{vary}"))
    check_payload(payload)
    assert payload["verdict"] != "codec-difference"
    if vary == "dtype":
        # float32 vs float64 on the same draws: the paired TOST shows equivalence
        assert payload["verdict"] == "equivalent"


def test_validate_against_reference_implementation(runs, capsys):
    try:
        implementation("reference")("tq-kv", budget=2, dim=16, rng="pcg64", seed=0)
    except (ValueError, KeyError, ImportError) as exc:
        pytest.skip(f"no reference implementation of tq-kv here: {exc}")
    payload = validate_json(capsys, "--scheme", "tq-kv", "--vary", "impl", "--out", str(runs / "kv-impl"))
    check_payload(payload)
    assert payload["verdict"] != "codec-difference"


def test_validate_usage_errors(capsys):
    if not torch.cuda.is_available():
        assert main(["validate", *SMALL, "--scheme", "tq-kv", "--vary", "device"]) == 2
        err = capsys.readouterr().err.strip()
        assert "second device" in err and len(err.splitlines()) == 1
    assert main(["validate", *SMALL, "--scheme", "nope"]) == 2
    assert "available:" in capsys.readouterr().err
    assert main(["validate", *SMALL, "--scheme", "tq-kv", "--against", "tq-kv"]) == 2


def test_compare_two_stored_runs(runs, capsys):
    if not (runs / "kv-seed" / "base").exists():
        validate_json(capsys, "--scheme", "tq-kv", "--vary", "seed", "--out", str(runs / "kv-seed"))
    base, variant, null = (str(runs / "kv-seed" / d) for d in ("base", "variant", "null"))
    assert main(["compare", base, variant, "--null", null, "--permutations", "199", "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert len(records) == 1 and records[0]["scheme"] == "tq-kv"
    assert records[0]["verdict"] in VERDICTS and records[0]["verdict"] != "codec-difference"
    assert main(["compare", base, variant, "--permutations", "199"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "runs differ in: seed" in lines[0] and lines[1].startswith("gaussian tq-kv 2 16 64 8:")
    assert main(["compare", base, str(runs / "missing")]) == 2


# --- dominance --------------------------------------------------------------------------
def group_frame(gen, points, n=50, sd=1e-3):
    """Trials of one group: points maps (scheme, budget) -> (bits, mean d2_t)."""
    rows = []
    for (scheme, budget), (bits, err) in points.items():
        for t, e in enumerate(gen.normal(err, sd, size=n)):
            rows.append(dict(scenario="gaussian", dim=16, seq_len=64, queries=8, calib_tokens=512, scheme=scheme,
                             budget=budget, trial=t, bits_per_element=bits, d2_t=e))
    return pd.DataFrame(rows)


def test_pareto_front_known_construction():
    points = {("s1", 2): (2.5, 0.30), ("s1", 3): (3.5, 0.10), ("s2", 2): (3.0, 0.35), ("s2", 3): (4.0, 0.05)}
    front = pareto_front(group_frame(np.random.default_rng(3), points), n_boot=200)
    got = front.set_index(["scheme", "budget"])
    assert got["non_dominated"].to_dict() == {("s1", 2): True, ("s1", 3): True, ("s2", 2): False, ("s2", 3): True}
    assert (got.loc[got["non_dominated"], "p_non_dominated"] == 1).all()
    assert got.at[("s2", 2), "p_non_dominated"] == 0
    assert (got["low"] <= got["mean"]).all() and (got["mean"] <= got["high"]).all()


@given(st.lists(st.tuples(st.integers(1, 6), st.floats(0, 1)), min_size=1, max_size=7))
def test_pareto_front_matches_brute_force(pairs):
    points = {(f"s{i}", 2): (float(b), e) for i, (b, e) in enumerate(pairs)}
    front = pareto_front(group_frame(np.random.default_rng(0), points, n=3, sd=0.0), n_boot=10)
    for row in front.itertuples():
        dominated = any(b <= row.bits_per_element and e <= row.mean and (b < row.bits_per_element or e < row.mean)
                        for (b, e) in ((front.bits_per_element[j], front["mean"][j]) for j in range(len(front))))
        assert row.non_dominated == (not dominated)


def test_crossover_known_construction():
    points = {("a", 2): (2, 0.20), ("a", 3): (3, 0.10), ("a", 4): (4, 0.05),
              ("b", 2): (2, 0.25), ("b", 3): (3, 0.08), ("b", 4): (4, 0.03)}
    table = crossovers(group_frame(np.random.default_rng(4), points), n_boot=200)
    assert len(table) == 1
    row = table.iloc[0]
    # Δ = a − b: −0.05 at budget 2, +0.02 at 3 -> zero at 2 + 0.05/0.07
    assert (row.budget_low, row.budget_high, row.better_below) == (2, 3, "a") and bool(row.confident)
    assert row.budget_cross == pytest.approx(2 + 0.05 / 0.07, abs=0.01)


def test_amplification_qjl_on_k_is_unbiased_but_amplified(tmp_path):
    # AMD paper: QJL on K gives unbiased logits (slope ≈ 1) but more logit variance, and softmax's
    # convexity turns that into a larger K share of the attention-output error than plain TQ
    config = SweepConfig(scenarios=("gaussian",), schemes=("tq-kv", "tq-qkv"), budgets=(2,), dims=(16,),
                         seq_lens=(64,), queries=(8,), trials=40, device="cpu")
    store = RunStore(tmp_path / "amp")
    run_sweep(config, store, progress=False)
    table = amplification(store.trials()).set_index("scheme")
    assert abs(table.at["tq-qkv", "logit_slope_mean"] - 1) < 0.05 < 1 - table.at["tq-kv", "logit_slope_mean"]
    assert table.at["tq-qkv", "logit_rel_mse_mean"] > table.at["tq-kv", "logit_rel_mse_mean"]
    assert table.at["tq-qkv", "k_share"] > table.at["tq-kv", "k_share"]
    assert (table["n_trials"] == 40).all()
