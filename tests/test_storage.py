"""Storage accounting (DESIGN.md, Scheme `bits`): per-cache bits (`bits_per_element`) and the
per-model constants (`model_bits` per layer-head, `model_bits_per_element`), amortised over
`--model-caches N` caches in `storage_bits_per_element`; counted by hand from the formats, not by
the ledger code under test."""
import json
import math
import sqlite3

import pandas as pd
import pytest
import torch

import schemes
from harness import cell as engine
from harness.cli import main
from kvcommon.rows import STORAGE_COLUMNS, TRIAL_COLUMNS
from harness.store import RESULTS_FILE, RunStore
from harness.sweep import Cell, SweepConfig
from schemes.base import BitLedger
from old_stores import rewrite_as_old_store


# --- the split, counted by hand ---------------------------------------------------------------
@pytest.mark.parametrize("n_heads", [1, 2])
def test_tq_kv_per_cache_and_model_bits_by_hand(n_heads):
    """tq-kv, b = 3, d = 128: per cache 3 code bits and a float32 norm per 128-element vector,
    3 + 32/128 = 3.25 bits/element; per model one packed sign per coordinate for K's and V's
    rotation of every head and one float32 codebook of 2^3 entries shared by K, V and the heads."""
    d, s = 128, 64
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(2, n_heads, s, d, generator=g) for _ in range(2))
    scheme = schemes.create("tq-kv", budget=3, dim=d)
    enc = scheme.encode(k, v)
    bits = BitLedger.per_trial(enc)
    assert bits.bits_per_element.tolist() == [3.25, 3.25]
    model_total = 2 * n_heads * d + 8 * 32
    assert bits.model.tolist() == [model_total] * 2
    assert bits.model_bits.tolist() == [model_total / n_heads] * 2
    assert bits.model_bits_per_element.tolist() == [model_total / (2 * n_heads * s * d)] * 2
    ledger = scheme.bits(enc)
    assert (ledger.total, ledger.model_total) == (2 * 2 * n_heads * s * d * 3.25 / 2, model_total)
    assert ledger.standalone_total == ledger.total + model_total


def test_squ_kv_per_cache_bits_follow_the_paper_formula_and_undercut_tq_kv(tmp_path):
    """squ-kv at b = 3 (d = 128, S = 1024, spectral_decay): per cache the paper's
    (b·d_eff + 2·(d − d_eff))/d bits (§3.2) plus a float32 norm per vector, from the d_eff stored
    in each row, averaged over K and V; fewer than tq-kv's 3.25. The calibration (basis, σ,
    widths, codebooks) is per model: amortised over one cache it would cost more than tq-kv."""
    out = tmp_path / "run"
    assert main(["run", "--scenario", "spectral_decay", "--scheme", "tq-kv,squ-kv", "--budget", "3",
                 "--dim", "128", "--seq-len", "1024", "--queries", "4", "--trials", "2", "--quiet",
                 "--out", str(out)]) == 0
    frame = RunStore(out).trials()
    tq, squ = frame[frame.scheme == "tq-kv"], frame[frame.scheme == "squ-kv"]
    assert (tq.bits_per_element == 3.25).all()
    b, d = 3, 128
    for row in squ.itertuples():
        paper = sum((b * e + 2 * (d - e)) / d for e in (row.d_eff_k, row.d_eff_v)) / 2
        assert row.d_eff_k < d / 4 and row.bits_per_element == pytest.approx(paper + 32 / d, rel=1e-12)
        assert row.bits_per_element < 3.25
        # per model per layer-head: int8 basis, float32 basis scales and σ, 4-bit widths for K and
        # V, and the 2- and 3-bit unit Gaussian codebooks (float32)
        assert row.model_bits == 2 * (8 * d * d + 32 * d + 32 * d + 4 * d) + 32 * (4 + 8)
        assert row.model_bits_per_element == pytest.approx(row.model_bits / (2 * 1024 * d), rel=1e-12)
        assert row.storage_bits_per_element == row.bits_per_element          # no --model-caches
        assert row.bits_per_element + row.model_bits_per_element > 3.25 + tq.model_bits_per_element.iloc[0]


def _sq_standalone_bits_by_hand(widths: torch.Tensor, s: int, d: int) -> float:
    """sq-kv's whole stored cache of one trial and one head, widths (2, d) of K and V: per tensor
    the code stream in whole bytes, a float32 norm per token, the int8 basis, float32 basis
    scales and σ, 4 bits of allocation table per coordinate; one float32 codebook per width in use."""
    total = 0
    for w in widths.tolist():
        total += math.ceil(sum(w) * s / 8) * 8 + 32 * s + 8 * d * d + 32 * d + 32 * d + 4 * d
    total += sum(32 * 2 ** w for w in set(widths.flatten().tolist()) if w)
    return total / (2 * s * d)


def test_model_caches_1_reproduces_the_standalone_cache(tmp_path):
    """--model-caches 1 charges every constant to its cache: storage_bits_per_element is the
    stand-alone count earlier versions stored as bits_per_element, counted here by hand."""
    d, s, n_cal = 16, 32, 64
    out = tmp_path / "one"
    assert main(["run", "--scenario", "spectral_decay", "--scheme", "tq-kv,sq-kv", "--budget", "3", "--dim", str(d),
                 "--seq-len", str(s), "--queries", "4", "--trials", "3", "--calib-tokens", str(n_cal),
                 "--model-caches", "1", "--quiet", "--out", str(out)]) == 0
    store = RunStore(out)
    assert store.read_manifest()["config"]["model_caches"] == 1
    frame = store.trials()
    tq = frame[frame.scheme == "tq-kv"]
    # 3 code bits + a float32 norm per 16-element vector; 16 packed rotation signs per tensor and a
    # float32 codebook of 8 entries
    assert tq.storage_bits_per_element.tolist() == [3 + 32 / d + (2 * d + 8 * 32) / (2 * s * d)] * 3
    config = SweepConfig.from_json(store.read_manifest()["config"])
    cell = Cell("spectral_decay", "sq-kv", 3, d, s, 4, n_cal)
    scheme = engine.create_scheme(config, cell)
    data = engine.draw_trials(config, cell, range(3), torch.device("cpu"), torch.float32)
    scheme.fit(data["k_cal"], data["v_cal"], trials=data["trials"])
    widths = torch.stack([scheme.calibration[x].widths[:, 0] for x in ("k", "v")], 1)     # (B, 2, d)
    sq = frame[frame.scheme == "sq-kv"].sort_values("trial")
    expected = [_sq_standalone_bits_by_hand(w, s, d) for w in widths]
    assert sq.storage_bits_per_element.tolist() == expected
    assert len(set(widths.flatten().tolist())) > 2        # water-filling: several widths, several codebooks
    pd.testing.assert_series_equal(sq.storage_bits_per_element, sq.bits_per_element + sq.model_bits_per_element,
                                   check_names=False, rtol=1e-14)


def test_model_caches_amortises_the_model_bits(tmp_path):
    base = ["run", "--scenario", "gaussian", "--scheme", "tq-kv", "--budget", "2", "--dim", "16", "--seq-len", "32",
            "--queries", "4", "--trials", "2", "--quiet"]
    assert main([*base, "--model-caches", "4", "--out", str(tmp_path / "four")]) == 0
    frame = RunStore(tmp_path / "four").trials()
    model = 4 * 32 + 2 * 16
    assert frame.model_bits.tolist() == [model] * 2
    assert frame.storage_bits_per_element.tolist() == [(2 * 32 * 16 * (2 + 2) + model / 4) / (2 * 32 * 16)] * 2
    # resuming under another N is another run: its storage column would differ
    assert main([*base, "--model-caches", "2", "--out", str(tmp_path / "four"), "--resume"]) == 2


@pytest.mark.parametrize("value,message", [("0", "--model-caches 0 must be a positive integer"),
                                           ("x", "invalid int value: 'x'")])
def test_bad_model_caches_is_one_line_exit_2(tmp_path, capsys, value, message):
    out = tmp_path / "never"
    assert main(["run", "--scenario", "gaussian", "--scheme", "tq-kv", "--budget", "2", "--dim", "16",
                 "--model-caches", value, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not out.exists()


# --- stores written before the storage columns ------------------------------------------------
def test_store_without_the_storage_columns_reports_migrates_and_resumes(tmp_path, capsys):
    """A run directory as the previous version wrote it (no storage columns in `trials`, no
    model_caches in the manifest), interrupted after its first cell: it still reads and reports;
    --resume adds the columns (NULL in the old rows) and runs the missing cell as a clean run."""
    args = ["run", "--scenario", "gaussian", "--scheme", "tq-kv,plain-kv", "--budget", "2", "--dim", "16",
            "--seq-len", "32", "--queries", "4", "--trials", "3", "--calib-tokens", "24", "--quiet"]
    out = tmp_path / "old"
    assert main([*args, "--out", str(out)]) == 0
    clean = RunStore(out).trials()
    old_columns = [c for c in TRIAL_COLUMNS if c not in STORAGE_COLUMNS]
    rewrite_as_old_store(out, old_columns, "plain-kv")
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["config"]["model_caches"]
    (out / "manifest.json").write_text(json.dumps(manifest))

    old = RunStore(out).trials()                          # read-only: not migrated, new columns NaN
    assert set(STORAGE_COLUMNS) <= set(old.columns) and old[list(STORAGE_COLUMNS)].isna().all().all()
    from reports import format_summary, summary_table
    assert "plain-kv" in format_summary(summary_table(old))

    assert main([*args, "--out", str(out), "--resume"]) == 0
    assert "1 cells run, 1 already stored" in capsys.readouterr().out
    with sqlite3.connect(out / RESULTS_FILE) as con:
        present = [row[1] for row in con.execute("PRAGMA table_info(trials)")]
    assert set(TRIAL_COLUMNS) <= set(present)
    resumed = RunStore(out).trials()
    plain, tq = resumed[resumed.scheme == "plain-kv"], resumed[resumed.scheme == "tq-kv"]
    assert plain[list(STORAGE_COLUMNS)].isna().all().all()
    assert tq[list(STORAGE_COLUMNS)].notna().all().all()
    kept = [c for c in clean.columns if c not in STORAGE_COLUMNS]
    pd.testing.assert_frame_equal(resumed[kept], clean[kept], check_exact=False, rtol=1e-12)
    pd.testing.assert_frame_equal(tq[list(STORAGE_COLUMNS)], clean[clean.scheme == "tq-kv"][list(STORAGE_COLUMNS)])


# --- the ledger reads what is serialized; every built-in codec's figures are those of before ----
def _previous_ledger(enc) -> tuple[list[float], list[float]]:
    """Each trial's (per-cache, per-model) bits as the ledger counted them before it read the
    storages: each entry's own bytes (counted here from NumPy's copy of its elements), a codes
    entry's split over the B trials, exact_bits where the codec gives them."""
    b = enc.shape[0]
    cache, model = [0.0] * b, [0.0] * b
    for part in ("codes", "side"):
        for key, t in getattr(enc, part).items():
            own = 8 * len(t.detach().cpu().numpy().tobytes())
            for i in range(b):
                bits = float(enc.exact_bits[key][i]) if key in enc.exact_bits else float(own // b if part == "codes" else own)
                (model if key in enc.model else cache)[i] += bits
    return cache, model


@pytest.mark.parametrize("name", schemes.available(families=False))
def test_every_builtin_codecs_bits_are_unchanged(name):
    """BitLedger.per_trial, which charges a view its whole storage and a claim at least its
    trial's non-zero bytes, gives every built-in codec the figures of the previous ledger, at two
    budgets, called as the sweep calls it (fitted with the trial indices, positions and queries)."""
    from schemes.conformance import _encode

    options = {"shard": {"kmeans_iter": 2}, "shard-pca-decode": {"kmeans_iter": 2}}.get(name, {})
    g = torch.Generator().manual_seed(3)
    k, v, k_cal, v_cal = (torch.randn(3, 2, 96, 32, generator=g) * (1 + torch.arange(32)) for _ in range(4))
    for budget in (2, 4):
        scheme = schemes.create(name, budget=budget, dim=32, seed=5, **options)
        engine.fit_codec(scheme, k_cal, v_cal, torch.arange(3))
        enc = _encode(scheme, k, v)
        bits = BitLedger.per_trial(enc)
        cache, model = _previous_ledger(enc)
        assert bits.cache.tolist() == cache and bits.model.tolist() == model
