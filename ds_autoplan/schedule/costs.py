"""Per-(stage, micro-batch) durations and activation-memory deltas fed to the simulator.

Memory model (docs/schedules.md §0, §8 decision 2): F allocates ``mem_f``; B changes memory by
``mem_b`` (<= 0) and W by ``mem_w`` (<= 0), with mem_f + mem_b + mem_w = 0; a fused BW
frees ``mem_b + mem_w``.  The paper's analysis uses (1, 0, -1)·m: everything is held until W.
With recomputation (an R action for that stage/mb), F keeps only ``keep_ckpt`` (the
input of the recomputed prefix and what the layers after it save; schedule/passes.py) and R
allocates the rest again.  ``b_transient``: bytes a backward holds from its start beyond its
net change until its end (a split layer's B stashes its output gradient for W while the
saved inputs are still held); one value, or one per stage / per (stage, micro-batch).

Runtime overheads: a real engine also spends time the per-layer costs leave out.
:class:`Overheads` holds what one runtime measured once (``bench/_measure.py``): ``dispatch``
per compute action (instruction launch, bookkeeping, autograd entry), ``p2p`` latency and
``send`` (the sender's time) per message, and ``step`` once per iteration (gradient
reduction and optimizer step after the last action).  ``Costs.with_overheads`` adds them;
all default to 0, which is the docs/schedules.md §3 model unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .ir import Kind, Schedule, ScheduleError


def _grid(x, S: int, n: int, name: str) -> np.ndarray:
    """Broadcast a scalar, a per-stage list, or an [S, n] array to float [S, n]."""
    a = np.asarray(x, dtype=float)
    if a.ndim == 0:
        a = np.full((S, n), float(a))
    elif a.ndim == 1:
        if a.shape[0] != S:
            raise ScheduleError(f"{name}: expected {S} per-stage values, got {a.shape[0]}")
        a = np.repeat(a[:, None], n, axis=1)
    elif a.shape != (S, n):
        raise ScheduleError(f"{name}: expected shape ({S}, {n}), got {a.shape}")
    if not np.all(np.isfinite(a)):
        raise ScheduleError(f"{name}: values must be finite")
    return a


@dataclass
class Costs:
    """Arrays of shape [num_stages, num_microbatches]."""

    f: np.ndarray
    b: np.ndarray
    w: np.ndarray
    r: np.ndarray
    mem_f: np.ndarray
    mem_b: np.ndarray
    mem_w: np.ndarray
    keep_ckpt: np.ndarray
    p2p: float = 0.0            # latency of one cross-rank transfer
    send: float = 0.0           # time a rank spends issuing a SEND (lowered lists only)
    num_ranks: int | None = None  # for the "units of 1/d of the model" scale
    dispatch: float = 0.0       # a runtime's own time per compute action
    step: float = 0.0           # once per iteration after the last action
    b_transient: float | np.ndarray = 0.0   # bytes a backward (B, BW) holds from its start
                                # on, beyond its net change, until its end (e.g. the output
                                # gradient a deferred W keeps while the layer's internals are
                                # still saved); a float or a [S, n] array

    @classmethod
    def per_stage(cls, num_stages: int, n: int, f, b, w, *, r=None, mem_f=1.0, mem_b=None,
                  mem_w=None, keep_ckpt=0.0, p2p: float = 0.0, send: float = 0.0,
                  num_ranks: int | None = None) -> "Costs":
        """Costs given per stage (scalar, list of S, or [S, n] array each)."""
        S = num_stages
        F, Bt, Wt = (_grid(x, S, n, nm) for x, nm in ((f, "f"), (b, "b"), (w, "w")))
        for nm, a in (("f", F), ("b", Bt), ("w", Wt)):
            if np.any(a < 0):
                raise ScheduleError(f"durations must be non-negative; {nm} has {a.min()}")
        if p2p < 0 or send < 0:
            raise ScheduleError("p2p latency and send time must be non-negative")
        R = F.copy() if r is None else _grid(r, S, n, "r")
        mf = _grid(mem_f, S, n, "mem_f")
        mb_ = np.zeros((S, n)) if mem_b is None else _grid(mem_b, S, n, "mem_b")
        mw = -(mf + mb_) if mem_w is None else _grid(mem_w, S, n, "mem_w")
        if not np.allclose(mf + mb_ + mw, 0.0, atol=1e-9 * max(1.0, float(np.abs(mf).max()))):
            raise ScheduleError("memory deltas must balance: mem_f + mem_b + mem_w = 0")
        return cls(F, Bt, Wt, R, mf, mb_, mw, _grid(keep_ckpt, S, n, "keep_ckpt"),
                   float(p2p), float(send), num_ranks)

    @classmethod
    def uniform(cls, sched: Schedule, f: float = 1.0, b: float = 1.0, w: float = 1.0, *,
                act: float = 1.0, mem_split=(1.0, 0.0, -1.0), p2p: float = 0.0,
                per: str = "slice") -> "Costs":
        """Uniform model.  ``per='slice'``: f, b, w, act are for one micro-batch over 1/d of
        the model (one 1F1B stage), so a schedule with S stages gets d/S of each per stage
        and all schedules on d ranks are compared on the same model.  ``per='stage'``: the
        values are per stage as given (the unit model of docs/schedules.md §3.4)."""
        S, d, n = sched.num_stages, sched.num_ranks, sched.num_microbatches
        scale = d / S if per == "slice" else 1.0
        if per not in ("slice", "stage"):
            raise ScheduleError("per must be 'slice' or 'stage'")
        a_f, a_b, a_w = (x * act * scale for x in mem_split)
        return cls.per_stage(S, n, f * scale, b * scale, w * scale, mem_f=a_f, mem_b=a_b,
                             mem_w=a_w, p2p=p2p, num_ranks=d)

    @property
    def shape(self) -> tuple[int, int]:
        """``(stages, micro-batches)`` the costs are for."""
        return self.f.shape

    def check(self, sched: Schedule) -> None:
        """Raise :class:`ScheduleError` unless these costs are for ``sched``'s stages and
        micro-batches."""
        if self.shape != (sched.num_stages, sched.num_microbatches):
            raise ScheduleError(f"costs are for {self.shape[0]} stages x {self.shape[1]} "
                                f"micro-batches; schedule has {sched.num_stages} x "
                                f"{sched.num_microbatches}")

    def take(self, order) -> "Costs":
        """These costs with the micro-batches in ``order`` (micro-batch k of the result is
        micro-batch ``order[k]`` here)."""
        i = list(order)
        tr = self.b_transient
        return replace(self, **{k: getattr(self, k)[:, i] for k in
                                ("f", "b", "w", "r", "mem_f", "mem_b", "mem_w", "keep_ckpt")},
                       b_transient=tr if np.ndim(tr) == 0 else tr[:, i])

    def with_transient(self, b_transient) -> "Costs":
        """These costs with ``b_transient`` bytes held during every backward (a scalar, or
        per stage, or per (stage, micro-batch))."""
        if np.ndim(b_transient) == 0:
            if not b_transient >= 0:
                raise ScheduleError("b_transient must be non-negative")
            return replace(self, b_transient=float(b_transient))
        a = _grid(b_transient, *self.shape, "b_transient")
        if np.any(a < 0):
            raise ScheduleError("b_transient must be non-negative")
        return replace(self, b_transient=a)

    def transient(self, kind: Kind, s: int, m: int) -> float:
        """Bytes held beyond the net change during action ``kind`` (backwards only)."""
        if kind not in (Kind.B, Kind.BW):
            return 0.0
        tr = self.b_transient
        return float(tr if np.ndim(tr) == 0 else tr[s, m])

    def with_overheads(self, ov: "Overheads") -> "Costs":
        """These costs plus a runtime's measured overheads (replacing p2p and send)."""
        return replace(self, p2p=ov.p2p, send=ov.send, dispatch=ov.dispatch, step=ov.step)

    def duration(self, kind: Kind, s: int, m: int) -> float:
        """Time of action ``kind`` on stage ``s`` for micro-batch ``m`` (a BW lasts B + W; a SEND
        its send time; a RECV 0), plus the runtime's dispatch time for compute.  A kind without
        a cost here raises :class:`ScheduleError`."""
        if kind == Kind.F:
            return self.f[s, m] + self.dispatch
        if kind == Kind.B:
            return self.b[s, m] + self.dispatch
        if kind == Kind.W:
            return self.w[s, m] + self.dispatch
        if kind == Kind.BW:
            return self.b[s, m] + self.w[s, m] + self.dispatch
        if kind == Kind.R:
            return self.r[s, m] + self.dispatch
        if kind in (Kind.SEND_F, Kind.SEND_B):
            return self.send
        if kind in (Kind.RECV_F, Kind.RECV_B):
            return 0.0
        raise _uncosted(kind, "duration")

    def mem_delta(self, kind: Kind, s: int, m: int, recomputed: bool) -> float:
        """Change of the rank's activation memory when ``kind`` of (``s``, ``m``) ends; a
        recomputed stage's F keeps only ``keep_ckpt`` and its R allocates the rest; SEND/RECV
        0.  A kind without a rule here raises :class:`ScheduleError`."""
        if kind == Kind.F:
            return self.keep_ckpt[s, m] if recomputed else self.mem_f[s, m]
        if kind == Kind.R:
            return self.mem_f[s, m] - self.keep_ckpt[s, m]
        if kind == Kind.B:
            return self.mem_b[s, m]
        if kind == Kind.W:
            return self.mem_w[s, m]
        if kind == Kind.BW:
            return self.mem_b[s, m] + self.mem_w[s, m]
        if kind in (Kind.SEND_F, Kind.SEND_B, Kind.RECV_F, Kind.RECV_B):
            return 0.0
        raise _uncosted(kind, "mem_delta")

    def unit(self, num_ranks: int) -> float:
        """One micro-batch's activation for 1/d of the model (the scale of `peak_units`)."""
        d = self.num_ranks or num_ranks
        return float(self.mem_f.mean(axis=1).sum()) / d


def _uncosted(kind: Kind, what: str) -> ScheduleError:
    """A kind the cost model does not know: an error, never a free action."""
    return ScheduleError(f"Costs.{what}: no cost for action kind {getattr(kind, 'value', kind)} "
                         f"(schedule/costs.py)")


@dataclass(frozen=True)
class Overheads:
    """A runtime's own time per compute action, per message and per iteration, seconds
    (measured once per runtime; see the module docstring)."""

    dispatch: float = 0.0
    p2p: float = 0.0
    send: float = 0.0
    step: float = 0.0

    def __post_init__(self):
        for k in ("dispatch", "p2p", "send", "step"):
            v = getattr(self, k)
            if not (v >= 0.0 and v < float("inf")):
                raise ScheduleError(f"overhead {k} must be finite and non-negative, got {v}")

    def to_dict(self) -> dict:
        """The overheads as a JSON-able dict (bench outputs, plan reports)."""
        return {"dispatch": self.dispatch, "p2p": self.p2p, "send": self.send, "step": self.step}
