"""The row schema: the columns of one stored trial row (one row per trial, DESIGN.md "results
are rows"). One definition that the cell engine (harness/cell.py) fills, the run store
(harness/store.py) keeps, the statistics and reports read, and the codec checks
(schemes/conformance.py) keep a codec's own diagnostics clear of. It imports nothing.

A cell is one (scenario, scheme, budget, dim, seq_len, queries, calib_tokens): what the runner
commits at once and what runs are matched on (and a setting, below: a cell without
its scheme and budget).
"""
CELL_COLUMNS = ("scenario", "scheme", "budget", "dim", "seq_len", "queries", "calib_tokens")
# A setting is a cell without its scheme and budget: the cells compared with each other. A
# setting's cells share their data trial by trial; settings that differ only in calib_tokens
# share K, V and Q too (the calibration sample has streams of its own), but their calibrated
# schemes are fitted on samples of different sizes.
SETTING_COLUMNS = ("scenario", "dim", "seq_len", "queries", "calib_tokens")

# The trial's configuration beside its cell. The trials table's column order is that of
# results.sqlite since its first version (calib_tokens after heads), though calib_tokens is now
# part of the cell.
CONFIG_COLUMNS = tuple(c for c in CELL_COLUMNS if c != "calib_tokens") + (
    "trial", "seed", "impl", "device", "dtype", "rng", "heads", "calib_tokens")

# Metrics every trial has (stats/metrics.py computes them); EVICTION_METRIC_NAMES only trials of
# an evicting codec (NaN otherwise).
METRIC_NAMES = tuple(
    f"{m}_{x}" for x in ("k", "v", "t") for m in ("rel_mse", "cos", "snr_err", "dir_err", "d2")
) + ("t_rel_mse_konly", "t_rel_mse_vonly", "kl_attn", "logit_rel_mse", "logit_slope", "ptcosine_k", "ptcosine_v")
EVICTION_METRIC_NAMES = ("evicted_mass",)
# the six-D error decomposition (stats.metrics), the columns the verdicts test
SIX_D = ("snr_err_k", "dir_err_k", "snr_err_v", "dir_err_v", "snr_err_t", "dir_err_t")

# Per-trial facts the built-in codecs report (Scheme.diagnostics: SpectralQuant's effective rank
# and spectral gap of its calibrated bases); NULL for the others. Any other name a codec reports
# is stored apart, long form (the store's diagnostics table), and read back as a column.
DIAGNOSTIC_COLUMNS = ("d_eff_k", "d_eff_v", "spectral_gap_k", "spectral_gap_v")

# The bit ledger beyond the per-cache bits_per_element (schemes.base.TrialBits): model bits per
# layer-head, the same amortised over one cache, and the bits charged with the model constants
# amortised over --model-caches N caches (= bits_per_element without the flag).
STORAGE_COLUMNS = ("model_bits", "model_bits_per_element", "storage_bits_per_element")

# Trial columns added after the first version: they end the table, in a new store as in an old
# one that gained them on open, so both agree.
ADDED_COLUMNS = STORAGE_COLUMNS + ("ptcosine_k", "ptcosine_v") + EVICTION_METRIC_NAMES

TRIAL_COLUMNS = (CONFIG_COLUMNS + ("bits_per_element",) + tuple(m for m in METRIC_NAMES if m not in ADDED_COLUMNS)
                 + DIAGNOSTIC_COLUMNS + ADDED_COLUMNS)

# The columns' types: text, integer, and every other one real.
TEXT_COLUMNS = frozenset({"scenario", "scheme", "impl", "device", "dtype", "rng"})
INTEGER_COLUMNS = frozenset({"budget", "dim", "seq_len", "queries", "trial", "seed", "heads", "calib_tokens"})

# A table a reproduction (harness reproduce) stores beside the trials: one row per claim of the
# paper (its columns: stats.claims.CLAIM_COLUMNS).
CLAIMS_TABLE = "claims"
