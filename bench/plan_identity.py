"""Plans before and after a refactor: every case of bench/planner.py,
bench/published_runs.py (the published configurations costed, and the planner's free choice
up to 64 GPUs) and the README's plan/cost examples, each written as its plan.to_dict() (the
search timings removed), its ds_config and its Megatron-LM flags.

    python bench/plan_identity.py --save DIR      # record the reference
    python bench/plan_identity.py --compare DIR   # same cases now: identical?

``--compare`` prints one line per case and, last, a JSON object {"cases", "identical",
"different"}; it exits 1 if any case differs.  Keys a newer Plan adds are compared against
their defaults (``NEW_DEFAULTS``): an old plan.json has none of them and must mean the same.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TIMING = ("search_time_s", "search_phases_s")
# fields added to plan.json after the reference: their values in a plan of the old space
NEW_DEFAULTS = {"ep": 1, "cp": 1, "cp_comm": "p2p", "offload": "none", "host_memory_gb_per_node": 0.0}
# rows added after the reference that a plan of the old space does not depend on: the
# offload baseline of clusters with host figures (issue 26)
NEW_ROWS = ("ZeRO-3 + full offload",)
# a costed published configuration, as compared
CONFIG_KEYS = ("tp", "pp", "dp", "micro_batch", "num_microbatches", "zero", "recompute", "sp",
               "chunks")


# the prediction's per-component breakdown (issue 38): a record of the costing, not a decision
RECORDS = ("components",)
# peaks the reference rounded to MB (plan.json keeps kB since issue 38)
ROUNDED_MB = ("peak_memory_gb_per_stage", "peak_gb")


def _mb(v):
    """A peak (or a list of them) as the reference rounded it."""
    return [_mb(x) for x in v] if isinstance(v, list) else round(v, 3) if isinstance(v, float) else v


def _clean(d):
    if isinstance(d, dict):
        return {k: _mb(v) if k in ROUNDED_MB else _clean(v)
                for k, v in d.items() if k not in TIMING + RECORDS and not _new_default(k, v, d)}
    if isinstance(d, list):
        return [_clean(x) for x in d]
    return d


def _new_default(k, v, d: dict) -> bool:
    """A key newer than the reference at its old meaning (no expert/context parallelism)."""
    return NEW_DEFAULTS.get(k, object()) == v or k == "etp" and v == d.get("tp") or k in NEW_ROWS or \
        k == "offload" and isinstance(v, dict) and v.get("what") == "none"


def _plan_record(plan) -> dict:
    from ds_autoplan.emit.deepspeed import ds_config
    from ds_autoplan.emit.megatron import megatron_args
    d = _clean(plan.to_dict())
    ds = _clean(ds_config(plan))
    ds.get("pipeline", {}).pop("autoplan", None)
    return {"plan": d, "ds_config": ds, "megatron_args": megatron_args(plan)}


def cases():
    """(name, thunk returning a JSON-able record) for every case."""
    import planner as bp
    import published_runs as pr
    from ds_autoplan.search import search
    out = []
    for i, (model, cluster, B, opts) in enumerate(bp.CASES):
        out.append((f"planner/{i}/{model}/{cluster}/{B}",
                    lambda a=(model, cluster, B, opts): _plan_record(
                        search(a[0], a[1], a[2], progress=False, **a[3]).plan)))
    for r in pr.load_rows():
        def published(r=r):
            try:
                (cfg, c), *_ = pr.cost_published(r)
            except Exception as e:        # a row the bench does not cost: its message
                return {"error": str(e)}
            return {"config": {k: getattr(cfg, k) if hasattr(cfg, k) else cfg.sequence_parallel
                               for k in CONFIG_KEYS}, "time": c.time,
                    "peak": c.peak, "fits": c.fits}
        out.append((f"published/{r['id']}/cost", published))
        if r["gpus"] <= 64:
            def free(r=r):
                model, cluster = pr.setup(r)
                res, err = pr.free_choice(r, cluster)
                return {"free": res, "error": err}
            out.append((f"published/{r['id']}/free", free))
    readme = [("llama2-7b", "8xh100-80gb", 512, {}), ("gpt3-13b", "2x8xa100-ib200", 256, {}),
              ("gpt3-6.7b", "8xa100-80gb", 256, {}),
              ("gpt-tiny", "cpu-2", 8, {"pp": 2, "schedules": ["v-half"], "precision": "fp32"}),
              ("gpt3-13b", "2x8xa100-ib200", 256, {"runtime": "megatron"}),
              ("gpt3-13b", "2x8xa100-ib200", 256, {"runtime": "deepspeed"}),
              ("llama2-70b", "64xa100-80gb", 512, {"fix": "schedule=interleaved,v=2"}),
              ("gpt3-175b", "64xa100-80gb", 1536, {"fix": "tp=8,pp=8,mbs=1,recompute=full"}),
              ("gpt3-6.7b", "8xa100-80gb", 256, {"fix": "pp=2,schedule=v-zb"}),
              ("gpt3-6.7b", "8xa100-80gb", 256, {"sequence_parallel": "off", "runtime": "megatron"})]
    for model, cluster, B, opts in readme:
        out.append((f"readme/{model}/{cluster}/{B}/{sorted(opts.items())}",
                    lambda a=(model, cluster, B, opts): _plan_record(
                        search(a[0], a[1], a[2], wide=False, **a[3]).plan)))

    for i, conf in enumerate(("tp=8,pp=8,mbs=1,recompute=full,schedule=1f1b",
                              "tp=8,pp=8,mbs=1,schedule=interleaved,v=2,sp=on",
                              "tp=4,pp=4,zero=1,recompute=selective")):
        out.append((f"readme/cost/gpt3-175b/{i}", lambda conf=conf: _cost_cli(conf)))
    return out


def _cost_cli(conf: str) -> dict:
    import contextlib
    import io
    from ds_autoplan.cli import main
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        main(["cost", "--model", "gpt3-175b", "--cluster", "64xa100-80gb", "--global-batch",
              "1536", "--config", conf, "--json"])
    return _clean(json.loads(buf.getvalue()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--save", metavar="DIR")
    g.add_argument("--compare", metavar="DIR")
    ap.add_argument("--only", help="run the cases whose name contains this")
    a = ap.parse_args(argv)
    d = a.save or a.compare
    os.makedirs(d, exist_ok=True)
    same = diff = 0
    for name, thunk in cases():
        if a.only and a.only not in name:
            continue
        rec = json.loads(json.dumps(thunk()))
        path = os.path.join(d, name.replace("/", "__") + ".json")
        if a.save:
            with open(path, "w") as f:
                json.dump(rec, f, indent=1, sort_keys=True)
            print(f"saved {name}", flush=True)
            continue
        if not os.path.exists(path):           # a case added after the reference
            print(f"new {name}", flush=True)
            continue
        with open(path) as f:
            ref = json.load(f)
        ok = _clean(ref) == _clean(rec)     # the published rows' records are raw
        same, diff = same + ok, diff + (not ok)
        print(f"{'identical' if ok else 'DIFFERENT'} {name}", flush=True)
        if not ok:
            with open(path + ".new", "w") as f:
                json.dump(rec, f, indent=1, sort_keys=True)
    if a.compare:
        print(json.dumps({"cases": same + diff, "identical": same, "different": diff}))
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
