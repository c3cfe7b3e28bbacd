"""harness fit: per layer of a capture, what its K, V, Q are made of, and a fitted:SPEC.json scenario."""
from __future__ import annotations

import json
import os

from ..errors import UsageError
from ._args import capture_file, output_file

NAME = "fit"
HELP = "fit a capture's per-layer statistics: nearest scenario family, and a spec for --scenario fitted:SPEC.json"


def add_arguments(p):
    p.add_argument("capture", type=capture_file, help="capture FILE.safetensors or .npz (harness capture)")
    p.add_argument("--out", type=output_file("SPEC.json in an existing directory you may write to"), default=None,
                   help="write the spec to SPEC.json (scenario fitted:SPEC.json)")
    p.add_argument("--fit-fraction", type=float, default=0.5,
                   help="fit on the first fraction of the tokens (default 0.5: replay:FILE's calibration part, so "
                        "its evaluation windows stay held out)")
    p.add_argument("--json", action="store_true", help="print the per-layer statistics and families as JSON")


def summary(spec: dict) -> dict:
    """The spec without the per-head moments (what --json prints)."""
    return {**{k: v for k, v in spec.items() if k != "layers"},
            "layers": [{k: v for k, v in layer.items() if k != "heads"} for layer in spec["layers"]]}


def format_table(spec: dict) -> str:
    rows = [f"{'layer':>5}  {'closest family':<20} {'dist':>5}  {'next':<20} {'dist':>5}  {'PR K':>5} {'PR V':>5} "
            f"{'α K':>5} {'dof':>5} {'tok sp':>6} {'K/V al':>6} {'μ K':>5} {'out ch':>6}"]
    for layer in spec["layers"]:
        fam, st = layer["family"], layer["statistics"]
        ranked = sorted(fam["distances"].items(), key=lambda kv: kv[1])
        dofs = sorted(x if x is not None else float("inf") for x in st["dof_per_head"])
        dof = dofs[len(dofs) // 2]
        rows.append(f"{layer['layer']:>5}  {ranked[0][0]:<20} {ranked[0][1]:5.3f}  {ranked[1][0]:<20} {ranked[1][1]:5.3f}  "
                    f"{st['k_participation_ratio']:5.1f} {st['v_participation_ratio']:5.1f} {st['k_decay_alpha']:5.2f} "
                    f"{dof:5.1f} {st['token_norm_overdispersion']:6.1f} {st['kv_alignment']:6.2f} {st['k_mean_share']:5.2f} {st['k_outlier_channels']:6.1f}")
    return "\n".join(rows)


def run(args) -> int:
    from scenarios.replay import load_capture

    from ..fit import fit_capture

    if args.out is not None and args.out.suffix != ".json":
        raise UsageError(f"harness fit: --out {args.out} must end in .json")
    if not 0 < args.fit_fraction <= 1:
        raise UsageError(f"harness fit: --fit-fraction {args.fit_fraction} must lie in (0, 1]")
    try:
        cap = load_capture(args.capture)
        spec = fit_capture(cap, fit_fraction=args.fit_fraction)
    except ValueError as exc:
        raise UsageError(f"harness fit: {exc}") from None
    if args.out is not None:
        tmp = args.out.with_name(args.out.name + ".partial")
        tmp.write_text(json.dumps(spec, separators=(",", ":")), encoding="utf-8")
        os.replace(tmp, args.out)
    if args.json:
        print(json.dumps(summary(spec), indent=2))
        return 0
    print(f"{cap.metadata.get('model', '?')}: {cap.n_layers} layers, {spec['heads']} heads ({spec['kv_heads']} "
          f"key/value), d={cap.dim}, fitted on tokens 0..{spec['fit_tokens'] - 1} of {cap.n_tokens}; RoPE "
          f"{'measured' if spec['rope'] else 'none'}")
    print(format_table(spec))
    print("dist: root-mean-square difference of 7 features in [0, 1] (fit --json: features) to each family's default "
          "draw; PR participation ratio (of d), α power-law decay, dof median Student-t dof of the whitened coordinates, tok sp var(|w|²)/2p of the whitened tokens w (1: Gaussian), "
          "K/V al subspace alignment, μ K mean offset's share of K's energy, out ch channels with std > 3x median")
    if args.out is not None:
        print(f"spec -> {args.out} (use --scenario fitted:{args.out}:layer=N)")
    return 0
