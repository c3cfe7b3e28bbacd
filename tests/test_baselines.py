"""The survey baselines (schemes/baselines.py) against theory and brute-force references."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

import schemes
from schemes.baselines import kept_tokens, svd_rank
from schemes.fp16 import half_shift, shift_down, shift_up


def _gauss(shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _uniform(shape, seed=0):
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 4 - 2


def test_half_shift_is_exact_for_ordinary_data_and_rescues_extremes():
    x = _gauss((2, 3, 8, 16))
    shift = half_shift(x)
    assert torch.equal(shift, torch.zeros(2, dtype=torch.int16))          # ordinary data: plain fp16
    for scale in (1e30, 1e-30):
        y = x * scale
        s = half_shift(y)
        back = shift_up(shift_down(y, s).half().float(), s)
        assert torch.isfinite(back).all()
        assert torch.allclose(back, y, rtol=2 ** -10, atol=0)             # fp16 relative precision


@pytest.mark.parametrize("name,width", [("int8", 8), ("int4", 4)])
def test_group_quant_error_matches_uniform_quantiser_theory(name, width):
    """Smooth (uniform) data: the error per element is Δ²/12 with Δ = (max − min)/(2^b − 1) of its
    group, except the group's min and max, which land on the grid exactly: (g − 2)/g · Δ²/12."""
    x = _uniform((2, 2, 512, 64))
    scheme = schemes.create(name, budget=3, dim=64)
    enc = scheme.encode(x, x)
    k_hat, _ = scheme.decode(enc)
    groups = x.reshape(2, 2, 512, 2, 32)
    delta = (groups.amax(-1) - groups.amin(-1)) / ((1 << width) - 1)
    predicted = float((delta ** 2 / 12).mean()) * 30 / 32
    measured = float(((x - k_hat) ** 2).mean())
    assert measured == pytest.approx(predicted, rel=0.03)
    # every element within half a step (plus fp16 rounding of min and scale)
    bound = (delta / 2 + 4e-3 * delta * (1 << width) + 1e-3).repeat_interleave(32, dim=-1)
    assert ((x - k_hat).abs() <= bound).all()


@pytest.mark.parametrize("name,width", [("int8", 8), ("int4", 4)])
@pytest.mark.parametrize("group", [32, 16, 24])
def test_group_quant_ledger_is_exact(name, width, group):
    b, h, s, d = 3, 2, 40, 64
    scheme = schemes.create(name, budget=5, dim=d, group_size=group)
    enc = scheme.encode(_gauss((b, h, s, d)), _gauss((b, h, s, d), 1))
    n_groups = math.ceil(d / group)
    per_tensor = h * s * math.ceil(n_groups * group * width / 8) * 8 + h * s * n_groups * 2 * 16 + 16
    assert scheme.bits(enc).total == 2 * per_tensor
    assert scheme.bits(enc).bits_per_element == pytest.approx(2 * per_tensor / (2 * h * s * d))


def test_group_quant_constant_groups_decode_to_their_value():
    x = torch.full((1, 1, 4, 64), 0.25)                         # 0.25 is exact in fp16
    for name in ("int8", "int4", "kivi"):
        scheme = schemes.create(name, budget=2, dim=64)
        k_hat, v_hat = scheme.decode(scheme.encode(x, x))
        assert torch.equal(k_hat, x) and torch.equal(v_hat, x)


def test_kivi_residual_exact_and_quantised_part_within_half_step():
    b, h, s, d, bits = 2, 2, 100, 64, 2
    k, v = _gauss((b, h, s, d)), _gauss((b, h, s, d), 1)
    k[..., 5] *= 20                                          # an outlier channel: per-channel K groups absorb it
    scheme = schemes.create("kivi", budget=bits, dim=d)
    k_hat, v_hat = scheme.decode(scheme.encode(k, v))
    n_q = s - 32
    assert torch.equal(k_hat[:, :, n_q:], k[:, :, n_q:].half().float())
    assert torch.equal(v_hat[:, :, n_q:], v[:, :, n_q:].half().float())
    levels = (1 << bits) - 1
    # K: groups of 32 tokens per channel (the last one padded); brute-force step per group
    for start in range(0, n_q, 32):
        blk = k[:, :, start:min(start + 32, n_q)]
        delta = (blk.amax(2, keepdim=True) - blk.amin(2, keepdim=True)) / levels
        err = (blk - k_hat[:, :, start:start + blk.shape[2]]).abs()
        assert (err <= delta / 2 + 2e-3 * delta * levels + 1e-3).all()
    # V: groups of 32 channels per token
    blk = v[:, :, :n_q].reshape(b, h, n_q, 2, 32)
    delta = (blk.amax(-1, keepdim=True) - blk.amin(-1, keepdim=True)) / levels
    err = (blk - v_hat[:, :, :n_q].reshape(b, h, n_q, 2, 32)).abs()
    assert (err <= delta / 2 + 2e-3 * delta * levels + 1e-3).all()
    # per-channel grouping: the outlier channel does not inflate the other channels' K error
    quiet = torch.ones(d, dtype=torch.bool)
    quiet[5] = False
    assert float(((k - k_hat)[:, :, :n_q, quiet] ** 2).mean()) < 0.2


@given(st.integers(1, 8), st.integers(1, 300))
def test_streaming_keeps_sinks_and_window_exactly(budget, s):
    d = 8
    k, v = _gauss((2, 1, s, d)), _gauss((2, 1, s, d), 1)
    scheme = schemes.create("streaming", budget=budget, dim=d)
    enc = scheme.encode(k, v)
    k_hat, v_hat = scheme.decode(enc)
    n_keep = kept_tokens(s, budget)
    sinks = min(4, n_keep)
    kept = torch.zeros(s, dtype=torch.bool)
    kept[:sinks] = True
    kept[s - (n_keep - sinks):] = True
    assert int(kept.sum()) == n_keep
    assert torch.equal(scheme.kept(enc), kept.expand(2, 1, s))
    for x, x_hat in ((k, k_hat), (v, v_hat)):
        assert torch.equal(x_hat[:, :, kept], x[:, :, kept].half().float())
        assert torch.equal(x_hat[:, :, ~kept], torch.zeros_like(x_hat[:, :, ~kept]))
    # storage: the kept fp16 tokens plus two int16 shifts, nothing else
    assert scheme.bits(enc).total == 2 * (n_keep * d * 16 + 16)


def _h2o_scores(k: np.ndarray, n_observe: int = 32, self_attention: bool = False) -> np.ndarray:
    """Brute force: attention each token of one head's keys (S, d) accumulates from the last
    n_observe keys as queries, each attending to the tokens before it (and itself if asked)."""
    s, d = k.shape
    score = np.zeros(s)
    for p in range(max(1, s - n_observe), s):
        seen = p + 1 if self_attention else p
        logits = k[:seen] @ k[p] / math.sqrt(d)
        w = np.exp(logits - logits.max())
        score[:seen] += w / w.sum()
    return score


def _h2o_reference(k: np.ndarray, n_keep: int, n_observe: int = 32, self_attention: bool = False) -> set:
    """Brute force H2O selection for one head's keys (S, d)."""
    s = k.shape[0]
    n_recent = int(n_keep * 0.5)
    score = _h2o_scores(k, n_observe, self_attention)
    recent = set(range(s - n_recent, s))
    rest = [i for i in np.argsort(-score, kind="stable") if i not in recent]
    return recent | set(rest[: n_keep - n_recent])


def test_h2o_keeps_brute_force_heavy_hitters_and_masks_the_rest():
    b, h, s, d, budget = 2, 2, 160, 16, 4
    k, v = _gauss((b, h, s, d), dtype=torch.float64), _gauss((b, h, s, d), 1, torch.float64)
    scheme = schemes.create("h2o", budget=budget, dim=d)
    enc = scheme.encode(k, v)
    k_hat, v_hat = scheme.decode(enc)
    n_keep = kept_tokens(s, budget)
    kept = scheme.kept(enc)
    for i in range(b):
        for j in range(h):
            keep = sorted(_h2o_reference(k[i, j].numpy(), n_keep))
            got = enc.codes["index"][i, j].tolist()
            assert got == keep and kept[i, j].nonzero().flatten().tolist() == keep
            assert torch.equal(k_hat[i, j, keep], k[i, j, keep].half().double())
            evicted = sorted(set(range(s)) - set(keep))
            assert torch.equal(v_hat[i, j, evicted], torch.zeros(len(evicted), d, dtype=torch.float64))
    # storage: kept fp16 K and V, int16 indices, two shifts
    assert scheme.bits(enc).total == 2 * h * n_keep * d * 16 + h * n_keep * 16 + 2 * 16


def test_eviction_storage_tracks_budget_over_16():
    s, d = 1024, 64
    for name in ("streaming", "h2o", "svd"):
        for budget in (1, 2, 4, 8):
            scheme = schemes.create(name, budget=budget, dim=d)
            enc = scheme.encode(_gauss((1, 1, s, d)), _gauss((1, 1, s, d), 1))
            bpe = scheme.bits(enc).bits_per_element
            # svd rounds its rank down: one rank step is 16·(S + d)/(S·d) = 0.27 bits here
            assert budget - 0.3 <= bpe <= budget * 1.05, (name, budget, bpe)


def test_svd_matches_numpy_truncated_svd():
    b, h, s, d, budget = 2, 2, 96, 32, 4
    x = _gauss((b, h, s, d), dtype=torch.float64)
    scheme = schemes.create("svd", budget=budget, dim=d)
    enc = scheme.encode(x, x)
    k_hat, _ = scheme.decode(enc)
    r = svd_rank(s, d, budget)
    assert r == (budget * s * d) // (16 * (s + d)) and enc.codes["k.basis"].shape[-1] == r
    for i in range(b):
        for j in range(h):
            u, sv, vt = np.linalg.svd(x[i, j].numpy(), full_matrices=False)
            ref = (u[:, :r] * sv[:r]) @ vt[:r]
            # Eckart–Young error, reached up to fp16 storage of basis and coefficients
            err, ref_err = np.sum((k_hat[i, j].numpy() - x[i, j].numpy()) ** 2), np.sum(sv[r:] ** 2)
            assert ref_err <= err <= ref_err * 1.01 + 1e-3
            assert np.allclose(k_hat[i, j].numpy(), ref, atol=2e-2)
    assert scheme.bits(enc).total == 2 * (h * (s + d) * r * 16 + h * 16)


def test_svd_coefficients_do_not_overflow_fp16_when_a_token_norm_exceeds_it():
    """Peak 8000 (fp16-safe) but a row norm of ~90000: the stored fp16 coefficients must not be inf."""
    x = torch.full((1, 1, 8, 128), 8000.0)
    x[0, 0, :, ::2] = -8000.0
    x = x * torch.linspace(0.5, 1.0, 8).view(1, 1, 8, 1)
    s = schemes.create("svd", budget=4, dim=128)
    k_hat, v_hat = s.decode(s.encode(x, x))
    assert torch.isfinite(k_hat).all()
    assert float(((k_hat - x) ** 2).sum() / (x ** 2).sum()) < 1e-3   # rank-1 data: near exact


@pytest.mark.parametrize("name", ["streaming", "h2o"])
def test_eviction_runner_attends_over_the_kept_tokens_only(name):
    """The runner's rows for an evicting codec: T̂ = softmax over the kept tokens of q·k̂ᵀ/√d times
    V̂, evicted_mass the exact attention on the evicted tokens, KL over the kept tokens. The kept
    keys are fp16 copies, so the KL is of the order of fp16 rounding of the logits (≈ 1e-6),
    not the 1e4 × evicted mass a placeholder logit 1e4 below the kept ones used to give."""
    from harness.cell import run_cell_chunk

    b, h, s, d, nq = 4, 2, 64, 16, 8
    k, v = _gauss((b, h, s, d), 5, torch.float64), _gauss((b, h, s, d), 6, torch.float64)
    q = _gauss((b, h, nq, d), 7, torch.float64)
    data = {"k": k, "v": v, "q": q, "k_cal": k, "v_cal": v, "positions": torch.arange(s), "trials": torch.arange(b)}
    scheme = schemes.create(name, budget=4, dim=d)
    metrics, _ = run_cell_chunk(scheme, data)
    kept = scheme.kept(scheme.encode(k, v))
    assert int(kept.sum()) == b * h * kept_tokens(s, 4)
    p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), dim=-1)
    mass = torch.where(kept[:, :, None, :], 0.0, p).sum(-1).mean(dim=(1, 2))
    np.testing.assert_allclose(metrics["evicted_mass"], mass.numpy(), rtol=1e-12)
    k_kept, v_kept = torch.where(kept[..., None], k.half().double(), 0.0), torch.where(kept[..., None], v.half().double(), 0.0)
    logits_kept = (q @ k_kept.transpose(-1, -2) / math.sqrt(d)).masked_fill(~kept[:, :, None, :], float("-inf"))
    t, t_hat = p @ v, torch.softmax(logits_kept, dim=-1) @ v_kept
    np.testing.assert_allclose(metrics["rel_mse_t"], (((t - t_hat) ** 2).sum(dim=(1, 2, 3)) / (t ** 2).sum(dim=(1, 2, 3))).numpy(), rtol=1e-9)
    assert (metrics["evicted_mass"] > 0.3).all() and (metrics["kl_attn"] < 1e-5).all()
    assert (np.abs(metrics["logit_slope"] - 1) < 1e-3).all() and (metrics["logit_rel_mse"] < 1e-5).all()


def test_h2o_heavy_hitters_are_the_tokens_others_attend_to_not_the_observers_themselves():
    """A cache with known heavy hitters: 8 hub tokens at positions 20..27 hold β·u, the last 32
    tokens (the observation window) α·u plus N(0, I) noise, all others N(0, I) (d = 64, S = 128,
    b = 2: 16 kept, 8 recent + 8 heavy hitters; α = 2, β = 12). An observer p gives a hub the
    logit αβ/√d = 3 (± 1.5), an earlier observer α²/√d = 0.5 (± 1.4), any other token 0 (± 1),
    so per observer a hub gets ≈ e³/(8e³ + 127e^0.5) ≈ 5 % of the attention, 1.1 over 32
    observers, against ≈ 0.1 for any other token: the hubs are the heavy hitters. Counting each
    observer's attention to itself (logit ‖k_p‖²/√d ≈ (α² + d)/√d = 8.5, ≈ 85 % of its
    attention) hands every heavy-hitter slot to the observation window instead: the brute force
    with self-attention shows that this case tells the two rules apart."""
    b, h, s, d, budget = 3, 2, 128, 64, 2
    alpha, beta, hubs = 2.0, 12.0, list(range(20, 28))
    u = torch.zeros(d, dtype=torch.float64)
    u[0] = 1.0
    k = _gauss((b, h, s, d), 8, torch.float64)
    k[:, :, hubs] = beta * u
    k[:, :, s - 32:] += alpha * u
    scheme = schemes.create("h2o", budget=budget, dim=d)
    n_keep, n_recent = kept_tokens(s, budget), int(kept_tokens(s, budget) * 0.5)
    assert n_keep - n_recent == len(hubs)
    index = scheme.encode(k, k).codes["index"].long()
    for i in range(b):
        for j in range(h):
            assert index[i, j, : n_keep - n_recent].tolist() == hubs
            assert set(index[i, j].tolist()) == _h2o_reference(k[i, j].numpy(), n_keep)
            with_self = sorted(_h2o_reference(k[i, j].numpy(), n_keep, self_attention=True))
            assert all(s - 32 <= x < s - n_recent for x in with_self[: n_keep - n_recent])   # the old rule


def test_h2o_on_gaussian_keys_no_longer_fills_its_heavy_hitters_from_the_observation_window():
    """Gaussian keys (S = 256, d = 64, b = 2: 16 heavy-hitter slots, observers 224..255, the
    non-recent part of the window 224..239): with self-attention all 16 slots went to 224..239.
    Excluding it, no token is special: window tokens are seen by fewer observers than older
    ones, so they should hold at most their share (16 of 240 candidates; ≤ 4 of 16 is lenient)."""
    s, d = 256, 64
    k = _gauss((4, 1, s, d), 9, torch.float64)
    index = schemes.create("h2o", budget=2, dim=d).encode(k, k).codes["index"].long()
    heavy = index[..., :16]
    assert ((heavy >= s - 32).sum(-1) <= 4).all(), heavy
    with_self = [sorted(_h2o_reference(k[i, 0].numpy(), 32, self_attention=True))[:16] for i in range(4)]
    assert all(x == list(range(224, 240)) for x in with_self)    # the failure this guards against
