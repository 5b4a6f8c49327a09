"""Hardware micro-benchmarks: matmul FLOP/s and collective bandwidth (all-reduce, all-gather,
p2p) between local processes (gloo on CPU, NCCL on GPUs), written as a cluster-spec dict.

Per collective a line ``t(bytes) = alpha + bytes / beta`` is fitted over the sizes; the bus
bandwidth convention of nccl-tests is used (all-reduce moves ``2(n-1)/n`` of the buffer per
rank, all-gather ``(n-1)/n`` of the output), so the figures are what the planner's
``size / bandwidth`` formulas expect.
"""
from __future__ import annotations

import os
import socket
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..errors import UserError


def median_seconds(fn, device: str | torch.device = "cpu", repeats: int = 5) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after one warm-up (a CUDA ``device``
    is synchronized around each call)."""
    device = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    times = []
    for r in range(repeats + 1):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        if r:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_flops(n: int = 512, device: str | torch.device = "cpu", dtype=torch.float32,
                 repeats: int = 5) -> float:
    """Achieved FLOP/s of an n x n x n matmul (median of ``repeats`` after one warm-up).  The
    operands come from a generator of its own: the process's random state is left as it was."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    return 2.0 * n ** 3 / median_seconds(lambda: a @ b, device, repeats)


def action_seconds(device: str | torch.device = "cpu", repeats: int = 50) -> float:
    """Fixed cost of one compute action: half a forward + backward of a 16 x 16 linear layer on
    one row (the autograd, dispatch and launch work every F and B pays whatever its size;
    median of ``repeats``).  The cost model's ``action_overhead_us``."""
    g = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(16, 16, device=device, generator=g, requires_grad=True)
    x = torch.randn(1, 16, device=device, generator=g)
    return median_seconds(lambda: (x @ w).sum().backward(), device, repeats) / 2


def host_link_GBps(device: str | torch.device = "cpu", nbytes: int = 1 << 24,
                   repeats: int = 5) -> dict:
    """Swap link bandwidth (docs/dawnpiper.md §7.2 ``BW_pcie``, D2H and H2D separately):
    pinned host <-> device copies on CUDA; on a CPU a host-to-host copy of the buffer (the
    "host" of a CPU rank is the same memory).  Median of ``repeats`` after one warm-up."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)

    def rate(dst, src):
        return nbytes / median_seconds(lambda: dst.copy_(src, non_blocking=cuda), device, repeats) / 1e9

    return {"d2h_GBps": rate(host, dev), "h2d_GBps": rate(dev, host), "bytes": nbytes}


def cpu_adam_rate(n_params: int = 1 << 24, threads: int | None = None, repeats: int = 3,
                  optimizer: str = "deepspeed") -> dict:
    """Parameters per second of one CPU optimizer step over ``n_params`` fp32 parameters with
    fp32 gradients and Adam moments (what ZeRO-Offload's CPU step updates: the rank's fp32
    master partition, ``stage_1_and_2.py`` ``single_partition_of_fp32_groups``), on
    ``threads`` threads (default torch's).  ``optimizer``: 'deepspeed' (DeepSpeed's
    ``DeepSpeedCPUAdam``, AVX; builds its op on first use) or 'torch' (``torch.optim.AdamW``
    with ``fused=True`` on CPU: Megatron-core's HybridDeviceOptimizer CPU optimizer).
    Median of ``repeats`` after one warm-up step; ``per_core``: the rate over the threads."""
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        p = torch.nn.Parameter(torch.zeros(n_params, dtype=torch.float32))
        p.grad = torch.full_like(p, 1e-3)
        if optimizer == "deepspeed":
            from deepspeed.ops.adam import DeepSpeedCPUAdam
            opt = DeepSpeedCPUAdam([p], lr=1e-4, adamw_mode=True)
        elif optimizer == "torch":
            opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
        else:
            raise ValueError(f"optimizer must be 'deepspeed' or 'torch', got {optimizer!r}")
        times = []
        for r in range(repeats + 1):
            t0 = time.perf_counter()
            opt.step()
            if r:
                times.append(time.perf_counter() - t0)
        n = torch.get_num_threads()
    finally:
        torch.set_num_threads(old)
    t = statistics.median(times)
    return {"optimizer": optimizer, "params": n_params, "threads": n, "step_s": t,
            "params_per_s": n_params / t, "per_core": n_params / t / n}


def host_figures(device: str, world: int, quick: bool = False) -> dict:
    """The host fields of one node (spec/cluster.py): memory, cores, the DeepSpeedCPUAdam rate
    per core and the host<->device copy rate of one device.  The CPU optimizer is measured on
    every core of this process (a rank's share when ``world`` ranks share the node is what the
    cost model derives from it).  Where DeepSpeed's CPU Adam op cannot be built, its rate is
    left out (the cluster then cannot offload, and says so)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    out = {"host_memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30, 2),
           "cpu_cores": cores}
    measured = {}
    try:
        r = cpu_adam_rate(1 << (22 if quick else 25), threads=cores, repeats=2 if quick else 3)
        out["cpu_adam_rate_per_core"] = float(r["per_core"])
        measured["cpu_adam"] = r
    except Exception as e:          # no compiler / op build failure: named, not fatal
        measured["cpu_adam"] = {"error": f"{type(e).__name__}: {e}"}
    link = host_link_GBps(device, 1 << (22 if quick else 26), repeats=3 if quick else 10)
    out["host_link_GBps"] = float(min(link["d2h_GBps"], link["h2d_GBps"]))
    measured["host_link"] = link
    return {"cluster": out, "measured": measured}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bench_worker(rank: int, world: int, port: int, backend: str, sizes, repeats: int, q):
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        import datetime
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        dev = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
        sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
        res = {"all_reduce": [], "all_gather": [], "p2p": []}
        for nbytes in sizes:
            x = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=dev)
            outs = [torch.empty_like(x) for _ in range(world)]
            for op in res:
                ts = []
                for r in range(3):       # 3 timed loops of `repeats` back-to-back calls
                    dist.barrier()
                    sync()
                    t0 = time.perf_counter()
                    for _ in range(repeats if r else 1):   # r == 0: warm-up
                        if op == "all_reduce":
                            dist.all_reduce(x)
                        elif op == "all_gather":
                            dist.all_gather(outs, x)
                        elif rank == 0:      # ping-pong: one-way time = round trip / 2
                            dist.send(x, 1)
                            dist.recv(x, 1)
                        elif rank == 1:
                            dist.recv(x, 0)
                            dist.send(x, 0)
                    sync()
                    dt = (time.perf_counter() - t0) / (repeats if r else 1)
                    if r:
                        ts.append(dt / 2 if op == "p2p" else dt)
                # the slowest rank defines a collective's time
                t = torch.tensor([statistics.median(ts)], dtype=torch.float64)
                dist.all_reduce(t.to(dev) if dev.type == "cuda" else t, op=dist.ReduceOp.MAX)
                res[op].append((x.numel() * 4, float(t.item())))
        if rank == 0:
            q.put(("ok", res))
        dist.destroy_process_group()
    except Exception as e:  # report instead of hanging the parent
        q.put(("error", f"rank {rank}: {type(e).__name__}: {e}"))


def _fit(points: list[tuple[int, float]], factor: float) -> dict:
    """t = alpha + bytes*factor/beta  (least squares); factor: bus-bandwidth convention."""
    b = np.array([p[0] * factor for p in points], float)
    t = np.array([p[1] for p in points], float)
    A = np.vstack([np.ones_like(b), b]).T
    (alpha, slope), *_ = np.linalg.lstsq(A, t, rcond=None)
    if slope <= 0:   # noisy/too few sizes: bandwidth of the largest transfer, no latency
        i = int(np.argmax(b))
        alpha, slope = 0.0, float(t[i] / b[i])
    return {"alpha_us": max(0.0, float(alpha)) * 1e6, "GBps": 1.0 / float(slope) / 1e9,
            "points": [[int(x), float(y)] for x, y in points]}


def collective_bandwidth(world: int = 2, backend: str | None = None,
                         sizes=(1 << 12, 1 << 16, 1 << 20, 1 << 22), repeats: int = 5,
                         timeout: float = 120.0) -> dict:
    """Spawn ``world`` local processes and time all-reduce, all-gather and p2p."""
    backend = backend or ("nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world
                          else "gloo")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_bench_worker, daemon=True,
                         args=(r, world, port, backend, list(sizes), repeats, q))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        status, res = q.get(timeout=timeout)
    except Exception:
        status, res = "error", f"collective benchmark timed out after {timeout:.0f} s"
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    if status != "ok":
        raise UserError(f"collective benchmark failed: {res}")
    n = world
    return {"backend": backend, "world": world,
            "all_reduce": _fit(res["all_reduce"], 2 * (n - 1) / n),
            "all_gather": _fit(res["all_gather"], (n - 1) / n * n),   # output = n buffers
            "p2p": _fit(res["p2p"], 1.0)}


def hardware_cluster_spec(world: int = 2, device: str | None = None, quick: bool = False,
                          name: str | None = None) -> dict:
    """Measure this machine and return ``{"cluster": ClusterSpec fields, "measured": raw}``
    (``ds_autoplan.spec.load_cluster(..., profile=path)`` reads the ``cluster`` part)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    flops = matmul_flops(256 if quick else 1024, device, repeats=3 if quick else 10)
    coll = collective_bandwidth(world, sizes=(1 << 12, 1 << 20) if quick else
                                (1 << 12, 1 << 16, 1 << 20, 1 << 22), repeats=3 if quick else 10)
    if device == "cuda":
        mem = torch.cuda.get_device_properties(0).total_memory / 2 ** 30
    else:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30 / world
    host = host_figures(device, world, quick)
    ar, p2p = coll["all_reduce"], coll["p2p"]
    cluster = {"name": name or f"measured-{device}-{world}", "num_nodes": 1,
               "gpus_per_node": world, "memory_gb": round(mem, 2),
               "reserve_gb": round(min(2.0, mem / 8), 2),
               # measured matmul rate = achieved: efficiency 1
               "peak_tflops": float(flops) / 1e12, "compute_efficiency": 1.0,
               "intra_node_GBps": ar["GBps"], "inter_node_GBps": ar["GBps"],
               "intra_latency_us": ar["alpha_us"], "inter_latency_us": ar["alpha_us"],
               "p2p_GBps": p2p["GBps"], "overlap_slowdown": 1.3, **host["cluster"]}
    return {"cluster": cluster,
            "measured": {"device": device, "matmul_flops": flops, **host["measured"], **coll}}
