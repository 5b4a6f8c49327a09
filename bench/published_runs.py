"""Validation against published training runs.

For every row of bench/data/published_runs.yaml (Megatron-LM on Selene -- Narayanan et al.
2021, Korthikanti et al. 2022; DeepSpeed's pipeline engine with Megatron tensor slicing --
MT-NLG 530B, BLOOM-176B; PyTorch FSDP -- MosaicML's 2023 MPT benchmarks on A100 and H100;
NeMo / Megatron-core with Transformer Engine -- NVIDIA's 2024 Nemotron-4 340B on DGX H100; each
row with its source): the published configuration costed by the planner's cost functions
(cost/iteration.py over CostModel's per-layer tables) under the execution model of the engine
and software stack that ran it (cost/engines.py: overlaps, gradient-reduction dtype,
attention-kernel generation, optimizer implementation -- the switches `ds-autoplan cost`
takes), and the signed throughput error
(published time / predicted time - 1).

One constant is calibrated, per GPU kind: ``sustained`` (the GEMM rate a training step keeps
over the burst MAMF; prior per kind in data/gpus.yaml).  Nothing is fitted per row.
* in-file error: calibrated on every source;
* leave-one-source-out (LOSO) error: for each source, calibrated on every *other* source
  (a kind no other source has keeps its per-kind prior) and the left-out rows predicted.
Unpublished knobs (micro-batch size, interleaving) follow one rule: of the values the engine
accepts that fit in memory, the one of median predicted time (lower median) under the prior;
each row prints what it took and from how many choices.

A published configuration is judged feasible against the device's measured allocatable memory
for its GPU kind (device_limit: bench/data/gpu_memory_*.json; H100 76.9 GiB of modelled
allocations), not against the planner's budget (reserve and headroom: policy for its own plans).

Then the planner's free choice for the same model, machine and batch, its prediction, and
whether its peak memory, re-checked with the closed form under the engines' accounting
(cost/memory.py), exceeds the budget.

    python bench/published_runs.py [--quick] [--json out.json] [--write]

--quick skips the free choice where the search space is large (more than 64 GPUs) so the run
stays under a minute on two cores.  --write stores the calibrated constants and the LOSO error
bands in ds_autoplan/data/calibration.json (what `ds-autoplan cost` and the plan report print).
The last line is one JSON object with "median_abs_error", "max_abs_error",
"loso_median_abs_error", "loso_max_abs_error", "loso_max_abs_error_multi_source_kinds" (rows
whose GPU kind another source also covers), "sources", "rows", "not_costed",
"free_choice_over_budget" and "published_infeasible".
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _measure as M  # noqa: E402

from ds_autoplan.cost.compute import get_gpu, gpu_kinds  # noqa: E402
from ds_autoplan.cost.engines import get_execution  # noqa: E402
from ds_autoplan.cost.iteration import Config, config_cost, split_layers  # noqa: E402
from ds_autoplan.cost.memory import usable_budget  # noqa: E402
from ds_autoplan.cost.model import CostModel  # noqa: E402
from ds_autoplan.spec import SpecError, load_cluster, load_model  # noqa: E402
from ds_autoplan.spec.cluster import GB  # noqa: E402
from ds_autoplan.spec.presets import read_mapping  # noqa: E402
from ds_autoplan.spec.parallel import Offload  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "published_runs.yaml")
CALIBRATION = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "ds_autoplan", "data", "calibration.json")


def load_rows(path: str = DATA) -> list[dict]:
    d = read_mapping(path)
    base = d["defaults"]
    rows = []
    for r in d["runs"]:
        r = {**{k: v for k, v in base.items() if k != "model"}, **r}
        r["model"] = {**base["model"], **r.get("model", {}), "name": r["id"], "num_layers": r["layers"],
                      "hidden": r["hidden"], "heads": r["heads"]}
        for k in ("vocab", "seq_len"):           # per-row model overrides
            if r.get(k):
                r["model"][k] = r[k]
        rows.append(r)
    return rows


def published_time(r: dict) -> float:
    """Seconds per iteration as published, or from Narayanan Eq. 3 for achieved TFLOP/s."""
    meas = r["measured"]
    if "iteration_time_s" in meas:
        return float(meas["iteration_time_s"])
    if "tokens_per_s" in meas:                    # MPT tables: Throughput (T/s), all GPUs
        return r["batch"] * r["model"]["seq_len"] / float(meas["tokens_per_s"])
    if "tokens_per_gpu_per_s" in meas:            # per-GPU token rate (e.g. GPU hours per token)
        return r["batch"] * r["model"]["seq_len"] / (r["gpus"] * float(meas["tokens_per_gpu_per_s"]))
    if "model_tflops_per_gpu" in meas:            # PaLM-style MFU count (Chowdhery et al. App. B)
        return model_flops(r) / (r["gpus"] * meas["model_tflops_per_gpu"] * 1e12)
    B, s, L, h, V = r["batch"], r["model"]["seq_len"], r["layers"], r["hidden"], r["model"]["vocab"]
    F = 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    return F / (r["gpus"] * meas["tflops_per_gpu"] * 1e12)


def model_flops(r: dict) -> float:
    """FLOPs of one iteration by Chowdhery et al. (PaLM) App. B: (6 N + 12 L h s) per token,
    N = the model's parameters without the input embedding."""
    model = load_model(r["model"])
    s = r["model"]["seq_len"]
    N = sum(u.params for u in model.layers) + model.post.params
    return r["batch"] * s * (6 * N + 12 * model.num_layers * model.hidden * s)


def setup(r: dict):
    model = load_model(r["model"])
    base = load_cluster(r["cluster"])
    cluster = load_cluster({**base.__dict__, "num_nodes": max(1, r["gpus"] // base.gpus_per_node)})
    return model, cluster


def layout(r: dict, model, cfg: Config) -> list[int]:
    """Blocks per stage of the row's pipeline: even, or with the embedding and the loss each
    counted as a layer where the row says so (Megatron's --account-for-embedding-in-pipeline-
    split / --account-for-loss-in-pipeline-split)."""
    return split_layers(model.num_layers, cfg.pp * cfg.chunks,
                        bool(r.get("account_for_embedding_in_pipeline_split")),
                        bool(r.get("account_for_loss_in_pipeline_split")))


def candidates(r: dict, model) -> list[Config]:
    """The published configuration with every unpublished knob enumerated."""
    tp, pp, cp = r["tp"], r["pp"], r.get("cp", 1)
    dp = r["gpus"] // (tp * pp * cp)
    B = r["batch"]
    mbs = [r["micro_batch"]] if r.get("micro_batch") else \
        [b for b in (1, 2, 4, 8, 16, 32) if (B // dp) % b == 0]
    slots = model.num_layers + bool(r.get("account_for_embedding_in_pipeline_split")) + \
        bool(r.get("account_for_loss_in_pipeline_split"))
    per_stage = slots // pp
    chunks = [r["chunks"]] if r.get("chunks") else \
        ([1] + [v for v in range(2, per_stage + 1) if pp > 1 and per_stage % v == 0])
    out = []
    for b in mbs:
        m = B // (dp * b)
        for v in chunks:
            if v > 1 and m % pp:          # Megatron's interleaving needs m a multiple of pp
                continue
            out.append(Config(tp=tp, pp=pp, dp=dp, cp=cp, ep=r.get("ep", 1), etp=r.get("etp"),
                              micro_batch=b, num_microbatches=m,
                              zero=r.get("zero", 0), offload=Offload.parse(r.get("offload") or "none"),
                              recompute=r["recompute"],
                              sp=bool(r.get("sequence_parallel")), chunks=v))
    return out


def cost_model(r: dict, model, cluster, sustained: float | None = None) -> CostModel:
    """The row's cost model: its engine's execution model; ``sustained`` replaces the GPU
    kind's constant (None: the per-kind prior of data/gpus.yaml, uncalibrated)."""
    # router imbalance as the run set it: tokens padded to the expert capacity (Megatron's
    # --moe-pad-expert-input-to-capacity) make every expert hold capacity_factor x the mean
    imb = {"moe_imbalance": float(r["moe_capacity_factor"])} if r.get("moe_capacity_factor") else {}
    cm = CostModel(model, cluster, r["precision"], r.get("runtime", "any"), execution=execution(r), **imb)
    if cm.gpu is not None:                 # keeps the row's attention-kernel generation
        prior = get_gpu(cluster.gpu, calibrated=False)
        cm.gpu = dataclasses.replace(cm.gpu, sustained=prior.sustained if sustained is None else sustained)
    return cm


def execution(r: dict):
    """The row's execution model: its engine, overlaps, published gradient-reduction dtype,
    attention-kernel generation, optimizer implementation and MoE token dispatch (the switches
    `ds-autoplan cost` takes: --execution --overlap --grad-reduce-dtype --attention-kernel
    --optimizer --moe-dispatch)."""
    return get_execution(r.get("execution"), r.get("overlap"), r.get("grad_reduce_dtype"),
                         r.get("attention_kernel"), r.get("optimizer"), r.get("moe_dispatch"))


def unpublished_rule(costed: list):
    """Of (cfg, cost) for every accepted value of the unpublished knobs, the one of median
    predicted time among those that fit (the lower median; all of them when none fits):
    neither the fastest (optimistic) nor the slowest choice."""
    fit = [x for x in costed if x[1].fits] or costed
    fit.sort(key=lambda x: x[1].time)
    return fit[(len(fit) - 1) // 2], len(fit)


# GPU kinds whose allocatable memory was measured (bench/gpu_memory_check.py measure)
MEMORY_MEASUREMENTS = {"h100-sxm-80gb": "gpu_memory_h100.json"}


def device_limit(cluster) -> float:
    """Bytes of modelled allocations one device of ``cluster`` can hold, from the measurement of
    its GPU kind: what PyTorch sees less what goes outside its caching allocator (CUDA context,
    cuBLAS, flash-attention workspaces), divided by the allocator's reserved/allocated peak ratio
    under a 1F1B-like stash pattern (H100: (79.18 - 0.68) / 1.021 = 76.86 GiB).  NCCL's buffers
    are not subtracted: they were not measured (0.54-0.69 GB per process group for a 4 MB
    all-reduce on 4 NVLink A100s, NVIDIA/nccl#964; shared between communicators split with
    shared resources, nccl#986), so this is an upper bound: a modelled peak above it contradicts
    a run that happened.  A published configuration ran -- a fact; the planner's budget
    (cost/memory.usable_budget: reserve and headroom) is policy.  Kinds without a measurement
    keep the planner's budget."""
    name = MEMORY_MEASUREMENTS.get(cluster.gpu)
    if name is None:
        return usable_budget(cluster)[0]
    with open(os.path.join(os.path.dirname(DATA), name)) as f:
        m = json.load(f)
    slack = m["pipeline"]["max_reserved_gib"] / m["pipeline"]["max_allocated_gib"]
    return (m["total_gib"] - m["outside_allocator_gib"]) / slack * GB


def cost_published(r: dict, sustained: float | None = None, cfg: Config | None = None):
    """((cfg, cost), cluster, choices): the published configuration costed and judged against
    the device's measured limit (:func:`device_limit`); ``cfg`` fixes the unpublished knobs
    (else :func:`unpublished_rule` chooses them)."""
    model, cluster = setup(r)
    cm = cost_model(r, model, cluster, sustained)
    E = device_limit(cluster)
    if cfg is not None:
        return (cfg, config_cost(cm, cfg, E, layout(r, model, cfg))), cluster, 1
    best, n = unpublished_rule([(c, config_cost(cm, c, E, layout(r, model, c))) for c in candidates(r, model)])
    return best, cluster, n


def kind_of(r: dict) -> str:
    return _gpu_of(r["cluster"])


@functools.lru_cache(maxsize=None)
def _gpu_of(cluster: str) -> str:
    return load_cluster(cluster).gpu


def predicted_time(r: dict, sustained: float, cfg: Config, memo: dict | None = None) -> float:
    """Seconds per iteration of row ``r``'s configuration ``cfg`` at ``sustained``; ``memo``
    (one per cross-validation: the rows do not change within it) keeps what was costed, for
    the bisections of the leave-one-source-out calibrations retrace each other's steps."""
    if memo is None:
        return cost_published(r, sustained, cfg)[0][1].time
    key = (r["id"], sustained, cfg)
    if key not in memo:
        memo[key] = cost_published(r, sustained, cfg)[0][1].time
    return memo[key]


def calibrate(rows: list, cfgs: dict, prior: dict, memo: dict | None = None) -> dict:
    """Per GPU kind, the ``sustained`` at which the median signed log error of that kind's
    ``rows`` is zero (bisection; predicted time falls as it rises); kinds without rows keep
    ``prior``."""
    out = dict(prior)
    for kind in sorted({kind_of(r) for r in rows}):
        rs = [r for r in rows if kind_of(r) == kind]
        lo, hi = 0.5, 1.2
        for _ in range(16):
            mid = (lo + hi) / 2
            e = statistics.median(math.log(published_time(r) / predicted_time(r, mid, cfgs[r["id"]], memo))
                                  for r in rs)
            lo, hi = (lo, mid) if e > 0 else (mid, hi)   # published slower: lower the rate
        out[kind] = round((lo + hi) / 2, 4)
    return out


def error(r: dict, sustained: dict, cfg: Config, memo: dict | None = None) -> float:
    return published_time(r) / predicted_time(r, sustained[kind_of(r)], cfg, memo) - 1.0


def cross_validate(rows: list, cfgs: dict, prior: dict) -> tuple[dict, dict, dict]:
    """(calibration on all sources, in-file errors by row id, LOSO errors by row id)."""
    memo: dict = {}
    full = calibrate(rows, cfgs, prior, memo)
    infile = {r["id"]: error(r, full, cfgs[r["id"]], memo) for r in rows}
    loso = {}
    for src in sorted({r["source_id"] for r in rows}):
        cal = calibrate([r for r in rows if r["source_id"] != src], cfgs, prior, memo)
        for r in rows:
            if r["source_id"] == src:
                loso[r["id"]] = error(r, cal, cfgs[r["id"]], memo)
    return full, infile, loso


def bands(rows: list, loso: dict) -> dict:
    """Expected error bands from the LOSO errors: overall and per execution model (median and
    max |error|, signed median, rows)."""
    def band(ids):
        e = [loso[i] for i in ids]
        return {"median_abs": round(statistics.median(abs(x) for x in e), 4),
                "max_abs": round(max(abs(x) for x in e), 4),
                "median_signed": round(statistics.median(e), 4), "rows": len(e)}
    out = {"all": band([r["id"] for r in rows])}
    for ex in sorted({r.get("execution", "any") for r in rows}):
        out[ex] = band([r["id"] for r in rows if r.get("execution", "any") == ex])
    return out


def free_choice(r: dict, cluster):
    """The planner's own plan for the row's model, machine and batch under the row's execution
    model (engine and stack, as `cost --execution ...` would), re-checked in memory."""
    from ds_autoplan.search import search
    model = load_model(r["model"])
    try:
        res = search(model, cluster, r["batch"], precision=r["precision"], wide=False,
                     baselines=False, keep_sim=False, execution=execution(r))
    except SpecError as e:
        return None, str(e).split(";")[0][:70]
    p = res.plan
    cfg = Config(**p.parallel.with_(chunks=2 if p.schedule == "interleaved" else 1).as_dict(),
                 recompute="full" if any(x > 0 for x in p.recompute_per_stage) else "none")
    cm = CostModel(model, cluster, r["precision"], execution=execution(r))
    check = config_cost(cm, cfg, p.predicted.memory_budget_gb * GB)
    over = max(p.predicted.peak_memory_gb_per_stage) * GB > p.predicted.memory_budget_gb * GB * (1 + 1e-9)
    # independent re-check where the closed form models the schedule exactly (1F1B or
    # Megatron's interleaving, no partial recompute; the search splits layers unevenly, so
    # the closed form's even split may differ by a layer: 2% slack)
    if p.schedule in ("1f1b", "interleaved") and cfg.recompute == "none" and p.pp == 1:
        over = over or max(check.peak) > p.predicted.memory_budget_gb * GB * 1.02
    return {"config": f"tp{p.tp} pp{p.pp} dp{p.dp} z{p.zero_stage} mbs{p.micro_batch_size} {p.schedule}"
                      f"{' sp' if p.sequence_parallel else ''}",
            "time": p.predicted.iteration_time_s, "over_budget": bool(over),
            "peak_gb": max(p.predicted.peak_memory_gb_per_stage)}, None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="free choice only up to 64 GPUs (< 60 s)")
    ap.add_argument("--json", help="write the rows and summary here")
    ap.add_argument("--data", default=DATA, help="the published-runs YAML")
    ap.add_argument("--write", action="store_true",
                    help=f"store the calibration and LOSO bands in {os.path.relpath(CALIBRATION)}")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    every = load_rows(a.data)
    data = [r for r in every if r.get("costed", True)]
    skipped = [{"id": r["id"], "source": r["source"], "why": r["not_costed"]} for r in every
               if not r.get("costed", True)]
    prior = {k: g.sustained for k, g in gpu_kinds(calibrated=False).items()}
    cfgs, nchoice, fits = {}, {}, {}
    for r in data:                         # unpublished knobs: chosen once, under the prior
        (cfg, c), _, n = cost_published(r)
        cfgs[r["id"]], nchoice[r["id"]] = cfg, n
    full, infile, loso = cross_validate(data, cfgs, prior)
    rows, over, infeasible = [], 0, 0
    hdr = (f"{'run':16s} {'GPUs':>5s} {'engine':>13s} {'tp/pp/dp':>9s} {'cp/ep':>5s} {'mbs':>3s} {'v':>2s} {'knobs':>6s} {'recompute':>9s} "
           f"{'published':>9s} {'predicted':>9s} {'error':>7s} {'LOSO':>7s} {'peak/limit GB':>15s}  free choice")
    print(hdr)
    print("-" * len(hdr))
    for r in data:
        pub = published_time(r)
        (cfg, c), cluster, _ = cost_published(r, full[kind_of(r)], cfgs[r["id"]])
        infeasible += not c.fits
        budget = device_limit(cluster) / GB
        fc, why = (None, "skipped (--quick)") if a.quick and r["gpus"] > 64 else free_choice(r, cluster)
        if fc:
            over += fc["over_budget"]
            ftxt = f"{fc['config']}: {fc['time']:.2f} s ({pub / fc['time']:.2f}x published)" + \
                (" OVER BUDGET" if fc["over_budget"] else "")
        else:
            ftxt = why
        published = bool(r.get("micro_batch") and r.get("chunks"))
        chose = "published" if published else f"median of {nchoice[r['id']]} that fit"
        knobs = "pub" if published else f"med/{nchoice[r['id']]}"
        print(f"{r['id']:16s} {r['gpus']:5d} {r.get('execution', 'any'):>13s} {cfg.tp:>3d}/{cfg.pp}/{cfg.dp:<3d} {f'{cfg.cp}/{cfg.ep}':>5s} "
              f"{cfg.micro_batch:3d} {cfg.chunks:2d} {knobs:>6s} {cfg.recompute:>9s} {pub:8.2f}s {c.time:8.2f}s "
              f"{100 * infile[r['id']]:+6.1f}% {100 * loso[r['id']]:+6.1f}% "
              f"{max(c.peak) / GB:6.1f}/{budget:5.1f}{'' if c.fits else ' OOM'}  {ftxt}")
        rows.append({"id": r["id"], "source": f"{r['source']}, row {r['row']}", "source_id": r["source_id"],
                     "execution": r.get("execution", "any"), "gpu": kind_of(r), "published_s": pub,
                     "predicted_s": c.time, "error": infile[r["id"]], "loso_error": loso[r["id"]],
                     "micro_batch": cfg.micro_batch, "chunks": cfg.chunks,
                     "unpublished_choice": chose, "fits": c.fits, "peak_gb": max(c.peak) / GB,
                     "unverified": r.get("unverified"), "free_choice": fc})
    for x in skipped:
        print(f"{x['id']:16s} not costed: {x['why'][:110]}...")
    print("knobs: pub = micro-batch and chunks as published; med/n = the median-time choice among n that fit "
          "(published_runs.unpublished_rule); calibrated sustained per kind: "
          + ", ".join(f"{k} {v:.3f} (prior {prior[k]:.3f})" for k, v in full.items() if v != prior[k]))
    abs_err = [abs(e) for e in infile.values()]
    abs_loso = [abs(e) for e in loso.values()]
    bnd = bands(data, loso)
    kind_sources = {}
    for r in data:
        kind_sources.setdefault(kind_of(r), set()).add(r["source_id"])
    multi = [abs(loso[r["id"]]) for r in data if len(kind_sources[kind_of(r)]) >= 2]
    summary = {"median_abs_error": round(statistics.median(abs_err), 4), "max_abs_error": round(max(abs_err), 4),
               "loso_median_abs_error": round(statistics.median(abs_loso), 4),
               "loso_max_abs_error": round(max(abs_loso), 4),
               # rows whose GPU kind another source also covers (a single-source kind's LOSO
               # prediction is its measured per-kind prior alone)
               "loso_max_abs_error_multi_source_kinds": round(max(multi), 4) if multi else None,
               "sources": len({r["source_id"] for r in data}),
               "rows": len(rows), "not_costed": len(skipped), "free_choice_over_budget": over, "published_infeasible": infeasible,
               "wall_s": round(time.perf_counter() - t0, 1)}
    if a.write:
        with open(CALIBRATION, "w") as f:
            json.dump({"written_by": "bench/published_runs.py --write",
                       "sustained": {k: v for k, v in full.items() if v != prior[k]},
                       "sustained_sources": {k: sorted({r["source_id"] for r in data if kind_of(r) == k})
                                             for k, v in full.items() if v != prior[k]},
                       "bands": bnd, "sources": sorted({r["source_id"] for r in data})}, f, indent=1)
            f.write("\n")
    return M.publish(summary, rows + [{"not_costed": skipped}], a.json)


if __name__ == "__main__":
    sys.exit(main())
