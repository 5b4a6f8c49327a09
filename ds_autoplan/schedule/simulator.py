"""Discrete-event simulator: the test oracle for every schedule (docs/schedules.md §3).

Each rank executes its list in order; an action starts when the rank is free and all its
predecessors have ended (plus the p2p latency across ranks).  On compute-only lists the
cross-rank edges carry the latency; on lowered lists (with SEND/RECV) compute also needs
its local RECV to have been posted.  A RECV *posts* the receive (an
irecv; zero time); the compute that consumes the data waits until it has arrived, which is
``p2p`` after the SEND completed.  ``blocking=True`` gives sends
rendezvous semantics (a SEND waits until the peer has posted the matching RECV), which is
what exposes send/recv ordering deadlocks (check 6 of §3.3).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .costs import Costs
from .ir import (Action, DependencyIndex, Kind, Schedule, ScheduleError,
                 cross_stage_pred, matching_recv_key, validate)


class DeadlockError(ScheduleError):
    """Some rank waits forever.  ``heads`` maps rank → the action it is stuck on,
    ``cycle`` is a list of ranks that wait on each other (empty if a rank waits on an
    action that never comes)."""

    def __init__(self, msg: str, heads: dict, cycle: list):
        super().__init__(msg)
        self.heads = heads
        self.cycle = cycle


@dataclass
class SimResult:
    """What :func:`simulate` returns: makespan, start and end of every action, busy time, peak
    memory (bytes and units of one 1F1B stage's micro-batch) and memory curves per rank."""
    makespan: float
    start: dict = field(repr=False)
    end: dict = field(repr=False)
    busy: list[float] = field(default_factory=list)
    peak_memory: list[float] = field(default_factory=list)
    peak_units: list[float] = field(default_factory=list)
    mem_curve: list[list[tuple[float, float]]] = field(default_factory=list, repr=False)
    unit: float = 1.0

    @property
    def num_ranks(self) -> int:
        """Pipeline ranks simulated."""
        return len(self.busy)

    @property
    def bubble_ratio(self) -> float:
        """1 − (mean work per rank)/makespan (docs/schedules.md §8 decision 6)."""
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)

    @property
    def rank_bubble(self) -> list[float]:
        """Per rank, the idle share of the makespan."""
        return [1.0 - b / self.makespan if self.makespan > 0 else 0.0 for b in self.busy]

    @property
    def peak_activation(self) -> float:
        """The largest per-rank peak of activation memory."""
        return max(self.peak_memory)

    def timeline(self) -> list[dict]:
        """One record per action, sorted by rank then start."""
        rows = [{"rank": a.rank, "kind": a.kind.value, "stage": a.stage, "mb": a.mb,
                 "start": self.start[a], "end": self.end[a]} for a in self.start]
        rows.sort(key=lambda r: (r["rank"], r["start"], r["end"]))
        return rows

    def summary(self) -> dict:
        """Makespan, bubble ratio, peaks and busy times as a JSON-able dict."""
        return {"makespan": self.makespan, "bubble_ratio": self.bubble_ratio,
                "peak_activation": list(self.peak_units), "peak_memory": list(self.peak_memory),
                "busy": list(self.busy)}


def _wait_cycle(waits_on: dict[int, int | None]) -> list[int]:
    for r0 in waits_on:
        seen, r = [], r0
        while r is not None and r not in seen:
            seen.append(r)
            r = waits_on.get(r)
        if r is not None:
            return seen[seen.index(r):]
    return []


def simulate(sched: Schedule, costs: Costs, *, blocking: bool = False,
             check: bool = True) -> SimResult:
    """Simulate ``sched`` with ``costs``; raise :class:`DeadlockError` if it cannot finish."""
    if check:
        validate(sched)
    costs.check(sched)
    dep = DependencyIndex(sched)
    lowered = sched.has_comm()
    d = sched.num_ranks
    lists = sched.ranks
    owner = {a.key: a for a in sched.actions()}
    end: dict[tuple, float] = {}
    start_of: dict[tuple, float] = {}
    t = [0.0] * d
    idx = [0] * d
    busy = [0.0] * d
    events: list[list[tuple[float, int, float]]] = [[] for _ in range(d)]
    # send key -> time the matching receive was posted
    posted: dict[tuple, float] = {}
    latency = costs.p2p
    remaining = sum(len(lst) for lst in lists)

    def ready_time(a: Action):
        """Earliest start allowed by dependencies, or ``(None, what)`` with the first missing
        one: ``(end, key)`` (an action not ended yet) or ``(posted, key)`` (a receive not
        posted yet, blocking sends)."""
        r = t[a.rank]
        if a.kind == Kind.RECV_F or a.kind == Kind.RECV_B:
            # a RECV posts the receive (zero time); the consumer waits for the data
            posted[(Kind.SEND_F, a.stage - 1, a.mb) if a.kind == Kind.RECV_F
                   else (Kind.SEND_B, a.stage + 1, a.mb)] = r
            return r, None
        if a.kind in (Kind.SEND_F, Kind.SEND_B):
            p = dep.preds(a)[0]
            if p not in end:
                return None, (end, p)
            if blocking:  # rendezvous: wait until the peer has posted the receive
                if a.key not in posted:
                    return None, (posted, a.key)
                return max(r, end[p], posted[a.key]), None
            return max(r, end[p]), None
        for p in dep.preds(a):
            if p not in end:
                return None, (end, p)
            r = max(r, end[p])
        xp = cross_stage_pred(a, dep) if a.kind.is_compute else None
        if xp is not None and sched.placement[xp[1]] != a.rank:
            if lowered:
                rk = (Kind.RECV_F, a.stage, a.mb) if a.kind == Kind.F else (Kind.RECV_B, a.stage, a.mb)
                sk = (Kind.SEND_F, a.stage - 1, a.mb) if a.kind == Kind.F else \
                    (Kind.SEND_B, a.stage + 1, a.mb)
                for k in (rk, sk):
                    if k not in end:
                        return None, (end, k)
                r = max(r, end[sk] + latency)
            else:
                r = max(r, end[xp] + latency)
        return r, None

    # passes over the ranks in a fixed order (the order fixes ties downstream, e.g. in
    # lowering); a rank whose head waits on something that has not happened is skipped
    # without re-examining its head
    waiting: list = [None] * d
    while remaining:
        progressed = False
        for rank in range(d):
            lst = lists[rank]
            w = waiting[rank]
            if w is not None and w[1] not in w[0]:
                continue
            while idx[rank] < len(lst):
                a = lst[idx[rank]]
                st, waiting[rank] = ready_time(a)
                if st is None:
                    break
                dur = float(costs.duration(a.kind, a.stage, a.mb))
                en = st + dur
                start_of[a.key] = st
                end[a.key] = en
                t[rank] = en
                idx[rank] += 1
                remaining -= 1
                progressed = True
                if a.kind.is_compute:
                    busy[rank] += dur
                    delta = float(costs.mem_delta(a.kind, a.stage, a.mb, (a.stage, a.mb) in dep.rec))
                    tr = costs.transient(a.kind, a.stage, a.mb)
                    if tr:      # held from the backward's start, its net change at its end
                        events[rank].append((st, 1, tr))
                        delta -= tr
                    if delta:
                        # allocations happen at start, frees at end (conservative peak)
                        events[rank].append((st if delta > 0 else en, 1 if delta > 0 else 0, delta))
        if not progressed:
            _raise_deadlock(sched, idx, owner, dep, end)

    peaks, curves = [], []
    for rank in range(d):
        ev = sorted(events[rank])  # at equal times frees (0) before allocations (1)
        cur, peak, curve = 0.0, 0.0, [(0.0, 0.0)]
        for tm, _, delta in ev:
            cur += delta
            curve.append((tm, cur))
            peak = max(peak, cur)
        peaks.append(peak)
        curves.append(curve)
    unit = costs.unit(d) or 1.0
    first = min(start_of.values()) if start_of else 0.0
    # + the runtime's once-per-iteration work after the last action (Costs.step)
    makespan = (max(end.values()) - first + costs.step) if end else 0.0
    by_action = {owner[k]: v for k, v in start_of.items()}
    end_by_action = {owner[k]: v for k, v in end.items()}
    return SimResult(makespan, by_action, end_by_action, busy, peaks,
                     [p / unit for p in peaks], curves, unit)


def _raise_deadlock(sched: Schedule, idx, owner, dep, end) -> None:
    heads, waits_on = {}, {}
    for r, lst in enumerate(sched.ranks):
        if idx[r] >= len(lst):
            continue
        a = lst[idx[r]]
        heads[r] = a.short()
        missing = [p for p in dep.preds(a) if p not in end]
        if a.kind.is_compute:
            xp = cross_stage_pred(a, dep)
            if xp is not None and xp not in end:
                missing.append(xp)
        if a.kind in (Kind.RECV_F, Kind.RECV_B):
            waits_on[r] = a.peer
        elif a.kind in (Kind.SEND_F, Kind.SEND_B) and not missing:
            waits_on[r] = a.peer
        elif missing:
            p = missing[0]
            waits_on[r] = owner[p].rank if p in owner else None
        else:
            waits_on[r] = None
    cycle = _wait_cycle(waits_on)
    desc = ", ".join(f"rank {r} at {h}" for r, h in heads.items())
    cyc = " -> ".join(f"rank {r}" for r in cycle + cycle[:1]) if cycle else "none (an awaited action is missing)"
    raise DeadlockError(f"deadlock in schedule {sched.name!r}: {desc}; wait cycle: {cyc}",
                        heads, cycle)
