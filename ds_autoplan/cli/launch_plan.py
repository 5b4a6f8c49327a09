"""What both forms of ``ds-autoplan launch`` share (launch_cmd.py: DeepSpeed's launcher;
launch_command.py: a torchrun command): the plan made before launch, the files a launch writes,
the planning request a ``--calibrate`` re-plan repeats."""
from __future__ import annotations

import os

from ..emit.deepspeed import MERGED_CONFIG   # the script's ds_config.json is never written
from . import UserError

PLAN_ENV = "DS_AUTOPLAN_PLAN"

# what a launch writes under --out (ds_autoplan.outputs.write_folder)
OUT_FILES = ("plan.json", MERGED_CONFIG, "profile.json", "measured.json", "cluster.detected.yaml",
             "replan.json", "cluster.calibrated.yaml")


def _plan_model_now(model, cluster, global_batch, pp, schedules, resources, out, offload=None,
                    tp=None, remeasure: bool = False, switchable: bool = False, precision=None) -> str:
    """Plan a model description before launch for the launch's ``resources`` (``{host:
    slots}``; ``--cluster auto``: detected on this node, with the launch's nodes and ranks per
    node); returns plan.json's path."""
    from ..emit.deepspeed import ds_config
    from ..spec import SpecError
    from .cluster_cmd import resolve
    world = sum(len(v) for v in resources.values())
    if cluster == "auto":
        _devices_here(resources)
        cluster = resolve(cluster, len(resources), world // len(resources), folder=out, remeasure=remeasure)
    from ..runtime.replan import plan_request
    try:
        plan = plan_request({"model": model, "global_batch": global_batch, "pp": pp, "tp": tp,
                             "schedules": schedules, "offload": offload, "precision": precision},
                            cluster, switchable)
    except (SpecError, ValueError, KeyError) as e:
        where = getattr(cluster, "name", cluster)       # a detected cluster: its name
        raise UserError(f"planning {model} on {where} failed: {e}") from None
    if plan.world != world:
        raise UserError(f"the plan uses {plan.world} ranks (cluster {plan.cluster}) but the launch "
                        f"has {world}; pass a cluster with {world} devices")
    from ..outputs import json_text, text, write_folder
    write_folder(out, {"plan.json": text(plan.to_json() + "\n"),
                       MERGED_CONFIG: json_text(ds_config(plan))}, complete=False)
    plan_path = os.path.join(out, "plan.json")
    print(f"ds-autoplan: {model} on {plan.cluster} ({world} ranks): pp={plan.pp} tp={plan.tp} "
          f"dp={plan.dp} schedule={plan.schedule_label} -> {plan_path}", flush=True)
    return plan_path


def _devices_here(resources: dict) -> None:
    """``--model`` with ``--cluster auto`` plans on this node's devices before launch: refused
    on a node without GPUs that launches onto other hosts (a login node), where they would be
    the wrong ones."""
    import socket

    import torch
    local = {"localhost", "127.0.0.1", socket.gethostname()}
    if not torch.cuda.is_available() and set(resources) - local:
        raise UserError("--model with --cluster auto plans on this node's devices, and it has no GPU "
                        f"while the launch runs on {', '.join(sorted(set(resources) - local))}: give "
                        "--cluster (`ds-autoplan cluster` on a worker writes one), or launch without "
                        "--model (every rank then reports its device)")


def replan_request(model: str, opts: dict) -> dict:
    """The planning request rank 0 re-plans with (runtime/replan.py ``plan_request``): the
    launch's model and restrictions, files as absolute paths; ``--cluster auto``: the cluster
    file the launch keeps in its folder."""
    from ..profile import persisted
    cluster = opts["cluster"] or "auto"
    if os.path.exists(model):
        model = os.path.abspath(model)
    return {"model": model, "global_batch": opts["global_batch"] or 8, "pp": opts["pp"], "tp": opts["tp"],
            "schedules": opts["schedules"], "offload": opts["offload"], "precision": opts.get("precision"),
            "cluster": os.path.join(opts["out"], persisted.FILE) if cluster == "auto"
            else os.path.abspath(cluster) if os.path.exists(cluster) else cluster}
