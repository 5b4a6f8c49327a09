"""Schedule-aware pipeline cost: per-stage costs from the cost model fed to the schedule
simulator, stage-aware recomputation to fit the per-device cap (docs/merak.md §6.6),
and the choice of the fastest schedule that fits."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..schedule import fastsim
from ..schedule.fastsim import cached_build as _build
from ..spec.cluster import GB
from .dp import INF, Context
from .partition import even_partition, minmax_partition, stage_matrices

def schedule_options(name: str, v: int = 2) -> dict:
    """Builder options: ``v`` model chunks per rank for a builder whose option sets them
    (the interleaved schedule's ``v``)."""
    from ..schedule.builders import builder_info
    opt = builder_info(name).chunks_option
    return {opt: v} if opt else {}


def chunks_per_rank(name: str, parts, P: int) -> int | None:
    """Model chunks per rank of a costed partition when the builder takes them as an option
    (the registry's ``chunks_option``: interleaved's ``v``); None for a fixed placement."""
    return len(parts) // P if schedule_options(name) else None


def options_of(name: str, parts: tuple, P: int) -> tuple:
    """Builder options of a costed partition (interleaved: v = stages / P), as a sorted tuple."""
    return tuple(sorted(schedule_options(name, max(1, len(parts) // P)).items()))


def chunk_counts(name: str, L: int, P: int, chunks: int | None = None) -> list[int]:
    """The chunks per rank to cost for ``name`` on ``P`` ranks and ``L`` blocks: ``chunks``
    when given (any count that leaves every stage a block: uneven splits too), else for a
    builder that takes them as an option (interleaved) every v >= 2 that divides the blocks
    of a rank (the even splits Megatron's own interleaving needs); else the placement's own
    ([2], unused)."""
    if not schedule_options(name):
        return [2]
    return [chunks] if chunks else [v for v in range(2, L // P + 1) if (L // P) % v == 0]


def full_recompute_evals(ctx: Context, schedules, keep_sim=False, chunks: int | None = None) -> list:
    """Megatron's uniform full recompute (--recompute-granularity full, every block of every
    stage) under each schedule: the blocks split evenly into the schedule's stages (uneven
    by one where they do not divide), all recomputed; ``ctx`` has the strategies without and
    with CKPT.  Sorted, best first."""
    P, L = ctx.pp, len(ctx.seq) - 2
    nock = [0] * len(ctx.seq)
    ck = [1 if ctx.cm.units[u].checkpointable else 0 for u in ctx.seq]
    evals = []
    for name in schedules:
        for v in chunk_counts(name, L, P, chunks):
            S = num_stages(name, P, v)
            if S > L:
                break
            parts = even_partition(L, S)
            figs = stage_figures(ctx.staged(S), parts, nock, ck)
            evals.append(stage_aware_recompute(ctx, name, parts, figs, [g["nblk"] for g in figs],
                                               keep_sim, max_rounds=0))
    return sorted(evals, key=lambda e: (not e.ok, e.time))


def num_stages(name: str, P: int, v: int = 2) -> int:
    """Pipeline stages of schedule ``name`` on ``P`` ranks with ``v`` chunks where it takes them."""
    from ..schedule.builders import builder_info
    return builder_info(name).num_stages(P, **schedule_options(name, v))


@dataclass
class Eval:
    """One executable configuration costed end to end."""
    schedule: str
    time: float                      # iteration seconds
    parts: tuple                     # blocks per schedule stage
    recompute: list                  # blocks recomputed per stage
    peak: list = field(default_factory=list)     # bytes per pipeline rank
    fits: bool = True
    bubble: float = 0.0
    sim: object = None               # (Schedule, Costs, SimResult) for plots
    ctx: object = None               # the context and stage figures it was costed with
    figs: list = None
    partitioner: str = "time-balanced"   # non-1F1B split: time-balanced or rank_balance's
    cut: bool = False                # not costed to the end: its time floor reached the bound

    @property
    def ok(self) -> bool:
        """True when the configuration fits and has a finite time."""
        return self.fits and math.isfinite(self.time)


def stage_figures(ctx: Context, parts: tuple, plan_nock: list, plan_ck: list):
    """Per-stage sums for the no-recompute and all-recompute variants of a uniform plan (fresh
    dicts), memoised in ``ctx`` per stage (its units and whether it sends on): the splits
    that rank balancing and the schedules try share most of their stages."""
    memo = ctx._figs_memo.setdefault((tuple(plan_nock), tuple(plan_ck)), {})
    # the cluster's calibrated fixed cost of every F and B of a stage and micro-batch
    # (spec/cluster.py; a split W's in simulate_plan)
    act_ovh = ctx.cm.cluster.action_overhead_us * 1e-6
    A0 = A1 = ck = None
    out = []
    for i, (lo, hi) in enumerate(ctx.bounds(parts)):
        key = (lo, hi, i < len(parts) - 1)
        if key not in memo:
            if A0 is None:
                A0, A1 = ctx.layer_arrays(plan_nock), ctx.layer_arrays(plan_ck)
                ck = np.array([ctx.cm.units[u].checkpointable for u in ctx.seq])
            sl = slice(lo, hi)
            nblk = int(ck[sl].sum())
            d_mem = (A0["f1"][sl] - A1["f1"][sl])[ck[sl]]
            d_time = (A1["bwd_ns"][sl] - A0["bwd_ns"][sl])[ck[sl]]
            memo[key] = dict(
                f=A0["fwd"][sl].sum() + A0["R"][sl].sum() + act_ovh, bw=A0["bwd_ns"][sl].sum() + act_ovh,
                w=A0["wgrad"][sl].sum(),
                # stash per micro-batch: the stage's activations and the output the engine keeps
                act=A0["f1"][sl].sum() + (A0["kept"][hi - 1] if key[2] else 0.0),
                ms=A0["ms"][sl].sum(), sync=A0["sync"][sl].sum(),
                p2p=A0["p2p"][hi - 1], nblk=nblk,
                d_mem=float(d_mem.mean()) if nblk else 0.0, d_time=float(d_time.mean()) if nblk else 0.0,
                ob=float(A1["ob"][sl][ck[sl]].max()) if nblk else 0.0)
        out.append(dict(memo[key]))
    return out


def simulate_plan(ctx: Context, name: str, parts: tuple, rec: list, figs: list, keep_sim=False):
    """Simulate schedule ``name`` on ctx.pp ranks with per-stage costs; returns
    (iteration time, peak bytes per rank, bubble, sim tuple).  For many micro-batches the
    makespan is extrapolated from runs at 2P and 4P (P > 8: P and 2P) micro-batches (steady state: the time is
    affine in m and the peak constant) [decision]; ``keep_sim`` keeps the larger run for plots."""
    from ..schedule import Costs, simulate
    P, m = ctx.pp, ctx.m
    opts = options_of(name, parts, P)
    S = len(parts)
    f, bw, w, act = _stage_arrays(figs, rec)
    p2p = float(max(g["p2p"] for g in figs))
    w_split = w + ctx.cm.cluster.action_overhead_us * 1e-6     # a split W is an action of its own

    def run(n):
        sched = _build(name, P, n, opts)
        c = None if keep_sim else fastsim.compiled(name, P, n, opts)
        if c is not None:          # the simulator's figures without its event loop
            b_ = bw - w if c.split else bw
            return sched, None, fastsim.run(c, f, b_, w_split if c.split else np.zeros(S), act,
                                            np.zeros(S), -act, p2p)
        split = any(a.kind.name == "W" for r in sched.ranks for a in r)
        costs = Costs.per_stage(S, n, f=f, b=bw - w if split else bw, w=w_split if split else np.zeros(S),
                                mem_f=act, mem_b=np.zeros(S), mem_w=-act, p2p=p2p, num_ranks=P)
        return sched, costs, simulate(sched, costs, check=False)  # builders are validated by their tests

    n1, n2 = sim_sizes(P)
    if m <= n2:
        sched, costs, res = run(m)
        makespan, peak_act, bub = res.makespan, np.array(res.peak_memory), res.bubble_ratio
    else:
        sched, costs, res = run(n2)
        # each extra micro-batch adds at least the busiest rank's work; the ratio of the
        # measured slope to it is kept per (schedule, split), recompute changes only the work
        work = np.zeros(P)
        for s in range(S):
            work[sched.placement[s]] += f[s] + bw[s]
        memo = ctx.__dict__.setdefault("_slope_memo", {})
        key = (name, tuple(parts))
        if key not in memo:
            _, _, r1 = run(n1)
            memo[key] = max(1.0, (res.makespan - r1.makespan) / (n2 - n1) / float(work.max()))
        slope = memo[key] * float(work.max())
        makespan = res.makespan + slope * (m - n2)
        peak_act = np.array(res.peak_memory)
        busy = np.array(res.busy) * m / n2
        bub = max(0.0, 1.0 - float(busy.mean()) / makespan)
    static, tail = _static_and_tail(figs, rec, sched.placement, P, ctx.cm.cluster)
    peak = static + peak_act
    T = makespan + float(tail.max())
    return T, peak, bub, ((sched, costs, res) if keep_sim else None)


def sim_sizes(P: int) -> tuple[int, int]:
    """Micro-batch counts simulated for a long run's slope (simulate_plan)."""
    return (2 * P, 4 * P) if P <= 8 else (P, 2 * P)


def _stage_arrays(figs: list, rec) -> tuple:
    """Per-stage F, B + W, W and stashed activations with ``rec`` blocks recomputed per stage."""
    k = np.array(rec, dtype=float)
    f = np.array([g["f"] for g in figs])
    bw = np.array([g["bw"] for g in figs]) + k * np.array([g["d_time"] for g in figs])
    w = np.array([g["w"] for g in figs])
    act = np.array([g["act"] for g in figs]) - k * np.array([g["d_mem"] for g in figs])
    return f, bw, w, act


def _static_and_tail(figs: list, rec, place, P: int, cluster) -> tuple:
    """Per rank: model states (+ the recompute transient where a stage recomputes) and the
    step's gradient synchronisation after the flush, with the cluster's calibrated per-device
    memory and per-iteration time overheads (spec/cluster.py)."""
    static = np.full(P, cluster.memory_overhead_gb * GB)
    tail = np.full(P, cluster.step_overhead_ms * 1e-3)
    for s, g in enumerate(figs):
        static[place[s]] += g["ms"] + (g["ob"] if rec[s] else 0.0)
        tail[place[s]] += g["sync"]
    return static, tail


def time_floor(ctx: Context, place: tuple, figs: list, rec) -> float:
    """What no run of this schedule, split and recompute can beat (docs/planner.md §2.8): the
    simulated time is the makespan plus the busiest rank's gradient synchronisation, and the
    makespan is at least each rank's work, m (F + B + W) of its stages."""
    f, bw, _, _ = _stage_arrays(figs, rec)
    work = np.zeros(ctx.pp)
    np.add.at(work, list(place), ctx.m * (f + bw))
    return float(work.max() + _static_and_tail(figs, rec, place, ctx.pp, ctx.cm.cluster)[1].max())


def plan_peaks(ctx: Context, name: str, parts: tuple, rec, figs: list) -> np.ndarray | None:
    """Per-rank peak bytes that simulate_plan reports for this plan, from the schedule's
    action order alone (fastsim.peaks: no timing needed), or None where the schedule does not
    compile (then only the simulator says)."""
    P, m = ctx.pp, ctx.m
    n = min(m, sim_sizes(P)[1])
    opts = options_of(name, parts, P)
    c = fastsim.order(name, P, n, opts)
    if c is None:
        return None
    _, _, _, act = _stage_arrays(figs, rec)
    S = len(parts)
    place = _build(name, P, n, opts).placement
    return _static_and_tail(figs, rec, place, P, ctx.cm.cluster)[0] + fastsim.peaks(c, act, np.zeros(S), -act)


def _evaluate(ctx: Context, name: str, parts: tuple, rec, figs: list, keep_sim=False) -> Eval:
    """simulate_plan memoised on (schedule, partition, recompute) in ``ctx._sim_memo``."""
    memo = ctx.__dict__.setdefault("_sim_memo", {})
    key = (name, tuple(parts), tuple(rec), keep_sim)
    if key not in memo:
        memo[key] = simulate_plan(ctx, name, parts, list(rec), figs, keep_sim)
    T, peak, bub, sim = memo[key]
    return Eval(name, T, tuple(parts), list(rec), list(peak), bool(np.all(peak <= ctx.E)), bub, sim, ctx, figs)


def simulate_layers(ctx: Context, parts: tuple, plan: list) -> Eval:
    """1F1B of a per-layer plan (any strategy per unit, its CKPT included), simulated like the
    executable configurations: the stage figures of the plan itself, each stage's largest
    backward transient (recompute, SDP gather) held on top of its model states."""
    figs = stage_figures(ctx, parts, plan, plan)
    ob = ctx.layer_arrays(plan)["ob"]
    for g, (lo, hi) in zip(figs, ctx.bounds(parts)):
        g["ob"] = float(ob[lo:hi].max())
    return _evaluate(ctx, "1f1b", parts, [1] * len(parts), figs)


def _placement(ctx: Context, name: str, parts: tuple) -> tuple | None:
    """The schedule's stage -> rank map (from the registry where it says, else built), or
    None where the builder refuses this many ranks or micro-batches."""
    from ..schedule import ScheduleError
    from ..schedule.builders import builder_info
    info, P, n, opts = builder_info(name), ctx.pp, min(ctx.m, sim_sizes(ctx.pp)[1]), options_of(name, parts, ctx.pp)
    try:
        info.check(P, n)
        return info.stage_placement(P, **dict(opts)) or _build(name, P, n, opts).placement
    except ScheduleError:
        return None


def stage_aware_recompute(ctx: Context, name: str, parts: tuple, figs: list, rec0=None,
                          keep_sim=False, max_rounds: int = 3, bound: float = INF) -> Eval:
    """Recomputed blocks per stage so that every rank fits (Merak SR, ds_autoplan version
    §6.6, with the headroom taken from the simulator): try ``rec0`` (default none); if a rank
    is over the cap, take full recomputation (if even that does not fit, the schedule is
    out), interpolate each rank's block count linearly between the two, then add one block
    per round on ranks still over.  The peaks come from the schedule's action order
    (:func:`plan_peaks`), so only the plan chosen is simulated, and not even that when its
    :func:`time_floor` is not below ``bound`` (returned as not fitting: it cannot win)."""
    S = len(parts)
    rec = list(rec0) if rec0 is not None else [0] * S
    full = [g["nblk"] for g in figs]
    place = _placement(ctx, name, parts)
    if place is None:
        return Eval(name, INF, parts, rec, fits=False)
    if time_floor(ctx, place, figs, rec) >= bound:                    # recompute only adds
        return Eval(name, INF, parts, rec, fits=False, cut=True)
    memo = {}

    def peak(r):
        if tuple(r) not in memo:
            p = plan_peaks(ctx, name, parts, r, figs)
            memo[tuple(r)] = p if p is not None else \
                np.array(_evaluate(ctx, name, parts, r, figs, keep_sim).peak)
        return memo[tuple(r)]

    def fits(r):
        return bool(np.all(peak(r) <= ctx.E))

    def final(r):
        if time_floor(ctx, place, figs, r) >= bound:        # no bubble, no wait: too slow
            return Eval(name, INF, parts, list(r), list(peak(r)), fits=False, cut=True)
        return _evaluate(ctx, name, parts, r, figs, keep_sim)

    if fits(rec) or max_rounds == 0:
        return final(rec)
    if not fits(full):
        return Eval(name, INF, parts, full, list(peak(full)), fits=False)
    p0, pf = peak(rec), peak(full)
    for r in range(ctx.pp):
        if p0[r] <= ctx.E:
            continue
        a = (p0[r] - ctx.E) / max(p0[r] - pf[r], 1e-9)
        for s in range(S):
            if place[s] == r:
                rec[s] = max(rec[s], min(full[s], math.ceil(a * full[s] - 1e-9)))
    for _ in range(max_rounds):
        if fits(rec):
            break
        over = peak(rec) > ctx.E
        changed = False
        for s in range(S):
            if over[place[s]] and rec[s] < full[s]:
                rec[s] += 1
                changed = True
        if not changed:
            break
    return final(rec if fits(rec) else full)


def time_partition(ctx: Context, S: int, plan_nock_fn) -> tuple | None:
    """Time-balanced min-max partition of the blocks into S schedule stages."""
    L = len(ctx.seq) - 2
    if L < S:
        return None
    sub = ctx.staged(S)
    return minmax_partition(stage_matrices(sub, plan_nock_fn(sub), "time"))


def rank_balance(ctx: Context, name: str, e0: Eval, figs_of, keep_sim=False, rounds: int = 4) -> Eval:
    """Galvatron-BMW's PP_Partition_Adjust (seed 000 §IV-B2 and App. B; docs/planner.md
    §4.3) for any stage->rank placement.  Memory is per rank (a V rank holds stages r and
    S-1-r, rank 0 the embedding and the LM head; in-flight micro-batches differ per stage),
    so when the time-balanced split ``e0`` (the paper's p_t corner) needs recompute to fit,
    move one boundary block out of a stage on the most loaded rank (no-recompute peak) to an
    adjacent stage; each candidate is costed with ``stage_aware_recompute`` (time including
    the recompute needed to fit: the paper's rules 1-2 judged on the simulated iteration,
    strictly faster and within the cap).  Greedy: the best candidate per round, stop when none
    is faster, no recompute is left, or after ``rounds`` rounds.  No outside bound: the walk is
    the same whatever the search's incumbent, so the search and `ds-autoplan cost` agree.
    ``figs_of(q)`` gives the stage figures of partition q."""
    place = _placement(ctx, name, e0.parts)
    S, best, seen = len(e0.parts), e0, {tuple(e0.parts)}
    if place is None or not (e0.ok and any(e0.recompute)):
        return e0
    for _ in range(rounds):
        p = best.parts
        pk = plan_peaks(ctx, name, p, [0] * S, best.figs)
        if pk is None:
            pk = _evaluate(ctx, name, p, [0] * S, best.figs, keep_sim).peak
        r = int(np.argmax(pk))
        cands = {tuple(x + (i == t) - (i == s) for i, x in enumerate(p))
                 for s in range(S) if place[s] == r and p[s] > 1 for t in (s - 1, s + 1) if 0 <= t < S}
        step = None
        for q in sorted(cands - seen):
            seen.add(q)
            lim = (step or best).time
            e = stage_aware_recompute(ctx, name, q, figs_of(q), None, keep_sim, bound=lim)
            if e.ok and e.time < lim:
                step = e
        if step is None:
            break
        best = step
        best.partitioner = "rank-balanced"
        if not any(best.recompute):
            break
    return best


def choose_schedule(ctx: Context, parts: tuple, plan: list, schedules, keep_sim=False,
                    bound: float = INF, chunks: int | None = None) -> list[Eval]:
    """Cost every schedule for a uniform executable config (strategies [s, s+CKPT]):
    1F1B on the given (BMW) partition with the DP's CKPT counts and with stage-aware
    recompute; the others on a time-balanced split into their stage count, adjusted per rank
    by ``rank_balance`` when that split needs recompute; ``chunks`` fixes the interleaved
    schedule's v (default: 2, 3, ... while faster).  Sorted, best first."""
    nock = lambda c: [0] * len(c.seq)   # noqa: E731  strategy 0 = no CKPT
    ck = lambda c: [1 if c.cm.units[u].checkpointable else 0 for u in c.seq]   # noqa: E731
    evals, adjust = [], []
    P = ctx.pp
    for name in schedules:
        if name == "1f1b":
            figs = stage_figures(ctx, parts, nock(ctx), ck(ctx))
            dp_rec = []
            for lo, hi in ctx.bounds(parts):
                dp_rec.append(sum(1 for u in range(lo, hi) if plan[u] == 1))
            evals.append(stage_aware_recompute(ctx, name, parts, figs, dp_rec, keep_sim, bound=bound))
            evals.append(stage_aware_recompute(ctx, name, parts, figs, None, keep_sim, bound=bound))
            continue
        # interleaved: every v = 2, 3, ... chunks per rank that leaves each chunk a block (the
        # bubble shrinks as 1/v, Narayanan et al. 2021 §2.2, while p2p grows: the time is not
        # monotone in v, so none is skipped; ``chunks`` fixes one), uneven splits included
        for v in chunk_counts(name, len(ctx.seq) - 2, P, chunks):
            sp = time_partition(ctx, num_stages(name, P, v), nock)
            if sp is None:
                break
            sub = ctx.staged(len(sp))
            figs_of = lambda q, sub=sub: stage_figures(sub, q, nock(sub), ck(sub))   # noqa: E731
            best = min([bound] + [e.time for e in evals if e.ok])
            evals.append(stage_aware_recompute(ctx, name, sp, figs_of(sp), None, keep_sim, bound=best))
            adjust.append((len(evals) - 1, figs_of))
    # BMW per rank (rank_balance) where a time-balanced split needs recompute
    for i, figs_of in adjust:
        evals[i] = rank_balance(ctx, evals[i].schedule, evals[i], figs_of, keep_sim)
    uniq = {}
    for e in evals:
        uniq.setdefault((e.schedule, tuple(e.parts), tuple(e.recompute)), e)
    evals = sorted(uniq.values(), key=lambda e: (not e.ok, e.time))
    return evals
