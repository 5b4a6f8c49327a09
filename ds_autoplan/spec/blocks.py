"""BlockShape: what one transformer block computes, as sizes (spec -> cost).

One frozen value per distinct block kind: the attention (multi-head / grouped-query with any
head size, or DeepSeek's multi-latent attention), its window, the MLP (GeLU, SwiGLU or GeGLU;
dense or mixture-of-experts with shared experts) and the norms.  Parameter counts, forward
FLOPs and the activation bytes the layer keeps for its backward follow from it (Korthikanti et
al. 2022 §4.1 accounting, generalised the same way as before: per sample, 2-byte activations,
``rep`` not split by TP, ``tp`` split by TP).  The cost model (cost/compute.py) costs the same
shapes kernel by kernel.
"""
from __future__ import annotations

from dataclasses import dataclass

# swiglu: SiLU gate; geglu: GeLU(-tanh) gate (Gemma); quick_geglu: x * sigmoid(1.702 x) gate,
# clamped, with 1 added to the linear half (gpt-oss)
ACTIVATIONS = ("gelu", "swiglu", "geglu", "quick_geglu")


@dataclass(frozen=True)
class BlockShape:
    s: int                    # tokens per sample (query length)
    h: int                    # hidden size
    heads: int                # attention (query) heads
    kv: int                   # key/value heads (groups); MLA: = heads
    hd: int                   # head size of Q/K/V (MLA: unused, see ``mla``)
    ffn: int                  # dense MLP width (0 on a mixture-of-experts layer)
    act: str = "gelu"         # gelu | swiglu | geglu (the last two gated: 3 matrices)
    experts: int = 0          # routed experts (0: dense layer)
    topk: int = 0             # experts per token
    expert_ffn: int = 0       # width of one routed expert
    shared_ffn: int = 0       # total width of the shared expert(s), every token goes through it
    shared_gate: bool = False  # Qwen2-MoE's sigmoid gate on the shared expert (an h -> 1 linear)
    router_bias: bool = False  # a bias per expert on the router (DeepSeek-V3's score correction, gpt-oss)
    expert_bias: bool = False  # biases on each expert's linears (gpt-oss)
    o_bias: bool = False       # a bias on the attention's output projection (HF attention_bias)
    sinks: bool = False        # a learned attention-sink logit per head (gpt-oss)
    # multi-latent attention (DeepSeek-V2 §2.1): (q_lora_rank (0: full-rank Q), kv_lora_rank,
    # qk_nope_head_dim, qk_rope_head_dim, v_head_dim)
    mla: tuple = ()
    window: int = 0           # sliding-window attention span in tokens (0: global)
    qk_norm: bool = False     # RMSNorm over each head's Q and K (Qwen3, Gemma-3)
    norms: int = 2            # norms in the block: 2 (pre-norm), 4 (Gemma-2/3's sandwich norms)
    layernorm: bool = True    # LayerNorm (weight + bias) or RMSNorm (weight only)
    linear_bias: bool = False  # biases on every linear (GPT-2)
    qkv_bias: bool = False     # biases on Q, K, V only (Qwen2)
    flash: bool = True
    dropout: bool = False
    cross_s: int = 0          # > 0: a decoder block with cross-attention over cross_s tokens

    # -- sizes ---------------------------------------------------------------------------
    @property
    def gated(self) -> bool:
        return self.act != "gelu"

    @property
    def qk_dim(self) -> int:
        """Head size of the query/key dot product."""
        return self.mla[2] + self.mla[3] if self.mla else self.hd

    @property
    def v_dim(self) -> int:
        return self.mla[4] if self.mla else self.hd

    @property
    def skv(self) -> int:
        """Keys each query attends to (sliding window: at most ``window``)."""
        return min(self.s, self.window) if self.window else self.s

    def attention_pairs(self) -> float:
        """Query-key pairs of the attention core counted like the full non-causal s x s matrix
        (the FLOP convention of Narayanan et al. 2021 §5.1 and the cost model): a causal
        window of w keys is the band of 2sw - w^2 of them (s^2 at w = s); without a fused
        kernel the whole matrix is computed (the window is a mask)."""
        s, w = self.s, self.skv
        return float(s * s if w >= s or not self.flash else 2 * s * w - w * w)

    def attn_linears(self) -> list[tuple[int, int, str]]:
        """The attention's linears as (in, out, how TP splits it): Megatron's column-parallel
        ("col") and row-parallel ("row") layers; MLA's down-projections are replicated ("rep")
        (DeepSeek-V2 §2.1.2, eq. 9-14)."""
        h, H = self.h, self.heads
        if self.mla:
            ql, kvl, nope, rope, v = self.mla
            q = [(h, ql, "rep"), (ql, H * (nope + rope), "col")] if ql else [(h, H * (nope + rope), "col")]
            return q + [(h, kvl + rope, "rep"), (kvl, H * (nope + v), "col"), (H * v, h, "row")]
        return [(h, (H + 2 * self.kv) * self.hd, "col"), (H * self.hd, h, "row")]

    def mlp_matrices(self, f: int) -> int:
        return (3 if self.gated else 2) * self.h * f

    def active_ffn(self) -> int:
        """MLP width one token goes through: the dense width, or top-k experts + shared."""
        return self.topk * self.expert_ffn + self.shared_ffn if self.experts else self.ffn

    def _bias(self) -> int:
        qkv = (self.heads + 2 * self.kv) * self.hd if not self.mla else 0
        if self.linear_bias:
            f = self.active_ffn()
            return qkv + self.h + (2 if self.gated else 1) * f + self.h
        return (qkv if self.qkv_bias else 0) + (self.h if self.o_bias else 0) + \
            (self.heads if self.sinks else 0)

    def _expert(self) -> int:
        """Parameters of one routed expert (its biases included)."""
        f = self.expert_ffn
        return self.mlp_matrices(f) + (((2 if self.gated else 1) * f + self.h) if self.expert_bias else 0)

    def _norm_params(self) -> int:
        n = self.norms * self.h * (2 if self.layernorm else 1)
        if self.qk_norm:
            n += 2 * self.qk_dim
        if self.mla:                     # norms on the compressed latents
            n += (self.mla[0] or 0) + self.mla[1]
        return n

    def _router(self) -> int:
        if not self.experts:
            return 0
        return self.h * self.experts + (self.experts if self.router_bias else 0) + \
            (self.h if self.shared_gate else 0)

    def params(self) -> int:
        attn = sum(i * o for i, o, _ in self.attn_linears())
        if self.experts:
            mlp = self.experts * self._expert() + self.mlp_matrices(self.shared_ffn)
        else:
            mlp = self.mlp_matrices(self.ffn)
        p = attn + mlp + self._router() + self._norm_params() + self._bias()
        if self.cross_s:                 # cross-attention (Q, K, V, O) and its norm
            p += 4 * self.h * self.h + 2 * self.h
        return p

    def expert_params(self) -> int:
        """Parameters of the routed experts (what expert parallelism divides; the shared
        experts, router and attention stay whole on every expert-parallel rank)."""
        return self.experts * self._expert() if self.experts else 0

    def active_params(self) -> int:
        """Parameters one token goes through: all but the routed experts it is not sent to."""
        if not self.experts:
            return self.params()
        return self.params() - self.expert_params() * (self.experts - self.topk) // self.experts

    # -- work and memory per sample ---------------------------------------------------------
    def flops(self) -> float:
        """Forward FLOPs per sample: 2 per multiply-add of every linear a token goes through
        (router included), and Q K^T plus the weighted sum over V on :meth:`attention_pairs`."""
        s, H = self.s, self.heads
        lin = sum(i * o for i, o, _ in self.attn_linears()) + self.mlp_matrices(self.active_ffn()) + \
            (self.h * self.experts if self.experts else 0)
        f = 2.0 * s * lin + 2.0 * self.attention_pairs() * H * (self.qk_dim + self.v_dim)
        if self.cross_s:
            h, c = self.h, self.cross_s
            f += 2 * s * 2 * h * h + 2 * c * 2 * h * h + 4 * s * c * h
        return f

    def activation_bytes(self) -> tuple[float, float]:
        """(bytes not split by TP, bytes split by TP) per sample kept for the backward."""
        s, h, H = self.s, self.h, self.heads
        rep = s * h * (10 if self.dropout else 8) + 4 * s * h * (self.norms - 2) // 2
        q, k, v = H * self.qk_dim, self.kv * self.qk_dim, self.kv * self.v_dim
        if self.mla:                     # K, V expanded per head from the latent
            k, v = H * self.qk_dim, H * self.v_dim
            ql, kvl, _, rope, _ = self.mla
            rep += 4 * s * (ql + kvl + rope)          # latents and their normed copies
        tp = s * (2 * (q + k + v) + 2 * H * self.v_dim + (6 if self.gated else 4) * self.active_ffn())
        if self.qk_norm:
            tp += 2 * s * (q + k)
        if not self.flash:               # scores, softmax, dropout mask over the whole matrix
            tp += 5 * H * s * s
        if self.experts:                 # router logits (fp32); tokens permuted to their experts and back
            rep += 4 * s * self.experts
            tp += 4 * s * self.topk * h
        if self.cross_s:
            c = self.cross_s
            rep += 4 * s * h
            tp += 6 * s * h + 4 * c * h + (0 if self.flash else 5 * H * s * c)
        return float(rep), float(tp)

    def boundary(self) -> float:
        """Bytes per sample of the block's input (what CKPT keeps; the pipeline send): the
        encoder output travels with every decoder stage."""
        return 2.0 * self.s * self.h + (2.0 * self.cross_s * self.h if self.cross_s else 0.0)
