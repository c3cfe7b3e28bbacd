"""The known-answer benchmark of the verdict rule (`harness selftest`): cases whose right answer
is known, run through the commands users run, and the rate at which the rule gives it.

Bugs. Each is a wrapper around a real built-in codec (BuggedScheme), registered for the
benchmark only (schemes.registry.registered) as `bug:<name>/<codec>`, seeded like the codec it
wraps (its seed family), so that it draws the same rotations and sketches on the same data. The
bug lies in the wrapper's pre-processing of the input, in a constructor constant, in entries of
the codec's own Encoded changed before the codec decodes them, or in post-processing of what the
codec decoded: every decoded tensor comes from the wrapped codec. Each bug is modelled on a real
kind of KV-quantiser bug and has a stated SIZE (a fraction of tokens, channels or trials, a
factor's error, a width), run at that size; at its `neutral` size it is no bug (identical
output, tests/test_known_answers.py). The right answer (Bug.target): `codec-difference`, from
`harness validate --scheme CODEC --against bug:NAME/CODEC` (null: a seed change of each), except
for the bugs too small to matter (a scale or table stored at too low a precision), whose right
answer is `negligible`: significant, and shown inside every margin. One bug changes only the
spread (uneven-calls: each trial's K error 1 ± 5 % times the codec's, the signs balanced by
construction, at the codec's storage).

Designs (PLUGIN_DESIGNS). Every bug runs three ways: in-process as above, and installed as the
entry points of a package (kvcommon.plugins.installed; loaded as every plug-in is), once as
`plug:NAME/CODEC`, which declares CODEC's seed family (schemes.registry.plugin_family) and so
draws CODEC's rotations and sketches (its rows are the in-process ones, which the benchmark
checks), and once as `plug-own:NAME/CODEC`, which declares none and draws its own: the paired
differences then carry the two codecs' independent draws, and small bugs are found less often.

Harmless changes. A change of an implementation variable that must not be called a codec
difference: dtype, RNG family, reference implementation and seed through `harness validate
--vary X` (tq-kv); torch thread count, chunk size ($KVHARNESS_CHUNK_TRIALS), worker count
(--workers 2) and trial order (an interrupted run resumed) through `harness run` twice and
`harness compare A B --null C` with C the run at seed + 1. The right answer: anything but
`codec-difference` or `implementation-discrepancy` (one codec on both sides: a flagged difference
is the implementations').

Seed-only compare. Three runs of the ten codecs of SEED_CODECS × b = 2, 3, 4 (heavy_tail, d = 64,
S = 256, 30 trials) at seeds r, r + 1, r + 2 and `harness compare A B --null C`: the right
answer is no `codec-difference` in any of the 30 cells.

Every case calls the command's own `run` in this process (the argparse namespace its parser
builds, its JSON output captured), so the bugged codecs registered here are visible to it;
repetition i uses root seed ROOT_SEED + 10·i. Targets: a rate of at least TARGET (95 %) in-process
(the plug-in designs' rates are stated beside it).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import math
import os
import platform
import subprocess
import tempfile
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

import schemes
from kvcommon.rng import generator
from schemes.base import Capabilities, Encoded, Scheme, encode_codec, fit_codec
from schemes.registry import SchemeSpec, registered, seed_family
from stats.validation import FLAGGED

TARGET = 0.95
ROOT_SEED = 1
SEED_CODECS = ("plain-kv", "tq-kv", "tq-qkv", "sq-kv", "sq-qkv", "int4", "kivi", "h2o", "streaming", "svd")


# --- the bugged codecs -------------------------------------------------------------------
NARROW = "narrow."


def _clone(enc: Encoded) -> Encoded:
    """A copy of enc with every tensor copied: the codec's memos (schemes.base, turboquant) are
    keyed by the identity of code tensors, so a changed copy is decoded afresh and never
    changes what the clean codec's cells share."""
    return Encoded(enc.shape, enc.dtype, {k: t.clone() for k, t in enc.codes.items()},
                   {k: t.clone() for k, t in enc.side.items()}, dict(enc.exact_bits), set(enc.model))


@dataclass(frozen=True)
class Bug:
    """A bug modelled on a real one, written as hooks around the codec `wrapped`; each hook takes
    the BuggedScheme `w` (w.size, w.inner, w.narrow, w.trials, ...):
    pre(w, k, v) -> (k, v): the input the codec encodes; fit(w, k_cal, v_cal) -> (k_cal, v_cal);
    patch(w, enc, k, v): changes enc (a copy of the codec's Encoded) in place before it is
    returned; post(w, enc, k_hat, v_hat) -> (k_hat, v_hat); logits(w, q, enc, logits) -> logits;
    options(size) -> constructor options of the codec (a changed constant). narrow: the codec at
    b − 1 bits is built too (w.narrow). size: the size the benchmark runs; neutral: the size at
    which the wrapper is the codec itself."""
    name: str
    wrapped: str
    size: float
    unit: str
    modelled_on: str
    pre: Callable | None = None
    fit: Callable | None = None
    patch: Callable | None = None
    post: Callable | None = None
    logits: Callable | None = None
    options: Callable | None = None
    narrow: bool = False
    neutral: float = 0.0
    scenario: str = "gaussian"
    budget: int = 2
    target: str = "codec-difference"    # the right verdict; `negligible` for a bug too small to matter

    @property
    def scheme(self) -> str:
        return f"bug:{self.name}/{self.wrapped}"

    def plugin(self, shares: bool) -> str:
        """Its name as an entry-point plug-in (PLUGIN_DESIGNS): `plug:` declares the wrapped codec's
        seed family, `plug-own:` declares none."""
        return f"{'plug' if shares else 'plug-own'}:{self.name}/{self.wrapped}"

    def at(self, size: float) -> "Bug":
        return dataclasses.replace(self, size=size)


@dataclass
class BuggedScheme(Scheme):
    """The codec `bug.wrapped` with `bug` in its pre- or post-processing (Bug). Scores through
    decode unless the codec scores on its codes or the bug changes the logits."""
    bug: Bug | None = None

    def __post_init__(self):
        if self.bug is None:
            raise ValueError("BuggedScheme needs a bug")
        self.trials = None

    def validate(self) -> None:
        """The wrapped codecs, built here, once the configuration is whole: `build` sets the RNG
        family (Scheme.rng) after the constructor, so the wrapped codecs draw from the run's."""
        super().validate()
        options = self.bug.options(self.bug.size) if self.bug.options else {}
        self.inner = schemes.create(self.bug.wrapped, budget=self.budget, dim=self.dim, seed=self.seed,
                                    rng=self.rng, **options)
        self.narrow = None
        if self.bug.narrow:
            if self.budget < 2:
                raise ValueError(f"{self.bug.scheme}: budget {self.budget} leaves no narrower width; valid: 2..8")
            self.narrow = schemes.create(self.bug.wrapped, budget=self.budget - 1, dim=self.dim, seed=self.seed,
                                         rng=self.rng)
        if self.inner.capabilities.scores_on_codes and self.bug.post and not self.bug.logits:
            raise ValueError(f"{self.bug.scheme}: a post-processing bug on a codec that scores on its codes "
                             f"would leave its logits clean")

    @property
    def size(self) -> float:
        return self.bug.size

    def check_cache(self, seq_len: int) -> None:
        self.inner.check_cache(seq_len)

    def diagnostics(self):
        return self.inner.diagnostics()

    def fit(self, k_cal, v_cal, trials=None):
        self.trials = None if trials is None else [int(t) for t in torch.as_tensor(trials).tolist()]
        if self.bug.fit:
            k_cal, v_cal = self.bug.fit(self, k_cal, v_cal)
        for codec in (self.inner, self.narrow):
            if codec is not None:
                fit_codec(codec, k_cal, v_cal, trials)
        return self

    def trial_indices(self, n_trials: int) -> list[int]:
        return self.trials if self.trials is not None and len(self.trials) == n_trials else list(range(n_trials))

    def encode(self, k, v, positions=None, queries=None):
        if self.bug.pre:
            k, v = self.bug.pre(self, k, v)
        enc = encode_codec(self.inner, k, v, positions, queries)
        if self.bug.patch:
            enc = _clone(enc)
            self.bug.patch(self, enc, k, v)
        return enc

    def decode(self, enc):
        k_hat, v_hat = self.inner.decode(enc)
        if self.bug.post:
            k_hat, v_hat = self.bug.post(self, enc, k_hat, v_hat)
        return k_hat, v_hat

    @property
    def capabilities(self) -> Capabilities:
        """The wrapped codec's, but for the trial indices (which a bug may read, and which the
        wrapper hands on where the codec takes them), the decode-token path (not wrapped: the
        tokens after the prefill are coded with the whole cache) and scoring on the codes where
        the bug changes the logits."""
        inner = self.inner.capabilities
        return dataclasses.replace(inner, fit_trials=True, decode_tokens=False,
                                   scores_on_codes=inner.scores_on_codes or self.bug.logits is not None)

    def score(self, q, enc):
        if self.inner.capabilities.scores_on_codes:
            logits = self.inner.score(q, enc)
        else:
            logits = q @ self.decode(enc)[0].transpose(-1, -2) / math.sqrt(self.dim)
        return self.bug.logits(self, q, enc, logits) if self.bug.logits else logits

    def kept(self, enc):
        return self.inner.kept(enc)


def spec_of(bug: Bug) -> SchemeSpec:
    """The registry entry of a bugged codec: seeded as the codec it wraps (its seed family)."""
    def make(*, budget: int, dim: int, seed: int = 0, **options) -> Scheme:
        scheme = BuggedScheme(budget=budget, dim=dim, seed=seed, bug=bug, **options)
        scheme.name = bug.scheme
        return scheme
    return SchemeSpec(bug.scheme, make, f"{bug.wrapped} with a known bug: {bug.modelled_on}",
                      seed_family(bug.wrapped))


def registered_bugs(bugs):
    """Context: the bugged codecs registered for the block only (schemes.registry.registered)."""
    return registered([spec_of(b) for b in bugs])


# --- the bugged codecs as an installed third-party package --------------------------------
PLUGIN_PACKAGE = "kvharness-known-bugs"
# the design of each bug case: the bugged codec's name in it and whether it shares the codec's draws
PLUGIN_DESIGNS = {"in-process": None, "plug-in, shared draws": True, "plug-in, own draws": False}
INSTALLED = types.SimpleNamespace()   # the installed package's factories, read by EntryPoint.load


def plugin_factory(bug: Bug, shares: bool):
    """The factory a third-party package would publish for `bug`: the same BuggedScheme, which
    declares the wrapped codec's seed family (`seed_family`, schemes.registry.plugin_family) when
    it shares its draws and nothing otherwise (it then draws under its own name)."""
    name = bug.plugin(shares)

    def make(*, budget: int, dim: int, seed: int = 0, **options) -> Scheme:
        scheme = BuggedScheme(budget=budget, dim=dim, seed=seed, bug=bug, **options)
        scheme.name = name
        return scheme
    make.__doc__ = f"{bug.wrapped} with a known bug, as a plug-in: {bug.modelled_on}"
    if shares:
        make.seed_family = seed_family(bug.wrapped)
    return make


@contextlib.contextmanager
def installed_bugs(bugs):
    """Context: the bugged codecs installed as the entry points of one package
    (kvcommon.plugins.installed), each twice: `plug:NAME/CODEC`, which declares CODEC's seed family,
    and `plug-own:NAME/CODEC`, which does not. They load the way every plug-in loads
    (schemes.registry), from harness.known_answers.INSTALLED; on exit nothing stays."""
    from kvcommon import plugins
    from schemes.registry import ENTRY_POINT_GROUP, reload_plugins
    points = {}
    for bug in bugs:
        for shares in (True, False):
            attribute = f"{'shared' if shares else 'own'}_{bug.name}_{bug.wrapped}".replace("-", "_")
            setattr(INSTALLED, attribute, plugin_factory(bug, shares))
            points[bug.plugin(shares)] = f"{__name__}:INSTALLED.{attribute}"
    try:
        with plugins.installed(PLUGIN_PACKAGE, ENTRY_POINT_GROUP, points):
            reload_plugins()
            yield
    finally:
        reload_plugins()
        INSTALLED.__dict__.clear()


# --- building blocks of the bugs -----------------------------------------------------------
def spaced(n: int, fraction: float, device=None) -> torch.Tensor:
    """Bool (n,): round(n·fraction) evenly spaced positions (at least one for a positive
    fraction): a hard-coded set, the same in every trial."""
    count = min(n, max(1, round(n * fraction))) if fraction > 0 else 0
    mask = torch.zeros(n, dtype=torch.bool, device=device)
    if count:
        mask[((torch.arange(count) + 0.5) * n / count).long().clamp_(max=n - 1)] = True
    return mask


def _token_mask(enc_or_x, fraction: float) -> torch.Tensor:
    """(1, 1, S, 1) bool: the tokens a token-fraction bug touches."""
    s = enc_or_x.shape[2]
    return spaced(s, fraction)[None, None, :, None]


def _tokens(w, enc, k_hat, v_hat, wrong):
    """k_hat, v_hat with the bug's tokens (w.size of them) taken from wrong = (k, v)."""
    mask = _token_mask(enc, w.size).to(k_hat.device)
    return torch.where(mask, wrong[0], k_hat), torch.where(mask, wrong[1], v_hat)


def _decode_changed(w, enc, change) -> tuple[torch.Tensor, torch.Tensor]:
    """The codec's decoding of a copy of enc changed by change(copy)."""
    other = _clone(enc)
    change(other)
    return w.inner.decode(other)


def _repacked_signs(packed: torch.Tensor, dim: int, shift: int) -> torch.Tensor:
    from schemes.packing import pack_bits, unpack_codes
    bits = unpack_codes(packed, 1, dim).to(torch.int64)
    return pack_bits(torch.roll(bits, shift, dims=-1), 1)


def _quantile_rows(x: torch.Tensor, q: float) -> torch.Tensor:
    """The q-quantile over the tokens of each (trial, head) of x (B, H, S), shape (B, H, 1)."""
    return torch.quantile(x.double(), q, dim=-1, keepdim=True).to(x.dtype)


def _floor_input(w, k, v):
    """Input whose round-to-nearest codes in int4 are floor((x − min)/scale): every element but
    each group's min and max moved down by half a step, kept within [min, max] (so the group's
    min, max, scale and the fp16 shift stay as they were; the max keeps its rounded code)."""
    from schemes.baselines import _pad_last
    from schemes.fp16 import half_shift, shift_down, shift_up
    group, levels = w.inner.group_size, (1 << w.inner.width) - 1
    out = []
    for x in (k, v):
        shift = half_shift(x)
        xs = shift_down(x, shift)
        n = xs.shape[-1]
        grouped = _pad_last(xs, group).reshape(*xs.shape[:-1], -1, group)
        lo = grouped.amin(-1, keepdim=True).half().to(x.dtype)
        hi = grouped.amax(-1, keepdim=True)
        step = ((hi - lo) / levels).half().to(x.dtype)
        moved = torch.minimum(torch.maximum(grouped - step / 2, lo), hi)
        extreme = (grouped == grouped.amin(-1, keepdim=True)) | (grouped == hi)
        moved = torch.where(extreme, grouped, moved).reshape(*xs.shape[:-1], -1)[..., :n]
        mask = _token_mask(x, w.size).to(x.device)
        out.append(shift_up(torch.where(mask, moved, xs), shift))
    return tuple(out)


def _flaky_trials(w, n_trials: int) -> torch.Tensor:
    """Bool (B,): the trials that ran at the narrower width, drawn per trial index."""
    return torch.tensor([generator(w.rng, w.seed, "flaky", t).random() < w.size for t in w.trial_indices(n_trials)],
                        dtype=torch.bool)


def _narrow_patch(w, enc, k, v):
    """enc also holds the coding at the narrower width the bug decodes from, under NARROW keys and
    charged like the rest: a bugged codec's ledger is what it stores, so it passes the sweep's
    check that an encoding stands alone, and its verdicts are said at its (larger) storage."""
    narrow = w.narrow.encode(k, v)
    enc.add(Encoded(enc.shape, enc.dtype, {NARROW + key: t for key, t in narrow.codes.items()},
                    {NARROW + key: t for key, t in narrow.side.items()},
                    {NARROW + key: t for key, t in narrow.exact_bits.items()}, {NARROW + key for key in narrow.model}))


def _narrow_of(enc: Encoded) -> Encoded:
    """The narrower width's coding that _narrow_patch stored in enc."""
    def part(entries):
        return {key.removeprefix(NARROW): t for key, t in entries.items() if key.startswith(NARROW)}
    return Encoded(enc.shape, enc.dtype, part(enc.codes), part(enc.side), part(enc.exact_bits),
                   {key.removeprefix(NARROW) for key in enc.model if key.startswith(NARROW)})


def _narrow_width(w, enc, k_hat, v_hat):
    if w.size <= 0:
        return k_hat, v_hat
    return w.narrow.decode(_narrow_of(enc))[0], v_hat


def _flaky(w, enc, k_hat, v_hat):
    chosen = _flaky_trials(w, enc.shape[0]).to(k_hat.device)[:, None, None, None]
    k_n, v_n = w.narrow.decode(_narrow_of(enc))
    return torch.where(chosen, k_n, k_hat), torch.where(chosen, v_n, v_hat)


def _qjl_parts(w, enc):
    """(decoding, decoding without the QJL correction) of enc: decode is linear in the residual
    norm, so a scale error f of the correction gives mse + f·(full − mse)."""
    full = w.inner.decode(enc)
    mse = _decode_changed(w, enc, lambda e: e.codes.update(
        {k: torch.zeros_like(t) for k, t in e.codes.items() if k.endswith(".residual_norm")}))
    return full, mse


def _qjl_decode(w, enc, k_hat, v_hat):
    (k, v), (k0, v0) = _qjl_parts(w, enc)
    f = 1 - w.size
    return k0 + f * (k - k0), v0 + f * (v - v0)


def _without_qjl(enc: Encoded) -> Encoded:
    """A copy of enc whose QJL correction is zero (every residual norm 0)."""
    zero = _clone(enc)
    zero.codes.update({k: torch.zeros_like(t) for k, t in zero.codes.items() if k.endswith(".residual_norm")})
    return zero


def _qjl_logits(w, q, enc, logits):
    mse = w.inner.score(q, _without_qjl(enc))
    return mse + (1 - w.size) * (logits - mse)


# uneven-calls: the per-trial gain of K's QJL correction, stored with the codes
QJL_GAIN = "k.qjl_gain"


def call_signs(w, n_trials: int) -> torch.Tensor:
    """(B,) float64 ±1, one per trial: trials 2j and 2j + 1 take opposite signs, which of the two
    is + drawn per pair j, so the signs of every pair sum to zero whatever the data."""
    signs = []
    for t in w.trial_indices(n_trials):
        first_up = generator(w.rng, w.seed, "uneven-calls", t // 2).random() < 0.5
        signs.append(1.0 if first_up == (t % 2 == 0) else -1.0)
    return torch.tensor(signs, dtype=torch.float64)


def _uneven_patch(w, enc, k, v):
    """Stores, per trial, the gain g of K's QJL correction that makes the trial's K error
    ‖K − (K₀ + g·D)‖² equal (1 ± size) times the codec's (g = 1), with K₀ the decoding without the
    correction and D = K̂ − K₀ the correction: the quadratic ‖E₀ − g·D‖² = (1 ± size)·‖E₀ − D‖²,
    E₀ = K − K₀, solved for its root nearer g = 1. The QJL correction raises the MSE (it is unbiased
    for inner products, not MSE-optimal: ‖E₀ − g·D‖² is least at g* = ⟨E₀, D⟩/‖D‖² < 1), so both
    signs have a root while size ≤ 1 − min/‖E₀ − D‖²."""
    if w.size <= 0:
        return
    k_hat = w.inner.decode(enc)[0]
    k0 = w.inner.decode(_without_qjl(enc))[0]
    d, e0 = (k_hat - k0).double().flatten(1), (k - k0).double().flatten(1)
    dd, ed, ee = (d * d).sum(1), (e0 * d).sum(1), (e0 * e0).sum(1)
    target = (ee - 2 * ed + dd) * (1 + w.size * call_signs(w, len(dd)).to(dd.device))
    root = (ed * ed - dd * (ee - target)).clamp(min=0).sqrt()
    enc.codes[QJL_GAIN] = torch.where(dd > 0, (ed + root) / dd.clamp(min=1e-300), 1.0).to(torch.float32)


def _uneven_decode(w, enc, k_hat, v_hat):
    if QJL_GAIN not in enc.codes:
        return k_hat, v_hat
    k0 = w.inner.decode(_without_qjl(enc))[0]
    gain = enc.codes[QJL_GAIN].to(k_hat.dtype)[:, None, None, None]
    return k0 + gain * (k_hat - k0), v_hat


def _uneven_logits(w, q, enc, logits):
    if QJL_GAIN not in enc.codes:
        return logits
    mse = w.inner.score(q, _without_qjl(enc))
    return mse + enc.codes[QJL_GAIN].to(logits.dtype)[:, None, None, None] * (logits - mse)


def bf16_truncated(t: torch.Tensor) -> torch.Tensor:
    """float32 t cut to bfloat16's 8 significant bits by dropping its low 16 bits (rounding toward
    zero, as a conversion by bit shift does), still float32: each value smaller by less than 2⁻⁷
    of itself, never larger."""
    return (t.to(torch.float32).contiguous().view(torch.int32) & -65536).view(torch.float32).to(t.dtype)


def _bf16_norm(w, enc, k, v):
    """The norms of the fraction's tokens truncated to bfloat16 on their way to storage (stored
    as float32 as before, so the storage is the codec's)."""
    _rows_of(enc, "kv", "norm", lambda t: _masked_rows(t, w.size, bf16_truncated(t)))


def _fp16_codebook(w, enc, k, v):
    """The Lloyd–Max tables passed through float16 (still stored as float32): each centroid off
    by at most 2⁻¹¹ of itself."""
    if w.size > 0:
        for key in [k for k in enc.side if k.startswith("codebook.")]:
            enc.side[key] = enc.side[key].half().to(enc.side[key].dtype)


def _rows_of(enc, prefix: str, key: str, change):
    """enc.codes[prefix.key] changed by change(tensor) for K and V."""
    for p in prefix:
        name = f"{p}.{key}"
        enc.codes[name] = change(enc.codes[name])


def _masked_rows(x, fraction, value):
    """x (B, H, S, ...) with the fraction's tokens replaced by value (same shape or broadcast)."""
    mask = spaced(x.shape[2], fraction, x.device).reshape(1, 1, -1, *([1] * (x.dim() - 3)))
    return torch.where(mask, value, x)


def _clip(w, k, v):
    out = []
    for x in (k, v):
        bound = _quantile_rows(x.abs().flatten(2), 1 - w.size).unsqueeze(-1)   # (B, H, 1, 1)
        out.append(torch.maximum(torch.minimum(x, bound), -bound) if w.size > 0 else x)
    return tuple(out)


def _channel_mask(w, k, v):
    keep = ~spaced(k.shape[-1], w.size, k.device)
    return k * keep, v * keep


def _stale_codebook(w, enc, k, v):
    from schemes.lloyd_max import beta_codebook
    stale = round(w.dim * (1 + w.size))
    for key in [k for k in enc.side if k.startswith("codebook.")]:
        bits = int(key.split(".")[1].removesuffix("bit"))
        enc.side[key] = torch.tensor(beta_codebook(stale, bits).centroids, dtype=enc.side[key].dtype,
                                     device=enc.side[key].device)


def _off_by_one_rotation(w, enc, k_hat, v_hat):
    wrong = _decode_changed(w, enc, lambda e: _rows_of(e, "kv", "rotation_signs",
                                                       lambda t: _repacked_signs(t, w.dim, 1)))
    return _tokens(w, enc, k_hat, v_hat, wrong)


def _v_with_k_codebook(w, enc, k_hat, v_hat):
    own = f"codebook.{w.budget - 1}bit"
    wrong = _decode_changed(w, enc, lambda e: e.side.update({own: e.side[f"codebook.{w.budget}bit"].clone()}))
    mask = _token_mask(enc, w.size).to(v_hat.device)
    return k_hat, torch.where(mask, wrong[1], v_hat)


def _dropped_norm(w, enc, k, v):
    _rows_of(enc, "kv", "norm", lambda t: _masked_rows(t, w.size, t.mean(dim=-1, keepdim=True)))


def _saturated_norm(w, enc, k, v):
    if w.size > 0:
        _rows_of(enc, "kv", "norm", lambda t: torch.minimum(t, _quantile_rows(t, 1 - w.size)))


def _inverted_sketch(w, enc, k, v):
    _rows_of(enc, "k", "sketch", lambda t: _masked_rows(t, w.size, torch.bitwise_not(t)))


def _dropped_zero_point(w, enc, k, v):
    _rows_of(enc, "kv", "min", lambda t: _masked_rows(t, w.size, torch.zeros_like(t)))


def _svd_rank(w, enc, k, v):
    n = int(w.size)
    if n <= 0:
        return
    for p in "kv":
        for key, axis in (("basis", -1), ("coeff", -1)):
            t = enc.codes[f"{p}.{key}"]
            keep = torch.arange(t.shape[axis], device=t.device) < t.shape[axis] - n
            enc.codes[f"{p}.{key}"] = t * keep.to(t.dtype)


def _v_calibrated_on_k(w, k_cal, v_cal):
    n = round(w.size * v_cal.shape[2])
    return k_cal, torch.cat((k_cal[:, :, :n], v_cal[:, :, n:]), dim=2)


def _stale_seq_len(w, enc, k_hat, v_hat):
    s = enc.shape[2]
    stale = torch.arange(s, device=k_hat.device) >= s - round(s * w.size)
    stale = stale[None, None, :, None]
    return torch.where(stale, 0.0, k_hat), torch.where(stale, 0.0, v_hat)


def _chunk_boundary(w, enc, k_hat, v_hat):
    s = enc.shape[2]
    chunk = round(1 / w.size) if w.size > 0 else s
    boundary = (torch.arange(s, device=k_hat.device) % chunk == 0) & (torch.arange(s, device=k_hat.device) > 0)
    boundary = boundary[None, None, :, None]
    return tuple(torch.where(boundary, torch.roll(x, 1, dims=2), x) for x in (k_hat, v_hat))


def _sign_flip(w, enc, k_hat, v_hat):
    return _tokens(w, enc, k_hat, v_hat, (-k_hat, -v_hat))


BUGS = (
    Bug("wrong-norm", "tq-kv", 0.05, "relative error of the normalisation constant",
        "a normalisation constant off by 5% (e.g. √d for √(d−1), or a stale rescale) on decode",
        post=lambda w, enc, k, v: (k * (1 + w.size), v * (1 + w.size))),
    Bug("stale-seq-len", "tq-kv", 0.02, "fraction of tokens past the stale length",
        "a stale sequence length: the last tokens of the cache are never written and read as zero",
        post=_stale_seq_len),
    Bug("channel-mask", "tq-kv", 1 / 32, "fraction of channels masked",
        "a hard-coded channel mask (built for another head layout) zeroes channels of K and V before coding",
        pre=_channel_mask),
    Bug("narrow-width", "tq-kv", 1, "bits narrower, on K",
        "a hard-coded narrower width: K coded and decoded at b − 1 bits whatever the budget",
        patch=_narrow_patch, post=_narrow_width, narrow=True),
    Bug("dropped-norm", "tq-kv", 1.0, "fraction of tokens",
        "the per-token norm dropped: tokens decoded with the cache's mean norm",
        patch=_dropped_norm),
    Bug("qjl-scale", "tq-qkv", 1 - 2 / math.pi, "relative error of the QJL constant",
        "a wrong QJL scale: √(2/π)/m for √(π/2)/m on the residual correction, in decode and scores",
        post=_qjl_decode, logits=_qjl_logits),
    Bug("sign-flip", "tq-kv", 0.01, "fraction of tokens",
        "sign flips in a few tokens: a lost sign bit negates their decoded K and V",
        post=_sign_flip),
    Bug("stale-codebook", "tq-kv", 0.25, "relative error of the codebook's dimension",
        "a stale codebook: the Lloyd–Max table solved for a head dimension 25% larger (cached by width only)",
        patch=_stale_codebook),
    Bug("off-by-one-rotation", "tq-kv", 0.02, "fraction of tokens",
        "an off-by-one rotation: the inverse rotation's signs shifted by one coordinate on some tokens",
        post=_off_by_one_rotation),
    Bug("flaky", "tq-kv", 0.2, "fraction of trials",
        "quality that varies from trial to trial: some trials coded at b − 1 bits (a spread change)",
        patch=_narrow_patch, post=_flaky, narrow=True),
    Bug("floor-rounding", "int4", 1.0, "fraction of tokens",
        "the wrong rounding mode: floor instead of round-to-nearest in the uniform quantiser",
        pre=_floor_input),
    Bug("clip-range", "tq-kv", 0.05, "fraction of elements clipped",
        "a clipping range off: inputs clipped at the 95th percentile of |x| before coding",
        pre=_clip),
    Bug("dropped-zero-point", "int4", 0.01, "fraction of tokens",
        "a dropped zero point: some tokens decoded without their groups' minimum",
        patch=_dropped_zero_point),
    Bug("v-with-k-codebook", "tq-kqv", 0.02, "fraction of tokens",
        "V decoded with K's codebook (the b-bit table for V's (b−1)-bit codes) on some tokens",
        post=_v_with_k_codebook),
    Bug("fp16-norm-overflow", "tq-kv", 0.05, "fraction of tokens saturated",
        "a scale stored in fp16 that overflows: the largest tokens' norms saturate at the format's maximum",
        patch=_saturated_norm, scenario="heavy_tail"),
    Bug("chunk-boundary", "tq-kv", 1 / 32, "fraction of tokens (one per 32-token chunk)",
        "tokens dropped at a chunk boundary: the first token of each chunk holds its predecessor",
        post=_chunk_boundary),
    Bug("kivi-residual", "kivi", 16, "tokens taken from the fp16 window",
        "the fp16 residual window shortened (16 of its 32 recent tokens quantised)",
        options=lambda size: {"residual": 32 - int(size)}),
    Bug("int4-group-size", "int4", 64, "the group size (neutral 32)",
        "a hard-coded group size of 64 (per token at d = 64) instead of 32",
        options=lambda size: {"group_size": int(size)}, neutral=32),
    Bug("svd-rank", "svd", 1, "rank deficit",
        "the low-rank truncation's rank off by one (floor for round)",
        patch=_svd_rank),
    Bug("v-calibrated-on-k", "sq-kv", 0.5, "fraction of V's calibration tokens",
        "V's basis calibrated partly on K's calibration tokens (a swapped buffer)",
        fit=_v_calibrated_on_k, scenario="lowrank_misaligned"),
    Bug("logit-scale", "tq-kv", 0.3, "relative error of the softmax scale",
        "a wrong softmax scale: logits scaled by 0.7 (≈ 1/√2: √d of a head twice as wide)",
        logits=lambda w, q, enc, logits: logits * (1 - w.size)),
    Bug("inverted-sketch", "tq-qkv", 0.1, "fraction of tokens",
        "the QJL sketch's bits inverted (a bit-order bug) on some tokens, in decode and scores",
        patch=_inverted_sketch),
    Bug("uneven-calls", "tq-qkv", 0.05, "relative change of each trial's K error, ± by trial",
        "quality that varies from call to call at the same mean and storage: each trial's K error "
        "(1 ± 5 %) times the codec's, through a per-call gain of the QJL correction",
        patch=_uneven_patch, post=_uneven_decode, logits=_uneven_logits),
    Bug("bf16-norm", "tq-kv", 1.0, "fraction of tokens",
        "a scale stored at too low a precision: the per-token norms truncated to bfloat16 (relative error < 2⁻⁷)",
        patch=_bf16_norm, target="negligible"),
    Bug("fp16-codebook", "tq-kv", 1.0, "fraction of tables (all or none)",
        "a table stored at too low a precision: the Lloyd–Max centroids cast through float16 (relative error ≤ 2⁻¹¹)",
        patch=_fp16_codebook, target="negligible"),
)


# --- the harmless changes ----------------------------------------------------------------
@dataclass(frozen=True)
class Harmless:
    """A change of an implementation variable whose right verdict is anything but
    `codec-difference`: `vary` through `harness validate --vary`, or a run-level `change`
    (threads, chunk, workers, resume) through two `harness run`s and `harness compare`."""
    name: str
    description: str
    vary: str | None = None
    change: str | None = None
    slow: bool = False      # left out of --quick


HARMLESS = (
    Harmless("dtype", "float32 vs float64 (validate --vary dtype)", vary="dtype"),
    Harmless("rng", "RNG family PCG64 vs MT19937 (validate --vary rng)", vary="rng"),
    Harmless("impl", "torch vs the independent NumPy reference (validate --vary impl)", vary="impl"),
    Harmless("seed", "root seed r vs r + 1, null r + 2 (validate --vary seed)", vary="seed"),
    Harmless("threads", "torch threads: the process's count vs 1 (or 2 where it is 1)", change="threads"),
    Harmless("chunk-size", "KVHARNESS_CHUNK_TRIALS=7 vs chunks sized by memory", change="chunk"),
    Harmless("workers", "--workers 2 (a local Dask cluster) vs serial", change="workers", slow=True),
    Harmless("trial-order", "a run interrupted at its third chunk and resumed vs one pass", change="resume"),
)


@dataclass(frozen=True)
class Settings:
    """The benchmark's configuration (the defaults: the full table; QUICK: the CI form)."""
    scenario: str = "gaussian"      # of the harmless changes (a bug may name its own)
    scheme: str = "tq-kv"           # of the harmless changes
    budget: int = 2                 # of the harmless changes (a bug names its own)
    dim: int = 64
    seq_len: int = 256
    queries: int = 64
    trials: int = 60
    permutations: int = 1000
    compare_scenario: str = "heavy_tail"
    compare_schemes: tuple = SEED_CODECS
    compare_budgets: tuple = (2, 3, 4)
    compare_trials: int = 30
    skip_slow: bool = False


QUICK = Settings(seq_len=128, queries=32, trials=40, permutations=500, compare_trials=20, skip_slow=True)


def _command(argv: list[str]) -> str:
    """Run `harness ARGV` in this process (its own parser and run function) and return what it
    printed; a usage error or failure raises."""
    from .cli import build_parser
    parser, handlers = build_parser()
    args = parser.parse_args([str(a) for a in argv])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = handlers[args.command](args)
    if status:
        raise RuntimeError(f"harness {' '.join(map(str, argv))} exited with status {status}")
    return out.getvalue()


def _six_d_shift(frame_a, frame_b) -> dict:
    """The largest |mean(B) − mean(A)| over the six-D metrics in units of their pooled
    between-trial standard deviation, and its metric."""
    from kvcommon.rows import SIX_D
    best = {"effect_sd": 0.0, "metric": None}
    for m in SIX_D:
        a, b = frame_a[m].to_numpy(float), frame_b[m].to_numpy(float)
        sd = math.sqrt((a.var(ddof=1) + b.var(ddof=1)) / 2)
        delta = b.mean() - a.mean()
        shift = abs(delta) / sd if sd > 0 else (0.0 if delta == 0 else math.inf)
        if shift > best["effect_sd"] or best["metric"] is None:
            best = {"effect_sd": float(shift), "metric": m}
    return best


def differing(frame_a, frame_b) -> list[str]:
    """The implementation variables recorded in the rows (impl, rng, seed, device, dtype) whose
    values differ between two runs' frames."""
    return [v for v in ("impl", "rng", "seed", "device", "dtype")
            if set(frame_a[v].unique()) != set(frame_b[v].unique())]


def _cell_args(s: Settings, scenario: str, budget: int, trials: int) -> list:
    return ["--scenario", scenario, "--budget", budget, "--dim", s.dim, "--seq-len", s.seq_len,
            "--queries", s.queries, "--trials", trials]


def validate_case(s: Settings, scheme: str, seed: int, *, against: str | None = None, vary: str = "seed",
                  scenario: str | None = None, budget: int | None = None) -> dict:
    """One `harness validate ... --json`: its verdict, the command and the six-D shift of its
    main comparison (from the runs it kept)."""
    from .store import RunStore
    with tempfile.TemporaryDirectory(prefix="kvharness-selftest-") as tmp:
        argv = ["validate", "--scheme", scheme] + (["--against", against] if against else []) + \
            ["--vary", vary] + _cell_args(s, scenario or s.scenario, budget or s.budget, s.trials) + \
            ["--seed", seed, "--permutations", s.permutations, "--json"]
        payload = json.loads(_command(argv + ["--out", tmp]))
        base = RunStore(Path(tmp) / "base").trials()
        if against:
            a, b = base[base["scheme"] == scheme], base[base["scheme"] == against]
        else:
            a, b = base, RunStore(Path(tmp) / "variant").trials()
        return {"verdict": payload["verdict"], "command": "harness " + " ".join(map(str, argv)),
                "differs": differing(a, b), "shared_draws": payload.get("shared_draws"),
                "rows_digest": _digest(b), **_six_d_shift(a, b)}


def _digest(frame) -> str:
    """A digest of a frame's six-D metrics in trial order: equal digests, equal rows."""
    from kvcommon.rows import SIX_D
    values = np.ascontiguousarray(frame.sort_values("trial")[list(SIX_D)].to_numpy(np.float64))
    return hashlib.sha256(values.tobytes()).hexdigest()[:16]


@contextlib.contextmanager
def _env(name: str, value: str | None):
    before = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


class _Interrupt(KeyboardInterrupt):
    """The benchmark's own Ctrl-C at a chosen chunk (a real one is never swallowed)."""


@contextlib.contextmanager
def _interrupted_at_chunk(n: int):
    """The n-th cell chunk computed in the block raises _Interrupt (a Ctrl-C) instead of running."""
    from . import cell as engine
    real, calls = engine.run_cell_chunk, {"n": 0}

    def run_or_stop(scheme, data):
        calls["n"] += 1
        if calls["n"] == n:
            raise _Interrupt
        return real(scheme, data)
    engine.run_cell_chunk = run_or_stop
    try:
        yield
    finally:
        engine.run_cell_chunk = real


def changed_run(change: str | None, argv: list) -> None:
    """`harness run ARGV` with a run-level change (Harmless.change) or none."""
    from .cell import CHUNK_TRIALS_ENV
    from kvcommon.threads import torch_threads
    if change is None:
        _command(argv)
    elif change == "threads":
        with torch_threads(1 if torch.get_num_threads() > 1 else 2):
            _command(argv)
    elif change == "chunk":
        with _env(CHUNK_TRIALS_ENV, "7"):
            _command(argv)
    elif change == "workers":   # started at once: the run's own gate would keep a small sweep serial
        from .runner import SERIAL_BELOW_ENV
        with _env(SERIAL_BELOW_ENV, "0"):
            _command(argv + ["--workers", 2])
    elif change == "resume":
        with _env(CHUNK_TRIALS_ENV, "7"):
            try:
                with _interrupted_at_chunk(3):
                    _command(argv)
            except _Interrupt:
                pass
            else:
                raise RuntimeError("the run to interrupt finished before its third chunk")
            _command(argv + ["--resume"])
    else:
        raise ValueError(f"unknown run-level change {change!r}; valid: threads, chunk, workers, resume")


def compare_case(s: Settings, seed: int, *, change: str | None, schemes_: tuple, scenario: str, budgets: tuple,
                 trials: int) -> dict:
    """Runs A (seed r), B (seed r with the change, or r + 1 without one) and the null C (the next
    seed), then `harness compare A B --null C --json`: the verdict of every cell."""
    from .store import RunStore
    with tempfile.TemporaryDirectory(prefix="kvharness-selftest-") as tmp:
        root = Path(tmp)

        def argv(name, run_seed):
            return ["run", "--scenario", scenario, "--scheme", ",".join(schemes_),
                    "--budget", ",".join(map(str, budgets)), "--dim", s.dim, "--seq-len", s.seq_len,
                    "--queries", s.queries, "--trials", trials, "--seed", run_seed, "--out", root / name, "--quiet"]
        changed_run(None, argv("A", seed))
        if change is None:
            changed_run(None, argv("B", seed + 1))
            changed_run(None, argv("C", seed + 2))
        else:
            changed_run(change, argv("B", seed))
            changed_run(None, argv("C", seed + 1))
        cmp = ["compare", root / "A", root / "B", "--null", root / "C", "--seed", seed,
               "--permutations", s.permutations, "--json"]
        cells = json.loads(_command(cmp))
        a, b = RunStore(root / "A").trials(), RunStore(root / "B").trials()
        identical = None
        if change is not None:
            from kvcommon.rows import SIX_D
            key = ["scheme", "budget", "trial"]
            x, y = a.sort_values(key)[list(SIX_D)].to_numpy(), b.sort_values(key)[list(SIX_D)].to_numpy()
            identical = bool(x.shape == y.shape and np.array_equal(x, y))
        manifest = json.loads((root / "B" / "manifest.json").read_text())
        return {"verdicts": [c["verdict"] for c in cells], "rows_identical": identical, "differs": differing(a, b),
                "torch_threads_b": manifest.get("provenance", {}).get("torch_threads"),
                "command": "harness " + " ".join(str(x).replace(str(root) + "/", "") for x in cmp),
                **_six_d_shift(a, b)}


# --- the benchmark -------------------------------------------------------------------------
def machine() -> dict:
    """Where the benchmark ran: CPU model, cores, `uptime` (its load) and the platform."""
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    try:
        uptime = subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        uptime = None
    return {"cpu": model, "cores": os.cpu_count(), "uptime": uptime,
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "platform": platform.platform(), "torch_threads": torch.get_num_threads()}


def _seeds(repetitions: int) -> list[int]:
    return [ROOT_SEED + 10 * i for i in range(repetitions)]


def _summary(case: dict, outcomes: list[dict], wall_s: float) -> dict:
    """A case's row: counts of each verdict over its repetitions, the rate of the right answer
    and whether it meets TARGET; outcomes hold each repetition's `verdicts` (cells) or `verdict`."""
    counts: dict = {}
    for o in outcomes:
        for v in o.get("verdicts", [o.get("verdict")]):
            counts[v] = counts.get(v, 0) + 1
    if case["kind"] == "bug":
        right = [o["verdict"] == case["target"] for o in outcomes]
    else:
        right = [not set(FLAGGED) & set(o.get("verdicts", [o.get("verdict")])) for o in outcomes]
    rate = sum(right) / len(right) if right else None
    shifts = [o["effect_sd"] for o in outcomes if "effect_sd" in o]
    metrics = [o["metric"] for o in outcomes if o.get("metric")]
    out = {**case, "repetitions": len(outcomes), "verdicts": counts,
           "cells": sum(len(o.get("verdicts", [None])) for o in outcomes),
           "rate": rate, "met": None if rate is None else rate >= TARGET,
           "effect_sd": float(np.median(shifts)) if shifts else None,
           "effect_metric": max(set(metrics), key=metrics.count) if metrics else None,
           "wall_s": round(wall_s, 2)}
    if outcomes:
        out["command"] = outcomes[0]["command"]
    for key in ("rows_identical", "torch_threads_b", "differs"):
        if outcomes and key in outcomes[0]:
            out[key] = [o[key] for o in outcomes]
    return out


def run_selftest(settings: Settings = Settings(), repetitions: int = 10, *, progress=None,
                 bugs=BUGS, harmless=HARMLESS, seed_compare: bool = True) -> dict:
    """The benchmark (module doc): every bug, every harmless change and the seed-only compare,
    `repetitions` times each; a JSON-ready payload (see table_markdown). progress(text), when
    given, is told of each case as it ends."""
    from stats.validation import VERDICTS
    say = progress or (lambda text: None)
    seeds = _seeds(repetitions)
    started, before = time.perf_counter(), machine()
    cases = []
    with registered_bugs(bugs), installed_bugs(bugs):
        for bug in bugs:
            case = {"case": bug.name, "kind": "bug", "codec": bug.wrapped, "scheme": bug.scheme,
                    "scenario": bug.scenario, "budget": bug.budget, "size": bug.size, "neutral": bug.neutral,
                    "unit": bug.unit, "modelled_on": bug.modelled_on, "target": bug.target}
            designs = {}
            for design, shares in PLUGIN_DESIGNS.items():
                scheme = bug.scheme if shares is None else bug.plugin(shares)
                t0 = time.perf_counter()
                outcomes = [validate_case(settings, bug.wrapped, r, against=scheme, scenario=bug.scenario,
                                          budget=bug.budget) for r in seeds]
                designs[design] = _summary({**case, "scheme": scheme, "design": design}, outcomes,
                                           time.perf_counter() - t0)
                designs[design]["rows_digest"] = [o["rows_digest"] for o in outcomes]
                designs[design]["shared_draws"] = [o["shared_draws"] for o in outcomes]
            cases.append(_with_designs(designs))
            say(_progress_line(cases[-1]))
    for change in harmless:
        case = {"case": change.name, "kind": "harmless", "codec": settings.scheme, "scenario": settings.scenario,
                "budget": settings.budget, "description": change.description, "target": "neither codec-difference nor implementation-discrepancy"}
        if change.slow and settings.skip_slow:
            cases.append({**case, "repetitions": 0, "skipped": "left out of --quick", "rate": None, "met": None,
                          "verdicts": {}, "cells": 0})
            say(f"{change.name}: skipped (--quick)")
            continue
        t0 = time.perf_counter()
        if change.vary:
            outcomes = [validate_case(settings, settings.scheme, r, vary=change.vary) for r in seeds]
        else:
            outcomes = [compare_case(settings, r, change=change.change, schemes_=(settings.scheme,),
                                     scenario=settings.scenario, budgets=(settings.budget,), trials=settings.trials)
                        for r in seeds]
        cases.append(_summary(case, outcomes, time.perf_counter() - t0))
        say(_progress_line(cases[-1]))
    if seed_compare:
        t0 = time.perf_counter()
        outcomes = [compare_case(settings, r, change=None, schemes_=settings.compare_schemes,
                                 scenario=settings.compare_scenario, budgets=settings.compare_budgets,
                                 trials=settings.compare_trials) for r in seeds]
        cases.append(_summary({"case": "seed-only compare", "kind": "seed-compare",
                               "codec": ",".join(settings.compare_schemes), "scenario": settings.compare_scenario,
                               "budget": list(settings.compare_budgets),
                               "description": f"compare A B --null C of {len(settings.compare_schemes)} codecs x "
                                              f"b = {', '.join(map(str, settings.compare_budgets))} at seeds r, "
                                              f"r + 1, r + 2",
                               "target": "no codec-difference cell"}, outcomes, time.perf_counter() - t0))
        say(_progress_line(cases[-1]))
    seen = [v for c in cases for v in c.get("verdicts", {}) if v not in VERDICTS]
    return {"settings": dataclasses.asdict(settings), "repetitions": repetitions, "seeds": seeds,
            "target": TARGET, "verdicts": list(VERDICTS) + sorted(set(seen)), "cases": cases,
            "wall_s": round(time.perf_counter() - started, 1), "machine": before, "machine_after": machine()}


def _with_designs(designs: dict) -> dict:
    """A bug's row: its in-process design's summary, with every design's (PLUGIN_DESIGNS) under
    `designs`, each saying whether its bugged codec's rows are the in-process one's, repetition by
    repetition (a plug-in that shares the codec's draws is the same codec, so they must be)."""
    inprocess = designs["in-process"]
    out = {k: v for k, v in inprocess.items() if k not in ("rows_digest", "shared_draws")}
    out["designs"] = {}
    for design, summary in designs.items():
        same = [a == b for a, b in zip(summary["rows_digest"], inprocess["rows_digest"])]
        out["designs"][design] = {
            "scheme": summary["scheme"], "verdicts": summary["verdicts"], "rate": summary["rate"],
            "met": summary["met"], "effect_sd": summary["effect_sd"], "wall_s": summary["wall_s"],
            "command": summary.get("command"), "shared_draws": summary["shared_draws"],
            "rows_identical_to_in_process": sum(same)}
    return out


def _progress_line(case: dict) -> str:
    verdicts = ", ".join(f"{v} {n}" for v, n in case["verdicts"].items())
    plugins = "".join(f"; {d} {_percent(r['rate'])}" for d, r in case.get("designs", {}).items() if d != "in-process")
    return f"{case['case']} ({case['kind']}): {verdicts}; rate {case['rate']:.0%}{plugins} ({case['wall_s']:.0f} s)"


def _percent(x) -> str:
    return "—" if x is None else f"{100 * x:.0f} %"


def table_markdown(payload: dict) -> str:
    """The benchmark's table in Markdown, from run_selftest's payload (or its JSON): one row per
    case with its kind, size, repetitions, the rate of each verdict (over cells, for the
    seed-only compare) and whether the target rate is met, then a line with the settings."""
    verdicts = payload["verdicts"]
    plugins = [d for d in PLUGIN_DESIGNS if d != "in-process"]
    head = ["case", "kind", "size", "reps"] + verdicts + ["right answer", f"target ≥ {payload['target']:.0%} met"] + \
        [f"right answer, {d}" for d in plugins]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in payload["cases"]:
        if c["kind"] == "bug":
            size = f"{c['size']:.3g} {c['unit']}"
            what = f"`{c['scheme']}` ({c['scenario']}, b = {c['budget']})"
        elif c["kind"] == "harmless":
            size, what = c["description"], ""
        else:
            size, what = f"{c.get('cells', 0) // max(c['repetitions'], 1)} cells", ""
        cells = c.get("cells") or 0
        rates = [_percent(c["verdicts"].get(v, 0) / cells) if cells else "—" for v in verdicts]
        met = "skipped" if c.get("skipped") else ("yes" if c["met"] else "no")
        name = c["case"] + (f" {what}" if what else "")
        lines.append("| " + " | ".join([name, c["kind"], size, str(c["repetitions"])] + rates +
                                       [f"{_percent(c['rate'])} {c['target']}", met] +
                                       [_design_cell(c, d) for d in plugins]) + " |")
    s = payload["settings"]
    m = payload.get("machine", {})
    lines.append("")
    lines.append("In-process: `bug:NAME/CODEC`, registered in the benchmark's process and seeded like CODEC; "
                 "plug-in: the same bugged codec installed as an entry point of a package, `plug:NAME/CODEC` "
                 "declaring CODEC's seed family (shared draws), `plug-own:NAME/CODEC` declaring none (draws of "
                 "its own); a plug-in cell gives the rate of the right answer and the verdicts that were not it.")
    lines.append("")
    lines.append(f"Validate cases: d = {s['dim']}, S = {s['seq_len']}, {s['queries']} queries, {s['trials']} trials, "
                 f"{s['permutations']} permutations; seed-only compare: {s['compare_scenario']}, "
                 f"{len(s['compare_schemes'])} codecs × b = {', '.join(map(str, s['compare_budgets']))}, "
                 f"{s['compare_trials']} trials; {payload['repetitions']} repetition(s) (root seeds "
                 f"{payload['seeds'][0]}, {payload['seeds'][0] + 10}, ...); {payload['wall_s']:.0f} s on "
                 f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores ({_load(payload)}).")
    return "\n".join(lines)


def _design_cell(case: dict, design: str) -> str:
    """A bug's rate of the right answer in a plug-in design, with the other verdicts' counts
    (and, for shared draws, a note where its rows were not the in-process ones); — for others."""
    d = case.get("designs", {}).get(design)
    if d is None:
        return "—"
    wrong = ", ".join(f"{v} {n}" for v, n in d["verdicts"].items() if v != case["target"])
    differ = case["repetitions"] - d["rows_identical_to_in_process"]
    note = f"; rows unlike in-process in {differ}" if design.endswith("shared draws") and differ else ""
    return _percent(d["rate"]) + (f" ({wrong}{note})" if wrong or note else "")


def _load(payload: dict) -> str:
    """'load average a, b, c' from the uptime line recorded at the start, and at the end where the
    run recorded one (a long run on a shared machine may see both)."""
    def averages(machine: dict) -> str:
        text = machine.get("uptime", "")
        return text.split("load average:", 1)[1].strip() if "load average:" in text else text
    start, end = averages(payload.get("machine", {})), averages(payload.get("machine_after", {}))
    return f"load average {start} at the start, {end} at the end" if end else f"load average {start}"


def summary_markdown(payload: dict) -> str:
    """The benchmark in three rows (the README's; docs/statistics.md has every case): per kind, how
    many cases meet the target and the lowest rate of the right answer; the bugs' row states the
    same for their plug-in designs (PLUGIN_DESIGNS)."""
    lines = ["| cases | right answer | met the ≥ 95 % target | lowest rate |", "|---|---|---|---|"]
    bugs = [c for c in payload["cases"] if c["kind"] == "bug"]
    bug_answer = "`codec-difference`, or `negligible` for the " + \
        f"{sum(c['target'] == 'negligible' for c in bugs)} stated so"
    for kind, count, answer in (("bug", "bugs injected into real codecs", bug_answer),
                                ("harmless", "harmless implementation changes",
                                 "neither `codec-difference` nor `implementation-discrepancy`"),
                                ("seed-compare", "seed-only compares of 30 cells", "no `codec-difference` cell")):
        cases = [c for c in payload["cases"] if c["kind"] == kind and not c.get("skipped")]
        if not cases:
            continue
        lowest = min(cases, key=lambda c: c["rate"])
        met, low = f"{sum(c['met'] for c in cases)} of {len(cases)}", f"{_percent(lowest['rate'])} ({lowest['case']})"
        if kind == "bug":
            met, low = f"in-process {met}", f"in-process {low}"
            for design in [d for d in PLUGIN_DESIGNS if d != "in-process"]:
                rows = [(c["case"], c["designs"][design]) for c in cases if design in c.get("designs", {})]
                if rows:
                    name, worst = min(rows, key=lambda r: r[1]["rate"])
                    met += f"; {design} {sum(d['met'] for _, d in rows)} of {len(rows)}"
                    low += f"; {design} {_percent(worst['rate'])} ({name})"
        lines.append(f"| {count} ({len(cases)}) | {answer} | {met} | {low} |")
    m = payload.get("machine", {})
    lines.append("")
    lines.append(f"From `harness selftest --repetitions {payload['repetitions']}` ({payload['wall_s'] / 60:.0f} min on "
                 f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores, {_load(payload)}); every case: "
                 f"[docs/statistics.md](docs/statistics.md#known-answers).")
    return "\n".join(lines)
