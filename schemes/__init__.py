"""KV-cache codecs: `available()` lists the registered names, `create(name, ...)` builds one."""
from . import turboquant  # noqa: F401  (registers the built-in schemes)
from .base import BitLedger, Encoded, Scheme
from .registry import available, create, specs

__all__ = ["BitLedger", "Encoded", "Scheme", "available", "create", "specs"]
