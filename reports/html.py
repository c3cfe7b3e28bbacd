"""The HTML report: one self-contained file (figures as base64 PNG data: URIs, CSS inline, no
script, nothing fetched), rendered with Jinja2 with autoescaping on, so every name that came
from configuration or plug-ins is escaped."""
from __future__ import annotations

import base64
import json

import jinja2

from .figures import ReportFigure
from .fitted import sections as fit_sections
from .raster import html_png
from stats.findings import Findings
from .narrative import (CLAIM_DETAIL_HEADER, CLAIM_HEADER, FRONT_HEADER, cell_header, cell_rows, claim_detail_rows,
                        claim_rows, crossover_header, crossover_rows, headline_header, headline_rows, lede,
                        method_sentence, setting_summaries, verdict_note, winner_header, winner_rows)


_TEMPLATE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>kvharness report: {{ title }}</title>
<style>
body { font-family: "DejaVu Sans", Helvetica, Arial, sans-serif; max-width: 1340px; margin: 1.5em auto;
       padding: 0 1em; color: #1a1a1a; line-height: 1.45; }
h1 { font-size: 1.6em; border-bottom: 2px solid #333; padding-bottom: .2em; }
h2 { font-size: 1.3em; margin-top: 2em; border-bottom: 1px solid #999; }
h3 { font-size: 1.1em; margin-top: 1.4em; }
table { border-collapse: collapse; font-size: .72em; margin: .8em 0; }
.wide { overflow-x: auto; }
th, td { border: 1px solid #bbb; padding: .15em .35em; text-align: left; vertical-align: top; }
th { background: #eee; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
figure { margin: 1.5em 0; }
figure img { max-width: 100%; height: auto; border: 1px solid #ddd; }
figcaption { font-size: .9em; color: #333; }
.absent { color: #7a4b00; background: #fff6e5; padding: .4em .6em; border-left: 3px solid #e0a030; }
.note { font-size: .9em; color: #444; }
nav ul { columns: 4; font-size: .9em; }
.incomplete { color: #8a1c00; background: #fff0eb; border-left: 3px solid #d0502a; padding: .25em .6em;
              margin: -.3em 0 .6em; font-weight: bold; font-size: .95em; }
.lede { color: #333; margin: -.4em 0 .6em; font-size: .95em; }
.headline { display: flex; gap: 1.2em; align-items: flex-start; margin-bottom: .6em; }
.headline figure.front { margin: 0; flex: 0 0 auto; }
.headline figure.front img { width: 520px; }
.headline h2 { font-size: 1.15em; margin: 0 0 .3em; border: none; }
.headline-table { flex: 1 1 0; min-width: 0; }
.headline-table table { font-size: .8em; }
table.claims { font-size: .78em; }
tr.verdict-reproduced td:nth-child(3) { color: #1a6b1a; font-weight: bold; }
tr.verdict-refuted td:nth-child(3) { color: #a11; font-weight: bold; }
tr.verdict-partly td:nth-child(3) { color: #8a5a00; font-weight: bold; }
</style>
</head>
<body>
<h1>kvharness report: {{ title }}</h1>
{% if notice %}<p class="incomplete" id="incomplete">{{ notice }}</p>{% endif %}
<p class="lede">{{ lede }}</p>
<section id="headline">
{% if claim_rows %}
<h2 id="claims">The AMD paper, claim by claim</h2>
<table class="claims" id="claims-table">
<thead><tr>{% for c in claim_header %}<th>{{ c }}</th>{% endfor %}</tr></thead>
<tbody>{% for row in claim_rows %}<tr class="verdict-{{ row[2] }}">{% for v in row %}<td>{{ v }}</td>{% endfor %}</tr>{% endfor %}</tbody>
</table>
<p class="note">How each claim was tested and the reasons: <a href="#claim-details">claim details</a>.</p>
{% endif %}
{% for h in headlines %}
<div class="headline">
{% if h.png %}<figure class="front" id="figure-{{ h.key }}"><img src="data:image/png;base64,{{ h.png }}" alt="{{ h.title }}" width="{{ h.width }}" height="{{ h.height }}"></figure>{% endif %}
<div class="headline-table">
<h2>{{ h.scenario }}: best codec at each storage level</h2>
<table class="headline-rows" id="headline-table-{{ loop.index }}">
<thead><tr>{% for c in headline_header %}<th>{{ c }}</th>{% endfor %}</tr></thead>
<tbody>{% for row in h.rows %}<tr>{% for v in row %}<td{% if loop.index > 1 %} class="num"{% endif %}>{{ v }}</td>{% endfor %}</tr>{% else %}<tr><td colspan="{{ headline_header|length }}">No storage level holds a codec: see the front and the cell table (harness report --storage-levels).</td></tr>{% endfor %}</tbody>
</table>
<p class="note">{{ h.caption }}</p>
{% if h.unplaced %}<p class="note">{{ h.unplaced }}</p>{% endif %}
</div>
</div>
{% endfor %}
</section>
{% for anchor, title, header, rows, note in fit_sections %}
<section id="{{ anchor }}">
<h2>{{ title }}</h2>
<div class="wide"><table id="{{ anchor }}-table">
<thead><tr>{% for c in header %}<th>{{ c }}</th>{% endfor %}</tr></thead>
<tbody>{% for row in rows %}<tr>{% for v in row %}<td{% if loop.index > 1 %} class="num"{% endif %}>{{ v }}</td>{% endfor %}</tr>{% endfor %}</tbody>
</table></div>
<p class="note">{{ note }}</p>
</section>
{% endfor %}
<nav id="contents"><ul>
<li><a href="#summary">Summary: every storage level, fronts, method</a></li>
<li><a href="#figures">Figures</a></li>
<li><a href="#cells">Every cell, crossovers</a></li>
<li><a href="#provenance">Provenance</a></li>
</ul></nav>

<section id="summary">
<h2>Summary</h2>
<h3>Best codec at each storage level, in full</h3>
<div class="wide"><table id="winners-table">
<thead><tr>{% for h in winner_header %}<th>{{ h }}</th>{% endfor %}</tr></thead>
<tbody>{% for row in winner_rows %}<tr>{% for v in row %}<td{% if loop.index > 1 %} class="num"{% endif %}>{{ v }}</td>{% endfor %}</tr>{% endfor %}</tbody>
</table></div>
<p class="note">{{ verdict_note }}</p>
{% for scenario, settings in summaries.items() %}{% set outer = loop.index %}
<h3 id="scenario-{{ outer }}">Scenario {{ scenario }}: the Pareto front on measured storage</h3>
{% for s in settings %}
<p><strong>{{ s.label }}.</strong> Non-dominated cells (no other cell stores fewer bits with a lower mean d₂(T)), cheapest first:</p>
<div class="wide"><table class="front-table" id="front-table-{{ outer }}-{{ loop.index }}">
<thead><tr>{% for h in front_header %}<th>{{ h }}</th>{% endfor %}</tr></thead>
<tbody>{% for row in s.front %}<tr>{% for v in row %}<td{% if loop.index > 1 %} class="num"{% endif %}>{{ v }}</td>{% endfor %}</tr>{% endfor %}</tbody>
</table></div>
{% if s.unplaced %}<p class="note">{{ s.unplaced }}</p>{% endif %}
{% endfor %}
{% endfor %}
{% if claim_rows %}
<h3 id="claim-details">Claim details</h3>
<div class="wide"><table id="claim-details-table">
<thead><tr>{% for c in claim_detail_header %}<th>{{ c }}</th>{% endfor %}</tr></thead>
<tbody>{% for row in claim_detail_rows %}<tr>{% for v in row %}<td>{{ v }}</td>{% endfor %}</tr>{% endfor %}</tbody>
</table></div>
{% endif %}
<h3>Method</h3>
<p>{{ method }}</p>
</section>

<section id="figures">
<h2>Figures</h2>
{% for f in figures %}
<figure id="figure-{{ f.key }}">
<h3>{{ f.title }}</h3>
{% if f.png %}<img src="data:image/png;base64,{{ f.png }}" alt="{{ f.title }}" width="{{ f.width }}" height="{{ f.height }}">
<figcaption>{{ f.caption }}</figcaption>
{% else %}<p class="absent">Not shown: {{ f.absent_reason }}.</p>{% endif %}
</figure>
{% endfor %}
</section>

<section id="cells">
<h2>Every cell</h2>
<p class="note">Means over trials with 95% Student-t confidence intervals; P(front): the share of paired-bootstrap
replicates in which the cell is non-dominated on (bits per element, d₂(T)), * when it is on the observed front.</p>
<div class="wide"><table id="cells-table">
<thead><tr>{% for h in cell_header %}<th>{{ h }}</th>{% endfor %}</tr></thead>
<tbody>{% for row in cell_rows %}<tr>{% for v in row %}<td{% if loop.index > 2 %} class="num"{% endif %}>{{ v }}</td>{% endfor %}</tr>{% endfor %}</tbody>
</table></div>
<h3 id="crossovers">Crossovers along the storage axis</h3>
{% if crossover_rows %}<div class="wide"><table id="crossovers-table">
<thead><tr>{% for h in crossover_header %}<th>{{ h }}</th>{% endfor %}</tr></thead>
<tbody>{% for row in crossover_rows %}<tr>{% for v in row %}<td>{{ v }}</td>{% endfor %}</tr>{% endfor %}</tbody>
</table></div>{% else %}<p>None: no pair of schemes swaps order between consecutive storage levels.</p>{% endif %}
</section>

<section id="provenance">
<h2>Provenance</h2>
<table id="provenance-table">
<tbody>{% for k, v in provenance %}<tr><th>{{ k }}</th><td>{{ v }}</td></tr>{% endfor %}</tbody>
</table>
<h3>Configuration</h3>
<pre>{{ config_json }}</pre>
</section>
</body>
</html>
"""


def png_base64(figure) -> tuple[str, int, int]:
    """A figure as base64 PNG text (reports.raster: drawn once for the HTML and the PDF) and its
    pixel width and height."""
    data = html_png(figure)
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")  # IHDR
    return base64.b64encode(data).decode("ascii"), width, height


def provenance_rows(manifest: dict | None, findings: Findings, run_time: str) -> list[tuple[str, str]]:
    """(label, value) pairs: versions, git SHA, device, times, and what the rows themselves record."""
    manifest = manifest or {}
    rows = [("run time", run_time), ("started at", str(manifest.get("started_at"))),
            ("finished at", str(manifest.get("finished_at")))]
    if manifest.get("resumed_at"):
        rows.append(("resumed at", ", ".join(map(str, manifest["resumed_at"]))))
    rows += [(k, str(v)) for k, v in sorted((manifest.get("provenance") or {}).items())]
    t = findings.trials
    for col in ("seed", "rng", "impl", "device", "dtype", "heads", "calib_tokens"):
        if col in t.columns:
            rows.append((f"{col} (in the rows)", ", ".join(map(str, sorted(t[col].unique())))))
    if not manifest:
        rows.insert(0, ("manifest", "absent: manifest.json is missing, only the rows are known"))
    return rows


def render_html(title: str, findings: Findings, figures: list[ReportFigure], manifest: dict | None,
                run_time: str, notice: str | None = None) -> str:
    """The page; `notice` (an unfinished run's 'incomplete: n of m cells ...') under the title."""
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    shown, headlines = [], []
    for f in figures:
        entry = {"key": f.key, "title": f.title, "caption": f.caption, "absent_reason": f.absent_reason, "png": None}
        if f.figure is not None:
            entry["png"], entry["width"], entry["height"] = png_base64(f.figure)
        if f.key.startswith("front-"):
            scenario = f.key[len("front-"):]
            unplaced = " ".join(x.unplaced for x in setting_summaries(findings).get(scenario, []) if x.unplaced)
            headlines.append({**entry, "scenario": scenario, "rows": headline_rows(findings, scenario),
                              "unplaced": unplaced})
        else:
            shown.append(entry)
    return env.from_string(_TEMPLATE).render(
        title=title, notice=notice, lede=lede(findings), headlines=headlines, headline_header=headline_header(findings),
        claim_header=CLAIM_HEADER, claim_rows=claim_rows(findings), claim_detail_header=CLAIM_DETAIL_HEADER,
        claim_detail_rows=claim_detail_rows(findings), fit_sections=fit_sections(findings),
        method=method_sentence(findings), summaries=setting_summaries(findings), front_header=FRONT_HEADER,
        winner_header=winner_header(findings), winner_rows=winner_rows(findings), verdict_note=verdict_note(findings),
        figures=shown, cell_header=cell_header(findings), cell_rows=cell_rows(findings),
        crossover_header=crossover_header(findings), crossover_rows=crossover_rows(findings),
        provenance=provenance_rows(manifest, findings, run_time),
        config_json=json.dumps((manifest or {}).get("config", {}), indent=2, sort_keys=True))
