"""Third-party codecs arrive through the entry-point group kvharness.schemes and pass the
conformance suite with no test code of their own."""
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from example_plugins import load_example

import pytest
import torch

import schemes
from kvcommon import plugins
from schemes import Encoded, Scheme, registry
from schemes.conformance import CHECKS, check_scheme
from schemes.packing import pack_bits, unpack_bits


@dataclass
class RoundKV(Scheme):
    """Toy plug-in: per-token max-abs scale (float32) and uniform mid-rise codes of `budget` bits."""
    name = "round-kv"

    def _encode(self, x, prefix, enc):
        scale = x.abs().amax(-1, keepdim=True)   # 0 for an all-zero token: decodes to zeros
        levels = 2 ** self.budget
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        idx = torch.clamp(((x / safe + 1) / 2 * levels).floor(), 0, levels - 1).to(torch.int64)
        enc.codes[f"{prefix}.codes"] = pack_bits(idx, self.budget)
        enc.codes[f"{prefix}.scale"] = scale.squeeze(-1).to(torch.float32)

    def _decode(self, enc, prefix):
        idx = unpack_bits(enc.codes[f"{prefix}.codes"], self.budget, self.dim).to(enc.dtype)
        return ((idx + 0.5) / 2 ** self.budget * 2 - 1) * enc.codes[f"{prefix}.scale"].to(enc.dtype).unsqueeze(-1)

    def encode(self, k, v):
        enc = Encoded(tuple(k.shape), k.dtype)
        self._encode(k, "k", enc)
        self._encode(v, "v", enc)
        self._largest_k = k.abs().amax(dim=(1, 2, 3))
        return enc

    def diagnostics(self):
        """Its own diagnostic, named by no harness constant: the largest |K| of each trial's cache."""
        return {"largest_abs_k": self._largest_k} if hasattr(self, "_largest_k") else {}

    def decode(self, enc):
        return self._decode(enc, "k"), self._decode(enc, "v")


class FakeEntryPoint:
    name = "round-kv"
    group = registry.ENTRY_POINT_GROUP

    def load(self):
        return RoundKV


def _codec_entry_points(points):
    """metadata.entry_points with `points` as the codec group's; every other caller (numba lists
    its own extensions when it first compiles) sees the real ones."""
    real = plugins.metadata.entry_points
    return lambda *args, **kw: list(points) if kw.get("group") == registry.ENTRY_POINT_GROUP else real(*args, **kw)


@pytest.fixture
def plugin(monkeypatch):
    monkeypatch.setenv(plugins.ENV, "1")
    monkeypatch.setattr(plugins.metadata, "entry_points",
                        _codec_entry_points([FakeEntryPoint()]))
    monkeypatch.setattr(registry, "_plugins", None)
    yield "round-kv"
    registry._plugins = None


def test_plugin_is_listed_and_created(plugin):
    assert plugin in schemes.available()
    assert schemes.specs()[plugin].description.startswith("Toy plug-in")
    s = schemes.create(plugin, budget=4, dim=16)
    assert isinstance(s, RoundKV) and s.budget == 4


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.name)
def test_plugin_passes_conformance(plugin, check):
    check.run(partial(schemes.create, plugin))


def test_an_unregistered_plugin_class_passes_check_scheme():
    check_scheme(RoundKV)


def test_plugin_never_shadows_a_builtin(monkeypatch):
    class Shadow(FakeEntryPoint):
        name = "tq-kv"
    monkeypatch.setenv(plugins.ENV, "1")
    monkeypatch.setattr(plugins.metadata, "entry_points", _codec_entry_points([Shadow()]))
    monkeypatch.setattr(registry, "_plugins", None)
    assert schemes.specs()["tq-kv"].factory is not RoundKV
    registry._plugins = None


@pytest.fixture
def missing_namespace(monkeypatch):
    """A namespace whose package is not installed (as kvpress is where the extra is not)."""
    def load():
        raise ImportError("No module named 'fakepress'")
    monkeypatch.setitem(registry._NAMESPACES, "fakepress",
                        registry.Namespace("fakepress", load, "fakepress is not installed: pip install fakepress"))
    monkeypatch.setattr(registry, "_loaded", {})
    yield "fakepress"


def test_missing_namespace_is_listed_with_its_reason(missing_namespace, capsys):
    assert not any(n.startswith("fakepress:") for n in schemes.available())
    reason = schemes.unavailable()["fakepress:*"]
    assert reason.startswith("fakepress is not installed: pip install fakepress")
    with pytest.raises(ValueError, match="'fakepress:Foo' cannot run here: fakepress is not installed"):
        schemes.create("fakepress:Foo", budget=2, dim=16)
    from harness.cli import main
    assert main(["list", "--all"]) == 0
    out = capsys.readouterr().out
    assert "schemes that cannot run here:" in out and "fakepress:*" in out
    assert main(["run", "--scenario", "gaussian", "--scheme", "fakepress:Foo", "--trials", "2"]) == 2
    assert "'fakepress:Foo' cannot run here: fakepress is not installed" in capsys.readouterr().err


def test_builtins_resolve_without_loading_namespaces(missing_namespace):
    assert schemes.create("tq-kv", budget=2, dim=16).name == "tq-kv"
    assert "fakepress" not in registry._loaded


class _BrokenEntryPoint:
    group = registry.ENTRY_POINT_GROUP

    def __init__(self, name, value, loaded):
        self.name, self.value, self._loaded = name, value, loaded

    def load(self):
        if isinstance(self._loaded, Exception):
            raise self._loaded
        return self._loaded


def test_a_broken_plugin_costs_only_its_own_name(monkeypatch, capsys):
    """A plug-in that fails to import, or loads to something that is not a Scheme class or a
    factory, is listed by unavailable() with the reason; the other plug-ins and every command run."""
    from harness.cli import main
    points = [FakeEntryPoint(),
              _BrokenEntryPoint("broken-import", "brokenpkg.codec:Codec", ModuleNotFoundError("No module named 'numpyy'")),
              _BrokenEntryPoint("not-a-scheme", "otherpkg:CONFIG", {"bits": 3}),
              _BrokenEntryPoint("wrong-class", "otherpkg:Thing", ValueError)]
    monkeypatch.setenv(plugins.ENV, "1")
    monkeypatch.setattr(plugins.metadata, "entry_points",
                        _codec_entry_points(points))
    monkeypatch.setattr(registry, "_plugins", None)
    try:
        assert "round-kv" in schemes.available()
        assert not {"broken-import", "not-a-scheme", "wrong-class"} & set(schemes.available())
        reasons = schemes.unavailable()
        assert reasons["broken-import"] == ("plug-in brokenpkg.codec:Codec failed to load: "
                                            "ModuleNotFoundError: No module named 'numpyy'")
        assert "is dict" in reasons["not-a-scheme"] and "not a Scheme subclass" in reasons["not-a-scheme"]
        assert "not a Scheme subclass" in reasons["wrong-class"]
        with pytest.raises(ValueError, match="'broken-import' cannot run here: plug-in brokenpkg.codec:Codec failed"):
            schemes.create("broken-import", budget=2, dim=16)
        assert main(["list"]) == 0 and "round-kv" in capsys.readouterr().out
    finally:
        registry._plugins = None


def test_a_factory_that_returns_no_scheme_is_refused(monkeypatch):
    points = [_BrokenEntryPoint("lazy", "pkg:make", lambda **kw: {"budget": kw["budget"]})]
    monkeypatch.setenv(plugins.ENV, "1")
    monkeypatch.setattr(plugins.metadata, "entry_points",
                        _codec_entry_points(points))
    monkeypatch.setattr(registry, "_plugins", None)
    try:
        with pytest.raises(ValueError, match="'lazy': its factory returned dict, not a Scheme"):
            schemes.create("lazy", budget=2, dim=16)
    finally:
        registry._plugins = None


def test_a_plugins_own_diagnostic_is_stored_per_trial(plugin, tmp_path):
    """A diagnostic no harness constant names goes to the `diagnostics` table and comes back as a
    column of RunStore.trials() (NaN for the codecs that do not report it), equal per trial to the
    largest |K| of the data the harness draws for that trial."""
    import sqlite3

    from harness.cell import draw_trials
    from harness.cli import main
    from kvcommon.rows import TRIAL_COLUMNS
    from harness.store import RESULTS_FILE, RunStore
    from harness.sweep import Cell, SweepConfig

    args = ["run", "--scenario", "heavy_tail", "--scheme", f"{plugin},tq-kv", "--budget", "4", "--dim", "16",
            "--seq-len", "32", "--queries", "4", "--trials", "5", "--quiet", "--out", str(tmp_path)]
    assert main(args) == 0
    with sqlite3.connect(tmp_path / RESULTS_FILE) as con:
        assert "largest_abs_k" not in {row[1] for row in con.execute("PRAGMA table_info(trials)")}
        assert con.execute("SELECT COUNT(*) FROM diagnostics WHERE name = 'largest_abs_k'").fetchone()[0] == 5
    frame = RunStore(tmp_path).trials()
    assert list(frame.columns) == list(TRIAL_COLUMNS) + ["largest_abs_k"]
    mine = frame[frame.scheme == plugin].sort_values("trial")
    assert frame[frame.scheme == "tq-kv"]["largest_abs_k"].isna().all()
    config = SweepConfig(scenarios=("heavy_tail",), schemes=(plugin,), budgets=(4,), dims=(16,), seq_lens=(32,),
                         queries=(4,), trials=5)
    cell = Cell("heavy_tail", plugin, 4, 16, 32, 4, config.calib_tokens[0])
    data = draw_trials(config, cell, range(5), torch.device("cpu"), torch.float32)
    expected = data["k"].abs().amax(dim=(1, 2, 3)).double().numpy()
    assert mine["largest_abs_k"].to_numpy() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("values,name,words", [
    (torch.ones(3), "d2_t", "names a trials column that is not a diagnostic"),
    (torch.ones(3), "largest k", "is not an identifier"),
    (torch.ones(3, 2), "largest_abs_k", r"has shape \(3, 2\); valid: \(3,\)"),
])
def test_a_diagnostic_that_would_overwrite_a_metric_or_is_not_per_trial_is_refused(values, name, words):
    from harness.cell import _diagnostics

    codec = RoundKV(budget=4, dim=16)
    codec.diagnostics = lambda: {name: values}
    with pytest.raises(ValueError, match=words):
        _diagnostics(codec, 3)
    codec.diagnostics = lambda: {"d_eff_k": torch.full((3,), 2.0)}      # a named diagnostic column: kept
    assert torch.equal(_diagnostics(codec, 3)["d_eff_k"], torch.full((3,), 2.0, dtype=torch.float64))


def example_module():
    """examples/absmax-codec's module."""
    return load_example("absmax-codec", "absmax_codec")


@pytest.fixture
def example_codec(monkeypatch):
    """examples/absmax-codec, installed as its pyproject.toml declares it: its module's AbsMax as
    the entry point `absmax` of kvharness.schemes (CI installs the package itself into a clean
    venv and runs it)."""
    module = example_module()

    class ExampleEntryPoint(FakeEntryPoint):
        name = "absmax"
        value = "absmax_codec:AbsMax"

        def load(self):
            return module.AbsMax
    monkeypatch.setenv(plugins.ENV, "1")
    monkeypatch.setattr(plugins.metadata, "entry_points", _codec_entry_points([ExampleEntryPoint()]))
    monkeypatch.setattr(registry, "_plugins", None)
    yield Path(module.__file__)
    registry._plugins = None


def test_a_new_codec_is_one_short_file_that_passes_the_shipped_checks_and_runs(example_codec, tmp_path):
    from harness.cli import main
    from harness.store import RunStore

    assert len(example_codec.read_text().splitlines()) <= 25
    assert "absmax" in schemes.available()
    check_scheme(partial(schemes.create, "absmax"))
    assert main(["run", "--scenario", "gaussian", "--scheme", "absmax", "--budget", "2,4", "--dim", "16",
                 "--seq-len", "32", "--queries", "4", "--trials", "3", "--quiet", "--out", str(tmp_path)]) == 0
    frame = RunStore(tmp_path).trials().groupby("budget")
    # b bits of code per element plus one float32 scale per 16-element token vector
    assert frame["bits_per_element"].mean().to_dict() == {2: 2 + 32 / 16, 4: 4 + 32 / 16}
    assert frame["rel_mse_k"].mean()[4] < frame["rel_mse_k"].mean()[2]
