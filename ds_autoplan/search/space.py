"""The search spaces: the executable space (:class:`Space`: uniform configurations as
:class:`~ds_autoplan.spec.parallel.Parallel`, restricted by the :class:`SearchOptions`) and the
per-layer strategy space from Galvatron-BMW's decision trees (docs/planner.md §1.3, pruning
takeaways §1.2)."""
from __future__ import annotations

import itertools
import math

import numpy as np

from ..cost import offload as ofl
from ..cost.memory import usable_budget
from ..cost.model import CostModel, Strategy
from ..spec import SpecError
from ..spec.cluster import GB, ClusterSpec
from ..spec.model import ModelSpec
from ..spec.parallel import NO_OFFLOAD, Offload, Parallel
from .fix import RECOMPUTE, parse_fix
from .options import SP_MODES, SearchOptions
from .pipeline import chunks_per_rank

PARADIGMS = ("DP", "SDP", "TP")


def divisors(n: int, upto: int | None = None) -> list[int]:
    """Positive divisors of ``n`` up to ``upto`` (default all), ascending (world sizes, degrees
    and batches need not be powers of two: BLOOM-176B ran pp=12 on 384 GPUs).  Trial division
    up to min(upto, sqrt(n)): the work is bounded by ``upto`` whatever ``n`` is."""
    hi = n if upto is None else min(n, max(int(upto), 0))
    small, large = [], []
    for k in range(1, min(math.isqrt(n), hi) + 1):
        if n % k == 0:
            small.append(k)
            if n // k != k and n // k <= hi:
                large.append(n // k)
    return small + large[::-1]


def ordered_factorizations(n: int, h: int) -> list[tuple]:
    """Ordered tuples of ``h`` factors >= 2 whose product is ``n``."""
    if h == 0:
        return [()] if n == 1 else []
    return [(f,) + rest for f in divisors(n)[1:] for rest in ordered_factorizations(n // f, h - 1)]


def decision_trees(n: int, prune_dp_sdp: bool = True) -> list[tuple]:
    """Trees for a group of ``n`` devices: tuples of (paradigm, degree), outer level first.
    Each paradigm appears at most once; takeaway 3 removes trees mixing DP and SDP."""
    if n == 1:
        return [()]
    trees = [tuple(zip(par, deg)) for h in (1, 2, 3)
             for par in itertools.permutations(PARADIGMS, h)
             for deg in ordered_factorizations(n, h)]
    if prune_dp_sdp:
        trees = [t for t in trees if not {"DP", "SDP"} <= {p for p, _ in t}]
    return trees


def enumerate_trees(n: int, prune_dp_sdp: bool = True, with_ckpt: bool = True) -> list[tuple]:
    """(tree, ckpt) pairs: every tree twice, with and without CKPT (§1.3)."""
    return [(t, ck) for t in decision_trees(n, prune_dp_sdp)
            for ck in ((False, True) if with_ckpt else (False,))]


def count_candidates(N: int, prune_dp_sdp: bool = True, with_ckpt: bool = True) -> int:
    """Total candidates over all PP degrees P = N/n (the paper's 68/44/22 for N = 8, §1.5)."""
    return sum(len(enumerate_trees(N // P, prune_dp_sdp, with_ckpt)) for P in divisors(N))


def tree_to_strategy(tree: tuple, ckpt: bool) -> Strategy:
    """A pruned tree (at most TP and one data paradigm) as a Strategy."""
    deg = dict(tree)
    if "DP" in deg and "SDP" in deg:
        raise ValueError("DP+SDP mixes are pruned (takeaway 3)")
    tp = deg.get("TP", 1)
    sdp = "SDP" in deg
    dp = deg.get("SDP", deg.get("DP", 1))
    tp_outer = len(tree) == 2 and tree[0][0] == "TP"
    return Strategy(tp, dp, 3 if sdp and dp > 1 else 0, tp_outer, ckpt)


def strategies(n: int, *, with_ckpt: bool = True, max_tp: int | None = None,
               allow_sdp: bool = True) -> list[Strategy]:
    """Galvatron-BMW's strategy set S for one stage group of ``n`` devices.  ``max_tp``
    prunes TP degrees beyond a node (TP across slow links never wins, takeaway 1)."""
    out = []
    for tree, ck in enumerate_trees(n, True, with_ckpt):
        s = tree_to_strategy(tree, ck)
        if max_tp and s.tp > max_tp:
            continue
        if s.sdp and not allow_sdp:
            continue
        if s not in out:
            out.append(s)
    return out


# context parallelism is searched where every CP rank still keeps at least this many tokens:
# NVIDIA's NeMo 24.09 recipes train Llama 3.1 8B/70B/405B at CP 2 on 8192-token sequences,
# 4096 tokens per rank (dgxc-benchmarking llama3.1 READMEs; bench/data/published_runs.yaml
# llama31_dgxc2024, costed within the published-runs bounds), and the cost model puts such a
# configuration ahead of every CP 1 plan for the 405B proxy on 32 H100 [below 4K tokens per
# rank the ring's steps are left out: no published run; 128K tokens: cp up to 32]
CP_MIN_TOKENS = 4096
# offloads the search weighs where the cluster has host figures and the engines run them
# (cost/offload.py check): the whole optimizer, Twin-Flow / Megatron fractions in quarters,
# ZeRO-Infinity (parameters too), and NVMe where the cluster has it; activations in host
# memory alone and beside the whole optimizer or ZeRO-Infinity [decision: quarters; no
# fraction with activations]
OFFLOAD_SPACE = tuple(Offload.parse(t) for t in (
    "opt", "opt:0.25", "opt:0.5", "opt:0.75", "opt+param", "nvme:opt", "nvme:opt+param",
    "act", "opt+act", "opt+param+act"))


class Space:
    """The executable space of one (model, cluster, global batch) under ``options`` (a
    :class:`SearchOptions`, or its fields as keywords): the degrees each dimension may take,
    the configurations (:meth:`combos`), their per-layer strategies, the recompute modes and
    schedules to cost, and whether a costed candidate lies in the space the user restricted
    (:meth:`admits`).  The cost model is the space's: it bounds the micro-batch."""
    def __init__(self, model: ModelSpec, cluster: ClusterSpec, global_batch: int,
                 options: SearchOptions | None = None, **changes):
        from . import partition as part
        from ..schedule.builders import REGISTRY, check_names, searched_by_default
        self.options = o = SearchOptions.of(options, **changes)
        self.fix = fx = parse_fix(o.fix)
        pp, tp = _merge_fix(fx, "pp", o.pp), _merge_fix(fx, "tp", o.tp)
        sequence_parallel = fx.get("sp", o.sequence_parallel)
        self.allow_zero = (fx["zero"],) if "zero" in fx else o.allow_zero
        schedules = o.schedules
        if "schedule" in fx:
            if fx["schedule"] not in REGISTRY:
                raise SpecError(f"schedule={fx['schedule']}: unknown schedule; choose from "
                                f"{', '.join(REGISTRY)}")
            schedules = [fx["schedule"]]
        self.ckpt = RECOMPUTE[fx.get("recompute", "auto")]
        self.offload_fix = Offload.parse(fx["offload"]) if "offload" in fx else None
        self.cp_comm = fx.get("cp_comm", "a2a" if o.runtime == "deepspeed" else "p2p")
        self.chunks = fx.get("v")
        self.model, self.cluster, self.B = model, cluster, int(global_batch)
        self.E, self.headroom_gb = usable_budget(cluster, o.budget_gb, o.headroom_gb)
        self.cm = CostModel(model, cluster, o.precision, o.runtime, execution=o.execution,
                            moe_imbalance=o.moe_imbalance, trainable=o.trainable)
        # the user's names must all exist (one line naming the builders); by default the
        # builders the registry marks as searched
        self.schedules = check_names(list(schedules)) if schedules else searched_by_default()
        if o.partitioner not in part.PARTITIONERS:
            raise SpecError(f"unknown partitioner {o.partitioner!r}; choose from "
                            f"{', '.join(part.PARTITIONERS)}")
        self.partitioner = o.partitioner
        self.N = cluster.world_size
        self.L = model.num_layers
        kv = int(model.config.get("kv_heads", model.heads))
        G = cluster.gpus_per_node
        self.tps = [t for t in divisors(G) if t <= (o.max_tp or G) and model.heads % t == 0
                    and kv % t == 0]
        self.pps = None
        if pp is not None:
            if pp < 1 or self.N % pp or pp > self.L:
                raise SpecError(f"pp={pp} must divide the {self.N} devices and be at most the "
                                f"{self.L} layers; choose from {self.pp_degrees()}")
            self.pps = [pp]
        if tp is not None:
            if tp not in self.tps:
                raise SpecError(f"tp={tp} is not possible here: {self._tp_limit(tp, o.max_tp)}; "
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
        self._seq = np.concatenate([[0], self.cm.block_types, [1]])
        self.max_mbs = self.micro_batch_bound()

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

    def trainable_summary(self, c: Parallel) -> dict:
        """What freezing saves at configuration ``c``: the trained parameters and the model
        states per device (mean over the pipeline's ranks) beside a full fine-tune's."""
        from ..spec.trainable import FULL
        total, train = self.cm.trainable.counts(self.model)
        full = CostModel(self.model, self.cluster, self.cm.precision, self.cm.runtime,
                         execution=self.cm.execution, moe_imbalance=self.cm.moe_imbalance, trainable=FULL)
        s = Strategy.of(c)
        states = [float(m.tables([s], c.batch_per_microbatch).ms[self._seq, 0].sum()) / c.pp
                  for m in (self.cm, full)]
        return {"spec": self.cm.trainable.label(), "params": int(total), "trainable_params": int(train),
                "model_states_gb": round(states[0] / GB, 3), "full_finetune_states_gb": round(states[1] / GB, 3)}

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
        offload: nothing (ZeRO with one data rank only to offload states), and where the cluster has host
        figures the :data:`OFFLOAD_SPACE` (or ``options.offloads``) members its engines run (--fix offload=... : that one;
        ``only``: these, for the baselines)."""
        if only is not None:
            want = [o for o in only if self.offload_fix in (None, o)]
        elif self.offload_fix is not None:
            want = [self.offload_fix]
        else:
            space = OFFLOAD_SPACE if self.options.offloads is None else self.options.offloads
            want = [NO_OFFLOAD] + ([o for o in space if self.cm.cluster.offload_missing(
                nvme=o.device == "nvme") == []] if self.cm._rates is not None else [])
        return [o for o in want if (o.states or dd > 1 or z == 0) and (z > 0 or not o.states)
                and self.cm.offload_refusal(Strategy(1, 1, z, offload=o), P) is None]

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
        for s in strategies(n // cp, max_tp=max(self.tps)):
            if s.tp not in self.tps:
                continue
            s = s._replace(**extra)
            zs = [z for z in (1, 2) if z in self.allow_zero] if s.dp * cp > 1 and s.zero == 0 else []
            out += [s] + [s._replace(zero=z) for z in zs]
        return out

    def admits(self, c) -> bool:
        """The costed :class:`~ds_autoplan.search.evaluate.Candidate` ``c`` lies in the space
        the user restricted (--pp/--tp/--sequence-parallel/--fix)."""
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


def _merge_fix(fx: dict, key: str, value):
    """A degree given both as --KEY and in --fix must agree."""
    if key in fx and value is not None and value != fx[key]:
        raise SpecError(f"--{key} {value} contradicts --fix {key}={fx[key]}")
    return fx.get(key, value)
