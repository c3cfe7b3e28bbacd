"""harness export: a run's trials as CSV or Parquet."""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import UsageError
from ..store import RESULTS_FILE, RunStore

NAME = "export"
HELP = "write a run's trials as CSV or Parquet"


def add_arguments(p):
    p.add_argument("directory", type=Path)
    p.add_argument("--format", choices=("csv", "parquet"), default="csv")
    p.add_argument("--output", type=Path, default=None, help="file to write (default DIR/results.FORMAT)")


def run(args) -> int:
    store = RunStore(args.directory)
    if not store.path.exists():
        raise UsageError(f"harness export: {args.directory} holds no {RESULTS_FILE}; give a run directory")
    output = args.output or args.directory / f"results.{args.format}"
    if output.is_dir():
        raise UsageError(f"harness export: --output {output} is a directory; give a file name")
    if not output.parent.is_dir():
        raise UsageError(f"harness export: --output {output}: the directory {output.parent} does not exist")
    store.check_integrity()
    frame = store.trials()  # the finished cells only
    # written under a temporary name and renamed, so the output is never half-written; the
    # temporary file goes whatever happens (an error, Ctrl-C)
    tmp = output.with_name(f".{output.name}.{os.getpid()}.tmp")
    try:
        if args.format == "csv":
            frame.to_csv(tmp, index=False)
        else:
            try:
                frame.to_parquet(tmp, index=False)
            except ImportError as exc:
                raise UsageError(f"harness export: parquet needs pyarrow ({exc}); pip install pyarrow") from None
        tmp.replace(output)
    finally:
        tmp.unlink(missing_ok=True)
    print(f"{len(frame)} rows -> {output}")
    return 0
