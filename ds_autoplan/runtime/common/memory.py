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

import numpy as np

from ...schedule import Costs, Kind, Schedule, ScheduleError
from ...schedule.ir import BACKWARD_KINDS
from . import trace


class ActionMemory:
    """(delta, rise) of tracked bytes per (kind, stage, mb) of the last step; with
    ``DS_AUTOPLAN_TRACE`` set, also each action's start and end (:mod:`.trace`)."""

    def __init__(self, tracker=None, recorder=None):
        self.tracker = tracker
        self.by_action: dict = {}
        self.timeline = trace.from_env()
        self.recorder = recorder          # runtime.common.record.Recorder: the run's record

    def measured(self, table: dict) -> dict:
        """``table`` (kind -> handler taking the action) with every compute kind's handler
        recording its action (:meth:`begin` ... :meth:`end`), and with a recorder every
        kind's; ``table`` itself when nothing is tracked, traced or recorded.  Plain calls, no
        context manager: this runs around every action."""
        if self.tracker is None and self.timeline is None and self.recorder is None:
            return dict(table)
        begin, end = self.begin, self.end
        every = self.recorder is not None

        def wrap(kind, fn):
            def run(a):
                token = begin()
                try:
                    fn(a)
                finally:
                    end(token, kind, a.stage, a.mb)
            return run
        return {k: wrap(k, fn) if every or k.is_compute else fn for k, fn in table.items()}

    def begin(self):
        """Start measuring one action; :meth:`end` with the returned token records it."""
        tr, rec = self.tracker, self.recorder
        t0 = trace.clock() if self.timeline is not None or rec is not None else None
        w0 = rec.wait if rec is not None else 0.0
        if tr is None:
            return None, None, t0, w0
        m0, peak0 = tr.current, tr.peak
        tr.peak = m0
        return m0, peak0, t0, w0

    def end(self, token, kind: Kind, stage: int, mb: int) -> None:
        """Record the action :meth:`begin` started: its (delta, rise) of tracked bytes (a
        compute action's), when tracing its start and end, when recording its own time."""
        m0, peak0, t0, w0 = token
        tr = self.tracker
        if tr is not None:
            if kind.is_compute:
                self.by_action[(Kind(kind), stage, mb)] = (tr.current - m0, tr.peak - m0)
            tr.peak = max(peak0, tr.peak)
        if t0 is not None:
            t1 = trace.clock()
            if self.timeline is not None and kind.is_compute:
                self.timeline.record(kind, stage, mb, t0, t1)
            rec = self.recorder
            if rec is not None:
                rec.action(kind, t1 - t0, rec.wait - w0)

    def waited(self, t0: float) -> None:
        """A wait for a peer that began at ``t0`` (``trace.clock()``) ended now: the record's
        idle time, excluded from the action it happened in."""
        if self.recorder is not None:
            self.recorder.waited(trace.clock() - t0)

    def new_step(self) -> None:
        """Forget the last step's measurements (a new step begins)."""
        self.by_action = {}
        if self.timeline is not None:
            self.timeline.next_step()


# per kind, where its measured change of tracked bytes goes in the simulator's memory model
# (schedule/costs.py): F keeps ``keep_ckpt`` (all of ``mem_f`` unless recomputed), R allocates
# the rest of ``mem_f``, B/BW free ``mem_b`` (a BW also what W would), W frees ``mem_w``;
# None: the kind moves no saved activations and is not measured (SEND/RECV)
MEMORY_RULES = {Kind.F: "keep_ckpt", Kind.R: "mem_f", Kind.B: "mem_b", Kind.BW: "mem_b",
                Kind.W: "mem_w", Kind.SEND_F: None, Kind.RECV_F: None, Kind.SEND_B: None,
                Kind.RECV_B: None}


def memory_rule(kind: Kind) -> str | None:
    """The :data:`MEMORY_RULES` entry of ``kind``; a kind without one is an error."""
    try:
        return MEMORY_RULES[kind]
    except KeyError:
        raise ScheduleError(f"action kind {getattr(kind, 'value', kind)} has no memory rule "
                            f"(runtime.common.memory.MEMORY_RULES)") from None


def stage_costs(sched: Schedule, by_action: dict, rank: int, mb: int = 0) -> Costs:
    """Simulator costs for ``rank``'s stages from the bytes measured for micro-batch ``mb``
    of each stage, applied to every micro-batch (unit times; other ranks' stages hold no
    memory), by :data:`MEMORY_RULES`.  A recomputed stage gives ``keep_ckpt`` = its F,
    ``mem_f`` = F + R; W must free exactly what F and B left (raises otherwise)."""
    S, n = sched.num_stages, sched.num_microbatches
    got = {f: np.zeros(S) for f in ("keep_ckpt", "mem_f", "mem_b", "mem_w")}
    rise = np.zeros(S)
    for s in sched.stages_of(rank):
        for need in ((Kind.F,), (Kind.B, Kind.BW)):
            if not any((k, s, mb) in by_action for k in need):
                raise ScheduleError(f"no measurement of {'/'.join(k.value for k in need)}{s}.{mb}")
        for (kind, st, m), (delta, up) in by_action.items():
            if st != s or m != mb:
                continue
            field = memory_rule(kind)
            if field is None:
                raise ScheduleError(f"{kind.value}{s}.{mb} was measured but moves no activations")
            got[field][s] += delta
            if kind in BACKWARD_KINDS:
                rise[s] = up
    keep, mb_, mw = got["keep_ckpt"], got["mem_b"], got["mem_w"]
    mf = keep + got["mem_f"]
    for s in sched.stages_of(rank):
        if mf[s] + mb_[s] + mw[s] != 0:
            raise ScheduleError(f"stage {s}: F{'+R' if got['mem_f'][s] else ''} {mf[s]:.0f}, "
                                f"B {mb_[s]:.0f} and W {mw[s]:.0f} bytes do not balance")
    rec = {a.stage for a in sched.actions() if a.kind == Kind.R}
    keep = np.where([s in rec for s in range(S)], keep, mf)
    return Costs.per_stage(S, n, 1.0, 1.0, 1.0, mem_f=mf, mem_b=mb_,
                           keep_ckpt=keep).with_transient(rise)
