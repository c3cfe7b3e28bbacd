"""The sweep runner, run store and CLI: determinism, chunking, resume, export, error paths."""
import json
import sqlite3

import pandas as pd
import pytest

from harness import cell as engine, runner
from harness.cli import main
from kvcommon.rows import TRIAL_COLUMNS
from harness.store import RESULTS_FILE, RunStore
from harness.sweep import SweepConfig
from stats.metrics import METRIC_NAMES
from interrupting import interrupt_at_chunk

SMALL = ["--budget", "2,3", "--dim", "16", "--seq-len", "32", "--queries", "4", "--trials", "6", "--quiet"]


def run(tmp_path, name, *extra):
    out = tmp_path / name
    code = main(["run", "--scenario", "gaussian,lowrank_aligned", "--scheme", "tq-kv,tq-qkv",
                 "--out", str(out), *SMALL, *extra])
    return code, out


def rows(out):
    return RunStore(out).trials()


def test_run_writes_every_cell_and_column(tmp_path, capsys):
    code, out = run(tmp_path, "a")
    assert code == 0
    frame = rows(out)
    assert len(frame) == 2 * 2 * 2 * 6
    assert set(TRIAL_COLUMNS) <= set(frame.columns)
    assert frame[list(METRIC_NAMES)].notna().all().all()
    assert set(frame["impl"]) == {"torch"} and set(frame["device"]) == {"cpu"}
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["finished_at"] and manifest["config"]["trials"] == 6
    assert {"torch", "numpy", "git_sha", "device"} <= set(manifest["provenance"])
    with sqlite3.connect(out / RESULTS_FILE) as con:
        assert con.execute("SELECT COUNT(*) FROM cells").fetchone()[0] == 8
    peaks = manifest["peak_mem_mb_per_cell"]
    assert len(peaks) == 8 and all(p > 10 for p in peaks.values())   # a Python + torch process
    # measured bits, counted by hand: per cache b code bits per element and a float32 norm per
    # 16-element vector; per model one float32 codebook of 2^b entries shared by K and V and 16
    # packed rotation signs per tensor (one head), charged to no cache without --model-caches
    tq = frame[(frame.scheme == "tq-kv") & (frame.budget == 2)]
    model = 4 * 32 + 2 * 16
    assert tq["bits_per_element"].iloc[0] == 2 + 32 / 16
    assert tq["model_bits"].iloc[0] == model
    assert tq["model_bits_per_element"].iloc[0] == pytest.approx(model / (2 * 32 * 16), rel=1e-12)
    assert tq["storage_bits_per_element"].iloc[0] == tq["bits_per_element"].iloc[0]


def test_same_command_same_rows_and_paired_data(tmp_path):
    _, a = run(tmp_path, "a")
    _, b = run(tmp_path, "b")
    pd.testing.assert_frame_equal(rows(a), rows(b))
    _, c = run(tmp_path, "c", "--seed", "1")
    assert not rows(a)["rel_mse_k"].equals(rows(c)["rel_mse_k"])


def test_rows_do_not_depend_on_chunking(tmp_path):
    # sq/squ: d_eff (so the stream length and the code widths in use) differs between trials of
    # spectral_decay, and on lowrank_aligned at d = 64 the power iteration runs on a partial block
    config = SweepConfig(scenarios=("spectral_decay", "lowrank_aligned"), schemes=("tq-kv", "tq-fkv", "squ-kv", "sq-qkv"),
                         budgets=(3,), dims=(64,), seq_lens=(32,), queries=(4,), trials=7, device="cpu",
                         calib_tokens=(96,))
    one, many = RunStore(tmp_path / "one"), RunStore(tmp_path / "many")
    runner.run_sweep(config, one, progress=False)
    runner.run_sweep(config, many, progress=False, memory_bytes=1)   # one trial per chunk
    a, b = one.trials(), many.trials()
    pd.testing.assert_frame_equal(a, b, check_exact=True)
    for name in ("squ-kv", "sq-qkv"):                                  # the cases the ledger must get right
        assert a[(a.scheme == name) & (a.scenario == "spectral_decay")]["bits_per_element"].nunique() > 1


def test_interrupted_run_keeps_finished_cells_and_resume_completes(tmp_path, monkeypatch):
    _, clean = run(tmp_path, "clean")
    real = engine.run_cell_chunk
    interrupt_at_chunk(monkeypatch, 3)
    code, out = run(tmp_path, "resumed")
    assert code == 130
    assert len(RunStore(out).finished_cells()) == 2           # the two cells before the interrupt
    assert len(rows(out)) == 2 * 6                             # and no partial cell
    monkeypatch.setattr(engine, "run_cell_chunk", real)
    code, out = run(tmp_path, "resumed", "--resume")
    assert code == 0
    pd.testing.assert_frame_equal(rows(out), rows(clean))


@pytest.mark.parametrize("args,message", [
    (["--scheme", "nope"], "unknown name 'nope'; available: all, plain-kv"),
    (["--scenario", "nope"], "unknown scenario 'nope'; available: gaussian"),
    (["--budget", "9"], "budget 9 is outside 1..8"),
    (["--budget", "0"], "budget 0 is outside 1..8"),
    (["--dim", "100"], "100 is not a power of two"),
    (["--trials", "0"], "--trials 0 must be at least 2"),
    (["--seq-len", "-4"], "--seq-len -4 must be a positive integer"),
    (["--budget", "two"], "is not a comma-separated list of integers"),
    (["--device", "tpu"], "invalid choice: 'tpu'"),
    (["--rng", "xorshift"], "invalid choice: 'xorshift'"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, capsys, args, message):
    out = tmp_path / "never"
    base = {"--scenario": "gaussian", "--scheme": "tq-kv", "--budget": "2", "--dim": "16"}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    argv = ["run", "--out", str(out), "--trials", "2", "--seq-len", "8", "--queries", "2"]
    for flag, value in base.items():
        argv += [flag, value]
    argv += [a for a in args if a not in base and a not in base.values()]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()


def test_output_directory_holding_another_run(tmp_path, capsys):
    _, out = run(tmp_path, "a")
    before = (out / RESULTS_FILE).read_bytes()
    code, _ = run(tmp_path, "a")                                    # same run, no --resume
    assert code == 2 and "already holds a run; pass --resume" in capsys.readouterr().err
    code, _ = run(tmp_path, "a", "--resume", "--seed", "5")        # a different run
    err = capsys.readouterr().err
    assert code == 2 and "holds a different run (differs in: seed)" in err
    assert (out / RESULTS_FILE).read_bytes() == before
    assert run(tmp_path, "a", "--resume")[0] == 0                   # same run resumes: nothing to do


def test_export_csv_and_parquet(tmp_path):
    _, out = run(tmp_path, "a")
    assert main(["export", str(out), "--format", "csv"]) == 0
    assert main(["export", str(out), "--format", "parquet"]) == 0
    frame = rows(out)
    pd.testing.assert_frame_equal(pd.read_csv(out / "results.csv"), frame, check_dtype=False)
    pd.testing.assert_frame_equal(pd.read_parquet(out / "results.parquet"), frame)
    assert main(["export", str(tmp_path / "missing")]) == 2


def test_list_json_reads_the_registry(capsys):
    import scenarios
    import schemes
    assert main(["list", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert [s["name"] for s in listing["schemes"]] == schemes.available()
    assert [s["name"] for s in listing["scenarios"]] == scenarios.available() + scenarios.parametric()
    assert all(s["description"] for s in listing["schemes"] + listing["scenarios"])


def test_module_entry_point_help_and_error(tmp_path):
    import subprocess
    import sys
    ok = subprocess.run([sys.executable, "-m", "harness", "run", "--help"], capture_output=True, text=True)
    assert ok.returncode == 0 and "--scenario" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "harness", "run", "--scenario", "gaussian", "--scheme", "x"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("given, expected", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_openmp_wait_policy_is_set_before_torch_loads(given, expected):
    """The harness asks idle OpenMP threads to sleep (OMP_WAIT_POLICY=PASSIVE, read once when torch
    loads libgomp): set on importing the package, before its modules load torch, as the CLI's
    entry points (python -m harness, kvharness = harness.cli:main) import it; a value the user
    set is kept."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given:
        env["OMP_WAIT_POLICY"] = given
    probe = ("import os, sys\n"
             "import harness\n"
             "seen = (os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)\n"
             "import harness.cli\n"
             "harness.cli.build_parser()\n"          # every command's modules, torch among them
             "print(*seen, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [expected, "False", "True"]


def test_paper_grid_preset_and_explicit_override():
    from harness.cli import build_parser
    from harness.commands.run import config_from_args
    import schemes
    parser, _ = build_parser()
    config = config_from_args(parser.parse_args(["run", "--grid", "paper", "--trials", "7", "--dim", "64"]))
    assert config.budgets == (2, 3, 4, 5, 6, 7) and config.seq_lens == (1024,) and config.queries == (64,)
    assert config.trials == 7 and config.dims == (64,)                     # explicit flags win
    assert len(config.scenarios) == 6 and "tq-kv" in config.schemes and "plain-kv" in config.schemes
    assert all(n.split("-")[0] in ("plain", "tq", "sq", "squ") for n in config.schemes)
    assert set(config.schemes) <= set(schemes.available())


def test_paper_grid_is_resolved_without_importing_the_optional_families():
    """`--grid paper` lists the sixteen paper schemes from the built-ins: it imported kvpress and
    transformers (4.3 s and 220 MB of resident memory on a 2-core AMD EPYC) to list press names
    it then dropped. The same sixteen as the full listing's."""
    import subprocess
    import sys
    code = ("import sys, schemes; from harness.sweep import grid; names = grid('paper')['schemes']; "
            "print(len(names), 'kvpress' in sys.modules, 'transformers' in sys.modules, ','.join(names))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    n, kvpress, transformers, names = done.stdout.split()
    assert (n, kvpress, transformers) == ("16", "False", "False"), done.stdout + done.stderr
    import schemes
    assert names.split(",") == [x for x in schemes.available() if x.split("-")[0] in ("plain", "tq", "sq", "squ")]


def test_sigkill_mid_sweep_then_resume_gives_exactly_the_uninterrupted_rows(tmp_path):
    """A run killed with SIGKILL keeps what it committed (sqlite transactions) and nothing of the
    chunk it was writing; --resume adds the rest, with no duplicates, and the rows equal those of
    an uninterrupted run. The run waits inside its third commit's transaction until it is killed
    (tests/interrupting.py), so the kill lands there every time."""
    import signal

    from interrupting import start_held, stored_chunks, wait_for_hold
    args = ["--scenario", "gaussian,heavy_tail,lowrank_aligned,spectral_decay", "--scheme", "tq-kv,plain-kv,tq-qkv",
            "--budget", "2,3", "--dim", "32", "--seq-len", "256", "--queries", "8", "--trials", "40", "--quiet"]
    assert main(["run", *args, "--out", str(tmp_path / "clean")]) == 0
    out, marker = tmp_path / "killed", tmp_path / "held"
    proc = start_held(["run", *args, "--out", str(out)], marker, 3, "during")
    wait_for_hold(proc, marker)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert stored_chunks(out, live=False) == 2                   # the third commit rolled back
    partial = rows(out)                                         # one chunk of 40 trials per cell
    assert len(partial) == 2 * 40 and len(RunStore(out).finished_cells()) == 2
    assert main(["run", *args, "--out", str(out), "--resume"]) == 0
    resumed, clean = rows(out), rows(tmp_path / "clean")
    assert not resumed.duplicated(["scenario", "scheme", "budget", "dim", "seq_len", "queries", "trial"]).any()
    pd.testing.assert_frame_equal(resumed, clean)


def test_other_failures_are_one_line_exit_1(tmp_path, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / RESULTS_FILE).write_text("garbage")
    assert main(["export", str(bad)]) == 2                          # a damaged store: a user-facing error
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "not a database" in err
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert main(["run", "--scenario", "gaussian", "--scheme", "tq-kv", "--out", str(afile), *SMALL]) == 2


def test_a_sweep_builds_each_codec_once_to_validate_and_each_cell_once_to_run(tmp_path, monkeypatch):
    """`run --scheme all`: each (codec, budget, dim) is built once to validate the sweep and to
    skip the codecs that cannot take it (not once for each), and each cell's scheme once to run,
    beside the two new instances the stand-alone check builds (cell.check_sample) in the one cell
    of each codec it checks (cell.sample_trial: one budget of each of this repository's codecs)."""
    import collections
    import itertools

    import schemes
    from harness.cli import build_parser
    from harness.commands.run import config_from_args

    built = collections.Counter()
    create = schemes.create

    def counted(name, **kw):
        built[(name, kw["budget"], kw["dim"])] += 1
        return create(name, **kw)
    monkeypatch.setattr(schemes, "create", counted)
    argv = ["run", "--scenario", "gaussian", "--scheme", "all", "--budget", "2,3", "--dim", "12", "--seq-len", "32",
            "--queries", "4", "--trials", "2", "--quiet", "--out", str(tmp_path / "run")]
    config = config_from_args(build_parser()[0].parse_args(argv))
    ran = set(itertools.product(config.schemes, (2, 3), (12,)))
    skipped = set(schemes.registry.all_schemes()) - set(config.schemes)
    assert "tq-kv" in skipped and "int8" in config.schemes                # d = 12 is no power of two
    assert ran <= set(built) <= ran | set(itertools.product(skipped, (2, 3), (12,)))
    assert set(built.values()) == {1}
    built.clear()
    assert main(argv) == 0
    # validated, built for its cell, twice by check_sample at one budget; a skipped codec once
    for name in config.schemes:
        assert sorted(built[(name, b, 12)] for b in (2, 3)) == [1 + 1, 1 + 1 + 2], name
    assert {n for key, n in built.items() if key not in ran} == {1}


def test_all_with_a_bad_setting_names_the_setting(capsys):
    """The settings are validated before the codecs are built: `all` with --dim 0 names --dim,
    not every codec as unable to take the sweep."""
    assert main(["run", "--scenario", "gaussian", "--scheme", "all", "--dim", "0", "--trials", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--dim 0 must be a positive integer" in err and "skipping" not in err


def test_a_command_imports_only_its_own_modules():
    """`harness report`'s parser is built from its own module alone: the command line does not
    import torch for a command that does not use it; the full parser (no or an unknown command,
    --help) still has every command."""
    import subprocess
    import sys

    from harness.cli import build_parser
    probe = ("import sys; from harness.cli import build_parser; parser, handlers = build_parser(['report', 'x']); "
             "print(sorted(handlers), 'torch' in sys.modules)")
    seen = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert seen.stdout.split() == ["['report']", "False"], seen.stdout + seen.stderr
    _, handlers = build_parser(["--help"])
    assert {"run", "report", "export", "list", "validate"} <= set(handlers)
