"""`ds-autoplan simulate`: build a schedule, simulate it, print a table or JSON, plot it."""
from __future__ import annotations

import inspect
import json
import os
import sys

from ..schedule import (BUILDERS, Costs, Schedule, ScheduleError, build, lower, names, simulate,
                        validate)


def add_parser(sub) -> None:
    p = sub.add_parser("simulate", help="build and simulate a pipeline schedule",
                       description="Build a pipeline schedule, simulate it and report makespan, "
                                   "bubble ratio and peak activation memory per rank.")
    p.add_argument("--schedule", default="1f1b",
                   help=f"builder name ({', '.join(names())})")
    p.add_argument("--compare", help="comma-separated schedules, printed side by side with "
                                     "ratios to the first")
    p.add_argument("--file", help="simulate a schedule file (.json or text form) instead")
    p.add_argument("--stages", "-d", type=int, default=4, help="pipeline devices d")
    p.add_argument("--microbatches", "-n", type=int, default=8, help="micro-batches n")
    p.add_argument("--chunks", "-v", type=int, default=None, help="chunks per rank (interleaved)")
    p.add_argument("--times", default="1,1,1",
                   help="F,B,W durations of one micro-batch over 1/d of the model")
    p.add_argument("--p2p", type=float, default=0.0, help="latency of a cross-rank transfer")
    p.add_argument("--mem-cap", type=float, default=None,
                   help="activation cap per rank (units of 1/d model micro-batch; adaptive)")
    p.add_argument("--option", "-o", action="append", metavar="KEY=VALUE",
                   help="builder option (JSON value), e.g. -o recompute='[1,1,0]' for merak-scp")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--plot", metavar="FILE",
                   help="write the Gantt chart to FILE (PNG/SVG, by its extension); with --compare "
                        "one chart per schedule, FILE's name with -SCHEDULE before the extension")
    p.add_argument("--memory-plot", metavar="FILE",
                   help="write the activation-memory plot to FILE (named like --plot's with --compare)")
    p.add_argument("--trace", metavar="FILE.json",
                   help="write the simulated timeline as a Chrome/Perfetto trace (one track per "
                        "rank; one process per schedule with --compare; 1 time unit = 1 ms)")
    p.add_argument("--save", help="write the (lowered) schedule to this file (.json or .txt)")
    p.set_defaults(func=run)


def _times(text: str) -> tuple[float, float, float]:
    try:
        vals = [float(x) for x in text.split(",")]
    except ValueError:
        raise ScheduleError(f"--times must be three numbers F,B,W, got {text!r}") from None
    if len(vals) != 3:
        raise ScheduleError(f"--times must be three numbers F,B,W, got {text!r}")
    if min(vals) < 0:
        raise ScheduleError(f"--times must be non-negative, got {text!r}")
    return vals[0], vals[1], vals[2]


def _options(name: str, args) -> dict:
    """Builder keyword arguments: --chunks, --mem-cap and the --times ratios go to builders
    whose signature takes them (v, mem_cap, f/b/w); --option KEY=VALUE to any builder."""
    params = inspect.signature(BUILDERS[name]).parameters
    opts = {}
    if args.chunks is not None and "v" in params:
        opts["v"] = args.chunks
    if args.mem_cap is not None and "mem_cap" in params:
        opts["mem_cap"] = args.mem_cap
    if {"f", "b", "w"} <= set(params):
        opts.update(zip("fbw", _times(args.times)))
    for item in args.option or []:
        key, sep, val = item.partition("=")
        if not sep or not key:
            raise ScheduleError(f"--option expects KEY=VALUE, got {item!r}")
        try:
            opts[key] = json.loads(val)
        except json.JSONDecodeError:
            opts[key] = val
    unknown = set(opts) - set(params)
    if unknown and not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        raise ScheduleError(f"{name}: unknown option(s) {', '.join(sorted(unknown))}; it takes "
                            f"{', '.join(k for k in params if k not in ('d', 'n')) or 'none'}")
    return opts


def _fmt(target: str) -> str:
    """The image format of ``target`` (its extension; PNG without one)."""
    return os.path.splitext(target)[1].lstrip(".").lower() or "png"


def simulate_one(sched: Schedule, f: float, b: float, w: float, p2p: float = 0.0):
    costs = Costs.uniform(sched, f, b, w, p2p=p2p)
    return simulate(sched, costs), costs


def _named(path: str, schedule: str, count: int) -> str:
    """The file --plot / --memory-plot PATH writes for ``schedule`` (one of ``count``)."""
    root, ext = os.path.splitext(path)
    return path if count == 1 else f"{root}-{schedule}{ext}"


def _wrote(files, stream) -> None:
    for what, path in files:
        print(f"wrote {what} to {path}", file=stream)


def _targets(args, names: list[str]) -> dict:
    """(option, schedule index) -> the file it writes, each checked before anything is
    simulated or written (ds_autoplan.outputs.resolve_file)."""
    from ..outputs import resolve_file
    out = {}
    for opt, path in (("--plot", args.plot), ("--memory-plot", args.memory_plot)):
        if path is None:
            continue
        for i, name in enumerate(names):
            out[opt, i] = resolve_file(_named(path, name, len(names)), opt, create_parent=False)
    for opt, path in (("--save", args.save), ("--trace", args.trace)):
        if path is not None:
            out[opt, 0] = resolve_file(path, opt, create_parent=False)
    return out


def run(args) -> int:
    from ..outputs import write_files
    f, b, w = _times(args.times)
    if args.file:
        scheds = [Schedule.load(args.file)]
        validate(scheds[0])        # a complete list before costs are sized by its micro-batches
    else:
        sel = args.compare.split(",") if args.compare else [args.schedule]
        known = names()
        for s in sel:
            if s not in known:
                raise ScheduleError(f"unknown schedule {s!r}; choose from {', '.join(known)}")
        scheds = [build(s, args.stages, args.microbatches, **_options(s, args)) for s in sel]
    targets = _targets(args, [s.name for s in scheds])
    rows = []
    for sched in scheds:
        res, costs = simulate_one(sched, f, b, w, args.p2p)
        rows.append((sched, res, costs))
    base = rows[0][1]
    out = []
    for sched, res, costs in rows:
        out.append({"schedule": sched.name, "stages": sched.num_ranks,
                    "microbatches": sched.num_microbatches, "makespan": res.makespan,
                    "bubble_ratio": res.bubble_ratio, "peak_activation": res.peak_units,
                    "makespan_ratio": res.makespan / base.makespan if base.makespan else 1.0,
                    "peak_ratio": max(res.peak_units) / max(base.peak_units)
                    if max(base.peak_units) else 1.0,
                    **({} if len(rows) > 1 else {"schedule_lists": sched.to_dict()["ranks"]})})
    wrote = []                     # (what, the path the user named)
    files = {}        # written together: a failure (a full disk) leaves none of them changed
    if ("--save", 0) in targets:
        sched, _, costs = rows[0]
        files[targets["--save", 0]] = (lower(sched, costs).save, "--save")
        wrote.append((f"the {sched.name} schedule (lowered)", args.save))
    if ("--trace", 0) in targets:
        from ..outputs import json_text
        from ..schedule.trace import trace_events
        groups = [(s.name, res.timeline()) for s, res, _ in rows]
        files[targets["--trace", 0]] = (json_text(trace_events(groups, scale=1e3), indent=None),
                                        "--trace")
        wrote.append(("the trace (open it in https://ui.perfetto.dev)", args.trace))
    if targets.keys() - {("--save", 0), ("--trace", 0)}:
        from ..schedule.plots import plot_gantt, plot_memory
        for i, (sched, res, _) in enumerate(rows):
            for opt, given, draw, what in (
                    ("--plot", args.plot, plot_gantt, "Gantt chart"),
                    ("--memory-plot", args.memory_plot, plot_memory, "activation-memory plot")):
                if (opt, i) in targets:
                    path = targets[opt, i]
                    files[path] = (lambda p, draw=draw, sched=sched, res=res, fmt=_fmt(path):
                                   draw(sched, res, p, fmt=fmt), opt)
                    wrote.append((f"the {sched.name} {what}", _named(given, sched.name, len(rows))))
    write_files(files)
    if args.json:
        _wrote(wrote, sys.stderr)       # stdout is the JSON
        if len(out) == 1:
            o = dict(out[0])
            o["schedule"] = {"name": o["schedule"], "ranks": o.pop("schedule_lists")}
            print(json.dumps(o))
        else:
            print(json.dumps({"compare": out}))
        return 0
    hdr = f"{'schedule':<14}{'d':>3}{'n':>5}{'makespan':>11}{'bubble':>9}{'peak act (per rank)':>28}{'time x':>8}{'mem x':>7}"
    print(hdr)
    for o in out:
        peaks = " ".join(f"{p:g}" for p in o["peak_activation"])
        print(f"{o['schedule']:<14}{o['stages']:>3}{o['microbatches']:>5}{o['makespan']:>11.4g}"
              f"{o['bubble_ratio']:>9.3f}{peaks:>28}{o['makespan_ratio']:>8.3f}{o['peak_ratio']:>7.3f}")
    _wrote(wrote, sys.stdout)
    return 0
