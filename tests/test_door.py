"""One door for every command (issue 47 item 5): every path a command reads or writes is checked
by harness/commands/_args.py before any work — empty, read-only, missing parent, a directory
where a file is needed (and the reverse), missing or unreadable input, a capture whose windows
overlap — and refused with exit 2, one line naming the option, the path, what is wrong and what
is valid; the files around are left as they were (no .lock, no partial file).

Read-only cases run the command as another user than the owner of a mode-555 directory: as
root (who ignores mode bits) the test process switches its effective user to nobody around the
call, which the checks (os.access for the effective user, a real probe) and the kernel both see."""
import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

from harness.cli import main
from scenarios.replay import load_capture, overlapping_windows
from test_capture_replay import synthetic_arrays, write_npz

TINY = ["run", "--dim", "32", "--seq-len", "64", "--queries", "8", "--trials", "2", "--budget", "2", "--quiet"]
NOBODY = 65534


def refused(capsys, argv, *words):
    """main(argv) exits 2 with one line on stderr holding every word, and no traceback."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, (code, err)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for word in words:
        assert word in err, (word, err)
    return err


@contextlib.contextmanager
def as_another_user():
    """The block runs as a user who does not own the test's files: as root, the effective user
    and group nobody (restored after); as anyone else, that user already is one."""
    if os.geteuid() != 0:
        yield
        return
    try:
        os.setegid(NOBODY)
        os.seteuid(NOBODY)
    except PermissionError:
        os.setegid(0)
        pytest.skip("root without the right to switch the effective user: no user for whom a directory is read-only")
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


def snapshot(base: Path) -> dict:
    """Every path under base with its bytes (None for a directory) and mode: .lock files included."""
    return {str(p.relative_to(base)): (None if p.is_dir() else p.read_bytes(), p.stat().st_mode)
            for p in sorted(base.rglob("*"))}


@pytest.fixture(scope="module")
def base():
    """A directory any user may enter (/tmp, not pytest's owner-only tmp_path) holding: cap.npz (a
    capture), spec.json, text.txt, afile, secret.npz (owner-only), overlap.npz and gap.npz,
    ro/ (mode 555), made/run (a finished tiny run; made/ did not exist before it) and rorun/ (a
    copy of it with a recommendation.json, mode 555)."""
    root = Path(tempfile.mkdtemp(dir="/tmp"))
    root.chmod(0o755)
    arrays, meta = synthetic_arrays(np.random.default_rng(0))
    write_npz(root / "cap.npz", arrays, meta)
    write_npz(root / "secret.npz", arrays, meta).chmod(0o600)
    positions = arrays["positions"].copy()
    positions[60:100] = np.arange(20, 60)              # segment 0 reads tokens 20..59 a second time
    write_npz(root / "overlap.npz", {**arrays, "positions": positions}, meta)
    positions = arrays["positions"].copy()
    positions[150:] += 5                                # segment 1 skips five positions
    write_npz(root / "gap.npz", {**arrays, "positions": positions}, meta)
    (root / "spec.json").write_text("{}")
    (root / "text.txt").write_text("some text")
    (root / "afile").write_text("x")
    (root / "ro").mkdir(mode=0o555)
    (root / "ro").chmod(0o555)
    for path in root.iterdir():
        if path.is_file() and path.name != "secret.npz":
            path.chmod(0o644)
    run = root / "made" / "run"
    assert main([*TINY, "--scenario", "gaussian", "--scheme", "int4", "--out", str(run)]) == 0
    rorun = root / "rorun"
    shutil.copytree(run, rorun)
    (rorun / "recommendation.json").write_text(json.dumps({"bits": 3, "layers": [{"layer": 0, "scheme": "int4",
                                                                                    "budget": 2}]}))
    for path in [root / "made", *(root / "made").rglob("*"), *rorun.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    rorun.chmod(0o555)
    yield root
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    shutil.rmtree(root)


def _check(capsys, base, argv, words, other_user=False):
    before = snapshot(base)
    argv = [str(x).replace("B/", f"{base}/") for x in argv]
    with as_another_user() if other_user else contextlib.nullcontext():
        refused(capsys, argv, *[w.replace("B/", f"{base}/") for w in words])
    assert snapshot(base) == before


# (command and arguments with B/ for the base directory, words the one line holds)
EMPTY = {
    "run --out": ([*TINY, "--scenario", "gaussian", "--scheme", "int4", "--out", ""], ["--out", "empty"]),
    "recommend --out": (["recommend", "B/cap.npz", "--bits", "3", "--out", ""], ["--out", "empty"]),
    "predictivity --out": (["predictivity", "B/cap.npz", "--spec", "B/spec.json", "--out", ""], ["--out", "empty"]),
    "reproduce --out": (["reproduce", "amd-paper", "--quick", "--out", ""], ["--out", "empty"]),
    "fit --out": (["fit", "B/cap.npz", "--out", ""], ["--out", "empty"]),
    "capture --out": (["capture", "--out", ""], ["--out", "empty"]),
    "export --output": (["export", "B/made/run", "--output", ""], ["--output", "empty"]),
    "fit CAPTURE": (["fit", ""], ["capture", "empty"]),
    "predictivity --spec": (["predictivity", "B/cap.npz", "--spec", "", "--out", "B/never"], ["--spec", "empty"]),
    "capture --text": (["capture", "--text", "", "--out", "B/x.safetensors"], ["--text", "empty"]),
    "compare RUN_A": (["compare", "", "B/made/run"], ["RUN_A", "empty"]),
    "effect --model": (["effect", "--scheme", "int4", "--model", ""], ["--model", "empty"]),
}
READ_ONLY = {
    "run --out new": ([*TINY, "--scenario", "gaussian", "--scheme", "int4", "--out", "B/ro/new"],
                      ["--out", "B/ro/new", "cannot be made", "B/ro is not writable", "valid:"]),
    "run --out existing --resume": ([*TINY, "--scenario", "gaussian", "--scheme", "int4", "--out", "B/ro", "--resume"],
                                    ["--out", "B/ro is not writable", "valid:"]),
    "recommend --out": (["recommend", "B/cap.npz", "--bits", "3", "--out", "B/ro/new"], ["--out", "B/ro is not writable"]),
    "predictivity --out": (["predictivity", "B/cap.npz", "--spec", "B/spec.json", "--out", "B/ro/new"],
                           ["--out", "B/ro is not writable"]),
    "reproduce --out": (["reproduce", "amd-paper", "--quick", "--out", "B/ro/new"], ["--out", "B/ro is not writable"]),
    "validate --out": (["validate", "--scenario", "gaussian", "--scheme", "int4", "--out", "B/ro/new"],
                       ["--out", "B/ro is not writable"]),
    "fit --out": (["fit", "B/cap.npz", "--out", "B/ro/spec.json"], ["--out", "cannot be written", "B/ro is not writable"]),
    "capture --out": (["capture", "--out", "B/ro/x.safetensors"], ["--out", "B/ro is not writable"]),
    "export --output": (["export", "B/made/run", "--output", "B/ro/x.csv"], ["--output", "B/ro is not writable"]),
    "export into a read-only run": (["export", "B/rorun"], ["--output", "B/rorun/results.csv", "B/rorun is not writable"]),
    "effect into a read-only run": (["effect", "--recommendation", "B/rorun"], ["--recommendation", "B/rorun is not writable"]),
    "fit unreadable CAPTURE": (["fit", "B/secret.npz"], ["B/secret.npz cannot be read"]),
    "run unreadable replay:FILE": ([*TINY, "--scenario", "replay:B/secret.npz", "--scheme", "int4", "--out", "B/never"],
                                   ["B/secret.npz", "cannot be read"]),
}
# report and selftest: one line each in their own files (the door's types), owned elsewhere
READ_ONLY_ELSEWHERE = {
    "report into a read-only run": (["report", "B/rorun"], ["B/rorun is not writable"]),
    "selftest --out": (["selftest", "--quick", "--out", "B/ro/x.json"], ["--out", "B/ro is not writable"]),
}
MISSING_PARENT = {
    "fit --out": (["fit", "B/cap.npz", "--out", "B/nodir/spec.json"], ["--out", "the directory B/nodir does not exist"]),
    "capture --out": (["capture", "--out", "B/nodir/x.safetensors"], ["--out", "B/nodir does not exist"]),
    "export --output": (["export", "B/made/run", "--output", "B/nodir/x.csv"], ["--output", "B/nodir does not exist"]),
    "run --out under a file": ([*TINY, "--scenario", "gaussian", "--scheme", "int4", "--out", "B/afile/a/b"],
                               ["--out", "lies under B/afile, which is a file"]),
    "recommend --out under a file": (["recommend", "B/cap.npz", "--bits", "3", "--out", "B/afile/x"], ["lies under"]),
    "predictivity --out under a file": (["predictivity", "B/cap.npz", "--spec", "B/spec.json", "--out", "B/afile/x"],
                                        ["lies under"]),
    "reproduce --out under a file": (["reproduce", "amd-paper", "--out", "B/afile/x"], ["lies under"]),
    "fit --out under a file": (["fit", "B/cap.npz", "--out", "B/afile/spec.json"], ["which is a file"]),
}
DIRECTORY_FOR_FILE = {
    "fit --out": (["fit", "B/cap.npz", "--out", "B/made"], ["--out", "B/made is a directory", "valid:"]),
    "capture --out": (["capture", "--out", "B/made"], ["--out", "is a directory"]),
    "export --output": (["export", "B/made/run", "--output", "B/made"], ["--output", "is a directory"]),
    "fit CAPTURE": (["fit", "B/made"], ["capture", "is a directory"]),
    "recommend CAPTURE": (["recommend", "B/made", "--bits", "3", "--out", "B/never"], ["capture", "is a directory"]),
    "predictivity CAPTURE": (["predictivity", "B/made", "--spec", "B/spec.json", "--out", "B/never"], ["is a directory"]),
    "predictivity --spec": (["predictivity", "B/cap.npz", "--spec", "B/made", "--out", "B/never"],
                            ["--spec", "is a directory"]),
    "capture --text": (["capture", "--text", "B/made", "--out", "B/x.safetensors"], ["--text", "is a directory"]),
}
FILE_FOR_DIRECTORY = {
    "run --out": ([*TINY, "--scenario", "gaussian", "--scheme", "int4", "--out", "B/afile"], ["--out", "is a file"]),
    "recommend --out": (["recommend", "B/cap.npz", "--bits", "3", "--out", "B/afile"], ["--out", "is a file"]),
    "predictivity --out": (["predictivity", "B/cap.npz", "--spec", "B/spec.json", "--out", "B/afile"], ["is a file"]),
    "reproduce --out": (["reproduce", "amd-paper", "--out", "B/afile"], ["--out", "is a file"]),
    "compare RUN_B": (["compare", "B/made/run", "B/afile"], ["RUN_B", "is a file"]),
    "compare --null": (["compare", "B/made/run", "B/made/run", "--null", "B/afile"], ["--null", "is a file"]),
    "export DIRECTORY": (["export", "B/afile"], ["directory", "is a file"]),
    "capture --model": (["capture", "--model", "B/afile", "--out", "B/x.safetensors"], ["--model", "is a file"]),
    "effect --model": (["effect", "--scheme", "int4", "--model", "B/afile"], ["--model", "is a file"]),
}
MISSING_INPUT = {
    "fit CAPTURE": (["fit", "B/none.npz"], ["B/none.npz: no such capture file", "valid: a capture"]),
    "recommend CAPTURE": (["recommend", "B/none.npz", "--bits", "3", "--out", "B/never"], ["no such capture file"]),
    "predictivity CAPTURE": (["predictivity", "B/none.npz", "--spec", "B/spec.json", "--out", "B/never"],
                             ["no such capture file"]),
    "predictivity --spec": (["predictivity", "B/cap.npz", "--spec", "B/none.json", "--out", "B/never"],
                            ["--spec", "B/none.json: no such fitted scenario spec"]),
    "capture --text": (["capture", "--text", "B/none.txt", "--out", "B/x.safetensors"], ["--text", "does not exist"]),
    "compare RUN_A": (["compare", "B/none", "B/made/run"], ["RUN_A", "does not exist"]),
    "export DIRECTORY": (["export", "B/none"], ["does not exist", "valid: a run directory"]),
    "effect --model": (["effect", "--scheme", "int4", "--model", "B/none"], ["--model", "does not exist"]),
}
OVERLAP = {
    "run replay:FILE": ([*TINY, "--scenario", "replay:B/overlap.npz", "--scheme", "int4", "--out", "B/never"],
                        ["B/overlap.npz", "overlapping windows in segment 0", "valid:"]),
    "fit CAPTURE": (["fit", "B/overlap.npz"], ["B/overlap.npz", "overlapping windows"]),
    "recommend CAPTURE": (["recommend", "B/overlap.npz", "--bits", "3", "--out", "B/never"], ["overlapping windows"]),
    "run replay:FILE with a gap": ([*TINY, "--scenario", "replay:B/gap.npz", "--scheme", "int4", "--out", "B/never"],
                                   ["B/gap.npz", "a gap in segment 1", "valid:"]),
}


def _cases(table):
    return pytest.mark.parametrize("argv, words", list(table.values()), ids=list(table))


@_cases(EMPTY)
def test_an_empty_path_is_refused(base, capsys, argv, words):
    _check(capsys, base, argv, words)


@_cases(READ_ONLY)
def test_a_read_only_directory_or_unreadable_file_is_refused(base, capsys, argv, words):
    if argv[:2] == ["effect", "--recommendation"]:   # what effect imports, loaded before the user changes
        from harness import capture, effect  # noqa: F401
        from harness.commands.capture import offline_and_quiet
        offline_and_quiet()
    _check(capsys, base, argv, words, other_user=True)


@_cases(READ_ONLY_ELSEWHERE)
def test_report_and_selftest_refuse_a_read_only_output(base, capsys, monkeypatch, argv, words):
    import harness.commands.report
    import harness.known_answers

    def ran(*args, **kwargs):
        raise AssertionError(f"{argv[0]} ran past the door")
    monkeypatch.setattr(harness.known_answers, "run_selftest", ran)
    monkeypatch.setattr(harness.commands.report, "write_report", ran)
    _check(capsys, base, argv, words, other_user=True)


@_cases(MISSING_PARENT)
def test_an_output_file_in_a_missing_directory_is_refused(base, capsys, argv, words):
    _check(capsys, base, argv, words)


@_cases(DIRECTORY_FOR_FILE)
def test_a_directory_where_a_file_is_needed_is_refused(base, capsys, argv, words):
    _check(capsys, base, argv, words)


@_cases(FILE_FOR_DIRECTORY)
def test_a_file_where_a_directory_is_needed_is_refused(base, capsys, argv, words):
    _check(capsys, base, argv, words)


@_cases(MISSING_INPUT)
def test_a_missing_input_is_refused(base, capsys, argv, words):
    _check(capsys, base, argv, words)


@_cases(OVERLAP)
def test_a_capture_whose_windows_overlap_is_refused(base, capsys, argv, words):
    _check(capsys, base, argv, words)


def test_a_new_run_directory_gets_its_missing_parents(base):
    """The fixture's run went into made/run with made/ missing (README: --out runs/main on a fresh
    checkout): a missing parent of an output directory is made, not refused."""
    assert (base / "made" / "run" / "results.sqlite").is_file()


def test_the_read_only_cases_really_cannot_write(base):
    """The premise of the read-only cases: as the other user, making a file in ro/ or rorun/ fails."""
    with as_another_user():
        for directory in ("ro", "rorun"):
            with pytest.raises(PermissionError):
                (base / directory / "probe").write_text("x")
        with pytest.raises(PermissionError):
            (base / "secret.npz").read_bytes()
    assert not (base / "ro" / "probe").exists()


def test_windows_are_consecutive_positions_per_segment():
    """overlapping_windows: None for one run of consecutive positions per segment (what harness
    capture writes); the first token that repeats, steps back or skips is named otherwise."""
    segments = np.array([0, 0, 0, 1, 1, 2])
    assert overlapping_windows(np.array([0, 1, 2, 0, 1, 0]), segments) is None
    assert overlapping_windows(np.array([7, 8, 9, 3, 4, 0]), segments) is None   # a window may start past 0
    assert "overlapping windows in segment 0: token 2 is at position 1 after position 1" in \
        overlapping_windows(np.array([0, 1, 1, 0, 1, 0]), segments)
    assert "overlapping windows in segment 1: token 4 is at position 0" in \
        overlapping_windows(np.array([0, 1, 2, 0, 0, 0]), segments)
    assert "a gap in segment 0: token 1" in overlapping_windows(np.array([0, 2, 3, 0, 1, 0]), segments)
    assert "negative" in overlapping_windows(np.array([0, 1, 2, -1, 0, 0]), segments)


def test_a_capture_with_consecutive_windows_still_loads(base):
    cap = load_capture(base / "cap.npz")
    assert cap.n_tokens == 200 and overlapping_windows(cap.positions, cap.segments) is None


@pytest.mark.parametrize("argv", [[*TINY, "--scenario", "gaussian", "--scheme", "int4"], ["reproduce", "amd-paper", "--quick"]],
                         ids=["run", "reproduce"])
def test_the_default_out_in_a_read_only_directory_is_refused(base, capsys, monkeypatch, argv):
    """Without --out, runs/ in the current directory: refused when it cannot be made there."""
    import harness.reproduce  # noqa: F401   what the commands import on their way, loaded before the user changes
    import harness.runner  # noqa: F401
    import reports  # noqa: F401
    import stats.claims  # noqa: F401
    monkeypatch.chdir(base / "ro")
    _check(capsys, base, argv, ["--out's default runs", "cannot be made: B/ro is not writable", "give --out DIR"],
           other_user=True)
