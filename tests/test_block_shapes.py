"""Per-layer parameters, FLOPs and activation bytes of the new block kinds
(spec/blocks.py) against hand formulas from the papers' shapes, and the kernel costs
(cost/compute.py) that follow them, at expert parallelism 1."""
from dataclasses import replace

import pytest

from ds_autoplan.cost.compute import block_times, get_gpu
from ds_autoplan.spec.blocks import BlockShape

H100 = get_gpu("h100-sxm-80gb")
S = 4096


def test_mla_counts_follow_deepseek_v2_eq_9_to_14():
    """DeepSeek-V3's attention: W^DQ [h, d_c'], W^UQ/W^QR [d_c', H(d_nope+d_rope)],
    W^DKV+W^KR [h, d_c+d_rope], W^UK/W^UV [d_c, H(d_nope+d_v)], W^O [H d_v, h], two latent
    RMSNorms; Q K^T over d_nope+d_rope, the sum over V over d_v."""
    h, H, ql, kvl, nope, rope, v = 7168, 128, 1536, 512, 128, 64, 128
    b = BlockShape(s=S, h=h, heads=H, kv=H, hd=56, ffn=18432, act="swiglu", mla=(ql, kvl, nope, rope, v),
                   layernorm=False)
    lin = h * ql + ql * H * (nope + rope) + h * (kvl + rope) + kvl * H * (nope + v) + H * v * h
    assert b.params() == lin + 3 * h * 18432 + 2 * h + ql + kvl
    assert b.flops() == 2 * S * (lin + 3 * h * 18432) + 2 * S * S * H * (nope + rope + v)


def test_moe_counts_shared_experts_router_bias_and_active():
    """Routed experts all count in the parameters, top-k in the FLOPs; the shared expert, the
    router [h, E], V3's per-expert bias and Qwen2-MoE's shared-expert gate count in both."""
    h, E, k, fe, fs = 2048, 60, 4, 1408, 5632
    b = BlockShape(s=S, h=h, heads=16, kv=16, hd=128, ffn=0, act="swiglu", experts=E, topk=k,
                   expert_ffn=fe, shared_ffn=fs, shared_gate=True, router_bias=True, layernorm=False)
    attn = 4 * h * h
    assert b.params() == attn + E * 3 * h * fe + 3 * h * fs + h * E + E + h + 2 * h
    assert b.active_params() == b.params() - (E - k) * 3 * h * fe
    assert b.expert_params() == E * 3 * h * fe and replace(b, experts=0, ffn=fe).expert_params() == 0
    assert b.flops() == 2 * S * (attn + 3 * h * (k * fe + fs) + h * E) + 4 * S * S * h
    dense = replace(b, experts=0, topk=0, ffn=k * fe + fs)
    rep, tp = b.activation_bytes()
    drep, dtp = dense.activation_bytes()
    # router logits (fp32, replicated) and the permuted tokens (k copies, TP-split) on top
    assert (rep - drep, tp - dtp) == (4 * S * E, 4 * S * k * h)


def test_window_qk_norm_sandwich_and_head_dim():
    """A local layer attends to ``window`` keys (with a fused kernel); QK-norm keeps its inputs (2 bytes each of Q
    and K) and has 2 head-size weights; sandwich norms add two norm inputs; head_dim sets the
    Q/K/V widths independently of hidden/heads (Gemma-7B: 16 x 256 = 4096 != 3072)."""
    g = BlockShape(s=S, h=3072, heads=16, kv=16, hd=256, ffn=24576, act="geglu", layernorm=False)
    assert g.params() == 3072 * 4096 * 4 + 3 * 3072 * 24576 + 2 * 3072
    local = replace(g, window=1024)
    # the causal band of 1024 keys: 2sw - w^2 of the s^2 pairs the full count has
    assert g.flops() - local.flops() == 2 * (S - 1024) ** 2 * 16 * (256 + 256)
    assert local.params() == g.params()
    nf = replace(g, flash=False)         # unfused: the window is a mask on the whole matrix
    assert nf.activation_bytes() == replace(nf, window=1024).activation_bytes()
    assert nf.flops() == replace(nf, window=1024).flops()
    qk = replace(g, qk_norm=True)
    assert qk.params() - g.params() == 2 * 256
    assert qk.activation_bytes()[1] - g.activation_bytes()[1] == 2 * S * (16 * 256 + 16 * 256)
    sw = replace(g, norms=4)
    assert sw.params() - g.params() == 2 * 3072 and sw.activation_bytes()[0] - g.activation_bytes()[0] == 4 * S * 3072


def test_kernel_times_follow_the_shapes():
    """cost/compute.py on the same shapes: a sliding window cuts the fused attention time; the
    experts run as a grouped GEMM over E experts on T*k/E tokens each, so time grows with
    top-k and the routed experts' time is above their FLOPs at the sustained matmul rate; MLA
    is costed from its own projections (not as h x h)."""
    moe = BlockShape(s=S, h=2048, heads=32, kv=4, hd=128, ffn=0, act="swiglu", experts=128, topk=8,
                     expert_ffn=768, qk_norm=True, layernorm=False)
    t8 = block_times(H100, moe, 1, 1, False)
    t4 = block_times(H100, replace(moe, topk=4), 1, 1, False)
    assert t4.fwd < t8.fwd and t4.bwd < t8.bwd
    rate = H100.mamf_tflops * H100.sustained * 1e12
    assert t8.fwd > 2 * S * 8 * 3 * 2048 * 768 / rate
    g = BlockShape(s=S, h=3072, heads=16, kv=16, hd=256, ffn=24576, act="geglu", layernorm=False)
    full, local = block_times(H100, g, 1, 1, False), block_times(H100, replace(g, window=512), 1, 1, False)
    band = (2 * S * 512 - 512 ** 2) / S ** 2          # the pairs a window of 512 keys keeps
    # the band's work at the kernel's measured rate for 512 keys (no faster than for 4096)
    rate_ratio = H100.fused_attention(1.0, 512, "fwd") / H100.fused_attention(1.0, S, "fwd")
    assert local.attn == pytest.approx(full.attn * band * rate_ratio) and rate_ratio >= 1
    assert local.fwd < full.fwd
    mla = BlockShape(s=S, h=7168, heads=128, kv=128, hd=56, ffn=18432, act="swiglu",
                     mla=(1536, 512, 128, 64, 128), layernorm=False)
    k1, k8 = block_times(H100, mla, 1, 1, False), block_times(H100, mla, 1, 8, False)
    # MLA's down-projections are replicated: TP 8 divides all but them
    assert k1.fwd / 8 < k8.fwd < k1.fwd
