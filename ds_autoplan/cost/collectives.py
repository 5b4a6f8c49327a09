"""Collective time primitives (planner-galvatron.md §2.3) over a node-major rank layout (§1.4)."""
from __future__ import annotations

from functools import lru_cache

from ..spec.cluster import ClusterSpec


class Network:
    """Bandwidth/latency of a group of ``g`` ranks spaced ``stride`` apart (consecutive ranks
    share a node).  A group spanning nodes shares each node's NIC with the other groups of
    the same shape, so its bus bandwidth is the node bandwidth times its members per node
    over the GPUs per node [decision, §6 #18]."""

    def __init__(self, cluster: ClusterSpec):
        self.c = cluster

    @lru_cache(maxsize=None)
    def link(self, g: int, stride: int = 1) -> tuple[float, float]:
        c, G = self.c, self.c.gpus_per_node
        if g * stride <= G:
            return c.intra_node_GBps * 1e9, c.intra_latency_us * 1e-6
        per_node = max(1, min(g, G // stride))
        return c.inter_node_GBps * 1e9 * per_node / G, c.inter_latency_us * 1e-6

    def all_reduce(self, X: float, g: int, stride: int = 1) -> float:
        """t_AR(X, g) = 2(g-1)/g * X / BW + lat."""
        if g <= 1 or X <= 0:
            return 0.0
        bw, lat = self.link(g, stride)
        return 2 * (g - 1) / g * X / bw + lat

    def all_gather(self, X: float, g: int, stride: int = 1) -> float:
        """t_AG(X, g) = (g-1)/g * X / BW + lat, X = gathered size (reduce-scatter alike)."""
        if g <= 1 or X <= 0:
            return 0.0
        bw, lat = self.link(g, stride)
        return (g - 1) / g * X / bw + lat

    reduce_scatter = all_gather

    def p2p(self, X: float, n: int) -> float:
        """Send of X bytes per device between adjacent stages of n devices each: stages of a
        full node or more cross the node boundary, smaller ones stay inside."""
        if X <= 0:
            return 0.0
        c, G = self.c, self.c.gpus_per_node
        if c.p2p_GBps:
            bw, lat = c.p2p_GBps * 1e9, c.inter_latency_us * 1e-6
        elif n >= G and c.num_nodes > 1:
            bw, lat = c.inter_node_GBps * 1e9 / G, c.inter_latency_us * 1e-6
        else:
            bw, lat = c.intra_node_GBps * 1e9, c.intra_latency_us * 1e-6
        return X / bw + lat
