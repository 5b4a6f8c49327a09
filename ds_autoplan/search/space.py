"""The per-layer strategy space from Galvatron-BMW's decision trees (docs/planner.md §1.3,
pruning takeaways §1.2)."""
from __future__ import annotations

import itertools
import math

from ..cost.model import Strategy

PARADIGMS = ("DP", "SDP", "TP")


def divisors(n: int, upto: int | None = None) -> list[int]:
    """Positive divisors of ``n`` up to ``upto`` (default all), ascending (world sizes, degrees
    and batches need not be powers of two: BLOOM-176B ran pp=12 on 384 GPUs).  Trial division
    up to min(upto, sqrt(n)): the work is bounded by ``upto`` whatever ``n`` is."""
    hi = n if upto is None else min(n, max(int(upto), 0))
    small, large = [], []
    for k in range(1, min(math.isqrt(n), hi) + 1):
        if n % k == 0:
            small.append(k)
            if n // k != k and n // k <= hi:
                large.append(n // k)
    return small + large[::-1]


def ordered_factorizations(n: int, h: int) -> list[tuple]:
    """Ordered tuples of ``h`` factors >= 2 whose product is ``n``."""
    if h == 0:
        return [()] if n == 1 else []
    return [(f,) + rest for f in divisors(n)[1:] for rest in ordered_factorizations(n // f, h - 1)]


def decision_trees(n: int, prune_dp_sdp: bool = True) -> list[tuple]:
    """Trees for a group of ``n`` devices: tuples of (paradigm, degree), outer level first.
    Each paradigm appears at most once; takeaway 3 removes trees mixing DP and SDP."""
    if n == 1:
        return [()]
    trees = [tuple(zip(par, deg)) for h in (1, 2, 3)
             for par in itertools.permutations(PARADIGMS, h)
             for deg in ordered_factorizations(n, h)]
    if prune_dp_sdp:
        trees = [t for t in trees if not {"DP", "SDP"} <= {p for p, _ in t}]
    return trees


def enumerate_trees(n: int, prune_dp_sdp: bool = True, with_ckpt: bool = True) -> list[tuple]:
    """(tree, ckpt) pairs: every tree twice, with and without CKPT (§1.3)."""
    return [(t, ck) for t in decision_trees(n, prune_dp_sdp)
            for ck in ((False, True) if with_ckpt else (False,))]


def count_candidates(N: int, prune_dp_sdp: bool = True, with_ckpt: bool = True) -> int:
    """Total candidates over all PP degrees P = N/n (the paper's 68/44/22 for N = 8, §1.5)."""
    return sum(len(enumerate_trees(N // P, prune_dp_sdp, with_ckpt)) for P in divisors(N))


def tree_to_strategy(tree: tuple, ckpt: bool) -> Strategy:
    """A pruned tree (at most TP and one data paradigm) as a Strategy."""
    deg = dict(tree)
    if "DP" in deg and "SDP" in deg:
        raise ValueError("DP+SDP mixes are pruned (takeaway 3)")
    tp = deg.get("TP", 1)
    sdp = "SDP" in deg
    dp = deg.get("SDP", deg.get("DP", 1))
    tp_outer = len(tree) == 2 and tree[0][0] == "TP"
    return Strategy(tp, dp, 3 if sdp and dp > 1 else 0, tp_outer, ckpt)


def strategies(n: int, *, with_ckpt: bool = True, max_tp: int | None = None,
               allow_sdp: bool = True) -> list[Strategy]:
    """Galvatron-BMW's strategy set S for one stage group of ``n`` devices.  ``max_tp``
    prunes TP degrees beyond a node (TP across slow links never wins, takeaway 1)."""
    out = []
    for tree, ck in enumerate_trees(n, True, with_ckpt):
        s = tree_to_strategy(tree, ck)
        if max_tp and s.tp > max_tp:
            continue
        if s.sdp and not allow_sdp:
            continue
        if s not in out:
            out.append(s)
    return out
