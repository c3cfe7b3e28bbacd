"""What a run records about where it ran and on what: versions, git SHA, device, host, times,
and a digest of every input file its scenarios read (replay captures, fitted specs), so that a
resume on a changed file is refused (check_inputs) instead of mixing two files' trials in a cell."""
from __future__ import annotations

import datetime
import hashlib
import platform
import subprocess
from importlib import metadata
from pathlib import Path

from .store import InputChanged


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def git_sha() -> str | None:
    """The commit of the source tree kvharness runs from (with '-dirty' when it has local edits)."""
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def package_version() -> str:
    try:
        return metadata.version("kvharness")
    except metadata.PackageNotFoundError:
        return "unknown"


def provenance(device) -> dict:
    """The versions, host and device a run records in its manifest (torch, NumPy and SciPy imported
    here: a report, which imports this module for `now`, needs none of them)."""
    import numpy
    import scipy
    import torch

    info = {
        "kvharness": package_version(), "git_sha": git_sha(), "python": platform.python_version(),
        "torch": torch.__version__, "numpy": numpy.__version__, "scipy": scipy.__version__,
        "platform": platform.platform(), "processor": platform.machine(), "device": str(device),
        "torch_threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def input_files(scenario_names) -> dict[str, Path]:
    """The files a sweep's scenarios read: the source of each parametric scenario that names a
    file (replay:FILE, fitted:SPEC.json, a plug-in's PREFIX:FILE), keyed by the source as named
    (relative to the working directory, as the scenario opens it)."""
    import scenarios
    files = {}
    for name in scenario_names:
        cls, source, _ = scenarios.parse(name)
        if getattr(cls, "parametric", False) and source and Path(source).is_file():
            files[source] = Path(source)
    return files


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def input_digests(scenario_names) -> dict[str, dict]:
    """{source: {"sha256", "bytes"}} of every input file (input_files), for the manifest's `inputs`."""
    return {source: {"sha256": sha256(path), "bytes": path.stat().st_size}
            for source, path in input_files(scenario_names).items()}


def check_inputs(manifest: dict, scenario_names) -> None:
    """InputChanged (one line naming the file) when an input file's sha256 differs from the one the
    manifest recorded when the run began. A manifest written before inputs were recorded (no
    `inputs`), or a file it does not name, is not checked: older runs still resume."""
    recorded = manifest.get("inputs")
    if not isinstance(recorded, dict):
        return
    for source, path in input_files(scenario_names).items():
        then = recorded.get(source)
        if not isinstance(then, dict) or not isinstance(then.get("sha256"), str):
            continue
        digest = sha256(path)
        if digest != then["sha256"]:
            raise InputChanged(f"input file {source} is not the one this run began with (sha256 {then['sha256'][:12]}... "
                               f"in manifest.json, {digest[:12]}... now): resuming would mix trials of two files in "
                               f"one cell; put the original back, or run again into a new --out")
