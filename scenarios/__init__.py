"""Scenario generators: `available()` lists the names, `create(name, **params)` builds one.

A scenario module registers its classes with `register`; every module of this package is
imported here, so a new scenario is one new file. A parametric scenario (class attribute
`parametric = True`, a `source` field) is named `PREFIX:ARGUMENT`, e.g. `replay:FILE`.

A name may set the scenario's documented parameters after colons, `NAME:KEY=VALUE[:KEY=VALUE]`
(`heavy_tail:dof=3`, `lowrank_aligned:rank=4:noise=0.05`, `replay:FILE:layer=2`): the whole
string is the scenario's name in the sweep, the store and the report, so cells with other
parameters are other cells with their own data streams.
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import fields

from kvcommon.registry import Registry

from .base import Population, Scenario, TrialShape, participation_ratio

_REGISTRY: Registry[type[Scenario]] = Registry("scenario")


def register(cls: type[Scenario]) -> type[Scenario]:
    _REGISTRY.add(cls.name, cls)
    return cls


def available() -> list[str]:
    """Concrete scenario names (what `all` means); parametric ones are listed by `parametric()`."""
    return [n for n, c in _REGISTRY.as_dict().items() if not getattr(c, "parametric", False)]


def parametric() -> list[str]:
    return [f"{n}:{c.source_hint}" for n, c in _REGISTRY.as_dict().items() if getattr(c, "parametric", False)]


def _lookup(name: str) -> type[Scenario]:
    cls = _REGISTRY.get(name.split(":", 1)[0])
    if cls is None:
        raise ValueError(_REGISTRY.unknown(name, available() + parametric()))
    return cls


def describe(name: str) -> str:
    return _lookup(name).description


def _typed(cls: type[Scenario], key: str, text: str):
    """A parameter's value from its text, as the type of the field's default."""
    default = next(f.default for f in fields(cls) if f.name == key)
    kind = type(default)
    if kind in (int, float) and (not text.isascii() or "_" in text):
        raise ValueError(f"scenario {cls.name}: parameter {key}={text!r} is not a plain {kind.__name__} (ASCII "
                         f"digits, no separators)")
    try:
        if kind is bool:
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return text.lower() in ("true", "1")
        return kind(text)
    except ValueError:
        raise ValueError(f"scenario {cls.name}: parameter {key}={text!r} is not a {kind.__name__}") from None


def parse(name: str) -> tuple[type[Scenario], str, dict]:
    """(class, source argument or '', parameters) of a scenario name (module doc)."""
    cls = _lookup(name)
    parts = name.split(":")[1:]
    argument = ""
    if getattr(cls, "parametric", False):
        if not parts or not parts[0] or "=" in parts[0]:
            raise ValueError(f"scenario {cls.name} needs its {cls.source_hint}: {cls.name}:{cls.source_hint}")
        argument, parts = parts[0], parts[1:]
    valid = sorted({f.name for f in fields(cls)} - {"source"})
    params = {}
    for part in parts:
        key, eq, text = part.partition("=")
        if not eq or not key:
            raise ValueError(f"scenario {name!r}: {part!r} is not KEY=VALUE; valid keys: {', '.join(valid)}")
        if key not in valid:
            raise ValueError(f"scenario {cls.name}: unknown parameter {key!r}; valid: {', '.join(valid)}")
        if key in params:
            raise ValueError(f"scenario {name!r}: parameter {key} is given twice")
        params[key] = _typed(cls, key, text)
    return cls, argument, params


def create(name: str, **params) -> Scenario:
    """The scenario `name` (parameters after colons included, module doc) with its documented
    parameters further overridden by params."""
    cls, argument, from_name = parse(name)
    valid = {f.name for f in fields(cls)} - {"source"}
    unknown = set(params) - valid
    if unknown:
        raise ValueError(f"scenario {cls.name}: unknown parameter(s) {', '.join(sorted(unknown))}; "
                         f"valid: {', '.join(sorted(valid))}")
    params = {**from_name, **params}
    scenario = cls(source=argument, **params) if argument else cls(**params)
    scenario.validate()
    return scenario


# DESIGN.md's six synthetic scenarios first (this fixes the order of `available()`), then the rest.
for _name in sorted((m.name for m in pkgutil.iter_modules(__path__) if m.name != "base"),
                    key=lambda n: (n != "synthetic", n)):
    importlib.import_module(f"{__name__}.{_name}")

__all__ = ["Population", "Scenario", "TrialShape", "available", "create", "describe", "parametric", "parse",
           "participation_ratio", "register"]
