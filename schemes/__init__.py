"""KV-cache codecs: `available()` lists the registered names, `create(name, ...)` builds one.

Every module of this package is imported here, so a codec file that calls `register` is
registered by existing — but the compiled CPU loops (`*_cpu` modules, numba: most of a second to
import), which register nothing and are imported where a computation takes them
(kvcommon/compiled.py), so a run on CUDA never loads numba. The `reference` subpackage
(independent NumPy implementations) is not part of this registry.
"""
import importlib
import pkgutil

from .base import BitLedger, Encoded, Scheme
from .registry import available, create, is_registered, register, specs, unavailable

# The codec families in DESIGN.md's order (this fixes the order of `available()`), then the rest.
_FIRST = ("turboquant", "spectralquant", "shard", "baselines")
_modules = [m.name for m in pkgutil.iter_modules(__path__) if not m.ispkg and not m.name.endswith("_cpu")]
for _name in sorted(_modules, key=lambda n: (_FIRST.index(n) if n in _FIRST else len(_FIRST), n)):
    importlib.import_module(f"{__name__}.{_name}")

__all__ = ["BitLedger", "Encoded", "Scheme", "available", "create", "register", "specs", "unavailable", "is_registered"]
