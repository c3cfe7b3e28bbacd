"""The shipped conformance checks (schemes/conformance.py) on every registered codec and every
NumPy reference codec, each through its factory; and on broken codecs, which they must catch."""
from dataclasses import dataclass, replace
from functools import partial

import pytest
import torch

import schemes
from schemes import conformance
from schemes.registry import reference_specs
from schemes.base import Encoded
from schemes.baselines import GroupQuant
from schemes.conformance import CHECKS, ConformanceError, check_scheme
from test_plugins import example_module

# options a codec takes in this suite where its defaults do not fit the small caches (S = 48)
SMALL_CACHE_OPTIONS = {
    "kvpress:SnapKVPress": {"window_size": 8},      # a 64-token observation window by default
    "kvpress:PyramidKVPress": {"window_size": 8},
    "shard": {"kmeans_iter": 4},                    # 25 Lloyd sweeps of 256 centroids: 40 s for 8 budgets
    "shard-pca-decode": {"kmeans_iter": 4},
}

FACTORIES = {name: partial(schemes.create, name, **SMALL_CACHE_OPTIONS.get(name, {})) for name in schemes.available()}
FACTORIES.update({f"reference:{name}": partial(schemes.create, name, impl="reference") for name in reference_specs()})


@pytest.mark.parametrize("check,factory", conformance.pytest_params(FACTORIES))
def test_conformance(check, factory):
    check.run(factory)


# --- the checks catch what they state -----------------------------------------------------------
@dataclass
class _MutatesInput(GroupQuant):
    name = "broken-mutates"

    def encode(self, k, v):
        enc = super().encode(k, v)
        k.mul_(1.0001)
        return enc


@dataclass
class _Float32Always(GroupQuant):
    name = "broken-dtype"

    def decode(self, enc):
        return tuple(x.float() for x in super().decode(enc))


@dataclass
class _MixesTrials(GroupQuant):
    name = "broken-mixes"

    def decode(self, enc):
        k, v = super().decode(enc)
        return k + 0.1 * k[:1], v                         # every trial gets some of the first


@dataclass
class _Underreports(GroupQuant):
    name = "broken-ledger"

    def bits(self, enc):
        ledger = super().bits(enc)
        first = next(iter(ledger.components))
        return replace(ledger, components={**ledger.components, first: ledger.components[first] // 2})


@dataclass
class _PerHeadDiagnostic(GroupQuant):
    name = "broken-diagnostic"

    def diagnostics(self):
        return {"groups_used": torch.ones(3, 2)}        # (B, H): one value per trial and head


@dataclass
class _ExactBitsLie(GroupQuant):
    name = "broken-exact-bits"

    def encode(self, k, v):
        enc = super().encode(k, v)
        for key in enc.codes:
            enc.exact_bits[key] = torch.ones(k.shape[0])     # one bit per trial, whatever is stored
        return enc


@dataclass
class _KeepsTheCache(GroupQuant):
    name = "broken-keeps-state"

    def encode(self, k, v):
        self._kept = (k.clone(), v.clone())                 # decoded from here, not from the encoding
        enc = Encoded(tuple(k.shape), k.dtype)
        enc.codes["byte"] = torch.zeros(k.shape[0], 1, dtype=torch.uint8)
        return enc

    def decode(self, enc):
        return self._kept


@pytest.mark.parametrize("cls,check,words", [
    # the 1-bit claim is raised to the trial's non-zero bytes (BitLedger.per_trial), still short of what is stored
    (_ExactBitsLie, "check_encoding_stands_alone", r"a trial coded alone is charged \d+ per-cache and 0 per-model bits, but its stored tensors occupy"),
    (_KeepsTheCache, "check_encoding_stands_alone", "cannot decode the stored encoding .AttributeError"),
    (_MutatesInput, "check_input_not_mutated", "changed its input k in place"),
    (_Float32Always, "check_roundtrip_keeps_shape_dtype_device", "as torch.float32 for a torch.float64 input"),
    (_MixesTrials, "check_trial_order_invariant", "permuting the trials changes"),
    (_Underreports, "check_ledger_matches_storage", "the per-cache ledger counts"),
    (_PerHeadDiagnostic, "check_diagnostics_per_trial", r"has shape \(3, 2\) for 3 trials"),
])
def test_a_broken_codec_fails_its_check_with_a_sentence(cls, check, words):
    factory = partial(cls, width=8)
    sound = partial(GroupQuant, width=8)
    run = next(c for c in CHECKS if c.name == check).run
    run(sound)                                              # the intact codec passes the check
    with pytest.raises(ConformanceError, match=words):
        run(factory)
    with pytest.raises(ConformanceError) as failed:
        check_scheme(factory)
    assert f"{check}: " in str(failed.value) and str(failed.value).startswith(tuple("0123456789"))


def test_check_scheme_passes_a_configured_unregistered_instance_and_names_bad_skips():
    check_scheme(partial(GroupQuant, width=4, group_size=16))   # no registered codec has this configuration
    with pytest.raises(ValueError, match="valid: check_roundtrip"):
        check_scheme(partial(GroupQuant, width=4), skip=("check_nope",))


def test_a_codec_that_raises_is_reported_per_check():
    def factory(**kw):
        raise_on = GroupQuant(width=4, **kw)
        raise_on.encode = lambda k, v: (_ for _ in ()).throw(RuntimeError("no encoder"))
        return raise_on
    with pytest.raises(ConformanceError, match="the codec raised RuntimeError: no encoder"):
        check_scheme(factory)


# --- passing the checks means running in a sweep ---------------------------------------------
def minimal_factory(*, budget, dim, seed):
    """A factory written to the documented signature, make(budget=, dim=, seed=), and no more."""
    return example_module().AbsMax(budget=budget, dim=dim, seed=seed)


def test_a_factory_of_the_documented_signature_passes_the_checks():
    check_scheme(minimal_factory)


def test_every_factory_the_checks_accept_runs_in_a_one_chunk_sweep():
    """Each factory the conformance checks run on (every registered codec's, every reference
    codec's, and a minimal factory of the documented signature), registered under a name of its
    own, runs in a sweep of one chunk at the checks' shape and a non-default RNG family, every
    cell stored: the checks and the sweep build and call codecs alike."""
    from harness.cell import CellFailure, run_serial
    from harness.sweep import SweepConfig
    from schemes.registry import SchemeSpec, registered

    factories = {**FACTORIES, "minimal": minimal_factory}
    names = {f"checked-{i}": label for i, label in enumerate(factories)}
    b, h, s, d = conformance.SHAPE
    config = SweepConfig(scenarios=("gaussian",), schemes=tuple(names), budgets=(conformance.BUDGET,), dims=(d,),
                         seq_lens=(s,), queries=(conformance.N_QUERIES,), trials=2, heads=h, calib_tokens=(2 * d,),
                         rng="mt19937", device="cpu")
    outcome = {}

    def on_chunk(cell, trials, rows, wall, peak):
        outcome[names[cell.scheme]] = rows.reason if isinstance(rows, CellFailure) else len(rows)
    with registered([SchemeSpec(name, factories[label], label) for name, label in names.items()]):
        config.validate()
        run_serial(config, config.cells(), torch.device("cpu"), torch.float32, None, on_chunk=on_chunk)
        built = schemes.create("checked-0", budget=3, dim=d, rng="philox")
    assert outcome == dict.fromkeys(factories, 2)
    assert built.rng == "philox"


def test_build_checks_the_configuration_once_for_every_implementation():
    """One create for the torch codecs and the NumPy reference: the same checks (a negative seed
    refused by both), and the RNG family set on the built codec, never handed to a factory."""
    from schemes.registry import build

    for create in (schemes.create, partial(schemes.create, impl="reference")):
        with pytest.raises(ValueError, match="seed -1 must be a non-negative integer"):
            create("tq-kv", budget=2, dim=16, seed=-1)
        assert create("tq-kv", budget=2, dim=16, rng="mt19937").rng == "mt19937"
    assert build(minimal_factory, budget=2, dim=16, rng="philox").rng == "philox"
    from harness import known_answers
    bug = known_answers.BUGS[0]
    with known_answers.registered_bugs([bug]):     # a codec that builds codecs: they draw from its family
        assert schemes.create(bug.scheme, budget=2, dim=16, rng="mt19937").inner.rng == "mt19937"
    with pytest.raises(ValueError, match="budget 9 is outside 1..8"):
        build(minimal_factory, budget=9, dim=16)
