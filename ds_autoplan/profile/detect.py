"""The machine this runs on, as a cluster (``ds-autoplan cluster``, ``--cluster auto``).

Every rank reports its facts (:func:`rank_facts`: node, device name and memory, host memory
and cores); :func:`ds_autoplan.spec.devices.check_homogeneous` groups them into nodes (the
launcher's node rank: ``GROUP_RANK`` under torchrun, ``CROSS_RANK`` under DeepSpeed's launcher,
``SLURM_NODEID`` under srun) and refuses a launch whose nodes differ.  A known GPU kind gets its
datasheet figures (``data/gpus.yaml``); what is measured replaces them: an unknown device's
matmul rate and memory bandwidth (a short micro-benchmark), the bus bandwidth of an all-reduce
among a node's ranks (nccl-tests' convention, as ``profile --hardware``) and, with several
nodes, along the rails between them (the ranks of one local rank, every rail at once).  A CPU
rank is a device with its share of the host (the gloo demos): always measured.
"""
from __future__ import annotations

import json
import os
import socket

import torch

from ..spec.devices import (Device, check_homogeneous, gpu_cluster, host_fields, kind_of,
                            same_devices)

GiB = 1024 ** 3
CPU_RANKS = 2            # CPU "devices" per node when nothing says how many (the demos' 2 ranks)
_NODE_VARS = ("GROUP_RANK", "CROSS_RANK", "SLURM_NODEID", "NODE_RANK")
_LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE")
# all-reduce sizes (bytes) fitted for bandwidth and latency: a few seconds, or a longer run
SIZES = {True: (1 << 16, 1 << 22), False: (1 << 16, 1 << 20, 1 << 24, 1 << 26)}


def launch_layout(env=None) -> dict:
    """This process's place in a launch, from the launcher's environment: rank, world,
    local_rank, local_size and node (0 .. nodes-1)."""
    env = os.environ if env is None else env
    world = int(env.get("WORLD_SIZE") or 1)
    rank = int(env.get("RANK") or 0)
    local_size = next((int(env[v]) for v in _LOCAL_SIZE_VARS if env.get(v)), world)
    local_rank = int(env.get("LOCAL_RANK") or rank % max(1, local_size))
    node = next((int(env[v]) for v in _NODE_VARS if env.get(v)), (rank - local_rank) // max(1, local_size))
    return {"rank": rank, "world": world, "local_rank": local_rank, "local_size": local_size, "node": node}


def host_facts() -> dict:
    """Host name, memory (GiB) and the cores this process may run on."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    return {"host": socket.gethostname(), "host_memory_gb": round(mem, 2), "cpu_cores": cores}


def device_facts(index: int) -> dict:
    """Name and memory (GiB) of CUDA device ``index``."""
    p = torch.cuda.get_device_properties(index)
    return {"device": p.name, "memory_gib": round(p.total_memory / GiB, 2)}


def rank_facts(layout: dict | None = None) -> dict:
    """What one rank reports: its layout, host and device (``device`` None on a CPU)."""
    layout = layout or launch_layout()
    f = {**layout, **host_facts(), "device": None, "memory_gib": None}
    if torch.cuda.is_available():
        f.update(device_facts(layout["local_rank"] % torch.cuda.device_count()))
    return f


# -- micro-benchmarks --------------------------------------------------------------------------------
def measure_device(device: torch.device, quick: bool = True) -> dict:
    """Achieved matmul rate (bf16 on a GPU, fp32 on a CPU; TFLOP/s, the best of a few square
    sizes) and memory bandwidth (a device-to-device copy: bytes read + written, GB/s)."""
    from .hardware import matmul_flops, median_seconds
    gpu, repeats = device.type == "cuda", 3 if quick else 10
    dtype = torch.bfloat16 if gpu else torch.float32
    best = max(matmul_flops(n, device, dtype, repeats) / 1e12
               for n in ((4096, 8192) if gpu else (256, 512)) + ((16384,) if gpu and not quick else ()))
    nbytes = (1 << 30 if gpu else 1 << 26) // (2 if quick else 1)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    hbm = 2 * nbytes / median_seconds(lambda: dst.copy_(src), device, repeats) / 1e9
    return {"peak_tflops": round(best, 5), "hbm_GBps": round(hbm, 1)}


def device_measured(device: torch.device, quick: bool, known: bool) -> dict:
    """What the micro-benchmarks give a cluster of ``device``: the matmul rate (the peak of a
    CPU or unknown kind, else shown beside a known kind's MAMF), the host link, a GPU's
    memory bandwidth and a CPU's fixed cost of one action (its sustained rate is the peak, so
    without it every micro-batch split would cost the same and MFU reach 1)."""
    from .hardware import action_seconds
    m = measure_device(device, quick)
    out = {"host_link_GBps": host_link(device, quick),
           ("matmul_tflops" if known else "peak_tflops"): m["peak_tflops"]}
    if device.type == "cuda":
        out["hbm_GBps"] = m["hbm_GBps"]
    else:
        out["action_overhead_us"] = round(action_seconds(device, 20 if quick else 100) * 1e6, 1)
    return out


def allreduce_busbw(group, device: torch.device, sizes=SIZES[True], repeats: int = 3) -> dict:
    """Bus bandwidth (GB/s) and latency (us) of an all-reduce over ``group`` (every member calls
    it): ``t = alpha + bytes * 2(n-1)/n / busbw`` fitted over ``sizes``; the slowest member's
    time counts."""
    import torch.distributed as dist

    from .hardware import _fit, median_seconds
    n = dist.get_world_size(group)
    points = []
    for nbytes in sizes:
        x = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
        dist.barrier(group=group)
        t = torch.tensor([median_seconds(lambda: dist.all_reduce(x, group=group), device, repeats)],
                         dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        points.append((x.numel() * 4, float(t.item())))
    fit = _fit(points, 2 * (n - 1) / n)
    return {"GBps": fit["GBps"], "alpha_us": fit["alpha_us"]}


def measure_links(nodes: list[list[dict]], device: torch.device, quick: bool = True) -> dict:
    """Collective (every rank of the launch calls it): the all-reduce bus bandwidth among the
    ranks of a node (every node's group at once) and, with several nodes, along the rails (the
    ranks of one local rank across the nodes, every rail at once), the slowest group's figure:
    ``intra_node_GBps``, ``intra_latency_us``, ``nic_GBps``, ``inter_node_GBps`` (a node's
    rails together), ``inter_latency_us``."""
    import torch.distributed as dist
    me, out = dist.get_rank(), {}
    sizes = SIZES[quick]
    node_groups = [sorted(f["rank"] for f in n) for n in nodes]
    per_node = len(node_groups[0])

    def over(groups) -> tuple[float, float]:
        mine = None
        for ranks in groups:     # every rank creates every group (torch.distributed's rule)
            g = dist.new_group(ranks)
            if me in ranks:
                mine = g
        r = allreduce_busbw(mine, device, sizes, 3 if quick else 10)
        worst = torch.tensor([-r["GBps"], r["alpha_us"]], dtype=torch.float64, device=device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        return round(-float(worst[0]), 3), round(float(worst[1]), 2)
    if per_node > 1:
        out["intra_node_GBps"], out["intra_latency_us"] = over(node_groups)
    if len(nodes) > 1:
        nic, out["inter_latency_us"] = over([[g[i] for g in node_groups] for i in range(per_node)])
        out.update(nic_GBps=nic, inter_node_GBps=round(nic * per_node, 3))
    return out


def host_link(device: torch.device, quick: bool = True) -> float:
    """Host <-> device copy rate of one device, each way (the slower direction; GB/s)."""
    from .hardware import host_link_GBps
    r = host_link_GBps(device, 1 << (22 if quick else 26), repeats=3 if quick else 10)
    return round(min(r["d2h_GBps"], r["h2d_GBps"]), 3)


# -- facts to a cluster --------------------------------------------------------------------------------
def cpu_cluster(num_nodes: int, per_node: int, host: dict, measured: dict,
                name: str | None = None) -> tuple[dict, dict, list[str]]:
    """The CPU ranks of ``num_nodes`` hosts as devices: each rank's share of the host memory,
    the measured matmul rate (achieved: efficiency 1) and collective bandwidths."""
    mem = host["host_memory_gb"] / per_node
    # one rank per node has no node-local link to measure (nor to cost): any positive figure
    intra = measured.get("intra_node_GBps") or measured.get("inter_node_GBps") or 1.0
    notes = [f"CPU: each of the {per_node} ranks of a node is a device with 1/{per_node} of "
             f"the host's {host['host_memory_gb']:.1f} GiB"]
    fields = {"name": name or f"cpu-auto-{num_nodes}x{per_node}", "num_nodes": num_nodes,
              "gpus_per_node": per_node, "memory_gb": round(mem, 2),
              "reserve_gb": round(min(0.5, mem / 8), 2),
              "peak_tflops": measured["peak_tflops"], "compute_efficiency": 1.0,
              "intra_node_GBps": intra, "inter_node_GBps": measured.get("inter_node_GBps") or intra,
              "intra_latency_us": measured.get("intra_latency_us", 50.0),
              "inter_latency_us": measured.get("inter_latency_us", measured.get("intra_latency_us", 100.0)),
              "overlap_slowdown": 1.3}
    if measured.get("action_overhead_us"):
        fields["action_overhead_us"] = measured["action_overhead_us"]
    if measured.get("nic_GBps"):
        fields["nic_GBps"] = measured["nic_GBps"]
    fields.update(host_fields(host, measured.get("host_link_GBps"),
                              measured.get("cpu_adam_rate_per_core"), notes))
    figures = {k: {"datasheet": None, "measured": v} for k, v in measured.items()}
    return fields, figures, notes


def cluster_from_facts(facts: list[dict], measured: dict | None = None, name: str | None = None,
                       where: str = "this launch") -> tuple[dict, dict, list[str]]:
    """ClusterSpec fields, figures (datasheet beside measured) and notes for the ranks'
    ``facts``; nodes that differ are refused naming the odd one."""
    nodes = check_homogeneous(facts)
    f, measured = nodes[0][0], dict(measured or {})
    host = {k: f[k] for k in ("host_memory_gb", "cpu_cores")}
    if not f.get("device"):
        return cpu_cluster(len(nodes), len(nodes[0]), host, measured, name)
    dev = same_devices([Device(f["device"], float(f["memory_gib"]))], where)   # a MIG slice is refused
    return gpu_cluster(dev, len(nodes), len(nodes[0]), kind=kind_of(dev.name, dev.memory_gib),
                       measured=measured, host=host, name=name)


def local_device(layout: dict) -> torch.device:
    """The device a rank of ``layout`` runs on: its local GPU, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", layout["local_rank"] % torch.cuda.device_count())
    return torch.device("cpu")


def with_matmul(facts, measured, name):
    """cluster_from_facts, the measured matmul rate of a known kind shown beside its MAMF (the
    kind's shape-aware model still costs its kernels)."""
    rate = measured.pop("matmul_tflops", None)
    fields, figures, notes = cluster_from_facts(facts, measured, name)
    if rate is not None and fields.get("gpu"):
        from ..spec.cluster import gpu_table
        figures["matmul_tflops"] = {"datasheet": gpu_table()[fields["gpu"]]["mamf_tflops"], "measured": rate}
    return fields, figures, notes


def facts_here(gpus_per_node: int | None = None, num_nodes: int = 1) -> list[dict]:
    """The ranks' facts of this machine alone: its visible GPUs (or ``gpus_per_node`` CPU ranks),
    repeated over ``num_nodes`` identical nodes (:func:`rank_facts`' keys)."""
    host = host_facts()
    cuda = torch.cuda.is_available()
    count = torch.cuda.device_count() if cuda else 0
    per_node = gpus_per_node or count or CPU_RANKS
    if cuda and per_node > count:
        raise ValueError(f"{per_node} GPUs per node asked for, {count} visible here")
    devs = [device_facts(i) if cuda else {"device": None, "memory_gib": None} for i in range(per_node)]
    if cuda:
        same_devices([Device(d["device"], d["memory_gib"]) for d in devs], "this machine")
    return [{"node": n, "rank": n * per_node + i, "local_rank": i, **host, **d}
            for n in range(num_nodes) for i, d in enumerate(devs)]


def detect_here(gpus_per_node: int | None = None, num_nodes: int = 1, quick: bool = True,
                measure: bool = True, name: str | None = None):
    """This machine alone, no launch: its visible GPUs (or ``gpus_per_node`` CPU ranks),
    repeated over ``num_nodes`` identical nodes.  Measured (spawned local processes for the
    all-reduce) what no datasheet gives, and everything else too with ``measure``.
    ``(fields, figures, notes, facts)``."""
    facts = facts_here(gpus_per_node, num_nodes)
    cuda, per_node, first = torch.cuda.is_available(), len(facts) // num_nodes, facts[0]
    known = cuda and kind_of(first["device"], first["memory_gib"]) is not None
    measured: dict = {}
    if measure or not known:
        measured.update(device_measured(torch.device("cuda", 0) if cuda else torch.device("cpu"), quick, known))
        if per_node > 1:
            from .hardware import collective_bandwidth
            ar = collective_bandwidth(per_node, sizes=SIZES[quick], repeats=3 if quick else 10)["all_reduce"]
            measured.update(intra_node_GBps=round(ar["GBps"], 3), intra_latency_us=round(ar["alpha_us"], 2))
    return (*with_matmul(facts, measured, name), facts)
