"""The planner: branch and bound over the executable space (one TP size and ZeRO stage,
per-layer CKPT, BMW partition, schedule chosen by simulation), the baselines on the same cost
model, and the wide Galvatron-BMW mode (per-layer TP/DP/SDP mixtures) reported separately.

:func:`search` is the entry point: one :class:`~ds_autoplan.search.options.SearchOptions`
(or its fields as keywords) in, a :class:`~ds_autoplan.search.result.SearchResult` out.  The
:class:`Planner` is the chain :class:`~ds_autoplan.search.space.Space` (what configurations
there are) -> :class:`~ds_autoplan.search.evaluate.Evaluator` (what one costs) -> the searches
here; :mod:`.result` assembles the Plan."""
from __future__ import annotations

import contextlib
import gc
import math
import sys
import time

import numpy as np

from ..plan import Plan
from ..spec import SpecError
from ..spec.cluster import ClusterSpec, load_cluster
from ..spec.model import ModelSpec, load_model
from ..spec.parallel import NO_OFFLOAD, Offload
from . import partition as part
from .dp import INF, Context
from .evaluate import Candidate, Evaluator
from .options import SearchOptions
from .pipeline import simulate_layers
from .result import SearchResult, cannot_fit, layer_labels, no_layout, to_plan
from .space import divisors


class Planner(Evaluator):
    """The planner of one (model, cluster, global batch) under one
    :class:`~ds_autoplan.search.options.SearchOptions` (or its fields as keywords): the
    executable space (:class:`~ds_autoplan.search.space.Space`), its evaluation
    (:class:`~ds_autoplan.search.evaluate.Evaluator`: stage DPs, partitioners, schedules by
    simulation, docs/planner.md §3-4), the branch and bound over it, the baselines and the
    wide mode."""

    def _bar(self, total, desc):
        if not self.options.progress:
            return None
        try:
            from tqdm import tqdm
            return tqdm(total=total, desc=desc, file=sys.stderr, leave=False)
        except ImportError:   # pragma: no cover
            return None

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

    def search_wide(self, incumbent: Candidate | None = None, bmw: bool = True, pps=None,
                    max_pairs: int = 12) -> dict:
        """Galvatron-BMW in the wide space (per-layer mixtures of :meth:`wide_strategies`,
        ``options.units`` memory units), each (P, m) plan costed like the executable ones: its
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
            ctx = Context(self.cm, S, P, m, self.B // m, self.E, self.options.units)
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
        return {"time": c.time, "pp": c.pp, "num_microbatches": c.num_microbatches,
                "layers_per_stage": list(c.parts),
                "strategies": layer_labels(c), "schedule": c.schedule, "source": "executable plan",
                "throughput_tokens_per_s": self.B * self.model.seq_len / c.time}


def _by_key(items) -> list:
    """(key, config) pairs sorted by key, ties by (pp, tp, dp, zero, micro-batches, batch)."""
    return sorted(items, key=lambda x: (x[0], x[1].pp, x[1].tp, x[1].dp, x[1].zero,
                                        x[1].num_microbatches, x[1].batch_per_microbatch))


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
def search(model, cluster, global_batch: int, seq: int | None = None,
           options: SearchOptions | None = None, **changes) -> SearchResult:
    """Plan ``model`` on ``cluster`` for ``global_batch``: the executable plan (never worse than
    the baselines on the same cost model), the baselines, the wide Galvatron-BMW result and
    the partitioner comparison.  ``options``: a :class:`SearchOptions` (what restricts the
    space, what is reported); ``changes``: its fields as keywords (over ``options``)."""
    o = SearchOptions.of(options, **changes)
    profile = o.profile
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
    _validate(model, cluster, global_batch, o.world_size)
    t0 = time.perf_counter()          # search time: not the loading (a profile imports torch)
    pl = Planner(model, cluster, global_batch, o)
    if next(pl.combos(), None) is None:
        raise no_layout(pl)
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
    bl = pl.baselines() if o.baselines else {}
    phases["baselines"] = time.perf_counter() - tp0
    for c in bl.values():              # the plan is never worse than a baseline
        if c is not None and c.ok and pl.admits(c) and (best is None or c.time < best.time * (1 - 1e-12)):
            best = c
    if best is None or not best.ok:
        raise cannot_fit(pl)
    # the winner's simulation (2P micro-batches) is kept for the Gantt and memory plots
    e = (best.alts or [None])[0]
    if o.keep_sim and best.pp > 1 and best.sim is None and e is not None and e.figs is not None:
        from .pipeline import simulate_plan
        best.sim = simulate_plan(e.ctx, e.schedule, e.parts, e.recompute, e.figs, True)[3]
    parts_cmp = {}
    if best.pp > 1:          # partitioners compared on the winner's configuration (1F1B, Eq. 9)
        for pn in part.PARTITIONERS:
            parts_cmp[pn] = pl.evaluate(best.par.with_(chunks=1), partitioner=pn, schedules=[],
                                        name=pn)
    tp0 = time.perf_counter()
    wd = pl.search_wide(best) if o.wide else {}
    phases["wide"] = time.perf_counter() - tp0
    dt = time.perf_counter() - t0
    phases["total"] = dt
    plan = to_plan(best, pl, bl, wd, dt, phases)
    return SearchResult(plan, best, bl, wd, tried, parts_cmp, model, cluster, dt, pl.evaluated)


def plan_model(model, cluster, global_batch: int, seq: int | None = None,
               options: SearchOptions | None = None, **changes) -> Plan:
    """The plan alone of :func:`search` (same options; no wide mode and no simulation kept for
    plots unless the keywords ask for them)."""
    changes = {"wide": False, "keep_sim": False, **changes}
    return search(model, cluster, global_batch, seq, options, **changes).plan
