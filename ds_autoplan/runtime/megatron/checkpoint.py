"""Save / resume a Megatron-core run under any other plan (issue 13, item 6), with
Megatron-core's own plan-independent format: ``dist_checkpointing`` over the chunks'
``sharded_state_dict`` (every ShardedTensor is keyed by *global* layer: the layer offsets come
from the plan's layout, :class:`..setup.StageLayerLayout` for V placements) and the Megatron
optimizer's ``sharded_state_dict`` (optimizer state keyed by the same parameter keys; the
DistributedOptimizer in its ``fully_sharded_model_space`` form).  Next to it,
``autoplan_checkpoint.json`` records the plan (:mod:`ds_autoplan.runtime.checkpoint`).

    save_checkpoint(chunks, optimizer, "ckpt", plan=plan, step=it)    # every rank
    meta = load_checkpoint(chunks_b, optimizer_b, "ckpt")             # chunks of another plan
"""
from __future__ import annotations

import os

import torch.distributed as dist

from ..checkpoint import read_meta, write_meta
from .shim import cpu_shim


def _sharded(chunks, optimizer, is_loading: bool) -> dict:
    """One sharded state dict: ``model<c>`` per local chunk and ``optimizer`` (Megatron-LM's
    layout of a checkpoint)."""
    model = {f"model{c}": _unwrapped(m).sharded_state_dict() for c, m in enumerate(chunks)}
    return {**model, "optimizer": optimizer.sharded_state_dict(model, is_loading=is_loading)}


def _unwrapped(chunk):
    """The GPTModel inside Megatron's DDP wrapper (whose own keys carry a ``module.`` prefix):
    the checkpoint does not depend on how the chunks are wrapped."""
    return getattr(chunk, "module", chunk)


def _num_layers(chunks) -> int:
    return chunks[0].config.num_layers


def save_checkpoint(chunks, optimizer, save_dir, *, plan, step: int) -> None:
    """Write the model chunks and the Megatron optimizer of this rank with
    ``dist_checkpointing.save`` and the plan's metadata (call on every rank)."""
    from megatron.core import dist_checkpointing
    if dist.get_rank() == 0:
        os.makedirs(save_dir, exist_ok=True)
    dist.barrier()
    with cpu_shim(remap_cuda_factories=True):     # its writer synchronises CUDA
        dist_checkpointing.save(_sharded(chunks, optimizer, False), save_dir)
    if dist.get_rank() == 0:
        write_meta(save_dir, framework="megatron", plan=plan, step=step,
                   num_layers=_num_layers(chunks), optimizer=optimizer)
    dist.barrier()


def load_checkpoint(chunks, optimizer, load_dir) -> dict:
    """Load a checkpoint written by :func:`save_checkpoint` under any plan for the same model
    into ``chunks`` (this rank's model chunks of the new plan) and ``optimizer``.  Returns the
    checkpoint's metadata (``meta["plan"]``: the plan it was saved under)."""
    from megatron.core import dist_checkpointing
    meta = read_meta(load_dir, framework="megatron", num_layers=_num_layers(chunks))
    with cpu_shim(remap_cuda_factories=True):
        loaded = dist_checkpointing.load(_sharded(chunks, optimizer, True), load_dir)
    for c, m in enumerate(chunks):
        _unwrapped(m).load_state_dict(loaded[f"model{c}"])
    optimizer.load_state_dict(loaded["optimizer"])
    dist.barrier()
    return meta


__all__ = ["load_checkpoint", "save_checkpoint"]
