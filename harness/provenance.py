"""What a run records about where it ran: versions, git SHA, device, host, times."""
from __future__ import annotations

import datetime
import platform
import subprocess
from importlib import metadata
from pathlib import Path

import numpy
import scipy
import torch


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


def provenance(device: torch.device) -> dict:
    info = {
        "kvharness": package_version(), "git_sha": git_sha(), "python": platform.python_version(),
        "torch": torch.__version__, "numpy": numpy.__version__, "scipy": scipy.__version__,
        "platform": platform.platform(), "processor": platform.machine(), "device": str(device),
        "torch_threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info
