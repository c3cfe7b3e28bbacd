"""harness list: the registered schemes and scenarios (--all: also the schemes and scenario plug-ins
that cannot run here, each with its reason)."""
from __future__ import annotations

import json

import scenarios
import schemes

NAME = "list"
HELP = "registered schemes and scenarios"


def add_arguments(p):
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--all", action="store_true", help="also the schemes and scenario plug-ins that cannot run here, "
                   "each with the reason (an optional package not installed, a kvpress press that needs a real "
                   "model, a plug-in that failed to load)")


def run(args) -> int:
    listing = {
        "schemes": [{"name": s.name, "description": s.description} for s in schemes.specs().values()],
        "scenarios": [{"name": n, "description": scenarios.describe(n)}
                      for n in scenarios.available() + scenarios.parametric()],
    }
    if args.all:
        listing["unavailable"] = [{"name": n, "reason": r} for n, r in schemes.unavailable().items()]
        listing["unavailable_scenarios"] = [{"name": n, "reason": r} for n, r in scenarios.unavailable().items()]
    if args.json:
        print(json.dumps(listing, indent=2))
        return 0
    titles = {"unavailable": "schemes that cannot run here:", "unavailable_scenarios": "scenarios that cannot run here:"}
    for kind, field in (("schemes", "description"), ("scenarios", "description"),
                        ("unavailable", "reason"), ("unavailable_scenarios", "reason")):
        if kind not in listing or (kind == "unavailable_scenarios" and not listing[kind]):
            continue
        print(titles.get(kind, f"{kind}:"))
        width = max([20] + [len(item["name"]) + 1 for item in listing[kind]])
        for item in listing[kind]:
            print(f"  {item['name']:<{width}} {item[field]}")
    return 0
