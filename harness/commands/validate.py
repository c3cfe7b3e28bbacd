"""harness validate: is the difference between two configurations a codec difference or
implementation variance? Runs the small sweeps it needs and prints a verdict (stats/validation.py).

Runs (each a run directory under --out, or a temporary directory):
- with --against B: `base` holds A and B on the base configuration (same data); `variant`
  holds A and B with the --vary variable changed. Main comparison A vs B on `base`; null
  comparisons A(base) vs A(variant) and B(base) vs B(variant).
- without --against: `base` and `variant` hold A; the main comparison is A(base) vs
  A(variant). The null is a seed change: `null` holds A with the root seed + 1 (+ 2 when the
  varied variable is the seed itself), compared with A(base).
"""
from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

import scenarios
import schemes
from stats.levels import ALPHA, EQUIVALENCE_MARGIN

from ..devices import DEVICES, DTYPES, resolve_device
from ..errors import UsageError
from ._args import check_test_options
from ..sweep import IMPLS, SweepConfig

NAME = "validate"
HELP = "is the difference between two configurations a codec difference or implementation variance?"

VARIABLES = ("impl", "rng", "seed", "device", "dtype")
RNGS = ("pcg64", "mt19937", "philox")


def add_arguments(p):
    p.add_argument("--scenario", required=True, help="scenario NAME")
    p.add_argument("--scheme", required=True, help="scheme A")
    p.add_argument("--against", default=None, help="scheme B (default: A itself under the --vary change)")
    p.add_argument("--vary", choices=VARIABLES, default="seed",
                   help="the implementation variable of the null (and of the main comparison without --against)")
    p.add_argument("--budget", type=int, default=3, help="bits per element (default 3)")
    p.add_argument("--dim", type=int, default=128, help="head dimension (default 128)")
    p.add_argument("--seq-len", type=int, default=1024, help="cached tokens S (default 1024)")
    p.add_argument("--queries", type=int, default=64, help="queries Nq (default 64)")
    p.add_argument("--trials", type=int, default=200, help="trials per configuration (default 200)")
    p.add_argument("--seed", type=int, default=0, help="root seed of the base configuration (default 0)")
    p.add_argument("--rng", choices=RNGS, default="pcg64")
    p.add_argument("--impl", choices=IMPLS, default="torch")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    p.add_argument("--device", choices=DEVICES, default="auto")
    p.add_argument("--alpha", type=float, default=ALPHA, help=f"family-wise level (default {ALPHA})")
    p.add_argument("--margin", type=float, default=EQUIVALENCE_MARGIN,
                   help=f"equivalence margin, a fraction of each metric's pooled mean (default {EQUIVALENCE_MARGIN})")
    p.add_argument("--permutations", type=int, default=1000, help="energy-test permutations (default 1000)")
    p.add_argument("--out", type=Path, default=None, help="directory for the runs (default: a temporary one)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _other(value, choices):
    return next(c for c in choices if c != value)


def variant_of(config: SweepConfig, vary: str) -> SweepConfig:
    """The base configuration with the implementation variable `vary` changed."""
    if vary == "seed":
        return dataclasses.replace(config, seed=config.seed + 1)
    if vary == "rng":
        return dataclasses.replace(config, rng=_other(config.rng, RNGS))
    if vary == "dtype":
        return dataclasses.replace(config, dtype=_other(config.dtype, tuple(DTYPES)))
    if vary == "impl":
        return dataclasses.replace(config, impl=_other(config.impl, IMPLS))
    if vary == "device":
        import torch
        if not torch.cuda.is_available():
            raise UsageError("harness validate: --vary device needs a second device (cuda), but only cpu is "
                             "available here; valid here: --vary impl, rng, seed, dtype")
        return dataclasses.replace(config, device=_other(config.device, ("cpu", "cuda")))
    raise UsageError(f"harness validate: unknown --vary {vary!r}; valid: {', '.join(VARIABLES)}")


def _check(args) -> None:
    if args.scenario not in scenarios.available() and ":" not in args.scenario:
        raise UsageError(f"harness validate: unknown scenario {args.scenario!r}; "
                         f"available: {', '.join(scenarios.available())}")
    for name in (args.scheme, args.against):
        if name is not None and not schemes.is_registered(name):
            raise UsageError(f"harness validate: {schemes.registry.unknown_message(name)}")
    if args.against == args.scheme:
        raise UsageError("harness validate: --against names the same scheme as --scheme; omit it to compare "
                         "A with itself under --vary")
    check_test_options(args, "validate")
    if args.trials < 3:
        raise UsageError(f"harness validate: --trials {args.trials} must be at least 3 (the energy effect's "
                         f"jackknife leaves one out)")


def configs(args) -> dict[str, SweepConfig]:
    """The run directories' names and their sweeps (module doc)."""
    device = args.device
    if args.vary == "device" or device == "auto":
        try:
            device = resolve_device(device).type  # record the concrete device, so a variant can differ
        except ValueError as exc:
            raise UsageError(f"harness validate: {exc}") from None
    names = (args.scheme,) + ((args.against,) if args.against else ())
    base = SweepConfig(scenarios=(args.scenario,), schemes=names, budgets=(args.budget,), dims=(args.dim,),
                       seq_lens=(args.seq_len,), queries=(args.queries,), trials=args.trials, seed=args.seed,
                       device=device, dtype=args.dtype, rng=args.rng, impl=args.impl)
    out = {"base": base, "variant": variant_of(base, args.vary)}
    if not args.against:
        shift = 2 if args.vary == "seed" else 1
        out["null"] = dataclasses.replace(base, seed=base.seed + shift)
    for name, config in out.items():
        try:
            config.validate()
            resolve_device(config.device)
        except ValueError as exc:
            raise UsageError(f"harness validate: {name} configuration: {exc}") from None
    return out


def _cell(frame, scheme):
    return frame[frame["scheme"] == scheme]


def run(args) -> int:
    from stats.validation import validate_samples

    from ..runner import RunConflict, run_sweep
    from ..store import RunStore

    _check(args)
    sweeps = configs(args)
    with tempfile.TemporaryDirectory(prefix="kvharness-validate-") as tmp:
        root = args.out or Path(tmp)
        frames = {}
        for name, config in sweeps.items():
            store = RunStore(root / name)
            try:
                run_sweep(config, store, resume=True, progress=False)
            except RunConflict as exc:
                raise UsageError(f"harness validate: {exc}") from None
            frames[name] = store.trials()
    base, variant = frames["base"], frames["variant"]
    a = args.scheme
    if args.against:
        b = args.against
        main = (_cell(base, a), _cell(base, b))
        nulls = [(_cell(base, a), _cell(variant, a)), (_cell(base, b), _cell(variant, b))]
        described = f"{a} vs {b}; null: {args.vary} change of each"
    else:
        main = (_cell(base, a), _cell(variant, a))
        nulls = [(_cell(base, a), _cell(frames["null"], a))]
        described = f"{a} vs {a} with {args.vary} changed; null: seed change"
    try:
        result = validate_samples(*main, nulls, alpha=args.alpha, margin=args.margin,
                                  n_permutations=args.permutations, seed=args.seed)
    except ValueError as exc:
        raise UsageError(f"harness validate: {exc}") from None
    if args.json:
        payload = result.to_json()
        payload.update(scenario=args.scenario, scheme=a, against=args.against, vary=args.vary,
                       budget=args.budget, dim=args.dim, seq_len=args.seq_len, queries=args.queries,
                       trials=args.trials, comparison=described,
                       runs={k: c.to_json() for k, c in sweeps.items()},
                       out=str(args.out) if args.out else None)
        print(json.dumps(payload, indent=2, default=float))
        return 0
    print(f"{args.scenario}, budget {args.budget}, dim {args.dim}: {described}")
    print(f"verdict: {result.verdict} ({result.reason})")
    main = result.main
    test = "Wilcoxon p" if main.paired else "KS p"
    print(f"main comparison, {main.tests}")
    print(f"{'metric':<10} {'effect':>10} {'SE':>9} {'KS D':>6} {test:>10} {'Holm p':>9} {'beyond null, Holm p':>19}")
    beyond = {r["test"]: r["p_holm"] for r in result.beyond}  # rule 1's tests, Holm over the rejected ones
    for m in main.p:
        e = main.effects[m]
        print(f"{m:<10} {e.estimate:>10.3g} {e.se:>9.2g} {main.ks_statistic[m]:>6.3f} {main.p[m]:>10.3g} "
              f"{main.p_holm[m]:>9.3g} {beyond[m] if m in beyond else float('nan'):>19.3g}")
    e = main.energy
    print(f"energy distance (squared, six-D standardised): {e.statistic:.4g}, {e.test} p {e.p_value:.3g} "
          f"({e.n_permutations} permutations), Holm p {main.p_holm['energy']:.3g}; unbiased E_U "
          f"{main.effects['energy'].estimate:.4g} (jackknife SE {main.effects['energy'].se:.2g})"
          + (f", beyond null, Holm p {beyond['energy']:.3g}" if "energy" in beyond else ""))
    for n in result.nulls:
        print(f"{n.label} ({n.tests}): energy {n.energy.statistic:.4g} (p {n.energy.p_value:.3g}), "
              f"min Holm p {min(n.p_holm.values()):.3g}, rejects: {n.rejects}")
    return 0
