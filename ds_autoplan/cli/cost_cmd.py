"""`ds-autoplan cost`: what does my configuration cost?  Costs your configuration
(--config tp=8,pp=8,mbs=1,recompute=full,schedule=1f1b,...; what it leaves open is searched)
on the planner's cost model and prints it beside the planner's free choice, with the reasons
the faster one wins."""
from __future__ import annotations

import json
import sys

from . import doc_description
from .plan_cmd import add_problem_args, search_options


def add_parser(sub) -> None:
    p = sub.add_parser("cost", help="cost your own configuration beside the planner's choice",
                       description=doc_description(__doc__))
    add_problem_args(p)
    p.add_argument("--config", required=True, metavar="K=V,...",
                   help="keys tp, pp, dp, mbs, zero, schedule, v (interleaved chunks), "
                        "recompute (auto|none|full|selective), sp (on|off), ep (expert parallel), "
                        "etp (expert tensor parallel), cp (context parallel), cp_comm (p2p|a2a)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=run)


def _costed(args, fix):
    from ..search import search
    return search(args.model, args.cluster, args.global_batch, args.seq,
                  search_options(args, wide=False, keep_sim=False, fix=fix))


def _line(res) -> dict:
    s = res.best.summary(res.plan.global_batch_size, res.model.seq_len)
    pr = res.plan.predicted
    s.update(mfu=pr.mfu, memory_budget_gb=pr.memory_budget_gb, execution=pr.execution,
             error_band=pr.error_band)
    return s


def run(args) -> int:
    from ..cost.engines import band_text
    from ..search.fix import describe, parse_fix, reasons
    from ..spec import SpecError
    from .cluster_cmd import resolve
    fix = parse_fix(args.config, "--config")
    args.cluster = resolve(args.cluster, args.nodes, args.gpus_per_node, args.world_size)
    free = _line(_costed(args, None))
    try:
        mine, why_not = _line(_costed(args, fix)), None
    except SpecError as e:         # the configuration cannot run here: say why, show the plan
        mine, why_not = None, str(e)
    out = {"config": fix, "yours": mine, "planner": free, "error": why_not}
    if mine is not None:
        out["speedup"] = mine["iteration_time_s"] / free["iteration_time_s"]
        out["reasons"] = reasons(mine, free) if out["speedup"] > 1 + 1e-9 else []
    if args.json:
        print(json.dumps(out, default=float))
        return _verdict(why_not)
    print(f"execution model: {free['execution']}")
    for label, s in (("your configuration", mine), ("planner's choice", free)):
        if s is None:
            print(f"{label:<19}: cannot run: {why_not}")
            continue
        print(f"{label:<19}: {describe(s)}")
        print(f"{'':<21}predicted {s['iteration_time_s']:.4g} s/iteration, "
              f"{s['throughput_tokens_per_s']:.6g} tokens/s, MFU {s['mfu']:.1%}, peak memory "
              f"{max(s['peak_memory_gb']):.2f} GB / {s['memory_budget_gb']:.1f} GB"
              + (f", host {s['host_memory_gb_per_node']:.1f} GB per node" if s.get("offload", "none") != "none" else ""))
        print(f"{'':<21}{band_text(s['error_band'])}")
    if mine is not None:
        x = out["speedup"]
        if x > 1 + 1e-9:
            print(f"the planner's choice is {x:.3f}x faster: {'; '.join(out['reasons'])}")
        else:
            print("your configuration is the planner's choice" if x > 1 - 1e-9 else
                  f"your configuration is {1 / x:.3f}x faster than the planner's choice (a search "
                  f"heuristic missed it: please report)")
    return _verdict(why_not)


def _verdict(why_not) -> int:
    """Exit status: 0 when the configuration can run, else 2 after one error line (the report,
    with the planner's choice, is printed first)."""
    if why_not is None:
        return 0
    print(f"ds-autoplan cost: error: your configuration cannot run: {why_not}", file=sys.stderr)
    return 2
