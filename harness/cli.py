"""python -m harness COMMAND: the command line of kvharness.

Each command is one module in harness/commands/ defining NAME, HELP, add_arguments(parser)
and run(args) -> exit status; the CLI discovers them, so a new command is one new file.
Exit status: 0 success; 2 usage error (one line naming what is wrong and what is valid,
nothing written), or a run directory the store refuses (harness.store.StoreError, one line);
1 any other failure; 130 interrupted by Ctrl-C, 143 by SIGTERM (a run keeps every stored chunk).
"""
from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import signal
import sys

from . import commands
from .commands._args import plain_number
from .errors import UsageError
from .store import StoreError

ORDER = ("list", "run", "report", "export")  # shown first in --help; the rest follow alphabetically
# time.perf_counter() at the process's first instruction, set by the early entry (harness/__main__.py:
# python -m harness and the kvharness script); None where main is called otherwise
STARTED_AT: float | None = None


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for kind in (int, float):   # every type=int and type=float reads ASCII digits only
            self.register("type", kind, plain_number(kind))

    def error(self, message):  # one line, no usage dump
        raise UsageError(f"{self.prog}: {message}")


def _command_modules(only: str | None = None):
    """The command modules (a module's file name is its command's NAME), sorted for --help; only
    `only`'s where that names one: a command imports what it uses, not what every command uses
    (`harness report` needs no torch)."""
    names = [m.name for m in pkgutil.iter_modules(commands.__path__) if not m.name.startswith("_")]
    mods = [importlib.import_module(f"{commands.__name__}.{name}") for name in names if only in (None, name)]
    rank = {name: i for i, name in enumerate(ORDER)}
    return sorted(mods, key=lambda m: (rank.get(m.NAME, len(ORDER)), m.NAME))


def build_parser(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, dict]:
    """The parser of every command, or, where argv starts with a command's name, of that one."""
    names = {m.name for m in pkgutil.iter_modules(commands.__path__) if not m.name.startswith("_")}
    only = argv[0] if argv and argv[0] in names else None
    parser = _Parser(prog="harness", description="kvharness: statistical validation of KV-cache codecs")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    handlers = {}
    for mod in _command_modules(only):
        mod.add_arguments(sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP))
        handlers[mod.NAME] = mod.run
    return parser, handlers


def main(argv: list[str] | None = None) -> int:
    try:
        argv = sys.argv[1:] if argv is None else argv
        parser, handlers = build_parser(argv)
        args = parser.parse_args(argv)
        return handlers[args.command](args)
    except (UsageError, StoreError) as exc:   # bad input, or a run directory that cannot be used as asked
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:   # Ctrl-C, or SIGTERM (harness/__main__.py raises Interrupted)
        print("interrupted: a run keeps every chunk of trials it stored; rerun it with --resume to finish", file=sys.stderr)
        return 128 + getattr(exc, "signum", signal.SIGINT)
    except Exception as exc:  # any other failure: one line, exit 1 (the traceback on request)
        if os.environ.get("KVHARNESS_DEBUG"):
            raise
        print(f"error: {type(exc).__name__}: {exc} (set KVHARNESS_DEBUG=1 for the traceback)".replace("\n", " "),
              file=sys.stderr)
        return 1
