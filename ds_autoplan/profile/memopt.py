"""DawnPiper's per-tensor memory optimisation under a stage memory cap
(partition-dawnpiper.md §3.3, §7; seed 002 §3-4, costs after Capuchin).

Candidates are the profile's units (nodes of the fine-grained graph, or layers): each one's
saved-for-backward bytes ``b`` are kept, recomputed (a run of consecutive recomputed units is
one checkpoint segment: its input is kept, its forward re-runs once before its backward) or
swapped to host memory.  Per stage ``x`` with ``k`` activation copies in flight:

    mem_x     = W_x + k * A_kept + P_x                                  (§3.3)
    G(u)      = (k - 1)(T_F + T_B) + (T_F - end_f(u)) + start_b(u)      (§7.2, 1F1B: k = l-x+1)
    FreeTime  = G(u) - S_out(u) - S_in(u),   S = b / BW                 (§7.2)
    swap_cost = max(0, -FreeTime) + queueing beyond the link budget    (§7.2, §7.4)
    RT(u)     = forward time of u (its segment re-runs once)            (§7.2)
    MSPS(u)   = saved(u) / RT(u),   saved = drop of mem_x (re-walked after every choice)

Selection (§7.3): first swaps whose transfer hides (FreeTime > 0, by FreeTime descending,
within the link budget ``sum b <= BW (T_F + T_B)``), then per step the cheaper of the best swap
(``swap_cost / saved``) and the best recompute (``RT / saved``) until ``mem_x <= cap``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .profile import Profile

KEEP, RECOMPUTE, SWAP = "keep", "recompute", "swap"


@dataclass
class StagePolicy:
    stage: int
    units: list[str]
    choice: dict[str, str]             # unit name -> keep | recompute | swap
    copies: int
    peak_bytes: float                  # mem_x with the choice
    base_peak_bytes: float             # mem_x keeping everything
    time_s: float                      # T_F + T_B per micro-batch
    extra_s: float                     # T^moo: recompute + exposed swap time per micro-batch
    feasible: bool = True
    notes: list = field(default_factory=list)

    @property
    def recompute(self) -> list[str]:
        return [u for u in self.units if self.choice[u] == RECOMPUTE]

    @property
    def swap(self) -> list[str]:
        return [u for u in self.units if self.choice[u] == SWAP]

    @property
    def recompute_fraction(self) -> float:
        """Share of the stage's units recomputed (Plan.recompute_per_stage)."""
        return len(self.recompute) / len(self.units) if self.units else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "recompute_fraction": self.recompute_fraction}


class _Stage:
    """Quantities of one stage for one micro-batch."""

    def __init__(self, prof: Profile, lo: int, hi: int, copies: int, bw: float,
                 state_factor: float):
        self.u = prof.units[lo:hi]
        self.k = max(1, int(copies))
        self.bw = bw
        last = hi == len(prof.units)
        self.b = [u.act_bytes - (u.act_shared_prev_bytes if i else 0) for i, u in enumerate(self.u)]
        if last and prof.loss:   # the loss joins the last unit
            self.b[-1] += prof.loss.get("act_bytes", 0) - prof.loss.get("act_shared_prev_bytes", 0)
        self.f = [u.fwd_s for u in self.u]
        self.bk = [u.bwd_s for u in self.u]
        if last and prof.loss:
            self.f[-1] += prof.loss["fwd_s"]
            self.bk[-1] += prof.loss["bwd_s"]
        self.inp = [u.in_bytes for u in self.u]
        self.W = state_factor * sum(u.param_bytes for u in self.u)
        self.TF, self.TB = sum(self.f), sum(self.bk)
        n = len(self.u)
        end_f = [sum(self.f[:i + 1]) for i in range(n)]
        start_b = [sum(self.bk[i + 1:]) for i in range(n)]
        self.G = [(self.k - 1) * (self.TF + self.TB) + (self.TF - end_f[i]) + start_b[i]
                  for i in range(n)]

    def S(self, i: int) -> float:
        return self.b[i] / self.bw if self.bw > 0 else float("inf")

    def free_time(self, i: int) -> float:
        return self.G[i] - 2 * self.S(i)

    def segments(self, plan: list[str]) -> list[list[int]]:
        segs, cur = [], []
        for i, c in enumerate(plan):
            if c == RECOMPUTE:
                cur.append(i)
            elif cur:
                segs.append(cur)
                cur = []
        return segs + ([cur] if cur else [])

    def mem(self, plan: list[str]) -> float:
        segs = self.segments(plan)
        kept = sum(b for b, c in zip(self.b, plan) if c == KEEP)
        kept += sum(self.inp[s[0]] for s in segs)               # checkpoint inputs
        transient = max([sum(self.b[i] for i in s) for s in segs] +
                        [sum(b for b, c in zip(self.b, plan) if c == SWAP)] + [0])
        return self.W + self.k * kept + transient

    def extra(self, plan: list[str]) -> float:
        rec = sum(f for f, c in zip(self.f, plan) if c == RECOMPUTE)
        sw = [i for i, c in enumerate(plan) if c == SWAP]
        stall = sum(max(0.0, -self.free_time(i)) for i in sw)
        budget = self.bw * (self.TF + self.TB)             # §7.4 link budget per cycle
        over = max(0.0, sum(self.b[i] for i in sw) - budget)
        return rec + stall + (over / self.bw if self.bw > 0 and sw else 0.0)


def mem_opt(prof: Profile, lo: int, hi: int, cap: float, copies: int, *, stage: int = 0,
            swap_GBps: float | None = 12.0, state_factor: float = 4.0,
            min_bytes: int = 0, prefix_only: bool = False) -> StagePolicy:
    """Choose keep / recompute / swap for units ``[lo, hi)`` so that ``mem_x <= cap``.
    ``swap_GBps=None`` disables swapping (recompute only).  ``state_factor``: model-state
    bytes per parameter byte (4 = fp32 weight, gradient, two Adam moments).
    ``prefix_only``: recompute only a leading run of the stage's units, which is what the
    DeepSpeed adapter and Megatron's block method execute (``recompute_fraction`` is then
    exactly ``Plan.recompute_per_stage``)."""
    bw = (swap_GBps or 0.0) * 1e9
    st = _Stage(prof, lo, hi, copies, bw, state_factor)
    n = len(st.u)
    plan = [KEEP] * n
    base = st.mem(plan)
    names = [u.name for u in st.u]

    def done(feasible=True, notes=()):
        return StagePolicy(stage, names, dict(zip(names, plan)), st.k, st.mem(plan), base,
                           st.TF + st.TB, st.extra(plan), feasible, list(notes))

    if base <= cap:
        return done()
    cand = [i for i in range(n) if st.b[i] > 0 and st.b[i] >= min_bytes]
    if bw > 0:   # phase 1: swaps hidden under computation, longest FreeTime first
        used = 0.0
        for i in sorted(cand, key=st.free_time, reverse=True):
            if st.free_time(i) <= 0 or used + st.b[i] > bw * (st.TF + st.TB):
                break
            plan[i] = SWAP
            used += st.b[i]
            if st.mem(plan) <= cap:
                return done()
    while st.mem(plan) > cap:   # phase 2: cheapest time per saved byte
        cur = st.mem(plan)
        best = None
        prefix = next((j for j, c in enumerate(plan) if c != RECOMPUTE), n)
        moves = []
        for i in cand:
            opts = {KEEP: (SWAP, RECOMPUTE) if bw > 0 else (RECOMPUTE,), SWAP: (RECOMPUTE,),
                    RECOMPUTE: ()}[plan[i]]   # a hidden swap may still become a recompute
            for c in opts:
                if c == RECOMPUTE and prefix_only:
                    if i >= prefix:   # extend the recomputed prefix up to and including i
                        moves.append((i, c, plan[:prefix] + [RECOMPUTE] * (i + 1 - prefix)
                                      + plan[i + 1:]))
                    continue
                moves.append((i, c, plan[:i] + [c] + plan[i + 1:]))
        for i, c, trial in moves:
            saved = cur - st.mem(trial)
            if saved <= 0:
                continue
            cost = st.extra(trial) - st.extra(plan)       # swap_cost or RT (MSPS^-1 * saved)
            key = (cost / saved, c != SWAP)                # ties: swap first (§7.1)
            if best is None or key < best[0]:
                best = (key, trial)
        if best is None:
            return done(False, [f"cannot reach {cap:.0f} B: best is {cur:.0f} B"])
        plan[:] = best[1]
    return done()


def inflight_copies(schedule, stage_f=None, stage_b=None) -> list[int]:
    """Peak number of micro-batches whose activations a stage holds (F started, backward
    not finished), from the simulator (1F1B: ``min(S - x + 1, m)``, GPipe: ``m``)."""
    from ..schedule import Costs, Kind, simulate
    S, n = schedule.num_stages, schedule.num_microbatches
    costs = Costs.per_stage(S, n, f=stage_f if stage_f is not None else 1.0,
                            b=stage_b if stage_b is not None else 1.0, w=0.0)
    res = simulate(schedule, costs)
    ev: dict[int, list] = {s: [] for s in range(S)}
    last_bwd: dict = {}
    for a, t in res.start.items():
        if a.kind == Kind.F:
            ev[a.stage].append((t, 1))
        elif a.kind in (Kind.B, Kind.BW, Kind.W):
            k = (a.stage, a.mb)
            last_bwd[k] = max(last_bwd.get(k, -1.0), res.end[a])
    for (s, _), t in last_bwd.items():
        ev[s].append((t, -1))
    out = []
    for s in range(S):
        cur = peak = 0
        for _, d in sorted(ev[s]):
            cur += d
            peak = max(peak, cur)
        out.append(peak)
    return out


def memory_policy(prof: Profile, bounds: list[tuple[int, int]], cap: float, copies: list[int],
                  **kw) -> list[StagePolicy]:
    """Per-stage policy for a partition of the profile's units (``bounds`` = [lo, hi) per
    stage, ``copies`` = activation copies per stage, e.g. :func:`inflight_copies`)."""
    return [mem_opt(prof, lo, hi, cap, k, stage=s, **kw)
            for s, ((lo, hi), k) in enumerate(zip(bounds, copies))]
