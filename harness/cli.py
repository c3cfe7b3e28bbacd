"""python -m harness {list, run, export}: the command line of kvharness.

Exit status: 0 success; 2 usage error (one line naming what is wrong and what is valid,
nothing written); 1 any other failure; 130 interrupted (finished cells are kept).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import scenarios
import schemes

from .devices import DEVICES, DTYPES
from .store import RESULTS_FILE, RunStore
from .sweep import IMPLS, SweepConfig


class UsageError(Exception):
    """A user error: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        raise UsageError(f"{self.prog}: {message}")


def _list_of(kind, valid=None):
    def parse(text: str):
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"empty list {text!r}")
        if kind is int:
            try:
                return tuple(int(x) for x in items)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
        if valid is not None:
            names = valid()
            if items == ["all"]:
                return tuple(names)
            for x in items:
                if x not in names:
                    raise argparse.ArgumentTypeError(f"unknown name {x!r}; available: all, {', '.join(names)}")
        return tuple(items)
    return parse


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="harness", description="kvharness: statistical validation of KV-cache codecs")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("list", help="registered schemes and scenarios")
    p.add_argument("--json", action="store_true", help="print one JSON object")

    p = sub.add_parser("run", help="run a sweep (the cross product of the flags) into a run directory")
    p.add_argument("--scenario", type=_list_of(str, scenarios.available), required=True,
                   help="NAME[,NAME...] or all")
    p.add_argument("--scheme", type=_list_of(str, schemes.available), required=True,
                   help="NAME[,NAME...] or all")
    p.add_argument("--budget", type=_list_of(int), default=(2, 3, 4), help="bits per element, 1..8 (default 2,3,4)")
    p.add_argument("--dim", type=_list_of(int), default=(128,), help="head dimensions (default 128)")
    p.add_argument("--seq-len", type=_list_of(int), default=(1024,), help="cached tokens S (default 1024)")
    p.add_argument("--queries", type=_list_of(int), default=(64,), help="queries Nq (default 64)")
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

    p = sub.add_parser("export", help="write a run's trials as CSV or Parquet")
    p.add_argument("directory", type=Path)
    p.add_argument("--format", choices=("csv", "parquet"), default="csv")
    p.add_argument("--output", type=Path, default=None, help="file to write (default DIR/results.FORMAT)")
    return parser


def _cmd_list(args) -> int:
    listing = {
        "schemes": [{"name": s.name, "description": s.description} for s in schemes.specs().values()],
        "scenarios": [{"name": n, "description": scenarios.describe(n)} for n in scenarios.available()],
    }
    if args.json:
        print(json.dumps(listing, indent=2))
        return 0
    for kind in ("schemes", "scenarios"):
        print(f"{kind}:")
        for item in listing[kind]:
            print(f"  {item['name']:<20} {item['description']}")
    return 0


def _cmd_run(args) -> int:
    from datetime import datetime

    from reports import format_summary, summary_table

    from .runner import RunConflict, run_sweep

    config = SweepConfig(
        scenarios=args.scenario, schemes=args.scheme, budgets=args.budget, dims=args.dim,
        seq_lens=args.seq_len, queries=args.queries, trials=args.trials, seed=args.seed,
        heads=args.heads, calib_tokens=args.calib_tokens, device=args.device, dtype=args.dtype,
        rng=args.rng, impl=args.impl)
    try:
        config.validate()
        from .devices import resolve_device
        resolve_device(args.device)
    except ValueError as exc:
        raise UsageError(f"harness run: {exc}") from None
    out = args.out or Path("runs") / f"{'-'.join(args.scenario)[:40]}-{datetime.now():%Y%m%d-%H%M%S}"
    store = RunStore(out)
    try:
        result = run_sweep(config, store, resume=args.resume, progress=None if not args.quiet else False)
    except RunConflict as exc:
        raise UsageError(f"harness run: {exc}") from None
    if not args.quiet:
        print(format_summary(summary_table(store.trials())))
    print(f"{result.n_cells_run} cells run, {result.n_cells_skipped} already stored, "
          f"{result.wall_s:.1f} s -> {out / RESULTS_FILE}")
    return 0


def _cmd_export(args) -> int:
    store = RunStore(args.directory)
    if not store.path.exists():
        raise UsageError(f"harness export: {args.directory} holds no {RESULTS_FILE}; give a run directory")
    frame = store.trials()
    output = args.output or args.directory / f"results.{args.format}"
    tmp = output.with_name(output.name + ".tmp")
    if args.format == "csv":
        frame.to_csv(tmp, index=False)
    else:
        try:
            frame.to_parquet(tmp, index=False)
        except ImportError as exc:
            raise UsageError(f"harness export: parquet needs pyarrow ({exc}); pip install pyarrow") from None
    tmp.replace(output)
    print(f"{len(frame)} rows -> {output}")
    return 0


COMMANDS = {"list": _cmd_list, "run": _cmd_run, "export": _cmd_export}


def main(argv: list[str] | None = None) -> int:
    try:
        args = _build_parser().parse_args(argv)
        return COMMANDS[args.command](args)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: every finished cell is stored; rerun with --resume to finish", file=sys.stderr)
        return 130
