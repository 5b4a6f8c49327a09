"""DynaPipe's adaptive cyclic schedule for micro-batches of unequal cost (docs/schedules.md §5.5).

Safety stock (seed 004): the number of ready micro-batches queued at a device.  1F1B keeps
none in steady state, so one slow micro-batch stalls every later device.  The cyclic
scheduler injects micro-batches as early as memory allows, which builds a stock of ready
work; when the memory limit would be exceeded it delays the injection.

Construction (a restatement of the reference's cyclic scheduler, §5.5):
every micro-batch is queued at the first stage's device; then, cycle after cycle, each
device looks at the head of each of its stage queues (one forward and one backward queue
per stage it owns), orders those ops backward-first, alternating backward/forward, each
group by (micro-batch, stage), and runs them, except that the forward of a micro-batch new
to the device is skipped this cycle if it would push the device over ``mem_limit`` or the
number of in-flight micro-batches (started, backward not finished) to ``max_inflight``.
Ops enabled in a cycle become visible in the next one.  The recorded per-device order is
the schedule; the core simulator then gives its wait-free replay (§5.5: each device runs
its fixed order as soon as inputs arrive), and :func:`ds_autoplan.schedule.lower` plans the
communication from that timeline (§5.6).

Memory accounting [decision, §8.9]: when a micro-batch is injected on a device, the
device reserves its whole footprint there (``mem_f`` summed over the device's stages, so
later chunks of a V placement cannot overshoot); each backward releases its stage's share.
"""
from __future__ import annotations

from collections import deque
from dataclasses import replace
from functools import lru_cache
from typing import Sequence

import numpy as np

from ..costs import Costs
from ..ir import Kind, Schedule, ScheduleError, sequential_placement, v_placement
from ..simulator import SimResult, simulate
from .registry import draft, register

F, BW = Kind.F, Kind.BW


def _placement(placement, d: int) -> tuple[int, ...]:
    if placement is None or placement == "sequential":
        return sequential_placement(d)
    if placement == "v":
        return v_placement(d)
    if isinstance(placement, str):
        raise ScheduleError(f"dynapipe: placement must be 'sequential', 'v' or a list, got {placement!r}")
    p = tuple(int(x) for x in placement)
    if sorted(set(p)) != list(range(d)):
        raise ScheduleError(f"dynapipe: placement {list(p)} must use every rank 0..{d - 1}")
    return p


def cyclic_order(placement: Sequence[int], n: int, mem_f: np.ndarray,
                 mem_limit: float | None = None, max_inflight: int | None = None
                 ) -> list[list[tuple[Kind, int, int]]]:
    """Per-rank op order of the cyclic scheduler (module docstring).  ``mem_f``: [S, n]
    activation each (stage, micro-batch) keeps until its backward."""
    S, d = len(placement), max(placement) + 1
    limit = np.inf if mem_limit is None else float(mem_limit)
    cap = np.inf if max_inflight is None else int(max_inflight)
    stages = [[s for s in range(S) if placement[s] == r] for r in range(d)]
    foot = np.array([mem_f[stages[r], :].sum(axis=0) for r in range(d)])
    for r in range(d):
        if foot[r].max() > limit:
            m = int(foot[r].argmax())
            raise ScheduleError(f"dynapipe: mem_limit {limit:g} is below micro-batch {m}'s "
                                f"activation on rank {r} ({foot[r, m]:g}); no schedule fits")
    queues = {(k, s): deque() for s in range(S) for k in (F, BW)}
    queues[(F, 0)].extend((F, 0, m) for m in range(n))
    started = [set() for _ in range(d)]
    held = np.zeros(d)            # reserved activation per rank
    live = [0] * d                # micro-batches in flight per rank
    left_bw = [{} for _ in range(d)]   # rank -> mb -> backward ops still to run there
    order: list[list[tuple]] = [[] for _ in range(d)]
    remaining = 2 * S * n
    while remaining:
        enabled = []
        for r in range(d):
            heads = [queues[(k, s)][0] for s in stages[r] for k in (F, BW) if queues[(k, s)]]
            bws = sorted((h for h in heads if h[0] == BW), key=lambda h: (h[2], h[1]))
            fws = sorted((h for h in heads if h[0] == F), key=lambda h: (h[2], h[1]))
            merged = [x for pair in zip(bws, fws) for x in pair]
            merged += bws[len(fws):] + fws[len(bws):]
            for op in merged:
                k, s, m = op
                if k == F and m not in started[r]:
                    if held[r] + foot[r, m] > limit or live[r] >= cap:
                        continue  # delayed injection (seed 004)
                    started[r].add(m)
                    held[r] += foot[r, m]
                    live[r] += 1
                    left_bw[r][m] = len(stages[r])
                if k == BW:
                    held[r] -= mem_f[s, m]
                    left_bw[r][m] -= 1
                    if not left_bw[r][m]:
                        live[r] -= 1
                queues[(k, s)].popleft()
                order[r].append(op)
                remaining -= 1
                if k == F:
                    enabled.append((F, s + 1, m) if s + 1 < S else (BW, s, m))
                elif s > 0:
                    enabled.append((BW, s - 1, m))
        if not enabled and remaining:
            raise ScheduleError("dynapipe: no progress in a cycle (mem_limit/max_inflight too "
                                "small for these micro-batches)")
        for op in enabled:  # visible from the next cycle on
            queues[(op[0], op[1])].append(op)
    return order


@lru_cache(maxsize=64)
def _unlimited(placement: tuple[int, ...], n: int, max_inflight: int | None) -> Schedule:
    """The schedule without a memory limit, memoised: activations only matter against a
    limit, so it is the same for every cost of ``n`` micro-batches (a per-step planner
    builds it for each micro-batch order it tries)."""
    order = cyclic_order(placement, n, np.zeros((len(placement), n)), None, max_inflight)
    return draft(n, placement, order, mem_limit=None, max_inflight=max_inflight)


def safety_stock(sched: Schedule, res: SimResult, p2p: float = 0.0) -> list[float]:
    """Mean number of ready-but-waiting compute actions on each rank, sampled when the rank
    starts an action (docs/schedules.md §8 decision 10).  Stage-0 forwards are excluded: the
    data loader always has them ready."""
    start = {a.key: t for a, t in res.start.items()}
    end = {a.key: t for a, t in res.end.items()}
    S = sched.num_stages
    out = []
    for r, lst in enumerate(sched.ranks):
        acts = [a for a in lst if a.kind.is_compute and not (a.kind == F and a.stage == 0)]
        ready = []
        for a in acts:
            k, s, m = a.key
            if k == F:
                t = end[(F, s - 1, m)] + (p2p if sched.placement[s - 1] != r else 0.0)
            else:
                nxt = [(Kind.B, s + 1, m), (BW, s + 1, m)] if s + 1 < S else []
                t = end[(F, s, m)]
                for key in nxt:
                    if key in end:
                        t = max(t, end[key] + (p2p if sched.placement[s + 1] != r else 0.0))
            ready.append((t, start[a.key]))
        if not ready:
            out.append(0.0)
            continue
        rt, st = np.array(ready).T
        t0 = np.array(sorted(start[a.key] for a in lst if a.kind.is_compute))
        out.append(float(((rt[None, :] <= t0[:, None]) & (t0[:, None] < st[None, :])).sum(1).mean()))
    return out


def _per_mb(x, S: int, n: int, name: str, default: float):
    if x is None:
        return default
    a = np.asarray(x, dtype=float)
    if a.ndim == 1:
        if a.shape[0] != n:
            raise ScheduleError(f"dynapipe: {name} needs one value per micro-batch ({n}), got {a.shape[0]}")
        a = np.tile(a, (S, 1))
    return a


@register("dynapipe", placement="option", min_d=1,
          stages_of=lambda d, o: len(_placement(o.get("placement"), d)))
def dynapipe(d: int, n: int, *, costs: Costs | None = None, mb_f=None, mb_b=None, mb_mem=None,
             p2p: float = 0.0, mem_limit: float | None = None, max_inflight: int | None = None,
             placement=None, report: bool = True) -> Schedule:
    """Adaptive cyclic schedule (F and BW actions).

    Costs per micro-batch: either ``costs`` (a :class:`Costs` for S stages × n), or
    ``mb_f`` / ``mb_b`` / ``mb_mem``: one forward time, backward time and activation per
    micro-batch (the same on every stage; defaults 1, 2, 1).  ``mem_limit``: activation cap
    per rank (same unit as the memory); ``max_inflight``: micro-batches in flight per rank.
    ``placement``: 'sequential' (default), 'v', or a stage→rank list.  With ``report`` (default)
    ``meta`` gets the per-rank ``safety_stock``, ``peak_memory`` and the ``makespan`` of the
    wait-free replay (one simulation; planners that simulate anyway pass ``report=False``).
    """
    pl = _placement(placement, d)
    S = len(pl)
    if costs is None:
        costs = Costs.per_stage(S, n, f=_per_mb(mb_f, S, n, "mb_f", 1.0),
                                b=_per_mb(mb_b, S, n, "mb_b", 2.0), w=0.0,
                                mem_f=_per_mb(mb_mem, S, n, "mb_mem", 1.0), p2p=p2p, num_ranks=d)
    if costs.shape != (S, n):
        raise ScheduleError(f"dynapipe: costs are for {costs.shape[0]} stages x {costs.shape[1]} "
                            f"micro-batches; need {S} x {n}")
    if max_inflight is not None and (not isinstance(max_inflight, int) or max_inflight < 1):
        raise ScheduleError(f"dynapipe: max_inflight must be a positive integer, got {max_inflight!r}")
    if mem_limit is None:
        sched = _unlimited(pl, n, max_inflight)
        sched = replace(sched, meta=dict(sched.meta))
    else:
        order = cyclic_order(pl, n, costs.mem_f, mem_limit, max_inflight)
        sched = draft(n, pl, order, mem_limit=mem_limit, max_inflight=max_inflight)
    if not report:
        return sched
    res = simulate(sched, costs)
    stock = safety_stock(sched, res, costs.p2p)
    return sched.replace_lists(sched.ranks, safety_stock=[round(x, 4) for x in stock],
                               peak_memory=[float(x) for x in res.peak_memory],
                               makespan=float(res.makespan))
