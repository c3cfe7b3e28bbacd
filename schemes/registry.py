"""The one registry of schemes: built-ins register with `register`, third-party packages
through the entry-point group `kvharness.schemes` (name = scheme name, value = a Scheme
subclass or a factory taking budget, dim, seed and options)."""
from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata
from typing import Callable

from .base import Scheme

ENTRY_POINT_GROUP = "kvharness.schemes"
MIN_BUDGET, MAX_BUDGET = 1, 8


@dataclass(frozen=True)
class SchemeSpec:
    name: str
    factory: Callable[..., Scheme]
    description: str


_BUILTIN: dict[str, SchemeSpec] = {}
_plugins: dict[str, SchemeSpec] | None = None


def register(name: str, factory: Callable[..., Scheme], description: str) -> None:
    """Add a built-in scheme; names are canonical lowercase and unique."""
    if name != name.lower() or name in _BUILTIN or name == "all":
        raise ValueError(f"scheme name {name!r} is not lowercase, is reserved or is taken")
    _BUILTIN[name] = SchemeSpec(name, factory, description)


def register_variant(name: str, cls: type[Scheme], description: str, **fixed) -> None:
    """Register `name` as `cls` with some constructor options fixed (a variant of a family);
    the instance carries the variant's name."""
    def make(*, budget: int, dim: int, seed: int = 0, **options) -> Scheme:
        scheme = cls(budget=budget, dim=dim, seed=seed, **fixed, **options)
        scheme.name = name
        return scheme
    make.__doc__ = description
    register(name, make, description)


def _load_plugins() -> dict[str, SchemeSpec]:
    global _plugins
    if _plugins is None:
        _plugins = {}
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            if ep.name in _BUILTIN:
                continue  # a plug-in never shadows a built-in
            factory = ep.load()
            doc = (getattr(factory, "__doc__", None) or "third-party scheme").strip().splitlines()[0]
            _plugins[ep.name] = SchemeSpec(ep.name, factory, doc)
    return _plugins


def specs() -> dict[str, SchemeSpec]:
    """Every registered scheme, built-ins first, in registration order."""
    return {**_BUILTIN, **_load_plugins()}


def available() -> list[str]:
    return list(specs())


def create(name: str, *, budget: int, dim: int, seed: int = 0, **options) -> Scheme:
    """A ready scheme for one configuration; ValueError naming what is valid otherwise."""
    table = specs()
    if name not in table:
        raise ValueError(f"unknown scheme {name!r}; available: {', '.join(table)}")
    if isinstance(budget, bool) or not isinstance(budget, int) or not MIN_BUDGET <= budget <= MAX_BUDGET:
        raise ValueError(f"budget {budget!r} is outside {MIN_BUDGET}..{MAX_BUDGET} bits per element")
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise ValueError(f"head dimension {dim!r} must be a positive integer")
    scheme = table[name].factory(budget=budget, dim=dim, seed=seed, **options)
    scheme.validate()
    return scheme
