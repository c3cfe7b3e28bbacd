"""harness compare: two stored runs, cells matched by configuration, one verdict per cell
(stats/validation.py compare_runs), every matched cell's tests one family (Holm). --null RUN_C,
a run of the same cells that differs from RUN_A only in an implementation variable (seed, rng,
...), supplies the implementation null; it should have the design of the main comparison (on
the same data as RUN_A when RUN_A and RUN_B share it). Without a null a difference beyond the
margin is reported as inconclusive."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from stats.margins import ALPHA

from ..errors import UsageError
from ._args import add_margin_arguments, check_spread_margin, check_test_options, input_dir
from ..store import RESULTS_FILE, RunStore, cell_name

NAME = "compare"
HELP = "compare two stored runs cell by cell: one verdict per cell"
RUN = "a run directory (holding results.sqlite) you may read"


def add_arguments(p):
    p.add_argument("run_a", type=input_dir(RUN), metavar="RUN_A")
    p.add_argument("run_b", type=input_dir(RUN), metavar="RUN_B")
    p.add_argument("--null", type=input_dir(RUN), default=None, metavar="RUN_C",
                   help="a run differing from RUN_A only in an implementation variable (the null)")
    p.add_argument("--alpha", type=float, default=ALPHA,
                   help=f"family-wise level over every matched cell's tests (default {ALPHA})")
    add_margin_arguments(p)
    p.add_argument("--permutations", type=int, default=1000, help="energy-test permutations (default 1000)")
    p.add_argument("--seed", type=int, default=0, help="seed of the permutation draws (default 0)")
    p.add_argument("--json", action="store_true", help="print a JSON list, one object per cell")


def shared_cells(a, b):
    """The rows of trial frame a whose cell (CELL_COLUMNS) frame b also holds."""
    from kvcommon.rows import CELL_COLUMNS
    keys = b[list(CELL_COLUMNS)].drop_duplicates()
    return a.merge(keys, on=list(CELL_COLUMNS), how="inner")


def _trials(directory: Path):
    """The finished, sound cells' trials of a run: a damaged store refused (harness.store), a cell
    missing trials named on stderr and left out, as unfinished."""
    store = RunStore(directory)
    if not store.path.exists():
        raise UsageError(f"harness compare: {directory} holds no {RESULTS_FILE}; give a run directory")
    store.check_integrity()
    for line in store.check_trials():
        print(f"harness compare: {directory}: {line}", file=sys.stderr)
    return store.trials()


MIN_TRIALS = 3   # the fewest trials with a finite six-D point a comparison tests (stats.validation.compare_samples)


def _n_testable(x, y) -> tuple[int, bool]:
    """(the trials of cell frames x and y a comparison can use, whether they are paired): paired
    (stats.validation.same_data) the trials finite in the six-D point in both, else the fewer of
    each side's finite trials."""
    from kvcommon.rows import SIX_D
    from stats.validation import same_data

    def finite(frame):
        values = frame[list(SIX_D)].apply(pd.to_numeric, errors="coerce").to_numpy(dtype=float)
        return pd.Series(np.isfinite(values).all(axis=1), index=frame["trial"].to_numpy())
    fx, fy = finite(x), finite(y)
    if same_data(x, y):
        return int((fx & fy.reindex(fx.index, fill_value=False)).sum()), True
    return int(min(fx.sum(), fy.sum())), False


def testable_cells(a, b, null, names: tuple) -> tuple:
    """(a, b, null) without the matched cells that cannot be tested (fewer than MIN_TRIALS usable
    trials against RUN_B or the null: not finite, or too few), and one line per cell left out.
    UsageError when cells match but none can be tested."""
    from stats.validation import CELL_COLUMNS
    keys = list(CELL_COLUMNS)
    others = [dict(iter(b.groupby(keys))), dict(iter(null.groupby(keys))) if null is not None else {}]
    lines, drop = [], []
    for key, x in a.groupby(keys):
        if key not in others[0]:
            continue
        for other, name in zip(others, names[1:]):
            if key in other:
                n, paired = _n_testable(x, other[key])
                if n < MIN_TRIALS:
                    drop.append(key)
                    lines.append(f"left out: cell {cell_name(key)}: {n} {'paired ' if paired else ''}trial(s) with a "
                                 f"finite six-D point in {names[0]} and {name}; a comparison needs at least {MIN_TRIALS}")
                    break
    if drop and len(drop) == sum(key in others[0] for key in a.groupby(keys).groups):
        raise UsageError(f"harness compare: no matched cell can be tested ({len(drop)} left out; first "
                         f"{lines[0].removeprefix('left out: ')}); run more --trials, or restore the stores from a copy")
    if drop:
        gone = pd.MultiIndex.from_tuples(drop, names=keys)
        a, b = (f[~f.set_index(keys).index.isin(gone)] for f in (a, b))
        null = null[~null.set_index(keys).index.isin(gone)] if null is not None else None
    return a, b, null, lines


def run(args) -> int:
    from stats.validation import CELL_COLUMNS, TESTS, compare_runs, differing_variables

    check_test_options(args, "compare")
    check_spread_margin(args, "compare")
    a, b = _trials(args.run_a), _trials(args.run_b)
    null = _trials(args.null) if args.null is not None else None
    if null is not None and shared_cells(shared_cells(a, b), null).empty:
        raise UsageError(f"harness compare: --null {args.null} shares no cell with {args.run_a} and {args.run_b} "
                         f"(cells are matched on {', '.join(CELL_COLUMNS)}): it would judge nothing; give a run of "
                         f"the same cells")
    a, b, null, left_out = testable_cells(a, b, null, (args.run_a, args.run_b, args.null))
    for line in left_out:
        print(f"harness compare: {line}", file=sys.stderr)
    table = compare_runs(a, b, null, alpha=args.alpha, margin=args.margin, spread_margin=args.spread_margin,
                         n_permutations=args.permutations, seed=args.seed)
    if table.empty:
        raise UsageError(f"harness compare: {args.run_a} and {args.run_b} share no cell "
                         f"(cells are matched on {', '.join(CELL_COLUMNS)})")
    n_a = a.groupby(list(CELL_COLUMNS)).ngroups
    n_b = b.groupby(list(CELL_COLUMNS)).ngroups
    if args.json:
        print(json.dumps(table.to_dict(orient="records"), indent=2, default=float))
        return 0
    differ = differing_variables(a, b)
    dropped = f", {len(left_out)} left out: too few finite trials" if left_out else ""
    print(f"{len(table)} matched cells ({n_a - len(table)} only in RUN_A, {n_b - len(table)} only in RUN_B{dropped}); "
          f"runs differ in: {', '.join(differ) or 'no implementation variable'}; "
          f"null: {args.null if args.null else 'none'}; one family: Holm over {len(table) * len(TESTS)} tests "
          f"({len(table)} cells x {len(TESTS)}), margins {args.margin:g} sd, spread ratio {args.spread_margin:g}")
    several = table["calib_tokens"].nunique() > 1  # name the calibration size only then, as the report does
    for row in table.itertuples(index=False):
        cell = " ".join(f"{getattr(row, c)}" for c in CELL_COLUMNS if c != "calib_tokens")
        cell += f" n_cal={row.calib_tokens}" if several else ""
        bits = f"; bits {row.bits_a:.3g} vs {row.bits_b:.3g}" if row.bits_a == row.bits_a else ""
        print(f"{cell}: {row.verdict} (min Holm p {row.min_p_holm:.3g}, beyond the margin {row.min_p_holm_beyond:.3g}"
              f"{bits}) {row.reason}")
    return 0
