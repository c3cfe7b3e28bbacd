"""The cells of a chunk code and decode a tensor once when their schemes code it alike
(PerTensorScheme.coding_key), with rows identical to coding it in every cell."""
import gc

import pandas as pd
import pytest
import torch

import schemes
from harness import bench
from harness import cell as engine
from harness.sweep import SweepConfig
from schemes import base
from schemes.spectralquant import SpectralQuant
from schemes.turboquant import TurboQuant

CONFIG = SweepConfig(scenarios=("heavy_tail",), schemes=("tq-kv", "tq-kqv", "tq-qkv", "sq-kv", "sq-kqv", "int4"),
                     budgets=(2, 3), dims=(32,), seq_lens=(64,), queries=(8,), trials=5, calib_tokens=(64,))


def _counting(monkeypatch, cls, method):
    calls = []
    real = getattr(cls, method)

    def counted(self, *args):
        calls.append((self.name, self.budget, next(a for a in args if isinstance(a, str))))
        return real(self, *args)
    monkeypatch.setattr(cls, method, counted)
    return calls


def _rows(todo):
    out = []
    engine.run_serial(CONFIG, todo, torch.device("cpu"), torch.float32, None, lambda c, r, w, p: out.extend(r))
    return pd.DataFrame(out).drop(columns=["wall_s", "peak_mem_mb"], errors="ignore").sort_values(
        ["scheme", "budget", "trial"], ignore_index=True)


def test_a_chunk_codes_each_tensor_once_per_distinct_coding(monkeypatch):
    # the check that a cell's first trial stands alone codes that trial again on new instances, on
    # purpose (harness.cell.check_sample, tests/test_integrity.py); counted here: the chunk's codings
    monkeypatch.setattr(engine, "check_sample", lambda *args, **kwargs: None)
    encodes = {cls: _counting(monkeypatch, cls, "encode_tensor") for cls in (TurboQuant, SpectralQuant)}
    decodes = {cls: _counting(monkeypatch, cls, "decode_tensor") for cls in (TurboQuant, SpectralQuant)}
    together = _rows(CONFIG.cells())
    # per budget: TurboQuant codes K plain (tq-kv, tq-kqv) and sketched (tq-qkv), V plain (tq-kv,
    # tq-qkv) and sketched (tq-kqv): 4 codings, not 6; SpectralQuant K once, V twice: 3, not 4
    assert len(encodes[TurboQuant]) == len(decodes[TurboQuant]) == 2 * 4
    assert len(encodes[SpectralQuant]) == len(decodes[SpectralQuant]) == 2 * 3
    for calls in encodes.values():
        calls.clear()
    apart = pd.concat([_rows([cell]) for cell in CONFIG.cells()]).sort_values(["scheme", "budget", "trial"],
                                                                            ignore_index=True)
    assert len(encodes[TurboQuant]) == 2 * 6 and len(encodes[SpectralQuant]) == 2 * 4   # one cell: nothing shared
    pd.testing.assert_frame_equal(together, apart, check_exact=True)


@pytest.mark.parametrize("name", ["sq-qkqv", "squ-kqv", "tq-qkqv", "tq-fkv"])
def test_encode_by_parts_equals_coding_into_one_encoded(name):
    """Encoded.add reproduces what encode_tensor writes into one Encoded, K then V: the same
    entries, model keys and per-trial bits (a side codebook both tensors use counted once)."""
    g = torch.Generator().manual_seed(1)
    k, v, k_cal, v_cal = (torch.randn(3, 2, 48, 32, generator=g) * torch.linspace(2, 0.1, 32) for _ in range(4))
    s = schemes.create(name, budget=3, dim=32, seed=7).fit(k_cal, v_cal)
    direct = base.Encoded(tuple(k.shape), k.dtype)
    for prefix, x in (("k", k), ("v", v)):
        s.encode_tensor(x, prefix, direct)
    parts = s.encode(k, v)
    assert parts.model == direct.model
    for field in ("codes", "side", "exact_bits"):
        a, b = getattr(parts, field), getattr(direct, field)
        assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a), field
    assert torch.equal(base.BitLedger.per_trial(parts).bits_per_element, base.BitLedger.per_trial(direct).bits_per_element)


def test_shared_results_live_no_longer_than_their_data():
    k = torch.randn(2, 1, 16, 32)
    s = schemes.create("tq-kqv", budget=3, dim=32)
    first = s.encode(k, k)
    assert schemes.create("tq-kv", budget=3, dim=32).encode(k, k).codes["k.codes"] is first.codes["k.codes"]
    assert s.decode(first)[0] is s.decode(first)[0]
    held = len(base._CODINGS.entries), len(base._DECODED.entries)
    del k, first
    gc.collect()
    assert len(base._CODINGS.entries) < held[0] and len(base._DECODED.entries) < held[1]


def test_the_bench_times_the_whole_coding_every_repeat(monkeypatch):
    calls = _counting(monkeypatch, TurboQuant, "encode_tensor")
    shape = bench.BenchShape(scheme="tq-kv", budget=3, dim=32, seq_len=16, queries=4, trials=2, repeats=3)
    bench.scheme_throughput(shape, torch.device("cpu"), ["tq-kv"])
    assert len(calls) == 2 * (1 + shape.repeats)      # K and V, at the warm-up and at each repeat


def test_cells_that_decode_k_alike_share_its_metrics_and_scores(monkeypatch):
    import stats.metrics
    monkeypatch.setattr(engine, "check_sample", lambda *args, **kwargs: None)   # the chunk's metrics, counted
    parts = {name: [] for name in ("key_metrics", "value_metrics", "score_metrics")}
    for name, calls in parts.items():
        real = getattr(stats.metrics, name)
        monkeypatch.setattr(stats.metrics, name, lambda *a, _real=real, _calls=calls: _calls.append(1) or _real(*a))
    _rows(CONFIG.cells())
    # per budget, 6 cells: K decoded 4 ways (tq plain, tq sketched, sq, int4); V 5 ways (tq plain,
    # tq sketched, sq plain, sq sketched, int4); scores 4 ways (K's, with tq-qkv's scored on its codes)
    assert len(parts["key_metrics"]) == 2 * 4
    assert len(parts["value_metrics"]) == 2 * 5
    assert len(parts["score_metrics"]) == 2 * 4


@pytest.mark.parametrize("names", [("tq-qkv", "tq-qkqv"), ("tq-fkv", "tq-fkfv"), ("sq-qkv", "sq-qkqv")])
def test_variants_that_score_k_alike_on_its_codes_score_once(monkeypatch, names):
    g = torch.Generator().manual_seed(2)
    k, v, q = (torch.randn(2, 1, 32, 16, generator=g) * torch.linspace(2, 0.2, 16) for _ in range(3))
    cls = TurboQuant if names[0].startswith("tq") else SpectralQuant
    calls = []
    real = cls._score_on_codes
    monkeypatch.setattr(cls, "_score_on_codes", lambda self, *a: calls.append(1) or real(self, *a))
    made = [schemes.create(n, budget=3, dim=16, seed=5).fit(k, v) for n in names]
    scores = [s.score(q, s.encode(k, v)) for s in made]
    assert len(calls) == 1 and scores[0] is scores[1]
    alone = schemes.create(names[1], budget=3, dim=16, seed=5).fit(k.clone(), v.clone())
    assert torch.equal(alone.score(q, alone.encode(k.clone(), v.clone())), scores[1])   # as computed afresh


def test_spectralquant_projects_a_tensor_once_for_every_budget_and_variant():
    """z = Qᵀu depends on the tensor and the calibration alone: sq and squ cells at any budget
    share it (the calibration is shared too, σ's division is in the coding's one pass), and it
    equals a fresh projection."""
    from schemes.spectralquant_memos import coordinates
    g = torch.Generator().manual_seed(4)
    k, v = (torch.randn(2, 1, 48, 16, generator=g) * torch.linspace(2, 0.1, 16) for _ in range(2))
    made = [schemes.create(n, budget=b, dim=16).fit(k, v) for n, b in (("sq-kv", 2), ("squ-qkv", 5))]
    first, second = (coordinates(k, s.calibration["k"].basis) for s in made)
    assert first is second
    fresh = schemes.create("sq-kv", budget=3, dim=16).fit(k.clone(), v.clone())
    assert torch.equal(first, coordinates(k.clone(), fresh.calibration["k"].basis))


def test_turboquant_variants_of_a_budget_rotate_and_quantise_a_tensor_once(monkeypatch):
    """tq-kv, tq-qkv, tq-fkv, tq-kqv and tq-kfv at one budget rotate K and V with the same signs
    (one seed family): each tensor is rotated once, quantised once per MSE width (b for the
    unsketched, b − 1 for both sketches), and its residual is computed once; the codes equal a
    fresh coding's (inference tensors: no memo serves them)."""
    from schemes import scalar_quantizer, turboquant
    counts = {"rht": 0, "quantize_pack": 0}
    for module, name in ((turboquant, "rht"), (scalar_quantizer, "quantize_pack")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name: counts.__setitem__(
            _name, counts[_name] + 1) or _real(*a))
    g = torch.Generator().manual_seed(6)
    k, v = (torch.randn(3, 2, 40, 32, generator=g) * torch.linspace(2, 0.1, 32) for _ in range(2))
    names = ("tq-kv", "tq-qkv", "tq-fkv", "tq-kqv", "tq-kfv")
    coded = {n: schemes.create(n, budget=3, dim=32, seed=11).fit(None, None, trials=torch.arange(3)).encode(k, v)
             for n in names}
    assert counts == {"rht": 2, "quantize_pack": 4}                       # K, V; each at 3 and 2 bits
    assert coded["tq-qkv"].codes["k.codes"] is coded["tq-fkv"].codes["k.codes"]
    assert coded["tq-qkv"].codes["k.residual_norm"] is coded["tq-fkv"].codes["k.residual_norm"]
    assert coded["tq-kv"].codes["k.rotation_signs"] is coded["tq-fkv"].codes["k.rotation_signs"]
    with torch.inference_mode():
        k_fresh, v_fresh = k.clone(), v.clone()
    for name in names:
        fresh = schemes.create(name, budget=3, dim=32, seed=11).fit(None, None, trials=torch.arange(3))
        alone = fresh.encode(k_fresh, v_fresh)
        assert alone.codes.keys() == coded[name].codes.keys()
        assert all(torch.equal(alone.codes[c], coded[name].codes[c]) for c in alone.codes), name
        assert all(torch.equal(a, b) for a, b in zip(fresh.decode(alone), fresh.decode(coded[name]))), name


def test_spectralquant_codings_that_allocate_alike_quantise_once(monkeypatch):
    """squ-qkv at budget b gives K's semantic coordinates b − 1 bits and the tail 2, as squ-kv at
    b − 1 does (b ≥ 3): one calibration, the same widths, so one search and one packed stream,
    equal to a fresh coding's; sq-kv at b allocates otherwise and codes apart."""
    from schemes import spectralquant_memos
    g = torch.Generator().manual_seed(8)
    k, v = (torch.randn(2, 1, 48, 16, generator=g) * torch.linspace(2, 0.1, 16) for _ in range(2))
    calls = []
    real = spectralquant_memos.search_and_pack
    monkeypatch.setattr(spectralquant_memos, "search_and_pack", lambda *a: calls.append(1) or real(*a))
    made = {(n, b): schemes.create(n, budget=b, dim=16).fit(k, v) for n, b in
            (("squ-kv", 3), ("squ-qkv", 4), ("sq-kv", 4))}
    coded = {key: s.encode(k, v) for key, s in made.items()}
    assert torch.equal(made["squ-kv", 3].calibration["k"].widths, made["squ-qkv", 4].calibration["k"].widths)
    assert coded["squ-kv", 3].codes["k.codes"] is coded["squ-qkv", 4].codes["k.codes"]
    assert coded["sq-kv", 4].codes["k.codes"] is not coded["squ-kv", 3].codes["k.codes"]
    assert len(calls) == 2 + 1 + 2                                      # K shared once; V, sq-kv's K and V apart
    with torch.inference_mode():
        k_fresh, v_fresh = k.clone(), v.clone()
    fresh = schemes.create("squ-qkv", budget=4, dim=16).fit(k_fresh, v_fresh)
    alone = fresh.encode(k_fresh, v_fresh)
    assert all(torch.equal(alone.codes[c], coded["squ-qkv", 4].codes[c]) for c in alone.codes)
    assert all(torch.equal(a, b) for a, b in zip(fresh.decode(alone), made["squ-qkv", 4].decode(coded["squ-qkv", 4])))


def test_a_sketched_spectralquant_coding_dequantises_once(monkeypatch):
    """sq-qkv's K: encode (the residual), decode and the score on the codes read one ẑ, equal to a
    fresh coding's."""
    from schemes import spectralquant_memos
    computed = []
    real = spectralquant_memos.DEQUANTISED.put
    monkeypatch.setattr(spectralquant_memos.DEQUANTISED, "put", lambda *a: computed.append(1) or real(*a))
    g = torch.Generator().manual_seed(9)
    k, v, q = (torch.randn(2, 1, 48, 16, generator=g) * torch.linspace(2, 0.1, 16) for _ in range(3))
    s = schemes.create("sq-qkv", budget=3, dim=16).fit(k, v)
    enc = s.encode(k, v)
    assert len(computed) == 1                                  # K's residual
    k_hat, v_hat = s.decode(enc)
    scores = s.score(q, enc)
    assert len(computed) == 2                                  # + V's decode; K's decode and score reuse
    with torch.inference_mode():
        k_fresh, v_fresh = k.clone(), v.clone()
    fresh = schemes.create("sq-qkv", budget=3, dim=16).fit(k_fresh, v_fresh)
    alone = fresh.encode(k_fresh, v_fresh)
    assert all(torch.equal(a, b) for a, b in zip(fresh.decode(alone), (k_hat, v_hat)))
    assert torch.equal(fresh.score(q, alone), scores)
