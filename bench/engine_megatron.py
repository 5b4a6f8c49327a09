"""megatron-core benchmark: Megatron's own 1F1B and interleaved schedules vs ds_autoplan's
V-Half, V-Min and V-ZB run through ``ds_autoplan.runtime.megatron.get_forward_backward_func``, on 4
CPU ranks (gloo) with calibrated-sleep layers (``models.sleep``, F:B:W = 1:1:1 per layer), in one
process group.  Reports the iteration time (median of the timed iterations after a warm-up,
with its min-max spread, ``bench/_measure.py``) and the peak saved-activation bytes per rank,
as ratios to Megatron's 1F1B from the same run, next to the simulator's predictions.

The simulator gets each runtime's own overheads, measured once per runtime before the timed
cases: the one-way p2p time of an activation, and the dispatch time per compute
action fitted so that null-model iterations (zero-sleep layers) of the runtime's reference
schedules are reproduced -- 1F1B for Megatron's schedules, 1F1B (fused backward) and V-ZB
(split B/W) for ds_autoplan's executor.  No optimizer
step runs here, so the once-per-iteration term is 0.

    python bench/engine_megatron.py [--quick] [--n 8] [--unit-ms 30] [--iters 5]

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

D = 4
INNER = 2     # a layer saves its input plus INNER copies (its "internal activations"); B frees
              # those and keeps input + output-grad for W: per layer (a_F, a_B, a_W) = (3, -1, -2)
OURS = ["1f1b", "v-half", "v-min", "v-zb"]   # ours-1f1b (a sanity check) is skipped by --quick
SHAPE = (8, 1, 8)                             # a micro-batch's boundary tensor [seq, mbs, hidden]
# per runtime: the schedules its dispatch time is fitted on (fused and split backward)
NULL = {"megatron": ["1f1b"], "ours": ["1f1b", "v-zb"]}


# ----------------------------------------------------------------------------- worker side
def _model_classes():
    import torch

    from megatron.core.enums import ModelType
    from ds_autoplan.models.sleep import SleepLayer

    class SleepChunk(torch.nn.Module):
        """One pipeline stage with the attributes Megatron's schedules use (.config,
        .model_type, set_input_tensor)."""

        def __init__(self, config, layers, t, first):
            super().__init__()
            self.config, self.model_type, self.first = config, ModelType.encoder_or_decoder, first
            self.layers = torch.nn.ModuleList(SleepLayer(t, t, t, inner=INNER, w_keeps="grad")
                                              for _ in range(layers))
            self.input_tensor = None

        def set_input_tensor(self, t):
            self.input_tensor = t[0] if isinstance(t, list) else t

        def forward(self, x):
            h = x if self.first else self.input_tensor
            for layer in self.layers:
                h = layer(h)
            return h

    return SleepChunk


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

    from ds_autoplan.models.sleep import scaled
    from ds_autoplan.runtime.megatron import cpu_shim, get_forward_backward_func, initialize
    from ds_autoplan.models.megatron_gpt import base_config
    from ds_autoplan.plan import Plan
    from ds_autoplan.runtime.memtrack import MemTracker

    t_case = time.perf_counter()
    SleepChunk = _model_classes()
    ps.destroy_model_parallel()
    d, n, L = case["pp"], case["n"], case["layers"]
    t = case["unit_ms"] / 1000.0
    name = case["schedule"]
    S = 2 * d if name.startswith("v-") or name == "interleaved" else d
    plan = Plan(pp=d, num_microbatches=n, schedule=name, layers_per_stage=[L // S] * S,
                recompute_per_stage=[0.0] * S)
    setup = initialize(plan)
    cfg = base_config(num_layers=L, hidden_size=SHAPE[2], **{
        k: v for k, v in setup.config_overrides.items() if k != "num_layers"})
    chunks = [SleepChunk(cfg, L // S, t, setup.pre_process(c)) for c in range(setup.num_chunks)]
    params = [p for c in chunks for p in c.parameters()]
    tracker = MemTracker(exclude=params)
    ours = case["runner"] == "ours"
    fb = get_forward_backward_func(plan, tracker=tracker) if ours else None
    p2p = M.ping(torch.zeros(*SHAPE)) if case["null"] else None

    def data():
        g = torch.Generator().manual_seed(0)
        while True:
            yield torch.randn(*SHAPE, generator=g)

    peaks = []

    def step():
        its = [data() for _ in chunks]
        kw = dict(forward_step_func=_fstep, data_iterator=its if len(chunks) > 1 else its[0],
                  model=chunks, num_microbatches=n, seq_length=SHAPE[0], micro_batch_size=1)
        if ours:
            fb(**kw)
            peaks.append(fb.peak_bytes)
        else:
            tracker.reset_peak()
            base = tracker.current
            with cpu_shim(remap_cuda_factories=True), tracker.track():
                ms.get_forward_backward_func()(**kw)
            peaks.append(tracker.peak - base)
        for p in params:
            p.grad = None
    # the runtime's reference schedules also run null iterations, interleaved with the timed ones
    nulls = [] if case["null"] else None
    if case["null_only"]:
        with scaled(0.0):
            nulls, times = M.timed(step, case["iters"], sync=dist.barrier), []
    else:
        times = M.timed(step, case["iters"], sync=dist.barrier, null=nulls)
    return {"rank": setup.pp_rank, "times": times, "null": nulls, "p2p": p2p,
            "peak": max(peaks[M.WARMUP:]),
            "case_s": time.perf_counter() - t_case}


# ----------------------------------------------------------------------------- driver side
def predict(name: str, n: int, t: float, overheads=None) -> dict:
    """Simulated iteration seconds and peak bytes per rank: F = B = W = ``t`` per layer, per
    layer (a_F, a_B, a_W) = (1 + INNER, 1 - INNER, -2) inputs, plus the runtime's overheads.
    A split backward (B, then W) holds the output gradient for W before autograd frees the
    layer's internals: one input more while a B runs."""
    from ds_autoplan.schedule import Costs, Kind, build, simulate
    s = build(name, D, n)
    lay = 2                                 # layers per 1F1B stage (one slice of the model)
    unit = SHAPE[0] * SHAPE[1] * SHAPE[2] * 4
    c = Costs.uniform(s, lay * t, lay * t, lay * t, act=lay * unit,
                      mem_split=(1.0 + INNER, 1.0 - INNER, -2.0))
    c.b[0] -= t                             # the first layer's input needs no gradient: no B
    if any(a.kind == Kind.B for a in s.actions()):
        c = c.with_transient(unit)
    r = simulate(s, c.with_overheads(overheads) if overheads else c)
    return {"makespan": r.makespan, "peak": max(r.peak_memory)}


def overheads(res: dict, p2p: float, n: int) -> dict:
    """Per runtime: dispatch fitted to its null-model iterations, with the measured p2p."""
    from ds_autoplan.schedule import Costs, Overheads, build
    out, base = {}, Overheads(p2p=p2p)
    for rt, nms in NULL.items():
        runs = [(s, Costs.uniform(s, 0.0, 0.0, 0.0), statistics.median(res[f"{rt}-{nm}"]["null"]))
                for nm, s in ((nm, build(nm, D, n)) for nm in nms)]
        out[rt] = Overheads(dispatch=M.fit_dispatch(runs, base), p2p=p2p)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 timed iterations, shorter sleeps (< 60 s)")
    ap.add_argument("--n", type=int, default=8, help="micro-batches per iteration")
    ap.add_argument("--unit-ms", type=float, default=None,
                    help="F = B = W sleep of one layer (default 30; 15 with --quick)")
    ap.add_argument("--iters", type=int, default=None, help="timed iterations per schedule (>= 3)")
    a = ap.parse_args(argv)
    unit = a.unit_ms if a.unit_ms is not None else (15.0 if a.quick else 30.0)
    iters = M.plan_iters(a.quick, a.iters)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from ds_autoplan.runtime.launch import launch
    from ds_autoplan.schedule import names

    L = 2 * D          # 1F1B: 2 layers per stage; V / interleaved: 1 layer per stage
    fn = os.path.abspath(__file__) + ":bench_case"
    rows = [("megatron-1f1b", "1f1b", "megatron"), ("megatron-interleaved", "interleaved", "megatron")]
    rows += [(f"ours-{nm}", nm, "ours") for nm in OURS
             if nm in names() and not (a.quick and nm == "1f1b")]
    # a reference schedule not timed (ours-1f1b with --quick) runs its null iterations alone
    rows += [(f"{rt}-{nm}", nm, rt) for rt, nms in NULL.items() for nm in nms
             if f"{rt}-{nm}" not in [r[0] for r in rows]]
    null_only = {"ours-1f1b"} if a.quick else set()
    cases = [dict(fn=fn, pp=D, n=a.n, layers=L, unit_ms=unit, schedule=s, runner=r,
                  null=s in NULL[r], null_only=label in null_only, iters=iters)
             for label, s, r in rows]
    t0 = time.time()
    out = launch(D, cases, timeout=600)
    res = {}
    pings = []
    for i, (label, _, _) in enumerate(rows):
        per = [out[r][i] for r in range(D)]
        # an iteration lasts until its slowest rank ends (ranks start after a barrier)
        res[label] = {k: [max(ts) for ts in zip(*(p[k] for p in per))] if per[0][k] is not None
                      else None for k in ("times", "null")}
        res[label]["peak_bytes_per_rank"] = [p["peak"] for p in per]
        pings += [per[0]["p2p"]] if per[0]["p2p"] is not None else []
    ovs = overheads(res, statistics.median(pings), a.n)
    null_ms = {k: statistics.median(r["null"]) for k, r in res.items() if r["null"]}
    res = {k: r for k, r in res.items() if k not in null_only}
    t = unit / 1000.0
    base = res["megatron-1f1b"]
    base_pred, base_ideal = predict("1f1b", a.n, t, ovs["megatron"]), predict("1f1b", a.n, t)
    rep = M.Report(iters)
    print(f"{'schedule':22s} {'iter ms':>9s} {'spread ms':>15s} {'sim ms':>8s} {'thr/1F1B':>9s} "
          f"{'peak/1F1B':>10s}  peak bytes per rank")
    figs = {}
    for label, nm, rt in rows:
        if label in null_only:
            continue
        r = res[label]
        pred, ideal = predict(nm, a.n, t, ovs[rt]), predict(nm, a.n, t)
        thr = M.ratio(base["times"], r["times"])
        mem = max(r["peak_bytes_per_rank"]) / max(base["peak_bytes_per_rank"])
        rep.sim_error(f"{label} time", r["times"], pred["makespan"])
        rep.errors[f"{label} memory"] = round(abs(max(r["peak_bytes_per_rank"]) - pred["peak"])
                                              / pred["peak"], 3)
        ceil = max(base_ideal["makespan"] / ideal["makespan"],
                   base_pred["makespan"] / pred["makespan"])
        floor = ideal["peak"] / base_ideal["peak"]
        figs[label] = (thr, (None, ceil), (mem, mem, mem), (floor, None))
        med, lo, hi = M.figure(r["times"])
        print(f"{label:22s} {1e3 * med:9.1f} {1e3 * lo:7.1f}-{1e3 * hi:7.1f} "
              f"{1e3 * pred['makespan']:8.1f} {thr[0]:9.3f} {mem:10.3f}  {r['peak_bytes_per_rank']}")
    print("runtime overheads (ms): " + "; ".join(
        f"{rt}: " + ", ".join(f"{k} {v * 1e3:.3f}" for k, v in ov.to_dict().items())
        + " (null iterations " + ", ".join(
            f"{nm} {1e3 * null_ms[f'{rt}-{nm}']:.1f}" for nm in NULL[rt]) + ")"
        for rt, ov in ovs.items()))

    def add(key, label, which):
        if label not in figs:
            return None
        thr, tb, mem, mb = figs[label]
        return rep.add(key, thr, tb) if which == "thr" else rep.add(key, mem, mb)
    v = {"v_zb_throughput_vs_megatron_1f1b": add("v_zb_throughput_vs_megatron_1f1b", "ours-v-zb", "thr"),
         "v_half_mem_vs_megatron_1f1b": add("v_half_mem_vs_megatron_1f1b", "ours-v-half", "mem"),
         "v_min_mem_vs_megatron_1f1b": add("v_min_mem_vs_megatron_1f1b", "ours-v-min", "mem"),
         "ours_1f1b_throughput_vs_megatron_1f1b": add("ours_1f1b_throughput_vs_megatron_1f1b",
                                                      "ours-1f1b", "thr"),
         "ours_1f1b_mem_vs_megatron_1f1b": add("ours_1f1b_mem_vs_megatron_1f1b", "ours-1f1b", "mem"),
         "megatron_interleaved_throughput_vs_megatron_1f1b": add(
             "megatron_interleaved_throughput_vs_megatron_1f1b", "megatron-interleaved", "thr")}
    sim = {nm: predict(nm, a.n, t) for nm in ("1f1b", "v-zb", "v-half", "v-min")}
    rep.out.update({k: None for k, x in v.items() if x is None})
    goals = {"max_sim_error<=0.10": max(rep.errors.values()) <= 0.10,
             "v_zb_throughput>=1.2": (v["v_zb_throughput_vs_megatron_1f1b"] or 0) >= 1.2,
             "v_min_mem<=0.55": v["v_min_mem_vs_megatron_1f1b"] <= 0.55,
             "v_half_mem<=0.8": v["v_half_mem_vs_megatron_1f1b"] <= 0.8}
    summary = rep.finish(
        goals,
        sim_v_zb_throughput_vs_1f1b=round(sim["1f1b"]["makespan"] / sim["v-zb"]["makespan"], 3),
        sim_v_half_mem_vs_1f1b=round(sim["v-half"]["peak"] / sim["1f1b"]["peak"], 3),
        sim_v_min_mem_vs_1f1b=round(sim["v-min"]["peak"] / sim["1f1b"]["peak"], 3),
        overheads_ms={rt: {k: round(x * 1e3, 3) for k, x in ov.to_dict().items()}
                      for rt, ov in ovs.items()},
        ranks=D, n=a.n, unit_ms=unit, quick=a.quick, wall_s=round(time.time() - t0, 1))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
