"""The simulator's answer for a planner's inner loop, without its event loop.

A compute-only schedule (F, B, W, BW; no R, no SEND/RECV) is a DAG: an action starts when
its rank is free and its predecessors have ended, plus the p2p latency on a cross-rank stage
edge (:func:`ds_autoplan.schedule.simulate`'s rules).  Start times are then a longest path,
computed once per (schedule, costs) in a topological order that is compiled once per
schedule.  The static search costs hundreds of (schedule, partition, recompute) variants on
the same few shapes with per-stage costs; the per-step planner of variable-length batches
(DynaPipe) compares a few micro-batch orders with costs per (stage, micro-batch).  Makespan
and peaks of :func:`run` are the simulator's to the last bit (the same additions in the same
order): ``tests/test_planner_space.py`` checks every registered schedule,
``tests/test_dynamic_plans.py`` the bit equality on costs per (stage, micro-batch)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

# duration / memory column per kind: F -> f, B -> b, W -> w, BW -> b + w
_KINDS = ("F", "B", "W", "BW")


@dataclass(frozen=True)
class Compiled:
    """A schedule compiled once for :func:`run`: actions in topological order with their rank,
    stage, micro-batch, kind, predecessors and rank predecessor."""
    order: tuple          # action indices, topological
    rank: np.ndarray      # [A] rank of each action
    stage: np.ndarray     # [A]
    mb: np.ndarray        # [A]
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
    """What :func:`run` returns: makespan, per-rank peak memory and busy time."""
    makespan: float
    peak_memory: np.ndarray
    busy: np.ndarray

    @property
    def bubble_ratio(self) -> float:
        """``1 - busy / (ranks * makespan)``, as :attr:`SimResult.bubble_ratio`."""
        return 1.0 - float(self.busy.sum()) / (len(self.busy) * self.makespan) if self.makespan > 0 else 0.0


@lru_cache(maxsize=64)
def compile_schedule(sched) -> Compiled | None:
    """The DAG of ``sched``; None when it has actions outside F/B/W/BW (use the simulator).
    Memoised: a :class:`~ds_autoplan.schedule.Schedule` is immutable and hashes by its
    lists (a per-step planner meets the same lists for every micro-batch order it tries).
    Dependencies as ``schedule.ir.DependencyIndex`` states them: F after F of the previous
    stage; B/BW after its F and after the next stage's backward; W after its B."""
    keys = [(a.kind.value, a.stage, a.mb) for lst in sched.ranks for a in lst]
    if any(k not in _KINDS for k, _, _ in keys):
        return None
    index = {k: i for i, k in enumerate(keys)}
    bwd = {(s, m): k for k, s, m in keys if k in ("B", "BW")}
    rank = np.repeat(np.arange(sched.num_ranks), [len(lst) for lst in sched.ranks])
    place, S = sched.placement, sched.num_stages
    prev, preds = [], []
    for lst in sched.ranks:
        base = len(prev)
        prev += [-1] + list(range(base, base + len(lst) - 1))
    for k, s, m in keys:
        if k == "F":
            ps = ((index[("F", s - 1, m)], place[s - 1] != place[s]),) if s > 0 else ()
        elif k == "W":
            ps = ((index[("B", s, m)], False),)
        elif s + 1 < S:
            ps = ((index[("F", s, m)], False), (index[(bwd[(s + 1, m)], s + 1, m)], place[s + 1] != place[s]))
        else:
            ps = ((index[("F", s, m)], False),)
        preds.append(ps)
    # Kahn's order over rank-sequence and dependency edges
    n = len(keys)
    succ = [[] for _ in range(n)]
    indeg = [0] * n
    for i in range(n):
        if prev[i] >= 0:
            succ[prev[i]].append(i)
            indeg[i] += 1
        for p, _ in preds[i]:
            succ[p].append(i)
            indeg[i] += 1
    order = [i for i in range(n) if indeg[i] == 0]
    for i in order:
        for j in succ[i]:
            indeg[j] -= 1
            if indeg[j] == 0:
                order.append(j)
    if len(order) != n:
        return None                     # a deadlock: let the simulator report it
    return Compiled(tuple(order), rank, np.array([s for _, s, _ in keys]),
                    np.array([m for _, _, m in keys]), np.array([_KINDS.index(k) for k, _, _ in keys]),
                    tuple(preds), tuple(prev), sched.num_ranks)


@lru_cache(maxsize=256)
def cached_build(name: str, d: int, n: int, opts: tuple):
    """``schedule.build(name, d, n, **dict(opts))``, memoised (schedules are immutable)."""
    from .builders import build
    return build(name, d, n, **dict(opts))


@lru_cache(maxsize=256)
def compiled(name: str, d: int, n: int, opts: tuple) -> Compiled | None:
    """The compiled DAG of the built schedule ``name`` (memoised through the builder cache), or
    None."""
    return compile_schedule(cached_build(name, d, n, opts))


def run(c: Compiled, f, b, w, mem_f, mem_b, mem_w, p2p: float) -> FastResult:
    """Durations and memory deltas per stage (``[S]`` each) or per (stage, micro-batch)
    (``[S, n]``) -> makespan, per-rank peak and busy time, as ``simulate`` computes them
    (allocations at start, frees at end, frees first on ties)."""
    f, b, w = (np.asarray(x, float) for x in (f, b, w))
    at = (c.kind, c.stage) if f.ndim == 1 else (c.kind, c.stage, c.mb)
    dur = np.stack([f, b, w, b + w])[at]                      # tables [kind, stage(, mb)]
    mf, mb, mw = (np.asarray(x, float) for x in (mem_f, mem_b, mem_w))
    delta = np.stack([mf, mb, mw, mb + mw])[at]
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
    nz = delta != 0
    d, alloc, rk = delta[nz], delta[nz] > 0, c.rank[nz]
    tm = np.where(alloc, st[nz], en[nz])
    o = np.lexsort((d, alloc, tm, rk))                         # per rank, by time, frees first
    d, rk = d[o], rk[o]
    # each rank's level: its own running sum from 0 (a row each, zero-padded), added in the
    # simulator's order
    count = np.bincount(rk, minlength=c.num_ranks)
    levels = np.zeros((c.num_ranks, int(count.max(initial=0)) + 1))
    levels[rk, np.arange(len(d)) - np.repeat(np.cumsum(count) - count, count)] = d
    peak = np.maximum(np.cumsum(levels, axis=1).max(axis=1), 0.0)
    return FastResult(makespan, peak, busy)


def run_costs(c: Compiled, costs) -> FastResult:
    """:func:`run` with a :class:`~ds_autoplan.schedule.Costs`; runtime overheads and
    backward transients are the simulator's only."""
    if costs.dispatch or costs.step or np.any(costs.b_transient):
        raise ValueError("fastsim: costs with runtime overheads or backward transients need "
                         "the simulator")
    return run(c, costs.f, costs.b, costs.w, costs.mem_f, costs.mem_b, costs.mem_w, costs.p2p)


@dataclass(frozen=True)
class Order:
    """Each rank's actions in program order (rank-major): rank, stage and kind index."""
    rank: np.ndarray
    stage: np.ndarray
    kind: np.ndarray
    num_ranks: int


@lru_cache(maxsize=256)
def order(name: str, d: int, n: int, opts: tuple) -> Order | None:
    """The program order of the built schedule ``name`` (memoised), or None when it has
    actions outside F/B/W/BW."""
    sched = cached_build(name, d, n, opts)
    acts = [(r, a.stage, a.kind.value) for r, lst in enumerate(sched.ranks) for a in lst]
    if any(k not in _KINDS for _, _, k in acts):
        return None
    r, s, k = zip(*acts)
    return Order(np.array(r), np.array(s), np.array([_KINDS.index(x) for x in k]), sched.num_ranks)


def peaks(c: Compiled | Order, mem_f, mem_b, mem_w) -> np.ndarray:
    """Per-rank peak of :func:`run` without its timing: a rank runs its actions one after
    another (allocations at an action's start, frees at its end), so its memory level peaks
    at some prefix of its own program order whatever the durations."""
    mf, mb, mw = (np.asarray(x, float) for x in (mem_f, mem_b, mem_w))
    delta = np.stack([mf, mb, mw, mb + mw])[c.kind, c.stage]
    cur = np.cumsum(delta)
    first = np.flatnonzero(np.r_[True, c.rank[1:] != c.rank[:-1]])
    level = cur - np.repeat((cur - delta)[first], np.diff(np.r_[first, len(delta)]))
    peak = np.zeros(c.num_ranks)
    np.maximum.at(peak, c.rank, level)
    return peak
