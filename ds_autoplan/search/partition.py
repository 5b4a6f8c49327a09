"""Pipeline partitioners over transformer blocks: even (Galvatron-Base), min-max time /
memory (p_t, p_m), Galvatron-BMW's bi-objective walk (docs/planner.md §4), DawnPiper's
binary partition (docs/dawnpiper.md §6) and Merak's parameter-balanced sharding
(docs/merak.md §4.4, at layer granularity).  A partition is a tuple of block counts."""
from __future__ import annotations

import math
from collections import deque

import numpy as np

from .bipartition import binary_partition
from .dp import INF, Context


def even_partition(L: int, P: int) -> tuple:
    """Equal counts, remainder on the *last* stages (they hold fewer 1F1B micro-batches)."""
    q, r = divmod(L, P)
    return tuple(q + (1 if i >= P - r else 0) for i in range(P))


def _seg_matrices(ctx: Context, plan: list):
    """Unit-range matrices [lo, hi) -> time C, steady time C_ns, (f1 sum, peak term, ms sum)."""
    A = ctx.layer_arrays(plan)
    N = len(ctx.seq)
    pc, pcn, pf, pm = (np.concatenate([[0.0], np.cumsum(A[k])]) for k in ("c", "cns", "f1", "ms"))
    v = pf[1:] + A["ob"]                                  # cumsum(f1) up to j + ob[j]
    lo = np.arange(N)[:, None]
    j = np.arange(N)[None, :]
    run = np.maximum.accumulate(np.where(j >= lo, v[None, :], -INF), axis=1)   # max_{lo<=j<=col}
    return A, pc, pcn, pf, pm, run


class StageSegs:
    """SEG_i[b, a]: the time or Eq. 2 memory of stage i over blocks a..b (inclusive), for
    every stage, kept as the terms of the (first, middle, last) stage shapes: a square
    block of it is formed on demand (a min-max partition only needs a band of it)."""

    def __init__(self, terms: dict, shapes: list, stash: list):
        self.terms, self.shapes, self.stash = terms, shapes, stash
        self.L = next(iter(terms.values()))[0].shape[0]

    def __len__(self) -> int:
        return len(self.shapes)

    def block(self, i: int, lo: int, hi: int) -> np.ndarray:
        """SEG_i over last blocks b and first blocks a in [lo, hi): [b - lo, a - lo]."""
        seg, f1 = self.terms[self.shapes[i]]
        if f1 is None:
            return seg[lo:hi, lo:hi]
        return self.stash[i] * f1[lo:hi, lo:hi] + seg[lo:hi, lo:hi]   # (K_i - 1) f1 + rest


def stage_matrices(ctx: Context, plan: list, objective: str) -> StageSegs:
    """SEG_i[b, a] of every stage of ``ctx``: stage time or Eq. 2 memory (memoised per plan:
    BMW revisits the same per-layer strategies)."""
    memo = ctx.__dict__.setdefault("_seg_memo", {})
    key = (objective, tuple(plan))
    if key not in memo:
        memo[key] = _stage_matrices(ctx, plan, objective)
    return memo[key]


def _shape_terms(A: dict, pcn, pf, pm, run, L: int, objective: str, first: bool, last: bool):
    """Stage-position-independent terms [b, a] of a stage over blocks a..b (INF where it
    cannot be one): the time, or the memory without the in-flight stash and the f1 sum."""
    b = np.arange(L)[:, None]
    a = np.arange(L)[None, :]
    lo = np.zeros_like(a) if first else a + 1
    hi = np.minimum((b + 3) if last else (b + 2), L + 2)
    valid = (a <= b) & ((b == L - 1) if last else True)
    if objective == "time":
        p2p = 0.0 if last else 2 * A["p2p"][np.minimum(hi - 1, L + 1)]
        return np.where(valid, pcn[hi] - pcn[lo] + p2p, INF), None
    # run[lo(a), hi(b) - 1] at [b, a]: lo and hi - 1 step by one unit per block, so a slice
    c0 = 2 if last else 1
    peak = run[0, c0:c0 + L][:, None] if first else run[1:L + 1, c0:c0 + L].T
    rest = peak - pf[lo] + pm[hi] - pm[lo]
    return np.where(valid, rest, INF), pf[hi] - pf[lo]


def _stage_matrices(ctx: Context, plan: list, objective: str) -> StageSegs:
    L, P = len(ctx.seq) - 2, ctx.pp
    shapes = [(i == 0, i == P - 1) for i in range(P)]
    # the terms of a stage shape do not depend on the stage count: shared by the contexts of
    # the same tables over other stage counts (Context.staged)
    terms = ctx.split_terms.setdefault((objective, tuple(plan)), {})
    missing = [k for k in dict.fromkeys(shapes) if k not in terms]
    if missing:
        A, pc, pcn, pf, pm, run = _seg_matrices(ctx, plan)
        for k in missing:
            terms[k] = _shape_terms(A, pcn, pf, pm, run, L, objective, *k)
    return StageSegs({k: terms[k] for k in dict.fromkeys(shapes)}, shapes, [ctx.K(i) - 1 for i in range(P)])


def minmax_partition(segs: StageSegs, stages=None, lo: int = 0, hi: int | None = None) -> tuple | None:
    """Exact min-max contiguous partition (§4.2) of blocks [lo, hi) (default all) into
    ``stages`` (default all of ``segs``); ties -> the first cut.  Stage j can only end
    at blocks j..j+W-1 of the range (W = blocks - stages + 1: every stage holds one), so
    the DP runs on that band of each SEG."""
    stages = range(len(segs)) if stages is None else stages
    hi = segs.L if hi is None else hi
    P, L = len(stages), hi - lo
    W = L - P + 1
    if W < 1:
        return None
    F = segs.block(stages[0], lo, lo + W)[:, 0].copy()    # F[b]: best max over stage 0 = blocks 0..b
    cuts = []
    for j in range(1, P):             # F_j[b] = min_a max(F_{j-1}[a-1], SEG_j[b, a]), a, b in j..j+W-1
        vals = np.maximum(F[None, :], segs.block(stages[j], lo + j, lo + j + W))
        arg = np.argmin(vals, axis=1)
        F = vals[np.arange(W), arg]
        cuts.append(arg)
    if not np.isfinite(F[W - 1]):
        return None
    parts, b = [], L - 1
    for j in range(P - 1, 0, -1):
        a = j + int(cuts[j - 1][b - j])
        parts.append(b - a + 1)
        b = a - 1
    parts.append(b + 1)
    return tuple(parts[::-1])


def frugal_plan(ctx: Context) -> list:
    """Most memory-frugal allowed strategy per unit (BMW's fallback Strategy_Init, §4.4)."""
    t = ctx.tab
    mem = np.where(t.allowed, ctx.pp * t.f1 + t.ms, INF)
    return [int(x) for x in np.argmin(mem[ctx.seq], axis=1)]


def stage_times(ctx: Context, parts, plan):
    """Per-stage time without gradient synchronisation and peak memory of partition ``parts`` under
    ``plan``."""
    C, Cns, Mem = ctx.stage_costs(parts, plan)
    return Cns, Mem


def adjust(ctx: Context, p: tuple, plan: list, p_t: tuple):
    """PP_Partition_Adjust with validation rules 1-3 (§4.3, strict <, both neighbours)."""
    T, _ = stage_times(ctx, p, plan)
    j = int(np.argmax(T))
    C_max = T[j]
    _, Ot = stage_times(ctx, p_t, plan)
    cands = []
    P = len(p)
    if j > 0 and p[j] > 1:
        cands.append(tuple(x + (1 if i == j - 1 else -1 if i == j else 0) for i, x in enumerate(p)))
    if j < P - 1 and p[j] > 1:
        cands.append(tuple(x + (1 if i == j + 1 else -1 if i == j else 0) for i, x in enumerate(p)))
    best = None
    for q in cands:
        Tq, Oq = stage_times(ctx, q, plan)
        if Tq.max() < C_max and Oq.max() <= ctx.E and Oq.max() <= Ot.max():
            k = (Tq.max(), Oq.max())
            if best is None or k < best[0]:
                best = (k, q)
    return None if best is None else best[1]


def bmw(ctx: Context, max_iters: int | None = None, log: list | None = None):
    """Galvatron-BMW's bi-objective balancing loop for one (P, m) (Algorithm 2, §4.4).
    Returns (T_iter, parts, plan, base) where base is Galvatron-Base's even-split result."""
    L = len(ctx.seq) - 2
    p0 = even_partition(L, ctx.pp)
    T0, plan0 = ctx.search(p0)
    base = (T0, p0, plan0)
    best = base
    if ctx.pp == 1:
        return best + (base,)
    S0 = plan0 if plan0 is not None else frugal_plan(ctx)
    p_m = minmax_partition(stage_matrices(ctx, S0, "mem"))
    p_t = minmax_partition(stage_matrices(ctx, S0, "time"))
    starts = [p for p in (p_m, p_t) if p is not None]
    Q, seen = deque(starts[:1]), set(starts[:1])
    for p in starts[1:]:                        # p_t is evaluated too (the box's other corner)
        T, plan = ctx.search(p)
        if T < best[0]:
            best = (T, p, plan)
    iters, cap = 0, max_iters or L * ctx.pp
    while Q and iters < cap:
        p = Q.popleft()
        iters += 1
        T, plan = ctx.search(p)
        if log is not None:
            log.append((p, T))
        if T < best[0]:
            best = (T, p, plan)
        if not math.isfinite(T):
            continue
        pt = minmax_partition(stage_matrices(ctx, plan, "time")) or p_t
        q = adjust(ctx, p, plan, pt)
        if q is not None and q not in seen:
            Q.append(q)
            seen.add(q)
    return best + (base,)


def dawnpiper(ctx: Context):
    """DawnPiper binary partitioning at block granularity (docs/dawnpiper.md §6.1-6.2):
    each cut is searched between the compute-balanced and memory-balanced cuts, ordered from
    the compute-balanced one, stopping at the first cut needing no memory optimisation;
    memory optimisation = the stage DP's CKPT choice.  Returns (T_iter, parts, plan)."""
    L, P = len(ctx.seq) - 2, ctx.pp
    if P == 1:
        T, plan = ctx.search((L,))
        return T, (L,), plan
    nomo = [int(np.argmin(np.where(ctx.tab.allowed[u] & ~np.array([s.ckpt for s in ctx.strategies]),
                                    ctx.cost[u], INF))) for u in ctx.seq]
    segT = stage_matrices(ctx, nomo, "time")
    segM = stage_matrices(ctx, nomo, "mem")

    def stage_cost(lo, hi, i):
        """Blocks [lo, hi) as stage i (the first / last stage adds the pre / post units);
        memory optimisation = the stage DP's CKPT choice."""
        units = ctx.seq[0 if i == 0 else lo + 1:hi + 2 if i == P - 1 else hi + 1]
        sp = ctx.solve(tuple(int(x) for x in units), ctx.K(i))
        if sp is None:
            return INF, None, True
        tcost = float((ctx.tab.c_ns[units, sp.strategies]).sum())
        return tcost, hi - lo, any(ctx.strategies[s].ckpt for s in sp.strategies)

    def candidates(lo, hi, first, mid, last):
        """Cuts from the compute-balanced toward the memory-balanced one (min-max splits of
        stages first..last over blocks [lo, hi) by time and by memory)."""
        pcb = minmax_partition(segT, range(first, last + 1), lo, hi)
        if pcb is None:
            return []
        pmb = minmax_partition(segM, range(first, last + 1), lo, hi) or pcb
        c_cb, c_mb = lo + sum(pcb[:mid - first + 1]), lo + sum(pmb[:mid - first + 1])
        step = -1 if c_mb < c_cb else 1
        return list(range(c_cb, c_mb + step, step))

    t, bounds, counts = binary_partition(L, P, stage_cost, candidates)
    if bounds is None or None in counts:
        return INF, None, None
    parts = tuple(counts)
    T, plan = ctx.search(parts)
    return T, parts, plan


def merak(ctx: Context):
    """Merak's graph sharding at block granularity (docs/merak.md §4.4-4.5): close a
    shard as soon as its parameter count passes total/P; the stage gets the blocks up to
    that point (the pre/post parameters count on the first/last stage)."""
    L, P = len(ctx.seq) - 2, ctx.pp
    units = ctx.cm.units
    params = np.array([units[u].params for u in ctx.seq])
    thr = params.sum() / P
    parts, acc, cnt = [], params[0], 0
    for i in range(L):
        acc += params[i + 1]
        cnt += 1
        left_blocks, left_stages = L - i - 1, P - len(parts) - 1
        if (acc >= thr and left_blocks >= left_stages and left_stages > 0) or left_blocks == left_stages > 0:
            parts.append(cnt)
            acc, cnt = 0.0, 0
    parts.append(cnt)
    parts = tuple(parts)
    if len(parts) != P or min(parts) < 1:
        parts = even_partition(L, P)
    T, plan = ctx.search(parts)
    return T, parts, plan


PARTITIONERS = ("bmw", "even", "dawnpiper", "merak")
