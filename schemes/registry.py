"""The one registry of schemes and the one way a codec is built (`build`, `create`).

A codec is registered in one of two ways: a module of this repository calls `register(name,
factory, description)` (with impl="reference" for the independent NumPy implementation of a
name, schemes/reference/), a third-party package declares an entry point in the group
`kvharness.schemes` (name = scheme name, value = a Scheme subclass or a factory; one that wraps a
built-in may declare whose random draws it shares with a `seed_family` attribute, see
plugin_family). A factory is
`make(budget=, dim=, seed=, **options)` returning a Scheme; `build` is the one place a factory
is called (by the sweep, `validate`, the conformance checks, `reproduce`, `effect`): it checks
budget, dim and seed, sets the codec's RNG family (Scheme.rng) and validates it. Families that
come from an optional package (`kvpress:<PressClass>`) are loaded through `register_namespace`:
a loader run on first use, so that importing the package (seconds, for kvpress and
transformers) is paid only by a command that needs its names. A namespace whose package is
missing is listed by `unavailable()` with the reason, and so is each member that cannot run
here."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

from kvcommon import plugins
from kvcommon.registry import IMPLS, Registry
from kvcommon.rng import seed_sequence

from .base import Scheme

ENTRY_POINT_GROUP = "kvharness.schemes"
MIN_BUDGET, MAX_BUDGET = 1, 8


@dataclass(frozen=True)
class SchemeSpec:
    name: str
    factory: Callable[..., Scheme]
    description: str
    family: str = ""    # variants of one family share their random draws (seed_family); "" = the name


@dataclass(frozen=True)
class Namespace:
    """Schemes named `prefix:<member>` from an optional package. load() returns (specs, not
    runnable: {name: reason}) or raises ImportError when the package is not installed."""
    prefix: str
    load: Callable[[], tuple[dict[str, SchemeSpec], dict[str, str]]]
    missing: str   # what to install, said when the package is absent


_BUILTIN: Registry[SchemeSpec] = Registry("scheme")
_REFERENCE: Registry[SchemeSpec] = Registry("scheme", " for the reference implementation")
_plugins: dict[str, SchemeSpec] | None = None
_broken_plugins: dict[str, str] = {}   # entry points that could not be loaded, with the reason
_NAMESPACES: dict[str, Namespace] = {}
_loaded: dict[str, tuple[dict[str, SchemeSpec], dict[str, str]]] = {}


def register(name: str, factory: Callable[..., Scheme], description: str = "", *, family: str = "",
             impl: str = "torch") -> None:
    """Add a built-in scheme; names are canonical lowercase and unique. family: see seed_family.
    impl="reference": the independent NumPy implementation of a torch codec's name (--impl
    reference). description: the factory's first docstring line when empty."""
    _registry(impl).add(name, _spec(name, factory, description, family))


def _spec(name: str, factory: Callable[..., Scheme], description: str, family: str) -> SchemeSpec:
    """The registry entry; description: the factory's first docstring line when empty."""
    description = description or (getattr(factory, "__doc__", None) or "scheme").strip().splitlines()[0]
    return SchemeSpec(name, factory, description, family)


def _registry(impl: str) -> Registry[SchemeSpec]:
    """The registry of an implementation (its codecs registered on import)."""
    if impl == "torch":
        return _BUILTIN
    if impl == "reference":
        try:
            from . import reference   # its modules list their factories on import
        except ImportError as exc:
            raise ValueError(f"the reference implementation is unavailable here ({exc}); valid: torch") from None
        for name, (factory, description) in reference.FACTORIES.items():
            if name not in _REFERENCE:
                _REFERENCE.add(name, _spec(name, factory, description, ""))
        return _REFERENCE
    raise ValueError(f"unknown implementation {impl!r}; valid: {', '.join(IMPLS)}")


def register_variant(name: str, cls: type[Scheme], description: str, *, family: str = "", **fixed) -> None:
    """Register `name` as `cls` with some constructor options fixed (a variant of a family);
    the instance carries the variant's name. family: see seed_family."""
    def make(*, budget: int, dim: int, seed: int = 0, **options) -> Scheme:
        scheme = cls(budget=budget, dim=dim, seed=seed, **fixed, **options)
        scheme.name = name
        return scheme
    make.__doc__ = description
    register(name, make, description, family=family)


@contextlib.contextmanager
def registered(entries):
    """Register the SchemeSpecs `entries` as built-ins for the block only: inside it they are
    schemes like any other (the sweep, `validate` and `compare` find them by name); on exit,
    exceptions included, they are taken out again, so nothing stays registered (the known-answer
    benchmark's bugged codecs, harness/known_answers.py). A name that is taken is refused."""
    added = []
    try:
        for entry in entries:
            register(entry.name, entry.factory, entry.description, family=entry.family)
            added.append(entry.name)
        yield
    finally:
        for name in reversed(added):
            _BUILTIN.remove(name)


def register_namespace(prefix: str, load, missing: str) -> None:
    """Add a family of schemes named `prefix:<member>`, loaded on first use (see Namespace)."""
    if prefix in _NAMESPACES or not prefix or ":" in prefix:
        raise ValueError(f"namespace {prefix!r} is empty, contains ':' or is taken")
    _NAMESPACES[prefix] = Namespace(prefix, load, missing)


def _load_namespace(prefix: str) -> tuple[dict[str, SchemeSpec], dict[str, str]]:
    if prefix not in _loaded:
        ns = _NAMESPACES[prefix]
        try:
            _loaded[prefix] = ns.load()
        except ImportError as exc:
            _loaded[prefix] = ({}, {f"{prefix}:*": f"{ns.missing} ({exc})"})
    return _loaded[prefix]


def _load_plugins() -> dict[str, SchemeSpec]:
    """The entry points of ENTRY_POINT_GROUP that load to a Scheme subclass or a callable factory;
    one that fails to import or loads to anything else is left out and listed by unavailable()
    with the reason, so a broken third-party package costs only its own name."""
    global _plugins
    if _plugins is None:
        _plugins = {}
        _broken_plugins.clear()
        for ep in plugins.entry_points(ENTRY_POINT_GROUP):
            if ep.name in _BUILTIN:
                continue  # a plug-in never shadows a built-in
            where = getattr(ep, "value", ep.name)
            try:
                factory = ep.load()
            except Exception as exc:  # noqa: BLE001 - any failure of a third-party import
                _broken_plugins[ep.name] = f"plug-in {where} failed to load: {type(exc).__name__}: {exc}"
                continue
            if isinstance(factory, type) and not issubclass(factory, Scheme) or not callable(factory):
                _broken_plugins[ep.name] = (f"plug-in {where} is {type(factory).__name__} {factory!r}, not a "
                                            f"Scheme subclass or a factory returning a Scheme")
                continue
            try:
                family = plugin_family(ep.name, factory)
            except ValueError as exc:
                _broken_plugins[ep.name] = f"plug-in {where}: {exc}"
                continue
            doc = (getattr(factory, "__doc__", None) or "third-party scheme").strip().splitlines()[0]
            _plugins[ep.name] = SchemeSpec(ep.name, factory, doc, family)
    return _plugins


def seed_families() -> list[str]:
    """The seed families a plug-in may declare: each built-in codec's (seed_family), sorted."""
    return sorted({spec.family or spec.name for spec in _BUILTIN.as_dict().values()})


def plugin_family(name: str, factory) -> str:
    """The seed family an entry point's Scheme subclass or factory declares with its attribute
    `seed_family` ("" where it declares none: the plug-in draws under its own name). A plug-in that
    wraps a built-in (tq-kv, say) declares that codec's family (`seed_family = "tq"`), so that it
    draws the same rotations and sketches as the codec on the same data and `validate --against`
    pairs the two on the codecs' own randomness too, as the built-in variants of a family are
    paired. ValueError naming the valid families for a family no built-in has."""
    family = getattr(factory, "seed_family", "")
    if family in ("", None):
        return ""
    valid = seed_families()
    if not isinstance(family, str) or family not in valid:
        raise ValueError(f"seed_family {family!r} of {name!r} is no built-in codec's; valid: {', '.join(valid)}")
    return family


def reload_plugins() -> None:
    """Forget the loaded entry points: the next look-up reads the installed packages again (a
    package installed or removed while this process runs: harness/known_answers.py)."""
    global _plugins
    _plugins = None
    _broken_plugins.clear()


def specs() -> dict[str, SchemeSpec]:
    """Every registered scheme, built-ins first, in registration order, then plug-ins and the
    runnable members of each namespace."""
    out = {**_BUILTIN.as_dict(), **_load_plugins()}
    for prefix in _NAMESPACES:
        out.update(_load_namespace(prefix)[0])
    return out


def unavailable() -> dict[str, str]:
    """Names that are known but cannot run here, each with a one-line reason: entry-point plug-ins
    that failed to load or load to no scheme, a namespace whose package is not installed (as
    `prefix:*`) and the members a namespace cannot run."""
    _load_plugins()
    out = dict(_broken_plugins)
    for prefix in _NAMESPACES:
        out.update(_load_namespace(prefix)[1])
    return out


def spec(name: str) -> SchemeSpec | None:
    """The spec of one name, loading only what it needs: a built-in without importing any
    optional package, a `prefix:member` with only its namespace; None for an unknown name."""
    if name in _BUILTIN:
        return _BUILTIN.get(name)
    prefix = name.split(":", 1)[0] if ":" in name else None
    if prefix in _NAMESPACES:
        return _load_namespace(prefix)[0].get(name)
    return _load_plugins().get(name)


def seed_family(name: str) -> str:
    """The name the runner derives a scheme's seed from (codec_seed): its family
    where it declares one (a built-in's `family`, a plug-in's `seed_family`), else the name itself. The variants of a family at one budget and d
    then draw the same randomness for a tensor they code alike (common random numbers): tq-kv
    and tq-kqv rotate K with the same signs, so K's codes, and every K-only metric, are equal,
    and the pair differs only in what the variants do differently (V's sketch)."""
    found = spec(name)
    return (found.family if found is not None else "") or name


def codec_seed(root_seed: int, name: str, budget: int, dim: int) -> int:
    """The seed of the codec `name`'s own draws in a sweep of root seed `root_seed` (the sweep's
    codec seed) at this budget and head dimension: derived from its seed family (seed_family), so
    the variants of a family draw alike."""
    return int(seed_sequence(root_seed, "scheme", seed_family(name), budget, dim).generate_state(1)[0])


def is_registered(name: str) -> bool:
    """Whether `name` is a runnable scheme, loading only what it needs (see spec)."""
    return spec(name) is not None


def unavailable_reason(name: str) -> str | None:
    """Why a known name cannot run here (its namespace's package missing, the member itself, or a
    plug-in that failed to load),
    None for a runnable or an unknown name."""
    if ":" not in name or name.split(":", 1)[0] not in _NAMESPACES:
        _load_plugins()
        return _broken_plugins.get(name)
    prefix = name.split(":", 1)[0]
    reasons = _load_namespace(prefix)[1]
    return reasons.get(name) or reasons.get(f"{prefix}:*")


def unknown_message(name: str) -> str:
    """Why `name` is not a scheme: the reason it cannot run here, or the available names."""
    reason = unavailable_reason(name)
    if reason:
        return f"scheme {name!r} cannot run here: {reason}"
    return _BUILTIN.unknown(name, specs())


def available(families: bool = True) -> list[str]:
    """Every runnable scheme name; families=False leaves out the members of the optional-package
    families (kvpress:<Press>), as the CLI's `all` does: those are asked for by name."""
    return list(specs()) if families else [*_BUILTIN.names(), *_load_plugins()]


def all_schemes() -> list[str]:
    """What `all` means on the command line: the built-in codecs and entry-point plug-ins."""
    return available(families=False)


def build(factory: Callable[..., Scheme], *, budget: int, dim: int, seed: int = 0, rng: str | None = None,
          label: str = "", **options) -> Scheme:
    """The codec factory(budget=, dim=, seed=, **options) returns, built as every caller builds
    a codec: budget in MIN_BUDGET..MAX_BUDGET, dim positive and seed non-negative checked first;
    then its RNG family set (rng: the sweep's --rng; None leaves the codec's own) and
    scheme.validate() called. A factory is never handed rng: a codec reads self.rng where it
    draws, not in its constructor. ValueError naming what is valid otherwise (label: the
    codec's name, for the messages)."""
    if isinstance(budget, bool) or not isinstance(budget, int) or not MIN_BUDGET <= budget <= MAX_BUDGET:
        raise ValueError(f"budget {budget!r} is outside {MIN_BUDGET}..{MAX_BUDGET} bits per element")
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise ValueError(f"head dimension {dim!r} must be a positive integer")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed {seed!r} must be a non-negative integer")
    scheme = factory(budget=budget, dim=dim, seed=seed, **options)
    if not isinstance(scheme, Scheme):
        raise ValueError(f"{f'scheme {label!r}: its' if label else 'the'} factory returned {type(scheme).__name__}, "
                         f"not a Scheme (schemes.base.Scheme)")
    if rng is not None:
        scheme.rng = rng
    scheme.validate()
    return scheme


def create(name: str, *, budget: int, dim: int, seed: int = 0, rng: str | None = None, impl: str = "torch",
           **options) -> Scheme:
    """A ready scheme for one configuration of a registered name, in implementation impl (torch,
    or the NumPy reference), built by `build`; ValueError naming what is valid otherwise."""
    if impl == "torch":
        found = spec(name)
        if found is None:
            raise ValueError(unknown_message(name))
    else:
        found = _registry(impl).lookup(name)
    return build(found.factory, budget=budget, dim=dim, seed=seed, rng=rng, label=name, **options)


def reference_specs() -> dict[str, SchemeSpec]:
    """The NumPy reference's schemes, in registration order (--impl reference)."""
    return _registry("reference").as_dict()
