"""DawnPiper's per-tensor memory optimisation under a stage memory cap
(docs/dawnpiper.md §3.3, §7; seed 002 §3-4, costs after Capuchin).

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

Per saved tensor (:func:`tensor_mem_opt`, the paper's granularity: each node's saved-tensor
list, §2.3) the same formulas apply to every tensor ``tau`` (G from the unit that saves it to
the first one reading it in the backward); recomputing ``tau`` re-runs the unit producing it,
and the swapped bytes of units ``u`` and ``u+1`` are back on the device together (swap-in one
unit ahead, §7.4).  :mod:`ds_autoplan.runtime.swap` executes the swap choice.
"""
from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field

from ..profile.profile import Profile

KEEP, RECOMPUTE, SWAP = "keep", "recompute", "swap"


@dataclass
class StagePolicy:
    """DawnPiper's memory optimisation of one stage: per unit keep / recompute / swap, the
    activation copies in flight, peak bytes with and without it, and its time."""
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
    tensor_choice: dict = field(default_factory=dict)   # "unit#index" -> choice (per tensor)
    swap_bytes: float = 0.0            # bytes offloaded per micro-batch
    tensor_bytes: dict = field(default_factory=dict)    # "unit#index" -> bytes

    @property
    def recompute(self) -> list[str]:
        """Units whose activations are recomputed."""
        return [u for u in self.units if self.choice[u] == RECOMPUTE]

    @property
    def swap(self) -> list[str]:
        """Units whose saved tensors are swapped to host memory."""
        return [u for u in self.units if self.choice[u] == SWAP]

    @property
    def swap_units(self) -> dict:
        """unit -> sorted indices of its saved tensors to offload (per-tensor choice), or
        None for all of them (per-unit choice): ``runtime.swap.SwapPolicy``'s ``units``."""
        if not self.tensor_choice:
            return {u: None for u in self.swap}
        units: dict = {}
        for key, c in self.tensor_choice.items():
            if c == SWAP:
                u, i = key.rsplit("#", 1)
                units.setdefault(u, []).append(int(i))
        return {u: sorted(ix) for u, ix in units.items()}

    @property
    def recompute_fraction(self) -> float:
        """Share of the stage's units recomputed (Plan.recompute_per_stage)."""
        return len(self.recompute) / len(self.units) if self.units else 0.0

    def to_dict(self) -> dict:
        """JSON-able form, with the recompute fraction."""
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
        self.end_f = [sum(self.f[:i + 1]) for i in range(n)]
        self.start_b = [sum(self.bk[i + 1:]) for i in range(n)]
        self.G = [self.gap(i, i) for i in range(n)]

    def gap(self, u: int, v: int) -> float:
        """G: end of producer ``u`` in F(k) to start of consumer ``v`` in B(k)  (§7.2, 1F1B)."""
        return (self.k - 1) * (self.TF + self.TB) + (self.TF - self.end_f[u]) + self.start_b[v]

    def S(self, i: int, b: float | None = None) -> float:
        b = self.b[i] if b is None else b
        return b / self.bw if self.bw > 0 else float("inf")

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
            min_bytes: int = 0, prefix_only: bool = False,
            per_tensor: bool = False) -> StagePolicy:
    """Choose keep / recompute / swap for units ``[lo, hi)`` so that ``mem_x <= cap``.
    ``swap_GBps=None`` disables swapping (recompute only).  ``state_factor``: model-state
    bytes per parameter byte (4 = fp32 weight, gradient, two Adam moments).
    ``prefix_only``: recompute only a leading run of the stage's units, which is what the
    DeepSpeed adapter and Megatron's block method execute (``recompute_fraction`` is then
    exactly ``Plan.recompute_per_stage``).  ``per_tensor``: choose per saved tensor
    (:func:`tensor_mem_opt`; needs a profile with ``tensors``)."""
    if per_tensor:
        return tensor_mem_opt(prof, lo, hi, cap, copies, stage=stage, swap_GBps=swap_GBps,
                              state_factor=state_factor, min_bytes=min_bytes,
                              prefix_only=prefix_only)
    bw = (swap_GBps or 0.0) * 1e9
    st = _Stage(prof, lo, hi, copies, bw, state_factor)
    n = len(st.u)
    plan = [KEEP] * n
    base = st.mem(plan)
    names = [u.name for u in st.u]

    def done(feasible=True, notes=()):
        return StagePolicy(stage, names, dict(zip(names, plan)), st.k, st.mem(plan), base,
                           st.TF + st.TB, st.extra(plan), feasible, list(notes),
                           swap_bytes=sum(b for b, c in zip(st.b, plan) if c == SWAP))

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


class _TensorStage(_Stage):
    """Per saved tensor quantities of one stage (docs/dawnpiper.md §2.3, §7.2): tensor
    ``j`` of ``b[j]`` bytes is saved first by unit ``unit[j]``, last used (earliest in the
    backward) by ``last[j]``, computed by unit ``prod[j]`` (None: produced outside the stage,
    so it can only be kept or swapped).  [decision] The loss's tensors (``swappable`` False)
    are never swapped: the runtimes compute the loss outside the stage's forward, and on the
    loss stage the gap G is the shortest anyway (§7.2).  ``prefix``: recomputation re-runs a
    leading run of units, as the runtimes' ``recompute_per_stage`` does."""

    def __init__(self, prof: Profile, lo: int, hi: int, copies: int, bw: float,
                 state_factor: float, prefix: bool = False):
        super().__init__(prof, lo, hi, copies, bw, state_factor)
        self.prefix = prefix
        gid = [i for i, t in enumerate(prof.tensors) if lo <= t["unit"] < hi]
        local = {g: j for j, g in enumerate(gid)}
        T = [prof.tensors[g] for g in gid]
        n = hi - lo
        rel = lambda u: u - lo if u is not None and lo <= u < hi else None   # noqa: E731
        self.names = [f"{'loss' if t.get('owner') == 'loss' else prof.units[t['unit']].name}"
                      f"#{t['index']}" for t in T]
        self.tb = [float(t["bytes"]) for t in T]
        self.unit = [t["unit"] - lo for t in T]
        self.last = [max(u for u in t["users"] if lo <= u < hi) - lo for t in T]
        self.prod = [rel(t["producer"]) for t in T]
        self.swappable = [t.get("owner") != "loss" for t in T]
        self.Gt = [self.gap(u, v) for u, v in zip(self.unit, self.last)]   # G(tau)  (§7.2)
        # inputs a recomputation of unit u reads: (producer, bytes, local tensor or None)
        self.ins = [[(rel(q), float(b), local.get(tid)) for q, b, tid in prof.units[lo + u].inputs]
                    for u in range(n)]

    def tfree(self, j: int) -> float:
        return self.Gt[j] - 2 * self.S(j, self.tb[j])     # FreeTime = G - S_out - S_in  (§7.2)

    def rerun(self, plan: list[str]) -> set[int]:
        """Units whose forward re-runs: producers of recomputed tensors (§7.2 RT); with
        ``prefix`` the leading units whose saved tensors are dropped."""
        if self.prefix:   # units 0..(last unit saving a recomputed tensor)
            return set(range(1 + max((w for w, c in zip(self.unit, plan) if c == RECOMPUTE),
                                     default=-1)))
        return {self.prod[j] for j, c in enumerate(plan) if c == RECOMPUTE}

    def prefix_plan(self, plan: list[str], u: int) -> list[str]:
        """``plan`` with units ``0..u`` recomputed: everything they save is dropped except
        what comes from outside the stage (the checkpointed stage input, kept)."""
        return [(RECOMPUTE if p is not None else KEEP) if w <= u else c
                for c, w, p in zip(plan, self.unit, self.prod)]

    def resident(self, plan: list[str]) -> float:
        """Bytes one micro-batch keeps on the device between F and B: kept tensors plus the
        checkpoints (inputs of re-run units that nothing keeps)  (§3.3 ``A_x``)."""
        R = self.rerun(plan)
        srcs = {(q, b, tid) for u in R for q, b, tid in self.ins[u]
                if (tid is None or plan[tid] == RECOMPUTE) and q not in R}
        return sum(b for b, c in zip(self.tb, plan) if c == KEEP) + sum(b for _, b, _ in srcs)

    def mem(self, plan: list[str]) -> float:
        """mem_x = W + k * resident + transient   (§3.3)."""
        R = self.rerun(plan)   # consecutive re-run units rematerialise together
        runs = self.segments([RECOMPUTE if u in R else KEEP for u in range(len(self.u))])
        trans = [sum(b for b, c, p in zip(self.tb, plan, self.prod) if c == RECOMPUTE
                     and p in r) for r in runs]
        # swap-in is issued one unit ahead of the backward that reads it (§7.4): the swapped
        # bytes of units u and u+1 are back on the device together
        sw = [0.0] * (len(self.u) + 1)
        for b, c, v in zip(self.tb, plan, self.last):
            if c == SWAP:
                sw[v] += b
        trans += [sw[u] + sw[u + 1] for u in range(len(self.u))]
        return self.W + self.k * self.resident(plan) + max(trans)

    def extra(self, plan: list[str]) -> float:
        """T^moo = sum RT of re-run units + exposed swap time (§7.2 swap_cost, §7.4 budget)."""
        rec = sum(self.f[u] for u in self.rerun(plan))
        sw = [j for j, c in enumerate(plan) if c == SWAP]
        stall = sum(max(0.0, -self.tfree(j)) for j in sw)
        over = max(0.0, sum(self.tb[j] for j in sw) - self.bw * (self.TF + self.TB))
        return rec + stall + (over / self.bw if self.bw > 0 and sw else 0.0)


def tensor_mem_opt(prof: Profile, lo: int, hi: int, cap: float, copies: int, *,
                   stage: int = 0, swap_GBps: float | None = 12.0, state_factor: float = 4.0,
                   min_bytes: int = 0, exact_limit: int = 0,
                   prefix_only: bool = False) -> StagePolicy:
    """keep / recompute / swap per saved tensor of units ``[lo, hi)`` so that ``mem_x <= cap``
    (DawnPiper §4 with Capuchin's cost model, docs/dawnpiper.md §7.1-7.4).  Candidates are
    the tensors of ``prof.tensors`` with at least ``min_bytes`` (θ, §7.3).  Recomputing a
    tensor re-runs its producing unit's forward once per micro-batch (shared by every tensor of
    that unit); the unit's inputs that no kept/swapped tensor holds become checkpoints.
    ``prefix_only``: recompute only whole leading units (what ``recompute_per_stage`` runs).
    The selection is Capuchin's greedy (§7.3); with at most ``exact_limit`` candidates every
    plan is enumerated instead (3^n, small stages only)."""
    if not prof.tensors:
        raise ValueError("profile has no per-tensor records (re-profile with this version)")
    bw = (swap_GBps or 0.0) * 1e9
    st = _TensorStage(prof, lo, hi, copies, bw, state_factor, prefix_only)
    n = len(st.tb)
    plan = [KEEP] * n
    base = st.mem(plan)

    def done(feasible=True, notes=()):
        R = st.rerun(plan)
        unit_choice = {}
        for u, un in enumerate(st.u):
            mine = [c for c, w in zip(plan, st.unit) if w == u]
            unit_choice[un.name] = RECOMPUTE if u in R else (SWAP if SWAP in mine else KEEP)
        return StagePolicy(stage, [u.name for u in st.u], unit_choice, st.k, st.mem(plan), base,
                           st.TF + st.TB, st.extra(plan), feasible, list(notes),
                           dict(zip(st.names, plan)),
                           sum(b for b, c in zip(st.tb, plan) if c == SWAP),
                           dict(zip(st.names, st.tb)))

    def legal(p) -> bool:
        if any(c == SWAP and not ok for c, ok in zip(p, st.swappable)) or \
                any(c == RECOMPUTE and q is None for c, q in zip(p, st.prod)):
            return False
        kp = len(st.rerun(p)) if prefix_only else 0
        return all(c == (RECOMPUTE if q is not None else KEEP) if w < kp else
                   not (prefix_only and c == RECOMPUTE)
                   for c, w, q in zip(p, st.unit, st.prod))

    if base <= cap:
        return done()
    cand = [j for j in range(n) if st.tb[j] > 0 and st.tb[j] >= min_bytes]
    if len(cand) <= exact_limit:
        best = None
        for combo in itertools.product((KEEP, RECOMPUTE, SWAP) if bw > 0 else (KEEP, RECOMPUTE),
                                       repeat=len(cand)):
            trial = list(plan)
            for j, c in zip(cand, combo):
                trial[j] = c
            if legal(trial) and st.mem(trial) <= cap and \
                    (best is None or st.extra(trial) < best[0]):
                best = (st.extra(trial), trial)
        if best is None:
            return done(False, [f"cannot reach {cap:.0f} B"])
        plan[:] = best[1]
        return done()
    if bw > 0:   # phase 1 (§7.3): swaps hidden under computation, longest FreeTime first
        used = 0.0
        for j in sorted(cand, key=st.tfree, reverse=True):
            if st.tfree(j) <= 0:
                break
            if used + st.tb[j] > bw * (st.TF + st.TB) or not st.swappable[j]:
                continue                               # over the link budget (§7.4)
            plan[j] = SWAP
            used += st.tb[j]
            if st.mem(plan) <= cap:
                return done()

    def moves(p):
        out = [p[:j] + [SWAP] + p[j + 1:] for j in cand if p[j] != SWAP and bw > 0]
        if prefix_only:    # extend the recomputed prefix to unit u
            out += [st.prefix_plan(p, u) for u in range(len(st.rerun(p)), len(st.u))]
        else:              # one tensor, or every candidate a unit produces
            out += [p[:j] + [RECOMPUTE] + p[j + 1:] for j in cand if p[j] != RECOMPUTE]
            out += [[RECOMPUTE if j in cand and st.prod[j] == u else c for j, c in enumerate(p)]
                    for u in sorted({st.prod[j] for j in cand if st.prod[j] is not None})]
        return [q for q in out if legal(q)]

    while st.mem(plan) > cap:   # phase 2 (§7.3): least extra time per saved byte
        cur, ext = st.mem(plan), st.extra(plan)
        best = None
        single = moves(plan)
        # a move may save nothing alone (its bytes come back as transient): then pairs
        for trials in (single, [q for m in single for q in moves(m)]):
            for trial in trials:
                saved = cur - st.mem(trial)
                if saved <= 0:
                    continue
                # swap_cost / saved vs RT / saved = 1 / MSPS; ties: swap first (§7.1)
                key = ((st.extra(trial) - ext) / saved, trial.count(RECOMPUTE))
                if best is None or key < best[0]:
                    best = (key, trial)
            if best is not None:
                break
        if best is None:
            return done(False, [f"cannot reach {cap:.0f} B: best is {cur:.0f} B"])
        plan[:] = best[1]
    if prefix_only:   # [decision] the per-byte greedy may overshoot the prefix: shortest fit
        kp = len(st.rerun(plan))
        rest = [KEEP if w < kp else c for c, w in zip(plan, st.unit)]
        plan[:] = next(t for t in (st.prefix_plan(rest, u) for u in range(-1, kp))
                       if st.mem(t) <= cap and st.extra(t) <= st.extra(plan))
    # [decision] undo choices the later ones made unnecessary, dearest first; a hidden swap
    # (cost 0) is undone too when the cap allows: it would only load the link and host memory
    for j in sorted(range(n), key=lambda j: -st.extra(plan) + st.extra(
            plan[:j] + [KEEP] + plan[j + 1:])):
        for c in (KEEP, SWAP) if plan[j] == RECOMPUTE and bw > 0 else (KEEP,):
            if plan[j] == c:
                break
            trial = plan[:j] + [c] + plan[j + 1:]
            if legal(trial) and st.mem(trial) <= cap and st.extra(trial) <= st.extra(plan):
                plan[:] = trial
                break
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


def stage_memory_options(policies: list[StagePolicy]) -> dict:
    """What the planner and the runtimes take from a per-stage policy (JSON-ready):
    ``recompute_per_stage`` (share of each stage's units whose forward re-runs: the Plan's
    ``recompute_per_stage``), ``swap_bytes_per_stage`` (bytes offloaded per micro-batch),
    ``swap`` (per stage: unit -> sorted tensor indices to offload, or None for the whole unit;
    :meth:`ds_autoplan.runtime.swap.SwapPolicy.from_dict` rebuilds the runtime policy),
    ``extra_s_per_stage`` (T^moo) and ``peak_bytes_per_stage`` (mem_x)."""
    return {"recompute_per_stage": [p.recompute_fraction for p in policies],
            "swap_bytes_per_stage": [float(p.swap_bytes) for p in policies],
            "swap": [p.swap_units for p in policies],
            "extra_s_per_stage": [p.extra_s for p in policies],
            "peak_bytes_per_stage": [p.peak_bytes for p in policies]}
