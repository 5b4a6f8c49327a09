"""Save / resume a Megatron-core run under any other plan, with
Megatron-core's own plan-independent format: ``dist_checkpointing`` over the chunks'
``sharded_state_dict`` (every ShardedTensor is keyed by *global* layer: the layer offsets come
from the plan's layout, :class:`..setup.StageLayerLayout` for V placements) and the Megatron
optimizer's ``sharded_state_dict`` (optimizer state keyed by the same parameter keys; the
DistributedOptimizer (ZeRO-1) in its ``fully_reshardable`` form).  Next to it,
``autoplan_checkpoint.json`` records the plan (:mod:`ds_autoplan.runtime.checkpoint`), and the
learning-rate scheduler, ``client_state`` and each rank's random generators are saved as in the
DeepSpeed runtime.

    save_checkpoint(chunks, optimizer, "ckpt", plan=plan, step=it, scheduler=sched)   # every rank
    meta = load_checkpoint(chunks_b, optimizer_b, "ckpt", scheduler=sched_b)  # another plan's chunks
"""
from __future__ import annotations

import os

import torch.distributed as dist

from ..checkpoint import (apply_rank_state, load_scheduler, load_train_state, rank_state_source,
                          read_meta, read_rank_state, save_rank_state, save_train_state,
                          write_meta)
from ..checkpoint_files import (CheckpointError, agree, check_dcp_metadata, fault_point,
                                no_code_on_load, resolve, save_atomically, verify_before_load)
from .shim import cpu_shim


def _metadata() -> dict:
    """The DistributedOptimizer's canonical per-parameter form (its default in 0.16.1,
    'fully_sharded_model_space', is deprecated and fails ShardedTensor validation on load);
    without CUDA it must gather over its gloo groups (the other path moves tensors to CUDA)."""
    import torch
    return {"distrib_optim_sharding_type": "fully_reshardable",
            "distrib_optim_fully_reshardable_mem_efficient": not torch.cuda.is_available()}


def _sharded(chunks, optimizer, is_loading: bool) -> dict:
    """One sharded state dict: ``model<c>`` per local chunk and ``optimizer`` (Megatron-LM's
    layout of a checkpoint); on save, also the fp32 masters a DistributedOptimizer reads."""
    model = {f"model{c}": _unwrapped(m).sharded_state_dict() for c, m in enumerate(chunks)}
    out = {**model, "optimizer": optimizer.sharded_state_dict(model, is_loading=is_loading,
                                                              metadata=_metadata())}
    if not is_loading:
        out["fp32_masters"] = _fp32_masters(model, optimizer)
    return out


def _fp32_masters(model_sd, optimizer) -> dict:
    """``optimizer.state.param.<key>`` for every fp32 parameter a non-distributed optimizer
    steps in place: the DistributedOptimizer's ``fully_reshardable`` state has these fp32 main
    weights, a plain optimizer's has none, so without them a ZeRO-0 checkpoint could not load
    under ZeRO-1 (megatron-core 0.16.1)."""
    import torch
    from megatron.core.dist_checkpointing.optimizer import (get_param_id_to_sharded_param_map,
                                                            make_sharded_optimizer_tensor)
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    out = {}
    for i, opt in enumerate(getattr(optimizer, "chained_optimizers", [optimizer])):
        if isinstance(opt, DistributedOptimizer):
            continue
        params = [p for g in opt.optimizer.param_groups for p in g["params"] if p.dtype == torch.float32]
        for j, sh in get_param_id_to_sharded_param_map(model_sd, params).items():
            out[f"{i}.{j}"] = make_sharded_optimizer_tensor(sh, sh.data, "optimizer.state.param")
    return out


def _unwrapped(chunk):
    """The GPTModel inside Megatron's DDP wrapper (whose own keys carry a ``module.`` prefix):
    the checkpoint does not depend on how the chunks are wrapped."""
    return getattr(chunk, "module", chunk)


def _num_layers(chunks) -> int:
    return chunks[0].config.num_layers


def save_checkpoint(chunks, optimizer, save_dir, *, plan, step: int, scheduler=None,
                    client_state=None) -> None:
    """Write the model chunks and the Megatron optimizer of this rank with
    ``dist_checkpointing.save``, the plan's metadata, ``scheduler`` (Megatron-core's
    ``OptimizerParamScheduler`` or anything with ``state_dict``) and each rank's
    ``client_state`` and random generators (call on every rank).  ``save_dir`` appears complete
    or not at all, and an existing one stays intact until the new copy is complete
    (:func:`ds_autoplan.runtime.checkpoint_files.save_atomically`)."""
    from megatron.core import dist_checkpointing

    def write(folder):
        with cpu_shim(remap_cuda_factories=True):     # its writer synchronises CUDA
            dist_checkpointing.save(_sharded(chunks, optimizer, False), folder)
        fault_point("file")
        save_rank_state(folder, client_state)
        if dist.get_rank() == 0:
            save_train_state(folder, scheduler=scheduler)
            write_meta(folder, framework="megatron", plan=plan, step=step,
                       num_layers=_num_layers(chunks), optimizer=optimizer, scheduler=scheduler)
    save_atomically(save_dir, write)


def _init_fresh_state(optimizer) -> None:
    """Give a fresh (never stepped) Megatron optimizer the state its first step would create:
    megatron-core 0.16.1 without Apex/TE reads Adam's per-parameter ``step`` in
    ``DistributedOptimizer.state_dict()`` (asserts exactly one value), and its
    ``init_state_fn`` creates ``exp_avg``/``exp_avg_sq`` but no ``step``."""
    import torch
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner, init = getattr(opt, "optimizer", None), getattr(opt, "init_state_fn", None)
        if inner is None or init is None or any(len(st) for st in inner.state.values()):
            continue
        init(inner, opt.config)
        for group in inner.param_groups:
            for p in group["params"]:
                inner.state[p].setdefault("step", torch.tensor(0.0))


def _in_own_layout(loaded: dict, optimizer) -> dict:
    """The loaded optimizer state with the non-tensor part (parameter groups, Adam's step) in
    the layout of ``optimizer``: dist_checkpointing restores non-tensor state as the *saving*
    optimizer wrote it, and the plain optimizer (``{"state", "param_groups"}``) and the
    DistributedOptimizer (``{"optimizer": {"param_groups"}, ...}``) differ."""
    own = optimizer.state_dict()
    by_distributed = "param_groups" in loaded.get("optimizer", {})
    step = (loaded["optimizer"]["param_groups"][0].get("step") if by_distributed
            else (loaded.get("state") or {}).get("common_step"))
    if "optimizer" in own and not by_distributed:             # plain -> DistributedOptimizer
        loaded["optimizer"] = {**own["optimizer"], "param_groups": [
            {**g, "step": step} for g in own["optimizer"]["param_groups"]]}
        loaded["param_state_sharding_type"] = _metadata()["distrib_optim_sharding_type"]
    if "optimizer" not in own and by_distributed:             # DistributedOptimizer -> plain
        loaded["param_groups"] = own["param_groups"]
        if step is not None:
            loaded["state"]["common_step"] = step
    return loaded


def _load_optimizer(optimizer, state: dict) -> None:
    """``optimizer.load_state_dict(state)``; for a DistributedOptimizer the per-parameter part
    is loaded with torch Adam's per-parameter ``step`` set aside: megatron-core 0.16.1's
    ``load_parameter_state_from_fully_reshardable`` skips ``step`` in the source but copies
    every key of the destination state (KeyError without Apex/TE).  Every parameter keeps its
    own ``step`` tensor (torch's Adam advances it in place)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    opts = getattr(optimizer, "chained_optimizers", [optimizer])
    if len(opts) != 1 or not isinstance(opts[0], DistributedOptimizer):
        optimizer.load_state_dict(state)
        return
    opt, param_state = opts[0], state.pop("param_state")
    opt.load_state_dict(state)
    steps = {p: st.pop("step") for p, st in opt.optimizer.state.items() if "step" in st}
    try:
        opt.load_parameter_state_from_fully_reshardable(param_state)
    finally:
        for p, step in steps.items():
            opt.optimizer.state[p]["step"] = step.clone()


def _check_backends(load_dir) -> None:
    """Refuse a ``dist_checkpointing`` folder whose ``metadata.json`` names other backends
    than the ones :func:`save_checkpoint` writes (torch_dist shards, torch common state): only
    those are read through :func:`~ds_autoplan.runtime.checkpoint_files.no_code_on_load`."""
    import json
    path = os.path.join(load_dir, "metadata.json")
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot be read ({str(e).splitlines()[0]})") from None
    got = (meta.get("sharded_backend"), meta.get("common_backend")) if isinstance(meta, dict) else None
    if got != ("torch_dist", "torch"):
        raise CheckpointError(f"{path}: backends {got}, ds_autoplan reads ('torch_dist', 'torch') "
                              "only (the ones it writes, read without running code)")


def load_checkpoint(chunks, optimizer, load_dir, *, scheduler=None) -> dict:
    """Load a checkpoint written by :func:`save_checkpoint` under any plan for the same model
    into ``chunks`` (this rank's model chunks of the new plan), ``optimizer`` and
    ``scheduler``.  Returns the checkpoint's metadata (``meta["plan"]``: the plan it was saved
    under; ``meta["client_state"]``).

    The scheduler is loaded after the optimizer: ``OptimizerParamScheduler.load_state_dict``
    sets every parameter group's lr and weight decay for the saved step.  Random generators:
    each rank continues saved rank ``rank % saved world size``
    (:func:`ds_autoplan.runtime.checkpoint.rank_state_source`), so dropout is reproduced exactly
    under the same plan only."""
    from megatron.core import dist_checkpointing
    load_dir = resolve(load_dir)
    meta = read_meta(load_dir, framework="megatron", num_layers=_num_layers(chunks))
    verify_before_load(load_dir)
    exc, train, rank_state = None, None, None
    meta["rng_from_rank"] = rank_state_source(meta)
    try:                                  # our files first: every rank agrees they are sound
        train, rank_state = load_train_state(load_dir), read_rank_state(load_dir, meta["rng_from_rank"])
        _check_backends(load_dir)
        check_dcp_metadata(load_dir)
    except CheckpointError as e:
        exc = e
    agree(exc, f"cannot load {load_dir}")
    _init_fresh_state(optimizer)
    with cpu_shim(remap_cuda_factories=True), no_code_on_load(load_dir):
        loaded = dist_checkpointing.load(_sharded(chunks, optimizer, True), load_dir)
    for c, m in enumerate(chunks):
        _unwrapped(m).load_state_dict(loaded[f"model{c}"])
    _load_optimizer(optimizer, _in_own_layout(loaded["optimizer"], optimizer))
    load_scheduler(scheduler, train, load_dir)
    meta["client_state"] = apply_rank_state(rank_state)
    dist.barrier()
    return meta


__all__ = ["load_checkpoint", "save_checkpoint"]
