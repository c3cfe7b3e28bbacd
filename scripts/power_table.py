"""Measured power of `harness validate --against`: per bug kind, design and trial count n, the
smallest bug size that comes out `codec-difference` in at least 95 % of repetitions.

Bug kinds (KINDS): two bugs of harness/known_answers.py whose size is continuous, run at a
log-spaced grid of sizes around where they start to be found: `wrong-norm` (decoded K and V
scaled by 1 + ε: a location effect) and `uneven-calls` (each trial's K error (1 ± ε) times the
codec's, the signs opposite within each pair of trials: a spread effect at the codec's mean).

Designs (harness.known_answers.PLUGIN_DESIGNS): `bug:NAME/CODEC` in-process, sharing CODEC's seed
family (paired on the data and on the codecs' own draws); `plug:NAME/CODEC`, an installed
entry-point plug-in declaring CODEC's seed family (the same pairing; its rows are checked equal
to the in-process ones, size by size, and where they are equal bit for bit its verdicts are the
in-process ones, not recomputed); `plug-own:NAME/CODEC`, a plug-in declaring none (paired
on the data only: the two codecs' own draws differ).

Rows. For each kind, the runs `harness validate --scheme CODEC --against B --vary seed` makes
(harness/commands/validate.py: `configs`, `variant_of`), through the runner that stores rows
(harness.runner.run_sweep into a RunStore), at POOL trials: the base run (CODEC and B on the
same data) and the variant run (the codecs' own seed changed, the same data), B every design's
bugged codec at every size of the grid. One pool per (kind, size); CODEC's rows come from the
first size's runs, which hold it too.

Resampling. A repetition at n trials draws n of the POOL trial indices WITHOUT replacement and
takes those trials from all four samples (CODEC and B, base and variant): every pair the rule
pairs (main, nulls) stays paired, trial by trial, on the same data key. A subsample of i.i.d.
trials drawn without replacement is itself an i.i.d. sample, so each repetition is distributed
as a fresh run of n trials (as stats/operating.py argues; a bootstrap with replacement would add
ties). The verdict is the real one: stats.validation.validate_samples on the resampled trial
frames, main CODEC vs B, nulls (CODEC, CODEC′) and (B, B′) — what `harness validate` calls.
The same REPETITIONS index sets (per n) serve every size and design (common random numbers), so
the rates of neighbouring sizes differ by the bug alone. Repetitions share their pool's trials,
so at n = 200 of 800 they are not independent: a rate near the target is a statement about
this pool as much as about the codec.

Found (as `harness selftest` counts a bug found): the verdict is the bug's right answer,
Bug.target (`codec-difference` for both kinds). The 95 % size at n: the rates at the grid sizes
are scanned from the top; the smallest grid size from which every larger size reaches the
target is bracketed with the grid size below it, and the size is interpolated linearly in
log size between the two (`threshold`).

    nice -n 10 .venv/bin/python scripts/power_table.py [--pool 800] [--repetitions 200]
        [--json docs/data/power.json]   # then: python scripts/render_tables.py
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

JSON = ROOT / "docs" / "data" / "power.json"
NS = (30, 60, 200)
TARGET = 0.95
POOL = 800
REPETITIONS = 200
PERMUTATIONS = 199   # the energy test is information only: the verdict does not read it
ROOT_SEED = 1
# bug kind -> its grid of sizes (log-spaced, ratio 2^(1/4)), bracketing where it starts to be found
# (a pilot at 200 trials: wrong-norm 0.01 never, 0.09 always; uneven-calls 0.005 never, 0.08 always)
KINDS = {
    "wrong-norm": tuple(round(0.012 * 2 ** (k / 4), 5) for k in range(15)),     # 0.012 .. 0.136
    "uneven-calls": tuple(round(0.006 * 2 ** (k / 4), 5) for k in range(13)),   # 0.006 .. 0.048
}
# what each kind changes, for the table's row of its measured size (a mean, or a spread)
EFFECT = {"wrong-norm": "location", "uneven-calls": "spread"}
SETTINGS = {"dim": 64, "seq_len": 256, "queries": 64}


# --- pure parts ------------------------------------------------------------------------------
def subsets(gen: np.random.Generator, n_total: int, n: int, repetitions: int) -> list[np.ndarray]:
    """`repetitions` sorted index sets, each n of range(n_total) drawn without replacement."""
    if not 1 <= n <= n_total:
        raise ValueError(f"n = {n} trials must lie in 1..{n_total} (the pool's trials)")
    return [np.sort(gen.permutation(n_total)[:n]) for _ in range(repetitions)]


def resampled(frames: tuple, index) -> tuple:
    """The frames (each one sample's rows, in trial order 0..N−1) at the same trial positions
    `index`: what is paired trial by trial stays paired, and every sample keeps its data key
    (the same trial indices in each)."""
    lengths = {len(f) for f in frames}
    if len(lengths) != 1:
        raise ValueError(f"the samples hold different numbers of trials ({sorted(lengths)}): not one pool")
    out = tuple(f.iloc[index] for f in frames)
    trials = [tuple(f["trial"].tolist()) for f in out]
    if len(set(trials)) != 1:
        raise ValueError("the samples' trials differ at the same positions: sort each by trial first")
    return out


def found(verdict: str, target: str = "codec-difference") -> bool:
    """A repetition finds the bug when its verdict is the bug's right answer (harness selftest)."""
    return verdict == target


def threshold(sizes, rates, target: float = TARGET) -> dict:
    """The smallest size found at rate ≥ target, from the rates at the sorted grid `sizes`: the
    smallest grid size from which every larger one reaches the target (scanned from the top), and
    the size interpolated linearly in log size between it and the grid size below it.
    {"size": interpolated (None when no grid size qualifies or the smallest does), "below":
    "above": the bracketing grid sizes, "rate_below", "rate_above": their rates, "bound": "" or
    "<=" (the smallest grid size already reaches it) or ">" (the largest does not)}."""
    sizes, rates = list(map(float, sizes)), list(map(float, rates))
    if len(sizes) != len(rates) or not sizes or sizes != sorted(sizes):
        raise ValueError("sizes must be sorted and as many as rates")
    k = len(sizes)
    while k > 0 and rates[k - 1] >= target:
        k -= 1
    if k == len(sizes):
        return {"size": None, "bound": ">", "below": sizes[-1], "rate_below": rates[-1], "above": None,
                "rate_above": None}
    if k == 0:
        return {"size": None, "bound": "<=", "below": None, "rate_below": None, "above": sizes[0],
                "rate_above": rates[0]}
    lo, hi, r_lo, r_hi = sizes[k - 1], sizes[k], rates[k - 1], rates[k]
    t = (target - r_lo) / (r_hi - r_lo)
    return {"size": math.exp(math.log(lo) + t * (math.log(hi) - math.log(lo))), "bound": "",
            "below": lo, "rate_below": r_lo, "above": hi, "rate_above": r_hi}


def threshold_text(th: dict, digits: int = 2) -> str:
    """A threshold in words: '0.031 (82 % at 0.028, 97 % at 0.04)', '≤ 0.004 (100 %)' or '> 0.128 (60 %)'."""
    def g(x):
        return f"{x:.{digits}g}"

    def pct(r):
        return f"{100 * r:.0f} %"
    if th["bound"] == ">":
        return f"> {g(th['below'])} ({pct(th['rate_below'])})"
    if th["bound"] == "<=":
        return f"≤ {g(th['above'])} ({pct(th['rate_above'])})"
    return f"{g(th['size'])} ({pct(th['rate_below'])} at {g(th['below'])}, {pct(th['rate_above'])} at {g(th['above'])})"


def _load_words(machine: dict) -> str:
    text = machine.get("uptime") or ""
    return text.split("load average:", 1)[1].strip() if "load average:" in text else "not recorded"


def table_markdown(payload: dict) -> str:
    """The 95 % table (rows: bug kind × design; columns: n) and the detection rates per size."""
    ns = payload["settings"]["ns"]
    lines = ["| bug | design | " + " | ".join(f"n = {n}" for n in ns) + " |", "|---|---|" + "---|" * len(ns)]
    for kind in payload["kinds"]:
        for design, d in kind["designs"].items():
            cells = [threshold_text(d["threshold"][str(n)]) for n in ns]
            lines.append(f"| `{kind['bug']}` | {design} | " + " | ".join(cells) + " |")
    for k in payload["kinds"]:
        lines += ["", f"`{k['bug']}` (`bug:{k['bug']}/{k['codec']}`, {k['scenario']}, b = {k['budget']}): size = "
                      f"{k['unit']}; `harness selftest` runs it at {k['selftest_size']:g}."]
    lines += ["", "Rate of `codec-difference` per size (% of repetitions):", ""]
    for kind in payload["kinds"]:
        sizes = kind["sizes"]
        lines += [f"| {kind['bug']}: design, n | " + " | ".join(f"{s:.3g}" for s in sizes) + " |",
                  "|---|" + "---|" * len(sizes)]
        for design, d in kind["designs"].items():
            for n in ns:
                rates = d["rates"][str(n)]
                lines.append(f"| {design}, {n} | " + " | ".join(f"{100 * r:.0f}" for r in rates) + " |")
        spread = EFFECT.get(kind["bug"]) == "spread"
        for design, d in kind["designs"].items():
            cells = [f"×{e['largest_spread_ratio']:.2f}" if spread else f"{e['largest_location_sd']:.2f}"
                     for e in d["at_pool"]]
            lines.append(f"| {design}: {'largest spread ratio' if spread else 'largest mean shift, sd'}, all "
                         f"{payload['settings']['pool']} trials | " + " | ".join(cells) + " |")
        lines.append("")
    s, m = payload["settings"], payload["machine"]
    lines.append(f"From `{payload['command']}`: {s['pool']}-trial pools ({', '.join(dict.fromkeys(k['scenario'] for k in payload['kinds']))}"
                 f", b = 2, d = {s['dim']}, S = {s['seq_len']}, {s['queries']} queries, root seed {s['seed']}), "
                 f"{s['repetitions']} subsamples per n without replacement, the same for every size and design; "
                 f"{payload['seconds']['rows'] / 60:.0f} min of runs and {payload['seconds']['resampling'] / 60:.0f} "
                 f"min of verdicts on {m['cores']} cores of {m['cpu']} (load average {_load_words(m)} at the start, "
                 f"{_load_words(payload['machine_after'])} at the end).")
    return "\n".join(lines).rstrip("\n")


# --- the rows --------------------------------------------------------------------------------
def _configs(names: tuple, bug, pool: int, seed: int):
    """The base and variant sweeps `harness validate --against --vary seed` runs (its own
    `configs`), for the schemes `names` on the bug's scenario and budget."""
    from harness.commands.validate import configs
    args = argparse.Namespace(scenario=bug.scenario, scheme=names[0], against=names[1], vary="seed",
                              budget=bug.budget, dim=SETTINGS["dim"], seq_len=SETTINGS["seq_len"],
                              queries=SETTINGS["queries"], trials=pool, seed=seed, rng="pcg64", impl="torch",
                              dtype="float32", device="cpu")
    runs = configs(args)
    return {name: dataclasses.replace(config, schemes=names) for name, config in runs.items()}


def _frames(config, directory: Path) -> dict:
    """Each scheme's rows of the sweep, run through the runner into a RunStore, sorted by trial."""
    from harness.runner import run_sweep
    from harness.store import RunStore
    store = RunStore(directory)
    run_sweep(config, store, progress=False)
    rows = store.trials()
    return {name: rows[rows["scheme"] == name].sort_values("trial", kind="stable").reset_index(drop=True)
            for name in config.schemes}


def pool_rows(bug, pool: int, seed: int, with_codec: bool) -> dict:
    """{scheme: (base rows, variant rows)} of the bug's three designs (and of its codec where
    with_codec), pool trials each."""
    from harness import known_answers as ka
    names = ((bug.wrapped,) if with_codec else ()) + (bug.scheme, bug.plugin(True), bug.plugin(False))
    with ka.registered_bugs([bug]), ka.installed_bugs([bug]), tempfile.TemporaryDirectory(prefix="power-") as tmp:
        runs = _configs(names, bug, pool, seed)
        frames = {name: _frames(config, Path(tmp) / name) for name, config in runs.items()}
    return {name: (frames["base"][name], frames["variant"][name]) for name in names}


def _six_d(frame) -> np.ndarray:
    from kvcommon.rows import SIX_D
    return frame[list(SIX_D)].to_numpy(np.float64)


# --- the study -------------------------------------------------------------------------------
def judge(codec: tuple, bugged: tuple, index_sets: dict, seeds: dict, permutations: int) -> dict:
    """{n: [verdict per repetition]}: validate_samples on each resample of the four samples."""
    from stats.validation import validate_samples
    out = {}
    for n, sets in index_sets.items():
        verdicts = []
        for index, seed in zip(sets, seeds[n]):
            a, a2, b, b2 = resampled(codec + bugged, index)
            verdicts.append(validate_samples(a, b, [(a, a2), (b, b2)], n_permutations=permutations,
                                             seed=int(seed)).verdict)
        out[n] = verdicts
    return out


def full_pool(codec: tuple, bugged: tuple, permutations: int) -> dict:
    """The verdict at all pool trials and the largest effects: location in pooled sd, spread ratio."""
    from stats.validation import SPREAD_TESTS, validate_samples
    v = validate_samples(codec[0], bugged[0], [codec, bugged], n_permutations=permutations, seed=0)
    rows = v.effect_rows()
    location = max(abs(r["standardised"] or 0.0) for t, r in rows.items() if t not in SPREAD_TESTS)
    spread = max(rows[t]["sd_ratio"] or 1.0 for t in SPREAD_TESTS)
    spread = max(spread, 1 / min(rows[t]["sd_ratio"] or 1.0 for t in SPREAD_TESTS))
    return {"verdict": v.verdict, "largest_location_sd": location, "largest_spread_ratio": spread,
            "paired": [v.main.paired] + [n.paired for n in v.nulls]}


def study(kinds=KINDS, *, pool: int = POOL, ns=NS, repetitions: int = REPETITIONS, seed: int = ROOT_SEED,
          permutations: int = PERMUTATIONS, progress=print) -> dict:
    from harness import known_answers as ka
    from kvcommon.threads import torch_threads
    bugs = {b.name: b for b in ka.BUGS}
    timing = {"rows": 0.0, "resampling": 0.0}
    out = []
    for name, sizes in kinds.items():
        bug = bugs[name]
        gen = np.random.default_rng([seed, len(out)])
        index_sets = {n: subsets(gen, pool, n, repetitions) for n in ns}
        seeds = {n: gen.integers(2 ** 31, size=repetitions) for n in ns}
        designs = {d: {"scheme": bug.scheme if s is None else bug.plugin(s), "rates": {str(n): [] for n in ns},
                       "verdicts": {str(n): [] for n in ns}, "at_pool": []}
                   for d, s in ka.PLUGIN_DESIGNS.items()}
        identical, codec = [], None
        for size in sizes:
            t0 = time.perf_counter()
            rows = pool_rows(bug.at(size), pool, seed, with_codec=codec is None)
            if codec is None:
                codec = rows.pop(bug.wrapped)
            timing["rows"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            inproc = rows[bug.scheme]
            identical.append(all(np.array_equal(_six_d(x), _six_d(y), equal_nan=True)
                                 for x, y in zip(inproc, rows[bug.plugin(True)])))
            with torch_threads(1):   # many small tests: thread hand-offs cost more than the work
                for d in designs.values():
                    if d["scheme"] == bug.plugin(True) and identical[-1]:
                        # the same numbers as in-process, bit for bit: the same verdicts (not recomputed)
                        for key in ("verdicts", "rates"):
                            for n in ns:
                                d[key][str(n)].append(designs["in-process"][key][str(n)][-1])
                        d["at_pool"].append(designs["in-process"]["at_pool"][-1])
                        continue
                    verdicts = judge(codec, rows[d["scheme"]], index_sets, seeds, permutations)
                    for n in ns:
                        counts = {}
                        for v in verdicts[n]:
                            counts[v] = counts.get(v, 0) + 1
                        d["verdicts"][str(n)].append(counts)
                        d["rates"][str(n)].append(sum(found(v, bug.target) for v in verdicts[n]) / repetitions)
                    d["at_pool"].append(full_pool(codec, rows[d["scheme"]], permutations))
            timing["resampling"] += time.perf_counter() - t0
            progress(f"{name} {size:g}: " + "; ".join(
                f"{d}: " + ", ".join(f"n={n} {100 * v['rates'][str(n)][-1]:.0f}%" for n in ns)
                + f", all {pool}: {v['at_pool'][-1]['verdict']}" for d, v in designs.items())
                + f" (rows {timing['rows']:.0f} s, verdicts {timing['resampling']:.0f} s)")
        for d in designs.values():
            d["threshold"] = {str(n): threshold(sizes, d["rates"][str(n)]) for n in ns}
        out.append({"bug": name, "codec": bug.wrapped, "scenario": bug.scenario, "budget": bug.budget,
                    "unit": bug.unit, "modelled_on": bug.modelled_on, "target": bug.target,
                    "selftest_size": bug.size, "sizes": list(sizes), "designs": designs,
                    "shared_rows_identical_to_in_process": identical})
    settings = {"pool": pool, "ns": list(ns), "repetitions": repetitions, "seed": seed, "permutations": permutations,
                "target": TARGET, **SETTINGS,
                "resampling": "n of the pool's trials without replacement, the same positions in all four samples"}
    return {"settings": settings, "kinds": out, "seconds": {k: round(v, 1) for k, v in timing.items()}}


def machine() -> dict:
    from harness.known_answers import machine as known
    return known()


def git_sha() -> str | None:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pool", type=int, default=POOL, help=f"trials per run (default {POOL})")
    p.add_argument("--repetitions", type=int, default=REPETITIONS, help=f"subsamples per n (default {REPETITIONS})")
    p.add_argument("--ns", default=",".join(map(str, NS)), help="trial counts judged (default 30,60,200)")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"bug kinds (default {','.join(KINDS)})")
    p.add_argument("--json", type=Path, default=JSON, help="where to write the results ('-': nowhere)")
    args = p.parse_args(argv)
    ns = tuple(int(x) for x in args.ns.split(","))
    kinds = {k: KINDS[k] for k in args.kinds.split(",")}
    if max(ns) > args.pool:
        p.error(f"--ns {args.ns}: every n must be at most --pool {args.pool}")
    before, start = machine(), time.perf_counter()
    payload = study(kinds, pool=args.pool, ns=ns, repetitions=args.repetitions)
    payload["seconds"]["total"] = round(time.perf_counter() - start, 1)
    given, shown = sys.argv[1:] if argv is None else list(argv), []
    for i, a in enumerate(given):   # where the JSON went is no part of what was computed
        if not (a.startswith("--json") or (i and given[i - 1] == "--json")):
            shown.append(a)
    payload.update(command=" ".join(["python scripts/power_table.py", *shown]),
                   git_sha=git_sha(), machine=before, machine_after=machine())
    if str(args.json) != "-":
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(table_markdown(payload))
    print(f"\n{payload['seconds']} s; load {before['uptime']} -> {payload['machine_after']['uptime']}; "
          f"pid {os.getpid()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
