"""Time t(M) and memory mem(M) of one padded micro-batch on one pipeline stage.

docs/schedules.md §5.3: a micro-batch M of ``mbs`` samples is padded to ``L = roundup(max len,
pad_to)`` (encoder-decoder: ``(L_enc, L_dec)``); per stage

    t_fwd(M) = layers · (overhead + lin · mbs·L + quad · mbs·L²)     t_bwd = bw_ratio · t_fwd

The quadratic term is attention (QKᵀ and AV FLOPs, plus the score-matrix memory traffic of
an unfused softmax).  Encoder-decoder (non-interleaved: a stage holds encoder *or*
decoder layers) takes ``max(t_enc_stage, t_dec_stage)`` with the decoder layer paying self-
attention over L_dec and cross-attention over L_dec·L_enc [code, §5.3].  Activation memory
per stage: ``layers · mbs·L·(mem_lin + mem_quad·L)`` (Korthikanti et al.: ``sbh(34 +
5as/h)`` bytes per layer).  All arrays broadcast (numpy), times in ms, memory in bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np


def pad_len(x, pad_to: int = 8):
    """Round lengths up to a multiple of ``pad_to`` (docs/schedules.md §5.3: roundup8)."""
    x = np.asarray(x)
    return (x + pad_to - 1) // pad_to * pad_to if pad_to > 1 else x


@dataclass(frozen=True)
class CostModel:
    """Per-stage cost of a padded micro-batch (see module docstring for the formulas)."""

    layers: float = 1.0        # transformer layers per pipeline stage
    overhead: float = 0.0      # ms per layer per forward (launches, small-GEMM inefficiency)
    lin: float = 0.0           # ms per token per layer, forward
    quad: float = 0.0          # ms per (token · attended token) per layer, forward
    bw_ratio: float = 2.0      # backward / forward time
    mem_lin: float = 0.0       # bytes per token per layer
    mem_quad: float = 0.0      # bytes per (token · attended token) per layer
    pad_to: int = 8
    encdec: bool = False       # lengths are (L_enc, L_dec) pairs
    dec_lin_ratio: float = 4 / 3  # decoder layer's extra cross-attention projections (32h² vs 24h²)

    # -- constructors -----------------------------------------------------------------
    @classmethod
    def gpt(cls, hidden: int = 2048, heads: int = 16, layers: int = 24, stages: int = 4, *,
            tflops: float = 150.0, hbm_tbps: float = 1.5, overhead_ms: float = 0.05,
            attention: str = "eager", encdec: bool = False, pad_to: int = 8) -> "CostModel":
        """GPT-like layer from first principles (A100-class defaults: 150 TFLOP/s achieved,
        1.5 TB/s).  Forward FLOPs per layer: 24·h² per token (QKV, projection, 4h MLP) and
        4·h per token pair (QKᵀ, AV).  ``attention='eager'`` (unfused softmax, as Megatron
        without flash attention) also moves ~8 bytes per score element per head (write and
        read the fp16 scores and probabilities); ``'flash'`` has only the FLOPs."""
        if attention not in ("eager", "flash"):
            raise ValueError("attention must be 'eager' or 'flash'")
        flops = tflops * 1e12 / 1e3           # FLOP per ms
        lin = 24.0 * hidden * hidden / flops
        quad = 4.0 * hidden / flops
        if attention == "eager":
            quad += 8.0 * heads / (hbm_tbps * 1e12 / 1e3)
        return cls(layers=layers / stages, overhead=overhead_ms, lin=lin, quad=quad,
                   mem_lin=34.0 * hidden, mem_quad=5.0 * heads, pad_to=pad_to, encdec=encdec)

    def with_(self, **kw) -> "CostModel":
        return replace(self, **kw)

    # -- model ------------------------------------------------------------------------
    def padded(self, lengths):
        return pad_len(lengths, self.pad_to)

    def _split(self, L):
        L = np.asarray(L, dtype=float)
        if self.encdec:
            return L[..., 0], L[..., 1]
        return L, None

    def fwd(self, mbs, L):
        """Forward time (ms) of ``mbs`` samples padded to ``L`` on one stage."""
        b = np.asarray(mbs, dtype=float)
        le, ld = self._split(L)
        enc = self.overhead + b * le * (self.lin + self.quad * le)
        if ld is None:
            return self.layers * enc
        dec = self.overhead + b * ld * (self.lin * self.dec_lin_ratio + self.quad * (ld + le))
        return self.layers * np.maximum(enc, dec)

    def bwd(self, mbs, L):
        return self.bw_ratio * self.fwd(mbs, L)

    def time(self, mbs, L):
        """t(M): forward + backward time of the micro-batch on one stage (the DP's t)."""
        return (1.0 + self.bw_ratio) * self.fwd(mbs, L)

    def memory(self, mbs, L):
        """mem(M): activation bytes one stage keeps for this micro-batch until its backward."""
        b = np.asarray(mbs, dtype=float)
        le, ld = self._split(L)
        m = b * le * (self.mem_lin + self.mem_quad * le)
        if ld is not None:
            m = np.maximum(m, b * ld * (self.mem_lin * self.dec_lin_ratio + self.mem_quad * (ld + le)))
        return self.layers * m

    def tokens(self, mbs, L):
        """Padded tokens of the micro-batch (both lengths for encoder-decoder)."""
        le, ld = self._split(L)
        return np.asarray(mbs) * (le if ld is None else le + ld)
