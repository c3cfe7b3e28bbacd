"""The words and tables of a report's summary, from Findings: plain strings (the HTML template
escapes them; the PDF draws them), shared by html.py and pdf.py so both say the same.

A setting's calibration size (n_cal, calib_tokens) is named, in labels and as a table column
after Nq, only when the run has several; a single-calibration report reads as it always did."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from .findings import ALPHA, EQUIVALENCE_MARGIN, SETTING, Findings


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


@dataclass(frozen=True)
class SettingSummary:
    """What the summary says about one (scenario, dim, seq_len, queries, calib_tokens)."""
    label: str
    front: str
    winners: list[str]
    crossovers: list[str]


def _select(frame: pd.DataFrame, setting: tuple) -> pd.DataFrame:
    mask = np.ones(len(frame), dtype=bool)
    for col, val in zip(SETTING, setting):
        mask &= (frame[col] == val).to_numpy()
    return frame[mask]


def _front_sentence(cells: pd.DataFrame) -> str:
    front = cells[cells.on_front].sort_values("bits_per_element")
    names = sorted(front.scheme.unique())
    parts = [f"{r.scheme} at b = {r.budget} ({num(r.bits_per_element)} bits/element, d₂(T) "
             f"{with_ci(r.d2_t, r.d2_t_low, r.d2_t_high)}, on the front in {r.p_front:.0%} of bootstrap "
             f"replicates)" for r in front.itertuples()]
    return (f"Non-dominated on (measured bits per element, mean d₂(T)): {', '.join(names)} — "
            + "; ".join(parts) + ".")


def _winner_sentence(w) -> str:
    head = (f"At b = {w.budget} bits, {w.winner} has the lowest d₂(T), "
            f"{with_ci(w.winner_mean, w.winner_low, w.winner_high)} at {num(w.winner_bits)} bits/element")
    if w.runner_up is None or (isinstance(w.runner_up, float) and np.isnan(w.runner_up)):
        return head + "; it is the only scheme at this budget."
    runner = f"{w.runner_up} ({with_ci(w.runner_up_mean, w.runner_up_low, w.runner_up_high)})"
    stats = f"Holm-corrected {p_equals(w.p_holm)}, Cliff's δ = {w.cliffs_delta:+.2f}"
    verdict = f" Verdict: {w.validation} ({w.validation_reason})."
    if w.comparison == "difference":
        return head + f"; it beats the runner-up {runner} significantly ({stats})." + verdict
    if w.comparison == "equivalent":
        return (head + f"; the runner-up {runner} is not significantly worse ({stats}) and the two are "
                f"equivalent within ±{EQUIVALENCE_MARGIN:.0%} of the runner-up's mean (TOST, α = {ALPHA})." + verdict)
    return (head + f"; its lead over the runner-up {runner} is not significant ({stats}), nor is "
            f"equivalence within ±{EQUIVALENCE_MARGIN:.0%} shown: a tie at this sample size." + verdict)


def _crossover_sentence(c) -> str:
    other = c.scheme_b if c.better_below == c.scheme_a else c.scheme_a
    status = ("confident: both paired-bootstrap 95% intervals of the difference exclude zero" if c.confident
              else "not confident: an interval of the difference includes zero")
    return (f"{c.better_below} beats {other} at b = {c.budget_low} but {other} beats {c.better_below} at "
            f"b = {c.budget_high}; the order flips near b ≈ {c.budget_cross:.2f} (mean d₂(T) difference "
            f"{c.scheme_a} − {c.scheme_b}: {c.delta_low:+.3g} then {c.delta_high:+.3g}; {status}).")


def setting_summaries(findings: Findings) -> dict[str, list[SettingSummary]]:
    """Per scenario, one SettingSummary per (dim, seq_len, queries, calib_tokens), in sorted order."""
    out: dict[str, list[SettingSummary]] = {}
    several = several_calibrations(findings)
    for setting in sorted(findings.settings):
        cells = _select(findings.cells, setting)
        wins = _select(findings.winners, setting).sort_values("budget")
        cross = _select(findings.crossovers, setting)
        sure = cross[cross.confident]
        words = [_crossover_sentence(c) for c in sure.itertuples()]
        if len(cross) > len(sure):
            words.append(f"{len(cross) - len(sure)} further order flip(s) between consecutive budgets are not "
                         f"confident (an interval of the difference includes zero); all are listed in the "
                         f"crossover table.")
        out.setdefault(setting[0], []).append(SettingSummary(
            setting_label(setting, several), _front_sentence(cells), [_winner_sentence(w) for w in wins.itertuples()],
            words or ["No crossovers: no pair of schemes swaps order between consecutive budgets."]))
    return out


WINNER_HEADER = ("scenario", "d", "S", "Nq", "b", "winner", "d₂(T) [95% CI]", "bits/el",
                 "runner-up", "d₂(T) [95% CI]", "Holm p", "Cliff's δ", "comparison", "verdict")


def winner_header(findings: Findings) -> tuple[str, ...]:
    return _with_n_cal(findings, WINNER_HEADER)


def winner_rows(findings: Findings) -> list[tuple[str, ...]]:
    rows = []
    for w in findings.winners.sort_values(list(SETTING) + ["budget"]).itertuples():
        has_runner = isinstance(w.runner_up, str)
        rows.append((w.scenario, str(w.dim), str(w.seq_len), str(w.queries), *_n_cal(findings, w.calib_tokens),
                     str(w.budget), w.winner,
                     with_ci(w.winner_mean, w.winner_low, w.winner_high), num(w.winner_bits),
                     w.runner_up if has_runner else "—",
                     with_ci(w.runner_up_mean, w.runner_up_low, w.runner_up_high) if has_runner else "—",
                     pvalue(w.p_holm), f"{w.cliffs_delta:+.2f}" if has_runner else "—", w.comparison,
                     w.validation if has_runner else "—"))
    return rows


CROSSOVER_HEADER = ("scenario", "d", "S", "Nq", "scheme A", "scheme B", "b low", "b high",
                    "Δ d₂(T) at low", "Δ d₂(T) at high", "b at flip", "better below", "confident")


def crossover_header(findings: Findings) -> tuple[str, ...]:
    return _with_n_cal(findings, CROSSOVER_HEADER)


def crossover_rows(findings: Findings) -> list[tuple[str, ...]]:
    """Every crossover; Δ = mean d₂(T) of scheme A − scheme B (paired over trials)."""
    rows = []
    for c in findings.crossovers.sort_values(list(SETTING) + ["scheme_a", "scheme_b", "budget_low"]).itertuples():
        rows.append((c.scenario, str(c.dim), str(c.seq_len), str(c.queries), *_n_cal(findings, c.calib_tokens),
                     c.scheme_a, c.scheme_b,
                     str(c.budget_low), str(c.budget_high), f"{c.delta_low:+.4g}", f"{c.delta_high:+.4g}",
                     f"{c.budget_cross:.2f}", c.better_below, "yes" if c.confident else "no"))
    return rows


CELL_HEADER = ("scenario", "scheme", "b", "d", "S", "Nq", "n", "bits/el", "d₂(T) [95% CI]",
               "d₂(K) [95% CI]", "d₂(V) [95% CI]", "KL(attn)", "logit slope", "P(front)")


def cell_header(findings: Findings) -> tuple[str, ...]:
    return _with_n_cal(findings, CELL_HEADER, at=6)


def cell_rows(findings: Findings) -> list[tuple[str, ...]]:
    rows = []
    for c in findings.cells.sort_values(list(SETTING) + ["budget", "d2_t"]).itertuples():
        rows.append((c.scenario, c.scheme, str(c.budget), str(c.dim), str(c.seq_len), str(c.queries),
                     *_n_cal(findings, c.calib_tokens),
                     str(c.n_trials), num(c.bits_per_element), with_ci(c.d2_t, c.d2_t_low, c.d2_t_high),
                     with_ci(c.d2_k, c.d2_k_low, c.d2_k_high), with_ci(c.d2_v, c.d2_v_low, c.d2_v_high),
                     num(c.kl_attn), num(c.logit_slope),
                     (f"{c.p_front:.0%}" + (" *" if c.on_front else ""))))
    return rows


def method_sentence(findings: Findings) -> str:
    t = findings.trials
    calib = (f"; calibration sizes n_cal = {', '.join(map(str, findings.calib_sizes))} tokens, on the same K, V and "
             f"Q draws" if several_calibrations(findings) else "")
    return (f"{len(t)} trials in {len(findings.cells)} cells: scenarios {', '.join(sorted(t.scenario.unique()))}; "
            f"schemes {', '.join(sorted(t.scheme.unique()))}; budgets {', '.join(map(str, sorted(t.budget.unique())))} "
            f"bits; head dimensions {', '.join(map(str, sorted(t.dim.unique())))}{calib}. Every number is the mean over "
            f"trials with its 95% Student-t confidence interval in brackets. Schemes are compared on per-trial "
            f"d₂(T) with two-sided Mann–Whitney U tests, Holm-corrected within each (setting, budget) family "
            f"(α = {ALPHA}), with Cliff's δ as the effect size (δ < 0: the first-named scheme has the smaller error). "
            f"Winners are per nominal budget b, and schemes may spend different measured bits per element at the "
            f"same b (shown with each winner); the Pareto front, on measured bits, accounts for that. "
            f"The front's confidence and the crossovers come from a paired bootstrap over trials (stats.dominance).")


def verdict_note(findings: Findings) -> str:
    """How to read the two verdict columns, saying whether this report had an implementation null."""
    null = ("This report was given an implementation null (--null): a second run of the same cells that differs "
            "only in an implementation variable." if findings.has_null else
            "This report was given no implementation null, so a detected difference stays 'inconclusive': pass "
            "--null DIR, a run of the same cells with another RNG family, seed, impl, device or dtype.")
    return ("'comparison' is the within-run Mann–Whitney/Holm result for winner vs runner-up ('difference', or for "
            f"a tie 'equivalent' by TOST within ±{EQUIVALENCE_MARGIN:.0%}, else 'inconclusive'). 'verdict' is the "
            "codec-difference / implementation-variance rule of stats.validation (KS on the six error coordinates and "
            "the energy test on the six-D points, Holm-corrected, judged against the implementation null). " + null)
