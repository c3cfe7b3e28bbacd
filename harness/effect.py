"""End-to-end effect of a codec inside a real model: compress K and V in every attention block
and measure how the model's own output (the sentence embedding) moves, beside the harness
metrics of the same K, V and queries.

Inside the model: a forward hook on each attention's key projection computes that block's
Q and V from the same input (F.linear with the block's own weights, so no other hook runs),
encodes the (1, H, S, d) K and V of one passage with the layer's scheme, decodes them and
returns K̂; the value projection's hook returns the matching V̂. The model's attention then
scores q·K̂ᵀ (the decoded keys; a QJL estimator is not used inside the model). The scheme of
a layer is calibrated (fit) on K, V of that layer captured from calibration passages that
are disjoint from the held-out passages measured.

Embedding: mean of the last hidden states over tokens, L2-normalised, as sentence-transformers
does for all-MiniLM-L6-v2 (1_Pooling/config.json: pooling_mode_mean_tokens; Normalize module).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

PASSAGE_TOKENS = 256  # all-MiniLM-L6-v2's max_seq_length (sentence_bert_config.json)


@dataclass(frozen=True)
class Passages:
    calibration: list[list[int]]
    held_out: list[list[int]]


def default_passages(tokenizer, n_held_out: int = 16, n_calibration: int = 4) -> Passages:
    """Token ids of pydoc topics: calibration passages from the first half of the sorted topics,
    held-out passages from the second half (each topic one passage of ≤ PASSAGE_TOKENS tokens)."""
    from pydoc_data.topics import topics

    keys = sorted(topics)
    half = len(keys) // 2

    def pick(names, n):
        long_enough = [k for k in names if len(topics[k]) > 2000]  # skip stubs: passages of real length
        chosen = [long_enough[i] for i in np.linspace(0, len(long_enough) - 1, n).round().astype(int)]
        return [tokenizer(topics[k][:8 * PASSAGE_TOKENS], truncation=True, max_length=PASSAGE_TOKENS)["input_ids"]
                for k in chosen]
    return Passages(pick(keys[:half], n_calibration), pick(keys[half:], n_held_out))


def embed(model, ids) -> torch.Tensor:
    """Mean-pooled, L2-normalised last hidden state of one passage: (hidden,)."""
    import torch
    with torch.no_grad():
        ids = torch.as_tensor(ids, dtype=torch.long)[None]
        hidden = model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state[0]
    pooled = hidden.mean(dim=0)
    return pooled / pooled.norm()


class CompressedAttention:
    """Context manager: while active, every attention block's K and V pass through its scheme.

    schemes: one calibrated Scheme per attention site. After each block, the harness metrics
    of (K, V, Q) vs (K̂, V̂) are appended to `metrics` (dicts of floats) and the measured bits
    per element to `bits`.
    """

    def __init__(self, sites, layer_schemes):
        self.sites, self.schemes = sites, layer_schemes
        self.metrics: list[dict[str, float]] = []
        self.bits: list[float] = []
        self._pending_v = {}
        self._hooks = []

    def __enter__(self):
        for i, site in enumerate(self.sites):
            self._hooks.append(site.key.register_forward_hook(self._key_hook(i, site)))
            self._hooks.append(site.value.register_forward_hook(self._value_hook(i)))
        return self

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _key_hook(self, i, site):
        import torch.nn.functional as F

        from schemes.base import BitLedger, codec_logits, encode_codec
        from stats.metrics import exact_logits, trial_metrics

        def to_heads(x, n_heads):  # (B, N, H·d) -> (B, H, N, d)
            return x.reshape(x.shape[0], x.shape[1], n_heads, site.head_dim).transpose(1, 2).float()

        def hook(module, args, output):
            x = args[0]
            k = to_heads(output, site.n_kv_heads)
            v = to_heads(F.linear(x, site.value.weight, site.value.bias), site.n_kv_heads)
            q = to_heads(F.linear(x, site.query.weight, site.query.bias), site.n_heads)
            scheme = self.schemes[i]
            enc = encode_codec(scheme, k, v)
            k_hat, v_hat = scheme.decode(enc)
            group = site.n_heads // site.n_kv_heads
            q_kv = q[:, ::group]  # one query head per key/value head (the first of its group)
            logits_hat = codec_logits(scheme, q_kv, enc, k_hat, exact_logits)
            self.metrics.append({n: float(m[0]) for n, m in trial_metrics(k, v, q_kv, k_hat, v_hat, logits_hat,
                                                                         scheme.kept(enc)).items()})
            self.bits.append(float(BitLedger.per_trial(enc).bits_per_element.mean()))   # the sweep's ledger
            self._pending_v[i] = v_hat.transpose(1, 2).reshape(output.shape).to(output.dtype)
            return k_hat.transpose(1, 2).reshape(output.shape).to(output.dtype)
        return hook

    def _value_hook(self, i):
        def hook(module, args, output):
            v_hat = self._pending_v.pop(i)
            if v_hat.shape != output.shape:
                raise RuntimeError(f"attention block {i}: value output {tuple(output.shape)} does not match the "
                                   f"compressed V {tuple(v_hat.shape)}")
            return v_hat
        return hook


@dataclass(frozen=True)
class EffectRow:
    scheme: str
    budget: int
    bits_per_element: float
    rel_mse_k: float
    rel_mse_v: float
    rel_mse_t: float
    kl_attn: float
    emb_cos_mean: float
    emb_cos_min: float


def calibrated_schemes(name: str, budget: int, calibration: dict, sites, seed: int):
    """One scheme per attention site, fitted on that layer's calibration K, V (1, Hkv, n, d)."""
    return calibrated_per_layer([(name, budget)] * len(sites), calibration, sites, seed)


def calibrated_per_layer(settings: list[tuple[str, int]], calibration: dict, sites, seed: int):
    """Scheme settings[i] = (name, budget) at attention site i, fitted on that layer's calibration
    K, V; a layer's scheme is seeded by (seed, name, budget, d, layer), so the same (name, budget)
    at a layer is the same scheme in a uniform and in a per-layer setting."""
    import torch

    import schemes
    from kvcommon.rng import seed_sequence
    from schemes.base import fit_codec
    out = []
    for layer, (site, (name, budget)) in enumerate(zip(sites, settings)):
        layer_seed = int(seed_sequence(seed, "effect", name, budget, site.head_dim, layer).generate_state(1)[0])
        scheme = schemes.create(name, budget=budget, dim=site.head_dim, seed=layer_seed)
        fit_codec(scheme, torch.from_numpy(calibration["k"][layer][None]), torch.from_numpy(calibration["v"][layer][None]))
        out.append(scheme)
    return out


@dataclass(frozen=True)
class Measured:
    """One setting inside the model: the harness metrics averaged over layers and passages, the
    measured bits per element, and each held-out passage's embedding cosine."""
    metrics: dict
    bits_per_element: float
    cosines: list


def measure_settings(loaded, settings: dict[str, list[tuple[str, int]]], *, n_held_out: int = 16,
                     seed: int = 0) -> dict[str, Measured]:
    """Each named setting (a (scheme, budget) per attention site) inside the model, on the same
    calibration and held-out passages."""
    import torch

    from .capture import attention_sites, capture_segments

    model = loaded.model
    passages = default_passages(loaded.tokenizer, n_held_out=n_held_out)
    sites = attention_sites(model)
    calibration = capture_segments(model, passages.calibration)
    reference = [embed(model, ids) for ids in passages.held_out]
    out = {}
    for label, per_layer in settings.items():
        if len(per_layer) != len(sites):
            raise ValueError(f"setting {label}: {len(per_layer)} layers, the model has {len(sites)} attention blocks")
        layer_schemes = calibrated_per_layer(per_layer, calibration, sites, seed)
        with CompressedAttention(sites, layer_schemes) as patched:
            cosines = [float(torch.dot(embed(model, ids), ref)) for ids, ref in zip(passages.held_out, reference)]
        mean = {key: float(np.mean([m[key] for m in patched.metrics]))
                for key in ("rel_mse_k", "rel_mse_v", "rel_mse_t", "kl_attn")}
        out[label] = Measured(mean, float(np.mean(patched.bits)), cosines)
    return out


def measure_effect(loaded, scheme_names: list[str], budgets: list[int], *, n_held_out: int = 16,
                   seed: int = 0) -> list[EffectRow]:
    """One row per (scheme, budget): harness metrics averaged over layers and held-out passages,
    and the cosine of each passage's embedding to the uncompressed model's (mean and minimum)."""
    from .capture import attention_sites

    n_sites = len(attention_sites(loaded.model))
    keys = [(name, budget) for name in scheme_names for budget in budgets]
    measured = measure_settings(loaded, {f"{n} b={b}": [(n, b)] * n_sites for n, b in keys}, n_held_out=n_held_out,
                                seed=seed)
    return [EffectRow(n, b, m.bits_per_element, **m.metrics, emb_cos_mean=float(np.mean(m.cosines)),
                      emb_cos_min=float(np.min(m.cosines))) for (n, b), m in zip(keys, measured.values())]


def format_effect(rows: list[EffectRow]) -> str:
    header = (f"{'scheme':<10} {'budget':>6} {'bits/el':>8} {'relMSE_K':>9} {'relMSE_V':>9} {'relMSE_T':>9} "
              f"{'KL_attn':>9} {'emb_cos':>8} {'emb_cos_min':>11}")
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r.scheme:<10} {r.budget:>6} {r.bits_per_element:>8.3f} {r.rel_mse_k:>9.4f} {r.rel_mse_v:>9.4f} "
                     f"{r.rel_mse_t:>9.4f} {r.kl_attn:>9.4f} {r.emb_cos_mean:>8.5f} {r.emb_cos_min:>11.5f}")
    return "\n".join(lines)
