"""harness list: the registered schemes and scenarios."""
from __future__ import annotations

import json

import scenarios
import schemes

NAME = "list"
HELP = "registered schemes and scenarios"


def add_arguments(p):
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args) -> int:
    listing = {
        "schemes": [{"name": s.name, "description": s.description} for s in schemes.specs().values()],
        "scenarios": [{"name": n, "description": scenarios.describe(n)}
                      for n in scenarios.available() + scenarios.parametric()],
    }
    if args.json:
        print(json.dumps(listing, indent=2))
        return 0
    for kind in ("schemes", "scenarios"):
        print(f"{kind}:")
        for item in listing[kind]:
            print(f"  {item['name']:<20} {item['description']}")
    return 0
