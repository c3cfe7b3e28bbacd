"""harness export: a run's trials as CSV or Parquet."""
from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

from ..errors import UsageError
from ..store import LOCK_FILE, MANIFEST_FILE, RESULTS_FILE, RunStore
from ._args import OUTPUT_FILE, check_path, input_dir, output_file

NAME = "export"
HELP = "write a run's trials as CSV or Parquet"


def add_arguments(p):
    p.add_argument("directory", type=input_dir("a run directory (holding results.sqlite) you may read"))
    p.add_argument("--format", choices=("csv", "parquet"), default="csv")
    p.add_argument("--output", type=output_file(), default=None, help="file to write (default DIR/results.FORMAT)")


# The files a run directory's own commands write (run, report; sqlite's side files): never an
# export's output, in this run or another (results.csv and results.parquet are export's own).
RUN_FILES = (RESULTS_FILE, f"{RESULTS_FILE}-journal", f"{RESULTS_FILE}-wal", f"{RESULTS_FILE}-shm", MANIFEST_FILE,
             f"{MANIFEST_FILE}.tmp", LOCK_FILE, "report.html", "report.pdf", "report.png")


def _not_regular(path: Path) -> bool:
    """Whether something other than a regular file is at `path` (a device, a FIFO, a directory)."""
    try:
        return not stat.S_ISREG(os.stat(path).st_mode)
    except FileNotFoundError:
        return False


def check_output(directory: Path, output: Path) -> Path:
    """The file to write (`output` with its symbolic links resolved, so that the rename replaces
    the file and not the link), or UsageError when it is a run's own file (RUN_FILES of a
    directory holding a run, or this run's files under another name) or not a regular file."""
    target = Path(os.path.realpath(output))
    if target.is_dir():
        raise UsageError(f"harness export: --output {output} is a directory; give a file name")
    if not target.parent.is_dir():
        raise UsageError(f"harness export: --output {output}: the directory {target.parent} does not exist")
    own = [directory / name for name in RUN_FILES if (directory / name).exists()]
    is_run = any((target.parent / name).exists() for name in (RESULTS_FILE, MANIFEST_FILE))
    if (is_run and target.name in RUN_FILES) or (target.exists() and any(os.path.samefile(target, f) for f in own)):
        raise UsageError(f"harness export: --output {output} is a file of the run in {target.parent} "
                         f"({', '.join(RUN_FILES[:1] + RUN_FILES[4:])} are the run's own); give another file name")
    if _not_regular(target):
        raise UsageError(f"harness export: --output {output} is not a regular file (a device, FIFO or socket); "
                         f"give a file name")
    # the default DIR/results.FORMAT in a read-only run too, before the trials are read
    check_path(output, OUTPUT_FILE, "export", "--output", "give --output FILE in a directory you may write to")
    return target


def run(args) -> int:
    store = RunStore(args.directory)
    if not store.path.exists():
        raise UsageError(f"harness export: {args.directory} holds no {RESULTS_FILE}; give a run directory")
    shown = args.output or args.directory / f"results.{args.format}"
    output = check_output(args.directory, shown)
    store.check_integrity()
    for line in store.check_trials():   # duplicated or orphaned rows refused; a cell missing trials named
        print(f"harness export: {line}", file=sys.stderr)
    frame = store.trials()  # the finished, sound cells only
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
        if _not_regular(output):   # made since the check: never renamed over
            raise UsageError(f"harness export: --output {output} is no longer a regular file; nothing written")
        tmp.replace(output)
    finally:
        tmp.unlink(missing_ok=True)
    print(f"{len(frame)} rows -> {shown}")
    return 0
