"""The decode phase (harness run --decode-tokens N): drifted tokens after the prefill, compressed
as they arrive; metrics and bits on the whole S+N cache; the prefill data do not depend on N."""
import json

import numpy as np
import pandas as pd
import pytest
import torch

import scenarios
import schemes
from harness import cell as engine, runner
from harness.cli import main
from harness.store import RunStore
from harness.sweep import Cell, SweepConfig
from schemes.base import BitLedger
from kvcommon.rng import generator
from kvcommon.rope import undo_rope
from stats.metrics import METRIC_NAMES, exact_logits, trial_metrics

ROPE = ["--scenario", "rope_lowrank", "--budget", "4", "--heads", "2", "--dim", "32", "--seq-len", "256",
        "--queries", "4", "--trials", "3", "--quiet"]


def _config(**overrides) -> SweepConfig:
    base = dict(scenarios=("rope_lowrank",), schemes=("tq-kv",), budgets=(4,), dims=(16,), seq_lens=(96,),
                queries=(4,), trials=2, heads=2, calib_tokens=(16,), device="cpu")
    return SweepConfig(**{**base, **overrides})


def _draw(config: SweepConfig, trials=range(2)):
    s = config.seq_lens[0]
    cell = Cell(config.scenarios[0], config.schemes[0], config.budgets[0], config.dims[0], s, config.queries[0],
                config.calib_tokens[0])
    return engine.draw_trials(config, cell, trials, torch.device("cpu"), torch.float64)


def test_cli_run_shard_decode_path_has_no_drift_but_pca_decode_does(tmp_path):
    out = tmp_path / "run"
    assert main(["run", *ROPE, "--scheme", "shard,shard-pca-decode,tq-kv", "--decode-tokens", "32",
                 "--out", str(out)]) == 0
    frame = RunStore(out).trials()
    assert len(frame) == 3 * 3 and frame[[*METRIC_NAMES, "bits_per_element"]].notna().all().all()
    assert json.loads((out / "manifest.json").read_text())["config"]["decode_tokens"] == 32
    k_err = frame.groupby("scheme")["rel_mse_k"].mean()
    # measured (3 trials): shard 0.0083, shard-pca-decode 0.045, tq-kv 0.0087 over the S+N = 288
    # tokens. The 32 drifted keys are half outside the prefill's rank-r subspace, which the PCA
    # basis cannot represent; shard codes them with the data-independent quantiser.
    assert k_err["shard-pca-decode"] > 3 * k_err["shard"]
    assert (frame[frame.scheme == "shard-pca-decode"]["rel_mse_k"].values
            > frame[frame.scheme == "shard"]["rel_mse_k"].values).all()      # paired, trial by trial


def test_pca_decode_gap_is_the_drift():
    """Without drift the prefill basis fits the decode tokens: the gap to shard (nearly) closes."""
    gaps = {}
    for drift in (0.0, 1.0):
        config = _config(schemes=("shard",), dims=(16,), seq_lens=(160,), trials=1, decode_tokens=32,
                         scenario_params={"rope_lowrank": {"drift": drift}})
        data = _draw(config, range(1))
        errors = {}
        for name in ("shard", "shard-pca-decode"):
            scheme = schemes.create(name, budget=4, dim=16, rank=32, n_iter=4, kmeans_iter=3, vq_centroids=16)
            metrics, _ = engine.run_cell_chunk(scheme, {k: v.float() if v.is_floating_point() else v
                                                        for k, v in data.items()})
            errors[name] = metrics["rel_mse_k"][0]
        gaps[drift] = errors["shard-pca-decode"] / errors["shard"]
    assert gaps[0.0] < 1.5 and gaps[1.0] > 5          # measured: 1.16 and 19.9


def test_no_decode_tokens_gives_the_rows_of_a_run_without_the_flag(tmp_path):
    small = ["--scenario", "gaussian,lowrank_aligned", "--scheme", "tq-kv,squ-kv", "--budget", "3", "--dim", "16",
             "--seq-len", "32", "--queries", "4", "--trials", "3", "--quiet"]
    assert main(["run", *small, "--out", str(tmp_path / "plain")]) == 0
    assert main(["run", *small, "--decode-tokens", "0", "--out", str(tmp_path / "zero")]) == 0
    pd.testing.assert_frame_equal(RunStore(tmp_path / "plain").trials(), RunStore(tmp_path / "zero").trials(),
                                  check_exact=True)
    # and the prefill data are those of the streams the runner documents (labels without N)
    config = _config(scenarios=("lowrank_aligned",), dims=(16,), seq_lens=(32,), heads=1)
    data = _draw(config, range(1))
    scenario = scenarios.create("lowrank_aligned")
    direct = scenario.draw(lambda *l: generator("pcg64", 0, "data", "lowrank_aligned", 16, 32, 4, 1, 0, *l),
                           scenarios.TrialShape(1, 32, 4, 16, 16))
    assert np.array_equal(data["k"][0].numpy(), direct["k"]) and np.array_equal(data["q"][0].numpy(), direct["q"])


def test_old_manifest_without_decode_tokens_resumes_and_config_round_trips(tmp_path):
    config = _config(decode_tokens=8)
    assert SweepConfig.from_json(json.loads(json.dumps(config.to_json()))) == config
    legacy = {k: v for k, v in _config().to_json().items() if k != "decode_tokens"}
    assert SweepConfig.from_json(legacy) == _config()
    store = RunStore(tmp_path / "old")
    runner.run_sweep(_config(trials=1), store, progress=False)
    manifest = store.read_manifest()
    del manifest["config"]["decode_tokens"]                     # as written before the decode phase
    store.write_manifest(manifest)
    assert runner.run_sweep(_config(trials=1), store, resume=True, progress=False).n_cells_skipped == 1
    with pytest.raises(runner.RunConflict, match="differs in: decode_tokens"):
        runner.run_sweep(_config(trials=1, decode_tokens=4), store, resume=True, progress=False)


@pytest.mark.parametrize("scenario", ["rope_lowrank", "lowrank_aligned", "heavy_tail"])
def test_prefill_data_do_not_depend_on_decode_tokens(scenario):
    base = _draw(_config(scenarios=(scenario,)))
    with_decode = _draw(_config(scenarios=(scenario,), decode_tokens=8))
    fewer = _draw(_config(scenarios=(scenario,), decode_tokens=3))
    for name in ("k", "v", "q", "k_cal", "v_cal", "positions"):
        assert torch.equal(base[name], with_decode[name]), name
    assert "k_decode" not in base
    assert with_decode["k_decode"].shape == with_decode["v_decode"].shape == (2, 2, 8, 16)
    assert torch.equal(with_decode["positions_decode"], torch.arange(96, 104))
    # a token's value depends on its index only: the first 3 of 8 are the 3 of a shorter phase
    # (rope_lowrank's RoPE at S..S+2 is the same rotation either way)
    assert torch.allclose(fewer["k_decode"], with_decode["k_decode"][:, :, :3], rtol=0, atol=1e-12)
    assert not torch.allclose(with_decode["k_decode"][:, :, :3], base["k"][:, :, -3:])


def test_population_drift_covariance_matches_the_mixture():
    """Decode tokens of a Population scenario: covariance (1−δ)·C_old + δ·C_new (base.draw's model)."""
    d, n, drift = 8, 20000, 0.3
    scenario = scenarios.create("spectral_decay", alpha=2.0, drift=drift)
    streams = lambda *l: generator("pcg64", 3, "test", *l)
    out = scenario.draw(streams, scenarios.TrialShape(1, 4, 1, d, 4, n))
    old = scenario.population(streams("population", 0), d)
    new = scenario.population(streams("population-drift", 0), d)
    for name, c_old, c_new in (("k", old.cov_k, new.cov_k), ("v", old.cov_v, new.cov_v)):
        expected = (1 - drift) * c_old + drift * c_new
        empirical = out[f"{name}_decode"][0].T @ out[f"{name}_decode"][0] / n
        # entries of a sample covariance deviate by ~sqrt(2/n)·scale; 6 sigma
        assert np.abs(empirical - expected).max() < 6 * np.sqrt(2 / n) * np.abs(expected).max()
        assert np.abs(c_old - c_new).max() > 0.1                  # the populations really differ


def test_rope_lowrank_decode_keys_leave_the_prefill_subspace_by_the_drift():
    """With RoPE undone, the share of decode-key energy inside the prefill's rank-r subspace is
    (1−δ) + δ·r/D for a Haar-random new subspace (E‖P x‖² = r/D·‖x‖²), plus the small noise."""
    h, s, d, n = 2, 2048, 32, 1024
    for drift in (0.0, 0.5, 1.0):
        scenario = scenarios.create("rope_lowrank", drift=drift, noise=0.01)
        out = scenario.draw(lambda *l: generator("pcg64", 4, "test", *l), scenarios.TrialShape(h, s, 1, d, 4, n))
        flat = lambda k, p: undo_rope(torch.from_numpy(k), torch.from_numpy(p)).numpy().transpose(1, 0, 2).reshape(
            k.shape[1], -1)
        r = scenario.rank(h, d)
        frame = np.linalg.svd(flat(out["k"], out["positions"]), full_matrices=False)[2][:r].T   # (D, r)
        x = flat(out["k_decode"], out["positions_decode"])
        inside = np.sum((x @ frame) ** 2) / np.sum(x ** 2)
        assert inside == pytest.approx((1 - drift) + drift * r / (h * d), abs=0.03)


def test_tq_kv_bits_count_the_decode_tokens_by_hand(tmp_path):
    out = tmp_path / "bits"
    assert main(["run", "--scenario", "gaussian", "--scheme", "tq-kv", "--budget", "2", "--dim", "16",
                 "--seq-len", "32", "--decode-tokens", "8", "--queries", "4", "--trials", "2", "--quiet",
                 "--out", str(out)]) == 0
    frame = RunStore(out).trials()
    # tq-kv codes all S+N = 40 tokens: per cache b code bits per element and a float32 norm per
    # 16-element vector; per model one float32 codebook of 2^b entries shared by K and V and 16
    # packed rotation signs per tensor
    side = (4 * 32 + 2 * 16) / (2 * 40 * 16)
    assert frame["bits_per_element"].tolist() == [2 + 32 / 16] * 2
    assert frame["model_bits_per_element"].tolist() == pytest.approx([side] * 2, rel=1e-12)


@pytest.mark.parametrize("name", ["shard", "shard-pca-decode"])
def test_shard_chunk_is_prefill_plus_tokens_coded_one_at_a_time(name):
    """The runner's Shard path against a second computation: the prefill encoded, each decode token
    through encode_decode_tokens on its own (as in deployment), metrics on the concatenation and
    the two ledgers (BitLedger.of) summed over 2·H·(S+N)·d: the decode codec's side data (shard's
    codebook and rotation signs) per model, the rest per cache."""
    config = _config(schemes=(name,), dims=(16,), seq_lens=(96,), trials=1, decode_tokens=5)
    data = {k: v.float() if v.is_floating_point() else v for k, v in _draw(config, range(1)).items()}
    make = lambda: schemes.create(name, budget=4, dim=16, rank=16, n_iter=2, kmeans_iter=3)
    metrics, bits = engine.run_cell_chunk(make(), data)
    scheme = make()
    scheme.fit(data["k_cal"], data["v_cal"])
    enc = scheme.encode(data["k"], data["v"], positions=data["positions"])
    k_hat, v_hat = scheme.decode(enc)
    token_codes_bits, side_bits = 0, 0
    for i in range(5):
        one = scheme.encode_decode_tokens(data["k_decode"][:, :, i:i + 1], data["v_decode"][:, :, i:i + 1], enc,
                                          positions=data["positions_decode"][i:i + 1])
        k_one, v_one = scheme.decode_decode_tokens(one, enc)
        k_hat, v_hat = torch.cat((k_hat, k_one), 2), torch.cat((v_hat, v_one), 2)
        # per token: its per-cache codes, less the 32-bit position a lone token at a position
        # other than S stores in this API (coded together, S..S+4 are implied); the per-model
        # data (shard's Lloyd-Max codebook and the trial's rotation signs) is one table shared by
        # every decode token
        ledger = BitLedger.of(one)
        token_codes_bits += sum(b for part, b in ledger.components.items()
                                if part not in ledger.model_components and part != "codes.positions")
        side_bits = ledger.model_total
    k = torch.cat((data["k"], data["k_decode"]), 2)
    v = torch.cat((data["v"], data["v_decode"]), 2)
    expected = trial_metrics(k, v, data["q"], k_hat, v_hat, exact_logits(data["q"], k_hat))
    for metric in ("rel_mse_k", "rel_mse_v", "rel_mse_t", "kl_attn"):
        assert metrics[metric][0] == pytest.approx(float(expected[metric][0]), rel=1e-5, abs=1e-9), metric
    cache_bits = BitLedger.of(enc).total + token_codes_bits
    assert BitLedger.of(enc).model_total == 0 and (side_bits > 0) == (name == "shard")
    n_elements = 2 * 2 * (96 + 5) * 16                                                           # 2·H·(S+N)·d
    assert float(bits.bits_per_element[0]) == pytest.approx(cache_bits / n_elements, rel=1e-12)
    assert float(bits.model[0]) == side_bits and float(bits.model_bits[0]) == side_bits / 2
    assert float(bits.standalone_bits_per_element[0]) == pytest.approx((cache_bits + side_bits) / n_elements, rel=1e-12)


def test_rows_with_decode_tokens_do_not_depend_on_chunking(tmp_path):
    config = _config(schemes=("tq-kv", "squ-kv", "shard"), dims=(16,), seq_lens=(96,), trials=3, decode_tokens=6,
                     scenario_params={"rope_lowrank": {"drift": 0.7}})
    one, many = RunStore(tmp_path / "one"), RunStore(tmp_path / "many")
    runner.run_sweep(config, one, progress=False)
    runner.run_sweep(config, many, progress=False, memory_bytes=1)   # one trial per chunk
    a, b = one.trials(), many.trials()
    assert len(a) == 9
    pd.testing.assert_frame_equal(a, b, check_exact=False, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("value", ["-1", "two"])
def test_bad_decode_tokens_is_one_line_exit_2_and_nothing_written(tmp_path, capsys, value):
    out = tmp_path / "never"
    code = main(["run", "--scenario", "gaussian", "--scheme", "tq-kv", "--budget", "2", "--dim", "16",
                 "--seq-len", "8", "--queries", "2", "--trials", "2", "--decode-tokens", value, "--out", str(out)])
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "--decode-tokens" in err
    if value == "-1":
        assert "--decode-tokens -1 must be a non-negative integer" in err
    assert not out.exists()


def test_replay_refuses_decode_tokens_before_anything_is_written(tmp_path, capsys):
    from test_capture_replay import synthetic_arrays, write_npz
    arrays, meta = synthetic_arrays(np.random.default_rng(0))
    capture = write_npz(tmp_path / "cap.npz", arrays, meta)
    out = tmp_path / "never"
    code = main(["run", "--scenario", f"replay:{capture}", "--scheme", "tq-kv", "--budget", "2", "--dim", "32",
                 "--seq-len", "16", "--queries", "2", "--trials", "2", "--calib-tokens", "8",
                 "--decode-tokens", "4", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "replay: --decode-tokens is not supported" in err and err.count("\n") == 1
    assert not out.exists()
    with pytest.raises(ValueError, match="drift=1.5 must lie in"):
        scenarios.create("gaussian", drift=1.5)
