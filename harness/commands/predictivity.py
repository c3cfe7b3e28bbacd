"""harness predictivity: do fitted (and generic) scenarios rank the codecs as the real windows do?

One sweep, stored in --out: replay:CAPTURE:layer=N and fitted:SPEC:layer=N for each layer, and
the six generic families plus rope_lowrank, all on the same codecs, d, S, Nq, budgets and
calibration size. Per layer the codecs' order at equal measured storage on each scenario is
compared with their order on the replayed windows (stats.predictivity: Kendall's τ over codec
pairs and storage levels, bootstrap 95 % interval, flipped pairs), over all codecs and within the
quantisers alone; then pooled over the layers. The fitted scenario and the nearest family (the
spec's `family.closest`) are chosen before any ranking is seen; "best generic" is the family
with the highest τ on that layer, chosen afterwards — an optimistic baseline. The result goes to
OUT/predictivity.json and to the run's tables fit_layers, predictivity and predictivity_flips
(harness/fit_tables.py).
"""
from __future__ import annotations

import json
import math
import os

import schemes

from ..errors import UsageError
from ..sweep import SweepConfig
from ._args import capture_file, comma_list, input_file, output_dir, sweep_into

NAME = "predictivity"
HELP = "rank codecs at equal storage on fitted/generic scenarios and on replayed real windows: Kendall's tau per layer"

DEFAULT_SCHEMES = ("plain-kv", "tq-kv", "tq-qkv", "tq-kqv", "sq-kv", "sq-qkv", "squ-kv", "svd", "h2o", "streaming")
# kvpress's attention-scored and window presses beside h2o and streaming, where kvpress is installed
KVPRESS_SCHEMES = ("kvpress:SnapKVPress", "kvpress:StreamingLLMPress")


def default_schemes() -> tuple[str, ...]:
    return DEFAULT_SCHEMES + tuple(name for name in KVPRESS_SCHEMES if schemes.is_registered(name))
QUANTISER_NAMES = ("plain-kv", "kivi", "int4", "int8")
QUANTISER_PREFIXES = ("tq-", "sq-", "squ-")
METRIC = "d2_t"
RESULT_FILE = "predictivity.json"


def is_quantiser(name: str) -> bool:
    """Codecs that keep every token and code each coordinate (not evicting, not low-rank)."""
    return name in QUANTISER_NAMES or name.startswith(QUANTISER_PREFIXES)


def add_arguments(p):
    p.add_argument("capture", type=capture_file, help="capture FILE.safetensors or .npz (harness capture)")
    p.add_argument("--spec", type=input_file("a fitted spec SPEC.json (harness fit --out) you may read",
                                             "fitted scenario spec"),
                   required=True, help="its fitted spec SPEC.json (harness fit --out)")
    p.add_argument("--layers", type=comma_list(int), default=None, help="layers (default: all of the spec)")
    p.add_argument("--scheme", type=comma_list(str, schemes.registry.all_schemes, known=schemes.is_registered),
                   default=None, help=f"codecs (default {','.join(DEFAULT_SCHEMES + KVPRESS_SCHEMES)}, "
                                      f"the kvpress presses where kvpress is installed)")
    p.add_argument("--budget", type=comma_list(int), default=(2, 3, 4, 5), help="nominal bits (default 2,3,4,5)")
    p.add_argument("--levels", default="3.5,4.5", help="storage levels, bits per element (default 3.5,4.5)")
    p.add_argument("--trials", type=int, default=20, help="trials per cell (default 20)")
    p.add_argument("--seq-len", type=int, default=128, help="cached tokens S (default 128)")
    p.add_argument("--queries", type=int, default=64, help="queries Nq (default 64)")
    p.add_argument("--calib-tokens", type=int, default=512, help="calibration tokens (default 512)")
    p.add_argument("--seed", type=int, default=0, help="root seed (default 0)")
    p.add_argument("--out", type=output_dir, required=True, help="run directory (reused when it holds this sweep)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def _config(args, spec) -> SweepConfig:
    from ..fit import FAMILIES
    layers = args.layers if args.layers is not None else tuple(range(spec.n_layers))
    bad = [n for n in layers if not 0 <= n < spec.n_layers]
    if bad:
        raise UsageError(f"harness predictivity: --layers {bad[0]} is not a layer of the spec (0..{spec.n_layers - 1})")
    names = tuple(f"replay:{args.capture}:layer={n}" for n in layers) + \
        tuple(f"fitted:{args.spec}:layer={n}" for n in layers) + FAMILIES
    return SweepConfig(scenarios=names, schemes=tuple(args.scheme or default_schemes()), budgets=tuple(args.budget), dims=(spec.dim,),
                       seq_lens=(args.seq_len,), queries=(args.queries,), trials=args.trials, seed=args.seed,
                       calib_tokens=(args.calib_tokens,))


def study(trials, layers, capture, spec_path, spec, levels, schemes_run, n_boot=None, structure=None) -> dict:
    """The per-layer and pooled agreements (module doc) as a JSON-ready dict; structure: per layer
    {"real": ..., "fitted": ...} statistics of the windows (harness/structure.py), where measured."""
    from stats import predictivity as pr

    from ..fit import FAMILIES
    boot = {} if n_boot is None else {"n_boot": n_boot}
    tables = pr.tables(trials, METRIC, levels)
    quantisers = tuple(s for s in schemes_run if is_quantiser(s))

    def row(ag):
        return {"tau": ag.tau, "ci": [ag.ci_low, ag.ci_high], "n_pairs": ag.n_pairs,
                "flipped": [{"level": lv, "a": a, "b": b, "real": [ra, rb], "synthetic": [ca, cb]}
                            for lv, a, b, ra, rb, ca, cb in ag.flipped]}

    out = {"metric": METRIC, "levels": list(levels), "schemes": list(schemes_run), "quantisers": list(quantisers),
           "layers": [], "pooled": {}}
    chosen = {group: {"fitted": [], "closest_family": [], "best_generic": []} for group in ("all", "quantisers")}
    for n in layers:
        real = tables[f"replay:{capture}:layer={n}"]
        fitted = tables[f"fitted:{spec_path}:layer={n}"]
        closest = spec.layer(n)["family"]["closest"]
        entry = {"layer": n, "closest_family": closest}
        entry["fitted_over_real"] = pr.error_ratios(trials, real.scenario, fitted.scenario, levels, quantisers)
        entry["fitted_over_real_by_codec"] = pr.codec_ratios(trials, real.scenario, fitted.scenario, levels,
                                                             schemes_run)
        if structure and n in structure:
            measured = structure[n]
            entry["structure"] = {**measured, "fitted_over_real": {
                name: (measured["fitted"][name] / value if value else float("nan"))
                for name, value in measured["real"].items()}}
        for group, names in (("all", None), ("quantisers", quantisers)):
            generic = {f: pr.agreement([(real, tables[f])], names, **boot) for f in FAMILIES}
            best = max(generic, key=lambda f: (generic[f].tau if not math.isnan(generic[f].tau) else -2))
            entry[group] = {"fitted": row(pr.agreement([(real, fitted)], names, **boot)),
                            "closest_family": row(generic[closest]),
                            "best_generic": {"family": best, **row(generic[best])},
                            "generic": {f: {"tau": g.tau, "ci": [g.ci_low, g.ci_high], "n_pairs": g.n_pairs}
                                        for f, g in generic.items()}}
            for key, candidate in (("fitted", fitted), ("closest_family", tables[closest]),
                                   ("best_generic", tables[best])):
                chosen[group][key].append((real, candidate))
        out["layers"].append(entry)
    for group, names in (("all", None), ("quantisers", quantisers)):
        out["pooled"][group] = {k: {key: v for key, v in row(pr.agreement(pairs, names, **boot)).items()
                                    if key != "flipped"} for k, pairs in chosen[group].items()}
    return out


def format_result(result: dict) -> str:
    def cell(r):
        return f"{r['tau']:5.2f} [{r['ci'][0]:5.2f}, {r['ci'][1]:5.2f}]"
    lines = [f"Kendall's tau of the codec order at equal measured storage ({result['metric']}, levels "
             f"{', '.join(map(str, result['levels']))} bits/element) vs the replayed real windows",
             f"{'layer':>6} {'codecs':<10} {'fitted':>21} {'nearest family (a priori)':>40} "
             f"{'best generic (post hoc)':>40}"]
    for entry in result["layers"]:
        for group in ("all", "quantisers"):
            g = entry[group]
            lines.append(f"{entry['layer']:>6} {group:<10} {cell(g['fitted']):>21} "
                         f"{entry['closest_family'] + ' ' + cell(g['closest_family']):>40} "
                         f"{g['best_generic']['family'] + ' ' + cell(g['best_generic']):>40}")
    for group in ("all", "quantisers"):
        p = result["pooled"][group]
        lines.append(f"{'pooled':>6} {group:<10} {cell(p['fitted']):>21} {cell(p['closest_family']):>40} "
                     f"{cell(p['best_generic']):>40}")
    lines.append("fitted / real mean error at equal storage (geometric mean over the quantisers and levels):")
    for entry in result["layers"]:
        lines.append(f"  layer {entry['layer']}: " + ", ".join(f"{m} {r:.2f}" for m, r in entry["fitted_over_real"].items()))
    lines.append("fitted / real per codec at equal storage (d2_t, logit_rel_mse; evicted_mass for evicting codecs):")
    for entry in result["layers"]:
        per_codec = entry.get("fitted_over_real_by_codec", {})
        lines.append(f"  layer {entry['layer']}: " + "; ".join(
            f"{codec} " + " ".join(f"{r:.2f}" for r in ratios.values()) for codec, ratios in per_codec.items()))
    if any("structure" in entry for entry in result["layers"]):
        lines.append("sequence structure of the windows, real -> fitted (sink share, recency ratio, heavy share, "
                     "lag-1 K, lag-1 V, logit sd):")
        for entry in result["layers"]:
            if "structure" in entry:
                real, fitted = entry["structure"]["real"], entry["structure"]["fitted"]
                lines.append(f"  layer {entry['layer']}: " + ", ".join(f"{real[k]:.3g} -> {fitted[k]:.3g}" for k in real))
    lines.append("flipped pairs, fitted vs real (level: a, b — real d2_t a/b; fitted a/b):")
    for entry in result["layers"]:
        flips = entry["all"]["fitted"]["flipped"]
        text = "; ".join(f"{f['level']}: {f['a']} vs {f['b']} real {f['real'][0]:.3g}/{f['real'][1]:.3g}, fitted "
                         f"{f['synthetic'][0]:.3g}/{f['synthetic'][1]:.3g}" for f in flips) or "none"
        lines.append(f"  layer {entry['layer']} ({len(flips)} of {entry['all']['fitted']['n_pairs']}): {text}")
    return "\n".join(lines)


def run(args) -> int:
    from scenarios.fitted import load_spec
    from scenarios.replay import load_capture
    from stats.equal_storage import parse_levels

    from ..structure import window_statistics

    from ..fit_tables import predictivity_frames

    try:
        spec = load_spec(args.spec)
        levels = parse_levels(args.levels)
    except ValueError as exc:
        raise UsageError(f"harness predictivity: {exc}") from None
    if args.trials < 2:
        raise UsageError(f"harness predictivity: --trials {args.trials} must be at least 2")
    config = _config(args, spec)
    store = sweep_into(config, args.out, "predictivity")
    layers = args.layers if args.layers is not None else tuple(range(spec.n_layers))
    causal = load_capture(args.capture).metadata.get("kind", "").startswith("decoder")
    heads = min(4, spec.n_kv_heads)
    structure = {n: {side: window_statistics(name, dim=spec.dim, seq_len=args.seq_len, n_heads=heads, causal=causal,
                                             seed=args.seed)
                     for side, name in (("real", f"replay:{args.capture}:layer={n}"),
                                        ("fitted", f"fitted:{args.spec}:layer={n}"))}
                 for n in layers}
    result = study(store.trials(), layers, args.capture, args.spec, spec, levels, tuple(config.schemes),
                   structure=structure)
    store.write_tables(predictivity_frames(result, spec.data))   # results.sqlite: fit_layers, predictivity, ...
    tmp = args.out / (RESULT_FILE + ".partial")
    tmp.write_text(json.dumps(result, indent=1), encoding="utf-8")
    os.replace(tmp, args.out / RESULT_FILE)
    print(json.dumps(result, indent=2) if args.json else format_result(result))
    return 0

