"""harness run: a sweep (the cross product of the flags) into a run directory."""
from __future__ import annotations

import importlib.util
from datetime import datetime
from pathlib import Path

import scenarios
import schemes

from ..devices import DEVICES, DTYPES, resolve_device
from ..errors import UsageError
from ..store import RESULTS_FILE, RunStore
from ..sweep import IMPLS, SweepConfig
from ._args import comma_list

NAME = "run"
HELP = "run a sweep (the cross product of the flags) into a run directory"


def add_arguments(p):
    p.add_argument("--scenario", type=comma_list(str, scenarios.available, scenarios.create), required=True,
                   help="NAME[,NAME...] or all (or a parametric one such as replay:FILE)")
    p.add_argument("--scheme", type=comma_list(str, schemes.available), required=True,
                   help="NAME[,NAME...] or all")
    p.add_argument("--budget", type=comma_list(int), default=(2, 3, 4), help="bits per element, 1..8 (default 2,3,4)")
    p.add_argument("--dim", type=comma_list(int), default=(128,), help="head dimensions (default 128)")
    p.add_argument("--seq-len", type=comma_list(int), default=(1024,), help="cached tokens S (default 1024)")
    p.add_argument("--queries", type=comma_list(int), default=(64,), help="queries Nq (default 64)")
    p.add_argument("--trials", type=int, default=200, help="trials per cell (default 200)")
    p.add_argument("--heads", type=int, default=1, help="heads H per trial (default 1)")
    p.add_argument("--calib-tokens", type=int, default=512, help="calibration tokens per head (default 512)")
    p.add_argument("--seed", type=int, default=0, help="root seed (default 0)")
    p.add_argument("--device", choices=DEVICES, default="auto")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    p.add_argument("--rng", choices=("pcg64", "mt19937", "philox"), default="pcg64",
                   help="bit-generator family of every random stream (default pcg64)")
    p.add_argument("--impl", choices=IMPLS, default="torch")
    p.add_argument("--out", type=Path, default=None, help="run directory (default runs/<scenario>-<time>)")
    p.add_argument("--resume", action="store_true", help="finish an interrupted run in --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no summary table")
    p.add_argument("--workers", type=int, default=None, help="run cells on a local Dask cluster of N workers")
    p.add_argument("--scheduler", default=None, help="run cells on an existing Dask cluster at ADDRESS")


def config_from_args(args) -> SweepConfig:
    """The sweep the flags describe, validated (UsageError naming the first bad value)."""
    config = SweepConfig(
        scenarios=args.scenario, schemes=args.scheme, budgets=args.budget, dims=args.dim,
        seq_lens=args.seq_len, queries=args.queries, trials=args.trials, seed=args.seed,
        heads=args.heads, calib_tokens=args.calib_tokens, device=args.device, dtype=args.dtype,
        rng=args.rng, impl=args.impl)
    if args.workers is not None and args.workers < 1:
        raise UsageError(f"harness run: --workers {args.workers} must be a positive integer")
    if args.workers and args.scheduler:
        raise UsageError("harness run: give --workers (a local cluster) or --scheduler (an existing one), not both")
    if (args.workers or args.scheduler) and importlib.util.find_spec("distributed") is None:
        raise UsageError("harness run: --workers/--scheduler need dask: pip install 'kvharness[distributed]'")
    try:
        config.validate()
        resolve_device(args.device)
    except ValueError as exc:
        raise UsageError(f"harness run: {exc}") from None
    return config


def run(args) -> int:
    from reports import format_summary, summary_table

    from ..runner import RunConflict, run_sweep

    config = config_from_args(args)
    out = args.out or Path("runs") / f"{'-'.join(args.scenario)[:40]}-{datetime.now():%Y%m%d-%H%M%S}"
    store = RunStore(out)
    try:
        result = run_sweep(config, store, resume=args.resume, progress=None if not args.quiet else False,
                           workers=args.workers, scheduler=args.scheduler)
    except RunConflict as exc:
        raise UsageError(f"harness run: {exc}") from None
    if not args.quiet:
        print(format_summary(summary_table(store.trials())))
    print(f"{result.n_cells_run} cells run, {result.n_cells_skipped} already stored, "
          f"{result.wall_s:.1f} s -> {out / RESULTS_FILE}")
    return 0
