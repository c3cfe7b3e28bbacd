"""Codecs compared at equal measured storage, not at equal nominal budget.

A nominal budget b says little about what a codec stores: at b = 2 the measured storage of the
registered codecs runs from 1.97 (svd) to 9 bits per element (int8, a fixed width). So every
comparison the report headlines is made at a common *storage level* x (bits per element):

- a scheme's value at x is the per-trial metric of its measured cell whose mean storage lies
  within ±TOLERANCE/2 of x (relative; the closest such cell), or else
- the per-trial interpolation between the scheme's two cells whose mean storages s₀ < x < s₁
  are the nearest below and above x: log-linear in the metric (rate–distortion curves are close
  to straight lines of log error against bits; linear where a value is not positive), trial by
  trial, with weight w = (x − s₀)/(s₁ − s₀). The cells of one setting ran on the same K, V and
  Q draws, so the interpolated values stay paired with every other scheme's;
- no extrapolation: a scheme whose cells do not reach x on both sides (and none within the
  tolerance) is absent at x. A fixed-width codec (int8, int4) thus appears only at the levels
  its measured storage puts it at.

Every pair of values compared at x therefore stands at storages within TOLERANCE (5 %) of each
other. Storage is `storage_bits_per_element` where the rows have it (per-cache bits plus the
model constants amortised over the run's --model-caches N), else `bits_per_element`.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from kvcommon.rows import SETTING_COLUMNS

STORAGE = "storage_bits_per_element"
TOLERANCE = 0.05  # relative storage difference within which two values count as equal storage
LEVEL = "storage_level"
# columns of a trial row that say which data it ran on (stats.validation.same_data reads them)
_DATA_COLUMNS = ("seed", "rng")


def storage_column(trials: pd.DataFrame) -> str:
    """The column that holds a row's storage: storage_bits_per_element when every row has it."""
    if STORAGE in trials.columns and trials[STORAGE].notna().all():
        return STORAGE
    return "bits_per_element"


def default_levels(trials: pd.DataFrame) -> tuple[float, ...]:
    """b + 0.5 for each nominal budget b of the run: the levels that the data-oblivious codecs
    (b bits plus a norm or scale per vector) and the calibrated ones (below b) both reach."""
    return tuple(sorted({float(b) + 0.5 for b in trials["budget"].unique()}))


def parse_levels(text: str) -> tuple[float, ...]:
    """'2.5,3.5' -> (2.5, 3.5); ValueError naming the bad entry otherwise."""
    out = []
    for part in text.split(","):
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"storage level {part.strip()!r} is not a number; give bits per element, "
                             f"e.g. 2.5,3.5,4.5") from None
        if not np.isfinite(value) or value <= 0:
            raise ValueError(f"storage level {part.strip()!r} must be a positive number of bits per element")
        out.append(value)
    return tuple(sorted(set(out)))


def _interpolate(low: np.ndarray, high: np.ndarray, w: float) -> np.ndarray:
    """Log-linear between low and high at weight w where both are positive, linear elsewhere."""
    with np.errstate(divide="ignore", invalid="ignore"):
        logged = np.exp((1 - w) * np.log(low) + w * np.log(high))
    linear = (1 - w) * low + w * high
    return np.where((low > 0) & (high > 0), logged, linear)


def _placements(storages: pd.Series, level: float):
    """How one scheme reaches `level`: ('measured', b, b, 0) with the closest cell within the
    tolerance, ('interpolated', b₀, b₁, w) between the nearest cells below and above, or None."""
    gap = (storages - level).abs() / level
    near = gap[gap <= TOLERANCE / 2]
    if len(near):
        b = near.idxmin()
        return "measured", b, b, 0.0
    below, above = storages[storages < level], storages[storages > level]
    if below.empty or above.empty:
        return None
    b0, b1 = below.idxmax(), above.idxmin()
    return "interpolated", b0, b1, float((level - storages[b0]) / (storages[b1] - storages[b0]))


def at_storage(trials: pd.DataFrame, metrics, levels=None) -> pd.DataFrame:
    """Per setting, scheme, storage level and trial: the metrics at that storage (module doc).

    Columns: SETTING_COLUMNS, scheme, storage_level, trial, seed, rng, source ('measured' or
    'interpolated'), budget_low, budget_high (the cells used; equal when measured), weight,
    storage (mean storage of the measured cell, or the level itself), then the metrics."""
    metrics = list(metrics)
    storage = storage_column(trials)
    levels = default_levels(trials) if levels is None else tuple(levels)
    columns = list(SETTING_COLUMNS) + ["scheme", LEVEL, "trial", *_DATA_COLUMNS, "source", "budget_low",
                                       "budget_high", "weight", "storage"] + metrics
    frames = []
    for key, group in trials.groupby(list(SETTING_COLUMNS) + ["scheme"], sort=True):
        by_budget = {b: g.set_index("trial") for b, g in group.groupby("budget")}
        storages = pd.Series({b: float(g[storage].mean()) for b, g in by_budget.items()})
        for level in levels:
            placed = _placements(storages, level)
            if placed is None:
                continue
            source, b0, b1, w = placed
            low, high = by_budget[b0], by_budget[b1]
            shared = low.index.intersection(high.index)
            low, high = low.loc[shared], high.loc[shared]
            out = pd.DataFrame({c: v for c, v in zip(SETTING_COLUMNS, key[:-1])}, index=range(len(shared)))
            out["scheme"], out[LEVEL], out["trial"] = key[-1], level, shared.to_numpy()
            for c in _DATA_COLUMNS:
                out[c] = low[c].to_numpy() if c in low.columns else None
            out["source"], out["budget_low"], out["budget_high"], out["weight"] = source, b0, b1, w
            out["storage"] = storages[b0] if source == "measured" else level
            for m in metrics:
                values = low[m].to_numpy(float)
                out[m] = values if source == "measured" else _interpolate(values, high[m].to_numpy(float), w)
            frames.append(out)
    if not frames:
        return pd.DataFrame(columns=columns)
    return pd.concat(frames, ignore_index=True)[columns]
