"""Executor contract: accepted lists, per-step state, dispatch tables (see the package doc)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from ...schedule import (Costs, DeadlockError, Kind, Schedule, ScheduleError, lower, simulate,
                         validate)

KINDS = tuple(Kind)


@dataclass(frozen=True)
class Rule:
    """What both adapters need to know of an action kind besides its handler."""

    forward: bool          # part of a forward-only pass (evaluation, ``forward_only``)
    grads: bool            # accumulates parameter gradients (Megatron syncs them in the
                           # last such action of each stage)
    source: int | None     # the stage whose data it consumes, relative to its own (-1 the
                           # previous, +1 the next); a SEND/RECV waits for its peer


# the per-kind table (schedule/ir.py's vocabulary); ``dispatch_table`` refuses a kind missing here
RULES = {
    Kind.F: Rule(forward=True, grads=False, source=-1),
    Kind.B: Rule(forward=False, grads=True, source=+1),
    Kind.W: Rule(forward=False, grads=True, source=None),
    Kind.BW: Rule(forward=False, grads=True, source=+1),
    Kind.R: Rule(forward=False, grads=False, source=None),
    Kind.SEND_F: Rule(forward=True, grads=False, source=None),
    Kind.RECV_F: Rule(forward=True, grads=False, source=None),
    Kind.SEND_B: Rule(forward=False, grads=False, source=None),
    Kind.RECV_B: Rule(forward=False, grads=False, source=None),
}


def accept(sched: Schedule, *, num_ranks: int, num_microbatches: int | None = None,
           placement: Sequence[int] | None = None, costs: Costs | None = None,
           who: str = "runtime") -> Schedule:
    """Validate ``sched`` (lowered or not: :func:`ds_autoplan.schedule.validate` checks the
    SEND/RECV pairing of a lowered list too) against the adapter's pipeline ranks, micro-batch
    count and placement, and return it lowered (``lower`` with ``costs``)."""
    if not isinstance(sched, Schedule):
        raise ScheduleError(f"{who}: expected a Schedule, got {type(sched).__name__}")
    if _PROVEN.get(id(sched)) is not sched:      # a proven list was validated before (per step)
        validate(sched)
    if sched.num_ranks != num_ranks:
        raise ScheduleError(f"{who}: schedule is for {sched.num_ranks} pipeline ranks, "
                            f"the pipeline has {num_ranks}")
    if num_microbatches is not None and sched.num_microbatches != num_microbatches:
        raise ScheduleError(f"{who}: schedule is for {sched.num_microbatches} micro-batches, "
                            f"the step has {num_microbatches}")
    if placement is not None and tuple(sched.placement) != tuple(placement):
        raise ScheduleError(f"{who}: schedule placement {tuple(sched.placement)} differs from "
                            f"the model's {tuple(placement)}")
    if not sched.has_comm():
        return lower(sched, costs)      # lowering simulates it (DeadlockError on a cycle)
    return deadlock_free(sched, who)


_PROVEN: dict = {}     # id -> lowered schedule the simulator finished (kept alive: ids stay valid)


def deadlock_free(sched: Schedule, who: str = "runtime") -> Schedule:
    """``sched`` (lowered) once the simulator has run it to the end with the runtimes'
    non-blocking SEND/RECV model (schedule/simulator.py); a list that would hang is refused
    with the simulator's message: where each rank stops and the wait cycle.  Whether it
    finishes depends on the orders only, not on the durations, so unit costs decide it."""
    if _PROVEN.get(id(sched)) is sched:
        return sched
    try:
        simulate(sched, Costs.uniform(sched), check=False)
    except DeadlockError as e:
        raise DeadlockError(f"{who}: refused, this action list would hang: {e}",
                            e.heads, e.cycle) from None
    if len(_PROVEN) >= 16:
        _PROVEN.pop(next(iter(_PROVEN)))
    _PROVEN[id(sched)] = sched
    return sched


def check_world(plan, world: int, pp: int, who: str = "runtime") -> None:
    """Both runtimes, before any model is built: the plan was made for ``tp x cp x pp x dp``
    processes (``pp``: its schedule's pipeline ranks); any other world would run another
    parallel layout than the one planned (e.g. a tp=2 plan on half its ranks, without TP)."""
    cp = plan.cp
    need = plan.tp * cp * pp * plan.dp
    if world != need:
        raise ScheduleError(f"{who}: the plan needs tp*cp*pp*dp = {plan.tp}*{cp}*{pp}*{plan.dp} = "
                            f"{need} processes, the world has {world}; plan for {world} devices "
                            f"or launch {need} ranks")


def waits_for(a, placement: Sequence[int]) -> int | None:
    """The pipeline rank action ``a`` depends on (what a step watchdog names when the rank
    is stuck there): a SEND's or RECV's peer; for F the rank of the previous stage, for B/BW
    that of the next one, whose data the action consumes; None when that stage is local."""
    if a.kind.is_comm:
        return a.peer
    src = RULES[a.kind].source
    if src is None or not 0 <= a.stage + src < len(placement):
        return None
    r = placement[a.stage + src]
    return None if r == placement[a.stage] else r


def posting_order(actions, early: bool = False) -> list:
    """``actions`` in the order a runtime whose SEND/RECV posts never block (gloo: a post
    returns at once, the transfer completes in the background) issues them.

    * The transfers between two compute actions are one group, posted as torch's
      ``batch_isend_irecv`` posts one: its sends before its receives.  A receive's post is a
      rendezvous message to its sender (gloo's sender writes only into a posted receive), so
      posting it first would hold back a send a neighbour may be waiting for.
    * ``early``: each receive joins the group before the compute action that precedes it
      (or the group before the one before that, where none lies between the two), so its
      sender finds it posted and writes at once instead of waiting for it: a round trip on
      the receiver's path.  A RECV_B stays after the F whose output gradient it receives
      (its buffers take that output's shape).  A receive's buffers then exist during one or
      two more compute actions.

    Receives from a peer keep their order, and sends to it theirs, so each (peer,
    direction) sees its messages in the list's order; compute actions keep theirs.  Over a
    backend whose sends can block until the peer's receive is posted (NCCL outside a group)
    only the list's own order is proven, so there it is not used."""
    groups: list = [[]]          # groups[j]: the transfers before compute action j (last: after all)
    comp: list = []
    for a in actions:
        if a.kind.is_comm:
            groups[-1].append(a)
        else:
            comp.append(a)
            groups.append([])
    if early:
        had = [bool(g) for g in groups]
        f_at = {(c.stage, c.mb): j for j, c in enumerate(comp) if c.kind == Kind.F}
        moved: list = [[] for _ in groups]
        last: dict = {}          # peer -> the group its last receive went to
        for j, g in enumerate(groups):
            keep = []
            for a in g:
                if a.kind in _SENDS or j == 0:
                    keep.append(a)
                    continue
                to = j - 2 if j >= 2 and not had[j - 1] and had[j - 2] else j - 1
                if a.kind == Kind.RECV_B:
                    to = max(to, f_at.get((a.stage, a.mb), -1) + 1)
                to = max(to, last.get(a.peer, 0))
                last[a.peer] = to
                (keep if to == j else moved[to]).append(a)
            groups[j] = keep
        groups = [g + m for g, m in zip(groups, moved)]
    out: list = []
    for j, g in enumerate(groups):
        out += [x for x in g if x.kind in _SENDS] + [x for x in g if x.kind not in _SENDS]
        if j < len(comp):
            out.append(comp[j])
    return out


_SENDS = (Kind.SEND_F, Kind.SEND_B)


def recomputed(actions) -> set:
    """The (stage, micro-batch) pairs a rank's list recomputes: their F keeps only the
    recomputed prefix's input, their R re-runs it (schedule/passes.py)."""
    return {(a.stage, a.mb) for a in actions if a.kind == Kind.R}


@dataclass
class StepState:
    """What one step (one optimizer step) brings besides the data, the same for both
    adapters (``set_step``; consumed by the next step):

    * ``schedule``: this step's schedule (any micro-batch count; e.g. a DynaPipe
      ``IterationPlan.lowered``); None keeps the adapter's own;
    * ``shapes``: per micro-batch ``(mbs, length)`` (``length`` an int or ``(enc, dec)``)
      of the activations crossing stage boundaries, so receives need no shape handshake;
    * ``loss_weights``: per micro-batch share ``w_m`` of the step's loss (sums to 1 over
      the step, or over all data-parallel replicas); the loss stage multiplies micro-batch
      m's loss by ``n · w_m``, undoing the frameworks' division by ``n``.
    """

    schedule: Schedule | None = None
    shapes: Sequence | None = None
    loss_weights: Sequence[float] | None = None

    def check(self, num_microbatches: int) -> None:
        """Raise :class:`ScheduleError` unless shapes and loss weights have one entry per
        micro-batch."""
        for name, xs in (("shapes", self.shapes), ("loss_weights", self.loss_weights)):
            if xs is not None and len(xs) != num_microbatches:
                raise ScheduleError(f"step state: {len(xs)} {name} for {num_microbatches} "
                                    f"micro-batches")

    def loss_factor(self, mb: int, num_microbatches: int) -> float | None:
        """Factor for micro-batch ``mb``'s loss (``n * w_mb``), or None without loss weights."""
        if self.loss_weights is None:
            return None
        return num_microbatches * float(self.loss_weights[mb])


def dispatch_table(handlers: Mapping[Kind, Callable], who: str) -> dict:
    """``handlers`` as a dict, checked to cover every action kind of the vocabulary (and
    every kind to have its :data:`RULES` entry)."""
    for what, have in (("rule in runtime.common.RULES", RULES), ("handler", handlers)):
        missing = [k.value for k in KINDS if k not in have]
        if missing:
            raise TypeError(f"{who}: no {what} for action kind(s) {', '.join(missing)}")
    return dict(handlers)
