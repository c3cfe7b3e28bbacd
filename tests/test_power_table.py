"""The pure parts of scripts/power_table.py (the measured power table of docs/statistics.md): the
95 % size interpolated as computed by hand, resampling that keeps paired samples paired, what
counts as found, and the stored table consistent with its own rates."""
from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("power_table", ROOT / "scripts" / "power_table.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


pt = _script()


def test_threshold_interpolates_in_log_size_between_the_bracketing_sizes():
    # 90 % at 0.02, 100 % at 0.04: 0.95 lies half-way, so the size is the geometric mean
    th = pt.threshold([0.01, 0.02, 0.04], [0.5, 0.9, 1.0])
    assert th["size"] == pytest.approx(math.sqrt(0.02 * 0.04))
    assert (th["below"], th["rate_below"], th["above"], th["rate_above"], th["bound"]) == (0.02, 0.9, 0.04, 1.0, "")
    # a quarter of the way: 0.8 -> 1.0 at 0.95 is t = 0.75; exp(log 0.01 + 0.75 log 2)
    th = pt.threshold([0.005, 0.01, 0.02], [0.0, 0.8, 1.0])
    assert th["size"] == pytest.approx(0.01 * 2 ** 0.75)
    # exactly at the target: that grid size
    assert pt.threshold([0.01, 0.02], [0.5, 0.95])["size"] == pytest.approx(0.02)


def test_threshold_is_where_every_larger_size_reaches_the_target():
    # 96 % at 0.02 but 90 % at 0.04: not yet found reliably; the bracket is 0.04 .. 0.08
    th = pt.threshold([0.01, 0.02, 0.04, 0.08], [0.2, 0.96, 0.9, 1.0])
    assert (th["below"], th["above"]) == (0.04, 0.08)
    assert th["size"] == pytest.approx(math.sqrt(0.04 * 0.08))


def test_threshold_outside_the_grid_is_a_bound():
    assert pt.threshold([0.01, 0.02], [0.97, 1.0]) == {"size": None, "bound": "<=", "below": None, "rate_below": None,
                                                        "above": 0.01, "rate_above": 0.97}
    th = pt.threshold([0.01, 0.02], [0.1, 0.6])
    assert (th["size"], th["bound"], th["below"], th["rate_below"]) == (None, ">", 0.02, 0.6)
    assert pt.threshold_text(th) == "> 0.02 (60 %)"
    assert pt.threshold_text(pt.threshold([0.01, 0.02], [0.9, 1.0])) == "0.014 (90 % at 0.01, 100 % at 0.02)"
    with pytest.raises(ValueError):
        pt.threshold([0.02, 0.01], [0.5, 1.0])


def test_found_is_the_bugs_right_answer():
    assert pt.found("codec-difference")
    assert not any(pt.found(v) for v in ("negligible", "equivalent", "inconclusive", "implementation-variance"))
    assert pt.found("negligible", target="negligible")


def test_subsets_draw_without_replacement():
    sets = pt.subsets(np.random.default_rng(0), 50, 30, 20)
    assert len(sets) == 20
    for s in sets:
        assert len(s) == len(set(s.tolist())) == 30 and list(s) == sorted(s) and 0 <= s.min() and s.max() < 50
    assert len({tuple(s) for s in sets}) == 20
    with pytest.raises(ValueError):
        pt.subsets(np.random.default_rng(0), 50, 51, 1)


def _frames(n=40, seed=0):
    """Four samples of one pool on the same data (A, A′, B, B′), each value tagged with its
    sample (0..3) and trial, so a resample shows which trial of which sample it took."""
    from kvcommon.rows import SIX_D
    from stats.validation import DATA_COLUMNS
    gen = np.random.default_rng(seed)
    base = gen.normal(1.0, 0.1, size=(n, len(SIX_D)))
    out = []
    for j in range(4):
        values = base + 0.001 * j + gen.normal(0, 0.01, size=base.shape)
        f = pd.DataFrame(values, columns=list(SIX_D))
        f["tag"] = 1000 * j + np.arange(n)
        f["trial"] = np.arange(n)
        for c, v in zip(DATA_COLUMNS, (1, "pcg64", "gaussian", 64, 256, 64)):
            f[c] = v
        out.append(f)
    return tuple(out)


def test_resampling_keeps_pairs_together():
    frames = _frames()
    index = pt.subsets(np.random.default_rng(1), 40, 25, 1)[0]
    sub = pt.resampled(frames, index)
    for j, f in enumerate(sub):
        assert f["trial"].tolist() == index.tolist()
        assert (f["tag"].to_numpy() == 1000 * j + index).all()
    # and the rule judges them paired, main and both nulls, as `validate --against` does
    from stats.validation import validate_samples
    a, a2, b, b2 = sub
    v = validate_samples(a, b, [(a, a2), (b, b2)], n_permutations=9)
    assert v.main.paired and all(n.paired for n in v.nulls)


def test_resampling_refuses_samples_of_different_pools():
    a, a2, b, b2 = _frames()
    with pytest.raises(ValueError, match="different numbers"):
        pt.resampled((a, b.iloc[:30]), [0, 1])
    with pytest.raises(ValueError, match="sort each by trial"):
        pt.resampled((a, b.iloc[::-1]), [0, 1])


def test_the_stored_table_follows_from_its_own_rates():
    data = json.loads((ROOT / "docs" / "data" / "power.json").read_text(encoding="utf-8"))
    assert data["settings"]["ns"] == [30, 60, 200] and data["settings"]["repetitions"] >= 100
    assert data["settings"]["target"] == 0.95
    for kind in data["kinds"]:
        assert kind["sizes"] == sorted(kind["sizes"])
        assert all(kind["shared_rows_identical_to_in_process"])
        assert set(kind["designs"]) == {"in-process", "plug-in, shared draws", "plug-in, own draws"}
        for d in kind["designs"].values():
            for n in data["settings"]["ns"]:
                rates, counts = d["rates"][str(n)], d["verdicts"][str(n)]
                assert [c.get(kind["target"], 0) / data["settings"]["repetitions"] for c in counts] == rates
                assert d["threshold"][str(n)] == pt.threshold(kind["sizes"], rates)
    text = pt.table_markdown(data)
    assert "| `wrong-norm` | in-process |" in text and "plug-in, own draws" in text
