"""Per-trial error metrics (DESIGN.md "Metrics"), batched: every function maps tensors with a
leading trial dimension B to one value per trial (B,).

For X ∈ {K, V, T}: rel_mse = ‖X − X̂‖²/‖X‖², cos = cosine of the flattened tensors,
snr_err = rel_mse/(1 + rel_mse) (the AMD paper's NF, eq. 2), dir_err = 1 − cos,
d2 = √(dir_err² + snr_err²). T = softmax(q kᵀ/√d)·v is the attention output.
"""
from __future__ import annotations

import math

import torch

METRIC_NAMES = tuple(
    f"{m}_{x}" for x in ("k", "v", "t") for m in ("rel_mse", "cos", "snr_err", "dir_err", "d2")
) + ("t_rel_mse_konly", "t_rel_mse_vonly", "kl_attn", "logit_rel_mse", "logit_slope")

SIX_D = ("snr_err_k", "dir_err_k", "snr_err_v", "dir_err_v", "snr_err_t", "dir_err_t")


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], -1)


def _sum_sq(x: torch.Tensor) -> torch.Tensor:
    """Σx² per trial, reduced in the tensor's dtype (cascade summation), returned as float64."""
    return torch.sum(torch.square(_flat(x)), dim=1).double()


def _safe_ratio(num: torch.Tensor, den: torch.Tensor, zero_over_zero: float) -> torch.Tensor:
    """num/den with 0/0 → zero_over_zero and x/0 → inf."""
    ratio = num / torch.where(den > 0, den, 1.0)
    return torch.where(den > 0, ratio, torch.where(num > 0, math.inf, zero_over_zero))


def relative_mse(x: torch.Tensor, x_hat: torch.Tensor) -> torch.Tensor:
    """‖x − x̂‖²/‖x‖² per trial (0/0 → 0: an all-zero tensor reproduced exactly has no error)."""
    return _safe_ratio(_sum_sq(x - x_hat), _sum_sq(x), 0.0)


def direction_error(x: torch.Tensor, x_hat: torch.Tensor) -> torch.Tensor:
    """1 − cos(x, x̂) per trial, computed as ‖x/‖x‖ − x̂/‖x̂‖‖²/2, which keeps its digits when
    the error is tiny (1 − x·x̂/(‖x‖‖x̂‖) cancels). Zero when both are zero, 1 when one is."""
    nx, nh = _sum_sq(x).sqrt(), _sum_sq(x_hat).sqrt()
    ux = _flat(x) / torch.where(nx > 0, nx, 1.0).to(x.dtype)[:, None]
    uh = _flat(x_hat) / torch.where(nh > 0, nh, 1.0).to(x.dtype)[:, None]
    err = _sum_sq(ux - uh) / 2
    return torch.where((nx > 0) & (nh > 0), err, torch.where((nx > 0) | (nh > 0), 1.0, 0.0))


def cosine(x: torch.Tensor, x_hat: torch.Tensor) -> torch.Tensor:
    """Cosine of the flattened tensors per trial (1 when both are zero, 0 when one is)."""
    return 1 - direction_error(x, x_hat)


def error_point(x: torch.Tensor, x_hat: torch.Tensor, suffix: str) -> dict[str, torch.Tensor]:
    """rel_mse, cos, snr_err, dir_err and d2 of one tensor, keyed with `_suffix`."""
    rel = relative_mse(x, x_hat)
    direction = direction_error(x, x_hat)
    snr = torch.where(torch.isinf(rel), 1.0, rel / (1 + rel))
    return {f"rel_mse_{suffix}": rel, f"cos_{suffix}": 1 - direction, f"snr_err_{suffix}": snr,
            f"dir_err_{suffix}": direction, f"d2_{suffix}": torch.sqrt(direction ** 2 + snr ** 2)}


def exact_logits(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q kᵀ/√d: (B, H, Nq, d) × (B, H, S, d) -> (B, H, Nq, S)."""
    return q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])


def kl_attention(logits: torch.Tensor, logits_hat: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ p̂) of the attention distributions over the S keys, averaged over heads and queries."""
    log_p = torch.log_softmax(logits.double(), dim=-1)
    log_p_hat = torch.log_softmax(logits_hat.double(), dim=-1)
    kl = torch.sum(log_p.exp() * (log_p - log_p_hat), dim=-1)
    return kl.reshape(kl.shape[0], -1).mean(dim=1)


def trial_metrics(k: torch.Tensor, v: torch.Tensor, q: torch.Tensor,
                  k_hat: torch.Tensor, v_hat: torch.Tensor, logits_hat: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every per-trial metric of DESIGN.md, each a float64 tensor (B,).

    logits_hat is the scheme's `score` (which may differ from q k̂ᵀ/√d, e.g. QJL on K); the
    compressed attention output is T̂ = softmax(logits_hat)·v̂, the reference T uses exact K, V.
    """
    logits = exact_logits(q, k)
    probs, probs_hat = torch.softmax(logits, dim=-1), torch.softmax(logits_hat, dim=-1)
    t = probs @ v
    out = error_point(k, k_hat, "k")
    out.update(error_point(v, v_hat, "v"))
    out.update(error_point(t, probs_hat @ v_hat, "t"))
    out["t_rel_mse_konly"] = relative_mse(t, probs_hat @ v)
    out["t_rel_mse_vonly"] = relative_mse(t, probs @ v_hat)
    out["kl_attn"] = kl_attention(logits, logits_hat)
    out["logit_rel_mse"] = relative_mse(logits, logits_hat)
    out["logit_slope"] = _safe_ratio(torch.sum(_flat(logits_hat) * _flat(logits), dim=1).double(),
                                     _sum_sq(logits), 1.0)
    return {name: out[name] for name in METRIC_NAMES}
