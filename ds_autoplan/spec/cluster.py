"""ClusterSpec: homogeneous nodes of identical devices (docs/planner.md §0, §1.4)."""
from __future__ import annotations

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
    import yaml
    return yaml.safe_load(GPU_DATA.read_text())


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
                nic_GBps=float(d["nic_GBps"]) if d.get("nic_GBps") else None)
        if c.reserve_gb < 0 or c.reserve_gb >= c.memory_gb:
            raise SpecError(f"{src}: reserve_gb must lie in [0, memory_gb)")
        if not 0 < c.compute_efficiency <= 1:
            raise SpecError(f"{src}: compute_efficiency must lie in (0, 1]")
        if c.gpu:
            check_gpu(c.gpu)
        return c


def load_cluster(cluster: "str | ClusterSpec | dict", profile: str | None = None) -> ClusterSpec:
    """A preset name, a YAML path, a dict or a ClusterSpec.  ``profile``: optional YAML/JSON
    of measured overrides (any ClusterSpec field, e.g. intra_node_GBps from a profile run)."""
    if isinstance(cluster, ClusterSpec):
        c = cluster
    elif isinstance(cluster, dict):
        c = ClusterSpec.from_dict(cluster)
    else:
        d, src = resolve(str(cluster), "clusters")
        c = ClusterSpec.from_dict(d, src)
    if profile:
        over = read_mapping(profile)
        over = over.get("cluster", over)
        fields = {k: v for k, v in over.items() if k in ClusterSpec.__dataclass_fields__}
        if {"peak_tflops", "compute_efficiency"} & set(fields) and "gpu" not in fields:
            fields["gpu"] = None         # a measured matmul rate replaces the GPU kind's model
        c = ClusterSpec.from_dict({**c.__dict__, **fields}, profile)
    return c
