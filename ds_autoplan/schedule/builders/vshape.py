"""V-shape schedules with controllable memory: V-Min, V-Half, V-ZB (Qi et al., NeurIPS 2024,
"Pipeline Parallelism with Controllable Memory"; docs/schedules.md §2).

The four steps of the building-block framework (§1.1) on integer *slots* (unit time, no comm):
a building block gives the slot of every pass of micro-batch 0; micro-batch k adds the
repeating interval T = 6 (§2.3); W passes are placed greedily into empty slots; warm-up and
cool-down are compacted under the block's own slot peak (reordering, §2.4) and squeezed.
The result is one ordered action list per rank; real times come from the simulator.

Pass types of one device row (index = "type"): F0, F1, B1, B0 and W (unlabelled) or
W1, W0.  Chunk 0 of device i is stage i, chunk 1 is stage 2d-1-i (§2.1).

"v-zb-greedy" (§4.3) builds V-ZB by list scheduling with real pass times instead.
"""
from __future__ import annotations

from functools import lru_cache

from ..ir import Kind, Schedule, ScheduleError, v_placement
from .registry import draft, register

T = 6                              # repeating interval: F0 F1 B1 B0 W1 W0 (§1.2)
F0, F1, B1, B0, W, W0 = range(6)   # W is W1 once W is split per chunk
MEM = (1, 1, 0, 0, -1)             # slot memory model (a_F, a_B, a_W) = (1, 0, -1)·m (§0)


# ----------------------------------------------------------------------------- blocks (§2.3)
def block(d: int, delta0, delta1: int, t1: int, t2: int, t3: int) -> list[list[int]]:
    """Slots [F0, F1, B1, B0] of micro-batch 0 per device, generic form of §2.3.

    ``delta0`` is the offset between adjacent devices of the passes travelling 0→d-1 (F0,
    B1); an int, or a list of d-1 per-transition offsets (appendix A's two-part rows)."""
    d0 = [delta0] * (d - 1) if isinstance(delta0, int) else list(delta0)
    f0 = [0] * d
    for i in range(1, d):
        f0[i] = f0[i - 1] + d0[i - 1]
    f1 = [0] * d
    f1[d - 1] = f0[d - 1] + t1
    for i in range(d - 2, -1, -1):
        f1[i] = f1[i + 1] + delta1
    b1 = [0] * d
    b1[0] = f1[0] + t2
    for i in range(1, d):
        b1[i] = b1[i - 1] + d0[i - 1]
    b0 = [0] * d
    b0[d - 1] = b1[d - 1] + t3
    for i in range(d - 2, -1, -1):
        b0[i] = b0[i + 1] + delta1
    return [[f0[i], f1[i], b1[i], b0[i]] for i in range(d)]


def vmin_block(d: int) -> list[list[int]]:
    """(δ0, δ1) = (1, 1); turns (1, 1+g, 1), g = 2 if d % 3 == 0 (reference code, §2.3)."""
    return block(d, 1, 1, 1, 1 + (2 if d % 3 == 0 else 0), 1)


def vhalf_block(d: int) -> list[list[int]]:
    """(δ0, δ1) = (2, 1); turns (1, 1+g, 2), g = 3 if d even (§2.3)."""
    return block(d, 2, 1, 1, 1 + (3 if d % 2 == 0 else 0), 2)


def vzb_block(d: int) -> list[list[int]]:
    """(δ0, δ1) = (4, 2); turns (1, 1, 1): row i mod 6 is F0 F1 B1 B0 W1 W0 rotated (§2.3)."""
    return block(d, 4, 2, 1, 1, 1)


def conflict_free(blk: list[list[int]]) -> bool:
    """§1.3: a block repeats without collisions iff each row's slots are distinct mod T."""
    return all(len({x % T for x in row}) == len(row) for row in blk)


# ----------------------------------------------------------------------------- slot machinery
def put_w(row: list[list[int]], split: bool) -> list[list[int]]:
    """Greedy W (§2.4): every empty slot takes one pending W (a B already seen); with
    ``split`` a pending W1 goes before a pending W0; leftovers are appended at the end."""
    occ = _occupancy(row[:4])
    out = [list(x) for x in row[:4]] + ([[], []] if split else [[]])
    pend = [0, 0]
    for i, t in enumerate(occ):
        if t >= 0:
            if t == B1 or t == B0:
                pend[t - B1 if split else 0] += 1
        elif pend[0]:
            out[W].append(i)
            pend[0] -= 1
        elif pend[1]:
            out[W + 1].append(i)
            pend[1] -= 1
    i = len(occ) - 1
    for w in range(2):
        for _ in range(pend[w]):
            i += 1
            out[W + w].append(i)
    return out


def _occupancy(row: list[list[int]]) -> list[int]:
    """Slot → pass type (-1 = empty) of one device row (F0, F1, B1, B0[, W])."""
    occ = [-1] * (1 + max(max(lst) for lst in row if lst))
    for t, lst in enumerate(row):
        for s in lst:
            occ[s] = t
    return occ


def _peak(occ: list[int], has_w: bool, cap: float = float("inf"), start: int = 0,
          state: tuple = (0, 0, 0), trace: list | None = None) -> float:
    """Peak of +1 per F, -1 per W over the slots; without explicit W every empty slot
    consumes one pending W (§2.4 ``slot_peak``).  Scans from ``start`` with ``state`` =
    (memory, pending W, peak so far); returns inf as soon as the peak exceeds ``cap``;
    ``trace`` (if given) receives the state after every slot."""
    cur, pend, res = state
    for i in range(start, len(occ)):
        t = occ[i]
        if t < 0:
            if pend and not has_w:
                cur -= 1
                pend -= 1
        elif t < B1:
            cur += 1
            if cur > res:
                if cur > cap:
                    return float("inf")
                res = cur
        elif t < W:
            pend += 1
        else:
            cur -= 1
        if trace is not None:
            trace.append((cur, pend, res))
    return res


def slot_peak(row: list[list[int]]) -> int:
    """Slot peak of one device row; explicit W iff the row has more than 4 types."""
    return int(_peak(_occupancy(row), len(row) > 4))


def _dep_slot(rows, dev: int, t: int, mb: int) -> int:
    """Latest slot among the passes that must precede pass (dev, t, mb) (§2.4 ``compact``):
    cross-device predecessor, previous pass of the chain F0→F1→B1→B0, same type mb-1, and
    for an (unlabelled) W the mb-th B of that device."""
    d = len(rows)
    e = -1
    if t in (F0, B1) and dev > 0:
        e = max(e, rows[dev - 1][t][mb])
    if t in (F1, B0) and dev + 1 < d:
        e = max(e, rows[dev + 1][t][mb])
    if 0 < t < W:
        e = max(e, rows[dev][t - 1][mb])
    if t == W:
        e = max(e, sorted(rows[dev][B1] + rows[dev][B0])[mb])
    if mb > 0:
        e = max(e, rows[dev][t][mb - 1])
    return e


def squeeze_unit(rows) -> list[list[list[int]]]:
    """Squeeze (§1.4): ASAP execution with unit costs, comm 0, per-device order = slot order."""
    d = len(rows)
    passes = sorted((s, dev, t, mb) for dev, row in enumerate(rows)
                    for t, lst in enumerate(row) for mb, s in enumerate(lst))
    free = [0] * d
    out = [[[0] * len(lst) for lst in row] for row in rows]    # start slots; a pass ends 1 later
    for _, dev, t, mb in passes:
        st = free[dev]
        if t in (F0, B1) and dev > 0:
            st = max(st, out[dev - 1][t][mb] + 1)
        if t in (F1, B0) and dev + 1 < d:
            st = max(st, out[dev + 1][t][mb] + 1)
        if 0 < t < W:
            st = max(st, out[dev][t - 1][mb] + 1)
        free[dev] = st + 1
        out[dev][t][mb] = st
    return out


def _converges(occ: list[int], start: int, moved: int, state: tuple, trace: list, cap: float,
               out: list | None = None) -> bool:
    """:func:`_peak` without explicit W from slot ``start`` in ``state`` after a pass moved
    from slot ``moved`` to ``start``, on a row whose old scan ``trace`` stayed within
    ``cap``: False as soon as the memory exceeds ``cap``; True at the first slot from
    ``moved`` on where (memory, pending W) equal the old scan's (the rest is unchanged).
    ``out`` receives the new states up to there (their running peak is not kept: a row
    within its cap never needs it)."""
    cur, pend = state[0], state[1]
    for i in range(start, len(occ)):
        t = occ[i]
        if t < 0:
            if pend:
                cur -= 1
                pend -= 1
        elif t < B1:
            cur += 1
            if cur > cap:
                return False
        elif t < W:
            pend += 1
        else:
            cur -= 1
        if out is not None:
            out.append((cur, pend, 0))
        if i >= moved and trace[i][0] == cur and trace[i][1] == pend:
            return True
    return True


def _first_free(occupied: set, lo: int, hi: int) -> int:
    """First slot in [lo, hi) not in ``occupied``, else ``hi``."""
    for s in range(lo, hi):
        if s not in occupied:
            return s
    return hi


def compact(rows, consider_w: bool, cap: int | None = None) -> list[list[list[int]]]:
    """Reordering pass of §2.4: move warm-up (only with explicit W) and cool-down passes to
    the first free earlier slot that keeps the device's slot peak <= cap; then squeeze.
    Phase 0 → 1 at the first B0 of device 0; phase 1 → 2 after the last micro-batch's F0;
    phase-1 passes (the steady state) never move."""
    if consider_w:
        rows = [put_w(r, split=False) for r in rows]
    rows = [[list(x) for x in r] for r in rows]
    if cap is None:
        cap = max(slot_peak(r) for r in rows)
    n = len(rows[0][F0])
    order = sorted((s, dev, t, mb) for dev, row in enumerate(rows)
                   for t, lst in enumerate(row) for mb, s in enumerate(lst))
    occ = [_occupancy(r) for r in rows]       # all passes, visited or not
    occupied = [set() for _ in rows]          # slots taken by visited passes
    # Incremental peak checks (same answers as a full slot_peak scan per try): with explicit
    # W only memory after each slot matters (a move of F/W shifts it by ±1 on [s, old):
    # an F fits at s iff the memory stays below cap on [s, old), a W or B always fits);
    # without, the scan state (memory, pending W) after each slot, re-scanned from the
    # moved slot until it meets the old scan (only cool-down passes move then).
    trace = [[] for _ in rows]
    for o, tr in zip(occ, trace):
        _peak(o, consider_w, trace=tr)
    ok = [tr[-1][2] <= cap for tr in trace]   # row within cap (else: full scans)
    if consider_w:
        trace = [[x[0] for x in tr] for tr in trace]
    phase = 0
    for cur, dev, t, mb in order:
        if phase == 0 and t == B0 and dev == 0:
            phase = 1
        if phase == 1 or (phase == 0 and not consider_w):
            if phase == 1 and t == F0 and mb == n - 1:
                phase = 2
            occupied[dev].add(cur)
            continue
        lo = _dep_slot(rows, dev, t, mb) + 1
        if lo >= cur:                         # no earlier slot: the pass stays
            occupied[dev].add(cur)
            continue
        o, tr = occ[dev], trace[dev]
        o[cur] = -1
        if ok[dev] and consider_w:
            if t < B1:
                j = cur - 1
                while j >= lo and tr[j] < cap:
                    j -= 1
                lo = j + 1
            s = _first_free(occupied[dev], lo, cur)
            o[s] = t
        else:
            for s in range(lo, cur):
                if s in occupied[dev]:
                    continue
                o[s] = t
                if not ok[dev]:
                    fits = _peak(o, consider_w, cap) <= cap
                else:
                    fits = _converges(o, s, cur, tr[s - 1] if s else (0, 0, 0), tr, cap)
                if fits:
                    break
                o[s] = -1
            else:
                s = cur
                o[cur] = t
        if s != cur:
            if consider_w:
                delta = MEM[t]
                if delta:
                    tr[s:cur] = [x + delta for x in tr[s:cur]]
                if not ok[dev]:
                    ok[dev] = _peak(o, True, cap) <= cap
            elif not ok[dev]:
                tr.clear()
                _peak(o, False, trace=tr)
                ok[dev] = tr[-1][2] <= cap
            else:
                new = []
                _converges(o, s, cur, tr[s - 1] if s else (0, 0, 0), tr, cap, new)
                tr[s:s + len(new)] = new
        rows[dev][t][mb] = s
        occupied[dev].add(s)
    if not consider_w:
        rows = [put_w(r, split=False) for r in rows]
    return squeeze_unit(rows)


def build_slots(blk: list[list[int]], n: int, cap: int | None = None) -> list[list[list[int]]]:
    """§2.4 pipeline: repeat, compact with explicit W, drop W, compact with implicit W,
    drop W, final greedy W1-before-W0.  Returns rows [F0, F1, B1, B0, W1, W0] of slots."""
    rows = [[[x + T * j for j in range(n)] for x in row] for row in blk]
    rows = [r[:4] for r in compact(rows, consider_w=True, cap=cap)]
    rows = [r[:4] for r in compact(rows, consider_w=False, cap=cap)]
    return [put_w(r, split=True) for r in rows]


def slots_to_schedule(rows, **meta) -> Schedule:
    """The per-rank lists of slot rows ``[F0, F1, B1, B0, W1, W0]`` (V placement), each rank's
    passes ordered by slot; ``meta`` goes to the schedule."""
    d = len(rows)
    n = len(rows[0][F0])
    kinds = (Kind.F, Kind.F, Kind.B, Kind.B, Kind.W, Kind.W)
    lists = []
    for i, row in enumerate(rows):
        stage = (i, 2 * d - 1 - i, 2 * d - 1 - i, i, 2 * d - 1 - i, i)
        passes = sorted((s, t, mb) for t, lst in enumerate(row) for mb, s in enumerate(lst))
        lists.append([(kinds[t], stage[t], mb) for _, t, mb in passes])
    return draft(n, v_placement(d), lists, **meta)


@lru_cache(maxsize=256)
def _cached(block_of, d: int, n: int) -> tuple:
    rows = build_slots(block_of(d), n)
    return tuple(tuple(tuple(x) for x in r) for r in rows)


def _build(block_of, d: int, n: int) -> Schedule:
    """The V schedule of building block ``block_of(d)`` for ``n`` micro-batches."""
    meta = {"block": block_of(d)}
    if n < 2 * d:
        meta["warning"] = (f"n={n} < 2d={2 * d}; bubbles and the stated peak memory "
                           f"are only guaranteed for n >= 2d (docs/schedules.md §8, decision 5)")
    return slots_to_schedule(_cached(block_of, d, n), **meta)


@register("v-min", placement="v", stages_per_rank=2, min_n=lambda d: d, search_order=3)
def v_min(d: int, n: int) -> Schedule:
    """V-Min: δ0 = δ1 = 1, peak (d+4)//3 units (≈ 1/3 of 1F1B), bubble ≈ 2/3 of 1F1B's."""
    return _build(vmin_block, d, n)


@register("v-half", placement="v", stages_per_rank=2, min_n=lambda d: d, search_order=2)
def v_half(d: int, n: int) -> Schedule:
    """V-Half: (δ0, δ1) = (2, 1), peak (d+2)//2 units (≈ 1/2 of 1F1B), bubble ≈ 1/2 of 1F1B's."""
    return _build(vhalf_block, d, n)


@register("v-zb", placement="v", stages_per_rank=2, min_n=lambda d: d, search_order=4)
def v_zb(d: int, n: int) -> Schedule:
    """V-ZB: (δ0, δ1) = (4, 2), peak d units (= 1F1B), bubble d-1 unit slots."""
    return _build(vzb_block, d, n)


# ----------------------------------------------------------------------------- V-ZB greedy (§4.3)
class _Greedy:
    """State of one greedy V-ZB pass (list scheduling with real per-pass costs)."""

    def __init__(self, d, n, cost, c, mem, cap, fill_f, fill_b, approved):
        self.d, self.n, self.cost, self.c, self.mem_d, self.cap = d, n, cost, c, mem, cap
        self.fill_f, self.fill_b = fill_f, fill_b
        self.count = [[0] * 6 for _ in range(d)]
        self.end: dict[tuple[int, int, int], float] = {}
        self.now = [0.0] * d
        self.mem = [0.0] * d
        self.bubble = [0.0] * d
        self.pending = [[] for _ in range(d)]     # FIFO of (W type, mb)
        self.order = [[] for _ in range(d)]
        self.approved = approved or [-1.0] * d

    def max_bubble(self, dev: int | None = None) -> float:
        m = max(self.bubble)
        if dev is not None:
            m = max(m, max(self.approved) - self.approved[dev])
        return m

    def src(self, dev: int, t: int, mb: int):
        """Cross-device predecessor of pass (dev, t, mb), or None (first/last device)."""
        if t in (F0, B1) and dev > 0:
            return (t, dev - 1, mb)
        if t in (F1, B0) and dev + 1 < self.d:
            return (t, dev + 1, mb)
        return None

    def put(self, dev: int, t: int) -> None:
        mb = self.count[dev][t]
        if mb >= self.n or self.mem[dev] + self.mem_d[t] > self.cap + 1e-9:
            raise ScheduleError("v-zb-greedy: memory cap too small for this greedy schedule")
        local = {F1: F0, B1: F1, B0: B1, W: B1, W0: B0}.get(t)   # same-device predecessor
        if local is not None and self.count[dev][local] <= mb:
            raise ScheduleError("v-zb-greedy: the greedy gets stuck under this memory cap")
        start = self.now[dev]
        p = self.src(dev, t, mb)
        if p is not None:
            if p not in self.end:               # input never produced: stuck under this cap
                raise ScheduleError("v-zb-greedy: the greedy gets stuck under this memory cap")
            start = max(start, self.end[p] + self.c)
        if self.count[dev][F0] > 0:             # idle time after the device has started
            self.bubble[dev] += start - self.now[dev]
        self.end[(t, dev, mb)] = self.now[dev] = start + self.cost[t]
        self.mem[dev] += self.mem_d[t]
        self.order[dev].append((t, mb))
        if t in (B1, B0):
            self.pending[dev].append((W + (t - B1), mb))
        self.count[dev][t] += 1

    def put_w(self, dev: int) -> None:
        if not self.pending[dev]:
            raise ScheduleError("v-zb-greedy: memory cap too small (no W left to free memory)")
        t, _ = self.pending[dev].pop(0)
        self.put(dev, t)

    def gap(self, dev: int, p) -> float:
        """Time the device would wait for the input ``p`` (or 0 if not known yet)."""
        return self.end[p] + self.c - self.now[dev] if p in self.end else 0.0

    def fill_w(self, dev: int, t: int, allowed: bool) -> None:
        """W passes that fit entirely into the wait for the input of the next pass, plus one
        more if the wait exceeds this device's bubble budget (§4.3)."""
        p = self.src(dev, t, self.count[dev][t])
        wcost = self.cost[W]
        while self.pending[dev] and p in self.end and self.gap(dev, p) >= wcost:
            self.put_w(dev)
        if self.pending[dev] and allowed and p is not None and \
                self.gap(dev, p) > self.max_bubble(dev) - self.bubble[dev]:
            self.put_w(dev)

    def run(self) -> None:
        d, n, f_mem = self.d, self.n, self.mem_d[F0]
        for i in range(d):                      # F0 of micro-batch 0 everywhere
            self.put(i, F0)
        for i in range(d - 1, -1, -1):          # extra F0s while waiting for F1(0)
            if i < d - 1:
                arrive = self.end[(F1, i + 1, 0)] + self.c
                while (self.mem[i] + f_mem * (2 + 2 * i) <= self.cap
                       and self.now[i] + self.cost[F0] <= arrive and self.count[i][F0] < n):
                    for j in range(i + 1):
                        self.put(j, F0)
            self.put(i, F1)
        chunk = F0                              # each device at least as many F as its predecessor
        for i in range(1, d):
            cnt, prev = self.count[i], self.count[i - 1]
            while cnt[F0] + cnt[F1] < prev[F0] + prev[F1] or cnt[F1] <= prev[F1] < n:
                for j in range(d - 1, i - 1, -1):
                    if self.count[j][chunk] < n:
                        self.put(j, chunk)
                chunk = F1 if chunk == F0 else F0
        for _ in range(2 * n):
            for i in range(d):                  # a B must not overflow memory
                while self.mem[i] + self.mem_d[B1] > self.cap + 1e-9:
                    self.put_w(i)
            first, second = [], []              # B0 next (devices d-1..0), then B1 next (0..d-1)
            for i in range(d):
                cnt = self.count[i]
                if cnt[B0] >= cnt[B1]:
                    second.append((i, B1))
                elif i == d - 1 or (B0, i + 1, cnt[B0]) in self.end or cnt[B1] >= n:
                    first.append((i, B0))
                else:
                    second.append((i, B1))
            for i, t in first[::-1] + second:
                self.fill_w(i, t, t == B0 or self.fill_b)
                self.put(i, t)
            for i in range(d):                  # then one F per device whose input is ready
                cnt = self.count[i]
                if cnt[F1] >= n:
                    continue
                if cnt[F1] >= cnt[F0]:
                    t = F0
                elif i == d - 1 or (F1, i + 1, cnt[F1]) in self.end:
                    t = F1
                elif cnt[F0] < n and (i == 0 or (F0, i - 1, cnt[F0]) in self.end):
                    t = F0
                else:
                    continue
                while self.mem[i] + f_mem > self.cap + 1e-9:
                    self.put_w(i)
                self.fill_w(i, t, self.fill_f)
                self.put(i, t)
        for i in range(d):
            while self.pending[i]:
                self.put_w(i)


def _greedy_best(d, n, cost, c, mem, cap, fill_f, fill_b, approved=None) -> "_Greedy":
    g = _Greedy(d, n, cost, c, mem, cap, fill_f, fill_b, approved)
    g.run()
    # repeat with this pass's per-device bubbles as the approved budget while it improves
    if approved is None or g.max_bubble() < max(approved):
        h = _greedy_best(d, n, cost, c, mem, cap, fill_f, fill_b, list(g.bubble))
        if h.max_bubble() < g.max_bubble():
            return h
    return g


@register("v-zb-greedy", placement="v", stages_per_rank=2, min_n=lambda d: d)
def v_zb_greedy(d: int, n: int, f: float = 1.0, b: float = 1.0, w: float = 1.0, c: float = 0.0,
                mem_cap: float | None = None) -> Schedule:
    """V-ZB built greedily with per-V-stage costs ``f, b, w``, comm ``c`` and an activation
    cap (units of M/d as ``SimResult.peak_units``; default d = 1F1B's), docs/schedules.md §4.3
    (reference zbv.py, restated).  Better than the block at n < 2d and for uneven costs."""
    cap = float(d if mem_cap is None else mem_cap)
    if min(f, b, w) <= 0 or c < 0 or cap <= 0:
        raise ScheduleError("v-zb-greedy: f, b, w and mem_cap must be > 0 and c >= 0")
    cost = (f, f, b, b, w, w)
    mem = (1.0, 1.0, 0.0, 0.0, -1.0, -1.0)      # (a_F, a_B, a_W) = (1, 0, -1)·m
    cap_m = 2 * cap                              # one unit = 2 m
    best, err = None, None
    for fill_b in (True, False):
        for fill_f in (True, False):
            try:
                g = _greedy_best(d, n, cost, c, mem, cap_m, fill_f, fill_b)
            except ScheduleError as e:
                err = e
                continue
            if best is None or g.max_bubble() < best.max_bubble():
                best = g
    if best is None:
        raise ScheduleError(f"{err}; mem_cap={cap:g} units is too small for the greedy at d={d}, "
                            f"n={n} (the 'adaptive' builder goes down to (d+4)//3 units)")
    kinds = (Kind.F, Kind.F, Kind.B, Kind.B, Kind.W, Kind.W)
    lists = []
    for i, seq in enumerate(best.order):
        stage = (i, 2 * d - 1 - i, 2 * d - 1 - i, i, 2 * d - 1 - i, i)
        lists.append([(kinds[t], stage[t], mb) for t, mb in seq])
    return draft(n, v_placement(d), lists, mem_cap=cap,
                 costs={"f": f, "b": b, "w": w, "c": c})
