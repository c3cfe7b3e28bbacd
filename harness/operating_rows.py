"""The real per-trial rows of harmless-change pairs that the verdict rule's operating
characteristics are measured on (stats/operating.py reads the stored file; stats/ does not
import harness/).

Every run goes through the harness's own runner (run_sweep, as `harness run` does) on one
design: heavy_tail, the codecs CODECS at b = 2 and 3, d = 64, S = 256, Nq = 64, on the CPU.
The runs differ from BASE in one implementation variable each (RUNS):

- seed (root seed 1) and rng (Philox instead of PCG64) draw other data: unpaired with BASE;
- dtype (float64), impl (the NumPy reference; only the codecs it has) and threads (torch on
  2 threads instead of 1) run on BASE's data trial by trial: paired with BASE;
- and the nulls `harness validate` pairs with them: scheme_seed (the codecs' own seed 1, the
  data unchanged: paired) and seed2 (root seed 2: unpaired).

Stored compactly (float32 throughout, a few hundred KB): `values` (run, cell, trial, six-D)
holds BASE and the unpaired runs as they are; a paired run holds its difference from BASE,
computed in float64 and then rounded, so BASE + difference keeps each paired difference to
float32's relative precision of the difference itself (dtype's are mostly below 1e-3 of a
metric's between-trial sd, many below float32's step of BASE), and bit-identical rows give an
exact zero. NaN marks a cell a run lacks (impl for a codec without a reference). `data[r]`
names the data run r ran on (equal names: paired), `difference[r]` says which runs are stored
as differences; the JSON beside the file records the command, versions, run times and machine.

    python -m harness.operating_rows [--trials 400] [--out tests/data/operating_rows.npz]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvcommon.rows import SIX_D

SCENARIO = "heavy_tail"
CODECS = ("tq-kv", "sq-kv", "int4", "kivi", "shard", "h2o")
BUDGETS = (2, 3)
DIM, SEQ_LEN, QUERIES = 64, 256, 64
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "operating_rows.npz"
# run name -> (changes from BASE, torch threads, the data it ran on: equal data = paired trial by trial)
RUNS = {
    "base": ({}, 1, "seed 0, pcg64"),
    "seed": ({"seed": 1}, 1, "seed 1, pcg64"),
    "rng": ({"rng": "philox"}, 1, "seed 0, philox"),
    "dtype": ({"dtype": "float64"}, 1, "seed 0, pcg64"),
    "impl": ({"impl": "reference"}, 1, "seed 0, pcg64"),
    "threads": ({}, 2, "seed 0, pcg64"),
    # the nulls `harness validate` runs for these (like for like): the codec's own seed on the
    # same data for a paired change, the root seed + 2 (+ 1 for rng) for an unpaired one
    "scheme_seed": ({"scheme_seed": 1}, 1, "seed 0, pcg64"),
    "seed2": ({"seed": 2}, 1, "seed 2, pcg64"),
}


def base_config(trials: int, codecs=CODECS):
    from .sweep import SweepConfig
    return SweepConfig(scenarios=(SCENARIO,), schemes=tuple(codecs), budgets=BUDGETS, dims=(DIM,),
                       seq_lens=(SEQ_LEN,), queries=(QUERIES,), trials=trials, seed=0, device="cpu",
                       dtype="float32", rng="pcg64", impl="torch")


def run_rows(config, n_threads: int, directory: Path) -> dict:
    """{(codec, budget): six-D values (trials, 6) in trial order} of one run of `config` on
    n_threads torch threads, through run_sweep into `directory`."""
    from kvcommon.threads import torch_threads

    from .runner import run_sweep
    from .store import RunStore
    store = RunStore(directory)
    with torch_threads(n_threads):
        run_sweep(config, store, progress=False)
    frame = store.trials().sort_values(["scheme", "budget", "trial"], kind="stable")
    return {(codec, int(budget)): group[list(SIX_D)].to_numpy(dtype=np.float64)
            for (codec, budget), group in frame.groupby(["scheme", "budget"], sort=False)}


def generate(trials: int = 400, codecs=CODECS, runs=tuple(RUNS), log=None) -> dict:
    """The arrays of the stored file (module doc) for `trials` trials per cell, each run
    through run_sweep in a temporary directory. `log(name, seconds)` is told each run's time."""
    from schemes.registry import reference_specs
    cells = [(c, b) for c in codecs for b in BUDGETS]
    values = np.full((len(runs), len(cells), trials, len(SIX_D)), np.nan)
    base = None
    with tempfile.TemporaryDirectory(prefix="kvharness-operating-") as tmp:
        for r, name in enumerate(runs):
            changes, n_threads, data = RUNS[name]
            names = [c for c in codecs if name != "impl" or c in reference_specs()]
            config = dataclasses.replace(base_config(trials, names), **changes)
            start = time.perf_counter()
            rows = run_rows(config, n_threads, Path(tmp) / name)
            if log:
                log(name, time.perf_counter() - start)
            for i, cell in enumerate(cells):
                if cell in rows:
                    values[r, i] = rows[cell]
            if name == "base":
                base = values[r].copy()
            elif data == RUNS["base"][2]:
                values[r] -= base   # the paired difference, in float64 (module doc)
    return {"values": values.astype(np.float32), "runs": np.array(runs), "data": np.array([RUNS[n][2] for n in runs]),
            "difference": np.array([n != "base" and RUNS[n][2] == RUNS["base"][2] for n in runs]),
            "codecs": np.array(codecs), "budgets": np.array(BUDGETS), "metrics": np.array(SIX_D)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.operating_rows", description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=400, help="trials per cell (default 400)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"the .npz to write (default {DEFAULT_OUT})")
    args = p.parse_args(argv)
    if args.trials < 2:
        print(f"python -m harness.operating_rows: --trials {args.trials} must be at least 2", file=sys.stderr)
        return 2
    import torch

    from stats.operating import machine

    from .provenance import provenance
    before = machine()
    times = {}
    arrays = generate(args.trials, log=lambda name, s: times.__setitem__(name, round(s, 1)))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp.npz")
    np.savez_compressed(tmp, **arrays)
    tmp.replace(args.out)
    record = {"command": "python -m harness.operating_rows " + " ".join(argv if argv is not None else sys.argv[1:]),
              "design": {"scenario": SCENARIO, "codecs": list(CODECS), "budgets": list(BUDGETS), "dim": DIM,
                         "seq_len": SEQ_LEN, "queries": QUERIES, "trials": args.trials, "device": "cpu"},
              "runs": {name: {"changes": RUNS[name][0], "torch_threads": RUNS[name][1], "data": RUNS[name][2]}
                       for name in RUNS},
              "seconds": times, "machine_before": before, "machine_after": machine(),
              "provenance": provenance(torch.device("cpu"))}
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(f"wrote {args.out} ({args.out.stat().st_size / 1024:.0f} KB); run times {times}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
