"""harness fit: what a capture's layers are made of, as a scenario spec (fitted:SPEC.json).

Per layer and per head, on the capture's fitting part (its first `fit_fraction` of tokens, the
part replay:FILE calibrates on, so the replayed windows stay held out):
- the spec (scenarios/fitted.py): per query head the mean and covariance of one token's
  (k, v, q), pre-RoPE where the capture has RoPE, and the Student-t dof of its whitened
  coordinates (`fit_dof`); the capture's rotary frequencies and scaling (`rope_from_capture`);
- statistics that say what the scenarios are made of (`layer_statistics`): participation ratio
  and power-law decay of the K and V spectra, channel kurtosis, outlier channels, mean offsets,
  K/V alignment, and for RoPE captures how much RoPE spreads the layer's keys; and the sequence's
  structure on each segment (harness/structure.py: attention sinks, recency, heavy hitters,
  neighbour correlation, logit spread);
- per query head the mean of a token as a function of its position (`position_profile`: where
  tokens depend on their absolute position, as through learned position embeddings), the order along
  the sequence around it (`transition`: a VAR(1) of the joint tokens) and the tail law under which its
  whitened tokens are likelier (`tail_law`);
- the nearest of the scenario families (`FAMILIES`, `FEATURES`, `family_distances`).
"""
from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np

import scenarios
from kvcommon.rng import generator
from kvcommon.threads import small_linalg
from scenarios.base import TrialShape, participation_ratio
from scenarios.fitted import FORMAT, N_SCALE_QUANTILES, dct_basis, head_model, position_deviation, tril
from scenarios.replay import Capture

from .structure import segment_statistics

# Family features: each in [0, 1], computed by `features` the same way on a real layer and on a
# draw of each family. The distance of a layer to a family is the root-mean-square difference of
# the seven (0: the same statistics; 1: opposite extremes on every one).
FEATURES = {
    "k_rank": "participation ratio of K's covariance / d",
    "v_rank": "participation ratio of V's covariance / d",
    "tail": "2 / (Student-t dof of the whitened (k, v) coordinates); 0 for Gaussian",
    "channels": "1 - participation ratio of K's channel variances / d (energy on few channels)",
    "kv_align": "mean squared cosine between the top-r eigenvectors of K and of V (r = min rank)",
    "rope_spread": "1 - PR(pre-RoPE keys of all heads) / PR(post-RoPE keys); 0 without RoPE",
    "k_mean": "|E k|^2 / E|k|^2 (mean offset's share of K's energy)",
}
FAMILIES = ("gaussian", "spectral_decay", "heavy_tail", "lowrank_aligned", "lowrank_misaligned", "outlier_channels",
            "rope_lowrank", "structured")
_DOF_GRID = np.geomspace(2.05, 200.0, 48)
_DOF_SAMPLE = 20_000
# The VAR(1) transition's largest singular value in whitened coordinates: below 1, so the
# innovations' covariance I − AAᵀ stays positive definite (a stationary process of covariance Σ).
MAX_TRANSITION_GAIN = 0.999


def fit_dof(x: np.ndarray) -> float | None:
    """Maximum-likelihood dof ν of a zero-centred Student-t with free scale fitted to the values x
    (a subsample of _DOF_SAMPLE, fixed seed, when larger), over a log grid of ν in [2.05, 200]
    (the scale by the EM fixed point σ² = mean(w x²), w = (ν+1)/(ν + x²/σ²), Liu & Rubin 1995);
    None when the Gaussian's likelihood is at least the best t's (no tail to model)."""
    x = np.asarray(x, dtype=float).ravel()
    if x.size > _DOF_SAMPLE:
        x = np.random.default_rng(0).choice(x, _DOF_SAMPLE, replace=False)
    x2 = np.square(x)
    best_ll, best_nu = -0.5 * x.size * (math.log(2 * math.pi * x2.mean()) + 1), None   # Gaussian MLE
    for nu in _DOF_GRID:
        s2 = x2.mean()
        for _ in range(30):
            s2 = np.mean((nu + 1) / (nu + x2 / s2) * x2)
        ll = x.size * (math.lgamma((nu + 1) / 2) - math.lgamma(nu / 2) - 0.5 * math.log(nu * math.pi * s2)) \
            - (nu + 1) / 2 * np.log1p(x2 / (nu * s2)).sum()
        if ll > best_ll:
            best_ll, best_nu = ll, float(nu)
    return best_nu


def whitened(x: np.ndarray) -> np.ndarray:
    """(n, p) data centred and rotated onto its covariance's eigenvectors, each coordinate scaled to
    unit variance (coordinates of zero variance dropped)."""
    centred = x - x.mean(0)
    with small_linalg():
        lam, vec = np.linalg.eigh(np.cov(centred, rowvar=False))
    keep = lam > 1e-10 * max(lam.max(), 1e-300)
    return centred @ vec[:, keep] / np.sqrt(lam[keep])


def scale2_quantiles(white: np.ndarray) -> np.ndarray:
    """Quantiles (probabilities 0, 1/64, ..., 1) of s² = m / mean(m), m = |w|² the squared norm of
    each whitened token w (n, p): the per-token scale of an elliptical law x = μ + s·L·g, for which
    m = s²·χ²_p, so that m / mean(m) estimates s² (with E s² = 1) up to a χ²_p / p factor of
    relative sd √(2/p) (0.14 for p = 96)."""
    m = np.sum(np.square(white), axis=1)
    return np.quantile(m / m.mean(), np.linspace(0, 1, N_SCALE_QUANTILES))


def norm_overdispersion(white: np.ndarray) -> float:
    """var(|w|²) / (2p) of whitened tokens w (n, p): 1 for a Gaussian; (2 + κ)/2 for independent
    coordinates of excess kurtosis κ; large when whole tokens are scaled up or down together."""
    m = np.sum(np.square(white), axis=1)
    return float(np.var(m) / (2 * white.shape[1]))


def spectrum(x: np.ndarray) -> np.ndarray:
    """Eigenvalues (descending) of the centred sample covariance of x (n, d)."""
    with small_linalg():
        return np.clip(np.linalg.eigvalsh(np.cov(x, rowvar=False)), 0, None)[::-1]


def decay_alpha(lam: np.ndarray) -> float:
    """α of the least-squares fit log λ_i = c − α log i over the positive eigenvalues (power law)."""
    lam = lam[lam > 1e-12 * lam[0]]
    return float(-np.polyfit(np.log(np.arange(1, lam.size + 1)), np.log(lam), 1)[0]) if lam.size > 1 else 0.0


def alignment(k: np.ndarray, v: np.ndarray) -> float:
    """Mean squared cosine of the principal angles between the top-r eigenvectors of K's and V's
    covariances, r = max(1, round(min(PR_K, PR_V))): 1 shared subspace, 0 orthogonal ones."""
    with small_linalg():
        lk, uk = np.linalg.eigh(np.cov(k, rowvar=False))
        lv, uv = np.linalg.eigh(np.cov(v, rowvar=False))
        r = max(1, round(min(participation_ratio(np.clip(lk, 0, None)), participation_ratio(np.clip(lv, 0, None)))))
        cos = np.linalg.svd(uk[:, ::-1][:, :r].T @ uv[:, ::-1][:, :r], compute_uv=False)
    return float(np.mean(cos ** 2))


def flat_pr(keys: np.ndarray) -> float:
    """Participation ratio of the keys of all heads (H, n, d) as one (n, H·d) matrix (centred)."""
    return participation_ratio(spectrum(keys.transpose(1, 0, 2).reshape(keys.shape[1], -1)))


def features(k: np.ndarray, v: np.ndarray, k_pre: np.ndarray | None = None) -> dict[str, float]:
    """FEATURES of one layer from its keys and values (H, n, d) as a cache stores them (post-RoPE),
    averaged over heads; k_pre: the same keys before RoPE (None without RoPE)."""
    d = k.shape[-1]
    per_head = []
    for kh, vh in zip(k, v):
        dof = fit_dof(whitened(np.hstack((kh, vh))))
        channel_var = kh.var(0)
        per_head.append({
            "k_rank": participation_ratio(spectrum(kh)) / d,
            "v_rank": participation_ratio(spectrum(vh)) / d,
            "tail": 0.0 if dof is None else 2.0 / dof,
            "channels": 1 - participation_ratio(channel_var) / d,
            "kv_align": alignment(kh, vh),
            "k_mean": float(np.sum(kh.mean(0) ** 2) / np.mean(np.sum(kh ** 2, -1))),
        })
    out = {name: float(np.mean([row[name] for row in per_head])) for name in per_head[0]}
    out["rope_spread"] = 0.0 if k_pre is None else float(max(0.0, 1 - flat_pr(k_pre) / flat_pr(k)))
    return {name: out[name] for name in FEATURES}


@functools.lru_cache(maxsize=8)
def family_features(n_kv_heads: int, dim: int, n_tokens: int, seed: int = 0) -> dict[str, dict[str, float]]:
    """FEATURES of each family's default scenario drawn at the capture's geometry (n tokens per
    head; up to 4 heads, all n_kv_heads for rope_lowrank, whose rank is a fraction of H·d)."""
    out = {}
    for name in FAMILIES:
        heads = n_kv_heads if name == "rope_lowrank" else min(4, n_kv_heads)
        shape = TrialShape(n_heads=heads, seq_len=n_tokens, n_queries=1, dim=dim, n_calib=1)
        draw = scenarios.create(name).draw(lambda *labels, _n=name: generator("pcg64", seed, "fit-family", _n, *labels),
                                           shape)
        k_pre = None
        if name == "rope_lowrank":
            from kvcommon.rope import undo_rope
            import torch
            k_pre = undo_rope(torch.from_numpy(draw["k"]), torch.from_numpy(draw["positions"])).numpy()
        out[name] = features(draw["k"], draw["v"], k_pre)
    return out


def family_distances(layer: dict[str, float], families: dict[str, dict[str, float]]) -> dict[str, float]:
    """RMS difference of the FEATURES between a layer and each family (module docstring)."""
    return {name: float(math.sqrt(np.mean([(layer[f] - ref[f]) ** 2 for f in FEATURES])))
            for name, ref in families.items()}


def rope_from_capture(cap: Capture) -> tuple[np.ndarray, float] | None:
    """(inv_freq (r/2,), scaling) of the capture's RoPE, measured from its pre- and post-RoPE queries
    at position 1: rotate-half RoPE on the first r coordinates (the file's rope_dims, d when absent)
    multiplies the complex pair z = x_i + i·x_{i+r/2} by scaling·e^{i·θ_i·p}, so at p = 1
    θ_i = arg(z_rope / z) and scaling = |z_rope| / |z| (medians over tokens, heads and layers). None
    without RoPE; ValueError when no token sits at position 1."""
    if not cap.has_rope:
        return None
    at_one = np.flatnonzero(cap.positions == 1)
    if at_one.size == 0:
        raise ValueError(f"{cap.path}: no token at position 1 to measure the RoPE frequencies from")
    rotated = cap.rope_dims
    half = rotated // 2
    x = cap.q[:, :, at_one, :rotated].astype(np.float64)
    y = cap.q_rope[:, :, at_one, :rotated].astype(np.float64)
    z, z_rope = x[..., :half] + 1j * x[..., half:], y[..., :half] + 1j * y[..., half:]
    ok = np.abs(z) > 1e-6 * np.abs(z).max()
    ratio = z_rope[ok.all(-1)] / z[ok.all(-1)]
    return np.median(np.angle(ratio), axis=0), float(np.median(np.abs(ratio)))


def transition(joint: np.ndarray, segments: np.ndarray, model) -> np.ndarray | None:
    """B (3d, 3d) of the VAR(1) x_t − μ = B (x_{t−1} − μ) + η_t fitted to a query head's tokens
    joint (n, 3d) = (k, v, q) in sequence order, segment ids (n,), and model, the head's TokenModel
    as the spec stores it: in its whitened coordinates w = Λ^−½ Uᵀ(x − μ) (unit covariance)
    A = E[w_t w_{t−1}ᵀ] over the consecutive pairs inside one segment (Yule–Walker with Var w = I),
    its singular components within the sampling noise dropped and the others capped at
    MAX_TRANSITION_GAIN, then B = U Λ^½ A Λ^−½ Uᵀ. None without a consecutive pair."""
    same = segments[1:] == segments[:-1]
    if not same.any():
        return None
    lam, vec = model.basis
    keep = lam > 1e-10 * max(float(lam.max()), 1e-300)
    basis = vec[:, keep]
    white = (joint - model.mean) @ basis / np.sqrt(lam[keep])
    n_pairs = int(same.sum())
    lagged = white[1:][same].T @ white[:-1][same] / n_pairs
    with small_linalg():
        u, sv, vt = np.linalg.svd(lagged)
    # Sampling noise alone puts singular values up to ≈ 2√(p/n) into a p × p lag covariance of n
    # pairs (entries of sd 1/√n); components at or below the optimal hard threshold for a square
    # matrix, (4/√3)·√p·(1/√n) (Gavish & Donoho 2014, IEEE Trans. Inf. Theory 60(8), known noise
    # level), are dropped, so the order the draws get is the one the data show beyond their noise.
    threshold = 4 / math.sqrt(3) * math.sqrt(lagged.shape[0] / n_pairs)
    gain = (u * np.where(sv > threshold, np.minimum(sv, MAX_TRANSITION_GAIN), 0.0)) @ vt
    return (basis * np.sqrt(lam[keep])) @ gain @ (basis / np.sqrt(lam[keep])).T


def position_profile(joint: np.ndarray, positions: np.ndarray, segments: np.ndarray) -> tuple[int, np.ndarray] | None:
    """The deviation of a token's mean from the overall mean as a function of its position, on a
    query head's tokens joint (n, 3d): (length, W), W (c − 1, 3d) the coefficients of the cosines
    j = 1..c−1 (`dct_basis`, length = the largest position + 1), fitted by least squares with the
    constant.

    c is chosen by leave-one-segment-out cross-validation over c = 1, 2, 4, ... up to a quarter of
    the positions: each segment's tokens are predicted from the profile fitted on the others,
    the error summed over the coordinates in units of their sd. c = 1 (no dependence on
    position the held-out segments confirm) gives None, as do fewer than two segments (a
    profile fitted on one segment cannot be told from that segment's own drift)."""
    ids = np.unique(segments)
    length = int(positions.max()) + 1
    if ids.size < 2 or length < 8:
        return None
    scaled = (joint - joint.mean(0)) / np.maximum(joint.std(0), 1e-12)
    candidates = [2 ** i for i in range(int(math.log2(length // 4)) + 1)]
    errors = []
    for c in candidates:
        basis = dct_basis(positions, length, c)
        error = 0.0
        for held in ids:
            out = segments == held
            with small_linalg():
                w = np.linalg.lstsq(basis[~out], scaled[~out], rcond=None)[0]
            error += float(np.sum((scaled[out] - basis[out] @ w) ** 2))
        errors.append(error)
    c = candidates[int(np.argmin(errors))]
    if c == 1:
        return None
    with small_linalg():
        w = np.linalg.lstsq(dct_basis(positions, length, c), joint, rcond=None)[0]
    return length, w[1:]


def tail_law(white: np.ndarray, dof: float | None, scale2: np.ndarray) -> str:
    """The tail law of scenarios/fitted.py under which the whitened tokens white (n, p) are more
    likely: "coordinate" (i.i.d. unit-variance Student-t(dof) coordinates, Gaussian for dof None)
    or "token" (w = s·g, g standard normal, s² from the quantiles scale2, each quantile an atom
    of weight 1/64, the two ends 1/128)."""
    from scipy.special import gammaln, logsumexp
    if dof is None:
        coordinate = float(np.sum(-0.5 * math.log(2 * math.pi) - 0.5 * white ** 2))
    else:
        s2 = (dof - 2) / dof
        coordinate = float(np.sum(gammaln((dof + 1) / 2) - gammaln(dof / 2) - 0.5 * math.log(dof * math.pi * s2)
                                  - (dof + 1) / 2 * np.log1p(white ** 2 / (s2 * dof))))
    atoms = np.maximum(np.asarray(scale2, dtype=float), 1e-6)
    weights = np.full(atoms.size, 1 / (atoms.size - 1))
    weights[[0, -1]] /= 2
    p = white.shape[1]
    terms = np.log(weights) - 0.5 * p * np.log(2 * math.pi * atoms) - np.sum(white ** 2, 1)[:, None] / (2 * atoms)
    return "token" if float(logsumexp(terms, axis=1).sum()) > coordinate else "coordinate"


def _digits(x: np.ndarray) -> list[float]:
    """Values rounded to 7 significant digits (a spec's size; float32 captures hold no more)."""
    return [float(f"{v:.7g}") for v in x]


def _fit_part(cap: Capture, fit_fraction: float) -> slice:
    split = int(cap.n_tokens * fit_fraction)
    if split < 8 * cap.dim:
        raise ValueError(f"{cap.path}: fit_fraction {fit_fraction} leaves {split} tokens to fit on; "
                         f"{8 * cap.dim} (8 d) at least are needed for a stable covariance")
    return slice(0, split)


def layer_statistics(k: np.ndarray, v: np.ndarray, q: np.ndarray, k_pre: np.ndarray | None,
                     dofs: list[float | None]) -> dict:
    """Readable statistics of one layer, means over its key/value heads (per head where noted):
    k, v (Hkv, n, d) as the cache stores them, q (Hq, n, d), dofs: the spec's per query head."""
    def mean_of(fn, xs):
        return float(np.mean([fn(x) for x in xs]))

    def kurtosis(x):
        c = x - x.mean(0)
        return float(np.mean(np.mean(c ** 4, 0) / np.mean(c ** 2, 0) ** 2 - 3))

    def outliers(x):
        std = x.std(0)
        return int(np.sum(std > 3 * np.median(std)))

    def mean_share(x):
        return float(np.sum(x.mean(0) ** 2) / np.mean(np.sum(x ** 2, -1)))

    stats = {
        "k_participation_ratio": mean_of(lambda x: participation_ratio(spectrum(x)), k),
        "v_participation_ratio": mean_of(lambda x: participation_ratio(spectrum(x)), v),
        "k_decay_alpha": mean_of(lambda x: decay_alpha(spectrum(x)), k),
        "v_decay_alpha": mean_of(lambda x: decay_alpha(spectrum(x)), v),
        "k_excess_kurtosis": mean_of(kurtosis, k),
        "v_excess_kurtosis": mean_of(kurtosis, v),
        "dof_per_head": dofs,
        "k_outlier_channels": mean_of(outliers, k),
        "k_channel_std_max_over_median": mean_of(lambda x: float(x.std(0).max() / np.median(x.std(0))), k),
        "k_mean_share": mean_of(mean_share, k),
        "v_mean_share": mean_of(mean_share, v),
        "q_mean_share": mean_of(mean_share, q),
        "kv_alignment": float(np.mean([alignment(a, b) for a, b in zip(k, v)])),
    }
    if k_pre is not None:
        stats["keys_pr_pre_rope"] = flat_pr(k_pre)
        stats["keys_pr_post_rope"] = flat_pr(k)
    return stats


def fit_capture(cap: Capture, *, fit_fraction: float = 0.5, progress=None) -> dict:
    """The spec (a JSON-ready dict, format scenarios.fitted.FORMAT) of every layer of the capture."""
    if not 0 < fit_fraction <= 1:
        raise ValueError(f"fit_fraction {fit_fraction} must lie in (0, 1]")
    part = _fit_part(cap, fit_fraction)
    rope = rope_from_capture(cap)
    families = family_features(cap.n_kv_heads, cap.dim, part.stop)
    out_layers = []
    for layer in range(cap.n_layers):
        k_pre = cap.k[layer, :, part].astype(np.float64)
        v = cap.v[layer, :, part].astype(np.float64)
        q_pre = cap.q[layer, :, part].astype(np.float64)
        k_cache = cap.k_rope[layer, :, part].astype(np.float64) if rope is not None else k_pre
        q_cache = cap.q_rope[layer, :, part].astype(np.float64) if rope is not None else q_pre
        heads, dofs, spreads = [], [], []
        for qh in range(cap.q.shape[1]):
            kv = qh // cap.group_size
            joint = np.hstack((k_pre[kv], v[kv], q_pre[qh]))
            profile = position_profile(joint, cap.positions[part], cap.segments[part])
            if profile is not None:   # the rest of the law is that of the tokens around their position's mean
                joint = joint - position_deviation(cap.positions[part], profile)
            white = whitened(joint)
            dof = fit_dof(white)
            scale2 = scale2_quantiles(white)
            head = {"query_head": qh, "kv_head": kv, "mean": _digits(joint.mean(0)),
                    "cov": _digits(np.asarray(tril(np.cov(joint, rowvar=False)))), "dof": dof,
                    "scale2_quantiles": _digits(scale2), "tail": tail_law(white, dof, scale2)}
            fitted = transition(joint, cap.segments[part], head_model(head))
            head["transition"] = None if fitted is None else _digits(fitted.ravel())
            if profile is not None:
                head["position_mean"] = {"length": profile[0], "coefficients": _digits(profile[1].ravel())}
            heads.append(head)
            dofs.append(dof)
            spreads.append(norm_overdispersion(white))
        feats = features(k_cache, v, k_pre if rope is not None else None)
        distances = family_distances(feats, families)
        closest = min(distances, key=distances.get)
        statistics = layer_statistics(k_cache, v, q_cache, k_pre if rope is not None else None, dofs)
        statistics["token_norm_overdispersion"] = float(np.mean(spreads))
        statistics["structure"] = segment_statistics(k_cache, v, q_cache, cap.positions[part], cap.segments[part],
                                                     causal=cap.metadata.get("kind", "").startswith("decoder"))
        out_layers.append({"layer": layer, "statistics": statistics,
                           "features": feats, "family": {"closest": closest, "distance": distances[closest],
                                                         "distances": distances},
                           "heads": heads})
        if progress:
            progress(layer)
    meta = cap.metadata
    return {"format": FORMAT, "capture": str(Path(cap.path)),
            "model": meta.get("model", ""), "model_sha256": meta.get("model_sha256", ""),
            "text_sha256": meta.get("text_sha256", ""), "n_tokens": cap.n_tokens, "fit_tokens": part.stop,
            "fit_fraction": fit_fraction,
            "head_dim": cap.dim, "heads": int(cap.q.shape[1]), "kv_heads": cap.n_kv_heads,
            "rope": None if rope is None else {"inv_freq": rope[0].tolist(), "scaling": rope[1]},
            "features": FEATURES, "distance": "root-mean-square difference of the features (each in [0, 1])",
            "family_features": families, "layers": out_layers}
