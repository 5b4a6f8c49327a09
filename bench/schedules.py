"""Benchmark of the schedule builders against 1F1B (docs/schedules.md §2.6, §3.4).

For d in {4, 8, 16} and n in {2d, 4d}: makespan ratio and peak-activation ratio of every
schedule vs 1F1B under the unit model (F = B = W = 1 per 1/d of the model, i.e. per 1F1B
stage; V stages get half; memory (1, 0, -1); Merak's R costs one F), and the wall time of
build + simulate (builder caches cleared first).  Last line: one JSON object.

    python bench/schedules.py [--quick]
"""
from __future__ import annotations

import argparse
import json
import time

from ds_autoplan.schedule import Costs, build, simulate
from ds_autoplan.schedule.builders import adaptive, vshape

SCHEDULES = [("1f1b", {}), ("gpipe", {}), ("interleaved", {"v": 2}), ("zb-h1", {}),
             ("merak-scp", {}), ("v-min", {}), ("v-half", {}), ("v-zb", {}), ("v-zb-greedy", {}),
             ("adaptive", {}), ("adaptive", "min")]   # "min": cap = V-Min's peak


def clear_caches() -> None:
    vshape._cached.cache_clear()
    for fn in (adaptive.search, adaptive.evaluate, adaptive._quick_makespan, adaptive.candidates):
        fn.cache_clear()


def run_one(name: str, kw: dict, d: int, n: int, repeats: int):
    """Simulation result and the best (wall, CPU) seconds of build + simulate."""
    wall = cpu = float("inf")
    for _ in range(repeats):
        clear_caches()
        t, c = time.perf_counter(), time.process_time()
        s = build(name, d, n, **kw)
        res = simulate(s, Costs.uniform(s, 1.0, 1.0, 1.0))
        wall = min(wall, time.perf_counter() - t)
        cpu = min(cpu, time.process_time() - c)
    return res, wall, cpu


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one timing run per case (< 60 s)")
    args = ap.parse_args(argv)
    repeats = 1 if args.quick else 3
    out: dict = {}
    print(f"{'d':>3} {'n':>4} {'schedule':<14} {'makespan':>9} {'x1F1B':>6} {'bubble':>6} "
          f"{'peak':>5} {'x1F1B':>6} {'wall s':>7} {'cpu s':>7}")
    for d in (4, 8, 16):
        for n in (2 * d, 4 * d):
            base = None
            for name, kw in SCHEDULES:
                tag = name
                if kw == "min":
                    kw, tag = {"mem_cap": (d + 4) // 3}, "adaptive@min"
                res, secs, cpu = run_one(name, kw, d, n, repeats)
                base = base or res
                mk = res.makespan / base.makespan
                mem = max(res.peak_units) / max(base.peak_units)
                label = tag + (f"(v={kw['v']})" if "v" in kw else "")
                print(f"{d:>3} {n:>4} {label:<14} {res.makespan:>9.1f} {mk:>6.3f} "
                      f"{res.bubble_ratio:>6.3f} {max(res.peak_units):>5.1f} {mem:>6.3f} "
                      f"{secs:>7.3f} {cpu:>7.3f}")
                out[(tag, d, n)] = (mk, mem, res.bubble_ratio, secs, cpu)
    key = lambda nm: out[(nm, 16, 64)]
    plain = [nm for nm, _ in SCHEDULES if nm != "adaptive"]
    summary = {
        "v_min_mem_ratio": round(key("v-min")[1], 4),
        "v_half_mem_ratio": round(key("v-half")[1], 4),
        "v_zb_mem_ratio": round(key("v-zb")[1], 4),
        "v_zb_bubble": round(key("v-zb")[2], 4),
        "one_f_one_b_bubble": round(key("1f1b")[2], 4),
        "v_min_makespan_ratio": round(key("v-min")[0], 4),
        "v_half_makespan_ratio": round(key("v-half")[0], 4),
        "v_zb_makespan_ratio": round(key("v-zb")[0], 4),
        "zb_h1_makespan_ratio": round(key("zb-h1")[0], 4),
        "v_zb_greedy_makespan_ratio": round(key("v-zb-greedy")[0], 4),
        "adaptive_makespan_ratio": round(key("adaptive")[0], 4),
        # appendix-A search at V-Min's memory vs canonical V-Min (both vs 1F1B)
        "adaptive_at_v_min_mem_makespan_ratio": round(key("adaptive@min")[0], 4),
        "adaptive_at_v_min_mem_ratio": round(key("adaptive@min")[1], 4),
        # builders without a search; the adaptive builder searches blocks (reported apart)
        "build_sim_s_d16_n64": round(max(key(nm)[3] for nm in plain), 4),
        "build_sim_cpu_s_d16_n64": round(max(key(nm)[4] for nm in plain), 4),
        "adaptive_search_build_sim_s_d16_n64": round(key("adaptive")[3], 4),
        "adaptive_search_build_sim_s_d8_n16": round(out[("adaptive", 8, 16)][3], 4),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
