"""KV-cache codecs: `available()` lists the registered names, `create(name, ...)` builds one.

Every module of this package is imported here, so a codec file that calls `register` is
registered by existing; the `reference` subpackage (independent NumPy implementations) is
not part of this registry.
"""
import importlib
import pkgutil

from .base import BitLedger, Encoded, Scheme
from .registry import available, create, register, specs

for _module in pkgutil.iter_modules(__path__):
    if not _module.ispkg:
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["BitLedger", "Encoded", "Scheme", "available", "create", "register", "specs"]
