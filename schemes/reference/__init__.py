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
from dataclasses import dataclass
from typing import Callable

MIN_BUDGET, MAX_BUDGET = 1, 8


@dataclass(frozen=True)
class ReferenceSpec:
    name: str
    factory: Callable[..., object]
    description: str


_SPECS: dict[str, ReferenceSpec] = {}


def register(name: str, factory: Callable[..., object], description: str = "") -> None:
    """Add a reference scheme; names are the torch registry's canonical lowercase names."""
    if name != name.lower() or name in _SPECS or name == "all":
        raise ValueError(f"reference scheme name {name!r} is not lowercase, is reserved or is taken")
    doc = description or (getattr(factory, "__doc__", None) or "reference scheme").strip().splitlines()[0]
    _SPECS[name] = ReferenceSpec(name, factory, doc)


def specs() -> dict[str, ReferenceSpec]:
    return dict(_SPECS)


def available() -> list[str]:
    """Names of every reference scheme, in registration order."""
    return list(_SPECS)


def create(name: str, *, budget: int, dim: int, seed: int = 0, rng: str = "pcg64", **options):
    """A ready reference scheme for one configuration; ValueError naming what is valid otherwise.

    Options the TurboQuant family understands: xp ("numpy" | "cupy" | a module) and
    compute_dtype ("float64" | "float32").
    """
    if name not in _SPECS:
        raise ValueError(f"unknown scheme {name!r} for the reference implementation; "
                         f"available: {', '.join(_SPECS)}")
    if isinstance(budget, bool) or not isinstance(budget, int) or not MIN_BUDGET <= budget <= MAX_BUDGET:
        raise ValueError(f"budget {budget!r} is outside {MIN_BUDGET}..{MAX_BUDGET} bits per element")
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise ValueError(f"head dimension {dim!r} must be a positive integer")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed {seed!r} must be a non-negative integer")
    scheme = _SPECS[name].factory(budget=budget, dim=dim, seed=seed, rng=rng, **options)
    scheme.validate()
    return scheme


for _module in pkgutil.iter_modules(__path__):
    if not _module.ispkg and not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["available", "create", "register", "specs"]
