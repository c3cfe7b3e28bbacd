"""TurboQuant's fused CPU passes (schemes/turboquant_cpu.py) against a torch reference written
out here step by step (unit rows, the torch butterflies, bucketize, pack_bits, the QJL sketch and
correction) and against the codec's chain of passes: the same bits, no rounding bound needed."""
import math
import platform

import pytest
import torch
from hypothesis import given, settings, strategies as st

import schemes
from harness import bench
from kvcommon import vector_norm_cpu
from schemes import turboquant_cpu
from schemes.hadamard import fwht_butterfly
from schemes.lloyd_max import beta_codebook
from schemes.packing import pack_bits, unpack_codes
from schemes.unit_rows import unit_rows

DTYPES = (torch.float32, torch.float64)


def _cache(shape, dtype, seed, special=True):
    """Gaussian rows of scales 1e-20..1e20, with (where there is room) a zero row, a row holding
    NaN, one holding +inf, a constant row and a row of one large entry."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    x *= 10.0 ** (torch.rand(*shape[:-1], 1, generator=g, dtype=torch.float64) * 40 - 20)
    x = x.to(dtype)
    rows = x.view(-1, shape[-1])
    if special and rows.shape[0] >= 6:
        rows[0] = 0
        rows[1, 1] = float("nan")
        rows[2, 0] = float("inf")
        rows[3] = 0.5
        rows[4] = 0
        rows[4, -1] = 3e30 if dtype == torch.float32 else 3e300
        rows[5] *= 1e-30                                   # float32: subnormal entries
    return x


def _same(a, b) -> bool:
    """a and b hold the same bits (any NaN as one NaN; -0 ≠ +0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    as_int = {torch.float32: torch.int32, torch.float64: torch.int64}[a.dtype]
    nan = torch.tensor(float("nan"), dtype=a.dtype)
    return torch.equal(torch.where(a.isnan(), nan, a).view(as_int), torch.where(b.isnan(), nan, b).view(as_int))


def _signs(enc, name, d, dtype):
    return unpack_codes(enc.codes[name], 1, d).to(dtype) * 2 - 1


def _reference_entries(x, enc, width, sketched):
    """TurboQuant's entries of x by whole-tensor torch passes (the chain's arithmetic, without
    the compiled loops), from the rotation and sketch signs stored in enc."""
    d = x.shape[-1]
    u, norms = unit_rows(x.clone())
    rot = _signs(enc, "k.rotation_signs", d, x.dtype).unsqueeze(-2)
    y = fwht_butterfly(u * rot)
    out = {"k.norm": norms.to(torch.float32)}
    e = y
    if width >= 1:
        book = beta_codebook(d, width)
        codes = torch.bucketize(y, torch.tensor(book.thresholds, dtype=torch.float64).to(x.dtype))
        out["k.codes"] = pack_bits(codes.to(torch.uint8), width)
        e = y - torch.tensor(book.centroids, dtype=torch.float64).to(x.dtype)[codes]
    if sketched:
        out["k.residual_norm"] = torch.linalg.vector_norm(e, dim=-1).to(torch.float32)
        sk = _signs(enc, "k.sketch_signs", d, x.dtype).unsqueeze(-2)
        out["k.sketch"] = pack_bits((fwht_butterfly(e * sk) * math.sqrt(d) >= 0).to(torch.uint8), 1)
    return out


def _reference_decode(enc, d, dtype, width, sketched):
    """decode(K) by torch passes from enc's entries."""
    y = torch.zeros(*enc.codes["k.norm"].shape, d, dtype=dtype)
    if width >= 1:
        c = enc.side[f"codebook.{width}bit"].to(dtype)
        y = c[unpack_codes(enc.codes["k.codes"], width, d).to(torch.int64)]
    if sketched:
        sk = _signs(enc, "k.sketch_signs", d, dtype).unsqueeze(-2)
        r = enc.codes["k.residual_norm"].to(dtype).unsqueeze(-1)
        y = y + math.sqrt(math.pi / 2) / d * r * (fwht_butterfly(_signs(enc, "k.sketch", d, dtype)) * math.sqrt(d) * sk)
    rot = _signs(enc, "k.rotation_signs", d, dtype).unsqueeze(-2)
    return fwht_butterfly(y) * rot * enc.codes["k.norm"].to(dtype).unsqueeze(-1)


def _coded(name, budget, x, fused: bool, monkeypatch):
    with monkeypatch.context() as m:
        if not fused:
            m.setattr(turboquant_cpu, "FUSED_DTYPES", ())
        calls = []
        original = turboquant_cpu.encode
        m.setattr(turboquant_cpu, "encode", lambda *a, **k: calls.append(1) or original(*a, **k))
        s = schemes.create(name, budget=budget, dim=x.shape[-1], seed=11)
        k, v = bench._unremembered({"k": x, "v": x.flip(2)}).values()     # fresh tensors: no memo serves this call
        enc = s.encode(k, v)
        k_hat, v_hat = s.decode(enc)
        assert bool(calls) == fused                              # the path asked for is the path taken
    return enc, k_hat, v_hat


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [8, 16, 64, 128, 256, 1024])
def test_the_norm_order_is_found_where_torch_sums_in_vectors(dim, dtype):
    """On x86 torch builds (32-byte vectors: 8 float32 / 4 float64 lanes, or 64-byte: 16 / 8) an
    order of norm_order reproduces vector_norm for every power of two d the codec meets in
    practice, so the fused passes are taken (the equality tests below are not vacuous)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the vector widths of other CPUs' torch builds are not listed here")
    assert turboquant_cpu.takes(dim, dtype)
    lanes, _ = vector_norm_cpu.norm_order(dtype, dim)
    assert lanes * torch.empty(0, dtype=dtype).element_size() in (32, 64)


@settings(max_examples=20, deadline=None)
@given(name=st.sampled_from(["tq-kv", "tq-qkv", "tq-kqv"]), budget=st.integers(1, 8),
       log_dim=st.integers(1, 8), n_trials=st.integers(1, 3), n_heads=st.integers(1, 2),
       n_tokens=st.integers(1, 40), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2 ** 16))
def test_fused_passes_give_the_bits_of_the_torch_reference_and_of_the_chain(
        name, budget, log_dim, n_trials, n_heads, n_tokens, dtype, seed):
    """Every stored entry of the fused encode equals the torch reference's bit for bit (norms,
    packed codes, residual norms, sketch bits), decode equals the reference decode of those
    entries, and both equal the codec's chain of passes (turboquant_cpu.FUSED_DTYPES emptied):
    widths 1–8 (0–7 MSE bits under a sketch), d = 2..256, rows of scales 1e-20..1e20 with zero,
    constant, NaN, inf, huge and subnormal rows."""
    d = 2 ** log_dim
    x = _cache((n_trials, n_heads, n_tokens, d), dtype, seed)
    with pytest.MonkeyPatch.context() as mp:
        fused = turboquant_cpu.takes(d, dtype)
        enc, k_hat, v_hat = _coded(name, budget, x, fused, mp)
        chain, k_chain, v_chain = _coded(name, budget, x, False, mp)
    sketched = name == "tq-qkv"
    width = budget - 1 if sketched else budget
    for key, want in _reference_entries(x, enc, width, sketched).items():
        assert _same(enc.codes[key], want.view(enc.codes[key].shape)), key
    assert list(enc.codes) == list(chain.codes) and enc.model == chain.model
    for key in chain.codes:
        assert _same(enc.codes[key], chain.codes[key]), key
    for key in chain.side:
        assert _same(enc.side[key], chain.side[key]), key
    assert _same(k_hat, _reference_decode(enc, d, dtype, width, sketched))
    assert _same(k_hat, k_chain) and _same(v_hat, v_chain)


@pytest.mark.parametrize("paired", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [8, 16, 32, 64, 128, 256, 512])
def test_every_row_length_of_the_register_pass_gives_the_chains_bits(dim, dtype, paired):
    """The lengths the encode holds a row in registers for (float32 with vector_norm's 8 lanes,
    d = 8..256) and the first one past them, at 1-bit codes, at searched widths (single rows: 2, 3, 5 bits;
    7 and 8 with AVX-512, 6 without, scalar_quantizer_cpu.SEARCHED_WIDTHS; 7, 8 and 6 folded) and,
    without AVX-512, grid widths (7 and 8 bits), with and without a sketch, on the
    special rows and rows of scales 1e-20..1e20: the chain's bits, with rows two at a time side
    by side and one at a time whatever this CPU's registers hold (paired_rows). Paired,
    25 tokens a head puts pairs across heads' (and trials') sign rows, 3 × 7 tokens an odd row
    count (a last row alone)."""
    for shape in ((2, 2, 25, dim), (1, 3, 7, dim)):
        x = _cache(shape, dtype, seed=dim)
        for name, budget in (("tq-kv", 1), ("tq-kv", 2), ("tq-kv", 3), ("tq-kv", 5), ("tq-kv", 6), ("tq-kv", 7), ("tq-kv", 8), ("tq-qkv", 4)):
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(turboquant_cpu, "paired_rows", lambda d, itemsize: paired)
                enc, k_hat, v_hat = _coded(name, budget, x, True, mp)
                chain, k_chain, v_chain = _coded(name, budget, x, False, mp)
            for key in chain.codes:
                assert _same(enc.codes[key], chain.codes[key]), (shape, name, budget, key)
            assert _same(k_hat, k_chain) and _same(v_hat, v_chain), (shape, name, budget)


@pytest.mark.parametrize("name", ["tq-kv", "tq-qkv"])
def test_rows_split_across_threads_give_the_same_bits(name, monkeypatch):
    """A call of ≥ 64 k elements splits its rows into one block per torch thread; the result is
    the one-thread result and the chain's."""
    x = _cache((3, 2, 200, 128), torch.float32, 5)
    with monkeypatch.context() as m:
        m.setattr(torch, "get_num_threads", lambda: 1)
        one, k_one, _ = _coded(name, 3, x, True, m)
    with monkeypatch.context() as m:
        m.setattr(torch, "get_num_threads", lambda: 3)
        split, k_split, _ = _coded(name, 3, x, True, m)
    chain, k_chain, _ = _coded(name, 3, x, False, monkeypatch)
    for key in chain.codes:
        assert _same(one.codes[key], split.codes[key]) and _same(split.codes[key], chain.codes[key]), key
    assert _same(k_one, k_split) and _same(k_split, k_chain)


def test_chain_where_no_norm_order_reproduces_torch(monkeypatch):
    """Where no candidate order gives vector_norm's bits, takes() is False and the codec codes by
    its chain of passes (the same entries as ever)."""
    monkeypatch.setattr(vector_norm_cpu, "_NORM_ORDERS", ((3, False),))
    vector_norm_cpu.norm_order.cache_clear()
    try:
        assert vector_norm_cpu.norm_order(torch.float32, 64) is None and not turboquant_cpu.takes(64, torch.float32)
        x = _cache((2, 1, 9, 64), torch.float32, 1)
        _coded("tq-kv", 2, x, False, monkeypatch)
    finally:
        vector_norm_cpu.norm_order.cache_clear()


def test_the_torch_passes_when_the_compiled_loops_are_off(monkeypatch):
    """Emptying compiled.DTYPES (the switch to every codec's torch passes) turns the fused
    passes off too."""
    from kvcommon import compiled
    monkeypatch.setattr(compiled, "DTYPES", ())
    assert not turboquant_cpu.takes(64, torch.float32)
    calls = []
    monkeypatch.setattr(turboquant_cpu, "encode", lambda *a, **k: calls.append(a))
    s = schemes.create("tq-kv", budget=2, dim=64)
    s.decode(s.encode(*bench._unremembered({"k": _cache((1, 1, 8, 64), torch.float32, 4),
                                            "v": _cache((1, 1, 8, 64), torch.float32, 5)}).values()))
    assert not calls


@pytest.mark.parametrize("name", ["tq-fkv", "plain-kv"])
def test_full_sketches_and_unrotated_variants_keep_the_chain(name, monkeypatch):
    """The fused passes code rotated tensors with no sketch or an RHT one; a FULL sketch and
    plain-kv go through the chain."""
    x = _cache((1, 1, 8, 32), torch.float32, 2)
    calls = []
    monkeypatch.setattr(turboquant_cpu, "encode", lambda *a, **k: calls.append(a) or None)
    s = schemes.create(name, budget=2, dim=32, seed=1)
    if name == "plain-kv":
        s.decode(s.encode(x, x))
        assert not calls
    else:
        with pytest.raises(TypeError):                      # V (no sketch) takes the fused pass
            s.encode(x, x)
        assert len(calls) == 1


def test_the_dense_rotation_reference_runs_the_chain(monkeypatch):
    """harness.bench's dense-rotation reference swaps turboquant's rht and rht_inverse; the fused
    passes (which are the Hadamard rotation) then stand aside, so the reference is timed as it
    was, and its decode is the dense rotation's (≠ the Hadamard codec's)."""
    x = bench._unremembered({"k": _cache((1, 1, 16, 64), torch.float32, 3, special=False)})["k"]   # no memo serves
    calls = []
    original = turboquant_cpu.encode
    monkeypatch.setattr(turboquant_cpu, "encode", lambda *a, **k: calls.append(1) or original(*a, **k))
    s = schemes.create("tq-kv", budget=3, dim=64)
    k_fused, _ = s.decode(s.encode(x, x))
    assert calls
    calls.clear()
    with bench._dense_rotation(64, torch.device("cpu")):
        k_dense, _ = s.decode(s.encode(x, x))
    assert not calls and not torch.equal(k_fused, k_dense)
    assert torch.allclose(k_dense, x, atol=0.5 * float(x.abs().max()))   # still a 3-bit reconstruction
