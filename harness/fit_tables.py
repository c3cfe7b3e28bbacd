"""The results of harness predictivity and harness recommend as tables of their run's
results.sqlite (beside `trials` and `cells`, whose columns they leave alone), and their readers.

Written by the command that ran the sweep into --out, all in one transaction
(RunStore.write_tables), after its sweep and before its JSON file; read back by `report`
(HTML, PDF, --json). One row per:

- fit_layers (predictivity): layer of the fitted spec — its nearest scenario family and the
  distance to it (the RMS difference of the 7 family features, 0 = the same statistics), the
  runner-up family, the statistics the families are made of, and, for the layers studied, the
  fitted/real ratio of each error component at equal storage (1 = the fit reproduces it).
- predictivity: (layer, codecs, candidate, family) — Kendall's τ of the codec order at equal
  measured storage on the candidate scenario against the replayed real windows, with its
  bootstrap 95 % interval and the number of (level, pair) comparisons; layer NULL: pooled over
  the layers. codecs: all, or the quantisers alone; candidate: fitted, closest_family (chosen a
  priori), best_generic (chosen afterwards), generic (each family).
- predictivity_flips: codec pair whose order the fitted scenario flips at a storage level
  (real and fitted mean d2_t of both); quantisers = 1 where both codecs are quantisers.
- predictivity_codecs: (layer, codec) — the fitted/real ratio at equal storage of its d2_t, logit
  error and (evicting codecs) evicted attention mass.
- predictivity_structure: (layer, statistic) — the sequence structure of the real and the fitted
  windows (harness/structure.py: sink share, recency ratio, heavy-hitter share, lag-1 correlation
  of K and V, logit sd) and their ratio.
- recommendation (recommend): layer — the codec and width chosen on the first half of the
  capture's windows, its mean storage and d2_t there, and on the held-out half its d2_t beside
  the uniform codec's at the recommendation's average storage, with the per-layer gain and CI;
  uniform_halving_bits: the bits per element that halve the uniform codec's d2_t in that layer.
- recommendation_judged: baseline — the whole recommendation against it on the held-out half:
  equal_storage (the best single codec at the same measured storage) and best_cell (the best
  single measured cell within the budget), gain 1 − Σ e_rec / Σ e_base with its CI, the paired
  difference per window with its standard error; conclusion: the one-line verdict (per-layer
  choice, or uniform as good and why).
- recommendation_effect (harness effect --recommendation DIR): setting — the sentence-embedding
  cosine to the uncompressed model of the per-layer recommendation and of the uniform settings
  beside it, with the paired difference per passage.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from stats.predictivity import CODEC_METRICS, DIAGNOSTIC_METRICS

# name -> ((column, type), ...): the column order and sqlite type of each table
TABLES = {
    "fit_layers": (("layer", "INTEGER"), ("closest_family", "TEXT"), ("distance", "REAL"), ("next_family", "TEXT"),
                   ("next_distance", "REAL"), ("k_participation_ratio", "REAL"), ("v_participation_ratio", "REAL"),
                   ("k_decay_alpha", "REAL"), ("dof_median", "REAL"), ("token_norm_overdispersion", "REAL"),
                   ("kv_alignment", "REAL"), ("k_mean_share", "REAL"), ("k_outlier_channels", "REAL"))
    + tuple((f"fitted_over_real_{m}", "REAL") for m in DIAGNOSTIC_METRICS),
    "predictivity": (("layer", "INTEGER"), ("codecs", "TEXT"), ("candidate", "TEXT"), ("family", "TEXT"),
                     ("tau", "REAL"), ("ci_low", "REAL"), ("ci_high", "REAL"), ("n_pairs", "INTEGER")),
    "predictivity_flips": (("layer", "INTEGER"), ("level", "REAL"), ("a", "TEXT"), ("b", "TEXT"),
                           ("real_a", "REAL"), ("real_b", "REAL"), ("fitted_a", "REAL"), ("fitted_b", "REAL"),
                           ("quantisers", "INTEGER")),
    "predictivity_codecs": (("layer", "INTEGER"), ("scheme", "TEXT"))
    + tuple((f"fitted_over_real_{m}", "REAL") for m in CODEC_METRICS),
    "predictivity_structure": (("layer", "INTEGER"), ("statistic", "TEXT"), ("real", "REAL"), ("fitted", "REAL"),
                               ("fitted_over_real", "REAL")),
    "recommendation": (("layer", "INTEGER"), ("scheme", "TEXT"), ("budget", "INTEGER"), ("storage", "REAL"),
                       ("error_choose", "REAL"), ("error_recommended", "REAL"), ("uniform", "TEXT"),
                       ("error_uniform", "REAL"), ("gain", "REAL"), ("gain_ci_low", "REAL"),
                       ("gain_ci_high", "REAL"), ("n_trials", "INTEGER"), ("uniform_halving_bits", "REAL")),
    "recommendation_judged": (("baseline", "TEXT"), ("bits", "REAL"), ("scheme", "TEXT"), ("budget", "INTEGER"),
                              ("storage_recommended", "REAL"), ("storage_baseline", "REAL"),
                              ("error_recommended", "REAL"), ("error_baseline", "REAL"), ("gain", "REAL"),
                              ("gain_ci_low", "REAL"), ("gain_ci_high", "REAL"), ("paired_difference", "REAL"),
                              ("paired_difference_se", "REAL"), ("n_trials", "INTEGER"), ("conclusion", "TEXT")),
    "recommendation_effect": (("setting", "TEXT"), ("schemes", "TEXT"), ("bits_per_element", "REAL"),
                              ("emb_cos_mean", "REAL"), ("emb_cos_min", "REAL"), ("difference", "REAL"),
                              ("difference_ci_low", "REAL"), ("difference_ci_high", "REAL"),
                              ("n_passages", "INTEGER")),
}
PREDICTIVITY_TABLES = ("fit_layers", "predictivity", "predictivity_flips")
RECOMMEND_TABLES = ("recommendation", "recommendation_judged")
EFFECT_TABLE = "recommendation_effect"


def frame(name: str, rows: list[dict]) -> pd.DataFrame:
    """Rows (dicts, missing keys NULL) as table `name`'s frame: its columns in order, INTEGER
    columns as nullable integers, REAL as float, non-finite numbers as missing."""
    columns = TABLES[name]
    data = {}
    for column, kind in columns:
        values = [row.get(column) for row in rows]
        if kind == "TEXT":
            data[column] = pd.Series(values, dtype=object)
        elif kind == "INTEGER":
            data[column] = pd.array([None if v is None else int(v) for v in values], dtype="Int64")
        else:
            data[column] = pd.Series([math.nan if v is None else float(v) for v in values], dtype=float)
    return pd.DataFrame(data, columns=[c for c, _ in columns])


def _median_dof(dofs) -> float | None:
    """The median Student-t dof over the heads; None (Gaussian) when that median is a Gaussian head."""
    values = sorted(math.inf if x is None else float(x) for x in dofs)
    mid = values[len(values) // 2] if values else math.inf
    return None if math.isinf(mid) else mid


def predictivity_frames(result: dict, spec_data: dict) -> dict[str, pd.DataFrame]:
    """fit_layers, predictivity and predictivity_flips of a predictivity result
    (harness.commands.predictivity.study) and the fitted spec it used (its JSON dict)."""
    ratios = {entry["layer"]: entry.get("fitted_over_real", {}) for entry in result["layers"]}
    fit_rows = []
    for layer in spec_data["layers"]:
        ranked = sorted(layer["family"]["distances"].items(), key=lambda kv: kv[1])
        st = layer["statistics"]
        row = {"layer": layer["layer"], "closest_family": layer["family"]["closest"],
               "distance": layer["family"]["distance"], "next_family": ranked[1][0] if len(ranked) > 1 else None,
               "next_distance": ranked[1][1] if len(ranked) > 1 else None,
               "dof_median": _median_dof(st.get("dof_per_head", []))}
        row.update({k: st.get(k) for k in ("k_participation_ratio", "v_participation_ratio", "k_decay_alpha",
                                           "token_norm_overdispersion", "kv_alignment", "k_mean_share",
                                           "k_outlier_channels")})
        row.update({f"fitted_over_real_{m}": r for m, r in ratios.get(layer["layer"], {}).items()})
        fit_rows.append(row)

    def tau_row(layer, codecs, candidate, family, r):
        return {"layer": layer, "codecs": codecs, "candidate": candidate, "family": family, "tau": r["tau"],
                "ci_low": r["ci"][0], "ci_high": r["ci"][1], "n_pairs": r.get("n_pairs")}

    tau_rows, flip_rows = [], []
    quantisers = set(result["quantisers"])
    for entry in result["layers"]:
        n = entry["layer"]
        for codecs in ("all", "quantisers"):
            g = entry[codecs]
            tau_rows += [tau_row(n, codecs, "fitted", None, g["fitted"]),
                         tau_row(n, codecs, "closest_family", entry["closest_family"], g["closest_family"]),
                         tau_row(n, codecs, "best_generic", g["best_generic"]["family"], g["best_generic"])]
            tau_rows += [tau_row(n, codecs, "generic", f, r) for f, r in g["generic"].items()]
        flip_rows += [{"layer": n, "level": f["level"], "a": f["a"], "b": f["b"], "real_a": f["real"][0],
                       "real_b": f["real"][1], "fitted_a": f["synthetic"][0], "fitted_b": f["synthetic"][1],
                       "quantisers": int(f["a"] in quantisers and f["b"] in quantisers)}
                      for f in entry["all"]["fitted"]["flipped"]]
    for codecs in ("all", "quantisers"):
        tau_rows += [tau_row(None, codecs, candidate, None, r) for candidate, r in result["pooled"][codecs].items()]
    codec_rows = [{"layer": entry["layer"], "scheme": scheme,
                   **{f"fitted_over_real_{m}": ratios.get(m) for m in CODEC_METRICS}}
                  for entry in result["layers"] for scheme, ratios in entry.get("fitted_over_real_by_codec", {}).items()]
    structure_rows = [{"layer": entry["layer"], "statistic": name, "real": value,
                       "fitted": entry["structure"]["fitted"][name],
                       "fitted_over_real": entry["structure"]["fitted_over_real"][name]}
                      for entry in result["layers"] if "structure" in entry
                      for name, value in entry["structure"]["real"].items()]
    return {"fit_layers": frame("fit_layers", fit_rows), "predictivity": frame("predictivity", tau_rows),
            "predictivity_flips": frame("predictivity_flips", flip_rows),
            "predictivity_codecs": frame("predictivity_codecs", codec_rows),
            "predictivity_structure": frame("predictivity_structure", structure_rows)}


def recommendation_frames(result: dict) -> dict[str, pd.DataFrame]:
    """recommendation and recommendation_judged of a recommend result (harness.commands.recommend)."""
    j = result["judged"]
    per_layer = {p["layer"]: p for p in j.get("per_layer", [])}
    rows = []
    for row in result["layers"]:
        p = per_layer.get(row["layer"], {})
        rows.append({**row, "error_recommended": p.get("error_recommended"), "uniform": result["uniform"],
                     "error_uniform": p.get("error_uniform"), "gain": p.get("gain"),
                     "gain_ci_low": p.get("gain_ci", [None, None])[0], "gain_ci_high": p.get("gain_ci", [None, None])[1],
                     "n_trials": p.get("n_trials"),
                     "uniform_halving_bits": result.get("conclusion", {}).get("halving_bits", {}).get(str(row["layer"]))})

    def judged(baseline, j, scheme, budget, storage_rec, storage_base):
        return {"baseline": baseline, "bits": result["bits"], "scheme": scheme, "budget": budget,
                "storage_recommended": storage_rec, "storage_baseline": storage_base,
                "error_recommended": j["error_recommended"], "error_baseline": j["error_uniform"], "gain": j["gain"],
                "gain_ci_low": j["gain_ci"][0], "gain_ci_high": j["gain_ci"][1],
                "paired_difference": j["paired_difference"], "paired_difference_se": j["paired_difference_se"],
                "n_trials": j["n_trials"], "conclusion": result.get("conclusion", {}).get("line")}

    judged_rows = [judged("equal_storage", j, result["uniform"], None, j["storage"], j["storage"])]
    if "judged_cell" in result:
        c = result["judged_cell"]
        judged_rows.append(judged("best_cell", c, result["uniform_cell"][0], result["uniform_cell"][1],
                                  c["storage_recommended"], c["storage_uniform"]))
    return {"recommendation": frame("recommendation", rows),
            "recommendation_judged": frame("recommendation_judged", judged_rows)}


def read(store) -> dict[str, pd.DataFrame]:
    """The tables of TABLES a run's store holds (RunStore), typed as written: INTEGER columns as
    nullable integers. Empty where the run has none."""
    out = {}
    for name, columns in TABLES.items():
        found = store.table(name)
        if found is None:
            continue
        for column, kind in columns:
            if column in found.columns and kind == "INTEGER":
                found[column] = pd.array([None if pd.isna(v) else int(v) for v in found[column]], dtype="Int64")
        out[name] = found
    return out


def records(tables: dict[str, pd.DataFrame]) -> dict[str, list[dict]]:
    """The tables as report --json carries them: one key per table, its rows as objects, NULL and
    non-finite numbers as null, integers as integers."""
    out = {}
    for name, table in tables.items():
        rows = []
        for row in table.to_dict(orient="records"):
            clean = {}
            for k, v in row.items():
                if v is None or v is pd.NA or (isinstance(v, float) and not math.isfinite(v)):
                    v = None
                elif isinstance(v, np.generic):
                    v = v.item()
                clean[k] = v
            rows.append(clean)
        out[name] = rows
    return out
