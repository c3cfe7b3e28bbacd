"""The significance level and the smallest effects of interest of every verdict kvharness
prints — the report's winners and ties, `validate`, `compare` and the claims of `reproduce` —
stated once. (A claim of the AMD paper that names its own tolerance keeps it beside the claim,
in its module of stats/claims/.)"""

ALPHA = 0.05                # family-wise level: Holm over each command's whole family of tests
# the smallest effect of interest on a metric's mean, in its pooled trial-to-trial standard
# deviations: equally reachable on every metric at a given trial count (stats/validation.py)
SMALLEST_EFFECT = 0.5
SPREAD_MARGIN = 1.25        # ... and on its spread, as a ratio of robust scales (stats/validation.py)
