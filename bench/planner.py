"""Planner benchmark: search time and plan quality against the baselines.

For each case the full search runs (executable space with schedule choice by simulation,
the five baselines on the same cost model, the partitioner comparison and the wide
Galvatron-BMW mode).  Printed per case: the plan, its predicted throughput, the throughput of
every baseline, plan / best baseline, the wide mode's gain, and the search time (wall and
process CPU seconds; the machine is shared, so CPU time is the steadier figure).

    python bench/planner.py [--quick] [--json out.json]

The last line is a JSON object with "search_time_s_175b_64gpu" (GPT-3 175B, 96 layers, 64
A100-80GB, global batch 1536, full space, in a fresh process), "plan_command_wall_s" (the
whole `ds-autoplan plan ... --out DIR` command: interpreter start, imports, search, configs,
report and plots; median of 3 runs), their process CPU seconds (steadier on a shared
machine), the 1-minute load average while measuring, and "min_ratio_vs_best_baseline" (plan
throughput / best baseline throughput, minimum over the cases), and
"search_time_s_moe64_64gpu" (OLMoE-1B-7B, 64 experts, on 64 H100, expert parallelism
searched).  Goals: search <= 2 s, MoE search <= 5 s, command <= 6 s,
ratio >= 1.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ds_autoplan.search import search  # noqa: E402

CASES = [  # model, cluster, global batch, options
    ("gpt3-175b", "64xa100-80gb", 1536, {}),
    ("bert-huge", "8xtitan-24gb", 64, {"budget_gb": 8, "precision": "fp16"}),
    ("bert-huge", "8xtitan-24gb", 128, {"budget_gb": 16, "precision": "fp16"}),
    ("t5-large", "8xtitan-24gb", 64, {"budget_gb": 8, "precision": "fp16"}),
    ("gpt3-1.3b", "8xa100-80gb", 512, {}),
    ("gpt3-13b", "2x8xa100-ib200", 256, {}),
    ("llama2-7b", "8xh100-80gb", 256, {}),
    ("vit-huge", "64xa100-40gb", 1024, {"budget_gb": 16}),
    ("llama2-70b", "64xa100-80gb", 512, {}),
    ("olmoe-1b-7b", "64xh100-80gb", 1024, {}),     # 64 experts, top-8: EP searched
]
QUICK = [0, 1, 3, 4, 5, 9]
MOE = CASES[9]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIG = ["--model", "gpt3-175b", "--cluster", "64xa100-80gb", "--global-batch", "1536"]


def _child(cmd: list[str]) -> tuple[float, float, str]:
    """Wall and CPU (user + sys) seconds of a child process, and its stdout."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime), r.stdout


def plan_command(runs: int = 3) -> dict:
    """The whole `ds-autoplan plan` for GPT-3 175B on 64 GPUs, written to a temporary --out."""
    walls, cpus, searches = [], [], []
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as d:
            wall, cpu, _ = _child([sys.executable, "-m", "ds_autoplan", "plan", *BIG, "--quiet",
                                   "--out", os.path.join(d, "plan")])
            with open(os.path.join(d, "plan", "plan.json")) as f:
                searches.append(json.load(f)["predicted"]["search_time_s"])
        walls.append(wall)
        cpus.append(cpu)
    return {"plan_command_wall_s": round(statistics.median(walls), 3),
            "plan_command_cpu_s": round(statistics.median(cpus), 3),
            "plan_command_search_s": round(statistics.median(searches), 3)}


def fresh_search(model="gpt3-175b", cluster="64xa100-80gb", B=1536, key="175b_64gpu") -> dict:
    """search() of one case in a fresh process (no warm caches): wall and CPU seconds."""
    code = ("import json, time; from ds_autoplan.search import search; "
            "t, c = time.perf_counter(), time.process_time(); "
            f"search({model!r}, {cluster!r}, {B}); "
            "print(json.dumps([time.perf_counter() - t, time.process_time() - c]))")
    _, _, out = _child([sys.executable, "-c", code])
    wall, cpu = json.loads(out.strip().splitlines()[-1])
    return {f"search_time_s_{key}": round(wall, 3), f"search_cpu_s_{key}": round(cpu, 3)}


def run_case(model, cluster, B, opts):
    t0, c0 = time.perf_counter(), time.process_time()
    r = search(model, cluster, B, **opts)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    p, pr = r.plan, r.plan.predicted
    tok = pr.throughput_tokens_per_s
    bl = {k: (v["throughput_tokens_per_s"] if v and v["iteration_time_s"] else 0.0)
          for k, v in pr.baselines.items()}
    best_bl = max(bl.values()) if bl else 0.0
    return {"model": model, "cluster": cluster, "global_batch": B,
            "plan": f"pp{p.pp} tp{p.tp}{'+sp' if p.sequence_parallel else ''} dp{p.dp}"
                    f"{f' ep{p.ep}' if p.ep > 1 else ''}{f' cp{p.cp}' if p.cp > 1 else ''} z{p.zero_stage} "
                    f"{p.schedule} mbs{p.micro_batch_size}x{p.num_microbatches}",
            "tokens_per_s": tok, "mfu": pr.mfu, "baselines": bl,
            "ratio_vs_best_baseline": tok / best_bl if best_bl else None,
            "wide_gain": pr.wide_gain, "wide_gain_vs_1f1b": pr.wide_gain_vs_1f1b,
            "search_wall_s": wall, "search_cpu_s": cpu}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="six cases (< 60 s on 2 cores)")
    ap.add_argument("--json", help="also write the full results here")
    a = ap.parse_args(argv)
    cases = [CASES[i] for i in QUICK] if a.quick else CASES
    rows = []
    for model, cluster, B, opts in cases:
        row = run_case(model, cluster, B, opts)
        rows.append(row)
        bl = ", ".join(f"{k} {v:.4g}" if v else f"{k} OOM" for k, v in row["baselines"].items())
        ratio = row["ratio_vs_best_baseline"]
        print(f"{model:>11} on {cluster:<15} B={B:<5} {row['plan']:<40} {row['tokens_per_s']:>10.5g} tok/s "
              f"MFU {row['mfu']:.1%}  x{ratio:.3f} best baseline  wide x{row['wide_gain'] or 0:.3f} "
              f"(x{row['wide_gain_vs_1f1b'] or 0:.3f} vs 1F1B)  "
              f"search {row['search_wall_s']:.2f} s wall / {row['search_cpu_s']:.2f} s cpu")
        print(f"{'':>13}baselines (tok/s): {bl}")
    ratios = [r["ratio_vs_best_baseline"] for r in rows if r["ratio_vs_best_baseline"]]
    load0 = os.getloadavg()[0]
    out = {**fresh_search(), **fresh_search(*MOE[:3], key="moe64_64gpu"), **plan_command(),
           "load_avg_1m": round((load0 + os.getloadavg()[0]) / 2, 2), "cpus": os.cpu_count(),
           "min_ratio_vs_best_baseline": round(min(ratios), 4),
           "median_ratio_vs_best_baseline": round(sorted(ratios)[len(ratios) // 2], 4),
           "max_wide_gain": round(max((r["wide_gain"] or 0) for r in rows), 4),
           "max_wide_gain_vs_1f1b": round(max((r["wide_gain_vs_1f1b"] or 0) for r in rows), 4),
           "cases": len(rows)}
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"summary": out, "rows": rows}, f, indent=2)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
