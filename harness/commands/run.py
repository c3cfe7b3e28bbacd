"""harness run: a sweep (the cross product of the flags) into a run directory."""
from __future__ import annotations

import dataclasses
import importlib.util
import sys
from datetime import datetime
from pathlib import Path

import scenarios
import schemes
from kvcommon.registry import IMPLS

from ..devices import DEVICES, DTYPES, resolve_device
from ..errors import UsageError
from ..store import RESULTS_FILE, RunStore
from ..sweep import GRIDS, SweepConfig, grid
from ._args import OUTPUT_DIR, EveryName, check_path, comma_list, output_dir

NAME = "run"
HELP = "run a sweep (the cross product of the flags) into a run directory"


# Flag -> (SweepConfig field, built-in default). Flags default to None so that an explicit
# flag overrides a --grid preset, which overrides the built-in default.
FIELDS = {"scenario": ("scenarios", None), "scheme": ("schemes", None), "budget": ("budgets", (2, 3, 4)),
          "dim": ("dims", (128,)), "seq_len": ("seq_lens", (1024,)), "queries": ("queries", (64,)),
          "trials": ("trials", 200), "heads": ("heads", 1), "calib_tokens": ("calib_tokens", (512,)),
          "seed": ("seed", 0), "device": ("device", "auto"), "dtype": ("dtype", "float32"),
          "rng": ("rng", "pcg64"), "impl": ("impl", "torch"), "decode_tokens": ("decode_tokens", 0)}


def add_arguments(p):
    p.add_argument("--scenario", type=comma_list(str, scenarios.available, scenarios.create),
                   help="NAME[,NAME...] or all (all,-NAME excludes one); parameters after colons, e.g. "
                        "heavy_tail:dof=5 or lowrank_aligned:rank=4:noise=0.05; replay:FILE[:layer=N]")
    p.add_argument("--scheme", type=comma_list(str, schemes.registry.all_schemes, why=schemes.registry.unavailable_reason,
                                               known=schemes.is_registered),
                   help="NAME[,NAME...] or all (the built-in codecs and entry-point plug-ins; an optional family's "
                        "members such as kvpress:SnapKVPress by name); all,-shard,-svd excludes those. With all, codecs that cannot "
                        "take the sweep's budgets or dims are skipped with one line saying which and why; a "
                        "codec named explicitly that cannot is an error")
    p.add_argument("--grid", choices=tuple(GRIDS), help="a named preset (paper: the AMD paper's grid); "
                   "explicit flags override it")
    p.add_argument("--budget", type=comma_list(int), help="bits per element, 1..8 (default 2,3,4)")
    p.add_argument("--dim", type=comma_list(int), help="head dimensions (default 128)")
    p.add_argument("--seq-len", type=comma_list(int), help="cached tokens S (default 1024)")
    p.add_argument("--queries", type=comma_list(int), help="queries Nq (default 64)")
    p.add_argument("--trials", type=int, help="trials per cell, at least 2 (default 200)")
    p.add_argument("--heads", type=int, help="heads H per trial (default 1)")
    p.add_argument("--calib-tokens", type=comma_list(int), help="calibration tokens per head, a sweep axis: "
                   "cells differing only in it share their K, V and Q draws (default 512)")
    p.add_argument("--decode-tokens", type=int, help="N tokens of a drifted distribution after the S prefill "
                   "tokens, compressed as they arrive; metrics on the S+N cache (default 0: no decode phase)")
    p.add_argument("--model-caches", type=int, help="amortise the per-model constants (SQ's bases, codebooks, "
                   "rotation signs) over N caches per layer-head in storage_bits_per_element (default: not "
                   "charged, per-cache bits only; 1: each cache stands alone)")
    p.add_argument("--seed", type=int, help="root seed (default 0)")
    p.add_argument("--device", choices=DEVICES, help="auto (default), cpu or cuda")
    p.add_argument("--dtype", choices=tuple(DTYPES), help="float32 (default) or float64")
    p.add_argument("--rng", choices=("pcg64", "mt19937", "philox"),
                   help="bit-generator family of every random stream (default pcg64)")
    p.add_argument("--impl", choices=IMPLS, help="torch (default) or reference (independent NumPy)")
    p.add_argument("--out", type=output_dir, default=None, help="run directory (default runs/<scenario>-<time>)")
    p.add_argument("--resume", action="store_true", help="finish an interrupted run in --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no summary table")
    p.add_argument("--workers", type=int, default=None, help="run cells in N processes, this one and a local Dask "
                   "cluster of N - 1, started once this run's first chunks show that they save more than their start "
                   "costs (else the run stays serial and says so; $KVHARNESS_SERIAL_BELOW_S=0 starts them at once)")
    p.add_argument("--scheduler", default=None, help="run cells on an existing Dask cluster at ADDRESS")


def _skip_unfit(config: SweepConfig, unfit: dict[str, tuple[int, int, str]]) -> SweepConfig:
    """The sweep of the codecs 'all' expanded to less the unfit ones (SweepConfig.unfit_schemes),
    which are named on stderr in one line, grouped by reason (UsageError if none is left)."""
    reasons = {}
    for name, (_, _, reason) in unfit.items():
        reasons.setdefault(reason, []).append(name)
    fit = tuple(name for name in config.schemes if name not in unfit)
    words = "; ".join(f"{', '.join(names)} ({reason})" for reason, names in reasons.items())
    if not fit:
        raise UsageError(f"harness run: no codec of 'all' takes this sweep: {words}")
    if reasons:
        print(f"harness run: skipping {len(unfit)} codec(s) that cannot take this sweep: {words}", file=sys.stderr)
    return dataclasses.replace(config, schemes=fit)


def config_from_args(args) -> SweepConfig:
    """The sweep the flags describe, validated (UsageError naming the first bad value)."""
    preset = grid(args.grid) if getattr(args, "grid", None) else {}
    values = {}
    for flag, (field, default) in FIELDS.items():
        given = getattr(args, flag, None)
        values[field] = given if given is not None else preset.get(field, default)
        if values[field] is None:
            raise UsageError(f"harness run: --{flag} is required (or give --grid {'|'.join(GRIDS)})")
    if values["trials"] < 2:
        raise UsageError(f"harness run: --trials {values['trials']} must be at least 2 (confidence intervals and "
                         f"tests need two trials per cell)")
    every = isinstance(values["schemes"], EveryName)
    values["schemes"] = tuple(values["schemes"])
    # not in FIELDS: unset is a valid value (no amortisation), not a missing flag
    config = SweepConfig(**values, model_caches=getattr(args, "model_caches", None))
    if args.workers is not None and args.workers < 1:
        raise UsageError(f"harness run: --workers {args.workers} must be a positive integer")
    if args.workers and args.scheduler:
        raise UsageError("harness run: give --workers (a local cluster) or --scheduler (an existing one), not both")
    if (args.workers or args.scheduler) and importlib.util.find_spec("distributed") is None:
        raise UsageError("harness run: --workers/--scheduler need dask: pip install 'kvharness[distributed]'")
    if args.scheduler is not None:
        from ..distributed import check_address
        try:
            check_address(args.scheduler)
        except ValueError as exc:
            raise UsageError(f"harness run: {exc}") from None
    try:
        unfit = config.validate(skip_unfit=every)     # each (codec, budget, dim) built once
        resolve_device(config.device)
    except ValueError as exc:
        raise UsageError(f"harness run: {exc}") from None
    return _skip_unfit(config, unfit) if every else config


def default_out(config: SweepConfig, root: Path = Path("runs")) -> Path:
    """runs/<scenarios>-<date>-<time>-<microseconds>, made here with mkdir (atomic), so two runs
    started at the same moment never share it: the second takes the next free -N suffix."""
    stem = f"{'-'.join(config.scenarios)[:40]}-{datetime.now():%Y%m%d-%H%M%S-%f}"
    root.mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        out = root / (stem if n == 1 else f"{stem}-{n}")
        try:
            out.mkdir()
            return out
        except FileExistsError:
            continue
    raise UsageError(f"harness run: no free directory name under {root} for {stem}; give --out")


def run(args) -> int:
    from reports import format_summary, summary_table

    from ..runner import RunConflict, check_data, check_memory, run_sweep

    config = config_from_args(args)
    check_memory(config, resolve_device(config.device))  # before a directory is made
    check_data(config)
    if args.out is None:   # --out itself passed the door (output_dir) as it was parsed
        check_path(Path("runs"), OUTPUT_DIR, "run", "--out's default",
                   "give --out DIR, a directory you may write to")
    out = args.out or default_out(config)
    store = RunStore(out)
    try:
        result = run_sweep(config, store, resume=args.resume, progress=None if not args.quiet else False,
                           workers=args.workers, scheduler=args.scheduler)
    except RunConflict as exc:
        raise UsageError(f"harness run: {exc}") from None
    if not args.quiet:
        print(format_summary(summary_table(store.trials())))
    kept = f", {result.n_trials_kept} of their trials stored before" if result.n_trials_kept else ""
    print(f"{result.n_cells_run} cells run, {result.n_cells_skipped} already stored{kept}, "
          f"{result.wall_s:.1f} s -> {out / RESULTS_FILE}")
    return 0
