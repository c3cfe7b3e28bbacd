"""Argument parsing helpers shared by the commands."""
from __future__ import annotations

import argparse
from typing import Callable


def comma_list(kind, names: Callable[[], list[str]] | None = None, check: Callable[[str], None] | None = None):
    """An argparse type for comma-separated lists. With `names`, 'all' expands to every name and
    each item must be a name, or pass `check` (which raises ValueError naming what is valid)."""
    def parse(text: str):
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"empty list {text!r}")
        if kind is int:
            try:
                return tuple(int(x) for x in items)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
        if names is not None:
            valid = names()
            if items == ["all"]:
                return tuple(valid)
            for x in items:
                if x in valid:
                    continue
                if check is None:
                    raise argparse.ArgumentTypeError(f"unknown name {x!r}; available: all, {', '.join(valid)}")
                try:
                    check(x)
                except ValueError as exc:
                    raise argparse.ArgumentTypeError(str(exc)) from None
        return tuple(items)
    return parse


def check_test_options(args, command: str) -> None:
    """--alpha, --margin and --permutations of the commands that run statistical tests."""
    from ..errors import UsageError
    if not 0 < args.alpha < 1:
        raise UsageError(f"harness {command}: --alpha {args.alpha} must lie in (0, 1)")
    if not args.margin > 0:
        raise UsageError(f"harness {command}: --margin {args.margin} must be positive")
    if args.permutations < 1:
        raise UsageError(f"harness {command}: --permutations {args.permutations} must be a positive integer")
