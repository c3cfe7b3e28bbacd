"""Scenario generators: `available()` lists the names, `create(name, **params)` builds one."""
from __future__ import annotations

from dataclasses import fields

from .base import Population, Scenario, TrialShape, participation_ratio
from .synthetic import SCENARIOS

_REGISTRY = {cls.name: cls for cls in SCENARIOS}


def available() -> list[str]:
    return list(_REGISTRY)


def describe(name: str) -> str:
    return _REGISTRY[name].description


def create(name: str, **params) -> Scenario:
    """The scenario `name` with its documented parameters overridden by params."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown scenario {name!r}; available: {', '.join(_REGISTRY)}")
    cls = _REGISTRY[name]
    valid = {f.name for f in fields(cls)}
    unknown = set(params) - valid
    if unknown:
        raise ValueError(f"scenario {name}: unknown parameter(s) {', '.join(sorted(unknown))}; "
                         f"valid: {', '.join(sorted(valid))}")
    scenario = cls(**params)
    scenario.validate()
    return scenario


__all__ = ["Population", "Scenario", "TrialShape", "available", "create", "describe", "participation_ratio"]
