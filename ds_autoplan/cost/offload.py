"""Offloading as the engines perform it: device, host and NVMe bytes per parameter, the
host<->device traffic and the CPU optimizer step (docs/offload.md §2-3).

All figures are per model parameter a rank holds before its ZeRO split over ``d`` data-parallel
ranks (the division by ``d`` is inside), like :func:`cost.memory.state_bytes`.  ``cb``: bytes of
the 16-bit model dtype (4 for fp32 training).

DeepSpeed 0.19.8, ZeRO-1/2 with ``offload_optimizer: cpu`` (ZeRO-Offload, Ren et al. 2021 §4;
``runtime/zero/stage_1_and_2.py``): the device keeps the 16-bit parameters (and, ZeRO-1, their
gradients until the boundary; ZeRO-2 sends its reduced partition to the host, ``grads_in_partition``
is never allocated); the host keeps, pinned, the fp32 master partition, its fp32 gradient, the
Adam moments (``DeepSpeedCPUAdam``), a 16-bit copy of the master (``param_buffer_of_bit16_for_
cpu_offload_groups``) and, under gradient accumulation, a 16-bit accumulation buffer per
parameter of the partition (``accumulated_grads_in_cpu``): 16 + 2 cb per parameter / d.
Traffic: at the boundary micro-batch each reduced gradient is copied to the fp32 buffer
(``async_inplace_copy_grad_to_fp32_buffer_from_gpu``: converted on the device, 4 B) while the
backward goes on; ZeRO-2 also sends every other micro-batch's reduced partition to the host and
brings the sum back for the next (``async_accumulate_grad_in_cpu_via_gpu``: cb each way), ZeRO-1
makes that round trip once, at the boundary; after the CPU step the 16-bit master copy goes back
(cb, ``bit16_partitions[partition_id].data.copy_``) before the parameter all-gather.  Nothing of
the step overlaps: ZeRO-Offload's one-step delayed update (§4.3) is not in 0.19.8.
``offload_optimizer.ratio`` is read by ZeRO-3 only (its config docstring): ZeRO-1/2 offload all.

DeepSpeed 0.19.8, ZeRO-3 (``runtime/zero/stage3.py``), ``offload_optimizer`` with ``ratio`` r
(ZeRO-Offload++ Twin-Flow): sub-groups ``i >= int((1 - r) n)`` are stepped by DeepSpeedCPUAdam
on the host, the others by a torch AdamW on the device -- the device's steps come first and run
asynchronously while the host steps its share, so the step takes the longer of the two; the
offloaded share's fp32 master, gradient and moments live on the host (16 r / d), the rest on the
device (16 (1 - r) / d: master, moments and its fp32 gradient at the step).  The gradient
partitions of every parameter are kept on the host (``grad_partitions_flat_buffer`` on
``self.device`` = cpu, the model dtype): each micro-batch after the first fetches, adds and
returns them.
``offload_param`` (ZeRO-Infinity,
Rajbhandari et al. 2021 §5) keeps the 16-bit partitions on the host: every forward and backward
fetches the rank's partition (cb / d) before the all-gather, and the step writes the parameters
on the host (no copy back).  On NVMe (ZeRO-Infinity §5.1, DeepSpeed's swappers) the states are read
and written once per step through host buffers (``offload_optimizer.buffer_count`` sub-groups of
fp32 elements) and the parameters read at every fetch.

Megatron-core 0.16.1 (``optimizer/cpu_offloading/hybrid_optimizer.py``, HybridDeviceOptimizer,
with the distributed optimizer and ``--use-precision-aware-optimizer`` as Megatron-LM requires):
the first ``optimizer_offload_fraction`` f of the shard's parameters get a host copy (fp32,
``param_update_in_fp32``), a pinned fp32 gradient and torch's ``AdamW`` (``fused=True``) moments
on the host: 16 f / d; the rest keep Megatron's 12 / d optimizer bytes on the device.  At the step
the gradients go to the host (4 B: fp32 buffers), the device's share steps first (asynchronous),
each host optimizer steps and copies its parameter back (cb); with
``overlap_cpu_optimizer_d2h_h2d`` every parameter has its own optimizer and streams, so copies and
host steps overlap each other (the longest of the three), otherwise they add up.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..spec import SpecError
from ..spec.parallel import Offload

# DRAM bytes per parameter of a CPU Adam step: DeepSpeedCPUAdam reads the fp32 parameter,
# gradient and moments (16) and writes the parameter and moments (12); DeepSpeed then copies
# the master into the 16-bit buffer (read 4, write 2: stage_1_and_2.py step)
CPU_ADAM_BYTES = 34.0
# torch.optim.AdamW(fused=True) on the host (Megatron's HybridDeviceOptimizer) over
# DeepSpeedCPUAdam, per core: 952 vs 714 M params/s for 10^8 fp32 parameters on one AMD EPYC
# (Zen 4) core, 1.33-1.44 on 1-2 threads, quiet machine (bench/offload_cpu.py)
TORCH_CPU_ADAM_SPEED = 1.33
# host memory kept for the OS, data loaders and the engines' other host allocations [decision]
HOST_RESERVE_FRACTION = 0.1
# DeepSpeed's zero_optimization.sub_group_size default (elements) and offload_optimizer /
# offload_param defaults (runtime/zero/config.py, offload_config.py): the NVMe swappers' buffers
SUB_GROUP_SIZE = 1e9
NVME_OPT_BUFFERS = 4
NVME_PARAM_IN_CPU = 1e9
ENGINES = ("deepspeed", "megatron")


@dataclass(frozen=True)
class OffloadTerms:
    """What one offload costs per parameter a rank holds (module docstring)."""
    device: tuple            # (parameter, gradient, optimizer) bytes left on the device
    host: float = 0.0        # host bytes
    cpu: float = 0.0         # parameters stepped by the host
    gpu: float = 0.0         # parameters stepped on the device
    d2h: float = 0.0         # to the host at the boundary, beside the last backward (DeepSpeed)
    d2h_step: float = 0.0    # to the host at the step (Megatron: after the backward)
    h2d: float = 0.0         # back to the device after the host step
    accum: float = 0.0       # both ways per micro-batch without synchronisation (ZeRO-2 accumulation)
    fetch: float = 0.0       # to the device in every forward and every backward (ZeRO-3 parameters)
    nvme_step: float = 0.0   # NVMe bytes read + written per step
    nvme_fetch: float = 0.0  # NVMe bytes read at every fetch
    concurrent: bool = False     # the device's share steps beside the host's
    overlap_copies: bool = False  # copies and host steps overlap (Megatron's overlap flag)
    torch_cpu: bool = False       # the host optimizer is torch's AdamW, not DeepSpeedCPUAdam


def check(engine: str, zero: int, off: Offload, pp: int = 1) -> str | None:
    """Why ``engine`` cannot run ``off`` at ZeRO stage ``zero`` with ``pp`` stages (None: it can)."""
    if off.activations:
        why = _check_activations(engine, pp)
        if why:
            return why
    if not off.states:
        return None
    if zero < 1:
        return "offloading model states needs ZeRO (stage 1-3)"
    if engine == "megatron":
        if zero != 1:
            return "Megatron offloads its distributed optimizer (ZeRO-1) only"
        if off.params or off.device != "cpu" or not off.optimizer:
            return "Megatron-core offloads optimizer states to host memory only (no parameters, no NVMe)"
        return None
    if pp > 1 and zero > 1:
        return "DeepSpeed's pipeline engine runs ZeRO 0/1 only"
    if zero < 3 and (off.params or off.device == "nvme" or off.optimizer != 1.0):
        return ("DeepSpeed's ZeRO-1/2 offload the whole optimizer to host memory (ratio, NVMe and "
                "parameter offload are ZeRO-3's)")
    return None


def _check_activations(engine: str, pp: int) -> str | None:
    """Why ``engine`` cannot keep activations in host memory with ``pp`` stages (None: it can;
    module docstring, docs/offload.md §2)."""
    if engine == "megatron":
        return ("Megatron-core's activation offloading (cpu_offloading) needs Transformer Engine, "
                "no pipeline and no recompute; activation offload is emitted for DeepSpeed only")
    if pp > 1:
        return ("activation offload runs without a pipeline here (one micro-batch in flight; the "
                "pipeline runtime keeps its stage inputs and recompute checkpoints on the device)")
    return None


def terms(engine: str, precision: str, zero: int, d: float, off: Offload,
          grad_bytes: float | None = None) -> OffloadTerms:
    """The offload terms of ``engine`` ('deepspeed' or 'megatron') for ``off`` at ZeRO stage
    ``zero`` over ``d`` ranks; ``grad_bytes``: Megatron's gradient-buffer dtype (None: fp32)."""
    why = check(engine, zero, off)
    if why:
        raise SpecError(f"{engine}: {why} (offload {off.text()}, ZeRO-{zero})")
    cb = 4.0 if precision == "fp32" else 2.0
    r = off.optimizer
    if not off.states:
        raise SpecError(f"{engine}: offload {off.text()} offloads no model states (terms of states only)")
    if engine == "megatron":
        g = grad_bytes or 4.0
        opt = 8.0 if precision == "fp32" else 12.0
        return OffloadTerms(device=(cb, g, (1 - r) * opt / d), host=16.0 * r / d, cpu=r / d, gpu=(1 - r) / d,
                            d2h_step=4.0 * r / d, h2d=cb * r / d, concurrent=r < 1, overlap_copies=True,
                            torch_cpu=True)
    if zero < 3:       # ZeRO-Offload: everything, host memory
        return OffloadTerms(device=(cb, cb if zero == 1 else 0.0, 0.0), host=(16.0 + 2 * cb) / d,
                            cpu=1.0 / d, d2h=(4.0 + (2 * cb if zero == 1 else 0.0)) / d, h2d=cb / d,
                            accum=2 * cb / d if zero == 2 else 0.0)
    nv = off.device == "nvme"
    # the whole gradient partition lives on the host (grad_partitions_flat_buffer on
    # self.device = cpu, in grad_accum_dtype: the model's by default, engine.get_data_types):
    # every micro-batch after the first brings it over, adds and sends it back; the offloaded
    # share's fp32 master and moments are host (or NVMe)
    states, grads = 12.0 * r / d, cb / d
    p_host = cb / d if off.params else 0.0
    return OffloadTerms(device=(0.0 if off.params else cb / d, 0.0, 16.0 * (1 - r) / d),
                        # on NVMe the host keeps buffers (host_cap) and this is what NVMe
                        # holds (the host's gradient partition too: a bound from above)
                        host=states + grads + p_host,
                        cpu=r / d, gpu=(1 - r) / d, d2h=4.0 * r / d,
                        h2d=0.0 if off.params else cb * r / d, accum=2 * grads,
                        fetch=cb / d if off.params else 0.0,
                        nvme_step=28.0 * r / d if nv else 0.0,
                        nvme_fetch=cb / d if nv and off.params else 0.0, concurrent=r < 1)


def host_cap(off: Offload, cb: float = 2.0) -> float:
    """The most host bytes one rank pins whatever its partition: with NVMe, the swappers'
    buffers (``buffer_count`` sub-groups of ``sub_group_size`` fp32 elements for the optimizer,
    ``max_in_cpu`` parameter elements); ``terms`` charges NVMe's states as host bytes up to this
    cap (a small partition is buffered whole), uncapped they are what NVMe must hold.  Unbounded
    for host memory."""
    if off.device != "nvme":
        return float("inf")
    return (NVME_OPT_BUFFERS * 4.0 * SUB_GROUP_SIZE if off.optimizer else 0.0) + \
        (cb * NVME_PARAM_IN_CPU if off.params else 0.0)


def node_host_bytes(per_stage, stage_ranks: int, cluster) -> float:
    """The largest host bytes of a node: ranks numbered stage by stage (Megatron's order, the
    pipeline outermost), ``stage_ranks`` per stage each holding ``per_stage[s]`` bytes, filled
    into nodes of ``gpus_per_node``."""
    import numpy as np
    per_rank = np.repeat(np.asarray(per_stage, dtype=float), stage_ranks)
    G = cluster.gpus_per_node
    if len(per_rank) % G:
        per_rank = np.concatenate([per_rank, np.zeros(G - len(per_rank) % G)])
    return float(per_rank.reshape(-1, G).sum(axis=1).max()) if len(per_rank) else 0.0


@dataclass(frozen=True)
class HostRates:
    """The host's rates as one rank sees them while every rank of its node does the same:
    parameters per second of the CPU step, host<->device bytes per second each way, NVMe bytes
    per second (0 where the cluster has none)."""
    cpu: float
    link: float
    nvme: float

    @classmethod
    def of(cls, cluster) -> "HostRates | None":
        """The node's rates shared by its ``gpus_per_node`` ranks; None if it cannot offload."""
        if cluster.offload_missing():
            return None
        G = cluster.gpus_per_node
        node = cluster.cpu_cores * cluster.cpu_adam_rate_per_core
        if cluster.host_memory_GBps:
            node = min(node, cluster.host_memory_GBps * 1e9 / CPU_ADAM_BYTES)
        return cls(cpu=node / G, link=cluster.host_link_each_GBps() * 1e9,
                   nvme=(cluster.nvme_GBps or 0.0) * 1e9 / G)


def host_budget_bytes(cluster) -> float:
    """Host bytes a node's ranks may pin: its memory less the reserve (0 without figures)."""
    from ..spec.cluster import GB
    return (cluster.host_memory_gb or 0.0) * (1 - HOST_RESERVE_FRACTION) * GB


def step_times(t: OffloadTerms, W: float, rates: HostRates, gpu_step: float) -> tuple[float, float]:
    """(seconds beside the last backward, seconds after it) of the step of ``W`` parameters a
    rank holds: the boundary gradient copy (hidden behind the backward as far as it goes), then
    the host step, the copies back and the device's share (``gpu_step``: its seconds)."""
    link, cpu = rates.link, rates.cpu * (TORCH_CPU_ADAM_SPEED if t.torch_cpu else 1.0)
    t_cpu = W * t.cpu / cpu if t.cpu else 0.0
    if t.nvme_step:
        if not rates.nvme:
            return float("inf"), float("inf")
        t_cpu += W * t.nvme_step / rates.nvme          # swap-in before, swap-out after
    d2h, h2d = W * t.d2h_step / link, W * t.h2d / link
    host = max(d2h, t_cpu, h2d) if t.overlap_copies else d2h + t_cpu + h2d
    after = max(gpu_step, host) if t.concurrent else gpu_step + host
    return W * t.d2h / link, after


def microbatch_times(t: OffloadTerms, W: float, rates: HostRates,
                     trained: float | None = None) -> tuple[float, float]:
    """(forward, backward) transfer seconds of one micro-batch of ``W`` parameters, ``trained``
    of which train (None: all): ZeRO-3's parameter fetch of all (from NVMe first when the
    parameters live there), the gradient accumulation round trip of the trained ones (backward,
    micro-batches without synchronisation: a frozen parameter has no gradient to accumulate)."""
    fetch = W * t.fetch / rates.link if t.fetch else 0.0
    if t.nvme_fetch:
        fetch += W * t.nvme_fetch / rates.nvme if rates.nvme else float("inf")
    grads = W if trained is None else trained
    return fetch, fetch + (grads * t.accum / rates.link if t.accum else 0.0)
