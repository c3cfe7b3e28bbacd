"""harness report DIR: DIR/report.html (self-contained) and DIR/report.pdf from the stored rows."""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

from kvcommon.rows import CLAIMS_TABLE
from stats.equal_storage import parse_levels

from ..errors import UsageError
from ..provenance import now, package_version
from ..store import RESULTS_FILE, RunStore
from ._args import WRITABLE_DIR, Once, check_path, input_dir, unique_items

NAME = "report"
HELP = "write DIR/report.html and DIR/report.pdf (summary, figures, provenance) from a stored run"


def add_arguments(p):
    p.add_argument("directory", type=input_dir("a run directory (holding results.sqlite) you may read"),
                   help="a run directory (holding results.sqlite)")
    p.add_argument("--null", type=input_dir("a run directory (holding results.sqlite) you may read"), default=None,
                   metavar="NULL_DIR",
                   help="a run of the same cells differing only in RNG family, seed, impl, device or dtype: "
                        "the implementation null of the codec-difference verdicts")
    p.add_argument("--screenshot", action="store_true",
                   help="also write DIR/report.png, the page as headless Chromium renders it")
    p.add_argument("--permutations", type=int, default=1000,
                   help="permutations of each energy test in the verdicts (default 1000)")
    p.add_argument("--storage-levels", default=None, metavar="X[,X...]", type=unique_items, action=Once,
                   help="bits per element at which codecs are compared at equal storage (default: b + 0.5 for "
                        "each budget b of the run)")
    p.add_argument("--json", action="store_true",
                   help="print the findings (Pareto fronts, best codec per storage level, verdicts, crossovers, and "
                        "the claims of a reproduction) as one JSON object instead of writing report.html and report.pdf")


def _run_time(store: RunStore, manifest: dict | None) -> str:
    """Wall time from the manifest's start and finish, and the summed per-cell compute time."""
    parts = []
    try:
        start = datetime.datetime.fromisoformat(manifest["started_at"])
        end = datetime.datetime.fromisoformat(manifest["finished_at"])
        parts.append(f"{(end - start).total_seconds():.0f} s from start to finish")
    except (TypeError, KeyError, ValueError):
        parts.append("unknown (the run did not record its start and finish)")
    con = sqlite3.connect(store.path)
    try:
        total = con.execute("SELECT SUM(wall_s), COUNT(*) FROM cells").fetchone()
        if total and total[0] is not None:
            parts.append(f"{total[0]:.1f} s of cell compute over {total[1]} cells")
    except sqlite3.Error:
        pass
    finally:
        con.close()
    return "; ".join(parts)


def incomplete_notice(store: RunStore) -> str | None:
    """'incomplete: n of m cells ...' for a run whose cells are not all finished, else None."""
    counts = store.completion()   # harness.runner.completion's, without importing the runner (torch)
    if counts is None or counts[0] >= counts[1]:
        return None
    done, expected = counts
    return (f"incomplete: {done} of {expected} cells — only finished cells are reported; the others have not run, "
            f"or not all their trials (harness run ... --resume finishes the run)")


def _findings(directory: Path, null_directory: Path | None, n_permutations: int, levels):
    from kvcommon.rows import CELL_COLUMNS
    from stats.findings import analyse

    from .compare import shared_cells

    trials = RunStore(directory).trials()
    if trials.empty:
        raise UsageError(f"harness report: {directory / RESULTS_FILE} holds no trials yet; run or resume the sweep first")
    null_trials = RunStore(null_directory).trials() if null_directory is not None else None
    if null_trials is not None and shared_cells(trials, null_trials).empty:
        raise UsageError(f"harness report: --null {null_directory} shares no cell with {directory} (cells are matched "
                         f"on {', '.join(CELL_COLUMNS)}): it would judge nothing; give a run of the same cells")
    findings = analyse(trials, null_trials, n_permutations, levels)
    for line in findings.left_out:   # cells whose stored values are not finite: named, the rest reported
        print(f"harness report: {line}", file=sys.stderr)
    # a reproduction (harness reproduce) stores its claims beside the trials; predictivity and
    # recommend their tables (harness/fit_tables.py)
    from ..fit_tables import read
    store = RunStore(directory)
    return dataclasses.replace(findings, claims=store.table(CLAIMS_TABLE), tables=read(store))


def write_report(directory: Path, null_directory: Path | None = None, n_permutations: int = 1000,
                 levels=None) -> tuple[Path, Path]:
    """Analyse the run in `directory` and write report.html and report.pdf there; each file is
    written under a temporary name and renamed, so neither is ever half-written. Both files show
    each figure's one drawing (reports.raster)."""
    import matplotlib.pyplot as plt

    from reports.figures import build_figures
    from reports.html import provenance_rows, render_html
    from reports.pdf import pdf_beside

    store = RunStore(directory)
    findings = _findings(directory, null_directory, n_permutations, levels)
    manifest = store.read_manifest()
    notice = "; ".join(filter(None, [incomplete_notice(store), *findings.left_out])) or None
    title = directory.resolve().name
    run_time = _run_time(store, manifest)
    html_path, pdf_path = directory / "report.html", directory / "report.pdf"
    tmp_html, tmp_pdf = directory / ".report.html.tmp", directory / ".report.pdf.tmp"
    figures = []
    try:
        # the PDF's tables are written beside the figures' building and the HTML (pdf_beside)
        with pdf_beside(tmp_pdf, title, findings, provenance_rows(manifest, findings, run_time), notice=notice) as shown:
            figures = build_figures(findings)
            shown.extend(figures)
            tmp_html.write_text(render_html(title, findings, figures, manifest, run_time, notice=notice),
                                encoding="utf-8")
        os.replace(tmp_html, html_path)
        os.replace(tmp_pdf, pdf_path)
    finally:
        for f in figures:
            if f.figure is not None:
                plt.close(f.figure)
        for tmp in (tmp_html, tmp_pdf):
            tmp.unlink(missing_ok=True)
    return html_path, pdf_path


def run(args) -> int:
    if not args.json:   # report.html and report.pdf go into the run directory
        check_path(args.directory, WRITABLE_DIR, "report", "DIR", "a run directory you may write to (report.html goes there), or --json")
    store = RunStore(args.directory)
    if not store.path.exists():
        raise UsageError(f"harness report: {args.directory} holds no {RESULTS_FILE}; give a run directory "
                         f"(made by `python -m harness run --out DIR`)")
    if args.null is not None and not RunStore(args.null).path.exists():
        raise UsageError(f"harness report: --null {args.null} holds no {RESULTS_FILE}; give a run directory")
    if args.permutations < 1:
        raise UsageError(f"harness report: --permutations {args.permutations} must be a positive integer")
    store.check_integrity()
    if args.null is not None:
        RunStore(args.null).check_integrity()
    for checked in (store, RunStore(args.null)) if args.null is not None else (store,):   # the rows' integrity
        for line in checked.check_trials():   # DamagedRows refused; a cell missing trials named, read as unfinished
            print(f"harness report: {checked.directory}: {line}", file=sys.stderr)
        checked.check_reportable()            # UnusableStore: no cell with finite values
    levels = None
    if args.storage_levels is not None:
        try:
            levels = parse_levels(args.storage_levels)
        except ValueError as exc:
            raise UsageError(f"harness report: --storage-levels: {exc}") from None
    if args.json:
        from stats.findings import to_json

        from ..fit_tables import records
        findings = _findings(args.directory, args.null, args.permutations, levels)
        out = to_json(findings)
        out.update(records(findings.tables))   # fit_layers, predictivity, ..., recommendation: where the run has them
        command = (f"harness report {args.directory} --json --permutations {args.permutations}"
                   + (f" --null {args.null}" if args.null is not None else "")
                   + (f" --storage-levels {args.storage_levels}" if args.storage_levels is not None else ""))
        out["provenance"] = {"kvharness": package_version(), "command": command, "created_at": now(),
                             "run": str(args.directory), "null": str(args.null) if args.null is not None else None}
        notice = incomplete_notice(store)
        if notice is not None:
            done, expected = store.completion()
            out["incomplete"] = {"finished_cells": done, "cells": expected, "notice": notice}
        print(json.dumps(out, indent=2))
        return 0
    if args.screenshot:
        from reports.screenshot import chromium
        if chromium() is None:
            raise UsageError("harness report: --screenshot needs Debian's chromium (apt-get install chromium)")
    html_path, pdf_path = write_report(args.directory, args.null, args.permutations, levels)
    print(f"report -> {html_path} and {pdf_path}")
    if args.screenshot:
        from reports.screenshot import screenshot
        try:
            print(f"screenshot -> {screenshot(html_path, args.directory / 'report.png')}")
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            print(f"error: harness report: {exc}", file=sys.stderr)
            return 1
    return 0
