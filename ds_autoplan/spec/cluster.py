"""ClusterSpec: homogeneous nodes of identical devices (docs/planner.md §0, §1.4), and the
host side of each node that offloading uses (docs/offload.md §1).

Host fields, all per node and all optional (a cluster without them cannot offload, and the
planner says which are missing: :meth:`ClusterSpec.offload_missing`):

* ``host_memory_gb`` -- host DRAM of one node (GB), shared by its ranks' pinned buffers;
* ``cpu_cores`` -- physical CPU cores of one node, shared by its ranks' CPU optimizers;
* ``cpu_adam_rate_per_core`` -- parameters per second one core updates with DeepSpeed's
  ``DeepSpeedCPUAdam`` (AVX, bf16/fp16 model with fp32 states), as ``ds-autoplan profile
  --hardware`` and ``bench/offload_cpu.py`` measure it;
* ``host_memory_GBps`` -- the node's DRAM bandwidth (all sockets): the CPU step streams its
  states through it, so it caps the cores' rate (``cost/offload.py`` CPU_ADAM_BYTES);
* ``host_link_GBps`` -- one GPU's host<->device link, GB/s each way (pinned copies);
* ``host_link_shared_by`` -- GPUs behind one such link (a PCIe switch's uplink to its CPU):
  when all of them copy at once each gets ``host_link_GBps / host_link_shared_by``;
* ``nvme_GBps``, ``nvme_gb`` -- the node's local NVMe (all drives): GB/s each way and GB.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

from . import SpecError
from .presets import need, read_mapping, resolve

GB = 1024 ** 3
GPU_DATA = Path(__file__).resolve().parents[1] / "data" / "gpus.yaml"


@lru_cache(maxsize=None)
def gpu_table() -> dict:
    """The per-GPU-kind figures of ``ds_autoplan/data/gpus.yaml`` as written (the cost model's
    ``cost.compute.gpu_kinds`` reads them)."""
    return read_mapping(GPU_DATA)


def check_gpu(name: str) -> None:
    """A clear error for a GPU kind ``gpus.yaml`` does not describe."""
    if name not in gpu_table():
        raise SpecError(f"unknown gpu kind {name!r}; known: {', '.join(sorted(gpu_table()))} "
                        f"(ds_autoplan/data/gpus.yaml)")


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    num_nodes: int
    gpus_per_node: int
    memory_gb: float
    peak_tflops: float
    intra_node_GBps: float
    inter_node_GBps: float
    reserve_gb: float = 2.0
    compute_efficiency: float = 0.5
    intra_latency_us: float = 10.0
    inter_latency_us: float = 20.0
    overlap_slowdown: float = 1.3       # gamma, Galvatron-BMW §IV (measured 1.3)
    p2p_GBps: float | None = None
    gpu: str | None = None              # GPU kind in ds_autoplan/data/gpus.yaml: shape-aware compute
    nic_GBps: float | None = None       # one GPU's own inter-node link (rail); default inter/gpus_per_node
    # -- host side, per node (module docstring); None: unknown, so no offloading --
    host_memory_gb: float | None = None
    cpu_cores: int | None = None
    cpu_adam_rate_per_core: float | None = None   # DeepSpeedCPUAdam parameters/s per core
    host_memory_GBps: float | None = None
    host_link_GBps: float | None = None           # per GPU, each way
    host_link_shared_by: int = 1
    nvme_GBps: float | None = None
    nvme_gb: float | None = None
    # -- fitted by `ds-autoplan calibrate` from the runs' records (cost/calibrate.py); the
    # defaults change nothing --
    compute_scale: float = 1.0          # achieved / modelled compute rate (a GPU kind's sustained factor)
    action_overhead_us: float = 0.0     # fixed cost of every F, B (and W) action: launch, hooks, small GEMMs
    step_overhead_ms: float = 0.0       # fixed cost of every iteration: the engine's per-step work
    memory_overhead_gb: float = 0.0     # per device, above (below: < 0) the modelled states and activations
    calibration_error: float | None = None   # the calibration's largest relative residual (its runs)
    calibration_runs: int | None = None      # how many runs it was fitted to

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @property
    def budget_bytes(self) -> float:
        """Per-device memory budget E (device memory minus the reserve)."""
        return (self.memory_gb - self.reserve_gb) * GB

    @property
    def rail_GBps(self) -> float:
        """Inter-node bandwidth of one GPU's own link (its NIC on a rail-optimised fabric)."""
        return self.nic_GBps or self.inter_node_GBps / self.gpus_per_node

    @property
    def flops(self) -> float:
        """Achieved FLOP/s of one device on transformer matmuls where the GPU kind has no
        shape-aware model (cost/compute.py), and for profiled models."""
        return self.peak_tflops * 1e12 * self.compute_efficiency

    def offload_missing(self, nvme: bool = False) -> list[str]:
        """The host fields offloading needs that this cluster lacks (empty: it can offload;
        ``nvme``: to NVMe too)."""
        need = ["host_memory_gb", "cpu_cores", "cpu_adam_rate_per_core", "host_link_GBps"]
        if nvme:
            need += ["nvme_GBps", "nvme_gb"]
        return [k for k in need if not getattr(self, k)]

    def host_link_each_GBps(self, active: int | None = None) -> float:
        """Host<->device GB/s (each way) of one GPU while ``active`` GPUs of its node copy at
        once (default all): ``host_link_shared_by`` of them share one link."""
        n = self.gpus_per_node if active is None else max(1, min(active, self.gpus_per_node))
        return float(self.host_link_GBps or 0.0) / max(1, min(self.host_link_shared_by, n))

    def with_budget(self, budget_gb: float) -> "ClusterSpec":
        """Same cluster, memory capped at ``budget_gb`` (the papers' E = 8G/16G settings)."""
        if budget_gb <= 0:
            raise SpecError(f"memory budget must be positive, got {budget_gb} GB")
        return replace(self, memory_gb=float(budget_gb), reserve_gb=0.0)

    @classmethod
    def from_dict(cls, d: dict, src: str = "cluster") -> "ClusterSpec":
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise SpecError(f"{src}: unknown cluster field(s) {', '.join(sorted(unknown))}")
        c = cls(name=str(d.get("name", src)),
                num_nodes=need(d, "num_nodes", int, src, 1),
                gpus_per_node=need(d, "gpus_per_node", int, src),
                memory_gb=need(d, "memory_gb", float, src),
                peak_tflops=need(d, "peak_tflops", float, src),
                intra_node_GBps=need(d, "intra_node_GBps", float, src),
                inter_node_GBps=need(d, "inter_node_GBps", float, src),
                reserve_gb=float(d.get("reserve_gb", 2.0)),
                compute_efficiency=need(d, "compute_efficiency", float, src, 0.5),
                intra_latency_us=float(d.get("intra_latency_us", 10.0)),
                inter_latency_us=float(d.get("inter_latency_us", 20.0)),
                overlap_slowdown=need(d, "overlap_slowdown", float, src, 1.3),
                p2p_GBps=float(d["p2p_GBps"]) if d.get("p2p_GBps") else None,
                gpu=str(d["gpu"]) if d.get("gpu") else None,
                nic_GBps=float(d["nic_GBps"]) if d.get("nic_GBps") else None,
                host_memory_gb=_opt(d, "host_memory_gb", float, src),
                cpu_cores=_opt(d, "cpu_cores", int, src),
                cpu_adam_rate_per_core=_opt(d, "cpu_adam_rate_per_core", float, src),
                host_memory_GBps=_opt(d, "host_memory_GBps", float, src),
                host_link_GBps=_opt(d, "host_link_GBps", float, src),
                host_link_shared_by=_opt(d, "host_link_shared_by", int, src) or 1,
                nvme_GBps=_opt(d, "nvme_GBps", float, src),
                nvme_gb=_opt(d, "nvme_gb", float, src),
                compute_scale=_opt(d, "compute_scale", float, src) or 1.0,
                action_overhead_us=_nonneg(d, "action_overhead_us", src),
                step_overhead_ms=_nonneg(d, "step_overhead_ms", src),
                memory_overhead_gb=float(d.get("memory_overhead_gb") or 0.0),
                calibration_error=_nonneg(d, "calibration_error", src) if d.get("calibration_error") is not None else None,
                calibration_runs=_opt(d, "calibration_runs", int, src))
        odd = {k: v for k, v in vars(c).items() if isinstance(v, float) and not math.isfinite(v)}
        if odd:
            raise SpecError(f"{src}: " + ", ".join(f"{k} {v}" for k, v in odd.items())
                            + ": every figure must be a finite number")
        if c.reserve_gb < 0 or c.reserve_gb >= c.memory_gb:
            raise SpecError(f"{src}: reserve_gb must lie in [0, memory_gb)")
        if not abs(c.memory_overhead_gb) < c.memory_gb:
            raise SpecError(f"{src}: memory_overhead_gb must lie within +-memory_gb")
        if not 0 < c.compute_efficiency <= 1:
            raise SpecError(f"{src}: compute_efficiency must lie in (0, 1]")
        if c.gpu:
            check_gpu(c.gpu)
        return c


def _opt(d: dict, key: str, typ, src: str):
    """An optional positive host figure (None where absent or null)."""
    v = d.get(key)
    if v is None:
        return None
    try:
        x = typ(v)
    except (TypeError, ValueError):
        raise SpecError(f"{src}: {key} must be a number, got {v!r}") from None
    if isinstance(v, bool) or not x > 0 or (typ is int and x != v):
        raise SpecError(f"{src}: {key} must be a positive {'integer' if typ is int else 'number'}, got {v!r}")
    return x


def _nonneg(d: dict, key: str, src: str) -> float:
    """An optional non-negative figure (0 where absent or null)."""
    v = d.get(key)
    if v is None:
        return 0.0
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise SpecError(f"{src}: {key} must be a number, got {v!r}") from None
    if isinstance(v, bool) or not (math.isfinite(x) and x >= 0):
        raise SpecError(f"{src}: {key} must be a non-negative number, got {v!r}")
    return x


def load_cluster(cluster: "str | ClusterSpec | dict", profile: str | None = None) -> ClusterSpec:
    """A preset name, a YAML path, a dict or a ClusterSpec.  ``profile``: optional YAML/JSON
    of measured overrides (any ClusterSpec field, e.g. intra_node_GBps from a profile run)."""
    if isinstance(cluster, ClusterSpec):
        c = cluster
    elif isinstance(cluster, dict):
        c = ClusterSpec.from_dict(cluster)
    else:
        d, src = resolve(str(cluster), "clusters")
        if isinstance(d.get("cluster"), dict):   # `ds-autoplan cluster --out` files: cluster + detected
            d = d["cluster"]
        c = ClusterSpec.from_dict(d, src)
    if profile:
        over = read_mapping(profile)
        over = over.get("cluster", over)
        fields = {k: v for k, v in over.items() if k in ClusterSpec.__dataclass_fields__}
        if {"peak_tflops", "compute_efficiency"} & set(fields) and "gpu" not in fields:
            fields["gpu"] = None         # a measured matmul rate replaces the GPU kind's model
        c = ClusterSpec.from_dict({**c.__dict__, **fields}, profile)
    return c
