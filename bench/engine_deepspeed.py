"""DeepSpeed engine benchmark: iteration time and peak activation bytes per rank of
DeepSpeed's TrainSchedule (1F1B) and DualPipeVSchedule and of ds_autoplan's V-Min, V-Half,
V-ZB and adaptive (with a memory cap) run in DeepSpeed's PipelineEngine, on 4 CPU ranks
with calibrated-sleep layers (F:B:W = 1:1:1 and 1:1.2:0.8), next to the simulator's
predictions (issue 4).  Ratios are to TrainSchedule from the same run.

    python bench/engine_deepspeed.py [--quick] [--n 8] [--unit-ms 10]

The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

SCHEDULES = ["ds-train", "ds-dualpipev", "v-min", "v-half", "v-zb", "adaptive"]
RATIOS = {"1:1:1": (1.0, 1.0, 1.0), "1:1.2:0.8": (1.0, 1.2, 0.8)}
INNER = 15          # a layer keeps 1 + INNER copies of its input; the loss stage 2 more


# ----------------------------------------------------------------------------- worker side
def _sleep_layer_cls():
    import torch

    from ds_autoplan.runtime.splitgrad import defer

    def weight_pass(x, inner, s, layer):
        time.sleep(layer.tw)           # the deferred weight-gradient work
        return [(layer.p, s)]

    class _Sleep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, p, layer):
            time.sleep(layer.tf)
            inner = x.repeat(1, 1, INNER)     # stands for a layer's internal activations
            ctx.save_for_backward(x, p, inner)
            ctx.layer = layer
            return x * p

        @staticmethod
        def backward(ctx, go):
            x, p, inner = ctx.saved_tensors
            layer = ctx.layer
            time.sleep(layer.tb)
            s = (go * x).sum().reshape(1)
            # W keeps the activations until it runs (the paper's memory model: a_B = 0)
            if defer(weight_pass, x, inner, s, layer=layer):
                return go * p, None, None
            time.sleep(layer.tw)
            return go * p, s, None

    class SleepLayer(torch.nn.Module):
        """y = p * x; F, B (input grad) and W (weight grad) sleep tf, tb, tw seconds."""

        def __init__(self, tf, tb, tw):
            super().__init__()
            self.p = torch.nn.Parameter(torch.ones(1))
            self.tf, self.tb, self.tw = tf, tb, tw

        def forward(self, x):
            return _Sleep.apply(x, self.p, self)
    return SleepLayer


def worker(args):
    import deepspeed
    import torch
    import torch.nn.functional as F

    from ds_autoplan.runtime.deepspeed.api import initialize
    from ds_autoplan.runtime.memtrack import MemTracker
    from ds_autoplan.schedule import build
    from ds_autoplan.runtime.deepspeed.dist import init_distributed
    torch.set_num_threads(1)
    init_distributed()
    d, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    SleepLayer = _sleep_layer_cls()
    L, n, unit = 2 * d, args.n, args.unit_ms / 1000.0
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(2, 16, 64, generator=g), torch.randn(2, 16, 64, generator=g)) for _ in range(n)]
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": n,
           "train_batch_size": 2 * n, "steps_per_print": 10 ** 9, "gradient_clipping": 0.0,
           "zero_allow_untested_optimizer": True}

    def opt(params):
        return torch.optim.SGD(params, lr=1e-3)

    for rname in args.ratios.split(","):
        f, b, w = RATIOS[rname]
        for name in SCHEDULES:
            # a stage of the 1F1B model holds 2 layers (d ranks, 2d layers); V stages hold 1
            layers = [SleepLayer(f * unit / 2, b * unit / 2, w * unit / 2) for _ in range(L)]
            if name.startswith("ds-"):
                from deepspeed.pipe import PipelineModule
                from deepspeed.runtime.pipe.dualpipev import DualPipeVModule
                cls = DualPipeVModule if name == "ds-dualpipev" else PipelineModule
                mod = cls(layers=layers, num_stages=d, loss_fn=F.mse_loss, partition_method="uniform")
                engine, *_ = deepspeed.initialize(model=mod, config=cfg, optimizer=opt,
                                                  model_parameters=list(mod.parameters()))
                tracker = MemTracker(exclude=list(mod.parameters()))
            else:
                opts = {"mem_cap": 0.75 * d, "f": f, "b": b, "w": w} if name == "adaptive" else {}
                sched = build(name, d, n, **opts)
                S = sched.num_stages
                plan = {"pp": d, "dp": 1, "micro_batch_size": 2, "num_microbatches": n,
                        "global_batch_size": 2 * n, "precision": "fp32", "schedule": name,
                        "schedule_options": opts, "layers_per_stage": [L // S] * S,
                        "recompute_per_stage": [0.0] * S}
                engine, *_ = initialize(layers, plan, schedule=sched, loss_fn=F.mse_loss,
                                        optimizer=opt, config=cfg, track_memory=True)
                tracker = engine.memtracker
            times, peaks = [], []
            warm = 0 if args.quick else 1
            for it in range(args.iters + warm):
                torch.distributed.barrier()
                t0 = time.perf_counter()
                if name.startswith("ds-"):
                    tracker.reset_peak()
                    with tracker.track():
                        engine.train_batch(iter(data))
                else:
                    engine.train_batch(iter(data))
                times.append(time.perf_counter() - t0)
                peaks.append(tracker.peak)
            res = {"ratio": rname, "schedule": name, "rank": rank,
                   "iter_time": min(times[warm:]), "peak": max(peaks[warm:]),
                   "act_bytes": data[0][0].numel() * 4}
            print("BENCH " + json.dumps(res), flush=True)
            del engine
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


# ----------------------------------------------------------------------------- driver side
def predict(name, d, n, fbw, unit, act):
    """Simulated (iteration seconds, peak activation bytes per rank); None for DualPipeV."""
    from ds_autoplan.schedule import Costs, build, simulate
    if name == "ds-dualpipev":
        return None
    f, b, w = fbw
    if name == "ds-train":
        sched = build("1f1b", d, n)
    else:
        opts = {"mem_cap": 0.75 * d, "f": f, "b": b, "w": w} if name == "adaptive" else {}
        sched = build(name, d, n, **opts)
    S, L = sched.num_stages, 2 * d
    lay = L // S
    # the loss stage also keeps the loss input and the target until its backward
    mem_f = [act * (1 + INNER) * lay + (2 * act if s == S - 1 else 0) for s in range(S)]
    mem_b = [-2 * act if s == S - 1 else 0.0 for s in range(S)]
    costs = Costs.per_stage(S, n, f * unit * lay / 2, b * unit * lay / 2, w * unit * lay / 2,
                            mem_f=mem_f, mem_b=mem_b)
    res = simulate(sched, costs)
    return res.makespan, res.peak_memory


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1:1:1 only, 2 timed iterations (< 60 s)")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--unit-ms", type=float, default=None,
                    help="sleep of one pass (F, B or W) of one 1F1B stage, ms")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--ratios", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.unit_ms = args.unit_ms or (25.0 if args.quick else 30.0)
    args.iters = args.iters or (2 if args.quick else 4)
    args.ratios = args.ratios or ("1:1:1" if args.quick else ",".join(RATIOS))
    if args.worker:
        return worker(args)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from ds_autoplan.runtime.launch import spawn
    t0 = time.time()
    outs = spawn([os.path.abspath(__file__), "--worker", *(["--quick"] if args.quick else []),
                  "--n", str(args.n), "--unit-ms", str(args.unit_ms), "--iters", str(args.iters), "--ratios", args.ratios],
                 args.ranks, timeout=600)
    rows = {}
    for rc, out in outs:
        if rc != 0:
            print(out[-3000:], file=sys.stderr)
            raise SystemExit(f"a benchmark rank failed (rc {rc})")
        for line in out.splitlines():
            if line.startswith("BENCH "):
                r = json.loads(line[6:])
                rows.setdefault((r["ratio"], r["schedule"]), {})[r["rank"]] = r
    d, unit = args.ranks, args.unit_ms / 1000.0
    summary, errs = {}, []
    print(f"{'F:B:W':10} {'schedule':14} {'iter s':>8} {'sim s':>8} {'thr x':>6} "
          f"{'peak B':>9} {'sim B':>9} {'mem x':>6}")
    for rname in args.ratios.split(","):
        base = rows[(rname, "ds-train")]
        t_base = max(r["iter_time"] for r in base.values())
        m_base = max(r["peak"] for r in base.values())
        for name in SCHEDULES:
            rr = rows[(rname, name)]
            t = max(r["iter_time"] for r in rr.values())
            m = max(r["peak"] for r in rr.values())
            act = next(iter(rr.values()))["act_bytes"]
            pred = predict(name, d, args.n, RATIOS[rname], unit, act)
            st, sm = (pred[0], max(pred[1])) if pred else (float("nan"), float("nan"))
            if pred:
                errs += [abs(t - st) / st, abs(m - sm) / sm]
            summary[(rname, name)] = {"thr": t_base / t, "mem": m / m_base}
            print(f"{rname:10} {name:14} {t:8.3f} {st:8.3f} {t_base / t:6.2f} {m:9d} {sm:9.0f} "
                  f"{m / m_base:6.2f}")
    out = {"v_zb_throughput_vs_trainschedule": round(summary[("1:1:1", "v-zb")]["thr"], 3),
           "v_half_mem_vs_trainschedule": round(summary[("1:1:1", "v-half")]["mem"], 3),
           "v_min_mem_vs_trainschedule": round(summary[("1:1:1", "v-min")]["mem"], 3),
           "dualpipev_throughput_vs_trainschedule": round(summary[("1:1:1", "ds-dualpipev")]["thr"], 3),
           "adaptive_throughput_vs_trainschedule": round(summary[("1:1:1", "adaptive")]["thr"], 3),
           "max_sim_error": round(max(errs), 3), "ranks": d, "n": args.n,
           "unit_ms": args.unit_ms, "wall_s": round(time.time() - t0, 1)}
    if "1:1.2:0.8" in args.ratios:
        out["v_zb_throughput_vs_trainschedule_1_1.2_0.8"] = round(summary[("1:1.2:0.8", "v-zb")]["thr"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
