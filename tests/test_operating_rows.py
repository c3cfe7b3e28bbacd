"""The generator of the operating-characteristics rows (harness/operating_rows.py): its arrays
hold what the runner stores, the paired runs as differences that give the rows back."""
import dataclasses

import numpy as np
import pytest

from harness.operating_rows import BUDGETS, RUNS, base_config, generate, run_rows
from kvcommon.rows import SIX_D


@pytest.mark.slow  # six small runs through the runner (about 25 s)
def test_generated_rows_are_the_runners_rows_with_paired_runs_as_differences(tmp_path):
    codecs, trials = ("int4", "tq-kv"), 3
    arrays = generate(trials, codecs=codecs, runs=("base", "rng", "dtype", "impl", "threads"))
    values = arrays["values"]
    assert values.dtype == np.float32 and values.shape == (5, len(codecs) * len(BUDGETS), trials, len(SIX_D))
    assert list(arrays["difference"]) == [False, False, True, True, True]
    assert list(arrays["data"]) == [RUNS[r][2] for r in ("base", "rng", "dtype", "impl", "threads")]
    cells = [(c, b) for c in codecs for b in BUDGETS]
    # the same runs, made here directly through the runner
    base = run_rows(base_config(trials, codecs), 1, tmp_path / "base")
    f64 = run_rows(dataclasses.replace(base_config(trials, codecs), dtype="float64"), 1, tmp_path / "f64")
    philox = run_rows(dataclasses.replace(base_config(trials, codecs), rng="philox"), 1, tmp_path / "philox")
    for i, cell in enumerate(cells):
        np.testing.assert_array_equal(values[0, i], base[cell].astype(np.float32))
        np.testing.assert_array_equal(values[1, i], philox[cell].astype(np.float32))
        # a paired run's difference is kept to float32's precision of the difference itself
        diff = f64[cell] - base[cell]
        np.testing.assert_allclose(values[2, i], diff, rtol=1e-7, atol=0)
        assert (values[4, i] == 0).all()  # rows do not depend on the thread count
    # int4 has no reference implementation: NaN; tq-kv has
    assert np.isnan(values[3, :2]).all() and np.isfinite(values[3, 2:]).all()
