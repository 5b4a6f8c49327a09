"""Plan-independent checkpoints: what both runtimes write next to their weights so that a run
saved under one plan resumes under another (issue 13, item 6).

A checkpoint is a folder.  Parameters and optimizer state are keyed by the model's *global
layer index* (and the parameter's name inside its layer), never by rank, stage or position
in an optimizer's parameter group, so a different schedule, partition, pp, dp or ZeRO stage
reads them unchanged.  ``autoplan_checkpoint.json`` says which plan wrote the folder:

    {"format": 1, "framework": "deepspeed", "step": 3, "num_layers": 8, "plan": {...},
     "optimizer": {"class": "Adam", "param_groups": [{"lr": 0.01, ...}]}}

``ds-autoplan checkpoint info DIR`` prints it (:func:`describe`).
"""
from __future__ import annotations

import json
import os

from ..errors import UserError

META = "autoplan_checkpoint.json"
FORMAT = 1


class CheckpointError(UserError):
    """A checkpoint folder that is missing, from another framework or another model."""


def state_path(ckpt_dir, layer: int) -> str:
    """The file holding the optimizer state (and fp32 master weights) of global ``layer``."""
    return os.path.join(os.fspath(ckpt_dir), f"layer_{layer:02d}-autoplan_states.pt")


def write_meta(ckpt_dir, *, framework: str, plan, step: int, num_layers: int, optimizer) -> dict:
    """Write ``autoplan_checkpoint.json`` (call on one rank)."""
    groups = [{k: v for k, v in g.items() if k != "params" and isinstance(v, (int, float, bool, str))}
              for g in getattr(optimizer, "param_groups", [])]
    meta = {"format": FORMAT, "framework": framework, "step": int(step), "num_layers": int(num_layers),
            "plan": plan.to_dict() if hasattr(plan, "to_dict") else plan,
            "optimizer": {"class": type(optimizer).__name__, "param_groups": groups}}
    with open(os.path.join(os.fspath(ckpt_dir), META), "w") as f:
        json.dump(meta, f, indent=1)
    return meta


def read_meta(ckpt_dir, framework: str | None = None, num_layers: int | None = None) -> dict:
    """The checkpoint's metadata; raises :class:`CheckpointError` when the folder is not an
    ds_autoplan checkpoint or was written by another framework or for another layer count."""
    path = os.path.join(os.fspath(ckpt_dir), META)
    if not os.path.isfile(path):
        raise CheckpointError(f"{ckpt_dir} is not a ds_autoplan checkpoint (no {META})")
    with open(path) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {meta.get('format')!r}, this version "
                              f"reads format {FORMAT}")
    if framework is not None and meta["framework"] != framework:
        raise CheckpointError(f"{ckpt_dir} was saved by the {meta['framework']} runtime; it "
                              f"cannot be loaded into {framework}")
    if num_layers is not None and meta["num_layers"] != num_layers:
        raise CheckpointError(f"{ckpt_dir} holds a model with {meta['num_layers']} layers, this "
                              f"model has {num_layers}")
    return meta


def describe(ckpt_dir) -> str:
    """Human-readable summary: framework, step, the plan it was saved under, optimizer."""
    meta = read_meta(ckpt_dir)
    p = meta["plan"] or {}
    opts = p.get("schedule_options") or {}
    lines = [f"checkpoint {ckpt_dir}: {meta['framework']}, step {meta['step']}, "
             f"{meta['num_layers']} layers",
             f"saved under plan: schedule {p.get('schedule')}"
             + (f" {opts}" if opts else "")
             + f", pp {p.get('pp')} tp {p.get('tp')} dp {p.get('dp')}, ZeRO {p.get('zero_stage')}, "
               f"{p.get('precision')}",
             f"  layers per stage {p.get('layers_per_stage')}, recompute {p.get('recompute_per_stage')}",
             f"  micro-batch {p.get('micro_batch_size')} x {p.get('num_microbatches')} per replica, "
             f"global batch {p.get('global_batch_size')}",
             f"optimizer {meta['optimizer']['class']} {meta['optimizer']['param_groups']}",
             "loads under any plan for the same model (schedule, partition, pp, dp, ZeRO 0/1)"]
    return "\n".join(lines)


__all__ = ["CheckpointError", "FORMAT", "META", "describe", "read_meta", "state_path", "write_meta"]
