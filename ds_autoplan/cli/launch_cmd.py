"""`ds-autoplan launch [planner options] [deepspeed launcher options] train.py [args]`: plan
for the launch's world size, write plan.json and ds_config.json, then run DeepSpeed's own
launcher with ``--deepspeed_config ds_config.json`` appended to the script's arguments and
``DS_AUTOPLAN_PLAN`` (the plan's path) in every rank's environment (integration.md §1.8).
``deepspeed --autoplan`` (after ``ds-autoplan patch deepspeed``) calls :func:`apply_autoplan`.
"""
from __future__ import annotations

import argparse
import json
import os

from . import UserError

PLAN_ENV = "DS_AUTOPLAN_PLAN"


def _planner_options(env) -> dict:
    return {"model": env.get("DS_AUTOPLAN_MODEL", "gpt-tiny"),
            "cluster": env.get("DS_AUTOPLAN_CLUSTER"),
            "global_batch": int(env.get("DS_AUTOPLAN_GLOBAL_BATCH", "8")),
            "out": env.get("DS_AUTOPLAN_OUT", "ds_autoplan_out")}


def apply_autoplan(args, world: int, env, model=None, cluster=None, global_batch=None, out=None):
    """Plan ``model`` on ``cluster`` (default ``cpu-<world>``) for ``world`` ranks, write
    ``plan.json`` and ``ds_config.json`` under ``out``, append ``--deepspeed_config`` to
    ``args.user_args`` and put the plan's path in ``env``.  Returns (plan, config path)."""
    from ..emit.deepspeed import ds_config
    from ..search import plan_model
    o = _planner_options(env)
    model, cluster = model or o["model"], cluster or o["cluster"] or f"cpu-{world}"
    global_batch, out = global_batch or o["global_batch"], out or o["out"]
    try:
        plan = plan_model(model, cluster, global_batch)
    except (ValueError, KeyError) as e:
        raise UserError(f"planning {model} on {cluster} failed: {e}") from None
    if plan.world != world:
        raise UserError(f"the plan uses {plan.world} ranks (cluster {cluster}) but the launch has "
                        f"{world}; pass a cluster with {world} devices")
    os.makedirs(out, exist_ok=True)
    plan_path, cfg_path = os.path.abspath(f"{out}/plan.json"), os.path.abspath(f"{out}/ds_config.json")
    plan.save(plan_path)
    with open(cfg_path, "w") as fh:
        json.dump(ds_config(plan), fh, indent=2)
    args.user_args = list(args.user_args) + ["--deepspeed_config", cfg_path]
    env[PLAN_ENV] = plan_path
    print(f"ds-autoplan: {model} on {cluster} ({world} ranks): pp={plan.pp} tp={plan.tp} "
          f"dp={plan.dp} schedule={plan.schedule} -> {plan_path}, {cfg_path}", flush=True)
    return plan, cfg_path


def launch_world(a) -> int:
    """The number of ranks DeepSpeed's launcher will start for parsed launcher args ``a``
    (its own resource functions: hostfile, include/exclude, num_nodes/num_gpus)."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.launcher import runner
    pool = runner.fetch_hostfile(a.hostfile) or {"localhost": get_accelerator().device_count()}
    active = runner.parse_inclusion_exclusion(pool, a.include, a.exclude)
    active = runner.apply_num_nodes_and_gpus(active, a.num_nodes, a.num_gpus)
    return sum(len(v) for v in active.values())


def _own_parser():
    p = argparse.ArgumentParser(prog="ds-autoplan launch", add_help=False)
    p.add_argument("--model", default=None, help="model preset or file (default gpt-tiny)")
    p.add_argument("--cluster", default=None, help="cluster preset or file (default cpu-<world>)")
    p.add_argument("--global-batch", type=int, default=None)
    p.add_argument("--out", default=None, help="directory for plan.json, ds_config.json")
    return p


def add_parser(subparsers):
    # every argument is passed through untouched ("+" is no option prefix for deepspeed or us):
    # ours (--model, --cluster, --global-batch, --out) are taken from the part before the script
    p = subparsers.add_parser("launch", prefix_chars="+", add_help=False,
                              help="plan, write ds_config.json, run the deepspeed launcher "
                                   "(options: --model --cluster --global-batch --out, then "
                                   "deepspeed launcher options, script, script args)",
                              description=__doc__.splitlines()[0])
    p.add_argument("argv", nargs=argparse.REMAINDER)
    p.set_defaults(func=run)


def run(args) -> int:
    from deepspeed.launcher import runner
    argv = list(args.argv)
    if not argv:
        raise UserError("give the training script, e.g. ds-autoplan launch --num_gpus 2 train.py")
    # the script is the first token runner.parse_args leaves as user_script; split there
    own, rest = _own_parser().parse_known_args(_before_script(argv))
    argv = rest + argv[len(_before_script(argv)):]
    try:
        a = runner.parse_args(argv)
    except SystemExit:
        raise UserError("could not parse the deepspeed launcher arguments") from None
    if not a.module and not os.path.exists(a.user_script):
        raise UserError(f"training script not found: {a.user_script}")
    cut = len(argv) - len(a.user_args) - 1
    apply_autoplan(a, launch_world(a), os.environ, own.model, own.cluster, own.global_batch, own.out)
    runner.main(argv[:cut] + [a.user_script] + a.user_args)
    return 0


def _before_script(argv):
    """The launcher/planner options: everything before the first token ending in .py (or
    the first non-option token)."""
    for i, tok in enumerate(argv):
        if tok.endswith(".py"):
            return argv[:i]
    return argv[:-1]
