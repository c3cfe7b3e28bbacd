"""A PNG screenshot of a report page, taken by headless Chromium (Debian's `chromium`)."""
from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

# No network and no background services: this workplace's machines have no outside network,
# and the report is self-contained.
_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
          "--disable-background-networking", "--disable-component-update", "--disable-sync")


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def screenshot(html: Path, png: Path, *, width: int = 1280, height: int = 6000, timeout: float = 120) -> Path:
    """Render `html` at width × height CSS pixels into `png`; RuntimeError naming the problem otherwise."""
    exe = chromium()
    if exe is None:
        raise RuntimeError("a screenshot needs Debian's chromium: apt-get install chromium")
    with tempfile.TemporaryDirectory() as profile:
        done = subprocess.run([exe, *_FLAGS, f"--user-data-dir={profile}", f"--screenshot={png}",
                               f"--window-size={width},{height}", Path(html).resolve().as_uri()],
                              capture_output=True, text=True, timeout=timeout)
    if not Path(png).exists():
        raise RuntimeError(f"chromium wrote no screenshot (exit {done.returncode}): {done.stderr.strip()[-300:]}")
    return Path(png)
