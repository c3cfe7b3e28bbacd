"""Shard and its building blocks: RoPE, rope_lowrank, DP allocation, k-means VQ, decode drift."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

import scenarios
import schemes
from scenarios.base import TrialShape
from scenarios.rope_lowrank import components_for_energy, singular_value_decay
from schemes.kmeans import assign, kmeans
from kvcommon.rng import generator
from kvcommon.rope import apply_rope, undo_rope
from schemes.packing import pack_mixed, unpack_mixed
from schemes.bit_allocation import BIT_CHOICES, allocate_bits, brute_force_allocation, group_error
from schemes.clipping import coefficient_scales, quantize_symmetric
from schemes.svd import randomized_svd


def _gauss(shape, seed=0, dtype=torch.float64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _rope_lowrank(h, s, d, seed=0, n_queries=8):
    sc = scenarios.create("rope_lowrank")
    out = sc.draw(lambda *l: generator("pcg64", seed, "test", *l), TrialShape(h, s, n_queries, d, 16))
    return sc, {k: torch.from_numpy(v) for k, v in out.items()}


# --- RoPE -----------------------------------------------------------------------------------
def _rope_reference(x: np.ndarray, p: int, base=10000.0) -> np.ndarray:
    """Independent form: channel pair (i, i + d/2) is a complex number rotated by e^{i·θ_i·p}."""
    half = x.shape[-1] // 2
    theta = base ** (-2 * np.arange(half) / x.shape[-1])
    z = (x[..., :half] + 1j * x[..., half:]) * np.exp(1j * theta * p)
    return np.concatenate((z.real, z.imag), -1)


@given(st.lists(st.integers(0, 100_000), min_size=1, max_size=6), st.sampled_from([2, 8, 64, 128]))
def test_rope_matches_complex_reference_and_round_trips(positions, d):
    x = _gauss((2, len(positions), d))
    pos = torch.tensor(positions)
    y = apply_rope(x, pos)
    ref = np.stack([_rope_reference(x[:, i].numpy(), p) for i, p in enumerate(positions)], 1)
    assert np.allclose(y.numpy(), ref, atol=1e-9)
    assert torch.allclose(undo_rope(y, pos), x, atol=1e-12, rtol=0)


@given(st.integers(0, 5000), st.integers(0, 5000), st.integers(0, 5000))
def test_rope_dot_product_depends_on_relative_position_only(m, n, t):
    q, k = _gauss((1, 64), 1), _gauss((1, 64), 2)
    a = apply_rope(q, torch.tensor([m])) @ apply_rope(k, torch.tensor([n])).T
    b = apply_rope(q, torch.tensor([m + t])) @ apply_rope(k, torch.tensor([n + t])).T
    assert torch.allclose(a, b, atol=1e-9)


def test_rope_rejects_odd_dim():
    with pytest.raises(ValueError, match="even"):
        apply_rope(torch.zeros(1, 3), torch.tensor([0]))


# --- rope_lowrank -------------------------------------------------------------------------------
def test_rope_lowrank_spectrum_sharp_when_undone_slow_when_applied():
    sc, out = _rope_lowrank(h=2, s=1024, d=64)
    r = sc.rank(2, 64)                                                   # 24 of 128
    decay = singular_value_decay(out["k"].numpy(), out["positions"].numpy())
    undone, applied = (components_for_energy(decay[k]) for k in ("rope_undone", "rope_applied"))
    assert undone <= r + 1                          # the planted rank holds 99.5% of the energy
    assert applied >= 3 * r                         # RoPE spreads it over many more components
    assert decay["rope_undone"][r] < 0.1 * decay["rope_undone"][r - 1]  # a sharp knee at r
    assert np.mean(np.sum(out["k"].numpy() ** 2, -1)) == pytest.approx(64, rel=0.1)
    assert torch.equal(out["positions"], torch.arange(1024))


# --- DP bit allocation --------------------------------------------------------------------------
@given(st.lists(st.floats(1e-4, 1e3), min_size=1, max_size=4), st.integers(0, 8),
       st.sampled_from([1.0, 4.0, 100.0]))
def test_dp_allocation_matches_brute_force(variances, budget_per_component, penalty):
    sizes = [64] * (len(variances) - 1) + [37]
    budget = budget_per_component * sum(sizes)
    alloc = allocate_bits(variances, sizes, budget, drop_penalty=penalty)
    assert sum(s * b for s, b in zip(sizes, alloc)) <= budget
    assert all(b in BIT_CHOICES for b in alloc)
    err = sum(group_error(v, b, penalty) for v, b in zip(variances, alloc))
    assert err == pytest.approx(brute_force_allocation(variances, sizes, budget, drop_penalty=penalty), rel=1e-12)


def test_drop_penalty_steers_bits_away_from_dropping():
    # one group of variance 1 and one of 0.2; 4 bits a component on average for two groups
    sizes, budget = [64, 64], 4 * 128
    assert allocate_bits([1.0, 0.2], sizes, budget, drop_penalty=4.0) == (4, 4)
    # a small group (variance 5e-5): by plain MSE dropping it for 8 bits on the big one wins
    # (5.1e-6 + 5e-5 < 8.1e-5 + 1.0e-6); with the 4x drop penalty keeping it at 2 bits wins
    # (4·5e-5 + 5.1e-6 > 8.2e-5) — the write-up's fix (§5)
    assert allocate_bits([1.0, 5e-5], sizes, budget, drop_penalty=1.0) == (8, 0)
    assert allocate_bits([1.0, 5e-5], sizes, budget, drop_penalty=4.0) == (6, 2)


@given(st.lists(st.sampled_from(BIT_CHOICES), min_size=1, max_size=5), st.integers(1, 6))
def test_mixed_width_packing_round_trips(alloc, n):
    widths = [[b for b in alloc for _ in range(3)], [b for b in reversed(alloc) for _ in range(3)]]
    gen = np.random.default_rng(len(alloc) * 7 + n)
    codes = [torch.tensor(np.stack([gen.integers(0, 1 << w, size=n) if w else np.zeros(n, int) for w in ws], 1))
             for ws in widths]
    packed = pack_mixed(codes, widths)
    assert packed.shape[-1] == math.ceil(sum(alloc) * 3 / 8)             # 2-bit digits, 4 a byte
    for a, b in zip(unpack_mixed(packed, widths), codes):
        assert torch.equal(a, b.to(torch.int64))


# --- k-means VQ ----------------------------------------------------------------------------------
def test_kmeans_objective_decreases_and_assignment_is_brute_force():
    pts = _gauss((2, 600, 4), 3, torch.float32)
    fit = kmeans(pts, 16, gen=generator("pcg64", 0, "km"), n_iter=30)
    obj = fit.objective
    assert (obj[:, 1:] <= obj[:, :-1] * (1 + 1e-6)).all()
    assert (obj[:, -1] < 0.9 * obj[:, 0]).all()                            # Lloyd improves on k-means++
    idx, d2 = assign(pts, fit.centroids)
    brute = ((pts[:, :, None, :] - fit.centroids[:, None, :, :]) ** 2).sum(-1)
    assert torch.allclose(d2, brute.amin(-1), rtol=1e-5, atol=1e-6)
    assert torch.allclose(d2.mean(-1), obj[:, -1], rtol=1e-5)
    # deterministic under a seed, different under another, and per-problem (batch-independent)
    again = kmeans(pts, 16, gen=generator("pcg64", 0, "km"), n_iter=30)
    other = kmeans(pts, 16, gen=generator("pcg64", 1, "km"), n_iter=30)
    alone = kmeans(pts[1:], 16, gen=generator("pcg64", 0, "km"), n_iter=30)
    assert torch.equal(again.centroids, fit.centroids) and not torch.equal(other.centroids, fit.centroids)
    assert torch.equal(alone.centroids[0], fit.centroids[1])


def test_assign_breaks_ties_to_the_first_centroid():
    """Points equidistant from several centroids (small integers: exact in float32) take the
    lowest index among them, as argmin does."""
    gen = np.random.default_rng(5)
    pts = torch.from_numpy(gen.integers(-2, 3, size=(3, 500, 4))).float()
    cents = torch.from_numpy(gen.integers(-2, 3, size=(3, 40, 4))).float()
    idx, d2 = assign(pts, cents)
    brute = ((pts[:, :, None, :] - cents[:, None, :, :]) ** 2).sum(-1)
    ties = (brute == brute.amin(-1, keepdim=True)).sum(-1) > 1
    assert ties.float().mean() > 0.2
    assert torch.equal(idx, brute.argmin(-1)) and torch.equal(d2, brute.amin(-1))


def test_kmeans_on_duplicates_and_random_init():
    pts = torch.zeros(1, 50, 4)
    fit = kmeans(pts, 8, gen=generator("pcg64", 0), n_iter=5, init="random")
    assert torch.equal(fit.centroids, torch.zeros(1, 8, 4))
    with pytest.raises(ValueError, match="valid"):
        kmeans(pts, 8, gen=generator("pcg64", 0), init="nope")


# --- randomized SVD ------------------------------------------------------------------------------
def test_randomized_svd_recovers_the_top_subspace():
    gen = np.random.default_rng(0)
    u = np.linalg.qr(gen.standard_normal((96, 6)))[0]
    x = torch.from_numpy(gen.standard_normal((1, 400, 6)) * [10, 8, 6, 4, 3, 2] @ u.T
                         + 0.01 * gen.standard_normal((1, 400, 96)))
    omega = torch.from_numpy(gen.standard_normal((96, 10)))
    basis, sv = randomized_svd(x, 6, 4, omega)
    ref = np.linalg.svd(x[0].numpy(), compute_uv=False)[:6]
    assert np.allclose(sv[0].numpy(), ref, rtol=1e-6)
    assert np.allclose(np.linalg.svd(basis[0].numpy().T @ u, compute_uv=False), 1, atol=1e-4)


# --- Shard ------------------------------------------------------------------------------------
def test_shard_keeps_sinks_and_window_bit_exact_and_handles_constant_data():
    k, v = _gauss((2, 2, 200, 16), 0, torch.float32), _gauss((2, 2, 200, 16), 1, torch.float32)
    scheme = schemes.create("shard", budget=4, dim=16)
    k_hat, v_hat = scheme.decode(scheme.encode(k, v))
    for x, x_hat in ((k, k_hat), (v, v_hat)):
        assert torch.equal(x_hat[:, :, :4], x[:, :, :4].half().float())
        assert torch.equal(x_hat[:, :, -64:], x[:, :, -64:].half().float())
    for value in (0.0, 0.3, 1e30, 1e-30):
        x = torch.full((1, 2, 100, 16), value)
        k_hat, v_hat = scheme.decode(scheme.encode(x, x))
        assert torch.isfinite(k_hat).all() and torch.isfinite(v_hat).all()
        assert torch.allclose(v_hat, x, rtol=2e-3)          # a constant V is one VQ centroid
        # constant keys are not constant once RoPE is undone: the K path is lossy on them
        if value == 0:
            assert torch.equal(k_hat, x) and torch.equal(v_hat, x)
        else:
            assert float(((k_hat / value - 1) ** 2).mean()) < 0.02


def test_shard_middle_is_trial_order_invariant_and_seeded():
    k, v = _gauss((3, 2, 150, 16), 0), _gauss((3, 2, 150, 16), 1)
    scheme = schemes.create("shard", budget=3, dim=16, seed=5)
    k_hat, v_hat = scheme.decode(scheme.encode(k, v))
    perm = torch.tensor([2, 0, 1])
    k_p, v_p = scheme.decode(scheme.encode(k[perm], v[perm]))
    assert torch.allclose(k_p, k_hat[perm], atol=1e-9) and torch.allclose(v_p, v_hat[perm], atol=1e-9)
    enc_a, enc_b = scheme.encode(k, v), schemes.create("shard", budget=3, dim=16, seed=5).encode(k, v)
    assert all(torch.equal(enc_a.codes[key], enc_b.codes[key]) for key in enc_a.codes)


def test_shard_codes_v_alike_at_every_budget_and_seed_with_one_kmeans_per_cache(monkeypatch):
    """V's VQ is a function of the cache alone: every budget, scheme seed and both variants store
    the same V codes (common random numbers across the cells of a sweep), computed by one k-means
    for the very tensor v; an equal copy of v is coded anew, to the same codes."""
    import schemes.shard as shard_module
    k, v = _gauss((2, 2, 150, 16), 0, torch.float32), _gauss((2, 2, 150, 16), 1, torch.float32)
    calls = []
    real = shard_module.kmeans
    monkeypatch.setattr(shard_module, "kmeans", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    encs = [schemes.create(name, budget=b, dim=16, seed=seed).encode(k, v)
            for name in ("shard", "shard-pca-decode") for b in (2, 4) for seed in (0, 7)]
    v_keys = [key for key in encs[0].codes if key.startswith("v.") and key not in ("v.sinks", "v.window")]
    assert len(calls) == 1 and {"v.index", "v.centroids"} <= set(v_keys)
    assert all(torch.equal(e.codes[key], encs[0].codes[key]) for e in encs[1:] for key in v_keys)
    assert not torch.equal(encs[0].codes["k.coeff_scale"], encs[2].codes["k.coeff_scale"])   # K differs by budget
    again = schemes.create("shard", budget=3, dim=16).encode(k, v.clone())
    assert len(calls) == 2 and all(torch.equal(again.codes[key], encs[0].codes[key]) for key in v_keys)


def _shard_ledger_prediction(h, s, d, r, budget, n_sinks=4, window=64):
    """Bits per trial from the write-up's storage formula (§5: rank·b coefficient bits a token,
    fp16 scales, int8 basis; §6: 8-bit VQ indices per 4 channels, fp16 centroids and channel
    max) plus fp16 sinks/window and the int16 shifts; written out independently of the code.
    One uint8 allocation per DP group of min(64, r // 2) components."""
    n_mid, total = s - n_sinks - window, h * d
    coeff = n_mid * math.ceil(r * budget / 8) * 8
    n_groups = math.ceil(r / max(1, min(64, r // 2)))
    k_side = total * 16 + total * r * 8 + r * 16 + r * 16 + n_groups * 8 + 16
    v_mid = n_mid * h * (d // 4) * 8 + 256 * 4 * 16 + total * 16 + 16
    exact = 2 * (n_sinks + window) * total * 16 + 4 * 16
    return coeff + k_side + v_mid + exact


def test_shard_on_rope_lowrank_ledger_errors_and_what_undoing_rope_buys():
    h, s, d, budget = 2, 512, 32, 4
    sc, out = _rope_lowrank(h, s, d)
    k, v = out["k"][None].float(), out["v"][None].float()
    scheme = schemes.create("shard", budget=budget, dim=d, rank=24, n_iter=8, kmeans_iter=10)
    enc = scheme.encode(k, v, positions=out["positions"])
    assert "positions" not in enc.codes                                   # 0..S−1 is implied, not stored
    ledger = scheme.bits(enc)
    assert ledger.total == _shard_ledger_prediction(h, s, d, 24, budget)
    k_hat, v_hat = scheme.decode(enc)
    rel = lambda x, y: float(((x - y) ** 2).sum() / (x ** 2).sum())
    # K middle error: at least the energy beyond rank 24 of the RoPE-free, centred keys
    # (Eckart–Young, numpy's SVD), at most that plus the Δ²/12 of a max-abs int4 quantiser of
    # the true coefficients (the clipped step only lowers it)
    mid = slice(4, s - 64)
    flat = undo_rope(k[0, :, mid].double(), out["positions"][mid]).transpose(0, 1).reshape(s - 68, -1).numpy()
    u, sv, _ = np.linalg.svd(flat - flat.mean(0), full_matrices=False)
    max_abs_step = np.abs(u[:, :24] * sv[:24]).max(0) / 7
    tail = np.sum(sv[24:] ** 2)
    measured = float(((k - k_hat)[0, :, mid].double() ** 2).sum())
    assert tail < measured <= (tail + (s - 68) * np.sum(max_abs_step ** 2 / 12)) * 1.05
    assert rel(k, k_hat) < 0.03
    assert 0.02 < rel(v, v_hat) < 0.2               # 2-bit VQ on flat Gaussian V
    no_undo = schemes.create("shard", budget=budget, dim=d, rank=24, n_iter=8, kmeans_iter=10, undo_rope=False)
    k_plain, _ = no_undo.decode(no_undo.encode(k, v))
    assert rel(k, k_plain) > 5 * rel(k, k_hat)      # RoPE hides the low rank (write-up §3)


def test_decode_tokens_no_drift_for_shard_but_drift_for_pca_decode():
    h, s, d, n_new = 2, 600, 32, 40
    sc, out = _rope_lowrank(h, s, d, seed=1)
    k, v = out["k"][None].float(), out["v"][None].float()
    # drifted decode tokens: keys from a fresh rank-r subspace (another population), values rescaled
    _, drift = _rope_lowrank(h, s + n_new, d, seed=2)
    same = sc.draw(lambda *l: generator("pcg64", 1, "test", *l), TrialShape(h, s + n_new, 8, d, 16))
    k_same, k_drift = (torch.from_numpy(x["k"][:, s:])[None].float() if isinstance(x["k"], np.ndarray)
                       else x["k"][:, s:][None].float() for x in (same, drift))
    v_same, v_drift = torch.from_numpy(same["v"][:, s:])[None].float(), 3 * drift["v"][:, s:][None].float()
    rel = lambda x, y: float(((x - y) ** 2).sum() / (x ** 2).sum())
    errors = {}
    for name in ("shard", "shard-pca-decode"):
        scheme = schemes.create(name, budget=4, dim=d, rank=32, n_iter=6, kmeans_iter=10)
        enc = scheme.encode(k, v)
        for label, kn, vn in (("same", k_same, v_same), ("drift", k_drift, v_drift)):
            dec = scheme.encode_decode_tokens(kn, vn, enc)
            k_hat, v_hat = scheme.decode_decode_tokens(dec, enc)
            assert k_hat.shape == kn.shape and v_hat.shape == vn.shape
            errors[name, label] = (rel(kn, k_hat), rel(vn, v_hat))
            # one token at a time gives the same codes as all at once for the data-independent path
            if name == "shard" and label == "drift":
                first = scheme.decode_decode_tokens(scheme.encode_decode_tokens(kn[:, :, :1], vn[:, :, :1], enc), enc)
                assert torch.allclose(first[0], k_hat[:, :, :1], atol=1e-6)
    shard_same, shard_drift = errors["shard", "same"], errors["shard", "drift"]
    pca_same, pca_drift = errors["shard-pca-decode", "same"], errors["shard-pca-decode", "drift"]
    assert shard_drift[0] < 1.5 * shard_same[0] and shard_drift[1] < 1.5 * shard_same[1]   # no drift
    assert pca_drift[0] > 10 * pca_same[0] and pca_drift[0] > 10 * shard_drift[0]          # K drifts
    assert pca_drift[1] > 3 * shard_drift[1]                                                # V clips


def test_clipped_coefficient_steps_beat_max_abs_on_gaussian_coefficients():
    c = _gauss((1, 4000, 3), 4)
    for width, bound in ((2, 0.25), (4, 0.02)):      # Gaussian midtread optimum: 0.19 (3 levels), 0.0095 (15)
        levels = torch.full((1, 3), float((1 << (width - 1)) - 1), dtype=torch.float64)
        scale = coefficient_scales(c, levels).double()
        err = float(((c - quantize_symmetric(c, scale, levels) * scale[:, None, :]) ** 2).mean())
        max_abs = c.abs().amax(1) / levels
        err_max_abs = float(((c - quantize_symmetric(c, max_abs, levels) * max_abs[:, None, :]) ** 2).mean())
        assert err < bound and err < err_max_abs


def test_shard_per_trial_bits_do_not_depend_on_the_batch():
    """Trials whose DP allocations differ pack coefficient rows of different lengths; each is
    charged its own length (Encoded.exact_bits), not the batch's longest. (Every budget's own
    cost b·r is reachable with equal groups, so a trial spends less only when more bits buy no
    modelled error: all-zero keys, whose components have variance 0 and get 0 bits.)"""
    from schemes.base import BitLedger
    g = torch.Generator().manual_seed(0)
    iso = torch.randn(1, 1, 150, 128, generator=g)
    k, v = torch.cat((iso, torch.zeros(1, 1, 150, 128))), torch.randn(2, 1, 150, 128, generator=g)
    s = schemes.create("shard", budget=5, dim=128)
    batched = BitLedger.per_trial_bits_per_element(s.encode(k, v))
    alone = [float(BitLedger.per_trial_bits_per_element(s.encode(k[i:i + 1], v[i:i + 1]))[0]) for i in range(2)]
    assert batched.tolist() == pytest.approx(alone, rel=1e-12)
    assert alone[0] != alone[1]          # the case that needs the per-trial count


def test_every_budget_has_its_own_allocation_at_one_head_of_64():
    """H = 1, d = 64: rank r = 64, two DP groups of 32, so the cost grid (steps of 64 bits) holds
    every budget's b·r exactly: the DP spends exactly b·64 bits per middle token, the measured
    bits per element rise by n_mid·64/(2·S·d) per budget step, and the K error does not grow
    (it falls: the allocation only adds bits). One group of 64 gave b = 3 the allocation of 2."""
    from schemes.base import BitLedger
    b, h, s, d = 2, 1, 256, 64
    k = _gauss((b, h, s, d), 11) * torch.arange(1, d + 1, dtype=torch.float64) ** -0.5
    v = _gauss((b, h, s, d), 12)
    n_mid = s - 4 - 64
    bits, errors = [], []
    for budget in range(1, 9):
        scheme = schemes.create("shard", budget=budget, dim=d)
        enc = scheme.encode(k, v)
        alloc = enc.codes["k.alloc"].tolist()
        assert all(32 * sum(row) == budget * 64 for row in alloc), (budget, alloc)
        bits.append(BitLedger.per_trial_bits_per_element(enc))
        k_hat, _ = scheme.decode(enc)
        errors.append(((k - k_hat) ** 2).sum(dim=(1, 2, 3)) / (k ** 2).sum(dim=(1, 2, 3)))
    step = n_mid * 64 / (2 * s * d)
    for lo, hi in zip(bits, bits[1:]):
        torch.testing.assert_close(hi - lo, torch.full((b,), step, dtype=torch.float64), rtol=1e-12, atol=0)
    for budget, (lo, hi) in enumerate(zip(errors, errors[1:]), start=1):
        assert (hi < lo).all(), f"K error does not fall from budget {budget} to {budget + 1}: {lo} -> {hi}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compiled_nearest_centroid_equals_torch_min(dtype):
    """kmeans_cpu.nearest_centroids gives (c² − 2·xc).min(-1).indices: the first of tied minima,
    the first NaN where a row has one, infinities as torch orders them; rows split across threads."""
    from schemes import kmeans_cpu
    gen = torch.Generator().manual_seed(3)
    cases = []
    for n in (5, 400):
        xc, c_sq = torch.randn(3, n, 256, generator=gen, dtype=dtype), torch.randn(3, 256, generator=gen, dtype=dtype)
        cases.append((xc, c_sq))
        cases.append((xc.round(), c_sq.round()))                                  # many ties
        nan = xc.clone()
        nan[0, 1, 17] = nan[1, 2, 0] = nan[1, 2, 9] = nan[2, 3, 255] = float("nan")
        cases.append((nan, c_sq))
        inf = xc.clone()
        inf[0] = float("inf")
        inf[1, :, 5] = float("-inf")
        cases.append((inf, c_sq))
    for xc, c_sq in cases:
        out = torch.empty(xc.shape[:2], dtype=torch.int64)
        kmeans_cpu.nearest_centroids(xc, c_sq, out)
        assert torch.equal(out, (c_sq[:, None, :] - 2 * xc).min(-1).indices)


def _fma_chain(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """x @ cᵀ (B, n, k) for float32 x (B, n, g), c (B, k, g) as the chain fma(x_g-1, c_g-1, …
    fma(x_1, c_1, x_0·c_0)), emulated in float64: the products are exact there and each step is
    rounded to float32 once (double rounding is off by one ulp only at a float32 midpoint)."""
    x, c = x.double(), c.double().transpose(1, 2)
    acc = (x[..., :1] @ c[:, :1]).float()
    for t in range(1, x.shape[-1]):
        acc = (x[..., t:t + 1] @ c[:, t:t + 1] + acc.double()).float()
    return acc


def test_compiled_nearest_point_pass_is_the_fma_chain_and_torch_min():
    """kmeans_cpu.nearest_points gives (c² − 2·x·c).min(-1).indices with each x·c the fma chain over
    the point's g coordinates in order (as an independent float64 emulation forms it), among many
    ties, duplicated centroids, NaN and infinite points, for point dimensions 1 to 8; rows split
    across threads."""
    from schemes import kmeans_cpu
    gen = torch.Generator().manual_seed(5)
    for g, k, n in ((1, 7, 50), (3, 256, 500), (4, 256, 4000), (8, 33, 300)):
        x = torch.randn(3, n, g, generator=gen) * torch.rand(3, n, 1, generator=gen) * 4
        c = torch.randn(3, k, g, generator=gen)
        nan, inf = x.clone(), x.clone()
        nan[0, 1, 0] = nan[2, 7, g - 1] = float("nan")
        inf[1, :3] = float("inf")
        inf[2, 4, 0] = float("-inf")
        for points, centroids in ((x, c), (x.round(), c.round()), (x, torch.cat((c[:, :5], c[:, :5]), 1)),
                                  (nan, c), (inf, c)):
            c_sq = (centroids ** 2).sum(-1)
            out = torch.empty(points.shape[:2], dtype=torch.int64)
            kmeans_cpu.nearest_points(points, centroids, c_sq, out)
            assert torch.equal(out, (c_sq[:, None, :] - 2 * _fma_chain(points, centroids)).min(-1).indices)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compiled_nearest_point_pass_equals_the_matmul_at_shards_shape(dtype):
    """At Shard's shape (g = 4, 256 centroids, points in multiples of 16) torch's CPU matmul (MKL)
    forms x·c by the same fma chain, so the compiled pass assigns as the matmul path did: Shard's
    rows did not change (main job: 300 rows identical)."""
    from schemes import kmeans_cpu
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(5, 30592, 4, generator=gen, dtype=dtype) * torch.rand(5, 30592, 1, generator=gen, dtype=dtype)
    c = torch.randn(5, 256, 4, generator=gen, dtype=dtype)
    c_sq = (c ** 2).sum(-1)
    out = torch.empty(x.shape[:2], dtype=torch.int64)
    kmeans_cpu.nearest_points(x, c, c_sq, out)
    assert torch.equal(out, (c_sq[:, None, :] - 2 * (x @ c.transpose(1, 2))).min(-1).indices)
    if dtype == torch.float32:
        assert torch.equal(x @ c.transpose(1, 2), _fma_chain(x, c))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compiled_kmeans_pp_seeding_picks_as_the_torch_passes(dtype, monkeypatch):
    """kmeans_cpu.kmeans_pp_picks picks the centres _init_kmeans_pp's torch passes pick, for point
    dimensions 1 to 4: on random points, on a problem of duplicates (ΣD² = 0: the uniform pick),
    with NaN and infinite points; rows split across threads."""
    from schemes import kmeans as kmeans_module
    gen = torch.Generator().manual_seed(7)
    uniforms = np.random.default_rng(8).random(64)
    for g in (1, 2, 3, 4):
        pts = torch.randn(4, 700, g, generator=gen, dtype=dtype)
        pts[1] = pts[1, :1]                                   # one point 700 times
        pts[2, 5, 0] = float("nan")
        pts[3, 9] = float("inf")
        fast = kmeans_module._init_kmeans_pp(pts, 64, uniforms)
        with monkeypatch.context() as m:
            m.setattr(kmeans_module, "compiled_loops", lambda points: None)
            slow = kmeans_module._init_kmeans_pp(pts, 64, uniforms)
        assert torch.equal(fast.isnan(), slow.isnan()) and torch.equal(fast.nan_to_num(), slow.nan_to_num())


def test_kmeans_same_with_the_compiled_assignment(monkeypatch):
    """k-means on the compiled nearest-centroid pass and on torch's gives the same centroids and objective."""
    from schemes import kmeans as kmeans_module
    pts = torch.randn(3, 3000, 4, generator=torch.Generator().manual_seed(4))
    fast = kmeans(pts, 256, gen=generator("pcg64", 0, "km"))
    monkeypatch.setattr(kmeans_module, "compiled_loops", lambda points: None)
    slow = kmeans(pts, 256, gen=generator("pcg64", 0, "km"))
    assert torch.equal(fast.centroids, slow.centroids) and torch.equal(fast.objective, slow.objective)
