"""Claims 5 and 12 (abstract; §1 finding 2): the softmax's nonlinearity (Jensen) amplifies the K
path's error with the score variance and does not amplify the V path's, judged on the first-order
table of the temperature experiment (first_order_t_rel_mse, path_slopes; claim_jensen,
claim_v_path). Claim 5 is judged on A, the K-only output error over its first-order prediction:
the part of the softmax's response the linearisation leaves out, which is what Jensen's
inequality is about.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from ..metrics import relative_mse
from .framework import (ClaimResult, _equivalent, _family, _headline, _holding, _result, _standard_verdict,
                        _summary, lacking, paired_row)

V_FLAT_MARGIN = 0.05         # claim 12: "not amplified" = |slope of log R_V per log score variance| <= 0.05 (TOST)


def first_order_t_rel_mse(logits: torch.Tensor, logits_hat: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The T error the logit error alone predicts to first order, per trial (B,).

    T = softmax(s)·V; for s → s + e the softmax Jacobian gives δp_i = p_i (e_i − ē), ē = Σ_j p_j e_j,
    so δT = Σ_i p_i (e_i − ē) v_i (per query row). Returns ‖δT‖²/‖T‖², comparable with
    t_rel_mse_konly = ‖softmax(s + e)·V − T‖²/‖T‖² (stats.metrics): their ratio is the
    amplification beyond first order, the nonlinear (Jensen) part of the softmax's response.
    logits, logits_hat (B, H, Nq, S); v (B, H, S, d); computed in float64."""
    s, s_hat, v = logits.double(), logits_hat.double(), v.double()
    p = torch.softmax(s, dim=-1)
    e = s_hat - s
    centred = e - (p * e).sum(-1, keepdim=True)
    t = p @ v
    return relative_mse(t, t + (p * centred) @ v)


def path_slopes(first_order: pd.DataFrame, error: str, reference: str) -> pd.DataFrame:
    """Per trial of every (scheme, dim, budget) of the first-order table: the least-squares slope
    of log(error / reference) against log score variance over the query temperatures (the trials
    share their draws across temperatures: one slope per trial is a paired trend test's unit).
    The score variance is the table's `score_var` (the exact logits' variance over keys, mean over
    query rows), or, in a table stored without it, 1/T² (logits scale as 1/T exactly).
    Columns: scheme, dim, budget, scenario, trial, slope."""
    frame = first_order.copy()
    frame["_x"] = np.log(frame["score_var"]) if "score_var" in frame.columns else -2 * np.log(frame["temperature"])
    frame["_y"] = np.log(frame[error] / frame[reference])
    frame = frame[np.isfinite(frame["_x"]) & np.isfinite(frame["_y"])]
    keys = ["scheme", "dim", "budget", "scenario", "trial"]

    def slope(g):
        x = g["_x"] - g["_x"].mean()
        return float((x * (g["_y"] - g["_y"].mean())).sum() / (x * x).sum()) if len(g) > 1 and (x * x).sum() > 0 \
            else np.nan

    out = frame.groupby(keys, sort=True)[["_x", "_y"]].apply(slope).rename("slope").reset_index()
    return out[np.isfinite(out.slope)]


def _ratio_means(g: pd.DataFrame, error: str, reference: str, temps) -> str:
    gm = np.exp(np.log(g[error] / g[reference]).groupby(g.temperature).mean())
    return ", ".join(f"{gm[t]:.3g}" for t in temps)


def _score_variances(g: pd.DataFrame, temps) -> str:
    if "score_var" not in g.columns:
        return "score variance 1/T^2"
    sv = g.groupby("temperature").score_var.mean()
    return "score variance " + ", ".join(f"{sv[t]:.3g}" for t in temps)


def claim_jensen(first_order: pd.DataFrame | None) -> ClaimResult:
    """Claim 5 on the part the paper attributes to the softmax's nonlinearity (Jensen), on the
    first-order table (one row per trial and query temperature; the trials share their draws
    across temperatures). A = t_rel_mse_konly / t_rel_mse_first_order: the output error with only
    K compressed over what the linearised softmax predicts from the same logit error
    (first_order_t_rel_mse); A = 1 is a first-order response, A > 1 the nonlinearity amplifying.
    Per (scheme, d, budget): part `A above 1`: log A at the largest score variance (smallest T)
    > 0 (one-sample Wilcoxon); part `A grows`: the per-trial slope of log A against log score
    variance (path_slopes) > 0 (one-sample Wilcoxon: a trend test). Holm over both. Reported
    alongside, outside the verdict's family: part `R_K grows`, the slope of log R_K (R_K =
    t_rel_mse_konly / logit_rel_mse, the output error per unit logit error) > 0. log R_K is
    log A plus the log of the linearised softmax's own R_K, which grows with the score variance
    with no nonlinearity at all, so R_K's growth alone does not show amplification; the reason
    gives both slopes. The V half of the finding is claim 12 (claim_v_path)."""
    test = ("tq-qkv (QJL on K: unbiased logits) on gaussian, queries at several temperatures (logit SD ~ 1/T, same "
            "draws): A = K-only output error / its first-order (linearised softmax) prediction from the same logits; "
            "per budget, log A at the largest score variance > 0 (Wilcoxon) and the per-trial slope of log A against "
            "log score variance > 0 (Wilcoxon: trend test), Holm; the slope of log R_K (K-only output error / logit "
            "error) reported alongside")
    if first_order is None or first_order.empty:
        return lacking(5, test, "paired", "the first-order table of the temperature experiment")
    if not {"t_rel_mse_konly", "t_rel_mse_first_order", "logit_rel_mse"} <= set(first_order.columns):
        return lacking(5, test, "paired", "the K-only errors with their first-order prediction")
    temps = sorted(first_order.temperature.unique())
    if len(temps) < 2:
        return lacking(5, test, "paired", "two query temperatures")
    keys = ["scheme", "dim", "budget", "trial"]
    a_slopes = path_slopes(first_order, "t_rel_mse_konly", "t_rel_mse_first_order").set_index(keys)
    r_slopes = path_slopes(first_order, "t_rel_mse_konly", "logit_rel_mse").set_index(keys)
    lin_slopes = path_slopes(first_order, "t_rel_mse_first_order", "logit_rel_mse").set_index(keys)
    order = list(reversed(temps))   # smallest score variance (largest T) first
    rows, reported, notes = [], [], []
    for (scheme, dim, budget), g in first_order.groupby(["scheme", "dim", "budget"], sort=True):
        where = dict(budget=int(budget), scenario=str(g.scenario.iloc[0]), dim=int(dim))
        top = g[g.temperature == temps[0]].set_index("trial").sort_index()
        log_a = np.log(top.t_rel_mse_konly / top.t_rel_mse_first_order).to_numpy(float)
        rows.append(paired_row(log_a, np.zeros(len(log_a)), f"log A at T={temps[0]}, {scheme} b={budget}",
                               part="A above 1", expect="greater", **where))
        slopes = a_slopes.loc[(scheme, dim, budget)].slope
        rows.append(paired_row(slopes.to_numpy(), np.zeros(len(slopes)), f"slope of log A, {scheme} b={budget}",
                               part="A grows", expect="greater", **where))
        r_k = r_slopes.loc[(scheme, dim, budget)].slope
        reported.append(paired_row(r_k.to_numpy(), np.zeros(len(r_k)), f"slope of log R_K, {scheme} b={budget}",
                                   part="R_K grows", expect="greater", **where))
        note = (f"b={budget} at T = {', '.join(map(str, order))} ({_score_variances(g, order)}): A "
                f"{_ratio_means(g, 't_rel_mse_konly', 't_rel_mse_first_order', order)}; R_K "
                f"{_ratio_means(g, 't_rel_mse_konly', 'logit_rel_mse', order)}, slope {r_k.mean():.2g} (linearised "
                f"softmax's {lin_slopes.loc[(scheme, dim, budget)].slope.mean():.2g})")
        if {"t_rel_mse_vonly", "v_rel_mse"} <= set(g.columns):
            note += f"; R_V {_ratio_means(g, 't_rel_mse_vonly', 'v_rel_mse', order)}"
        notes.append(note)
    tests = _family(rows, 5)
    r_tests = _family(reported, 5, in_verdict=False)
    verdict, reason = _standard_verdict(tests, "comparisons")
    reason += (f". Reported, not judged (R_K = K-only output error / logit error, which the linearised softmax "
               f"already makes grow): {_summary(r_tests)}. Geometric means (A = K-only error / its first-order "
               f"prediction, 1 = the linearised softmax explains it, above 1 = amplified by the nonlinearity; R = "
               f"output error with one cache compressed / that cache's error): " + "; ".join(notes))
    head = _headline(_holding(tests, verdict), "min", part="A above 1")
    if head is not None:
        a_top = float(np.exp(head["estimate"]))
        reason = (f"at the largest score variance (T = {temps[0]}) the K-only output error is {a_top:.3g} times its "
                  f"first-order prediction ({head['label']}): the softmax's nonlinearity "
                  f"{'amplifies' if a_top > 1 else 'damps'} it there. {reason[0].upper()}{reason[1:]}")
    return _result(5, test, "paired", pd.concat([tests, r_tests], ignore_index=True), (verdict, reason), head,
                   f"A (K-only output error / its first-order prediction) at the largest score variance (T = "
                   f"{temps[0]}), geometric mean, smallest over budgets", transform=np.exp)


def claim_v_path(first_order: pd.DataFrame | None) -> ClaimResult:
    """Claim 12 (the V half of the paper's finding 2). Per (scheme, d, budget) of the first-order
    table: the per-trial slope of log R_V (V-only output error / V error) against log score
    variance (path_slopes), expected equivalent to 0: paired TOST within ±V_FLAT_MARGIN. A
    slope inside the margin is as claimed even when significant (negligible); a significant
    slope not shown inside it counts against. The claim's second half, that the distinction is
    invisible to accuracy-only evaluation, is a statement about evaluation practice, not a
    property of the codecs: not tested."""
    test = (f"tq-qkv on gaussian at several query temperatures (same draws): per trial, the slope of log R_V (V-only "
            f"output error / V error) against log score variance; equivalent to 0 within +-{V_FLAT_MARGIN} (paired "
            f"TOST: R_V changes by at most {16 ** V_FLAT_MARGIN - 1:.0%} over a 16-fold score variance), a "
            f"significant slope (Wilcoxon, Holm) not inside the margin counts against; 'invisible to accuracy-only "
            f"evaluation' is not tested")
    if first_order is None or first_order.empty or not {"t_rel_mse_vonly", "v_rel_mse"} <= set(first_order.columns):
        return lacking(12, test, "paired", "the V-only errors of the temperature experiment")
    temps = sorted(first_order.temperature.unique())
    if len(temps) < 2:
        return lacking(12, test, "paired", "two query temperatures")
    v = path_slopes(first_order, "t_rel_mse_vonly", "v_rel_mse")
    order = list(reversed(temps))
    rows, notes = [], []
    for (scheme, dim, budget), g in v.groupby(["scheme", "dim", "budget"], sort=True):
        zero = np.zeros(len(g))
        row = paired_row(g.slope.to_numpy(), zero, f"slope of log R_V, {scheme} b={budget}", part="V flat",
                         expect="equivalent", budget=int(budget), scenario=str(g.scenario.iloc[0]), dim=int(dim))
        row["equivalent"] = _equivalent(g.slope.to_numpy(), zero, V_FLAT_MARGIN, paired=True)
        rows.append(row)
        f = first_order[(first_order.scheme == scheme) & (first_order.dim == dim) & (first_order.budget == budget)]
        notes.append(f"b={budget}: R_V {_ratio_means(f, 't_rel_mse_vonly', 'v_rel_mse', order)} at T = "
                     f"{', '.join(map(str, order))} ({_score_variances(f, order)})")
    tests = _family(rows, 12)
    verdict, reason = _standard_verdict(tests, "V-path slopes")
    reason += ". Geometric-mean R_V (1 = the output error is the V error): " + "; ".join(notes)
    head = _headline(_holding(tests, verdict).assign(size=lambda t: t.estimate.astype(float).abs()), "max", key="size")
    return _result(12, test, "paired", tests, (verdict, reason), head,
                   "slope of log R_V (V-only output error / V error) per unit log score variance, largest in size")
