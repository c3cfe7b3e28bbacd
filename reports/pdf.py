"""The PDF report: matplotlib's PdfPages with text pages (the summary in sentences), table
pages (winners, every cell, provenance) and one page per figure. Every page is A4: text pages
portrait, tables and figures landscape, each figure scaled onto its page (never enlarged) as
an image at FIGURE_PPI, its title and caption as text. Fonts are embedded as TrueType
(pdf.fonttype 42) so the text can be searched and extracted."""
from __future__ import annotations

import contextlib
import functools
import os
import signal
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Callable

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.backends.backend_pdf import PdfPages  # noqa: E402
from matplotlib.font_manager import FontProperties  # noqa: E402
from matplotlib.table import Cell  # noqa: E402
from matplotlib.textpath import TextToPath  # noqa: E402

from .figures import ReportFigure  # noqa: E402
from .fitted import sections as fit_sections  # noqa: E402
from .raster import FIGURE_BOX, FIGURE_PPI, page_image, page_scale, page_size  # noqa: E402,F401  (page_scale: re-exported)
from stats.findings import Findings  # noqa: E402
from .narrative import (CLAIM_DETAIL_HEADER, CLAIM_HEADER, FRONT_HEADER, cell_header, cell_rows,  # noqa: E402
                        claim_detail_rows, claim_rows, crossover_header, crossover_rows, headline_header,
                        headline_rows, lede, method_sentence, setting_summaries, verdict_note,
                        winner_header, winner_rows)

PORTRAIT, LANDSCAPE = (8.27, 11.69), (11.69, 8.27)  # A4, inches
_NOTICE = {"color": "#a02000", "fontweight": "bold", "va": "top"}
_LINES_PER_PAGE, _WRAP = 62, 105
_ROWS_PER_PAGE = 30
# The pages' own text is plain (math text off: names are drawn as they are); a report figure is
# drawn with math text on (reports.raster).


def _text_pages(pdf: PdfPages, lines: list[tuple[str, str]]) -> None:
    """Flow (style, text) lines over portrait pages; style is 'h1', 'h2', 'h3' or 'p'."""
    wrapped = []
    for style, text in lines:
        width = _WRAP if style == "p" else 80
        for i, part in enumerate(textwrap.wrap(text, width) or [""]):
            wrapped.append((style, ("    " if style == "p" and i else "") + part))
        wrapped.append(("gap", ""))
    for start in range(0, len(wrapped), _LINES_PER_PAGE):
        fig = plt.figure(figsize=PORTRAIT)
        y = 0.96
        for style, text in wrapped[start:start + _LINES_PER_PAGE]:
            size = {"h1": 15, "h2": 12, "h3": 10}.get(style, 8)
            if text:
                fig.text(0.06, y, text, fontsize=size, fontweight="bold" if style != "p" else "normal",
                         va="top", family="DejaVu Sans")
            y -= 0.0145 if style != "gap" else 0.004
        pdf.savefig(fig)
        plt.close(fig)


# Tables: every cell's text fits its cell. A cell's text starts Cell.PAD of the cell's width in from
# its left edge; it may take _FILL of the width, so it ends short of the right edge too.
_TABLE_PT, _SMALLEST_PT = 6.5, 4.5   # the tables' font size, and the smallest it shrinks to
_FILL = 1 - 2 * Cell.PAD
_TABLE_BOX = (0.03, 0.03, 0.94, 0.88)   # a table page's table axes (figure fractions)
_MEASURE = TextToPath()


@functools.lru_cache(maxsize=1 << 16)
def _width_pt(text: str, size: float, bold: bool = False) -> float:
    """The drawn width of `text` (its widest line) in points at `size` points. Memoised: a table
    repeats its values (a scenario, a budget, a codec in every row) and table_layout measures each
    at every font size it tries, then again to wrap it, a FreeType layout each time (table_layout
    took 0.9 s of the main job's PDF, 0.3 s memoised and with _wrap's one-line case); the font is
    matplotlib's default family, which the report leaves as it is."""
    prop = FontProperties(size=size, weight="bold" if bold else "normal")
    return max((_MEASURE.get_text_width_height_descent(line, prop, ismath=False)[0] for line in text.split("\n")),
               default=0.0)


def _wrap(text: str, width_pt: float, size: float, bold: bool) -> str:
    """`text` broken at spaces into lines of at most width_pt (a single word longer than that
    stays whole: the column widths are chosen so that none is)."""
    one_line = " ".join(text.split())
    if _width_pt(one_line, size, bold) <= width_pt:
        # the greedy loop below would keep every word on this line: each of its prefixes draws
        # inside the whole line's box (its glyphs, at the same places)
        return one_line
    lines: list[str] = []
    for word in text.split():
        if lines and _width_pt(f"{lines[-1]} {word}", size, bold) <= width_pt:
            lines[-1] += f" {word}"
        else:
            lines.append(word)
    return "\n".join(lines)


def _column_needs(columns, size: float, part) -> list[float]:
    """Per column, the width in points its widest part(cell) needs (the header, first, in bold)."""
    return [max(_width_pt(part(v), size, bold=i == 0) for i, v in enumerate(col)) / _FILL for col in columns]


def table_layout(header, rows, width_pt: float, size: float = _TABLE_PT):
    """(column widths as fractions of width_pt, the header and rows with each cell wrapped to its
    column, the font size) such that every cell's text lies inside its cell: each column at least
    its longest word wide, the rest of the width shared out by how much more each column's longest
    text needs; the font shrinks (to _SMALLEST_PT) only where the longest words do not fit."""
    header = [str(h) for h in header]
    rows = [[str(v) for v in r] for r in rows]
    columns = list(zip(header, *rows))
    longest_word = lambda v: max(v.split(), key=len, default="")
    while True:
        natural = _column_needs(columns, size, lambda v: v)
        minimal = _column_needs(columns, size, longest_word)
        if sum(minimal) <= width_pt or size <= _SMALLEST_PT:
            break
        size = max(_SMALLEST_PT, size - 0.5)
    if sum(natural) <= width_pt:
        widths = [w * width_pt / sum(natural) for w in natural]
    else:
        spare, wanted = width_pt - sum(minimal), [n - m for n, m in zip(natural, minimal)]
        widths = [m + max(spare, 0) * w / sum(wanted) for m, w in zip(minimal, wanted)]
    wrap = lambda r, bold: [_wrap(v, w * _FILL, size, bold) for v, w in zip(r, widths)]
    return [w / width_pt for w in widths], wrap(header, True), [wrap(r, False) for r in rows], size


def _row_height_pt(row, size: float) -> float:
    return (max((v.count("\n") + 1 for v in row), default=1) * 1.25 + 0.8) * size


def _draw_table(ax, header, rows, widths, size: float, height_pt: float):
    """A table of wrapped cells filling ax's width from its top, each row as tall as its lines;
    height_pt is the axes' height in points."""
    table = ax.table(cellText=[list(r) for r in rows] or None, colLabels=list(header), loc="upper center",
                     cellLoc="left", colWidths=widths)
    table.auto_set_font_size(False)
    table.set_fontsize(size)
    all_rows = [header, *rows]
    for (row, _), cell in table.get_celld().items():
        cell.set_height(_row_height_pt(all_rows[row], size) / height_pt)
        if row == 0:
            cell.set_facecolor("#e6e6e6")
            cell.set_text_props(fontweight="bold")
    return table


def _table_pages(pdf: PdfPages, title: str, header, rows, notice: str | None = None) -> None:
    """A table over as many landscape pages as its rows need (each page as many rows as fit), header
    repeated, every cell's text wrapped inside its cell (table_layout); `notice` (a warning line)
    under the first page's title."""
    width_pt, height_pt = (LANDSCAPE[0] * _TABLE_BOX[2] * 72, LANDSCAPE[1] * _TABLE_BOX[3] * 72)
    widths, header, rows, size = table_layout(header, rows, width_pt)
    pages, page, used = [], [], _row_height_pt(header, size)
    for row in rows:
        h = _row_height_pt(row, size)
        if page and used + h > height_pt:
            pages.append(page)
            page, used = [], _row_height_pt(header, size)
        page.append(row)
        used += h
    pages.append(page)
    for number, chunk in enumerate(pages, 1):
        fig = plt.figure(figsize=LANDSCAPE)
        part = f" ({number}/{len(pages)})" if len(pages) > 1 else ""
        fig.text(0.04, 0.96, title + part, fontsize=12, fontweight="bold", va="top")
        if notice and number == 1:
            fig.text(0.04, 0.935, notice, fontsize=8, **_NOTICE)
        ax = fig.add_axes(_TABLE_BOX)
        ax.axis("off")
        _draw_table(ax, header, chunk or [["" for _ in header]], widths, size, height_pt)
        pdf.savefig(fig)
        plt.close(fig)


def _headline_pages(pdf: PdfPages, title: str, findings: Findings, figures: list[ReportFigure],
                    notice: str | None = None) -> int:
    """The report's first screen as its first page(s): per scenario, on one landscape page, the
    title and lede, the Pareto-front figure and the table of the best codec at each storage level;
    `notice` (an unfinished run's warning) in a line under the title. Returns the pages written."""
    header = headline_header(findings)
    n_pages = 0
    for f in figures:
        if not f.key.startswith("front-") or f.figure is None:
            continue
        scenario = f.key[len("front-"):]
        page = plt.figure(figsize=LANDSCAPE)
        page.text(0.04, 0.96, f"kvharness report: {title}", fontsize=15, fontweight="bold", va="top")
        if notice:
            page.text(0.04, 0.928, notice, fontsize=8, **_NOTICE)
        page.text(0.04, 0.915 - (0.02 if notice else 0), "\n".join(textwrap.wrap(lede(findings), 150)), fontsize=8,
                  va="top")
        image, _ = page_image(f.figure)   # drawn once for the HTML and the PDF (reports.raster)
        ax = page.add_axes([0.03, 0.2, 0.42, 0.62])
        ax.imshow(image)
        ax.set_anchor("N")
        ax.axis("off")
        page.text(0.48, 0.82, f"{scenario}: best codec at each storage level", fontsize=11, fontweight="bold",
                  va="top")
        box = (0.48, 0.2, 0.5, 0.58)
        table_ax = page.add_axes(box)
        table_ax.axis("off")
        rows = headline_rows(findings, scenario) or [tuple("—" for _ in header)]
        widths, wrapped_header, wrapped, size = table_layout(header, rows, LANDSCAPE[0] * box[2] * 72)
        _draw_table(table_ax, wrapped_header, wrapped, widths, size, LANDSCAPE[1] * box[3] * 72)
        unplaced = " ".join(x.unplaced for x in setting_summaries(findings).get(scenario, []) if x.unplaced)
        page.text(0.04, 0.12, "\n".join(textwrap.wrap(" ".join(filter(None, (f.caption, unplaced,
                                                                          verdict_note(findings)))), 170)),
                  fontsize=7, va="top")
        pdf.savefig(page)
        plt.close(page)
        n_pages += 1
    return n_pages


def _figure_page(pdf: PdfPages, f: ReportFigure) -> None:
    """One figure on an A4 landscape page: its title, the figure scaled to fit FIGURE_BOX (as an
    image of FIGURE_PPI on the page) and its caption."""
    image, _ = page_image(f.figure)
    width, height = page_size(f.figure)  # inches on the page
    page = plt.figure(figsize=LANDSCAPE)
    page.text(0.04, 0.96, f.title, fontsize=11, fontweight="bold", va="top")
    left = (LANDSCAPE[0] - width) / 2
    top = 0.7  # inches below the page's top edge
    ax = page.add_axes([left / LANDSCAPE[0], 1 - (top + height) / LANDSCAPE[1], width / LANDSCAPE[0],
                        height / LANDSCAPE[1]])
    ax.imshow(image, interpolation="none")
    ax.axis("off")
    if f.caption:
        page.text(0.04, 1 - (top + height + 0.12) / LANDSCAPE[1], "\n".join(textwrap.wrap(f.caption, 190)),
                  fontsize=7, va="top")
    pdf.savefig(page)
    plt.close(page)


# the pages' rc settings: TrueType fonts embedded (searchable text), plain text (no math text)
_PAGE_RC = {"pdf.fonttype": 42, "ps.fonttype": 42, "text.parse_math": False}


def _info(title: str) -> dict[str, str]:
    return {"Title": f"kvharness report: {title}", "Creator": "kvharness (python -m harness report)"}


def _parts(title: str, findings: Findings, figures: list[ReportFigure], provenance: list[tuple[str, str]],
           notice: str | None) -> list[tuple[bool, Callable[[PdfPages], None]]]:
    """The report's pages in order, in parts: (whether the part shows figures, a function writing
    its pages); `notice` (an unfinished run's 'incomplete: n of m cells ...') on the first page.
    `figures` is read when a part that shows them is written (pdf_beside fills it later)."""
    lines = [("h1", f"kvharness report: {title}"), ("h2", "Summary"), ("p", verdict_note(findings))]
    fronts = []
    for settings in setting_summaries(findings).values():
        for s in settings:
            fronts += [(s.label, *row) for row in s.front]
            if s.unplaced:
                lines.append(("p", f"{s.label}: {s.unplaced}"))
    lines += [("h2", "Method"), ("p", method_sentence(findings))]
    notice_shown = findings.claims is not None and notice is not None   # on the claims' first page
    # a headline page per scenario of the cells (figures.front_figure draws one for each)
    no_headline = findings.cells.scenario.nunique() == 0

    def claims(pdf):
        if findings.claims is not None:
            _table_pages(pdf, f"kvharness report: {title} — the AMD paper, claim by claim", CLAIM_HEADER,
                         claim_rows(findings), notice=notice)

    def headline(pdf):
        _headline_pages(pdf, title, findings, figures, None if notice_shown else notice)

    def tables(pdf):
        for _, section_title, header, rows, _ in fit_sections(findings):
            _table_pages(pdf, section_title, header, rows)
        _table_pages(pdf, "Best codec at each storage level (d₂(T), mean [95% CI])", winner_header(findings),
                     winner_rows(findings), notice=notice if no_headline and not notice_shown else None)
        _table_pages(pdf, "The Pareto front on measured storage, per setting", ("setting",) + FRONT_HEADER,
                     fronts)

    def text_and_figure_pages(pdf):
        absent = [f for f in figures if f.figure is None]
        shown = [("h2", "Figures not shown"), *[("p", f"{f.title}: {f.absent_reason}.") for f in absent]] if absent else []
        _text_pages(pdf, lines + shown)
        for f in figures:
            if f.figure is not None and not f.key.startswith("front-"):
                _figure_page(pdf, f)

    def details(pdf):
        _table_pages(pdf, "Every cell (mean [95% CI])", cell_header(findings), cell_rows(findings))
        if len(findings.crossovers):
            _table_pages(pdf, "Crossovers along the storage axis (Δ = mean d₂(T) of A − B)", crossover_header(findings),
                         crossover_rows(findings))
        if findings.claims is not None:
            _table_pages(pdf, "Claim details", CLAIM_DETAIL_HEADER, claim_detail_rows(findings))
        _table_pages(pdf, "Provenance", ("item", "value"), provenance)
    return [(False, claims), (True, headline), (False, tables), (True, text_and_figure_pages), (False, details)]


def write_pdf(path: Path, title: str, findings: Findings, figures: list[ReportFigure],
              provenance: list[tuple[str, str]], notice: str | None = None) -> None:
    """Write the whole report to `path` (the caller renames it into place), in this process;
    `notice` (an unfinished run's 'incomplete: n of m cells ...') on the first page."""
    with plt.rc_context(_PAGE_RC), PdfPages(path) as pdf:
        for _, write in _parts(title, findings, figures, provenance, notice):
            write(pdf)
        pdf.infodict().update(_info(title))


def _write_parts(parts, files, with_figures: bool) -> None:
    """Each part that shows figures (with_figures) or none into its own file; a part without
    pages writes none."""
    with plt.rc_context(_PAGE_RC):
        for (shows_figures, write), file in zip(parts, files):
            if shows_figures == with_figures:
                with PdfPages(file) as pdf:
                    write(pdf)


def _join(files, path: Path, info: dict[str, str]) -> None:
    from pypdf import PdfWriter
    writer = PdfWriter()
    for file in files:
        if file.exists():
            writer.append(str(file))
    writer.add_metadata({f"/{key}": value for key, value in info.items()})
    with open(path, "wb") as out:
        writer.write(out)


@contextlib.contextmanager
def pdf_beside(path: Path, title: str, findings: Findings, provenance: list[tuple[str, str]],
               notice: str | None = None):
    """write_pdf's file, written while the block runs; the block builds the figures, puts them
    in the list it is given and writes the HTML (which draws them). The parts that show no figure
    (tables: most of the PDF's time) are written in a forked process from the start, the figure
    and text pages in this one after the block, each figure's one drawing (reports.raster) shared
    with the HTML; the parts are then joined in order (pypdf). Where the platform cannot fork, or
    the forked process fails or runs past its time (_wait; it is then killed), its parts are
    written here."""
    figures: list[ReportFigure] = []
    if not hasattr(os, "fork"):
        yield figures
        write_pdf(path, title, findings, figures, provenance, notice)
        return
    parts = _parts(title, findings, figures, provenance, notice)
    with tempfile.TemporaryDirectory(prefix="kvharness-report-") as tmp:
        files = [Path(tmp) / f"part-{i}.pdf" for i in range(len(parts))]
        pid = os.fork()
        if pid == 0:   # the forked process: its parts, then out, never back into the caller
            status = 1
            try:
                _write_parts(parts, files, with_figures=False)
                status = 0
            finally:
                os._exit(status)
        started, status = time.monotonic(), None
        try:
            yield figures
            _write_parts(parts, files, with_figures=True)
            status = _wait(pid, max(_WAIT_LEAST_S, _WAIT_FACTOR * (time.monotonic() - started)))
        except BaseException:
            if status is None:   # not yet collected (once it is, its number may be another's)
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            raise
        if status != 0:
            _write_parts(parts, files, with_figures=False)
        _join(files, path, _info(title))


# How long the forked process may take beyond this one's share: a fork from a process whose other
# threads held a lock it then needs (a sweep's pools, in harness reproduce) could wait forever;
# its parts are then written here. Generous against its normal share (a third of the work).
_WAIT_LEAST_S, _WAIT_FACTOR = 60.0, 10.0


def _wait(pid: int, limit_s: float) -> int:
    """The forked process's exit status, or −1 (killed) once `limit_s` seconds have passed."""
    deadline = time.monotonic() + limit_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return -1
        time.sleep(0.02)
