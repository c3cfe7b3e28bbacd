"""The report's tables of a predictivity or recommend run (Findings.tables, read from the run's
fit_layers, predictivity, predictivity_flips, predictivity_codecs, predictivity_structure,
recommendation, recommendation_judged and
recommendation_effect tables: harness/fit_tables.py): plain strings, shared by html.py and pdf.py.
Each function returns (title, header, rows, note) sections, none where the run lacks the table."""
from __future__ import annotations

import pandas as pd

from stats.findings import Findings

from .narrative import num


def _missing(x) -> bool:
    return x is None or x is pd.NA or (isinstance(x, float) and x != x)


def _tau(row) -> str:
    if row is None or _missing(row["tau"]):
        return "n/a"
    return f"{row['tau']:.2f} [{row['ci_low']:.2f}, {row['ci_high']:.2f}]"


def _percent(gain, low, high) -> str:
    if _missing(gain):
        return "n/a"
    return f"{100 * gain:+.1f} % [{100 * low:+.1f}, {100 * high:+.1f}]"


def _pick(taus: pd.DataFrame, layer, codecs: str, candidate: str):
    """The predictivity row of (layer or None for pooled, codecs, candidate), or None."""
    at = taus[(taus["layer"].isna() if layer is None else taus["layer"] == layer) & (taus["codecs"] == codecs)
              & (taus["candidate"] == candidate)]
    return None if at.empty else at.iloc[0]


FIT_HEADER = ("layer", "nearest family (distance)", "next (distance)", "τ fitted, all codecs",
              "τ fitted, quantisers", "τ nearest family (a priori)", "τ best generic (post hoc)", "flipped pairs",
              "fitted / real: K, V, KL(attn), d₂(T)")
FLIP_HEADER = ("layer", "bits/el", "codec pair", "real d₂(T) a / b", "fitted d₂(T) a / b", "both quantisers")
RECOMMENDATION_HEADER = ("layer", "recommended", "bits/el", "d₂(T), choosing half", "d₂(T), held-out half",
                         "uniform codec, held-out", "gain [95% CI]")
EFFECT_HEADER = ("setting", "codec per layer", "bits/el", "embedding cosine, mean", "minimum",
                 "recommendation − this setting [95% CI]")


def fit_rows(findings: Findings) -> list[tuple[str, ...]]:
    """Per layer of the fitted spec: its family and closeness, τ of the fitted scenario (all codecs
    and quantisers) beside the nearest and the best generic family, its flips and error ratios;
    then the pooled τ."""
    layers, taus = findings.tables.get("fit_layers"), findings.tables.get("predictivity")
    if layers is None or taus is None:
        return []
    flips = findings.tables.get("predictivity_flips")
    rows = []
    for lay in layers.itertuples(index=False):
        fitted, quant = _pick(taus, lay.layer, "all", "fitted"), _pick(taus, lay.layer, "quantisers", "fitted")
        nearest, best = _pick(taus, lay.layer, "all", "closest_family"), _pick(taus, lay.layer, "all", "best_generic")
        n_flips = 0 if flips is None else int((flips["layer"] == lay.layer).sum())
        ratios = ", ".join(num(getattr(lay, f"fitted_over_real_{m}")) for m in ("rel_mse_k", "rel_mse_v", "kl_attn",
                                                                                 "d2_t"))
        rows.append((str(lay.layer), f"{lay.closest_family} ({lay.distance:.3f})",
                     f"{lay.next_family} ({lay.next_distance:.3f})" if not _missing(lay.next_family) else "—",
                     _tau(fitted), _tau(quant), _tau(nearest),
                     f"{best['family']} {_tau(best)}" if best is not None else "n/a",
                     f"{n_flips} of {fitted['n_pairs']}" if fitted is not None else "not studied",
                     ratios if fitted is not None else "—"))
    pooled = [_pick(taus, None, codecs, c) for codecs, c in (("all", "fitted"), ("quantisers", "fitted"),
                                                             ("all", "closest_family"), ("all", "best_generic"))]
    rows.append(("pooled", "", "", *(_tau(p) for p in pooled), "", ""))
    return rows


CODEC_HEADER = ("layer", "codec", "fitted / real d₂(T)", "logit error", "evicted mass")
STRUCTURE_HEADER = ("layer", "statistic", "real windows", "fitted", "fitted / real")


def codec_rows(findings: Findings) -> list[tuple[str, ...]]:
    codecs = findings.tables.get("predictivity_codecs")
    if codecs is None:
        return []
    return [(str(c.layer), c.scheme, num(c.fitted_over_real_d2_t), num(c.fitted_over_real_logit_rel_mse),
             "—" if _missing(c.fitted_over_real_evicted_mass) else num(c.fitted_over_real_evicted_mass))
            for c in codecs.itertuples(index=False)]


def structure_rows(findings: Findings) -> list[tuple[str, ...]]:
    structure = findings.tables.get("predictivity_structure")
    if structure is None:
        return []
    return [(str(r.layer), r.statistic, num(r.real), num(r.fitted), num(r.fitted_over_real))
            for r in structure.itertuples(index=False)]


def flip_rows(findings: Findings) -> list[tuple[str, ...]]:
    flips = findings.tables.get("predictivity_flips")
    if flips is None:
        return []
    return [(str(f.layer), num(f.level), f"{f.a} vs {f.b}", f"{num(f.real_a)} / {num(f.real_b)}",
             f"{num(f.fitted_a)} / {num(f.fitted_b)}", "yes" if f.quantisers else "no")
            for f in flips.itertuples(index=False)]


def recommendation_rows(findings: Findings) -> list[tuple[str, ...]]:
    """Per layer the recommended codec and width with its held-out gain against the uniform codec at
    the same average storage; then the whole recommendation against each baseline."""
    rec, judged = findings.tables.get("recommendation"), findings.tables.get("recommendation_judged")
    if rec is None:
        return []
    rows = [(str(r.layer), f"{r.scheme} b={r.budget}", f"{r.storage:.3f}", num(r.error_choose),
             num(r.error_recommended), f"{r.uniform}: {num(r.error_uniform)}",
             _percent(r.gain, r.gain_ci_low, r.gain_ci_high)) for r in rec.itertuples(index=False)]
    for j in ([] if judged is None else judged.itertuples(index=False)):
        base = (f"{j.scheme} at {j.storage_baseline:.3f} (equal storage)" if j.baseline == "equal_storage"
                else f"{j.scheme} b={j.budget} at {j.storage_baseline:.3f} (best single cell)")
        rows.append((f"all, ≤ {j.bits:g}", "", f"{j.storage_recommended:.3f}", "", num(j.error_recommended),
                     f"{base}: {num(j.error_baseline)}", _percent(j.gain, j.gain_ci_low, j.gain_ci_high)))
    return rows


def _conclusion(findings: Findings) -> str:
    """The recommendation's one-line verdict (recommendation_judged.conclusion) and a space, or ''."""
    judged = findings.tables.get("recommendation_judged")
    if judged is None or "conclusion" not in judged.columns or judged.empty or _missing(judged["conclusion"].iloc[0]):
        return ""
    return f"{judged['conclusion'].iloc[0]}. "


def effect_rows(findings: Findings) -> list[tuple[str, ...]]:
    effect = findings.tables.get("recommendation_effect")
    if effect is None:
        return []
    return [(e.setting, e.schemes, num(e.bits_per_element), f"{e.emb_cos_mean:.5f}", f"{e.emb_cos_min:.5f}",
             "—" if _missing(e.difference) else
             f"{e.difference:+.5f} [{e.difference_ci_low:+.5f}, {e.difference_ci_high:+.5f}]")
            for e in effect.itertuples(index=False)]


FIT_NOTE = ("τ: Kendall's τ of the codecs' order at equal measured storage (d₂(T)) on the scenario against the "
            "replayed real windows, 95 % bootstrap interval over trials; the fitted scenario and the nearest family "
            "are chosen before any ranking is seen, the best generic family afterwards (an optimistic baseline). "
            "fitted / real: the fitted scenario's mean error over the real one at equal storage (1: reproduced; "
            "the component far from 1 is the statistic the fit misses). Distance: RMS difference of 7 features "
            "in [0, 1] to the family's default draw.")
RECOMMENDATION_NOTE = ("Chosen on the first half of the capture's windows, judged on the held-out second half, "
                       "paired over windows; gain = 1 − recommended / uniform summed d₂(T) (positive: the per-layer "
                       "choice has less error), 95 % bootstrap interval. Per layer the uniform codec is set to the "
                       "recommendation's average storage, so a layer's gain also reflects its own storage.")
EFFECT_NOTE = ("The cosine of the compressed model's sentence embedding to the uncompressed one over held-out "
               "passages (harness effect --recommendation); difference paired per passage, 95 % bootstrap interval.")


def sections(findings: Findings) -> list[tuple[str, str, tuple, list, str]]:
    """(anchor, title, header, rows, note) of each table the run has."""
    out = []
    for anchor, title, header, rows, note in (
            ("fit-layers", "Fitted scenarios: family, and how well they predict the real codec ranking", FIT_HEADER,
             fit_rows(findings), FIT_NOTE),
            ("predictivity-flips", "Codec pairs the fitted scenario orders differently from the real windows",
             FLIP_HEADER, flip_rows(findings), "Each at one storage level; mean d₂(T) of a and b."),
            ("predictivity-codecs", "Each codec's error on the fitted scenario over its error on the real windows",
             CODEC_HEADER, codec_rows(findings), "Geometric mean over the storage levels of the fitted scenario's mean "
             "over the real windows' at equal storage; 1: reproduced. Evicted mass: evicting codecs only."),
            ("predictivity-structure", "The sequence structure of the real and the fitted windows", STRUCTURE_HEADER,
             structure_rows(findings), "Means over windows and heads (harness/structure.py): sink share on the first "
             "4 keys, recency ratio (attention per key on the nearest 1/16 of keys over the mean), heavy-hitter share "
             "(the top 1 % of keys' share of the mass), lag-1 correlation of K and V, logit sd."),
            ("recommendation", "Recommended codec and width per layer", RECOMMENDATION_HEADER,
             recommendation_rows(findings), _conclusion(findings) + RECOMMENDATION_NOTE),
            ("recommendation-effect", "The recommendation inside the model", EFFECT_HEADER, effect_rows(findings),
             EFFECT_NOTE)):
        if rows:
            out.append((anchor, title, header, rows, note))
    return out
