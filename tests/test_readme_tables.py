"""The generated tables of README.md and docs/ (scripts/render_tables.py): every copy is the rendering
of its JSON under docs/data/, a stale copy is caught, and the JSON is what the code computes today."""
from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _renderer():
    spec = importlib.util.spec_from_file_location("render_tables", ROOT / "scripts" / "render_tables.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


render_tables = _renderer()


def _data(name: str) -> dict:
    return json.loads((ROOT / render_tables.TABLES[name].data).read_text(encoding="utf-8"))


def _block(text: str, name: str) -> str:
    start, end = f"<!-- table:{name} -->\n", f"<!-- /table:{name} -->"
    assert start in text and end in text, f"no generated block {name}"
    return text.split(start, 1)[1].split(end, 1)[0]


def test_every_generated_copy_is_current():
    assert render_tables.stale() == [], "run: python scripts/render_tables.py"


def test_a_stale_copy_is_caught_and_rewritten(tmp_path):
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    readme = tmp_path / "README.md"
    text = readme.read_text(encoding="utf-8")
    block = _block(text, "reproduction")
    first = _data("reproduction")["claims"][0]
    row = next(line for line in block.splitlines() if line.startswith(f"| {first['id']} |"))
    other = "reproduced" if first["verdict"] != "reproduced" else "refuted"
    readme.write_text(text.replace(row, row.replace(f"| {first['verdict']} |", f"| {other} |")), encoding="utf-8")
    assert render_tables.stale(tmp_path) == ["README.md: reproduction"]
    assert render_tables.write(tmp_path) == ["README.md: reproduction"]
    assert render_tables.stale(tmp_path) == []
    assert readme.read_text(encoding="utf-8") == text


def test_an_unknown_or_missing_block_is_an_error(tmp_path):
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    statistics = tmp_path / "docs" / "statistics.md"
    text = statistics.read_text(encoding="utf-8")
    statistics.write_text(text.replace("<!-- table:operating -->\n" + _block(text, "operating")
                                       + "<!-- /table:operating -->", ""), encoding="utf-8")
    assert render_tables.stale(tmp_path) == ["operating: in no document"]
    statistics.write_text("<!-- table:nonesuch -->\n<!-- /table:nonesuch -->\n", encoding="utf-8")
    with pytest.raises(SystemExit, match="unknown generated table 'nonesuch'"):
        render_tables.stale(tmp_path)


def test_readme_reproduction_rows_state_the_stored_claims():
    """Each claim's verdict and counts, read from the README's text, equal the stored run's."""
    block = _block((ROOT / "README.md").read_text(encoding="utf-8"), "reproduction")
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in block.splitlines()
            if line.startswith("| ") and line.split(" | ")[0].strip("| ").isdigit()}
    claims = _data("reproduction")["claims"]
    assert sorted(map(int, rows)) == [c["id"] for c in claims] == list(range(1, len(claims) + 1))
    for c in claims:
        cells = [cell.strip(" |") for cell in rows[str(c["id"])]]
        assert cells[2] == c["verdict"]
        assert cells[4] == f"{c['n_as_claimed']} / {c['n_opposite']} / {c['n_tests']}"
        assert cells[3].startswith(f"{c['estimate']:.4g} [")


def test_operating_data_is_what_the_rule_gives_today():
    """One cell of the study (the seed change at n = 30) recomputed on the stored rows with the
    current verdict rule: each (change, n) draws from its own stream, so one cell alone gives the
    counts it has in the whole study."""
    from kvcommon.threads import torch_threads
    from stats.operating import load_pairs, study

    data = _data("operating")
    stored = {(r["change"], r["n"]): r["counts"] for r in data["null"]}
    with torch_threads(1):   # as the study runs: many small tests
        fresh = study(load_pairs(), ns=(30,), effects=(), repetitions=data["repetitions"],
                      n_permutations=data["permutations"], seed=data["seed"], changes=("seed",))
    assert fresh["null"][0]["counts"] == stored[("seed", 30)], \
        "run: python scripts/render_tables.py --produce operating"


@pytest.mark.slow
def test_reproduction_data_is_what_the_code_gives_today(tmp_path):
    """The quick reproduction rerun: every claim's verdict and counts as stored, its estimate to 4 digits."""
    from harness.reproduce import reproduce, sizes

    data = _data("reproduction")
    assert data["command"] == "harness reproduce amd-paper --quick"
    claims = reproduce(sizes()["quick"], tmp_path / "repro", progress=False)
    fresh = {int(r.id): r for r in claims.itertuples()}
    for c in data["claims"]:
        r = fresh[c["id"]]
        assert (r.verdict, r.n_tests, r.n_as_claimed, r.n_opposite) == (
            c["verdict"], c["n_tests"], c["n_as_claimed"], c["n_opposite"]), c["id"]
        assert f"{r.estimate:.4g}" == f"{c['estimate']:.4g}", c["id"]
