"""What a reader sees of the report's figures and PDF tables: every figure has its own title, no
rendered text shows raw math markup, no legend lists more than MAX_SERIES entries, no PDF
table cell is cut off, the HTML and the PDF carry the same text, and each figure is drawn once
for both."""
from __future__ import annotations

import re

import numpy as np
import pandas as pd
import pytest

from kvcommon.rows import TRIAL_COLUMNS
from stats.findings import analyse

CODECS = ("plain-kv", "tq-kv", "tq-qkv", "tq-fkv", "tq-kqv", "tq-qkqv", "tq-kfv", "tq-fkfv", "sq-kv", "squ-kv",
          "int8", "int4", "kivi", "h2o", "svd")


def synthetic_findings(names=CODECS, scenarios=("gaussian", "price_$5_vs_$10"), seed=3):
    """Findings of a made-up run (random metrics spanning five decades, so axes go logarithmic) of
    the given codecs: the figures and tables drawn without running a sweep."""
    rng = np.random.default_rng(seed)
    rows = []
    overhead = {name: rng.uniform(0.05, 0.45) for name in names}   # bits beyond the budget, as a codec's norms
    for scenario in scenarios:
        for name in names:
            for budget in (2, 3):
                for dim in (32, 64):
                    for trial in range(4):
                        row = {c: 10 ** rng.uniform(-6, -0.3) for c in TRIAL_COLUMNS}   # over 5 decades
                        row.update(scenario=scenario, scheme=name, budget=budget, dim=dim, seq_len=64, queries=8,
                                   trial=trial, seed=0, impl="torch", device="cpu", dtype="float32", rng="pcg64",
                                   heads=1, calib_tokens=512, bits_per_element=budget + overhead[name],
                                   storage_bits_per_element=budget + overhead[name], model_bits=0.0,
                                   model_bits_per_element=0.0)
                        for c in ("d_eff_k", "d_eff_v", "spectral_gap_k", "spectral_gap_v"):
                            row[c] = float(rng.integers(2, 30)) if name.startswith("sq") else np.nan
                        rows.append(row)
    return analyse(pd.DataFrame(rows), n_permutations=20)


@pytest.fixture(scope="module")
def figures():
    import matplotlib.pyplot as plt

    from reports.figures import build_figures

    built = build_figures(synthetic_findings())
    yield built
    for f in built:
        if f.figure is not None:
            plt.close(f.figure)


def test_every_figure_has_its_own_title(figures):
    """Each figure's title is words of its own (the significance heat map's once came out as 0.3, a
    layout constant that shadowed it, and the HTML showed it as the heading)."""
    drawn = {f.key: f for f in figures if f.figure is not None}
    assert "significance" in drawn
    assert drawn["significance"].title.startswith("Pairwise differences in d₂(T)")
    for f in figures:
        assert isinstance(f.title, str) and any(ch.isalpha() for ch in f.title), (f.key, f.title)


def rendered_texts(fig) -> list[tuple[str, bool]]:
    """(what is drawn, whether as math text) for every visible text of a figure, after drawing it."""
    import io

    import matplotlib.text

    fig.savefig(io.BytesIO(), format="png", dpi=30)
    out = []
    for text in fig.findobj(matplotlib.text.Text):
        if text.get_visible() and text.get_text():
            out.append(text._preprocess_math(text.get_text()))
    return out


def assert_no_raw_math(key: str, texts) -> None:
    """No drawn text shows math markup; math text is only numbers (the 10^k tick labels)."""
    for s, math in texts:
        if math:
            assert re.sub(r"\\mathdefault|\\times|[\s${}^.,\d\-−]", "", s) == "", (key, s)
        else:
            assert "mathdefault" not in s and "\\" not in s, (key, s)


def test_names_with_dollars_and_log_ticks_are_drawn_as_meant(figures):
    """Log-axis tick labels are typeset (not printed as $\\mathdefault{10^{-5}}$, which switching
    math text off for names did), and a scenario named with $ is drawn as it is spelled."""
    texts = {f.key: rendered_texts(f.figure) for f in figures if f.figure is not None}
    assert any(math for drawn in texts.values() for _, math in drawn), "no log axis: the test lost its bite"
    for key, drawn in texts.items():
        assert_no_raw_math(key, drawn)
    titled = [key for key, drawn in texts.items() if any("price_$5_vs_$10" in s for s, math in drawn if not math)]
    assert len(titled) >= 3, titled


def test_figures_stay_typeset_after_the_pdf_draws_them(tmp_path):
    """The PDF draws the figures with its pages' math text off; their tick labels stay typeset."""
    import matplotlib.pyplot as plt

    from reports.figures import build_figures
    from reports.pdf import write_pdf

    findings = synthetic_findings(names=CODECS[:4])
    built = build_figures(findings)
    try:
        write_pdf(tmp_path / "report.pdf", "t", findings, built, [("item", "value")])
        for f in built:
            if f.figure is not None:
                assert_no_raw_math(f.key, rendered_texts(f.figure))
    finally:
        for f in built:
            if f.figure is not None:
                plt.close(f.figure)


@pytest.mark.parametrize("notice", [None, "incomplete: 3 of 4 cells"])
def test_the_pdf_written_beside_the_html_is_the_pdf_written_alone(tmp_path, notice):
    """pdf_beside (the tables in a forked process while the figures are built and the HTML drawn,
    the parts joined) gives the pages, their text and the document's metadata of write_pdf (one
    process, one PdfPages)."""
    import matplotlib.pyplot as plt
    from pypdf import PdfReader

    from reports.figures import build_figures
    from reports.pdf import pdf_beside, write_pdf

    findings = synthetic_findings(names=CODECS[:4])
    built = build_figures(findings)
    provenance = [("item", "value")]
    try:
        write_pdf(tmp_path / "alone.pdf", "t", findings, built, provenance, notice)
        with pdf_beside(tmp_path / "beside.pdf", "t", findings, provenance, notice) as shown:
            shown.extend(built)
    finally:
        for f in built:
            if f.figure is not None:
                plt.close(f.figure)
    alone, beside = PdfReader(tmp_path / "alone.pdf"), PdfReader(tmp_path / "beside.pdf")
    assert len(alone.pages) == len(beside.pages) > 5
    assert [p.extract_text() for p in alone.pages] == [p.extract_text() for p in beside.pages]
    assert [p.mediabox for p in alone.pages] == [p.mediabox for p in beside.pages]
    assert alone.metadata.title == beside.metadata.title == "kvharness report: t"
    assert alone.metadata.creator == beside.metadata.creator


def test_a_forked_pdf_process_that_hangs_is_stopped_and_its_pages_written_here(tmp_path, monkeypatch):
    """A forked process that never finishes (a lock held at the fork by another thread) is killed
    after its time and its parts are written in this process: the PDF is whole."""
    import os
    import time

    from pypdf import PdfReader

    import reports.pdf as pdf

    parent, real = os.getpid(), pdf._write_parts

    def hangs_in_the_fork(parts, files, with_figures):
        while os.getpid() != parent:
            time.sleep(1)
        real(parts, files, with_figures)
    monkeypatch.setattr(pdf, "_write_parts", hangs_in_the_fork)
    monkeypatch.setattr(pdf, "_WAIT_LEAST_S", 1.0)
    monkeypatch.setattr(pdf, "_WAIT_FACTOR", 0.0)
    findings = synthetic_findings(names=CODECS[:2])
    started = time.monotonic()
    with pdf.pdf_beside(tmp_path / "report.pdf", "t", findings, [("item", "value")]):
        pass   # no figures
    pages = [p.extract_text() for p in PdfReader(tmp_path / "report.pdf").pages]
    assert any("Provenance" in p for p in pages) and any("Every cell" in p for p in pages)
    assert time.monotonic() - started < 60


def test_no_legend_lists_more_than_a_panel_draws(figures):
    """Every legend names at most MAX_SERIES entries (one legend of all 15 codecs was 24 entries at
    5 px on a 1366-px screen for the main job), and each codec drawn is named in some legend."""
    from reports.styles import MAX_SERIES

    with_legend = 0
    for f in figures:
        if f.figure is None:
            continue
        legends = [*f.figure.legends, *(ax.get_legend() for ax in f.figure.axes if ax.get_legend())]
        for legend in legends:
            assert len(legend.get_texts()) <= MAX_SERIES, (f.key, [t.get_text() for t in legend.get_texts()])
        named = {t.get_text() for legend in legends for t in legend.get_texts()}
        drawn = {a.get_gid() for ax in f.figure.axes for a in [*ax.lines, *ax.collections] if a.get_gid()}
        if legends:
            with_legend += 1
            assert drawn <= named, (f.key, drawn - named)
    assert with_legend >= 4


def _page_words(pdf, page: int) -> list[str]:
    import subprocess

    text = subprocess.run(["pdftotext", "-f", str(page), "-l", str(page), "-layout", str(pdf), "-"],
                          capture_output=True, text=True, check=True).stdout
    return text.split()


@pytest.mark.skipif(__import__("shutil").which("pdftotext") is None, reason="pdftotext (poppler-utils) is absent")
def test_pdf_table_cells_are_not_cut_off(tmp_path):
    """Every word of every cell of the winners table, the widest (16 columns: 'b = 2–3 interpolated',
    '0.2101 [0.1723, 0.2480]', 'Wilcoxon (paired)'), is on its PDF page whole: a cell's text that
    runs into the next cell comes out of pdftotext cut or fused with its neighbour's."""
    import matplotlib.pyplot as plt

    from reports.figures import build_figures
    from reports.narrative import winner_rows
    from reports.pdf import write_pdf

    findings = synthetic_findings(names=CODECS[:6], scenarios=("heavy_tail",))
    built = [f for f in build_figures(findings) if f.key.startswith("front-")]
    try:
        write_pdf(tmp_path / "report.pdf", "t", findings, built, [("item", "value")])
    finally:
        for f in built:
            plt.close(f.figure)
    rows = winner_rows(findings)
    assert any("interpolated" in cell for row in rows for cell in row)
    words = _page_words(tmp_path / "report.pdf", 2)   # page 1: the first screen; page 2: the winners table
    assert "Best" in words and "storage" in words
    missing = [word for row in rows for cell in row for word in cell.split() if word not in words]
    assert missing == []


class _CheckedPages:
    """Stands in for PdfPages: each page, drawn, is checked for table cells whose text reaches past
    the cell, or tables that run off the page."""

    def __init__(self, path):
        self.overflow, self.tables = [], 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def infodict(self):
        return {}

    def savefig(self, fig):
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        page = fig.bbox
        for ax in fig.axes:
            for table in ax.tables:
                self.tables += 1
                outer = table.get_window_extent(renderer)
                if outer.y0 < page.y0 - 1 or outer.x1 > page.x1 + 1:
                    self.overflow.append(("table off the page", outer.bounds))
                for (row, col), cell in table.get_celld().items():
                    box, text = cell.get_window_extent(renderer), cell.get_text().get_window_extent(renderer)
                    if text.width and (text.x0 < box.x0 - 0.5 or text.x1 > box.x1 + 0.5 or text.y0 < box.y0 - 0.5
                                       or text.y1 > box.y1 + 0.5):
                        self.overflow.append((row, col, cell.get_text().get_text()))


def test_no_pdf_table_cell_runs_past_its_cell(monkeypatch):
    """Drawn through write_pdf (the first screen's table, the winners, fronts, every cell, the
    provenance), no cell's text leaves its cell and no table leaves its page, whatever the names."""
    import matplotlib.pyplot as plt

    import reports.pdf
    from reports.figures import build_figures

    findings = synthetic_findings(names=CODECS[:8])
    built = [f for f in build_figures(findings) if f.key.startswith("front-")]
    pages = []
    monkeypatch.setattr(reports.pdf, "PdfPages", lambda path: pages.append(_CheckedPages(path)) or pages[-1])
    try:
        reports.pdf.write_pdf("unused.pdf", "t", findings, built,
                              [("item", "value"), ("command", "harness run " + " ".join(["--scheme all"] * 30))])
    finally:
        for f in built:
            plt.close(f.figure)
    assert pages[0].tables >= 6
    assert pages[0].overflow == []


# --- the HTML and the PDF say the same things -------------------------------------------------------

# What the HTML shows and the PDF does not, as it stands: headings of the page's own navigation (a PDF
# table page titles its table in words of its own), the run's configuration, and the notes under the
# every-cell table and the claims table.
HTML_ONLY = tuple(re.compile(p) for p in (r"Best codec at each storage level, in full",
                                          r"Scenario .*: the Pareto front on measured storage", r"Figures",
                                          r"Configuration", r"Means over trials with 95% Student-t .*",
                                          r"How each claim was tested and the reasons: claim details\."))


class _HtmlParts:
    """What a reader of the HTML sees, by kind: 'heading' (h1-h3), 'cell' (every table's td and
    th), 'caption' (figure captions and the notes under the first screen's tables), 'figure' (the
    alt text of each figure's image: its title), each text with its spaces collapsed."""

    _KIND = {"h1": "heading", "h2": "heading", "h3": "heading", "td": "cell", "th": "cell", "figcaption": "caption"}

    def __init__(self, page: str):
        from html.parser import HTMLParser

        self.parts = {"heading": [], "cell": [], "caption": [], "figure": []}
        self._open, self._text = None, []   # the element being read: (tag, kind)
        parser = HTMLParser()
        parser.handle_starttag, parser.handle_endtag, parser.handle_data = self._start, self._end, self._data
        parser.feed(page)

    def _start(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "img":
            self.parts["figure"].append(attrs["alt"])
        kind = "caption" if tag == "p" and attrs.get("class") == "note" else self._KIND.get(tag)
        if kind and self._open is None:
            self._open, self._text = (tag, kind), []

    def _end(self, tag):
        if self._open and self._open[0] == tag:
            self.parts[self._open[1]].append(" ".join("".join(self._text).split()))
            self._open = None

    def _data(self, data):
        if self._open:
            self._text.append(data)


def _pdf_text(path) -> str:
    """The PDF's text in the order it was drawn (a table's cells row by row, a cell's wrapped lines
    together; -raw also keeps a hyphen that ends a line, which pdftotext otherwise drops as a
    hyphenation), by pdftotext (poppler-utils) or else pypdf; the test is skipped with neither."""
    import shutil
    import subprocess

    if shutil.which("pdftotext"):
        return subprocess.run(["pdftotext", "-raw", str(path), "-"], capture_output=True, text=True,
                              check=True).stdout
    pypdf = pytest.importorskip("pypdf", reason="neither pdftotext (poppler-utils) nor pypdf is installed")
    return "\n".join(page.extract_text() for page in pypdf.PdfReader(path).pages)


def _compact(text: str) -> str:
    """text with every space and line break removed and compatibility characters folded (NFKC: a
    subscript ₂ or a ligature as extracted from the PDF is the plain character), so that a caption
    wrapped over several PDF lines still reads as the HTML's one line."""
    import unicodedata

    return "".join(unicodedata.normalize("NFKC", text).split())


@pytest.fixture(scope="module")
def both_outputs(tmp_path_factory):
    """The HTML and the PDF of one set of synthetic findings (two scenarios, one named with $, seven
    codecs of four families) and the figures they were drawn from: (findings, html, pdf path, figures)."""
    import matplotlib.pyplot as plt

    from reports.figures import build_figures
    from reports.html import provenance_rows, render_html
    from reports.pdf import write_pdf

    findings = synthetic_findings(names=CODECS[:4] + ("sq-kv", "int8", "h2o"))
    built = build_figures(findings)
    pdf = tmp_path_factory.mktemp("both") / "report.pdf"
    try:
        page = render_html("t", findings, built, None, "1 s")
        write_pdf(pdf, "t", findings, built, provenance_rows(None, findings, "1 s"))
    finally:
        for f in built:
            if f.figure is not None:
                plt.close(f.figure)
    return findings, page, pdf, built


def test_html_and_pdf_show_the_same_headings_tables_and_captions(both_outputs):
    """Every heading of the HTML (but its navigation), every table cell, every figure's title and
    every caption is in the PDF's text too (spaces and line breaks aside), and each figure drawn
    appears in both with the title and caption its builder gave it: the two outputs of one report
    say the same things."""
    findings, page, pdf, built = both_outputs
    parts = _HtmlParts(page).parts
    text = _compact(_pdf_text(pdf))
    html_only = HTML_ONLY
    if findings.crossovers.empty:   # the PDF leaves an empty crossovers table out, the HTML says "None"
        html_only += (re.compile(r"Crossovers along the storage axis"),)
    headings = [h for h in parts["heading"] if not any(p.fullmatch(h) for p in html_only)]
    assert len(headings) >= 8 and [h for h in headings if _compact(h) not in text] == []
    cells = [c for c in parts["cell"] if c]
    assert len(cells) > 200
    assert [c for c in cells if _compact(c) not in text] == []
    captions = [c for c in parts["caption"] if c and not any(p.fullmatch(c) for p in html_only)]
    assert [c for c in captions if _compact(c) not in text] == []
    drawn = [f for f in built if f.figure is not None]
    assert len(drawn) >= 6 and parts["figure"] == [f.title for f in drawn]
    for f in drawn:
        assert f.caption in parts["caption"] and _compact(f.caption) in text, f.key
        if not f.key.startswith("front-"):   # a front heads the first screen under its scenario's name
            assert f.title in parts["heading"] and _compact(f.title) in text, f.key
    for f in built:
        if f.figure is None:
            assert _compact(f"{f.title}: {f.absent_reason}.") in text and f.absent_reason in page, f.key


def _counting(method, counts):
    """method, counting its calls per object (by id) in counts."""
    def counted(self, *args, **kwargs):
        counts[id(self)] += 1
        return method(self, *args, **kwargs)
    return counted


def test_each_figure_is_drawn_and_measured_once_for_both_outputs(monkeypatch, tmp_path):
    """Writing the HTML and the PDF draws each report figure once and measures its tight box once:
    the figures were drawn two to four times (savefig drew each once more to run the inert layout
    engine that tight_layout leaves, and the HTML drew again those whose PDF page is coarser)."""
    import collections

    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure

    from reports.figures import build_figures
    from reports.html import render_html
    from reports.pdf import write_pdf

    findings = synthetic_findings(names=CODECS[:5])
    built = build_figures(findings)
    drawn, measured = collections.Counter(), collections.Counter()
    monkeypatch.setattr(Figure, "draw", _counting(Figure.draw, drawn))
    monkeypatch.setattr(Figure, "get_tightbbox", _counting(Figure.get_tightbbox, measured))
    try:
        render_html("t", findings, built, None, "1 s")
        write_pdf(tmp_path / "report.pdf", "t", findings, built, [("item", "value")])
    finally:
        for f in built:
            if f.figure is not None:
                plt.close(f.figure)
    figures = [f for f in built if f.figure is not None]
    assert len(figures) >= 6
    assert {f.key: drawn[id(f.figure)] for f in figures} == {f.key: 1 for f in figures}
    assert {f.key: measured[id(f.figure)] for f in figures} == {f.key: 1 for f in figures}
