"""Saved-activation bytes per action, measured the same way in both adapters, and the
simulator costs they imply (the check that a runtime executes the simulator's memory model).

:class:`ActionMemory` records, for every compute action of a step, the change of the
tracked bytes (``runtime.memtrack.MemTracker``) and the rise above the level at its start
(the B of a split layer stashes its output gradient for W before it frees the saved
inputs, so the peak can lie inside B).  :func:`stage_costs` turns the values of one
micro-batch into simulator :class:`~ds_autoplan.schedule.Costs` (schedule/costs.py memory
model: F allocates ``mem_f``, or ``keep_ckpt`` when recomputed and R the rest; B and W
free; a B may hold ``b_transient`` more until its end).
"""
from __future__ import annotations

import contextlib

import numpy as np

from ...schedule import Costs, Kind, Schedule, ScheduleError
from . import trace


class ActionMemory:
    """(delta, rise) of tracked bytes per (kind, stage, mb) of the last step; with
    ``DS_AUTOPLAN_TRACE`` set, also each action's start and end (:mod:`.trace`)."""

    def __init__(self, tracker=None):
        self.tracker = tracker
        self.by_action: dict = {}
        self.timeline = trace.from_env()

    @contextlib.contextmanager
    def measure(self, kind: Kind, stage: int, mb: int):
        """Context around one compute action: records its (delta, rise) of tracked bytes and, when
        tracing, its start and end."""
        tr, tl = self.tracker, self.timeline
        if tr is None and tl is None:
            yield
            return
        t0 = trace.clock()
        if tr is not None:
            m0, peak0 = tr.current, tr.peak
            tr.peak = m0
        try:
            yield
        finally:
            if tr is not None:
                self.by_action[(Kind(kind), stage, mb)] = (tr.current - m0, tr.peak - m0)
                tr.peak = max(peak0, tr.peak)
            if tl is not None:
                tl.record(kind, stage, mb, t0, trace.clock())

    def new_step(self) -> None:
        """Forget the last step's measurements (a new step begins)."""
        self.by_action = {}
        if self.timeline is not None:
            self.timeline.next_step()


def stage_costs(sched: Schedule, by_action: dict, rank: int, mb: int = 0) -> Costs:
    """Simulator costs for ``rank``'s stages from the bytes measured for micro-batch ``mb``
    of each stage, applied to every micro-batch (unit times; other ranks' stages hold no
    memory).  A recomputed stage gives ``keep_ckpt`` = its F, ``mem_f`` = F + R; W must free
    exactly what F and B left (raises otherwise)."""
    S, n = sched.num_stages, sched.num_microbatches
    mf, mb_, rise, keep = (np.zeros(S) for _ in range(4))
    for s in sched.stages_of(rank):
        def get(kind, default=None):
            v = by_action.get((kind, s, mb), default)
            if v is None:
                raise ScheduleError(f"no measurement of {kind.value}{s}.{mb}")
            return v
        f, r = get(Kind.F), get(Kind.R, (0, 0))
        bk = Kind.B if (Kind.B, s, mb) in by_action else Kind.BW
        b, w = get(bk), get(Kind.W, (0, 0)) if bk == Kind.B else (0, 0)
        mf[s], keep[s], mb_[s], rise[s] = f[0] + r[0], f[0], b[0], b[1]
        if mf[s] + mb_[s] + w[0] != 0:
            raise ScheduleError(f"stage {s}: F{'+R' if r[0] else ''} {mf[s]:.0f}, B {mb_[s]:.0f} "
                                f"and W {w[0]:.0f} bytes do not balance")
    rec = {a.stage for a in sched.actions() if a.kind == Kind.R}
    keep = np.where([s in rec for s in range(S)], keep, mf)
    return Costs.per_stage(S, n, 1.0, 1.0, 1.0, mem_f=mf, mem_b=mb_,
                           keep_ckpt=keep).with_transient(rise)
