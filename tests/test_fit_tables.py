"""The results of harness predictivity and recommend as tables of their run's results.sqlite
(harness/fit_tables.py), carried by report --json (checked against the shipped schema) and shown
in the HTML report.

Independent sources: Kendall's τ recomputed with scipy from the stored trial rows, the fitted
spec's own families and statistics, and the per-layer gains recomputed by hand from the rows."""
import json
import math
import sqlite3

import numpy as np
import pytest

from harness.cli import main
from harness.fit import FAMILIES
from harness.structure import STATISTICS
from harness.store import RunStore
from test_fit import llama_capture, write_capture

SCHEMES = ("plain-kv", "tq-kv", "sq-kv")


pytestmark = pytest.mark.usefixtures("one_torch_thread")   # tests/conftest.py


def two_layer_capture(path, seed=5, n=1200, d=32):
    gen = np.random.default_rng(seed)
    mix = gen.standard_normal((d, d)) * np.arange(1, d + 1) ** -0.8
    k = np.stack([gen.standard_normal((2, n, d)) @ mix.T + 0.5, gen.standard_normal((2, n, d)) * 2])
    v = gen.standard_normal((2, 2, n, d)) @ mix.T
    q = gen.standard_normal((2, 2, n, d))
    return write_capture(path, k, v, q)


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """A predictivity run over two layers (3 codecs, b 2-3, levels 3 and 4, 3 trials)."""
    tmp = tmp_path_factory.mktemp("study")
    cap = two_layer_capture(tmp / "cap.npz")
    spec = tmp / "spec.json"
    assert main(["fit", str(cap), "--out", str(spec)]) == 0
    out = tmp / "run"
    assert main(["predictivity", str(cap), "--spec", str(spec), "--scheme", ",".join(SCHEMES), "--budget", "2,3",
                 "--levels", "3,4", "--trials", "3", "--seq-len", "32", "--queries", "8", "--calib-tokens", "64",
                 "--out", str(out)]) == 0
    return {"cap": cap, "spec": spec, "out": out}


def test_predictivity_tables_hold_the_study(study, capsys):
    from scipy.stats import kendalltau
    capsys.readouterr()
    store = RunStore(study["out"])
    spec = json.loads(study["spec"].read_text())
    fit = store.table("fit_layers")
    assert fit["layer"].tolist() == [0, 1]
    for layer in spec["layers"]:   # the spec's own family, closeness and statistics
        row = fit[fit["layer"] == layer["layer"]].iloc[0]
        assert row["closest_family"] == layer["family"]["closest"]
        assert row["distance"] == pytest.approx(layer["family"]["distance"])
        ranked = sorted(layer["family"]["distances"].items(), key=lambda kv: kv[1])
        assert (row["next_family"], row["next_distance"]) == (ranked[1][0], pytest.approx(ranked[1][1]))
        assert row["kv_alignment"] == pytest.approx(layer["statistics"]["kv_alignment"])
        assert row["fitted_over_real_d2_t"] > 0
    taus = store.table("predictivity")
    trials = store.trials()
    means = trials.groupby(["scenario", "budget", "scheme"])["d2_t"].mean()
    assert set(trials["storage_bits_per_element"].round(6)) == {3.0, 4.0}   # levels 3, 4 are the measured cells
    c_all = d_all = 0
    for layer in (0, 1):   # τ of the fitted scenario, recomputed with scipy from the rows
        c = dd = 0
        for budget in (2, 3):
            real = means[f"replay:{study['cap']}:layer={layer}", budget][list(SCHEMES)].to_numpy()
            fitted = means[f"fitted:{study['spec']}:layer={layer}", budget][list(SCHEMES)].to_numpy()
            t = kendalltau(real, fitted).statistic
            c, dd = c + round(3 * (1 + t) / 2), dd + round(3 * (1 - t) / 2)
        row = taus[(taus["layer"] == layer) & (taus["codecs"] == "all") & (taus["candidate"] == "fitted")].iloc[0]
        assert row["tau"] == pytest.approx((c - dd) / (c + dd)) and row["n_pairs"] == 6
        assert row["ci_low"] <= row["tau"] <= row["ci_high"] or np.isnan(row["ci_low"])
        c_all, d_all = c_all + c, d_all + dd
        flips = store.table("predictivity_flips")
        assert (flips["layer"] == layer).sum() == dd   # one row per discordant pair
        generic = taus[(taus["layer"] == layer) & (taus["codecs"] == "all") & (taus["candidate"] == "generic")]
        assert len(generic) == len(FAMILIES) and generic["n_pairs"].gt(0).all()
        per_codec = store.table("predictivity_codecs").set_index(["layer", "scheme"])
        for scheme in SCHEMES:   # geometric mean over the two levels of fitted / real mean d2_t, from the rows
            ratios = [means[f"fitted:{study['spec']}:layer={layer}", budget][scheme]
                      / means[f"replay:{study['cap']}:layer={layer}", budget][scheme] for budget in (2, 3)]
            assert per_codec.loc[(layer, scheme), "fitted_over_real_d2_t"] == pytest.approx(math.sqrt(ratios[0] * ratios[1]))
            assert per_codec.loc[(layer, scheme), "fitted_over_real_evicted_mass"] is None   # no evicting codec here
        structure = store.table("predictivity_structure")
        at = structure[structure["layer"] == layer]
        assert set(at["statistic"]) == set(STATISTICS)
        np.testing.assert_allclose(at["fitted_over_real"], at["fitted"] / at["real"])
    pooled = taus[taus["layer"].isna() & (taus["codecs"] == "all") & (taus["candidate"] == "fitted")].iloc[0]
    assert pooled["tau"] == pytest.approx((c_all - d_all) / (c_all + d_all))
    for f in store.table("predictivity_flips").itertuples():   # real and fitted orders differ, as the rows say
        layer_means = {kind: means[name].xs(int(f.level) - 1) for kind, name in
                       (("real", f"replay:{study['cap']}:layer={f.layer}"), ("fitted", f"fitted:{study['spec']}:layer={f.layer}"))}
        assert (f.real_a, f.real_b) == (pytest.approx(layer_means["real"][f.a]), pytest.approx(layer_means["real"][f.b]))
        assert np.sign(f.real_a - f.real_b) == -np.sign(f.fitted_a - f.fitted_b)
        assert f.quantisers == 1
    con = sqlite3.connect(store.path)   # declared types: the layer an INTEGER, NULL for the pooled rows
    assert dict(con.execute("SELECT name, type FROM pragma_table_info('predictivity')").fetchall())["layer"] == "INTEGER"
    con.close()


def test_report_carries_and_shows_the_predictivity_tables(study, capsys):
    import importlib.resources

    import jsonschema
    capsys.readouterr()
    assert main(["report", str(study["out"]), "--json", "--permutations", "20"]) == 0
    found = json.loads(capsys.readouterr().out)
    schema = json.loads(importlib.resources.files("reports").joinpath("report.schema.json").read_text())
    jsonschema.validate(found, schema)
    assert found["schema_version"] == "1.1"
    taus = RunStore(study["out"]).table("predictivity")
    assert len(found["predictivity"]) == len(taus)
    pooled = [r for r in found["predictivity"] if r["layer"] is None]
    assert {(r["codecs"], r["candidate"]) for r in pooled} == {(c, k) for c in ("all", "quantisers")
                                                               for k in ("fitted", "closest_family", "best_generic")}
    assert [r["layer"] for r in found["fit_layers"]] == [0, 1] and "recommendation" not in found
    broken = json.loads(json.dumps(found))
    broken["predictivity"][0]["tau"] = 1.5
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)

    from harness.commands.report import write_report
    html_path, _ = write_report(study["out"], n_permutations=20)
    html = html_path.read_text()
    assert 'id="fit-layers-table"' in html
    fitted0 = taus[(taus["layer"] == 0) & (taus["codecs"] == "all") & (taus["candidate"] == "fitted")].iloc[0]
    assert f"{fitted0['tau']:.2f} [{fitted0['ci_low']:.2f}, {fitted0['ci_high']:.2f}]" in html
    assert "<td>pooled</td>" in html


def test_recommendation_tables_hold_the_per_layer_gains(tmp_path, capsys):
    gen = np.random.default_rng(6)
    n, d = 1600, 32
    k = gen.standard_normal((2, 1, n, d)) * np.array([1.0, 3.0])[:, None, None, None] ** np.linspace(0, 1, d)
    v = gen.standard_normal((2, 1, n, d))
    cap = write_capture(tmp_path / "cap.npz", k, v, gen.standard_normal((2, 1, n, d)))
    out = tmp_path / "rec"
    assert main(["recommend", str(cap), "--bits", "3.6", "--scheme", "tq-kv,svd", "--budget", "2,3,4", "--trials", "4",
                 "--seq-len", "32", "--queries", "8", "--calib-tokens", "64", "--out", str(out)]) == 0
    capsys.readouterr()
    store = RunStore(out)
    result = json.loads((out / "recommendation.json").read_text())
    rec = store.table("recommendation")
    judge = store.trials()
    judge = judge[judge["scenario"].str.endswith("part=second")]
    level = np.mean([r["storage"] for r in result["layers"]])
    for row in rec.itertuples():   # per layer, by hand: its cell against the uniform codec at the average storage
        rows = judge[judge["scenario"] == f"replay:{cap}:layer={row.layer}:part=second"]
        mine = rows[(rows["scheme"] == row.scheme) & (rows["budget"] == row.budget)]["d2_t"].mean()
        cells = {b: g.sort_values("trial") for b, g in rows[rows["scheme"] == row.uniform].groupby("budget")}
        storage = {b: g["storage_bits_per_element"].mean() for b, g in cells.items()}
        near = [b for b in cells if abs(storage[b] - level) / level <= 0.025]
        if near:
            base = cells[min(near, key=lambda b: abs(storage[b] - level))]["d2_t"].mean()
        else:
            lo = max((b for b in cells if storage[b] < level), key=lambda b: storage[b])
            hi = min((b for b in cells if storage[b] > level), key=lambda b: storage[b])
            w = (level - storage[lo]) / (storage[hi] - storage[lo])
            base = np.mean(np.exp((1 - w) * np.log(cells[lo]["d2_t"].to_numpy()) + w * np.log(cells[hi]["d2_t"].to_numpy())))
        assert row.error_recommended == pytest.approx(mine, rel=1e-9) and row.error_uniform == pytest.approx(base, rel=1e-9)
        assert row.gain == pytest.approx(1 - mine / base, rel=1e-9) and row.gain_ci_low <= row.gain <= row.gain_ci_high
        assert row.uniform == result["uniform"] and row.n_trials == 4
    judged = store.table("recommendation_judged").set_index("baseline")
    assert judged.loc["equal_storage", "gain"] == pytest.approx(result["judged"]["gain"])
    assert judged.loc["equal_storage", "error_baseline"] == pytest.approx(rec["error_uniform"].sum())
    assert judged.loc["best_cell", "scheme"] == result["uniform_cell"][0]
    assert judged.loc["best_cell", "budget"] == result["uniform_cell"][1]
    assert main(["report", str(out), "--json", "--permutations", "20"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert [r["layer"] for r in found["recommendation"]] == rec["layer"].tolist()
    assert {r["baseline"] for r in found["recommendation_judged"]} == {"equal_storage", "best_cell"}
    from reports.fitted import recommendation_rows
    from stats.findings import Findings
    import pandas as pd
    from harness.fit_tables import read
    rows = recommendation_rows(Findings(*(pd.DataFrame(),) * 6, tables=read(store)))
    first = rec.iloc[0]
    assert rows[0][1] == f"{first['scheme']} b={first['budget']}"
    assert rows[0][-1].startswith(f"{100 * first['gain']:+.1f} %") and len(rows) == len(rec) + 2


@pytest.mark.skipif(__import__("importlib").util.find_spec("transformers") is None, reason="transformers not installed")
def test_decoder_path_capture_fit_predictivity_recommend(tmp_path, capsys):
    """The decoder path end to end on a random-weight Llama (RoPE, 4 query heads over 2 key/value
    heads): capture -> fit -> predictivity -> recommend, their tables and report --json. The fitted
    spec carries the model's own rotary frequencies, the fitted scenario draws (and replay replays)
    post-RoPE keys, and τ is Kendall's τ of the stored rows."""
    from scipy.stats import kendalltau

    model, cap = llama_capture(tmp_path / "llama.npz", 400)
    spec = tmp_path / "llama.json"
    assert main(["fit", str(cap), "--out", str(spec)]) == 0
    fitted_spec = json.loads(spec.read_text())
    assert fitted_spec["heads"] == 4 and fitted_spec["kv_heads"] == 2
    np.testing.assert_allclose(fitted_spec["rope"]["inv_freq"], model.model.rotary_emb.inv_freq.double().numpy(),
                               rtol=1e-4, atol=1e-6)
    common = ["--scheme", "plain-kv,tq-kv", "--budget", "2,3", "--trials", "3", "--seq-len", "32", "--queries", "8",
              "--calib-tokens", "64"]
    out = tmp_path / "study"
    assert main(["predictivity", str(cap), "--spec", str(spec), *common, "--levels", "4,5", "--out", str(out)]) == 0
    store = RunStore(out)
    taus, trials = store.table("predictivity"), store.trials()
    assert store.table("fit_layers")["layer"].tolist() == [0, 1]
    assert set(trials["storage_bits_per_element"].round(6)) == {4.0, 5.0}   # d = 16: b + 2 (a norm per token)
    means = trials.groupby(["scenario", "budget", "scheme"])["d2_t"].mean()
    for layer in (0, 1):
        c = dd = 0
        for budget in (2, 3):
            real = means[f"replay:{cap}:layer={layer}", budget][["plain-kv", "tq-kv"]].to_numpy()
            fitted = means[f"fitted:{spec}:layer={layer}", budget][["plain-kv", "tq-kv"]].to_numpy()
            t = kendalltau(real, fitted).statistic
            c, dd = c + (t > 0), dd + (t < 0)
        row = taus[(taus["layer"] == layer) & (taus["codecs"] == "all") & (taus["candidate"] == "fitted")].iloc[0]
        assert row["n_pairs"] == c + dd == 2 and row["tau"] == pytest.approx((c - dd) / (c + dd))
    rec_out = tmp_path / "rec"
    assert main(["recommend", str(cap), "--bits", "4.5", *common, "--out", str(rec_out)]) == 0
    rec = RunStore(rec_out).table("recommendation")
    assert rec["layer"].tolist() == [0, 1] and rec["storage"].mean() <= 4.5 + 1e-9
    assert np.isfinite(rec["gain"]).all() and (rec["gain_ci_low"] <= rec["gain"]).all()
    capsys.readouterr()
    assert main(["report", str(rec_out), "--json", "--permutations", "20"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert [r["scheme"] for r in found["recommendation"]] == rec["scheme"].tolist()


def test_pdf_and_html_show_every_fit_table_without_cutting_a_cell(monkeypatch):
    """Made-up rows of all six tables, long codec names included: the PDF draws each as a table
    whose cells hold their text (the report's own check), and the HTML has each section."""
    import dataclasses

    import matplotlib.pyplot as plt

    import reports.pdf
    from harness.fit_tables import frame
    from reports.html import render_html
    from test_report_text import _CheckedPages, synthetic_findings

    long = "kvpress:ObservedAttentionPress"
    tables = {
        "fit_layers": frame("fit_layers", [{"layer": n, "closest_family": "lowrank_misaligned", "distance": 0.12,
                                            "next_family": "outlier_channels", "next_distance": 0.2,
                                            **{f"fitted_over_real_{m}": 1.5 for m in ("rel_mse_k", "rel_mse_v",
                                                                                     "kl_attn", "d2_t")}}
                                           for n in range(3)]),
        "predictivity": frame("predictivity", [{"layer": n, "codecs": c, "candidate": k, "family": "spectral_decay",
                                                "tau": 0.5, "ci_low": 0.25, "ci_high": 0.75, "n_pairs": 72}
                                               for n in (0, 1, 2, None) for c in ("all", "quantisers")
                                               for k in ("fitted", "closest_family", "best_generic")]),
        "predictivity_flips": frame("predictivity_flips", [{"layer": 0, "level": 3.5, "a": long, "b": "tq-kv",
                                                            "real_a": 0.1, "real_b": 0.2, "fitted_a": 0.3,
                                                            "fitted_b": 0.2, "quantisers": 0}]),
        "recommendation": frame("recommendation", [{"layer": n, "scheme": long, "budget": 3, "storage": 3.25,
                                                    "error_choose": 0.1, "error_recommended": 0.11, "uniform": "tq-kv",
                                                    "error_uniform": 0.12, "gain": 0.08, "gain_ci_low": -0.01,
                                                    "gain_ci_high": 0.17, "n_trials": 20} for n in range(3)]),
        "recommendation_judged": frame("recommendation_judged", [
            {"baseline": "equal_storage", "bits": 3.5, "scheme": "tq-kv", "storage_recommended": 3.25,
             "storage_baseline": 3.25, "error_recommended": 0.33, "error_baseline": 0.36, "gain": 0.08,
             "gain_ci_low": -0.01, "gain_ci_high": 0.17, "paired_difference": -0.01, "paired_difference_se": 0.01,
             "n_trials": 20},
            {"baseline": "best_cell", "bits": 3.5, "scheme": long, "budget": 3, "storage_recommended": 3.25,
             "storage_baseline": 3.1, "error_recommended": 0.33, "error_baseline": 0.5, "gain": 0.34,
             "gain_ci_low": 0.2, "gain_ci_high": 0.4, "paired_difference": -0.1, "paired_difference_se": 0.01,
             "n_trials": 20}]),
        "recommendation_effect": frame("recommendation_effect", [
            {"setting": "recommended", "schemes": ", ".join([f"{long} b=3"] * 6), "bits_per_element": 3.5,
             "emb_cos_mean": 0.95, "emb_cos_min": 0.9, "n_passages": 16},
            {"setting": "best cell: tq-kv b=3", "schemes": "tq-kv b=3", "bits_per_element": 4.0, "emb_cos_mean": 0.98,
             "emb_cos_min": 0.97, "difference": -0.03, "difference_ci_low": -0.04, "difference_ci_high": -0.02,
             "n_passages": 16}]),
    }
    findings = dataclasses.replace(synthetic_findings(names=("tq-kv", "sq-kv"), scenarios=("gaussian",)),
                                   tables=tables)
    pages = []
    monkeypatch.setattr(reports.pdf, "PdfPages", lambda path: pages.append(_CheckedPages(path)) or pages[-1])
    reports.pdf.write_pdf("unused.pdf", "t", findings, [], [("item", "value")])
    plain = dataclasses.replace(findings, tables={})
    reports.pdf.write_pdf("unused.pdf", "t", plain, [], [("item", "value")])
    assert pages[0].overflow == [] and pages[0].tables == pages[1].tables + 4
    html = render_html("t", findings, [], None, "1 s")
    for anchor in ("fit-layers", "predictivity-flips", "recommendation", "recommendation-effect"):
        assert f'id="{anchor}-table"' in html
    assert "+8.0 % [-1.0, +17.0]" in html and "−0.03000 [" not in html and "-0.03000 [-0.04000, -0.02000]" in html
    assert 'id="fit-layers-table"' not in render_html("t", plain, [], None, "1 s")
    plt.close("all")
