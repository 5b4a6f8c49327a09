"""Closed-form cost of one uniform configuration (every layer the same TP/DP/ZeRO/recompute),
for configurations the search cannot express yet (any pipeline degree, interleaving with v
chunks per rank, selective recompute) and for checking a plan's memory independently of the
simulator.  Same per-layer tables as the search (CostModel.tables).

Time (Narayanan et al. 2021 §2.2): the busiest rank's forward+backward per micro-batch t_mb,
m micro-batches plus a bubble of (p-1)/v micro-batch times (§2.2.2: interleaving with v chunks
divides the bubble by v), then the busiest rank's non-overlapped tail (gradient reduction,
optimizer step, ZeRO parameter gather).
Memory: model states + in-flight micro-batches' stashes + the largest backward transient;
1F1B rank r keeps min(p - r, m) micro-batches (§2.2.1), Megatron's interleaved schedule keeps
2(p - r - 1) + (v - 1) p + 1 chunk micro-batches in flight (its warm-up count + 1).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..spec.model import tied_embeddings
from ..spec.parallel import Parallel
from .engines import lockstep_time
from .model import CostModel, Strategy

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True, kw_only=True)
class Config(Parallel):
    """A uniform configuration: its degrees and batch split (``chunks``: interleaved model
    chunks per rank, 1 = plain 1F1B) and one recompute mode for every layer."""
    recompute: str = "none"

    def strategy(self) -> Strategy:
        """The per-layer :class:`Strategy` of this uniform configuration (full recompute ->
        checkpointing, selective -> Korthikanti's selective recompute)."""
        return Strategy.of(self, ckpt=self.recompute == "full", sel=self.recompute == "selective")


@dataclass
class ConfigCost:
    """The closed-form cost of one configuration: iteration time, peak bytes per pipeline rank,
    whether it fits, and its parts (time per micro-batch, bubble, non-overlapped tail)."""
    time: float
    peak: list = field(default_factory=list)       # bytes per pipeline rank
    fits: bool = True
    per_microbatch: float = 0.0
    bubble: float = 0.0
    tail: float = 0.0


def split_layers(L: int, S: int) -> list[int]:
    """L blocks into S chunks as evenly as possible (the later chunks take the remainder, as
    the first carries the embedding and the last the head)."""
    q, r = divmod(L, S)
    return [q + (1 if i >= S - r else 0) for i in range(S)]


def in_flight(pp: int, rank: int, m: int, v: int) -> float:
    """Micro-batches of a whole stage's activations rank ``rank`` holds at its peak."""
    if pp == 1:
        return 1.0
    if v == 1:
        return float(min(pp - rank, m))
    return min(2 * (pp - rank - 1) + (v - 1) * pp + 1, m * v) / v


def config_cost(cm: CostModel, cfg: Config, budget: float | None = None) -> ConfigCost:
    """Iteration seconds and per-rank peak bytes of ``cfg`` under ``cm``."""
    s = cfg.strategy()
    B_m = cfg.batch_per_microbatch
    tab = cm.tables([s], B_m)
    seq = np.concatenate([[0], cm.block_types, [1]])
    v, P, m = cfg.chunks, cfg.pp, cfg.num_microbatches
    S = P * v
    nblk = split_layers(len(cm.block_types), S)
    col = lambda a: a[seq, 0]   # noqa: E731
    fwd, bwd_ns, sync, f1, ob, ms, p2p = (col(tab.fwd), col(tab.bwd_ns), col(tab.bwd - tab.bwd_ns),
                                           col(tab.f1), col(tab.ob), col(tab.ms), col(tab.p2p))
    work, tail, peak = np.zeros(P), np.zeros(P), np.zeros(P)
    f_r, b_r, x_r = np.zeros(P), np.zeros(P), np.zeros(P)
    act, trans = np.zeros(P), np.zeros(P)
    lo = 0
    for c, n in enumerate(nblk):
        hi = lo + n + (1 if c == 0 else 0) + (1 if c == S - 1 else 0)
        r = c % P
        sl = slice(lo, hi)
        work[r] += fwd[sl].sum() + bwd_ns[sl].sum() + (2 * p2p[hi - 1] if c < S - 1 else 0.0)
        f_r[r] += fwd[sl].sum()
        b_r[r] += bwd_ns[sl].sum()
        x_r[r] = p2p[hi - 1] if c < S - 1 else 0.0
        tail[r] += sync[sl].sum()
        peak[r] += ms[sl].sum()
        act[r] += f1[sl].sum()
        trans[r] = max(trans[r], float(ob[sl].max()))
        lo = hi
    for r in range(P):
        peak[r] += in_flight(P, r, m, v) * act[r] + trans[r]
    t_mb = float(work.max())
    bubble = (P - 1) / v * t_mb
    if P > 1 and cm.execution.tied_reduce and tied_embeddings(cm.model.config):
        # tied word-embedding gradients all-reduced between the first and the last stage
        # (DeepSpeed ReduceTiedGrads, Megatron finalize_model_grads) after the flush
        E = cm.model.vocab * cm.model.hidden / cfg.tp * (4 if cm.precision != "fp16" else 2)
        t_tied = cm.net.p2p(E, cfg.tp * cfg.dp)
        tail[0] += t_tied
        tail[P - 1] += t_tied
    if cm.execution.lockstep and v == 1:
        # DeepSpeed's TrainSchedule: neighbours in lock step (cost/engines.py)
        T = lockstep_time(f_r, b_r, x_r, m) + float(tail.max())
        bubble = T - float(tail.max()) - m * t_mb
    else:
        T = m * t_mb + bubble + float(tail.max())
    E = budget if budget is not None else cm.cluster.budget_bytes
    return ConfigCost(T, list(peak), bool(np.all(peak <= E)), t_mb, bubble, float(tail.max()))
