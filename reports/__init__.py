"""Reports from stored runs: summary tables (and figures and documents as they arrive)."""
from .summary import format_summary, mean_ci, summary_table

__all__ = ["format_summary", "mean_ci", "summary_table"]
