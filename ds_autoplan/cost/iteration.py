"""Closed-form cost of one uniform configuration (every layer the same TP/DP/ZeRO/recompute),
for configurations the search cannot express yet (any pipeline degree, interleaving with v
chunks per rank, selective recompute) and for checking a plan's memory independently of the
simulator.  Same per-layer tables as the search (CostModel.tables).

Time (Narayanan et al. 2021 §2.2): the busiest rank's forward+backward per micro-batch t_mb,
m micro-batches plus a bubble of (p-1)/v micro-batch times (§2.2.2: interleaving with v chunks
divides the bubble by v), then the busiest rank's non-overlapped tail (gradient reduction,
optimizer step, ZeRO parameter gather).
Memory: model states + the in-flight micro-batches' stashes + the largest backward transient.
The stashes are counted per stage along the rank's own action order (the same builders the
planner simulates): 1F1B rank r holds min(p - r, m) micro-batches (§2.2.1), Megatron's
interleaved schedule 2(p - r - 1) + (v - 1) p + 1 chunk micro-batches (its warm-up count + 1),
but not of every chunk alike: the last rank runs the last chunk's backward right after its
forward, so the head's logits are held for one micro-batch, not for the rank's average.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from ..spec.model import tied_embeddings
from ..schedule import Kind, build
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
    host: float = 0.0                              # host bytes of the busiest node (offload)


def split_layers(L: int, S: int, embedding: bool = False, loss: bool = False) -> list[int]:
    """L blocks into S chunks as evenly as possible (the later chunks take the remainder, as
    the first carries the embedding and the last the head).  ``embedding`` / ``loss``: the
    embedding (the head and loss) counts as one block of the first (last) chunk, as
    Megatron's --account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split
    split them (Llama 3 §3.3.2: one layer fewer on the first and the last stage)."""
    q, r = divmod(L + embedding + loss, S)
    out = [q + (1 if i >= S - r else 0) for i in range(S)]
    out[0] -= embedding
    out[-1] -= loss
    return out


@lru_cache(maxsize=256)
def stash_orders(pp: int, m: int, v: int) -> tuple:
    """Per pipeline rank, the stash events of Megatron's schedule in the rank's order, as two
    arrays (stages, signs: +1 | -1): 1F1B (v = 1) or interleaved with v chunks (stage = chunk *
    pp + rank); a forward stashes its stage's activations, the (fused) backward frees them."""
    sched = build("1f1b", pp, m) if v == 1 else build("interleaved", pp, m, v=v)
    out = []
    for rank in sched.ranks:
        ev = [(a.stage, 1.0 if a.kind == Kind.F else -1.0) for a in rank if a.kind in (Kind.F, Kind.BW)]
        stages, signs = np.array([e[0] for e in ev], dtype=np.intp), np.array([e[1] for e in ev])
        stages.flags.writeable = signs.flags.writeable = False      # shared by the cache
        out.append((stages, signs))
    return tuple(out)


def stash_peaks(pp: int, m: int, v: int, act) -> np.ndarray:
    """Per rank, the largest sum of stashed activations over its action order, ``act[s]``
    bytes per micro-batch of stage ``s`` (a running sum in the rank's order: np.cumsum adds
    left to right, as a loop would)."""
    if pp == 1:
        return np.array([float(np.sum(act))])
    act = np.asarray(act, dtype=float)
    return np.array([float(np.cumsum(signs * act[stages]).max(initial=0.0))
                     for stages, signs in stash_orders(pp, m, v)])


def config_cost(cm: CostModel, cfg: Config, budget: float | None = None,
                layout: list[int] | None = None) -> ConfigCost:
    """Iteration seconds and per-rank peak bytes of ``cfg`` under ``cm``.  ``layout``: blocks
    per stage in Megatron's (chunk, rank) order, pp * chunks entries (its
    --pipeline-model-parallel-layout; a stage may hold only the embedding or only the head);
    default :func:`split_layers`."""
    s = cfg.strategy()
    why = cm.offload_refusal(s, cfg.pp)
    if why:
        from ..spec import SpecError
        raise SpecError(f"offload {cfg.offload.text()} with ZeRO-{cfg.zero}: {why}")
    B_m = cfg.batch_per_microbatch
    tab = cm.tables([s], B_m)
    seq = np.concatenate([[0], cm.block_types, [1]])
    v, P, m = cfg.chunks, cfg.pp, cfg.num_microbatches
    S = P * v
    L = len(cm.block_types)
    nblk = split_layers(L, S) if layout is None else [int(n) for n in layout]
    if len(nblk) != S or sum(nblk) != L or min(nblk) < 0 or 0 in nblk[1:-1]:
        from ..spec import SpecError
        raise SpecError(f"layer layout {nblk} must give {S} stages (pp {P} x chunks {v}) "
                        f"{L} blocks in all, a block in every stage between the first and the last")
    col = lambda a: a[seq, 0]   # noqa: E731
    fwd, bwd_ns, sync, f1, ob, ms, p2p, kept, hb, ha = (
        col(tab.fwd), col(tab.bwd_ns), col(tab.bwd - tab.bwd_ns), col(tab.f1), col(tab.ob), col(tab.ms),
        col(tab.p2p), col(tab.kept), col(tab.host), col(tab.host_act))
    work, tail, peak = np.zeros(P), np.zeros(P), np.zeros(P)
    f_r, b_r, x_r = np.zeros(P), np.zeros(P), np.zeros(P)
    act, trans, host, host_act = np.zeros(S), np.zeros(P), np.zeros(P), np.zeros(P)
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
        host[r] += hb[sl].sum()
        host_act[r] += ha[sl].sum()          # activations in host memory: pp = 1, one micro-batch
        act[c] = f1[sl].sum() + (kept[hi - 1] if c < S - 1 else 0.0)   # + the output kept
        trans[r] = max(trans[r], float(ob[sl].max()))
        lo = hi
    peak += stash_peaks(P, m, v, act) + trans
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
    fits = bool(np.all(peak <= E))
    node_host = 0.0
    if cfg.offload.any:
        from .offload import host_budget_bytes, host_cap, node_host_bytes
        if cfg.offload.device == "nvme":      # the states on the node's NVMe (cost/offload.py)
            from ..spec.cluster import GB
            fits = fits and node_host_bytes(host, cfg.stage_ranks, cm.cluster) <= (cm.cluster.nvme_gb or 0.0) * GB
        host = np.minimum(host, host_cap(cfg.offload, 4.0 if cm.precision == "fp32" else 2.0)) + host_act
        node_host = node_host_bytes(host, cfg.stage_ranks, cm.cluster)
        fits = fits and node_host <= host_budget_bytes(cm.cluster)
    return ConfigCost(T, list(peak), fits, t_mb, bubble, float(tail.max()), node_host)
