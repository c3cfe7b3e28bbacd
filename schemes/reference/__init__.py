"""Independent reference implementations of the codecs (`--impl reference`).

Written for clarity from the published math, in NumPy against an array namespace `xp` (CuPy
where a GPU exists), float64 by default, with their own randomness and their own building
blocks: they share no codec code with the torch path, so agreement between the two is
evidence, not tautology. The objects follow the torch Scheme protocol (schemes/base.py) and
convert at the boundary (adapter.py).

Every module of this package is imported below; a module lists its schemes by calling
`register(name, factory, description)` at import (into FACTORIES, which schemes.registry reads the
first time the reference is asked for: this package imports nothing of the registry), so a new
reference codec is one file. A factory takes (budget, dim, seed, **options) and returns a scheme
object; schemes.registry.build, the one way a codec is built, checks the configuration, sets its
RNG family and validates it. Build one with `schemes.create(name, impl="reference", ...)`; the
names are `schemes.registry.reference_specs()`.
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Callable

# name -> (factory, description), in registration order
FACTORIES: dict[str, tuple[Callable[..., object], str]] = {}


def register(name: str, factory: Callable[..., object], description: str = "") -> None:
    """Add a reference scheme; names are the torch registry's canonical lowercase names, each once."""
    if name in FACTORIES:
        raise ValueError(f"reference scheme name {name!r} is taken")
    FACTORIES[name] = (factory, description)


for _module in pkgutil.iter_modules(__path__):
    if not _module.ispkg and not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["FACTORIES", "register"]
