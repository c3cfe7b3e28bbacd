"""The words and tables of a report's summary, from Findings: plain strings (the HTML template
escapes them; the PDF draws them), shared by html.py and pdf.py so both say the same.

A setting's calibration size (n_cal, calib_tokens) is named, in labels and as a table column
after Nq, only when the run has several; a single-calibration report reads as it always did."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from stats.equal_storage import LEVEL, STORAGE, TOLERANCE

from stats.findings import ALPHA, CELL as CELL_KEY, SETTING, SMALLEST_EFFECT, Findings


def num(x: float) -> str:
    """A number as every table and sentence of the report shows it: 4 significant digits."""
    if x is None or (isinstance(x, float) and np.isnan(x)):
        return "n/a"
    return f"{x:.4g}"


def with_ci(mean: float, low: float, high: float) -> str:
    return f"{num(mean)} [{num(low)}, {num(high)}]"


def pvalue(p: float) -> str:
    if p is None or np.isnan(p):
        return "n/a"
    return "< 1e-6" if p < 1e-6 else f"{p:.2g}"


def p_equals(p: float) -> str:
    """'p = 0.012' or 'p < 1e-6', for sentences."""
    text = pvalue(p)
    return f"p {text}" if text.startswith("<") else f"p = {text}"


def setting_label(setting: tuple, with_n_cal: bool = False) -> str:
    scenario, dim, seq_len, queries, n_cal = setting
    return f"{scenario}, d = {dim}, S = {seq_len}, Nq = {queries}" + (f", n_cal = {n_cal}" if with_n_cal else "")


def several_calibrations(findings: Findings) -> bool:
    return len(findings.calib_sizes) > 1


def _with_n_cal(findings: Findings, header: tuple, at: int = 4) -> tuple:
    """header with an "n_cal" column at `at` (after Nq) when the run has several calibration sizes."""
    return header[:at] + ("n_cal",) + header[at:] if several_calibrations(findings) else header


def _n_cal(findings: Findings, value) -> tuple:
    """The n_cal cell of a table row: (str(value),) with several calibration sizes, else ()."""
    return (str(value),) if several_calibrations(findings) else ()


FRONT_HEADER = ("scheme", "b", "bits/el", "d₂(T) [95% CI]", "P(front)")


@dataclass(frozen=True)
class SettingSummary:
    """What the summary says about one (scenario, dim, seq_len, queries, calib_tokens): its Pareto
    front as table rows (FRONT_HEADER), cheapest first, and the schemes that no storage level
    of the run reaches (so they are in no equal-storage comparison), in words."""
    label: str
    front: list[tuple[str, ...]]
    unplaced: str


def _select(frame: pd.DataFrame, setting: tuple) -> pd.DataFrame:
    mask = np.ones(len(frame), dtype=bool)
    for col, val in zip(SETTING, setting):
        mask &= (frame[col] == val).to_numpy()
    return frame[mask]


def _front_rows(cells: pd.DataFrame) -> list[tuple[str, ...]]:
    """One row per front point; the budgets of a fixed-width codec, whose cells are identical
    (same storage, same errors), share one row ("b = 2, 3, 4")."""
    front = cells[cells.on_front].sort_values(["storage", "d2_t", "budget"])
    rows: list[list] = []
    for r in front.itertuples():
        if rows and rows[-1][0] == r.scheme and rows[-1][-1] == (r.storage, r.d2_t):
            rows[-1][1] += f", {r.budget}"
            continue
        rows.append([r.scheme, str(r.budget), num(r.storage), with_ci(r.d2_t, r.d2_t_low, r.d2_t_high),
                     f"{r.p_front:.0%}", (r.storage, r.d2_t)])
    return [tuple(row[:-1]) for row in rows]


def _unplaced(findings: Findings, setting: tuple) -> str:
    """The codecs of a setting in no equal-storage comparison, why, and how to compare them; those
    on the Pareto front are said to be (the first screen shows them there)."""
    cells = _select(findings.cells, setting)
    placed = set(_select(findings.equal, setting).scheme.unique())
    missing = cells[~cells.scheme.isin(placed)]
    if missing.empty:
        return ""
    on_front = set(missing[missing.on_front.fillna(False).astype(bool)].scheme) if "on_front" in missing else set()
    spans = missing.groupby("scheme").storage.agg(["min", "max"])
    parts = [f"{name} ({num(r['min'])}" + (f"–{num(r['max'])}" if r["max"] > r["min"] * 1.001 else "")
             + (" bits/element, on the Pareto front)" if name in on_front else ")") for name, r in spans.iterrows()]
    levels = ",".join(num(x) for x in sorted(spans["min"].unique())[:3])
    return (f"Not compared at any storage level: {', '.join(parts)} — measured storage outside every level "
            f"±{TOLERANCE / 2:.1%} and not between two of the codec's own cells around one (values are "
            f"interpolated, never extrapolated); `harness report --storage-levels {levels}` compares them there.")


def setting_summaries(findings: Findings) -> dict[str, list[SettingSummary]]:
    """Per scenario, one SettingSummary per (dim, seq_len, queries, calib_tokens), in sorted order."""
    out: dict[str, list[SettingSummary]] = {}
    several = several_calibrations(findings)
    for setting in sorted(findings.settings):
        out.setdefault(setting[0], []).append(SettingSummary(
            setting_label(setting, several), _front_rows(_select(findings.cells, setting)),
            _unplaced(findings, setting)))
    return out


def _varying(findings: Findings) -> list[str]:
    """The setting columns besides the scenario that take several values in the run."""
    return [c for c in SETTING[1:] if findings.cells[c].nunique() > 1]


_SHORT = {"dim": "d", "seq_len": "S", "queries": "Nq", "calib_tokens": "n_cal"}


def lede(findings: Findings) -> str:
    """One line under the title: what was run and how it is compared."""
    t = findings.trials
    fixed = ", ".join(f"{_SHORT[c]} = {t[c].iloc[0]}" for c in SETTING[1:] if c not in _varying(findings))
    varying = "; ".join(f"{_SHORT[c]} ∈ {{{', '.join(map(str, sorted(t[c].unique())))}}}" for c in _varying(findings))
    return (f"{t.scheme.nunique()} codecs × {t.scenario.nunique()} scenario(s) × budgets "
            f"{', '.join(map(str, sorted(t.budget.unique())))} bits; {fixed}" + (f"; {varying}" if varying else "")
            + f"; {t.groupby(list(CELL_KEY)).size().min()} paired trials per cell. Codecs are ranked at equal "
            f"measured storage (±{TOLERANCE / 2:.1%}), never per nominal budget; tests are paired"
            + (f" ({INTERPOLATED}: interpolated between the codec's two nearest budgets)"
               if findings.winners[["winner_source", "runner_up_source"]].map(_interpolated).to_numpy().any() else "")
            + ". " + attribution(findings))


def attributes(findings: Findings) -> bool:
    """Whether the report can attribute a difference to the codec: an implementation null run was given."""
    return bool(findings.has_null)


def attribution(findings: Findings) -> str:
    """One sentence on what the verdicts can say: with a null run, codec or implementation;
    without one, only whether the best codec and the runner-up differ."""
    if attributes(findings):
        return ("Verdicts set each difference against the null run's implementation variance (stats.validation, "
                "margin half a standard deviation).")
    if findings.claims is not None:   # a reproduction: its null runs (null-rng, null-impl) serve claim 11 alone
        return ("The reproduction's implementation null runs (RNG family, NumPy reference) judge claim 11's "
                "codec comparisons; the best-codec verdicts here have no null of their own, so they say whether the "
                "best codec and the runner-up differ, not whether a difference is the codec's.")
    return ("No implementation null run: the tests say whether the best codec and the runner-up differ, not "
            "whether a difference is the codec's; to attribute, rerun with --seed 1 into another directory and "
            "give it as report --null.")


HEADLINE_HEADER = ("bits/el", "best", "d₂(T) [95% CI]", "runner-up", "d₂(T) [95% CI]", "paired test", "verdict")


def headline_header(findings: Findings) -> tuple[str, ...]:
    header = tuple(_SHORT[c] for c in _varying(findings)) + HEADLINE_HEADER
    return header if attributes(findings) else header[:-1]


def headline_rows(findings: Findings, scenario: str) -> list[tuple[str, ...]]:
    """The first screen's table for one scenario: the best codec at each storage level (marked
    where its value is interpolated between two budgets), its runner-up at the same storage, the
    paired test between them (Holm p and what it says: 'tie' where the two are shown inside the
    margin) and, when a null run was given, the verdict; setting columns only for what varies."""
    varying = _varying(findings)
    rows = []
    wins = findings.winners[findings.winners.scenario == scenario]
    for w in wins.sort_values(list(SETTING) + [LEVEL]).itertuples():
        has_runner = isinstance(w.runner_up, str)
        said = f"tie ({w.comparison})" if has_runner and w.comparison in ("equivalent", "negligible") else w.comparison
        test = f"p {pvalue(w.p_holm)}: {said}" if has_runner else "—"
        rows.append((*(str(getattr(w, c)) for c in varying), num(w.storage_level), _placed(w.winner, w.winner_source),
                     with_ci(w.winner_mean, w.winner_low, w.winner_high),
                     _placed(w.runner_up, w.runner_up_source) if has_runner else "—",
                     with_ci(w.runner_up_mean, w.runner_up_low, w.runner_up_high) if has_runner else "—", test,
                     w.validation if has_runner else "—")[:len(headline_header(findings))])
    return rows


INTERPOLATED = "†"


def _interpolated(source) -> bool:
    return isinstance(source, str) and source.endswith("interpolated")


def _placed(scheme: str, source: str) -> str:
    """A codec's name, marked † where its value at the level is interpolated between two budgets."""
    return f"{scheme}{INTERPOLATED}" if _interpolated(source) else scheme


CLAIM_HEADER = ("#", "claim (section)", "verdict", "effect [95% CI]", "as claimed / against / tests")
CLAIM_DETAIL_HEADER = ("#", "test", "paired", "effect", "reason")


def claim_rows(findings: Findings) -> list[tuple[str, ...]]:
    """A reproduction's claims, one short row each (the first screen)."""
    if findings.claims is None:
        return []
    return [(str(c.id), f"{c.claim} ({c.section})", c.verdict, with_ci(c.estimate, c.ci_low, c.ci_high),
             f"{c.n_as_claimed} / {c.n_opposite} / {c.n_tests}") for c in findings.claims.itertuples()]


def claim_detail_rows(findings: Findings) -> list[tuple[str, ...]]:
    """How each claim was tested and why its verdict is what it is."""
    if findings.claims is None:
        return []
    return [(str(c.id), c.test, str(c.paired), c.effect, c.reason) for c in findings.claims.itertuples()]


WINNER_HEADER = ("scenario", "d", "S", "Nq", "bits/el", "best", "best from", "best d₂(T) [95% CI]", "runner-up",
                 "runner-up from", "runner-up d₂(T) [95% CI]", "test", "Holm p", "effect", "comparison", "verdict")


def winner_header(findings: Findings) -> tuple[str, ...]:
    return _with_n_cal(findings, WINNER_HEADER)


_TEST_WORDS = {"wilcoxon-signed-rank": "Wilcoxon (paired)", "mann-whitney": "Mann–Whitney"}


def winner_rows(findings: Findings) -> list[tuple[str, ...]]:
    """The best codec at each storage level with its runner-up at the same storage (within
    stats.equal_storage.TOLERANCE), the test between them, and the verdict."""
    rows = []
    for w in findings.winners.sort_values(list(SETTING) + [LEVEL]).itertuples():
        has_runner = isinstance(w.runner_up, str)
        rows.append((w.scenario, str(w.dim), str(w.seq_len), str(w.queries), *_n_cal(findings, w.calib_tokens),
                     num(w.storage_level), w.winner, w.winner_source,
                     with_ci(w.winner_mean, w.winner_low, w.winner_high),
                     w.runner_up if has_runner else "—", w.runner_up_source if has_runner else "—",
                     with_ci(w.runner_up_mean, w.runner_up_low, w.runner_up_high) if has_runner else "—",
                     _TEST_WORDS.get(w.test, "—") if has_runner else "—", pvalue(w.p_holm),
                     f"{w.effect:+.2f}" if has_runner else "—", w.comparison,
                     w.validation if has_runner else "—"))
    return rows


CROSSOVER_HEADER = ("scenario", "d", "S", "Nq", "scheme A", "scheme B", "bits/el low", "bits/el high",
                    "Δ d₂(T) at low", "Δ d₂(T) at high", "bits/el at flip", "better below", "confident")


def crossover_header(findings: Findings) -> tuple[str, ...]:
    return _with_n_cal(findings, CROSSOVER_HEADER)


def crossover_rows(findings: Findings) -> list[tuple[str, ...]]:
    """Every crossover along the storage levels; Δ = mean d₂(T) of scheme A − scheme B (paired over trials)."""
    rows = []
    low, high, cross = f"{LEVEL}_low", f"{LEVEL}_high", f"{LEVEL}_cross"
    for c in findings.crossovers.sort_values(list(SETTING) + ["scheme_a", "scheme_b", low]).itertuples():
        rows.append((c.scenario, str(c.dim), str(c.seq_len), str(c.queries), *_n_cal(findings, c.calib_tokens),
                     c.scheme_a, c.scheme_b, num(getattr(c, low)), num(getattr(c, high)), f"{c.delta_low:+.4g}",
                     f"{c.delta_high:+.4g}", f"{getattr(c, cross):.2f}", c.better_below, "yes" if c.confident else "no"))
    return rows


CELL_HEADER = ("scenario", "scheme", "b", "d", "S", "Nq", "n", "bits/el", "d₂(T) [95% CI]",
               "d₂(K) [95% CI]", "d₂(V) [95% CI]", "ptcos K", "ptcos V", "KL(attn)", "logit slope", "evicted mass",
               "P(front)")


def cell_header(findings: Findings) -> tuple[str, ...]:
    return _with_n_cal(findings, CELL_HEADER, at=6)


def cell_rows(findings: Findings) -> list[tuple[str, ...]]:
    rows = []
    for c in findings.cells.sort_values(list(SETTING) + ["budget", "d2_t"]).itertuples():
        rows.append((c.scenario, c.scheme, str(c.budget), str(c.dim), str(c.seq_len), str(c.queries),
                     *_n_cal(findings, c.calib_tokens),
                     str(c.n_trials), num(c.bits_per_element), with_ci(c.d2_t, c.d2_t_low, c.d2_t_high),
                     with_ci(c.d2_k, c.d2_k_low, c.d2_k_high), with_ci(c.d2_v, c.d2_v_low, c.d2_v_high),
                     num(c.ptcosine_k), num(c.ptcosine_v), num(c.kl_attn), num(c.logit_slope),
                     "—" if np.isnan(c.evicted_mass) else num(c.evicted_mass),
                     (f"{c.p_front:.0%}" + (" *" if c.on_front else ""))))
    return rows


def method_sentence(findings: Findings) -> str:
    t = findings.trials
    calib = (f"; calibration sizes n_cal = {', '.join(map(str, findings.calib_sizes))} tokens, on the same K, V and "
             f"Q draws" if several_calibrations(findings) else "")
    storage = ("per-cache bits plus the model constants amortised over --model-caches caches"
               if findings.storage == STORAGE else "per-cache bits")
    return (f"{len(t)} trials in {len(findings.cells)} cells: scenarios {', '.join(sorted(t.scenario.unique()))}; "
            f"schemes {', '.join(sorted(t.scheme.unique()))}; budgets {', '.join(map(str, sorted(t.budget.unique())))} "
            f"bits; head dimensions {', '.join(map(str, sorted(t.dim.unique())))}{calib}. Codecs are compared at equal "
            f"measured storage ({storage} per element), never per nominal budget: at each storage level "
            f"({', '.join(num(x) for x in findings.levels)} bits/element) a codec enters with its measured cell within "
            f"±{TOLERANCE / 2:.1%} of the level, or interpolated trial by trial between its two cells around it (log "
            f"error against bits), never extrapolated, so compared values differ in storage by at most "
            f"{TOLERANCE:.0%}. Every number is the mean over trials with its 95% Student-t confidence interval in "
            f"brackets. Trials of a setting share their K, V and Q, so codecs are compared with paired tests "
            f"(Wilcoxon signed-rank on per-trial d₂(T) differences, rank-biserial effect r ∈ [−1, 1], r < 0: the "
            f"first-named codec has the smaller error), Holm-corrected over every pair at every storage level, one "
            f"family (α = {ALPHA}). The Pareto front is on measured storage; its confidence and the crossovers come from a "
            f"paired bootstrap over trials (stats.dominance).")


def verdict_note(findings: Findings) -> str:
    """How to read the two verdict columns, saying whether this report had an implementation null."""
    null = ("This report was given an implementation null (--null): a second run of the same cells that differs "
            "only in an implementation variable." if findings.has_null else
            "This report was given no implementation null, so a difference beyond the margin stays 'inconclusive': "
            "pass --null DIR, a run of the same cells with another RNG family, seed, impl, device or dtype.")
    return ("'comparison' is the paired test of the best codec against the runner-up at the same storage, on the "
            f"smallest effect of interest ({SMALLEST_EFFECT:g} of d₂(T)'s pooled trial-to-trial standard deviation): "
            f"'difference' at Holm p < {ALPHA} with the mean difference beyond the margin, 'negligible' significant "
            "but shown inside it, 'equivalent' not significant and shown inside it (paired TOST), else "
            "'inconclusive'. 'verdict' is the rule of stats.validation on the six error coordinates and their spreads "
            "at that storage, every level one family, judged against the implementation null. " + null)
