"""Conformance checks every registered scheme passes with no test code of its own.

Each `check_<property>(name)` builds the scheme through the registry and raises
AssertionError when the property fails. tests/test_conformance.py applies every check to
every name in `schemes.available()`; EXPECTED_FAILURES lists exceptions with their reason.
"""
from __future__ import annotations

import math

import torch

import schemes
from schemes.base import BitLedger, call_with_optional, stored_bits

DIM = 64
SHAPE = (3, 2, 48, DIM)  # B, H, S, d — small enough for every scheme, two heads
N_QUERIES = 5

# (check name, scheme name) -> reason; a pair listed here is expected to fail.
EXPECTED_FAILURES: dict[tuple[str, str], str] = {}

# scheme name -> (options, reason): parameters a scheme takes in this suite where its defaults do
# not fit the suite's small caches (S = 48 tokens).
TEST_OPTIONS: dict[str, tuple[dict, str]] = {
    "kvpress:SnapKVPress": ({"window_size": 8}, "its 64-token observation window needs more than 64 cached tokens"),
    "kvpress:PyramidKVPress": ({"window_size": 8}, "its 64-token observation window needs more than 64 cached tokens"),
}


def _make(name: str, budget: int = 3, seed: int = 0, dim: int = DIM):
    options = TEST_OPTIONS.get(name, ({}, ""))[0]
    return schemes.create(name, budget=budget, dim=dim, seed=seed, **options)


def _data(seed: int = 0, shape=SHAPE, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(shape, generator=g, dtype=dtype)
    v = torch.randn(shape, generator=g, dtype=dtype)
    q = torch.randn(shape[:2] + (N_QUERIES, shape[3]), generator=g, dtype=dtype)
    return k, v, q


def _roundtrip(scheme, k, v, trials=None):
    """fit, encode, decode; `trials` (the trial indices) go to a fit that takes them."""
    if trials is None:
        scheme.fit(k, v)
    else:
        call_with_optional(scheme.fit, k, v, trials=trials)
    enc = scheme.encode(k, v)
    return enc, scheme.decode(enc)


def check_roundtrip_keeps_shape_dtype_device(name):
    for dtype in (torch.float32, torch.float64):
        k, v, _ = _data(dtype=dtype)
        _, (k_hat, v_hat) = _roundtrip(_make(name), k, v)
        for x, x_hat in ((k, k_hat), (v, v_hat)):
            assert x_hat.shape == x.shape, (x_hat.shape, x.shape)
            assert x_hat.dtype == x.dtype, (x_hat.dtype, x.dtype)
            assert x_hat.device == x.device


def check_same_seed_same_codes(name):
    k, v, _ = _data()
    enc_a, _ = _roundtrip(_make(name, seed=7), k, v)
    enc_b, _ = _roundtrip(_make(name, seed=7), k, v)
    for part in ("codes", "side"):
        a, b = getattr(enc_a, part), getattr(enc_b, part)
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), f"{part}.{key} differs between two runs with one seed"


def check_input_not_mutated(name):
    k, v, q = _data()
    k0, v0, q0 = k.clone(), v.clone(), q.clone()
    scheme = _make(name)
    enc, _ = _roundtrip(scheme, k, v)
    scheme.score(q, enc)
    assert torch.equal(k, k0) and torch.equal(v, v0) and torch.equal(q, q0)


def check_ledger_matches_storage(name):
    """The ledger is the stored bits, split into per-cache and per-model parts that add up to the
    stand-alone total, and no per-trial tensor stores values at full width."""
    k, v, _ = _data()
    scheme = _make(name)
    enc, _ = _roundtrip(scheme, k, v)
    ledger = scheme.bits(enc)
    b, h, s, d = SHAPE
    every = {("codes", key): stored_bits(t) // b for key, t in enc.codes.items()}
    every.update({("side", key): stored_bits(t) for key, t in enc.side.items()})
    assert enc.model <= enc.codes.keys() | enc.side.keys(), "Encoded.model names entries that are not stored"
    model = sum(bits for (_, key), bits in every.items() if key in enc.model)
    assert ledger.total == sum(every.values()) - model
    assert ledger.model_total == model
    assert ledger.standalone_total == ledger.total + ledger.model_total == sum(every.values())
    assert ledger == BitLedger.of(enc)
    assert ledger.n_elements == 2 * h * s * d and ledger.n_heads == h
    assert ledger.model_bits == model / h
    per_trial = BitLedger.per_trial(enc)
    assert per_trial.cache.shape == per_trial.model.shape == (b,)
    # exact per-trial counts never exceed the batch's padded ones
    assert (per_trial.cache <= ledger.total).all() and (per_trial.model <= ledger.model_total).all()
    assert torch.equal(per_trial.storage_bits_per_element(1), (per_trial.cache + per_trial.model) / (2 * h * s * d))
    assert torch.equal(per_trial.storage_bits_per_element(), per_trial.bits_per_element)
    for key, t in enc.codes.items():
        assert t.shape[0] == b, f"codes.{key} lacks the leading trial dimension"
        if t.is_floating_point():
            assert t[0].numel() < h * s * d, f"codes.{key} stores a full-size float tensor"
    assert 0 < ledger.bits_per_element < 32


def check_model_constants_do_not_depend_on_the_cache(name):
    """What a codec tags per model (Encoded.model) is shared by every cache of a layer-head: a
    fitted scheme stores the same model entries, and charges them alike, whatever cache it codes."""
    k, v, _ = _data(0)
    k_other, v_other, _ = _data(1)
    scheme = _make(name)
    call_with_optional(scheme.fit, k, v, trials=torch.arange(SHAPE[0]))
    a, b = scheme.encode(k, v), scheme.encode(3 * k_other, v_other)
    assert a.model == b.model
    for key in a.model:
        part = "codes" if key in a.codes else "side"
        assert torch.equal(getattr(a, part)[key], getattr(b, part)[key]), \
            f"{part}.{key} is tagged per model but depends on the cache coded"
    assert torch.equal(BitLedger.per_trial(a).model, BitLedger.per_trial(b).model)


def check_score_matches_decode(name):
    """score(q) equals q·k̂ᵀ/√d with k̂ = decode (also for QJL: the correction is linear in q)."""
    k, v, q = _data(dtype=torch.float64)
    scheme = _make(name)
    enc, (k_hat, _) = _roundtrip(scheme, k, v)
    logits = scheme.score(q, enc)
    expected = q @ k_hat.transpose(-1, -2) / math.sqrt(DIM)
    assert logits.shape == (SHAPE[0], SHAPE[1], N_QUERIES, SHAPE[2])
    assert torch.allclose(logits, expected, rtol=1e-9, atol=1e-9), (logits - expected).abs().max()


def check_kept_mask(name):
    """Scheme.kept is None (every token held) or a bool (B, H, S) mask with a kept token in every
    head, on the cache's device; the tokens it evicts decode to zero in K and V."""
    k, v, _ = _data()
    scheme = _make(name)
    enc, (k_hat, v_hat) = _roundtrip(scheme, k, v)
    kept = scheme.kept(enc)
    if kept is None:
        return
    assert kept.dtype == torch.bool and kept.shape == SHAPE[:3] and kept.device == k.device
    assert kept.any(-1).all(), "a head keeps no token"
    for x_hat in (k_hat, v_hat):
        assert torch.equal(x_hat[~kept], torch.zeros_like(x_hat[~kept])), "an evicted token decodes to non-zero"


def check_error_not_growing_with_budget(name):
    k, v, _ = _data(shape=(4, 1, 256, DIM))
    errors = []
    for budget in range(1, 9):
        _, (k_hat, v_hat) = _roundtrip(_make(name, budget=budget), k, v)
        errors.append(float(((k - k_hat) ** 2).sum() + ((v - v_hat) ** 2).sum()))
    for b, (lo, hi) in enumerate(zip(errors, errors[1:]), start=1):
        assert hi <= lo * 1.02, f"error grows from budget {b} ({lo:.4g}) to {b + 1} ({hi:.4g})"


def check_edge_inputs_stay_finite(name):
    b, h, s, d = SHAPE
    cases = {
        "zeros": torch.zeros(SHAPE),
        "constant rows": torch.full(SHAPE, 0.3),
        "one token": torch.randn(b, h, 1, d),
        "huge magnitudes": torch.randn(SHAPE) * 1e30,
        "tiny magnitudes": torch.randn(SHAPE) * 1e-30,
    }
    for case, x in cases.items():
        scheme = _make(name)
        enc, (k_hat, v_hat) = _roundtrip(scheme, x, x.clone())
        q = torch.randn(x.shape[0], x.shape[1], N_QUERIES, d)
        assert torch.isfinite(k_hat).all() and torch.isfinite(v_hat).all(), f"{case}: decode not finite"
        if case != "huge magnitudes":  # logits of 1e30-sized keys overflow float32 by construction
            assert torch.isfinite(scheme.score(q, enc)).all(), f"{case}: score not finite"
        if case == "zeros":
            assert torch.equal(k_hat, x), "zeros must decode to zeros"


def check_trial_order_invariant(name):
    """Permuting the trials (with their indices) permutes the output: a scheme never mixes trials."""
    k, v, q = _data()
    perm = torch.tensor([2, 0, 1])
    scheme = _make(name)
    enc, (k_hat, v_hat) = _roundtrip(scheme, k, v, trials=torch.arange(3))
    enc_p, (k_hat_p, v_hat_p) = _roundtrip(_make(name), k[perm], v[perm], trials=perm)
    assert torch.allclose(k_hat_p, k_hat[perm], atol=1e-6) and torch.allclose(v_hat_p, v_hat[perm], atol=1e-6)
    single_enc, (k_one, _) = _roundtrip(_make(name), k[1:2], v[1:2], trials=torch.tensor([1]))
    assert torch.allclose(k_one, k_hat[1:2], atol=1e-6), "a trial's result depends on the batch"


CHECKS = [obj for key, obj in dict(globals()).items() if key.startswith("check_")]
