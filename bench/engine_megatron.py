"""megatron-core benchmark: Megatron's own 1F1B and interleaved schedules vs ds_autoplan's
V-Half, V-Min and V-ZB run through ``ds_autoplan.runtime.megatron.get_forward_backward_func``, on 4
CPU ranks (gloo) with calibrated-sleep layers (F:B:W = 1:1:1 per layer), in one process group.
Reports the iteration time and the peak saved-activation bytes per rank, as ratios to
Megatron's 1F1B from the same run, next to the simulator's predictions (issue 5).

    python bench/engine_megatron.py [--quick] [--n 8] [--unit-ms 30] [--iters 5]

The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

D = 4
INNER = 2     # a layer saves its input plus INNER copies (its "internal activations"); B frees
              # those and keeps input + output-grad for W: per layer (a_F, a_B, a_W) = (3, -1, -2)
OURS = ["1f1b", "v-half", "v-min", "v-zb"]   # ours-1f1b (a sanity check) is skipped by --quick


# ----------------------------------------------------------------------------- worker side
def _model_classes():
    import torch

    from megatron.core.enums import ModelType
    from ds_autoplan.runtime.splitgrad import defer

    def weight_pass(x, go, layer):
        time.sleep(layer.tw)                       # the deferred weight-gradient work
        return [(layer.p, (go * x).sum().reshape(1))]

    class _Sleep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, p, layer):
            time.sleep(layer.tf)
            inner = x.repeat(1, 1, INNER)
            ctx.save_for_backward(x, inner)
            ctx.p, ctx.layer = p, layer
            return x * p

        @staticmethod
        def backward(ctx, go):
            x, _inner = ctx.saved_tensors
            layer = ctx.layer
            time.sleep(layer.tb)
            gx = go * ctx.p
            if defer(weight_pass, x, go, layer=layer):
                return gx, None, None
            time.sleep(layer.tw)
            return gx, (go * x).sum().reshape(1), None

    class SleepLayer(torch.nn.Module):
        def __init__(self, t):
            super().__init__()
            self.p = torch.nn.Parameter(torch.ones(1))
            self.tf = self.tb = self.tw = t

        def forward(self, x):
            return _Sleep.apply(x, self.p, self)

    class SleepChunk(torch.nn.Module):
        """One pipeline stage with the attributes Megatron's schedules use (.config,
        .model_type, set_input_tensor)."""

        def __init__(self, config, layers, t, first):
            super().__init__()
            self.config, self.model_type, self.first = config, ModelType.encoder_or_decoder, first
            self.layers = torch.nn.ModuleList(SleepLayer(t) for _ in range(layers))
            self.input_tensor = None

        def set_input_tensor(self, t):
            self.input_tensor = t[0] if isinstance(t, list) else t

        def forward(self, x):
            h = x if self.first else self.input_tensor
            for layer in self.layers:
                h = layer(h)
            return h

    return SleepChunk


def calibrated(t: float, samples: int = 5) -> float:
    """The sleep request that takes ``t`` seconds here (time.sleep overshoots by a roughly
    constant amount, which would otherwise penalise schedules with more, shorter actions)."""
    over = 0.0
    for _ in range(samples):
        t0 = time.perf_counter()
        time.sleep(t)
        over += time.perf_counter() - t0 - t
    return max(0.0, t - over / samples)


def _loss(out):
    loss = out.float().mean()
    return loss, {"loss": loss.detach().clone()}


def _fstep(data_it, model):
    x = next(data_it) if model.first else None
    return model(x), _loss


def bench_case(case) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import schedules as ms

    from ds_autoplan.runtime.megatron import cpu_shim, get_forward_backward_func, initialize
    from ds_autoplan.models.megatron_gpt import base_config
    from ds_autoplan.plan import Plan
    from ds_autoplan.runtime.memtrack import MemTracker

    SleepChunk = _model_classes()
    ps.destroy_model_parallel()
    d, n, L = case["pp"], case["n"], case["layers"]
    t = calibrated(case["unit_ms"] / 1000.0)
    name = case["schedule"]
    S = 2 * d if name.startswith("v-") or name == "interleaved" else d
    plan = Plan(pp=d, num_microbatches=n, schedule=name, layers_per_stage=[L // S] * S,
                recompute_per_stage=[0.0] * S)
    setup = initialize(plan)
    cfg = base_config(num_layers=L, hidden_size=case["hidden"], **{
        k: v for k, v in setup.config_overrides.items() if k != "num_layers"})
    chunks = [SleepChunk(cfg, L // S, t, setup.pre_process(c)) for c in range(setup.num_chunks)]
    params = [p for c in chunks for p in c.parameters()]
    tracker = MemTracker(exclude=params)
    ours = case["runner"] == "ours"
    fb = get_forward_backward_func(plan, tracker=tracker) if ours else None
    shape = (8, 1, case["hidden"])

    def data():
        g = torch.Generator().manual_seed(0)
        while True:
            yield torch.randn(*shape, generator=g)

    times, peaks = [], []
    for it in range(case["iters"] + 1):
        its = [data() for _ in chunks]
        kw = dict(forward_step_func=_fstep, data_iterator=its if len(chunks) > 1 else its[0],
                  model=chunks, num_microbatches=n, seq_length=shape[0], micro_batch_size=1)
        dist.barrier()
        t0 = time.perf_counter()
        if ours:
            fb(**kw)
            peak = fb.peak_bytes
        else:
            tracker.reset_peak()
            base = tracker.current
            with cpu_shim(remap_cuda_factories=True), tracker.track():
                ms.get_forward_backward_func()(**kw)
            peak = tracker.peak - base
        dist.barrier()
        if it > 0:                           # the first iteration is a warm-up
            times.append(time.perf_counter() - t0)
            peaks.append(peak)
        for p in params:
            p.grad = None
    # the fastest iteration: sleeps are exact, so slower ones only measure CPU contention
    return {"rank": setup.pp_rank, "time": min(times), "peak": max(peaks)}


# ----------------------------------------------------------------------------- driver side
def simulate_predictions(n: int) -> dict:
    from ds_autoplan.schedule import Costs, build, names, simulate
    out = {}
    for nm in ["1f1b", "interleaved", "v-half", "v-min", "v-zb"]:
        if nm not in names():
            continue
        s = build(nm, D, n)
        # per layer (a_F, a_B, a_W) = (1 + INNER, -INNER + 1, -2) of one input, F=B=W=1
        split = (1.0 + INNER, 1.0 - INNER, -2.0)
        r = simulate(s, Costs.uniform(s, 1.0, 1.0, 1.0, mem_split=split))
        out[nm] = {"makespan": r.makespan, "peak": max(r.peak_memory)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer iterations, shorter sleeps (< 60 s)")
    ap.add_argument("--n", type=int, default=8, help="micro-batches per iteration")
    ap.add_argument("--unit-ms", type=float, default=None,
                    help="F = B = W sleep of one layer (default 30; 20 with --quick)")
    ap.add_argument("--iters", type=int, default=None, help="timed iterations per schedule")
    a = ap.parse_args(argv)
    unit = a.unit_ms if a.unit_ms is not None else (20.0 if a.quick else 30.0)
    iters = a.iters if a.iters is not None else (1 if a.quick else 5)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from ds_autoplan.runtime.launch import launch
    from ds_autoplan.schedule import names

    L = 2 * D          # 1F1B: 2 layers per stage; V / interleaved: 1 layer per stage
    fn = os.path.abspath(__file__) + ":bench_case"
    rows = [("megatron-1f1b", "1f1b", "megatron"), ("megatron-interleaved", "interleaved", "megatron")]
    rows += [(f"ours-{nm}", nm, "ours") for nm in OURS
             if nm in names() and not (a.quick and nm == "1f1b")]
    cases = [dict(fn=fn, pp=D, n=a.n, layers=L, unit_ms=unit, hidden=8, iters=iters,
                  schedule=s, runner=r) for _, s, r in rows]
    t0 = time.time()
    out = launch(D, cases, timeout=600)
    res = {}
    for i, (label, _, _) in enumerate(rows):
        per = [out[r][i] for r in range(D)]
        res[label] = {"time_s": max(p["time"] for p in per),
                      "peak_bytes_per_rank": [p["peak"] for p in per]}
    base = res["megatron-1f1b"]
    sim = simulate_predictions(a.n)
    print(f"{'schedule':22s} {'iter ms':>9s} {'thr/1F1B':>9s} {'peak/1F1B':>10s}  peak bytes per rank")
    for label, r in res.items():
        r["throughput_vs_megatron_1f1b"] = base["time_s"] / r["time_s"]
        r["mem_vs_megatron_1f1b"] = max(r["peak_bytes_per_rank"]) / max(base["peak_bytes_per_rank"])
        print(f"{label:22s} {1000 * r['time_s']:9.1f} {r['throughput_vs_megatron_1f1b']:9.3f} "
              f"{r['mem_vs_megatron_1f1b']:10.3f}  {r['peak_bytes_per_rank']}")
    if sim:
        print("simulator (F=B=W=1 per layer):", {k: (v["makespan"], v["peak"]) for k, v in sim.items()})

    def get(label, key):
        return res[label][key] if label in res else None
    summary = {
        "v_zb_throughput_vs_megatron_1f1b": get("ours-v-zb", "throughput_vs_megatron_1f1b"),
        "v_half_mem_vs_megatron_1f1b": get("ours-v-half", "mem_vs_megatron_1f1b"),
        "v_min_mem_vs_megatron_1f1b": get("ours-v-min", "mem_vs_megatron_1f1b"),
        "ours_1f1b_throughput_vs_megatron_1f1b": get("ours-1f1b", "throughput_vs_megatron_1f1b"),
        "ours_1f1b_mem_vs_megatron_1f1b": get("ours-1f1b", "mem_vs_megatron_1f1b"),
        "megatron_interleaved_throughput_vs_megatron_1f1b":
            get("megatron-interleaved", "throughput_vs_megatron_1f1b"),
        "sim_v_zb_throughput_vs_1f1b": (sim["1f1b"]["makespan"] / sim["v-zb"]["makespan"]
                                         if "v-zb" in sim else None),
        "sim_v_half_mem_vs_1f1b": sim["v-half"]["peak"] / sim["1f1b"]["peak"] if "v-half" in sim else None,
        "sim_v_min_mem_vs_1f1b": sim["v-min"]["peak"] / sim["1f1b"]["peak"] if "v-min" in sim else None,
        "ranks": D, "n": a.n, "unit_ms": unit, "iters": iters, "quick": a.quick,
        "wall_s": round(time.time() - t0, 1),
    }
    v = summary
    summary["goals_met"] = bool(
        v["v_zb_throughput_vs_megatron_1f1b"] and v["v_zb_throughput_vs_megatron_1f1b"] >= 1.2
        and v["v_min_mem_vs_megatron_1f1b"] is not None and v["v_min_mem_vs_megatron_1f1b"] <= 0.55
        and v["v_half_mem_vs_megatron_1f1b"] is not None and v["v_half_mem_vs_megatron_1f1b"] <= 0.8)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
