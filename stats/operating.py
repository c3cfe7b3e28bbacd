"""Operating characteristics of the verdict rule (stats/validation.py) on resampled REAL
per-trial rows: how often each verdict comes out when the change is harmless (false alarms),
and how many trials a known injected effect needs to be called a codec-difference (power).

Rows. tests/data/operating_rows.npz (written by `python -m harness.operating_rows`, through the
harness's runner; its JSON beside it records the command and machine): heavy_tail, six codecs
of different families at b = 2 and 3, d = 64, S = 256, 400 trials per cell, in a base run and
in five runs that each change one harmless variable (HARMLESS): seed and RNG family draw other
data (unpaired with the base), dtype, the reference implementation and the torch thread count
run on the base's data trial by trial (paired).

Resampling. A repetition at n trials takes, for one (change, codec, budget) cell, 2n of the
cell's trials WITHOUT replacement and splits them: the main comparison base[I] vs changed[J]
and its null, the same harmless change on other trials, base[K] vs changed[L] (I, K disjoint;
paired: J = I and L = K, the samples share their data key; unpaired: J, L drawn the same way
independently). The null is like for like: the same design, the same change, independent data.
A subsample drawn without replacement from an i.i.d. sample is itself an i.i.d. sample of the
true distribution, so each repetition is distributed exactly as a fresh experiment of n trials
(a bootstrap with replacement would add ties and the difference between the two 400-trial
pools as if it were real: at n = 200 a Welch test on it would reject ~11 % instead of 5 %).
Repetitions of one cell share its 400 trials, so rates at n = 200 (every trial used) vary
less between repetitions than between cells: the cells (twelve per change) are the
independent units. Repetition r uses cell r mod (number of cells), so every codec counts alike.

Injected effects (EFFECTS), applied to the changed side of the main comparison only, on the
cell's whole 400-trial pool before resampling (m = the pool's per-metric mean, sd its
standard deviation): a mean shift by a fraction δ of the mean, y + δ·m (on all six metrics,
or on snr_err_t and dir_err_t only), which moves the mean by δ·m and keeps the spread; a
spread change y ↦ m + k·(y − m), which keeps the mean and multiplies the standard deviation by
k (in a paired comparison the per-trial differences then have mean 0 and sd (k − 1)·sd).
Power is the rate of `codec-difference`; the trials needed for 80 % power is the smallest n
of the grid whose rate reaches 80 % (None: not within the grid).

    python -m stats.operating [--repetitions R] [--permutations P] [--ns 30,60,100,200]
                              [--seed S] [--margin M] [--json docs/data/operating.json]

prints the README's tables (table_markdown) and writes the results as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .levels import ALPHA
from .metrics import SIX_D
from .validation import VERDICTS, TrialSample, validate_samples

ROOT = Path(__file__).resolve().parents[1]
ROWS = ROOT / "tests" / "data" / "operating_rows.npz"
JSON = ROOT / "docs" / "data" / "operating.json"
HARMLESS = ("seed", "rng", "dtype", "impl", "threads")
NS = (30, 60, 100, 200)
T_ONLY = tuple(j for j, m in enumerate(SIX_D) if m.endswith("_t"))
# effect name -> (kind, size, coordinates): "shift" adds size·mean, "spread" scales deviations by size
EFFECTS = {
    "shift 1 %": ("shift", 0.01, None), "shift 2 %": ("shift", 0.02, None), "shift 5 %": ("shift", 0.05, None),
    "T shift 1 %": ("shift", 0.01, T_ONLY), "T shift 2 %": ("shift", 0.02, T_ONLY),
    "T shift 5 %": ("shift", 0.05, T_ONLY), "spread x1.5": ("spread", 1.5, None),
}
POWER = 0.80


# --- the rows -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Pair:
    """One harmless-change cell: the base run's rows x and the changed run's rows y (trials, 6)
    of one codec and budget; paired when both ran on the same data trial by trial."""
    change: str
    codec: str
    budget: int
    x: np.ndarray
    y: np.ndarray
    paired: bool


def load_pairs(path: Path = ROWS) -> list[Pair]:
    """The harmless-change cells of the stored rows (module doc), float64; a paired run's
    stored difference is added back to the base."""
    with np.load(path) as z:
        values, runs, data = z["values"].astype(np.float64), list(z["runs"]), list(z["data"])
        difference, codecs, budgets = z["difference"], list(z["codecs"]), [int(b) for b in z["budgets"]]
        if tuple(z["metrics"]) != SIX_D:
            raise ValueError(f"{path}: metrics {tuple(z['metrics'])} are not stats.metrics.SIX_D {SIX_D}")
    base = values[runs.index("base")]
    cells = [(c, b) for c in codecs for b in budgets]
    pairs = []
    for r, change in enumerate(runs):
        if change == "base":
            continue
        for i, (codec, budget) in enumerate(cells):
            y = base[i] + values[r, i] if difference[r] else values[r, i]
            if np.isnan(y).all():
                continue  # a cell the run lacks (no reference implementation of this codec)
            pairs.append(Pair(change, str(codec), budget, base[i], y, data[r] == data[runs.index("base")]))
    return pairs


# --- resampling and injection ---------------------------------------------------------------
def resample(gen: np.random.Generator, n_total: int, n: int, paired: bool) -> tuple:
    """Trial indices (I, J, K, L) of one repetition (module doc): main base[I] vs changed[J],
    null base[K] vs changed[L]; I and K disjoint, J and L disjoint, each of n trials drawn
    without replacement; paired: J = I and L = K."""
    if 2 * n > n_total:
        raise ValueError(f"n = {n} trials per side needs {2 * n} of the cell's trials (main and null on "
                         f"disjoint trials), but it has {n_total}")
    first = gen.permutation(n_total)[: 2 * n]
    second = first if paired else gen.permutation(n_total)[: 2 * n]
    return first[:n], second[:n], first[n:], second[n:]


def samples(pair: Pair, indices: tuple, y: np.ndarray | None = None) -> tuple:
    """(main x, main y), (null x, null y) as TrialSamples from resample's indices; `y`, the
    changed side's rows of the main comparison (default pair.y: an injected effect goes there).
    A sample's key is (run's data, its trial indices): paired samples share theirs."""
    i, j, k, l = indices
    data_x, data_y = ("base",) * 2 if pair.paired else ("base", pair.change)
    y = pair.y if y is None else y

    def sample(rows, data, idx):
        return TrialSample((data, tuple(idx.tolist())), rows[idx])
    return ((sample(pair.x, data_x, i), sample(y, data_y, j)),
            (sample(pair.x, data_x, k), sample(pair.y, data_y, l)))


def inject(rows: np.ndarray, effect: str) -> np.ndarray:
    """rows (trials, 6) with EFFECTS[effect] applied (module doc): a shift adds size·mean to
    the chosen coordinates; a spread change maps y to mean + size·(y − mean)."""
    kind, size, columns = EFFECTS[effect]
    columns = list(range(rows.shape[1])) if columns is None else list(columns)
    out = rows.copy()
    mean = rows[:, columns].mean(axis=0)
    if kind == "shift":
        out[:, columns] += size * mean
    else:
        out[:, columns] = mean + size * (rows[:, columns] - mean)
    return out


# --- the study ------------------------------------------------------------------------------
def study(pairs: list[Pair], *, ns=NS, effects=tuple(EFFECTS), repetitions: int = 48, n_permutations: int = 199,
          alpha: float = ALPHA, margin: float | None = None, seed: int = 0, changes=HARMLESS) -> dict:
    """The verdict counts of every (change, n): for no effect (the false alarms: each verdict,
    also per codec and budget) and for each injected effect (codec-differences). Each (change,
    n) draws from its own stream (seed, change, n), and every effect is judged on the same
    subsamples, so its numbers do not depend on which others are computed."""
    options = {"alpha": alpha, "n_permutations": n_permutations}
    if margin is not None:
        options["margin"] = margin
    null, power = [], []
    for c, change in enumerate(changes):
        cells = [p for p in pairs if p.change == change]
        if not cells:
            continue
        injected = {e: [inject(p.y, e) for p in cells] for e in effects}
        for n in ns:
            gen = np.random.default_rng([seed, HARMLESS.index(change) if change in HARMLESS else 100 + c, n])
            counts: dict = {}
            per_cell: dict = {}
            hits = dict.fromkeys(effects, 0)
            for r in range(repetitions):
                i = r % len(cells)
                pair = cells[i]
                indices = resample(gen, len(pair.x), n, pair.paired)
                permutation_seed = int(gen.integers(2 ** 31))
                (mx, my), null_pair = samples(pair, indices)
                verdict = validate_samples(mx, my, [null_pair], seed=permutation_seed, **options).verdict
                counts[verdict] = counts.get(verdict, 0) + 1
                cell_counts = per_cell.setdefault((pair.codec, pair.budget), {})
                cell_counts[verdict] = cell_counts.get(verdict, 0) + 1
                for e in effects:
                    (mx, my), null_pair = samples(pair, indices, injected[e][i])
                    hits[e] += validate_samples(mx, my, [null_pair], seed=permutation_seed,
                                                **options).verdict == "codec-difference"
            design = "paired" if cells[0].paired else "unpaired"
            null.append({"change": change, "design": design, "n": n, "repetitions": repetitions,
                         "counts": counts, "cells": [{"codec": k[0], "budget": k[1], "counts": v}
                                                     for k, v in per_cell.items()]})
            power.extend({"change": change, "design": design, "effect": e, "n": n, "repetitions": repetitions,
                          "codec_difference": hits[e]} for e in effects)
    verdicts = list(VERDICTS) + sorted({v for row in null for v in row["counts"]} - set(VERDICTS))
    return {"verdicts": verdicts, "ns": list(ns), "effects": list(effects), "repetitions": repetitions,
            "permutations": n_permutations, "alpha": alpha, "margin": margin, "seed": seed,
            "null": null, "power": power, "trials_for_power": trials_for_power(power, POWER)}


def trials_for_power(power: list[dict], target: float = POWER) -> list[dict]:
    """Per (effect, change): the smallest n whose codec-difference rate reaches `target`
    (None when no n of the grid does) and the rate at the largest n."""
    out = []
    for key in dict.fromkeys((row["effect"], row["change"]) for row in power):
        rows = sorted((row for row in power if (row["effect"], row["change"]) == key), key=lambda row: row["n"])
        rates = [row["codec_difference"] / row["repetitions"] for row in rows]
        reached = [row["n"] for row, rate in zip(rows, rates) if rate >= target]
        out.append({"effect": key[0], "change": key[1], "n": reached[0] if reached else None,
                    "largest_n": rows[-1]["n"], "rate_at_largest_n": rates[-1]})
    return out


# --- output ---------------------------------------------------------------------------------
def table_markdown(payload: dict) -> str:
    """The README's tables from the study's JSON: the false-alarm rate of each verdict per
    harmless change and n (%), and the trials needed for 80 % power per injected effect and
    harmless change ("> N (r %)": not reached at the largest n, where the rate was r)."""
    verdicts = payload["verdicts"]
    lines = ["| harmless change | design | n | " + " | ".join(verdicts) + " |",
             "|---|---|---|" + "---|" * len(verdicts)]
    for row in payload["null"]:
        rates = " | ".join(f"{100 * row['counts'].get(v, 0) / row['repetitions']:.0f}" for v in verdicts)
        lines.append(f"| {row['change']} | {row['design']} | {row['n']} | {rates} |")
    changes = list(dict.fromkeys(row["change"] for row in payload["trials_for_power"]))
    needed = {(row["effect"], row["change"]): row for row in payload["trials_for_power"]}
    lines += ["", f"| injected effect | {' | '.join(changes)} |", "|---|" + "---|" * len(changes)]
    for effect in dict.fromkeys(row["effect"] for row in payload["trials_for_power"]):
        cells = []
        for change in changes:
            row = needed.get((effect, change))
            cells.append("–" if row is None else str(row["n"]) if row["n"] is not None
                         else f"> {row['largest_n']} ({100 * row['rate_at_largest_n']:.0f} %)")
        lines.append(f"| {effect} | {' | '.join(cells)} |")
    return "\n".join(lines)


def machine() -> dict:
    """CPU model, core count and `uptime` (load) of this machine."""
    model = ""
    try:
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), "")
    except OSError:
        pass
    try:
        load = subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        load = ""
    return {"cpu": model, "cores": os.cpu_count(), "uptime": load}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m stats.operating", description=__doc__.splitlines()[0])
    p.add_argument("--repetitions", type=int, default=48, help="repetitions per harmless change and n (default 48)")
    p.add_argument("--permutations", type=int, default=199, help="energy-test permutations (default 199)")
    p.add_argument("--ns", default=",".join(map(str, NS)), help=f"trial counts (default {','.join(map(str, NS))})")
    p.add_argument("--seed", type=int, default=0, help="root seed of the study (default 0)")
    p.add_argument("--margin", type=float, default=None, help="the rule's margin (default: the rule's own)")
    p.add_argument("--rows", type=Path, default=ROWS, help=f"the stored rows (default {ROWS.relative_to(ROOT)})")
    p.add_argument("--json", type=Path, default=JSON, help=f"where to write the results (default "
                   f"{JSON.relative_to(ROOT)}; '-' writes none)")
    args = p.parse_args(argv)

    def usage(message: str) -> int:
        print(f"python -m stats.operating: {message}", file=sys.stderr)
        return 2
    try:
        ns = tuple(int(x) for x in args.ns.split(","))
    except ValueError:
        return usage(f"--ns {args.ns!r} must be comma-separated integers, e.g. 30,60,100,200")
    if args.repetitions < 1:
        return usage(f"--repetitions {args.repetitions} must be at least 1")
    if not args.rows.is_file():
        return usage(f"--rows {args.rows} does not exist; write it with python -m harness.operating_rows")
    pairs = load_pairs(args.rows)
    n_total = min(len(pair.x) for pair in pairs)
    if min(ns) < 3 or 2 * max(ns) > n_total:
        return usage(f"--ns {args.ns}: every n must lie in 3..{n_total // 2} (main and null take 2n of a "
                     f"cell's {n_total} trials)")
    import torch
    torch.set_num_threads(1)  # thousands of small energy tests: thread hand-offs cost more than the work
    before, start = machine(), time.perf_counter()
    payload = study(pairs, ns=ns, repetitions=args.repetitions, n_permutations=args.permutations,
                    margin=args.margin, seed=args.seed)
    payload.update(command="python -m stats.operating " + " ".join(sys.argv[1:] if argv is None else argv),
                   rows=str(args.rows.relative_to(ROOT) if args.rows.is_relative_to(ROOT) else args.rows),
                   seconds=round(time.perf_counter() - start, 1), machine=before, machine_after=machine())
    if str(args.json) != "-":
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"{payload['command']}: {args.repetitions} repetitions per harmless change and n, {args.permutations} "
          f"permutations, {payload['seconds']} s on {before['cores']} x {before['cpu']} "
          f"(load: {before['uptime']} -> {payload['machine_after']['uptime']})\n")
    print(table_markdown(payload))
    return 0


# --- constructed draws (tests/test_validation.py) -----------------------------------------
LOCATION = 10.0
SHIFTED = "dir_err_k"


def draw(gen: np.random.Generator, codec_shift: float, impl_shift: float, *, n: int = 40, paired: bool = False,
         correlation: float = 0.7) -> tuple:
    """Constructed samples (not real rows), one repetition: (A, B, [(A, A′), (B, B′)]) as
    TrialSamples, N(LOCATION, 1) per coordinate, B = A + codec_shift and A′, B′ shifted by
    impl_shift on SHIFTED. Paired samples share their data key and a per-trial component
    (every coordinate correlated `correlation` between samples); unpaired ones are independent."""
    j = SIX_D.index(SHIFTED)
    shifts = {"a": 0.0, "b": codec_shift, "a2": impl_shift, "b2": codec_shift + impl_shift}
    shared = gen.standard_normal((n, len(SIX_D))) if paired else None
    made = {}
    for k, (name, shift) in enumerate(shifts.items()):
        noise = gen.standard_normal((n, len(SIX_D)))
        values = np.sqrt(correlation) * shared + np.sqrt(1 - correlation) * noise if paired else noise
        values = values + LOCATION
        values[:, j] += shift
        made[name] = TrialSample(("constructed", 0 if paired else k, tuple(range(n))), values)
    a, b = made["a"], made["b"]
    return a, b, [(a, made["a2"]), (b, made["b2"])]


if __name__ == "__main__":
    sys.exit(main())
