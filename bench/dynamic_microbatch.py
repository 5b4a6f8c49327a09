"""Dynamic micro-batching benchmark (DynaPipe).

For global batches drawn from the shipped real length distribution
(ds_autoplan/data/text_lengths.tsv) it compares, per iteration:

  packing            rows of max_len, 1 row per micro-batch, 1F1B
  fixed              fixed micro-batch size (best of 1,2,4,8 that fits memory), 1F1B
  token              token budget per micro-batch (best of several that fit), 1F1B
  dynapipe-1f1b      DynaPipe DP micro-batches, 1F1B order
  dynapipe-adaptive  DynaPipe DP micro-batches, adaptive cyclic schedule (§5.5)

Times: (1) simulated with the cost model (ds_autoplan.dynamic.cost, GPT-like layer on an
A100-class device; ms); (2) real on CPU: every iteration's lowered per-rank lists are
executed by one thread per pipeline rank (in one process), each compute action sleeping
its cost-model time scaled by --ms-per-unit (sleep overhead calibrated), transfers through
queues in the planned order, while a background worker (process by default) plans the
next iteration; (3) with --real-multiproc, real on CPU processes: one gloo rank per pipeline
stage runs every plan in DeepSpeed's PipelineEngine (ds_autoplan.runtime.deepspeed.dynamic:
the plan's micro-batch count, padded shapes and lowered schedule), each stage one layer
whose forward and backward sleep the cost-model time of the micro-batch's shape; plans are
made before the timed steps.
Planning time per iteration is the DynaPipe planner's (DP, schedule search over
micro-batch orders, lowering) CPU time on one core of this machine (thread CPU time, so
other load on the machine does not inflate it; wall time is reported too);
planning_fraction divides it by the simulated iteration time.  The last line is a JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _measure as M  # noqa: E402
from ds_autoplan.dynamic.cost import CostModel  # noqa: E402
from ds_autoplan.dynamic.lengths import LengthSampler  # noqa: E402
from ds_autoplan.dynamic.microbatch import fixed_split, token_split  # noqa: E402
from ds_autoplan.dynamic.planner import IterationPlanner, Prefetcher  # noqa: E402
from ds_autoplan.dynamic.replay import run_threads  # noqa: E402


def planners(cost: CostModel, S: int, max_len: int, mem_cap: float, device_mem: float,
             batches: list[np.ndarray]) -> dict[str, IterationPlanner]:
    """The five methods; fixed/token pick the best setting that fits the memory cap."""
    def best(fn, values, key):
        ok = []
        for v in values:
            plans = [fn(b, cost, S, v) for b in batches]
            if all(cost.memory(m.mbs, m.seqlen) <= mem_cap for p in plans for m in p.microbatches):
                ok.append((np.mean([p.objective for p in plans]), v))
        return {key: min(ok)[1]} if ok else {key: values[0]}

    one = dict(schedule="1f1b", device_mem=device_mem)
    dp = dict(mem_cap=mem_cap)
    return {
        "packing": IterationPlanner(cost, S, "packing", split_opts={"max_len": max_len}, **one),
        "fixed": IterationPlanner(cost, S, "fixed", split_opts=best(fixed_split, [1, 2, 4, 8], "mbs"), **one),
        "token": IterationPlanner(cost, S, "token", split_opts=best(
            token_split, [max_len // 2, max_len, 2 * max_len, 4 * max_len], "max_tokens"), **one),
        "dynapipe-1f1b": IterationPlanner(cost, S, "dynapipe", split_opts=dp, **one),
        "dynapipe-adaptive": IterationPlanner(cost, S, "dynapipe", schedule="dynapipe",
                                              split_opts=dp, device_mem=device_mem),
    }


def _plan_job(job):
    """Top-level (picklable) planning job for the background worker."""
    planner, step, lengths = job
    return planner(lengths, step=step)


def _cost_sleep(cost: CostModel, scale: float):
    """A sleep layer (``models.sleep``) whose forward and backward sleep the cost model's
    time of a [mbs, padded len, 1] input (one pipeline stage), ``scale`` ms per ms."""
    from ds_autoplan.models.sleep import SleepLayer
    return SleepLayer(lambda sh: float(cost.fwd(sh[0], sh[1])) * scale / 1e3,
                      lambda sh: float(cost.bwd(sh[0], sh[1])) * scale / 1e3)


def _multiproc_worker(args, cost, batches, methods, scale) -> None:
    """One rank of --real-multiproc: every method's plans through DeepSpeed's engine."""
    import torch
    import torch.nn.functional as F

    from ds_autoplan.runtime.deepspeed import initialize
    from ds_autoplan.runtime.deepspeed.dist import init_distributed
    from ds_autoplan.runtime.deepspeed.dynamic import static_plan, train_batch
    torch.set_num_threads(1)
    init_distributed()
    d = torch.distributed.get_world_size()
    cfg = {"steps_per_print": 10 ** 9, "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True}

    def shapes(stage, shape):
        return True, [(torch.float32, (int(shape[0]), int(shape[1]), 1))]
    for name, pl in methods.items():
        plans = [pl(b, step=i) for i, b in enumerate(batches)]
        engine, *_ = initialize([_cost_sleep(cost, scale) for _ in range(d)], static_plan(d),
                                loss_fn=F.mse_loss, config=cfg,
                                optimizer=lambda p: torch.optim.SGD(p, lr=1e-3))
        times = []
        for plan in plans:
            data = [(torch.ones(m, L, 1), torch.zeros(m, L, 1)) for m, L in plan.shapes]
            torch.distributed.barrier()
            t0 = time.perf_counter()
            train_batch(engine, plan, iter(data), shapes=shapes, weight="samples")
            times.append(time.perf_counter() - t0)
        print("BENCH " + json.dumps({"method": name, "real_mp_s": float(np.mean(times))}), flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small run (< 60 s on 2 cores)")
    ap.add_argument("--model", choices=["gpt", "t5"], default="gpt")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--attention", choices=["eager", "flash"], default="eager")
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--global-batch", type=int, default=None, help="samples per iteration")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--device-mem-gb", type=float, default=40.0,
                    help="activation memory per device; the DP's per-micro-batch cap is this / stages")
    ap.add_argument("--ms-per-unit", type=float, default=None,
                    help="real run: milliseconds of sleep per simulated millisecond (default 1, "
                         "--quick 0.5)")
    ap.add_argument("--planner-worker", choices=["thread", "process"], default="process",
                    help="background planner for the real run (a process keeps the GIL free)")
    ap.add_argument("--no-real", action="store_true", help="skip the threaded CPU run")
    ap.add_argument("--real-multiproc", action="store_true",
                    help="also run every plan in DeepSpeed's PipelineEngine on --stages CPU ranks")
    ap.add_argument("--mp-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    gbs = args.global_batch or (256 if args.quick else 512)
    if gbs < 1 or args.stages < 1:
        print("error: --global-batch and --stages must be positive", file=sys.stderr)
        return 2
    iters = M.plan_iters(args.quick, args.iters or (None if args.quick else 8))
    sys.setswitchinterval(5e-4)  # a planner *thread* must not delay the rank threads much

    cost = CostModel.gpt(args.hidden, args.heads, args.layers, args.stages,
                         attention=args.attention, encdec=args.model == "t5")
    sampler = LengthSampler("encdec" if args.model == "t5" else "decoder", args.max_len, args.seed)
    batches = [sampler(gbs) for _ in range(iters)]
    warm = sampler(gbs)          # planned once first by every method, not counted
    device_mem = args.device_mem_gb * 2**30
    mem_cap = device_mem / args.stages
    methods = planners(cost, args.stages, args.max_len, mem_cap, device_mem, batches)
    scale = args.ms_per_unit or (0.5 if args.quick else 1.0)
    if args.mp_worker:
        _multiproc_worker(args, cost, batches, methods, scale)
        return 0

    rows, per_it = {}, {}
    for name, pl in methods.items():
        pl(warm)
        plans = [pl(b, step=i) for i, b in enumerate(batches)]
        per_it[name] = {"sim_ms": [p.predicted_ms for p in plans],
                        "plan_cpu_ms": [p.plan_cpu_seconds * 1e3 for p in plans]}
        rows[name] = {
            "setting": pl.split_opts,
            "sim_ms": float(np.mean([p.predicted_ms for p in plans])),
            "microbatches": float(np.mean([p.num_microbatches for p in plans])),
            "padding_efficiency": float(sum(p.split.real_tokens for p in plans)
                                        / sum(p.split.padded_tokens for p in plans)),
            "plan_ms": float(np.mean([p.plan_seconds for p in plans]) * 1e3),
            "plan_cpu_ms": float(np.mean([p.plan_cpu_seconds for p in plans]) * 1e3),
            "peak_mem_gb": float(max(max(p.info["peak_memory"]) for p in plans) / 2**30),
            "fits_device_mem": bool(all(max(p.info["peak_memory"]) <= device_mem for p in plans)),
            "safety_stock": [round(float(x), 2) for x in np.mean(
                [p.info["safety_stock"] for p in plans], axis=0)],
        }
    base = rows["packing"]["sim_ms"]
    for r in rows.values():
        r["sim_speedup_vs_packing"] = base / r["sim_ms"]

    real_mode = "skipped"
    if not args.no_real:
        real_mode = ("threads: one per pipeline rank in one process, calibrated sleep per "
                     f"action, queue transfers in the planned order, background planner "
                     f"{args.planner_worker}")
        # imported here: torch on the heap makes every full garbage collection while planning
        # cost ~90 ms, and the planning rows above are timed without it
        from ds_autoplan.models.sleep import sleep
        for name, pl in methods.items():
            pf = Prefetcher(_plan_job, [(pl, i, b) for i, b in enumerate(batches)], depth=1,
                            kind=args.planner_worker)
            runs, waits, before = [], [], 0.0
            _plan_job((pl, -1, warm))
            for plan in pf:  # per iteration: wait for its plan (if not ready) + execute it
                waits.append(pf.waited - before)
                t0 = time.perf_counter()
                run_threads(plan.lowered, plan.costs, scale, sleep=sleep)
                runs.append(time.perf_counter() - t0)
                before = pf.waited
            # the first plan cannot overlap anything (worker start-up): warm-up, excluded
            exposed = float(np.mean(waits[1:])) if len(waits) > 1 else 0.0
            rows[name]["real_s"] = float(np.mean(runs)) + exposed
            rows[name]["real_exposed_planning_s"] = exposed
            rows[name]["real_vs_sim"] = float(np.mean(runs)) / (rows[name]["sim_ms"] * scale / 1e3)
            per_it[name]["real_s"] = runs
        rb = rows["packing"]["real_s"]
        for r in rows.values():
            r["real_speedup_vs_packing"] = rb / r["real_s"]

    if args.real_multiproc:
        from ds_autoplan.runtime.launch import spawn
        real_mode += ("; multiproc: one gloo rank per stage, DeepSpeed PipelineEngine, sleep "
                      "layers, plans made before the timed steps")
        M.prebuild_ops()        # outside the ranks' kill timeout
        argv_w = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--real-multiproc"]
        outs = spawn([os.path.abspath(__file__), *argv_w, "--mp-worker"], args.stages, timeout=600)
        for rc, out in outs:
            if rc != 0:
                print(out[-3000:], file=sys.stderr)
                print("error: a --real-multiproc rank failed", file=sys.stderr)
                return 1
            for line in out.splitlines():
                if line.startswith("BENCH "):
                    r = json.loads(line[6:])
                    row = rows[r["method"]]
                    row["real_mp_s"] = max(row.get("real_mp_s", 0.0), r["real_mp_s"])
        for r in rows.values():
            r["real_mp_speedup_vs_packing"] = rows["packing"]["real_mp_s"] / r["real_mp_s"]

    hdr = f"{'method':18s} {'sim ms':>9s} {'x pack':>7s} {'real s':>8s} {'x pack':>7s} " \
          f"{'pad eff':>7s} {'#mb':>6s} {'plan ms':>8s} {'cpu ms':>7s} {'peak GB':>8s}  setting"
    print(f"model={args.model} h={args.hidden} layers={args.layers} stages={args.stages} "
          f"attention={args.attention} max_len={args.max_len} global_batch={gbs} iters={iters}")
    print(hdr)
    print("(! = peak activation above --device-mem-gb: that baseline would need recomputation)")
    for name, r in rows.items():
        print(f"{name:18s} {r['sim_ms']:9.1f} {r['sim_speedup_vs_packing']:7.2f} "
              f"{r.get('real_s', float('nan')):8.3f} {r.get('real_speedup_vs_packing', float('nan')):7.2f} "
              f"{r['padding_efficiency']:7.3f} {r['microbatches']:6.1f} {r['plan_ms']:8.1f} {r['plan_cpu_ms']:7.1f} "
              f"{r['peak_mem_gb']:8.1f}{' ' if r['fits_device_mem'] else '!'} {r['setting']}")
    if args.real_multiproc:
        print(f"DeepSpeed PipelineEngine on {args.stages} CPU ranks (s per iteration, x packing): " +
              ", ".join(f"{k} {r['real_mp_s']:.3f} {r['real_mp_speedup_vs_packing']:.2f}"
                        for k, r in rows.items()))
    dyn, it = rows["dynapipe-adaptive"], per_it["dynapipe-adaptive"]
    rep = M.Report(iters)
    # per iteration (the same global batch for every method): paired ratios
    sim_x = M.ratio(per_it["packing"]["sim_ms"], it["sim_ms"], paired=True)
    rep.add("speedup_vs_packing", sim_x, digits=4)
    if "real_s" in it:
        rep.add("real_speedup_vs_packing", M.ratio(per_it["packing"]["real_s"], it["real_s"],
                                                   paired=True), bound=(None, sim_x[2]), digits=4)
    else:
        rep.out["real_speedup_vs_packing"] = None
    rep.add("planning_fraction", M.figure([c / t for c, t in zip(it["plan_cpu_ms"], it["sim_ms"])]),
            digits=4)
    out = rep.finish(
        {"planning_fraction<=0.05": rep.out["planning_fraction"] <= 0.05,
         "speedup_vs_packing>=1.5": rep.out["speedup_vs_packing"] >= 1.5},
        padding_efficiency=round(dyn["padding_efficiency"], 4),
        planning_fraction_wall=round(dyn["plan_ms"] / dyn["sim_ms"], 4),
        adaptive_vs_1f1b=round(rows["dynapipe-1f1b"]["sim_ms"] / dyn["sim_ms"], 4),
        real_mode=real_mode,
        **({"real_multiproc_speedup_vs_packing": round(dyn["real_mp_speedup_vs_packing"], 4)}
           if args.real_multiproc else {}),
        methods={k: {kk: (round(v, 4) if isinstance(v, float) else v) for kk, v in r.items()}
                 for k, r in rows.items()},
        config={"model": args.model, "hidden": args.hidden, "layers": args.layers,
                "stages": args.stages, "attention": args.attention, "max_len": args.max_len,
                "global_batch": gbs, "iters": iters, "device_mem_gb": args.device_mem_gb})
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
