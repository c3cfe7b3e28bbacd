"""The metrics' per-token terms and the logits' sums in one compiled pass per row
(stats/metrics_cpu.py) against the torch passes of stats/metrics.py (kvcommon.compiled.DTYPES
emptied): the same bits, per token, per query and in every row of trial_metrics, over shapes,
dtypes, widths that are and are not a multiple of the vector (the tail) or long enough for torch's
cascade of partial sums, and rows that are zero, NaN, ±inf, huge or subnormal."""
import math
import platform

import pytest
import torch
from hypothesis import given, settings, strategies as st

from kvcommon import compiled, sum_cpu, vector_norm_cpu
from kvcommon.rows import EVICTION_METRIC_NAMES, METRIC_NAMES
from stats import metrics, metrics_cpu
from test_turboquant_cpu import _same

DTYPES = (torch.float32, torch.float64)


def _rows(shape, dtype, seed, special):
    """x (shape) of Gaussian rows of scales 1e-20..1e20 and x̂ = x plus noise of relative size
    1e-6..1 per row; with `special`, where there is room: x̂ = x exactly, x̂ zero, x zero, both
    zero, a NaN in x, +inf in x̂, −inf in x, a subnormal row, x̂ = −x."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    x *= 10.0 ** (torch.rand(*shape[:-1], 1, generator=g, dtype=torch.float64) * 40 - 20)
    noise = torch.randn(*shape, generator=g, dtype=torch.float64)
    x_hat = x + noise * x.abs().amax(-1, keepdim=True) * 10.0 ** (torch.rand(*shape[:-1], 1, generator=g,
                                                                              dtype=torch.float64) * 6 - 6)
    x, x_hat = x.to(dtype), x_hat.to(dtype)
    if special:
        xr, hr = x.view(-1, shape[-1]), x_hat.view(-1, shape[-1])
        tiny = torch.finfo(dtype).tiny
        for r, (a, b) in enumerate([(None, "same"), (None, 0.0), (0.0, None), (0.0, 0.0), ("nan", None),
                                    (None, "inf"), ("-inf", None), ("subnormal", "subnormal"), (None, "neg")]):
            if r >= xr.shape[0]:
                break
            if a == 0.0:
                xr[r] = 0.0
            elif a == "nan":
                xr[r, -1] = math.nan
            elif a == "-inf":
                xr[r, 0] = -math.inf
            elif a == "subnormal":
                xr[r] = tiny * torch.randn(shape[-1], generator=g, dtype=torch.float64).to(dtype) / 4
            if b == "same":
                hr[r] = xr[r]
            elif b == 0.0:
                hr[r] = 0.0
            elif b == "inf":
                hr[r, shape[-1] // 2] = math.inf
            elif b == "subnormal":
                hr[r] = xr[r] / 2
            elif b == "neg":
                hr[r] = -xr[r]
    return x, x_hat


def _torch_terms(x, x_hat, monkeypatch):
    """The torch passes' per-token terms (the compiled loops switched off), direction filled in."""
    with monkeypatch.context() as m:
        m.setattr(compiled, "DTYPES", ())
        assert metrics._compiled_terms(x, x_hat) is None
        xx, hh, ee, direction = metrics._token_terms(x.clone(), x_hat.clone())
    assert direction is None
    return xx, hh, ee, metrics._rel_and_direction(xx, hh, ee)[1]


@settings(max_examples=40, deadline=None)
@given(n_trials=st.integers(1, 3), n_heads=st.integers(1, 2), n_tokens=st.integers(1, 40),
       d=st.one_of(st.integers(1, 40), st.sampled_from([64, 100, 128, 256, 1000, 1024])),
       dtype=st.sampled_from(DTYPES), special=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_token_terms_are_the_bits_of_the_torch_passes(n_trials, n_heads, n_tokens, d, dtype, special, seed):
    """‖x_s‖², ‖x̂_s‖², ‖x_s − x̂_s‖² and the token's direction error: the compiled pass gives the
    torch passes' bits, token by token (NaN where they give NaN)."""
    x, x_hat = _rows((n_trials, n_heads, n_tokens, d), dtype, seed, special)
    fused = metrics._compiled_terms(x, x_hat)
    assert fused is (metrics_cpu if metrics_cpu.takes(dtype, d) else None)
    if fused is None:                    # no order reproduces vector_norm at this d: the torch passes
        return
    got = fused.token_terms(x, x_hat)
    with pytest.MonkeyPatch.context() as mp:
        want = _torch_terms(x, x_hat, mp)
    for name, a, b in zip(("xx", "hh", "ee", "direction"), got, want):
        assert a.shape == x.shape[:-1] and _same(a, b), name
    *energies, direction = fused.token_terms(x, x_hat, False)      # the energies alone (error_point, relative_mse)
    assert direction is None and all(_same(a, b) for a, b in zip(energies, got))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_pass_is_taken_at_the_widths_a_sweep_meets(dtype):
    """On x86 torch builds an order of norm_order reproduces vector_norm at every head dimension
    (powers of two) and at cache and query lengths of a sweep (the logits' rows), so the pass is
    taken and the equality tests are not vacuous. (Some other widths have no order: float32 rows
    whose tail past the vector is 5-7 entries long; they go to the torch passes.)"""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the vector widths of other CPUs' torch builds are not listed here")
    assert all(metrics_cpu.takes(dtype, d) for d in (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 777))


def _trial(b, h, s, nq, d, dtype, seed, special, evict):
    g = torch.Generator().manual_seed(seed + 1)
    k, k_hat = _rows((b, h, s, d), dtype, seed, special)
    v, v_hat = _rows((b, h, s, d), dtype, seed + 2, special)
    k, k_hat = torch.nan_to_num(k), torch.nan_to_num(k_hat)        # finite logits: T and the KL defined
    q = torch.randn(b, h, nq, d, generator=g, dtype=torch.float64).to(dtype)
    kept = None
    if evict:
        kept = torch.rand(b, h, s, generator=g) < 0.6
        kept[..., 0] = True
        k_hat, v_hat = torch.where(kept[..., None], k_hat, 0.0), torch.where(kept[..., None], v_hat, 0.0)
    return k, v, q, k_hat, v_hat, metrics.exact_logits(q, k_hat), kept


def _spy(function, name, calls):
    """function, recording its name in calls at each call."""
    def spied(*args):
        calls.append(name)
        return function(*args)
    return spied


def _metrics(tensors):
    """trial_metrics on fresh copies (no memo of an earlier call answers)."""
    return metrics.trial_metrics(*(t.clone() if t is not None else None for t in tensors))


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 3), h=st.integers(1, 2), s=st.integers(1, 48), nq=st.integers(1, 6),
       d=st.sampled_from([1, 3, 8, 12, 13, 32, 64, 100, 128]), dtype=st.sampled_from(DTYPES), special=st.booleans(),
       evict=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_trial_metrics_rows_are_the_same_with_and_without_the_compiled_pass(b, h, s, nq, d, dtype, special, evict,
                                                                          seed):
    """Every metric of trial_metrics (with an evicting codec's kept mask too) holds the same bits
    whether the per-token terms come from the compiled pass or from the torch passes."""
    tensors = _trial(b, h, s, nq, d, dtype, seed, special, evict)
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        for name in ("token_terms", "logit_terms", "kl_terms"):
            mp.setattr(metrics_cpu, name, _spy(getattr(metrics_cpu, name), name, calls))
        fused = _metrics(tensors)
        logits = metrics_cpu.takes_products(dtype, s)
        assert ("logit_terms" in calls) == logits                   # the logits' rows; the KL's (float64):
        assert ("kl_terms" in calls) == metrics_cpu.takes_products(torch.float64, s)   # K's, V's, T's:
        assert ("token_terms" in calls) == (metrics_cpu.takes(dtype, d) or (metrics_cpu.takes(dtype, s) and not logits))
        mp.setattr(compiled, "DTYPES", ())
        calls.clear()
        plain = _metrics(tensors)
        assert not calls                                            # the switch routes to torch
    names = METRIC_NAMES + (EVICTION_METRIC_NAMES if evict else ())
    assert list(fused) == list(plain) == list(names)
    for name in names:
        assert _same(fused[name], plain[name]), name


@settings(max_examples=30, deadline=None)
@given(n_rows=st.integers(1, 40), n=st.sampled_from([1, 3, 7, 8, 9, 17, 64, 100, 256, 777, 1024, 1031, 4099]),
       dtype=st.sampled_from(DTYPES), special=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_logit_terms_are_the_bits_of_the_torch_passes(n_rows, n, dtype, special, seed):
    """‖s_q‖², ‖s_q − ŝ_q‖² and Σ ŝ_qi·s_qi of each query's logits: the compiled pass gives the bits
    of vector_norm and of torch.sum(ŝ * s, dim=-1), at lengths below one vector, with a tail, and
    long enough for the cascade's levels (4099)."""
    s, s_hat = _rows((n_rows, n), dtype, seed, special)
    if not metrics_cpu.takes_products(dtype, n):
        return
    ss, ee, products = metrics_cpu.logit_terms(s, s_hat)
    assert _same(ss, metrics._per_token_sq(s)) and _same(ee, metrics._per_token_sq(s - s_hat))
    assert _same(products, torch.sum(s_hat * s, dim=-1))


@settings(max_examples=30, deadline=None)
@given(b=st.integers(1, 2), h=st.integers(1, 2), nq=st.integers(1, 5),
       s=st.sampled_from([1, 3, 7, 9, 17, 64, 100, 777, 1024, 1031]), evict=st.booleans(), wild=st.booleans(),
       seed=st.integers(0, 2 ** 16))
def test_kl_terms_are_the_bits_of_the_torch_passes(b, h, nq, s, evict, wild, seed):
    """Each query's Σ p·(log p − log p̂) over its tokens (0 for an evicted token, whose log p and
    log p̂ are −inf): the compiled pass gives torch.sum(where(kept, p * (log p − log p̂), 0))'s
    bits; with `wild`, logits of scale 1e3 (probabilities that underflow to 0, −inf−(−inf)) and
    a NaN query."""
    g = torch.Generator().manual_seed(seed)
    scale = 1e3 if wild else 3.0
    logits, logits_hat = (scale * torch.randn(b, h, nq, s, generator=g, dtype=torch.float64) for _ in range(2))
    if wild:
        logits_hat[0, 0, 0, 0] = math.nan
    kept = None
    if evict:
        kept = torch.rand(b, h, s, generator=g) < 0.6
        kept[..., 0] = True
    log_p = torch.log_softmax(metrics._kept_logits(logits, kept), dim=-1)
    log_p_hat = torch.log_softmax(metrics._kept_logits(logits_hat, kept), dim=-1)
    p = log_p.exp()
    if not metrics_cpu.takes_products(torch.float64, s):
        return
    terms = p * (log_p - log_p_hat)
    if evict:
        terms = torch.where(kept[:, :, None, :], terms, 0.0)
    assert _same(metrics_cpu.kl_terms(p, log_p, log_p_hat, kept), torch.sum(terms, dim=-1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_sum_order_is_found_at_the_lengths_a_sweep_meets(dtype):
    """On x86 torch builds sum_order reproduces torch.sum at every cache length a sweep meets
    (and lengths with a tail), so the logits' pass is taken and its equality tests are not vacuous."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the vector widths of other CPUs' torch builds are not listed here")
    assert all(metrics_cpu.takes_products(dtype, n) for n in (64, 128, 256, 512, 777, 1024, 2048, 4096))


def _rows_without(monkeypatch, tensors, module, candidates, order, unused: str):
    """The metrics of tensors with module's candidate orders replaced by ones that reproduce no
    torch reduction (order: the probe's cache, cleared around it): metrics_cpu.`unused` is never
    called and the rows are the torch passes'."""
    monkeypatch.setattr(module, candidates[0], candidates[1])
    order.cache_clear()
    try:
        calls = []
        with monkeypatch.context() as m:
            m.setattr(metrics_cpu, unused, lambda *a: calls.append(a))
            got = _metrics(tensors)
        assert not calls
    finally:
        order.cache_clear()
    monkeypatch.setattr(compiled, "DTYPES", ())
    want = _metrics(tensors)
    assert all(_same(got[name], want[name]) for name in METRIC_NAMES)


def test_the_torch_passes_where_no_sum_order_reproduces_torch_sum(monkeypatch):
    """Where no vector width gives torch.sum's bits, the logits' sums are torch's (the per-token
    pass is still taken) and the rows are the same."""
    tensors = _trial(2, 1, 40, 4, 64, torch.float32, 5, False, False)
    with monkeypatch.context() as m:
        m.setattr(sum_cpu, "_SUM_LANES", (3,))
        sum_cpu.sum_order.cache_clear()
        assert not metrics_cpu.takes_products(torch.float32, 40) and metrics_cpu.takes(torch.float32, 40)
    _rows_without(monkeypatch, tensors, sum_cpu, ("_SUM_LANES", (3,)), sum_cpu.sum_order, "logit_terms")


def test_a_single_long_row_goes_to_torch():
    """torch splits a single row of 32 k entries or more across its threads (an order of its own):
    such a row is left to the torch passes; many rows of that length are not."""
    x, x_hat = _rows((1, 1, 1, 40000), torch.float32, 6, False)
    assert metrics._compiled_terms(x, x_hat) is None
    x, x_hat = _rows((1, 1, 2, 40000), torch.float32, 6, False)
    assert metrics._compiled_terms(x, x_hat) is not None or not metrics_cpu.takes(torch.float32, 40000)


def test_rows_split_across_threads_give_the_same_bits(monkeypatch):
    """A call of ≥ 64 k elements splits its rows into one block per torch thread: the terms are
    the one-thread terms."""
    x, x_hat = _rows((3, 2, 300, 128), torch.float32, 7, True)
    s, s_hat = _rows((3, 2, 100, 1024), torch.float32, 8, True)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    one = metrics._token_terms(x, x_hat, directions=True) + metrics_cpu.logit_terms(s, s_hat)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    split = metrics._token_terms(x, x_hat, directions=True) + metrics_cpu.logit_terms(s, s_hat)
    assert all(_same(a, b) for a, b in zip(one, split))


@pytest.mark.parametrize("case", ["half", "transposed", "mixed dtypes", "empty"])
def test_the_torch_passes_where_the_pass_does_not_take_the_tensors(case):
    """Other dtypes (float16), a non-contiguous tensor (vector_norm may sum its rows in another
    order), mixed dtypes and empty tensors go to the torch passes, with their results."""
    x, x_hat = _rows((2, 1, 16, 32), torch.float32, 3, False)
    if case == "half":
        x, x_hat = x.half(), x_hat.half()
    elif case == "transposed":
        x, x_hat = x.transpose(-1, -2), x_hat.transpose(-1, -2)
    elif case == "mixed dtypes":
        x_hat = x_hat.double()
    else:
        x, x_hat = x[:, :, :0], x_hat[:, :, :0]
    assert metrics._compiled_terms(x, x_hat) is None
    assert metrics._token_terms(x, x_hat)[3] is None


def test_the_torch_passes_where_no_norm_order_reproduces_vector_norm(monkeypatch):
    """Where no candidate order gives vector_norm's bits, takes() is False and the metrics are the
    torch passes' (the same rows as ever)."""
    with monkeypatch.context() as m:
        m.setattr(vector_norm_cpu, "_NORM_ORDERS", ((3, False),))
        vector_norm_cpu.norm_order.cache_clear()
        assert not metrics_cpu.takes(torch.float32, 64)
        x, x_hat = _rows((2, 1, 16, 64), torch.float32, 4, True)
        assert metrics._compiled_terms(x, x_hat) is None
    tensors = _trial(2, 1, 16, 4, 64, torch.float32, 4, False, False)
    _rows_without(monkeypatch, tensors, vector_norm_cpu, ("_NORM_ORDERS", ((3, False),)), vector_norm_cpu.norm_order,
                  "token_terms")
