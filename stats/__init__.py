"""Metrics and statistical inference on per-trial results. `stats.margins` (the significance level
and equivalence margin) imports nothing, so the command line can read it without loading torch;
the metrics load on first use of the names below."""

__all__ = ["METRIC_NAMES", "SIX_D", "trial_metrics"]


def __getattr__(name: str):
    if name in __all__:
        from . import metrics
        return getattr(metrics, name)
    raise AttributeError(f"module 'stats' has no attribute {name!r}")
