"""What the 2023 MosaicML (MPT) stack's kernels reach on one H100, beside today's.
(1) causal attention, head dim 128, at the MPT rows' shapes (7b: b 6, 32 heads; 13b: b 2, 40 heads;
    s 2048) and s 4096, through torch SDPA's three back-ends: flash (FlashAttention-2, sm80 code),
    efficient (xformers/CUTLASS memory-efficient kernel: FlashAttention-1-generation sm80 mma.sync
    code, the proxy for the 2023 FA1 / Triton-pre-MLIR kernels), cudnn (Hopper-native);
    forward and forward+backward, FA2 FLOP convention (causal = half the score FLOPs, bwd 2.5x fwd).
(2) one AdamW step over a ZeRO-3 shard (7b: 0.83e9, 13b: 1.61e9 fp32 params in 32/40 flat tensors):
    Composer's DecoupledAdamW as a per-tensor loop of eager ops vs torch.optim.AdamW(fused=True).
What data/gpus.yaml's attention_kernels (fa1 on Hopper) and cost/engines.py's EAGER_STEP_BYTES
stand on (results: bench/data/gpu_stack_h100.json, lent H100, 2026-11-26, ~11 s, measured with
this script before its timing and copy helpers were shared with gpu_kernels.py: same method).

    python bench/gpu_stack.py OUT.json

Plain torch, no ds_autoplan import: runs on the device image."""
import json, math, time
import torch

from gpu_kernels import attention, bench, copy_bw, dev  # noqa: E402  (bench/ is the script's folder)


def adam(n_params, n_tensors, mode):
    per = int(n_params // n_tensors)
    ps = [torch.randn(per, device=dev) for _ in range(n_tensors)]
    gs = [torch.randn(per, device=dev) * 1e-3 for _ in range(n_tensors)]
    if mode == "fused":
        params = [torch.nn.Parameter(p) for p in ps]
        for p, g in zip(params, gs):
            p.grad = g
        opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
        f = opt.step
    else:   # Composer DecoupledAdamW.adamw: per-tensor eager ops
        ms = [torch.zeros_like(p) for p in ps]; vs = [torch.zeros_like(p) for p in ps]
        st = [0]
        def f():
            st[0] += 1
            b1, b2, lr, wd, eps = 0.9, 0.95, 1e-4, 1e-5, 1e-8
            bc1, bc2 = 1 - b1 ** st[0], 1 - b2 ** st[0]
            for p, g, m, v in zip(ps, gs, ms, vs):
                p.mul_(1 - wd)
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = (v.sqrt() / math.sqrt(bc2)).add_(eps)
                p.addcdiv_(m, denom, value=-lr / bc1)
    t = bench(f, reps=8, warm=2)[0]
    out = {"mode": mode, "params": per * n_tensors, "tensors": n_tensors, "s": t,
           "bytes_per_param_at_copy_bw": None}
    del ps, gs
    torch.cuda.empty_cache()
    return out


def main(path):
    t0 = time.time()
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
           "date": time.strftime("%Y-%m-%d %H:%M"), "method": __doc__, "attention": [], "adam": []}
    bw = copy_bw()["tb_per_s"] * 1e12; res["copy_bytes_per_s"] = bw
    for (b, h) in ((6, 32), (2, 40)):
        for s in (2048, 4096):
            bb = max(1, b * 2048 // s)
            for backend in ("flash", "efficient", "cudnn"):
                for bwd in (False, True):
                    res["attention"].append(attention(bb, h, s, 128, backend, bwd))
                    print(json.dumps(res["attention"][-1]), flush=True)
    for n, k in ((0.83e9, 32), (1.61e9, 40)):
        for mode in ("composer_loop", "fused"):
            r = adam(n, k, mode)
            r["bytes_per_param_at_copy_bw"] = r["s"] * bw / r["params"]
            res["adam"].append(r); print(json.dumps(r), flush=True)
    res["wall_s"] = time.time() - t0
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k != "method"}))


if __name__ == "__main__":
    import sys
    main(sys.argv[1])
