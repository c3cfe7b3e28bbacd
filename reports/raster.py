"""Each report figure rasterised exactly once, for both outputs. The PDF page shows it at
FIGURE_PPI, scaled to fit its page (page_scale), and the HTML at PNG_DPI: the figure is drawn
once at the finer of the two and each output is that drawing downsampled to its own resolution
(drawing the HTML's image apart from the page's took 14 of the 36 s of the quick reproduction's
report, and drew 4 of the main job's 7 figures twice, those whose page is coarser than PNG_DPI).

Its layout is computed once too: the tight box is measured once and handed to savefig (which
would measure it again by drawing the figure, for bbox_inches="tight"), and savefig is kept from
running a layout engine first (_render)."""
from __future__ import annotations

import io
import weakref

import matplotlib
import matplotlib.pyplot as plt
from matplotlib.layout_engine import PlaceHolderLayoutEngine
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

_DRAWINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
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


def page_dpi(figure) -> float:
    """Dots per figure inch of the figure's image on its PDF page: FIGURE_PPI × page_scale, at
    least MIN_PPI."""
    return max(FIGURE_PPI * page_scale(figure), MIN_PPI)


def page_size(figure) -> tuple[float, float]:
    """(width, height) in inches that the figure takes on its PDF page: its tight box × page_scale."""
    box, scale = _tight_box(figure), page_scale(figure)
    return box.width * scale, box.height * scale


def _render(figure, dpi: float) -> Image.Image:
    """The figure's tight box drawn at `dpi` as an RGB image: one draw."""
    if isinstance(figure.get_layout_engine(), PlaceHolderLayoutEngine):
        # tight_layout leaves this inert stand-in behind, and savefig draws a figure that has any
        # layout engine once more before drawing it, to run the engine: a second layout of every
        # text (0.45 of the 1.2 s of the main job's widest figure) for an engine that does
        # nothing; the layout is final once the figure is built
        figure.set_layout_engine(None)
    buf = io.BytesIO()
    with plt.rc_context(FIGURE_RC):
        # an uncompressed PNG: it is decoded at once (zlib's default level took 0.1 s of the 0.7 s of
        # the main job's widest figure); the HTML's PNG is compressed, once, in html_png
        figure.savefig(buf, format="png", dpi=dpi, bbox_inches=_tight_box(figure), pil_kwargs={"compress_level": 0})
    buf.seek(0)
    return Image.open(buf).convert("RGB")


def _drawing(figure) -> tuple[Image.Image, float]:
    """The figure's one drawing (an RGB image) and its dots per figure inch: the finer of its PDF
    page's resolution (page_dpi) and the HTML's (PNG_DPI), so that each output is it downsampled."""
    if figure not in _DRAWINGS:
        dpi = max(page_dpi(figure), PNG_DPI)
        _DRAWINGS[figure] = (_render(figure, dpi), dpi)
    return _DRAWINGS[figure]


def _downsampled(image: Image.Image, dpi: float, target: float, resample: Image.Resampling) -> Image.Image:
    """`image`, drawn at `dpi`, at `target` dots per inch; as it is where dpi <= target."""
    if dpi <= target:
        return image
    size = tuple(max(1, round(n * target / dpi)) for n in image.size)
    return image.resize(size, resample)


def page_image(figure) -> tuple[Image.Image, float]:
    """The figure as its PDF page shows it (an RGB image) and the dots per figure inch of that image
    (page_dpi): its one drawing, downsampled where the HTML's resolution drew it finer. Downsampled
    by area averages, which the PDF compresses about as well as a drawing at page_dpi (Lanczos'
    ringing made the main job's PDF 1.4 times as large)."""
    image, dpi = _drawing(figure)
    target = page_dpi(figure)
    return _downsampled(image, dpi, target, Image.Resampling.BOX), target


def html_png(figure) -> bytes:
    """The figure as PNG at PNG_DPI: its one drawing, downsampled (Lanczos) where the page's
    resolution drew it finer."""
    image, dpi = _drawing(figure)
    buf = io.BytesIO()
    _downsampled(image, dpi, PNG_DPI, Image.Resampling.LANCZOS).save(buf, format="PNG", optimize=False)
    return buf.getvalue()
