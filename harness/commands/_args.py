"""Argument parsing helpers shared by the commands."""
from __future__ import annotations

import argparse
import math
import os
import stat
import tempfile
from pathlib import Path
from typing import Callable


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


# ---------------------------------------------------------------- the door: every path a command reads or writes
# One check per kind of path, run before any work (as the argparse type of the option, or through
# check_path where the path is known only later: a default, a directory named in a file): what
# is wrong in one line, with what is valid. Nothing is created by a check; the write probe is an
# unnamed temporary file (O_TMPFILE where the file system has it), gone when closed.

OUTPUT_DIR, OUTPUT_FILE, INPUT_FILE, INPUT_DIR, WRITABLE_DIR = \
    "output directory", "output file", "input file", "input directory", "writable directory"
VALID = {OUTPUT_DIR: "a new directory (its missing parents are made) or an existing one you may write to",
         OUTPUT_FILE: "a file name in an existing directory you may write to",
         INPUT_FILE: "an existing file you may read",
         INPUT_DIR: "an existing directory you may read",
         WRITABLE_DIR: "an existing directory you may write to"}


def _cannot_write(directory: Path) -> str | None:
    """Why (a few words) no file can be made in the existing directory `directory` (mode bits for
    this user, a read-only file system, ...), or None: os.access for the effective user, then a
    real probe (root passes os.access on any directory of a writable file system)."""
    effective = os.access in os.supports_effective_ids
    if not os.access(directory, os.W_OK | os.X_OK, effective_ids=effective):
        return "read-only for this user or on its file system"
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


def _cannot_read(target: Path, directory: bool) -> str | None:
    effective = os.access in os.supports_effective_ids
    if not os.access(target, os.R_OK | (os.X_OK if directory else 0), effective_ids=effective):
        return "cannot be read (permission denied)"
    try:
        if directory:
            with os.scandir(target) as entries:
                next(entries, None)
        else:
            with open(target, "rb") as f:
                f.read(1)
    except OSError as exc:
        return f"cannot be read ({exc.strerror or type(exc).__name__})"
    return None


def path_problem(target: Path, kind: str, noun: str | None = None) -> str | None:
    """What makes `target` unusable as a `kind` (OUTPUT_DIR, OUTPUT_FILE, INPUT_FILE, INPUT_DIR,
    WRITABLE_DIR), to follow its name, or None. An output directory may not exist yet: then every
    existing ancestor must be a directory and the nearest one writable (mkdir makes the rest). A
    missing input is ': no such NOUN' where `noun` is given (the readers' own words)."""
    if kind != OUTPUT_FILE and target.is_symlink() and not target.exists():   # a file is written through it
        return f"is a symbolic link to {os.readlink(target)}, which does not exist"
    if kind in (INPUT_FILE, INPUT_DIR, WRITABLE_DIR):
        if not target.exists():
            above = next((p for p in target.absolute().parents if p.exists()), None)
            if above is not None and not above.is_dir():
                return f"lies under {above}, which is a file"
            return f": no such {noun}" if noun else "does not exist"
        if kind == INPUT_FILE:
            if target.is_dir():
                return "is a directory"
            if not stat.S_ISREG(target.stat().st_mode):   # opening a FIFO to probe it would wait for a writer
                return "is not a regular file (a device, FIFO or socket)"
            return _cannot_read(target, directory=False)
        if not target.is_dir():
            return "is a file"
        return _cannot_read(target, directory=True) or (_not_writable(target) if kind == WRITABLE_DIR else None)
    if kind == OUTPUT_FILE:
        if target.is_dir():
            return "is a directory"
        parent = Path(os.path.realpath(target)).parent
        if not parent.exists():
            return f"cannot be written: the directory {parent} does not exist"
        if not parent.is_dir():
            return f"lies under {parent}, which is a file"
        reason = _cannot_write(parent)
        return f"cannot be written: {parent} is not writable ({reason})" if reason else None
    if kind != OUTPUT_DIR:
        raise ValueError(f"unknown kind of path {kind!r}; valid: {', '.join(VALID)}")
    if target.exists():
        if not target.is_dir():
            return "is a file"
        return _cannot_read(target, directory=True) or _not_writable(target)
    above = next((p for p in target.absolute().parents if p.exists()), None)
    if above is None:
        return None
    if not above.is_dir():
        return f"lies under {above}, which is a file"
    reason = _cannot_write(above)
    return f"cannot be made: {above} is not writable ({reason})" if reason else None


def _not_writable(directory: Path) -> str | None:
    reason = _cannot_write(directory)
    return f"is not writable ({reason})" if reason else None


def _door(kind: str, what: str | None = None, noun: str | None = None):
    """An argparse type for a path of `kind`, refused at parsing, before any work; `what` names
    what is valid more closely (e.g. 'a capture FILE.safetensors or .npz')."""
    def parse(text: str) -> Path:
        # Path('') is the current directory, where a run would write its store: the empty name is refused
        problem = path_problem(Path(text), kind, noun) if text.strip() else "an empty path"
        if problem:
            shown = "" if not text.strip() else text if problem.startswith(":") else f"{text} "
            raise argparse.ArgumentTypeError(f"{shown}{problem}; valid: {what or VALID[kind]}")
        return Path(text)
    parse.__name__ = kind.replace(" ", "_")
    return parse


def output_dir(text: str) -> Path:
    """--out of the commands that write a run directory (module comment above)."""
    return _door(OUTPUT_DIR)(text)


def output_file(what: str | None = None):
    """An argparse type for a file a command writes (fit --out, capture --out, export --output)."""
    return _door(OUTPUT_FILE, what)


def input_file(what: str | None = None, noun: str | None = None):
    """An argparse type for a file a command reads (a capture, a spec, a text)."""
    return _door(INPUT_FILE, what, noun)


# the capture FILE of fit, recommend and predictivity (its readers say "no such capture file" too)
capture_file = input_file("a capture FILE.safetensors or .npz (harness capture) you may read", "capture file")


def input_dir(what: str | None = None):
    """An argparse type for a directory a command reads (a run, a model)."""
    return _door(INPUT_DIR, what)


def check_path(target: Path, kind: str, command: str, option: str, what: str | None = None) -> None:
    """UsageError (one line: the option, the path, what is wrong, what is valid) unless `target`
    can serve as `kind`: the door for paths known only after parsing (a default, a run directory
    named inside a file, a run a command writes into)."""
    from ..errors import UsageError
    problem = path_problem(target, kind)
    if problem:
        space = "" if problem.startswith(":") else " "
        raise UsageError(f"harness {command}: {option} {target}{space}{problem}; valid: {what or VALID[kind]}")


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
    from ..sweep import MAX_SEED
    if not 0 <= args.seed <= MAX_SEED:
        raise UsageError(f"harness {command}: --seed {args.seed} must be an integer in 0..{MAX_SEED}")
    if getattr(args, "out", None) is not None:
        check_out_dir(args.out, command, "a directory for the runs: new, or existing and writable")


def check_out_dir(out: Path, command: str, advice: str) -> None:
    """UsageError unless `out` can be a directory this command writes (path_problem OUTPUT_DIR):
    it is one or does not exist yet, with no file on its way up (mkdir would fail), not a symbolic
    link to nowhere (mkdir would fail too), and writable (or its nearest existing ancestor)."""
    check_path(out, OUTPUT_DIR, command, "--out", advice)


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
