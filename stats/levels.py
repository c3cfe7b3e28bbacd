"""The significance level and the equivalence margin of every verdict kvharness prints — the
report's winners and ties, `validate`, `compare` and the claims of `reproduce` — stated once.
(A claim of the AMD paper that names its own tolerance keeps it beside the claim, stats/claims.py.)"""

ALPHA = 0.05                # family-wise level: Holm within each family of tests
EQUIVALENCE_MARGIN = 0.10   # "equivalent": a TOST within ± this fraction of the mean compared against
# verdicts of `validate`, `compare` and the report (stats/validation.py): the smallest effect of
# interest on a metric's mean, in its pooled trial-to-trial standard deviations, and on its spread,
# as a ratio of standard deviations
SMALLEST_EFFECT = 0.5
SPREAD_MARGIN = 1.25
