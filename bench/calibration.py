"""Calibration benchmark: from a cluster file with deliberately wrong figures, run plan A for
a few steps on 2 CPU ranks, ``ds-autoplan calibrate`` the cluster from A's record, and check
that the calibrated cluster predicts A and a second, different plan B (also run, to be
measured) -- docs/calibration.md.

The machine: DeepSpeed's pipeline engine (ds_autoplan's adapter), real gloo transfers, a
real optimizer (AdamW), and calibrated-sleep layers for compute (models/sleep.py: the
machine's two cores would otherwise measure their own contention): each layer of gpt-tiny
sleeps what the cost model gives it on the *true* cluster, ``COMPUTE_SLOWER`` times what the
wrong cluster file says.  The wrong file also has links ``LINKS_FASTER`` times too fast
(latency divided, bandwidth multiplied) against the links ``ds-autoplan cluster`` measures
here.  Plan A: pp=2, 1F1B, micro-batch 2 x 4; plan B: pp=2, 1F1B, micro-batch 1 x 8 (twice the
actions: the per-action fixed cost matters).

Printed: ``error_before_A`` (the wrong file's prediction of A), ``error_after_A``,
``error_after_B`` (the calibrated file's), ``memory_error_after`` (the largest over both
plans' pipeline ranks), ``record_overhead`` (the record's own time per iteration over the
iteration: its per-action bookkeeping, timed on a no-op action, plus its one gather and
write, spread over the counted steps), each as the median and min-max spread over the
repeats, and ``goals_met``: after-A <= 0.03, after-B <= 0.05, memory <= 0.02, overhead <= 0.01.

    python bench/calibration.py [--quick] [--repeats 3] [--steps 4] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import _measure as M  # noqa: E402

MODEL = "gpt-tiny"
COMPUTE_SLOWER = 3.0
LINKS_FASTER = 20.0
BLOCK_F_MS = 1.0          # one block's forward at micro-batch 2 on the wrong cluster
PLANS = {"A": {"mbs": 2, "m": 4, "schedule": "1f1b"}, "B": {"mbs": 2, "m": 4, "schedule": "zb-h1"}}
# without --quick also: plan C, micro-batch 1 x 8 (twice the actions), predicted from A alone
# (error_after_C: informational, no goal; one micro-batch size cannot separate the fixed cost
# of an action from the compute rate) and from A and C together (error_after_AC_*)
EXTRA = {"C": {"mbs": 1, "m": 8, "schedule": "1f1b"}}
GOALS = {"error_after_A": 0.03, "error_after_B": 0.05, "memory_error_after": 0.02,
         "record_overhead": 0.01}


# ----------------------------------------------------------------------------- worker side
def worker(args) -> int:
    """Train every plan of ``args.plans`` (folders, each recording itself there) on these
    ranks, one after the other in the same processes: the plans' records, seconds apart,
    see the same load on a shared machine."""
    import torch
    import torch.nn.functional as F

    from ds_autoplan.models.sleep import cost_model_layers
    from ds_autoplan.plan import Plan
    from ds_autoplan.runtime.deepspeed import initialize
    from ds_autoplan.runtime.deepspeed.dist import init_distributed
    from ds_autoplan.spec.cluster import load_cluster
    from ds_autoplan.spec.model import load_model
    torch.set_num_threads(1)
    init_distributed()
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
           "steps_per_print": 10 ** 9, "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0}
    runs = []
    for folder in args.plans.split(","):
        plan = Plan.load(os.path.join(folder, "plan.json"))
        layers = cost_model_layers(MODEL, load_cluster(args.cluster), plan.micro_batch_size, COMPUTE_SLOWER)
        os.environ["DS_AUTOPLAN_OUT"] = folder           # this engine's record goes there
        engine, *_ = initialize(layers, plan, loss_fn=F.mse_loss, config=cfg, track_memory=True)
        g = torch.Generator().manual_seed(0)
        shape = (plan.micro_batch_size, plan.seq_len, load_model(MODEL).hidden)
        runs.append((engine, [(torch.randn(*shape, generator=g), torch.randn(*shape, generator=g))
                              for _ in range(plan.num_microbatches)]))
    for engine, data in runs:
        torch.distributed.barrier()
        for _ in range(args.steps):
            engine.train_batch(iter(data))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


# ----------------------------------------------------------------------------- driver side
def wrong_cluster(path: str) -> dict:
    """This machine's 2 CPU ranks as ``ds-autoplan cluster`` measures them, with the links
    ``LINKS_FASTER`` times too fast and a compute rate that gives a block ``BLOCK_F_MS``:
    the sleep layers then take ``COMPUTE_SLOWER`` times the file's compute."""
    import yaml

    from ds_autoplan.cli.cluster_cmd import resolve
    from ds_autoplan.cost.model import CostModel, Strategy
    from ds_autoplan.spec.cluster import ClusterSpec
    from ds_autoplan.spec.model import load_model
    det = resolve("auto", 1, 2)
    d = {k: v for k, v in vars(det).items() if v is not None}
    d.update(name="calibration-bench-1x2", compute_efficiency=1.0,
             intra_latency_us=det.intra_latency_us / LINKS_FASTER,
             inter_latency_us=det.inter_latency_us / LINKS_FASTER,
             intra_node_GBps=det.intra_node_GBps * LINKS_FASTER,
             inter_node_GBps=det.inter_node_GBps * LINKS_FASTER)
    cm = CostModel(load_model(MODEL), ClusterSpec.from_dict(d), precision="fp32")
    f = float(cm.tables([Strategy(1, 1)], 2).fwd[2, 0])
    d["peak_tflops"] = d["peak_tflops"] * f / (BLOCK_F_MS * 1e-3)
    with open(path, "w") as fh:
        yaml.safe_dump({"cluster": d}, fh, sort_keys=False)
    return {"measured_latency_us": det.intra_latency_us, "measured_GBps": det.intra_node_GBps}


def make_plan(cluster: str, out: str, mbs: int, m: int, schedule: str):
    from ds_autoplan.outputs import text, write_folder
    from ds_autoplan.search import SearchOptions, plan_model
    plan = plan_model(MODEL, cluster, mbs * m, options=SearchOptions(
        precision="fp32", pp=2, schedules=[schedule], fix={"dp": 1, "mbs": mbs, "recompute": "none"},
        partitioner="even", baselines=False))
    write_folder(out, {"plan.json": text(plan.to_json() + "\n")}, complete=False)
    return plan


def run_plans(folders: list, cluster: str, steps: int) -> list:
    """Train the plans in ``folders`` on 2 ranks, one after the other in one launch; their
    records (measured.json)."""
    from ds_autoplan.runtime.launch import spawn
    outs = spawn([os.path.abspath(__file__), "--worker", "--plans", ",".join(folders), "--cluster",
                  cluster, "--steps", str(steps)], 2, timeout=300,
                 env={"DS_AUTOPLAN_MEASURE_STEPS": str(steps)})
    for rc, out in outs:
        if rc != 0:
            print(out[-4000:], file=sys.stderr)
            raise SystemExit(f"a benchmark rank failed (rc {rc})")
    recs = []
    for f in folders:
        with open(os.path.join(f, "measured.json")) as fh:
            recs.append(json.load(fh))
    return recs


def _label(p) -> str:
    return f"pp={p.pp} dp={p.dp} mbs={p.micro_batch_size}x{p.num_microbatches} {p.schedule_label}"


def record_overhead(rec: dict, gather_s: float) -> float:
    """The record's own seconds per iteration over the measured iteration: its bookkeeping
    per action (timed here on a no-op action, with and without a recorder) times the
    iteration's actions, plus its one gather and write over the counted steps."""
    from ds_autoplan.runtime.common.memory import ActionMemory
    from ds_autoplan.runtime.common.record import Recorder
    from ds_autoplan.schedule import Action, Kind

    class _Plan:
        pp = 1
    n = 20000
    acts = [Action(0, Kind.F, 0, 0), Action(0, Kind.SEND_F, 0, 0, 1)] * (n // 2)

    def per_action(am) -> float:
        table = am.measured({Kind.F: lambda a: None, Kind.SEND_F: lambda a: None})
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for a in acts:
                table[a.kind](a)
            best = min(best, (time.perf_counter() - t0) / n)
        return best
    rec_ = Recorder("/nonexistent", _Plan(), 0, "bench", steps=10 ** 9)
    rec_.step_begin()
    cost = max(0.0, per_action(ActionMemory(None, rec_)) - per_action(ActionMemory()))
    actions = sum(sum(c.get("count") or [0]) for c in rec["components"].values())
    it = rec["iteration_time_s"]["measured"]
    return (cost * actions + gather_s / rec["steps"]) / it


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one repeat (CI-sized)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--steps", type=int, default=4, help="steps per run (the first is warm-up)")
    ap.add_argument("--json", default=None, help="also write summary and rows here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--plans", help=argparse.SUPPRESS)
    ap.add_argument("--cluster", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    repeats = args.repeats or (1 if args.quick else 3)
    from ds_autoplan.cli import main as cli
    from ds_autoplan.runtime.calibration import recost
    M.prebuild_ops()
    tmp = tempfile.mkdtemp(prefix="ds_autoplan_calibration_")
    every = {**PLANS, **({} if args.quick else EXTRA)}
    rows, figures = [], {k: [] for k in ("error_before_A", *GOALS)}
    if not args.quick:
        figures.update(error_after_C=[], error_after_AC_B=[])
    try:
        wrong = os.path.join(tmp, "wrong.yaml")
        links = wrong_cluster(wrong)
        folders = {k: os.path.join(tmp, k) for k in every}
        plans = {k: make_plan(wrong, folders[k], v["mbs"], v["m"], v["schedule"]) for k, v in every.items()}
        for rep in range(repeats):
            recs, row = {}, {}
            t0 = time.perf_counter()
            for k, r in zip(every, run_plans([folders[k] for k in every], wrong, args.steps)):
                recs[k] = r
                row[k] = {"repeat": rep, "plan": k, "label": _label(plans[k]),
                          "measured_s": recs[k]["iteration_time_s"]["measured"]}
                rows.append(row[k])
            print(f"(the runs took {time.perf_counter() - t0:.1f} s)")

            def calibrated(name, *runs):
                out = os.path.join(tmp, f"calibrated-{name}-{rep}.yaml")
                if cli(["calibrate", *(folders[r] for r in runs), "--cluster", wrong, "--out", out]) != 0:
                    raise SystemExit("ds-autoplan calibrate failed")
                return out

            def error(cluster, k, note=None):
                after = recost(plans[k], cluster)
                meas = recs[k]["iteration_time_s"]["measured"]
                err = abs(after.predicted.iteration_time_s - meas) / meas
                if note:
                    comps = after.predicted.components or {}
                    row[k].update({f"predicted_{note}_s": after.predicted.iteration_time_s,
                                   f"error_{note}": round(err, 4),
                                   "components": {n: [round(sum(c["measured"]), 5), round(sum(comps.get(n) or []), 5)]
                                                  for n, c in recs[k]["components"].items()}})
                return err, after
            c_a = calibrated("A", "A")
            mem = []
            for k in every:
                err, after = error(c_a, k, "after")
                if f"error_after_{k}" in figures:
                    figures[f"error_after_{k}"].append(err)
                if k in PLANS:
                    mm = recs[k]["peak_memory_gb"]["measured"]
                    mem += [abs(p - m) / m for p, m in zip(after.predicted.peak_memory_gb_per_stage, mm) if m]
                    row[k]["memory_gb"] = [mm, after.predicted.peak_memory_gb_per_stage]
            if not args.quick:
                figures["error_after_AC_B"].append(error(calibrated("AC", "A", "C"), "B")[0])
            figures["error_before_A"].append(error(wrong, "A")[0])
            figures["memory_error_after"].append(max(mem))
            figures["record_overhead"].append(record_overhead(recs["A"], 0.0))
        summary = {"links_measured": links}
        for k, v in figures.items():
            med, lo, hi = M.figure(v)
            summary[k] = round(float(med), 4)
            summary.setdefault("spread", {})[k] = [round(float(lo), 4), round(float(hi), 4)]
        summary["goals"] = {f"{k}<={g}": bool(summary[k] <= g) for k, g in GOALS.items()}
        summary["goals_met"] = all(summary["goals"].values())
        for r in rows:
            print(json.dumps(r))
        return M.publish(summary, rows, args.json)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
