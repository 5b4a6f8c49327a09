"""ds_autoplan's runtime against torch.distributed.pipelining, schedule by schedule, on the
same ranks and model: V-ZB / ``ScheduleZBVZeroBubble``, 1F1B / ``Schedule1F1B``, ZB-H1 /
``ScheduleInterleavedZeroBubble`` with one chunk per rank, interleaved 1F1B /
``ScheduleInterleaved1F1B`` (torch 2.13).  Ours run in DeepSpeed's ``PipelineEngine``
(``ds_autoplan.initialize``, as ``bench/engine_deepspeed.py``), torch's in its own
``PipelineStage`` + schedule with an SGD step after each ``step()`` (DeepSpeed's
``train_batch`` includes its optimizer step).

The model is ``bench/engine_deepspeed.py``'s: 2d calibrated-sleep layers (F = B = W =
``unit/2`` per layer), micro-batches of 2 x 16 x 64, MSE loss; torch's copy splits its
backward at the autograd graph (``SleepLayer(split='graph')``: B and W sleep in torch's
input- and weight-gradient passes), ours through ``runtime.splitgrad``.  Same sleeps, same
saved bytes per layer.

Every round runs, for every pair, one iteration of ours and one of torch's (alternating which
goes first), then :data:`NULLS` null iterations of each, alternating (every sleep at zero: the
runtime's own time; the JSON's ``null_iteration_ms`` is the median over all of them of the
slowest rank's); ratios are per round (paired), printed with their min-max spread.  Memory:
the peak saved-activation bytes per rank (``runtime.memtrack``, the same tracker for both),
the largest rank.
The last round's null iterations also run instrumented: the JSON's ``null_breakdown_ms`` is,
for the rank that finished last, each runtime's own time per iteration by what it spends it
on (compute actions, p2p posting and waiting, the once-per-step instructions, the loss
aggregation, the rest) with the number of calls.

    python bench/engine_peers.py [--quick] [--n 8] [--unit-ms 30] [--iters 5] [--json OUT]

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
import engine_deepspeed as E  # noqa: E402

# ours -> torch.distributed.pipelining's schedule of the same name
PAIRS = {"v-zb": "ScheduleZBVZeroBubble", "1f1b": "Schedule1F1B",
         "zb-h1": "ScheduleInterleavedZeroBubble", "interleaved": "ScheduleInterleaved1F1B"}
FBW = (1.0, 1.0, 1.0)
NULLS = 5       # null iterations of each runtime per round (a null iteration lasts ~30-80 ms)
ONCE_DS = E._STEP_INSTR      # DeepSpeed's once-per-step instructions -> the engine's methods


# ----------------------------------------------------------------------------- worker side
class _Torch:
    """One torch.distributed.pipelining schedule on this rank: stages (the placement of our
    schedule of the same shape), SGD, and a step like ``train_batch``."""

    def __init__(self, ours: str, d: int, n: int, unit: float, data):
        import torch
        import torch.nn.functional as F
        from torch.distributed import pipelining as tp

        from ds_autoplan.models.sleep import SleepLayer
        from ds_autoplan.runtime.memtrack import MemTracker
        from ds_autoplan.schedule import build
        rank = torch.distributed.get_rank()
        place = build(ours, d, n).placement
        S, L = len(place), 2 * d
        f, b, w = FBW
        mine = [s for s in range(S) if place[s] == rank]
        self.stages = []
        for s in mine:
            mod = torch.nn.Sequential(*(SleepLayer(f * unit / 2, b * unit / 2, w * unit / 2,
                                                   inner=E.INNER, split="graph")
                                        for _ in range(L // S)))
            self.stages.append(tp.PipelineStage(mod, s, S, torch.device("cpu")))
        cls = getattr(tp, PAIRS[ours])
        arg = self.stages[0] if cls is tp.Schedule1F1B else self.stages
        self.sched = cls(arg, n, loss_fn=F.mse_loss)
        params = [p for st in self.stages for p in st.submod.parameters()]
        self.opt = torch.optim.SGD(params, lr=1e-3)
        self.first, self.last = 0 in mine, S - 1 in mine
        self.x = torch.cat([x for x, _ in data]) if self.first else None
        self.y = torch.cat([y for _, y in data]) if self.last else None
        self.tracker = MemTracker(exclude=params)
        self.losses: list = []

    def step(self):
        self.tracker.reset_peak()
        with self.tracker.track():
            self.sched.step(*((self.x,) if self.first else ()), target=self.y,
                            losses=self.losses if self.last else None)
        self.opt.step()
        self.opt.zero_grad()

    @property
    def peak(self):
        return self.tracker.peak

    def instrument(self, bd):
        """Wrap the pieces of a step in the breakdown ``bd``."""
        from torch.distributed.pipelining import schedules
        for st in self.stages:
            for nm in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                bd.patch(st, nm, "actions")
            bd.patch(st, "scale_grads", "once: scale gradients")
            bd.patch(st, "clear_runtime_states", "once: stage set-up")
        bd.patch(schedules, "_batch_p2p", "p2p: post")
        bd.patch(schedules, "_wait_batch_p2p", "p2p: wait")
        bd.patch(self.sched, "_update_losses", "loss aggregation")
        bd.patch(self.sched, "_split_inputs", "once: stage set-up")
        bd.patch(self.opt, "step", "once: optimizer step")
        bd.patch(self.opt, "zero_grad", "once: optimizer step")


class _Ours:
    """One of our schedules in DeepSpeed's engine (``bench/engine_deepspeed.py``'s)."""

    def __init__(self, name: str, d: int, n: int, unit: float, data, cfg):
        self.engine, _ = E._engine(name, d, n, FBW, unit, cfg)
        self.data = data

    def step(self):
        self.engine.train_batch(iter(self.data))

    @property
    def peak(self):
        return self.engine.memtracker.peak

    def instrument(self, bd):
        e = self.engine
        table = {k: bd.timed(f, "actions" if k.is_compute else "p2p: post")
                 for k, f in e.ap_table.items()}
        bd.patch(e, "ap_table", None, table)
        for nm, method in ONCE_DS.items():
            bd.patch(e, method, f"once: {nm}")
        bd.patch(e, "_exec_commit_p2p", "p2p: wait for sends")
        bd.patch(e, "_wait", "p2p: wait")
        bd.patch(e, "_aggregate_total_loss", "loss aggregation")


def worker(args):
    import torch

    from ds_autoplan.models.sleep import scaled
    d, rank, n, unit, data, cfg = E.setup(args)
    barrier = torch.distributed.barrier
    names = args.schedules.split(",")
    runs = {}
    for nm in names:
        runs[("ours", nm)] = _Ours(nm, d, n, unit, data, cfg)
        runs[("torch", nm)] = _Torch(nm, d, n, unit, data)
    times = {k: [] for k in runs}
    nulls = {k: [] for k in runs}
    peaks = {k: 0 for k in runs}
    breakdown = {}

    def once(run):
        barrier()
        t0 = time.perf_counter()
        run.step()
        return time.perf_counter() - t0
    rounds = M.WARMUP + args.iters
    for r in range(rounds):
        for i, nm in enumerate(names):
            pair = [("ours", nm), ("torch", nm)]
            if (r + i) % 2:
                pair.reverse()
            for k in pair:
                t = once(runs[k])
                if r >= M.WARMUP:
                    times[k].append(t)
                    peaks[k] = max(peaks[k], runs[k].peak)
            for j in range(NULLS):           # null iterations, alternating which goes first
                for k in (pair if j % 2 == 0 else pair[::-1]):
                    with scaled(0.0):
                        t = once(runs[k])
                    if r >= M.WARMUP:
                        nulls[k].append(t)
            if r == rounds - 1:          # the breakdown of one more null iteration each
                for k in pair:
                    bd = M.Breakdown()
                    runs[k].instrument(bd)
                    with scaled(0.0):
                        barrier()
                        with bd.total():
                            runs[k].step()
                    bd.unpatch()
                    breakdown[k] = {**bd.result(), "calls": bd.calls}
    for k in runs:
        print("BENCH " + json.dumps({"rank": rank, "runtime": k[0], "schedule": k[1],
                                     "times": times[k], "nulls": nulls[k], "peak": peaks[k],
                                     "breakdown": breakdown[k]}), flush=True)
    barrier()
    torch.distributed.destroy_process_group()


# ----------------------------------------------------------------------------- driver side
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 timed rounds (< 90 s)")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--unit-ms", type=float, default=30.0,
                    help="sleep of one pass (F, B or W) of one 1F1B stage (2 layers), ms")
    ap.add_argument("--iters", type=int, default=None, help="timed rounds (>= 3)")
    ap.add_argument("--schedules", default=",".join(PAIRS))
    ap.add_argument("--json", default=None, help="also write summary + rows to this file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.iters = M.plan_iters(args.quick, args.iters)
    if args.worker:
        return worker(args)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from ds_autoplan.runtime.launch import spawn
    M.prebuild_ops()
    t0 = time.time()
    outs = spawn([os.path.abspath(__file__), "--worker", "--n", str(args.n), "--unit-ms",
                  str(args.unit_ms), "--iters", str(args.iters), "--schedules", args.schedules],
                 args.ranks, timeout=900)
    rows = E.bench_rows(outs)
    by = {}
    for r in rows:
        by.setdefault((r["runtime"], r["schedule"]), []).append(r)

    def per_round(k, field):     # an iteration lasts as long as its slowest rank
        return [max(ts) for ts in zip(*(r[field] for r in by[k]))]
    rep = M.Report(args.iters)
    names = args.schedules.split(",")
    print(f"{'ours / torch':34} {'time x':>7} {'spread':>13} {'ours ms':>8} {'torch ms':>8} "
          f"{'mem x':>6} {'null ours':>9} {'null torch':>10}")
    nulls, breakdown = {}, {}
    for nm in names:
        o, t = ("ours", nm), ("torch", nm)
        ratio = M.ratio(per_round(o, "times"), per_round(t, "times"), paired=True)
        mem = max(r["peak"] for r in by[o]) / max(r["peak"] for r in by[t])
        key = nm.replace("-", "_")
        rep.add(f"{key}_time_vs_torch", ratio)
        rep.add(f"{key}_mem_vs_torch", (mem, mem, mem))
        for k in (o, t):
            label = f"{k[0]} {nm}"
            nulls[label] = round(statistics.median(per_round(k, "nulls")) * 1e3, 2)
            # the rank that finished last: its own time and waits are the iteration's
            last = max(by[k], key=lambda r: r["breakdown"]["total"])["breakdown"]
            breakdown[label] = {c: round(v * 1e3, 3) for c, v in last.items() if c != "calls"}
            breakdown[label]["calls"] = last["calls"]
        print(f"{nm + ' / ' + PAIRS[nm]:34} {ratio[0]:7.3f} {ratio[1]:6.3f}-{ratio[2]:6.3f} "
              f"{statistics.median(per_round(o, 'times')) * 1e3:8.1f} "
              f"{statistics.median(per_round(t, 'times')) * 1e3:8.1f} {mem:6.3f} "
              f"{nulls['ours ' + nm]:9.2f} {nulls['torch ' + nm]:10.2f}")
    o = rep.out
    goals = {f"{nm.replace('-', '_')}_time<=1.00": o[f"{nm.replace('-', '_')}_time_vs_torch"] <= 1.0
             for nm in names}
    goals.update({f"{nm.replace('-', '_')}_mem<={0.95 if nm == 'v-zb' else 1.0}":
                  o[f"{nm.replace('-', '_')}_mem_vs_torch"] <= (0.95 if nm == "v-zb" else 1.0)
                  for nm in names})
    if "1f1b" in names:      # the runtime's own time per iteration, the same 1F1B schedule
        goals["null_iteration_1f1b<=torch"] = nulls["ours 1f1b"] <= nulls["torch 1f1b"]
    for label, cats in breakdown.items():
        print(f"null {label:18} " + ", ".join(f"{c} {v:.2f}" for c, v in cats.items()
                                                if c != "calls"))
    M.publish(rep.finish(goals, ranks=args.ranks, n=args.n, unit_ms=args.unit_ms,
                         null_iteration_ms=nulls, null_breakdown_ms=breakdown,
                         wall_s=round(time.time() - t0, 1)), rows, args.json)


if __name__ == "__main__":
    main()
