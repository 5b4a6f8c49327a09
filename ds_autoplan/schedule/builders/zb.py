"""ZB-H1: zero-bubble 1F1B with the backward split into B (input grad) and W (weight grad)
(Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, §3.1 handcrafted schedules;
docs/schedules.md §1.1, §4.2).

Warm-up and the F/B alternation are those of 1F1B; rank i postpones its W passes by i
micro-batches, so the W's fill the cool-down bubbles.  Rank i then holds at most
(d - i) + i = d micro-batches of activations: the same peak as 1F1B's first rank.  With
F = B = W the bubble is (d-1)(F+B-W), one third of 1F1B's (d-1)(F+B+W).
"""
from __future__ import annotations

from ..ir import Kind, Schedule, sequential_placement
from .registry import draft, register

F, B, W = Kind.F, Kind.B, Kind.W


def zb_h1_order(d: int, n: int, rank: int) -> list[tuple]:
    """ZB-H1 order of ``rank``: 1F1B's warm-up and F/B alternation with the rank's W passes delayed
    by ``rank`` micro-batches."""
    warm = min(d - rank - 1, n)
    keys = [(F, rank, m) for m in range(warm)]
    nf, nw = warm, 0
    for k in range(n):
        if nf < n:
            keys.append((F, rank, nf)); nf += 1
        keys.append((B, rank, k))
        if k - nw >= rank:          # W of micro-batch k - rank (delayed by `rank`)
            keys.append((W, rank, nw)); nw += 1
    keys += [(W, rank, m) for m in range(nw, n)]
    return keys


@register("zb-h1")
def zb_h1(d: int, n: int) -> Schedule:
    """ZB-H1 (one stage per rank, B/W split, peak activation memory of 1F1B)."""
    return draft(n, sequential_placement(d), [zb_h1_order(d, n, r) for r in range(d)])
