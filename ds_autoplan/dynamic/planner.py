"""Per-iteration planning (docs/schedules.md §5.1) and the background worker that hides it.

``IterationPlanner(lengths)`` → :class:`IterationPlan`: split the global batch into
micro-batches (DP or a baseline), build the pipeline schedule for those unequal
micro-batches (DynaPipe's adaptive cyclic schedule or 1F1B) for each micro-batch order
tried, time those with the fast simulation (``schedule.fastsim``), simulate the fastest in
full once, and lower it so every rank has its send/recv order (§5.6: the core
``lower`` plans communication from the simulated timeline and ``simulate(blocking=True)``
proves it deadlock-free).  The plan carries the *shape plan* -- (mbs, padded length) per
micro-batch, in execution order -- so both ends of every transfer know the tensor shape
without a handshake.

:class:`Prefetcher` runs the planner for iteration i+1 (and further, ``depth``) in a
background thread or process while iteration i trains (§5.7).
"""
from __future__ import annotations

import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import numpy as np

from ..schedule import Costs, Schedule, build, fastsim, lower, simulate
from ..schedule.builders import builder_info
from ..schedule.builders.dynapipe import safety_stock
from .cost import CostModel
from .microbatch import MicroBatchPlan, split


@dataclass
class IterationPlan:
    """Micro-batch ``k`` of the schedule (``Action.mb == k``) holds the samples
    ``microbatches[k]`` and has the padded shape ``shapes[k]`` on every stage."""

    step: int
    microbatches: list[tuple[int, ...]]   # dataset indices per micro-batch, execution order
    shapes: list[tuple]                   # shape plan: (mbs, padded len) per micro-batch
    split: MicroBatchPlan                 # the split (positions into the step's sample list)
    schedule: Schedule                    # compute actions per rank (F, BW)
    lowered: Schedule                     # with SEND/RECV: every rank's communication order
    costs: Costs
    predicted_ms: float                   # simulated iteration time (cost-model units)
    plan_seconds: float                   # wall time spent planning
    plan_cpu_seconds: float               # CPU time of the planning thread (load-independent)
    info: dict = field(default_factory=dict)

    @property
    def num_microbatches(self) -> int:
        return len(self.microbatches)

    def to_dict(self) -> dict:
        """What a runtime rank needs, JSON-ready (no cost model, no numpy)."""
        return {"step": self.step, "microbatches": [list(m) for m in self.microbatches],
                "shapes": [[m, list(L) if isinstance(L, tuple) else L] for m, L in self.shapes],
                "schedule": self.lowered.to_dict(), "predicted_ms": self.predicted_ms}


def stage_costs(plan: MicroBatchPlan, cost: CostModel, stages: int, p2p: float = 0.0) -> Costs:
    """Simulator costs [S, n] for the micro-batches of ``plan`` (same layers on every stage)."""
    mbs = np.array([m.mbs for m in plan.microbatches], dtype=float)
    L = np.array([m.seqlen for m in plan.microbatches], dtype=float)
    tile = lambda x: np.tile(np.asarray(x, dtype=float), (stages, 1))  # noqa: E731
    return Costs.per_stage(stages, len(mbs), f=tile(cost.fwd(mbs, L)), b=tile(cost.bwd(mbs, L)),
                           w=0.0, mem_f=tile(cost.memory(mbs, L)), p2p=p2p, num_ranks=stages)


def _reorder(plan: MicroBatchPlan, perm) -> MicroBatchPlan:
    perm = list(perm)
    return MicroBatchPlan(plan.method, [plan.microbatches[i] for i in perm], plan.times[perm],
                          plan.stages, plan.real_tokens, plan.padded_tokens, plan.t_max,
                          dict(plan.info))


def _orders(times: np.ndarray) -> dict[str, list[int]]:
    """Micro-batch orders tried for the schedule (a cheap stand-in for the reference's
    clustered permutations, §5.5): as split, cost descending, ascending, alternating
    long/short, and "pyramid" (cheap ones at both ends, the most expensive in the middle,
    so warm-up and drain are fast)."""
    n = len(times)
    desc = [int(i) for i in np.argsort(-times, kind="stable")]
    asc = desc[::-1]
    alt = [desc[(i // 2) if i % 2 == 0 else n - 1 - i // 2] for i in range(n)]
    pyramid = asc[0::2] + asc[1::2][::-1]
    out: dict[str, list[int]] = {}
    for name, perm in (("split", list(range(n))), ("desc", desc), ("asc", asc),
                       ("alternate", alt), ("pyramid", pyramid)):
        if perm not in out.values():
            out[name] = perm
    return out


@dataclass
class IterationPlanner:
    """Plans one iteration.  ``method``/``split_opts``: micro-batching (see
    :func:`ds_autoplan.dynamic.microbatch.split`); ``schedule``: 'dynapipe' (adaptive) or any
    registered builder (e.g. '1f1b'); ``device_mem``: activation memory per rank for the
    schedule (the adaptive schedule first runs unlimited and only reruns with this limit
    when the replay's peak exceeds it, §5.5)."""

    cost: CostModel
    stages: int
    method: str = "dynapipe"
    schedule: str = "dynapipe"
    split_opts: dict = field(default_factory=dict)
    schedule_opts: dict = field(default_factory=dict)
    device_mem: float | None = None
    p2p: float = 0.0
    try_orders: bool = True

    def __call__(self, lengths, ids: Iterable[int] | None = None, step: int = 0) -> IterationPlan:
        t0, c0 = time.perf_counter(), time.thread_time()
        lengths = np.asarray(lengths)
        ids = list(range(len(lengths))) if ids is None else [int(i) for i in ids]
        sp = split(self.method, lengths, self.cost, self.stages, **self.split_opts)
        costs_sp = stage_costs(sp, self.cost, self.stages, self.p2p)
        options = builder_info(self.schedule).options
        # a builder that does not take the costs gives one schedule for every order
        same = None if "costs" in options else self._schedule(options, len(sp), costs_sp, None)
        best = None
        orders = _orders(sp.times) if self.try_orders else {"split": list(range(len(sp)))}
        for oname, perm in orders.items():
            costs = costs_sp.take(perm)
            sched, fast = same or self._schedule(options, len(sp), costs, None)
            res = fast(costs)
            if self.device_mem is not None and max(res.peak_memory) > self.device_mem \
                    and "mem_limit" in options:
                sched, fast = self._schedule(options, len(sp), costs, self.device_mem)
                res = fast(costs)
            if best is None or res.makespan < best[2] - 1e-9:
                best = (oname, perm, res.makespan, sched, costs)
        oname, perm, _, sched, costs = best
        cand = _reorder(sp, perm)
        res = simulate(sched, costs)    # the chosen list in full, once: its timeline is lowered
        low = lower(sched, costs, res)
        mbs = [tuple(ids[p] for p in mb.samples) for mb in cand.microbatches]
        info = {"order": oname, "peak_memory": [float(x) for x in res.peak_memory],
                "safety_stock": safety_stock(sched, res, self.p2p), "bubble": res.bubble_ratio}
        return IterationPlan(step, mbs, cand.shapes, cand, sched, low, costs, float(res.makespan),
                             time.perf_counter() - t0, time.thread_time() - c0, info)

    def _schedule(self, options: dict, n: int, costs: Costs, mem_limit) -> tuple[Schedule, Callable]:
        """The schedule of ``n`` micro-batches with these costs and its makespan and peaks as
        a function of the costs (``schedule.fastsim``; the simulator where it does not apply).
        A cost-aware builder (one taking ``costs``, e.g. DynaPipe's adaptive schedule) gets
        the costs and the memory limit."""
        given = {"costs": costs, "report": False, "mem_limit": mem_limit}
        opts = {**self.schedule_opts,
                **{k: v for k, v in given.items() if k in options and v is not None}}
        sched = build(self.schedule, self.stages, n, **opts)
        c = fastsim.compile_schedule(sched)
        if c is None:
            return sched, lambda cs: simulate(sched, cs, check=False)
        return sched, lambda cs: fastsim.run_costs(c, cs)


class Prefetcher:
    """Iterate ``fn(job)`` over ``jobs`` with up to ``depth`` upcoming jobs computed in a
    background worker ('thread', 'process', or 'none' for inline), results in job order.

    With depth >= 1 the plan for iteration i+1 is computed while the caller trains on
    iteration i.  ``waited`` accumulates the seconds the caller blocked on a result (the
    planning time that was *not* hidden)."""

    def __init__(self, fn: Callable, jobs: Iterable, depth: int = 1, kind: str = "thread"):
        if kind not in ("thread", "process", "none"):
            raise ValueError("kind must be 'thread', 'process' or 'none'")
        self.fn, self.jobs, self.depth, self.kind = fn, jobs, max(0, int(depth)), kind
        self.waited = 0.0

    def __iter__(self) -> Iterator:
        if self.kind == "none" or self.depth == 0:
            for job in self.jobs:
                t = time.perf_counter()
                out = self.fn(job)
                self.waited += time.perf_counter() - t
                yield out
            return
        if self.kind == "thread":
            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dynapipe-planner")
        else:
            import multiprocessing as mp
            pool = ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn"))
        pending: deque = deque()
        it = iter(self.jobs)
        try:
            for job in it:
                pending.append(pool.submit(self.fn, job))
                if len(pending) > self.depth:
                    yield self._take(pending)
            while pending:
                yield self._take(pending)
        finally:
            for f in pending:
                f.cancel()
            pool.shutdown(wait=True, cancel_futures=True)

    def _take(self, pending: deque):
        t = time.perf_counter()
        out = pending.popleft().result()
        self.waited += time.perf_counter() - t
        return out
