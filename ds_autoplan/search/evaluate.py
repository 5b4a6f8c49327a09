"""The evaluation of one executable configuration: its stage DP contexts, the partitioner's
split and recompute, the schedules simulated (docs/planner.md §3-4), the cheap Eq. 9 ranking
key and the time and memory floors the branch and bound prunes with (§2.8).  A result is a
:class:`Candidate`."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..cost import offload as ofl
from ..cost.model import Strategy
from ..plan import Plan
from ..spec.cluster import GB
from ..spec.parallel import Parallel
from . import partition as part
from .dp import INF, Context
from .pipeline import Eval, choose_schedule, chunks_per_rank, full_recompute_evals, sim_sizes
from .space import Space


@dataclass
class Candidate:
    """An executable configuration (``par``: its degrees and batch split) and its cost."""
    name: str
    par: Parallel
    time: float
    schedule: str = "1f1b"
    parts: tuple = ()
    recompute: list = field(default_factory=list)
    peak: list = field(default_factory=list)
    partitioner: str = "bmw"
    ctx: Context | None = field(default=None, repr=False)
    plan: list | None = field(default=None, repr=False)
    sim: object = field(default=None, repr=False)
    note: str = ""
    bubble: float = 0.0
    alts: list = field(default_factory=list, repr=False)   # schedules costed (Eval), best first
    estimate: float = INF                                  # Eq. 9 ranking key
    host: float = 0.0                                      # host bytes of the busiest node (offload)

    @property
    def ok(self) -> bool:
        """True when the candidate was costed to a finite time."""
        return math.isfinite(self.time)

    def __getattr__(self, name: str):
        """The configuration's degrees and batch split read as the candidate's own
        (``c.tp``, ``c.num_microbatches``: its :class:`Parallel`'s fields and properties)."""
        par = self.__dict__.get("par")
        if par is None or name.startswith("_"):
            raise AttributeError(name)
        return getattr(par, name)

    def columns(self) -> np.ndarray:
        """Each unit's (in ``ctx.seq`` order) strategy column of ``ctx``'s tables: the stage
        DP's choice where it made one, else the first strategy (recompute and activation
        offload differ per column; the offloaded states do not)."""
        n = len(self.ctx.seq)
        return np.asarray(self.plan if self.plan is not None and len(self.plan) == n else [0] * n)

    @property
    def selective(self) -> bool:
        """Selective recompute of the attention core on every layer."""
        return bool(self.ctx is not None and self.ctx.strategies[0].sel)

    def summary(self, B: int, seq: int) -> dict:
        """The candidate as a JSON-able row of the report: its degrees and batch split as
        plan.json names them, schedule, time and memory."""
        return {"name": self.name, **Plan.parallel_fields(self.par),
                "selective_recompute": self.selective,
                "schedule": self.schedule, "partitioner": self.partitioner,
                "chunks": chunks_per_rank(self.schedule, self.parts, self.pp) or 1,
                "bubble": self.bubble,
                "iteration_time_s": self.time if self.ok else None,
                "throughput_tokens_per_s": B * seq / self.time if self.ok else 0.0,
                "layers_per_stage": list(self.parts), "recompute_layers": list(self.recompute),
                "peak_memory_gb": [round(x / GB, 3) for x in self.peak], "note": self.note,
                "host_memory_gb_per_node": round(self.host / GB, 3)}


class Evaluator(Space):
    """Costs the configurations of its :class:`Space`: contexts memoised per (pp,
    micro-batches, micro-batch, strategies), floors per configuration; ``evaluated`` counts
    the configurations costed in full."""
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._ctx: dict = {}
        self._floors: dict = {}
        self.evaluated = 0

    def ctx(self, P, m, B_m, strats) -> Context:
        """The DP :class:`Context` of one (pp, m, B_m, strategies), memoised."""
        key = (P, m, B_m, tuple(strats))
        if key not in self._ctx:
            self._ctx[key] = Context(self.cm, list(strats), P, m, B_m, self.E, self.options.units)
        return self._ctx[key]

    def ctx_of(self, c: Parallel, strats) -> Context:
        """The search context of configuration ``c`` over the strategies ``strats``."""
        return self.ctx(c.pp, c.num_microbatches, c.batch_per_microbatch, strats)

    def _units(self, c: Parallel, what: str) -> np.ndarray:
        """Per-unit figure (pre, blocks, post) of the config without CKPT: one strategy's
        table, so ranking the whole space costs no Context and no CKPT column."""
        tab = self.cm.tables(self.exec_strats(c)[:1], c.batch_per_microbatch)
        return getattr(tab, what)[self._seq, 0]

    def floors(self, c: Parallel) -> tuple[float, float]:
        """(time, memory) that no costed plan of ``c`` goes below, whatever its schedule, split,
        chunks and recompute (docs/planner.md §2.8): the time floor and the model states of the
        busiest rank's least share (or of the embedding's or the head's rank with a block)."""
        f = self._time_terms(c)
        return f["time"], f["states"]

    def could_beat(self, c: Parallel, T: float) -> bool:
        """Whether some plan of ``c`` might fit and run faster than ``T`` (docs/planner.md
        §2.8).  Its makespan is then below ``T' = T - sync`` (the mean synchronisation), and a
        micro-batch's activations of a layer live from its forward to its backward, at least
        the trip ``R`` from that layer through the last and back (F, then B without W): by
        Little's law a rank keeps on average ``rate R`` of them (``rate``: micro-batches per
        second of the run whose peak is reported).  Summed over the ranks, model states and
        these stashes must fit ``P`` budgets; what does not is saved by recomputation at its
        least time per byte (a fractional knapsack over the layers and their recompute
        variants), which the ranks' mean work must absorb.  The embedding's rank alone keeps
        ``rate R_0`` micro-batches of the embedding's output and of a block."""
        t = self._time_terms(c)
        if t["time"] >= T:
            return False
        f = self._mem_terms(c)
        Tm, P, m = T - t["sync"], c.pp, c.num_microbatches
        # the peak is that of a run of n micro-batches (pipeline.simulate_plan extrapolates
        # longer ones: each further micro-batch adds at least the busiest rank's work w1)
        n = m if P == 1 else min(m, sim_sizes(P)[1])
        Ms = Tm - t["w1"] * (m - n)
        if Ms <= 0:
            return False
        rate = n / Ms
        if f["mem"](max(1, math.ceil(rate * f["trip"][0] - 1e-9))) > self.E:
            return False
        need = f["states"] + rate * float(f["stash"] @ f["trip"]) - P * self.E
        # each (layer, recompute variant) an item, both variants allowed (a relaxation)
        save, cost = (rate * f["save"] * f["trip"][:, None]).ravel(), m * f["extra"].ravel()
        neg = cost < 0                      # faster and leaner: every such item is taken
        need, extra = need - float(save[neg].sum()), float(cost[neg].sum())
        for i in np.argsort(cost / np.maximum(save, 1e-300)):
            if need <= 0:
                break
            if neg[i] or save[i] <= 0:
                continue
            x = min(1.0, need / save[i])
            need -= x * save[i]
            extra += x * cost[i]
        return need <= 0 and t["mean"] + extra / P < Tm

    def _time_terms(self, c: Parallel) -> dict:
        """The time floor of ``c`` and its parts, from its table without recompute (the
        cheapest variant of every layer): the simulated iteration is the makespan plus the
        busiest rank's gradient synchronisation, the makespan at least each rank's work
        m (F + B + W), so at least m times the busiest rank's least share (:func:`_busiest`,
        ``w1``) plus the mean synchronisation; ``mean``: the mean rank's work."""
        key = ("time", c)
        if key not in self._floors:
            tab = self.cm.tables(self.exec_strats(c)[:1], c.batch_per_microbatch)
            seq, P, q, m = self._seq, c.pp, -(-self.L // c.pp), c.num_microbatches
            cns, ms = tab.c_ns[seq, 0], tab.ms[seq, 0]
            w1, blk = _busiest(cns, P, q), float(ms[1:-1].min())
            sync = float((tab.bwd - tab.bwd_ns)[seq, 0].sum()) / P
            self._floors[key] = dict(time=m * w1 + sync, w1=w1, sync=sync, mean=m * float(cns.sum()) / P,
                                     states=max(_busiest(ms, P, q), max(ms[0], ms[-1]) + blk))
        return self._floors[key]

    def _mem_terms(self, c: Parallel) -> dict:
        """Memory terms of :meth:`could_beat`, each layer at its leanest variant (no recompute,
        full or selective recompute): every rank keeps the model states of its share and at
        least one micro-batch of a block's activations (or its input, plus one block's
        recomputed activations); the embedding's and the head's ranks also theirs and their
        outputs; per layer the trip, stash, and what each recompute variant saves and costs."""
        key = ("mem", c)
        if key in self._floors:
            return self._floors[key]
        strats = [*self.exec_strats(c), Strategy.of(c, sel=True)]
        tab = self.cm.tables(strats, c.batch_per_microbatch)
        seq, P, q = self._seq, c.pp, -(-self.L // c.pp)
        cns = tab.c_ns[seq]
        ms, f1 = tab.ms[seq].min(axis=1), tab.f1[seq]
        blk = f1[1:-1]
        keep, keep_ck = float(min(blk[:, 0].min(), blk[:, 2].min())), float(blk[:, 1].min())
        ob = float(tab.ob[seq[1:-1], 1].min())
        ms_blk = float(ms[1:-1].min())
        share = _busiest(ms, P, q) + min(keep, keep_ck + ob)
        head = ms[-1] + ms_blk + f1[-1].min() + min(keep, keep_ck + ob)
        emb, f1_emb = ms[0] + ms_blk, f1[0].min()

        def mem(k: int) -> float:
            return float(max(share, head, emb + min(k * (f1_emb + keep), k * (f1_emb + keep_ck) + ob)))
        # trip from each unit: its forward to the end and the backward (without W) back to it
        fb = (tab.fwd + tab.bwd_ns - tab.wgrad)[seq].min(axis=1)
        f = self._floors[key] = dict(
            mem=mem, trip=np.cumsum(fb[::-1])[::-1], states=float(ms.sum()), stash=f1[:, 0],
            save=np.maximum(f1[:, 0:1] - f1[:, 1:], 0.0), extra=cns[:, 1:] - cns[:, :1])
        return f

    def host_need(self, cand: Candidate) -> tuple[float, float]:
        """(host, NVMe) bytes of the busiest node of ``cand`` (schedule stages on rank
        ``stage % pp``; 0 without offload, NVMe 0 unless offloaded there)."""
        c, ctx, parts = cand.par, cand.ctx, cand.parts
        if not c.offload.any or not parts:
            return 0.0, 0.0
        cols = cand.columns()
        host, act = ctx.tab.host[ctx.seq, cols], ctx.tab.host_act[ctx.seq, cols]
        per_rank, act_rank = np.zeros(c.pp), np.zeros(c.pp)
        for i, (lo, hi) in enumerate(ctx.bounds(tuple(parts))):
            per_rank[i % c.pp] += host[lo:hi].sum()
            act_rank[i % c.pp] += act[lo:hi].sum()      # one micro-batch in flight (pp = 1)
        cap = ofl.host_cap(c.offload, 4.0 if self.options.precision == "fp32" else 2.0)
        nvme = ofl.node_host_bytes(per_rank, c.stage_ranks, self.cluster) if c.offload.device == "nvme" else 0.0
        return ofl.node_host_bytes(np.minimum(per_rank, cap) + act_rank, c.stage_ranks, self.cluster), nvme

    def _host_floor(self, c: Parallel) -> float:
        """Host bytes a node needs at least: its ranks' even share of the offloaded states."""
        if not c.offload.any:
            return 0.0
        tot = float(self._units(c, "host").sum())
        cap = ofl.host_cap(c.offload, 4.0 if self.options.precision == "fp32" else 2.0)
        return min(tot / c.pp, cap) * min(self.cluster.gpus_per_node, c.world_size)

    def _check_host(self, cand: Candidate) -> None:
        """Set the candidate's node host bytes; one beyond the host budget (or, offloading to
        NVMe, beyond the node's NVMe) does not fit."""
        if cand.ctx is None or not cand.par.offload.any:
            return
        cand.host, nvme = self.host_need(cand)
        if cand.host > self.host_E:
            cand.time = INF
            cand.note = (f"host memory: {cand.host / GB:.0f} GB per node needed, "
                         f"{self.host_E / GB:.0f} GB usable")
        elif nvme > (self.cluster.nvme_gb or 0.0) * GB:
            cand.time = INF
            cand.note = f"NVMe: {nvme / GB:.0f} GB per node needed, {self.cluster.nvme_gb or 0:.0f} GB"

    def lower_bound(self, c: Parallel) -> float:
        """No bubble, perfect balance, no recompute: m * sum_l c_ns / P (for B&B ordering)."""
        return c.num_microbatches * float(self._units(c, "c_ns").sum()) / c.pp

    def evaluate(self, c: Parallel, *, partitioner=None, schedules=None, ckpt=None,
                 name="plan", keep_sim=False, bound: float = INF) -> Candidate:
        """ckpt: 'dp' (per-layer choice + stage-aware), 'none', 'full' (uniform, Megatron);
        default: the --fix recompute ('dp' unless fixed)."""
        self.evaluated += 1
        ckpt = ckpt or self.ckpt
        ctx = self.ctx_of(c, self.mode_strats(c, ckpt))
        pname = partitioner or self.partitioner
        L, P = self.L, c.pp

        def cand(time, schedule, parts, recompute, peak, partitioner, cx, plan=None, sim=None,
                 bubble=0.0, note=""):
            return Candidate(name, par=c.with_(chunks=max(1, len(parts or ()) // P)), time=time,
                             schedule=schedule, parts=parts, recompute=recompute, peak=peak,
                             partitioner=partitioner, ctx=cx, plan=plan, sim=sim, bubble=bubble,
                             note=note)
        if ckpt == "full":
            parts = part.even_partition(L, P)
            plan = [1 if self.cm.units[u].checkpointable else 0 for u in ctx.seq]
            full = self.ctx_of(c, self.exec_strats(c))
            if P == 1:
                C, Cns, Mem = full.stage_costs(parts, plan)
                if Mem.max() > self.E:
                    return cand(INF, "1f1b", parts, [L], list(Mem), "even", full, plan,
                                note=over_budget(float(Mem.max()), self.E))
                return cand(full.pipeline_time(parts, plan), "1f1b", parts, [L], list(Mem), "even",
                            full, plan)
            # every schedule with every block recomputed (Megatron runs full recompute with its
            # interleaving too), blocks split evenly into the schedule's stages
            evs = full_recompute_evals(full, schedules or self.schedules, keep_sim, self.chunks)
            if not evs or not evs[0].ok:
                e = evs[0] if evs else None
                return cand(INF, "1f1b", parts, e.recompute if e else [], e.peak if e else [], "even",
                            full, plan, note=why_out(evs, self.E))
            e = evs[0]
            out = cand(e.time, e.schedule, e.parts, e.recompute, e.peak, "even", full, plan, e.sim,
                       bubble=e.bubble)
            out.alts = evs
            return out
        if pname == "bmw":
            T, parts, plan, base = part.bmw(ctx)
        elif pname == "even":
            parts = part.even_partition(L, P)
            T, plan = ctx.search(parts)
        elif pname == "dawnpiper":
            T, parts, plan = part.dawnpiper(ctx)
        else:
            T, parts, plan = part.merak(ctx)
        if P == 1 or not schedules and schedules is not None:
            if plan is None:           # the leanest strategies of its split do not fit
                parts = parts or part.even_partition(L, P)
                _, _, Mem = ctx.stage_costs(parts, part.frugal_plan(ctx))
                return cand(INF, "1f1b", parts, [], [], pname, ctx,
                            note=over_budget(float(Mem.max()), self.E))
            _, _, Mem = ctx.stage_costs(parts, plan)
            rec = [sum(1 for u in range(lo, hi) if plan[u] == 1) for lo, hi in ctx.bounds(parts)]
            return cand(T, "1f1b", parts, rec, list(Mem), pname, ctx, plan)
        if plan is None:       # the 1F1B DP found nothing: schedules with less memory may fit
            parts = part.even_partition(L, P)
            plan = [0] * len(ctx.seq)
        lean = ckpt in ("none", "selective")         # no full-layer recompute
        full = self.ctx_of(c, self.exec_strats(c, ckpt == "selective")) if lean else ctx
        scheds = schedules or self.schedules
        evs = choose_schedule(full, parts, plan, scheds, keep_sim, bound, chunks=self.chunks)
        if lean:
            evs = [e for e in evs if not any(e.recompute)]
        if not evs or not evs[0].ok:
            return cand(INF, "1f1b", parts, [], [], pname, ctx, plan, note=why_out(evs, self.E))
        e: Eval = evs[0]
        out = cand(e.time, e.schedule, e.parts, e.recompute, e.peak,
                   pname if e.schedule == "1f1b" else e.partitioner, full, plan, e.sim, bubble=e.bubble)
        out.alts = evs
        return out

    def estimate(self, c: Parallel, partitioner=None, ckpt=None):
        """Eq. 9 time (1F1B, no simulation) of the partitioner's plan: the cheap ranking key."""
        ckpt = ckpt or self.ckpt
        ctx = self.ctx_of(c, self.mode_strats(c, ckpt))
        pname = partitioner or self.partitioner
        P = c.pp
        if ckpt == "full":
            parts = part.even_partition(self.L, P)
            plan = [1 if self.cm.units[u].checkpointable else 0 for u in ctx.seq]
            _, _, Mem = ctx.stage_costs(parts, plan)
            return ctx.pipeline_time(parts, plan) if Mem.max() <= self.E else INF
        if P == 1 or pname == "even":
            return ctx.search(part.even_partition(self.L, P))[0]
        if pname == "bmw":
            return part.bmw(ctx)[0]
        return (part.dawnpiper(ctx) if pname == "dawnpiper" else part.merak(ctx))[0]

    def min_memory(self) -> float:
        """Least per-device memory of any configuration of the (restricted) space, for the
        'cannot fit' message: its smallest micro-batch, a memory-balanced split, every block
        recomputed unless the recompute mode rules that out (max pipeline stage); offloads
        whose states the node's host memory cannot hold left out.  Where a floor of every
        configuration is already over the budget, the least floor (the message says "at
        least")."""
        combos = list(self.combos())
        mb = min((c.micro_batch for c in combos), default=None)
        cands = []
        for c in combos:
            if c.micro_batch != mb or self._host_floor(c) > self.host_E:   # host memory too small
                continue
            strats = self.mode_strats(c, self.ckpt)
            ctx = self.ctx_of(c, strats)
            plan = [1 if len(strats) > 1 and self.cm.units[u].checkpointable else 0 for u in ctx.seq]
            # a floor of the busiest stage without splitting (each stage's memory, dp.Context.
            # stage_costs, has no negative term): the mean of the model states, and each unit's
            # states, kept activation and output together
            A = ctx.layer_arrays(plan)
            cands.append((max(float(A["ms"].sum()) / c.pp, float((A["ms"] + A["f1"] + A["ob"]).max())),
                          c, ctx, plan))
        if cands and min(x[0] for x in cands) > self.E:      # settled without the L^2 split
            return min(x[0] for x in cands)
        best = INF
        for _, c, ctx, plan in cands:
            parts = part.minmax_partition(part.stage_matrices(ctx, plan, "mem")) if c.pp > 1 else (self.L,)
            if parts is None:
                continue
            _, _, Mem = ctx.stage_costs(parts, plan)
            best = min(best, float(Mem.max()))
        return best


def why_out(evals: list[Eval], budget: float) -> str:
    """Why no schedule of a configuration is kept, for the report: the least peak memory one
    of them needs over the per-device ``budget`` (bytes), or that costing stopped where its
    least possible time could not beat the best plan found."""
    if any(e.cut for e in evals):
        return "slower: even its least possible time exceeds the best plan's (not costed further)"
    over = [max(e.peak) for e in evals if e.peak]
    return over_budget(min(over), budget) if over else "no schedule of it fits its layers"


def over_budget(need: float, budget: float) -> str:
    return (f"does not fit: needs {need / GB:.1f} GB per device, budget {budget / GB:.1f} GB "
            f"(short by {(need - budget) / GB:.1f} GB)")


def _busiest(x: np.ndarray, P: int, q: int) -> float:
    """Least load of the busiest of ``P`` ranks holding the units ``x`` (embedding, blocks,
    head), each rank at least one block: the mean, the embedding or the head with a block,
    or the ``q`` = ceil(blocks / P) lightest blocks (some rank holds that many)."""
    blk = np.sort(x[1:-1])
    return float(max(x.sum() / P, max(x[0], x[-1]) + blk[0], blk[:q].sum()))
