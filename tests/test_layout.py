"""The layout follows the data path: the packages import each other only downstream
(kvcommon ← scenarios, schemes, stats ← reports; harness drives them all), at module level or
inside a function (an import deferred to a call is still an arrow up a floor), and no module
imports one that imports it back, at module level or inside a function."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvcommon", "scenarios", "schemes", "stats", "reports", "harness")
# what each package may import at module level (the data path, DESIGN.md)
ALLOWED = {"kvcommon": set(), "scenarios": {"kvcommon"}, "schemes": {"kvcommon"}, "stats": {"kvcommon"},
           "reports": {"kvcommon", "stats"}, "harness": set(PACKAGES) - {"harness"}}


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path], *, anywhere: bool = False) -> set[str]:
    """The project modules `name` imports at module level, or with anywhere=True also inside
    functions and methods (every Import and ImportFrom node of the file)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    found = set()
    for node in [tree] if anywhere else tree.body:
        for n in ast.walk(node) if anywhere or isinstance(node, (ast.If, ast.Try)) else [node]:
            if isinstance(n, ast.Import):
                found |= {a.name for a in n.names if a.name.split(".")[0] in PACKAGES}
            elif isinstance(n, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - n.level + 1] if n.level else []
                target = ".".join(base + ([n.module] if n.module else []))
                for a in n.names:
                    found.add(f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target)
    return {m for m in found if m in modules and m != name}


def _upstream(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} imports {b}" for a, deps in graph.items() for b in deps
                  if b.split(".")[0] != a.split(".")[0] and b.split(".")[0] not in ALLOWED[a.split(".")[0]])


def test_packages_import_only_downstream_and_modules_form_no_cycle():
    modules = _modules()
    graph = {name: _imports(name, path, modules, anywhere=True) for name, path in modules.items()}
    upstream = _upstream(graph)
    assert not upstream, upstream

    def reaches(start, goal, seen):
        return any(d == goal or (d not in seen and not seen.add(d) and reaches(d, goal, seen)) for d in graph[start])
    cycles = sorted(name for name in graph if reaches(name, name, set()))
    assert not cycles, f"modules on an import cycle: {cycles}"


def test_the_store_imports_the_row_schema_and_nothing_else_of_the_project():
    """The run store keeps rows whose columns kvcommon/rows.py defines and raises its own errors
    (harness.store.StoreError, which the CLI maps to exit status 2): it imports neither the
    statistics, nor the sweep engine, nor the CLI's errors."""
    modules = _modules()
    assert _imports("harness.store", modules["harness.store"], modules) == {"kvcommon.rows"}


def test_an_import_inside_a_function_is_seen(tmp_path):
    """The walk sees an import wherever it is: in a function, a method, a nested block."""
    modules = _modules()
    source = tmp_path / "probe.py"
    source.write_text("import numpy\n\n\nclass A:\n    def f(self):\n        if True:\n"
                      "            from stats.metrics import METRIC_NAMES\n        return METRIC_NAMES\n\n\n"
                      "def g():\n    from harness import store\n    return store\n")
    assert _imports("schemes.probe", source, modules) == set()
    assert _imports("schemes.probe", source, modules, anywhere=True) == {"stats.metrics", "harness.store"}
    assert _upstream({"schemes.probe": {"stats.metrics", "harness.store", "kvcommon.rows"}}) == [
        "schemes.probe imports harness.store", "schemes.probe imports stats.metrics"]


# The tests mirror the modules in one flat folder: tests/test_<module>.py holds the tests of one
# module (<module> the last part of its path, or a package's name), tests/test_<topic>.py those of
# a behaviour that spans modules (shared coding, refusals, integrity, ...). Subfolders per package
# would add nothing a name does not say: the modules' last names are unique but for the commands
# of harness/commands/ named as the module they drive, and conformance and fitted (two packages each).
def _test_files() -> dict[str, Path]:
    return {path.stem: path for path in sorted((ROOT / "tests").glob("test_*.py"))}


def _misnamed(files: dict[str, Path], modules: dict[str, Path]) -> list[str]:
    """'test file -> expected name' for each test file that imports exactly one project module (the
    module it tests) and is not named after it."""
    out = []
    for stem, path in files.items():
        tested = _imports(f"tests.{stem}", path, modules, anywhere=True)
        if len(tested) == 1:
            expected = f"test_{next(iter(tested)).rsplit('.', 1)[-1]}"
            if stem != expected:
                out.append(f"{stem}.py -> {expected}.py")
    return out


def test_a_test_file_of_one_module_is_named_after_it():
    """Each test file that imports one project module only is tests/test_<that module>.py."""
    assert _misnamed(_test_files(), _modules()) == []


def test_the_naming_rule_sees_a_misnamed_file(tmp_path):
    """A file testing stats/energy.py alone under another name is reported; under its module's
    name, or importing two modules (a topic), it is not."""
    modules = _modules()
    for stem, text in (("test_stats_energy", "from stats.energy import energy_distance\n"),
                       ("test_energy", "def test_x():\n    from stats import energy\n"),
                       ("test_paired", "from stats.energy import energy_distance\nfrom stats import inference\n")):
        (tmp_path / f"{stem}.py").write_text(text)
    files = {path.stem: path for path in sorted(tmp_path.glob("test_*.py"))}
    assert _misnamed(files, modules) == ["test_stats_energy.py -> test_energy.py"]


def _probe_output(code: str) -> list[str]:
    """What a fresh interpreter running `code` (with the project on its path) prints, split into
    words; its standard error in the assertion message when it fails."""
    import os
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


def test_numba_loads_only_where_a_computation_takes_the_compiled_loops():
    """Importing the codecs and the CLI leaves numba (most of a second) unloaded, so a run on CUDA
    never pays it; a float32 TurboQuant encode on the CPU loads it (the fused pass takes it)."""
    probe = ("import sys, torch, schemes, harness.cli\n"
             "before = 'numba' in sys.modules\n"
             "s = schemes.create('tq-kv', budget=2, dim=64)\n"
             "s.decode(s.encode(torch.randn(1, 1, 8, 64), torch.randn(1, 1, 8, 64)))\n"
             "print(before, 'numba' in sys.modules)\n")
    assert _probe_output(probe) == ["False", "True"]


def test_codecs_off_the_compiled_loops_never_load_numba():
    """With the compiled loops switched off (what a CUDA tensor gets: compiled.takes is False),
    every built-in codec encodes, decodes and scores without importing numba."""
    probe = ("import sys, torch, schemes\n"
             "from kvcommon import compiled\n"
             "compiled.DTYPES = ()\n"
             "k, v, q = (torch.randn(2, 1, 16, 32) for _ in range(3))\n"
             "for name in ('tq-kv', 'tq-qkv', 'sq-kv', 'sq-qkv', 'shard', 'int4', 'kivi'):\n"
             "    s = schemes.create(name, budget=3, dim=32)\n"
             "    s.fit(k, v, trials=torch.arange(2)) if s.capabilities.fit_trials else s.fit(k, v)\n"
             "    enc = s.encode(k, v)\n"
             "    s.decode(enc); s.score(q, enc)\n"
             "print('numba' in sys.modules)\n")
    assert _probe_output(probe) == ["False"]


def test_the_metrics_load_numba_only_where_their_compiled_pass_takes_the_tensors():
    """stats.metrics imports its compiled pass (stats/metrics_cpu.py) only where
    kvcommon.compiled.takes says yes: with the loops switched off (what a CUDA tensor gets)
    trial_metrics leaves numba unloaded; on the CPU in float32 it loads it."""
    probe = ("import sys, torch\n"
             "from kvcommon import compiled\n"
             "from stats.metrics import exact_logits, trial_metrics\n"
             "k, v, q = (torch.randn(2, 1, 16, 32) for _ in range(3))\n"
             "compiled.DTYPES = ()\n"
             "trial_metrics(k, v, q, k + 0.1, v - 0.1, exact_logits(q, k + 0.1))\n"
             "off = 'numba' in sys.modules\n"
             "compiled.DTYPES = (torch.float32, torch.float64)\n"
             "trial_metrics(k, v, q, k + 0.2, v - 0.2, exact_logits(q, k + 0.2))\n"
             "print(off, 'numba' in sys.modules, 'stats.metrics_cpu' in sys.modules)\n")
    assert _probe_output(probe) == ["False", "True", "True"]
