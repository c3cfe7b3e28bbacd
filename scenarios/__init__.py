"""Scenario generators: `available()` lists the names, `create(name, **params)` builds one.

A scenario module registers its classes with `register`; every module of this package is
imported here, so a new scenario is one new file. A parametric scenario (class attribute
`parametric = True`, a `source` field) is named `PREFIX:ARGUMENT`, e.g. `replay:FILE`.

Third-party scenarios are Scenario subclasses published under the entry-point group
`kvharness.scenarios` (entry-point name = the class's `name`), loaded on first use; one that
fails to load is left out and listed by `unavailable()` with the reason. `scenarios.conformance.
check_scenario` is the shipped check a plug-in passes.

A name may set the scenario's documented parameters after colons, `NAME:KEY=VALUE[:KEY=VALUE]`
(`heavy_tail:dof=3`, `lowrank_aligned:rank=4:noise=0.05`, `replay:FILE:layer=2`): the whole
string is the scenario's name in the sweep, the store and the report, so cells with other
parameters are other cells with their own data streams.
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import fields

from kvcommon import plugins
from kvcommon.registry import Registry

from .base import Population, Scenario, TrialShape, participation_ratio

ENTRY_POINT_GROUP = "kvharness.scenarios"
_REGISTRY: Registry[type[Scenario]] = Registry("scenario")
_BUILTIN: set[str] = set()
_plugins_loaded = [False]
_broken: dict[str, str] = {}


def register(cls: type[Scenario]) -> type[Scenario]:
    _REGISTRY.add(cls.name, cls)
    return cls


def _load_plugins() -> None:
    """Register the Scenario subclasses of ENTRY_POINT_GROUP once (module doc); a plug-in never
    shadows a built-in."""
    if _plugins_loaded[0]:
        return
    _plugins_loaded[0] = True
    for ep in plugins.entry_points(ENTRY_POINT_GROUP):
        if ep.name in _REGISTRY:
            continue
        where = getattr(ep, "value", ep.name)
        try:
            cls = ep.load()
        except Exception as exc:  # noqa: BLE001 - any failure of a third-party import
            _broken[ep.name] = f"plug-in {where} failed to load: {type(exc).__name__}: {exc}"
            continue
        if not (isinstance(cls, type) and issubclass(cls, Scenario)):
            _broken[ep.name] = f"plug-in {where} is {type(cls).__name__} {cls!r}, not a Scenario subclass"
        elif cls.name != ep.name:
            _broken[ep.name] = f"plug-in {where} is named {cls.name!r}; its entry point must carry that name"
        else:
            _REGISTRY.add(ep.name, cls)


def reload_plugins() -> None:
    """Forget the loaded plug-ins and load them again on next use (tests; a new installation)."""
    for name in [n for n in _REGISTRY.names() if n not in _BUILTIN]:
        _REGISTRY._entries.pop(name)
    _broken.clear()
    _plugins_loaded[0] = False


def unavailable() -> dict[str, str]:
    """Plug-in scenarios that could not be loaded: name -> the reason."""
    _load_plugins()
    return dict(_broken)


def available() -> list[str]:
    """Concrete scenario names (what `all` means), built-ins first, then plug-ins; parametric ones
    are listed by `parametric()`."""
    _load_plugins()
    return [n for n, c in _REGISTRY.as_dict().items() if not getattr(c, "parametric", False)]


def parametric() -> list[str]:
    _load_plugins()
    return [f"{n}:{c.source_hint}" for n, c in _REGISTRY.as_dict().items() if getattr(c, "parametric", False)]


def _lookup(name: str) -> type[Scenario]:
    _load_plugins()
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
for _name in sorted((m.name for m in pkgutil.iter_modules(__path__) if m.name not in ("base", "conformance")),
                    key=lambda n: (n != "synthetic", n)):
    importlib.import_module(f"{__name__}.{_name}")
_BUILTIN.update(_REGISTRY.names())

__all__ = ["Population", "Scenario", "TrialShape", "available", "create", "describe", "parametric", "parse",
           "participation_ratio", "register", "reload_plugins", "unavailable"]
