"""Compute time from the work's shape, per GPU kind.

A block's forward and backward are costed kernel by kernel on the TP-split shapes the engines
run (Megatron's column/row-parallel linears, Narayanan et al. 2021 §2.3; sequence parallelism
shards the norm/dropout work, Korthikanti et al. 2022 §4.2.2):

* GEMMs: tile and wave quantisation of the output over the GPU's SMs (NVIDIA Deep Learning
  Performance Guide, "Matrix Multiplication Background"), at the measured maximum achievable
  matmul rate, bounded below by the HBM traffic of the operands (roofline);
* attention scores without flash attention: batched GEMMs over heads (same model) plus the
  softmax/dropout traffic on the [s, s] scores; with flash attention: a fused kernel at the
  GPU's published FlashAttention-2 fraction of peak;
* norms, bias-GeLU/SwiGLU, bias-dropout-add: HBM traffic at the GPU's streaming bandwidth.

One model per GPU kind (``ds_autoplan/data/gpus.yaml``); nothing is fitted per run.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import NamedTuple

from ..spec.cluster import check_gpu, gpu_table

# backward traffic of a bandwidth-bound kernel over its forward's: it reads the saved input(s)
# and the output gradient and writes the input gradient (norm, GeLU, softmax: 3 tensors where
# the forward moved 2; dropout-add: 2 where the forward moved 2-3) [decision]
BWD_TRAFFIC = 1.5


@dataclass(frozen=True)
class GPU:
    """One GPU kind of ``data/gpus.yaml``: dense bf16 peak, measured maximum achievable matmul rate
    (MAMF) and the share of it a training step sustains (the one figure calibrated per kind),
    SMs and GEMM tile, HBM bandwidth and its streaming efficiency, flash-attention rates."""
    name: str
    peak_tflops: float
    mamf_tflops: float
    sustained: float
    sms: int
    tile: tuple
    hbm_GBps: float
    stream_eff: float
    flash_eff: float
    flash_seq: tuple = ()     # ((s, TFLOP/s), ...): measured causal fwd+bwd flash throughput by length
    flash_fwd_seq: tuple = ()  # the same for the forward alone
    attention: str = ""       # the attention-kernel generation the flash figures above are of
    kernels: tuple = ()       # ((name, flash_eff, flash_seq, flash_fwd_seq), ...): other generations

    def with_attention(self, name: str | None) -> "GPU":
        """This kind with the flash-attention figures of kernel generation ``name`` ('fa1',
        'fa2', 'cudnn': data/gpus.yaml ``attention_kernels``; None: the kind's default)."""
        if not name or name == self.attention:
            return self
        for n, eff, seq, fwd in self.kernels:
            if n == name:
                return replace(self, attention=n, flash_eff=eff, flash_seq=seq, flash_fwd_seq=fwd)
        from ..spec import SpecError
        known = ", ".join([self.attention] + [k[0] for k in self.kernels])
        raise SpecError(f"no attention-kernel figures for {name!r} on {self.name}; known: {known}")

    def gemm(self, M: float, N: float, K: float, batch: float = 1) -> float:
        """Seconds of a [M, K] x [K, N] GEMM (``batch`` of them): whole waves of output tiles
        at the per-SM share of the sustained matmul rate, or the operands' HBM traffic."""
        if min(M, N, K, batch) <= 0:
            return 0.0
        per_sm = self.mamf_tflops * self.sustained * 1e12 / self.sms
        tm, tn = self.tile
        waves = min(math.ceil(math.ceil(M / a) * math.ceil(N / b) * batch / self.sms)
                    for a, b in ((tm, tn), (tn, tm)))
        t_c = waves * 2.0 * tm * tn * K / per_sm
        return max(t_c, self.stream(2.0 * batch * (M * K + K * N + M * N)))

    def stream(self, nbytes: float) -> float:
        """Seconds of a bandwidth-bound kernel moving ``nbytes`` through HBM."""
        return nbytes / (self.hbm_GBps * 1e9 * self.stream_eff)

    def fused_attention(self, flops: float, s: int | None = None, part: str = "both") -> float:
        """Seconds of a flash-attention kernel's forward (``flops``, counted on the full,
        non-causal score matrix) and/or its backward (2.5x those FLOPs, FA-2's count):
        ``part`` 'fwd', 'bwd' or 'both'.  Where the kind has measured tables by sequence
        length (causal kernels, FA2 FLOP convention: half the full count; interpolated in
        log s, clamped at the ends), the forward runs at the forward table's rate and the
        backward takes what the forward+backward table leaves; else ``flash_eff`` of peak."""
        if not (self.flash_seq and s):
            return {"fwd": 1.0, "bwd": 2.5, "both": 3.5}[part] * flops / (self.peak_tflops * 1e12 * self.flash_eff)
        both = 3.5 * flops / 2 / (_interp_log(self.flash_seq, s) * 1e12)
        fwd = flops / 2 / (_interp_log(self.flash_fwd_seq, s) * 1e12) if self.flash_fwd_seq else both / 3.5
        return {"fwd": fwd, "bwd": both - fwd, "both": both}[part]


def _interp_log(table: tuple, s: int) -> float:
    """``table`` ((x, y), ...) sorted by x, at ``s``: linear in log x, clamped at the ends."""
    xs = [math.log(a) for a, _ in table]
    ys = [b for _, b in table]
    x = min(max(math.log(s), xs[0]), xs[-1])
    i = max(j for j in range(len(xs)) if xs[j] <= x)
    if i == len(xs) - 1:
        return ys[i]
    return ys[i] + (ys[i + 1] - ys[i]) * (x - xs[i]) / (xs[i + 1] - xs[i])


def _table(v: dict, key: str, scale: float = 1.0) -> tuple:
    return tuple(sorted((int(a), scale * float(b)) for a, b in (v.get(key) or {}).items()))


def _kernels(v: dict) -> tuple:
    """The kind's other attention-kernel generations (data/gpus.yaml ``attention_kernels``): each
    either its own measured tables or ``scale`` x the default generation's figures."""
    out = []
    for name, k in (v.get("attention_kernels") or {}).items():
        f = float(k.get("scale", 1.0))
        src = v if "scale" in k else k
        out.append((name, f * float(src.get("flash_eff", v["flash_eff"])),
                    _table(src, "flash_tflops_by_seq", f), _table(src, "flash_fwd_tflops_by_seq", f)))
    return tuple(out)


@lru_cache(maxsize=None)
def gpu_kinds(calibrated: bool = True) -> dict:
    """The GPU kinds of data/gpus.yaml; ``calibrated``: with the per-kind ``sustained`` that
    bench/published_runs.py fitted on the published runs of that kind (data/calibration.json),
    where it has one; else the per-kind prior of gpus.yaml."""
    data = gpu_table()
    cal = calibration()["sustained"] if calibrated else {}
    return {k: GPU(k, float(v["peak_tflops"]), float(v["mamf_tflops"]), float(cal.get(k, v["sustained"])),
                   int(v["sms"]), tuple(int(x) for x in v["tile"]), float(v["hbm_GBps"]),
                   float(v["stream_eff"]), float(v["flash_eff"]), _table(v, "flash_tflops_by_seq"),
                   _table(v, "flash_fwd_tflops_by_seq"), str(v.get("attention", "")), _kernels(v))
            for k, v in data.items()}


@lru_cache(maxsize=None)
def calibration() -> dict:
    """data/calibration.json, written by ``bench/published_runs.py --write``: the per-kind
    ``sustained`` fitted on published runs and the cross-validated error bands."""
    import json
    from pathlib import Path
    p = Path(__file__).resolve().parents[1] / "data" / "calibration.json"
    if not p.is_file():
        return {"sustained": {}, "bands": {}}
    return json.loads(p.read_text())


def get_gpu(name: str | None, calibrated: bool = True) -> GPU | None:
    """The :class:`GPU` of kind ``name`` (calibrated on published runs, or the prior), None for no
    name; an unknown kind is refused."""
    if not name:
        return None
    check_gpu(name)
    return gpu_kinds(calibrated)[name]


class UnitTimes(NamedTuple):
    """Seconds of one unit for one micro-batch on one device."""
    fwd: float        # forward compute
    bwd: float        # backward compute (input and weight gradients)
    wgrad: float      # weight-gradient share of bwd (the W of B/W-split schedules)
    attn: float       # forward of the attention core alone (what selective recompute replays)
    wcol: float = 0.0  # weight gradients of the column-parallel linears: Megatron overlaps the
                       # backward TP all-reduce (or SP reduce-scatter) of their input gradient with it


@dataclass(frozen=True)
class Dims:
    """The shapes of a built model that the kernels see."""
    arch: str
    s: int
    h: int
    heads: int
    kv: int
    f: int
    vocab: int
    gated: bool
    flash: bool
    dropout: bool
    dec_s: int

    @classmethod
    def of(cls, model) -> "Dims | None":
        """The shapes of ``model`` (a :class:`~ds_autoplan.spec.ModelSpec`), or None for a profiled
        model whose measured times stand."""
        c = model.config
        if "num_layers" not in c:           # a profiled model: its measured times stand
            return None
        arch, h = model.arch, model.hidden
        return cls(arch, model.seq_len, h, model.heads, int(c.get("kv_heads", model.heads)),
                   int(c.get("ffn", 4 * h)), model.vocab, arch == "llama",
                   bool(c.get("flash_attention", arch in ("gpt", "llama"))),
                   bool(c.get("dropout", arch != "llama")), int(c.get("dec_seq_len", model.seq_len)))


def _linears(g: GPU, lin: list) -> tuple[float, float, float]:
    """(forward, backward, weight-gradient) seconds of ``n`` Y[M,N] = X[M,K] W[K,N] GEMMs per
    item (M, N, K[, n]): the backward is dX = dY W^T ([M,K] from N) and dW = X^T dY ([K,N]
    from M)."""
    lin = [(*x, 1)[:4] for x in lin]
    f = sum(g.gemm(M, N, K, n) for M, N, K, n in lin)
    dx = sum(g.gemm(M, K, N, n) for M, N, K, n in lin)
    dw = sum(g.gemm(K, N, M, n) for M, N, K, n in lin)
    return f, dx + dw, dw


def _attention_core(g: GPU, blk, b: float, t: int, s: int, skv: int, pairs: float) -> tuple[float, float]:
    """(forward, backward) seconds of softmax(Q K^T) V over the b*heads/t local heads, Q/K of
    head size ``qk_dim``, V of ``v_dim``, on ``skv`` keys; ``pairs``: the query-key pairs the
    fused kernel works on, counted like the full s x skv matrix (BlockShape.attention_pairs:
    a sliding window's band), its rate taken at ``skv`` keys."""
    nh = b * blk.heads / t
    dq, dv = blk.qk_dim, blk.v_dim
    if blk.flash:                  # fused kernel; its backward redoes QK^T (FA-2: 2.5x the flops)
        fl = 2.0 * nh * pairs * (dq + dv)
        return g.fused_attention(fl, skv, "fwd"), g.fused_attention(fl, skv, "bwd")
    mm = g.gemm(s, skv, dq, nh) + g.gemm(s, dv, skv, nh)
    # scale+mask+softmax (read and write the scores) and dropout (read, write, 1-byte mask)
    sm = g.stream(nh * s * skv * (4 + (5 if blk.dropout else 0)))
    return mm + sm, 2 * mm + BWD_TRAFFIC * sm


def _mlp_linears(blk, T: float, t: int, ep: int = 1, etp: int | None = None,
                 imb: float = 1.0) -> tuple[list, list, float]:
    """(GEMMs [M, N, K, batch], the column-parallel ones, MLP width per token) of the block's
    MLP at TP ``t``.  Experts run as a grouped GEMM (Megatron's --moe-grouped-gemm), one per
    local expert: the stage's T*k token copies per TP group spread over its ranks, so a rank
    holds E/ep experts of width f/etp (expert TP, default = TP) on T*k*etp/t rows, the busiest
    expert-parallel rank ``imb`` times the mean (router imbalance; ep = 1: every expert on
    every rank, no imbalance between ranks); shared experts as a dense MLP on every token; the
    router as a replicated [h, E] linear."""
    up = 2 if blk.gated else 1
    lin, col = [], []
    if blk.experts:
        etp = t if etp is None else etp
        n = blk.experts // ep
        Te, E, fe = T * blk.topk * etp / t * (imb if ep > 1 else 1.0) / n, blk.experts, blk.expert_ffn
        col.append((Te, up * fe / etp, blk.h, n))
        lin += [col[-1], (Te, blk.h, fe / etp, n), (T, E, blk.h, 1)]
        if blk.shared_ffn:
            col.append((T, up * blk.shared_ffn / t, blk.h, 1))
            lin += [col[-1], (T, blk.h, blk.shared_ffn / t, 1)]
    else:
        col.append((T, up * blk.ffn / t, blk.h, 1))
        lin += [col[-1], (T, blk.h, blk.ffn / t, 1)]
    return lin, col, blk.active_ffn() / t


def block_times(g: GPU, blk, b: float, t: int, sp: bool, ep: int = 1, etp: int | None = None,
                imb: float = 1.0) -> UnitTimes:
    """One transformer block (a :class:`~ds_autoplan.spec.blocks.BlockShape`) for ``b`` samples
    per device at TP degree ``t``, its experts at expert parallelism ``ep`` and expert TP
    ``etp`` (:func:`_mlp_linears`).  Context parallelism needs nothing here: a CP rank's
    linears see b s / cp tokens and its attention (s/cp queries over s keys, causal chunks
    balanced) the work of b / cp whole samples, so the cost model passes b / cp."""
    s, h = blk.s, blk.h
    T = b * s
    q = t if sp and t > 1 else 1
    lin, col = [], []
    for i, o, how in blk.attn_linears():
        lin.append({"col": (T, o / t, i, 1), "row": (T, o, i / t, 1), "rep": (T, o, i, 1)}[how])
        if how == "col":
            col.append(lin[-1])
    mlin, mcol, fa = _mlp_linears(blk, T, t, ep, etp, imb)
    lin, col = lin + mlin, col + mcol
    n_norm, n_res = blk.norms, 2
    attn_f, attn_b = _attention_core(g, blk, b, t, s, blk.skv if blk.flash else s, blk.attention_pairs())
    if blk.cross_s:                # cross-attention over the encoder output
        Tc = b * blk.cross_s
        cross = [(T, h / t, h, 1), (Tc, 2 * h / t, h, 1), (T, h, h / t, 1)]
        lin += cross
        col += cross[:2]
        cf, cb = _attention_core(g, blk, b, t, s, blk.cross_s, s * blk.cross_s)
        attn_f, attn_b = attn_f + cf, attn_b + cb
        n_norm, n_res = n_norm + 1, 3
    lf, lb, lw = _linears(g, lin)
    wcol = sum(g.gemm(K, N, M, n) for M, N, K, n in col)
    # elementwise traffic per token, 2-byte activations: norm reads+writes h; bias-dropout-add
    # reads 2h, writes h (+ a 1-byte mask); the activation reads its input(s) and writes f/t;
    # QK-norm reads and writes Q and K; experts: tokens permuted to their experts and back
    res = 7 if blk.dropout else 6
    ew = T * (n_norm * 4 * h / q + n_res * res * h / q + (6 if blk.gated else 4) * fa)
    if blk.qk_norm:
        ew += T * 4 * (blk.heads + blk.kv) * blk.qk_dim / t
    if blk.experts:
        ew += T * 2 * 2 * 2 * blk.topk * h / t
    ew_f = g.stream(ew)
    return UnitTimes(lf + attn_f + ew_f, lb + attn_b + BWD_TRAFFIC * ew_f, lw, attn_f, wcol)


def head_times(g: GPU, d: Dims, b: float, t: int, sp: bool) -> UnitTimes:
    """Final norm, vocabulary-parallel logits and cross-entropy (Megatron computes it in fp32:
    read bf16 logits, write fp32, softmax; backward writes the logit gradients)."""
    s = d.dec_s if d.arch == "t5" else d.s
    T = b * s
    q = t if sp and t > 1 else 1
    lf, lb, lw = _linears(g, [(T, d.vocab / t, d.h)])
    nv = T * d.vocab / t
    return UnitTimes(lf + g.stream(T * 4 * d.h / q + 10 * nv), lb + g.stream(T * 8 * d.h / q + 8 * nv),
                     lw, 0.0)


def embedding_times(g: GPU, d: Dims, b: float, t: int, sp: bool) -> UnitTimes:
    """Lookup (+ position add and dropout) forward; gradient scatter into the table backward."""
    T = b * d.s
    x = T * d.h * 2
    return UnitTimes(g.stream(3 * x), g.stream(3 * x), g.stream(x), 0.0)


def unit_times(g: GPU, d: Dims, unit, b: float, t: int, sp: bool, ep: int = 1,
               etp: int | None = None, imb: float = 1.0) -> UnitTimes | None:
    """Times of a ModelSpec unit, or None where the shape model has no kernel list for it
    (ViT patch embedding and classification head: those keep FLOPs at the matmul rate)."""
    if unit.kind == "block":
        return block_times(g, unit.shape, b, t, sp, ep, etp, imb)
    if d.arch == "vit":
        return None
    if unit.kind == "post":
        return head_times(g, d, b, t, sp)
    return embedding_times(g, d, b, t, sp)


def attention_score_bytes(d: Dims, unit) -> float:
    """Activation bytes per sample of the attention scores, softmax output and dropout mask
    (5 a s^2, Korthikanti et al. 2022 §4.1; a window is a mask on them): what selective
    recompute does not keep; split by TP like the rest of the attention.  Zero with flash
    attention."""
    blk = unit.shape
    if d is None or blk is None or blk.flash or unit.kind != "block":
        return 0.0
    return 5.0 * blk.heads * blk.s * (blk.s + blk.cross_s)
