"""Independent reference implementations of the codecs (`--impl reference`).

Written for clarity from the published math, in NumPy against an array namespace `xp` (CuPy
where a GPU exists), float64 by default, with their own randomness and their own building
blocks: they share no codec code with the torch path, so agreement between the two is
evidence, not tautology. The objects follow the torch Scheme protocol (schemes/base.py) and
convert at the boundary (adapter.py).

Every module of this package is imported below; a module registers its schemes by calling
`register(name, factory, description)` at import, so a new reference codec is one file.
A factory takes (budget, dim, seed, rng, **options) and returns a ready scheme object.
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Callable

from kvcommon.registry import Registry

from ..registry import MAX_BUDGET, MIN_BUDGET, SchemeSpec

_SPECS: Registry[SchemeSpec] = Registry("scheme", " for the reference implementation")


def register(name: str, factory: Callable[..., object], description: str = "") -> None:
    """Add a reference scheme; names are the torch registry's canonical lowercase names."""
    doc = description or (getattr(factory, "__doc__", None) or "reference scheme").strip().splitlines()[0]
    _SPECS.add(name, SchemeSpec(name, factory, doc))


def specs() -> dict[str, SchemeSpec]:
    return _SPECS.as_dict()


def available() -> list[str]:
    """Names of every reference scheme, in registration order."""
    return _SPECS.names()


def create(name: str, *, budget: int, dim: int, seed: int = 0, rng: str = "pcg64", **options):
    """A ready reference scheme for one configuration; ValueError naming what is valid otherwise.

    Options the TurboQuant family understands: xp ("numpy" | "cupy" | a module) and
    compute_dtype ("float64" | "float32").
    """
    spec = _SPECS.lookup(name)
    if isinstance(budget, bool) or not isinstance(budget, int) or not MIN_BUDGET <= budget <= MAX_BUDGET:
        raise ValueError(f"budget {budget!r} is outside {MIN_BUDGET}..{MAX_BUDGET} bits per element")
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise ValueError(f"head dimension {dim!r} must be a positive integer")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed {seed!r} must be a non-negative integer")
    scheme = spec.factory(budget=budget, dim=dim, seed=seed, rng=rng, **options)
    scheme.validate()
    return scheme


for _module in pkgutil.iter_modules(__path__):
    if not _module.ispkg and not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["available", "create", "register", "specs"]
