"""Independent reference implementations of the codecs (`--impl reference`).

Written for clarity from the published math, in NumPy against an array namespace `xp` (CuPy
where a GPU exists), float64 by default, with their own randomness and their own building
blocks: they share no codec code with the torch path, so agreement between the two is
evidence, not tautology. The objects follow the torch Scheme protocol (schemes/base.py) and
convert at the boundary (adapter.py).

Every module of this package is imported below; a module registers its schemes by calling
`register(name, factory, description)` at import (schemes.registry.register with
impl="reference"), so a new reference codec is one file. A factory takes (budget, dim, seed,
**options) and returns a scheme object; schemes.registry.build, the one way a codec is built,
checks the configuration, sets its RNG family and validates it.
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Callable

from .. import registry
from ..registry import SchemeSpec


def register(name: str, factory: Callable[..., object], description: str = "") -> None:
    """Add a reference scheme; names are the torch registry's canonical lowercase names."""
    registry.register(name, factory, description, impl="reference")


def specs() -> dict[str, SchemeSpec]:
    return registry.reference_specs()


def available() -> list[str]:
    """Names of every reference scheme, in registration order."""
    return list(specs())


def create(name: str, *, budget: int, dim: int, seed: int = 0, rng: str | None = None, **options):
    """A ready reference scheme for one configuration (schemes.registry.create, impl="reference");
    ValueError naming what is valid otherwise.

    Options the TurboQuant family understands: xp ("numpy" | "cupy" | a module) and
    compute_dtype ("float64" | "float32").
    """
    return registry.create(name, budget=budget, dim=dim, seed=seed, rng=rng, impl="reference", **options)


for _module in pkgutil.iter_modules(__path__):
    if not _module.ispkg and not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["available", "create", "register", "specs"]
