"""Planner benchmark (issue 3): search time and plan quality against the baselines.

For each case the full search runs (executable space with schedule choice by simulation,
the five baselines on the same cost model, the partitioner comparison and the wide
Galvatron-BMW mode).  Printed per case: the plan, its predicted throughput, the throughput of
every baseline, plan / best baseline, the wide mode's gain, and the search time (wall and
process CPU seconds; the machine is shared, so CPU time is the steadier figure).

    python bench/planner.py [--quick] [--json out.json]

The last line is a JSON object with "search_time_s_175b_64gpu" (GPT-3 175B, 96 layers, 64
A100-80GB, global batch 1536, full space) and "min_ratio_vs_best_baseline" (plan throughput
/ best baseline throughput, minimum over the cases).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
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
]
QUICK = [0, 1, 3, 4, 5]


def run_case(model, cluster, B, opts):
    t0, c0 = time.perf_counter(), time.process_time()
    r = search(model, cluster, B, **opts)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    p, pr = r.plan, r.plan.predicted
    tok = pr["throughput_tokens_per_s"]
    bl = {k: (v["throughput_tokens_per_s"] if v and v["iteration_time_s"] else 0.0)
          for k, v in pr["baselines"].items()}
    best_bl = max(bl.values()) if bl else 0.0
    return {"model": model, "cluster": cluster, "global_batch": B,
            "plan": f"pp{p.pp} tp{p.tp}{'+sp' if p.sequence_parallel else ''} dp{p.dp} z{p.zero_stage} {p.schedule} mbs{p.micro_batch_size}x{p.num_microbatches}",
            "tokens_per_s": tok, "mfu": pr["mfu"], "baselines": bl,
            "ratio_vs_best_baseline": tok / best_bl if best_bl else None,
            "wide_gain": pr.get("wide_gain"), "wide_gain_vs_1f1b": pr.get("wide_gain_vs_1f1b"),
            "search_wall_s": wall, "search_cpu_s": cpu}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="five cases (< 60 s on 2 cores)")
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
    big = rows[0]
    ratios = [r["ratio_vs_best_baseline"] for r in rows if r["ratio_vs_best_baseline"]]
    out = {"search_time_s_175b_64gpu": round(big["search_wall_s"], 3),
           "search_cpu_s_175b_64gpu": round(big["search_cpu_s"], 3),
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
