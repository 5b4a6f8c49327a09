"""Measure, on one CUDA GPU, what the cost model's per-kind efficiency stands on: bf16 GEMM
throughput for the GEMM shapes of a Megatron transformer layer (forward, data-gradient and
weight-gradient products, per tensor-parallel split), fused attention (SDPA: flash and cuDNN
back-ends, causal, forward and forward+backward) and HBM bandwidth (device-to-device copy).
Writes one JSON file.  Timing: CUDA events, warm-up, median of repeats, inputs rotated among
several buffers so the L2 cache does not serve repeats; random data (never zeros)."""
import json, statistics, sys, time, platform
import torch

dev = torch.device("cuda")
props = torch.cuda.get_device_properties(0)


def bench(fn, reps=30, warm=5):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts), min(ts), max(ts)


def gemm(M, K, N, sets=3):
    xs = [torch.randn(M, K, device=dev, dtype=torch.bfloat16) for _ in range(sets)]
    ws = [torch.randn(K, N, device=dev, dtype=torch.bfloat16) for _ in range(sets)]
    i = [0]
    def f():
        j = i[0] % sets; i[0] += 1
        torch.mm(xs[j], ws[j])
    med, lo, hi = bench(f, reps=15, warm=3)
    fl = 2.0 * M * K * N
    return {"M": M, "K": K, "N": N, "s": med, "tflops": fl / med / 1e12, "tflops_best": fl / lo / 1e12}


def attention(b, heads, s, d, backend, bwd):
    from torch.nn.attention import sdpa_kernel, SDPBackend
    be = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
          "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]
    q, k, v = (torch.randn(b, heads, s, d, device=dev, dtype=torch.bfloat16, requires_grad=bwd)
               for _ in range(3))
    g = torch.randn(b, heads, s, d, device=dev, dtype=torch.bfloat16)
    def f():
        with sdpa_kernel([be]):
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            if bwd:
                o.backward(g)
    try:
        med, lo, hi = bench(f, reps=20)
    except Exception as e:  # a back-end this build lacks
        return {"backend": backend, "error": str(e)[:200]}
    fwd = 4.0 * b * heads * s * s * d / 2          # causal: half the score matrix
    fl = fwd * (3.5 if bwd else 1.0)               # FA2 convention: bwd = 2.5x fwd
    return {"backend": backend, "b": b, "heads": heads, "s": s, "d": d, "bwd": bwd, "s_time": med,
            "tflops": fl / med / 1e12}


def copy_bw():
    n = 2 * 1024**3 // 2
    a = torch.randn(n, device=dev, dtype=torch.bfloat16); c = torch.empty_like(a)
    med, lo, hi = bench(lambda: c.copy_(a), reps=20)
    return {"bytes_moved": 2 * a.numel() * 2, "s": med, "tb_per_s": 2 * a.numel() * 2 / med / 1e12}


def main(out):
    t0 = time.time()
    res = {"device": torch.cuda.get_device_name(0), "sms": props.multi_processor_count,
           "torch": torch.__version__, "cuda": torch.version.cuda,
           "date": time.strftime("%Y-%m-%d"), "method": __doc__, "gemm": [], "attention": []}
    res["copy"] = copy_bw()
    big = gemm(8192, 8192, 8192); res["gemm_8192_cubed"] = big
    for h in (2048, 4096, 5120, 8192, 12288):
        for t in (1, 2, 4, 8):
            for T in (4096, 16384):
                for name, (K, N) in {"qkv": (h, 3 * h // t), "proj": (h // t, h),
                                     "fc1": (h, 4 * h // t), "fc2": (4 * h // t, h)}.items():
                    for kind, (M_, K_, N_) in {"fwd": (T, K, N), "dgrad": (T, N, K),
                                               "wgrad": (K, T, N)}.items():
                        r = gemm(M_, K_, N_); r.update(h=h, tp=t, tokens=T, gemm=name, pass_=kind)
                        res["gemm"].append(r)
    for backend in ("flash", "cudnn"):
        for s in (1024, 2048, 4096, 8192, 16384):
            for d in (64, 128):
                heads = 4096 // d
                b = max(1, 16384 // s)
                for bwd in (False, True):
                    res["attention"].append(attention(b, heads, s, d, backend, bwd))
    res["wall_s"] = time.time() - t0
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print("device", res["device"], "copy TB/s %.2f" % res["copy"]["tb_per_s"],
          "8192^3 %.0f TFLOP/s" % big["tflops"], "gemms", len(res["gemm"]), "wall %.0f s" % res["wall_s"])
    import collections
    by = collections.defaultdict(list)
    for r in res["gemm"]:
        by[(r["h"], r["tp"])].append(r["tflops"])
    for k, v in sorted(by.items()):
        print("h=%d tp=%d median %.0f TFLOP/s" % (k[0], k[1], statistics.median(v)))
    for r in res["attention"]:
        if "error" in r:
            print("attn", r["backend"], "error", r["error"][:80])
        else:
            print("attn %s s=%d d=%d bwd=%s %.0f TFLOP/s" % (r["backend"], r["s"], r["d"], r["bwd"], r["tflops"]))


if __name__ == "__main__":
    main(sys.argv[1])
