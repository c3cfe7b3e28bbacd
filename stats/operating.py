"""Operating characteristics of the verdict rule (stats/validation.py): how often each verdict
comes out under constructed truths, measured by simulation.

A study cell is (codec shift c, implementation shift i, pairing), both shifts in standard
deviations of one six-D coordinate. Each repetition draws four trial frames of n trials:
A, B = A + c (the main comparison A vs B), A′ = A + i and B′ = B + i (the null comparisons
A vs A′ and B vs B′, as `harness validate --against` builds them), and applies
validate_samples. Coordinates are N(LOCATION, 1): the ±10 % equivalence margin is one
standard deviation. Unpaired: the four frames are independent draws with different seeds.
Paired: they ran on the same data (same seed, same trials: same_data is true) and share a
per-trial component, every coordinate correlated `correlation` between frames.

    python -m stats.operating [--repetitions R] [--permutations P] [--n N] [--seed S]

prints the table of verdict rates (markdown) that README.md shows.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
import pandas as pd

from .levels import ALPHA
from .metrics import SIX_D
from .validation import VERDICTS, TrialSample, validate_samples

CODEC_SHIFTS = (0.0, 0.5, 1.0, 2.0, 3.0)
IMPLEMENTATION_SHIFTS = (0.0, 0.5, 1.0, 2.0, 3.0)
LOCATION = 10.0
SHIFTED = "dir_err_k"  # the coordinate both shifts move (any one would do: the rule is symmetric in them)


def draw(gen: np.random.Generator, codec_shift: float, impl_shift: float, *, n: int = 40, paired: bool = False,
         correlation: float = 0.7) -> tuple:
    """One repetition: (A, B, [(A, A′), (B, B′)]) as TrialSamples (module doc). Paired samples
    share their data key (as frames with equal seed, rng, ... and trials would); unpaired ones
    get one key each."""
    j = SIX_D.index(SHIFTED)
    shifts = {"a": 0.0, "b": codec_shift, "a2": impl_shift, "b2": codec_shift + impl_shift}
    shared = gen.standard_normal((n, len(SIX_D))) if paired else None
    samples = {}
    for k, (name, shift) in enumerate(shifts.items()):
        noise = gen.standard_normal((n, len(SIX_D)))
        values = np.sqrt(correlation) * shared + np.sqrt(1 - correlation) * noise if paired else noise
        values = values + LOCATION
        values[:, j] += shift
        key = ("constructed", 0 if paired else k, tuple(range(n)))
        samples[name] = TrialSample(key, values)
    a, b = samples["a"], samples["b"]
    return a, b, [(a, samples["a2"]), (b, samples["b2"])]


def operating_characteristics(cells=None, *, repetitions: int = 100, n: int = 40, pairings=(False, True),
                              correlation: float = 0.7, alpha: float = ALPHA, n_permutations: int = 199,
                              seed: int = 0) -> pd.DataFrame:
    """The verdict rates of study cells: `cells` is a list of (codec shift c, implementation
    shift i), default every pair of CODEC_SHIFTS × IMPLEMENTATION_SHIFTS. One row per (paired,
    c, i) with the repetitions and the rate of each verdict (columns named as VERDICTS). Each
    cell draws from its own stream (seed, paired, c, i), so its rates do not depend on which
    other cells are computed."""
    if cells is None:
        cells = [(c, i) for c in CODEC_SHIFTS for i in IMPLEMENTATION_SHIFTS]
    rows = []
    for paired in pairings:
        for c, i in cells:
            gen = np.random.default_rng([seed, int(paired), int(round(100 * c)), int(round(100 * i))])
            counts = dict.fromkeys(VERDICTS, 0)
            for _ in range(repetitions):
                a, b, nulls = draw(gen, c, i, n=n, paired=paired, correlation=correlation)
                verdict = validate_samples(a, b, nulls, alpha=alpha, n_permutations=n_permutations,
                                           seed=int(gen.integers(2 ** 31))).verdict
                counts[verdict] += 1
            rows.append({"paired": paired, "codec_shift": c, "impl_shift": i, "repetitions": repetitions,
                         **{v: counts[v] / repetitions for v in VERDICTS}})
    return pd.DataFrame(rows)


def markdown(table: pd.DataFrame) -> str:
    """The table as a markdown grid: a row per (pairing, c), a column per i, each cell the
    percentages of codec-difference / implementation-variance / equivalent / inconclusive
    ("–" for a cell not computed)."""
    shifts = sorted(table["impl_shift"].unique())
    lines = ["| pairing | c \\ i | " + " | ".join(f"{i:g}" for i in shifts) + " |",
             "|---|---|" + "---|" * len(shifts)]
    rates = {(r["paired"], r["codec_shift"], r["impl_shift"]): " / ".join(f"{100 * r[v]:.0f}" for v in VERDICTS)
             for r in table.to_dict("records")}
    for paired in sorted(table["paired"].unique()):
        for c in sorted(table.loc[table["paired"] == paired, "codec_shift"].unique()):
            cells = " | ".join(rates.get((paired, c, i), "–") for i in shifts)
            lines.append(f"| {'paired' if paired else 'unpaired'} | {c:g} | {cells} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m stats.operating", description=__doc__.splitlines()[0])
    p.add_argument("--repetitions", type=int, default=100, help="repetitions per cell (default 100)")
    p.add_argument("--permutations", type=int, default=199, help="energy-test permutations (default 199)")
    p.add_argument("--n", type=int, default=40, help="trials per frame (default 40)")
    p.add_argument("--seed", type=int, default=0, help="root seed of the study (default 0)")
    args = p.parse_args(argv)
    import torch
    torch.set_num_threads(1)  # thousands of tiny energy tests: thread hand-offs cost more than the work
    print(f"Each cell: % {' / '.join(VERDICTS)} of {args.repetitions} repetitions, n = {args.n} trials per "
          f"frame, {args.permutations} permutations, seed {args.seed}.\n")
    print(markdown(operating_characteristics(repetitions=args.repetitions, n=args.n,
                                             n_permutations=args.permutations, seed=args.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
