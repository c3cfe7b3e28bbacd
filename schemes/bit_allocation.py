"""Bits per group of components by exact dynamic programming (Shard write-up §5): minimise the
modelled squared error Σ group_error subject to a bit budget, over a grid of widths; and a brute
force over every allocation, for tests."""
from __future__ import annotations

import itertools

BIT_CHOICES = (0, 2, 4, 6, 8)   # Shard's widths: whole 2-bit digits (packing.pack_mixed)


def group_error(variance: float, bits: int, drop_penalty: float) -> float:
    """Modelled squared error of a component group: uniform-quantiser noise variance/(3·4^b)
    (write-up §5), or the whole variance × drop_penalty when the group is dropped (b = 0)."""
    return variance * drop_penalty if bits == 0 else variance / (3.0 * 4 ** bits)


def allocate_bits(variances, sizes, budget_bits: int, *, drop_penalty: float = 4.0,
                  choices=BIT_CHOICES) -> tuple[int, ...]:
    """Bits per group minimising Σ group_error subject to Σ size·bits <= budget_bits (exact DP
    over the reachable costs; ties go to the cheaper, then lexicographically smaller choice)."""
    if 0 not in choices:
        raise ValueError(f"bit choices {choices} must include 0 so that every budget is feasible")
    states = {0: (0.0, ())}                                   # cost -> (error, allocation)
    for variance, size in zip(variances, sizes):
        nxt: dict[int, tuple[float, tuple]] = {}
        for cost, (err, alloc) in states.items():
            for bits in choices:
                c = cost + size * bits
                if c > budget_bits:
                    continue
                cand = (err + group_error(float(variance), bits, drop_penalty), alloc + (bits,))
                if c not in nxt or cand < nxt[c]:
                    nxt[c] = cand
        states = nxt
    best = min(states.items(), key=lambda item: (item[1][0], item[0], item[1][1]))
    return best[1][1]


def brute_force_allocation(variances, sizes, budget_bits, *, drop_penalty=4.0, choices=BIT_CHOICES):
    """Reference for tests: the minimal modelled error over every allocation within budget."""
    best = None
    for alloc in itertools.product(choices, repeat=len(variances)):
        if sum(s * b for s, b in zip(sizes, alloc)) <= budget_bits:
            err = sum(group_error(float(v), b, drop_penalty) for v, b in zip(variances, alloc))
            best = err if best is None else min(best, err)
    return best
