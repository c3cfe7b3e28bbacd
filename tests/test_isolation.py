"""A plug-in is trusted with nothing (DESIGN.md, Scheme protocol; issue 47): each making one
plausible mistake, installed as an entry point and run in a `--scheme all` sweep beside the
built-in codecs, it costs its own cells, named, and no built-in row changes; scenario plug-ins
likewise. The plug-ins are classes of this module, so the separate process that decodes a
plug-in's stored bytes imports them by name, as it would an installed package."""
import io
import itertools
import sqlite3
import zipfile
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pytest
import torch

from example_plugins import load_example
from harness.cli import main
from harness.store import RESULTS_FILE
from kvcommon import plugins
from schemes import Encoded, registry
from schemes.base import BitLedger, Capabilities
from test_plugins import _codec_entry_points
from test_scenario_conformance import GlobalSeed

AbsMax = load_example("absmax-codec", "absmax_codec").AbsMax
Laplace = load_example("laplace-scenario", "laplace_scenario").Laplace


# --- codecs, each with one mistake --------------------------------------------------------------
class HalvesKThroughData(AbsMax):
    """Halves K through .data: no version counter is bumped."""
    name = "halves-k-data"

    def encode(self, k, v):
        k.data.mul_(0.5)
        return super().encode(k, v)


class HalvesKThroughNumpy(AbsMax):
    """Halves K through a NumPy view of it."""
    name = "halves-k-numpy"

    def encode(self, k, v):
        view = k.detach().numpy()
        view *= 0.5
        return super().encode(k, v)


class HalvesVThroughOut(AbsMax):
    """Halves V through an out= argument."""
    name = "halves-v-out"

    def encode(self, k, v):
        torch.mul(v, 0.5, out=v)
        return super().encode(k, v)


class StoresAViewOfEverything(AbsMax):
    """Stores full[:, :1], a one-element view of a float32 tensor holding all of K and V."""
    name = "stores-a-view"

    def encode(self, k, v):
        enc = Encoded(tuple(k.shape), k.dtype)
        enc.codes["full"] = torch.cat((k, v), dim=2).float().reshape(len(k), -1)[:, :1]
        return enc

    def decode(self, enc):
        view = enc.codes["full"]
        b, h, s, d = enc.shape
        full = torch.as_strided(view, (b, 2 * h * s * d), (view.stride(0), 1)).reshape(b, h, 2 * s, d)
        return full[:, :, :s].to(enc.dtype), full[:, :, s:].to(enc.dtype)


class ClaimsFourTimesTheTokens(AbsMax):
    """Its Encoded.shape claims 4× the tokens (the ledger divides by the shape)."""
    name = "claims-more-tokens"

    def encode(self, k, v):
        enc = super().encode(k, v)
        b, h, s, d = enc.shape
        enc.shape = (b, h, 4 * s, d)
        return enc


class ExactBitsForTheFirstTrialOnly(AbsMax):
    """exact_bits honest for the batch's first trial, 1 bit for every other."""
    name = "exact-bits-first"

    def encode(self, k, v):
        enc = super().encode(k, v)
        for key, t in enc.codes.items():
            enc.exact_bits[key] = torch.ones(len(t))
            enc.exact_bits[key][0] = t[0].numel() * t.element_size() * 8
        return enc


_ORIGINALS: dict[int, tuple] = {}
_IDS = itertools.count(1)


class KeepsOriginalsInTheModule(AbsMax):
    """Keeps K and V in a module-level dict, keyed by an id stored in its codes; decodes them."""
    name = "keeps-originals"

    def encode(self, k, v):
        enc = super().encode(k, v)
        key = next(_IDS)
        _ORIGINALS[key] = (k.clone(), v.clone())
        enc.codes["id"] = torch.full((len(k), 1), key, dtype=torch.int64)
        return enc

    def decode(self, enc):
        return _ORIGINALS[int(enc.codes["id"][0, 0])]


@dataclass
class HonestOnTrialZero(KeepsOriginalsInTheModule):
    """Honest on any batch holding trial 0; keeps the originals in the module on the others."""
    name = "honest-on-trial-zero"
    capabilities = Capabilities(fit_trials=True)

    def fit(self, k_cal, v_cal, trials=None):
        self.honest = trials is not None and bool((trials == 0).any())
        return self

    def encode(self, k, v):
        return AbsMax.encode(self, k, v) if self.honest else super().encode(k, v)

    def decode(self, enc):
        return AbsMax.decode(self, enc) if "id" not in enc.codes else super().decode(enc)


class TagsItsCodesPerModel(AbsMax):
    """Tags K's codes per model: charged once per model, not per cache."""
    name = "tags-codes-per-model"

    def encode(self, k, v):
        enc = super().encode(k, v)
        enc.model.add("k.codes")
        return enc


class HonestOnlyAlone(KeepsOriginalsInTheModule):
    """Honest when coding one trial (as a check codes it); keeps the originals in the module when
    coding a batch of them."""
    name = "honest-only-alone"

    def encode(self, k, v):
        return AbsMax.encode(self, k, v) if len(k) == 1 else super().encode(k, v)

    def decode(self, enc):
        return AbsMax.decode(self, enc) if "id" not in enc.codes else super().decode(enc)


class DithersEachDecode(AbsMax):
    """Dithers K from a generator of its own that advances at every decode: its first decode on
    an instance is the encoder's, its second is not."""
    name = "dithers-each-decode"

    def fit(self, k_cal, v_cal):
        self._gen = torch.Generator().manual_seed(self.seed)
        return self

    def decode(self, enc):
        k, v = super().decode(enc)
        return k + 1e-3 * torch.rand(k.shape, generator=self._gen, dtype=k.dtype), v


class BroadcastsTrialZero(AbsMax):
    """Decodes K as (1, H, S, d): trial 0's decoding, broadcast over the batch by the metrics."""
    name = "broadcasts-trial-zero"

    def decode(self, enc):
        k, v = super().decode(enc)
        return k[:1], v


MISTAKES = {   # plug-in -> words of its cell's failure
    HalvesKThroughData: "wrote its input k in place",
    HalvesKThroughNumpy: "wrote its input k in place",
    HalvesVThroughOut: "wrote its input v in place",
    ClaimsFourTimesTheTokens: "1, 128, 16) and dtype torch.float32 for K and V of shape",
    KeepsOriginalsInTheModule: "cannot decode the stored encoding (KeyError",
    HonestOnTrialZero: "cannot decode the stored encoding (KeyError",
    HonestOnlyAlone: "codes a trial differently in company",
    TagsItsCodesPerModel: "codes.k.codes tagged per model (charged once per model, not per cache) change",
    DithersEachDecode: "decoding 2 of 2",
    BroadcastsTrialZero: "decode returned K as torch.float32 of shape (1, 1, 32, 16)",
}
STORED = (StoresAViewOfEverything,)   # runs, and is charged what it stores


class _EntryPoint:
    group = registry.ENTRY_POINT_GROUP

    def __init__(self, cls):
        self.name, self.value, self._cls = cls.name, f"{cls.__module__}:{cls.__name__}", cls

    def load(self):
        return self._cls


SWEEP = ["run", "--scenario", "heavy_tail", "--scheme", "all", "--budget", "2,3", "--dim", "16", "--seq-len", "32",
         "--queries", "4", "--trials", "3", "--quiet"]


def _trials(out) -> pd.DataFrame:
    with sqlite3.connect(out / RESULTS_FILE) as con:
        frame = pd.read_sql("SELECT * FROM trials", con)
    return frame.sort_values(["scheme", "budget", "trial"]).reset_index(drop=True)


def _saved_storage_bytes(enc: Encoded) -> int:
    """Brute force: the bytes of the storages torch.save writes for the encoding's tensors (the
    archive's data/ records), read back from the archive."""
    buffer = io.BytesIO()
    torch.save({"codes": enc.codes, "side": enc.side}, buffer)
    with zipfile.ZipFile(buffer) as archive:
        return sum(info.file_size for info in archive.infolist() if "/data/" in info.filename)


def test_plugins_mistakes_cost_their_own_cells_named_and_no_builtin_row_changes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVHARNESS_CHUNK_TRIALS", "2")           # two chunks: every plug-in is checked on each
    assert main([*SWEEP, "--out", str(tmp_path / "alone")]) == 0
    builtin = _trials(tmp_path / "alone")
    monkeypatch.setenv(plugins.ENV, "1")
    monkeypatch.setattr(plugins.metadata, "entry_points",
                        _codec_entry_points([_EntryPoint(cls) for cls in (*MISTAKES, *STORED)]))
    monkeypatch.setattr(registry, "_plugins", None)
    try:
        assert main([*SWEEP, "--out", str(tmp_path / "beside")]) == 1
    finally:
        registry._plugins = None
    err = capsys.readouterr().err
    beside = _trials(tmp_path / "beside")
    mine = beside[beside.scheme.isin(builtin.scheme.unique())].reset_index(drop=True)
    pd.testing.assert_frame_equal(mine, builtin, check_exact=True)       # every column, every built-in row
    for cls, words in MISTAKES.items():
        failure = err.split(f"codec {cls.name}: ")[1].split("; codec ")[0]
        assert cls.name in failure and words in failure, (cls.name, failure)
    counts = beside.scheme.value_counts()
    complete = set(counts[counts == len(builtin) / builtin.scheme.nunique()].index)   # every budget and trial
    assert complete - set(builtin.scheme) == {cls.name for cls in STORED}
    assert (beside[beside.scheme == StoresAViewOfEverything.name].bits_per_element == 32).all()   # float32 K and V


class HangsWhenDecodingElsewhere(AbsMax):
    """Its decode never returns in the separate decoding process (a `-c` process)."""
    name = "hangs-elsewhere"

    def decode(self, enc):
        import sys
        import time
        while sys.argv[:1] == ["-c"]:
            time.sleep(1)
        return super().decode(enc)


def test_a_plugin_whose_decode_hangs_in_the_decoding_process_costs_its_cells(tmp_path, monkeypatch, capsys):
    from schemes.conformance import DECODE_TIMEOUT_ENV
    monkeypatch.setenv(DECODE_TIMEOUT_ENV, "3")
    monkeypatch.setenv(plugins.ENV, "1")
    monkeypatch.setattr(plugins.metadata, "entry_points",
                        _codec_entry_points([_EntryPoint(HangsWhenDecodingElsewhere)]))
    monkeypatch.setattr(registry, "_plugins", None)
    sweep = [*SWEEP, "--out", str(tmp_path / "run")]
    sweep[sweep.index("all")] = "hangs-elsewhere,int4"
    try:
        assert main(sweep) == 1
    finally:
        registry._plugins = None
    err = capsys.readouterr().err
    assert "codec hangs-elsewhere" in err and "gave no answer in 3 s" in err
    assert set(_trials(tmp_path / "run").scheme) == {"int4"}


def test_a_view_of_the_whole_cache_is_charged_the_whole_cache():
    """full[:, :1] occupies one element per trial but torch.save writes all of `full`: 32 bits per
    element of K and V, counted from the archive torch.save writes (brute force)."""
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(3, 2, 24, 16, generator=g), torch.randn(3, 2, 24, 16, generator=g)
    enc = StoresAViewOfEverything(budget=2, dim=16).encode(k, v)
    bits = BitLedger.per_trial(enc)
    saved = _saved_storage_bytes(enc)
    assert saved == 3 * 2 * 2 * 24 * 16 * 4
    assert bits.cache.tolist() == [8 * saved / 3] * 3 and bits.bits_per_element.tolist() == [32.0] * 3
    assert BitLedger.of(enc).total == 8 * saved / 3


def test_exact_bits_never_go_below_what_a_trials_own_slice_holds():
    """A claim of 1 bit is raised to the non-zero bytes of the trial's own slice (counted here
    byte by byte with NumPy); the first trial's honest claim stands."""
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(3, 1, 24, 16, generator=g), torch.randn(3, 1, 24, 16, generator=g)
    enc = ExactBitsForTheFirstTrialOnly(budget=3, dim=16).encode(k, v)
    honest = AbsMax(budget=3, dim=16).encode(k, v)
    bits = BitLedger.per_trial(enc).cache
    assert float(bits[0]) == float(BitLedger.per_trial(honest).cache[0])
    for i in (1, 2):
        floor = sum(8 * np.count_nonzero(np.frombuffer(t[i].numpy().tobytes(), dtype=np.uint8))
                    for t in enc.codes.values())
        assert float(bits[i]) == floor > 1


@dataclass(frozen=True)
class HalfTheDimension(Laplace):
    """Draws K and V of half the head dimension asked."""
    name = "half-the-dimension"

    def draw(self, streams, shape):
        out = super().draw(streams, shape)
        out["k"], out["v"] = out["k"][..., ::2], out["v"][..., ::2]
        return out


class _ScenarioEntryPoint:
    def __init__(self, cls):
        import scenarios
        self.group, self.name, self.value, self._cls = scenarios.ENTRY_POINT_GROUP, cls.name, f"pkg:{cls.name}", cls

    def load(self):
        return self._cls


def test_a_failing_scenario_costs_its_own_cells_named_as_the_scenarios(monkeypatch):
    """Beside a sound scenario plug-in, one that is not a function of its seed and one that draws
    another dimension than asked: their cells fail, each named as the scenario's, before any row."""
    import scenarios
    from harness.cell import CellFailure, run_serial
    from harness.sweep import SweepConfig

    points = [_ScenarioEntryPoint(cls) for cls in (Laplace, GlobalSeed, HalfTheDimension)]
    monkeypatch.setenv(plugins.ENV, "1")
    real = plugins.metadata.entry_points
    monkeypatch.setattr(plugins.metadata, "entry_points", lambda *a, **kw: points if kw.get("group") ==
                        scenarios.ENTRY_POINT_GROUP else real(*a, **kw))
    scenarios.reload_plugins()
    outcome = {}

    def on_chunk(cell, trials, rows, wall, peak):
        outcome.setdefault((cell.scenario, cell.scheme), rows.reason if isinstance(rows, CellFailure) else len(rows))
    try:
        config = SweepConfig(scenarios=("laplace", "global-seed", "half-the-dimension"), schemes=("tq-kv", "plain-kv"),
                             budgets=(2,), dims=(16,), seq_lens=(32,), queries=(4,), trials=3, calib_tokens=(32,))
        config.validate()
        run_serial(config, config.cells(), torch.device("cpu"), torch.float32, None, on_chunk=on_chunk)
    finally:
        scenarios.reload_plugins()
    for scheme in ("tq-kv", "plain-kv"):
        assert isinstance(outcome["laplace", scheme], int)
        assert "scenario global-seed failed its checks: trial" in outcome["global-seed", scheme]
        assert "drawn twice differs in k" in outcome["global-seed", scheme]
        assert ("scenario half-the-dimension failed its checks: k has shape (1, 32, 8), not (1, 32, 16) (heads 1, "
                "tokens 32, dimension 16 asked)") in outcome["half-the-dimension", scheme]


@pytest.mark.parametrize("write,written", [
    (lambda d: d["k"].data.mul_(0.5), ["k"]),
    (lambda d: np.multiply(d["v"].numpy(), 0.5, out=d["v"].numpy()), ["v"]),
    (lambda d: torch.mul(d["q"], 0.5, out=d["q"]), ["q"]),
    (lambda d: d["trials"].numpy().__setitem__(0, 7), ["trials"]),
    (lambda d: d["k_cal"].mul_(1.0), []),                   # a version bump that changes nothing: harmless
])
def test_every_write_path_is_found_by_the_chunks_snapshot(write, written):
    from harness.cell import _snapshot, _written

    g = torch.Generator().manual_seed(2)
    data = {name: torch.randn(2, 1, 8, 4, generator=g) for name in ("k", "v", "q", "k_cal")}
    data.update(trials=torch.arange(2), exact=(torch.zeros(1),))
    before = _snapshot(data)
    assert "exact" not in before and _written(data, before) == []
    write(data)
    assert _written(data, before) == written
