"""A PNG screenshot of a whole report page, taken by headless Chromium (Debian's `chromium`).

Chromium's --screenshot captures the window, not the page, so the page's height is measured
first: a copy of the page with a small script that writes document.documentElement.scrollHeight
into the DOM, read back with --dump-dom at the same width. The screenshot is then taken at that
height (plus a margin), and the blank bottom cropped away with Pillow.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

# No network and no background services: this workplace's machines have no outside network,
# and the report is self-contained.
_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
          "--disable-background-networking", "--disable-component-update", "--disable-sync",
          "--hide-scrollbars")
_PROBE = ('<script>addEventListener("load",()=>{document.body.dataset.pageHeight='
          'Math.ceil(Math.max(document.documentElement.scrollHeight,document.body.scrollHeight))})</script></body>')
FALLBACK_HEIGHT = 20000  # CSS pixels, when the page cannot be measured
MAX_HEIGHT = 60000


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _run(exe: str, args: list[str], profile: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([exe, *_FLAGS, f"--user-data-dir={profile}", *args], capture_output=True, text=True,
                          timeout=timeout)


def page_height(html: Path, width: int, *, timeout: float = 120) -> int | None:
    """The page's full height in CSS pixels at `width`, as Chromium lays it out; None if unknown."""
    exe = chromium()
    if exe is None:
        return None
    text = Path(html).read_text(encoding="utf-8")
    if "</body>" not in text:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        probed = Path(tmp) / "probed.html"
        probed.write_text(text.replace("</body>", _PROBE, 1), encoding="utf-8")
        done = _run(exe, ["--dump-dom", f"--window-size={width},900", "--virtual-time-budget=5000",
                          probed.as_uri()], str(Path(tmp) / "profile"), timeout)
    found = re.search(r'data-page-height="(\d+)"', done.stdout)
    return int(found.group(1)) if found else None


def crop_blank_bottom(png: Path, margin: int = 16) -> None:
    """Cut the rows at the bottom that are all the colour of the bottom-right pixel (blank page
    below the content), keeping `margin` pixels of it."""
    import numpy as np
    from PIL import Image

    with Image.open(png) as image:
        pixels = np.asarray(image.convert("RGB"))
    content = np.nonzero((pixels != pixels[-1, -1]).any(axis=(1, 2)))[0]
    bottom = int(content.max()) + 1 + margin if content.size else 1
    if bottom < pixels.shape[0]:
        Image.fromarray(pixels[:bottom]).save(png)


def screenshot(html: Path, png: Path, *, width: int = 1280, height: int | None = None, timeout: float = 120) -> Path:
    """Render `html` at `width` CSS pixels and the page's full height (or `height`) into `png`;
    RuntimeError naming the problem otherwise."""
    exe = chromium()
    if exe is None:
        raise RuntimeError("a screenshot needs Debian's chromium: apt-get install chromium")
    if height is None:
        measured = page_height(html, width, timeout=timeout)
        height = min(MAX_HEIGHT, measured + 64) if measured else FALLBACK_HEIGHT
    with tempfile.TemporaryDirectory() as profile:
        done = _run(exe, [f"--screenshot={png}", f"--window-size={width},{height}", Path(html).resolve().as_uri()],
                    profile, timeout)
    if not Path(png).exists():
        raise RuntimeError(f"chromium wrote no screenshot (exit {done.returncode}): {done.stderr.strip()[-300:]}")
    crop_blank_bottom(Path(png))
    return Path(png)
