"""The report's figures (matplotlib, Agg backend) from the tidy frames of stats/findings.py.

Each builder returns a ReportFigure: a matplotlib Figure, or None with the reason the run
cannot support it. Every codec has one fixed style (reports.styles: colour, marker, line
style) in every figure, and figures are faceted by codec family so that no panel draws more
than MAX_SERIES (8) codecs. Each artist drawn for a codec carries the codec's name as its gid,
which is how the tests count a panel's series and check its colours.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import matplotlib

matplotlib.use("Agg")  # files only, never a display; must precede pyplot

import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.text  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib import ticker  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from kvcommon.rows import SIX_D  # noqa: E402

from stats.findings import SETTING, Findings  # noqa: E402
from stats.margins import ALPHA  # noqa: E402
from .styles import MAX_SERIES, SchemeStyle, panel_groups, scheme_styles  # noqa: E402

_UNIT_D2 = "(dimensionless)"
# The area of an A4 landscape PDF page a figure may take (inches; reports.pdf draws figures that
# fit it at their own size) and the smallest label size there, in points.
PAGE_FIGURE_BOX = (10.9, 6.7)
_LABEL_PT = 7
_FRONT_COLOUR = "black"
_CELL_GREY = "#b8b8b8"


@dataclass
class ReportFigure:
    key: str
    title: str
    caption: str
    figure: Figure | None = None
    absent_reason: str | None = None


def _main_slice(frame: pd.DataFrame, every_calibration: bool = False) -> tuple[pd.DataFrame, str]:
    """The rows at the largest seq_len and queries and, unless every_calibration, the largest
    calibration size (figures show one such slice, so no line or panel mixes settings; the
    summary table has every cell), and words saying which slice it is (n_cal only when the
    frame has several calibration sizes)."""
    s, nq = frame.seq_len.max(), frame.queries.max()
    rows, where = frame[(frame.seq_len == s) & (frame.queries == nq)], f"S = {s} cached tokens, Nq = {nq} queries"
    if not every_calibration and frame.calib_tokens.nunique() > 1:
        n_cal = frame.calib_tokens.max()
        rows, where = rows[rows.calib_tokens == n_cal], f"{where}, n_cal = {n_cal} calibration tokens"
    return rows, where


def _scale(ax, axis: str, values) -> None:
    """Log scale with ticks at 1, 2, 5 × 10^k and plain labels when the positive values span
    a factor of 3 or more; otherwise stay linear (a log axis over a narrow range shows no
    readable ticks)."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    if len(v) == 0 or (v <= 0).any() or v.max() < 3 * v.min():
        return
    target = ax.xaxis if axis == "x" else ax.yaxis
    (ax.set_xscale if axis == "x" else ax.set_yscale)("log")
    decades = np.log10(v.max() / v.min())
    if decades > 4:  # wide: a few powers of ten, written 10^k so labels stay short
        target.set_major_locator(ticker.LogLocator(base=10, numticks=7))
        target.set_major_formatter(ticker.LogFormatterSciNotation())
    else:
        subs = (1.0, 2.0, 5.0) if decades <= 2.5 else (1.0,)
        target.set_major_locator(ticker.LogLocator(base=10, subs=subs, numticks=12))
        target.set_major_formatter(ticker.FuncFormatter(lambda x, _: f"{x:.2g}"))
    target.set_minor_locator(ticker.NullLocator())


def _grid(n_rows: int, n_cols: int, width: float = 3.6, height: float = 2.9, **kw):
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(width * n_cols + 1.8, height * n_rows + 0.6),
                             squeeze=False, **kw)
    return fig, axes


def _family_grid(row_keys: list, names, width: float = 3.6, height: float = 2.9, **kw):
    """A grid with one row per row key and one column per codec-family panel (reports.styles):
    (fig, axes, groups), groups the [(family, [names])] of the columns."""
    groups = panel_groups(names)
    fig, axes = _grid(len(row_keys), len(groups), width, height, **kw)
    return fig, axes, groups


def _codec_series(frame, names, styles, order: str | None = None):
    """(name, its rows sorted by `order`, its style) for each codec of `names` in frame, by name."""
    for name, g in frame[frame.scheme.isin(names)].groupby("scheme"):
        yield name, (g.sort_values(order) if order else g), styles[name]


def _tag(artists, name: str):
    """Name the artists drawn for one codec (their gid): see the module doc."""
    for artist in artists if isinstance(artists, (list, tuple)) else [artists]:
        for part in getattr(artist, "lines", None) or [artist]:
            for a in part if isinstance(part, (list, tuple)) else [part]:
                if a is not None:
                    a.set_gid(name)
    return artists


def _legend(fig: Figure, styles: dict[str, SchemeStyle], names, extra=()) -> None:
    """Legends of at most MAX_SERIES codecs, each as large as its panels: the panels are faceted
    by codec family, one family group a column (a legend under each column) or a row (a legend
    right of each row); the extra handles (reference lines) in one legend above the panels."""
    names = set(names)
    panels = []
    for ax in fig.axes:
        spec = ax.get_subplotspec()
        drawn = {a.get_gid() for a in [*ax.lines, *ax.collections] if a.get_gid() in names}
        if spec is not None and drawn:
            panels.append((spec.rowspan.start, spec.colspan.start, ax, drawn))

    def grouped(index: int) -> dict[int, tuple]:
        groups: dict[int, tuple] = {}
        for panel in panels:
            last, seen = groups.get(panel[index], (panel, set()))
            groups[panel[index]] = (max(last, panel, key=lambda p: p[1 - index]), seen | panel[3])
        return groups

    by_column, by_row = grouped(1), grouped(0)
    right = 0.0   # inches kept free right of the panels for row legends
    if all(len(drawn) <= MAX_SERIES for _, drawn in by_column.values()):
        places = [(panel[2], drawn, dict(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2))
                  for panel, drawn in by_column.values()]
    elif all(len(drawn) <= MAX_SERIES for _, drawn in by_row.values()):
        places = [(panel[2], drawn, dict(loc="center left", bbox_to_anchor=(1.02, 0.5)))
                  for panel, drawn in by_row.values()]
        right = 1.5
    else:
        places = [(ax, drawn, dict(loc="best")) for _, _, ax, drawn in panels]
    for ax, drawn, where in places:
        handles = [plt.Line2D([], [], color=styles[n].colour, marker=styles[n].marker, linestyle=styles[n].line,
                              label=n) for n in sorted(drawn)]
        legend = ax.legend(handles=handles, frameon=False, title="scheme", **where)
        legend.set_in_layout(not right)   # a row legend sits in the margin kept for it
    top = 0.0
    if extra:
        fig.legend(handles=list(extra), loc="upper center", bbox_to_anchor=(0.5, 1.0), ncol=len(extra),
                   frameon=False)
        top = 0.3
    fig.tight_layout(rect=(0, 0, 1 - right / fig.get_figwidth(), 1 - top / fig.get_figheight()))


def _representative(values, n: int = 3) -> list:
    """Up to n of the sorted values: the smallest, the middle and the largest."""
    values = sorted(values)
    if len(values) <= n:
        return values
    return sorted({values[0], values[len(values) // 2], values[-1]})


def dimension_figure(findings: Findings, styles) -> ReportFigure:
    """The AMD paper's Figure 1: d2_T against head dimension, one line per scheme, one row per
    (scenario, budget) at up to three budgets (smallest, middle, largest; the paper shows 2, 4, 6),
    one column per codec family."""
    title = "Attention-output error d₂(T) against head dimension"
    cells, where = _main_slice(findings.cells)
    dims = sorted(cells.dim.unique())
    if len(dims) < 2:
        return ReportFigure("dimension", title, "", absent_reason=f"the run has one head dimension (d = {dims[0]}); "
                            "this figure needs two or more (--dim 64,128,256)")
    budgets = _representative(cells.budget.unique())
    rows = [(sc, b) for sc in sorted(cells.scenario.unique()) for b in budgets]
    fig, axes, groups = _family_grid(rows, cells.scheme.unique(), sharex=True)
    for r, (sc, b) in enumerate(rows):
        for c, (fam, names) in enumerate(groups):
            ax = axes[r, c]
            sel = cells[(cells.scenario == sc) & (cells.budget == b) & cells.scheme.isin(names)]
            drawn = sorted(sel.scheme.unique())
            for i, (name, g, st) in enumerate(_codec_series(sel, names, styles, "dim")):
                # a small multiplicative dodge so overlapping error bars stay apart
                x = g.dim * 2 ** (0.02 * (i - (len(drawn) - 1) / 2))
                _tag(ax.errorbar(x, g.d2_t, yerr=_bars(g.d2_t - g.d2_t_low, g.d2_t_high - g.d2_t), color=st.colour,
                                 marker=st.marker, linestyle=st.line, capsize=2, markersize=4, linewidth=1.2), name)
            if len(sel):
                _scale(ax, "y", sel.d2_t)
            ax.set_xscale("log", base=2)
            ax.set_xticks(dims, [str(d) for d in dims])
            ax.set_title(f"{sc}, b = {b} bits: {fam}", fontsize=9)
            ax.set_xlabel("head dimension d (coordinates)")
            ax.set_ylabel(f"d₂(T) {_UNIT_D2}")
    _legend(fig, styles, cells.scheme.unique())
    caption = (f"Mean d₂(T) per trial with 95% Student-t confidence intervals (error bars) at nominal budgets "
               f"b = {', '.join(map(str, budgets))}; {where}; one column per codec family.")
    return ReportFigure("dimension", title, caption, fig)


# where a front point's label may sit (points from the point): right or left of it, just above, just
# below, then further up and down; _place_labels takes the first that overlaps no label before it
_LABEL_OFFSETS = tuple((sx * 4, dy) for dy in (3, -10, 12, -19, 21, -28, 30, -37) for sx in (1, -1))


def _bars(below, above) -> np.ndarray:
    """errorbar's (2, n) extents as a float array: lists of pandas Series there are read through
    float() of one-element Series, which pandas deprecates (a warning line per point)."""
    return np.asarray([np.asarray(below, dtype=float), np.asarray(above, dtype=float)])


def _place_labels(ax, renderer) -> None:
    """Move each annotation of ax to the first of _LABEL_OFFSETS (mirrored to the left of the point
    for negative x) where it overlaps no label placed before it and stays inside the axes; where
    none does, the one overlapping least. In display space, after the layout is final."""
    placed = []
    box_of_axes = ax.get_window_extent(renderer)
    scale = ax.figure.dpi / 72
    for label in [t for t in ax.texts if hasattr(t, "xyann")]:
        label.xyann = _LABEL_OFFSETS[0]
        label.set_horizontalalignment("left")
        base = label.get_window_extent(renderer)
        best, best_cost = None, None
        for dx, dy in _LABEL_OFFSETS:
            shift_x = (dx - _LABEL_OFFSETS[0][0]) * scale - (base.width if dx < 0 else 0)
            box = base.translated(shift_x, (dy - _LABEL_OFFSETS[0][1]) * scale)
            cost = sum(max(0, min(box.x1, b.x1) - max(box.x0, b.x0)) * max(0, min(box.y1, b.y1) - max(box.y0, b.y0))
                       for b in placed)
            cost += 0 if (box_of_axes.x0 <= box.x0 and box.x1 <= box_of_axes.x1) else base.width * base.height
            if best_cost is None or cost < best_cost:
                best, best_cost = (dx, dy, box), cost
            if cost == 0:
                break
        dx, dy, box = best
        label.xyann = (dx, dy)
        label.set_horizontalalignment("right" if dx < 0 else "left")
        placed.append(box)


def front_figure(findings: Findings, styles, scenario: str) -> ReportFigure:
    """The headline of a scenario: every cell of each setting as a grey point on (measured storage,
    mean d₂(T)), the Pareto front as a step line through its cells in the codecs' colours, each
    front point labelled with its codec and budget; one panel per setting of the scenario."""
    cells = findings.cells[findings.cells.scenario == scenario]
    settings = sorted({tuple(k) for k in cells[list(SETTING)].itertuples(index=False)})
    several_cal = findings.cells.calib_tokens.nunique() > 1
    n_cols = min(3, len(settings))
    n_rows = -(-len(settings) // n_cols)
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(5.2 if n_cols == 1 else 3.6 * n_cols, 3.5 * n_rows),
                             squeeze=False)
    front_names = sorted(cells[cells.on_front].scheme.unique(), key=lambda n: cells[cells.scheme == n].storage.min())
    coloured = set(front_names[:MAX_SERIES])
    for i, setting in enumerate(settings):
        ax = axes[divmod(i, n_cols)]
        sel = cells
        for col, val in zip(SETTING, setting):
            sel = sel[sel[col] == val]
        ax.scatter(sel.storage, sel.d2_t, s=14, color=_CELL_GREY, linewidths=0, zorder=2)
        front = sel[sel.on_front].sort_values(["storage", "d2_t"])
        ax.step(front.storage, front.d2_t, where="post", color=_FRONT_COLOUR, linewidth=0.9, zorder=3)
        # a fixed-width codec's budgets are one point (identical cells): one marker, one label
        points = front.groupby(["scheme", "storage", "d2_t", "d2_t_low", "d2_t_high"], sort=False).budget.agg(
            lambda b: ",".join(map(str, sorted(b)))).reset_index()
        for r in points.itertuples():
            st = styles[r.scheme]
            colour = st.colour if r.scheme in coloured else _FRONT_COLOUR
            _tag(ax.errorbar([r.storage], [r.d2_t], yerr=[[r.d2_t - r.d2_t_low], [r.d2_t_high - r.d2_t]],
                             color=colour, marker=st.marker, markersize=6, capsize=2, linewidth=1, zorder=4),
                 r.scheme)
            ax.annotate(f"{r.scheme} b={r.budget}", (r.storage, r.d2_t), xytext=_LABEL_OFFSETS[0],
                        textcoords="offset points", fontsize=7, color=colour)
        _scale(ax, "y", np.r_[sel.d2_t, front.d2_t_low.clip(lower=sel.d2_t.min() / 10)])
        _scale(ax, "x", sel.storage)
        _, dim, seq_len, queries, n_cal = setting
        ax.set_title(f"d = {dim}, S = {seq_len}, Nq = {queries}" + (f", n_cal = {n_cal}" if several_cal else ""),
                     fontsize=9)
        ax.set_xlabel("measured storage (bits per element)")
        ax.set_ylabel(f"mean d₂(T) {_UNIT_D2}")
    for j in range(len(settings), n_rows * n_cols):
        axes[divmod(j, n_cols)].set_visible(False)
    fig.tight_layout()
    renderer = fig.canvas.get_renderer()
    for ax in axes.flat:
        _place_labels(ax, renderer)
    caption = (f"{scenario}: grey points are every cell (a codec at one budget); the black step line is the Pareto "
               f"front (no other cell stores fewer bits with a lower mean d₂(T)), its points in the codecs' colours "
               f"with 95% confidence intervals.")
    return ReportFigure(f"front-{scenario}", f"Pareto front on measured storage: {scenario}", caption, fig)


def rate_distortion_figures(findings: Findings, styles) -> list[ReportFigure]:
    """d2_T, d2_K, d2_V against measured storage, one figure per head dimension: one row per
    (scenario, tensor), one column per codec family; the shaded band is the 95% CI of the
    mean; d2_T panels mark the Pareto front of the setting's cells (all families)."""
    cells, where = _main_slice(findings.cells)
    out = []
    metrics = (("d2_t", "T (attention output)"), ("d2_k", "K"), ("d2_v", "V"))
    for dim in sorted(cells.dim.unique()):
        sel_dim = cells[cells.dim == dim]
        rows = [(sc, m, label) for sc in sorted(sel_dim.scenario.unique()) for m, label in metrics]
        fig, axes, groups = _family_grid(rows, sel_dim.scheme.unique(), sharey="row")
        for r, (sc, m, label) in enumerate(rows):
            scen = sel_dim[sel_dim.scenario == sc]
            for c, (fam, names) in enumerate(groups):
                ax = axes[r, c]
                for name, g, st in _codec_series(scen, names, styles, "storage"):
                    _tag(ax.plot(g.storage, g[m], color=st.colour, marker=st.marker, linestyle=st.line,
                                 markersize=4, linewidth=1.2), name)
                    _tag(ax.fill_between(g.storage, g[f"{m}_low"], g[f"{m}_high"], color=st.colour,
                                         alpha=0.18, linewidth=0), name)
                if m == "d2_t":
                    front = scen[scen.on_front].sort_values("storage")
                    ax.step(front.storage, front.d2_t, where="post", color=_FRONT_COLOUR,
                            linewidth=0.8, linestyle=(0, (1, 1)))
                    ax.scatter(front.storage, front.d2_t, s=70, facecolors="none",
                               edgecolors=_FRONT_COLOUR, linewidths=0.9, zorder=5)
                _scale(ax, "y", np.r_[scen[m], scen[f"{m}_low"].clip(lower=scen[m].min() / 10)])
                ax.set_title(f"{sc}: {label}, {fam}", fontsize=9)
                ax.set_xlabel("measured storage (bits per element)")
                ax.set_ylabel(f"d₂({m[-1].upper()}) {_UNIT_D2}")
        front_handle = plt.Line2D([], [], color=_FRONT_COLOUR, marker="o", markerfacecolor="none",
                                  linestyle=(0, (1, 1)), label="Pareto front (all codecs)")
        _legend(fig, styles, sel_dim.scheme.unique(), extra=[front_handle])
        caption = (f"Head dimension d = {dim}, {where}; one column per codec family, one y axis scale per row. "
                   f"Lines join a codec's budgets; bands are 95% confidence intervals of the mean; circled points "
                   f"on the d₂(T) rows are the setting's non-dominated cells on (measured storage, d₂(T)).")
        out.append(ReportFigure(f"rate_distortion_d{dim}", f"Rate–distortion at d = {dim}", caption, fig))
    return out


def _mid(values) -> object:
    values = sorted(values)
    return values[len(values) // 2]


def error_space_figure(findings: Findings, styles) -> ReportFigure:
    """Per-trial points of the six-D error space, projected on its three (snr_err, dir_err)
    planes (K, V, T): one row per (scenario, codec family), one column per plane."""
    title = "The six-dimensional error space, projected per tensor"
    trials, where = _main_slice(findings.trials)
    dim, budget = trials.dim.max(), _mid(trials.budget.unique())
    trials = trials[(trials.dim == dim) & (trials.budget == budget)]
    groups = panel_groups(trials.scheme.unique())
    rows = [(sc, fam, names) for sc in sorted(trials.scenario.unique()) for fam, names in groups
            if trials[(trials.scenario == sc) & trials.scheme.isin(names)].size]
    fig, axes = _grid(len(rows), 3)
    planes = [(SIX_D[2 * i], SIX_D[2 * i + 1], t) for i, t in enumerate(("K", "V", "T"))]
    for r, (sc, fam, names) in enumerate(rows):
        scen = trials[trials.scenario == sc]
        for c, (x, y, tensor) in enumerate(planes):
            ax = axes[r, c]
            for name, g, st in _codec_series(scen, names, styles):
                _tag(ax.scatter(g[x], g[y], color=st.colour, marker=st.marker, s=12, alpha=0.6, linewidths=0), name)
            _scale(ax, "x", scen[x])
            _scale(ax, "y", scen[y])
            ax.set_title(f"{sc}: {tensor}, {fam}", fontsize=9)
            ax.set_xlabel(f"snr_err_{tensor.lower()} = relMSE/(1+relMSE)")
            ax.set_ylabel(f"dir_err_{tensor.lower()} = 1 − cos")
    _legend(fig, styles, trials.scheme.unique())
    caption = (f"One point per trial at d = {dim}, b = {budget} bits, {where}; the six coordinates "
               f"({', '.join(SIX_D)}) are shown as three planes, one row per codec family. d₂ is the distance "
               f"from the origin.")
    return ReportFigure("error_space", title, caption, fig)


def significance_figure(findings: Findings, styles) -> ReportFigure:
    """The effect size on d2_T between every pair of schemes (row vs column) at each storage
    level, annotated with the effect and a star where the Holm-corrected p-value is below ALPHA
    (paired Wilcoxon and rank-biserial r where the trials are paired, else Mann–Whitney and
    Cliff's δ: both lie in [−1, 1])."""
    title = "Pairwise differences in d₂(T) at equal storage: effect size and corrected significance"
    tests = findings.tests
    if tests.empty:
        return ReportFigure("significance", title, "", absent_reason="no storage level holds two or more schemes; "
                            "pairwise comparisons at equal storage need them (harness report --storage-levels)")
    tests, where = _main_slice(tests)
    dim = tests.dim.max()
    tests = tests[tests.dim == dim]
    scen, levels = sorted(tests.scenario.unique()), sorted(tests.storage_level.unique())
    names = sorted(set(tests.scheme_a) | set(tests.scheme_b))
    # Laid out for an A4 landscape page (PAGE_FIGURE_BOX, where the PDF draws it unscaled): tick
    # labels of 7 pt, names only on the outer panels, panels as large as the page allows but with
    # rows of at least 7.5 pt (a larger grid outgrows the page and is scaled onto it).
    n, n_rows, n_cols = len(names), len(scen), len(levels)
    label = max(len(x) for x in names) * 0.62 * _LABEL_PT / 72 + 0.35  # inches: tick labels and axis label
    bar, title_height = 0.9, 0.42  # inches: the colour bar's column, each panel's two-line title
    width, height = PAGE_FIGURE_BOX[0] - 0.3, PAGE_FIGURE_BOX[1] - 0.3  # less savefig's padding
    side = min((width - label - bar) / n_cols - 0.1, (height - label) / n_rows - title_height)
    side = max(side, n * 7.5 / 72 + 0.1)
    fig, axes = plt.subplots(n_rows, n_cols, squeeze=False,
                             figsize=(label + n_cols * (side + 0.1) + bar, n_rows * (side + title_height) + label))
    annotate = side / n >= 6 * 0.62 * _LABEL_PT / 72  # room for "+0.53*" in a cell, else stars only
    for r, sc in enumerate(scen):
        for c, level in enumerate(levels):
            sel = tests[(tests.scenario == sc) & (tests.storage_level == level)]
            effect = pd.DataFrame(np.nan, index=names, columns=names)
            note = pd.DataFrame("", index=names, columns=names)
            for t in sel.itertuples():
                star = "*" if t.p_holm < ALPHA else ""
                effect.loc[t.scheme_a, t.scheme_b], effect.loc[t.scheme_b, t.scheme_a] = t.effect, -t.effect
                note.loc[t.scheme_a, t.scheme_b] = f"{t.effect:+.2f}{star}"
                note.loc[t.scheme_b, t.scheme_a] = f"{-t.effect:+.2f}{star}"
            if not annotate:
                note = note.map(lambda t: "*" if t.endswith("*") else "")
            ax = axes[r, c]
            _heatmap(ax, effect, note)
            ax.set_title(f"{sc}\n{level:g} bits/element", fontsize=8)  # two lines: no overlap with the next panel's
            ax.set_xlabel("scheme (column)" if r == n_rows - 1 else "")
            ax.set_ylabel("scheme (row)" if c == 0 else "")
            ax.tick_params(labelsize=_LABEL_PT, labelleft=c == 0, labelbottom=r == n_rows - 1, length=0)
            ax.grid(False)
    fig.tight_layout(rect=(0, 0, 1 - bar / fig.get_figwidth(), 1))
    # one colour bar for every panel, so all panels keep the same size
    bar = fig.add_axes((1 - 0.75 * bar / fig.get_figwidth(), 0.25, 0.15 / fig.get_figwidth(), 0.5))
    fig.colorbar(matplotlib.cm.ScalarMappable(matplotlib.colors.Normalize(-1, 1), "RdBu_r"), cax=bar,
                 label="effect, row vs column (−1 … 1)")
    caption = (f"d = {dim}, {where}, at each storage level (schemes absent from a level cannot reach it without "
               f"extrapolation). Cell (row, column): for paired trials the matched-pairs rank-biserial r of the "
               f"per-trial d₂(T) differences (Wilcoxon signed-rank), otherwise Cliff's δ (Mann–Whitney); < 0 (blue) "
               f"means the row scheme is better. * marks a Holm-corrected p < {ALPHA:g}, every pair at every level "
               f"of the report one family.")
    return ReportFigure("significance", title, caption, fig)


def _heatmap(ax, values: pd.DataFrame, notes: pd.DataFrame) -> None:
    """values (rows × columns, in [−1, 1], NaN blank) as square cells on RdBu_r with white lines
    between them, each annotated with its note in black or white by the cell's luminance, every
    row and column labelled (x labels vertical). Drawn directly: seaborn's heatmap draws the
    whole figure once per panel to decide its tick labels (8.8 of 11 s for 18 panels)."""
    data = values.to_numpy(dtype=float)
    cmap, norm = matplotlib.colormaps["RdBu_r"], matplotlib.colors.Normalize(-1, 1)
    ax.pcolormesh(np.ma.masked_invalid(data), cmap=cmap, norm=norm, edgecolors="white", linewidth=0.4)
    n_rows, n_cols = data.shape
    ax.set_xlim(0, n_cols)
    ax.set_ylim(n_rows, 0)
    ax.set_aspect("equal")
    ax.set_xticks(np.arange(n_cols) + 0.5, labels=list(values.columns), rotation=90)
    ax.set_yticks(np.arange(n_rows) + 0.5, labels=list(values.index), rotation=0)
    for side in ax.spines.values():
        side.set_visible(False)
    for i in range(n_rows):
        for j in range(n_cols):
            text = notes.iat[i, j]
            if text and np.isfinite(data[i, j]):
                red, green, blue, _ = cmap(norm(data[i, j]))
                dark = 0.2126 * red + 0.7152 * green + 0.0722 * blue < 0.408  # seaborn's threshold
                # clipped to the axes it lies inside (the panel is laid out so a note fits its cell):
                # the layout then skips measuring each of the hundreds of notes, as it does the cells
                ax.text(j + 0.5, i + 0.5, text, ha="center", va="center", fontsize=_LABEL_PT, clip_on=True,
                        color="white" if dark else "black")


def _scatter_cells(findings: Findings, styles, x: str, y: str, key: str, title: str, xlabel: str, ylabel: str,
                   caption: str, diagonal: bool) -> ReportFigure:
    cells, where = _main_slice(findings.cells)
    dim = cells.dim.max()
    cells = cells[cells.dim == dim]
    usable = cells[(cells[x] > 0) & (cells[y] > 0) & np.isfinite(cells[x]) & np.isfinite(cells[y])]
    if usable.empty:
        return ReportFigure(key, title, "", absent_reason=f"no cell has positive, finite {x} and {y} "
                            f"(every scheme reproduces the logits or T exactly)")
    scen = sorted(usable.scenario.unique())
    fig, axes, groups = _family_grid(scen, usable.scheme.unique(), width=3.8, height=3.3)
    for r, sc in enumerate(scen):
        every = usable[usable.scenario == sc]
        for c, (fam, names) in enumerate(groups):
            ax = axes[r, c]
            for name, g, st in _codec_series(every, names, styles, "budget"):
                _tag(ax.errorbar(g[x], g[y], xerr=_bars(g[x] - g[f"{x}_low"], g[f"{x}_high"] - g[x]),
                                 yerr=_bars(g[y] - g[f"{y}_low"], g[f"{y}_high"] - g[y]), color=st.colour,
                                 marker=st.marker, linestyle=st.line, markersize=4, linewidth=1, capsize=1.5), name)
            if diagonal:
                lo = min(every[x].min(), every[y].min()) / 1.5
                hi = max(every[x].max(), every[y].max()) * 1.5
                ax.plot([lo, hi], [lo, hi], color="grey", linewidth=0.8, linestyle=":")
                _scale(ax, "x", [lo, hi])
                _scale(ax, "y", [lo, hi])
            else:
                _scale(ax, "x", np.r_[every[x], every[f"{x}_low"].clip(lower=every[x].min() / 10)])
                _scale(ax, "y", np.r_[every[y], every[f"{y}_low"].clip(lower=every[y].min() / 10)])
            ax.set_title(f"{sc}: {fam}", fontsize=9)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
    _legend(fig, styles, usable.scheme.unique())
    return ReportFigure(key, title, f"d = {dim}, {where}; one column per codec family. " + caption, fig)


def isolation_figure(findings: Findings, styles) -> ReportFigure:
    return _scatter_cells(
        findings, styles, "t_rel_mse_konly", "t_rel_mse_vonly", "isolation",
        "K-only versus V-only isolation of the attention-output error",
        "relMSE of T with only K compressed", "relMSE of T with only V compressed",
        "Each point is one cell (a scheme at one budget; budgets joined by a line, 95% CIs as bars). "
        "Above the dotted diagonal the V codec dominates T's error, below it the K codec does.", diagonal=True)


def amplification_figure(findings: Findings, styles) -> ReportFigure:
    return _scatter_cells(
        findings, styles, "logit_rel_mse", "t_rel_mse_konly", "amplification",
        "Logit-error variance against the attention-output error it causes",
        "logit relMSE ‖ŝ − s‖²/‖s‖²", "relMSE of T with only K compressed",
        "Each point is one cell (budgets joined by a line, 95% CIs as bars). The softmax turns logit "
        "error variance into T error (a Jensen gap), so an unbiased but noisier logit estimator (QJL on K) "
        "can lose to a biased, lower-variance one.", diagonal=False)


def _spread(values, half_width: float) -> np.ndarray:
    """Horizontal offsets for a strip of points: equal values (d_eff is an integer per head, so
    ties are the rule) fan out evenly around 0 within ±half_width; deterministic, no jitter draw."""
    values = np.asarray(values, dtype=float)
    offsets = np.zeros(len(values))
    keys = np.round(values, 9)
    for v in np.unique(keys):
        idx = np.flatnonzero(keys == v)
        if len(idx) > 1:
            offsets[idx] = np.linspace(-half_width, half_width, len(idx))
    return offsets


def _n_cal_words(values) -> str:
    sizes = sorted({int(v) for v in values})
    return f"n_cal = {', '.join(str(n) for n in sizes)} calibration tokens"


def d_eff_figure(findings: Findings, styles) -> ReportFigure:
    """Per-trial d_eff of K and V (the rounded participation ratio of each trial's calibration
    covariance, mean over heads; stored by the calibrated schemes sq-*, squ-*), one panel per
    (scenario, head dimension, calibration size), a box and a strip per (tensor, scheme); the
    dashed line is the head dimension d, the largest possible d_eff. With several calibration
    sizes a row is one (scenario, d) and a column one size, the row's panels on one y axis, so
    a row reads as d_eff against n_cal."""
    trials = findings.trials
    title = "Effective dimension d_eff of the calibration covariance"
    if not {"d_eff_k", "d_eff_v"} <= set(trials.columns):
        return ReportFigure("d_eff", title, "", absent_reason="the run's rows hold no d_eff_k / d_eff_v columns "
                            "(the store predates the per-trial diagnostics), so no d_eff")
    calibrated = trials[trials.d_eff_k.notna() | trials.d_eff_v.notna()]
    if calibrated.empty:
        return ReportFigure("d_eff", title, "", absent_reason="the run has no calibrated scheme (sq-*, squ-*), "
                            "so no d_eff")
    calibrated, where = _main_slice(calibrated, every_calibration=True)
    # d_eff is a property of the trial's calibration sample, not of the budget: one budget per
    # scheme keeps one point per trial instead of repeating each trial once per budget.
    keep = calibrated.groupby("scheme").budget.transform(lambda b: _mid(b.unique()))
    calibrated = calibrated[calibrated.budget == keep]
    budgets = sorted(calibrated.budget.unique())
    n_cal = _n_cal_words(calibrated.calib_tokens)
    title = f"{title} at {n_cal}"
    panels = [tuple(k) for k in calibrated[["scenario", "dim", "calib_tokens"]].drop_duplicates()
              .sort_values(["scenario", "dim", "calib_tokens"]).itertuples(index=False)]
    names = sorted(calibrated.scheme.unique())
    sizes = sorted(calibrated.calib_tokens.unique())
    if len(sizes) > 1:
        rows = sorted({(sc, dim) for sc, dim, _ in panels})
        n_rows, n_cols = len(rows), len(sizes)
        place = {(sc, dim, cal): (rows.index((sc, dim)), sizes.index(cal)) for sc, dim, cal in panels}
    else:
        n_cols = min(3, len(panels))
        n_rows = -(-len(panels) // n_cols)
        place = {p: divmod(i, n_cols) for i, p in enumerate(panels)}
    fig, axes = _grid(n_rows, n_cols, width=max(3.6, 1.1 + 0.55 * len(names)), height=3.1)
    log_panels = 0
    slot = min(0.8 / len(names), 0.3)  # x width per scheme inside the K (or V) group
    group = slot * len(names)
    for sc, dim, cal in panels:
        ax = axes[place[(sc, dim, cal)]]
        same_row = calibrated[(calibrated.scenario == sc) & (calibrated.dim == dim)]  # every calibration size
        sel = same_row[same_row.calib_tokens == cal]
        for t, tensor in enumerate(("k", "v")):
            for j, name in enumerate(names):
                values = sel.loc[sel.scheme == name, f"d_eff_{tensor}"].dropna().to_numpy(float)
                if len(values) == 0:
                    continue
                st = styles[name]
                x = t - group / 2 + slot * (j + 0.5)
                ax.boxplot(values, positions=[x], widths=0.75 * slot, showfliers=False, patch_artist=True,
                           boxprops={"facecolor": (*st.colour[:3], 0.15), "edgecolor": st.colour},
                           medianprops={"color": st.colour, "linewidth": 1.6},
                           whiskerprops={"color": st.colour}, capprops={"color": st.colour})
                _tag(ax.scatter(x + _spread(values, 0.22 * slot), values, color=st.colour, marker=st.marker,
                                s=10, alpha=0.75, linewidths=0, zorder=3), name)
        ax.axhline(dim, color="grey", linestyle="--", linewidth=1)
        ax.annotate(f"d = {dim}", (1, dim), xycoords=("axes fraction", "data"), xytext=(-2, 2),
                    textcoords="offset points", ha="right", va="bottom", fontsize=7, color="dimgrey")
        low = np.nanmin(same_row[["d_eff_k", "d_eff_v"]].to_numpy(float))  # one axis per row
        if dim > 8 * low:  # a linear axis up to d would squash the boxes into its bottom eighth
            ax.set_yscale("log", base=2)
            ax.set_ylim(2.0 ** np.floor(np.log2(low)) / 1.15, dim * 1.4)  # a tick below the lowest box
            log_panels += 1
            ax.yaxis.set_major_locator(ticker.LogLocator(base=2, numticks=12))
            ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda y, _: f"{y:g}"))
            ax.yaxis.set_minor_locator(ticker.NullLocator())
        else:
            ax.set_ylim(0, dim * 1.1)
        ax.set_xlim(-0.5, 1.5)
        ax.set_xticks([0, 1], ["K", "V"])
        ax.grid(False, axis="x")
        ax.set_title(f"{sc}, d = {dim}, n_cal = {cal}", fontsize=9)
        ax.set_xlabel("tensor")
        ax.set_ylabel("d_eff (participation ratio of\nthe calibration covariance)")
    for r, c in set(np.ndindex(n_rows, n_cols)) - set(place.values()):
        axes[r, c].set_visible(False)
    head_dim = plt.Line2D([], [], color="grey", linestyle="--", label="head dimension d")
    _legend(fig, styles, names, extra=[head_dim])
    heads = sorted(calibrated.heads.unique())
    per_head = f" (mean over the {', '.join(map(str, heads))} heads)" if max(heads) > 1 else ""
    caption = (f"One point per trial{per_head}: d_eff = round(tr(C)²/‖C‖²_F) of the trial's calibration "
               f"covariance C of K or V from {n_cal}; boxes span the quartiles with the median as a bar, "
               f"whiskers reach the furthest trial within 1.5 IQR. {where}, b = {', '.join(map(str, budgets))} bits (d_eff does not depend "
               f"on the budget). The dashed line is the head dimension d, the largest possible d_eff"
               f"{'; panels where d exceeds 8 × the smallest d_eff use a log₂ axis' if log_panels else ''}. "
               + ("Columns are the calibration sizes (each trial's samples from the same population at every size) "
                  "and a row's panels share their y axis, so a row shows d_eff's self-calibration (the AMD paper): "
                  "it follows the calibration budget rather than recovering the data's true rank."
                  if len(sizes) > 1 else
                  "`--calib-tokens` sets n_cal; a run with several sizes (`--calib-tokens 32,128,512`) draws one "
                  "column per size on the same trials, which shows d_eff's self-calibration (the AMD paper): it "
                  "follows the calibration budget rather than recovering the data's true rank."))
    return ReportFigure("d_eff", title, caption, fig)


def calibration_figure(findings: Findings, styles) -> ReportFigure:
    """Mean d₂(T) (95% CI bars) against the calibration size n_cal, one line per scheme, one
    row per (scenario, head dimension) and one column per codec family, at the run's middle
    budget: how much calibration a calibrated codec needs, against the data-independent ones
    (flat lines: same K, V, Q draws at every n_cal)."""
    title = "Error against the calibration size"
    cells, where = _main_slice(findings.cells, every_calibration=True)
    sizes = sorted(cells.calib_tokens.unique())
    if len(sizes) < 2:
        return ReportFigure("calibration", title, "", absent_reason=f"the run has one calibration size (n_cal = "
                            f"{sizes[0]}); give --calib-tokens several values to see the error against it")
    budget = _mid(sorted(cells.budget.unique()))
    cells = cells[cells.budget == budget]
    panels = sorted({(sc, dim) for sc, dim in cells[["scenario", "dim"]].itertuples(index=False)})
    fig, axes, groups = _family_grid(panels, cells.scheme.unique(), sharey="row")
    for r, (sc, dim) in enumerate(panels):
        every = cells[(cells.scenario == sc) & (cells.dim == dim)]
        for c, (fam, names) in enumerate(groups):
            ax = axes[r, c]
            for name, g, st in _codec_series(every, names, styles, "calib_tokens"):
                _tag(ax.errorbar(g.calib_tokens, g.d2_t, yerr=_bars(g.d2_t - g.d2_t_low, g.d2_t_high - g.d2_t),
                                 color=st.colour, marker=st.marker, linestyle=st.line, markersize=4, linewidth=1.2,
                                 capsize=2), name)
            ax.set_xscale("log", base=2)
            ax.set_xticks(sizes, [str(n) for n in sizes])
            ax.xaxis.set_minor_locator(ticker.NullLocator())
            _scale(ax, "y", np.r_[every.d2_t, every.d2_t_high])
            ax.axvline(dim, color="grey", linestyle="--", linewidth=1)
            ax.set_title(f"{sc}, d = {dim}, b = {budget}: {fam}", fontsize=9)
            ax.set_xlabel("calibration tokens n_cal")
            ax.set_ylabel(f"d₂(T) {_UNIT_D2}")
    at_d = plt.Line2D([], [], color="grey", linestyle="--", label="n_cal = d")
    _legend(fig, styles, cells.scheme.unique(), extra=[at_d])
    caption = (f"{where}, budget {budget} bits; one column per codec family. Points are cell means of d₂(T) with "
               f"95% confidence intervals; every calibration size sees the same K, V and Q draws, so schemes that "
               f"ignore calibration are flat. Left of the dashed line (n_cal < d) the calibration covariance is "
               f"rank-deficient.")
    return ReportFigure("calibration", title, caption, fig)


_DOLLAR = re.compile(r"(?<!\\)\$")


def literal(text: str) -> str:
    """`text` as matplotlib should draw it, character for character: each unescaped $ escaped, so
    that math text (on: the log axes' tick labels are 10^k in math text) never parses a name
    ('price_$5_vs_$10' would be typeset as math, or fail to parse)."""
    return _DOLLAR.sub(r"\\$", text)


def names_literal(fig: Figure) -> None:
    """Turn math text on in a figure built with it off, with every text drawn from names (titles,
    legends, annotations, axis labels, categorical tick labels) made literal first. Tick labels of
    the numeric axes are written by their formatters at each draw, so their math is typeset."""
    for text in fig.findobj(matplotlib.text.Text):
        text.set_text(literal(text.get_text()))
        text.set_parse_math(True)
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            for formatter in (axis.get_major_formatter(), axis.get_minor_formatter()):
                if isinstance(formatter, ticker.FixedFormatter):
                    formatter.seq = [literal(str(s)) for s in formatter.seq]


def build_figures(findings: Findings) -> list[ReportFigure]:
    """Every figure of the report, in reading order; absent ones carry their reason. A figure is
    laid out with math text off (a name with $ signs is no formula) and drawn with it on, its names
    escaped (names_literal), so the log axes' 10^k tick labels are typeset."""
    styles = scheme_styles(findings.trials.scheme.unique())
    with plt.rc_context({"text.parse_math": False, "font.size": 8, "axes.titlesize": 9, "axes.labelsize": 8,
                         "legend.fontsize": 8, "axes.grid": True, "grid.alpha": 0.3}):
        figures = [*(front_figure(findings, styles, sc) for sc in sorted(findings.cells.scenario.unique())),
                   dimension_figure(findings, styles), *rate_distortion_figures(findings, styles),
                   error_space_figure(findings, styles), significance_figure(findings, styles),
                   isolation_figure(findings, styles), amplification_figure(findings, styles),
                   d_eff_figure(findings, styles), calibration_figure(findings, styles)]
    for f in figures:
        if f.figure is not None:
            names_literal(f.figure)
    return figures


__all__ = ["ReportFigure", "SchemeStyle", "build_figures", "d_eff_figure", "front_figure", "scheme_styles"]
