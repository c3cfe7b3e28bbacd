"""harness bench: throughput figures measured in one run (batched vs loop vs reference, per scheme)."""
from __future__ import annotations

import json

from ..bandwidth import bandwidth_lines
from ..bench import BenchShape, grid_time, memory_needed, run_bench, workers_speedup
from ..devices import DEVICES, available_memory_bytes, resolve_device
from ..errors import UsageError
from ..sweep import GRIDS
from ._args import comma_list

NAME = "bench"
HELP = "measure throughput: batched runner vs per-trial loop vs reference, vectors/s per scheme"


def add_arguments(p):
    d = BenchShape()
    p.add_argument("--scheme", default=d.scheme, help=f"scheme of the runner comparison (default {d.scheme})")
    p.add_argument("--schemes", type=comma_list(str), default=None, help="schemes to time (default all)")
    p.add_argument("--budget", type=int, default=d.budget, help="budget of the runner comparison")
    p.add_argument("--budgets", type=comma_list(int), default=None,
                   help="budgets of the per-scheme throughput table (default: --budget)")
    p.add_argument("--reference", action="store_true",
                   help="also time the NumPy reference implementation per scheme")
    p.add_argument("--dim", type=int, default=d.dim)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--queries", type=int, default=d.queries)
    p.add_argument("--trials", type=int, default=d.trials)
    p.add_argument("--repeats", type=int, default=None,
                   help=f"timed repeats of each figure, the fastest kept (default {d.repeats}; with --grid 2: "
                        f"alternating passes on each trial count)")
    p.add_argument("--device", choices=DEVICES, default="auto")
    p.add_argument("--grid", choices=tuple(GRIDS), default=None,
                   help="time a whole preset grid instead (paper: the AMD paper's), on --trials per cell, one chunk "
                        "of the run's own size and twice --trials in two chunks, modelled as fixed + per chunk "
                        "+ per trial and evaluated at the grid's trial count and chunks")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="also time a 12-cell sweep serially and with --workers N, in this run (the ratio, and the "
                        "load average, which sways both)")
    p.add_argument("--triad-mib", type=int, default=None, metavar="MIB",
                   help="size of each of the bandwidth triad's three float64 arrays (default: 4x the last-level "
                        "cache, at least 64 MiB, at most an eighth of the available memory)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args) -> int:
    if args.repeats is None:
        args.repeats = 2 if args.grid else BenchShape().repeats
    for flag in ("budget", "dim", "seq_len", "queries", "trials", "repeats"):
        if getattr(args, flag) < 1:
            raise UsageError(f"harness bench: --{flag.replace('_', '-')} must be a positive integer")
    try:
        device = resolve_device(args.device)
        import schemes
        schemes.create(args.scheme, budget=args.budget, dim=args.dim)
        for name in args.schemes or ():
            schemes.create(name, budget=args.budget, dim=args.dim)
    except ValueError as exc:
        raise UsageError(f"harness bench: {exc}") from None
    if args.grid:
        return _print_grid(grid_time(args.grid, args.trials, device, args.repeats), args.json)
    shape = BenchShape(scheme=args.scheme, budget=args.budget, dim=args.dim, seq_len=args.seq_len,
                       queries=args.queries, trials=args.trials, repeats=args.repeats)
    for b in args.budgets or ():
        if not 1 <= b <= 8:
            raise UsageError(f"harness bench: budget {b} is outside 1..8 bits per element")
    impls = ("torch", "reference") if args.reference else ("torch",)
    if args.workers is not None and args.workers < 1:
        raise UsageError("harness bench: --workers must be a positive integer")
    need, available = memory_needed(shape, device), available_memory_bytes(device)
    if need > available:
        raise UsageError(f"harness bench: {max(shape.trials, 8)} trials of d = {shape.dim}, S = {shape.seq_len}, "
                         f"Nq = {shape.queries} in one batch need about {need / 2 ** 30:.1f} GiB, more than the "
                         f"{available / 2 ** 30:.1f} GiB available on {device.type}; lower --trials, --seq-len, --dim "
                         f"or --queries")
    triad_bytes = None
    if args.triad_mib is not None:
        if args.triad_mib < 1:
            raise UsageError("harness bench: --triad-mib must be a positive integer (MiB per array)")
        triad_bytes = args.triad_mib << 20
        if 3 * triad_bytes > available:
            raise UsageError(f"harness bench: --triad-mib {args.triad_mib} needs three arrays of "
                             f"{args.triad_mib} MiB, more than the {available / 2 ** 20:.0f} MiB available on "
                             f"{device.type}; lower --triad-mib")
    result = run_bench(shape, device, list(args.schemes) if args.schemes else None, args.budgets, impls,
                       triad_bytes)
    if args.workers:
        result["workers"] = workers_speedup(shape, device, args.workers)
    if args.json:
        print(json.dumps(result, indent=2, default=str))
        return 0
    r = result["runner"]
    print(f"device {result['device']}, {result['threads']} threads, cell {'/'.join(map(str, r['cell']))}, "
          f"{r['trials']} trials")
    print(f"  batched runner   {r['batched_trials_per_s']:10.1f} trials/s")
    print(f"  per-trial loop   {r['loop_trials_per_s']:10.1f} trials/s   (batched = {r['batched_over_loop']:.1f}x)")
    if r.get("reference_trials_per_s"):
        print(f"  reference (NumPy){r['reference_trials_per_s']:10.1f} trials/s   "
              f"(batched = {r['batched_over_reference']:.1f}x)")
    print("  encode+decode vectors/s (scheme, implementation, budget):")
    for name, by_impl in result["schemes_vectors_per_s"].items():
        for impl, by_budget in by_impl.items():
            rates = "  ".join(f"b={b}: {rate:,.0f}" for b, rate in by_budget.items())
            print(f"    {name:<18} {impl:<9} {rates}")
    for line in bandwidth_lines(result):
        print(f"  {line}")
    a = result["attention"]
    print(f"  attention step {a['attention_gflops']:.1f} GFLOP/s = {a['attention_fraction_of_matmul']:.0%} "
          f"of a 2048² matmul ({a['matmul_gflops']:.1f} GFLOP/s)")
    for rot in result["rotation_by_budget"].values():
        print(f"  tq-kv b={rot['budget']} Hadamard rotation {rot['hadamard_vectors_per_s']:,.0f} vectors/s, dense matmul "
              f"rotation {rot['dense_vectors_per_s']:,.0f} vectors/s (Hadamard = {rot['fast_over_dense']:.2f}x dense)")
    th = result["threads_comparison"]
    print(f"  sq-kv cell ({th['trials']} trials): small linear algebra on one thread = "
          f"{th['one_thread_over_all_threads']:.1f}x all threads; calibration with eigh = "
          f"{th['eigh_over_power']:.1f}x the power iteration")
    load = result["load_average"]
    print(f"  load average {load['before'][0]:.2f} before, {load['after'][0]:.2f} after "
          f"({result['cpu_count']} CPUs, OMP_WAIT_POLICY {result['omp_wait_policy'] or 'unset'}); "
          f"figures are minima, --json keeps every sample")
    if "workers" in result:
        w = result["workers"]
        print(f"  sweep of {w['cells']} cells x {w['trials']} trials: serial {w['serial_s']:.1f} s, --workers "
              f"{w['workers']} {w['workers_s']:.1f} s (serial/workers = {w['serial_over_workers']:.2f}, rows "
              f"{'identical' if w['rows_identical'] else 'DIFFER'}); load average {w['loadavg']['before'][0]:.1f} "
              f"before, {w['loadavg']['after'][0]:.1f} after")
    return 0


def _print_grid(result: dict, as_json: bool) -> int:
    if as_json:
        print(json.dumps(result, indent=2))
        return 0
    n, (t1, t2) = result["sample_trials"], result["measured_s"]
    sizes = sorted(set(result["chunk_trials_by_scenario_dim"].values()))
    print(f"grid {result['grid']}: {result['cells']} cells, timed on {n} trials per cell, on one chunk of the "
          f"run's own size ({', '.join(map(str, sizes))} trials) and on {2 * n} trials in two chunks "
          f"({result['repeats']} alternating passes each, the fastest kept) after a {result['warmup_s']:.1f} s "
          f"warm-up: {t1:.1f} s, {t2:.1f} s and {result['measured_in_two_chunks_s']:.1f} s (of every "
          f"cell: {result['per_trial_s']:.2f} s per trial, {result['trials_per_s']:.1f} trials/s; "
          f"{result['per_chunk_s']:.1f} s per chunk; {result['fixed_s']:.1f} s once)")
    print(f"  estimated at {result['grid_trials']} trials ({result['chunks_at_grid_trials']} chunks): "
          f"{result['estimated_grid_s'] / 60:.1f} min")
    for title, table in (("scheme family", result["estimated_s_by_family"]), ("head dim", result["estimated_s_by_dim"])):
        print(f"  by {title}: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in table.items()))
    print("  by slice (scenario/dim, the whole run): " + ", ".join(
        f"{k} {v:.0f} s" for k, v in result["estimated_s_by_scenario_dim"].items()))
    print(f"  largest peak memory of a cell: {result['peak_mem_mb_max']:.0f} MiB")
    load = result["load_average"]
    print(f"  load average {load['before'][0]:.2f} before, {load['after'][0]:.2f} after")
    return 0
