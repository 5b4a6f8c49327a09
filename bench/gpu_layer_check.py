"""Whole-block check of the cost model's shape model on a real GPU.

``measure OUT.json`` (on a CUDA GPU; plain torch, no ds_autoplan import): a Megatron-style GPT
block -- pre-LN, QKV / projection / FC1 / FC2 linears on their tensor-parallel shard
(``h -> 3h/t``, ``h/t -> h``, ``h -> 4h/t``, ``4h/t -> h``), causal flash attention (SDPA) over
the ``heads/t`` local heads, GeLU, two dropout-adds -- in bf16, forward and forward+backward
timed with CUDA events (median of repeats after warm-up; inputs rotated among three sets,
random data).  The tensor-parallel collectives are not run: this checks compute only.

``compare FILE.json [...]`` (here): the cost model's ``block_times`` for the same shapes on the
file's GPU kind, against the measurement.  The prediction uses the kind's ``sustained`` prior of
``data/gpus.yaml`` (the layer-GEMM rate measured on these GPUs, which layer shapes keep under a
sustained load: bench/gpu_sustained.py), not the figure calibrated on published runs of older
stacks; everything else is the model as shipped.  Prints one JSON line: per-case errors,
median and max absolute error of forward+backward.
"""
from __future__ import annotations

import json
import statistics
import time

CASES = [  # (h, heads, s, b, t)
    (4096, 32, 2048, 1, 1), (4096, 32, 2048, 2, 1), (4096, 32, 2048, 4, 1), (4096, 32, 4096, 1, 1),
    (5120, 40, 4096, 1, 1), (5120, 40, 4096, 1, 2),
    (8192, 64, 2048, 1, 1), (8192, 64, 2048, 1, 2), (8192, 64, 2048, 1, 4), (8192, 64, 2048, 1, 8),
    (8192, 64, 4096, 1, 8), (12288, 96, 2048, 1, 4), (12288, 96, 2048, 1, 8),
]


def measure(out: str) -> None:
    import torch
    import torch.nn.functional as F
    dev, dt = torch.device("cuda"), torch.bfloat16

    def block(h, heads, t):
        hl, fl = h // t, 4 * h // t
        mk = lambda i, o: torch.nn.Linear(i, o, device=dev, dtype=dt)   # noqa: E731
        return dict(ln1=torch.nn.LayerNorm(h, device=dev, dtype=dt), qkv=mk(h, 3 * hl),
                    proj=mk(hl, h), ln2=torch.nn.LayerNorm(h, device=dev, dtype=dt),
                    fc1=mk(h, fl), fc2=mk(fl, h), nh=heads // t, dh=h // heads)

    def fwd(m, x):
        b, s, _ = x.shape
        q, k, v = m["qkv"](m["ln1"](x)).view(b, s, 3, m["nh"], m["dh"]).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + F.dropout(m["proj"](a.transpose(1, 2).reshape(b, s, -1)), 0.1)
        return x + F.dropout(m["fc2"](F.gelu(m["fc1"](m["ln2"](x)))), 0.1)

    from gpu_kernels import bench         # CUDA-event timing, median of repeats (same folder)

    def timed(fn):
        return bench(fn, reps=20, warm=5)[0]

    rows = []
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for h, heads, s, b, t in CASES:
        m = block(h, heads, t)
        xs = [torch.randn(b, s, h, device=dev, dtype=dt, requires_grad=True) for _ in range(3)]
        gs = [torch.randn(b, s, h, device=dev, dtype=dt) for _ in range(3)]
        i = [0]

        def f_only():
            with torch.no_grad(), sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                fwd(m, xs[i[0] % 3]); i[0] += 1

        def f_b():
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                fwd(m, xs[i[0] % 3]).backward(gs[i[0] % 3]); i[0] += 1
        rows.append(dict(h=h, heads=heads, s=s, b=b, t=t, fwd=timed(f_only), fwd_bwd=timed(f_b)))
        print("h=%5d s=%5d b=%d t=%d fwd %.3f ms fwd+bwd %.3f ms" % (
            h, s, b, t, rows[-1]["fwd"] * 1e3, rows[-1]["fwd_bwd"] * 1e3), flush=True)
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%d"), "method": __doc__,
           "rows": rows}
    with open(out, "w") as fh:
        json.dump(res, fh, indent=1)


KINDS = {"H100": "h100-sxm-80gb", "H200": "h200-141gb"}


def compare(paths: list[str]) -> dict:
    from ds_autoplan.cost.compute import block_times, get_gpu
    from ds_autoplan.spec.blocks import BlockShape
    out = {"cases": [], "files": paths}
    for path in paths:
        with open(path) as fh:
            data = json.load(fh)
        kind = next(v for k, v in KINDS.items() if k in data["device"])
        g = get_gpu(kind, calibrated=False)
        for r in data["rows"]:
            blk = BlockShape(s=r["s"], h=r["h"], heads=r["heads"], kv=r["heads"],
                             hd=r["h"] // r["heads"], ffn=4 * r["h"], act="gelu", flash=True,
                             dropout=True, linear_bias=True)      # the measured block
            u = block_times(g, blk, r["b"], r["t"], sp=False)
            out["cases"].append({"gpu": kind, **{k: r[k] for k in ("h", "s", "b", "t")},
                                 "fwd_err": round(u.fwd / r["fwd"] - 1, 4),
                                 "fwd_bwd_err": round((u.fwd + u.bwd) / r["fwd_bwd"] - 1, 4)})
    errs = [abs(c["fwd_bwd_err"]) for c in out["cases"]]
    out["median_abs_error"] = round(statistics.median(errs), 4)
    out["max_abs_error"] = round(max(errs), 4)
    out["mean_signed_error"] = round(statistics.mean(c["fwd_bwd_err"] for c in out["cases"]), 4)
    return out


if __name__ == "__main__":
    import _measure as M
    M.device_check(measure, compare, "gpu_layer_check.py")
