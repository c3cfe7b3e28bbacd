"""harness selftest: the known-answer benchmark of the verdict rule (harness/known_answers.py).
Bugs modelled on real ones, wrapped around the real codecs and registered for the benchmark only,
must come out `codec-difference` (or `negligible`, for those stated too small to matter), each
also as an installed plug-in that shares the codec's draws and one that does not; harmless
implementation changes must not; a 30-cell seed-only `compare` must have no `codec-difference`
cell. Prints the table of rates (Markdown) or JSON."""
from __future__ import annotations

import json
import os
import sys

from ..errors import UsageError
from ._args import output_file

NAME = "selftest"
HELP = "the known-answer benchmark: the rate of right verdicts on known bugs and harmless changes"


def add_arguments(p):
    p.add_argument("--quick", action="store_true",
                   help="the CI form: one repetition, S = 128, 40 trials, 500 permutations, no --workers case")
    p.add_argument("--repetitions", type=int, default=None,
                   help="repetitions of every case, each at its own root seed (default 10; 1 with --quick)")
    p.add_argument("--json", action="store_true", help="print the JSON payload instead of the table")
    p.add_argument("--out", type=output_file(), default=None, metavar="FILE", help="also write the JSON payload to FILE")


def run(args) -> int:
    from ..known_answers import QUICK, Settings, run_selftest, table_markdown

    repetitions = args.repetitions if args.repetitions is not None else (1 if args.quick else 10)
    if repetitions < 1:
        raise UsageError(f"harness selftest: --repetitions {repetitions} must be a positive integer")
    payload = run_selftest(QUICK if args.quick else Settings(), repetitions,
                           progress=lambda text: print(text, file=sys.stderr, flush=True))
    payload["command"] = "harness selftest" + (" --quick" if args.quick else "") + \
        (f" --repetitions {args.repetitions}" if args.repetitions is not None else "")
    text = json.dumps(payload, indent=2, default=float)
    if args.out is not None:
        partial = args.out.with_name(args.out.name + ".tmp")   # written whole, then renamed: never half a file
        partial.write_text(text + "\n")
        os.replace(partial, args.out)
    print(text if args.json else table_markdown(payload))
    return 0
