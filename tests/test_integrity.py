"""Right numbers or a clear refusal (issue 31): a trial whose data or metrics are not finite is an
error naming its cell, never a stored zero; a codec that raises costs its own cells only; a codec
that writes its input in place fails and changes no other codec's rows."""
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pytest
import torch

from harness import cell as engine
from harness.cli import main
from harness.store import RunStore
from kvcommon import plugins
from schemes import registry
from schemes.base import Capabilities
from schemes.baselines import GroupQuant
from stats.metrics import trial_metrics

SMALL = ["--dim", "16", "--seq-len", "32", "--queries", "4", "--calib-tokens", "32", "--trials", "3", "--quiet"]
KEY = ["scenario", "scheme", "budget", "dim", "seq_len", "queries", "calib_tokens", "trial"]


class _EntryPoint:
    group = registry.ENTRY_POINT_GROUP

    def __init__(self, cls):
        self.name, self.value, self._cls = cls.name, f"tests:{cls.__name__}", cls

    def load(self):
        return self._cls


@pytest.fixture
def install(monkeypatch):
    """install(*classes): the classes as entry-point plug-ins, for this test only."""
    real = plugins.metadata.entry_points
    monkeypatch.setenv(plugins.ENV, "1")   # the suite keeps installed plug-ins out (tests/conftest.py)

    def put(*classes):
        def entry_points(**kwargs):   # other callers (torch's own plug-ins) see the real ones
            return [_EntryPoint(c) for c in classes] if kwargs == {"group": registry.ENTRY_POINT_GROUP} else real(**kwargs)
        monkeypatch.setattr(plugins.metadata, "entry_points", entry_points)
        monkeypatch.setattr(registry, "_plugins", None)
    yield put
    registry._plugins = None


def rows(out) -> pd.DataFrame:
    return RunStore(out).trials().sort_values(KEY).reset_index(drop=True)


# --- item 1: not finite is an error naming the cell, never a zero ------------------------------------
def test_a_trial_of_nan_data_scores_nan_not_a_perfect_zero():
    """The metrics' 0/0 guards compare with > 0, which is False on NaN: a NaN trial stored rel_mse 0,
    d2 0. Each metric of the NaN trial is NaN now; the other trials are untouched."""
    g = torch.Generator().manual_seed(0)
    k, v, q = (torch.randn(3, 1, 16, 8, generator=g) for _ in range(3))
    k_hat, v_hat = k + 0.1, v - 0.1
    clean = trial_metrics(k, v, q, k_hat, v_hat, q @ k_hat.transpose(-1, -2) / 8 ** 0.5)
    k[1] = float("nan")
    v[1] = float("nan")
    dirty = trial_metrics(k, v, q, k_hat, v_hat, q @ k_hat.transpose(-1, -2) / 8 ** 0.5)
    for name, values in dirty.items():
        assert torch.isnan(values[1]), name
        assert torch.equal(values[[0, 2]], clean[name][[0, 2]]), name


@dataclass
class NaNDecoder(GroupQuant):
    """Decodes K of trial 1 to NaN."""
    name = "nan-decoder"

    def decode(self, enc):
        k, v = super().decode(enc)
        k = k.clone()
        k[1] = float("nan")
        return k, v


def test_a_codec_decoding_nan_fails_its_cell_by_name_and_stores_the_others(install, tmp_path, capsys):
    install(NaNDecoder)
    out = tmp_path / "run"
    code = main(["run", "--scenario", "gaussian", "--scheme", "int4,nan-decoder", "--budget", "4",
                 "--out", str(out), *SMALL])
    err = capsys.readouterr().err
    assert code == 1
    assert len(err.strip().splitlines()) == 1
    assert "scheme nan-decoder, budget 4, dim 16" in err and "rel_mse_k" in err and "trial 1" in err
    stored = rows(out)
    assert set(stored.scheme) == {"int4"} and len(stored) == 3
    assert RunStore(out).stored_trials() == {("gaussian", "int4", 4, 16, 32, 4, 32): 3}


def test_data_that_are_not_finite_stop_the_run_naming_the_data(monkeypatch, tmp_path, capsys):
    real = engine.draw_trials

    def with_inf(*args, **kwargs):
        data = real(*args, **kwargs)
        data["v"][2, 0, 5, 1] = float("inf")
        return data
    monkeypatch.setattr(engine, "draw_trials", with_inf)
    out = tmp_path / "run"
    code = main(["run", "--scenario", "gaussian", "--scheme", "int4,tq-kv", "--budget", "2", "--out", str(out), *SMALL])
    err = capsys.readouterr().err
    assert code == 1 and len(err.strip().splitlines()) == 1
    assert "scenario gaussian drew data that are not finite (v not finite in trial 2; dim 16, seq_len 32" in err
    assert not out.exists()   # nothing stored: nothing left behind


def test_the_finiteness_check_names_each_column_and_trial():
    columns = {"rel_mse_k": np.array([0.1, np.nan, 0.2]), "d2_t": np.array([0.1, 0.2, np.inf]),
               "bits_per_element": np.ones(3), "largest_abs_k": np.array([np.nan] * 3)}   # a diagnostic: not checked
    assert engine.non_finite_columns(columns, range(4, 7)) == "rel_mse_k, d2_t not finite in trials 5, 6"
    assert engine.non_finite_columns({"rel_mse_k": np.ones(3)}, range(3)) is None


# --- item 10: a codec that raises costs its own cells -------------------------------------------------
@dataclass
class Raiser(GroupQuant):
    name = "raiser"

    def encode(self, k, v):
        raise RuntimeError("plug-in bug")


def test_a_codec_that_raises_costs_only_its_cells(install, tmp_path, capsys):
    install(Raiser)
    out, alone = tmp_path / "run", tmp_path / "alone"
    code = main(["run", "--scenario", "gaussian", "--scheme", "tq-kv,raiser,int4", "--budget", "2,3",
                 "--out", str(out), *SMALL])
    err = capsys.readouterr().err
    assert code == 1 and len(err.strip().splitlines()) == 1
    assert "2 of 6 cells failed" in err and "codec raiser: 2 cell(s)" in err and "RuntimeError: plug-in bug" in err
    assert "the other 4 are stored" in err
    assert main(["run", "--scenario", "gaussian", "--scheme", "tq-kv,int4", "--budget", "2,3",
                 "--out", str(alone), *SMALL]) == 0
    pd.testing.assert_frame_equal(rows(out), rows(alone))


def test_all_with_a_raising_plugin_runs_the_rest(install, tmp_path, capsys):
    install(Raiser)
    out = tmp_path / "run"
    code = main(["run", "--scenario", "gaussian", "--scheme", "all,-shard,-shard-pca-decode,-svd", "--budget", "2",
                 "--out", str(out), "--dim", "16", "--seq-len", "32", "--queries", "4", "--calib-tokens", "32",
                 "--trials", "2", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and "codec raiser" in err[0]
    stored = set(rows(out).scheme)
    assert "raiser" not in stored and {"tq-kv", "int4", "sq-kv", "h2o"} <= stored


# --- item 3: a codec's rows never depend on its neighbours --------------------------------------------
@dataclass
class Halver(GroupQuant):
    """Writes its input in place: K in encode (the issue's case) or Q in score."""
    name = "halver"
    capabilities = Capabilities(scores_on_codes=True)    # the sweep calls its score
    where = "k"

    def encode(self, k, v):
        enc = super().encode(k, v)
        if self.where == "k":
            k.mul_(0.5)
        return enc

    def score(self, q, enc):
        if self.where == "q":
            q[0].mul_(0.5)          # a view: it shares its base's version counter
        return super().score(q, enc)


def test_the_codec_order_of_a_sweep_changes_no_row(tmp_path):
    """Five built-in codecs of four families (eviction, a calibrated basis, shared codings of the
    tq variants), in one order and the reverse: the same rows, bit for bit."""
    names = ["tq-kv", "tq-qkv", "sq-kv", "kivi", "h2o"]
    frames = []
    for order in (names, names[::-1]):
        out = tmp_path / "-".join(order)
        assert main(["run", "--scenario", "heavy_tail", "--scheme", ",".join(order), "--budget", "2,3",
                     "--out", str(out), *SMALL]) == 0
        frames.append(rows(out))
    pd.testing.assert_frame_equal(*frames, check_exact=True)


@pytest.mark.parametrize("where,tensor", [("k", "k"), ("q", "q")])
def test_a_codec_writing_its_input_fails_by_name_and_changes_no_other_row(install, monkeypatch, tmp_path, capsys,
                                                                         where, tensor):
    """The writer runs first in its chunk: the codecs after it get the data as drawn (the chunk is
    drawn again), so their rows equal a run without it."""
    monkeypatch.setattr(Halver, "where", where)
    install(Halver)
    out, alone = tmp_path / "run", tmp_path / "alone"
    code = main(["run", "--scenario", "gaussian", "--scheme", "halver,tq-kv,int4", "--budget", "2",
                 "--out", str(out), *SMALL])
    err = capsys.readouterr().err
    assert code == 1 and len(err.strip().splitlines()) == 1
    assert f"codec halver wrote its input {tensor} in place" in err and "codec halver: 1 cell(s)" in err
    assert main(["run", "--scenario", "gaussian", "--scheme", "tq-kv,int4", "--budget", "2", "--out", str(alone),
                 *SMALL]) == 0
    pd.testing.assert_frame_equal(rows(out), rows(alone), check_exact=True)


# --- item 12: --workers on a sweep too small to pay for their start ----------------------------------
def test_workers_on_a_small_sweep_run_serially_and_say_so(monkeypatch, tmp_path, capsys):
    from harness import distributed

    def no_cluster(*args, **kwargs):
        raise AssertionError("a cluster was started for a sweep too small to pay for it")
    monkeypatch.setattr(distributed, "cluster", no_cluster)
    args = ["run", "--scenario", "gaussian", "--scheme", "tq-kv,int4", "--budget", "2", *SMALL]
    assert main(args + ["--out", str(tmp_path / "w"), "--workers", "2"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("harness run: running serially, not on 2 workers: this sweep is about")
    assert main(args + ["--out", str(tmp_path / "s")]) == 0
    pd.testing.assert_frame_equal(rows(tmp_path / "w"), rows(tmp_path / "s"), check_exact=True)


def test_the_serial_estimate_grows_with_the_work():
    from harness.distributed import CELL_S, SERIAL_BELOW_S, serial_estimate_s
    from harness.sweep import SweepConfig
    small = SweepConfig(scenarios=("gaussian",), schemes=("tq-kv",), budgets=(2,), dims=(16,), seq_lens=(32,),
                        queries=(4,), trials=3)
    large = SweepConfig(scenarios=("gaussian",), schemes=("tq-kv", "sq-kv", "int4"), budgets=(2, 3, 4), dims=(128,),
                        seq_lens=(1024,), queries=(64,), trials=200)     # 9 cells of a paper setting
    cell = small.cells()[0]
    assert CELL_S < serial_estimate_s(small, small.cells()) < 1
    assert serial_estimate_s(small, small.cells(), {cell: 3}) == CELL_S        # nothing left but the cell's fixed cost
    assert serial_estimate_s(large, large.cells()) > SERIAL_BELOW_S


# --- item 9: a stored run with values that are not finite is reported, the cells named ---------------
def test_report_leaves_out_cells_that_are_not_finite_and_names_each(tmp_path, capsys):
    """A store written by another tool (or an old version): int4's d2_t NULL in every trial (a codec
    that decoded NaN), kivi's rel_mse_k NULL in one trial. `report --json` and `report` exit 0,
    name each of the two cells in one line, and report the other cells exactly as a store without
    the two cells does."""
    import json
    import shutil
    import sqlite3

    out = tmp_path / "run"
    assert main(["run", "--scenario", "gaussian", "--scheme", "tq-kv,tq-qkv,int4,kivi", "--budget", "2", "--out",
                 str(out), *SMALL[:-3], "--trials", "4", "--quiet"]) == 0
    (out / ".lock").unlink(missing_ok=True)
    without = tmp_path / "without"
    shutil.copytree(out, without)
    with sqlite3.connect(out / "results.sqlite") as con:
        con.execute("UPDATE trials SET d2_t = NULL WHERE scheme = 'int4'")
        con.execute("UPDATE trials SET rel_mse_k = NULL WHERE scheme = 'kivi' AND trial = 1")
    with sqlite3.connect(without / "results.sqlite") as con:
        for table in ("trials", "cells"):
            con.execute(f"DELETE FROM {table} WHERE scheme IN ('int4', 'kivi')")
    capsys.readouterr()
    assert main(["report", str(out), "--json", "--permutations", "50"]) == 0
    captured = capsys.readouterr()
    found = json.loads(captured.out)
    lines = [line for line in captured.err.splitlines() if line.startswith("harness report: left out")]
    assert lines == [
        "harness report: left out: cell (scenario gaussian, scheme int4, budget 2, dim 16, seq_len 32, queries 4, "
        "calib_tokens 32): d2_t not finite in 4 of 4 trials",
        "harness report: left out: cell (scenario gaussian, scheme kivi, budget 2, dim 16, seq_len 32, queries 4, "
        "calib_tokens 32): rel_mse_k not finite in 1 of 4 trials"]
    assert found.pop("left_out") == [line.removeprefix("harness report: ") for line in lines]
    assert main(["report", str(without), "--json", "--permutations", "50"]) == 0
    reference = json.loads(capsys.readouterr().out)
    assert reference.pop("incomplete")["finished_cells"] == 2     # its manifest still names the 4 cells
    found.pop("provenance"), reference.pop("provenance")          # other directories, other times
    assert found == reference
    assert main(["report", str(out), "--permutations", "50"]) == 0
    assert (out / "report.html").exists() and "left out: cell (scenario gaussian, scheme int4" in \
        (out / "report.html").read_text()


def test_the_documented_nan_of_evicted_mass_is_no_reason_to_leave_a_cell_out():
    from stats.finite import finite_cells
    frame = pd.DataFrame({"scenario": "g", "scheme": ["tq-kv"] * 3 + ["h2o"] * 3, "budget": 2, "dim": 16,
                          "seq_len": 32, "queries": 4, "calib_tokens": 32, "trial": [0, 1, 2] * 2,
                          "d2_t": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6],
                          "evicted_mass": [np.nan] * 3 + [0.1, np.inf, 0.2]})
    usable, notes = finite_cells(frame, ("d2_t",), ("evicted_mass",))
    assert list(usable.scheme) == ["tq-kv"] * 3
    assert notes == ("left out: cell (scenario g, scheme h2o, budget 2, dim 16, seq_len 32, queries 4, "
                     "calib_tokens 32): evicted_mass not finite in 1 of 3 trials",)


# --- item 4, in the sweep: the first trial of each cell is checked as a stored encoding -----------
@dataclass
class KeepsTheCache(GroupQuant):
    """One byte a trial stored; decodes from the cache it kept on itself."""
    name = "keeps-cache"

    def encode(self, k, v):
        from schemes.base import Encoded
        self._kept = (k.clone(), v.clone())
        enc = Encoded(tuple(k.shape), k.dtype)
        enc.codes["byte"] = torch.zeros(k.shape[0], 1, dtype=torch.uint8)
        return enc

    def decode(self, enc):
        return self._kept


def test_the_sweep_refuses_a_codec_whose_encoding_does_not_stand_alone(install, tmp_path, capsys):
    install(KeepsTheCache)
    out = tmp_path / "run"
    code = main(["run", "--scenario", "gaussian", "--scheme", "keeps-cache,int4", "--budget", "2", "--out", str(out),
                 *SMALL])
    err = capsys.readouterr().err
    assert code == 1 and len(err.strip().splitlines()) == 1
    assert "scheme keeps-cache, budget 2" in err and "does not stand alone" in err
    assert set(rows(out).scheme) == {"int4"}


def test_the_checks_of_codecs_sharing_data_share_the_checked_trials_codings(monkeypatch, tmp_path):
    """This repository's codecs are checked in one cell each (sample_trial), on one trial for all:
    Shard's k-means of V runs once for that trial, not once per check (the checks' memos,
    cell._check_memos), and once per chunk; the rows are those of a sweep without the check."""
    import schemes.shard
    fits = []
    real = schemes.shard.kmeans
    monkeypatch.setattr(schemes.shard, "kmeans", lambda points, *a, **kw: fits.append(len(points)) or real(points, *a, **kw))
    monkeypatch.setenv(CHUNK_TRIALS_ENV, "4")
    sweep = ["run", "--scenario", "gaussian", "--scheme", "shard,shard-pca-decode", "--budget", "2,3,4", "--dim", "16",
             "--seq-len", "128", "--queries", "4", "--trials", "4", "--quiet"]
    assert main([*sweep, "--out", str(tmp_path / "checked")]) == 0
    assert sorted(fits) == [1, 4]           # the chunk's 4 trials once; the checked trial once
    monkeypatch.setattr(engine, "check_sample", lambda *args, **kwargs: None)
    assert main([*sweep, "--out", str(tmp_path / "unchecked")]) == 0
    pd.testing.assert_frame_equal(rows(tmp_path / "checked"), rows(tmp_path / "unchecked"), check_exact=True)


@pytest.mark.parametrize("then_raises", [False, True])
def test_a_built_in_codec_writing_its_input_when_coding_one_trial_alone_is_found(monkeypatch, tmp_path, capsys,
                                                                                 then_raises):
    """The checks of this repository's codecs share a copy of the checked trial: a write into it is
    found after the check, whether the check passed or failed after it, named as the writer's, and
    the copy is taken afresh for the next codec's check, which passes."""
    real = GroupQuant.encode

    def encode(self, k, v, *args, **kwargs):
        if len(k) == 1:
            k.mul_(0.5)
            if then_raises:
                raise RuntimeError("after the write")
        return real(self, k, v, *args, **kwargs)
    monkeypatch.setattr(GroupQuant, "encode", encode)
    code = main(["run", "--scenario", "gaussian", "--scheme", "int4,tq-kv,kivi", "--budget", "2", "--out",
                 str(tmp_path / "run"), *SMALL])
    err = capsys.readouterr().err
    assert code == 1 and "scheme int4, budget 2" in err and "the codec wrote its input k in place" in err
    assert "tq-kv" not in err and "kivi" not in err
    assert set(rows(tmp_path / "run").scheme) == {"tq-kv", "kivi"}


# --- issue 47: a run is a function of its inputs, checked; the store knows its own integrity ------
import hashlib  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import sqlite3  # noqa: E402

from harness.cell import CHUNK_TRIALS_ENV  # noqa: E402
from harness.provenance import input_files  # noqa: E402
from harness.store import CellDamage  # noqa: E402
from interrupting import interrupt_at_chunk  # noqa: E402

TINY = ["--budget", "4", "--dim", "32", "--seq-len", "16", "--queries", "4", "--calib-tokens", "32", "--quiet"]
SWEEP = ["run", "--scenario", "gaussian", "--scheme", "int4,tq-kv", "--trials", "6", *TINY]


def one_line(capsys, argv, code, *words) -> str:
    """main(argv) exits `code` with one line on stderr holding every word, and no traceback."""
    assert main(argv) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for word in words:
        assert word in err, (word, err)
    return err


def edit(out, *statements):
    with sqlite3.connect(out / "results.sqlite") as con:
        for statement in statements:
            con.execute(statement)


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    """SWEEP uninterrupted, committed in chunks of 3 trials (trials 0-2, 3-5 of each cell)."""
    out = tmp_path_factory.mktemp("clean") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CHUNK_TRIALS_ENV, "3")
        assert main([*SWEEP, "--out", str(out)]) == 0
    return out


@pytest.fixture
def run_copy(clean_run, tmp_path, monkeypatch):
    monkeypatch.setenv(CHUNK_TRIALS_ENV, "3")
    out = tmp_path / "run"
    shutil.copytree(clean_run, out)
    return out


def _capture(path, seed):
    from test_capture_replay import synthetic_arrays, write_npz
    arrays, meta = synthetic_arrays(np.random.default_rng(seed))
    return write_npz(path, arrays, meta)


def test_resume_refuses_a_changed_input_file_by_name_and_writes_nothing(tmp_path, capsys, monkeypatch):
    """Interrupted after its first chunk on replay:cap.npz, the run is resumed on another file at
    that path: exit 2, one line naming the file, store and manifest unchanged, no lock left. With
    the original back it resumes to the rows of an uninterrupted run on it. The manifest's digest
    is the file's sha256 (hashlib on its bytes)."""
    cap = _capture(tmp_path / "cap.npz", 0)
    argv = ["run", "--scenario", f"replay:{cap}", "--scheme", "int4", "--trials", "6", *TINY]
    reference = tmp_path / "reference"
    assert main([*argv, "--out", str(reference)]) == 0
    out = tmp_path / "run"
    monkeypatch.setenv(CHUNK_TRIALS_ENV, "3")
    with pytest.MonkeyPatch.context() as mp:
        interrupt_at_chunk(mp, 2)
        assert main([*argv, "--out", str(out)]) == 130
    original = cap.read_bytes()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["inputs"] == {str(cap): {"sha256": hashlib.sha256(original).hexdigest(), "bytes": len(original)}}
    _capture(cap, 1)                                          # another file at the same path
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.name != ".lock"}
    capsys.readouterr()
    one_line(capsys, [*argv, "--out", str(out), "--resume"], 2, f"input file {str(cap)} is not the one this run began "
             f"with", hashlib.sha256(original).hexdigest()[:12], hashlib.sha256(cap.read_bytes()).hexdigest()[:12])
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before      # nothing written, and no .lock
    cap.write_bytes(original)
    assert main([*argv, "--out", str(out), "--resume"]) == 0
    pd.testing.assert_frame_equal(RunStore(out).trials(), RunStore(reference).trials(), check_exact=True)


def test_a_manifest_without_digests_still_resumes(tmp_path, monkeypatch):
    """A run written before inputs were recorded (no `inputs` in its manifest) resumes as before."""
    cap = _capture(tmp_path / "cap.npz", 0)
    argv = ["run", "--scenario", f"replay:{cap}", "--scheme", "int4", "--trials", "6", *TINY]
    out = tmp_path / "run"
    monkeypatch.setenv(CHUNK_TRIALS_ENV, "3")
    with pytest.MonkeyPatch.context() as mp:
        interrupt_at_chunk(mp, 2)
        assert main([*argv, "--out", str(out)]) == 130
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["inputs"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert main([*argv, "--out", str(out), "--resume"]) == 0
    assert len(RunStore(out).trials()) == 6


def test_the_input_files_are_the_sources_of_parametric_scenarios_that_name_a_file(tmp_path):
    spec, cap = tmp_path / "spec.json", tmp_path / "cap.safetensors"
    spec.write_text("{}")
    cap.write_bytes(b"x")
    names = ["gaussian", "heavy_tail:dof=3", f"fitted:{spec}:layer=0", f"replay:{cap}", f"replay:{tmp_path}"]
    assert input_files(names) == {str(spec): spec, str(cap): cap}       # a directory is no input file


# Hand edits of the clean run's int4 cell (trials 0-5 in chunks 0-2, 3-5): what the damage is, and
# whether readers refuse it (duplicated, orphaned) or read the cell as unfinished (missing).
INT4 = "scheme = 'int4'"
EDITS = {
    "deleted trial": ([f"DELETE FROM trials WHERE {INT4} AND trial = 4"], "missing", (4,)),
    "deleted cells row": ([f"DELETE FROM cells WHERE {INT4}"], None, ()),
    "duplicated trial": ([f"INSERT INTO trials SELECT * FROM trials WHERE {INT4} AND trial = 1"], "duplicated", (1,)),
    "orphaned trial": ([f"INSERT INTO trials SELECT * FROM trials WHERE {INT4} AND trial = 1",
                        "UPDATE trials SET trial = 9 WHERE rowid = (SELECT MAX(rowid) FROM trials)"], "orphaned", (9,)),
    "moved trial": ([f"UPDATE trials SET trial = 7 WHERE {INT4} AND trial = 2"], "missing", (2,)),
}


@pytest.mark.parametrize("case", list(EDITS))
def test_damaged_trials_are_found_by_every_reader_and_resume_recomputes_them(run_copy, clean_run, capsys, case):
    """report, compare and export name the damaged cell: missing trials (or a deleted cells row) make
    it unfinished — read by none, said in one line and in the report's incomplete notice — and
    duplicated or orphaned rows are refused (exit 2, one line), never averaged in. --resume then
    recomputes the cell: rows identical to the clean run, both cells finished."""
    statements, kind, trials = EDITS[case]
    edit(run_copy, *statements)
    cell = ("gaussian", "int4", 4, 32, 16, 4, 32)
    found = [d for d in RunStore(run_copy).damage() if d.kind == kind]
    if kind is not None:
        assert found[0] == CellDamage(cell, kind, trials, True)
    refuses = kind in ("duplicated", "orphaned") or case == "moved trial"    # a moved row is orphaned too
    capsys.readouterr()
    for argv in (["report", str(run_copy), "--json", "--permutations", "20"], ["export", str(run_copy)],
                 ["compare", str(run_copy), str(clean_run), "--permutations", "20"]):
        if refuses:
            one_line(capsys, argv, 2, "gaussian/int4/4/32/16/4/32", "--resume")
            continue
        assert main(argv) == 0
        captured = capsys.readouterr()
        if kind == "missing":
            assert "gaussian/int4/4/32/16/4/32 lacks the row(s) of trial(s) 4" in captured.err
        if argv[0] == "report":
            assert json.loads(captured.out)["incomplete"]["finished_cells"] == 1
        if argv[0] == "compare":
            assert captured.out.startswith("1 matched cells (0 only in RUN_A, 1 only in RUN_B")
    assert main([*SWEEP, "--out", str(run_copy), "--resume"]) == 0
    assert RunStore(run_copy).damage() == [] and len(RunStore(run_copy).finished_cells()) == 2
    pd.testing.assert_frame_equal(RunStore(run_copy).trials(), RunStore(clean_run).trials(), check_exact=True)


def test_resume_recomputes_only_what_the_damage_reaches(run_copy, monkeypatch):
    """A deleted cells row costs the cell's last chunk; a trial deleted from the first chunk the
    whole cell, each trial once."""
    edit(run_copy, "DELETE FROM cells WHERE scheme = 'int4'", "DELETE FROM trials WHERE scheme = 'tq-kv' AND trial = 1")
    seen = []
    real = engine.run_cell_chunk

    def spy(scheme, data):
        seen.append((scheme.name, tuple(data["trials"].tolist())))
        return real(scheme, data)
    monkeypatch.setattr(engine, "run_cell_chunk", spy)
    assert main([*SWEEP, "--out", str(run_copy), "--resume"]) == 0
    computed = {}
    for name, trials in seen:
        computed.setdefault(name, []).extend(trials)
    assert computed == {"int4": [3, 4, 5], "tq-kv": [0, 1, 2, 3, 4, 5]}


@pytest.mark.parametrize("seed", range(4))
def test_the_damage_found_is_what_the_rows_show(run_copy, seed):
    """Random hand edits (rows deleted, duplicated, renumbered): the store's damage against an
    independent count of each (cell, trial)'s rows in the raw table."""
    gen = np.random.default_rng(seed)
    with sqlite3.connect(run_copy / "results.sqlite") as con:
        rowids = [r for (r,) in con.execute("SELECT rowid FROM trials")]
        for rowid in gen.choice(rowids, 5, replace=False):
            action = gen.integers(3)
            if action == 0:
                con.execute("DELETE FROM trials WHERE rowid = ?", (int(rowid),))
            elif action == 1:
                con.execute("INSERT INTO trials SELECT * FROM trials WHERE rowid = ?", (int(rowid),))
            else:
                con.execute("UPDATE trials SET trial = trial + 6 WHERE rowid = ?", (int(rowid),))
        raw = pd.read_sql_query("SELECT scheme, trial FROM trials", con)
    counts = raw.value_counts().to_dict()
    expected = set()
    for scheme in ("int4", "tq-kv"):
        cell = ("gaussian", scheme, 4, 32, 16, 4, 32)
        mine = {t: n for (s, t), n in counts.items() if s == scheme}
        for kind, trials in (("missing", [t for t in range(6) if t not in mine]),
                             ("duplicated", [t for t, n in mine.items() if n > 1]),
                             ("orphaned", [t for t in mine if t >= 6])):
            if trials:
                expected.add(CellDamage(cell, kind, tuple(sorted(trials)), True))
    assert set(RunStore(run_copy).damage()) == expected


def test_rows_of_a_cell_outside_the_run_are_refused_by_every_command(run_copy, clean_run, capsys):
    """Rows of a cell the manifest's configuration does not have cannot be recomputed: report,
    export, compare and --resume each refuse them in one line (exit 2); the resume leaves no lock."""
    edit(run_copy, "INSERT INTO trials SELECT * FROM trials WHERE scheme = 'int4' AND trial = 0",
         "UPDATE trials SET scheme = 'int8' WHERE rowid = (SELECT MAX(rowid) FROM trials)")
    capsys.readouterr()
    for argv in (["report", str(run_copy), "--json"], ["export", str(run_copy)], ["compare", str(clean_run), str(run_copy)],
                 [*SWEEP, "--out", str(run_copy), "--resume"]):
        one_line(capsys, argv, 2, "cell gaussian/int8/4/32/16/4/32 is not a cell of the run's configuration")
    assert (run_copy / ".lock").exists() is False


@pytest.mark.parametrize("value, shown", [("'abc'", "holds text ('abc')"), ("x'0102'", "holds blob (2 bytes)")])
def test_text_or_a_blob_in_a_numeric_column_is_one_line_exit_2(run_copy, clean_run, capsys, value, shown):
    edit(run_copy, f"UPDATE trials SET d2_t = {value} WHERE scheme = 'tq-kv' AND trial = 2")
    capsys.readouterr()
    for argv in (["report", str(run_copy)], ["report", str(run_copy), "--json"], ["export", str(run_copy)],
                 ["compare", str(run_copy), str(clean_run)], ["compare", str(clean_run), str(run_copy)],
                 [*SWEEP, "--out", str(run_copy), "--resume"]):
        one_line(capsys, argv, 2, "column d2_t of trials", shown, "trial 2 of cell gaussian/tq-kv/4/32/16/4/32")
    assert not (run_copy / ".lock").exists()


@pytest.mark.parametrize("change, words", [
    (lambda m: m.update(config=[1, 2]), "its config is a JSON list, not an object"),
    (lambda m: m["config"].update(dims=None), "its config field dims is null, not a list of integers"),
    (lambda m: m["config"].update(bogus=1), "its config holds the unknown field(s) bogus; valid: scenarios"),
    (lambda m: m["config"].update(trials="6"), "its config field trials is \"6\", not an integer"),
    (lambda m: m.update(resumed_at="now"), "its resumed_at is a JSON str, not a list"),
])
def test_a_manifest_that_is_no_run_s_is_one_line_exit_2_and_a_refused_resume_leaves_no_lock(run_copy, capsys, change,
                                                                                            words):
    manifest = json.loads((run_copy / "manifest.json").read_text())
    change(manifest)
    (run_copy / "manifest.json").write_text(json.dumps(manifest))
    assert (run_copy / ".lock").exists()                      # left by the run that made the store
    capsys.readouterr()
    for argv in (["report", str(run_copy)], ["report", str(run_copy), "--json"], [*SWEEP, "--out", str(run_copy), "--resume"]):
        one_line(capsys, argv, 2, "manifest.json is not what a run writes", words)
    assert not (run_copy / ".lock").exists()


def test_a_lock_that_is_a_directory_is_one_line_exit_2(run_copy, capsys):
    (run_copy / ".lock").unlink()
    (run_copy / ".lock").mkdir()
    capsys.readouterr()
    one_line(capsys, [*SWEEP, "--out", str(run_copy), "--resume"], 2, ".lock is a directory", "remove it")


def test_report_and_compare_refuse_a_store_without_a_usable_cell(run_copy, clean_run, tmp_path, capsys):
    """Every cell not finite: report exits 2 in one line, compare too; one cell not finite: compare
    leaves it out in one line and judges the other; 2 trials a cell: compare exits 2 in one line."""
    edit(run_copy, "UPDATE trials SET snr_err_k = 1e999 WHERE scheme = 'int4'")
    capsys.readouterr()
    assert main(["compare", str(run_copy), str(clean_run), "--permutations", "20"]) == 0
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "left out: cell gaussian/int4/4/32/16/4/32: 0 paired trial(s)" in captured.err
    assert captured.out.startswith("1 matched cells") and "1 left out" in captured.out and "gaussian tq-kv" in captured.out
    edit(run_copy, "UPDATE trials SET snr_err_k = 1e999, d2_t = NULL")
    for argv in (["report", str(run_copy)], ["report", str(run_copy), "--json"]):
        one_line(capsys, argv, 2, "no finished cell has finite values to report (2 left out")
    one_line(capsys, ["compare", str(run_copy), str(clean_run)], 2, "no matched cell can be tested (2 left out")
    two = tmp_path / "two"
    assert main([*SWEEP[:-len(TINY) - 2], "--trials", "2", *TINY, "--out", str(two)]) == 0
    capsys.readouterr()
    one_line(capsys, ["compare", str(two), str(two)], 2, "2 paired trial(s)", "needs at least 3")
