"""Claims 5 and 12 (abstract; §1 finding 2): the softmax (Jensen) amplifies the K path's error
with the score variance and does not amplify the V path's, judged on the first-order table of the
temperature experiment (first_order_t_rel_mse, path_slopes; claim_jensen, claim_v_path).
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from ..metrics import relative_mse
from .framework import (ClaimResult, _equivalent, _family, _headline, _no_comparison, _result, _standard_verdict,
                        lacking, paired_row)

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
    """Claim 5 as the paper reads it, on the first-order table (one row per trial and query
    temperature; the trials share their draws across temperatures). R_K = t_rel_mse_konly /
    logit_rel_mse: the output error with only K compressed per unit of logit error; R_V =
    t_rel_mse_vonly / v_rel_mse, the same for V. Per (scheme, d, budget): part `K grows with
    score variance`: the per-trial slope of log R_K against log score variance (path_slopes)
    > 0 (one-sample Wilcoxon: a trend test over the score-variance settings); part `K beyond
    V`: that slope minus the same trial's slope of log R_V > 0 (paired Wilcoxon: variance on
    the V path is not amplified as the K path's is). Holm over both parts. The amplification
    beyond the linearised softmax (A = konly / first-order prediction) is reported in the reason,
    not judged: the paper's claim is the growth, not its order."""
    test = ("tq-qkv (QJL on K: unbiased logits) on gaussian, queries at several temperatures (logit SD ~ 1/T, same "
            "draws): per trial, the slope of log R_K (K-only output error / logit error) against log score variance "
            "over the temperatures > 0 (Wilcoxon: trend test), and minus the slope of log R_V (V-only output error / "
            "V error) > 0 (paired Wilcoxon: the V path is not amplified), Holm")
    if first_order is None or first_order.empty:
        return lacking(5, test, "paired", "the first-order table of the temperature experiment")
    temps = sorted(first_order.temperature.unique())
    if len(temps) < 2:
        return lacking(5, test, "paired", "two query temperatures")
    has_v = {"t_rel_mse_vonly", "v_rel_mse"} <= set(first_order.columns)
    k = path_slopes(first_order, "t_rel_mse_konly", "logit_rel_mse").set_index(["scheme", "dim", "budget", "trial"])
    v = path_slopes(first_order, "t_rel_mse_vonly", "v_rel_mse").set_index(["scheme", "dim", "budget", "trial"]) \
        if has_v else None
    order = list(reversed(temps))   # smallest score variance (largest T) first
    rows, notes = [], []
    for (scheme, dim, budget), g in first_order.groupby(["scheme", "dim", "budget"], sort=True):
        where = dict(budget=int(budget), scenario=str(g.scenario.iloc[0]), dim=int(dim))
        ks = k.loc[(scheme, dim, budget)].slope
        rows.append(paired_row(ks.to_numpy(), np.zeros(len(ks)), f"slope of log R_K, {scheme} b={budget}",
                               part="K grows with score variance", expect="greater", **where))
        label = f"slope of log R_K - of log R_V, {scheme} b={budget}"
        if v is None:
            rows.append(_no_comparison(label + " (the table has no V-only errors)", part="K beyond V",
                                       expect="greater", **where))
        else:
            vs = v.loc[(scheme, dim, budget)].slope
            shared = ks.index.intersection(vs.index)
            rows.append(paired_row(ks[shared].to_numpy(), vs[shared].to_numpy(), label, part="K beyond V",
                                   expect="greater", **where))
        note = (f"b={budget} at T = {', '.join(map(str, order))} ({_score_variances(g, order)}): R_K "
                f"{_ratio_means(g, 't_rel_mse_konly', 'logit_rel_mse', order)}")
        if has_v:
            note += f"; R_V {_ratio_means(g, 't_rel_mse_vonly', 'v_rel_mse', order)}"
        notes.append(note + f"; A {_ratio_means(g, 't_rel_mse_konly', 't_rel_mse_first_order', order)}")
    tests = _family(rows, 5)
    verdict, reason = _standard_verdict(tests, "comparisons")
    reason += (". Geometric means (R = output error with one cache compressed / that cache's error; A = K-only "
               "error / its first-order softmax prediction, 1 = the linearised softmax explains it): "
               + "; ".join(notes))
    head = _headline(tests, "min", part="K grows with score variance")
    return _result(5, test, "paired", tests, (verdict, reason), head,
                   "slope of log R_K (K-only output error / logit error) per unit log score variance, smallest over "
                   "budgets")


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
    head = _headline(tests.assign(size=tests.estimate.astype(float).abs()), "max", key="size")
    return _result(12, test, "paired", tests, (verdict, reason), head,
                   "slope of log R_V (V-only output error / V error) per unit log score variance, largest in size")
