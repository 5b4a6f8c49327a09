"""The planner: executable-space search (one TP size and ZeRO stage, per-layer CKPT, BMW
partition, schedule chosen by simulation), baselines on the same cost model, and the wide
Galvatron-BMW mode (per-layer TP/DP/SDP mixtures) reported separately."""
from __future__ import annotations

import contextlib
import gc
import math
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from ..cost.engines import error_band
from ..cost.memory import usable_budget
from ..cost.model import MOE_IMBALANCE, CostModel, Strategy
from ..plan import Plan
from ..spec import SpecError
from ..spec.cluster import GB, ClusterSpec, load_cluster
from ..spec.model import ModelSpec, load_model
from ..spec.parallel import NO_OFFLOAD, Offload, Parallel
from ..cost import offload as ofl
from . import partition as part
from .dp import INF, Context
from .pipeline import DEFAULT_SCHEDULES, Eval, available, choose_schedule, sim_sizes, \
    chunks_per_rank, full_recompute_evals, schedule_options, simulate_layers, stage_figures
from .fix import RECOMPUTE, fix_text, parse_fix
from .space import divisors, strategies as wide_strategies


SP_MODES = ("auto", "on", "off")
# context parallelism is searched where every CP rank still keeps at least this many tokens:
# NVIDIA's NeMo 24.09 recipes train Llama 3.1 8B/70B/405B at CP 2 on 8192-token sequences,
# 4096 tokens per rank (dgxc-benchmarking llama3.1 READMEs; bench/data/published_runs.yaml
# llama31_dgxc2024, costed within the published-runs bounds), and the cost model puts such a
# configuration ahead of every CP 1 plan for the 405B proxy on 32 H100 [below 4K tokens per
# rank the ring's steps are left out: no published run; 128K tokens: cp up to 32]
CP_MIN_TOKENS = 4096
# offloads the search weighs where the cluster has host figures and the engines run them
# (cost/offload.py check): the whole optimizer, Twin-Flow / Megatron fractions in quarters,
# ZeRO-Infinity (parameters too), and NVMe where the cluster has it [decision: quarters]
OFFLOAD_SPACE = tuple(Offload.parse(t) for t in (
    "opt", "opt:0.25", "opt:0.5", "opt:0.75", "opt+param", "nvme:opt", "nvme:opt+param"))


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

    @property
    def pp(self) -> int:
        """Pipeline degree (of the candidate's :class:`Parallel`)."""
        return self.par.pp

    @property
    def tp(self) -> int:
        """Tensor-parallel degree."""
        return self.par.tp

    @property
    def dp(self) -> int:
        """Data-parallel degree."""
        return self.par.dp

    @property
    def zero(self) -> int:
        """ZeRO stage over the data-parallel group."""
        return self.par.zero

    @property
    def m(self) -> int:
        """Micro-batches per iteration."""
        return self.par.num_microbatches

    @property
    def B_m(self) -> int:
        """Samples of one micro-batch over the data-parallel group."""
        return self.par.batch_per_microbatch

    @property
    def sp(self) -> bool:
        """Sequence parallelism, as the config's strategies were costed."""
        return bool(self.ctx is not None and self.ctx.strategies[0].sp)

    @property
    def selective(self) -> bool:
        """Selective recompute of the attention core on every layer."""
        return bool(self.ctx is not None and self.ctx.strategies[0].sel)

    def summary(self, B: int, seq: int) -> dict:
        """The candidate as a JSON-able row of the report (degrees, batch split, schedule, time)."""
        return {"name": self.name, "pp": self.pp, "tp": self.tp, "dp": self.dp, "zero_stage": self.zero,
                "micro_batch_size": self.B_m // self.dp if self.dp else 0, "num_microbatches": self.m,
                "ep": self.par.ep, "etp": self.par.etp, "cp": self.par.cp, "cp_comm": self.par.cp_comm,
                "sequence_parallel": self.sp, "selective_recompute": self.selective,
                "schedule": self.schedule, "partitioner": self.partitioner,
                "chunks": chunks_per_rank(self.schedule, self.parts, self.pp) or 1,
                "bubble": self.bubble,
                "iteration_time_s": self.time if self.ok else None,
                "throughput_tokens_per_s": B * seq / self.time if self.ok else 0.0,
                "layers_per_stage": list(self.parts), "recompute_layers": list(self.recompute),
                "peak_memory_gb": [round(x / GB, 3) for x in self.peak], "note": self.note,
                "offload": self.par.offload.text(), "host_memory_gb_per_node": round(self.host / GB, 3)}


@dataclass
class SearchResult:
    """What :func:`search` returns: the plan, the best candidate, the baselines, the wide
    mode's result, the alternatives and partitioners tried."""
    plan: Plan
    best: Candidate
    baselines: dict
    wide: dict
    alternatives: list
    partitioners: dict
    model: ModelSpec
    cluster: ClusterSpec
    search_time_s: float
    evaluated: int


class Planner:
    """The planner of one (model, cluster, global batch): the executable space, the stage DPs,
    partitioners and schedule choice by simulation (docs/planner.md §3-4), and the baselines;
    options restrict the space (``fix``, ``pp``, ``tp``, ``runtime``, ...)."""
    def __init__(self, model: ModelSpec, cluster: ClusterSpec, global_batch: int, *,
                 precision: str = "bf16", budget_gb: float | None = None, units: int = 512,
                 schedules=None, partitioner: str = "bmw", max_tp: int | None = None,
                 allow_zero: tuple = (0, 1, 2, 3), progress: bool = False,
                 pp: int | None = None, tp: int | None = None, sequence_parallel: str = "auto",
                 fix: dict | str | None = None, runtime: str = "any", headroom_gb: float | None = None,
                 execution=None, moe_imbalance: float = MOE_IMBALANCE):
        self.fix = fx = parse_fix(fix)
        pp, tp = _merge_fix(fx, "pp", pp), _merge_fix(fx, "tp", tp)
        sequence_parallel = fx.get("sp", sequence_parallel)
        if "zero" in fx:
            allow_zero = (fx["zero"],)
        if "schedule" in fx:
            if not available([fx["schedule"]]):
                from ..schedule import names
                raise SpecError(f"schedule={fx['schedule']}: unknown schedule; choose from {', '.join(names())}")
            schedules = [fx["schedule"]]
        self.ckpt = RECOMPUTE[fx.get("recompute", "auto")]
        self.offload_fix = Offload.parse(fx["offload"]) if "offload" in fx else None
        self.cp_comm = fx.get("cp_comm", "a2a" if runtime == "deepspeed" else "p2p")
        self.chunks = fx.get("v")
        self.model, self.cluster, self.B = model, cluster, int(global_batch)
        self.E, self.headroom_gb = usable_budget(cluster, budget_gb, headroom_gb)
        self.cm = CostModel(model, cluster, precision, runtime, execution=execution,
                            moe_imbalance=moe_imbalance)
        self.precision, self.units = precision, units
        # the user's names must all exist (one line naming the builders); the default list
        # keeps the registered ones
        from ..schedule.builders import check_names
        self.schedules = check_names(list(schedules)) if schedules else available(DEFAULT_SCHEDULES)
        if partitioner not in part.PARTITIONERS:
            raise SpecError(f"unknown partitioner {partitioner!r}; choose from {', '.join(part.PARTITIONERS)}")
        self.partitioner = partitioner
        self.N = cluster.world_size
        self.L = model.num_layers
        kv = int(model.config.get("kv_heads", model.heads))
        G = cluster.gpus_per_node
        self.tps = [t for t in divisors(G) if t <= (max_tp or G) and model.heads % t == 0 and kv % t == 0]
        self.allow_zero = allow_zero
        self.progress = progress
        self.pps = None
        if pp is not None:
            if pp < 1 or self.N % pp or pp > self.L:
                raise SpecError(f"pp={pp} must divide the {self.N} devices and be at most the "
                                f"{self.L} layers; choose from {self.pp_degrees()}")
            self.pps = [pp]
        if tp is not None:
            if tp not in self.tps:
                raise SpecError(f"tp={tp} is not possible here: {self._tp_limit(tp, max_tp)}; "
                                f"choose from {self.tps}")
            self.tps = [tp]
        if sequence_parallel not in SP_MODES:
            raise SpecError(f"sequence_parallel must be one of {', '.join(SP_MODES)}, got {sequence_parallel!r}")
        self.sp = sequence_parallel
        if sequence_parallel == "on":      # SP is a TP feature: 'on' searches TP > 1 only
            self.tps = [t for t in self.tps if t > 1]
            if not self.tps:
                raise SpecError(f"sequence parallelism 'on' needs tensor parallelism (tp > 1), but "
                                f"tp={tp or 1} is the only degree possible here; use 'auto' or 'off'")
        self.eps, self.cps = self._expert_degrees(), self._context_degrees()
        self.host_E = ofl.host_budget_bytes(cluster)
        if self.offload_fix is not None and self.offload_fix.any:
            missing = cluster.offload_missing(nvme=self.offload_fix.device == "nvme")
            if missing:
                raise SpecError(f"offload={self.offload_fix.text()}: cluster {cluster.name!r} has no "
                                f"host figures to offload with (missing {', '.join(missing)}; "
                                "`ds-autoplan profile --hardware` measures them)")
        self._ctx: dict = {}
        self._floors: dict = {}
        self._seq = np.concatenate([[0], self.cm.block_types, [1]])
        self.max_mbs = self.micro_batch_bound()
        self.evaluated = 0

    def _tp_limit(self, t: int, max_tp: int | None) -> str:
        """Why tensor degree ``t`` is not searched: what it fails to divide (tensor parallelism
        splits the attention heads and the key/value heads, within one node), in the model
        file's own field names."""
        from ..spec.presets import field_name
        G, cfg = self.cluster.gpus_per_node, self.model.config
        heads, kv = self.model.heads, int(cfg.get("kv_heads", self.model.heads))
        why = [f"it does not divide the {G} devices of a node" if G % t else
               f"it is more than {max_tp}, the widest allowed" if max_tp and t > max_tp else ""]
        why += [f"it does not divide the {n} {what} ({field_name(cfg, k)}={n})" for k, n, what in
                (("heads", heads, "attention heads"), ("kv_heads", kv, "key/value heads"))
                if n % t and (k == "heads" or kv != heads)]
        return "; ".join(w for w in why if w) or "it is outside the space searched"

    def micro_batch_bound(self) -> int:
        """The largest micro-batch per device any plan could hold: even its leanest layout
        (the widest TP with sequence parallelism, every layer recomputed: a layer keeps only
        its input) spread over the deepest pipeline and the widest context split keeps
        ``total / (P cp)`` bytes per sample on some device.  Micro-batches are enumerated up
        to it, so the search's work does not grow with the global batch."""
        lean = Strategy(max(self.tps), 1, ckpt=True, sp=max(self.tps) > 1)
        per_sample = float(self.cm.tables([lean], 1).f1[self._seq, 0].sum()) / \
            (max(self.pp_degrees()) * max(self.cps))
        if per_sample <= 0:
            return self.B
        return max(1, min(self.B, int(self.E // per_sample)))

    def _expert_degrees(self) -> list[int]:
        """Expert-parallel degrees: divisors of the routed experts (1 for a dense model)."""
        E = self.cm.num_experts
        eps = divisors(E) if E > 1 else [1]
        if "ep" in self.fix and self.fix["ep"] not in eps:
            raise SpecError(f"ep={self.fix['ep']}: expert parallelism must divide the model's "
                            f"{E} routed experts; choose from {eps}" if E > 1 else
                            f"ep={self.fix['ep']}: {self.model.label} has no experts (ep=1)")
        return [self.fix["ep"]] if "ep" in self.fix else eps

    def _context_degrees(self) -> list[int]:
        """Context-parallel degrees searched: 1, and for decoder-only models the degrees that
        keep :data:`CP_MIN_TOKENS` tokens per rank with the sequence a multiple of 2 cp."""
        m, s = self.model, self.model.seq_len
        ok = [c for c in divisors(self.N) if c == 1 or (
            m.arch in ("gpt", "llama") and s % (2 * c) == 0 and s // c >= CP_MIN_TOKENS)]
        if "cp" not in self.fix:
            return ok
        c = self.fix["cp"]
        if c > 1 and (m.arch not in ("gpt", "llama") or s % (2 * c) or self.N % c):
            raise SpecError(f"cp={c}: context parallelism needs a decoder-only model whose "
                            f"sequence ({s}) is a multiple of 2 cp and cp dividing the {self.N} devices")
        return [c]

    def _expert_layouts(self, t: int, n: int, eps=None):
        """(ep, etp) pairs for TP ``t`` on a stage of ``n`` ranks: expert TP 1 or t (Megatron's
        default), ep x etp dividing the stage."""
        etps = [self.fix["etp"]] if "etp" in self.fix else list(dict.fromkeys((t, 1)))
        if len(self.eps) == 1 and self.eps[0] == 1 and "etp" not in self.fix:
            etps = [t]                  # dense: no expert layers
        for ep in eps or self.eps:
            for et in etps:
                if n % (ep * et) == 0:
                    yield ep, et

    def pp_degrees(self) -> list[int]:
        """Pipeline degrees: divisors of the world size, at most one block per stage (uneven
        block counts per stage are fine: BMW splits them)."""
        return [P for P in divisors(self.N) if P <= self.L]

    # -- contexts ---------------------------------------------------------------------
    def ctx(self, P, m, B_m, strats) -> Context:
        """The DP :class:`Context` of one (pp, m, B_m, strategies), memoised."""
        key = (P, m, B_m, tuple(strats))
        if key not in self._ctx:
            self._ctx[key] = Context(self.cm, list(strats), P, m, B_m, self.E, self.units)
        return self._ctx[key]

    def combos(self, pps=None, tps=None, zeros=None, eps=None, cps=None, offloads=None):
        """The executable space as :class:`Parallel` configurations (chunks decided later by
        the schedule): DeepSpeed's pipeline engine takes ZeRO 0/1 only with pp > 1
        (docs/planner.md); any micro-batch per GPU dividing the batch share of a data-parallel
        rank.  Sequence parallelism is one flag per plan (Megatron-core has one for the model);
        'auto' sets it whenever tp > 1: on the cost model it never adds time (same TP volume, a
        smaller p2p tensor) and always saves memory (Korthikanti et al. 2022 §4.2.2)."""
        for P in pps or self.pps or self.pp_degrees():
            n = self.N // P
            for t in tps or self.tps:
                for cp in cps or self.cps:
                    if n % (t * cp):
                        continue
                    d = n // (t * cp)
                    if self.B % d or self.fix.get("dp", d) != d:
                        continue
                    for ep, etp in self._expert_layouts(t, n, eps):
                        yield from self._batch_splits(P, t, d, cp, ep, etp, zeros, offloads)

    def _batch_splits(self, P, t, d, cp, ep, etp, zeros, offloads=None):
        """Configurations of one layout over ZeRO stages and micro-batches.  Engines: ring
        attention is Megatron's, whose distributed optimizer is ZeRO-1 (so cp > 1 over p2p
        takes ZeRO <= 1; DeepSpeed-Ulysses takes any stage); DeepSpeed's MoE layers do not
        run under ZeRO-3 (ep > 1: ZeRO <= 2)."""
        for z in zeros or self.allow_zero:
            if P > 1 and z > 1:
                continue
            if (cp > 1 and self.cp_comm == "p2p" and z > 1) or (ep > 1 and z > 2):
                continue
            for off in self.offloads(z, P, d * cp, offloads):
                for b in divisors(self.B // d, upto=self.max_mbs):
                    if self.fix.get("mbs", b) != b:
                        continue
                    m = self.B // (b * d)
                    if P > 1 and m < P:
                        continue
                    yield self.config(tp=t, pp=P, dp=d, cp=cp, ep=ep, etp=etp, zero=z, micro_batch=b,
                                      num_microbatches=m, offload=off)

    def offloads(self, z: int, P: int, dd: int, only=None) -> list:
        """What a configuration at ZeRO stage ``z`` with ``P`` stages and ``dd`` data ranks may
        offload: nothing (ZeRO with one data rank only to offload), and where the cluster has host
        figures the :data:`OFFLOAD_SPACE` members its engines run (--fix offload=... : that one;
        ``only``: these, for the baselines)."""
        if only is not None:
            want = [o for o in only if self.offload_fix in (None, o)]
        elif self.offload_fix is not None:
            want = [self.offload_fix]
        else:
            want = [NO_OFFLOAD] + ([o for o in OFFLOAD_SPACE if self.cm.cluster.offload_missing(
                nvme=o.device == "nvme") == []] if self.cm._rates is not None else [])
        return [o for o in want if (o.any or dd > 1 or z == 0) and (z > 0 or not o.any)
                and self.cm.offload_refusal(Strategy(1, 1, z, offload=o), P) is None]

    def host_need(self, c: Parallel, ctx: Context, parts) -> tuple[float, float]:
        """(host, NVMe) bytes of the busiest node of ``c`` with stage sizes ``parts`` (schedule
        stages on rank ``stage % pp``; 0 without offload, NVMe 0 unless offloaded there)."""
        if not c.offload.any or not parts:
            return 0.0, 0.0
        host = ctx.tab.host[ctx.seq, 0]
        per_rank = np.zeros(c.pp)
        for i, (lo, hi) in enumerate(ctx.bounds(tuple(parts))):
            per_rank[i % c.pp] += host[lo:hi].sum()
        cap = ofl.host_cap(c.offload, 4.0 if self.precision == "fp32" else 2.0)
        nvme = ofl.node_host_bytes(per_rank, c.stage_ranks, self.cluster) if c.offload.device == "nvme" else 0.0
        return ofl.node_host_bytes(np.minimum(per_rank, cap), c.stage_ranks, self.cluster), nvme

    def config(self, **degrees) -> Parallel:
        """A configuration of this planner's space (keywords as :class:`Parallel`), with
        sequence parallelism as the planner's mode sets it (on whenever tp > 1 unless 'off')."""
        comm = self.cp_comm if degrees.get("cp", 1) > 1 else "p2p"     # no CP: no exchange
        return Parallel(sp=degrees.get("tp", 1) > 1 and self.sp != "off", cp_comm=comm, **degrees)

    def exec_strats(self, c: Parallel, sel: bool = False):
        """The two strategies of an executable config (without / with CKPT)."""
        return (Strategy.of(c, ckpt=False, sel=sel), Strategy.of(c, ckpt=True, sel=sel))

    def mode_strats(self, c: Parallel, ckpt: str) -> tuple:
        """Strategies a recompute mode chooses among: 'dp'/'full' with and without full-layer
        CKPT; 'none' without; 'selective' the attention core only, on every layer (Megatron's
        --recompute-granularity selective does not mix with full-layer recompute)."""
        if ckpt in ("none", "selective"):
            return self.exec_strats(c, ckpt == "selective")[:1]
        return self.exec_strats(c)

    def ctx_of(self, c: Parallel, strats) -> Context:
        """The search context of configuration ``c`` over the strategies ``strats``."""
        return self.ctx(c.pp, c.num_microbatches, c.batch_per_microbatch, strats)

    def recompute_modes(self) -> list[str]:
        """Recompute modes to search: the fixed one, else per-layer CKPT, plus selective
        recompute (Korthikanti et al. 2022 §5) where it saves memory (attention scores kept,
        i.e. no flash attention) and the plan is for Megatron, the runtime that has it."""
        if "recompute" in self.fix:
            return [self.ckpt]
        if self.cm.runtime != "megatron":
            return ["dp"]
        t, d = self.tps[0], self.N // self.tps[0]
        a, b = (self.cm.tables([s], d).f1 for s in (Strategy(t, d), Strategy(t, d, sel=True)))
        return ["dp", "selective"] if np.any(b < a) else ["dp"]

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

    def _host_floor(self, c: Parallel) -> float:
        """Host bytes a node needs at least: its ranks' even share of the offloaded states."""
        if not c.offload.any:
            return 0.0
        tot = float(self._units(c, "host").sum())
        cap = ofl.host_cap(c.offload, 4.0 if self.precision == "fp32" else 2.0)
        return min(tot / c.pp, cap) * min(self.cluster.gpus_per_node, c.world_size)

    def _check_host(self, cand: Candidate) -> None:
        """Set the candidate's node host bytes; one beyond the host budget (or, offloading to
        NVMe, beyond the node's NVMe) does not fit."""
        if cand.ctx is None or not cand.par.offload.any:
            return
        cand.host, nvme = self.host_need(cand.par, cand.ctx, cand.parts)
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

    # -- evaluation of one executable config ------------------------------------------
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
                 bubble=0.0):
            return Candidate(name, par=c.with_(chunks=max(1, len(parts or ()) // P)), time=time,
                             schedule=schedule, parts=parts, recompute=recompute, peak=peak,
                             partitioner=partitioner, ctx=cx, plan=plan, sim=sim, bubble=bubble)
        if ckpt == "full":
            parts = part.even_partition(L, P)
            plan = [1 if self.cm.units[u].checkpointable else 0 for u in ctx.seq]
            full = self.ctx_of(c, self.exec_strats(c))
            if P == 1:
                C, Cns, Mem = full.stage_costs(parts, plan)
                T = full.pipeline_time(parts, plan) if Mem.max() <= self.E else INF
                return cand(T, "1f1b", parts, [L], list(Mem), "even", full, plan)
            # every schedule with every block recomputed (Megatron runs full recompute with its
            # interleaving too), blocks split evenly into the schedule's stages
            evs = full_recompute_evals(full, schedules or self.schedules, keep_sim, self.chunks)
            if not evs or not evs[0].ok:
                e = evs[0] if evs else None
                return cand(INF, "1f1b", parts, e.recompute if e else [], e.peak if e else [], "even",
                            full, plan)
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
            if plan is None:
                return cand(INF, "1f1b", parts or (), [], [], pname, ctx)
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
            return cand(INF, "1f1b", parts, [], [], pname, ctx, plan)
        e: Eval = evs[0]
        out = cand(e.time, e.schedule, e.parts, e.recompute, e.peak,
                   pname if e.schedule == "1f1b" else e.partitioner, full, plan, e.sim, bubble=e.bubble)
        out.alts = evs
        return out

    # -- searches -----------------------------------------------------------------------
    def _bar(self, total, desc):
        if not self.progress:
            return None
        try:
            from tqdm import tqdm
            return tqdm(total=total, desc=desc, file=sys.stderr, leave=False)
        except ImportError:   # pragma: no cover
            return None

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

    def search_exec(self, top: int = 3, oom_probe: int = 2, ckpt: str | None = None
                    ) -> tuple[Candidate | None, list]:
        """Branch and bound over the executable space (docs/planner.md §2.8).  Configurations
        that cannot fit (memory floor) are out; the rest are costed until none is left whose
        time floor (:meth:`floors`, a true lower bound of its simulated time under any
        schedule) is below the best time found, so no configuration can beat the result.
        The order only decides how soon the bound bites: first the best ``top`` by Eq. 9
        (1F1B) and by Eq. 9 without 1F1B's fill and drain, and ``oom_probe`` configurations
        1F1B cannot fit, then the rest by their floor."""
        ranked = []
        for c in self.combos():
            lb, states = self.floors(c)
            if states <= self.E and self._host_floor(c) <= self.host_E:
                ranked.append((lb, c))
        ranked.sort(key=lambda r: r[0])
        bar = self._bar(len(ranked), "search")
        best_est, scored = INF, []
        for lb, c in ranked:
            if bar:
                bar.update(1)
            if lb >= best_est:         # ordering only: configs past here are costed by floor
                break
            est = self.estimate(c, ckpt=ckpt)
            best_est = min(best_est, est)
            scored.append((est, lb, c))
        if bar:
            bar.close()
        fit = sorted((r for r in scored if math.isfinite(r[0])), key=lambda r: r[0])
        oom = sorted((r for r in scored if not math.isfinite(r[0])), key=lambda r: r[1])
        # Eq. 9 is 1F1B's time: its fill and drain, (P-1) of its m+P-1 steady steps, is what
        # the V and zero-bubble schedules nearly remove (Qi et al. 2024), so the best configs
        # by Eq. 9 without that term come early too (by Eq. 9 alone a deeper pipeline with
        # few micro-batches ranked behind configs it beats: Llama 3 405B on 8192 H100s)
        steady = sorted(fit, key=lambda r: r[0] * r[2].num_microbatches
                        / (r[2].num_microbatches + r[2].pp - 1))
        picked = list({id(r[2]): r for r in fit[:top] + steady[:top]}.values())
        first = sorted(picked, key=lambda r: r[1]) + oom[:oom_probe]
        est_of = {id(c): est for est, _, c in scored}
        seen = {id(r[2]) for r in first}
        rest = [(est_of.get(id(c), INF), lb, c) for lb, c in ranked if id(c) not in seen]
        best, tried, won = None, [], None
        for est, lb, c in first + rest:
            if best is not None and not self.could_beat(c, best.time):
                continue               # its floors: no plan of it that fits beats the best
            bound = best.time if best is not None else INF
            cand = self.evaluate(c, bound=bound, ckpt=ckpt)
            cand.estimate = est
            self._check_host(cand)
            tried.append(cand)
            if cand.ok and (best is None or cand.time < best.time):
                best, won = cand, (c, est, bound)
        if won is not None and won[2] < INF:
            # the winner once more without the bound: every schedule of it costed for the
            # report, exactly as `ds-autoplan cost` costs this configuration
            best = self.evaluate(won[0], ckpt=ckpt)
            best.estimate = won[1]
            self._check_host(best)
        return best, tried

    def best_of(self, name, combos, **kw) -> Candidate | None:
        """Best config of a restricted space: ranked by Eq. 9, the winner costed in full."""
        ek = {k: v for k, v in kw.items() if k in ("partitioner", "ckpt")}
        ranked = []
        for lb, c in _by_key(((self.lower_bound(c), c) for c in combos)):
            if len(ranked) >= 2 and lb >= ranked[1][0]:     # no later config ranks in the top 2
                break
            ranked = sorted(ranked + [(self.estimate(c, **ek), c)], key=lambda x: x[0])[:2]
        best = None
        for est, c in ranked[:2]:
            if not math.isfinite(est):
                break
            cand = self.evaluate(c, name=name, **kw)
            self._check_host(cand)
            if cand.ok and (best is None or cand.time < best.time):
                best = cand
        return best

    def baselines(self) -> dict:
        """Pure DP, ZeRO-3, Megatron default 3D (uniform TPxPPxDP, 1F1B, even split, no or full
        recompute), DeepSpeed autotuning's space (ZeRO stage x micro-batch, P = 1, TP = 1),
        Galvatron without BMW (even split, per-layer CKPT) and, where the cluster can offload,
        ZeRO-3 with the optimizer and parameters on the host and every layer recomputed, all on
        this cost model."""
        out = {}
        p1 = dict(ckpt="none", schedules=[])
        plain = dict(eps=[1], cps=[1], offloads=[NO_OFFLOAD])     # no expert/context parallelism, no offload
        out["pure DP"] = self.best_of("pure DP", self.combos([1], [1], [0], **plain), **p1)
        out["ZeRO-3"] = self.best_of("ZeRO-3", self.combos([1], [1], [3], **plain), **p1)
        mg = None
        for kw in (dict(ckpt="full", schedules=["1f1b"]), dict(ckpt="none", partitioner="even", schedules=["1f1b"])):
            c = self.best_of("Megatron 3D", self.combos(zeros=[0], offloads=[NO_OFFLOAD]), **kw)
            if c and (mg is None or c.time < mg.time):
                mg = c
        out["Megatron 3D"] = mg
        out["DeepSpeed autotuning"] = self.best_of("DeepSpeed autotuning", self.combos([1], [1], **plain), **p1)
        out["Galvatron (no BMW)"] = self.best_of("Galvatron (no BMW)", self.combos(offloads=[NO_OFFLOAD]),
                                                 partitioner="even", schedules=["1f1b"])
        if self.cm._rates is not None:
            # DeepSpeed users' usual hand choice for a model beyond GPU memory: ZeRO-3 with the
            # optimizer and the parameters offloaded to the host (ZeRO-Infinity's CPU offload)
            full = Offload(1.0, True)
            out["ZeRO-3 + full offload"] = self.best_of("ZeRO-3 + full offload", self.combos(
                [1], [1], [3], eps=[1], cps=[1], offloads=[full]), ckpt="full", schedules=[])
        return out

    def wide_strategies(self, n: int, par: Parallel | None = None) -> list[Strategy]:
        """Galvatron-BMW's per-layer set for a stage group of ``n`` devices (decision trees,
        CKPT) plus ZeRO-1 and ZeRO-2 data parallelism (Galvatron's DP is ZeRO-2) where the
        user allows them: the executable data-parallel layouts are all in it.  Expert and
        context parallelism are one per model (Megatron-core builds one EP and CP group): the
        trees split the n / cp ranks of one context slice, with ``par``'s ep, etp and cp."""
        cp = par.cp if par is not None else 1
        if n % cp:
            return []
        extra = {} if par is None else dict(ep=par.ep, etp=0 if par.etp == par.tp else par.etp,
                                            cp=cp, cp_comm=par.cp_comm)
        out = []
        for s in wide_strategies(n // cp, max_tp=max(self.tps)):
            if s.tp not in self.tps:
                continue
            s = s._replace(**extra)
            zs = [z for z in (1, 2) if z in self.allow_zero] if s.dp * cp > 1 and s.zero == 0 else []
            out += [s] + [s._replace(zero=z) for z in zs]
        return out

    def search_wide(self, incumbent: Candidate | None = None, bmw: bool = True, pps=None,
                    max_pairs: int = 12) -> dict:
        """Galvatron-BMW in the wide space (per-layer mixtures of :meth:`wide_strategies`,
        ``self.units`` memory units), each (P, m) plan costed like the executable ones: its
        1F1B schedule simulated (``simulate_layers``).  The executable space is inside the
        wide one (uniform layouts, any schedule), so ``incumbent`` (the executable plan)
        seeds the branch and bound on Eq. 9's balanced-stage lower bound: the wide result
        is never slower than the narrow one.  At most ``max_pairs`` (P, m) pairs are searched
        (the bound ignores memory, so it is loose where only memory-lean mixtures fit)."""
        best = {"bmw": self._wide_entry(incumbent) if incumbent is not None and incumbent.ok else None,
                "base": None}
        cands = []
        for P in pps or self.pp_degrees():
            S = self.wide_strategies(self.N // P, incumbent.par if incumbent is not None else None)
            # micro-batch of the whole stage group
            for B_m in divisors(self.B, upto=self.max_mbs * (self.N // P)):
                m = self.B // B_m
                if P > 1 and m < P:
                    continue
                # min_s c_ns over the ZeRO-0, no-CKPT member of each layout: ZeRO-2/3 add
                # gradient/parameter collectives to the backward, CKPT a forward, never less
                tab = self.cm.tables(list(dict.fromkeys(s._replace(zero=0, ckpt=False) for s in S)), B_m)
                if not tab.allowed[2:].any():
                    continue
                cns = np.where(tab.allowed, tab.c_ns, INF)[self._seq].min(axis=1)
                # the simulated 1F1B >= (m-1) max + sum >= (m+P-1) sum/P: balanced, no re-layout
                cands.append(((m + P - 1) * float(cns.sum()) / P, P, m, S))
        cands.sort(key=lambda x: x[0])
        for lb, P, m, S in cands[:max_pairs]:
            if best["bmw"] is not None and lb >= best["bmw"]["time"]:
                break
            ctx = Context(self.cm, S, P, m, self.B // m, self.E, self.units)
            if bmw:
                T, parts, plan, base = part.bmw(ctx, max_iters=2 * P)
            else:
                parts = part.even_partition(self.L, P)
                T, plan = ctx.search(parts)
                base = (T, parts, plan)
            for key, (tt, pp_, pl) in (("bmw", (T, parts, plan)), ("base", base)):
                if pl is None or not math.isfinite(tt):
                    continue
                if P > 1:
                    e = simulate_layers(ctx, tuple(pp_), pl)
                    if not e.ok:
                        continue
                    tt = e.time
                if best[key] is None or tt < best[key]["time"]:
                    best[key] = {"time": tt, "pp": P, "num_microbatches": m, "layers_per_stage": list(pp_),
                                 "strategies": [S[i].label() for i in pl], "schedule": "1f1b",
                                 "source": "per-layer search",
                                 "throughput_tokens_per_s": self.B * self.model.seq_len / tt}
        return best

    def _wide_entry(self, c: Candidate) -> dict:
        """An executable plan as a point of the wide space."""
        return {"time": c.time, "pp": c.pp, "num_microbatches": c.m, "layers_per_stage": list(c.parts),
                "strategies": layer_labels(c), "schedule": c.schedule, "source": "executable plan",
                "throughput_tokens_per_s": self.B * self.model.seq_len / c.time}

    def admits(self, c: Candidate) -> bool:
        """``c`` lies in the space the user restricted (--pp/--tp/--sequence-parallel/--fix)."""
        want = dict(pp=c.pp, tp=c.tp, dp=c.dp, zero=c.zero, mbs=c.par.micro_batch, schedule=c.schedule,
                    v=chunks_per_rank(c.schedule, c.parts, c.pp), ep=c.par.ep, etp=c.par.etp,
                    cp=c.par.cp, cp_comm=c.par.cp_comm, offload=c.par.offload.text())
        if any(self.fix.get(k, x) != x for k, x in want.items()):
            return False
        if self.pps and c.pp not in self.pps or c.tp not in self.tps:
            return False
        if self.ckpt in ("none", "selective"):
            return not any(c.recompute) and c.selective == (self.ckpt == "selective")
        return self.ckpt == "dp" or list(c.recompute) == list(c.parts)

    def min_memory(self) -> float:
        """Least per-device memory of any configuration of the (restricted) space, for the
        'cannot fit' message: its smallest micro-batch, a memory-balanced split, every block
        recomputed unless the recompute mode rules that out (max pipeline stage); offloads
        whose states the node's host memory cannot hold left out."""
        combos = list(self.combos())
        mb = min((c.micro_batch for c in combos), default=None)
        best = INF
        for c in combos:
            if c.micro_batch != mb or self._host_floor(c) > self.host_E:   # host memory too small
                continue
            strats = self.mode_strats(c, self.ckpt)
            ctx = self.ctx_of(c, strats)
            plan = [1 if len(strats) > 1 and self.cm.units[u].checkpointable else 0 for u in ctx.seq]
            parts = part.minmax_partition(part.stage_matrices(ctx, plan, "mem")) if c.pp > 1 else (self.L,)
            if parts is None:
                continue
            _, _, Mem = ctx.stage_costs(parts, plan)
            best = min(best, float(Mem.max()))
        return best


def _busiest(x: np.ndarray, P: int, q: int) -> float:
    """Least load of the busiest of ``P`` ranks holding the units ``x`` (embedding, blocks,
    head), each rank at least one block: the mean, the embedding or the head with a block,
    or the ``q`` = ceil(blocks / P) lightest blocks (some rank holds that many)."""
    blk = np.sort(x[1:-1])
    return float(max(x.sum() / P, max(x[0], x[-1]) + blk[0], blk[:q].sum()))


def _by_key(items) -> list:
    """(key, config) pairs sorted by key, ties by (pp, tp, dp, zero, micro-batches, batch)."""
    return sorted(items, key=lambda x: (x[0], x[1].pp, x[1].tp, x[1].dp, x[1].zero,
                                        x[1].num_microbatches, x[1].batch_per_microbatch))


def _merge_fix(fx: dict, key: str, value):
    """A degree given both as --KEY and in --fix must agree."""
    if key in fx and value is not None and value != fx[key]:
        raise SpecError(f"--{key} {value} contradicts --fix {key}={fx[key]}")
    return fx.get(key, value)


def _validate(model: ModelSpec, cluster: ClusterSpec, B: int, world_size: int | None):
    if not isinstance(B, int) or B <= 0:
        raise SpecError(f"global batch must be a positive integer, got {B!r}")
    N = cluster.world_size
    if world_size is not None and world_size != N:
        raise SpecError(f"world size {world_size} does not match cluster {cluster.name!r} "
                        f"({cluster.num_nodes} nodes x {cluster.gpus_per_node} devices = {N})")


def _is_model_profile(path: str) -> bool:
    """A ``ds-autoplan profile`` output (rather than a YAML of measured cluster overrides)."""
    from ..profile.profile import is_profile
    return is_profile(path)


@contextlib.contextmanager
def _gc_paused():
    """CPython's cyclic collector off while the search runs: it allocates ~10^6 small objects
    that live until it returns (schedules' actions, memoised tables), which the collector
    would re-scan several times (some 15% of the search time) and none of which it frees."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@_gc_paused()
def search(model, cluster, global_batch: int, seq: int | None = None, *, precision: str = "bf16",
           budget_gb: float | None = None, partitioner: str = "bmw", schedules=None,
           wide: bool = True, baselines: bool = True, progress: bool = False,
           world_size: int | None = None, profile: str | None = None, units: int = 512,
           max_tp: int | None = None, keep_sim: bool = True, pp: int | None = None,
           tp: int | None = None, sequence_parallel: str = "auto", fix=None,
           runtime: str = "any", headroom_gb: float | None = None, execution=None,
           moe_imbalance: float = MOE_IMBALANCE) -> SearchResult:
    """Plan ``model`` on ``cluster`` for ``global_batch``: the executable plan (never worse than
    the baselines on the same cost model), the baselines, the wide Galvatron-BMW result and
    the partitioner comparison.  ``pp``/``tp`` restrict the search to one degree;
    ``sequence_parallel``: 'auto' (on whenever tp > 1), 'on' (tp > 1 only) or 'off'; ``fix``:
    the user's configuration, as restrictions (:func:`ds_autoplan.search.fix.parse_fix`);
    ``runtime``: whose memory accounting the plan must fit ('any', 'megatron', 'deepspeed');
    ``execution``: the engine's execution model (cost/engines.py; default 'any');
    ``headroom_gb``: memory kept free below the budget (cost/memory.py usable_budget)."""
    if profile and _is_model_profile(profile):
        # a model profile (ds-autoplan profile MODEL --out profile.json): measured per-layer
        # costs replace the preset's; the cluster's FLOP/s turn them back into the same times
        from ..profile import load_profile, to_model_spec
        cluster = load_cluster(cluster)
        prof = load_profile(profile, model if isinstance(model, str) else None)
        model = to_model_spec(prof, flops_ref=cluster.flops)
    else:
        model = load_model(model, seq)
        cluster = load_cluster(cluster, profile)
    _validate(model, cluster, global_batch, world_size)
    t0 = time.perf_counter()          # search time: not the loading (a profile imports torch)
    pl = Planner(model, cluster, global_batch, precision=precision, budget_gb=budget_gb,
                 partitioner=partitioner, schedules=schedules, progress=progress, units=units,
                 max_tp=max_tp, pp=pp, tp=tp, sequence_parallel=sequence_parallel, fix=fix,
                 runtime=runtime, headroom_gb=headroom_gb, execution=execution,
                 moe_imbalance=moe_imbalance)
    if next(pl.combos(), None) is None:
        if pl.fix:
            raise SpecError(f"{fix_text(pl.fix)}: no layout of {cluster.world_size} devices and global "
                            f"batch {global_batch} has these values (pp x tp x dp = devices, "
                            f"micro-batch x micro-batches x dp = batch, micro-batches >= pp)")
        raise SpecError(f"global batch {global_batch} is not divisible into micro-batches for "
                        f"{cluster.world_size} devices: no pipeline/tensor/data layout gives "
                        f"global_batch = micro_batch x micro-batches x dp with micro-batches >= pp; "
                        f"use a multiple of {cluster.world_size}")
    phases = {}
    tp0 = time.perf_counter()
    best, tried = None, []
    for mode in pl.recompute_modes():
        b, t = pl.search_exec(ckpt=mode)
        tried += t
        if b is not None and (best is None or b.time < best.time):
            best = b
    phases["executable"] = time.perf_counter() - tp0
    tp0 = time.perf_counter()
    bl = pl.baselines() if baselines else {}
    phases["baselines"] = time.perf_counter() - tp0
    for c in bl.values():              # the plan is never worse than a baseline
        if c is not None and c.ok and pl.admits(c) and (best is None or c.time < best.time * (1 - 1e-12)):
            best = c
    if best is None or not best.ok:
        need = pl.min_memory()
        E = pl.E / GB
        what = f"model {model.label}" + (f" with {fix_text(pl.fix)}" if pl.fix else "")
        missing = cluster.offload_missing()
        host = (f"; offloading weighed too ({pl.host_E / GB:.0f} GB of host memory usable per node)"
                if not missing else f"; offloading not weighed: the cluster has no host figures "
                f"(missing {', '.join(missing)}; `ds-autoplan profile --hardware` measures them)")
        if math.isfinite(need) and need > pl.E:
            raise SpecError(f"{what} cannot fit on {cluster.name} with global batch "
                            f"{global_batch}: needs at least {need / GB:.1f} GB per device, budget is "
                            f"{E:.1f} GB (short by {need / GB - E:.1f} GB){host}")
        if math.isfinite(need):     # the 1F1B floor fits; the schedules allowed hold more in flight
            raise SpecError(f"{what} cannot fit on {cluster.name} with global batch "
                            f"{global_batch}: no schedule, split and recompute choice it allows stays "
                            f"within the {E:.1f} GB budget per device (a memory-balanced 1F1B split "
                            f"would need {need / GB:.1f} GB){host}")
        raise SpecError(f"model {model.label} cannot fit on {cluster.name} at any setting "
                        f"(budget {E:.1f} GB per device)")
    # the winner's simulation (2P micro-batches) is kept for the Gantt and memory plots
    e = (best.alts or [None])[0]
    if keep_sim and best.pp > 1 and best.sim is None and e is not None and e.figs is not None:
        from .pipeline import simulate_plan
        best.sim = simulate_plan(e.ctx, e.schedule, e.parts, e.recompute, e.figs, True)[3]
    parts_cmp = {}
    if best.pp > 1:          # partitioners compared on the winner's configuration (1F1B, Eq. 9)
        for pn in part.PARTITIONERS:
            parts_cmp[pn] = pl.evaluate(best.par.with_(chunks=1), partitioner=pn, schedules=[],
                                        name=pn)
    tp0 = time.perf_counter()
    wd = pl.search_wide(best) if wide else {}
    phases["wide"] = time.perf_counter() - tp0
    dt = time.perf_counter() - t0
    phases["total"] = dt
    plan = to_plan(best, model, cluster, global_batch, precision, pl, bl, wd, tried, dt)
    plan.predicted["search_phases_s"] = {k: round(v, 3) for k, v in phases.items()}
    return SearchResult(plan, best, bl, wd, tried, parts_cmp, model, cluster, dt, pl.evaluated)


def to_plan(c: Candidate, model, cluster, B, precision, pl: Planner, bl: dict, wd: dict, tried,
            dt: float) -> Plan:
    """The :class:`Plan` of candidate ``c`` with its predicted cost, baselines and wide-mode
    comparison."""
    seq = model.seq_len
    nblk = list(c.parts)
    rec = [r / n if n else 0.0 for r, n in zip(c.recompute, nblk)] if c.recompute else [0.0] * len(nblk)
    tok = B * seq / c.time
    flops = 3 * model.flops_per_sample * B / c.time      # F + 2F for backward (no recompute)
    mfu = flops / (cluster.world_size * cluster.peak_tflops * 1e12)
    pred = {"iteration_time_s": c.time, "throughput_tokens_per_s": tok,
            "samples_per_s": B / c.time, "mfu": mfu,
            "peak_memory_gb_per_stage": [round(x / GB, 3) for x in c.peak],
            "memory_budget_gb": round(pl.E / GB, 3), "memory_headroom_gb": round(pl.headroom_gb, 3),
            "memory_runtime": pl.cm.runtime, "search_time_s": dt,
            "offload": offload_summary(c, pl),
            "execution": pl.cm.execution.label(), "error_band": error_band(pl.cm.execution.name),
            "baselines": {k: (v.summary(B, seq) if v is not None else None) for k, v in bl.items()},
            "wide": wd,
            "candidates_evaluated": pl.evaluated}
    best_bl = max((v.time and B * seq / v.time for v in bl.values() if v is not None and v.ok), default=0)
    pred["ratio_vs_best_baseline"] = tok / best_bl if best_bl else None
    alts = c.alts
    if wd.get("bmw"):
        pred["wide_gain"] = wd["bmw"]["throughput_tokens_per_s"] / tok
        # the wide mode is costed like the paper (1F1B): also compare with our best 1F1B
        t1 = min((e.time for e in alts if e.schedule == "1f1b" and e.ok), default=None)
        if c.pp == 1:
            t1 = c.time
        if t1:
            pred["wide_gain_vs_1f1b"] = wd["bmw"]["throughput_tokens_per_s"] / (B * seq / t1)
    pred["schedules_tried"] = [{"schedule": e.schedule, "iteration_time_s": e.time if e.ok else None,
                                "fits": e.fits, "layers_per_stage": list(e.parts),
                                "recompute_layers": list(e.recompute),
                                "peak_memory_gb": [round(x / GB, 3) for x in e.peak]} for e in alts]
    return Plan(**Plan.parallel_fields(c.par.with_(sp=c.sp)), global_batch_size=B,
                precision=precision, schedule=c.schedule,
                schedule_options=schedule_options(c.schedule, len(nblk) // c.pp), layers_per_stage=nblk,
                recompute_per_stage=[round(x, 6) for x in rec], model=model.name, cluster=cluster.name,
                seq_len=seq, num_layers=model.num_layers, world_size=cluster.world_size,
                selective_recompute=c.selective, partitioner=c.partitioner, layer_strategies=layer_labels(c), predicted=pred,
                notes=[c.note] if c.note else [])


def offload_summary(c: Candidate, pl: Planner) -> dict:
    """What the plan offloads, the host bytes of its busiest node and its budget, and the
    seconds per iteration the offloading adds on the busiest rank (its tables with and without
    the offload); why nothing is offloaded where the cluster cannot."""
    off = c.par.offload
    if not off.any:
        missing = pl.cluster.offload_missing()
        return {"what": "none", "why": (f"cluster has no host figures (missing {', '.join(missing)})"
                                        if missing else "fits and runs fastest without")}
    s = c.ctx.strategies[0]
    with_, without = (pl.cm.tables([x], c.B_m) for x in (s, s._replace(offload=NO_OFFLOAD)))
    seq = c.ctx.seq
    extra = c.m * (with_.c_ns - without.c_ns)[seq, 0] + (with_.bwd - with_.bwd_ns - without.bwd + without.bwd_ns)[seq, 0]
    per_rank = np.zeros(c.pp)
    for i, (lo, hi) in enumerate(c.ctx.bounds(tuple(c.parts))):
        per_rank[i % c.pp] += extra[lo:hi].sum()
    return {"what": off.text(), "label": off.label(), "host_memory_gb_per_node": round(c.host / GB, 3),
            "host_budget_gb_per_node": round(pl.host_E / GB, 3), "step_s": round(float(per_rank.max()), 4)}


def layer_labels(c: Candidate) -> list[str]:
    """Per-unit strategy labels (embedding, blocks in schedule-stage order, head); recomputed
    blocks are the first ones of their stage (Megatron's 'block' method)."""
    base = Strategy.of(c.par.with_(sp=c.sp)).label()
    out = [base]
    for n, r in zip(c.parts, c.recompute or [0] * len(c.parts)):
        out += [base + "+CKPT"] * int(r) + [base] * (n - int(r))
    return out + [base]


def plan_model(model, cluster, global_batch: int, seq: int | None = None, **opts) -> Plan:
    """Plan ``model`` on ``cluster`` for ``global_batch``; options as :func:`search`."""
    opts.setdefault("wide", False)
    opts.setdefault("keep_sim", False)
    return search(model, cluster, global_batch, seq, **opts).plan
