"""The example plug-in packages under examples/, loaded from their files as their packages publish
them (CI installs the packages themselves into a clean venv)."""
import functools
import importlib.util
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@functools.cache
def load_example(package: str, module: str):
    """The module `module` of examples/<package>, executed once."""
    spec = importlib.util.spec_from_file_location(module, EXAMPLES / package / f"{module}.py")
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded
