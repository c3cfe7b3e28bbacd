"""Scenario generators: `available()` lists the names, `create(name, **params)` builds one.

A scenario module registers its classes with `register`; every module of this package is
imported here, so a new scenario is one new file. A parametric scenario (class attribute
`parametric = True`, a `source` field) is named `PREFIX:ARGUMENT`, e.g. `replay:FILE`.
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import fields

from .base import Population, Scenario, TrialShape, participation_ratio

_REGISTRY: dict[str, type[Scenario]] = {}


def register(cls: type[Scenario]) -> type[Scenario]:
    if not cls.name or cls.name in _REGISTRY:
        raise ValueError(f"scenario name {cls.name!r} is empty or taken")
    _REGISTRY[cls.name] = cls
    return cls


def available() -> list[str]:
    """Concrete scenario names (what `all` means); parametric ones are listed by `parametric()`."""
    return [n for n, c in _REGISTRY.items() if not getattr(c, "parametric", False)]


def parametric() -> list[str]:
    return [f"{n}:{c.source_hint}" for n, c in _REGISTRY.items() if getattr(c, "parametric", False)]


def describe(name: str) -> str:
    return _REGISTRY[name.split(":", 1)[0]].description


def create(name: str, **params) -> Scenario:
    """The scenario `name` with its documented parameters overridden by params."""
    prefix, _, argument = name.partition(":")
    cls = _REGISTRY.get(prefix)
    if cls is None or bool(argument) != bool(getattr(cls, "parametric", False)):
        raise ValueError(f"unknown scenario {name!r}; available: {', '.join(available() + parametric())}")
    valid = {f.name for f in fields(cls)} - {"source"}
    unknown = set(params) - valid
    if unknown:
        raise ValueError(f"scenario {prefix}: unknown parameter(s) {', '.join(sorted(unknown))}; "
                         f"valid: {', '.join(sorted(valid))}")
    scenario = cls(source=argument, **params) if argument else cls(**params)
    scenario.validate()
    return scenario


# DESIGN.md's six synthetic scenarios first (this fixes the order of `available()`), then the rest.
for _name in sorted((m.name for m in pkgutil.iter_modules(__path__) if m.name != "base"),
                    key=lambda n: (n != "synthetic", n)):
    importlib.import_module(f"{__name__}.{_name}")

__all__ = ["Population", "Scenario", "TrialShape", "available", "create", "describe", "parametric",
           "participation_ratio", "register"]
