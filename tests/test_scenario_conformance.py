"""scenarios.conformance.check_scenario on the built-in scenarios and on broken ones, and the
entry-point route of scenario plug-ins (kvharness.scenarios)."""
import dataclasses
import functools
from dataclasses import dataclass

import numpy as np
import pytest

import scenarios
from harness.cli import main
from harness.store import RunStore
from kvcommon import plugins
from scenarios.conformance import CHECKS, ConformanceError, check_scenario
from example_plugins import load_example


Laplace = load_example("laplace-scenario", "laplace_scenario").Laplace


@dataclass(frozen=True)
class GlobalSeed(Laplace):
    """Draws K from NumPy's global state, not the streams it is handed."""
    name = "global-seed"

    def draw(self, streams, shape):
        out = super().draw(streams, shape)
        out["k"] = np.random.standard_normal(out["k"].shape)
        return out


@dataclass(frozen=True)
class CalibrationCoupled(Laplace):
    """K drawn from the calibration tokens' stream: it changes with the calibration size."""
    name = "calibration-coupled"

    def draw(self, streams, shape):
        out = super().draw(streams, shape)
        out["k"] = out["k"] + streams("k_cal", 0).standard_normal(shape.n_calib).mean()
        return out


@dataclass(frozen=True)
class Single(Laplace):
    """float32 values and a NaN in q."""
    name = "single"

    def draw(self, streams, shape):
        out = {k: v.astype(np.float32) if k != "positions" else v for k, v in super().draw(streams, shape).items()}
        out["q"][0, 0, 0] = np.nan
        return out


@dataclass(frozen=True)
class Lenient(Laplace):
    """Accepts a scale of NaN (its validate checks nothing)."""
    name = "lenient"

    def validate(self):
        pass


@pytest.mark.parametrize("name", scenarios.available())
def test_every_built_in_scenario_passes(name):
    check_scenario(functools.partial(scenarios.create, name))


@pytest.mark.parametrize("cls, check, words", [
    (GlobalSeed, "check_same_seed_same_trial", "differs between two draws"),
    (CalibrationCoupled, "check_streams_keep_the_prefill", "k changes when the trial shape changes"),
    (Single, "check_shapes_dtype_finite", "is float32, not float64"),
    (Lenient, "check_invalid_parameters_refused", "=nan is accepted by validate"),
])
def test_a_broken_scenario_fails_the_check_that_states_its_fault(cls, check, words):
    check_scenario(Laplace)
    with pytest.raises(ConformanceError, match=words) as info:
        check_scenario(cls)
    assert f"{check}: " in str(info.value)
    run = next(c for c in CHECKS if c.name == check)
    with pytest.raises(ConformanceError):
        run.run(cls)


class _EntryPoint:
    group = scenarios.ENTRY_POINT_GROUP

    def __init__(self, name, target):
        self.name, self.value, self._target = name, f"pkg:{name}", target

    def load(self):
        if isinstance(self._target, Exception):
            raise self._target
        return self._target


@pytest.fixture
def installed(monkeypatch):
    """A Laplace plug-in, a broken one, one that is not a Scenario and one that would shadow a
    built-in, as installed entry points."""
    points = [_EntryPoint("laplace", Laplace), _EntryPoint("broken", ModuleNotFoundError("No module named 'x'")),
              _EntryPoint("config", {"scale": 2}), _EntryPoint("gaussian", Laplace)]
    monkeypatch.setenv(plugins.ENV, "1")
    real = plugins.metadata.entry_points   # other packages list their own groups during a run
    monkeypatch.setattr(plugins.metadata, "entry_points", lambda **kw: points if kw.get("group") ==
                        scenarios.ENTRY_POINT_GROUP else real(**kw))
    scenarios.reload_plugins()
    yield
    scenarios.reload_plugins()


def test_a_scenario_plugin_is_listed_created_and_runs_in_a_sweep(installed, tmp_path, capsys):
    assert "laplace" in scenarios.available() and scenarios.available()[0] == "gaussian"
    assert scenarios.create("gaussian").__class__ is not Laplace   # never shadows a built-in
    reasons = scenarios.unavailable()
    assert reasons["broken"].startswith("plug-in pkg:broken failed to load: ModuleNotFoundError")
    assert "not a Scenario subclass" in reasons["config"]
    assert main(["list", "--all"]) == 0   # harness list --all names each broken plug-in with its reason
    listed = capsys.readouterr().out.split("scenarios that cannot run here:")[1]
    assert "broken" in listed and "failed to load: ModuleNotFoundError" in listed and "config" in listed
    assert scenarios.create("laplace:scale=2").scale == 2.0
    out = tmp_path / "run"
    assert main(["run", "--scenario", "laplace", "--scheme", "tq-kv", "--budget", "2", "--dim", "16", "--seq-len",
                 "32", "--queries", "4", "--trials", "3", "--out", str(out), "--quiet"]) == 0
    rows = RunStore(out).trials()
    assert (rows.scenario == "laplace").all() and len(rows) == 3 and np.isfinite(rows.d2_t).all()


def test_plugins_are_switched_off_in_the_project_suite(monkeypatch):
    monkeypatch.setattr(plugins.metadata, "entry_points", lambda **kw: [_EntryPoint("laplace", Laplace)])
    monkeypatch.setenv(plugins.ENV, "0")
    scenarios.reload_plugins()
    try:
        assert "laplace" not in scenarios.available()
    finally:
        scenarios.reload_plugins()


def test_the_laplace_example_is_what_the_check_passes():
    # the plug-in of the README's section, drawn: unit variance per coordinate, Laplace kurtosis 6
    from scenarios.conformance import draw
    k = draw(Laplace(), scenarios.TrialShape(1, 4096, 4, 8, 16))["k"].ravel()
    assert abs(k.var() - 1) < 0.08 and abs(((k - k.mean()) ** 4).mean() / k.var() ** 2 - 6) < 1.0
    assert dataclasses.replace(Laplace(), scale=2.0).population(None, 3).mix_k[0, 0] == 2.0


@dataclass(frozen=True)
class PerHeadTails(Laplace):
    """A per-head law from scalar parameters: head h's coordinates are Student-t with
    dof0 + h·step degrees of freedom and scale 1 + h (population and latent both take `head`)."""
    name = "per-head-tails"
    dof0: float = 5.0
    step: float = 20.0

    def population(self, gen, dim, head):
        return scenarios.Population(np.eye(dim) * (1 + head), np.eye(dim) * (1 + head))

    def latent(self, gen, shape, head):
        dof = self.dof0 + head * self.step
        return gen.standard_t(dof, shape) * np.sqrt((dof - 2) / dof)


def test_population_and_latent_get_the_head_they_draw_when_they_name_it():
    """Each head draws its own law (variance (1 + h)², kurtosis of Student-t(dof0 + h·step):
    6/(dof − 4) excess) and the check passes; Laplace, whose overrides leave `head` out, draws
    exactly as before (its rows do not move)."""
    from scenarios.conformance import draw
    check_scenario(PerHeadTails)
    k = draw(PerHeadTails(), scenarios.TrialShape(2, 20000, 4, 8, 16))["k"]
    for head, dof in ((0, 5.0), (1, 25.0)):
        x = k[head].ravel() / (1 + head)
        assert abs(x.var() - 1) < 0.05
        excess = ((x - x.mean()) ** 4).mean() / x.var() ** 2 - 3
        assert abs(excess - 6 / (dof - 4)) < (2.5 if dof == 5.0 else 0.15)
    gen = lambda *labels: np.random.default_rng(abs(hash(labels)) % 2 ** 32)  # noqa: E731
    shape = scenarios.TrialShape(2, 16, 4, 8, 16)
    before = Laplace().draw(gen, shape)
    expected = np.stack([np.random.default_rng(abs(hash(("k", h))) % 2 ** 32).laplace(0, 1 / np.sqrt(2), (16, 8))
                         for h in range(2)])
    np.testing.assert_array_equal(before["k"], expected)
