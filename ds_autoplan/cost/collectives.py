"""Collective time primitives (docs/planner.md §2.3) over a node-major rank layout (§1.4)."""
from __future__ import annotations

from functools import lru_cache

from ..spec.cluster import ClusterSpec


class Network:
    """Collective times of a group of ``g`` ranks spaced ``stride`` apart over a node-major rank
    layout (consecutive ranks share a node) with a two-level bandwidth hierarchy: NVLink
    inside a node (``intra_node_GBps``, bus bandwidth) and one inter-node link per GPU
    (``ClusterSpec.rail_GBps``, a rail-optimised fabric).  A group with ``k`` members on each of
    ``n`` nodes runs hierarchically [decision, the two-level ring of NCCL's tree/ring
    algorithms]: its ``k`` node-local members reduce-scatter over NVLink, each member then
    reduces its 1/k shard with its peers on the other nodes over its own rail, and they gather
    back inside the node.  So a group strided across nodes (k = 1) pays the whole tensor on one
    rail while a node-contiguous one splits it over k rails, and groups inside a node never
    touch the fabric."""

    def __init__(self, cluster: ClusterSpec):
        self.c = cluster

    @lru_cache(maxsize=None)
    def layout(self, g: int, stride: int = 1) -> tuple[int, int]:
        """(members per node k, nodes spanned n) of the group."""
        G = self.c.gpus_per_node
        if g * stride <= G:
            return g, 1
        k = max(1, min(g, G // stride))
        return k, -(-g // k)

    def _phases(self, X: float, g: int, stride: int, factor: float) -> float:
        """factor 2: all-reduce; 1: all-gather / reduce-scatter (X = the full tensor)."""
        if g <= 1 or X <= 0:
            return 0.0
        c = self.c
        k, n = self.layout(g, stride)
        t = 0.0
        if k > 1:
            t += factor * (k - 1) / k * X / (c.intra_node_GBps * 1e9) + c.intra_latency_us * 1e-6
        if n > 1:
            t += factor * (n - 1) / n * (X / k) / (c.rail_GBps * 1e9) + c.inter_latency_us * 1e-6
        return t

    @lru_cache(maxsize=None)
    def link(self, g: int, stride: int = 1) -> tuple[float, float]:
        """Effective (bus bandwidth B/s, latency s) of the group: t_AG(X) = (g-1)/g X/bw + lat."""
        if g <= 1:
            return self.c.intra_node_GBps * 1e9, self.c.intra_latency_us * 1e-6
        k, n = self.layout(g, stride)
        lat = (self.c.intra_latency_us if k > 1 else 0.0) + (self.c.inter_latency_us if n > 1 else 0.0)
        t = self._phases(1.0, g, stride, 1.0) - lat * 1e-6
        return (g - 1) / g / t, lat * 1e-6

    def all_reduce(self, X: float, g: int, stride: int = 1) -> float:
        """t_AR(X, g) = 2(g-1)/g * X / BW + lat per level of the hierarchy."""
        return self._phases(X, g, stride, 2.0)

    def all_gather(self, X: float, g: int, stride: int = 1) -> float:
        """t_AG(X, g) = (g-1)/g * X / BW + lat per level, X = gathered size (reduce-scatter alike)."""
        return self._phases(X, g, stride, 1.0)

    reduce_scatter = all_gather

    def all_to_all(self, X: float, g: int, stride: int = 1) -> float:
        """All-to-all of ``X`` bytes per rank over ``g`` ranks spaced ``stride`` apart: each
        rank keeps X/g and sends X/g to every peer; with ``k`` members per node the (k-1)/g
        share for node peers goes over NVLink and the (g-k)/g share for other nodes over the
        GPU's own rail, both at once (the slower bounds it), plus each level's latency."""
        if g <= 1 or X <= 0:
            return 0.0
        c = self.c
        k, n = self.layout(g, stride)
        intra = (k - 1) / g * X / (c.intra_node_GBps * 1e9) + (c.intra_latency_us * 1e-6 if k > 1 else 0.0)
        inter = (g - k) / g * X / (c.rail_GBps * 1e9) + c.inter_latency_us * 1e-6 if n > 1 else 0.0
        return max(intra, inter)

    def ring_step(self, X: float, g: int, stride: int = 1) -> float:
        """One step of a ring over ``g`` ranks spaced ``stride`` apart, every rank sending ``X``
        bytes to its successor at once: a ring spanning nodes has steps crossing a node
        boundary, on the rail, which the lock-step ring waits for."""
        if g <= 1 or X <= 0:
            return 0.0
        c = self.c
        if self.layout(g, stride)[1] > 1:
            return X / (c.rail_GBps * 1e9) + c.inter_latency_us * 1e-6
        return X / (c.intra_node_GBps * 1e9) + c.intra_latency_us * 1e-6

    def p2p(self, X: float, n: int) -> float:
        """Send of X bytes per device between adjacent stages of n devices each: stages of a
        full node or more cross the node boundary, smaller ones stay inside."""
        if X <= 0:
            return 0.0
        c, G = self.c, self.c.gpus_per_node
        if c.p2p_GBps:
            bw, lat = c.p2p_GBps * 1e9, c.inter_latency_us * 1e-6
        elif n >= G and c.num_nodes > 1:
            bw, lat = c.rail_GBps * 1e9, c.inter_latency_us * 1e-6
        else:
            bw, lat = c.intra_node_GBps * 1e9, c.intra_latency_us * 1e-6
        return X / bw + lat
