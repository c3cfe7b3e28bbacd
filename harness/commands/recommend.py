"""harness recommend: a codec and width per layer under an average storage budget (harness/recommend.py);
the result in OUT/recommendation.json and the run's tables recommendation and
recommendation_judged (harness/fit_tables.py)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import schemes

from ..errors import UsageError
from ..sweep import SweepConfig
from ._args import capture_file, comma_list, output_dir, sweep_into
from .predictivity import DEFAULT_SCHEMES

NAME = "recommend"
HELP = "a codec and width per layer minimising attention-output error at an average storage of B bits/element"
RESULT_FILE = "recommendation.json"


def add_arguments(p):
    p.add_argument("capture", type=capture_file, help="capture FILE.safetensors or .npz (harness capture)")
    p.add_argument("--bits", type=float, required=True, help="average measured storage, bits per element")
    p.add_argument("--layers", type=comma_list(int), default=None, help="layers (default: all)")
    p.add_argument("--scheme", type=comma_list(str, schemes.registry.all_schemes, known=schemes.is_registered),
                   default=DEFAULT_SCHEMES, help=f"codecs (default {','.join(DEFAULT_SCHEMES)})")
    p.add_argument("--budget", type=comma_list(int), default=(2, 3, 4, 5), help="nominal bits (default 2,3,4,5)")
    p.add_argument("--trials", type=int, default=20, help="windows per half and cell (default 20)")
    p.add_argument("--seq-len", type=int, default=128, help="cached tokens S (default 128)")
    p.add_argument("--queries", type=int, default=64, help="queries Nq (default 64)")
    p.add_argument("--calib-tokens", type=int, default=512, help="calibration tokens (default 512)")
    p.add_argument("--seed", type=int, default=0, help="root seed (default 0)")
    p.add_argument("--out", type=output_dir, required=True, help="run directory (reused when it holds this sweep)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def _names(capture: Path, layers, part: str) -> dict[int, str]:
    return {n: f"replay:{capture}:layer={n}:part={part}" for n in layers}


def format_result(result: dict) -> str:
    j = result["judged"]
    lines = [f"{'layer':>5}  {'recommended':<16} {'storage':>7}"]
    for row in result["layers"]:
        lines.append(f"{row['layer']:>5}  {row['scheme'] + ' b=' + str(row['budget']):<16} {row['storage']:7.3f}")
    lines.append(f"held-out half, {j['n_trials']} windows per layer, both at {j['storage']:.3f} bits/element: summed "
                 f"d2_t {j['error_recommended']:.4g} against {j['error_uniform']:.4g} for {result['uniform']} in every "
                 f"layer; gain {100 * j['gain']:.1f} % [{100 * j['gain_ci'][0]:.1f}, "
                 f"{100 * j['gain_ci'][1]:.1f}] (95 % bootstrap over windows)")
    if "judged_cell" in result:
        c = result["judged_cell"]
        lines.append(f"against the best one measured setting, {result['uniform_cell'][0]} b={result['uniform_cell'][1]} at "
                     f"{c['storage_uniform']:.3f} bits/element (what one width for all layers can deploy within "
                     f"{result['bits']}): {c['error_recommended']:.4g} at {c['storage_recommended']:.3f} against "
                     f"{c['error_uniform']:.4g}; gain {100 * c['gain']:.1f} % [{100 * c['gain_ci'][0]:.1f}, "
                     f"{100 * c['gain_ci'][1]:.1f}]")
    if "conclusion" in result:
        lines.append(result["conclusion"]["line"])
    return "\n".join(lines)


def run(args) -> int:
    from scenarios.replay import load_capture

    from ..fit_tables import recommendation_frames
    from ..recommend import choose, conclusion, halving_bits, judge, judge_cell, options, uniform, uniform_cell

    if not args.bits > 0:
        raise UsageError(f"harness recommend: --bits {args.bits} must be a positive number of bits per element")
    if args.trials < 2:
        raise UsageError(f"harness recommend: --trials {args.trials} must be at least 2")
    try:
        cap = load_capture(args.capture)
    except ValueError as exc:
        raise UsageError(f"harness recommend: {exc}") from None
    layers = args.layers if args.layers is not None else tuple(range(cap.n_layers))
    bad = [n for n in layers if not 0 <= n < cap.n_layers]
    if bad:
        raise UsageError(f"harness recommend: --layers {bad[0]} is not a layer of the capture (0..{cap.n_layers - 1})")
    first, second = _names(args.capture, layers, "first"), _names(args.capture, layers, "second")
    config = SweepConfig(scenarios=tuple(first.values()) + tuple(second.values()), schemes=tuple(args.scheme),
                         budgets=tuple(args.budget), dims=(cap.dim,), seq_lens=(args.seq_len,), queries=(args.queries,),
                         trials=args.trials, seed=args.seed, calib_tokens=(args.calib_tokens,))
    store = sweep_into(config, args.out, "recommend")
    trials = store.trials()
    opts = options(trials, first)
    picks = choose(opts, args.bits)
    if picks is None:
        least = sum(min(o["storage_bits_per_element"]) for o in opts.values()) / len(opts)
        raise UsageError(f"harness recommend: --bits {args.bits} is below what these codecs reach "
                         f"(least average storage {least:.3f} bits/element)")
    result = {"bits": args.bits, "capture": str(args.capture), "metric": "d2_t",
              "layers": [{"layer": n, "scheme": picks[n][0], "budget": int(picks[n][1]),
                          "storage": float(opts[n].at[picks[n], "storage_bits_per_element"]),
                          "error_choose": float(opts[n].at[picks[n], "d2_t"])} for n in sorted(picks)]}
    level = float(np.mean([row["storage"] for row in result["layers"]]))
    base = uniform(trials, first, level)
    if base is None:
        raise UsageError(f"harness recommend: no single codec reaches {level:.3f} bits/element in every layer; "
                         f"give --budget values around it")
    try:
        result["uniform"], result["judged"] = base, judge(trials, second, picks, base)
        result["conclusion"] = conclusion(result["judged"], base, halving_bits(opts, base))
        cell = uniform_cell(opts, args.bits)
        if cell is not None:
            result["uniform_cell"] = [cell[0], int(cell[1])]
            result["judged_cell"] = judge_cell(trials, second, picks, cell)
    except ValueError as exc:
        raise UsageError(f"harness recommend: {exc}") from None
    store.write_tables(recommendation_frames(result))   # results.sqlite: recommendation, recommendation_judged
    tmp = args.out / (RESULT_FILE + ".partial")
    tmp.write_text(json.dumps(result, indent=1), encoding="utf-8")
    os.replace(tmp, args.out / RESULT_FILE)
    print(json.dumps(result, indent=2) if args.json else format_result(result))
    return 0
