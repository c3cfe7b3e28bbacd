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
    """Σx² per trial in one fused pass (cascade summation in the tensor's dtype), as float64."""
    return torch.square(torch.linalg.vector_norm(_flat(x), dim=1)).double()


def _safe_ratio(num: torch.Tensor, den: torch.Tensor, zero_over_zero: float) -> torch.Tensor:
    """num/den with 0/0 → zero_over_zero and x/0 → inf."""
    ratio = num / torch.where(den > 0, den, 1.0)
    return torch.where(den > 0, ratio, torch.where(num > 0, math.inf, zero_over_zero))


def _energies(x: torch.Tensor, x_hat: torch.Tensor):
    """(‖x‖², ‖x̂‖², ‖x − x̂‖²) per trial."""
    return _sum_sq(x), _sum_sq(x_hat), _sum_sq(x - x_hat)


def _rel_and_direction(xx, hh, ee):
    """rel_mse = ‖x−x̂‖²/‖x‖² and dir_err = 1 − cos. The direction error uses the identity
    ‖x‖‖x̂‖ − x·x̂ = (‖x − x̂‖² − (‖x‖ − ‖x̂‖)²)/2, whose terms keep their digits when the error is
    tiny (1 − x·x̂/(‖x‖‖x̂‖) would cancel). 0/0 cases: both zero → 0, one zero → 1."""
    rel = _safe_ratio(ee, xx, 0.0)
    nx, nh = xx.sqrt(), hh.sqrt()
    both = (nx > 0) & (nh > 0)
    num = torch.clamp(ee - (nx - nh) ** 2, min=0.0) / 2
    direction = torch.where(both, num / torch.where(both, nx * nh, 1.0),
                            torch.where((nx > 0) | (nh > 0), 1.0, 0.0))
    return rel, torch.clamp(direction, max=2.0)


def relative_mse(x: torch.Tensor, x_hat: torch.Tensor) -> torch.Tensor:
    """‖x − x̂‖²/‖x‖² per trial (0/0 → 0: an all-zero tensor reproduced exactly has no error)."""
    return _safe_ratio(_sum_sq(x - x_hat), _sum_sq(x), 0.0)


def direction_error(x: torch.Tensor, x_hat: torch.Tensor) -> torch.Tensor:
    """1 − cos(x, x̂) per trial, accurate for tiny errors (see _rel_and_direction)."""
    return _rel_and_direction(*_energies(x, x_hat))[1]


def cosine(x: torch.Tensor, x_hat: torch.Tensor) -> torch.Tensor:
    """Cosine of the flattened tensors per trial (1 when both are zero, 0 when one is)."""
    return 1 - direction_error(x, x_hat)


def error_point(x: torch.Tensor, x_hat: torch.Tensor, suffix: str) -> dict[str, torch.Tensor]:
    """rel_mse, cos, snr_err, dir_err and d2 of one tensor, keyed with `_suffix`."""
    rel, direction = _rel_and_direction(*_energies(x, x_hat))
    snr = torch.where(torch.isinf(rel), 1.0, rel / (1 + rel))
    return {f"rel_mse_{suffix}": rel, f"cos_{suffix}": 1 - direction, f"snr_err_{suffix}": snr,
            f"dir_err_{suffix}": direction, f"d2_{suffix}": torch.sqrt(direction ** 2 + snr ** 2)}


def exact_logits(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q kᵀ/√d: (B, H, Nq, d) × (B, H, S, d) -> (B, H, Nq, S)."""
    return q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits q kᵀ/√d, probabilities softmax(logits), T = probs·v) of the exact cache, the
    reference of every codec's metrics on the same data: the runner computes it once per chunk
    and hands it to trial_metrics for each cell of the chunk."""
    logits = exact_logits(q, k)
    probs = torch.softmax(logits, dim=-1)
    return logits, probs, probs @ v


def kl_attention(logits: torch.Tensor, logits_hat: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ p̂) of the attention distributions over the S keys, averaged over heads and queries."""
    log_p = torch.log_softmax(logits.double(), dim=-1)
    log_p_hat = torch.log_softmax(logits_hat.double(), dim=-1)
    kl = torch.sum(log_p.exp() * (log_p - log_p_hat), dim=-1)
    return kl.reshape(kl.shape[0], -1).mean(dim=1)


def trial_metrics(k: torch.Tensor, v: torch.Tensor, q: torch.Tensor,
                  k_hat: torch.Tensor, v_hat: torch.Tensor, logits_hat: torch.Tensor,
                  exact: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Every per-trial metric of DESIGN.md, each a float64 tensor (B,).

    logits_hat is the scheme's `score` (which may differ from q k̂ᵀ/√d, e.g. QJL on K); the
    compressed attention output is T̂ = softmax(logits_hat)·v̂, the reference T uses exact K, V.
    exact: exact_attention(q, k, v) when the caller has it already (shared by the cells of a chunk).
    """
    logits, probs, t = exact_attention(q, k, v) if exact is None else exact
    probs_hat = torch.softmax(logits_hat, dim=-1)
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
