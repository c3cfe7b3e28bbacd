"""kvpress presses as codecs (schemes/kvpress_bridge.py): registration and listing, the budget's
share of kept tokens and the measured ledger, the prefill queries a press observes, and the
cross-check against kvharness's own eviction codecs. CI installs kvpress (the test extra), so
there every bridged press runs here and through the conformance suite."""
import math
import os

import numpy as np
import pytest
import torch

import schemes
from harness.cell import draw_trials, run_cell_chunk
from harness.sweep import Cell, SweepConfig
from schemes import registry
from schemes.base import BitLedger
from schemes.baselines import kept_tokens

if os.environ.get("CI") == "true":
    import kvpress  # noqa: F401  (CI must run the presses: a missing kvpress fails here, never skips)
else:
    pytest.importorskip("kvpress")

from schemes import kvpress_bridge  # noqa: E402

# five presses CI runs end to end: norm-, attention-, window-, value- and similarity-based
FIVE = ("kvpress:KnormPress", "kvpress:SnapKVPress", "kvpress:TOVAPress", "kvpress:StreamingLLMPress",
        "kvpress:ObservedAttentionPress", "kvpress:KeyDiffPress", "kvpress:CURPress")


def _data(b=3, h=2, s=160, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, s, d, generator=g) for _ in range(3))


def test_presses_are_registered_with_their_docstrings():
    names = [n for n in schemes.available() if n.startswith("kvpress:")]
    assert set(FIVE) <= set(names) and len(names) >= 10
    import kvpress
    for name in FIVE:
        first = kvpress.__dict__[name.split(":")[1]].__doc__.strip().splitlines()[0].strip()
        assert schemes.specs()[name].description == first


def test_presses_that_cannot_run_say_why():
    reasons = schemes.unavailable()
    assert "model" in reasons["kvpress:QFilterPress"] and "hub" in reasons["kvpress:QFilterPress"]
    assert "wraps another press" in reasons["kvpress:AdaKVPress"]
    assert "channels" in reasons["kvpress:ThinKPress"]
    assert not set(reasons) & set(schemes.available())
    with pytest.raises(ValueError, match="kvpress:QFilterPress.*cannot run here.*Q-filters"):
        schemes.create("kvpress:QFilterPress", budget=2, dim=32)


def test_list_all_names_every_press(capsys):
    from harness.cli import main
    assert main(["list", "--all"]) == 0
    out = capsys.readouterr().out
    assert "kvpress:SnapKVPress" in out and "SnapKV: Attention-based KV cache compression" in out
    assert "schemes that cannot run here:" in out and "kvpress:KVzipPress" in out


@pytest.mark.parametrize("name", FIVE)
@pytest.mark.parametrize("budget", (2, 4))
def test_budget_keeps_its_share_and_the_ledger_counts_it(name, budget):
    """b bits per element keep round(S·b/16) fp16 tokens: the ledger is those tokens, their int16
    indices and the two int16 shifts, exactly."""
    k, v, q = _data()
    scheme = schemes.create(name, budget=budget, dim=32)
    enc = scheme.encode(k, v, queries=q)
    b, h, s, d = k.shape
    n = kept_tokens(s, budget)
    kept = scheme.kept(enc)
    assert (kept.sum(-1) == n).all()
    k_hat, v_hat = scheme.decode(enc)
    assert torch.equal(k_hat[kept], k[kept].half().float()) and torch.equal(v_hat[kept], v[kept].half().float())
    per_head = 2 * n * d * 16 + n * 16
    assert BitLedger.of(enc).total == h * per_head + 2 * 16


def test_streaming_llm_press_keeps_exactly_what_streaming_keeps():
    """Cross-check: kvpress's StreamingLLMPress (n_sink = 4) and kvharness's streaming (4 sinks)
    keep the same tokens and decode to the same cache for every budget and several lengths; only
    the ledger differs, by the press's stored indices (streaming's are implied by S)."""
    for s in (64, 200, 1024):
        k, v, q = _data(b=2, h=2, s=s, d=16, seed=s)
        for budget in range(1, 9):
            if kept_tokens(s, budget) <= 4:
                continue   # no window left: kvpress ranks tied sinks, streaming keeps the first n
            ours, press = schemes.create("streaming", budget=budget, dim=16), \
                schemes.create("kvpress:StreamingLLMPress", budget=budget, dim=16)
            enc_ours, enc_press = ours.encode(k, v), press.encode(k, v, queries=q)
            assert torch.equal(ours.kept(enc_ours), press.kept(enc_press)), (s, budget)
            for a, b in zip(ours.decode(enc_ours), press.decode(enc_press)):
                assert torch.equal(a, b)
            n = kept_tokens(s, budget)
            assert BitLedger.of(enc_press).total - BitLedger.of(enc_ours).total == 2 * n * 16


def _config(**kw):
    return SweepConfig(scenarios=("heavy_tail",), schemes=FIVE, budgets=(2,), dims=(32,), seq_lens=(160,),
                       queries=(8,), trials=3, **kw)


def test_prefill_queries_are_a_draw_of_their_own():
    """q_prefill is drawn on streams of its own: k, v, q and the calibration draw do not move."""
    config = _config()
    cell = Cell("heavy_tail", FIVE[0], 2, 32, 160, 8, 512)
    plain = draw_trials(config, cell, range(3), torch.device("cpu"), torch.float32)
    with_q = draw_trials(config, cell, range(3), torch.device("cpu"), torch.float32, prefill_queries=True)
    for name, x in plain.items():
        assert torch.equal(x, with_q[name]), name
    assert with_q["q_prefill"].shape == (3, 1, 160, 32)
    assert not torch.equal(with_q["q_prefill"][..., :8, :], with_q["q"])
    assert schemes.create(FIVE[0], budget=2, dim=32).capabilities.prefill_queries
    assert not schemes.create("h2o", budget=2, dim=32).capabilities.prefill_queries


def test_the_press_sees_the_prefill_queries():
    """The module's queries are exactly the queries handed in: TOVA keeps what the last prefill
    query attends to. One key is aligned with the last query and the keys are otherwise random."""
    k, v, q = _data(b=1, h=1, s=128, d=32, seed=3)
    q[0, 0, -1] = 0
    q[0, 0, -1, 0] = 40.0
    k[0, 0, :, 0] = -1.0
    k[0, 0, 17, 0] = 3.0   # the only key the last query favours
    press = schemes.create("kvpress:TOVAPress", budget=1, dim=32)
    kept = press.kept(press.encode(k, v, queries=q))[0, 0]
    assert kept[17] and kept[-1] and int(kept.sum()) == kept_tokens(128, 1)
    q_other = q.clone()
    q_other[0, 0, -1, 0] = -40.0   # now every key but 17 is favoured over it
    assert not press.kept(press.encode(k, v, queries=q_other))[0, 0, 17]


@pytest.mark.parametrize("name", FIVE)
def test_presses_run_through_the_runner(name):
    """The runner hands the press the scenario's prefill queries and computes evicted_mass and
    the kept-token metrics from its kept mask; the ledger is the budget's share of fp16 tokens."""
    config = _config()
    cell = Cell("heavy_tail", name, 2, 32, 160, 8, 512)
    data = draw_trials(config, cell, range(3), torch.device("cpu"), torch.float32, prefill_queries=True)
    scheme = schemes.create(name, budget=2, dim=32, seed=5)
    metrics, bits = run_cell_chunk(scheme, data)
    assert np.isfinite(metrics["evicted_mass"]).all() and (metrics["evicted_mass"] > 0).all()
    assert np.isfinite(metrics["kl_attn"]).all() and np.isfinite(metrics["d2_t"]).all()
    n = kept_tokens(160, 2)
    assert torch.equal(bits.cache, torch.full((3,), float(2 * n * 32 * 16 + n * 16 + 32), dtype=torch.float64))


def test_h2o_and_observed_attention_differ_as_stated():
    """Cross-check with h2o (documented in the README): ObservedAttentionPress, kvpress's nearest
    to H2O, scores a token by the mean causal attention it receives from every prefill query, with
    no reserved recent window; h2o sums the attention from the last 32 keys as observers and keeps
    half its budget as the recent window. Given the keys as queries, the press's choice outside
    h2o's recent window still overlaps h2o's heavy hitters far above chance."""
    k, v, _ = _data(b=4, h=1, s=256, d=32, seed=11)
    k = k * torch.linspace(0.5, 2.0, 256)[:, None]   # keys of growing norm: attention is uneven
    budget, s = 4, 256
    h2o, press = schemes.create("h2o", budget=budget, dim=32), \
        schemes.create("kvpress:ObservedAttentionPress", budget=budget, dim=32)
    kept_h2o, kept_press = h2o.kept(h2o.encode(k, v)), press.kept(press.encode(k, v))
    n = kept_tokens(s, budget)
    recent = int(n * 0.5)
    old = slice(0, s - recent)
    overlap = (kept_h2o[..., old] & kept_press[..., old]).sum(-1).double()
    chance = (n - recent) * kept_press[..., old].sum(-1).double() / (s - recent)
    assert (overlap > 1.5 * chance).all(), (overlap, chance)
    assert not torch.equal(kept_h2o, kept_press)


def test_registry_loads_kvpress_only_for_its_names(monkeypatch):
    """A built-in resolves without the kvpress namespace; a kvpress name loads only it."""
    monkeypatch.setattr(registry, "_loaded", {})
    assert registry.spec("tq-kv") is not None and "kvpress" not in registry._loaded
    assert registry.spec("kvpress:KnormPress") is not None and "kvpress" in registry._loaded


def test_compression_ratio_gives_the_count():
    import kvpress.utils
    for s in (1, 2, 7, 48, 160, 1000, 1024, 4096):
        for budget in range(1, 9):
            n = kept_tokens(s, budget)
            r = kvpress_bridge.compression_ratio(s, n)
            assert 0 <= r < 1
            assert (s if r == 0 else kvpress.utils.compute_n_kept(s, r)) == n


def test_matching_refuses_edited_tokens():
    k, v, _ = _data(b=1, h=1, s=20, d=8)
    idx = torch.tensor([[[3, 3, 7]]])
    k[0, 0, 3] = k[0, 0, 5] = k[0, 0, 9]     # identical tokens take distinct indices
    v[0, 0, 3] = v[0, 0, 5] = v[0, 0, 9]
    gather = idx[..., None].expand(-1, -1, -1, 8)
    found = kvpress_bridge.match_tokens(k, v, k.gather(2, gather), v.gather(2, gather))
    assert sorted(found[0, 0].tolist()) == [3, 5, 7]
    with pytest.raises(ValueError, match="not input tokens"):
        kvpress_bridge.match_tokens(k, v, k.gather(2, gather) * 1.5, v.gather(2, gather))


def test_token_signatures_do_not_depend_on_the_batch():
    """A token hashes alike among S tokens and among any subset of them, in every dtype; the
    float64 projection used before differed in the last bits between a (1, 2, 48, 64) cache and
    its 9 kept tokens on an AMD EPYC with MKL, and every press was refused."""
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        for s, d in ((48, 64), (1024, 128), (333, 256)):
            k = torch.randn(1, 2, s, d, generator=g).to(dtype)
            v = torch.randn(1, 2, s, d, generator=g).to(dtype)
            idx = torch.randperm(s, generator=g)[: s // 5 + 1].expand(1, 2, -1)
            gather = idx[..., None].expand(-1, -1, -1, d)
            sig = kvpress_bridge.token_signatures(k, v)
            assert sig.dtype == torch.int64 and sig.shape == (1, 2, s)
            assert torch.equal(kvpress_bridge.token_signatures(k.gather(2, gather), v.gather(2, gather)),
                               sig.gather(2, idx))
            assert sig.unique().numel() == 2 * s or sig[0, 0].unique().numel() == s   # no collision
            assert torch.equal(kvpress_bridge.match_tokens(k, v, k.gather(2, gather), v.gather(2, gather)), idx)
    # the hash reads every bit: one ulp in one element changes it
    k, v, _ = _data(b=1, h=1, s=4, d=8)
    k2 = k.clone()
    k2[0, 0, 2, 5] = torch.nextafter(k2[0, 0, 2, 5], torch.tensor(math.inf))
    a, b = kvpress_bridge.token_signatures(k, v), kvpress_bridge.token_signatures(k2, v)
    assert torch.equal(a[..., [0, 1, 3]], b[..., [0, 1, 3]]) and a[0, 0, 2] != b[0, 0, 2]


def test_press_options_are_checked():
    with pytest.raises(ValueError, match="unknown press option.*window_size"):
        schemes.create("kvpress:SnapKVPress", budget=2, dim=32, window_sise=8)
    k, v, q = _data(b=1, h=1, s=40, d=8)
    with pytest.raises(ValueError, match="SnapKVPress on a cache of 40 tokens"):
        schemes.create("kvpress:SnapKVPress", budget=2, dim=8).encode(k, v, queries=q)
    assert math.isfinite(kvpress_bridge.compression_ratio(40, 5))
