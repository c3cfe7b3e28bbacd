"""Metric functions against values computed by hand."""
import math

import numpy as np
import pytest
import torch

from kvcommon.threads import torch_threads
from kvcommon.rows import SIX_D
from stats.metrics import (EVICTION_METRIC_NAMES, METRIC_NAMES, cosine, kl_attention, per_token_cosine,
                           relative_mse, trial_metrics, weighted_values)


def t(*rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_relative_mse_and_cosine_by_hand():
    x, x_hat = t([1.0, 0.0]), t([0.5, 0.5])
    assert relative_mse(x, x_hat).item() == pytest.approx(0.5)           # (0.25 + 0.25) / 1
    assert cosine(x, x_hat).item() == pytest.approx(1 / math.sqrt(2))     # 0.5 / (1 · √0.5)


def test_zero_cases():
    z = torch.zeros(1, 3, dtype=torch.float64)
    assert relative_mse(z, z).item() == 0 and cosine(z, z).item() == 1
    assert math.isinf(relative_mse(z, t([1.0, 0, 0])).item())
    assert cosine(t([1.0, 0, 0]), z).item() == 0


def test_tiny_direction_error_keeps_its_digits():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 4096, dtype=torch.float32, generator=g)
    x_hat = x + 1e-4 * torch.randn(1, 4096, generator=g)
    dx, dh = x.double(), x_hat.double()
    exact = 1 - (dx * dh).sum() / (dx.norm() * dh.norm())
    assert 1 - cosine(x, x_hat).item() == pytest.approx(exact.item(), rel=1e-3)


def test_kl_attention_by_hand():
    logits = torch.log(t([0.5, 0.25, 0.25])).reshape(1, 1, 1, 3)
    logits_hat = torch.log(t([0.25, 0.5, 0.25])).reshape(1, 1, 1, 3)
    expected = 0.5 * math.log(2) + 0.25 * math.log(0.5)
    assert kl_attention(logits, logits_hat).item() == pytest.approx(expected)
    assert kl_attention(logits, logits + 3.0).item() == pytest.approx(0, abs=1e-12)  # shift-invariant


def test_trial_metrics_exact_reconstruction_and_scaled_logits():
    g = torch.Generator().manual_seed(0)
    k, v, q = (torch.randn(2, 1, 16, 8, generator=g, dtype=torch.float64) for _ in range(3))
    q = q[:, :, :4]
    logits = q @ k.transpose(-1, -2) / math.sqrt(8)
    m = trial_metrics(k, v, q, k, v, logits)
    assert set(m) == set(METRIC_NAMES) and set(SIX_D) <= set(m)
    for name in ("rel_mse_k", "rel_mse_v", "rel_mse_t", "dir_err_t", "d2_t", "kl_attn", "logit_rel_mse"):
        assert torch.allclose(m[name], torch.zeros(2, dtype=torch.float64), atol=1e-12), name
    assert torch.allclose(m["logit_slope"], torch.ones(2, dtype=torch.float64))
    # a scheme whose logits shrink by 0.9 has slope 0.9 and logit_rel_mse 0.01
    m = trial_metrics(k, v, q, k, v, 0.9 * logits)
    assert torch.allclose(m["logit_slope"], torch.full((2,), 0.9, dtype=torch.float64))
    assert torch.allclose(m["logit_rel_mse"], torch.full((2,), 0.01, dtype=torch.float64))
    assert torch.allclose(m["t_rel_mse_vonly"], torch.zeros(2, dtype=torch.float64), atol=1e-12)


def test_error_point_definitions():
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(3, 1, 32, 8, generator=g, dtype=torch.float64), torch.randn(3, 1, 32, 8, generator=g, dtype=torch.float64)
    q = torch.randn(3, 1, 4, 8, generator=g, dtype=torch.float64)
    v_hat = v + 0.3 * torch.randn(v.shape, generator=g, dtype=torch.float64)
    m = trial_metrics(k, v, q, k, v_hat, q @ k.transpose(-1, -2) / math.sqrt(8))
    rel = ((v - v_hat) ** 2).sum(dim=(1, 2, 3)) / (v ** 2).sum(dim=(1, 2, 3))
    cos = (v * v_hat).sum(dim=(1, 2, 3)) / ((v ** 2).sum(dim=(1, 2, 3)) * (v_hat ** 2).sum(dim=(1, 2, 3))).sqrt()
    assert torch.allclose(m["rel_mse_v"], rel)
    assert torch.allclose(m["snr_err_v"], rel / (1 + rel))
    assert torch.allclose(m["dir_err_v"], 1 - cos)
    assert torch.allclose(m["d2_v"], torch.sqrt((1 - cos) ** 2 + (rel / (1 + rel)) ** 2))
    # only V was compressed: T's error is the V-only isolation metric
    assert torch.allclose(m["rel_mse_t"], m["t_rel_mse_vonly"])
    assert torch.allclose(m["t_rel_mse_konly"], torch.zeros(3, dtype=torch.float64), atol=1e-12)


def _per_token_cosine_loop(x: np.ndarray, x_hat: np.ndarray) -> np.ndarray:
    """Brute force: per trial, the mean over (head, token) of each token vector's cosine."""
    out = np.zeros(x.shape[0])
    for b in range(x.shape[0]):
        values = []
        for h in range(x.shape[1]):
            for s in range(x.shape[2]):
                a, c = x[b, h, s], x_hat[b, h, s]
                na, nc = np.linalg.norm(a), np.linalg.norm(c)
                values.append(1.0 if na == 0 and nc == 0 else 0.0 if na == 0 or nc == 0 else a @ c / (na * nc))
        out[b] = np.mean(values)
    return out


def test_per_token_cosine_matches_a_numpy_loop_with_zero_tokens():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 2, 20, 8, generator=g, dtype=torch.float64) * torch.rand(3, 2, 20, 1, generator=g) * 10
    x_hat = x + 0.7 * torch.randn(x.shape, generator=g, dtype=torch.float64)
    x[0, 0, 3] = 0            # zero token, non-zero reconstruction: 0
    x_hat[0, 1, 4] = 0        # evicted-like token: 0
    x[1, 0, 5] = x_hat[1, 0, 5] = 0   # both zero: 1
    x_hat[2, 1, 6] = -x[2, 1, 6]      # opposite: −1
    got = per_token_cosine(x, x_hat)
    np.testing.assert_allclose(got.numpy(), _per_token_cosine_loop(x.numpy(), x_hat.numpy()), rtol=1e-12)
    m = trial_metrics(x, x, x[:, :, :4], x_hat, x, x[:, :, :4] @ x_hat.transpose(-1, -2) / math.sqrt(8))
    np.testing.assert_allclose(m["ptcosine_k"].numpy(), got.numpy(), rtol=1e-12)
    assert torch.equal(m["ptcosine_v"], torch.ones(3, dtype=torch.float64))
    z = torch.zeros(1, 1, 2, 4, dtype=torch.float64)
    assert per_token_cosine(z, z).item() == 1 and per_token_cosine(z + 1, z).item() == 0


def test_per_token_and_flattened_cosine_can_order_two_codecs_differently():
    """Flattened cos weights a token by ‖x‖²: codec A reproduces one large token exactly and
    the small ones badly, codec B every token moderately. By hand (d = 2, S = 4): x = (10, 0)
    and three (1, 0). A: (10, 0) and three (1, 1): flattened cos = 103/(√103·√106) = 0.9858,
    per token (1 + 3/√2)/4 = 0.7803. B: every token turned by 30°: cos 0.8660 both ways."""
    x = torch.tensor([[10.0, 0], [1, 0], [1, 0], [1, 0]], dtype=torch.float64).reshape(1, 1, 4, 2)
    a = torch.tensor([[10.0, 0], [1, 1], [1, 1], [1, 1]], dtype=torch.float64).reshape(1, 1, 4, 2)
    turn = torch.tensor([[math.cos(math.pi / 6), math.sin(math.pi / 6)]], dtype=torch.float64)
    b = x.norm(dim=-1, keepdim=True) * turn
    assert cosine(x, a).item() == pytest.approx(103 / math.sqrt(103 * 106), rel=1e-12)
    assert per_token_cosine(x, a).item() == pytest.approx((1 + 3 / math.sqrt(2)) / 4, rel=1e-12)
    assert cosine(x, b).item() == pytest.approx(math.sqrt(3) / 2) == per_token_cosine(x, b).item()
    assert cosine(x, a) > cosine(x, b) and per_token_cosine(x, a) < per_token_cosine(x, b)


def _eviction_case(seed=3, b=2, h=2, nq=5, s=12, d=4):
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(b, h, s, d, generator=g, dtype=torch.float64) for _ in range(2))
    q = 2 * torch.randn(b, h, nq, d, generator=g, dtype=torch.float64)
    kept = torch.rand(b, h, s, generator=g) < 0.5
    kept[..., 0] = True
    k_hat = torch.where(kept[..., None], k + 0.1 * torch.randn(k.shape, generator=g, dtype=torch.float64), 0.0)
    v_hat = torch.where(kept[..., None], v + 0.1 * torch.randn(v.shape, generator=g, dtype=torch.float64), 0.0)
    return k, v, q, k_hat, v_hat, kept


def test_eviction_metrics_match_a_numpy_loop():
    """evicted_mass, KL over the kept tokens, T̂ = softmax over the kept tokens · V̂, and the
    logit metrics over the kept pairs, each against an explicit loop."""
    k, v, q, k_hat, v_hat, kept = _eviction_case()
    d = k.shape[-1]
    logits_hat = q @ k_hat.transpose(-1, -2) / math.sqrt(d)
    m = trial_metrics(k, v, q, k_hat, v_hat, logits_hat, kept)
    assert set(m) == set(METRIC_NAMES) | set(EVICTION_METRIC_NAMES)
    K, V, Q, Kh, Vh, M = (x.numpy() for x in (k, v, q, k_hat, v_hat, kept))
    for b in range(K.shape[0]):
        mass, kl, t_err, t_den, l_err, l_cross, l_den, n = 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0
        for h in range(K.shape[1]):
            keep = np.flatnonzero(M[b, h])
            for i in range(Q.shape[2]):
                s = K[b, h] @ Q[b, h, i] / math.sqrt(d)
                s_hat = Kh[b, h] @ Q[b, h, i] / math.sqrt(d)
                p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
                mass += 1 - p[keep].sum()
                p_kept = p[keep] / p[keep].sum()
                p_hat = np.exp(s_hat[keep] - s_hat[keep].max())
                p_hat /= p_hat.sum()
                kl += np.sum(p_kept * np.log(p_kept / p_hat))
                t, t_hat = p @ V[b, h], p_hat @ Vh[b, h, keep]
                t_err += np.sum((t - t_hat) ** 2)
                t_den += np.sum(t ** 2)
                l_err += np.sum((s[keep] - s_hat[keep]) ** 2)
                l_cross += np.sum(s[keep] * s_hat[keep])
                l_den += np.sum(s[keep] ** 2)
                n += 1
        assert m["evicted_mass"][b].item() == pytest.approx(mass / n, rel=1e-10)
        assert m["kl_attn"][b].item() == pytest.approx(kl / n, rel=1e-9)
        assert m["rel_mse_t"][b].item() == pytest.approx(t_err / t_den, rel=1e-9)
        assert m["logit_rel_mse"][b].item() == pytest.approx(l_err / l_den, rel=1e-10)
        assert m["logit_slope"][b].item() == pytest.approx(l_cross / l_den, rel=1e-10)
    assert (m["evicted_mass"] > 0).all() and torch.isfinite(torch.stack(list(m.values()))).all()


def test_no_eviction_metric_depends_on_the_evicted_logits():
    """Whatever the codec's score says about an evicted token (0, −1e4, +1e4), no metric moves:
    none is set by a constant. Exact kept logits give KL 0 and slope 1 with mass evicted."""
    k, v, q, k_hat, v_hat, kept = _eviction_case(seed=4)
    logits = q @ k.transpose(-1, -2) / math.sqrt(k.shape[-1])
    evicted = ~kept[:, :, None, :].expand_as(logits)
    runs = [trial_metrics(k, v, q, k_hat, v_hat, torch.where(evicted, c, logits), kept) for c in (0.0, -1e4, 1e4)]
    for other in runs[1:]:
        for name in runs[0]:
            torch.testing.assert_close(other[name], runs[0][name], rtol=1e-12, atol=0, msg=name)
    m = runs[0]
    assert torch.allclose(m["kl_attn"], torch.zeros(2, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(m["logit_rel_mse"], torch.zeros(2, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(m["logit_slope"], torch.ones(2, dtype=torch.float64))
    assert (m["evicted_mass"] > 0.05).all()
    # a mask that keeps every token is the ordinary definition, with nothing evicted
    full = torch.ones_like(kept)
    plain, masked = trial_metrics(k, v, q, k_hat, v_hat, logits), trial_metrics(k, v, q, k_hat, v_hat, logits, full)
    assert "evicted_mass" not in plain and torch.equal(masked["evicted_mass"], torch.zeros(2, dtype=torch.float64))
    for name in plain:
        torch.testing.assert_close(masked[name], plain[name], rtol=1e-12, atol=1e-15, msg=name)


def test_flattened_and_per_token_cosine_order_kivi_and_sq_kv_oppositely_on_heavy_tail(tmp_path):
    """The reordering on real codecs (heavy_tail, b = 2, d = 64, S = 256): kivi's K has the smaller
    flattened direction error (1 − cos_k ≈ 0.071 vs 0.085) but the larger per-token one
    (1 − ptcosine_k ≈ 0.094 vs 0.071), as heavy-tailed token norms weight the flattened cosine
    towards the large tokens. Each paired mean difference must exceed 4 of its standard errors."""
    from harness.cli import main
    from harness.store import RunStore

    out = tmp_path / "run"
    assert main(["run", "--scenario", "heavy_tail", "--scheme", "kivi,sq-kv", "--budget", "2", "--dim", "64",
                 "--seq-len", "256", "--queries", "4", "--trials", "8", "--quiet", "--out", str(out)]) == 0
    frame = RunStore(out).trials()
    kivi, sq = (frame[frame.scheme == s].set_index("trial") for s in ("kivi", "sq-kv"))
    for column, sign in (("cos_k", 1), ("ptcosine_k", -1)):
        diff = sign * (kivi[column] - sq[column])          # > 0: the order this column gives
        assert diff.mean() > 4 * diff.std(ddof=1) / math.sqrt(len(diff)), (column, diff.describe())


def _noisy_trial(b: int, s: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(b, 1, s, d, generator=g) for _ in range(2))
    q = torch.randn(b, 1, 64, d, generator=g)
    k_hat, v_hat = k + 0.05 * torch.randn(k.shape, generator=g), v + 0.05 * torch.randn(v.shape, generator=g)
    return k, v, q, k_hat, v_hat, q @ k_hat.transpose(-1, -2) / math.sqrt(d)


@pytest.mark.parametrize("b, s, d", [(1, 777, 64), (1, 1024, 128), (3, 1024, 128)])
def test_trial_metrics_are_the_same_bits_at_any_thread_count(b, s, d):
    """The per-trial sums reduce rows first (one thread a row) and the trial's rows in float64: a
    worker process with fewer threads than a serial run gives its rows. (A single reduction over
    the flattened trial gave logit_slope other last bits at 1, 2 and 3 threads for seeds 2 and 3
    of (1, 777, 64) and seed 2 of (1, 1024, 128).)"""
    for seed in range(4):
        runs = []
        for n in (1, 2, 3):
            with torch_threads(n):
                runs.append(trial_metrics(*(x.clone() for x in _noisy_trial(b, s, d, seed))))
        for other in runs[1:]:
            assert all(torch.equal(runs[0][name], other[name]) for name in METRIC_NAMES), \
                (seed, [name for name in METRIC_NAMES if not torch.equal(runs[0][name], other[name])])


def test_float32_trial_sums_agree_with_float64_brute_force():
    """Row sums in float32, the trial's rows in float64: the float64 sums of the same (float32)
    values to 1e-7 (measured 8e-9 for rel_mse_k; one float32 sum over the flattened 131,072-element
    trial erred by 2.3e-6)."""
    k, v, q, k_hat, v_hat, logits_hat = _noisy_trial(2, 1024, 128, seed=1)
    m = trial_metrics(k, v, q, k_hat, v_hat, logits_hat)
    dk, dkh, dq = k.double(), k_hat.double(), q.double()
    rel_k = ((dk - dkh) ** 2).sum(dim=(1, 2, 3)) / (dk ** 2).sum(dim=(1, 2, 3))
    logits = dq @ dk.transpose(-1, -2) / math.sqrt(128)
    slope = (logits_hat.double() * logits).sum(dim=(1, 2, 3)) / (logits ** 2).sum(dim=(1, 2, 3))
    np.testing.assert_allclose(m["rel_mse_k"].numpy(), rel_k.numpy(), rtol=1e-7)
    np.testing.assert_allclose(m["logit_slope"].numpy(), slope.numpy(), rtol=1e-7)


def test_attention_output_is_the_same_bits_at_any_thread_count_at_long_caches():
    """weighted_values (probs · v, the attention output of every T metric) gives one thread's bits
    on the whole batch whatever the caller's thread count: MKL splits the token dimension across
    threads otherwise (2 threads gave other last bits than 1 at S = 777 on an Intel Xeon), and
    the threads' blocks of the batch (5 × 2 products: uneven blocks) each give those bits;
    broadcast batches take torch's product on one thread."""
    gen = torch.Generator().manual_seed(4)
    for dtype, s in ((torch.float32, 2048), (torch.float64, 777)):
        probs = torch.softmax(torch.randn(5, 2, 64, s, generator=gen, dtype=dtype), dim=-1)
        v = torch.randn(5, 2, s, 128, generator=gen, dtype=dtype)
        with torch_threads(1):
            reference, broadcast = probs @ v, probs @ v[:1]
        for n in (1, 2, 3):
            with torch_threads(n):
                assert torch.equal(weighted_values(probs, v), reference)
                assert torch.equal(weighted_values(probs, v[:1]), broadcast)
                assert torch.get_num_threads() == n
