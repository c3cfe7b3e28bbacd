"""NVIDIA kvpress presses as kvharness codecs: `kvpress:<PressClass>`, e.g. `kvpress:SnapKVPress`.

Registered as the namespace `kvpress` (schemes.registry.register_namespace) when the package
is importable (`pip install 'kvharness[kvpress]'`); the import (kvpress pulls in transformers,
seconds) happens on first use of a `kvpress:` name or of the full listing, never for a built-in.

How a press codes one cache (every trial on its own, so no press sees two trials at once):
1. A one-layer model is built around the cache: a minimal attention module whose config carries
   the heads and head dim (num_attention_heads = num_key_value_heads = H: one query head per
   KV head, as the scenarios draw them; head_dim = d; one hidden layer), and no RoPE: position
   embeddings cos = 1, sin = 0, and a `rotary_emb` that returns them for any position. The
   scenario's keys and queries are used as given (post-RoPE where the scenario applies RoPE),
   so a press's rotation steps are identities.
2. Hidden states, (1, S, 2·H·d), carry per token its query and its key: q_proj and k_proj are
   identity blocks that give them back, so the module's queries are exactly the prefill
   queries and its (pre-RoPE) keys exactly the cache's keys. The prefill queries are the
   queries of the cached tokens themselves, which the runner draws from the scenario's query
   law on streams of their own (`q_prefill`); never the evaluated queries, which a
   question-agnostic press does not see (kvpress compresses the context before the question
   arrives). Called without them (the conformance suite), the keys stand in, as h2o's
   observers do.
3. `attentions`, (1, H, S, S), the causal softmax of those queries against the keys, is given
   to the presses that require eager attention weights (NEEDS_ATTENTIONS); the others get None
   and compute what they read (SnapKV's window, TOVA's last query) from the same queries.
4. The press's own `compress` runs at the compression ratio that keeps the budget's share of
   tokens: kept fp16 tokens cost 16 bits per element, so budget b keeps n = round(S·b/16)
   (schemes.baselines.kept_tokens, as h2o and streaming); ratio r = 1 − (n + ½)/S makes
   kvpress's int(S·(1 − r)) equal n exactly (r = 0, nothing pruned, when n = S). A press that
   sizes its cache otherwise (PyramidKV's layer budget) keeps what it keeps: the ledger counts it.
5. The kept tokens are found by matching what compress returned against the input (a press
   only gathers: each returned (key, value) pair equals an input pair exactly; one that edits
   or merges tokens is refused). Ties between identical tokens take the earliest free index.

Stored (schemes.baselines.Eviction, all per cache): the kept K and V in fp16 after a per-trial
power-of-two shift (int16, counted), and their indices (int16, int32 past 32767 tokens).
`kept(enc)` names them, so the runner computes evicted_mass and the kept-token metrics as for
h2o and streaming. A press's `seed` field (RandomPress) is set from the scheme's seed, and a
press that draws from torch's global generator draws from a fork of it seeded likewise.
Presses that cannot run on synthetic tensors are listed by `unavailable()` with the reason
(`harness list --all`).
"""
from __future__ import annotations

import functools
import inspect
import math
import re
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from .base import Capabilities, Encoded
from .baselines import Eviction, kept_tokens
from .fp16 import half_shift, shift_down
from .registry import SchemeSpec, register_namespace

PREFIX = "kvpress"
INSTALL = "kvpress is not installed: pip install 'kvharness[kvpress]'"

# Presses whose score asserts eager attention weights (kvpress: 'Requires attn_implementation="eager"').
NEEDS_ATTENTIONS = frozenset({"ObservedAttentionPress"})

# Presses that cannot code a synthetic cache, with the reason (kvpress 0.5.5). Every other
# press class that kvpress exports and that builds with only a compression ratio is bridged.
NOT_RUNNABLE = {
    "QFilterPress": "needs the Q-filters trained for a named model (downloaded from the Hugging Face hub)",
    "KVzapPress": "needs the KVzap scoring model trained for a named model (downloaded from the hub)",
    "ExpectedAttentionStatsPress": "needs query statistics computed for a named model (downloaded from the hub)",
    "DuoAttentionPress": "needs per-head streaming patterns of a named model (downloaded, or computed on a data set)",
    "KVzipPress": "reconstructs the context through a real model forward with its tokenizer",
    "KVgradPress": "reconstructs the context through a real model forward with gradients",
    "RestoreKVPress": "needs restore embeddings of a named model (downloaded from the hub) and a model forward",
    "FastKVzipPress": "needs gate weights trained for a named model (downloaded from the hub)",
    "FinchPress": "needs the model's tokenizer and a delimiter token between context and question",
    "KVComposePress": "scores every layer and head of a real model together (model-level, not per cache)",
    "CAMPress": "a decoding-time press: merges values while tokens are generated, not a prefill eviction",
    "ThinKPress": "prunes key channels, not tokens: not an eviction of cached tokens",
    "SimLayerKVPress": "keeps all tokens or a fixed window per layer by a lazy-layer test on a model's layers: "
                       "no compression ratio to set from the budget",
    "DMSPress": "needs a model trained with dynamic memory sparsification (DMS) scores",
    "LUKVPress": "needs a budget curve fitted for a named model and its layers",
}


# --- the one-layer model around a cache ---------------------------------------------------
def _no_rope(x: torch.Tensor, n: int):
    """cos = 1, sin = 0 of shape (1, n, d): rotation by angle 0 (the bridge's model has no RoPE)."""
    shape = (1, n, x.shape[-1])
    return torch.ones(shape, dtype=x.dtype, device=x.device), torch.zeros(shape, dtype=x.dtype, device=x.device)


class _IdentityRotary(torch.nn.Module):
    """A rotary embedding of angle 0 for every position (kvpress reads module.rotary_emb)."""

    def __init__(self, dim: int):
        super().__init__()
        self.register_buffer("inv_freq", torch.zeros(dim // 2), persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        return _no_rope(x, position_ids.shape[-1])


class _Slice(torch.nn.Module):
    """A projection that picks features [start, stop) of the hidden states (an identity block)."""

    def __init__(self, start: int, stop: int):
        super().__init__()
        self.start, self.stop = start, stop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[..., self.start:self.stop]


class _Attention(torch.nn.Module):
    """What a press reads of a Llama-like attention layer: config (heads, head dim, layers),
    layer_idx, head_dim, rotary_emb, and q_proj / k_proj that give back the queries and the keys
    the hidden states carry (hidden = [queries | keys] per token, each H·d features)."""

    def __init__(self, config, n_heads: int, dim: int):
        super().__init__()
        self.config = config
        self.layer_idx = 0
        self.head_dim = dim
        self.num_key_value_groups = 1
        self.scaling = dim ** -0.5
        self.q_proj = _Slice(0, n_heads * dim)
        self.k_proj = _Slice(n_heads * dim, 2 * n_heads * dim)
        self.rotary_emb = _IdentityRotary(dim)


@functools.lru_cache(maxsize=16)
def _module(n_heads: int, dim: int) -> _Attention:
    """The attention module for H heads of dim d (stateless for the bridged presses: shared)."""
    from transformers import LlamaConfig
    config = LlamaConfig(hidden_size=2 * n_heads * dim, num_attention_heads=n_heads, num_key_value_heads=n_heads,
                         head_dim=dim, num_hidden_layers=1, intermediate_size=1, vocab_size=1)
    config._attn_implementation = "sdpa"
    return _Attention(config, n_heads, dim)


def causal_attention(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """softmax(q·kᵀ/√d) with query i seeing keys 0..i (a prefill's eager attention weights):
    queries, keys (B, H, S, d) -> (B, H, S, S)."""
    s = keys.shape[-2]
    logits = queries @ keys.transpose(-1, -2) / math.sqrt(keys.shape[-1])
    future = torch.ones(s, s, dtype=torch.bool, device=keys.device).triu(1)
    return torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)


def compression_ratio(s: int, n_keep: int) -> float:
    """The ratio r at which kvpress keeps exactly n_keep of s tokens: int(s·(1 − r)) = n_keep."""
    return 0.0 if n_keep >= s else 1.0 - (n_keep + 0.5) / s


def token_signatures(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """int64 (B, H, S): a hash of the bits of each token's (key, value) pair, keys, values (B, H, S, d).
    Σ bits·w over the pair's 32-bit words (16-bit for half types) in unsigned 64-bit arithmetic,
    which wraps by definition and is exact in any order, so a token hashes alike in a batch of
    any size on any BLAS (a float projection does not: MKL's gemv rounds a row differently by the
    number of rows on some CPUs). Random odd 64-bit weights: two distinct tokens collide with
    probability about 2^-64 (then the exact check refuses the match)."""
    x = torch.cat((keys, values), -1).detach().contiguous().cpu()
    word = torch.int16 if x.element_size() == 2 else torch.int32
    words = x.view(word).numpy().astype(np.uint64)       # sign-extended, reinterpreted: still exact
    weights = np.random.default_rng(0).integers(0, 2 ** 64, size=words.shape[-1], dtype=np.uint64, endpoint=False) | np.uint64(1)
    return torch.from_numpy((words * weights).sum(-1, dtype=np.uint64).view(np.int64)).to(keys.device)


def match_tokens(keys: torch.Tensor, values: torch.Tensor, kept_keys: torch.Tensor,
                 kept_values: torch.Tensor) -> torch.Tensor:
    """Indices (B, H, n) of the input tokens that compress returned: keys, values (B, H, S, d),
    kept_* (B, H, n, d). Matched on an exact hash of each (key, value) pair's bits
    (token_signatures), then checked exactly; identical tokens take distinct indices, earliest
    first. ValueError when a returned token is not an input token (the press edited or merged
    tokens)."""
    d = keys.shape[-1]
    sig_in = token_signatures(keys, values)             # (B, H, S)
    sig_out = token_signatures(kept_keys, kept_values)  # (B, H, n)
    order = torch.sort(sig_in, dim=-1, stable=True)
    out_sorted = torch.sort(sig_out, dim=-1, stable=True)
    # rank of each returned token among the returned tokens with its signature (duplicates)
    first = torch.searchsorted(out_sorted.values.contiguous(), out_sorted.values.contiguous(), right=False)
    rank = torch.empty_like(first).scatter_(-1, out_sorted.indices,
                                           torch.arange(first.shape[-1], device=first.device) - first)
    pos = torch.searchsorted(order.values.contiguous(), sig_out.contiguous(), right=False) + rank
    pos = pos.clamp(max=keys.shape[-2] - 1)
    idx = torch.gather(order.indices, -1, pos)
    gather = idx[..., None].expand(-1, -1, -1, d)
    if not (torch.equal(keys.gather(2, gather), kept_keys) and torch.equal(values.gather(2, gather), kept_values)):
        raise ValueError("the press returned tokens that are not input tokens (it edits or merges tokens)")
    return idx


# --- the codec ---------------------------------------------------------------------------
@dataclass
class KvpressScheme(Eviction):
    """A kvpress press as an evicting codec (module docstring): the press's own compress picks
    the kept tokens of each (trial, head); they are stored in fp16 with their indices."""
    capabilities: ClassVar[Capabilities] = Capabilities(prefill_queries=True)  # the press observes the prefill's queries
    press_class: type | None = None
    press_options: dict = field(default_factory=dict)

    def validate(self) -> None:
        super().validate()
        if self.press_class is None:
            raise ValueError(f"{self.name}: no press class")
        names = set(inspect.signature(self.press_class).parameters)
        unknown = sorted(set(self.press_options) - names)
        if unknown:
            raise ValueError(f"{self.name}: unknown press option(s) {', '.join(unknown)}; valid: "
                             f"{', '.join(sorted(names - {'compression_ratio'}))}")

    def check_cache(self, seq_len: int) -> None:
        """ValueError when the press cannot code a cache of seq_len tokens (SnapKV's 64-token
        window needs more than 64): tried on one random cache of that length, as the sweep will."""
        g = torch.Generator().manual_seed(0)
        k, v = (torch.randn(1, 1, seq_len, self.dim, generator=g) for _ in range(2))
        self.press_index(k, v)

    def make_press(self, s: int):
        """The press for a cache of s tokens at this budget."""
        options = dict(self.press_options)
        if "seed" in inspect.signature(self.press_class).parameters:
            options.setdefault("seed", self.seed)
        return self.press_class(compression_ratio=compression_ratio(s, kept_tokens(s, self.budget)), **options)

    def press_index(self, k: torch.Tensor, v: torch.Tensor, queries: torch.Tensor | None = None) -> torch.Tensor:
        """Kept token positions (B, H, n_keep), ascending, as the press chooses them, trial by trial."""
        b, h, s, d = k.shape
        module = _module(h, d)
        press = self.make_press(s)
        eager = self.press_class.__name__ in NEEDS_ATTENTIONS
        out = []
        for t in range(b):
            # ordinary data have shift 0 (used as is); 1e30-sized data are scaled by a power of two
            keys = shift_down(k[t:t + 1], half_shift(k[t:t + 1]))
            values = shift_down(v[t:t + 1], half_shift(v[t:t + 1]))
            q = keys if queries is None else queries[t:t + 1].to(k.dtype)
            hidden = torch.cat((q, keys), -1).transpose(1, 2).reshape(1, s, 2 * h * d)   # [queries | keys]
            cos, sin = _no_rope(q, q.shape[2])
            kwargs = {"hidden_states": hidden, "position_embeddings": (cos, sin),
                      "cache_position": torch.arange(s, device=k.device),
                      "position_ids": torch.arange(s, device=k.device)[None], "attention_mask": None}
            attentions = causal_attention(q, keys) if eager else None
            # a press that draws from torch's global generator (LeverageScorePress's sketch) draws
            # from a fork of it seeded by the scheme: reproducible, and the caller's state untouched
            cuda = [k.device] if k.device.type == "cuda" else []
            with torch.no_grad(), torch.random.fork_rng(devices=cuda):
                torch.default_generator.manual_seed(self.seed)   # the generators fork_rng forked
                if cuda:
                    torch.cuda.manual_seed(self.seed)
                try:
                    kept_k, kept_v = press.compress(module, hidden, keys, values, attentions, kwargs)
                except AssertionError as exc:   # kvpress validates with assert
                    raise ValueError(f"{self.name} on a cache of {s} tokens: {exc}") from None
            if kept_k.shape[:2] != (1, h) or kept_k.shape[-1] != d:
                raise ValueError(f"{self.name}: compress returned keys of shape {tuple(kept_k.shape)}, "
                                 f"not (1, {h}, n, {d}): not a token eviction")
            out.append(match_tokens(keys, values, kept_k, kept_v).sort(-1).values)
        if len({x.shape[-1] for x in out}) > 1:
            raise ValueError(f"{self.name}: the press kept different numbers of tokens in the trials of one batch")
        return torch.cat(out)

    def encode(self, k, v, queries=None):
        """Encode k, v (B, H, S, d); queries (B, H, S, d): the prefill queries of the cached tokens
        (the runner's q_prefill), the keys when None."""
        enc = Encoded(tuple(k.shape), k.dtype)
        idx = self.press_index(k, v, queries)
        dtype = torch.int16 if k.shape[2] <= torch.iinfo(torch.int16).max else torch.int32
        enc.codes["index"] = idx.to(dtype)
        self.store_kept(enc, k, v, idx)
        return enc

    def stored_index(self, enc):
        return enc.codes["index"].to(torch.int64)


# --- the namespace -----------------------------------------------------------------------
def _first_line(cls) -> str:
    lines = [x.strip() for x in (cls.__doc__ or "").strip().splitlines() if x.strip()]
    return lines[0] if lines else cls.__name__


def _factory(cls, name: str, description: str):
    def make(*, budget: int, dim: int, seed: int = 0, **options):
        scheme = KvpressScheme(budget=budget, dim=dim, seed=seed, press_class=cls, press_options=options)
        scheme.name = name
        return scheme
    make.__doc__ = description
    return make


def press_classes() -> dict[str, type]:
    """Every press class kvpress exports (BasePress subclasses, the abstract bases left out)."""
    import kvpress
    from kvpress.presses.base_press import BasePress
    from kvpress.presses.scorer_press import ScorerPress
    out = {}
    for attr in kvpress.__all__:
        cls = getattr(kvpress, attr)
        if isinstance(cls, type) and issubclass(cls, BasePress) and cls not in (BasePress, ScorerPress):
            out[attr] = cls
    return out


def _builds_alone(cls) -> str | None:
    """None when the press builds from a compression ratio alone, else why not."""
    params = inspect.signature(cls).parameters
    # a parameter naming a press (press, presses, base_press, ...) with nothing in it by default
    wrapped = [name for name, p in params.items() if re.fullmatch(r"([a-z]\w*_)?press(es)?", name)
               and (p.default is p.empty or p.default is None)]
    if wrapped:
        return f"wraps another press ({', '.join(wrapped)}): not a codec on its own"
    required = [name for name, p in params.items() if p.default is p.empty
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if required:
        return f"needs {', '.join(required)} besides a compression ratio"
    if "compression_ratio" not in params:
        return "has no compression ratio to set from the budget"
    return None


def load() -> tuple[dict[str, SchemeSpec], dict[str, str]]:
    """(specs of the runnable presses, {name: reason} of the others); ImportError without kvpress."""
    specs, reasons = {}, {}
    for attr, cls in press_classes().items():
        name = f"{PREFIX}:{attr}"
        reason = NOT_RUNNABLE.get(attr) or _builds_alone(cls)
        if reason:
            reasons[name] = reason
            continue
        description = _first_line(cls)
        specs[name] = SchemeSpec(name, _factory(cls, name, description), description)
    return specs, reasons


register_namespace(PREFIX, load, INSTALL)
