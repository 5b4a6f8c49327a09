"""DeepSpeed engine benchmark: iteration time and peak activation bytes per rank of
DeepSpeed's TrainSchedule (1F1B) and DualPipeVSchedule and of ds_autoplan's V-Min, V-Half,
V-ZB and adaptive (with a memory cap) run in DeepSpeed's PipelineEngine, on 4 CPU ranks
with calibrated-sleep layers (F:B:W = 1:1:1 and 1:1.2:0.8), next to the simulator's
predictions.  Ratios are to TrainSchedule, per round of the same run: every
round times one iteration of every schedule (after a warm-up round), figures are medians
with their min-max spread (``bench/_measure.py``).

The simulator gets the runtime's own overheads, measured once per runtime in
every round, so they see the same load as the timed steps: the one-way p2p time of an
activation, the once-per-iteration work (gradient reduction and optimizer step, timed inside
the engine) and the dispatch time per compute action, fitted so that null-model iterations
(sleep layers at zero) of the runtime's reference schedules are reproduced -- TrainSchedule
for DeepSpeed's own schedules, 1F1B (fused backward) and V-ZB (split B/W) for ds_autoplan's.

    python bench/engine_deepspeed.py [--quick] [--n 8] [--unit-ms 25] [--iters 5]

The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _measure as M  # noqa: E402

SCHEDULES = ["ds-train", "ds-dualpipev", "v-min", "v-half", "v-zb", "adaptive"]
RATIOS = {"1:1:1": (1.0, 1.0, 1.0), "1:1.2:0.8": (1.0, 1.2, 0.8)}
INNER = 15          # a layer keeps 1 + INNER copies of its input; the loss stage 2 more
# per runtime: the schedules its dispatch time is fitted on (fused and split backward)
NULL = {"ds": ["ds-train"], "ours": ["1f1b", "v-zb"]}
# once-per-iteration instructions: DeepSpeed's instruction class -> the engine method
_STEP_INSTR = {"ReduceTiedGrads": "_exec_reduce_tied_grads", "ReduceGrads": "_exec_reduce_grads",
               "OptimizerStep": "_exec_optimizer_step"}


# ----------------------------------------------------------------------------- worker side
def _engine(name, d, n, fbw, unit, cfg):
    """(engine, memory tracker) of one schedule; ``fbw`` x ``unit`` per 1F1B stage."""
    import deepspeed
    import torch
    import torch.nn.functional as F

    from ds_autoplan.models.sleep import SleepLayer
    from ds_autoplan.runtime.deepspeed.api import initialize
    from ds_autoplan.runtime.memtrack import MemTracker
    from ds_autoplan.schedule import build

    def opt(params):
        return torch.optim.SGD(params, lr=1e-3)
    f, b, w = fbw
    L = 2 * d
    # a stage of the 1F1B model holds 2 layers (d ranks, 2d layers); V stages hold 1
    layers = [SleepLayer(f * unit / 2, b * unit / 2, w * unit / 2, inner=INNER) for _ in range(L)]
    if name.startswith("ds-"):
        from deepspeed.pipe import PipelineModule
        from deepspeed.runtime.pipe.dualpipev import DualPipeVModule
        cls = DualPipeVModule if name == "ds-dualpipev" else PipelineModule
        mod = cls(layers=layers, num_stages=d, loss_fn=F.mse_loss, partition_method="uniform")
        engine, *_ = deepspeed.initialize(model=mod, config=cfg, optimizer=opt,
                                          model_parameters=list(mod.parameters()))
        return engine, MemTracker(exclude=list(mod.parameters()))
    opts = {"mem_cap": 0.75 * d, "f": f, "b": b, "w": w} if name == "adaptive" else {}
    sched = build(name, d, n, **opts)
    S = sched.num_stages
    plan = {"pp": d, "dp": 1, "micro_batch_size": 2, "num_microbatches": n,
            "global_batch_size": 2 * n, "precision": "fp32", "schedule": name,
            "schedule_options": opts, "layers_per_stage": [L // S] * S,
            "recompute_per_stage": [0.0] * S}
    engine, *_ = initialize(layers, plan, schedule=sched, loss_fn=F.mse_loss, optimizer=opt,
                            config=cfg, track_memory=True)
    return engine, None


def _step_timer(engine) -> list:
    """Time the engine's once-per-iteration instructions (gradient reductions, optimizer
    step); returns the list whose first item accumulates their seconds."""
    acc = [0.0]

    def wrap(fn):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                acc[0] += time.perf_counter() - t0
        return timed
    # DeepSpeed's engines run them from their instruction map, ds_autoplan's by method
    engine._INSTRUCTION_MAP = {k: wrap(f) if k.__name__ in _STEP_INSTR else f
                               for k, f in type(engine)._INSTRUCTION_MAP.items()}
    for method in _STEP_INSTR.values():
        setattr(engine, method, wrap(getattr(engine, method)))
    return acc


def _stepper(engine, tracker, data):
    def step():
        if tracker is None:                 # ds_autoplan's adapter tracks by itself
            engine.train_batch(iter(data))
            return
        tracker.reset_peak()
        with tracker.track():
            engine.train_batch(iter(data))
    return step


def bench_rows(outs) -> list:
    """The ``BENCH`` rows the ranks printed (``spawn``'s ``(rc, output)`` per rank); a failed
    rank ends the benchmark with its output's tail."""
    rows = []
    for rc, out in outs:
        if rc != 0:
            print(out[-3000:], file=sys.stderr)
            raise SystemExit(f"a benchmark rank failed (rc {rc})")
        rows += [json.loads(ln[6:]) for ln in out.splitlines() if ln.startswith("BENCH ")]
    return rows


def setup(args):
    """A rank's set-up (one thread, the process group): (d, rank, n, unit seconds, the
    micro-batches, the DeepSpeed config)."""
    import torch

    from ds_autoplan.runtime.deepspeed.dist import init_distributed
    torch.set_num_threads(1)
    init_distributed()
    d, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    n, unit = args.n, args.unit_ms / 1000.0
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(2, 16, 64, generator=g), torch.randn(2, 16, 64, generator=g)) for _ in range(n)]
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": n,
           "train_batch_size": 2 * n, "steps_per_print": 10 ** 9, "gradient_clipping": 0.0,
           "zero_allow_untested_optimizer": True}
    return d, rank, n, unit, data, cfg


def worker(args):
    import torch

    from ds_autoplan.models.sleep import scaled
    d, rank, n, unit, data, cfg = setup(args)
    barrier = torch.distributed.barrier
    refs = [nm for nms in NULL.values() for nm in nms]     # null iterations of these

    def emit(**row):
        print("BENCH " + json.dumps({"rank": rank, **row}), flush=True)
    for rname in args.ratios.split(","):
        names = SCHEDULES + [nm for nm in refs if nm not in SCHEDULES]
        built = {nm: _engine(nm, d, n, RATIOS[rname], unit, cfg) for nm in names}
        acc = {nm: _step_timer(built[nm][0]) for nm in refs}
        times = {nm: [] for nm in names}
        nulls, steps = {nm: [] for nm in refs}, {nm: [] for nm in refs}
        peaks = {nm: 0 for nm in names}
        for r in range(M.WARMUP + args.iters):       # rounds: every schedule once per round
            if r >= M.WARMUP:
                emit(kind="p2p", seconds=M.ping(data[0][0].clone()))
            for nm, (engine, tracker) in built.items():
                step = _stepper(engine, tracker, data)
                if nm in refs:      # the runtime's own time: sleep layers at zero
                    acc[nm][0] = 0.0
                    with scaled(0.0):
                        t = M.timed(step, 1, warmup=0, sync=barrier)
                    if r >= M.WARMUP:
                        nulls[nm] += t
                        steps[nm].append(acc[nm][0])
                if nm in SCHEDULES:
                    t = M.timed(step, 1, warmup=0, sync=barrier)
                    if r >= M.WARMUP:
                        times[nm] += t
                        peaks[nm] = max(peaks[nm], (tracker or engine.memtracker).peak)
        for nm in SCHEDULES:
            emit(kind="run", ratio=rname, schedule=nm, times=times[nm], peak=peaks[nm],
                 act_bytes=data[0][0].numel() * 4)
        for nm in refs:
            emit(kind="null", schedule=nm, times=nulls[nm], step=statistics.median(steps[nm]))
        del built
    barrier()
    torch.distributed.destroy_process_group()


# ----------------------------------------------------------------------------- driver side
def _sched(name, d, n, fbw):
    from ds_autoplan.schedule import build
    if name in ("ds-train", "1f1b"):
        return build("1f1b", d, n)
    opts = {"mem_cap": 0.75 * d, "f": fbw[0], "b": fbw[1], "w": fbw[2]} if name == "adaptive" else {}
    return build(name, d, n, **opts)


def predict(name, d, n, fbw, unit, act, overheads=None):
    """Simulated (iteration seconds, peak activation bytes per rank) with the runtime's
    ``overheads``; None for DualPipeV (no builder of ours)."""
    from ds_autoplan.schedule import Costs, simulate
    if name == "ds-dualpipev":
        return None
    f, b, w = fbw
    sched = _sched(name, d, n, fbw)
    S, L = sched.num_stages, 2 * d
    lay = L // S
    # the loss stage also keeps the loss input and the target until its backward
    mem_f = [act * (1 + INNER) * lay + (2 * act if s == S - 1 else 0) for s in range(S)]
    mem_b = [-2 * act if s == S - 1 else 0.0 for s in range(S)]
    # the first layer's input needs no gradient: no B there (models/sleep.py)
    b_stage = [b * unit * (lay - (s == 0)) / 2 for s in range(S)]
    costs = Costs.per_stage(S, n, f * unit * lay / 2, b_stage, w * unit * lay / 2,
                            mem_f=mem_f, mem_b=mem_b)
    res = simulate(sched, costs.with_overheads(overheads) if overheads else costs)
    return res.makespan, res.peak_memory


def overheads(rows, d, n) -> dict:
    """Per runtime: p2p and step measured, dispatch fitted to its null-model iterations;
    (Overheads, {schedule: null iteration seconds})."""
    from ds_autoplan.schedule import Costs, Overheads
    p2p = statistics.median(r["seconds"] for r in rows if r["kind"] == "p2p" and r["rank"] == 0)
    out = {}
    for rt, names in NULL.items():
        t_null, runs, step = {}, [], 0.0
        for name in names:
            per, by_rank = [r for r in rows if r["kind"] == "null" and r["schedule"] == name], {}
            for r in per:
                by_rank.setdefault(r["rank"], []).extend(r["times"])
            t_null[name] = statistics.median(max(ts) for ts in zip(*by_rank.values()))
            step = max([step] + [r["step"] for r in per])
            sched = _sched(name, d, n, (1, 1, 1))
            runs.append((sched, Costs.uniform(sched, 0.0, 0.0, 0.0), t_null[name]))
        base = Overheads(p2p=p2p, step=step)
        out[rt] = (Overheads(dispatch=M.fit_dispatch(runs, base), p2p=p2p, step=step), t_null)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1:1:1 only, 3 timed rounds (< 60 s)")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--unit-ms", type=float, default=None,
                    help="sleep of one pass (F, B or W) of one 1F1B stage, ms")
    ap.add_argument("--iters", type=int, default=None, help="timed rounds (>= 3)")
    ap.add_argument("--ratios", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.unit_ms = args.unit_ms or (25.0 if args.quick else 30.0)
    args.iters = M.plan_iters(args.quick, args.iters)
    args.ratios = args.ratios or ("1:1:1" if args.quick else ",".join(RATIOS))
    if args.worker:
        return worker(args)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from ds_autoplan.runtime.launch import spawn
    M.prebuild_ops()            # before the clock and outside any kill timeout
    t0 = time.time()
    outs = spawn([os.path.abspath(__file__), "--worker", *(["--quick"] if args.quick else []),
                  "--n", str(args.n), "--unit-ms", str(args.unit_ms), "--iters", str(args.iters),
                  "--ratios", args.ratios], args.ranks, timeout=600)
    rows = bench_rows(outs)
    d, n, unit = args.ranks, args.n, args.unit_ms / 1000.0
    ovs = overheads(rows, d, n)
    runs = {}
    for r in rows:
        if r["kind"] == "run":
            runs.setdefault((r["ratio"], r["schedule"]), []).append(r)
    rep = M.Report(args.iters)
    print(f"{'F:B:W':10} {'schedule':14} {'iter s':>8} {'spread':>13} {'sim s':>8} {'ideal':>7} "
          f"{'thr x':>6} {'peak B':>9} {'sim B':>9} {'mem x':>6}")
    keys = {"v-zb": "v_zb_throughput_vs_trainschedule", "ds-dualpipev":
            "dualpipev_throughput_vs_trainschedule", "adaptive": "adaptive_throughput_vs_trainschedule"}
    mkeys = {"v-half": "v_half_mem_vs_trainschedule", "v-min": "v_min_mem_vs_trainschedule"}
    for rname in args.ratios.split(","):
        fbw, sfx = RATIOS[rname], "" if rname == "1:1:1" else "_" + rname.replace(":", "_")
        per_round = {nm: [max(ts) for ts in zip(*(r["times"] for r in runs[(rname, nm)]))]
                     for nm in SCHEDULES}
        peak = {nm: max(r["peak"] for r in runs[(rname, nm)]) for nm in SCHEDULES}
        act = runs[(rname, "ds-train")][0]["act_bytes"]
        pred = {nm: predict(nm, d, n, fbw, unit, act, ovs["ds" if nm.startswith("ds-") else "ours"][0])
                for nm in SCHEDULES}
        ideal = {nm: predict(nm, d, n, fbw, unit, act) for nm in SCHEDULES}
        for nm in SCHEDULES:
            ts, p, i = per_round[nm], pred[nm], ideal[nm]
            thr = M.ratio(per_round["ds-train"], ts, paired=True)
            mem = peak[nm] / peak["ds-train"]
            if p:
                rep.sim_error(f"{rname} {nm} time", ts, p[0])
                rep.errors[f"{rname} {nm} memory"] = round(abs(peak[nm] - max(p[1])) / max(p[1]), 3)
            ceil = max(ideal["ds-train"][0] / i[0], pred["ds-train"][0] / p[0]) if p else None
            if nm in keys and (sfx == "" or nm == "v-zb"):
                rep.add(keys[nm] + sfx, thr, (None, ceil) if ceil else None)
            if nm in mkeys and sfx == "":
                floor = min(max(i[1]) / max(ideal["ds-train"][1]), max(p[1]) / max(pred["ds-train"][1]))
                rep.add(mkeys[nm], (mem, mem, mem), (floor, None))
            med, lo, hi = M.figure(ts)
            print(f"{rname:10} {nm:14} {med:8.3f} {lo:6.3f}-{hi:6.3f} "
                  f"{p[0] if p else float('nan'):8.3f} {i[0] if i else float('nan'):7.3f} "
                  f"{thr[0]:6.2f} {peak[nm]:9d} {max(p[1]) if p else float('nan'):9.0f} {mem:6.2f}")
    o = rep.out
    goals = {"max_sim_error<=0.10": max(rep.errors.values()) <= 0.10,
             "v_zb_throughput>=1.2": o["v_zb_throughput_vs_trainschedule"] >= 1.2,
             "v_half_mem<=0.8": o["v_half_mem_vs_trainschedule"] <= 0.8,
             "v_min_mem<=0.55": o["v_min_mem_vs_trainschedule"] <= 0.55}
    print("runtime overheads (ms): " + "; ".join(
        f"{rt}: " + ", ".join(f"{k} {v * 1e3:.3f}" for k, v in ov.to_dict().items())
        + " (null iterations " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in t.items()) + ")"
        for rt, (ov, t) in ovs.items()))
    print(json.dumps(rep.finish(goals, ranks=d, n=n, unit_ms=args.unit_ms,
                                overheads_ms={rt: {k: round(v * 1e3, 3) for k, v in ov.to_dict().items()}
                                              for rt, (ov, _) in ovs.items()},
                                wall_s=round(time.time() - t0, 1))))


if __name__ == "__main__":
    main()
