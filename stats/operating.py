"""Operating characteristics of the verdict rule (stats/validation.py) on resampled REAL
per-trial rows: how often each verdict comes out when the change is harmless (false alarms),
and how many trials a known injected effect needs to be called a codec-difference (power).

Rows. tests/data/operating_rows.npz (written by `python -m harness.operating_rows`, through the
harness's runner; its JSON beside it records the command and machine): heavy_tail, six codecs
of different families at b = 2 and 3, d = 64, S = 256, 400 trials per cell, in a base run, in
five runs that each change one harmless variable (HARMLESS): seed and RNG family draw other
data (unpaired with the base), dtype, the reference implementation and the torch thread count
run on the base's data trial by trial (paired); and in the runs of their nulls (NULL_OF).

Nulls, like for like, as `harness validate` builds them (harness/commands/validate.py): a
change that keeps the data (dtype, impl, threads) is judged against the codecs' own seed
changed on the same data (paired, scheme_seed); one that draws other data (seed, rng) against
the root seed changed (unpaired; seed + 2 for the seed, + 1 for the RNG). The main comparison
is base vs changed, the null base vs null run, both on the same base sample.

Resampling. A repetition at n trials draws, for one (change, codec, budget) cell, n trials
WITHOUT replacement from each pool of 400 it uses: base[I] vs changed[J] (main) and base[I] vs
null[K] (null); J = I when the change keeps the data, K = I when the null does (the samples
then share their data key: paired), else drawn independently from their own pools. A
subsample drawn without replacement from an i.i.d. sample is itself an i.i.d. sample of the
true distribution, so each repetition is distributed exactly as a fresh experiment of n trials
(a bootstrap with replacement would add ties and the difference between two 400-trial pools
as if it were real: at n = 200 a Welch test on it rejects ~11 % instead of 5 %). Repetitions of
one cell share its 400 trials, so its rates at large n vary less between repetitions than
between cells: the cells (twelve per change, four for impl) are the independent units.
Repetition r uses cell r mod (number of cells), so every codec counts alike.

Injected effects (EFFECTS), applied to the changed side of the main comparison only, on the
cell's whole 400-trial pool before resampling (m = the pool's per-metric mean): a mean shift
by a fraction δ of the mean, y + δ·m (on all six metrics, or on snr_err_t and dir_err_t
only), which moves the mean by δ·m and keeps the spread (and, in the rule's own unit, y + 1·sd
on all six); a spread change y ↦ m + k·(y − m),
which keeps the mean and multiplies the standard deviation by k. Where the changed rows
equal the base's trial by trial (threads; dtype nearly), the injected effect is all there is
between the two sides of a pair, so paired power there is the power against a constant shift
(or against differences k − 1 times the trials' deviations): an upper bound for a real
codec pair, whose per-trial differences have a spread of their own (impl shows one).
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

from kvcommon.rows import SIX_D

from .margins import ALPHA
from .validation import VERDICTS, TrialSample, validate_samples

ROOT = Path(__file__).resolve().parents[1]
ROWS = ROOT / "tests" / "data" / "operating_rows.npz"
JSON = ROOT / "docs" / "data" / "operating.json"
HARMLESS = ("seed", "rng", "dtype", "impl", "threads")
NULL_OF = {"seed": "seed2", "rng": "seed", "dtype": "scheme_seed", "impl": "scheme_seed", "threads": "scheme_seed"}
NS = (30, 60, 100, 200)
T_ONLY = tuple(j for j, m in enumerate(SIX_D) if m.endswith("_t"))
# effect name -> (kind, size, coordinates): "shift" adds size·mean, "spread" scales deviations by size
EFFECTS = {
    "shift 1 %": ("shift", 0.01, None), "shift 2 %": ("shift", 0.02, None), "shift 5 %": ("shift", 0.05, None),
    "T shift 1 %": ("shift", 0.01, T_ONLY), "T shift 2 %": ("shift", 0.02, T_ONLY),
    "T shift 5 %": ("shift", 0.05, T_ONLY), "spread x1.5": ("spread", 1.5, None),
    # in the rule's own unit (its margin is in standard deviations): a codec's 1-5 % is 0.06 to
    # 2 sd of a cache metric and 0.02 to 0.5 sd of an output metric in these rows
    "shift 1 sd": ("shift_sd", 1.0, None),
}
POWER = 0.80


# --- the rows -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Pair:
    """One harmless-change cell of one codec and budget (rows (trials, 6)): the base run's x,
    the changed run's y and the null run's z (NULL_OF); y_paired (z_paired) when y (z) ran on
    x's data trial by trial."""
    change: str
    codec: str
    budget: int
    x: np.ndarray
    y: np.ndarray
    z: np.ndarray
    y_paired: bool
    z_paired: bool


def load_pairs(path: Path = ROWS) -> list[Pair]:
    """The harmless-change cells of the stored rows (module doc), float64; a run stored as a
    difference from the base has the base added back."""
    with np.load(path) as z:
        values, runs, data = z["values"].astype(np.float64), list(z["runs"]), list(z["data"])
        difference, codecs, budgets = z["difference"], list(z["codecs"]), [int(b) for b in z["budgets"]]
        if tuple(z["metrics"]) != SIX_D:
            raise ValueError(f"{path}: metrics {tuple(z['metrics'])} are not kvcommon.rows.SIX_D {SIX_D}")
    missing = sorted({"base", *HARMLESS, *NULL_OF.values()} - set(runs))
    if missing:
        raise ValueError(f"{path} lacks run(s) {', '.join(missing)}; rewrite it with python -m harness.operating_rows")
    base = values[runs.index("base")]

    def rows(run, i):
        r = runs.index(run)
        return base[i] + values[r, i] if difference[r] else values[r, i]

    def paired(run):
        return data[runs.index(run)] == data[runs.index("base")]
    pairs = []
    for change in HARMLESS:
        for i, (codec, budget) in enumerate((c, b) for c in codecs for b in budgets):
            y = rows(change, i)
            if np.isnan(y).all():
                continue  # a cell the run lacks (no reference implementation of this codec)
            pairs.append(Pair(change, str(codec), budget, base[i], y, rows(NULL_OF[change], i), paired(change),
                              paired(NULL_OF[change])))
    return pairs


# --- resampling and injection ---------------------------------------------------------------
def resample(gen: np.random.Generator, n_total: int, n: int, y_paired: bool, z_paired: bool) -> tuple:
    """Trial indices (I, J, K) of one repetition (module doc), each n of n_total drawn without
    replacement: main base[I] vs changed[J], null base[I] vs null[K]; J = I when y_paired,
    K = I when z_paired, else independent draws."""
    if not 1 <= n <= n_total:
        raise ValueError(f"n = {n} trials must lie in 1..{n_total} (the cell's trials)")
    i = gen.permutation(n_total)[:n]
    j = i if y_paired else gen.permutation(n_total)[:n]
    k = i if z_paired else gen.permutation(n_total)[:n]
    return i, j, k


def samples(pair: Pair, indices: tuple, y: np.ndarray | None = None) -> tuple:
    """(base, changed, null) TrialSamples from resample's indices; `y`, the changed side's rows
    (default pair.y: an injected effect goes there). A sample's key is (the data its run drew,
    its trial indices): a paired sample shares the base sample's key."""
    i, j, k = indices
    y = pair.y if y is None else y
    x = TrialSample(("base", tuple(i.tolist())), pair.x[i])
    changed = TrialSample(x.key if pair.y_paired else (pair.change, tuple(j.tolist())), y[j])
    null = TrialSample(x.key if pair.z_paired else (NULL_OF[pair.change], tuple(k.tolist())), pair.z[k])
    return x, changed, null


def inject(rows: np.ndarray, effect: str) -> np.ndarray:
    """rows (trials, 6) with EFFECTS[effect] applied (module doc): a shift adds size·mean (or
    size·sd, "shift_sd") to the chosen coordinates; a spread change maps y to mean + size·(y − mean)."""
    kind, size, columns = EFFECTS[effect]
    columns = list(range(rows.shape[1])) if columns is None else list(columns)
    out = rows.copy()
    mean = rows[:, columns].mean(axis=0)
    if kind == "shift":
        out[:, columns] += size * mean
    elif kind == "shift_sd":
        out[:, columns] += size * rows[:, columns].std(axis=0)
    else:
        out[:, columns] = mean + size * (rows[:, columns] - mean)
    return out


# --- the study ------------------------------------------------------------------------------
def study(pairs: list[Pair], *, ns=NS, effects=tuple(EFFECTS), repetitions: int = 48, n_permutations: int = 199,
          alpha: float = ALPHA, margin: float | None = None, seed: int = 0, changes=HARMLESS) -> dict:
    """The verdict counts of every (change, n): for no effect (the false alarms: each verdict,
    also per codec and budget) and for each injected effect (codec-differences, also per codec
    and budget). Each (change,
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
            hits = {e: {} for e in effects}   # per (codec, budget): codec-differences
            for r in range(repetitions):
                i = r % len(cells)
                pair = cells[i]
                indices = resample(gen, len(pair.x), n, pair.y_paired, pair.z_paired)
                permutation_seed = int(gen.integers(2 ** 31))
                x, y, z = samples(pair, indices)
                verdict = validate_samples(x, y, [(x, z)], seed=permutation_seed, **options).verdict
                counts[verdict] = counts.get(verdict, 0) + 1
                cell_counts = per_cell.setdefault((pair.codec, pair.budget), {})
                cell_counts[verdict] = cell_counts.get(verdict, 0) + 1
                for e in effects:
                    x, y, z = samples(pair, indices, injected[e][i])
                    found = validate_samples(x, y, [(x, z)], seed=permutation_seed, **options).verdict
                    key = (pair.codec, pair.budget)
                    hits[e][key] = hits[e].get(key, 0) + (found == "codec-difference")
            design = "paired" if cells[0].y_paired else "unpaired"
            null.append({"change": change, "design": design, "null": NULL_OF[change], "n": n,
                         "repetitions": repetitions,
                         "counts": counts, "cells": [{"codec": k[0], "budget": k[1], "counts": v}
                                                     for k, v in per_cell.items()]})
            power.extend({"change": change, "design": design, "effect": e, "n": n, "repetitions": repetitions,
                          "codec_difference": sum(hits[e].values()),
                          "cells": [{"codec": k[0], "budget": k[1], "repetitions": sum(per_cell[k].values()),
                                     "codec_difference": v} for k, v in hits[e].items()]} for e in effects)
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


def git_sha() -> str | None:
    """The checkout's commit (the rule's version the figures belong to), None outside git."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


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
    if min(ns) < 3 or max(ns) > n_total:
        return usage(f"--ns {args.ns}: every n must lie in 3..{n_total} (the stored trials per cell)")
    import torch
    torch.set_num_threads(1)  # thousands of small energy tests: thread hand-offs cost more than the work
    before, start = machine(), time.perf_counter()
    payload = study(pairs, ns=ns, repetitions=args.repetitions, n_permutations=args.permutations,
                    margin=args.margin, seed=args.seed)
    payload.update(command="python -m stats.operating " + " ".join(sys.argv[1:] if argv is None else argv),
                   rows=str(args.rows.relative_to(ROOT) if args.rows.is_relative_to(ROOT) else args.rows),
                   git_sha=git_sha(),
                   seconds=round(time.perf_counter() - start, 1), machine=before, machine_after=machine())
    if str(args.json) != "-":
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"{payload['command']}: {args.repetitions} repetitions per harmless change and n, {args.permutations} "
          f"permutations, {payload['seconds']} s on {before['cores']} x {before['cpu']} "
          f"(load: {before['uptime']} -> {payload['machine_after']['uptime']})\n")
    print(table_markdown(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
