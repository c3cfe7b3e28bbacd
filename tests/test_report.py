"""harness report: the HTML and PDF from a small real run — structure, numbers against the raw
sqlite rows, self-containedness, escaping, a headless-Chromium check and the PDF's pages."""
import base64
import io
import json
import math
import re
import shutil
import sqlite3
import statistics
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image
from scipy import stats as sps

from harness.cli import main
from kvcommon.rows import TRIAL_COLUMNS
from harness.store import RunStore
from stats.findings import analyse
from reports.html import render_html
from interrupting import interrupt_at_chunk

RUN = ["--scenario", "gaussian", "--scheme", "tq-kv,plain-kv,tq-qkv", "--dim", "16,32", "--seq-len", "64",
       "--queries", "8", "--trials", "8", "--budget", "2,3", "--quiet"]
LEVELS = (3.5, 4.5)  # bits/element: measured cells (tq-qkv d = 32 at 3.57), interpolations and absences
FIGURES = ("front-gaussian", "dimension", "rate_distortion_d16", "rate_distortion_d32", "error_space", "significance",
           "isolation", "amplification")
ABSENT = ("d_eff",)
FIGURE_TITLES = ("Rate–distortion at d = 16", "The six-dimensional error space")
CHROMIUM = Path("/usr/bin/chromium")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "run"
    assert main(["run", *RUN, "--out", str(out)]) == 0
    assert main(["report", str(out), "--permutations", "100", "--storage-levels", ",".join(map(str, LEVELS))]) == 0
    return out


@pytest.fixture(scope="module")
def html(run_dir):
    return (run_dir / "report.html").read_text(encoding="utf-8")


class _Tables(HTMLParser):
    """Rows of every <table id=...> and every <img> tag's attributes, from the raw HTML."""

    def __init__(self):
        super().__init__()
        self.tables, self.images, self._table, self._row, self._cell = {}, [], None, None, None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "table":
            self._table = self.tables.setdefault(attrs.get("id"), [])
        elif tag == "tr" and self._table is not None:
            self._row = []
        elif tag in ("td", "th") and self._row is not None:
            self._cell = []
        elif tag == "img":
            self.images.append(attrs)

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self._row.append("".join(self._cell).strip())
            self._cell = None
        elif tag == "tr" and self._row is not None:
            self._table.append(self._row)
            self._row = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def parsed(html_text) -> _Tables:
    p = _Tables()
    p.feed(html_text)
    return p


def raw_cells(run_dir) -> dict[tuple, dict]:
    """Per (scheme, budget, dim): d2_t values and bits from the sqlite file, without pandas."""
    out = {}
    with sqlite3.connect(run_dir / "results.sqlite") as con:
        for scheme, budget, dim, d2, bits in con.execute("SELECT scheme, budget, dim, d2_t, bits_per_element FROM trials"):
            cell = out.setdefault((scheme, budget, dim), {"d2_t": [], "bits": []})
            cell["d2_t"].append(d2)
            cell["bits"].append(bits)
    return out


def fmt(x):
    return f"{x:.4g}"


def expected_ci(values) -> str:
    """Mean [95% Student-t CI], recomputed from the raw values with the statistics module."""
    mean, sd, n = statistics.fmean(values), statistics.stdev(values), len(values)
    half = sps.t.ppf(0.975, n - 1) * sd / math.sqrt(n)
    return f"{fmt(mean)} [{fmt(mean - half)}, {fmt(mean + half)}]"


def test_every_section_and_figure_present(run_dir, html):
    assert not list(run_dir.glob(".report*.tmp"))
    for section in ("summary", "figures", "cells", "provenance"):
        assert f'<section id="{section}">' in html
    for key in FIGURES:
        block = html.split(f'id="figure-{key}"', 1)[1].split("</figure>", 1)[0]
        assert 'src="data:image/png;base64,' in block and ("<figcaption>" in block or key.startswith("front-")), key
    for key in ABSENT:
        block = html.split(f'id="figure-{key}"', 1)[1].split("</figure>", 1)[0]
        assert "Not shown:" in block and "<img" not in block, key
    assert "Best codec at each storage level" in html and "Crossovers along the storage axis" in html
    manifest = RunStore(run_dir).read_manifest()
    assert manifest["provenance"]["git_sha"] in html and manifest["started_at"] in html


def test_cell_table_matches_the_store(run_dir, html):
    rows = parsed(html).tables["cells-table"]
    header, body = rows[0], rows[1:]
    col = {h: i for i, h in enumerate(header)}
    raw = raw_cells(run_dir)
    assert len(body) == len(raw) == 3 * 2 * 2
    for row in body:
        cell = raw[(row[col["scheme"]], int(row[col["b"]]), int(row[col["d"]]))]
        assert row[col["d₂(T) [95% CI]"]] == expected_ci(cell["d2_t"])
        assert row[col["bits/el"]] == fmt(statistics.fmean(cell["bits"]))
        assert row[col["n"]] == str(len(cell["d2_t"]))


def raw_trials(run_dir) -> dict[tuple, dict[int, tuple[float, float]]]:
    """Per (scheme, budget, dim): trial -> (bits, d2_t), from the sqlite file without pandas."""
    out = {}
    with sqlite3.connect(run_dir / "results.sqlite") as con:
        for scheme, budget, dim, trial, bits, d2 in con.execute(
                "SELECT scheme, budget, dim, trial, bits_per_element, d2_t FROM trials"):
            out.setdefault((scheme, budget, dim), {})[trial] = (bits, d2)
    return out


def value_at(cells: dict[int, dict[int, tuple]], level: float) -> list[float] | None:
    """One scheme's per-trial d2_t at `level` bits/element, written out from the module doc of
    stats.equal_storage: a cell within ±2.5 % of the level, else log-linear interpolation between
    the nearest cells below and above, else None."""
    storage = {b: statistics.fmean(bits for bits, _ in rows.values()) for b, rows in cells.items()}
    near = [b for b in storage if abs(storage[b] - level) <= 0.025 * level]
    if near:
        b = min(near, key=lambda b: abs(storage[b] - level))
        return [cells[b][t][1] for t in sorted(cells[b])]
    below = [b for b in storage if storage[b] < level]
    above = [b for b in storage if storage[b] > level]
    if not below or not above:
        return None
    lo, hi = max(below, key=storage.get), min(above, key=storage.get)
    w = (level - storage[lo]) / (storage[hi] - storage[lo])
    return [math.exp((1 - w) * math.log(cells[lo][t][1]) + w * math.log(cells[hi][t][1])) for t in sorted(cells[lo])]


def test_winners_and_front_match_brute_force(run_dir, html):
    tables = parsed(html).tables
    raw = raw_cells(run_dir)
    per_trial = raw_trials(run_dir)
    means = {k: statistics.fmean(v["d2_t"]) for k, v in raw.items()}
    bits = {k: statistics.fmean(v["bits"]) for k, v in raw.items()}
    header, *rows = tables["winners-table"]
    col = {h: i for i, h in enumerate(header)}
    shown = {(int(r[col["d"]]), float(r[col["bits/el"]])): r for r in rows}
    checked = 0
    for dim in (16, 32):
        for level in LEVELS:
            at = {}
            for scheme in ("plain-kv", "tq-kv", "tq-qkv"):
                cells = {b: per_trial[(s, b, d)] for (s, b, d) in per_trial if s == scheme and d == dim}
                values = value_at(cells, level)
                if values is not None:
                    at[scheme] = statistics.fmean(values)
            if not at:
                assert (dim, level) not in shown
                continue
            ranked = sorted(at, key=at.get)
            row = shown[(dim, level)]
            assert row[col["best"]] == ranked[0] and row[col["best d₂(T) [95% CI]"]].startswith(fmt(at[ranked[0]]))
            if len(ranked) > 1:
                assert row[col["runner-up"]] == ranked[1] and row[col["test"]] == "Wilcoxon (paired)"
            checked += 1
        # Pareto front by brute force over the setting's cells on (bits, mean d2_t)
        pts = [k for k in means if k[2] == dim]
        front = {k for k in pts if not any(bits[o] <= bits[k] and means[o] <= means[k]
                                           and (bits[o] < bits[k] or means[o] < means[k]) for o in pts)}
        header, *body = tables["cells-table"]
        cell_col = {h: i for i, h in enumerate(header)}
        marked = {(r[cell_col["scheme"]], int(r[cell_col["b"]]), dim) for r in body
                  if int(r[cell_col["d"]]) == dim and r[cell_col["P(front)"]].endswith("*")}
        assert marked == front
    assert checked == len(shown) == 3  # at d = 16 no scheme stores as little as 3.5 bits/element


def test_json_findings_match_the_tables(run_dir, html, capsys):
    """report --json prints the same fronts and winners as the HTML, storage within 5 %."""
    import json

    assert main(["report", str(run_dir), "--json", "--permutations", "100",
                 "--storage-levels", ",".join(map(str, LEVELS))]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["storage"]["levels"] == list(LEVELS) and found["storage"]["tolerance"] == 0.05
    header, *rows = parsed(html).tables["winners-table"]
    col = {h: i for i, h in enumerate(header)}
    assert [(w["dim"], w["storage_level"], w["winner"]) for w in found["winners"]] == \
        [(int(r[col["d"]]), float(r[col["bits/el"]]), r[col["best"]]) for r in rows]
    for w in found["winners"]:
        if w["runner_up"] is not None:
            assert abs(w["winner_storage"] - w["runner_up_storage"]) <= 0.05 * w["storage_level"]
            assert w["verdict"] in {"codec-difference", "implementation-variance", "negligible", "equivalent",
                                    "inconclusive"}
    # the shipped schema (its version is the payload's) accepts it, and rejects a payload that breaks it
    import importlib.resources

    import jsonschema

    schema = json.loads(importlib.resources.files("reports").joinpath("report.schema.json").read_text())
    jsonschema.validate(found, schema)
    assert found["schema_version"] == schema["properties"]["schema_version"]["const"]
    assert found["provenance"]["command"].startswith(f"harness report {run_dir} --json")
    broken = json.loads(json.dumps(found))
    broken["winners"][0]["comparison"] = "probably"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)
    placed = {w["winner_source"]: w["winner_placed"] for w in found["winners"]}
    assert all(p["source"] == ("interpolated" if s.endswith("interpolated") else "measured") for s, p in placed.items())
    for v in found["verdicts"]:  # each verdict carries its effects with their CIs and margins
        effect = v["verdict_effects"]["snr_err_t"]
        assert effect["ci95"][0] <= effect["estimate"] <= effect["ci95"][1] and effect["margin"] > 0
    assert found["verdicts"] and {f["setting"]["dim"] for f in found["fronts"]} == {16, 32}
    assert all(p["d2_t_low"] <= p["d2_t"] <= p["d2_t_high"] for f in found["fronts"] for p in f["points"])


def test_html_is_self_contained_with_valid_images(html):
    images = parsed(html).images
    assert len(images) == len(FIGURES)
    for img in images:
        assert img["src"].startswith("data:image/png;base64,")
        data = base64.b64decode(img["src"].split(",", 1)[1], validate=True)
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        picture = Image.open(io.BytesIO(data))
        assert picture.size == (int(img["width"]), int(img["height"]))
        assert np.asarray(picture.convert("L"), dtype=float).var() > 10  # not blank
    assert not re.search(r"""(src|href)=["']?(https?:|//)""", html)
    assert "<script" not in html and "<link" not in html


def test_names_from_configuration_and_plugins_are_escaped():
    rng = np.random.default_rng(0)
    frame = pd.DataFrame({c: rng.random(6) for c in TRIAL_COLUMNS})
    evil = '<img src=x onerror="alert(1)">&co'
    frame = pd.concat([frame.assign(scheme=evil), frame.assign(scheme="tq-kv")], ignore_index=True)
    frame = frame.assign(scenario="<b>scn</b>", budget=2, dim=16, seq_len=8, queries=4, trial=list(range(6)) * 2,
                         seed=0, impl="torch", device="cpu", dtype="float32", rng="pcg64", heads=1, calib_tokens=512)
    manifest = {"config": {"note": "<script>alert(2)</script>"}, "provenance": {"git_sha": "<i>sha</i>"}}
    page = render_html("<u>title</u>", analyse(frame, n_permutations=20), [], manifest, "1 s")
    for raw in (evil, "<b>scn</b>", "<script>", "<i>sha</i>", "<u>title</u>"):
        assert raw not in page
    assert "&lt;img src=x onerror=&#34;alert(1)&#34;&gt;&amp;co" in page
    assert "&lt;b&gt;scn&lt;/b&gt;" in page and "&lt;i&gt;sha&lt;/i&gt;" in page


def test_pdf_opens_with_table_figures_and_nonblank_pages(run_dir, tmp_path):
    pypdf = pytest.importorskip("pypdf")
    reader = pypdf.PdfReader(run_dir / "report.pdf")
    text = "\n".join(page.extract_text() for page in reader.pages)
    assert "Best codec at each storage level" in text and "Every cell" in text
    raw = raw_cells(run_dir)
    assert expected_ci(raw[("tq-kv", 2, 16)]["d2_t"]) in text  # a summary-table number
    for title in FIGURE_TITLES:
        assert title in text
    assert len(reader.pages) >= len(FIGURES) + 3
    if shutil.which("pdftoppm") is None:
        pytest.skip("pdftoppm (poppler-utils) is absent: pages not rasterised")
    subprocess.run(["pdftoppm", "-r", "30", "-png", str(run_dir / "report.pdf"), str(tmp_path / "page")],
                   check=True, timeout=60)
    pages = sorted(tmp_path.glob("page*.png"))
    assert len(pages) == len(reader.pages)
    for page in pages:
        assert np.asarray(Image.open(page).convert("L"), dtype=float).var() > 1, page


def _chromium(args, tmp_path, timeout=90):
    return subprocess.run([str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                           "--no-first-run", "--disable-background-networking", "--disable-component-update",
                           "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}", *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian's chromium is not installed (/usr/bin/chromium); "
                    ".ci/run installs it with apt-get install chromium")
def test_browser_loads_every_image_without_console_errors(run_dir, html, tmp_path):
    shot = run_dir / "report.png"
    done = _chromium(["--enable-logging=stderr", "--v=0", f"--screenshot={shot}", "--window-size=1280,4000",
                      (run_dir / "report.html").as_uri()], tmp_path)
    assert shot.exists(), done.stderr[-2000:]
    assert not [line for line in done.stderr.splitlines() if ":CONSOLE" in line]
    pixels = np.asarray(Image.open(shot).convert("L"), dtype=float)
    assert pixels.var() > 100  # text and figures, not a blank page
    # the browser's own verdict on the images: a copy with a load probe, read back from the DOM
    probe = ('<script>addEventListener("load",()=>{const im=[...document.images];'
             'document.body.dataset.images=im.length;'
             'document.body.dataset.broken=im.filter(i=>!(i.complete&&i.naturalWidth>0)).length})</script></body>')
    probed = tmp_path / "probed.html"
    probed.write_text(html.replace("</body>", probe), encoding="utf-8")
    dom = _chromium(["--dump-dom", "--virtual-time-budget=5000", probed.as_uri()], tmp_path).stdout
    body = re.search(r"<body[^>]*>", dom).group(0)
    assert f'data-images="{len(FIGURES)}"' in body and 'data-broken="0"' in body, body


def test_directory_without_results_is_a_usage_error(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "results.sqlite" in err
    assert not (tmp_path / "report.html").exists()


def test_verdicts_use_the_implementation_null(run_dir, tmp_path):
    """With --null (the same cells under another RNG family) every winner-vs-runner-up verdict
    is judged against two null comparisons; without it none is."""
    null = tmp_path / "null"
    assert main(["run", *RUN, "--rng", "mt19937", "--out", str(null)]) == 0
    from reports.narrative import headline_header, lede

    trials = RunStore(run_dir).trials()
    found_null = analyse(trials, RunStore(null).trials(), n_permutations=50, levels=LEVELS)
    found_alone = analyse(trials, n_permutations=50, levels=LEVELS)
    with_null, alone = (f.winners[f.winners.runner_up.map(lambda r: isinstance(r, str))]
                        for f in (found_null, found_alone))
    assert len(with_null) == len(alone) == 2  # d = 16 at 4.5 and d = 32 at 3.5 hold two schemes or more
    valid = {"codec-difference", "implementation-variance", "negligible", "equivalent", "inconclusive"}
    assert set(with_null.validation) <= valid and (with_null.n_null == 2).all()
    assert (alone.n_null == 0).all() and "codec-difference" not in set(alone.validation)
    # the first screen: the verdict column only with a null; without one a line says what can be concluded
    assert headline_header(found_null)[-1] == "verdict" and "verdict" not in headline_header(found_alone)
    assert "No implementation null run" in lede(found_alone) and "No implementation null" not in lede(found_null)
    # a reproduction (claims) ran its null runs for claim 11: the line says whose they are, not that none ran
    import dataclasses

    import pandas as pd
    reproduction = dataclasses.replace(found_alone, claims=pd.DataFrame())
    assert "No implementation null" not in lede(reproduction) and "judge claim 11" in lede(reproduction)


SQ_RUN = ["--scenario", "spectral_decay", "--scheme", "sq-kv,tq-kv", "--budget", "3", "--dim", "16", "--seq-len", "32",
          "--queries", "4", "--trials", "6", "--calib-tokens", "256", "--quiet"]


def _figure_block(html_text, key):
    return html_text.split(f'id="figure-{key}"', 1)[1].split("</figure>", 1)[0]


def test_d_eff_figure_drawn_from_the_calibrated_rows(tmp_path):
    """A run with a calibrated scheme (sq-kv) gets a real d_eff figure: an image in its section,
    the run's calibration size (256, not the default 512) in the title, and exactly the stored
    per-trial d_eff_k / d_eff_v values of sq-kv as its points; tq-kv stores none and is not drawn."""
    import matplotlib.pyplot as plt

    from reports.figures import d_eff_figure, scheme_styles

    out = tmp_path / "sq"
    assert main(["run", *SQ_RUN, "--out", str(out)]) == 0
    assert RunStore(out).read_manifest()["config"]["calib_tokens"] == [256]
    assert main(["report", str(out), "--permutations", "50"]) == 0
    page = (out / "report.html").read_text(encoding="utf-8")
    block = _figure_block(page, "d_eff")
    assert 'src="data:image/png;base64,' in block and "Not shown:" not in block
    assert "n_cal = 256 calibration tokens" in block and "--calib-tokens" in block

    with sqlite3.connect(out / "results.sqlite") as con:
        stored = {tensor: sorted(v for (v,) in con.execute(f"SELECT d_eff_{tensor} FROM trials WHERE scheme = 'sq-kv'"))
                  for tensor in ("k", "v")}
        assert con.execute("SELECT COUNT(*) FROM trials WHERE scheme = 'tq-kv' AND d_eff_k IS NOT NULL").fetchone() == (0,)
    assert all(len(v) == 6 and all(1 <= x <= 16 for x in v) for v in stored.values())

    trials = RunStore(out).trials()
    figure = d_eff_figure(analyse(trials, n_permutations=20), scheme_styles(trials.scheme.unique()))
    try:
        assert figure.absent_reason is None and "n_cal = 256" in figure.title
        (ax,) = [a for a in figure.figure.axes if a.get_visible()]
        assert ax.get_title() == "spectral_decay, d = 16, n_cal = 256"
        assert "participation ratio" in ax.get_ylabel()
        strips = [c.get_offsets() for c in ax.collections]
        assert len(strips) == 2  # one strip per tensor for sq-kv, none for tq-kv
        by_side = {("k" if np.mean(xy[:, 0]) < 0.5 else "v"): sorted(xy[:, 1]) for xy in strips}
        assert by_side == stored
        dashed = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
        assert [tuple(line.get_ydata()) for line in dashed] == [(16, 16)]  # the head dimension d
    finally:
        plt.close(figure.figure)


def test_run_without_calibrated_scheme_states_why_d_eff_is_absent(html):
    block = _figure_block(html, "d_eff")
    assert "<img" not in block
    assert "Not shown: the run has no calibrated scheme (sq-*, squ-*), so no d_eff." in block


@pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian's chromium is not installed (/usr/bin/chromium); "
                    ".ci/run installs it with apt-get install chromium")
@pytest.mark.slow
def test_report_screenshot_flag_writes_a_non_blank_png(run_dir):
    shot = run_dir / "report.png"
    shot.unlink(missing_ok=True)
    assert main(["report", str(run_dir), "--screenshot", "--permutations", "99"]) == 0
    pixels = np.asarray(Image.open(shot).convert("L"), dtype=float)
    assert pixels.shape[1] == 1280 and pixels.var() > 100


@pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian's chromium is not installed (/usr/bin/chromium); "
                    ".ci/run installs it with apt-get install chromium")
def test_headline_table_and_front_are_on_the_first_screen(run_dir, html, tmp_path):
    """At 1400 × 900 CSS pixels the first scenario's headline table and front figure lie inside
    the first viewport, as the browser lays them out (positions read back from the DOM)."""
    shot = tmp_path / "first.png"
    done = _chromium([f"--screenshot={shot}", "--window-size=1400,900", (run_dir / "report.html").as_uri()], tmp_path)
    assert shot.exists(), done.stderr[-2000:]
    pixels = np.asarray(Image.open(shot).convert("L"), dtype=float)
    assert pixels.shape == (900, 1400) and pixels.var() > 100
    rect = ("const r=e=>{const b=document.querySelector(e).getBoundingClientRect();"
            "return [b.left,b.top,b.right,b.bottom].map(Math.round).join(',')};")
    probe = (f'<script>addEventListener("load",()=>{{{rect}document.body.dataset.table=r("#headline-table-1");'
             'document.body.dataset.front=r("figure.front img")})</script></body>')
    probed = tmp_path / "probed.html"
    probed.write_text(html.replace("</body>", probe), encoding="utf-8")
    dom = _chromium(["--dump-dom", "--window-size=1400,900", "--virtual-time-budget=5000", probed.as_uri()],
                    tmp_path).stdout
    body = re.search(r"<body[^>]*>", dom).group(0)
    for key in ("table", "front"):
        left, top, right, bottom = map(int, re.search(rf'data-{key}="([-\d,]+)"', body).group(1).split(","))
        assert 0 <= left < right <= 1400 and 0 <= top < bottom <= 900, (key, body)


def _synthetic_findings(names):
    """Findings of a made-up run of the given codecs on two scenarios (random metrics), so the
    figures can be drawn with every family at once without running 24 codecs."""
    rng = np.random.default_rng(11)
    rows = []
    for scenario in ("gaussian", "heavy_tail"):
        for name in names:
            for budget in (2, 3):
                for trial in range(4):
                    row = {c: rng.uniform(0.01, 0.5) for c in TRIAL_COLUMNS}
                    row.update(scenario=scenario, scheme=name, budget=budget, dim=32, seq_len=64, queries=8,
                               trial=trial, seed=0, impl="torch", device="cpu", dtype="float32", rng="pcg64",
                               heads=1, calib_tokens=512, bits_per_element=budget + rng.uniform(0, 1))
                    calibrated = name.startswith("sq")
                    for c in ("d_eff_k", "d_eff_v", "spectral_gap_k", "spectral_gap_v"):
                        row[c] = float(rng.integers(2, 30)) if calibrated else np.nan
                    rows.append(row)
    return analyse(pd.DataFrame(rows), n_permutations=20)


@pytest.mark.slow
def test_figures_facet_by_family_with_fixed_colours():
    """Every panel of every figure draws at most 8 codecs, and a codec has one colour and marker
    in every figure: the fixed style of reports.styles, whichever other codecs the run has."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgba

    import schemes
    from reports.figures import build_figures
    from reports.styles import MAX_SERIES, panel_groups, style

    names = schemes.available()
    assert len(names) > 2 * MAX_SERIES
    assert all(len(g) <= MAX_SERIES for _, g in panel_groups(names))
    figures = build_figures(_synthetic_findings(names))
    seen: dict[str, set] = {}
    try:
        drawn = [f for f in figures if f.figure is not None]
        assert {f.key for f in drawn} >= {"front-gaussian", "front-heavy_tail", "rate_distortion_d32", "error_space",
                                          "isolation", "amplification", "d_eff"}
        for f in drawn:
            for ax in f.figure.axes:
                artists = [a for a in [*ax.lines, *ax.collections] if a.get_gid()]
                assert len({a.get_gid() for a in artists}) <= MAX_SERIES, (f.key, ax.get_title())
                for a in artists:
                    colour = a.get_color() if hasattr(a, "get_marker") else a.get_facecolor()[0] \
                        if len(a.get_facecolor()) else a.get_edgecolor()[0]
                    colour = to_rgba(np.asarray(colour).ravel()[:4] if not isinstance(colour, str) else colour)
                    seen.setdefault(a.get_gid(), set()).add(colour[:3])
    finally:
        for f in figures:
            if f.figure is not None:
                plt.close(f.figure)
    assert set(seen) == set(names)
    for name, colours in seen.items():
        assert colours == {tuple(to_rgba(style(name).colour)[:3])}, name


def test_styles_are_fixed_and_distinct_within_a_family():
    from reports.styles import family, scheme_styles, style

    assert scheme_styles(["tq-kv"])["tq-kv"] == scheme_styles(["tq-kv", "sq-kv", "int8"])["tq-kv"] == style("tq-kv")
    import schemes
    by_family: dict[str, list] = {}
    for name in schemes.available():
        by_family.setdefault(family(name), []).append(style(name))
    for fam, styles in by_family.items():
        assert len({s.colour for s in styles}) == len(styles), fam          # colours differ within a family
        assert len({s.marker for s in styles}) == 1, fam                    # one marker per family
    markers = {fam: styles[0].marker for fam, styles in by_family.items()}
    assert len(set(markers.values())) == len(markers)                       # and families differ by marker
    assert style("my-plugin") == style("my-plugin") and family("kvpress:KnormPress") == "eviction"


def test_palette_is_seaborns():
    """The palette written out in reports.styles is seaborn's colour-blind then dark palette, value
    for value (the report no longer imports seaborn for it)."""
    sns = pytest.importorskip("seaborn")
    from reports.styles import _PALETTE

    assert _PALETTE == list(sns.color_palette("colorblind", 10) + sns.color_palette("dark", 10))


@pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian's chromium is not installed (/usr/bin/chromium); "
                    ".ci/run installs it with apt-get install chromium")
@pytest.mark.slow
def test_a_reproduction_shows_its_claims_table_first(run_dir, tmp_path):
    """A run with a claims table (harness reproduce) opens with it: the table is the first thing
    after the title, its top inside the 1400 × 900 first screen, every claim a row with its verdict;
    the PDF's first page is the claims table too."""
    from stats.claims import CLAIM_COLUMNS
    out = tmp_path / "reproduction"
    shutil.copytree(run_dir, out)
    verdicts = ["reproduced", "refuted", "inconclusive"] * 4
    claims = pd.DataFrame([{c: {"id": i, "section": "§4", "claim": f"claim number {i}", "test": "paired Wilcoxon",
                                "paired": "paired", "verdict": verdicts[i - 1], "reason": f"because {i}",
                                "effect": "d2(T) difference", "estimate": 0.1 * i, "ci_low": 0.1 * i - 0.05,
                                "ci_high": 0.1 * i + 0.05, "n_tests": 3, "n_as_claimed": 2, "n_opposite": 1}[c]
                            for c in CLAIM_COLUMNS} for i in range(1, 12)])
    RunStore(out).write_table("claims", claims)
    assert main(["report", str(out), "--permutations", "50", "--storage-levels", "3.5"]) == 0
    page = (out / "report.html").read_text(encoding="utf-8")
    rows = parsed(page).tables["claims-table"]
    assert [r[0] for r in rows[1:]] == [str(i) for i in range(1, 12)]
    assert [r[2] for r in rows[1:]] == verdicts[:11]
    assert page.index('id="claims-table"') < page.index('id="headline-table-1"')
    probe = ('<script>addEventListener("load",()=>{const b=document.getElementById("claims-table")'
             '.getBoundingClientRect();document.body.dataset.claims=[b.top,b.bottom].map(Math.round).join(",")})'
             '</script></body>')
    probed = tmp_path / "probed.html"
    probed.write_text(page.replace("</body>", probe), encoding="utf-8")
    dom = _chromium(["--dump-dom", "--window-size=1400,900", "--virtual-time-budget=5000", probed.as_uri()],
                    tmp_path).stdout
    top, bottom = map(int, re.search(r'data-claims="([-\d,]+)"', dom).group(1).split(","))
    assert 0 <= top < 300 and bottom <= 900, (top, bottom)
    pypdf = pytest.importorskip("pypdf")
    first = pypdf.PdfReader(out / "report.pdf").pages[0].extract_text()
    assert "claim by claim" in first and "claim number 11" in first
    found = __import__("json").loads(subprocess.run(
        [__import__("sys").executable, "-m", "harness", "report", str(out), "--json", "--permutations", "20"],
        capture_output=True, text=True, check=True).stdout)
    assert [c["verdict"] for c in found["claims"]] == verdicts[:11]


@pytest.fixture(scope="module")
def unfinished_dir(tmp_path_factory):
    """A run interrupted with 3 of its 4 cells finished (chunks of 3 trials; the 8th chunk never
    ran), then reported."""
    from harness import cell as engine
    out = tmp_path_factory.mktemp("unfinished") / "run"
    args = ["run", "--scenario", "gaussian", "--scheme", "tq-kv,plain-kv", "--budget", "2,3", "--dim", "16",
            "--seq-len", "64", "--queries", "8", "--trials", "6", "--quiet", "--out", str(out)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(engine.CHUNK_TRIALS_ENV, "3")
        interrupt_at_chunk(mp, 8)
        assert main(args) == 130
    assert len(RunStore(out).finished_cells()) == 3
    assert main(["report", str(out), "--permutations", "20"]) == 0
    return out


def test_report_of_an_unfinished_run_says_so_on_its_first_screen(unfinished_dir, html, capsys):
    page = (unfinished_dir / "report.html").read_text(encoding="utf-8")
    notice = re.search(r'<p class="incomplete" id="incomplete">([^<]*)</p>', page)
    assert notice and notice.group(1).startswith("incomplete: 3 of 4 cells")
    assert page.index('id="incomplete"') < page.index('<section id="headline">')     # under the title
    assert 'id="incomplete"' not in html                                            # a finished run: none
    pypdf = pytest.importorskip("pypdf")
    first = pypdf.PdfReader(unfinished_dir / "report.pdf").pages[0].extract_text()
    assert "incomplete: 3 of 4 cells" in first
    capsys.readouterr()
    assert main(["report", str(unfinished_dir), "--json", "--permutations", "20"]) == 0
    found = json.loads(capsys.readouterr().out)["incomplete"]
    assert found["finished_cells"] == 3 and found["cells"] == 4


def test_every_pdf_page_is_a4_and_figures_are_landscape(run_dir):
    pypdf = pytest.importorskip("pypdf")
    reader = pypdf.PdfReader(run_dir / "report.pdf")
    a4 = (841.68, 595.44)
    sizes = [(float(p.mediabox.width), float(p.mediabox.height)) for p in reader.pages]
    for size in sizes:
        assert min(max(abs(a - b) for a, b in zip(size, paper)) for paper in (a4, a4[::-1])) < 1, size
    for page in reader.pages:
        text = page.extract_text()
        if any(title in text for title in FIGURE_TITLES):
            assert float(page.mediabox.width) > float(page.mediabox.height)


def test_significance_heatmap_labels_are_readable_on_the_pdf_page():
    """24 codecs at three storage levels (the README's main job): tick labels of at least 7 pt
    on the PDF page the figure is scaled onto (they were about 2 pt: a 35-inch-wide figure)."""
    import matplotlib.pyplot as plt

    import schemes
    from reports.figures import significance_figure
    from reports.pdf import page_scale
    from reports.styles import scheme_styles

    names = schemes.registry.all_schemes()
    rng = np.random.default_rng(3)
    rows = []
    for name in names:
        for budget in (2, 3, 4):
            for trial in range(6):
                row = {c: rng.uniform(0.01, 0.5) for c in TRIAL_COLUMNS}
                row.update(scenario="heavy_tail", scheme=name, budget=budget, dim=32, seq_len=64, queries=8,
                           trial=trial, seed=0, impl="torch", device="cpu", dtype="float32", rng="pcg64", heads=1,
                           calib_tokens=512, bits_per_element=budget + 0.5, storage_bits_per_element=budget + 0.5)
                rows.append(row)
    f = significance_figure(analyse(pd.DataFrame(rows), n_permutations=20), scheme_styles(names))
    try:
        labels = [t for ax in f.figure.axes[:-1] for t in ax.get_xticklabels() + ax.get_yticklabels() if t.get_text()]
        assert {t.get_text() for t in labels} == set(names)
        assert min(t.get_fontsize() for t in labels) * page_scale(f.figure) >= 7
    finally:
        plt.close(f.figure)


@pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian's chromium is not installed (/usr/bin/chromium); "
                    ".ci/run installs it with apt-get install chromium")
def test_screenshot_captures_the_whole_page(tmp_path):
    """A page 9000 CSS pixels tall with a red band at its very bottom: the PNG holds all of it
    (it was cut at 6000 px) and ends just below the band (the blank bottom is cropped)."""
    from reports.screenshot import screenshot
    page = tmp_path / "tall.html"
    page.write_text('<!DOCTYPE html><html><body style="margin:0;background:#fff">'
                    '<div style="height:8960px;background:linear-gradient(#eee,#ccc)"></div>'
                    '<div style="height:40px;background:#f00"></div></body></html>', encoding="utf-8")
    png = screenshot(page, tmp_path / "tall.png", width=800)
    pixels = np.asarray(Image.open(png).convert("RGB")).astype(int)
    assert pixels.shape[1] == 800 and 9000 <= pixels.shape[0] <= 9000 + 64
    band = pixels[8965:8995]
    assert (band[..., 0] > 200).all() and (band[..., 1] < 60).all()


def test_a_front_codec_in_no_comparison_is_named_on_the_first_screen_with_the_levels_that_compare_it(run_dir,
                                                                                                     tmp_path):
    """Codecs on the front that no storage level reaches (the default levels, b + 0.5, miss the
    codecs storing b + 2 bits/element at d = 16) are named under the headline, with why and the
    --storage-levels that compare them; given those levels, they are compared."""
    import re as _re
    import shutil

    from reports.narrative import setting_summaries

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("report.*"))
    assert main(["report", str(copy), "--permutations", "20"]) == 0
    html = (copy / "report.html").read_text(encoding="utf-8")
    headline = html.split('id="headline"', 1)[1].split("</section>", 1)[0]
    said = [m for m in _re.finditer(r"Not compared at any storage level: (.*?) — .*?--storage-levels ([\d.,]+)`",
                                    headline) if "on the Pareto front" in m.group(1)]
    assert said, "no front codec named under the headline"
    levels = tuple(float(x) for x in said[0].group(2).split(","))
    named = set(_re.findall(r"([\w-]+) \(", said[0].group(1)))
    found = analyse(RunStore(run_dir).trials(), n_permutations=20, levels=levels)
    placed = set(found.equal.scheme.unique())
    assert named & placed and all(not s.unplaced or not (named & placed) & set(_re.findall(r"([\w-]+) \(", s.unplaced))
                                  for v in setting_summaries(found).values() for s in v)


def _crowded_front(names):
    """Findings whose Pareto front is every codec: codec i < n − 1 at 2 + 0.06 i bits with mean d2_t
    0.5 · 0.93^i, close together, and the last at 9 bits and 0.001, so the others crowd one end of
    the axis (their labels collide at fixed offsets)."""
    rng = np.random.default_rng(12)
    rows = []
    for i, name in enumerate(names):
        bits, error = (2 + 0.06 * i, 0.5 * 0.93 ** i) if i < len(names) - 1 else (9.0, 0.001)
        for trial in range(6):
            row = {c: rng.uniform(0.01, 0.5) for c in TRIAL_COLUMNS}
            row.update(scenario="gaussian", scheme=name, budget=2, dim=32, seq_len=64, queries=8, trial=trial, seed=0,
                       impl="torch", device="cpu", dtype="float32", rng="pcg64", heads=1, calib_tokens=512,
                       bits_per_element=bits, storage_bits_per_element=bits,
                       d2_t=error * (1 + 0.01 * rng.standard_normal()))
            rows.append(row)
    return analyse(pd.DataFrame(rows), n_permutations=20)


def _label_overlaps(figure) -> int:
    renderer = figure.canvas.get_renderer()
    count = 0
    for ax in figure.axes:
        boxes = [t.get_window_extent(renderer) for t in ax.texts if hasattr(t, "xyann")]
        count += sum(1 for i, a in enumerate(boxes) for b in boxes[i + 1:]
                     if max(0, min(a.x1, b.x1) - max(a.x0, b.x0)) * max(0, min(a.y1, b.y1) - max(a.y0, b.y0)) > 0)
    return count


def test_front_labels_do_not_overlap(monkeypatch):
    """Each front point's label sits where it overlaps no other label of its panel; at the fixed
    offsets the labels of this crowded front collide."""
    import matplotlib.pyplot as plt

    import reports.figures as figures_module
    import schemes

    findings = _crowded_front(schemes.available()[:8])
    assert findings.cells.on_front.sum() == 8
    placed = figures_module.front_figure(findings, figures_module.scheme_styles(findings.cells.scheme.unique()),
                                         "gaussian").figure
    monkeypatch.setattr(figures_module, "_place_labels", lambda ax, renderer: None)
    fixed = figures_module.front_figure(findings, figures_module.scheme_styles(findings.cells.scheme.unique()),
                                        "gaussian").figure
    try:
        assert _label_overlaps(fixed) > 0 and _label_overlaps(placed) == 0
    finally:
        plt.close(placed)
        plt.close(fixed)


def test_a_figure_too_tall_for_legible_text_on_its_page_is_drawn_and_fits_the_box():
    """A grid of 90 panels (a predictivity run's per-scenario figures reach 270 inches) would be drawn
    at under 5 dots per inch to fit its page, where FreeType cannot set 10-point text (a crash):
    it is drawn at MIN_PPI and shrunk onto the page box."""
    import matplotlib.pyplot as plt

    from reports.raster import FIGURE_BOX, MIN_PPI, page_image, page_size
    fig, axes = plt.subplots(90, 1, figsize=(12, 270))
    for ax in axes:
        ax.set_title("panel", fontsize=10)
        ax.plot([1, 2], [1, 2])
    try:
        image, dpi = page_image(fig)
        width, height = page_size(fig)
    finally:
        plt.close(fig)
    assert dpi == MIN_PPI and image.size[1] > 100 * MIN_PPI
    assert width <= FIGURE_BOX[0] + 1e-9 and height <= FIGURE_BOX[1] + 1e-9


# What running a sweep needs and reading one does not: the scenarios, the codecs, the engine,
# numba's compiled loops and torch (issue 49: their imports, through harness.sweep, harness.runner
# and the energy tests, were seconds of the main job's report).
RUN_ONLY_MODULES = ("scenarios", "schemes", "numba", "torch", "harness.cell", "harness.runner")


def test_report_imports_nothing_that_only_a_run_needs(run_dir, tmp_path):
    """`harness report` on a stored run, in a process of its own, imports no scenario, codec,
    sweep engine, numba or torch (the verdicts' energy tests run on NumPy)."""
    import sys

    for name in ("results.sqlite", "manifest.json"):   # a copy: the report writes into its directory
        shutil.copy(run_dir / name, tmp_path / name)
    probe = ("import sys; from harness.cli import main; status = main(['report', sys.argv[1], '--permutations', '20']); "
             "print(status, *sorted(m for m in sys.modules if m in sys.argv[2:] or m.split('.')[0] in sys.argv[2:]))")
    seen = subprocess.run([sys.executable, "-c", probe, str(tmp_path), *RUN_ONLY_MODULES],
                          capture_output=True, text=True, check=True)
    status, *imported = seen.stdout.split("\n")[-2].split()
    assert status == "0", seen.stdout + seen.stderr
    assert imported == []
