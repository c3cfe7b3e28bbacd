"""The example plug-in packages under examples/, imported as their installed packages are: by
module name from a folder on sys.path (CI installs the packages themselves into a clean venv).
Imported by name, so a separate process (the sweep decodes a plug-in's stored bytes in one,
schemes.conformance.decode_elsewhere) imports the same module, as it would an installed one."""
import importlib
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(package: str, module: str):
    """The module `module` of examples/<package>, imported by name (once: Python caches it)."""
    folder = str(EXAMPLES / package)
    if folder not in sys.path:
        sys.path.append(folder)
    return importlib.import_module(module)
