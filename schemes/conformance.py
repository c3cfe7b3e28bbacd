"""Conformance checks for a KV-cache codec, shipped for plug-in authors (in the spirit of
scikit-learn's `check_estimator`).

A check takes a *factory*: a callable `make(budget=, dim=, seed=, **options)` that returns a
scheme (schemes/base.py), the signature of a registered factory. Every check builds its codecs
through schemes.registry.build, as the sweep does (budget, dim and seed checked, the RNG family
set, validate called), and calls them as the sweep does (schemes.base.fit_codec with the trial
indices, encode_codec with the tokens' positions and prefill queries, each where the codec
declares it takes them): a factory that passes the checks runs in a sweep. Any of these will do:

    functools.partial(schemes.create, "tq-kv")                  # a registered codec
    functools.partial(schemes.reference.create, "tq-kv")        # its NumPy reference
    functools.partial(MyCodec, group=32)                        # an unregistered class, configured
    functools.partial(schemes.create, "kvpress:SnapKVPress", window_size=8)

`check_scheme(factory)` runs every check and raises ConformanceError listing each failure as a
sentence; `CHECKS` holds them one by one (name, function, what it states) for a test runner, and
`pytest_params(factories)` turns a {label: factory} mapping into pytest parameters.

The data are small and seeded (B = 3 trials, H = 2 heads, S = 48 tokens, d = 64 unless the
factory is asked for another dim), so a codec whose defaults need a longer cache takes smaller
options in its factory. Applicability is by capability, not by name: a check skips the budgets a
factory refuses (ValueError at construction), `kept` is checked where the codec evicts, and what
a codec takes beyond the plain protocol it gets where it declares it (Scheme.capabilities).
"""
from __future__ import annotations

import io
import math
from typing import Callable

import torch

from kvcommon.checks import Check, ConformanceError, require, run_checks
from kvcommon.rows import METRIC_NAMES

from .base import BitLedger, Encoded, encode_codec, fit_codec, stored_bits
from .registry import MAX_BUDGET, MIN_BUDGET, build

Factory = Callable[..., object]

DIM = 64
SHAPE = (3, 2, 48, DIM)          # B, H, S, d
N_QUERIES = 5
BUDGET = 3


RNG = "pcg64"                    # the sweep's default --rng, set on every codec built here


def _make(factory: Factory, budget: int = BUDGET, seed: int = 0, dim: int = DIM):
    """The factory's codec, built as the sweep builds it (schemes.registry.build)."""
    return build(factory, budget=budget, dim=dim, seed=seed, rng=RNG)


def _encode(scheme, k: torch.Tensor, v: torch.Tensor) -> Encoded:
    """encode as the sweep calls it: the tokens' positions 0..S−1, and as the cached tokens' own
    queries the keys scaled to unit length (a trial's, of the scale the sweep's queries have,
    whatever the keys' magnitude), each where the codec declares it takes them."""
    return encode_codec(scheme, k, v, torch.arange(k.shape[2], device=k.device), torch.nn.functional.normalize(k, dim=-1))


def _data(seed: int = 0, shape=SHAPE, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(shape, generator=g, dtype=dtype)
    v = torch.randn(shape, generator=g, dtype=dtype)
    q = torch.randn(shape[:2] + (N_QUERIES, shape[3]), generator=g, dtype=dtype)
    return k, v, q


def _roundtrip(scheme, k, v, trials=None):
    """fit (on k, v), encode and decode, as the sweep calls them; trials: the trial indices
    (0..B−1 when None), for a fit that declares it takes them."""
    fit_codec(scheme, k, v, torch.arange(len(k)) if trials is None else trials)
    enc = _encode(scheme, k, v)
    return enc, scheme.decode(enc)


def _largest(t: torch.Tensor) -> float:
    return float(t.abs().max()) if t.numel() else 0.0


def stored_copy(enc: Encoded) -> Encoded:
    """enc as a deployment would store and load it: its tensors and tables written to bytes
    (torch.save) and read back, so nothing of it is shared with the encoder's objects."""
    buffer = io.BytesIO()
    torch.save({"shape": list(enc.shape), "dtype": str(enc.dtype).removeprefix("torch."), "codes": enc.codes,
                "side": enc.side, "exact_bits": enc.exact_bits, "model": sorted(enc.model)}, buffer)
    buffer.seek(0)
    data = torch.load(buffer, weights_only=True)
    return Encoded(tuple(data["shape"]), getattr(torch, data["dtype"]), data["codes"], data["side"],
                   data["exact_bits"], set(data["model"]))


def require_standalone(enc: Encoded, reference: tuple, fresh, q: torch.Tensor | None = None) -> None:
    """The encoding of one trial stands alone (ConformanceError where it does not): its ledger
    counts the bits its tensors occupy (a trial coded alone has no padding, so its exact bits are
    its stored bits), and `fresh`, a new instance built and fitted as the encoder was, decodes its
    stored bytes (stored_copy) to reference = (k̂, v̂) the encoder decoded, exactly, and scores
    them (q given: reference's third entry) as the encoder did."""
    ledger, stored = BitLedger.per_trial(enc), BitLedger.of(enc)
    require(enc.n_trials == 1, f"require_standalone takes the encoding of one trial, not {enc.n_trials}")
    require(float(ledger.cache[0]) == stored.total and float(ledger.model[0]) == stored.model_total,
             f"a trial coded alone is charged {float(ledger.cache[0]):.0f} per-cache and {float(ledger.model[0]):.0f} "
             f"per-model bits, but its stored tensors occupy {stored.total} and {stored.model_total} (exact_bits may "
             f"only leave out the padding of a batch)")
    copy = stored_copy(enc)
    try:
        decoded = fresh.decode(copy)
    except Exception as exc:  # noqa: BLE001 - the codec's own failure, said as the property it breaks
        raise ConformanceError(f"a new instance, built and fitted as the encoder, cannot decode the stored encoding "
                               f"({type(exc).__name__}: {exc}): the codec decodes from something the encoding does "
                               f"not hold") from None
    for what, x, x_ref in (("K", decoded[0], reference[0]), ("V", decoded[1], reference[1])):
        require(x.shape == x_ref.shape and torch.equal(x, x_ref),
                 f"a new instance, built and fitted as the encoder, decodes the stored encoding to another {what} "
                 f"(by up to {_largest(x - x_ref) if x.shape == x_ref.shape else math.inf:.3g}): the codec decodes "
                 f"from something the encoding does not hold")
    if q is not None and len(reference) > 2:
        logits = fresh.score(q, copy)
        require(torch.equal(logits, reference[2]),
                 "a new instance, built and fitted as the encoder, scores the stored encoding differently: the "
                 "codec scores from something the encoding does not hold")


# --- the checks ------------------------------------------------------------------------------
def check_roundtrip_keeps_shape_dtype_device(factory: Factory) -> None:
    """decode returns K and V of the input's shape, dtype and device, in float32 and float64."""
    for dtype in (torch.float32, torch.float64):
        k, v, _ = _data(dtype=dtype)
        _, (k_hat, v_hat) = _roundtrip(_make(factory), k, v)
        for what, x, x_hat in (("K", k, k_hat), ("V", v, v_hat)):
            require(x_hat.shape == x.shape, f"decode returns {what} of shape {tuple(x_hat.shape)} for a "
                                             f"{dtype} input of shape {tuple(x.shape)}")
            require(x_hat.dtype == x.dtype, f"decode returns {what} as {x_hat.dtype} for a {dtype} input")
            require(x_hat.device == x.device, f"decode returns {what} on {x_hat.device} for an input on {x.device}")


def check_same_seed_same_codes(factory: Factory) -> None:
    """Two schemes built with one seed store identical codes and side data for one cache."""
    k, v, _ = _data()
    enc_a, _ = _roundtrip(_make(factory, seed=7), k, v)
    enc_b, _ = _roundtrip(_make(factory, seed=7), k, v)
    for part in ("codes", "side"):
        a, b = getattr(enc_a, part), getattr(enc_b, part)
        require(a.keys() == b.keys(), f"two schemes with seed 7 store different {part} entries: "
                                       f"{sorted(a.keys() ^ b.keys())}")
        for key in a:
            require(torch.equal(a[key], b[key]), f"{part}.{key} differs between two schemes built with seed 7")


def check_input_not_mutated(factory: Factory) -> None:
    """fit, encode, decode and score leave k, v and q as they were."""
    k, v, q = _data()
    k0, v0, q0 = k.clone(), v.clone(), q.clone()
    scheme = _make(factory)
    enc, _ = _roundtrip(scheme, k, v)
    scheme.score(q, enc)
    for what, x, x0 in (("k", k, k0), ("v", v, v0), ("q", q, q0)):
        require(torch.equal(x, x0), f"the scheme changed its input {what} in place (largest change "
                                     f"{_largest(x - x0):.3g})")


def check_ledger_matches_storage(factory: Factory) -> None:
    """bits() counts exactly the stored tensors, split into per-cache and per-model parts that add
    up to the stand-alone total, with no per-trial tensor held at full width."""
    k, v, _ = _data()
    scheme = _make(factory)
    enc, _ = _roundtrip(scheme, k, v)
    ledger = scheme.bits(enc)
    b, h, s, d = SHAPE
    every = {("codes", key): stored_bits(t) // b for key, t in enc.codes.items()}
    every.update({("side", key): stored_bits(t) for key, t in enc.side.items()})
    stray = enc.model - (enc.codes.keys() | enc.side.keys())
    require(not stray, f"Encoded.model names entries that are not stored: {sorted(stray)}")
    model = sum(bits for (_, key), bits in every.items() if key in enc.model)
    require(ledger.total == sum(every.values()) - model,
             f"the per-cache ledger counts {ledger.total} bits but the stored per-cache tensors hold "
             f"{sum(every.values()) - model}")
    require(ledger.model_total == model, f"the per-model ledger counts {ledger.model_total} bits but the "
                                          f"entries tagged per model hold {model}")
    require(ledger == BitLedger.of(enc), "bits(enc) differs from BitLedger.of(enc), the count of what is stored")
    require(ledger.n_elements == 2 * h * s * d and ledger.n_heads == h,
             f"the ledger counts {ledger.n_elements} elements and {ledger.n_heads} heads for a cache of "
             f"{2 * h * s * d} elements (K and V) and {h} heads")
    per_trial = BitLedger.per_trial(enc)
    require(per_trial.cache.shape == per_trial.model.shape == (b,),
             f"per-trial bits have shape {tuple(per_trial.cache.shape)}, not one entry per trial ({b},)")
    require((per_trial.cache <= ledger.total).all() and (per_trial.model <= ledger.model_total).all(),
             "a trial's exact bit count exceeds the batch's padded count")
    for key, t in enc.codes.items():
        require(t.shape[0] == b, f"codes.{key} lacks the leading trial dimension (shape {tuple(t.shape)}, "
                                  f"{b} trials)")
        if t.is_floating_point():
            require(t[0].numel() < h * s * d, f"codes.{key} stores a full-size float tensor per trial")
    require(0 < ledger.bits_per_element < 32,
             f"{ledger.bits_per_element:.3g} bits per element is not a compression of float32")


def check_encoding_stands_alone(factory: Factory) -> None:
    """A trial's encoding, stored as bytes and loaded, decodes and scores on a new instance
    (built and fitted as the encoder: per-model constants are shared) exactly as the encoder
    decodes it, after the encoder has coded another cache; coded alone, its ledger is the bits
    its tensors occupy, and in a batch it is charged the same."""
    k_cal, v_cal, _ = _data(5)
    k, v, q = _data(0)

    def fitted(trials: torch.Tensor):
        scheme = _make(factory)
        fit_codec(scheme, k_cal[trials], v_cal[trials], trials)
        return scheme

    one = torch.tensor([1])
    first = fitted(one)
    enc = _encode(first, k[one], v[one])
    reference = tuple(first.decode(enc)) + ((first.score(q[one], enc),) if first.capabilities.scores_on_codes else ())
    _encode(first, -2 * k[:1], v[:1])        # a decoder reading what its encoder saw last now reads this
    require_standalone(enc, reference, fitted(one), q[one])
    batch = BitLedger.per_trial(_encode(fitted(torch.arange(3)), k, v))
    alone = BitLedger.per_trial(enc)
    require(float(batch.cache[1]) == float(alone.cache[0]) and float(batch.model[1]) == float(alone.model[0]),
             f"trial 1 is charged {float(batch.cache[1]):.0f} + {float(batch.model[1]):.0f} bits in a batch of 3 but "
             f"{float(alone.cache[0]):.0f} + {float(alone.model[0]):.0f} coded alone")


def check_model_constants_do_not_depend_on_the_cache(factory: Factory) -> None:
    """What a codec tags per model (Encoded.model) is the same whatever cache it codes."""
    k, v, _ = _data(0)
    k_other, v_other, _ = _data(1)
    scheme = _make(factory)
    fit_codec(scheme, k, v, torch.arange(SHAPE[0]))
    a, b = _encode(scheme, k, v), _encode(scheme, 3 * k_other, v_other)
    require(a.model == b.model, f"two caches tag different entries per model: {sorted(a.model ^ b.model)}")
    for key in a.model:
        part = "codes" if key in a.codes else "side"
        require(torch.equal(getattr(a, part)[key], getattr(b, part)[key]),
                 f"{part}.{key} is tagged per model but changes with the cache coded")


def check_score_matches_decode(factory: Factory) -> None:
    """score(q, enc) equals q·k̂ᵀ/√d with k̂ the decoded keys (in float64)."""
    k, v, q = _data(dtype=torch.float64)
    scheme = _make(factory)
    enc, (k_hat, _) = _roundtrip(scheme, k, v)
    logits = scheme.score(q, enc)
    b, h, s, d = SHAPE
    require(logits.shape == (b, h, N_QUERIES, s),
             f"score returns shape {tuple(logits.shape)}, not (B, H, Nq, S) = {(b, h, N_QUERIES, s)}")
    expected = q @ k_hat.transpose(-1, -2) / math.sqrt(d)
    require(torch.allclose(logits, expected, rtol=1e-9, atol=1e-9),
             f"score differs from q·decode(k)ᵀ/√d by up to {_largest(logits - expected):.3g}")


def check_kept_mask(factory: Factory) -> None:
    """kept(enc) is None (every token held) or a bool (B, H, S) mask keeping a token in every
    head; the tokens it evicts decode to zero."""
    k, v, _ = _data()
    scheme = _make(factory)
    enc, (k_hat, v_hat) = _roundtrip(scheme, k, v)
    kept = scheme.kept(enc) if hasattr(scheme, "kept") else None
    if kept is None:
        return
    require(kept.dtype == torch.bool and kept.shape == SHAPE[:3],
             f"kept() returns {kept.dtype} of shape {tuple(kept.shape)}, not bool of shape {SHAPE[:3]}")
    require(kept.device == k.device, f"kept() returns a mask on {kept.device} for a cache on {k.device}")
    require(kept.any(-1).all(), "kept() keeps no token in some head")
    for what, x_hat in (("K", k_hat), ("V", v_hat)):
        require(not x_hat[~kept].any(), f"an evicted token decodes to a non-zero {what}")


def check_error_not_growing_with_budget(factory: Factory) -> None:
    """The squared reconstruction error does not grow (beyond 2 %) from one accepted budget to
    the next, over 1..8 bits."""
    k, v, _ = _data(shape=(4, 1, 256, DIM))
    errors = {}
    for budget in range(MIN_BUDGET, MAX_BUDGET + 1):
        try:
            scheme = _make(factory, budget=budget)
        except ValueError:
            continue                                 # a budget this codec refuses
        _, (k_hat, v_hat) = _roundtrip(scheme, k, v)
        errors[budget] = float(((k - k_hat) ** 2).sum() + ((v - v_hat) ** 2).sum())
    budgets = sorted(errors)
    for lo, hi in zip(budgets, budgets[1:]):
        require(errors[hi] <= errors[lo] * 1.02,
                 f"the error grows from budget {lo} ({errors[lo]:.4g}) to budget {hi} ({errors[hi]:.4g})")


def check_edge_inputs_stay_finite(factory: Factory) -> None:
    """Zeros, constant rows, a single token, and magnitudes of 1e30 and 1e-30 decode to finite
    values (zeros to zeros) and score finitely."""
    b, h, s, d = SHAPE
    gen = torch.Generator().manual_seed(11)
    cases = {
        "zeros": torch.zeros(SHAPE),
        "constant rows": torch.full(SHAPE, 0.3),
        "one token": torch.randn(b, h, 1, d, generator=gen),
        "huge magnitudes": torch.randn(SHAPE, generator=gen) * 1e30,
        "tiny magnitudes": torch.randn(SHAPE, generator=gen) * 1e-30,
    }
    for case, x in cases.items():
        scheme = _make(factory)
        enc, (k_hat, v_hat) = _roundtrip(scheme, x, x.clone())
        q = torch.randn(x.shape[0], x.shape[1], N_QUERIES, d, generator=gen)
        require(torch.isfinite(k_hat).all() and torch.isfinite(v_hat).all(),
                 f"a cache of {case} decodes to non-finite values")
        if case != "huge magnitudes":   # logits of 1e30-sized keys overflow float32 by construction
            require(torch.isfinite(scheme.score(q, enc)).all(), f"a cache of {case} scores non-finite logits")
        if case == "zeros":
            require(not k_hat.any() and not v_hat.any(), "a cache of zeros does not decode to zeros")


def check_trial_order_invariant(factory: Factory) -> None:
    """Permuting the trials (with their indices) permutes the output, and a trial coded alone
    decodes as in its batch: a codec never mixes trials."""
    k, v, _ = _data()
    perm = torch.tensor([2, 0, 1])
    _, (k_hat, v_hat) = _roundtrip(_make(factory), k, v, trials=torch.arange(3))
    _, (k_hat_p, v_hat_p) = _roundtrip(_make(factory), k[perm], v[perm], trials=perm)
    require(torch.allclose(k_hat_p, k_hat[perm], atol=1e-6) and torch.allclose(v_hat_p, v_hat[perm], atol=1e-6),
             "permuting the trials changes their decoded values, not only their order")
    _, (k_one, _) = _roundtrip(_make(factory), k[1:2], v[1:2], trials=torch.tensor([1]))
    require(torch.allclose(k_one, k_hat[1:2], atol=1e-6),
             f"a trial decodes differently alone than in its batch (by up to {_largest(k_one - k_hat[1:2]):.3g})")


def check_diagnostics_per_trial(factory: Factory) -> None:
    """diagnostics() after a fit gives one real value per trial under each name, and every name
    is an identifier that no metric already uses (the run store keeps each one)."""
    k, v, _ = _data()
    scheme = _make(factory)
    _roundtrip(scheme, k, v, trials=torch.arange(len(k)))
    for name, values in scheme.diagnostics().items():
        require(isinstance(name, str) and name.isidentifier() and name not in METRIC_NAMES,
                 f"diagnostic name {name!r} is not an identifier or is already a metric's")
        values = torch.as_tensor(values)
        require(values.shape == (len(k),), f"diagnostic {name} has shape {tuple(values.shape)} for {len(k)} "
                                            f"trials; one value per trial is ({len(k)},)")
        require(not values.is_complex() and values.dtype != torch.bool,
                 f"diagnostic {name} is {values.dtype}, not a real number per trial")


CHECKS: tuple[Check, ...] = tuple(
    Check.of(fn) for fn in (check_roundtrip_keeps_shape_dtype_device, check_same_seed_same_codes, check_input_not_mutated,
               check_ledger_matches_storage, check_encoding_stands_alone,
               check_model_constants_do_not_depend_on_the_cache,
               check_score_matches_decode, check_kept_mask, check_error_not_growing_with_budget,
               check_edge_inputs_stay_finite, check_trial_order_invariant, check_diagnostics_per_trial))


def check_scheme(factory: Factory, *, skip: tuple[str, ...] = ()) -> None:
    """Run every check (but those named in skip) on the factory's schemes; ConformanceError
    listing every failure, one sentence per check, if any fails. A check that raises something
    else reports it as the codec's error in that check."""
    run_checks(CHECKS, factory, skip, "the codec")


def pytest_params(factories: dict[str, Factory], expected_failures: dict[tuple[str, str], str] | None = None):
    """pytest parameters (check, factory) for every check and factory, ids `label-check`;
    expected_failures maps (check name, label) to the reason the pair is expected to fail
    (marked xfail, strict). Use: @pytest.mark.parametrize("check,factory", pytest_params({...}))
    and call check.run(factory)."""
    import pytest

    expected_failures = expected_failures or {}
    params = []
    for label, factory in factories.items():
        for check in CHECKS:
            reason = expected_failures.get((check.name, label))
            marks = [pytest.mark.xfail(reason=reason, strict=True, raises=ConformanceError)] if reason else []
            params.append(pytest.param(check, factory, id=f"{label}-{check.name}", marks=marks))
    return params
