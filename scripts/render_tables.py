"""Render the generated tables of README.md and docs/*.md from the JSON kept under docs/data/.

A generated table sits between two markers in a Markdown file:

    <!-- table:NAME -->
    ...rendered by TABLES[NAME].render from TABLES[NAME].data...
    <!-- /table:NAME -->

Tables of results that come from a run are never edited by hand: the run's numbers are kept as
JSON (written by --produce from a stored run or a study), and this script writes the Markdown.

    python scripts/render_tables.py            # rewrite every generated block from its JSON
    python scripts/render_tables.py --check    # exit 1 naming each stale block; writes nothing
    harness report RUN_DIR --json > r.json && python scripts/render_tables.py --produce reproduction r.json --size quick
    python scripts/render_tables.py --produce operating [--repetitions 96]
    nice -n 10 python scripts/render_tables.py --produce power    # or scripts/power_table.py, then render

Adding a table is one entry in TABLES: its marker name, its JSON file, a render function from the
loaded JSON to Markdown, and (optionally) a producer that writes the JSON.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DATA = Path("docs/data")
BLOCK = re.compile(r"(<!-- table:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /table:(?P=name) -->)", re.S)


def _cell(text) -> str:
    """A Markdown table cell: pipes escaped, no line breaks."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def _grid(header, rows) -> str:
    lines = ["| " + " | ".join(map(_cell, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(_cell, row)) + " |" for row in rows]
    return "\n".join(lines)


# --- the reproduction of the AMD paper ----------------------------------------------------------------
def render_reproduction(data: dict) -> str:
    """The claims table exactly as the report's first screen shows it (reports.narrative.claim_rows)."""
    import pandas as pd

    from reports.narrative import CLAIM_HEADER, claim_rows

    claims = pd.DataFrame(data["claims"])
    rows = claim_rows(SimpleNamespace(claims=claims))
    counts = claims.verdict.value_counts()
    from stats.claims import VERDICTS

    tally = ", ".join(f"{int(counts.get(v, 0))} {v}" for v in VERDICTS)
    return (f"From `{data['command']}` ({data['reduced']}): {tally}. Each effect is the claim's headline "
            f"statistic at the comparison its effect text names: for most claims the one least favourable to the "
            f"claim, for a `partly` claim taken where the claim holds; what it measures, the test and the reason "
            f"are in [docs/reproduction.md](docs/reproduction.md#the-quick-reproduction).\n\n"
            + _grid(CLAIM_HEADER, rows))


def render_reproduction_details(data: dict) -> str:
    """How each claim was tested and why its verdict is what it is (reports.narrative.claim_detail_rows)."""
    import pandas as pd

    from reports.narrative import CLAIM_DETAIL_HEADER, claim_detail_rows

    rows = claim_detail_rows(SimpleNamespace(claims=pd.DataFrame(data["claims"])))
    return f"From `{data['command']}`.\n\n" + _grid(CLAIM_DETAIL_HEADER, rows)


CLAIM_FIELDS = ("id", "section", "claim", "test", "paired", "verdict", "reason", "effect", "estimate", "ci_low",
                "ci_high", "n_tests", "n_as_claimed", "n_opposite")


def produce_reproduction(args) -> dict:
    """From the output of `harness report DIR --json` of a reproduction run (args.source) and the
    size it was run at (args.size): the command, what it reduced, and per claim what the table needs."""
    from harness.reproduce import sizes

    if args.source is None:
        raise SystemExit("--produce reproduction needs the JSON of `harness report RUN_DIR --json` (a file or -)")
    text = sys.stdin.read() if args.source == "-" else Path(args.source).read_text()
    report = json.loads(text)
    if not report.get("claims"):
        raise SystemExit(f"{args.source}: no claims; give the report of a `harness reproduce` run")
    size = sizes()[args.size]
    command = "harness reproduce amd-paper" + ("" if args.size == "paper" else f" --{args.size}")
    return {"command": command, "reduced": f"reduced from the paper: {size.reduced}" if args.size != "paper"
            else "the paper's grid", "n_trials": report["n_trials"],
            "claims": [{k: c[k] for k in CLAIM_FIELDS} for c in report["claims"]]}


# --- operating characteristics of the verdict rule ---------------------------------------------------------
def render_operating(data: dict) -> str:
    """The false-alarm rates and the trials for 80 % power, as stats.operating prints them."""
    from stats.operating import table_markdown

    machine, uptime = data["machine"], data["machine"].get("uptime", "")
    load = uptime.split("load average:", 1)[1].strip() if "load average:" in uptime else "not recorded"
    return (f"From `{data['command']}` ({data['repetitions']} repetitions per harmless change and n; "
            f"{data['seconds'] / 60:.0f} min on {machine['cores']} cores of {machine['cpu']}, load average {load}). "
            f"False alarms, % of repetitions per verdict:\n\n" + table_markdown(data))


def produce_operating(args) -> dict:
    """Run the study of stats.operating on the stored real rows (its own command writes the JSON)."""
    import tempfile

    from stats.operating import main

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "operating.json"
        if main(["--repetitions", str(args.repetitions), "--json", str(out)]) != 0:
            raise SystemExit("stats.operating failed")
        data = json.loads(out.read_text())
    data["command"] = f"python -m stats.operating --repetitions {args.repetitions}"   # its JSON went to a temporary file
    return data


# --- the known-answer benchmark (harness selftest) ---------------------------------------------------------
def render_known_answers(data: dict) -> str:
    from harness.known_answers import table_markdown

    return table_markdown(data)


def render_known_answers_summary(data: dict) -> str:
    from harness.known_answers import summary_markdown

    return summary_markdown(data)


# --- the measured power of `validate --against` (scripts/power_table.py) -----------------------------------
def _power_script():
    """scripts/power_table.py as a module (scripts/ is no package)."""
    import importlib.util

    if "power_table" not in sys.modules:
        spec = importlib.util.spec_from_file_location("power_table", ROOT / "scripts" / "power_table.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules["power_table"]


def render_power(data: dict) -> str:
    """The smallest bug found in 95 % of repetitions per design and n, and the rates per size."""
    return _power_script().table_markdown(data)


def produce_power(args) -> dict:
    """Run scripts/power_table.py (about an hour on 2 cores) and return its JSON."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "power.json"
        if _power_script().main(["--json", str(out)]) != 0:
            raise SystemExit("scripts/power_table.py failed")
        return json.loads(out.read_text(encoding="utf-8"))


# --- the registry -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Table:
    data: Path                                   # JSON, relative to the repository root
    render: Callable[[dict], str]                # loaded JSON -> Markdown (without the markers)
    produce: Callable[..., dict] | None = None   # argparse namespace -> the JSON to store


TABLES: dict[str, Table] = {
    "reproduction": Table(DATA / "reproduction.json", render_reproduction, produce_reproduction),
    "reproduction-details": Table(DATA / "reproduction.json", render_reproduction_details),
    "operating": Table(DATA / "operating.json", render_operating, produce_operating),
    "known-answers": Table(DATA / "known_answers.json", render_known_answers),
    "known-answers-summary": Table(DATA / "known_answers.json", render_known_answers_summary),
    "power": Table(DATA / "power.json", render_power, produce_power),
}


def documents(root: Path = ROOT) -> list[Path]:
    """The Markdown files that may hold generated blocks: README.md and docs/**/*.md."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def rendered(name: str, root: Path = ROOT) -> str:
    table = TABLES[name]
    return table.render(json.loads((root / table.data).read_text(encoding="utf-8"))).rstrip("\n") + "\n"


def render_text(text: str, root: Path = ROOT, where: str = "") -> tuple[str, list[str]]:
    """(text with every generated block rendered, names of the blocks that changed). An unknown
    marker name is an error."""
    changed = []

    def one(match):
        name = match.group("name")
        if name not in TABLES:
            raise SystemExit(f"{where}: unknown generated table {name!r}; known: {', '.join(TABLES)}")
        body = rendered(name, root)
        if body != match.group("body"):
            changed.append(name)
        return match.group(1) + body + match.group(4)

    return BLOCK.sub(one, text), changed


def stale(root: Path = ROOT) -> list[str]:
    """'FILE: NAME' for every generated block whose text differs from its rendering, and
    'NAME: in no document' for a registered table that no document shows."""
    out, seen = [], set()
    for path in documents(root):
        text = path.read_text(encoding="utf-8")
        seen.update(m.group("name") for m in BLOCK.finditer(text))
        _, changed = render_text(text, root, str(path.relative_to(root)))
        out += [f"{path.relative_to(root)}: {name}" for name in changed]
    out += [f"{name}: in no document" for name in TABLES if name not in seen]
    return out


def write(root: Path = ROOT) -> list[str]:
    done = []
    for path in documents(root):
        text = path.read_text(encoding="utf-8")
        new, changed = render_text(text, root, str(path.relative_to(root)))
        if changed:
            path.write_text(new, encoding="utf-8")
            done += [f"{path.relative_to(root)}: {name}" for name in changed]
    return done


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if any generated block is stale; write nothing")
    p.add_argument("--produce", choices=[n for n, t in TABLES.items() if t.produce], default=None,
                   help="write the table's JSON (docs/data/) from a run or a study, then render")
    p.add_argument("source", nargs="?", default=None, help="--produce reproduction: `harness report DIR --json` output")
    p.add_argument("--size", choices=("quick", "paper"), default="quick", help="the reproduction's size (default quick)")
    p.add_argument("--repetitions", type=int, default=96, help="--produce operating: repetitions per harmless change and n")
    args = p.parse_args(argv)
    if args.produce:
        table = TABLES[args.produce]
        target = ROOT / table.data
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(table.produce(args), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"wrote {table.data}")
    if args.check:
        problems = stale()
        for line in problems:
            print(f"stale: {line}")
        if problems:
            print("run: python scripts/render_tables.py")
        return 1 if problems else 0
    for line in write():
        print(f"rendered {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
