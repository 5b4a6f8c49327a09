"""Schedule passes the runtimes share: recomputation (R) and the single-stage schedule.

Meaning of R (one for the simulator and both runtimes): ``R(s, mb)`` re-runs the *first k
layers* of stage ``s`` for micro-batch ``mb`` from the stage input its F kept, with autograd
on, before the backward of ``(s, mb)``.  The F of a recomputed ``(s, mb)`` runs those k
layers without autograd and keeps only their input; the remaining layers of the stage run
normally.  k counts the plan's layers (``layers_per_stage`` units, i.e. transformer layers;
the embedding, which precedes them on stage 0, is part of the recomputed prefix, the head
is not) and is carried by the schedule as ``meta["recompute_layers"]`` (one count per
stage).  Which (stage, micro-batch) pairs are recomputed is decided by the action list
alone: a runtime never recomputes without an R and never skips one.

This is Merak's stage-aware recomputation, the first layers of a stage (seed 001 §5.2,
docs/merak.md §6.3 [decision]) and DawnPiper's prefix mode (docs/dawnpiper.md
§7); the simulator's memory model (``Costs.mem_delta``): F keeps ``keep_ckpt`` (input +
the layers after the prefix), R allocates ``mem_f - keep_ckpt``.
"""
from __future__ import annotations

from typing import Protocol, Sequence

from .ir import Action, Kind, Schedule, ScheduleError

META_KEY = "recompute_layers"


def recompute_counts(fractions: Sequence[float], layers_per_stage: Sequence[int]) -> list[int]:
    """Per stage, the number of leading layers a plan's ``recompute_per_stage`` fractions
    recompute: ``round(fraction · layers)`` (Megatron's ``recompute_num_layers`` per stage)."""
    if len(fractions) != len(layers_per_stage):
        raise ScheduleError(f"{len(fractions)} recompute fractions for {len(layers_per_stage)} stages")
    return [int(round(float(f) * int(n))) for f, n in zip(fractions, layers_per_stage)]


def add_recompute(sched: Schedule, layers: Sequence[int]) -> Schedule:
    """Recompute the first ``layers[s]`` layers of every stage ``s`` with ``layers[s] > 0``:
    insert ``R(s, mb)`` right before each backward of that stage that has none and record
    the counts in ``meta["recompute_layers"]``.  Communication actions are dropped (lower the
    result again).  A RECV only posts the receive, so after lowering R runs while the output
    gradient is in flight (Merak's early recompute, docs/merak.md §5.2 step 1) and at
    most one recomputed micro-batch per rank is materialised at a time."""
    layers = [int(k) for k in layers]
    if len(layers) != sched.num_stages:
        raise ScheduleError(f"{len(layers)} recompute counts for {sched.num_stages} stages")
    if any(k < 0 for k in layers):
        raise ScheduleError(f"recompute counts must be >= 0, got {layers}")
    old = sched.meta.get(META_KEY)
    has = {(a.stage, a.mb) for a in sched.actions() if a.kind == Kind.R}
    if old is not None and any(o != k for o, k in zip(old, layers) if o and k):
        raise ScheduleError(f"schedule already recomputes {list(old)} layers per stage, not {layers}")
    out = []
    for r, lst in enumerate(sched.ranks):
        new = []
        for a in lst:
            if a.kind.is_comm:
                continue
            if a.kind in (Kind.B, Kind.BW) and layers[a.stage] and (a.stage, a.mb) not in has:
                new.append(Action(r, Kind.R, a.stage, a.mb))
            new.append(a)
        out.append(new)
    merged = [max(k, o) for k, o in zip(layers, old or [0] * len(layers))]
    return sched.replace_lists(out, lowered=False, **{META_KEY: merged})


def with_recompute(sched: Schedule, fractions: Sequence[float],
                   layer_counts: Sequence[int]) -> Schedule:
    """A plan's ``recompute_per_stage`` ``fractions`` (of ``layer_counts`` layers per stage) as
    R actions (:func:`add_recompute` with :func:`recompute_counts`).  A schedule with R actions
    of its own (a hand-written list, merak-scp) already says what is recomputed and is
    returned as it is, as is one where nothing is recomputed."""
    if not any(float(f) > 0 for f in fractions) or any(a.kind == Kind.R for a in sched.actions()):
        return sched
    return add_recompute(sched, recompute_counts(fractions, layer_counts))


class PipelinePlan(Protocol):
    """What the schedule layer reads of a plan: these fields of a
    :class:`~ds_autoplan.plan.Plan`, described here so that the schedule package (below the
    plan in the layer order) neither imports the Plan nor calls back into it."""
    pp: int
    num_microbatches: int
    schedule: str                      # a registered builder's name
    schedule_options: dict
    layers_per_stage: Sequence[int]
    recompute_per_stage: Sequence[float]


def plan_schedule(plan: PipelinePlan, schedule: Schedule | None = None) -> Schedule:
    """The action list a plan runs -- the one plan -> schedule path of both runtimes:
    ``schedule`` (a hand-written list, one DynaPipe step's) or the plan's own (its builder with
    its options; :func:`single_stage` for pp = 1), with the plan's ``recompute_per_stage`` as
    R actions (:func:`with_recompute`).  A plan whose ``layers_per_stage`` does not give one
    count per stage of the schedule (DeepSpeed's own ``partition_method``) gets its R once the
    runtime has cut the model (the DeepSpeed module calls :func:`with_recompute` with its
    partition's counts)."""
    if schedule is None:
        from .builders import build
        schedule = single_stage(plan.num_microbatches) if plan.pp == 1 else \
            build(plan.schedule, plan.pp, plan.num_microbatches, **plan.schedule_options)
    if len(plan.layers_per_stage) != schedule.num_stages:
        return schedule
    return with_recompute(schedule, plan.recompute_per_stage, plan.layers_per_stage)


def stage_recompute(sched: Schedule, stage: int, num_layers: int) -> int:
    """The k of ``stage`` (which has ``num_layers`` layers) under ``sched``: 0 when its list
    has no R for the stage, else ``meta["recompute_layers"][stage]`` or, without that entry,
    all of its layers.  Raises when R would recompute nothing or more than the stage has (no
    silent skips)."""
    if not any(a.kind == Kind.R and a.stage == stage for a in sched.actions()):
        return 0
    given = sched.meta.get(META_KEY)
    if given is not None and len(given) != sched.num_stages:
        raise ScheduleError(f"meta[{META_KEY!r}] has {len(given)} entries for "
                            f"{sched.num_stages} stages")
    k = int(num_layers) if given is None else int(given[stage])
    if not 0 < k <= int(num_layers):
        raise ScheduleError(f"stage {stage} has R actions but recomputes {k} of its {num_layers} "
                            f"layers (meta[{META_KEY!r}] must give 1..{num_layers})")
    return k


def recompute_layers(sched: Schedule, layers_per_stage: Sequence[int]) -> list[int]:
    """:func:`stage_recompute` of every stage, for a model cut into ``layers_per_stage``."""
    if len(layers_per_stage) != sched.num_stages:
        raise ScheduleError(f"{len(layers_per_stage)} layer counts for {sched.num_stages} stages")
    return [stage_recompute(sched, s, n) for s, n in enumerate(layers_per_stage)]


def single_stage(n: int) -> Schedule:
    """No pipelining: one rank runs F, BW of each micro-batch in turn (plans with pp = 1)."""
    keys = [k for m in range(n) for k in ((Kind.F, 0, m), (Kind.BW, 0, m))]
    return Schedule.from_keys("no-pipeline", n, [0], [keys])
