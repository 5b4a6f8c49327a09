"""Executor contract: accepted lists, per-step state, dispatch tables (see the package doc)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from ...schedule import Costs, Kind, Schedule, ScheduleError, lower, validate

KINDS = tuple(Kind)


def accept(sched: Schedule, *, num_ranks: int, num_microbatches: int | None = None,
           placement: Sequence[int] | None = None, costs: Costs | None = None,
           who: str = "runtime") -> Schedule:
    """Validate ``sched`` (lowered or not: :func:`ds_autoplan.schedule.validate` checks the
    SEND/RECV pairing of a lowered list too) against the adapter's pipeline ranks, micro-batch
    count and placement, and return it lowered (``lower`` with ``costs``)."""
    if not isinstance(sched, Schedule):
        raise ScheduleError(f"{who}: expected a Schedule, got {type(sched).__name__}")
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
    return sched if sched.has_comm() else lower(sched, costs)


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
    """``handlers`` as a dict, checked to cover every action kind of the vocabulary."""
    missing = [k.value for k in KINDS if k not in handlers]
    if missing:
        raise TypeError(f"{who}: no handler for action kind(s) {', '.join(missing)}")
    return dict(handlers)
