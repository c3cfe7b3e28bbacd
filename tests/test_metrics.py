"""Metric functions against values computed by hand."""
import math

import pytest
import torch

from stats.metrics import METRIC_NAMES, SIX_D, cosine, kl_attention, relative_mse, trial_metrics


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
    x = torch.randn(1, 4096, dtype=torch.float32)
    x_hat = x + 1e-4 * torch.randn(1, 4096)
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
