"""DawnPiper's binary pipeline partitioning (seed 002, Algorithm 1; docs/dawnpiper.md
§6.1-6.2), over any stage cost: the profile-level search (``search.dawnpiper``, cuts at fx
units, memory optimisation = keep/recompute/swap) and the block-level planner partitioner
(``search.partition.dawnpiper``, memory optimisation = the stage DP's checkpointing) both
run it.  Pure Python: planning imports no torch."""
from __future__ import annotations

from functools import lru_cache
from typing import Callable

INF = float("inf")


def left_group(k: int) -> int:
    """Stages split off on the left of ``k`` (§6.2: ceil(k/2); three stages: the paper's 1)."""
    return 1 if k == 3 else (k + 1) // 2


def binary_partition(n: int, stages: int, stage_cost: Callable, candidates: Callable,
                     widen: bool = False) -> tuple:
    """Cut units ``[0, n)`` into ``stages`` stages of at least one unit.

    ``stage_cost(lo, hi, x) -> (time, payload, needs_mo)`` costs units ``[lo, hi)`` as stage
    ``x`` (time ``inf`` if it cannot fit; ``needs_mo``: it fits only with memory optimisation).
    ``candidates(lo, hi, L, mid, R)`` lists the cuts between stages ``mid`` and ``mid + 1``
    from the compute-balanced one toward the memory-balanced one (Theorem 4.1: the best cut
    lies between them); the walk stops at the first cut needing no memory optimisation.
    ``widen``: when no candidate fits, try every other cut (§4.4).
    Returns ``(bottleneck time, ((lo, hi) per stage), (payload per stage))``; the bounds are
    None when no cut was costed."""

    @lru_cache(maxsize=None)          # §6.4: halves repeat across top cuts
    def bipar(lo, hi, L, R):
        if L == R:
            t, payload, mo = stage_cost(lo, hi, L)
            return t, ((lo, hi),), (payload,), mo
        mid = L + left_group(R - L + 1) - 1
        first, last = lo + mid - L + 1, hi - (R - mid)       # every stage keeps a unit
        cands = [c for c in candidates(lo, hi, L, mid, R) if first <= c <= last]
        rest = [c for c in range(first, last + 1) if c not in cands] if widen else []
        best = (INF, None, None, True)
        for c in cands + rest:
            if rest and c == rest[0] and best[0] < INF:
                break                                        # widen only when nothing fit
            tl, bl, pl, ml = bipar(lo, c, L, mid)
            tr, br, pr, mr = bipar(c, hi, mid + 1, R)
            if bl is None or br is None:
                continue
            t = max(tl, tr)
            if t < best[0] or best[1] is None:
                best = (t, bl + br, pl + pr, ml or mr)
            if t < INF and not (ml or mr):
                break                                        # first cut needing no MO (§6.1)
        return best

    t, bounds, payloads, _ = bipar(0, n, 0, stages - 1)
    return t, bounds, payloads
