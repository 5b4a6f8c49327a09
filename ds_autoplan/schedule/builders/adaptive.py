"""Adaptive V-shape schedule under an activation-memory cap: a search over V building
blocks (Qi et al. 2024, appendix A; docs/schedules.md §4.1).

Search space (appendix A): T = 6 slots per device row; device 0 has F0 at 0 and F1, B1, B0
at three distinct positions of 1..5; row i+1 adds (δF0, δF1, δB1, δB0) = (k, -1, k, -1)
mod 6, with k = k0 for the first K transitions and k1 <= k0 after.  Walking the dependency
chain F0(0..d-1) → F1(d-1..0) → B1(0..d-1) → B0(d-1..0), each pass at the next occurrence
of its position strictly later, turns the mod-6 rows into a block.  The canonical V-Min,
V-Half and V-ZB blocks are added.

Layout of a block (appendix A, restated from the reference's v_auto_schedule.py): repeat
max(n, 2d) times, squeeze, lay the warm-up out in closed form without raising the peak,
squeeze, drop the surplus micro-batches (release early W's when n is small), lay the
cool-down out with tight dependencies, fill bubbles greedily, relabel W's first-in
first-out.  The canonical §2.4 pipeline (vshape.build_slots) is tried as well.

Selection [decision, for speed]: the steady-state peak of a block follows from its
lifespans (Eq. 1, counted exactly per slot phase); blocks above the cap are dropped.  Of
the two highest memory levels that fit, the 12 blocks with the shortest un-reordered
pipeline (repeat + greedy W + squeeze, 8 micro-batches) are laid out both ways; the
smallest unit-cost makespan whose real peak fits wins (with ``f, b, w`` given: the
smallest simulated makespan with those costs).  Search is on n' = min(n, 2d)
micro-batches (bubbles do not depend on n for n >= 2d, §4.1); the winner is laid out for
n and re-checked.  This reproduces §4.1's table (d = 4, 8; n = 2d, 4d) exactly.  Results
are cached.
"""
from __future__ import annotations

import itertools
from functools import lru_cache

from ..ir import Schedule, ScheduleError
from .registry import register
from .vshape import (B0, B1, F0, F1, T, W, W0, build_slots, put_w, slots_to_schedule,
                     squeeze_unit, vhalf_block, vmin_block, vzb_block, _occupancy, _peak)

TOP_PER_LEVEL = 12   # blocks fully built per memory level
LEVELS = 2           # memory levels (in m) searched below the cap
QUICK_N = 8          # micro-batches of the cheap ranking pass (un-reordered pipeline)


def _after(t: int, pos: int) -> int:
    """Next slot strictly after ``t`` whose position mod T is ``pos``."""
    return t + (pos - t - 1) % T + 1


def _block_from_rows(rows: list[list[int]]) -> tuple:
    d = len(rows)
    f0, f1, b1, b0 = ([0] * d for _ in range(4))
    for i in range(1, d):
        f0[i] = _after(f0[i - 1], rows[i][0])
    f1[d - 1] = _after(f0[d - 1], rows[d - 1][1])
    for i in range(d - 2, -1, -1):
        f1[i] = _after(f1[i + 1], rows[i][1])
    b1[0] = _after(f1[0], rows[0][2])
    for i in range(1, d):
        b1[i] = _after(b1[i - 1], rows[i][2])
    b0[d - 1] = _after(b1[d - 1], rows[d - 1][3])
    for i in range(d - 2, -1, -1):
        b0[i] = _after(b0[i + 1], rows[i][3])
    return tuple((f0[i], f1[i], b1[i], b0[i]) for i in range(d))


def steady_peak(blk) -> int:
    """Steady-state peak (in m) of a repeated block: per device, the largest number of
    micro-batch lifespans (F start to W end, W at the first free position after its B,
    appendix A) overlapping one slot, summed over the two chunks (Eq. 1, exact)."""
    best = 0
    for f0, f1, b1, b0 in blk:
        used = {x % T for x in (f0, f1, b1, b0)}
        ws = []
        for b in (b1, b0):
            k = next(j for j in range(1, T + 1) if (b + j) % T not in used)
            used.add((b + k) % T)
            ws.append(b + k)
        spans = ((f0, ws[1]), (f1, ws[0]))
        for t in range(T * 10 ** 6, T * 10 ** 6 + T):
            best = max(best, sum((t - f) // T + (w - t) // T + 1 for f, w in spans))
    return best


@lru_cache(maxsize=64)
def candidates(d: int) -> dict[tuple, int]:
    """All conflict-free appendix-A blocks plus the canonical ones → steady peak (m)."""
    out: dict[tuple, int] = {}
    for p in itertools.permutations(range(1, T), 3):
        for k0 in range(1, T):
            for k1 in range(1, k0 + 1):
                for K in (range(1, d) if k1 < k0 else (d - 1,)):
                    rows = [[0, *p]]
                    for i in range(d - 1):
                        k = k0 if i < K else k1
                        r = rows[-1]
                        nxt = [(r[0] + k) % T, (r[1] - 1) % T, (r[2] + k) % T, (r[3] - 1) % T]
                        if len(set(nxt)) < 4:
                            break
                        rows.append(nxt)
                    else:
                        blk = _block_from_rows(rows)
                        if blk not in out:
                            out[blk] = steady_peak(blk)
    for fn in (vmin_block, vhalf_block, vzb_block):
        blk = tuple(tuple(r) for r in fn(d))
        out[blk] = steady_peak(blk)
    return {b: p for b, p in out.items() if p <= 2 * d}


def _rows(blk, n: int):
    return [[[x + T * j for j in range(n)] for x in row] for row in blk]


@lru_cache(maxsize=4096)
def _quick_makespan(blk, n: int) -> int:
    """Unit-cost makespan of the block repeated, greedy W, squeezed (no reordering)."""
    rows = squeeze_unit([put_w(r, split=True) for r in _rows(blk, n)])
    return 1 + max(max(max(lst) for lst in r) for r in rows)


# ----------------------------------------------------------------------------- appendix A
# The reference's repeat → squeeze → warm-up re-layout → squeeze → drop surplus → cool-down
# re-layout → greedy bubble filling → relabel W pipeline (docs/schedules.md §4.1), restated on a
# grid: per device a list of pass types by slot (E = empty).
E = -1
W1 = W
_UP = (F0, B1, W1)                  # passes travelling device 0 → d-1 (and W1)
_DMEM = (1, 1, 0, 0, -1, -1)        # slot memory of F0 F1 B1 B0 W1 W0


class _Reject(Exception):
    """The appendix-A pipeline cannot lay out this block (the reference asserts or skips)."""


def _grid_peak(row) -> int:
    cur = res = 0
    for t in row:
        if t != E:
            cur += _DMEM[t]
            res = max(res, cur)
    return res


def _peak_all(grid) -> int:
    return max(_grid_peak(r) for r in grid)


def _squeeze_grid(grid):
    """Squeeze: ASAP slots keeping every device's order; a column's passes are taken
    0→d-1 for F0/B1/W1, then d-1→0 for F1/B0/W0 (so same-column inputs come first)."""
    p = len(grid)
    cnt = [[0] * 6 for _ in range(p)]
    pos, nxt, cells = {}, [0] * p, []
    for j in range(max(len(r) for r in grid)):
        for up in (True, False):
            for i in (range(p) if up else range(p - 1, -1, -1)):
                t = grid[i][j] if j < len(grid[i]) else E
                if t == E or (t in _UP) != up:
                    continue
                mb = cnt[i][t]
                cnt[i][t] += 1
                k = nxt[i]
                src = i - 1 if t in (F0, B1) else i + 1 if t in (F1, B0) else -1
                if 0 <= src < p:
                    if (src, t, mb) not in pos:
                        raise _Reject("input scheduled after its consumer")
                    k = max(k, pos[(src, t, mb)] + 1)
                pos[(i, t, mb)] = k
                nxt[i] = k + 1
                cells.append((i, k, t))
    out = [[E] * max(nxt) for _ in range(p)]
    for i, k, t in cells:
        out[i][k] = t
    return out


def _repeat_grid(blk, m: int):
    """The block repeated m times; W1, W0 at the first free position after B1, B0."""
    grid = []
    for row in blk:
        used = {x % T for x in row}
        slots = list(row)
        for b in (row[2], row[3]):
            k = next(j for j in range(1, T + 1) if (b + j) % T not in used)
            used.add((b + k) % T)
            slots.append(b + k)
        g = [E] * (max(slots) + T * m + 1)
        for t, x in enumerate(slots):
            for j in range(m):
                g[x + T * j] = t
        grid.append(g)
    width = max(len(g) for g in grid)
    return [g + [E] * (width - len(g)) for g in grid]


def _warmup(grid, m: int):
    """Warm-up in closed form without raising the peak: everything before device i's first
    B0 is laid out again from slot i as F0 x (2(d-1-i)), (F0 F1) x (i+1), then
    (B1 W1 F1-or-F0) triples, with at most min(i+1, peak//2) F1 and peak - that many F0."""
    p = len(grid)
    pk = min(_peak_all(grid), 2 * p)
    for i, row in enumerate(grid):
        n_f1 = min(i + 1, pk // 2, m)
        n_f0 = min(pk - n_f1, m)
        c = [0] * 6
        for j, t in enumerate(row):
            if t == B0:
                break
            if t != E:
                c[t] += 1
                row[j] = E
        u, j = [0] * 6, i

        def put(t, ok):
            nonlocal j
            if ok:
                if j >= len(row) or row[j] != E:
                    raise _Reject("warm-up does not fit before the first B0")
                row[j] = t
                u[t] += 1
            j += 1
        for _ in range(2 * (p - 1 - i)):
            put(F0, u[F0] < min(n_f0, c[F0]))
        for _ in range(i + 1):
            put(F0, u[F0] < min(n_f0, c[F0]))
            put(F1, u[F1] < min(n_f1, c[F1]))
        while any(u[t] < c[t] for t in (F0, F1, B1, W1)):
            put(B1, u[B1] < c[B1])
            put(W1, u[W1] < c[W1])
            if u[F1] < c[F1]:
                if u[F1] >= u[F0]:
                    raise _Reject("F1 before its F0")
                put(F1, True)
            else:
                put(F0, u[F0] < c[F0])
    return grid


def _drop_surplus(grid, m: int) -> None:
    """Keep the first m passes of every type (the block was repeated max(m, 2d) times)."""
    for row in grid:
        c = [0] * 6
        for j, t in enumerate(row):
            if t != E:
                if c[t] >= m:
                    row[j] = E
                c[t] += 1


def _release_w(grid, pk: int) -> None:
    """Few micro-batches: move early W passes to the end while memory allows (up to pk)."""
    peaks = [_grid_peak(r) for r in grid]
    for i, row in enumerate(grid):
        pad, cnt = [E] * (pk - min(peaks)), 0
        for j in range(len(row)):
            if peaks[i] + cnt >= pk:
                break
            if row[j] in (W1, W0):
                pad[cnt], row[j] = row[j], E
                cnt += 1
        row.extend(pad)
    width = max(len(r) for r in grid)
    for r in grid:
        r.extend([E] * (width - len(r)))


def _cooldown(grid, m: int):
    """Cool-down: take the last min(i+1, ...) B1 and (peak+1)//2 B0 of device i and the
    tail W's out, put the B's back with tight dependencies anchored at device 0's last
    F1, then refill W greedily (W1 first) after the last remaining W; squeeze."""
    p = len(grid)
    pk = _peak_all(grid)
    max_b0 = min((pk + 1) // 2, m)
    max_b1 = min(pk - max_b0, m)
    anchor = -1
    for i, row in enumerate(grid):
        nb1 = nb0 = nw1 = nw0 = 0
        last_f1 = -1
        for j in range(len(row) - 1, -1, -1):
            t = row[j]
            if t == F1 and last_f1 < 0:
                last_f1 = j
            if t == B1 and nb1 < min(i + 1, max_b1):
                row[j], nb1 = E, nb1 + 1
            if t == B0 and nb0 < max_b0:
                row[j], nb0 = E, nb0 + 1
        for j in range(len(row) - 1, -1, -1):
            if nw1 >= nb1 and nw0 >= nb0 and nw1 + nw0 >= pk:
                break
            if row[j] == W1:
                row[j], nw1 = E, nw1 + 1
            elif row[j] == W0:
                row[j], nw0 = E, nw0 + 1
        if i == 0:
            anchor = last_f1
        need = max(anchor - i + 2 * p, anchor + 1 + i) + 1
        row.extend([E] * max(0, need - len(row)))
        for k in range(nb0):
            x = anchor - i + 2 * p - 2 * k
            if x < 0 or row[x] != E:
                raise _Reject("cool-down slot of B0 taken")
            row[x] = B0
        for k in range(nb1):
            x = anchor + 1 + i - 2 * k
            if x < 0:
                raise _Reject("cool-down slot of B1 out of range")
            row[x] = B1          # may overwrite (as the reference); completeness is checked
    for row in grid:
        last_w = max([j for j, t in enumerate(row) if t in (W1, W0)], default=-1)
        pend = [0, 0]
        for j, t in enumerate(row):
            if t in (B1, B0):
                pend[t - B1] += 1
            elif t in (W1, W0):
                pend[t - W1] -= 1
            elif t == E and j > last_w:
                for w in (0, 1):
                    if pend[w] > 0:
                        row[j] = W1 + w
                        pend[w] -= 1
                        break
        row.extend([W1] * pend[0] + [W0] * pend[1])
    width = max(len(r) for r in grid)
    for r in grid:
        r.extend([E] * (width - len(r)))
    return _squeeze_grid(grid)


def _fill_bubbles(grid):
    """Greedy bubble filling: scanning slots left to right, an empty slot takes the first
    later pass of a type not seen yet on that device whose inputs are already done and
    that does not raise the peak."""
    p, width = len(grid), len(grid[0])
    pk = _peak_all(grid)
    last = [{t: max([j for j, x in enumerate(r) if x == t], default=-1) for t in range(6)}
            for r in grid]
    mem, cnt, pos = [0] * p, [[0] * 6 for _ in range(p)], {}

    def take(i, j, t):
        pos[(i, t, cnt[i][t])] = j
        cnt[i][t] += 1
        mem[i] += _DMEM[t]

    for j in range(width):
        for i, row in enumerate(grid):
            if row[j] != E:
                take(i, j, row[j])
                continue
            avail = {t for t in range(6) if last[i][t] > j}
            delta = top = 0
            for k in range(j + 1, width):
                if not avail:
                    break
                t = row[k]
                if t == E:
                    continue
                delta += _DMEM[t]
                before, top = top, max(top, delta)
                if t not in avail:
                    continue
                avail.discard(t)
                if _DMEM[t] > 0 and mem[i] + before >= pk:
                    continue
                mb = cnt[i][t]
                src = i - 1 if t in (F0, B1) else i + 1 if t in (F1, B0) else -1
                if 0 <= src < p:
                    ok = 0 <= pos.get((src, t, mb), -1) < j
                else:   # first/last device: the local predecessor (or the B of a W)
                    pre = {B1: F1, F1: F0, B0: B1, W1: B1, W0: B0}.get(t)
                    ok = pre is None or cnt[i][pre] > mb
                if ok:
                    row[j], row[k] = t, E
                    take(i, j, t)
                    break
    return grid


def _relabel_w(grid):
    """W passes take the chunk of the oldest pending B (first in, first out)."""
    for row in grid:
        queue = []
        for j, t in enumerate(row):
            if t in (B1, B0):
                queue.append(W1 + t - B1)
            elif t in (W1, W0):
                if not queue:
                    raise _Reject("W before its B")
                row[j] = queue.pop(0)
    return grid


def appendix_a_rows(blk, n: int, cap_m: int):
    """Rows [F0, F1, B1, B0, W1, W0] of slots per micro-batch through the appendix-A
    pipeline, or None where it cannot lay the block out within ``cap_m``."""
    d = len(blk)
    reps = max(n, 2 * d)
    try:
        grid = _repeat_grid(blk, reps)
        init = _peak_all(grid)
        if (n == reps and init > cap_m) or init > 2 * d:
            return None
        grid = _squeeze_grid(_warmup(_squeeze_grid(grid), reps))
        pk = _peak_all(grid)
        if pk > init:
            return None
        if n < reps:
            _drop_surplus(grid, n)
            if n <= d and 2 * n <= cap_m:
                _release_w(grid, min(2 * d, pk))
            grid = _squeeze_grid(grid)
            init = pk = _peak_all(grid)
            if pk > cap_m:
                return None
        grid = _relabel_w(_fill_bubbles(_cooldown(grid, n)))
    except _Reject:
        return None
    if _peak_all(grid) > init:
        return None
    rows = [[[j for j, x in enumerate(r) if x == t] for t in range(6)] for r in grid]
    if any(len(lst) != n for r in rows for lst in r):
        return None
    return rows


# ----------------------------------------------------------------------------- selection
def _layout(blk, n: int, cap_m: int, method: str):
    if method == "appendix-a":
        return appendix_a_rows(blk, n, cap_m)
    return build_slots([list(r) for r in blk], n)


@lru_cache(maxsize=4096)
def evaluate(blk, n: int, cap_m: int = 10 ** 9, method: str = "canonical"):
    """(unit-cost makespan, peak in m) of the block laid out by ``method`` ("canonical":
    the §2.4 pipeline; "appendix-a"), or None if that layout fails."""
    rows = _layout(blk, n, cap_m, method)
    if rows is None:
        return None
    try:
        rows = squeeze_unit(rows)
    except KeyError:            # an input placed after its consumer: not a valid layout
        return None
    first = min(min(min(lst) for lst in r) for r in rows)
    span = 1 + max(max(max(lst) for lst in r) for r in rows) - first
    return span, int(max(_peak(_occupancy(r), True) for r in rows))


def min_cap_units(d: int) -> float:
    """Smallest cap (units of M/d) any searched block reaches: V-Min's (d+4)//3 (§2.5)."""
    return min(candidates(d).values()) / 2


def _real_makespan(blk, n: int, cap_m: int, method: str, fbw: tuple) -> float:
    """Makespan of the laid-out block with per-V-stage costs (f, b, w), comm 0."""
    from ..costs import Costs
    from ..simulator import simulate
    s = slots_to_schedule(_layout(blk, n, cap_m, method))
    costs = Costs.per_stage(s.num_stages, n, *fbw, num_ranks=len(blk))
    return simulate(s, costs, check=False).makespan


METHODS = ("appendix-a", "canonical")


@lru_cache(maxsize=512)
def search(d: int, n: int, cap_m: int, fbw: tuple = (1.0, 1.0, 1.0)) -> tuple:
    """(block, method) with the smallest makespan, then lower peak, whose peak is <= cap_m;
    makespans with unit costs, or simulated with per-V-stage costs ``fbw`` (as the
    reference evaluates its candidates with real costs)."""
    cands = candidates(d)
    levels = sorted({p for p in cands.values() if p <= cap_m}, reverse=True)
    if not levels:
        raise ScheduleError(f"adaptive: mem_cap {cap_m / 2:g} is below the minimum feasible "
                            f"{min_cap_units(d):g} units (V-Min's peak) for d={d}")
    ne = min(n, 2 * d)
    scored = []
    for lvl in levels[:LEVELS]:
        blks = sorted((b for b, p in cands.items() if p == lvl),
                      key=lambda b: (_quick_makespan(b, min(ne, QUICK_N)), b))
        for b in blks[:TOP_PER_LEVEL]:
            for method in METHODS:
                r = evaluate(b, ne, cap_m, method)
                if r is not None and r[1] <= cap_m:
                    mk = r[0] if fbw == (1.0, 1.0, 1.0) else \
                        _real_makespan(b, ne, cap_m, method, fbw)
                    scored.append((mk, r[1], METHODS.index(method), b))
    for mk, pk, mi, b in sorted(scored):
        r = evaluate(b, n, cap_m, METHODS[mi])
        if r is not None and r[1] <= cap_m:
            return b, METHODS[mi]
    # fall back to the cheapest blocks (V-Min-like) with the canonical layout
    for lvl in reversed(levels):
        for b in sorted(b for b, p in cands.items() if p == lvl):
            r = evaluate(b, n, cap_m, "canonical")
            if r is not None and r[1] <= cap_m:
                return b, "canonical"
    raise ScheduleError(f"adaptive: no V building block keeps the peak within {cap_m / 2:g} "
                        f"units for d={d}, n={n}; minimum is {min_cap_units(d):g}")


@register("adaptive", placement="v", stages_per_rank=2, min_n=lambda d: d)
def adaptive(d: int, n: int, mem_cap: float | None = None, f: float = 1.0, b: float = 1.0,
             w: float = 1.0) -> Schedule:
    """V-shape schedule with the fewest bubbles whose peak activation stays <= ``mem_cap``
    (per rank, units of one micro-batch's activation for 1/d of the model, as
    ``SimResult.peak_units``; default d = 1F1B's first rank).  ``f, b, w``: relative
    per-stage pass times used to pick among the shortlisted blocks (default equal)."""
    try:
        cap = float(d if mem_cap is None else mem_cap)
        fbw = (float(f), float(b), float(w))
    except (TypeError, ValueError) as e:
        raise ScheduleError(f"adaptive: mem_cap, f, b, w must be numbers: {e}") from e
    if not cap == cap or cap <= 0 or min(fbw) <= 0:
        raise ScheduleError(f"adaptive: mem_cap and f, b, w must be positive, got "
                            f"mem_cap={mem_cap!r}, f, b, w = {fbw}")
    cap_m = int(2 * cap + 1e-9)           # one unit = 2 m (two V stages)
    if cap_m >= 2 * d and fbw[0] == fbw[1] == fbw[2] and n >= 2 * d:
        # §4.1: from 2d·m up the family's best is the V-ZB block (bubble d-1 slots, §2.6);
        # skip the search, which would only find it again
        from dataclasses import replace
        from .vshape import v_zb
        s = v_zb(d, n)
        return replace(s, meta={**s.meta, "layout": "v-zb block", "mem_cap": cap})
    blk, method = search(d, n, cap_m, fbw)
    mk, pk = evaluate(blk, n, cap_m, method)
    return slots_to_schedule(_layout(blk, n, cap_m, method),
                             block=[list(r) for r in blk], layout=method, mem_cap=cap,
                             expected_unit_makespan=mk, expected_peak_units=pk / 2)
