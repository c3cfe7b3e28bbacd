"""Per-cell summary of a run: means with 95% confidence intervals, from the stored rows alone."""
from __future__ import annotations

import pandas as pd
from stats.findings import cell_estimates


SUMMARY_METRICS = ("d2_t", "rel_mse_k", "rel_mse_v", "kl_attn", "logit_slope")


def summary_table(trials: pd.DataFrame, metrics=SUMMARY_METRICS) -> pd.DataFrame:
    """One row per cell: n_trials, bits_per_element and, per metric, mean, ci_low, ci_high
    (stats.findings.cell_estimates, with the summary's column names)."""
    estimates = cell_estimates(trials, metrics).drop(columns="storage")
    return estimates.rename(columns={f"{m}_{end}": f"{m}_ci_{end}" for m in metrics for end in ("low", "high")})


def format_summary(table: pd.DataFrame, metric: str = "d2_t") -> str:
    """A plain-text table: one line per cell with the metric's mean and 95% CI; an n_cal column
    only when the table has several calibration sizes."""
    several = table["calib_tokens"].nunique() > 1 if len(table) else False
    w = max([10] + [len(name) for name in table["scheme"]]) if len(table) else 10   # kvpress:ObservedAttentionPress
    lines = [f"{'scenario':<20} {'scheme':<{w}} {'b':>2} {'d':>4} {'S':>5} {'Nq':>4} "
             + (f"{'n_cal':>6} " if several else "") + f"{'bits/el':>8} {metric + ' mean [95% CI]':>34}"]
    for r in table.itertuples(index=False):
        mean, lo, hi = getattr(r, metric), getattr(r, f"{metric}_ci_low"), getattr(r, f"{metric}_ci_high")
        lines.append(f"{r.scenario:<20} {r.scheme:<{w}} {r.budget:>2} {r.dim:>4} {r.seq_len:>5} {r.queries:>4} "
                     + (f"{r.calib_tokens:>6} " if several else "")
                     + f"{r.bits_per_element:>8.3f} {mean:>12.5f} [{lo:.5f}, {hi:.5f}]")
    return "\n".join(lines)
