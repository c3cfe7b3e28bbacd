"""Metrics and statistical inference on per-trial results."""
from .metrics import METRIC_NAMES, SIX_D, trial_metrics

__all__ = ["METRIC_NAMES", "SIX_D", "trial_metrics"]
