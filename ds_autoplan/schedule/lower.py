"""Lowering: compute-only lists → lists with SEND/RECV (docs/schedules.md §6.4, §5.6).

The compute lists are timed with the simulator; every cross-rank edge becomes a transfer
at the producer's end time.  A SEND goes right after its producer; the RECV (which only
*posts* the receive; the consumer waits for the data) goes on the consumer's rank before
the first action that starts at or after the transfer time, never after the consumer.  Every rank then sees
its transfers in one global (time, sequence) order, so even rendezvous sends cannot form
a cycle of waits (DynaPipe's communication planning); the simulator re-checks this with
``blocking=True``.
"""
from __future__ import annotations

import bisect

from .costs import Costs
from .ir import Action, DependencyIndex, Kind, Schedule, cross_stage_pred
from .simulator import SimResult, simulate


def lower(sched: Schedule, costs: Costs | None = None, timeline: SimResult | None = None
          ) -> Schedule:
    """Return ``sched`` with SEND_F/RECV_F/SEND_B/RECV_B inserted (idempotent).
    ``timeline``: ``simulate(sched, costs)`` when the caller has it already."""
    if sched.has_comm():
        return sched
    if costs is None:
        costs = Costs.uniform(sched)
    res = simulate(sched, costs) if timeline is None else timeline
    end = {a.key: v for a, v in res.end.items()}
    dep = DependencyIndex(sched)
    # transfers: (time, producer rank, seq) → (send action, recv action)
    transfers = []
    for a in sched.actions():
        xp = cross_stage_pred(a, dep)
        if xp is None:
            continue
        prod_rank = sched.placement[xp[1]]
        if prod_rank == a.rank:
            continue
        if a.kind == Kind.F:
            snd = Action(prod_rank, Kind.SEND_F, xp[1], a.mb, a.rank)
            rcv = Action(a.rank, Kind.RECV_F, a.stage, a.mb, prod_rank)
        else:
            snd = Action(prod_rank, Kind.SEND_B, xp[1], a.mb, a.rank)
            rcv = Action(a.rank, Kind.RECV_B, a.stage, a.mb, prod_rank)
        transfers.append((end[xp], prod_rank, xp[1], a.mb, snd, rcv))
    transfers.sort(key=lambda x: x[:4])
    # per rank: compute actions with ends; comm events keyed by (time, seq)
    out = []
    starts = {a.key: v for a, v in res.start.items()}
    for r, lst in enumerate(sched.ranks):
        begins = [starts[a.key] for a in lst]
        pos_of = {a.key: i for i, a in enumerate(lst)}
        slots: list[list[tuple]] = [[] for _ in range(len(lst) + 1)]  # comm before action i
        for seq, (tm, _, _, _, snd, rcv) in enumerate(transfers):
            if snd.rank == r:
                p = pos_of[(Kind.F if snd.kind == Kind.SEND_F else dep.backward_kind(snd.stage, snd.mb),
                            snd.stage, snd.mb)]
                slots[p + 1].append((tm, seq, snd))
            if rcv.rank == r:
                consumer = pos_of[(Kind.F if rcv.kind == Kind.RECV_F else dep.backward_kind(rcv.stage, rcv.mb),
                                   rcv.stage, rcv.mb)]
                i = bisect.bisect_left(begins, tm)  # first action starting >= transfer time
                slots[min(i, consumer)].append((tm, seq, rcv))
        new = []
        for i in range(len(lst) + 1):
            new.extend(x[2] for x in sorted(slots[i], key=lambda x: (x[0], x[1])))
            if i < len(lst):
                new.append(lst[i])
        out.append(new)
    return sched.replace_lists(out, lowered=True)
