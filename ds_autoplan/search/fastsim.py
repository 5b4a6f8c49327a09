"""The simulator's answer for the planner's inner loop, without its event loop.

A compute-only schedule (F, B, W, BW; no R, no SEND/RECV) whose costs are per stage is a
DAG: an action starts when its rank is free and its predecessors have ended, plus the p2p
latency on a cross-rank stage edge (``schedule.simulator.simulate``'s rules).  Start times
are then a longest path, computed once per (schedule, costs) in a topological order that
is compiled once per schedule shape.  The planner costs hundreds of (schedule, partition,
recompute) variants on the same few shapes; ``tests/test_planner.py`` checks this against
the simulator on every registered schedule."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

# duration / memory column per kind: F -> f, B -> b, W -> w, BW -> b + w
_KINDS = ("F", "B", "W", "BW")


@dataclass(frozen=True)
class Compiled:
    order: tuple          # action indices, topological
    rank: np.ndarray      # [A] rank of each action
    stage: np.ndarray     # [A]
    kind: np.ndarray      # [A] index into _KINDS
    preds: tuple          # per action: ((pred index, cross-rank stage edge?), ...)
    prev: tuple           # per action: previous action on its rank, or -1
    num_ranks: int

    @property
    def split(self) -> bool:
        """B and W are separate actions (else BW carries both)."""
        return bool((self.kind == 2).any())


@dataclass
class FastResult:
    makespan: float
    peak_memory: np.ndarray
    busy: np.ndarray

    @property
    def bubble_ratio(self) -> float:
        return 1.0 - float(self.busy.sum()) / (len(self.busy) * self.makespan) if self.makespan > 0 else 0.0


def compile_schedule(sched) -> Compiled | None:
    """The DAG of ``sched``; None when it has actions outside F/B/W/BW (use the simulator)."""
    from ..schedule.ir import DependencyIndex, cross_stage_pred
    acts = [a for lst in sched.ranks for a in lst]
    if any(a.kind.value not in _KINDS for a in acts):
        return None
    dep = DependencyIndex(sched)
    index = {a.key: i for i, a in enumerate(acts)}
    prev, preds = [], []
    for lst in sched.ranks:
        prev += [-1] + [index[a.key] for a in lst[:-1]]
    place = sched.placement
    for a in acts:
        xp = cross_stage_pred(a, dep)
        preds.append(tuple((index[p], p == xp and place[p[1]] != a.rank) for p in dep.preds(a)))
    # Kahn's order over rank-sequence and dependency edges
    succ = [[] for _ in acts]
    indeg = [0] * len(acts)
    for i, (pv, ps) in enumerate(zip(prev, preds)):
        for p in ([pv] if pv >= 0 else []) + [p for p, _ in ps]:
            succ[p].append(i)
            indeg[i] += 1
    order = [i for i, k in enumerate(indeg) if k == 0]
    for i in order:
        for j in succ[i]:
            indeg[j] -= 1
            if indeg[j] == 0:
                order.append(j)
    if len(order) != len(acts):
        return None                     # a deadlock: let the simulator report it
    return Compiled(tuple(order), np.array([a.rank for a in acts]), np.array([a.stage for a in acts]),
                    np.array([_KINDS.index(a.kind.value) for a in acts]), tuple(preds), tuple(prev),
                    sched.num_ranks)


@lru_cache(maxsize=256)
def compiled(name: str, d: int, n: int, opts: tuple) -> Compiled | None:
    from .pipeline import _build
    return compile_schedule(_build(name, d, n, opts))


def run(c: Compiled, f, b, w, mem_f, mem_b, mem_w, p2p: float) -> FastResult:
    """Per-stage durations and memory deltas -> makespan, per-rank peak and busy time, as
    ``simulate`` computes them (allocations at start, frees at end, frees first on ties)."""
    f, b, w = (np.asarray(x, float) for x in (f, b, w))
    dur_tab = np.stack([f, b, w, b + w])                      # [kind, stage]
    mf, mb, mw = (np.asarray(x, float) for x in (mem_f, mem_b, mem_w))
    mem_tab = np.stack([mf, mb, mw, mb + mw])
    dur = dur_tab[c.kind, c.stage]
    dl = dur.tolist()
    end = [0.0] * len(dl)
    start = [0.0] * len(dl)
    prev, preds = c.prev, c.preds
    for i in c.order:
        pv = prev[i]
        s = end[pv] if pv >= 0 else 0.0
        for p, cross in preds[i]:
            e = end[p] + p2p if cross else end[p]
            if e > s:
                s = e
        start[i] = s
        end[i] = s + dl[i]
    st, en = np.array(start), np.array(end)
    makespan = float(en.max() - st.min())
    busy = np.bincount(c.rank, weights=dur, minlength=c.num_ranks)
    delta = mem_tab[c.kind, c.stage]
    nz = delta != 0
    d, alloc, rk = delta[nz], delta[nz] > 0, c.rank[nz]
    tm = np.where(alloc, st[nz], en[nz])
    o = np.lexsort((d, alloc, tm, rk))                         # per rank, by time, frees first
    d, rk = d[o], rk[o]
    cur = np.cumsum(d)
    # each rank's level: the running sum less the sum before the rank's first event
    head = np.maximum.accumulate(np.where(np.r_[True, rk[1:] != rk[:-1]], np.arange(len(d)), 0))
    level = cur - (cur - d)[head]
    peak = np.zeros(c.num_ranks)
    np.maximum.at(peak, rk, level)
    return FastResult(makespan, peak, busy)
