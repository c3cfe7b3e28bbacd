"""Per-trial error metrics (DESIGN.md "Metrics"), batched: every function maps tensors with a
leading trial dimension B to one value per trial (B,).

The AMD paper's definitions (seeds/amd-tq-sq-validation-paper.zh.txt, §2 "误差度量" (error
metrics), eq. 2; §3 is the experimental set-up that uses them):
- For X ∈ {K, V, T}: rel_mse_X = ‖X − X̂‖²/‖X‖² (Frobenius, over the whole trial), cos_X = the
  cosine of the flattened tensors, snr_err_X = rel_mse_X/(1 + rel_mse_X) (the paper's NF),
  dir_err_X = 1 − cos_X, d2_X = √(dir_err_X² + snr_err_X²). T = softmax(q kᵀ/√d)·v is the
  attention output; the reference T uses exact K, V.
- The six-D error point (SIX_D) is (snr_err_K, dir_err_K, snr_err_V, dir_err_V, snr_err_T,
  dir_err_T): the paper's "six scalar metrics" — an NF and a direction error for each of the
  two caches and the output. Its direction errors use the flattened cosine, the same tensor
  pair as its NF: for one pair (x, x̂), relMSE and cos fix ‖x̂‖/‖x‖ (relMSE = 1 + r² − 2r·cos),
  so each (snr_err, dir_err) pair is one consistent description of one reconstruction, and
  d2_X is the distance of that pair from the origin (eq. 2).
- The paper's isolation metrics relMSE_K and relMSE_V are output errors, NOT cache errors:
  relMSE_K is the relMSE of T with only K compressed (V exact), stored as t_rel_mse_konly;
  relMSE_V the relMSE of T with only V compressed (K exact), stored as t_rel_mse_vonly. The
  cache errors ‖K − K̂‖²/‖K‖² and ‖V − V̂‖²/‖V‖² are rel_mse_k and rel_mse_v.
- The paper's per-token cache metrics ptcosine_K = cosine(K, K̂), ptcosine_V = cosine(V, V̂),
  "measuring each token's reconstruction quality independently of Q", are ptcosine_k and
  ptcosine_v: the mean over the H·S token vectors of each one's cosine with its
  reconstruction (per_token_cosine). They are not the flattened cos_k, cos_v, which weight a
  token by ‖x‖² and can order codecs differently (tests/test_metrics.py shows such a case);
  they are stored beside the six-D point, not part of it.
Zero vectors, for every cosine here: both zero → 1 (reproduced exactly), one zero → 0.

Evicting codecs (Scheme.kept gives the kept-token mask): the attention of a real evicting
cache is the softmax over the kept tokens only, so T̂ = softmax over kept(ŝ)·V̂ and
t_rel_mse_konly uses the same attention with exact V. evicted_mass is the exact attention
probability (exact logits, all S tokens) on the evicted tokens, mean over heads and queries.
kl_attn, logit_rel_mse and logit_slope are over the kept tokens: kl_attn = KL(p_kept ‖ p̂) with
p_kept the exact attention renormalised over the kept tokens and p̂ the codec's softmax over
the kept tokens (KL(p ‖ p̂) over all S is infinite once mass is evicted; evicted_mass carries
that part); the logit metrics use the kept (query, token) pairs only. For a codec that keeps
every token these are the ordinary definitions and evicted_mass is NaN (NULL in the store:
the codec has no eviction to measure). t_rel_mse_vonly keeps the exact attention over all S
tokens with V̂, whose evicted values decode to zero: the output an evicting V cache loses.
"""
from __future__ import annotations

import math

import torch

from kvcommon import compiled
from kvcommon.memo import IdentityMemo
from kvcommon.rows import EVICTION_METRIC_NAMES, METRIC_NAMES   # the metrics' names: columns of the row schema
from kvcommon.threads import torch_threads


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], -1)


# Every per-trial sum runs in two stages: along each row (a token vector, a query's logits) in
# the tensor's dtype, then over the trial's rows in float64. Torch reduces a row within one
# thread and splits only the many rows between threads, so the sums are the same bits whatever
# the thread count; a single reduction over a whole flattened trial is split across threads
# and is not (logit_slope changed its last bits between 1 and 2 threads at S = 777, d = 64).
# The rows' energies are also what the per-token cosines use, so one pass gives both; on the CPU
# that pass is one compiled loop over each row (stats/metrics_cpu.py), with the same bits.
def _trial_sum(rows: torch.Tensor) -> torch.Tensor:
    """The per-row values (B, ...) summed per trial, float64 (B,)."""
    return _flat(rows.double()).sum(dim=1)


def _per_token_sq(x: torch.Tensor) -> torch.Tensor:
    """‖x_s‖² per row (token vector) of x (..., d), (...) float64."""
    return torch.square(torch.linalg.vector_norm(x, dim=-1)).double()


def _sum_sq(x: torch.Tensor) -> torch.Tensor:
    """Σx² per trial, float64 (B,): the rows' squared norms summed."""
    return _trial_sum(_per_token_sq(x))


def _log_probs(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.double(), dim=-1)


def _probs(logits: torch.Tensor) -> torch.Tensor:
    return _exact(_log_probs, logits).exp()


# The terms of the exact side (K, V, T, the exact logits): the same for every cell of a chunk, so
# computed once per chunk for the very tensor (the runner shares K, V and exact_attention's result).
_EXACT = IdentityMemo(16)


def _exact(term, x: torch.Tensor) -> torch.Tensor:
    """term(x) for an exact-side tensor x, remembered for the very x (_EXACT)."""
    return _EXACT.get_or_compute((x,), lambda: term(x), term.__name__)


def _not_a_number(*terms: torch.Tensor) -> torch.Tensor:
    """Where any of the terms is NaN: the comparisons that pick the 0/0 cases below are False on
    NaN, and would otherwise turn a NaN trial into an exact 0 (a perfect score)."""
    return torch.stack(torch.broadcast_tensors(*map(torch.isnan, terms))).any(dim=0)


def _safe_ratio(num: torch.Tensor, den: torch.Tensor, zero_over_zero: float) -> torch.Tensor:
    """num/den with 0/0 → zero_over_zero and x/0 → inf; NaN where num or den is NaN."""
    ratio = num / torch.where(den > 0, den, 1.0)
    ratio = torch.where(den > 0, ratio, torch.where(num > 0, math.inf, zero_over_zero))
    return torch.where(_not_a_number(num, den), math.nan, ratio)


# torch's reductions split a single output's row across threads from this many elements on
# (at::internal::GRAIN_SIZE), in an order of their own; many rows are split between threads whole.
_TORCH_GRAIN = 32768


def _compiled_terms(x: torch.Tensor, x_hat: torch.Tensor):
    """stats.metrics_cpu where its compiled passes take the rows of x and x̂ with the bits of the
    torch passes (contiguous CPU tensors of one shape and a kvcommon.compiled.DTYPES dtype,
    vector_norm's order found: metrics_cpu.takes; not one row of _TORCH_GRAIN entries or more),
    else None. Imported only then, so a run on CUDA never loads numba."""
    if not (compiled.takes(x) and x_hat.dtype == x.dtype and x_hat.device == x.device and x_hat.shape == x.shape
            and x.dim() >= 1 and x.numel() and x.is_contiguous() and x_hat.is_contiguous()
            and (x.numel() < _TORCH_GRAIN or x.numel() > x.shape[-1])):
        return None
    from . import metrics_cpu
    return metrics_cpu if metrics_cpu.takes(x.dtype, x.shape[-1]) else None


def _token_terms(x: torch.Tensor, x_hat: torch.Tensor, directions: bool = False):
    """(‖x_s‖², ‖x̂_s‖², ‖x_s − x̂_s‖², dir_err_s) per row (token vector) s of x, x̂ (..., d), float64
    (...): on the CPU in one compiled pass (metrics_cpu.token_terms; dir_err_s with `directions`,
    else None); else by torch's passes, x's energies remembered for the very x, and dir_err_s None
    (per_token_cosine computes it)."""
    loops = _compiled_terms(x, x_hat)
    if loops is not None:
        return loops.token_terms(x, x_hat, directions)
    return _exact(_per_token_sq, x), _per_token_sq(x_hat), _per_token_sq(x - x_hat), None


def _rel_and_direction(xx, hh, ee):
    """rel_mse = ‖x−x̂‖²/‖x‖² and dir_err = 1 − cos. The direction error uses the identity
    ‖x‖‖x̂‖ − x·x̂ = (‖x − x̂‖² − (‖x‖ − ‖x̂‖)²)/2, whose terms keep their digits when the error is
    tiny (1 − x·x̂/(‖x‖‖x̂‖) would cancel). 0/0 cases: both zero → 0, one zero → 1; NaN in, NaN out."""
    rel = _safe_ratio(ee, xx, 0.0)
    nx, nh = xx.sqrt(), hh.sqrt()
    both = (nx > 0) & (nh > 0)
    num = torch.clamp(ee - (nx - nh) ** 2, min=0.0) / 2
    direction = torch.where(both, num / torch.where(both, nx * nh, 1.0),
                            torch.where((nx > 0) | (nh > 0), 1.0, 0.0))
    direction = torch.where(_not_a_number(xx, hh, ee), math.nan, direction)
    return rel, torch.clamp(direction, max=2.0)


def relative_mse(x: torch.Tensor, x_hat: torch.Tensor) -> torch.Tensor:
    """‖x − x̂‖²/‖x‖² per trial (0/0 → 0: an all-zero tensor reproduced exactly has no error)."""
    loops = _compiled_terms(x, x_hat)
    if loops is not None:
        xx, _, ee, _ = loops.token_terms(x, x_hat, False)
        return _safe_ratio(_trial_sum(ee), _trial_sum(xx), 0.0)
    return _safe_ratio(_sum_sq(x - x_hat), _exact(_sum_sq, x), 0.0)


def direction_error(x: torch.Tensor, x_hat: torch.Tensor) -> torch.Tensor:
    """1 − cos(x, x̂) per trial, accurate for tiny errors (see _rel_and_direction)."""
    return _rel_and_direction(*map(_trial_sum, _token_terms(x, x_hat)[:3]))[1]


def cosine(x: torch.Tensor, x_hat: torch.Tensor) -> torch.Tensor:
    """Cosine of the flattened tensors per trial (1 when both are zero, 0 when one is)."""
    return 1 - direction_error(x, x_hat)


def per_token_cosine(x: torch.Tensor, x_hat: torch.Tensor, terms: tuple | None = None) -> torch.Tensor:
    """Mean over the token vectors (B, H, S, d) -> (B,) of each vector's cosine with its
    reconstruction: the paper's ptcosine (§2). Every token of every head weighs the same,
    whatever its norm. A token that is zero and reproduced as zero has cosine 1, one whose
    original or reconstruction alone is zero (e.g. an evicted token) has cosine 0. terms:
    _token_terms(x, x̂) when the caller has them."""
    *energies, direction = terms or _token_terms(x, x_hat, directions=True)
    if direction is None:
        _, direction = _rel_and_direction(*energies)
    return 1 - _flat(direction).mean(dim=1)


def error_point(x: torch.Tensor, x_hat: torch.Tensor, suffix: str, terms: tuple | None = None
                ) -> dict[str, torch.Tensor]:
    """rel_mse, cos, snr_err, dir_err and d2 of one tensor, keyed with `_suffix`; terms:
    _token_terms(x, x̂) when the caller has them."""
    rel, direction = _rel_and_direction(*map(_trial_sum, (terms or _token_terms(x, x_hat))[:3]))
    snr = torch.where(torch.isinf(rel), 1.0, rel / (1 + rel))
    return {f"rel_mse_{suffix}": rel, f"cos_{suffix}": 1 - direction, f"snr_err_{suffix}": snr,
            f"dir_err_{suffix}": direction, f"d2_{suffix}": torch.sqrt(direction ** 2 + snr ** 2)}


def exact_logits(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q kᵀ/√d: (B, H, Nq, d) × (B, H, S, d) -> (B, H, Nq, S)."""
    return q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])


def _kept_logits(logits: torch.Tensor, kept: torch.Tensor | None) -> torch.Tensor:
    """logits (B, H, Nq, S) with the evicted tokens (kept (B, H, S) False) at −inf, so that a
    softmax is over the kept tokens only; unchanged when kept is None."""
    return logits if kept is None else logits.masked_fill(~kept[:, :, None, :], float("-inf"))


def attention(logits: torch.Tensor, kept: torch.Tensor | None = None) -> torch.Tensor:
    """Attention probabilities (B, H, Nq, S): the softmax over the kept tokens (all when kept is None)."""
    return torch.softmax(_kept_logits(logits, kept), dim=-1)


def kl_attention(logits: torch.Tensor, logits_hat: torch.Tensor, kept: torch.Tensor | None = None) -> torch.Tensor:
    """KL(p ‖ p̂) of the attention distributions over the S keys, averaged over heads and queries.
    With kept (B, H, S): both distributions are over the kept tokens (p the exact attention
    renormalised over them), so the KL is finite whatever mass was evicted."""
    if kept is None:
        log_p, p = _exact(_log_probs, logits), _exact(_probs, logits)
    else:
        log_p = torch.log_softmax(_kept_logits(logits.double(), kept), dim=-1)
        p = log_p.exp()
    log_p_hat = torch.log_softmax(_kept_logits(logits_hat.double(), kept), dim=-1)
    loops = _compiled_terms(log_p, log_p_hat)
    if loops is not None and p.is_contiguous() and loops.takes_products(torch.float64, logits.shape[-1]):
        kl = loops.kl_terms(p, log_p, log_p_hat, kept)    # the terms and their sums in one pass, the same bits
    else:
        terms = p * (log_p - log_p_hat)
        if kept is not None:  # an evicted token contributes 0·(−inf + inf) = NaN; its term is 0
            terms = torch.where(kept[:, :, None, :], terms, 0.0)
        kl = torch.sum(terms, dim=-1)
    return kl.reshape(kl.shape[0], -1).mean(dim=1)


def evicted_mass(logits: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Exact attention probability on the evicted tokens (kept (B, H, S) False) under the exact
    logits (B, H, Nq, S), averaged over heads and queries: (B,), float64."""
    probs = torch.softmax(logits.double(), dim=-1)
    mass = torch.sum(torch.where(kept[:, :, None, :], 0.0, probs), dim=-1)
    return mass.reshape(mass.shape[0], -1).mean(dim=1)


def weighted_values(probs: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """probs · v (B, H, Nq, d). On the CPU every product runs on one intra-op thread: MKL splits
    the long inner (token) dimension across threads and rounds differently at 2 threads than at
    1 (Intel Xeon: T's last bits at S = 777 and 1024, d = 64 and 128), so a worker process with
    one thread would give other rows than a serial run with two. The threads share the batch
    instead: the B·H products split into contiguous blocks, one per torch thread
    (compiled.by_row_blocks), each block's matmul on one thread — a product's bits do not depend
    on the batch around it, so the rows are one thread's whatever the count (tests/test_metrics.py).
    On two cores 1.3–1.9x one thread on the whole batch at S = 777..4096, d = 64..256."""
    if probs.device.type != "cpu":
        return probs @ v
    threads = torch.get_num_threads()
    with torch_threads(1):
        if probs.dim() < 3 or probs.shape[:-2] != v.shape[:-2] or probs.dtype != v.dtype or \
                probs.requires_grad or v.requires_grad:
            return probs @ v                                 # broadcast batches, mixed dtypes: as torch does them
        p, w = probs.reshape(-1, *probs.shape[-2:]), v.reshape(-1, *v.shape[-2:])
        out = torch.empty(p.shape[0], p.shape[1], w.shape[2], dtype=p.dtype)

        def run(start: int, stop: int) -> None:
            with torch_threads(1):                           # OpenMP's count is per thread: the pool's too
                torch.matmul(p[start:stop], w[start:stop], out=out[start:stop])
        compiled.by_row_blocks(p.shape[0], p.numel(), run, threads=threads)
    return out.reshape(*probs.shape[:-1], v.shape[-1])


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits q kᵀ/√d, probabilities softmax(logits), T = probs·v) of the exact cache, the
    reference of every codec's metrics on the same data: the runner computes it once per chunk
    and hands it to trial_metrics for each cell of the chunk."""
    logits = exact_logits(q, k)
    probs = torch.softmax(logits, dim=-1)
    return logits, probs, weighted_values(probs, v)


def key_metrics(k: torch.Tensor, k_hat: torch.Tensor) -> dict[str, torch.Tensor]:
    """The metrics of K and its reconstruction alone: error_point(·, "k") and ptcosine_k (one
    pass of the rows' terms for both)."""
    terms = _token_terms(k, k_hat, directions=True)
    return {**error_point(k, k_hat, "k", terms=terms), "ptcosine_k": per_token_cosine(k, k_hat, terms=terms)}


def value_metrics(v: torch.Tensor, v_hat: torch.Tensor, probs: torch.Tensor, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """The metrics of V̂ against the exact attention (probs, T): error_point(·, "v"), ptcosine_v and
    t_rel_mse_vonly (T̂ with exact probabilities and V̂); one pass of the rows' terms for V's two."""
    terms = _token_terms(v, v_hat, directions=True)
    out = error_point(v, v_hat, "v", terms=terms)
    out["t_rel_mse_vonly"] = relative_mse(t, weighted_values(probs, v_hat))
    out["ptcosine_v"] = per_token_cosine(v, v_hat, terms=terms)
    return out


def score_metrics(logits: torch.Tensor, logits_hat: torch.Tensor, kept: torch.Tensor | None, v: torch.Tensor,
                  t: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(the metrics of the scores alone: t_rel_mse_konly, kl_attn, the logit metrics and, with kept,
    evicted_mass; the compressed attention probabilities p̂ (B, H, Nq, S))."""
    probs_hat = attention(logits_hat, kept)
    out = {"t_rel_mse_konly": relative_mse(t, weighted_values(probs_hat, v)), "kl_attn": kl_attention(logits, logits_hat, kept)}
    if kept is not None:
        out["evicted_mass"] = evicted_mass(logits, kept)
        # the logit metrics over the kept (query, token) pairs: the evicted ones count zero
        pairs = kept[:, :, None, :].expand_as(logits)
        logits, logits_hat = torch.where(pairs, logits, 0.0), torch.where(pairs, logits_hat, 0.0)
    out["logit_rel_mse"], out["logit_slope"] = _logit_errors(logits, logits_hat)
    return out, probs_hat


def _logit_errors(logits: torch.Tensor, logits_hat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logit_rel_mse ‖ŝ − s‖²/‖s‖², logit_slope Σ ŝ·s/‖s‖²) per trial: the rows' three sums in one
    compiled pass on the CPU where it gives torch's bits (metrics_cpu.logit_terms), else torch's passes."""
    loops = _compiled_terms(logits, logits_hat)
    if loops is not None and loops.takes_products(logits.dtype, logits.shape[-1]):
        ss, ee, products = loops.logit_terms(logits, logits_hat)
        energy = _trial_sum(ss)
        return _safe_ratio(_trial_sum(ee), energy, 0.0), _safe_ratio(_trial_sum(products), energy, 1.0)
    return (relative_mse(logits, logits_hat),
            _safe_ratio(_trial_sum(torch.sum(logits_hat * logits, dim=-1)), _exact(_sum_sq, logits), 1.0))


def trial_metrics(k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, k_hat: torch.Tensor, v_hat: torch.Tensor,
                  logits_hat: torch.Tensor, kept: torch.Tensor | None = None,
                  exact: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Every per-trial metric of DESIGN.md, each a float64 tensor (B,): METRIC_NAMES, and with
    kept also EVICTION_METRIC_NAMES.

    logits_hat is the scheme's `score` (which may differ from q k̂ᵀ/√d, e.g. QJL on K); the
    compressed attention output is T̂ = softmax(logits_hat)·v̂, the reference T uses exact K, V.
    kept (B, H, S), bool: the tokens an evicting codec keeps (Scheme.kept); T̂'s softmax, the KL
    and the logit metrics are then over the kept tokens only (module docstring).
    exact: exact_attention(q, k, v) when the caller has it already (shared by the cells of a chunk).
    The metrics of K alone, of V alone and of the scores alone (key_metrics, value_metrics,
    score_metrics) are remembered for the very tensors they are computed from (_PARTS): cells of a
    chunk whose codecs decode K (or V, or score) alike compute them once; only T̂'s are per cell.
    """
    logits, probs, t = exact_attention(q, k, v) if exact is None else exact
    masks = () if kept is None else (kept,)
    scored, probs_hat = _memoized(score_metrics, (logits, logits_hat, *masks, v, t), logits, logits_hat, kept, v, t)
    out = {**_memoized(key_metrics, (k, k_hat), k, k_hat), **_memoized(value_metrics, (v, v_hat, probs, t),
                                                                            v, v_hat, probs, t), **scored}
    out.update(error_point(t, weighted_values(probs_hat, v_hat), "t"))
    names = METRIC_NAMES if kept is None else METRIC_NAMES + EVICTION_METRIC_NAMES
    return {name: out[name] for name in names}


_PARTS = IdentityMemo(24)   # a chunk's parts at one budget: every codec's K, V and scores, with room


def _memoized(part, tensors: tuple[torch.Tensor, ...], *args):
    return _PARTS.get_or_compute(tensors, lambda: part(*args), part.__name__)
