"""The installed plug-ins of a kvharness entry-point group (`kvharness.schemes`,
`kvharness.scenarios`), unless switched off: with KVHARNESS_PLUGINS=0 no installed package is
loaded. The project's own test suite sets it (tests/conftest.py), so whatever third-party
packages a machine has installed never enter its sweeps; its tests of the plug-in route set it
back to 1."""
from __future__ import annotations

import os
from importlib import metadata

ENV = "KVHARNESS_PLUGINS"


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def entry_points(group: str) -> list:
    """The entry points of `group` (none when plug-ins are switched off)."""
    return list(metadata.entry_points(group=group)) if enabled() else []
