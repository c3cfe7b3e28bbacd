"""harness reproduce amd-paper: run what each claim of the AMD paper needs and report every claim
as reproduced / partly / refuted / inconclusive with its statistic (harness/reproduce.py, stats/claims/)."""
from __future__ import annotations

import argparse
import time
from datetime import datetime
from pathlib import Path

from stats.margins import ALPHA

from ..devices import DEVICES
from ..errors import UsageError
from ..store import RESULTS_FILE
from ._args import OUTPUT_DIR, check_path, output_dir

NAME = "reproduce"
HELP = "run what each claim of a paper needs and judge every claim (reproduced / partly / refuted / inconclusive)"


def add_arguments(p):
    from ..reproduce import TARGETS
    p.add_argument("target", choices=TARGETS,
                   help="the paper: amd-paper (Ablation Studies, Statistical Inference, and KV-Cache Compression "
                        "Validation; AMD)")
    p.add_argument("--quick", action="store_true",
                   help="a reduced grid for a 2-core CPU (30 trials, d 64/128, S 256, b 2-4; about two minutes); "
                        "default: the paper's §3 grid (200 trials, d 64/128/256, b 2..7, n_cal 512) at S 1024")
    p.add_argument("--size", choices=("tiny", "quick", "paper"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", type=output_dir, default=None, help="run directory (default runs/amd-paper-<time>)")
    p.add_argument("--resume", action="store_true", help="finish an interrupted reproduction in --out")
    p.add_argument("--seed", type=int, default=0, help="root seed (default 0)")
    p.add_argument("--device", choices=DEVICES, default="auto", help="auto (default), cpu or cuda")
    p.add_argument("--workers", type=int, default=None, help="run cells on a local Dask cluster of N workers")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args) -> int:
    from stats.claims import VERDICTS, format_claims

    from ..reproduce import check, reproduce, sizes
    from ..runner import RunConflict

    if args.quick and args.size not in (None, "quick"):
        raise UsageError(f"harness reproduce: give --quick or --size {args.size}, not both")
    size = sizes()[args.size or ("quick" if args.quick else "paper")]
    if args.workers is not None and args.workers < 1:
        raise UsageError(f"harness reproduce: --workers {args.workers} must be a positive integer")
    if args.seed < 0:
        raise UsageError(f"harness reproduce: --seed {args.seed} must be a non-negative integer")
    try:
        check(size, seed=args.seed, device=args.device)
    except ValueError as exc:
        raise UsageError(f"harness reproduce: {exc}") from None
    if args.out is None:   # --out itself passed the door (output_dir) as it was parsed
        check_path(Path("runs"), OUTPUT_DIR, "reproduce", "--out's default",
                   "give --out DIR, a directory you may write to")
    out = args.out or Path("runs") / f"{args.target}-{datetime.now():%Y%m%d-%H%M%S}"
    print(f"harness reproduce {args.target}, size {size.name}; reduced from the paper: {size.reduced}")
    start = time.perf_counter()
    try:
        claims = reproduce(size, out, resume=args.resume, seed=args.seed, device=args.device, workers=args.workers,
                           progress=False if args.quiet else None)
    except RunConflict as exc:
        raise UsageError(f"harness reproduce: {exc}") from None
    from .report import write_report
    html_path, pdf_path = write_report(out)
    print(f"report -> {html_path} and {pdf_path}")
    print(f"claims (alpha {ALPHA}, Holm within each claim; effect [95 % CI]):")
    print(format_claims(claims))
    counts = claims.verdict.value_counts()
    print("verdicts: " + ", ".join(f"{int(counts.get(v, 0))} {v}" for v in VERDICTS)
          + f"; {time.perf_counter() - start:.0f} s -> {out / RESULTS_FILE} (tables claims, claim_tests); "
            f"harness report {out} --json includes them")
    return 0
