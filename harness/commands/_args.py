"""Argument parsing helpers shared by the commands."""
from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Callable

from ..sweep import MAX_SEED


class EveryName(tuple):
    """The names 'all' expanded to (minus any '-NAME' exclusions): a sweep may skip those of them
    that cannot take its configuration, where a name given explicitly is an error."""


def plain_number(kind):
    """An argparse type for int or float that takes the number as ASCII text only: Python's own
    int('２') is 2 and int('1_0') is 10 (fullwidth digits, digit separators), which a command line
    should refuse rather than read. The CLI's parsers use it for every type=int and type=float."""
    def parse(text: str):
        if not text.isascii() or "_" in text:
            raise argparse.ArgumentTypeError(f"{text!r} is not a plain {kind.__name__} (ASCII digits, no separators)")
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
    parse.__name__ = kind.__name__
    return parse


class Once(argparse.Action):
    """Store an option's value, refusing the option given twice (where a later value would silently
    replace the first, e.g. --storage-levels 2.5 --storage-levels 3.5)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is not self.default:
            raise argparse.ArgumentError(self, "is given twice; give it once (a comma-separated list where it takes one)")
        setattr(namespace, self.dest, values)


def unique_items(text: str) -> str:
    """An argparse type for a comma-separated list read later (e.g. --storage-levels): refuses an
    empty item ('2,,3'), an item given twice and characters outside ASCII; returns the text."""
    items = [x.strip() for x in text.split(",")]
    if not text.isascii():
        raise argparse.ArgumentTypeError(f"{text!r} holds characters outside ASCII (fullwidth digits?)")
    if "" in items:
        raise argparse.ArgumentTypeError(f"{text!r} has an empty item; separate values by single commas")
    _repeated(items)
    return text


def path(text: str) -> Path:
    """An argparse type for a file or directory name: the empty string is refused (Path('') is
    the current directory, where a run would write its store)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path; give a file or directory name")
    return Path(text)


def _repeated(items) -> None:
    seen = set()
    for x in items:
        if x in seen:
            raise argparse.ArgumentTypeError(f"{x} is given twice; give each value once")
        seen.add(x)


def comma_list(kind, names: Callable[[], list[str]] | None = None, check: Callable[[str], None] | None = None,
               known: Callable[[str], bool] | None = None, why: Callable[[str], str | None] | None = None):
    """An argparse type for comma-separated lists of distinct values. With `names`, 'all' expands
    to every name ('all,-a,-b': every name but a and b; 'all,x': every name and x, a known name
    outside `names()`, e.g. a kvpress press) and each item must be a name, or pass
    `check` (which raises ValueError naming what is valid). `known(x)`, where given, accepts a
    name without listing them all (schemes: a built-in without importing an optional package);
    `why(x)`, where given, says why a known name that is not available cannot be used."""
    def parse(text: str):
        items = [x.strip() for x in text.split(",")]
        if not any(items):
            raise argparse.ArgumentTypeError(f"empty list {text!r}")
        if "" in items:
            raise argparse.ArgumentTypeError(f"{text!r} has an empty item; separate values by single commas")
        if kind is int:
            try:
                values = tuple(plain_number(int)(x) for x in items)
            except argparse.ArgumentTypeError:
                raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers (ASCII "
                                                 f"digits)") from None
            _repeated(values)
            return values
        _repeated(items)
        if names is not None:
            if items[0] != "all" and known is not None and all(known(x) for x in items):
                return tuple(items)
            valid = names()
            if items[0] == "all":
                excluded = [x[1:] for x in items[1:] if x.startswith("-")]
                added = [x for x in items[1:] if not x.startswith("-")]
                wrong = [x for x in items[1:] if x.startswith("-") and x[1:] not in valid]
                if wrong:
                    raise argparse.ArgumentTypeError(
                        f"after 'all' give exclusions -NAME of known names, not {wrong[0]!r}; "
                        f"available: {', '.join(valid)}")
                for x in added:
                    if x in valid:
                        raise argparse.ArgumentTypeError(f"{x!r} is already part of 'all'")
                    if known is None or not known(x):
                        reason = why(x) if why is not None else None
                        raise argparse.ArgumentTypeError(
                            f"{x!r} cannot run here: {reason}" if reason else
                            f"unknown name {x!r} after 'all' (a name outside all, e.g. a kvpress press); "
                            f"all is: {', '.join(valid)}")
                kept = EveryName([*(n for n in valid if n not in excluded), *added])
                if not kept:
                    raise argparse.ArgumentTypeError(f"{text!r} excludes every name")
                return kept
            for x in items:
                if x in valid:
                    continue
                if check is None:
                    reason = why(x) if why is not None else None
                    if reason:
                        raise argparse.ArgumentTypeError(f"{x!r} cannot run here: {reason}")
                    raise argparse.ArgumentTypeError(f"unknown name {x!r}; available: all, {', '.join(valid)}")
                try:
                    check(x)
                except ValueError as exc:
                    raise argparse.ArgumentTypeError(str(exc)) from None
        return tuple(items)
    return parse


def check_test_options(args, command: str) -> None:
    """--alpha, --margin, --permutations, --seed and (where the command has it) --out of the
    commands that run statistical tests."""
    from ..errors import UsageError
    if not 0 < args.alpha < 1:
        raise UsageError(f"harness {command}: --alpha {args.alpha} must lie in (0, 1)")
    if not 0 < args.margin < math.inf:
        raise UsageError(f"harness {command}: --margin {args.margin} must be a positive finite number")
    if args.permutations < 1:
        raise UsageError(f"harness {command}: --permutations {args.permutations} must be a positive integer")
    if not 0 <= args.seed <= MAX_SEED:
        raise UsageError(f"harness {command}: --seed {args.seed} must be an integer in 0..{MAX_SEED}")
    if getattr(args, "out", None) is not None:
        check_out_dir(args.out, command, "give a directory for the runs")


def check_out_dir(out: Path, command: str, advice: str) -> None:
    """UsageError unless `out` can be a directory: it is one or does not exist yet, with no file on
    its way up (mkdir would fail) and not a symbolic link to nowhere (mkdir would fail too)."""
    from ..errors import UsageError
    if out.is_symlink() and not out.exists():
        raise UsageError(f"harness {command}: --out {out} is a symbolic link to {os.readlink(out)}, which does not "
                         f"exist; {advice}")
    if out.exists() and not out.is_dir():
        raise UsageError(f"harness {command}: --out {out} is a file; {advice}")
    above = next((p for p in out.absolute().parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise UsageError(f"harness {command}: --out {out} lies under {above}, which is a file; {advice}")


def add_margin_arguments(p) -> None:
    """--margin and --spread-margin of the commands that give verdicts (stats/validation.py)."""
    from stats.margins import SMALLEST_EFFECT, SPREAD_MARGIN
    p.add_argument("--margin", type=float, default=SMALLEST_EFFECT,
                   help=f"smallest effect of interest on a metric's mean, in its pooled trial-to-trial standard "
                        f"deviations (default {SMALLEST_EFFECT})")
    p.add_argument("--spread-margin", type=float, default=SPREAD_MARGIN,
                   help=f"smallest change of interest of a metric's spread, a ratio of its trials' mean absolute deviations "
                        f"(default {SPREAD_MARGIN})")


def check_spread_margin(args, command: str) -> None:
    """--spread-margin of the commands that give verdicts: a finite ratio of spreads above 1."""
    from ..errors import UsageError
    if not 1 < args.spread_margin < float("inf"):
        raise UsageError(f"harness {command}: --spread-margin {args.spread_margin} must be a finite ratio of "
                         f"standard deviations above 1, e.g. 1.25")


def sweep_into(config, out: Path, command: str):
    """Validate config and run it into the run directory `out` (resumed where it exists), bad
    input and another run in `out` as the command's one-line usage errors; the RunStore."""
    from ..errors import UsageError
    from ..runner import RunConflict, run_sweep
    from ..store import RunStore
    try:
        config.validate()
    except ValueError as exc:
        raise UsageError(f"harness {command}: {exc}") from None
    store = RunStore(out)
    try:
        run_sweep(config, store, resume=out.exists(), progress=False)
    except RunConflict as exc:
        raise UsageError(f"harness {command}: {exc}") from None
    return store
