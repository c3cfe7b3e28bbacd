"""What a reader sees of the report's figures and PDF tables: every figure has its own title, no
rendered text shows raw math markup, no legend lists more than MAX_SERIES entries, and no PDF
table cell is cut off."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from harness.store import TRIAL_COLUMNS
from stats.findings import analyse

CODECS = ("plain-kv", "tq-kv", "tq-qkv", "tq-fkv", "tq-kqv", "tq-qkqv", "tq-kfv", "tq-fkfv", "sq-kv", "squ-kv",
          "int8", "int4", "kivi", "h2o", "svd")


def synthetic_findings(names=CODECS, scenarios=("gaussian", "price_$5_vs_$10"), seed=3):
    """Findings of a made-up run (random metrics spanning two decades, so axes go logarithmic) of
    the given codecs: the figures and tables drawn without running a sweep."""
    rng = np.random.default_rng(seed)
    rows = []
    overhead = {name: rng.uniform(0.05, 0.45) for name in names}   # bits beyond the budget, as a codec's norms
    for scenario in scenarios:
        for name in names:
            for budget in (2, 3):
                for dim in (32, 64):
                    for trial in range(4):
                        row = {c: rng.uniform(0.002, 0.5) for c in TRIAL_COLUMNS}
                        row.update(scenario=scenario, scheme=name, budget=budget, dim=dim, seq_len=64, queries=8,
                                   trial=trial, seed=0, impl="torch", device="cpu", dtype="float32", rng="pcg64",
                                   heads=1, calib_tokens=512, bits_per_element=budget + overhead[name],
                                   storage_bits_per_element=budget + overhead[name], model_bits=0.0,
                                   model_bits_per_element=0.0)
                        for c in ("d_eff_k", "d_eff_v", "spectral_gap_k", "spectral_gap_v"):
                            row[c] = float(rng.integers(2, 30)) if name.startswith("sq") else np.nan
                        rows.append(row)
    return analyse(pd.DataFrame(rows), n_permutations=20)


@pytest.fixture(scope="module")
def figures():
    import matplotlib.pyplot as plt

    from reports.figures import build_figures

    built = build_figures(synthetic_findings())
    yield built
    for f in built:
        if f.figure is not None:
            plt.close(f.figure)


def test_every_figure_has_its_own_title(figures):
    """Each figure's title is words of its own (the significance heat map's once came out as 0.3, a
    layout constant that shadowed it, and the HTML showed it as the heading)."""
    drawn = {f.key: f for f in figures if f.figure is not None}
    assert "significance" in drawn
    assert drawn["significance"].title.startswith("Pairwise differences in d₂(T)")
    for f in figures:
        assert isinstance(f.title, str) and any(ch.isalpha() for ch in f.title), (f.key, f.title)
