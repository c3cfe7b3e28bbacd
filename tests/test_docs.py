"""README.md and docs/ speak of the product: the README is short, no document carries development
history (commit hashes, "this machine", "session") or points outside the repository, every
relative link resolves (to a file, and to a heading where it names one), and CI runs the README's
test command as written."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_README_LINES = 310
FORBIDDEN_WORDS = ("this machine", "session", "../shared")
# a commit-hash-like word: 7 to 40 hex digits with at least one digit and one letter
HEX = re.compile(r"(?<![0-9A-Za-z_])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![0-9A-Za-z_])")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def documents(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def forbidden(text: str) -> list[str]:
    """The forbidden words and hash-like strings of a text."""
    lowered = text.lower()
    return [w for w in FORBIDDEN_WORDS if w in lowered] + HEX.findall(text)


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lowercase, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.*)$", text, re.M)}


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """Each relative link of a Markdown file that names no file inside the repository, or a
    heading its target does not have."""
    out = []
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):   # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.is_relative_to(root.resolve()) or not resolved.exists():
            out.append(f"{path.name}: {target} (no such file in the repository)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            out.append(f"{path.name}: {target} (no such heading)")
    return out


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; at most {MAX_README_LINES}"


@pytest.mark.parametrize("path", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_development_history(path):
    assert forbidden(path.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize("path", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    assert broken_links(path) == []


def test_the_checks_catch_what_they_look_for(tmp_path):
    assert forbidden("head 7482e2b on this Machine, see ../shared/x") == ["this machine", "../shared", "7482e2b"]
    assert forbidden("b = 2..7, 345,600 rows, 2605.08114, deadbeef, 1234567, ±2.5 %") == []
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n## The `--json` flag\n", encoding="utf-8")
    page = tmp_path / "README.md"
    page.write_text("[ok](docs/a.md#the---json-flag) [top](#title) [web](https://example.org)\n# Title\n"
                    "[gone](docs/b.md) [out](../x.md) [bad](docs/a.md#nowhere)\n```\n[code](not/a/link.md)\n```\n",
                    encoding="utf-8")
    (tmp_path.parent / "x.md").write_text("outside\n", encoding="utf-8")
    assert broken_links(page, tmp_path) == ["README.md: docs/b.md (no such file in the repository)",
                                            "README.md: ../x.md (no such file in the repository)",
                                            "README.md: docs/a.md#nowhere (no such heading)"]


def test_ci_runs_the_readme_test_command():
    """The README's second set-up command is the line CI runs, byte for byte."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert readme[2] == "```bash" and readme[5] == "```"
    assert readme[4] in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
