"""The installed plug-ins of a kvharness entry-point group (`kvharness.schemes`,
`kvharness.scenarios`), unless switched off: with KVHARNESS_PLUGINS=0 no installed package is
loaded. The project's own test suite sets it (tests/conftest.py), so whatever third-party
packages a machine has installed never enter its sweeps; its tests of the plug-in route set it
back to 1. `installed` puts a package's metadata on the import path for a block, as pip would
(the known-answer benchmark's plug-in codecs, harness/known_answers.py)."""
from __future__ import annotations

import contextlib
import importlib
import os
import sys
import tempfile
from importlib import metadata
from pathlib import Path

ENV = "KVHARNESS_PLUGINS"


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def entry_points(group: str) -> list:
    """The entry points of `group` (none when plug-ins are switched off)."""
    return list(metadata.entry_points(group=group)) if enabled() else []


@contextlib.contextmanager
def installed(package: str, group: str, points: dict[str, str]):
    """For the block: a distribution `package` installed, as `pip install` leaves one, whose
    entry points in `group` are `points` (name -> "module:attribute"; the modules must be
    importable), and plug-ins switched on. importlib.metadata finds it on sys.path like any
    installed package, so its entry points load through EntryPoint.load; on exit, exceptions
    included, the distribution and the setting are gone. A caller that caches the entry points
    it read (schemes.registry) reloads them on both sides of the block."""
    if any("=" in name or "\n" in name or not name.strip() for name in points):
        raise ValueError(f"entry-point names of {package!r} must be non-empty and hold no '=' or newline")
    before = os.environ.get(ENV)
    with tempfile.TemporaryDirectory(prefix="kvharness-plugin-") as root:
        info = Path(root) / f"{package.replace('-', '_')}-0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 0\n")
        (info / "entry_points.txt").write_text(f"[{group}]\n" + "".join(f"{n} = {v}\n" for n, v in points.items()))
        sys.path.insert(0, root)
        importlib.invalidate_caches()
        os.environ[ENV] = "1"
        try:
            yield
        finally:
            sys.path.remove(root)
            importlib.invalidate_caches()
            if before is None:
                os.environ.pop(ENV, None)
            else:
                os.environ[ENV] = before
