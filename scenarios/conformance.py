"""Conformance checks for a scenario, shipped for plug-in authors (as schemes.conformance is for
codecs).

A check takes a *factory*: a callable `make(**params)` returning a ready Scenario (the protocol
of scenarios/base.py), e.g. a registered name through `functools.partial(scenarios.create,
"heavy_tail")`, or an unregistered class itself. The checks draw trials exactly as a sweep
does: the scenario's `draw(streams, shape)` with NumPy generators from kvcommon.rng, labelled
(seed, "data", scenario, dim, seq_len, queries, heads, trial, tensor, head) as harness/cell.py
labels them, after `validate()` and `check_shape(shape)`.

`check_scenario(factory)` runs every check and raises ConformanceError listing each failure as
a sentence; `CHECKS` holds them one by one (name, function, what it states).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np

from kvcommon.checks import Check, ConformanceError, require, run_checks
from kvcommon.rng import generator

from .base import Scenario, TrialShape

Factory = Callable[..., Scenario]

SHAPES = (TrialShape(1, 16, 4, 8, 12), TrialShape(2, 33, 5, 16, 20, n_decode=3, prefill_queries=True))
PREFILL = ("k", "v", "q", "k_cal", "v_cal")


def draw(scenario: Scenario, shape: TrialShape, trial: int = 0, seed: int = 0, rng: str = "pcg64") -> dict:
    """One trial as a sweep draws it (module doc)."""
    scenario.validate()
    scenario.check_shape(shape)

    def streams(*labels):
        return generator(rng, seed, "data", scenario.name, shape.dim, shape.seq_len, shape.n_queries,
                         shape.n_heads, trial, *labels)
    return scenario.draw(streams, shape)


def expected_shapes(shape: TrialShape) -> dict[str, tuple]:
    """The tensors a trial of `shape` holds, with their shapes (what the sweep asks a scenario for)."""
    h, s, d = shape.n_heads, shape.seq_len, shape.dim
    out = {"k": (h, s, d), "v": (h, s, d), "q": (h, shape.n_queries, d), "k_cal": (h, shape.n_calib, d),
           "v_cal": (h, shape.n_calib, d), "positions": (s,)}
    if shape.n_decode:
        n = shape.n_decode
        out.update(k_decode=(h, n, d), v_decode=(h, n, d), positions_decode=(n,))
        if shape.prefill_queries:
            out["q_prefill_decode"] = (h, n, d)
    if shape.prefill_queries:
        out["q_prefill"] = (h, s, d)
    return out


def check_shapes_dtype_finite(factory: Factory) -> None:
    """Every tensor a trial needs is there, with its shape, in float64 (positions: integers), and
    finite, for one head and several, with and without decode tokens and prefill queries."""
    scenario = factory()
    for shape in SHAPES:
        trial = draw(scenario, shape)
        for name, expected in expected_shapes(shape).items():
            require(name in trial, f"a trial of shape {shape} lacks {name!r}")
            x = np.asarray(trial[name])
            require(x.shape == expected, f"{name} has shape {x.shape}, not {expected} (shape {shape})")
            if name.startswith("positions"):
                require(np.issubdtype(x.dtype, np.integer), f"{name} is {x.dtype}, not integers")
            else:
                require(x.dtype == np.float64, f"{name} is {x.dtype}, not float64")
                require(np.isfinite(x).all(), f"{name} has {int((~np.isfinite(x)).sum())} non-finite values")


def check_same_seed_same_trial(factory: Factory) -> None:
    """A trial is a function of (seed, RNG family, cell, trial index) alone: drawn twice, and by two
    instances, it is the same to the bit."""
    shape = SHAPES[1]
    first, again, other = draw(factory(), shape, trial=3), draw(factory(), shape, trial=3), None
    other = draw(factory(), shape, trial=3, seed=1)
    for name in first:
        require(np.array_equal(first[name], again[name]), f"{name} differs between two draws of one trial")
    require(not np.array_equal(first["k"], other["k"]), "k is the same under another root seed")


def check_trials_independent(factory: Factory) -> None:
    """Trials are separate draws: two trials' K differ, and their values are not correlated beyond
    chance (|r| of the flattened K below 5/√n, n the number of values)."""
    shape = SHAPES[1]
    scenario = factory()
    a, b = draw(scenario, shape, trial=0)["k"].ravel(), draw(scenario, shape, trial=1)["k"].ravel()
    require(not np.array_equal(a, b), "trials 0 and 1 draw the same k")
    r = float(np.corrcoef(a, b)[0, 1]) if a.std() > 0 and b.std() > 0 else 0.0
    require(abs(r) < 5 / math.sqrt(a.size), f"k of trials 0 and 1 correlate (r = {r:.3f} over {a.size} values)")


def check_streams_keep_the_prefill(factory: Factory) -> None:
    """The prefill (k, v, q and the calibration draw's leading tokens' streams) does not depend on
    the calibration size, the decode tokens or the prefill queries: codecs compared at other
    settings see the same K and V."""
    base = TrialShape(2, 33, 5, 16, 20)
    reference = draw(factory(), base)
    for shape in (dataclasses.replace(base, n_calib=7), dataclasses.replace(base, n_decode=4),
                  dataclasses.replace(base, prefill_queries=True)):
        other = draw(factory(), shape)
        for name in ("k", "v", "q"):
            require(np.array_equal(reference[name], other[name]),
                     f"{name} changes when the trial shape changes to {shape}")


def check_invalid_parameters_refused(factory: Factory) -> None:
    """Every numeric parameter is refused (ValueError at validate) when it is NaN or infinite: a
    parameter that is not finite is bad input, never a trial of NaN."""
    scenario = factory()
    for f in dataclasses.fields(scenario):
        value = getattr(scenario, f.name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        for bad in (math.nan, math.inf, -math.inf):
            try:
                dataclasses.replace(scenario, **{f.name: bad}).validate()
            except ValueError:
                continue
            raise ConformanceError(f"parameter {f.name}={bad} is accepted by validate()")


CHECKS: tuple[Check, ...] = tuple(
    Check.of(fn) for fn in (check_shapes_dtype_finite, check_same_seed_same_trial, check_trials_independent,
               check_streams_keep_the_prefill, check_invalid_parameters_refused))


def check_scenario(factory: Factory, *, skip: tuple[str, ...] = ()) -> None:
    """Run every check (but those named in skip) on the factory's scenarios; ConformanceError
    listing every failure, one sentence per check, if any fails. A check that raises something
    else reports it as the scenario's error in that check."""
    run_checks(CHECKS, factory, skip, "the scenario")
