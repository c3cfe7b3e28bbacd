"""The per-token terms of the metrics (stats/metrics.py) in one compiled pass over each row on the
CPU (numba), in place of torch's passes: x − x̂ written out, a vector_norm pass over each of x, x̂
and x − x̂, then a dozen whole-tensor passes over the tokens for the direction errors.

One row (a token vector x_s and its reconstruction x̂_s, d entries) at a time, read once:
  1. ‖x_s‖, ‖x̂_s‖ and ‖x_s − x̂_s‖ in the rows' dtype, each sum of squares in
     torch.linalg.vector_norm's order on this build (kvcommon/vector_norm_cpu.py's norm_order:
     `lanes` accumulators, element i into accumulator i mod lanes, added in order, then the tail
     one by one, with a fused multiply-add where torch's tail has one), the three sums in one
     vector loop (_lane_sums: LLVM vectors of `lanes` entries, each product and sum rounded as
     torch's vector instructions round it); x_s − x̂_s rounded in the dtype as torch's
     subtraction rounds it;
  2. their squares in the dtype, widened to float64: the energies xx, hh, ee of
     metrics._per_token_sq.
Then, in a second pass over the tokens, each token's direction error 1 − cos(x_s, x̂_s) from them
as metrics._rel_and_direction computes it (float64, each operation rounded once as there; NaN
where an energy is NaN), from the roots √xx, √hh that torch's sqrt gives: on this build torch's
float64 sqrt is not always the correctly rounded root (1 ulp from NumPy's on 7,666 of 10^6 random
values), so the roots are torch's own, taken on the same tensors as there.
The logits' rows (a query's S logits s and ŝ) get the same pass for ‖s‖² and ‖s − ŝ‖², and in it
Σ ŝ_i·s_i, each product rounded in the dtype and summed in torch.sum's order
(kvcommon/sum_cpu.py's sum_order), as torch.sum(ŝ * s, dim=-1) gives it: logit_rel_mse and
logit_slope without the product tensor. And the KL of the attention: each query's terms
p_i·(log p_i − log p̂_i) (0 on an evicted token) formed in a row buffer and summed in torch.sum's
order, without the (B, H, Nq, S) differences and terms written out (the log-probabilities
themselves stay torch's log_softmax: its vector exp and log are not the correctly rounded ones).
The same bits as torch's passes (tests/test_metrics_cpu.py); the sums over tokens and trials that
follow stay in torch. Where no order of norm_order reproduces vector_norm (`takes` False), or none
of sum_order torch.sum (`takes_products` False), the metrics run their torch passes.

A *_cpu module: stats/metrics.py imports it only where kvcommon.compiled.takes says the compiled
loops take the tensors, so a run on CUDA never loads numba. Rows are split across the torch
thread budget (compiled.by_row_blocks); each row is one thread's, so the split changes no bit.
"""
from __future__ import annotations

import llvmlite.ir as ir
import numba
import numpy as np
import torch
from numba import types
from numba.core.extending import intrinsic

from kvcommon import compiled
from kvcommon.compiled import FLAT_JIT, by_row_blocks, row_view
from kvcommon.sum_cpu import _sum_products, sum_order
from kvcommon.vector_norm_cpu import _fma, norm_order
from kvcommon.vectors_cpu import counted_loop, lane_total, load_vector

# the accumulator counts _token_rows has a vector loop for (norm_order's other candidate, 1, is the
# plain sequential sum)
_VECTOR_LANES = (4, 8, 16)


@intrinsic(prefer_literal=True)
def _lane_sums(typingctx, x, y, full, lanes):
    """(Σ x_i², Σ y_i², Σ (x_i − y_i)²) over the first `full` entries (a multiple of lanes) of the
    contiguous rows x, y, each summed in `lanes` accumulators (i into accumulator i mod lanes, one
    LLVM vector of them) that are then added in order: vector_norm's order before its tail.
    lanes: a constant (a literal at the call); x and y C-contiguous (typing fails otherwise)."""
    if not isinstance(lanes, types.IntegerLiteral) or x.layout != "C" or y.layout != "C":
        return None
    n_lanes, dtype = lanes.literal_value, x.dtype

    def codegen(context, builder, signature, args):
        xa = context.make_array(signature.args[0])(context, builder, args[0])
        ya = context.make_array(signature.args[1])(context, builder, args[1])
        vector = ir.VectorType(context.get_value_type(dtype), n_lanes)
        with counted_loop(builder, args[2], n_lanes, [ir.Constant(vector, None)] * 3, "lane_sums") as loop:
            vx = load_vector(context, builder, xa, loop.index, vector)
            vy = load_vector(context, builder, ya, loop.index, vector)
            ve = builder.fsub(vx, vy)
            loop.next = [builder.fadd(s, builder.fmul(v, v)) for s, v in zip(loop.carried, (vx, vy, ve))]  # two roundings
        out = [lane_total(builder, s, n_lanes) for s in loop.carried]
        return context.make_tuple(builder, signature.return_type, out)
    return types.UniTuple(dtype, 3)(x, y, full, lanes), codegen


@numba.jit(**FLAT_JIT)
def _row_energies(a, b, lanes, fma_tail, zero):  # pragma: no cover - compiled
    """(‖a‖², ‖b‖², ‖a − b‖²) of one row pair, float64, as the module docstring says."""
    d = a.shape[0]
    full = d - d % lanes if lanes > 1 else 0
    if lanes == 8:
        sx, sh, se = _lane_sums(a, b, full, 8)
    elif lanes == 4:
        sx, sh, se = _lane_sums(a, b, full, 4)
    elif lanes == 16:
        sx, sh, se = _lane_sums(a, b, full, 16)
    else:
        sx = sh = se = zero
    fused = fma_tail and lanes > 1
    for i in range(full, d):
        p, q = a[i], b[i]
        e = p - q
        if fused:
            sx, sh, se = _fma(p, p, sx), _fma(q, q, sh), _fma(e, e, se)
        else:
            sx, sh, se = sx + p * p, sh + q * q, se + e * e
    nx, nh, ne = np.sqrt(sx), np.sqrt(sh), np.sqrt(se)
    return np.float64(nx * nx), np.float64(nh * nh), np.float64(ne * ne)


@numba.jit(**FLAT_JIT)
def _token_rows(x, x_hat, lanes, fma_tail, zero, xx, hh, ee):  # pragma: no cover - compiled
    """For each row r of x, x̂ (n, d): xx[r], hh[r], ee[r] = ‖x_r‖², ‖x̂_r‖², ‖x_r − x̂_r‖², float64
    (zero: 0 in x's dtype)."""
    for r in range(x.shape[0]):
        xx[r], hh[r], ee[r] = _row_energies(x[r], x_hat[r], lanes, fma_tail, zero)


@numba.jit(**FLAT_JIT)
def _logit_rows(s, s_hat, lanes, fma_tail, sum_lanes, zero, acc, ss, ee, products):  # pragma: no cover - compiled
    """For each row r of the logits s, ŝ (n, S): ss[r], ee[r] = ‖s_r‖², ‖s_r − ŝ_r‖² (float64) and
    products[r] = Σ ŝ_ri·s_ri in torch.sum's order (s's dtype); zero: 0 in s's dtype, acc: the
    caller's scratch of 16·sum_lanes in s's dtype."""
    for r in range(s.shape[0]):
        ss[r], _, ee[r] = _row_energies(s[r], s_hat[r], lanes, fma_tail, zero)
        products[r] = _sum_products(s_hat[r], s[r], sum_lanes, acc)


@numba.jit(**FLAT_JIT)
def _directions(xx, hh, ee, nx, nh, out):  # pragma: no cover - compiled
    """out[s] = metrics._rel_and_direction's direction error of token s from its energies and
    the roots nx = √xx, nh = √hh (torch's), its operations in its order."""
    for s in range(xx.shape[0]):
        if np.isnan(xx[s]) or np.isnan(hh[s]) or np.isnan(ee[s]):
            out[s] = np.nan
            continue
        a, b = nx[s], nh[s]
        if a > 0 and b > 0:
            gap = a - b
            num = ee[s] - gap * gap
            if num < 0.0:                # clamp(min=0) (NaN stays NaN)
                num = 0.0
            dr = (num / 2) / (a * b)
        elif a > 0 or b > 0:
            dr = 1.0
        else:
            dr = 0.0
        out[s] = 2.0 if dr > 2.0 else dr  # clamp(max=2)


def takes(dtype: torch.dtype, d: int) -> bool:
    """Whether the pass gives torch's bits for rows of d entries in dtype: the compiled loops are on
    for dtype (kvcommon.compiled.DTYPES) and norm_order found vector_norm's order."""
    if dtype not in compiled.DTYPES or d < 1:
        return False
    order = norm_order(dtype, d)
    return order is not None and (order[0] in _VECTOR_LANES or order[0] == 1)


@numba.jit(**FLAT_JIT)
def _kl_rows(p, log_p, log_p_hat, kept, per_mask, first_row, sum_lanes, terms, ones, acc, out):  # pragma: no cover - compiled
    """out[r] = Σ_i p_ri·(log p_ri − log p̂_ri) over row r (a query's S tokens), the terms as
    metrics.kl_attention forms them (0 where kept[(first_row + r) // per_mask] is False, when kept
    has rows) and summed in torch.sum's order as Σ terms_i·1 (the products are the terms,
    exactly). terms (S), ones (S, all 1) and acc (16·sum_lanes), in p's dtype: the caller's scratch."""
    n, s = p.shape
    masked = kept.shape[0] > 0
    for r in range(n):
        pr, lr, hr = p[r], log_p[r], log_p_hat[r]
        for i in range(s):
            terms[i] = pr[i] * (lr[i] - hr[i])
        if masked:
            kr = kept[(first_row + r) // per_mask]
            for i in range(s):
                if not kr[i]:
                    terms[i] = 0.0
        out[r] = _sum_products(terms, ones, sum_lanes, acc)


def kl_terms(p: torch.Tensor, log_p: torch.Tensor, log_p_hat: torch.Tensor, kept: torch.Tensor | None) -> torch.Tensor:
    """Σ_i p_i·(log p_i − log p̂_i) of each query (B, H, Nq) over its S tokens, float64, for
    contiguous float64 CPU tensors (B, H, Nq, S) with takes_products(float64, S); kept (B, H, S):
    the terms of evicted tokens are 0, as metrics.kl_attention sets them."""
    b, h, nq, s = p.shape
    pr, lr, hr = (row_view(t.detach()) for t in (p, log_p, log_p_hat))
    masks = np.zeros((0, s), np.bool_) if kept is None else kept.reshape(-1, s).contiguous().numpy()
    out = torch.empty((b, h, nq), dtype=torch.float64)
    o = out.reshape(-1).numpy()
    sum_lanes = sum_order(torch.float64, s)
    by_row_blocks(pr.shape[0], p.numel() * 3, lambda a, z: _kl_rows(
        pr[a:z], lr[a:z], hr[a:z], masks, nq, a, sum_lanes, np.empty(s), np.ones(s),
        np.empty(16 * max(sum_lanes, 1)), o[a:z]))
    return out


def takes_products(dtype: torch.dtype, n: int) -> bool:
    """Whether logit_terms gives torch's bits for rows of n entries in dtype: takes(dtype, n) and
    sum_order found torch.sum's order."""
    return takes(dtype, n) and sum_order(dtype, n) is not None


def logit_terms(s: torch.Tensor, s_hat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(‖s_q‖², ‖s_q − ŝ_q‖² float64, Σ ŝ_qi·s_qi in s's dtype) of each row (a query's logits) of s,
    ŝ (..., S), contiguous CPU tensors of one shape and dtype with takes_products(dtype, S)."""
    shape, n = s.shape[:-1], s.shape[-1]
    lanes, fma_tail = norm_order(s.dtype, n)
    sum_lanes = sum_order(s.dtype, n)
    sr, hr = row_view(s.detach()), row_view(s_hat.detach())
    ss, ee = (torch.empty(shape, dtype=torch.float64) for _ in range(2))
    products = torch.empty(shape, dtype=s.dtype)
    views = [t.reshape(-1).numpy() for t in (ss, ee, products)]
    kind = sr.dtype.type
    by_row_blocks(sr.shape[0], s.numel() * 2, lambda a, b: _logit_rows(
        sr[a:b], hr[a:b], lanes, fma_tail, sum_lanes, kind(0), np.empty(16 * max(sum_lanes, 1), sr.dtype),
        *(v[a:b] for v in views)))
    return ss, ee, products


def token_terms(x: torch.Tensor, x_hat: torch.Tensor, directions: bool = True) -> tuple:
    """(‖x_s‖², ‖x̂_s‖², ‖x_s − x̂_s‖², 1 − cos(x_s, x̂_s)) of each row (token vector) of x, x̂ (..., d),
    contiguous CPU tensors of one shape and dtype with takes(dtype, d): four float64 tensors (...);
    without `directions` the last is None (not computed)."""
    shape, d = x.shape[:-1], x.shape[-1]
    lanes, fma_tail = norm_order(x.dtype, d)
    xr, hr = row_view(x.detach()), row_view(x_hat.detach())
    xx, hh, ee = (torch.empty(shape, dtype=torch.float64) for _ in range(3))
    views = [row.reshape(-1).numpy() for row in (xx, hh, ee)]
    by_row_blocks(xr.shape[0], x.numel() * 2, lambda a, b: _token_rows(
        xr[a:b], hr[a:b], lanes, fma_tail, xr.dtype.type(0), *(v[a:b] for v in views)))
    if not directions:
        return xx, hh, ee, None
    nx, nh = xx.sqrt(), hh.sqrt()            # torch's roots, on tensors laid out as _rel_and_direction's
    direction = torch.empty(shape, dtype=torch.float64)
    _directions(*views, nx.reshape(-1).numpy(), nh.reshape(-1).numpy(), direction.reshape(-1).numpy())
    return xx, hh, ee, direction
