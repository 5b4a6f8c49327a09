"""DeepSpeed-Ulysses sequence parallelism in the DeepSpeed pipeline runtime (Jacobs et al.
2023, "DeepSpeed Ulysses", §3: each rank holds 1/sp of the sequence; before attention an
all-to-all trades the sequence split for a head split, after it the reverse).

DeepSpeed 0.19.8 reads the sequence-parallel group from an ``mpu`` with
``get_sequence_parallel_group`` (``deepspeed.utils.groups._get_sequence_parallel_group``) or
from its device mesh; the PipelineEngine's ``mpu`` is its ``PipelineParallelGrid``, whose
topology has pipe / data (/ model) axes only.  So the Ulysses groups are built here with
``torch.distributed.new_group`` on the pipeline topology's data axis: the data axis of stage s
holds dp·sp ranks, rank (s, k·sp + j) is shard j of data-parallel replica k, and each
(s, k) gives one group of sp ranks (sp is the plan's ``cp``: context parallelism, which the
DeepSpeed runtime runs as Ulysses).  The engine itself keeps seeing dp·sp data-parallel
ranks (so ``ds_autoplan.initialize`` multiplies ``train_batch_size`` by cp): its gradient all-reduce (mean over the data axis) is then what DeepSpeed's
``seq_data_parallel_group`` reduction does with Ulysses -- the mean over the sp shards of
per-shard mean losses is the full sequence's mean loss, so gradients equal the run without
sequence parallelism.

* :func:`sequence_parallel_group` -- this rank's Ulysses group (collective: every rank calls it);
* :func:`ulysses` -- wraps every attention core (modules of the given classes, taking q, k, v
  as [batch, seq, heads, head_dim]; the tiny GPT's is ``models.tiny_gpt.CausalCore``, see
  ``models.tiny_gpt.ulysses_layers``) of a layer list in DeepSpeed's ``DistributedAttention``
  and sets ``seq_shard`` (the shard index) on every module that numbers positions;
* :func:`shard_sequence` -- this rank's slice (dim 1) of a micro-batch's tensors.
"""
from __future__ import annotations

import torch.distributed as dist


def sequence_parallel_group(plan):
    """This rank's Ulysses group for ``plan`` (sp = the plan's context-parallel degree
    ``cp``, which DeepSpeed runs as Ulysses; ``plan.pp`` pipeline ranks).  DeepSpeed's
    ``PipeDataParallelTopology``: the data axis of each stage has world/pp = dp·sp ranks, sp of
    them consecutive per group.  Every rank must call it (``new_group`` is collective); None
    when ``cp`` is 1."""
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology
    pp, sp = plan.pp, plan.cp
    if sp == 1:
        return None
    world = dist.get_world_size()
    if world % pp or (world // pp) % sp:
        raise ValueError(f"sequence parallelism {sp} must divide the {world // pp} data-axis ranks "
                         f"of each of the {pp} pipeline stages (world {world})")
    data = world // pp
    topo = PipeDataParallelTopology(num_pp=pp, num_dp=data)
    mine = None
    for s in range(pp):
        for k in range(data // sp):
            ranks = [topo.get_rank(pipe=s, data=k * sp + j) for j in range(sp)]
            g = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine = g
    return mine


def ulysses(layers, group, core_types) -> list:
    """``layers`` with DeepSpeed-Ulysses attention over ``group``: every module of
    ``core_types`` (q, k, v as [batch, seq, heads, head_dim], called with the batch dim as
    fourth argument) becomes ``DistributedAttention(core, group, scatter_idx=2, gather_idx=1)``
    (heads scattered, sequence gathered; heads, ``nh`` of the enclosing attention, must divide
    by the group size), and every module with a ``seq_shard`` attribute (a position-numbering
    embedding) gets this rank's shard index."""
    from deepspeed.sequence.layer import DistributedAttention

    sp, rank = dist.get_world_size(group), dist.get_rank(group)
    for layer in layers:
        for mod in list(layer.modules()):
            for name, child in list(mod.named_children()):
                if isinstance(child, core_types):
                    setattr(mod, name, DistributedAttention(child, group, scatter_idx=2, gather_idx=1))
            if hasattr(mod, "seq_shard"):
                mod.seq_shard = rank
            nh = getattr(mod, "nh", None)
            if nh is not None and nh % sp:
                raise ValueError(f"Ulysses needs the {nh} attention heads divisible by "
                                 f"sequence parallelism {sp}")
    return layers


def shard_sequence(tensors, group):
    """This rank's contiguous 1/sp slice along the sequence (dim 1) of each tensor."""
    sp, rank = dist.get_world_size(group), dist.get_rank(group)
    out = []
    for t in tensors:
        if t.size(1) % sp:
            raise ValueError(f"sequence length {t.size(1)} not divisible by sequence parallelism {sp}")
        n = t.size(1) // sp
        out.append(t[:, rank * n:(rank + 1) * n].contiguous())
    return tuple(out) if isinstance(tensors, tuple) else out


__all__ = ["sequence_parallel_group", "shard_sequence", "ulysses"]
