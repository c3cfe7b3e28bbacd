"""harness fit and the fitted:SPEC.json scenario.

Independent sources: a capture built here from a stated law (mean, covariance, Student-t dof)
whose parameters the fit must recover within their sampling error; draws of the six scenario
families with non-default parameters, which must be classified to their own family; the
model's own rotary inv_freq for the frequencies measured from a random-weight Llama capture.
"""
import json
import math

import numpy as np
import pytest

import scenarios
from harness.cli import main
from harness.fit import FEATURES, fit_capture, fit_dof, rope_from_capture, whitened
from harness.store import RunStore
from kvcommon.rng import generator
from scenarios.base import TrialShape
from scenarios.replay import CAPTURE_FORMAT, load_capture


pytestmark = pytest.mark.usefixtures("one_torch_thread")   # tests/conftest.py


def write_capture(path, k, v, q, *, k_rope=None, q_rope=None, segment_len=None):
    """A .npz capture of k, v (L, Hkv, N, d), q (L, Hq, N, d); one segment unless segment_len."""
    n = k.shape[2]
    seg = segment_len or n
    arrays = {"q": q.astype(np.float32), "k": k.astype(np.float32), "v": v.astype(np.float32),
              "positions": np.arange(n) % seg, "segments": np.arange(n) // seg}
    if k_rope is not None:
        arrays["q_rope"], arrays["k_rope"] = q_rope.astype(np.float32), k_rope.astype(np.float32)
    meta = {"format": CAPTURE_FORMAT, "model": "test", "model_sha256": "0" * 64, "layers": str(k.shape[0]),
            "heads": str(q.shape[1]), "kv_heads": str(k.shape[1]), "head_dim": str(k.shape[3]),
            "n_tokens": str(n), "text_sha256": "0" * 64, "rope": "yes" if k_rope is not None else "no"}
    np.savez(path, metadata=np.array(json.dumps(meta)), **arrays)
    return path


# ---------------------------------------------------------------- a known law, recovered

DIM, DOF, N_TOKENS = 8, 5.0, 8000


def known_law(seed=0):
    """Mean (3d,) with offsets, covariance with a power-law spectrum and one large channel, per head."""
    gen = np.random.default_rng(seed)
    p = 3 * DIM
    a = gen.standard_normal((p, p)) * (np.arange(1, p + 1) ** -0.7)
    cov = a @ a.T
    cov[0, 0] += 100.0   # an outlier key channel (std ≈ 10 against ≈ 2)
    return gen.normal(0, 1.5, p), cov


def sample_law(gen, mean, cov, n, dof):
    """x = μ + U diag(√λ) z, z i.i.d. t(dof) of unit variance (the law scenarios.fitted states)."""
    lam, vec = np.linalg.eigh(cov)
    z = gen.standard_t(dof, (n, len(mean))) * math.sqrt((dof - 2) / dof)
    return mean + z @ (vec * np.sqrt(lam)).T


@pytest.fixture(scope="module")
def known(tmp_path_factory):
    """A one-layer capture with 2 key/value heads and 4 query heads (GQA), drawn from known_law."""
    gen = np.random.default_rng(1)
    laws = [known_law(h) for h in range(4)]
    k = np.empty((1, 2, N_TOKENS, DIM))
    v = np.empty_like(k)
    q = np.empty((1, 4, N_TOKENS, DIM))
    for kv in range(2):  # query heads 2kv and 2kv+1 share the kv head's k, v; law of head 2kv for all three
        x = sample_law(gen, *laws[2 * kv], N_TOKENS, DOF)
        k[0, kv], v[0, kv], q[0, 2 * kv] = x[:, :DIM], x[:, DIM:2 * DIM], x[:, 2 * DIM:]
        q[0, 2 * kv + 1] = x[:, 2 * DIM:] * 2.0
    path = write_capture(tmp_path_factory.mktemp("known") / "cap.npz", k, v, q)
    spec = fit_capture(load_capture(path))
    spec_path = path.with_name("spec.json")
    spec_path.write_text(json.dumps(spec))
    return {"path": path, "spec": spec, "spec_path": spec_path, "laws": laws, "k": k, "v": v, "q": q}


def test_fit_dof_recovers_student_t_and_says_gaussian_for_gaussian():
    gen = np.random.default_rng(0)
    # 20 000 values (the subsample): the MLE's sd at ν = 4 is ≈ 0.2 (Fisher information of ν), the grid step 10 %
    assert fit_dof(gen.standard_t(4.0, 20_000)) == pytest.approx(4.0, rel=0.2)
    assert fit_dof(gen.standard_t(10.0, 20_000)) == pytest.approx(10.0, rel=0.4)
    gaussian = fit_dof(gen.standard_normal(20_000))
    assert gaussian is None or gaussian > 50


def test_fit_recovers_the_known_law(known):
    spec, n_fit = known["spec"], N_TOKENS // 2
    assert spec["fit_tokens"] == n_fit and spec["heads"] == 4 and spec["kv_heads"] == 2 and spec["rope"] is None
    heads = spec["layers"][0]["heads"]
    assert [h["kv_head"] for h in heads] == [0, 0, 1, 1]
    for kv in range(2):
        mean, cov = known["laws"][2 * kv]
        model = scenarios.fitted.load_spec(known["spec_path"]).token_model(0, 2 * kv)
        se = np.sqrt(np.diag(cov) / n_fit)
        assert np.all(np.abs(model.mean - mean) < 5 * se)                       # mean offsets, 5 standard errors
        # covariance: relative Frobenius error; for t(5) entries (kurtosis 9) its sd is ≈ 0.05 at n = 4000
        assert np.linalg.norm(model.cov - cov) / np.linalg.norm(cov) < 0.15
        assert model.dof == pytest.approx(DOF, rel=0.3)
        # the second query head of the group: the same k, v moments, q scaled by 2
        other = scenarios.fitted.load_spec(known["spec_path"]).token_model(0, 2 * kv + 1)
        np.testing.assert_allclose(other.cov[:2 * DIM, :2 * DIM], model.cov[:2 * DIM, :2 * DIM], rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(other.cov[2 * DIM:, 2 * DIM:], 4 * model.cov[2 * DIM:, 2 * DIM:], rtol=1e-5,
                                   atol=1e-8)
    stats = spec["layers"][0]["statistics"]
    k_fit = known["k"][0, :, :n_fit]
    assert stats["k_mean_share"] == pytest.approx(np.mean([np.sum(x.mean(0) ** 2) / np.mean(np.sum(x ** 2, -1))
                                                           for x in k_fit]), rel=1e-5)   # float32 file
    assert stats["k_outlier_channels"] >= 1       # channel 0 of every head has a std far above the rest


def test_fitted_scenario_draws_the_spec_and_a_refit_recovers_it(known):
    """Draw many tokens from fitted:SPEC (heads first, one query head of each group at random),
    re-estimate the joint moments of (k, v, q_prefill) and the tail: equal to the spec within sampling error."""
    spec = scenarios.fitted.load_spec(known["spec_path"])
    scenario = scenarios.create(f"fitted:{known['spec_path']}", heads="first", layer=0)
    assert scenario.tail == "fitted"   # the default: each head's likelier law, Student-t coordinates here
    assert {head["tail"] for head in known["spec"]["layers"][0]["heads"]} == {"coordinate"}
    n = 6000
    shape = TrialShape(n_heads=2, seq_len=n, n_queries=16, dim=DIM, n_calib=64, prefill_queries=True)
    draw = scenario.draw(lambda *labels: generator("pcg64", 3, *labels), shape)
    for head in range(2):
        joint = np.hstack((draw["k"][head], draw["v"][head], draw["q_prefill"][head]))
        # which query head of the group did the trial use? the one whose q covariance fits
        candidates = [spec.token_model(0, 2 * head + g) for g in range(2)]
        model = min(candidates, key=lambda m: np.linalg.norm(np.cov(joint, rowvar=False) - m.cov))
        se = np.sqrt(np.diag(model.cov) / n)
        assert np.all(np.abs(joint.mean(0) - model.mean) < 5 * se)
        assert np.linalg.norm(np.cov(joint, rowvar=False) - model.cov) / np.linalg.norm(model.cov) < 0.15
        assert fit_dof(whitened(joint)) == pytest.approx(model.dof, rel=0.3)
        for row in draw["q"][head]:   # evaluated queries are window tokens' own queries
            assert np.any(np.all(draw["q_prefill"][head] == row, axis=-1))


def test_fitted_scenario_shapes_dtype_determinism_and_errors(known):
    name = f"fitted:{known['spec_path']}"
    scenario = scenarios.create(name)
    assert scenario.layer_index(scenarios.fitted.load_spec(known["spec_path"])) == 0   # middle of 1 layer
    shape = TrialShape(n_heads=2, seq_len=64, n_queries=8, dim=DIM, n_calib=32)

    def draw(seed):
        return scenario.draw(lambda *labels: generator("pcg64", seed, name, *labels), shape)
    a, b, c = draw(1), draw(1), draw(2)
    for key, want in (("k", (2, 64, DIM)), ("v", (2, 64, DIM)), ("q", (2, 8, DIM)), ("k_cal", (2, 32, DIM)),
                      ("v_cal", (2, 32, DIM))):
        assert a[key].shape == want and a[key].dtype == np.float64 and np.all(np.isfinite(a[key]))
        assert np.array_equal(a[key], b[key]) and not np.array_equal(a[key], c[key])
    np.testing.assert_array_equal(a["positions"], np.arange(64))
    assert not np.allclose(a["k"][:, :32], a["k_cal"])          # calibration is its own draw
    with pytest.raises(ValueError, match="head_dim in spec is 8, requested dim 16"):
        scenario.check_shape(TrialShape(1, 16, 4, 16, 8))
    with pytest.raises(ValueError, match="3 heads requested, the spec has 2"):
        scenario.check_shape(TrialShape(3, 16, 4, DIM, 8))
    with pytest.raises(ValueError, match="decode-tokens is not supported"):
        scenario.check_shape(TrialShape(1, 16, 4, DIM, 8, n_decode=4))
    with pytest.raises(ValueError, match=r"layer=1; valid: -1 \(middle\) or 0..0"):
        scenarios.create(f"{name}:layer=1")
    with pytest.raises(ValueError, match="no such fitted scenario spec"):
        scenarios.create("fitted:/nonexistent/spec.json")
    bad = known["spec_path"].with_name("bad.json")
    bad.write_text(json.dumps({"format": "kvharness-fitted/1", "head_dim": 8, "heads": 4, "kv_heads": 2,
                               "layers": [{"heads": []}]}))
    with pytest.raises(ValueError, match="layer 0 needs 4 heads"):
        scenarios.create(f"fitted:{bad}")


def test_token_scale_tail_is_recovered_and_redrawn(tmp_path):
    """Elliptical law x = μ + s·L·g with s² = 0.25 (80 % of tokens) or 4 (20 %), E s² = 1: the fitted
    s² quantiles put ≈ 20 % of tokens near 4 (χ²_p/p noise: relative sd √(2/24) = 0.29), and a
    tail=token redraw has the capture's token-norm overdispersion var(|w|²)/2p (p·var(s²)/2 + E s⁴ = 12·2.25 + 3.25 ≈ 30
    here; 1 for a Gaussian) within 20 %; tail=gaussian redraws have ≈ 1."""
    from harness.fit import norm_overdispersion
    gen = np.random.default_rng(2)
    n, p = 8000, 3 * DIM
    mean, cov = known_law(3)
    s2 = np.where(gen.random(n) < 0.2, 4.0, 0.25)
    x = mean + np.sqrt(s2)[:, None] * gen.standard_normal((n, p)) @ np.linalg.cholesky(cov).T
    path = write_capture(tmp_path / "cap.npz", x[None, None, :, :DIM], x[None, None, :, DIM:2 * DIM],
                         x[None, None, :, 2 * DIM:])
    spec = fit_capture(load_capture(path))
    quantiles = np.asarray(spec["layers"][0]["heads"][0]["scale2_quantiles"])
    assert quantiles[0] >= 0 and np.all(np.diff(quantiles) >= 0)
    probs = np.linspace(0, 1, len(quantiles))
    assert np.interp(0.5, probs, quantiles) == pytest.approx(0.25, rel=0.3)
    assert np.interp(0.92, probs, quantiles) == pytest.approx(4.0, rel=0.3)
    real = spec["layers"][0]["statistics"]["token_norm_overdispersion"]
    assert real == pytest.approx(norm_overdispersion(whitened(x[: n // 2])), rel=1e-6) and real > 20
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    shape = TrialShape(n_heads=1, seq_len=6000, n_queries=1, dim=DIM, n_calib=1, prefill_queries=True)
    for tail, want, tol in (("token", real, 0.2), ("gaussian", 1.0, 0.15)):
        draw = scenarios.create(f"fitted:{spec_path}:tail={tail}").draw(
            lambda *labels: generator("pcg64", 4, *labels), shape)
        redrawn = np.hstack((draw["k"][0], draw["v"][0], draw["q_prefill"][0]))
        assert norm_overdispersion(whitened(redrawn)) == pytest.approx(want, rel=tol), tail
    with pytest.raises(ValueError, match="tail='x'; valid: fitted, token, coordinate, gaussian"):
        scenarios.create(f"fitted:{spec_path}:tail=x")


# ---------------------------------------------------------------- known constructions -> their family

CONSTRUCTIONS = [("gaussian", {}), ("spectral_decay", {"alpha": 1.2}), ("heavy_tail", {"dof": 3.5, "alpha": 1.2}),
                 ("lowrank_aligned", {"rank": 6}), ("lowrank_misaligned", {"rank": 6}),
                 ("outlier_channels", {"n_outliers": 3, "outlier_scale": 8.0}), ("rope_lowrank", {"rank_fraction": 0.15})]


@pytest.mark.parametrize("family,params", CONSTRUCTIONS, ids=[c[0] for c in CONSTRUCTIONS])
def test_known_construction_is_classified_to_its_family(family, params, tmp_path):
    import torch
    from kvcommon.rope import apply_rope, undo_rope
    n, d, h = 2048, 32, 4
    draw = scenarios.create(family, **params).draw(lambda *labels: generator("pcg64", 7, family, *labels),
                                                   TrialShape(n_heads=h, seq_len=n, n_queries=n, dim=d, n_calib=1))
    kwargs = {}
    k, q = draw["k"], draw["q"]
    if family == "rope_lowrank":  # the capture holds both versions, as harness capture writes them
        pos = torch.arange(n)
        kwargs = {"k_rope": k, "q_rope": q}
        k, q = undo_rope(torch.from_numpy(k), pos).numpy(), undo_rope(torch.from_numpy(q), pos).numpy()
        np.testing.assert_allclose(apply_rope(torch.from_numpy(k), pos).numpy(), draw["k"], atol=1e-9)
    kwargs = {name: x[None] for name, x in kwargs.items()}
    path = write_capture(tmp_path / "cap.npz", k[None], draw["v"][None], q[None], **kwargs)
    layer = fit_capture(load_capture(path))["layers"][0]
    distances = layer["family"]["distances"]
    assert set(layer["features"]) == set(FEATURES)
    assert layer["family"]["closest"] == family, distances
    assert layer["family"]["distance"] == min(distances.values()) < 0.1


# ---------------------------------------------------------------- RoPE: a random-weight Llama (decoder, GQA)

def llama_capture(path, segment_len: int):
    """(model, path): a random-weight Llama (2 layers, RoPE, 4 query heads over 2 key/value heads)
    and its capture of two random segments of segment_len tokens, written to path."""
    import torch
    import transformers
    from harness.capture import capture_segments
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=128, num_hidden_layers=2, vocab_size=500,
                                      max_position_embeddings=512, rope_theta=500.0)
    with torch.random.fork_rng():   # the global torch stream stays untouched
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).eval()
    gen = np.random.default_rng(0)
    tensors = capture_segments(model, [gen.integers(0, 500, segment_len) for _ in range(2)])
    return model, write_capture(path, tensors["k"], tensors["v"], tensors["q"], k_rope=tensors["k_rope"],
                                q_rope=tensors["q_rope"], segment_len=segment_len)


@pytest.mark.skipif(__import__("importlib").util.find_spec("transformers") is None, reason="transformers not installed")
def test_llama_capture_rope_frequencies_and_fitted_draws_carry_its_rope(tmp_path):
    from kvcommon.rope import apply_rope_numpy as apply_rope
    model, path = llama_capture(tmp_path / "llama.npz", 300)
    cap = load_capture(path)
    inv_freq, scaling = rope_from_capture(cap)
    expected = model.model.rotary_emb.inv_freq.double().numpy()       # the model's own frequencies
    np.testing.assert_allclose(inv_freq, expected, rtol=1e-4, atol=1e-6)
    assert scaling == pytest.approx(float(model.model.rotary_emb.attention_scaling), rel=1e-4)
    spec = fit_capture(cap, fit_fraction=0.9)
    assert spec["heads"] == 4 and spec["kv_heads"] == 2 and spec["rope"] is not None
    assert spec["layers"][0]["features"]["rope_spread"] >= 0
    spec_path = tmp_path / "llama.json"
    spec_path.write_text(json.dumps(spec))
    scenario = scenarios.create(f"fitted:{spec_path}:layer=1", heads="first")
    shape = TrialShape(n_heads=2, seq_len=40, n_queries=4, dim=16, n_calib=8, prefill_queries=True)
    draw = scenario.draw(lambda *labels: generator("pcg64", 0, *labels), shape)
    # undoing the capture's RoPE at positions 0..S-1 (the inverse rotation: apply at −θ) gives pre-RoPE
    # keys; applying it again must give the drawn keys back — and the pre-RoPE keys are not the drawn ones
    pre = apply_rope(draw["k"], np.arange(40), -inv_freq, 1 / scaling)
    np.testing.assert_allclose(apply_rope(pre, np.arange(40), inv_freq, scaling), draw["k"], atol=1e-8)
    assert not np.allclose(pre[:, 1:], draw["k"][:, 1:])


# ---------------------------------------------------------------- the command

def test_fit_cli_writes_a_spec_that_harness_run_uses(known, tmp_path, capsys):
    spec = tmp_path / "s.json"
    assert main(["fit", str(known["path"]), "--out", str(spec)]) == 0
    out = capsys.readouterr().out
    assert "closest family" in out and f"fitted:{spec}" in out
    assert json.loads(spec.read_text())["layers"][0]["heads"][0]["dof"] is not None
    assert main(["fit", str(known["path"]), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert "heads" not in summary["layers"][0] and summary["layers"][0]["family"]["closest"]
    run_dir = tmp_path / "run"
    name = f"fitted:{spec}:layer=0"
    assert main(["run", "--scenario", name, "--scheme", "tq-kv", "--dim", str(DIM), "--budget", "3",
                 "--seq-len", "32", "--queries", "8", "--trials", "3", "--quiet", "--out", str(run_dir)]) == 0
    frame = RunStore(run_dir).trials()
    assert len(frame) == 3 and set(frame["scenario"]) == {name} and frame["rel_mse_k"].between(0, 1).all()


@pytest.mark.parametrize("argv,message", [
    (["--out", "x.txt"], "--out .*x.txt must end in .json"),
    (["--fit-fraction", "0"], "--fit-fraction 0.0 must lie in"),
    (["--fit-fraction", "0.005"], "leaves 40 tokens to fit on"),
])
def test_fit_cli_bad_input_is_one_line_exit_2_and_writes_nothing(known, tmp_path, capsys, argv, message):
    argv = [a.replace("x.txt", str(tmp_path / "x.txt")) for a in argv]
    assert main(["fit", str(known["path"]), *argv, "--out" if "--out" not in argv else "--json",
                 *([str(tmp_path / "s.json")] if "--out" not in argv else [])]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and __import__("re").search(message, err), err
    assert not list(tmp_path.iterdir())
    assert main(["fit", str(tmp_path / "missing.safetensors")]) == 2
    assert "no such capture file" in capsys.readouterr().err


# ---------------------------------------------------------------- predictivity: Kendall's τ at equal storage

def table(name, means, levels=(3.5,), n=6, noise=0.0, seed=0):
    from stats.predictivity import Table
    gen = np.random.default_rng(seed)
    return Table(name, {(lv, s): m + noise * gen.standard_normal(n) for lv in levels for s, m in means.items()}, n)


def test_tau_is_kendalls_tau_per_level_and_pools_levels_by_pairs():
    from scipy.stats import kendalltau
    from stats.predictivity import agreement
    gen = np.random.default_rng(0)
    names = [f"c{i}" for i in range(7)]
    ref_means, cand_means = gen.random(7), gen.random(7)
    ref = table("ref", dict(zip(names, ref_means)))
    cand = table("cand", dict(zip(names, cand_means)))
    ag = agreement([(ref, cand)], n_boot=50)
    assert ag.tau == pytest.approx(kendalltau(ref_means, cand_means).statistic, abs=1e-12)   # no ties: τ_a = τ_b
    assert ag.n_pairs == 21
    flipped = {(a, b) for _, a, b, *_ in ag.flipped}
    expected = {(names[i], names[j]) for i in range(7) for j in range(i + 1, 7)
                if (ref_means[i] - ref_means[j]) * (cand_means[i] - cand_means[j]) < 0}
    assert flipped == expected
    # two layers pooled: the pair-weighted mean of the per-layer τ (scipy), here 21 and 10 pairs
    sub = names[:5]
    ref2 = table("ref2", dict(zip(sub, ref_means[::-1][:5])))
    cand2 = table("cand2", dict(zip(sub, cand_means[:5])))
    pooled = agreement([(ref, cand), (ref2, cand2)], n_boot=50)
    want = (21 * kendalltau(ref_means, cand_means).statistic + 10 * kendalltau(ref_means[::-1][:5], cand_means[:5]).statistic) / 31
    assert pooled.tau == pytest.approx(want, abs=1e-12) and pooled.n_pairs == 31
    # the quantisers alone: only pairs inside the subset
    assert agreement([(ref, cand)], names[:4], n_boot=50).tau == pytest.approx(
        kendalltau(ref_means[:4], cand_means[:4]).statistic, abs=1e-12)


def test_bootstrap_interval_is_degenerate_when_orders_are_certain_and_wide_when_they_are_noise():
    from stats.predictivity import agreement
    means = {f"c{i}": float(i) for i in range(5)}
    same = agreement([(table("a", means, noise=0.01), table("b", means, noise=0.01, seed=1))], n_boot=200)
    assert (same.tau, same.ci_low, same.ci_high) == (1.0, 1.0, 1.0)
    rev = agreement([(table("a", means, noise=0.01), table("b", {k: -v for k, v in means.items()}, noise=0.01))],
                    n_boot=200)
    assert (rev.tau, rev.ci_low, rev.ci_high) == (-1.0, -1.0, -1.0) and len(rev.flipped) == 10
    flat = {f"c{i}": 0.0 for i in range(5)}   # no order at all: the interval must straddle 0
    noise = agreement([(table("a", flat, noise=1.0, n=10), table("b", flat, noise=1.0, n=10, seed=1))], n_boot=400)
    assert noise.ci_low < 0 < noise.ci_high


def test_predictivity_cli_matches_an_independent_kendall_tau(tmp_path, capsys):
    from scipy.stats import kendalltau
    gen = np.random.default_rng(5)
    n, d = 1200, 32
    mix = gen.standard_normal((d, d)) * np.arange(1, d + 1) ** -0.8
    k = (gen.standard_normal((1, 2, n, d)) @ mix.T) + 0.5
    v = gen.standard_normal((1, 2, n, d)) @ mix.T
    q = gen.standard_normal((1, 2, n, d))
    cap = write_capture(tmp_path / "cap.npz", k, v, q)
    spec = tmp_path / "spec.json"
    assert main(["fit", str(cap), "--out", str(spec)]) == 0
    out = tmp_path / "study"
    argv = ["predictivity", str(cap), "--spec", str(spec), "--scheme", "plain-kv,tq-kv,sq-kv", "--budget", "2,3",
            "--levels", "3,4", "--trials", "3", "--seq-len", "32", "--queries", "8", "--calib-tokens", "64",
            "--out", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "Kendall's tau" in text and "pooled" in text
    result = json.loads((out / "predictivity.json").read_text())
    frame = RunStore(out).trials()
    assert set(frame["storage_bits_per_element"].round(6)) == {3.0, 4.0}      # levels 3, 4 are measured cells
    means = frame.groupby(["scenario", "budget", "scheme"])["d2_t"].mean()
    c = dd = 0
    for budget in (2, 3):
        real = means[f"replay:{cap}:layer=0", budget]
        fitted = means[f"fitted:{spec}:layer=0", budget]
        t = kendalltau(real[["plain-kv", "tq-kv", "sq-kv"]].to_numpy(), fitted[["plain-kv", "tq-kv", "sq-kv"]].to_numpy())
        c, dd = c + round(3 * (1 + t.statistic) / 2), dd + round(3 * (1 - t.statistic) / 2)
    layer = result["layers"][0]
    assert layer["all"]["fitted"]["tau"] == pytest.approx((c - dd) / (c + dd)) and layer["all"]["fitted"]["n_pairs"] == 6
    assert result["pooled"]["all"]["fitted"]["tau"] == layer["all"]["fitted"]["tau"]
    assert result["quantisers"] == ["plain-kv", "tq-kv", "sq-kv"]
    assert layer["closest_family"] == json.loads(spec.read_text())["layers"][0]["family"]["closest"]
    ratios = layer["fitted_over_real"]
    assert {"rel_mse_k", "rel_mse_v", "kl_attn", "d2_t"} <= set(ratios) and all(r > 0 for r in ratios.values())
    assert "fitted / real mean error" in text
    # a second call reuses the stored sweep (nothing rerun) and gives the same result
    assert main(argv) == 0
    capsys.readouterr()
    assert json.loads((out / "predictivity.json").read_text())["layers"][0]["all"]["fitted"]["tau"] == \
        layer["all"]["fitted"]["tau"]


def test_predictivity_cli_bad_input_is_exit_2_and_writes_nothing(known, tmp_path, capsys):
    out = tmp_path / "never"
    for extra, message in ((["--spec", str(tmp_path / "none.json")], "no such fitted scenario spec"),
                           (["--spec", str(known["spec_path"]), "--layers", "3"], "--layers 3 is not a layer"),
                           (["--spec", str(known["spec_path"]), "--levels", "x"], "storage level 'x' is not a number")):
        assert main(["predictivity", str(known["path"]), *extra, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1
    assert not out.exists()


def test_error_ratios_are_geometric_means_of_mean_ratios_at_measured_storage():
    import pandas as pd
    from stats.predictivity import error_ratios
    gen = np.random.default_rng(0)
    rows = []
    truth = {}
    for scenario, factor in (("real", 1.0), ("synthetic", 2.0)):
        for scheme in ("a", "b"):
            for budget, storage in ((2, 3.0), (3, 4.0)):
                for trial in range(4):
                    value = factor * (1 + gen.random())
                    truth.setdefault((scenario, scheme, storage), []).append(value)
                    rows.append({"scenario": scenario, "scheme": scheme, "budget": budget, "dim": 8, "seq_len": 16,
                                 "queries": 4, "calib_tokens": 8, "trial": trial, "seed": 0, "rng": "pcg64",
                                 "bits_per_element": storage, "storage_bits_per_element": storage, "kl_attn": value})
    ratios = error_ratios(pd.DataFrame(rows), "real", "synthetic", (3.0, 4.0), ("a", "b"), metrics=("kl_attn",))
    logs = [np.log(np.mean(truth["synthetic", s, x]) / np.mean(truth["real", s, x])) for s in "ab" for x in (3.0, 4.0)]
    assert ratios["kl_attn"] == pytest.approx(np.exp(np.mean(logs)), rel=1e-12)


# ---------------------------------------------------------------- recommend: per-layer choice under a storage budget

def test_replay_parts_split_the_evaluation_windows(tmp_path):
    gen = np.random.default_rng(0)
    n = 400
    k = gen.standard_normal((1, 1, n, 8))
    path = write_capture(tmp_path / "parts.npz", k, k, k)
    cap = load_capture(path)
    full = scenarios.create(f"replay:{path}").window_starts(cap, 20)
    first = scenarios.create(f"replay:{path}:part=first").window_starts(cap, 20)
    second = scenarios.create(f"replay:{path}:part=second").window_starts(cap, 20)
    np.testing.assert_array_equal(full, np.arange(200, 381))                    # unchanged default
    np.testing.assert_array_equal(first, np.arange(200, 281))                   # windows inside [200, 300)
    np.testing.assert_array_equal(second, np.arange(300, 381))                  # windows inside [300, 400)
    with pytest.raises(ValueError, match="part='x'; valid: all, first, second"):
        scenarios.create(f"replay:{path}:part=x")


def test_choose_is_the_brute_force_optimum():
    import itertools
    import pandas as pd
    from harness.recommend import choose
    gen = np.random.default_rng(3)
    keys = [(s, b) for s in ("a", "b", "c") for b in (2, 3, 4)]
    opts = {layer: pd.DataFrame({"storage_bits_per_element": [b + gen.random() for _, b in keys],
                                 "d2_t": gen.random(len(keys)) / np.array([b for _, b in keys])},
                                index=pd.MultiIndex.from_tuples(keys, names=["scheme", "budget"]))
            for layer in range(4)}
    for bits in (2.0, 2.6, 3.0, 3.5, 4.2):
        best = None
        for combo in itertools.product(keys, repeat=4):
            storage = np.mean([opts[lay].at[key, "storage_bits_per_element"] for lay, key in enumerate(combo)])
            error = sum(opts[lay].at[key, "d2_t"] for lay, key in enumerate(combo))
            if storage <= bits and (best is None or error < best[0]):
                best = (error, combo)
        picks = choose(opts, bits)
        if best is None:
            assert picks is None
        else:
            assert tuple(picks[lay] for lay in range(4)) == best[1]


def uniform_frame(gen):
    """Two layers; codec a at 3.0 / 4.0 bits (budgets 2, 3), codec b at 3.5 / 5.0; 5 trials."""
    import pandas as pd
    rows = []
    for layer in (0, 1):
        for scheme, storages in (("a", (3.0, 4.0)), ("b", (3.5, 5.0))):
            for budget, storage in zip((2, 3), storages):
                for trial in range(5):
                    rows.append({"scenario": f"L{layer}", "scheme": scheme, "budget": budget, "dim": 8, "seq_len": 16,
                                 "queries": 4, "calib_tokens": 8, "trial": trial, "seed": 0, "rng": "pcg64",
                                 "bits_per_element": storage, "storage_bits_per_element": storage,
                                 "d2_t": (0.2 if scheme == "a" else 0.25) / budget * (1 + gen.random())})
    return pd.DataFrame(rows)


def test_uniform_is_the_best_codec_at_the_same_measured_storage():
    from harness.recommend import at_level, uniform
    frame = uniform_frame(np.random.default_rng(0))
    layers = {0: "L0", 1: "L1"}
    values = at_level(frame, layers, 3.5)
    for layer in (0, 1):
        rows = frame[frame["scenario"] == f"L{layer}"].sort_values("trial")
        a2, a3 = (rows[(rows["scheme"] == "a") & (rows["budget"] == b)]["d2_t"].to_numpy() for b in (2, 3))
        np.testing.assert_allclose(values["a"][layer], np.sqrt(a2 * a3), rtol=1e-12)   # log-linear, weight 1/2
        np.testing.assert_allclose(values["b"][layer], rows[(rows["scheme"] == "b") & (rows["budget"] == 2)]["d2_t"])
    want = min(values, key=lambda s: values[s].mean(1).sum())
    assert uniform(frame, layers, 3.5) == want
    assert set(at_level(frame, layers, 4.5)) == {"b"}           # a does not reach 4.5: never extrapolated
    assert uniform(frame, layers, 6.0) is None


def test_recommend_cli_runs_and_its_gain_matches_the_stored_rows(tmp_path, capsys):
    gen = np.random.default_rng(6)
    n, d = 1600, 32
    k = gen.standard_normal((2, 1, n, d)) * np.array([1.0, 3.0])[:, None, None, None] ** np.linspace(0, 1, d)
    v = gen.standard_normal((2, 1, n, d))
    q = gen.standard_normal((2, 1, n, d))
    cap = write_capture(tmp_path / "cap.npz", k, v, q)
    out = tmp_path / "rec"
    argv = ["recommend", str(cap), "--bits", "3.6", "--scheme", "tq-kv,svd,h2o", "--budget", "2,3,4", "--trials", "4",
            "--seq-len", "32", "--queries", "8", "--calib-tokens", "64", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "gain" in printed
    result = json.loads((out / "recommendation.json").read_text())
    frame = RunStore(out).trials()
    judge = frame[frame["scenario"].str.endswith("part=second")]
    rec = sum(judge[(judge["scenario"] == f"replay:{cap}:layer={row['layer']}:part=second") &
                    (judge["scheme"] == row["scheme"]) & (judge["budget"] == row["budget"])]["d2_t"].mean()
              for row in result["layers"])
    level = np.mean([row["storage"] for row in result["layers"]])
    assert result["judged"]["storage"] == pytest.approx(level)
    uni = 0.0
    for layer in (0, 1):   # the uniform codec at the same storage, by hand: its cell within 2.5 %, or log-linear
        rows = judge[(judge["scenario"] == f"replay:{cap}:layer={layer}:part=second") &
                     (judge["scheme"] == result["uniform"])]
        cells = {b: g.sort_values("trial") for b, g in rows.groupby("budget")}
        storage = {b: g["storage_bits_per_element"].mean() for b, g in cells.items()}
        near = [b for b in cells if abs(storage[b] - level) / level <= 0.025]
        if near:
            b = min(near, key=lambda b: abs(storage[b] - level))
            uni += cells[b]["d2_t"].mean()
        else:
            lo = max((b for b in cells if storage[b] < level), key=lambda b: storage[b])
            hi = min((b for b in cells if storage[b] > level), key=lambda b: storage[b])
            w = (level - storage[lo]) / (storage[hi] - storage[lo])
            uni += np.mean(np.exp((1 - w) * np.log(cells[lo]["d2_t"].to_numpy()) + w * np.log(cells[hi]["d2_t"].to_numpy())))
    assert result["judged"]["gain"] == pytest.approx(1 - rec / uni, rel=1e-9)
    assert result["judged"]["gain_ci"][0] <= result["judged"]["gain"] <= result["judged"]["gain_ci"][1]
    assert np.mean([row["storage"] for row in result["layers"]]) <= 3.6 + 1e-9
    cell = result["uniform_cell"]      # the best measured single cell: paired by hand on the judge half
    pick = frame[frame["scenario"].str.endswith("part=first")].groupby(["scheme", "budget", "scenario"])[
        ["d2_t", "storage_bits_per_element"]].mean().groupby(["scheme", "budget"]).agg(
        {"d2_t": "sum", "storage_bits_per_element": "mean"})
    pick = pick[pick["storage_bits_per_element"] <= 3.6 + 1e-9]
    assert tuple(cell) == pick["d2_t"].idxmin()
    cell_err = judge[(judge["scheme"] == cell[0]) & (judge["budget"] == cell[1])].groupby("scenario")["d2_t"].mean().sum()
    assert result["judged_cell"]["gain"] == pytest.approx(1 - rec / cell_err, rel=1e-9)
    assert result["judged_cell"]["storage_uniform"] <= 3.6 + 1e-9
    choose_half = frame[frame["scenario"].str.endswith("part=first")]
    for layer in (0, 1):   # the uniform codec's error curve per layer: scipy's regression of log2 d2_t on storage
        from scipy.stats import linregress
        cells = choose_half[(choose_half["scenario"] == f"replay:{cap}:layer={layer}:part=first")
                            & (choose_half["scheme"] == result["uniform"])].groupby("budget")[
            ["storage_bits_per_element", "d2_t"]].mean()
        slope = linregress(cells["storage_bits_per_element"], np.log2(cells["d2_t"])).slope
        assert result["conclusion"]["halving_bits"][str(layer)] == pytest.approx(-1 / slope, rel=1e-9)
    j = result["judged"]
    assert result["conclusion"]["kind"] == ("per-layer" if j["gain"] >= 0.15 and j["gain_ci"][0] > 0 else "uniform")
    assert result["conclusion"]["line"] in printed.splitlines()
    assert RunStore(out).table("recommendation_judged")["conclusion"].iloc[0] == result["conclusion"]["line"]
    assert main([*argv[:2], "--bits", "0.5", *argv[4:]]) == 2
    assert "below what these codecs reach" in capsys.readouterr().err


def test_the_recommendation_verdict_follows_the_gain_rule_and_gives_the_curves_as_reason():
    """A gain of at least 15 % with its interval above 0 is a per-layer verdict; anything else says
    uniform is as good, with the layers' halving bits, alike (within 1.5x) or not."""
    from harness.recommend import conclusion
    judged = {"gain": 0.2, "gain_ci": [0.05, 0.3], "storage": 3.5}
    assert conclusion(judged, "tq-kv", {0: 1.0, 1: 3.0})["kind"] == "per-layer"
    for gain, ci in ((0.2, [-0.01, 0.4]), (0.1, [0.05, 0.15]), (-0.03, [-0.13, 0.05])):
        alike = conclusion({**judged, "gain": gain, "gain_ci": ci}, "tq-kv", {0: 1.0, 1: 1.2, 2: float("inf")})
        assert alike["kind"] == "uniform" and "fall alike" in alike["line"] and "1.00, 1.20, inf" in alike["line"]
        assert alike["halving_bits"] == {"0": 1.0, "1": 1.2, "2": None} and "\n" not in alike["line"]
    differ = conclusion({**judged, "gain": 0.0, "gain_ci": [-0.1, 0.1]}, "tq-kv", {0: 1.0, 1: 2.0})
    assert differ["kind"] == "uniform" and "differ" in differ["line"]


# ---------------------------------------------------------------- the order along the sequence

def var1_tokens(gen, mean, cov, transition, n, segment_len):
    """A stationary VAR(1) of covariance cov along each segment (restarted from its stationary law):
    x_t − μ = B (x_{t−1} − μ) + η_t, Cov η = Σ − BΣBᵀ (drawn here with Cholesky factors, not the
    eigen-roots scenarios.fitted uses)."""
    p = len(mean)
    start = np.linalg.cholesky(cov)
    noise = np.linalg.cholesky(cov - transition @ cov @ transition.T)
    out = np.empty((n, p))
    for t in range(n):
        if t % segment_len == 0:
            out[t] = start @ gen.standard_normal(p)
        else:
            out[t] = transition @ out[t - 1] + noise @ gen.standard_normal(p)
    return mean + out


def known_transition(p, seed=2):
    """A transition B = c·R, R a random rotation, c 0.8: stationary with Σ = I (BΣBᵀ = 0.64 I)."""
    gen = np.random.default_rng(seed)
    q, r = np.linalg.qr(gen.standard_normal((p, p)))
    return 0.8 * q * np.sign(np.diag(r))


def test_the_fitted_transition_is_the_generating_var1_and_draws_keep_it(tmp_path):
    """A capture drawn from a known VAR(1) (an oscillating one: a scaled rotation, which no set of
    per-coordinate decays can express) gives back its B within sampling error, never mixing
    segments; the fitted scenario then draws tokens with lag-1 cross-covariance BΣ and covariance Σ."""
    from harness.fit import transition
    from scenarios.fitted import head_model
    gen = np.random.default_rng(4)
    p, n = 3 * DIM, 6000
    b_true = known_transition(p)
    x = var1_tokens(gen, np.zeros(p), np.eye(p), b_true, n, segment_len=500)
    k, v, q = (x[None, None, :, i * DIM:(i + 1) * DIM] for i in range(3))
    path = write_capture(tmp_path / "var.npz", k, v, q, segment_len=500)
    spec = fit_capture(load_capture(path), fit_fraction=1.0)
    head = spec["layers"][0]["heads"][0]
    fitted = np.asarray(head["transition"]).reshape(p, p)
    se = 1 / math.sqrt(n)                       # a lag-1 covariance of unit-variance coordinates
    assert np.abs(fitted - b_true).max() < 6 * se
    segments = np.arange(n) // 500
    assert np.abs(transition(x, segments, head_model(head)) - fitted).max() < 1e-6   # what the spec stores
    shuffled = transition(x, np.arange(n), head_model(head))   # every token its own segment: no pair
    assert shuffled is None
    model = head_model(head)
    draws = model.sample(np.random.default_rng(5), 20000, tail="gaussian")
    centred = draws - draws.mean(0)
    lag1 = centred[1:].T @ centred[:-1] / (len(draws) - 1)
    np.testing.assert_allclose(lag1, b_true @ model.cov, atol=8 / math.sqrt(20000))
    np.testing.assert_allclose(np.cov(draws, rowvar=False), model.cov, atol=0.1)
    iid = model.sample(np.random.default_rng(5), 20000, tail="gaussian", order="iid")
    centred = iid - iid.mean(0)
    assert np.abs(centred[1:].T @ centred[:-1] / 19999).max() < 6 / math.sqrt(20000)


def test_the_tail_law_is_the_likelier_one():
    """Tokens scaled as a whole (an elliptical scale mixture) are "token"; i.i.d. Student-t
    coordinates along the covariance's eigenvectors (distinct variances, so whitening finds those
    axes: the basis the scenario draws in) are "coordinate" (the fit's own estimates handed in)."""
    from harness.fit import scale2_quantiles, tail_law
    gen = np.random.default_rng(6)
    p, n = 24, 4000
    scale = np.sqrt(gen.chisquare(4, (n, 1)) / 4)
    mixture = gen.standard_normal((n, p)) / scale
    mixture = whitened(mixture)
    assert tail_law(mixture, fit_dof(mixture), scale2_quantiles(mixture)) == "token"
    coordinates = whitened(gen.standard_t(4, (n, p)) * np.linspace(1, 4, p))
    assert tail_law(coordinates, fit_dof(coordinates), scale2_quantiles(coordinates)) == "coordinate"


def test_a_spec_without_order_or_tail_draws_as_before(known, tmp_path):
    """Specs written before the sequence model (no transition, no tail) draw i.i.d. tokens with
    Student-t coordinates, exactly as then: x = μ + root·z from the "tokens" stream."""
    data = json.loads(known["spec_path"].read_text())
    for head in data["layers"][0]["heads"]:
        head.pop("transition", None)
        head.pop("tail", None)
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    shape = TrialShape(n_heads=1, seq_len=64, n_queries=8, dim=DIM, n_calib=16)
    draw = scenarios.create(f"fitted:{old}", heads="first").draw(lambda *labels: generator("pcg64", 7, *labels), shape)
    model = scenarios.fitted.load_spec(old).token_model(0, int(generator("pcg64", 7, "query_head", 0).integers(2)))
    gen = generator("pcg64", 7, "tokens", 0)
    z = gen.standard_t(model.dof, (64, 3 * DIM)) * math.sqrt((model.dof - 2) / model.dof)
    np.testing.assert_array_equal(draw["k"][0], (model.mean + z @ model.root.T)[:, :DIM])


def test_a_spec_whose_covariance_is_not_a_covariance_is_refused_in_one_line(known, tmp_path, capsys):
    """A variance made negative by hand: the scenario refuses the spec when built (naming the file,
    layer and head), and a run is exit 2 with one line, writing nothing."""
    data = json.loads(known["spec_path"].read_text())
    data["layers"][0]["heads"][1]["cov"][0] = -5.0   # the first variance of head 1
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"bad\.json: layer 0 head 1: its covariance is not positive semi-definite"):
        scenarios.create(f"fitted:{bad}:layer=0")
    out = tmp_path / "run"
    assert main(["run", "--scenario", f"fitted:{bad}:layer=0", "--scheme", "tq-kv", "--dim", str(DIM), "--budget", "3",
                 "--seq-len", "32", "--queries", "4", "--trials", "2", "--quiet", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "not positive semi-definite" in err and len(err.strip().splitlines()) == 1 and not out.exists()


def known_profile(positions, p, length):
    """A smooth mean against position (n, p): on a third of the coordinates a slow ramp and one
    period of a cosine (as learned position embeddings vary), on the others nothing."""
    t = np.asarray(positions, dtype=float)[:, None] / length
    amplitude = np.where(np.arange(p) % 3 == 0, 1.5, 0.0)
    return amplitude * (t - 0.5) + amplitude * np.cos(2 * np.pi * t)


def test_a_mean_that_depends_on_position_is_recovered_and_drawn_where_windows_lie(tmp_path):
    """Tokens = a known profile of their position + independent Gaussian noise, over 8 segments of
    256 positions: the fit finds the profile (its residual against the truth within the noise a
    per-position average leaves), fits the rest of the law on the tokens around it (covariance back
    to the noise's), and a draw places its window at p0..p0+S−1 inside the P positions with mean
    μ + m(p) there. The same tokens shuffled across positions have no profile; S > P is refused in
    one line, and :position=none draws exactly what the spec without the profile draws."""
    from scenarios.fitted import head_model, load_spec
    gen = np.random.default_rng(8)
    p, seg, n = 3 * DIM, 256, 2048
    positions = np.arange(n) % seg
    truth = known_profile(positions, p, seg)
    x = truth + gen.standard_normal((n, p))
    k, v, q = (x[None, None, :, i * DIM:(i + 1) * DIM] for i in range(3))
    path = write_capture(tmp_path / "pos.npz", k, v, q, segment_len=seg)
    spec = fit_capture(load_capture(path), fit_fraction=1.0)
    head = spec["layers"][0]["heads"][0]
    model = head_model(head)
    assert model.position_mean is not None and model.position_mean[0] == seg
    fitted = model.mean + model.deviation(np.arange(seg))
    true_mean = known_profile(np.arange(seg), p, seg) + 0.0
    # each position's mean is known from 8 tokens (sd 1/√8 = 0.35); a smooth fit does far better
    assert np.sqrt(np.mean((fitted - true_mean) ** 2)) < 0.35 / 2
    assert np.abs(np.diag(model.cov) - 1).max() < 0.15            # the noise's variance, not the profile's
    shuffled = x[gen.permutation(n)]
    k, v, q = (shuffled[None, None, :, i * DIM:(i + 1) * DIM] for i in range(3))
    flat = write_capture(tmp_path / "flat.npz", k, v, q, segment_len=seg)
    assert "position_mean" not in fit_capture(load_capture(flat), fit_fraction=1.0)["layers"][0]["heads"][0]

    spec_path = tmp_path / "pos.json"
    spec_path.write_text(json.dumps(spec))
    s = 64
    shape = TrialShape(n_heads=1, seq_len=s, n_queries=8, dim=DIM, n_calib=16)
    scenario = scenarios.create(f"fitted:{spec_path}", heads="first", order="iid")
    sums, counts = np.zeros((seg, DIM)), np.zeros(seg)
    for trial in range(300):
        draw = scenario.draw(lambda *labels, t=trial: generator("pcg64", t, *labels), shape)
        pos = draw["positions"]
        assert np.array_equal(pos, pos[0] + np.arange(s)) and 0 <= pos[0] <= seg - s
        sums[pos] += draw["k"][0]
        counts[pos] += 1
    seen = counts >= 30
    drawn = sums[seen] / counts[seen, None]
    np.testing.assert_allclose(drawn, fitted[seen, :DIM], atol=5 / math.sqrt(30))
    too_long = TrialShape(n_heads=1, seq_len=seg + 1, n_queries=8, dim=DIM, n_calib=16)
    with pytest.raises(ValueError, match=rf"seq_len {seg + 1} exceeds the {seg} positions.*position=none"):
        scenario.check_shape(too_long)
    without = json.loads(spec_path.read_text())
    del without["layers"][0]["heads"][0]["position_mean"]
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(without))
    streams = lambda *labels: generator("pcg64", 3, *labels)  # noqa: E731
    a = scenarios.create(f"fitted:{spec_path}:position=none", heads="first").draw(streams, shape)
    b = scenarios.create(f"fitted:{plain}", heads="first").draw(streams, shape)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
    assert load_spec(spec_path).token_model(0, 0).position_mean is not None
