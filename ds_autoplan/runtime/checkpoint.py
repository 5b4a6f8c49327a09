"""Plan-independent checkpoints: what both runtimes write next to their weights so that a run
saved under one plan resumes under another.

A checkpoint is a folder.  Parameters and optimizer state are keyed by the model's *global
layer index* (and the parameter's name inside its layer), never by rank, stage or position
in an optimizer's parameter group, so a different schedule, partition, pp, dp or ZeRO stage
reads them unchanged.  ``autoplan_checkpoint.json`` says which plan wrote the folder:

    {"format": 1, "framework": "deepspeed", "step": 3, "num_layers": 8, "world_size": 2,
     "counters": {"global_samples": 24, "skipped_steps": 0}, "plan": {...},
     "optimizer": {"class": "Adam", "param_groups": [{"lr": 0.01, ...}]},
     "lr_scheduler": "WarmupDecayLR"}

``ds-autoplan checkpoint info DIR`` prints it (:func:`describe`).  Beside it, the training
state that belongs to no layer: ``autoplan_train_state.pt`` (the learning-rate scheduler's
``state_dict`` and the optimizer's parameter-group hyperparameters; :func:`save_train_state`)
and one ``autoplan_rank_XXXXX.pt`` per rank (its random generators and the user's
``client_state``; :func:`save_rank_state`).  Every file is written crash-safe, listed with its
size and sha256 in ``manifest.json`` and read without running code
(:mod:`ds_autoplan.runtime.checkpoint_files`).
"""
from __future__ import annotations

import json
import os
import random

import torch
import torch.distributed as dist

from .checkpoint_files import (MANIFEST, CheckpointError, fault_point, loadable_without_code,
                               open_regular, read_latest, read_manifest, safe_load, torch_save,
                               verify)
from .rng import RngState

META = "autoplan_checkpoint.json"
FORMAT = 1


def state_path(ckpt_dir, layer: int) -> str:
    """The file holding the optimizer state (and fp32 master weights) of global ``layer``."""
    return os.path.join(os.fspath(ckpt_dir), f"layer_{layer:02d}-autoplan_states.pt")


def write_meta(ckpt_dir, *, framework: str, plan, step: int, num_layers: int, optimizer,
               scheduler=None, counters: dict | None = None) -> dict:
    """Write ``autoplan_checkpoint.json`` (call on one rank): ``step`` is the number of
    optimizer steps taken, ``counters`` further step counters (ints, e.g. DeepSpeed's
    ``global_samples`` / ``skipped_steps``); the learning-rate scheduler is named (its state is
    in :data:`TRAIN_STATE`)."""
    groups = [{k: v for k, v in g.items() if k != "params" and isinstance(v, (int, float, bool, str))}
              for g in getattr(optimizer, "param_groups", [])]
    meta = {"format": FORMAT, "framework": framework, "step": int(step), "num_layers": int(num_layers),
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "counters": {k: int(v) for k, v in (counters or {}).items()},
            "plan": plan.to_dict() if hasattr(plan, "to_dict") else plan,
            "optimizer": {"class": type(optimizer).__name__, "param_groups": groups},
            "lr_scheduler": type(scheduler).__name__ if scheduler is not None else None}
    with open(os.path.join(os.fspath(ckpt_dir), META), "w") as f:
        json.dump(meta, f, indent=1)
    fault_point("file")
    return meta


_META_FIELDS = {"framework": str, "step": int, "num_layers": int, "world_size": int,
                "counters": dict, "optimizer": dict}


def read_meta(ckpt_dir, framework: str | None = None, num_layers: int | None = None) -> dict:
    """The checkpoint's metadata; raises :class:`CheckpointError` when the folder is not an
    ds_autoplan checkpoint or was written by another framework or for another layer count."""
    path = os.path.join(os.fspath(ckpt_dir), META)
    if not os.path.isfile(path):
        tag = read_latest(ckpt_dir)                                 # engine.save_checkpoint's
        hint = "" if tag is None else f"; its latest checkpoint is {os.path.join(os.fspath(ckpt_dir), tag)}"
        raise CheckpointError(f"{ckpt_dir} is not a ds_autoplan checkpoint (no {META}){hint}")
    try:
        with open_regular(path) as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: not a ds_autoplan checkpoint description (a JSON "
                              f"{type(meta).__name__}, not an object)")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {meta.get('format')!r}, this version "
                              f"reads format {FORMAT}")
    bad = [k for k, t in _META_FIELDS.items() if not isinstance(meta.get(k), t)
           or isinstance(meta.get(k), bool)]
    if bad:
        raise CheckpointError(f"{path}: missing or invalid {', '.join(bad)} (expected "
                              + ", ".join(f"{k}: {_META_FIELDS[k].__name__}" for k in bad) + ")")
    if framework is not None and meta["framework"] != framework:
        raise CheckpointError(f"{ckpt_dir} was saved by the {meta['framework']} runtime; it "
                              f"cannot be loaded into {framework}")
    if num_layers is not None and meta["num_layers"] != num_layers:
        raise CheckpointError(f"{ckpt_dir} holds a model with {meta['num_layers']} layers, this "
                              f"model has {num_layers}")
    return meta


TRAIN_STATE = "autoplan_train_state.pt"


def save_train_state(ckpt_dir, *, scheduler=None, optimizer=None) -> None:
    """Write the state of no layer (call on one rank; every rank's is the same): the
    learning-rate scheduler's ``state_dict()`` and the optimizer's parameter-group
    hyperparameters (everything but ``params``: lr, betas, weight decay as the scheduler left
    them)."""
    groups = [{k: v for k, v in g.items() if k != "params"}
              for g in getattr(optimizer, "param_groups", [])]
    state = {"scheduler": scheduler.state_dict() if scheduler is not None else None,
             "param_groups": groups}
    loadable_without_code(state, f"the learning-rate scheduler's state_dict ({type(scheduler).__name__}) "
                                 "or the optimizer's parameter groups")
    torch_save(state, os.path.join(os.fspath(ckpt_dir), TRAIN_STATE))


def load_train_state(ckpt_dir) -> dict:
    """What :func:`save_train_state` wrote; a missing or unreadable file raises
    :class:`CheckpointError` naming it (never a silent restart of the schedule)."""
    state = safe_load(os.path.join(os.fspath(ckpt_dir), TRAIN_STATE))
    if not isinstance(state, dict) or not {"scheduler", "param_groups"} <= state.keys():
        raise CheckpointError(f"{os.path.join(os.fspath(ckpt_dir), TRAIN_STATE)}: not a "
                              "ds_autoplan train state (no scheduler / param_groups)")
    return state


def load_scheduler(scheduler, train_state: dict, ckpt_dir) -> None:
    """``scheduler.load_state_dict`` of the saved state; refuses a checkpoint saved without a
    scheduler when the run has one (it would restart its schedule silently)."""
    if scheduler is None:
        return
    if train_state["scheduler"] is None:
        raise CheckpointError(f"{ckpt_dir} was saved without a learning-rate scheduler; this run "
                              f"has one ({type(scheduler).__name__}): to start its schedule from "
                              "the beginning, load without scheduler state (DeepSpeed: "
                              "load_lr_scheduler_states=False; Megatron: scheduler=None)")
    scheduler.load_state_dict(train_state["scheduler"])


def restore_param_groups(optimizer, saved: list, ckpt_dir) -> None:
    """Put the saved hyperparameters (lr, betas, ...) into ``optimizer``'s groups: one saved
    group per group, or one setting shared by all saved groups.  Schedulers such as
    DeepSpeed's WarmupLR set the learning rate of the *next* step at the end of a step and
    ``load_state_dict`` only restores their counter, so without this the first resumed step
    would run at the fresh scheduler's rate."""
    groups = optimizer.param_groups
    if not saved:
        return
    if len(saved) != len(groups):
        if any(g != saved[0] for g in saved):
            raise CheckpointError(f"{ckpt_dir}: the optimizer had {len(saved)} parameter groups "
                                  f"with different settings, this one has {len(groups)}")
        saved = saved[:1] * len(groups)
    for g, s in zip(groups, saved):
        g.update(s)


def rank_state_path(ckpt_dir, rank: int) -> str:
    return os.path.join(os.fspath(ckpt_dir), f"autoplan_rank_{rank:05d}.pt")


def save_rank_state(ckpt_dir, client_state=None) -> None:
    """Save what belongs to this rank (call on every rank): its random generators
    (:class:`~ds_autoplan.runtime.rng.RngState`: torch CPU, CUDA when in use, Megatron's RNG
    tracker; and, as Megatron-LM's checkpoints do, Python's ``random`` and NumPy's global
    generator, which data pipelines draw from) and its ``client_state`` (DeepSpeed's engine
    keeps one per rank too)."""
    import numpy as np
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    client_state = dict(client_state or {})
    loadable_without_code(client_state, "client_state")
    torch_save({"torch": RngState().state_dict(), "python": random.getstate(),
                "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss),
                          float(gauss)),              # plain values: no numpy objects to unpickle
                "client_state": client_state}, rank_state_path(ckpt_dir, dist.get_rank()))


def rank_state_source(meta: dict) -> int:
    """The saved rank whose generators this rank continues: ``rank % saved world size``
    (read with :func:`read_rank_state`, put in place with :func:`apply_rank_state`).

    Under the plan the checkpoint was saved under, every rank continues its own generators and
    dropout is reproduced exactly.  Under another plan the generators continue (they do not
    restart from the seed, so the masks of the steps before the checkpoint are not drawn
    again), but a layer's masks are drawn on whichever rank holds it now, in that rank's
    schedule order: dropout is then *not* the uninterrupted run's."""
    return dist.get_rank() % int(meta.get("world_size") or 1)


def read_rank_state(ckpt_dir, src: int) -> dict:
    """Saved rank ``src``'s state (:func:`save_rank_state`), read without running code; a
    missing or unreadable file raises :class:`CheckpointError` naming it (never a silent
    reset of that rank's generators and ``client_state``)."""
    path = rank_state_path(ckpt_dir, src)
    sd = safe_load(path)
    if not isinstance(sd, dict) or not {"torch", "python", "numpy", "client_state"} <= sd.keys():
        raise CheckpointError(f"{path}: not a ds_autoplan rank state (generators, client_state)")
    return sd


def apply_rank_state(sd: dict) -> tuple:
    """Continue the generators :func:`read_rank_state` read; returns its ``client_state``."""
    import numpy as np
    RngState.from_state_dict(sd["torch"]).restore()
    random.setstate(sd["python"])
    name, keys, pos, has_gauss, gauss = sd["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    return sd["client_state"]


def check_files(ckpt_dir) -> int:
    """Verify every file of ``ckpt_dir`` against its manifest (sizes and sha256); returns
    how many files it lists, raises :class:`CheckpointError` naming each missing, truncated,
    changed or unlisted file."""
    problems = verify(ckpt_dir)
    if problems:
        raise CheckpointError(f"checkpoint {ckpt_dir} is damaged: " + "; ".join(problems))
    return len(read_manifest(ckpt_dir))


def describe(ckpt_dir) -> str:
    """Human-readable summary: framework, step, the plan it was saved under, optimizer, and
    the verification of its files against the manifest."""
    meta = read_meta(ckpt_dir)
    files = check_files(ckpt_dir)
    p = meta.get("plan") if isinstance(meta.get("plan"), dict) else {}
    opts = p.get("schedule_options") or {}
    counters = "".join(f", {k} {v}" for k, v in (meta.get("counters") or {}).items())
    lines = [f"checkpoint {ckpt_dir}: {meta['framework']}, step {meta['step']}, "
             f"{meta['num_layers']} layers" + counters
             + (f", saved on {meta['world_size']} ranks" if "world_size" in meta else ""),
             f"saved under plan: schedule {p.get('schedule')}"
             + (f" {opts}" if opts else "")
             + f", pp {p.get('pp')} tp {p.get('tp')} dp {p.get('dp')}, ZeRO {p.get('zero_stage')}, "
               f"{p.get('precision')}",
             f"  layers per stage {p.get('layers_per_stage')}, recompute {p.get('recompute_per_stage')}",
             f"  micro-batch {p.get('micro_batch_size')} x {p.get('num_microbatches')} per replica, "
             f"global batch {p.get('global_batch_size')}",
             f"optimizer {meta['optimizer'].get('class')} {meta['optimizer'].get('param_groups')}, "
             f"lr scheduler {meta.get('lr_scheduler')}",
             f"files: {files} verified against {MANIFEST} (size and sha256 of each)",
             "loads under any plan for the same model (schedule, partition, pp, dp, ZeRO 0/1)"]
    return "\n".join(lines)


__all__ = ["CheckpointError", "FORMAT", "META", "TRAIN_STATE", "apply_rank_state", "check_files",
           "describe", "load_scheduler", "load_train_state", "rank_state_path", "rank_state_source",
           "read_meta", "read_rank_state", "restore_param_groups", "save_rank_state",
           "save_train_state", "state_path", "write_meta"]
