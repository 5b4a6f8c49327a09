"""Per-layer, per-strategy memory and time (docs/planner.md §2.2, §2.4, §2.5).

Everything is vectorised over (layer type, strategy): the DP and BMW only index arrays.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from ..spec.cluster import ClusterSpec
from ..spec.model import LayerSpec, ModelSpec
from ..spec.parallel import Parallel
from .collectives import Network
from .compute import Dims, UnitTimes, attention_score_bytes, get_gpu, unit_times
from .engines import UNFUSED_DISPATCH_BYTES, Execution, get_execution, grad_bytes
from .memory import RUNTIMES, local_optimizer_fraction, state_bytes
from . import offload as ofl
from ..spec.parallel import NO_OFFLOAD, Offload

PRECISIONS = ("bf16", "fp16", "fp32")
# router load imbalance: tokens the busiest expert-parallel rank receives over the mean
# [decision: 1.1; auxiliary-loss balanced routing keeps the busiest expert within ~10% of the
# mean after warm-up (Fedus et al. 2022 §2.2 capacity factor 1.0-1.25); 1.0 = perfect balance]
MOE_IMBALANCE = 1.1
ACT_SCALE = {"bf16": 1.0, "fp16": 1.0, "fp32": 2.0}   # activations are specified at 2 bytes


class Strategy(NamedTuple):
    """One intra-stage strategy (a pruned decision tree, §1.3): TP degree, data degree, how
    the data dimension shards model states (ZeRO stage; SDP = 3), level order and CKPT."""
    tp: int
    dp: int
    zero: int = 0
    tp_outer: bool = False   # True: TP is the outer tree level (strided TP groups)
    ckpt: bool = False
    sp: bool = False         # Megatron sequence parallelism (Korthikanti et al. 2022 §4.2.2); needs tp > 1
    sel: bool = False        # selective recompute of the attention core (Korthikanti et al. §5); ckpt wins
    ep: int = 1              # expert parallelism (MoE layers; docs/planner.md §2.7)
    etp: int = 0             # expert tensor parallelism (0: = tp, Megatron's default)
    cp: int = 1              # context parallelism: the sequence split over cp ranks
    cp_comm: str = "p2p"     # p2p: ring attention (Megatron); a2a: Ulysses (DeepSpeed)
    offload: Offload = NO_OFFLOAD   # what the device does not hold (cost/offload.py)

    @classmethod
    def of(cls, par: Parallel, *, ckpt: bool = False, sel: bool = False) -> "Strategy":
        """The intra-stage strategy of a uniform configuration ``par`` (every layer alike)."""
        return cls(tp=par.tp, dp=par.dp, zero=par.zero, ckpt=ckpt, sp=par.sequence_parallel, sel=sel,
                   ep=par.ep, etp=0 if par.etp == par.tp else par.etp, cp=par.cp, cp_comm=par.cp_comm,
                   offload=par.offload)

    @property
    def n(self) -> int:
        """Devices of the stage group: tp * cp * dp."""
        return self.tp * self.dp * self.cp

    @property
    def expert_tp(self) -> int:
        """Tensor-parallel degree of the expert layers (Megatron's default: the dense TP)."""
        return self.etp or self.tp

    @property
    def expert_dp(self) -> int:
        """Expert-data-parallel degree: the stage's ranks regrouped as etp * ep * expert_dp."""
        return self.n // (self.ep * self.expert_tp)

    @property
    def sdp(self) -> bool:
        """True when the data dimension shards parameters too (ZeRO-3 / SDP)."""
        return self.zero == 3

    def label(self) -> str:
        """Short human label, e.g. ``TP4+DP2/Z1+CKPT``."""
        parts = []
        data = (f"SDP{self.dp}" if self.zero == 3 else f"DP{self.dp}" +
                (f"/Z{self.zero}" if self.zero else "")) if self.dp > 1 else ""
        tp = f"TP{self.tp}" if self.tp > 1 else ""
        parts = [tp, data] if self.tp_outer else [data, tp]
        s = "+".join(p for p in parts if p) or "1 device"
        s += (f"+CP{self.cp}" + ("(a2a)" if self.cp_comm == "a2a" else "") if self.cp > 1 else "") + \
            (f"+EP{self.ep}" if self.ep > 1 else "") + (f"/ETP{self.etp}" if self.ep > 1 and self.expert_tp != self.tp else "")
        return s + ("+SP" if self.sp and self.tp > 1 else "") + ("+CKPT" if self.ckpt else
                                                                 "+SEL" if self.sel else "") + \
            (f"+OFF({self.offload.text()})" if self.offload.any else "")

    def tp_stride(self) -> int:
        """Rank distance between members of a TP group (docs/planner.md §1.4)."""
        return self.dp if self.tp_outer else 1

    def dp_stride(self) -> int:
        """Rank distance between members of a data-parallel group (docs/planner.md §1.4)."""
        return 1 if self.tp_outer else self.tp

    def data_index(self) -> np.ndarray:
        """Batch shard held by each local rank of the stage group (§1.4)."""
        r = np.arange(self.tp * self.dp)       # one context-parallel slice of the stage
        return r % self.dp if self.tp_outer else r // self.tp


@dataclass
class LayerTables:
    """Arrays [T, S] for T layer types and S strategies (one stage group, one micro-batch)."""
    strategies: list
    ms: np.ndarray       # O_ms: model states
    f1: np.ndarray       # O_f1: forward stash of one micro-batch
    ob: np.ndarray       # O_b: backward transient (recompute, SDP gathered layer)
    fwd: np.ndarray      # T_fwd
    bwd: np.ndarray      # T_bwd with gradient sync (last micro-batch)
    bwd_ns: np.ndarray   # T_bwd without sync
    wgrad: np.ndarray    # weight-gradient share of bwd_ns (the W of B/W-split schedules)
    p2p: np.ndarray      # send of this layer's output to the next stage (per micro-batch)
    R: np.ndarray        # [T, S, S] re-layout cost before a layer of type T, from s' to s
    allowed: np.ndarray  # [T, S] bool
    kept: np.ndarray = None   # bytes of this layer's output the engine keeps per in-flight
    #                           micro-batch when it ends a pipeline stage (DeepSpeed)
    host: np.ndarray = None   # host bytes per rank of the offloaded states (cost/offload.py)
    host_act: np.ndarray = None   # host bytes of one micro-batch's offloaded activations

    @property
    def c(self) -> np.ndarray:
        """Per unit and strategy: forward + backward time of a micro-batch that synchronises
        gradients."""
        return self.fwd + self.bwd

    @property
    def c_ns(self) -> np.ndarray:
        """Per unit and strategy: forward + backward time of a micro-batch without gradient
        synchronisation."""
        return self.fwd + self.bwd_ns


class CostModel:
    """``runtime``: whose memory accounting holds ('any' = the larger of Megatron's and
    DeepSpeed's, see cost/memory.py).  ``overlap_grad_reduce``: the data-parallel gradient
    reduction (ZeRO 0/1) overlaps the last micro-batch's backward (Galvatron §2.4; Megatron's
    --overlap-grad-reduce).  Default False, what the emitted engines do: DeepSpeed 0.19.8 reduces
    after the backward (the pipeline engine's ReduceGrads instruction follows the last
    BackwardPass; without pipelines ZeRO-0/1 reduce in allreduce_gradients at the boundary, only
    ZeRO-2's per-micro-batch reduce-scatter runs in backward hooks) and the emitted Megatron-LM
    flags do not set --overlap-grad-reduce.  The optimizer step and ZeRO's parameter all-gather
    after it are never hidden.
    ``overlap_tp_comm``: the backward TP all-reduce of the column-parallel input gradient runs
    beside their weight-gradient GEMMs (Megatron since its 2022 releases; False: Megatron-LM 2021).
    ``execution``: the engine's execution model (cost/engines.py; a name or an Execution): what
    it overlaps and serialises; it sets both overlap switches unless they are given."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, precision: str = "bf16",
                 runtime: str = "any", overlap_grad_reduce: bool | None = None,
                 overlap_tp_comm: bool | None = None, execution: "Execution | str | None" = None,
                 moe_imbalance: float = MOE_IMBALANCE, trainable=None):
        from ..spec import SpecError
        from ..spec.trainable import parse_trainable
        if precision not in PRECISIONS:
            raise SpecError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        if runtime not in RUNTIMES:
            raise SpecError(f"runtime must be one of {', '.join(RUNTIMES)}, got {runtime!r}")
        self.model, self.cluster, self.precision = model, cluster, precision
        ex = execution if isinstance(execution, Execution) else get_execution(execution)
        self.execution = ex
        self.runtime = runtime
        self.overlap_grad_reduce = ex.grad_overlap if overlap_grad_reduce is None else overlap_grad_reduce
        self.overlap_tp_comm = ex.tp_overlap if overlap_tp_comm is None else overlap_tp_comm
        self.gpu = get_gpu(cluster.gpu)
        if self.gpu is not None:        # the stack's attention-kernel generation (cost/engines.py)
            self.gpu = self.gpu.with_attention(ex.attention)
        self.dims = Dims.of(model) if self.gpu is not None else None
        self.net = Network(cluster)
        self._rates = ofl.HostRates.of(cluster)        # None: the cluster cannot offload
        self.gamma = cluster.overlap_slowdown
        if not moe_imbalance >= 1.0:
            raise SpecError(f"moe_imbalance must be >= 1 (tokens of the busiest expert rank over "
                            f"the mean), got {moe_imbalance!r}")
        self.moe_imbalance = float(moe_imbalance)
        # unit types: 0 = pre, 1 = post, 2.. distinct blocks
        blocks = model.type_ids
        self.units: list[LayerSpec] = [model.pre, model.post]
        for i, t in enumerate(blocks):
            if t + 2 >= len(self.units):
                self.units.append(model.layers[i])
        self.block_types = np.array([t + 2 for t in blocks], dtype=np.int64)
        shapes = [u.shape for u in self.units if u.shape is not None]
        self.num_experts = max((b.experts for b in shapes), default=0)   # routed, per MoE layer
        self._heads = [(b.heads, b.kv) for b in shapes]
        # frozen parameters (spec/trainable.py): per unit (parameters with any adapters, the
        # trained share of them)
        self.trainable = parse_trainable(trainable)
        self.unit_params = [self.trainable.split(u) for u in self.units]
        self._cache: dict = {}
        self._column_memo: dict = {}
        self._relayout: dict = {}
        self._times: dict = {}

    def ov(self, x, y):
        """Overlap with mutual slowdown gamma: max + (gamma-1)*min (§2.4, §6 #5), of two
        seconds (Python's max/min: numpy's ufuncs cost microseconds on scalars)."""
        return max(x, y) + (self.gamma - 1) * min(x, y)

    def tables(self, strategies: list, B_m: int) -> LayerTables:
        """Memory and time of every unit under each of ``strategies`` for micro-batch size ``B_m``
        (memoised): the arrays the stage DP indexes, a column per strategy (:meth:`_column`)."""
        key = (tuple(strategies), B_m)
        if key in self._cache:
            return self._cache[key]
        T, S = len(self.units), len(strategies)
        arrays = [np.zeros((T, S)) for _ in range(11)]
        allowed = np.ones((T, S), dtype=bool)
        for j, s in enumerate(strategies):
            values, allowed[:, j] = self._column(s, B_m)
            for x, v in zip(arrays, values):
                x[:, j] = v
        ms, f1, ob, fwd, bwd, bwd_ns, wg, p2p, kept, host, host_act = arrays
        R = self._relayout_times(tuple(strategies), B_m, ACT_SCALE[self.precision])
        res = LayerTables(list(strategies), ms, f1, ob, fwd, bwd, bwd_ns, wg, p2p, R, allowed, kept, host,
                          host_act)
        self._cache[key] = res
        return res

    def _column(self, s: Strategy, B_m: int) -> tuple:
        """One strategy's column of :meth:`tables`: (ms, f1, ob, fwd, bwd, bwd_ns, wgrad, p2p, kept,
        host, host_act) per unit and whether each unit may take it, memoised per (strategy,
        micro-batch): the tables of the many strategy lists the search asks for share them."""
        key = (s, B_m)
        if key not in self._column_memo:
            self._column_memo[key] = self._column_of(s, B_m)
        return self._column_memo[key]

    def _column_of(self, s: Strategy, B_m: int) -> tuple:
        cb = 4 if self.precision == "fp32" else 2
        ab = ACT_SCALE[self.precision]
        T = len(self.units)
        ms, f1, ob, fwd, bwd, bwd_ns, wg, p2p, kept, host, host_act = (np.zeros(T) for _ in range(11))
        allowed = np.ones(T, dtype=bool)
        out = ((ms, f1, ob, fwd, bwd, bwd_ns, wg, p2p, kept, host, host_act), allowed)
        net, ex = self.net, self.execution
        gcb = grad_bytes(ex, self.precision, cb)
        t, d, z, cp, ep = s.tp, s.dp, s.zero, s.cp, s.ep
        b = B_m / d
        if B_m % d or not self.admits(s):
            allowed[:] = False
        # a context-parallel rank does the work of b / cp whole samples (compute.block_times)
        bc = b / cp
        # dense parameters are replicated over the dp x cp ranks of a tensor-parallel rank
        # (Megatron's dp-cp group, stride t); routed experts are split ep x etp and
        # replicated over the expert-data-parallel group (stride etp * ep)
        etp = s.expert_tp
        split = ep > 1 or etp != t
        dd, ed = d * cp, s.expert_dp
        pb, gb, obytes = state_bytes(self.precision, z, dd, self.runtime, ex.grad_bytes, ex.master_remainders)
        opt_share = local_optimizer_fraction(z, dd, self.precision, self.runtime)
        pe, ge, oe = state_bytes(self.precision, z, ed, self.runtime, ex.grad_bytes, ex.master_remainders)
        opt_e = local_optimizer_fraction(z, ed, self.precision, self.runtime)
        off = self.offload_terms(s, dd, ed) if s.offload.states else None
        if s.offload.activations and self.offload_refusal(s):
            allowed[:] = False
            return out
        if off is not None:
            if off[0] is None:
                allowed[:] = False
                return out
            (pb, gb, obytes), (pe, ge, oe) = off[0].device, off[1].device
            opt_share, opt_e = off[0].gpu * dd, off[1].gpu * ed
        # sequence parallelism (Korthikanti et al. 2022 §4.2.2): the activations TP keeps
        # replicated (LayerNorm/dropout inputs, residuals), the layer input kept by CKPT and
        # the pipeline send ([s/t, b, h]) are split along the sequence over the t ranks
        q = t if s.sp and t > 1 else 1
        for i, u in enumerate(self.units):
            We = u.expert_params if split else 0.0
            n_u, n_tr = self.unit_params[i]
            tr = n_tr / n_u if n_u else 0.0        # trained share: gradient, master, moments
            W, Wx = (n_u - We) / t, We / (ep * etp)
            sel = s.sel and not s.ckpt and u.checkpointable
            act = (u.act_rep / q + (u.act_tp - (attention_score_bytes(self.dims, u) if sel else 0.0)) / t) * ab
            x = u.boundary * ab / q
            ck = s.ckpt and u.checkpointable
            if s.ckpt and not u.checkpointable:
                allowed[i] = False
            ms[i] = W * (pb + tr * gb + tr * obytes) + Wx * (pe + tr * ge + tr * oe)
            if off is not None:      # the trained parameters' states; frozen 16-bit copies
                host[i] = tr * (W * off[0].host + Wx * off[1].host) + \
                    ((1.0 - tr) * (W + Wx) * cb if s.offload.params else 0.0)
            f1[i] = bc * (x if ck else act)
            k = self.unit_times(u, bc, t, s.sp, ep, etp)
            c_f, c_b, buf = self.parallel_comm(u, s, bc, ab)
            ob[i] = (bc * act if ck else 0.0) + ((W + Wx) * 2 * cb if z == 3 else 0.0) + buf
            # with SP each all-reduce is a reduce-scatter + all-gather of the same tensor
            # (§4.2.2): 2 (t-1)/t X / BW, a ring all-reduce's own two phases, so t_AR stands
            A_tp = u.tp_allreduces * net.all_reduce(bc * u.boundary * ab, t, s.tp_stride()) if t > 1 else 0.0
            g_f, g_b, g_sync, gather = (a + e for a, e in zip(
                self._data_comm(W * cb, W * gcb, dd, s.dp_stride(), z, tr),
                self._data_comm(Wx * cb, Wx * gcb, ed, etp * ep, z, tr)))
            # after the step: ZeRO-1/2 gather the updated parameters (hidden behind the next
            # forward with Megatron's --overlap-param-gather); the Adam step itself streams
            # the rank's optimizer shard through HBM (memory-bound)
            tail = gather + self.step_time(tr * (W * opt_share + Wx * opt_e))
            hide = 0.0
            if off is not None:      # host step, copies and fetches (cost/offload.py)
                (hide, tail_o), (mf, mb) = self._offload_times(off, W, Wx, tail - gather, tr)
                tail, g_f, g_b = gather + tail_o, g_f + mf, g_b + mb
            # a frozen weight's backward computes the input gradient only
            k_comp = k.bwd - (1.0 - tr) * k.wgrad + (k.fwd + c_f if ck else k.attn if sel else 0.0)
            # Megatron overlaps the backward TP all-reduce of the column-parallel input
            # gradient with their weight-gradient GEMMs; CKPT repeats the forward's
            k_tp = (self.ov(A_tp, k.wcol) - k.wcol if k.wcol and self.overlap_tp_comm else A_tp) + \
                (A_tp if ck else 0.0)
            base = self.ov(k_comp, g_b) + k_tp + c_b
            # FSDP prefetches the next layer's all-gather behind this layer's forward
            fwd[i] = (self.ov(k.fwd, g_f) if ex.zero3_prefetch else k.fwd + g_f) + A_tp + c_f
            bwd[i] = (self.ov(k_comp, g_sync + g_b) + k_tp + c_b if self.overlap_grad_reduce
                      else base + g_sync) + tail
            if s.offload.activations and u.kind == "block":
                # a block's kept activations in host memory (docs/offload.md §2-3): the input
                # of a recomputed block (DeepSpeed's cpu_checkpointing), every saved tensor of
                # a kept one (runtime/swap.py); copied out on a side stream beside the
                # forward, back on demand when its backward starts (not hidden)
                moved, f1[i] = f1[i], 0.0
                host_act[i], ob[i] = moved, ob[i] + moved
                t_link = moved / self._rates.link
                fwd[i] += self.ov(k.fwd, t_link) - k.fwd
                bwd[i] += t_link
                base += t_link
            if hide:     # the boundary gradient copy follows each reduction: in backward
                #          hooks with ZeRO-2/3, after the backward with ZeRO-1
                bwd[i] += self.ov(k_comp, g_b + hide) - self.ov(k_comp, g_b) if z >= 2 else hide
            bwd_ns[i] = base
            wg[i] = tr * k.wgrad
            p2p[i] = self.p2p_time(bc * u.boundary * ab, t, q, s)
            # DeepSpeed's PipelineEngine keeps each in-flight micro-batch's stage output
            # (pipe_buffers['outputs'], freed after its backward); Megatron-LM frees it
            # once sent (deallocate_pipeline_outputs, set by its training arguments)
            kept[i] = bc * u.boundary * ab if self.runtime != "megatron" else 0.0
        return out

    def offload_engines(self, zero: int, off: Offload = NO_OFFLOAD) -> tuple:
        """The engines whose offloading ``off`` at ZeRO stage ``zero`` must fit: the runtime's,
        or for 'any' both where both run the stage (ZeRO-1), DeepSpeed's above it and for an
        activation offload (DeepSpeed's alone: docs/offload.md §2)."""
        if self.runtime != "any":
            return (self.runtime,)
        return ofl.ENGINES if zero == 1 and not off.activations else ("deepspeed",)

    def offload_refusal(self, s: Strategy, pp: int = 1) -> str | None:
        """Why strategy ``s`` (in a pipeline of ``pp`` stages) cannot offload here: the
        cluster's missing host figures or the engine that cannot run it (None: it can)."""
        if not s.offload.any:
            return None
        missing = self.cluster.offload_missing(nvme=s.offload.device == "nvme")
        if missing:
            return (f"cluster {self.cluster.name!r} has no host figures to offload with "
                    f"(missing {', '.join(missing)}; `ds-autoplan profile --hardware` measures them)")
        for e in self.offload_engines(s.zero, s.offload):
            why = ofl.check(e, s.zero, s.offload, pp)
            if why:
                return f"{e}: {why}"
        return None

    def offload_terms(self, s: Strategy, dd: int, ed: int):
        """(dense, expert) :class:`~cost.offload.OffloadTerms` of strategy ``s`` over the
        data groups ``dd`` / ``ed``: the larger of the engines' (:meth:`offload_engines`);
        (None, None) where the cluster lacks host figures or an engine cannot run it."""
        if self.offload_refusal(s):
            return None, None
        eng = self.offload_engines(s.zero, s.offload)
        gbytes = self.execution.grad_bytes
        out = []
        for d in (dd, ed):
            ts = [ofl.terms(e, self.precision, s.zero, d, s.offload, gbytes) for e in eng]
            out.append(max(ts, key=lambda t: sum(t.device)) if len(ts) > 1 else ts[0])
            if len(ts) > 1:     # memory of the larger, host and transfers of the heavier
                other = ts[0] if out[-1] is ts[1] else ts[1]
                out[-1] = ofl.OffloadTerms(**{**out[-1].__dict__, **{
                    k: max(getattr(out[-1], k), getattr(other, k)) for k in
                    ("host", "d2h", "d2h_step", "h2d", "accum", "fetch")},
                    "concurrent": False, "overlap_copies": False, "torch_cpu": True})
        return tuple(out)

    def _offload_times(self, off, W: float, Wx: float, gpu_step: float, tr: float = 1.0):
        """((seconds beside the last backward, seconds after it), (forward, backward seconds per
        micro-batch)) of the offload ``off`` (dense, expert terms) for ``W`` dense and ``Wx``
        expert parameters on a rank, of which the share ``tr`` trains (the step, its copies and
        the gradient accumulation round trip see those; fetches all); ``gpu_step``: the device's
        share of the step."""
        hide = after = mf = mb = 0.0
        for t, n in zip(off, (W, Wx)):
            if n <= 0:
                continue
            h, a = ofl.step_times(t, tr * n, self._rates, gpu_step * n / (W + Wx)) if tr > 0 else (0.0, 0.0)
            f, b = ofl.microbatch_times(t, n, self._rates, tr * n)
            hide, after, mf, mb = hide + h, after + a, mf + f, mb + b
        return (hide, after), (mf, mb)

    def model_state_bytes(self, s: Strategy) -> tuple[float, float, float]:
        """(parameter, gradient, optimizer) bytes one rank of strategy ``s`` holds for the
        whole model (every unit once, no pipeline): frozen parameters count their parameter
        bytes only (spec/trainable.py)."""
        pb, gb, ob = state_bytes(self.precision, s.zero, s.dp * s.cp, self.runtime,
                                 self.execution.grad_bytes, self.execution.master_remainders)
        units = [self.units[0], *(self.units[t] for t in self.block_types), self.units[1]]
        n = [self.trainable.split(u) for u in units]
        total, train = sum(a for a, _ in n) / s.tp, sum(b for _, b in n) / s.tp
        return total * pb, train * gb, train * ob

    def _data_comm(self, X: float, Xg: float, d: int, stride: int, z: int, tr: float = 1.0) -> tuple:
        """(forward all-gather, backward collectives, gradient sync, post-step all-gather)
        seconds of parameters of ``X`` bytes (gradients ``Xg``) replicated over a data group of
        ``d`` ranks spaced ``stride`` apart, at ZeRO stage ``z``, of which the share ``tr``
        trains (only it has gradients and is updated; ZeRO-3 gathers all)."""
        net, ex = self.net, self.execution
        if d <= 1 or X <= 0:
            return 0.0, 0.0, 0.0, 0.0
        Xg, Xu = Xg * tr, X * tr
        g_f = net.all_gather(X, d, stride) if z == 3 else 0.0
        rs = net.reduce_scatter(Xg, d, stride) if Xg > 0 else 0.0
        g_b = (net.all_gather(X, d, stride) + rs) if z == 3 else (rs if z == 2 else 0.0)
        ar = net.all_reduce(Xg, d, stride) if Xg > 0 else 0.0
        g_sync = {0: ar, 1: ar if ex.full_allreduce else rs, 2: 0.0, 3: 0.0}[z]
        gather = net.all_gather(Xu, d, stride) if z in (1, 2) and not ex.param_gather_overlap and Xu > 0 else 0.0
        return g_f, g_b, g_sync, gather

    def admits(self, s: Strategy) -> bool:
        """Expert and context parallelism the model can take: ep divides the routed experts
        (dense models: ep = 1, etp = tp); cp on decoder-only models with the sequence a
        multiple of 2 cp (Megatron's causal load balancing); Ulysses (a2a) with the query and
        key/value heads divisible by tp * cp (Jacobs et al. 2023 §3.1)."""
        E = self.num_experts
        if E > 1 and (s.ep < 1 or E % s.ep) or E <= 1 and (s.ep > 1 or s.expert_tp != s.tp):
            return False
        if s.n % (s.ep * s.expert_tp):
            return False
        if s.cp > 1:
            if self.model.arch not in ("gpt", "llama") or self.model.seq_len % (2 * s.cp):
                return False
            g = s.tp * s.cp
            if s.cp_comm == "a2a" and any(q % g or kv % g for q, kv in self._heads):
                return False
        return True

    def parallel_comm(self, u: LayerSpec, s: Strategy, bc: float, ab: float) -> tuple:
        """(forward, backward, transient buffer bytes) of unit ``u``'s expert and context
        parallel communication for ``bc`` samples' worth of work per rank.

        Experts (Megatron's alltoall dispatcher): each MoE layer dispatches and combines the
        rank's token copies (T topk / t tokens of h, the busiest rank ``moe_imbalance`` times
        the mean) by all-to-all over the ep ranks spaced etp apart, forward and backward; with
        etp > 1 the received tokens are all-gathered / reduce-scattered over the etp ranks.
        Context (ring attention, Megatron's --cp-comm-type p2p): cp - 1 ring steps pass the
        K, V blocks forward (K, V and their gradients backward), overlapped with the attention
        kernels; Ulysses (a2a): Q, K, V to head sharding and the output back, forward and
        backward, not overlapped.  Buffers: the all-to-all send/receive tensors, the ring's
        two receive blocks."""
        if u.kind != "block" or (s.ep == 1 and s.cp == 1):
            return 0.0, 0.0, 0.0
        net, t, cp = self.net, s.tp, s.cp
        f = b = buf = 0.0
        tok = bc * u.boundary * ab             # the rank's token tensor [T, h], 2-byte elements
        blk = u.shape
        if u.expert_params and s.ep > 1:
            X = tok * blk.topk / t * self.moe_imbalance
            etp = s.expert_tp
            a2a = 2 * net.all_to_all(X, s.ep, etp)
            if etp > 1:
                a2a += 2 * net.all_gather(X * etp, etp, 1)
            f, b, buf = f + a2a, b + a2a, buf + 2 * X
        if cp > 1 and blk is not None:
            kv = tok * blk.kv * (blk.qk_dim + blk.v_dim) / blk.h / t      # K and V of the rank's tokens
            k = self.unit_times(u, bc, t, s.sp, s.ep, s.expert_tp)
            if s.cp_comm == "p2p":
                attn_b = k.attn * (k.bwd / k.fwd if k.fwd else 2.0)
                cf = (cp - 1) * net.ring_step(kv, cp, t)
                cb_ = (cp - 1) * net.ring_step(2 * kv, cp, t)
                f += self.ov(k.attn, cf) - k.attn
                b += self.ov(attn_b, cb_) - attn_b
                buf += 2 * kv
            else:
                qkv, out = tok / t + kv, tok / t
                a2a = net.all_to_all(qkv, cp, t) + net.all_to_all(out, cp, t)
                f, b, buf = f + a2a, b + a2a, buf + qkv + out
        return f, b, buf

    def _relayout_times(self, strategies: tuple, B_m: int, ab: float) -> np.ndarray:
        """R[type, s', s]: re-layout before each layer type (§2.5), activations only: an
        all-gather of ``frac`` of the micro-batch's boundary tensor over ``g`` ranks."""
        if strategies not in self._relayout:     # what does not depend on the micro-batch
            n = len(strategies)
            shapes = [self.relayout_shape(sp, s) for sp in strategies for s in strategies]
            # reshaped: an empty strategy list (a pipeline depth no allowed layout fits) is (0, 0)
            frac = np.array([f for f, _ in shapes], dtype=float).reshape(n, n)
            g = np.array([g for _, g in shapes], dtype=int).reshape(n, n)
            a, c = np.nonzero(g > 1)
            g, frac = g[a, c], frac[a, c]
            bw, lat = np.array([self.net.link(int(x), 1) for x in g]).T if len(a) else (None, None)
            self._relayout[strategies] = a, c, g, frac, bw, lat
        a, c, g, frac, bw, lat = self._relayout[strategies]
        R = np.zeros((len(self.units), len(strategies), len(strategies)))
        if len(a):
            for i, u in enumerate(self.units):
                R[i, a, c] = (g - 1) / g * B_m * u.boundary * ab * frac / bw + lat
        return R

    def unit_times(self, u: LayerSpec, b: float, t: int, sp: bool, ep: int = 1,
                   etp: int | None = None) -> UnitTimes:
        """Compute seconds of unit ``u`` for ``b`` samples at TP ``t`` (experts at ``ep`` x
        ``etp``): from the work's shape on a known GPU kind (cost/compute.py); otherwise
        (profiled models, GPU kinds without data) FLOPs at the cluster's constant rate with a
        2x backward (docs/planner.md §2.1).  Memoised: strategies that differ only in
        ZeRO stage or recompute share the kernels."""
        etp = t if etp is None else etp
        key = (u, b, t, sp, ep, etp) if u.expert_params else (u, b, t, sp)
        if key not in self._times:
            self._times[key] = self._unit_times(u, b, t, sp, ep, etp)
        return self._times[key]

    def _unit_times(self, u: LayerSpec, b: float, t: int, sp: bool, ep: int = 1,
                    etp: int | None = None) -> UnitTimes:
        if self.dims is not None:
            k = unit_times(self.gpu, self.dims, u, b, t, sp, ep, etp, self.moe_imbalance)
            if k is not None and u.expert_params and self.execution.moe_dispatch == "unfused":
                # the stack's unfused token dispatch (cost/engines.py): every rank re-lays,
                # permutes and unpermutes the TP group's b s topk token copies of h/t elements;
                # a third forward, two thirds backward [decision]
                d = self.gpu.stream(UNFUSED_DISPATCH_BYTES * b * u.shape.s * u.shape.topk * u.shape.h / t)
                k = k._replace(fwd=k.fwd + d / 3, bwd=k.bwd + 2 * d / 3)
            if k is not None:
                return k if self.cluster.compute_scale == 1.0 else \
                    UnitTimes(*(x / self.cluster.compute_scale for x in k))
            F = b * u.flops / (t * self.gpu.mamf_tflops * self.gpu.sustained * self.cluster.compute_scale * 1e12)
        else:
            F = b * u.flops / (t * self.cluster.flops * self.cluster.compute_scale)
        return UnitTimes(F, 2 * F, F, 0.0)

    def p2p_time(self, X: float, t: int, q: int, s: Strategy) -> float:
        """Send of one micro-batch's boundary tensor (X bytes unsplit) to the next stage.  With
        SP each TP rank holds and sends X/t.  Without it, Megatron's scatter/gather (Narayanan et
        al. 2021 §4.1) sends X/t per rank and all-gathers it over NVLink on arrival; DeepSpeed's
        pipeline engine sends the whole X from every TP rank ('any' keeps that bound)."""
        split = self.runtime == "megatron" if self.execution.p2p_split is None else self.execution.p2p_split
        if q > 1 or t == 1 or not split:
            return self.net.p2p(X / q, s.n)
        return self.net.p2p(X / t, s.n) + self.net.all_gather(X, t, s.tp_stride())

    def step_time(self, n_params: float) -> float:
        """Adam step over ``n_params`` locally updated parameters: HBM-bound (0 where the
        cluster names no GPU kind with a memory bandwidth)."""
        return self.gpu.stream(n_params * self.execution.step_bytes(self.precision)) if self.gpu else 0.0

    @staticmethod
    def relayout_shape(sp: Strategy, s: Strategy) -> tuple[float, int]:
        """R(l, s', s) of §2.5 as (fraction of the micro-batch tensor X gathered, group size):
        containment is checked on the rank mapping of §1.4; (0, 1) = free."""
        return _relayout_shape(Strategy(sp.tp, sp.dp, tp_outer=sp.tp_outer),
                               Strategy(s.tp, s.dp, tp_outer=s.tp_outer))

    def relayout(self, X: float, sp: Strategy, s: Strategy) -> float:
        """Seconds to re-lay a boundary tensor of ``X`` bytes from strategy ``sp`` to ``s``
        (docs/planner.md §2.5)."""
        frac, g = self.relayout_shape(sp, s)
        return self.net.all_gather(X * frac, g, 1)


@lru_cache(maxsize=None)
def _relayout_shape(sp: Strategy, s: Strategy) -> tuple[float, int]:
    """:meth:`CostModel.relayout_shape` of two layouts (TP, data degree, level order)."""
    if (sp.tp, sp.dp, sp.tp_outer) == (s.tp, s.dp, s.tp_outer) or sp.n != s.n:
        return 0.0, 1
    d0, d1 = sp.dp, s.dp
    i0, i1 = sp.data_index(), s.data_index()
    if d1 > d0 and np.all(i1 * d0 // d1 == i0):        # slice forward, gather backward
        return 1.0 / d0, d1 // d0
    if d1 < d0 and np.all(i0 * d1 // d0 == i1):        # gather forward, slice backward
        return 1.0 / d1, d0 // d1
    if d1 == d0 and np.all(i0 == i1):
        return 0.0, 1
    return 1.0, s.n
