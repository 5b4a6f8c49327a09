"""`ds-autoplan calibrate RUN_DIR [RUN_DIR ...] --cluster C --out C2.yaml`: fit the cluster's
figures to what runs on it measured (each RUN_DIR holds a run's plan.json and the
measured.json the run wrote beside it) and write the calibrated cluster, loadable by every
``--cluster`` (docs/calibration.md).  Prints one row per cost-model component: predicted,
measured and their ratio before and after, then which figure moved from what to what."""
from __future__ import annotations

import json
import math
import os

from . import UserError, doc_description

from ..runtime.calibration import HEADER, _plain, calibrated_yaml, fit_folders


def add_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="fit the cluster's figures to the records of runs on it",
                       description=doc_description(__doc__))
    p.add_argument("runs", nargs="+", metavar="RUN_DIR",
                   help="a run's output folder (plan.json and the measured.json the run wrote)")
    p.add_argument("--cluster", required=True, help="the cluster file or preset the runs were planned on")
    p.add_argument("--out", required=True, help="write the calibrated cluster YAML here (a new file, "
                                                "or one an earlier calibrate wrote)")
    p.add_argument("--model", default=None,
                   help="the model description, where the plans name one that is no preset or file")
    p.add_argument("--json", action="store_true", help="print the table as one JSON object")
    p.set_defaults(func=run)


def _table(runs, predict, cl0, cl1) -> list[dict]:
    from ..cost.components import NAMES
    rows = []
    for r in runs:
        p0, p1 = predict(cl0, r.index), predict(cl1, r.index)
        meas = r.rec["iteration_time_s"]["measured"]
        rows.append({"run": r.folder, "component": "iteration", "measured": meas,
                     "before": p0[0], "after": p1[0]})
        for name in NAMES:
            m = sum(r.rec["components"][name]["measured"])
            b, a = sum(p0[2].get(name) or []), sum(p1[2].get(name) or [])
            if m or b or a:
                rows.append({"run": r.folder, "component": name, "measured": m, "before": b, "after": a})
        mm = max(r.rec["peak_memory_gb"]["measured"])
        rows.append({"run": r.folder, "component": "peak memory (GB)", "measured": mm,
                     "before": max(p0[1]), "after": max(p1[1])})
    return rows


def _ratio(p, m) -> str:
    return f"{p / m:.3f}" if m else "-"


def run(args) -> int:
    from ..outputs import resolve_file, text, write_file
    from ..spec import SpecError
    from ..spec.cluster import load_cluster
    target = resolve_file(args.out, "--out", create_parent=False)
    if os.path.exists(target):
        with open(target, "rb") as fh:
            head = fh.read(len(HEADER))
        if head.decode("utf-8", "replace") != HEADER:
            raise UserError(f"--out {args.out}: exists and was not written by ds-autoplan calibrate; "
                            "give a new file")
    try:
        cl0 = load_cluster(args.cluster)
    except (SpecError, OSError) as e:
        raise UserError(f"--cluster {args.cluster}: {e}") from None
    res, runs, predict = fit_folders(args.runs, cl0, args.model)
    cl1 = res.cluster
    if not all(math.isfinite(x) for x in res.residuals):     # before anything is printed or written
        raise UserError("the fit did not converge")
    rows = _table(runs, predict, cl0, cl1)
    report = {"rows": rows, "moved": [list(m) for m in res.moved], "unchanged": [list(u) for u in res.unchanged],
              "disagree": [[n, r] for n, r in res.disagree], "residuals": res.residuals, "out": args.out}
    if args.json:
        print(json.dumps(report, default=float))
    else:
        _print(rows, res)
    write_file(args.out, text(calibrated_yaml(res, runs, args.cluster, cl0, args.out)), what="--out")
    if not args.json:
        print(f"wrote {args.out}")
    return 0


def _print(rows, res) -> None:
    w = max(len(r["component"]) for r in rows)
    run_dir = None
    for r in rows:
        if r["run"] != run_dir:
            run_dir = r["run"]
            print(f"{run_dir}:")
            print(f"  {'component':<{w}}  {'measured':>11}  {'before':>11} {'ratio':>6}  {'after':>11} {'ratio':>6}")
        unit = "" if "GB" in r["component"] else " s"
        print(f"  {r['component']:<{w}}  {r['measured']:>9.4g}{unit:2}  {r['before']:>9.4g}{unit:2} "
              f"{_ratio(r['before'], r['measured']):>6}  {r['after']:>9.4g}{unit:2} {_ratio(r['after'], r['measured']):>6}")
    for f, b, a, why in res.moved:
        print(f"moved {f}: {_plain(b):.6g} -> {_plain(a):.6g} ({why})")
    for f, why in res.unchanged:
        print(f"unchanged {f}: {why}")
    for n, r in res.disagree:
        print(f"disagree {n}: measured/predicted {', '.join(f'{x:.3g}' for x in r)} across the runs "
              "(beyond the fit's spread: not averaged)")
    worst = max(abs(x) for x in res.residuals)
    print(f"residual after calibration: up to {100 * worst:.2f}% of the measured iteration time "
          f"over {len(res.residuals)} run(s)")
