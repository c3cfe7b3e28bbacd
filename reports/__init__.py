"""Reports from stored runs: summary tables (and figures and documents as they arrive)."""
from stats.inference import mean_ci

from .summary import format_summary, summary_table

__all__ = ["format_summary", "mean_ci", "summary_table"]
