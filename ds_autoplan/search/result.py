"""The search's result: the :class:`Plan` of the winning candidate with its
:class:`~ds_autoplan.plan.Prediction` (:func:`to_plan`), the :class:`SearchResult` the report
is written from, and what the search says when no configuration is left (:func:`no_layout`,
:func:`cannot_fit`)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..cost.engines import error_band
from ..cost.model import Strategy
from ..plan import Plan, Prediction
from ..spec import SpecError
from ..spec.cluster import GB, ClusterSpec
from ..spec.model import ModelSpec
from ..spec.parallel import NO_OFFLOAD
from .evaluate import Candidate, Evaluator
from .fix import fix_text
from .pipeline import schedule_options


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


def to_plan(c: Candidate, pl: Evaluator, bl: dict, wd: dict, dt: float,
            phases: dict | None = None) -> Plan:
    """The :class:`Plan` of candidate ``c`` of ``pl``'s space with its :class:`Prediction`:
    the predicted cost, the baselines ``bl``, the wide mode's entries ``wd``, the schedules
    tried; ``dt`` the search's seconds, ``phases`` per phase."""
    model, cluster, B = pl.model, pl.cluster, pl.B
    seq = model.seq_len
    nblk = list(c.parts)
    rec = [r / n if n else 0.0 for r, n in zip(c.recompute, nblk)] if c.recompute else [0.0] * len(nblk)
    tok = B * seq / c.time
    # F + 2F for backward (no recompute); frozen weights skip their gradient's F
    total, train = pl.cm.trainable.counts(model)
    flops = (2 + train / total) * model.flops_per_sample * B / c.time
    best_bl = max((v.time and B * seq / v.time for v in bl.values() if v is not None and v.ok), default=0)
    wide_gain = wide_gain_1f1b = None
    if wd.get("bmw"):
        wide_gain = wd["bmw"]["throughput_tokens_per_s"] / tok
        # the wide mode is costed like the paper (1F1B): also compare with our best 1F1B
        t1 = min((e.time for e in c.alts if e.schedule == "1f1b" and e.ok), default=None)
        if c.pp == 1:
            t1 = c.time
        if t1:
            wide_gain_1f1b = wd["bmw"]["throughput_tokens_per_s"] / (B * seq / t1)
    pred = Prediction(
        iteration_time_s=c.time, throughput_tokens_per_s=tok, samples_per_s=B / c.time,
        mfu=flops / (cluster.world_size * cluster.peak_tflops * 1e12),
        peak_memory_gb_per_stage=[round(x / GB, 6) for x in c.peak],
        memory_budget_gb=round(pl.E / GB, 3), memory_headroom_gb=round(pl.headroom_gb, 3),
        memory_runtime=pl.cm.runtime, offload=offload_summary(c, pl),
        trainable=None if pl.cm.trainable.full else pl.trainable_summary(c.par), execution=pl.cm.execution.label(),
        error_band=error_band(pl.cm.execution.name, cluster), search_time_s=dt,
        baselines={k: (v.summary(B, seq) if v is not None else None) for k, v in bl.items()},
        wide=wd, candidates_evaluated=pl.evaluated,
        ratio_vs_best_baseline=tok / best_bl if best_bl else None,
        wide_gain=wide_gain, wide_gain_vs_1f1b=wide_gain_1f1b,
        schedules_tried=[{"schedule": e.schedule, "iteration_time_s": e.time if e.ok else None,
                          "fits": e.fits, "layers_per_stage": list(e.parts),
                          "recompute_layers": list(e.recompute),
                          "peak_memory_gb": [round(x / GB, 3) for x in e.peak]} for e in c.alts],
        search_phases_s={k: round(v, 3) for k, v in phases.items()} if phases is not None else None,
        components=predicted_components(c))
    return Plan(c.par, precision=pl.options.precision, schedule=c.schedule,
                schedule_options=schedule_options(c.schedule, len(nblk) // c.pp), layers_per_stage=nblk,
                recompute_per_stage=[round(x, 6) for x in rec], model=model.name, cluster=cluster.name,
                seq_len=seq, num_layers=model.num_layers, world_size=cluster.world_size,
                gpus_per_node=cluster.gpus_per_node,
                selective_recompute=c.selective, partitioner=c.partitioner,
                layer_strategies=layer_labels(c), predicted=pred, notes=[c.note] if c.note else [])


def predicted_components(c: Candidate) -> dict | None:
    """Per pipeline rank, the predicted seconds per iteration of each cost-model component
    (cost/components.py) of candidate ``c``, from the stage figures it was costed with; None
    where the candidate was not costed stage by stage (the closed form)."""
    from ..cost.components import pipeline_components
    from .pipeline import _build, _stage_arrays, _static_and_tail, options_of, stage_figures
    ctx = c.ctx
    if ctx is None or not c.parts or not c.ok:
        return None
    e = next((a for a in c.alts if a.schedule == c.schedule and tuple(a.parts) == tuple(c.parts)), None)
    if e is not None and e.figs is not None:
        figs, rec = e.figs, list(e.recompute)
    elif c.pp == 1 and c.plan is not None:
        figs, rec = stage_figures(ctx, tuple(c.parts), list(c.plan), list(c.plan)), [0]
    else:
        return None
    P, m = c.pp, c.num_microbatches
    if P == 1:              # one stage, unpipelined
        place, split = (0,), False
    else:
        sched = _build(c.schedule, P, min(m, 2 * P), options_of(c.schedule, tuple(c.parts), P))
        place, split = sched.placement, any(a.kind.name == "W" for r in sched.ranks for a in r)
    f, bw, w, _ = _stage_arrays(figs, rec)
    r = np.array(rec, dtype=float) * np.array([g["d_time"] for g in figs])
    _, tail = _static_and_tail(figs, rec, place, P, ctx.cm.cluster)
    return pipeline_components(place, m, f, bw - w if split else bw, w, r, split, tail,
                               c.time - float(tail.max()), ctx.cm.cluster.action_overhead_us * 1e-6)


def offload_summary(c: Candidate, pl: Evaluator) -> dict:
    """What the plan offloads, the host bytes of its busiest node and its budget, and the
    seconds per iteration the offloading adds on the busiest rank (its tables with and without
    the offload); why nothing is offloaded where the cluster cannot."""
    off = c.par.offload
    if not off.any:
        missing = pl.cluster.offload_missing()
        return {"what": "none", "why": (f"cluster has no host figures (missing {', '.join(missing)})"
                                        if missing else "fits and runs fastest without")}
    st = c.ctx.strategies
    with_, without = (pl.cm.tables(x, c.batch_per_microbatch) for x in (st, [s._replace(offload=NO_OFFLOAD) for s in st]))
    seq = c.ctx.seq
    p = c.columns()
    extra = c.num_microbatches * (with_.c_ns - without.c_ns)[seq, p] + \
        (with_.bwd - with_.bwd_ns - without.bwd + without.bwd_ns)[seq, p]
    per_rank = np.zeros(c.pp)
    for i, (lo, hi) in enumerate(c.ctx.bounds(tuple(c.parts))):
        per_rank[i % c.pp] += extra[lo:hi].sum()
    return {"what": off.text(), "label": off.label(), "host_memory_gb_per_node": round(c.host / GB, 3),
            "host_budget_gb_per_node": round(pl.host_E / GB, 3), "step_s": round(float(per_rank.max()), 4)}


def layer_labels(c: Candidate) -> list[str]:
    """Per-unit strategy labels (embedding, blocks in schedule-stage order, head); recomputed
    blocks are the first ones of their stage (Megatron's 'block' method)."""
    base = Strategy.of(c.par).label()
    out = [base]
    for n, r in zip(c.parts, c.recompute or [0] * len(c.parts)):
        out += [base + "+CKPT"] * int(r) + [base] * (n - int(r))
    return out + [base]


def no_layout(pl: Evaluator) -> SpecError:
    """The error when ``pl``'s space has no configuration at all."""
    N, B = pl.cluster.world_size, pl.B
    if pl.fix:
        off = pl.offload_fix
        why = {pl.cm.offload_refusal(Strategy(1, 1, z, offload=off), P) for z in pl.allow_zero
               for P in pl.pps or [1]} if off is not None else {None}
        return SpecError(f"{fix_text(pl.fix)}: no layout of {N} devices and global "
                         f"batch {B} has these values (pp x tp x dp = devices, "
                         f"micro-batch x micro-batches x dp = batch, micro-batches >= pp)" +
                         ("" if None in why else f"; offload={off.text()}: {sorted(why)[0]}"))
    return SpecError(f"global batch {B} is not divisible into micro-batches for "
                     f"{N} devices: no pipeline/tensor/data layout gives "
                     f"global_batch = micro_batch x micro-batches x dp with micro-batches >= pp; "
                     f"use a multiple of {N}")


def cannot_fit(pl: Evaluator) -> SpecError:
    """The error when no configuration of ``pl``'s space fits: by how much the leanest one
    misses the budget (:meth:`Evaluator.min_memory`), or that only the schedules allowed do."""
    model, cluster, B = pl.model, pl.cluster, pl.B
    need = pl.min_memory()
    E = pl.E / GB
    what = f"model {model.label}" + (f" with {fix_text(pl.fix)}" if pl.fix else "")
    missing = cluster.offload_missing()
    host = (f"; offloading weighed too ({pl.host_E / GB:.0f} GB of host memory usable per node)"
            if not missing else f"; offloading not weighed: the cluster has no host figures "
            f"(missing {', '.join(missing)}; `ds-autoplan profile --hardware` measures them)")
    if math.isfinite(need) and need > pl.E:
        return SpecError(f"{what} cannot fit on {cluster.name} with global batch "
                         f"{B}: needs at least {need / GB:.1f} GB per device, budget is "
                         f"{E:.1f} GB (short by {need / GB - E:.1f} GB){host}")
    if math.isfinite(need):     # the 1F1B floor fits; the schedules allowed hold more in flight
        return SpecError(f"{what} cannot fit on {cluster.name} with global batch "
                         f"{B}: no schedule, split and recompute choice it allows stays "
                         f"within the {E:.1f} GB budget per device (a memory-balanced 1F1B split "
                         f"would need {need / GB:.1f} GB){host}")
    return SpecError(f"model {model.label} cannot fit on {cluster.name} at any setting "
                     f"(budget {E:.1f} GB per device)")
