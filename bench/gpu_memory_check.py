"""Whole-block check of the memory model on a real GPU: activation stash and allocator overhead.

``measure OUT.json`` (on a CUDA GPU; plain torch, no ds_autoplan import): for Megatron-style
blocks on their tensor-parallel shard (no collectives) -- GPT (LayerNorm, GeLU, two dropouts)
and LLaMA (RMSNorm, SwiGLU fused as Megatron's bias_swiglu: its input kept, the product
recomputed) with causal flash attention (SDPA) -- in bf16: the bytes a stack of blocks keeps
for its backward per sample (allocated after the forward less before, the output left out,
the stack's input added back: it is the first block's LayerNorm input); the LM head with an
fp32 cross-entropy: bytes held after its forward and the forward/backward peak per logit; the
device memory outside PyTorch's allocator after CUDA, cuBLAS and flash attention start; and
the caching allocator's reserved / allocated peak under a 1F1B-like stash pattern (run it
again with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to compare).

``compare FILE.json [...]`` (here): the model's per-sample stash (spec/blocks.py:
act_rep + act_tp / t, Korthikanti et al. 2022 §4 generalised) for the same shapes against the
measurement; the head's 6 bytes per logit against the measured peak.  Prints one JSON line.
"""
from __future__ import annotations

import json
import os
import statistics
import time

CASES = [  # (arch, h, heads, ffn, s, t)
    ("gpt", 4096, 32, 16384, 2048, 1), ("gpt", 4096, 32, 16384, 4096, 2), ("gpt", 8192, 64, 32768, 2048, 4),
    ("llama", 4096, 32, 11008, 4096, 1), ("llama", 8192, 64, 28672, 4096, 4), ("llama", 8192, 64, 28672, 8192, 8),
]
HEAD = (4096, 128256, 4096)   # (h, vocab, s)


def measure(out: str) -> None:
    import torch
    import torch.nn.functional as F
    dev, dt = torch.device("cuda"), torch.bfloat16

    class FusedSwiGLU(torch.autograd.Function):      # keeps its input only (bias_swiglu)
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            g, u = x.chunk(2, dim=-1)
            return F.silu(g) * u

        @staticmethod
        def backward(ctx, dy):
            (x,) = ctx.saved_tensors
            with torch.enable_grad():
                xx = x.detach().requires_grad_()
                g, u = xx.chunk(2, dim=-1)
                return torch.autograd.grad(F.silu(g) * u, xx, dy)[0]

    class Block(torch.nn.Module):
        def __init__(self, arch, h, heads, ffn, t):
            super().__init__()
            self.arch, self.h, self.hl, self.H = arch, h, h // t, heads // t
            lin = lambda i, o: torch.nn.Linear(i, o, bias=arch == "gpt", device=dev, dtype=dt)   # noqa: E731
            norm = (lambda: torch.nn.LayerNorm(h, device=dev, dtype=dt)) if arch == "gpt" else \
                (lambda: torch.nn.RMSNorm(h, device=dev, dtype=dt))
            self.n1, self.n2 = norm(), norm()
            self.qkv, self.o = lin(h, 3 * self.hl), lin(self.hl, h)
            self.fc1 = lin(h, (2 if arch == "llama" else 1) * ffn // t)
            self.fc2 = lin(ffn // t, h)
            self.p = 0.1 if arch == "gpt" else 0.0

        def forward(self, x):                      # x: [b, s, h]
            b, s, _ = x.shape
            q, k, v = self.qkv(self.n1(x)).view(b, s, 3, self.H, -1).permute(2, 0, 3, 1, 4)
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            drop = (lambda z: F.dropout(z, self.p, True)) if self.p else (lambda z: z)   # noqa: E731
            x = x + drop(self.o(a.transpose(1, 2).reshape(b, s, self.hl)))
            y = self.fc1(self.n2(x))
            y = F.gelu(y) if self.arch == "gpt" else FusedSwiGLU.apply(y)
            return x + drop(self.fc2(y))

    torch.empty(1, device=dev)
    w = torch.randn(4096, 4096, device=dev, dtype=dt)
    (w @ w).sum().item()
    qq = torch.randn(1, 8, 256, 128, device=dev, dtype=dt)
    F.scaled_dot_product_attention(qq, qq, qq, is_causal=True).sum().item()
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    outside = total - free - torch.cuda.memory_reserved()
    del w, qq
    torch.cuda.empty_cache()

    rows, n = [], 3
    for arch, h, heads, ffn, s, t in CASES:
        blocks = [Block(arch, h, heads, ffn, t) for _ in range(n)]
        x = torch.randn(1, s, h, device=dev, dtype=dt, requires_grad=True)
        torch.cuda.synchronize()
        m0 = torch.cuda.memory_allocated()
        y = x
        for i in range(n):
            y = blocks[i](y)
        torch.cuda.synchronize()
        stash = (torch.cuda.memory_allocated() - m0 - y.numel() * y.element_size()
                 + x.numel() * x.element_size()) / n
        y.float().sum().backward()
        rows.append({"arch": arch, "h": h, "heads": heads, "ffn": ffn, "s": s, "t": t,
                     "stash_bytes_per_sample": stash})
        del blocks, x, y          # nothing of this case may be freed inside the next one's count
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    h, V, s = HEAD
    W = torch.nn.Parameter(torch.randn(V, h, device=dev, dtype=dt) * 0.01)
    x = torch.randn(s, h, device=dev, dtype=dt, requires_grad=True)
    lab = torch.randint(0, V, (s,), device=dev)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    m0 = torch.cuda.memory_allocated()
    loss = F.cross_entropy((x @ W.t()).float(), lab)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - m0
    fpeak = torch.cuda.max_memory_allocated() - m0
    loss.backward()
    torch.cuda.synchronize()
    head = {"h": h, "vocab": V, "s": s, "held_bytes_per_logit": held / (s * V),
            "fwd_peak_bytes_per_logit": fpeak / (s * V),
            "fwd_bwd_peak_bytes_per_logit": (torch.cuda.max_memory_allocated() - m0) / (s * V)}
    del W, x, loss
    torch.cuda.empty_cache()

    # 1F1B-like: states in one flat buffer, then p warm-up forwards, F/B alternation, cool-down
    torch.cuda.reset_peak_memory_stats()
    states = torch.empty(int(0.4 * total) // 2, device=dev, dtype=dt)
    blocks = [Block("llama", 4096, 32, 11008, 1) for _ in range(6)]
    live = []

    def fwd():
        y = torch.randn(1, 4096, 4096, device=dev, dtype=dt, requires_grad=True)
        for bl in blocks:
            y = bl(y)
        live.append(y)

    def bwd():
        live.pop(0).float().sum().backward()
    p = max(1, int(0.4 * total / (6 * 4096 * 140000)))   # in-flight micro-batches to ~40% more
    for _ in range(p):
        fwd()
    for _ in range(p):
        bwd()
        fwd()
    while live:
        bwd()
    torch.cuda.synchronize()
    pipe = {"in_flight": p, "max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
            "max_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%d"),
           "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "method": __doc__,
           "total_gib": total / 2**30, "outside_allocator_gib": outside / 2**30,
           "rows": rows, "head": head, "pipeline": pipe}
    with open(out, "w") as fh:
        json.dump(res, fh, indent=1)


def compare(paths: list[str]) -> dict:
    from ds_autoplan.spec import load_model
    out = {"cases": [], "files": paths}
    for path in paths:
        with open(path) as fh:
            data = json.load(fh)
        for r in data["rows"]:
            m = load_model({"name": "check", "arch": r["arch"], "num_layers": 1, "hidden": r["h"],
                            "heads": r["heads"], "ffn": r["ffn"], "vocab": 32000, "seq_len": r["s"],
                            "flash_attention": True, "dropout": r["arch"] == "gpt"})
            u = m.layers[0]
            model = u.act_rep + u.act_tp / r["t"]
            out["cases"].append({**{k: r[k] for k in ("arch", "h", "s", "t")},
                                 "measured_mb": round(r["stash_bytes_per_sample"] / 2**20, 1),
                                 "model_mb": round(model / 2**20, 1),
                                 "error": round(model / r["stash_bytes_per_sample"] - 1, 4)})
        hd, pipe = data["head"], data["pipeline"]
        out.setdefault("head", []).append({"model_bytes_per_logit": 6.0, **{k: round(v, 3) for k, v in hd.items()
                                                                              if "per_logit" in k}})
        out.setdefault("allocator", []).append({
            "device": data["device"], "alloc_conf": data["alloc_conf"], "total_gib": round(data["total_gib"], 2),
            "outside_allocator_gib": round(data["outside_allocator_gib"], 2),
            "reserved_over_allocated": round(pipe["max_reserved_gib"] / pipe["max_allocated_gib"], 4),
            "max_allocated_gib": round(pipe["max_allocated_gib"], 2)})
    errs = [abs(c["error"]) for c in out["cases"]]
    out["median_abs_error"] = round(statistics.median(errs), 4)
    out["max_abs_error"] = round(max(errs), 4)
    return out


if __name__ == "__main__":
    import _measure as M
    M.device_check(measure, compare, "gpu_memory_check.py")
