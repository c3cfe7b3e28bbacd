"""harness validate: is the difference between two configurations a codec difference,
implementation variance, or too small to matter? Runs the small sweeps it needs and prints a
verdict (stats/validation.py).

Runs (each a run directory under --out, or a temporary directory). Every null has the design of
the comparison it judges (stats/validation.py, 'Nulls'): paired on the same data when that is.
- with --against B: `base` holds A and B on the base configuration (same data: a paired main
  comparison A vs B; paired on the codecs' own draws too when A and B share a seed family, which
  the output states). The nulls A(base) vs A(variant) and B(base) vs B(variant) change one
  implementation variable on the same data: --vary dtype, impl or device change it in `variant`;
  --vary seed and rng change the codecs' own seed or RNG family in `variant` (scheme_seed,
  scheme_rng), the data staying as they are.
- without --against: `base` and `variant` hold A with the --vary variable changed; the main
  comparison is A(base) vs A(variant). dtype, impl and device keep the data (paired): `null`
  holds A with only the codec's own seed changed (paired). seed and rng change the data
  (unpaired): `null` holds A with the root seed + 1 (+ 2 when the seed is varied), unpaired.
"""
from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

import scenarios
import schemes
from kvcommon.registry import IMPLS
from stats.margins import ALPHA

from ..devices import DEVICES, DTYPES, resolve_device
from ..errors import UsageError
from ._args import add_margin_arguments, check_spread_margin, check_test_options, output_dir
from ..sweep import MAX_SEED, SweepConfig

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
    add_margin_arguments(p)
    p.add_argument("--permutations", type=int, default=1000, help="energy-test permutations (default 1000)")
    p.add_argument("--out", type=output_dir, default=None, help="directory for the runs (default: a temporary one)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _other(value, choices):
    return next(c for c in choices if c != value)


PAIRED_VARIABLES = ("dtype", "impl", "device")  # changes that keep the data


def next_seed(seed: int, step: int = 1) -> int:
    """seed + step in the seeds a store holds (0..MAX_SEED), wrapping past the top: another seed
    for every valid one, so the largest valid --seed has a variant and a null too."""
    return (seed + step) % (MAX_SEED + 1)


def variant_of(config: SweepConfig, vary: str, same_data: bool = False) -> SweepConfig:
    """The base configuration with the implementation variable `vary` changed; with same_data,
    seed and rng change only the codecs' own draws (scheme_seed, scheme_rng), not the data."""
    if vary == "seed":
        if same_data:
            return dataclasses.replace(config, scheme_seed=next_seed(config.codec_seed))
        return dataclasses.replace(config, seed=next_seed(config.seed))
    if vary == "rng":
        if same_data:
            return dataclasses.replace(config, scheme_rng=_other(config.codec_rng, RNGS))
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
    check_spread_margin(args, "validate")
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
    out = {"base": base, "variant": variant_of(base, args.vary, same_data=bool(args.against))}
    if not args.against:
        if args.vary in PAIRED_VARIABLES:
            out["null"] = variant_of(base, "seed", same_data=True)  # the codec's own seed, the same data
        else:
            out["null"] = dataclasses.replace(base, seed=next_seed(base.seed, 2 if args.vary == "seed" else 1))
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
        changed = ("codec seed" if args.vary == "seed" else "codec RNG family" if args.vary == "rng"
                   else args.vary)
        described = f"{a} vs {b}; null: {changed} change of each, on the same data"
        families = {a: schemes.registry.seed_family(a), b: schemes.registry.seed_family(b)}
    else:
        main = (_cell(base, a), _cell(variant, a))
        nulls = [(_cell(base, a), _cell(frames["null"], a))]
        null = "codec seed change, on the same data" if args.vary in PAIRED_VARIABLES else "seed change"
        described = f"{a} vs {a} with {args.vary} changed; null: {null}"
        families = None
    try:
        # without --against both sides are A: only args.vary differs, so a flagged difference is the
        # implementations' (stats.validation.decide: implementation-discrepancy), never the codec's
        result = validate_samples(*main, nulls, alpha=args.alpha, margin=args.margin, spread_margin=args.spread_margin,
                                  n_permutations=args.permutations, seed=args.seed,
                                  implementation=None if args.against else (args.vary,))
    except ValueError as exc:
        raise UsageError(f"harness validate: {exc}") from None
    if args.json:
        payload = result.to_json()
        payload.update(scenario=args.scenario, scheme=a, against=args.against, vary=args.vary,
                       budget=args.budget, dim=args.dim, seq_len=args.seq_len, queries=args.queries,
                       trials=args.trials, comparison=described,
                       shared_draws=None if families is None else len(set(families.values())) == 1,
                       seed_families=families,
                       runs={k: c.to_json() for k, c in sweeps.items()},
                       out=str(args.out) if args.out else None)
        print(json.dumps(payload, indent=2, default=float))
        return 0
    print(f"{args.scenario}, budget {args.budget}, dim {args.dim}: {described}")
    print(f"verdict: {result.verdict} ({result.reason})")
    if families is not None:
        print(draws_line(families))
    if result.storage:
        st = result.storage
        print(f"storage: {a} {st['a']:.4g}, {args.against or a} {st['b']:.4g} bits/element "
              f"({'equal within' if st['equal'] else 'unequal, beyond'} ±{st['tolerance']:.1%})")
    main = result.main
    print(f"main comparison, {main.tests}; family: Holm over {result.family_size} tests; margins {args.margin:g} sd, "
          f"spread ratio {args.spread_margin:g}")
    print(f"{'test':<13} {'effect':>10} {'95% CI':>23} {'margin':>9} {'Holm p':>9} {'beyond p':>9} {'inside p':>9}")
    for t, row in result.effect_rows().items():
        low, high = (float("nan") if v is None else v for v in row["ci95"])
        estimate = float("nan") if row["estimate"] is None else row["estimate"]
        print(f"{t:<13} {estimate:>10.3g} [{low:>10.3g}, {high:>10.3g}] {row['margin']:>9.3g} "
              f"{_num(row['p_zero_holm']):>9.3g} {_num(row['p_beyond_holm']):>9.3g} {_num(row['p_inside']):>9.3g}")
    e = main.energy
    print(f"information: energy distance (squared, six-D standardised) {e.statistic:.4g}, {e.test} p "
          f"{e.p_value:.3g} ({e.n_permutations} permutations); {'Wilcoxon' if main.paired else 'KS'} p "
          + ", ".join(f"{m} {p:.3g}" for m, p in main.p.items()))
    for n in result.nulls:
        print(f"{n.label} ({n.tests}): min Holm p {min(n.p_holm.values()):.3g}, significant: {n.rejects}")
    return 0


def draws_line(families: dict[str, str]) -> str:
    """Whether the two codecs of `--against` share their own random draws (rotations, sketches):
    they do when their seed families (schemes.registry.seed_family) are one, and are then paired on
    those draws as well as on the data; otherwise each side's draws add to the paired differences,
    and a difference of a given size is found less often."""
    (a, fa), (b, fb) = families.items()
    if fa == fb:
        return f"codec draws: shared (seed family {fa!r}): paired on the codecs' own draws as well as the data"
    return (f"codec draws: not shared (seed families {fa!r} and {fb!r}): paired on the data only; a plug-in that "
            f"wraps a built-in declares its family with `seed_family` (docs/codecs.md)")


def _num(x):
    return float("nan") if x is None else x
