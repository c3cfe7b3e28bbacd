"""Each report figure rasterised once, for both outputs: the PDF draws it at FIGURE_PPI, scaled to
fit its page (page_scale), and the HTML at PNG_DPI; the HTML's image is the page render
downsampled where that is at least as fine, so a figure is drawn once, not twice (drawing each
twice took 14 of the 36 s of the quick reproduction's report)."""
from __future__ import annotations

import io
import weakref

import matplotlib
import matplotlib.pyplot as plt
from PIL import Image

from .figures import PAGE_FIGURE_BOX

# The area of a landscape page a figure may take (inches; below the title, above the caption)
# and the resolution it is drawn at there; the HTML's resolution.
FIGURE_BOX, FIGURE_PPI = PAGE_FIGURE_BOX, 200
PNG_DPI = 110
# the least resolution a figure is drawn at: a figure so large that fitting its page would draw it
# coarser (a grid of scores of panels) is drawn at this and shrunk on the page, since FreeType
# cannot set text below about a pixel per em (a crash, not a blur)
MIN_PPI = 36
# a report figure is drawn with math text on, for its log axes' 10^k tick labels (its names are
# escaped, figures.literal)
FIGURE_RC = {"text.parse_math": True}

_PAGE_RENDERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_BOXES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _tight_box(figure):
    """The figure's tight bounding box (inches), padded as savefig pads it, measured once: passed
    to savefig, it spares the draw that bbox_inches="tight" makes to measure it again."""
    if figure not in _BOXES:
        with plt.rc_context(FIGURE_RC):
            _BOXES[figure] = figure.get_tightbbox().padded(matplotlib.rcParams["savefig.pad_inches"])
    return _BOXES[figure]


def page_scale(figure) -> float:
    """The factor a figure is drawn at on its PDF page: it fits FIGURE_BOX, never enlarged."""
    box = _tight_box(figure)
    return min(1.0, FIGURE_BOX[0] / box.width, FIGURE_BOX[1] / box.height)


def _render(figure, dpi: float) -> Image.Image:
    buf = io.BytesIO()
    with plt.rc_context(FIGURE_RC):
        figure.savefig(buf, format="png", dpi=dpi, bbox_inches=_tight_box(figure))
    buf.seek(0)
    return Image.open(buf).convert("RGB")


def page_size(figure) -> tuple[float, float]:
    """(width, height) in inches that the figure takes on its PDF page: its tight box × page_scale."""
    box, scale = _tight_box(figure), page_scale(figure)
    return box.width * scale, box.height * scale


def page_image(figure) -> tuple[Image.Image, float]:
    """The figure as drawn for its PDF page (an RGB image) and the dots per figure inch it was drawn
    at (FIGURE_PPI × page_scale, at least MIN_PPI); drawn once per figure."""
    if figure not in _PAGE_RENDERS:
        dpi = max(FIGURE_PPI * page_scale(figure), MIN_PPI)
        _PAGE_RENDERS[figure] = (_render(figure, dpi), dpi)
    return _PAGE_RENDERS[figure]


def html_png(figure) -> bytes:
    """The figure as PNG at PNG_DPI: the page render downsampled (Lanczos) where it is at least as
    fine, else drawn at PNG_DPI."""
    image, dpi = page_image(figure)
    if dpi >= PNG_DPI:
        size = tuple(max(1, round(n * PNG_DPI / dpi)) for n in image.size)
        image = image.resize(size, Image.Resampling.LANCZOS)
    else:
        image = _render(figure, PNG_DPI)
    buf = io.BytesIO()
    image.save(buf, format="PNG", optimize=False)
    return buf.getvalue()
