"""The columns of a trial frame that name its cell and its setting (one definition for the
store, the statistics and the reports; the cell's are the row schema's, kvcommon/rows.py).

A cell is one (scenario, scheme, budget, dim, seq_len, queries, calib_tokens): what the runner
commits at once and what runs are matched on. A setting is a cell without its scheme and
budget: the cells compared with each other. A setting's cells share their data trial by trial;
settings that differ only in calib_tokens share K, V and Q too (the calibration sample has
streams of its own), but their calibrated schemes are fitted on samples of different sizes.
"""
from kvcommon.rows import CELL_COLUMNS

SETTING_COLUMNS = ("scenario", "dim", "seq_len", "queries", "calib_tokens")

__all__ = ["CELL_COLUMNS", "SETTING_COLUMNS"]
