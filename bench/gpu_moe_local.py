"""The local (one-GPU) work of a megatron-core 0.9 MoE layer at the Grok-1 314B
dgxc-benchmarking shapes (NeMo 24.09: hidden 6144, 8 experts of FFN 32768 split over TP 4
(8192 per rank), gated GeLU, top-2, drop-and-pad at capacity factor 1, alltoall dispatcher,
moe_grouped_gemm false = SequentialMLP), per micro-batch of 4096 tokens per TP group, for
1, 2, 4 local experts (EP 8, 4, 2: 8192/nloc rows per local expert, 8192 rows in all):
  experts_loop   : SequentialMLP fwd+bwd (a Python loop of per-expert fc1 -> geglu -> fc2)
  experts_bmm    : the same work as one batched GEMM per linear (the grouped-GEMM ideal)
  gemm_only      : the loop's six GEMMs alone (fwd, dgrad, wgrad), no elementwise
  accum_fp32 / accum_bf16 : adding the experts' bf16 weight gradients into a main_grad buffer
  wgrad_bf16 / wgrad_fp32_accumulate : the two wgrad GEMMs writing bf16 vs accumulating into fp32
  dispatch_local : the dispatcher's local data movement fwd+bwd (router linear + fp32 softmax,
                   top-k, capacity top-k, sp2hp / hp2sp re-layout copies, padded permute
                   index_select, the a2a buffers as copies, the local-expert transpose, the
                   all-gather-last-dim cat and reduce-scatter-last-dim split copies, the
                   probs-weighted scatter_add unpermute); NCCL time itself not measured.
No megatron/TE needed (torch only).  ~30-60 s on one H100, < 12 GB.  Writes $OUT/moe_h100.json."""
import json, os
import torch
import torch.nn.functional as F

from gpu_kernels import bench as _bench, dev  # noqa: E402  (bench/ is the script's folder)

bf = torch.bfloat16
H, FE, E, K, TP, T = 6144, 8192, 8, 2, 4, 4096     # FE: expert FFN per TP rank (32768 / 4)


def bench(fn):
    """Median seconds of ``fn`` (gpu_kernels.bench's CUDA-event timing, 12 repeats after 3)."""
    return _bench(fn, reps=12, warm=3)[0]


def experts(nloc):
    rows = T * K // nloc                    # rows per local expert (8192 in all)
    w1 = [torch.randn(H, 2 * FE, device=dev, dtype=bf, requires_grad=True) for _ in range(nloc)]
    w2 = [torch.randn(FE, H, device=dev, dtype=bf, requires_grad=True) for _ in range(nloc)]
    x = torch.randn(nloc * rows, H, device=dev, dtype=bf, requires_grad=True)
    g = torch.randn(nloc * rows, H, device=dev, dtype=bf)
    def geglu(a):
        u, v = a.chunk(2, dim=-1)
        return F.gelu(u, approximate="tanh") * v
    def loop():
        outs = [geglu(xi @ a) @ b for xi, a, b in zip(torch.split(x, rows), w1, w2)]
        torch.cat(outs).backward(g)
    W1 = torch.randn(nloc, H, 2 * FE, device=dev, dtype=bf, requires_grad=True)
    W2 = torch.randn(nloc, FE, H, device=dev, dtype=bf, requires_grad=True)
    def bmm():
        y = torch.bmm(geglu(torch.bmm(x.view(nloc, rows, H), W1)), W2)
        y.view(-1, H).backward(g)
    xs = [torch.randn(rows, H, device=dev, dtype=bf) for _ in range(nloc)]
    a1 = [torch.randn(rows, 2 * FE, device=dev, dtype=bf) for _ in range(nloc)]
    h1 = [torch.randn(rows, FE, device=dev, dtype=bf) for _ in range(nloc)]
    wa = [w.detach() for w in w1]
    wb = [w.detach() for w in w2]
    def gemms():
        for i in range(nloc):
            xs[i] @ wa[i]; h1[i] @ wb[i]                       # fwd
            g[:rows] @ wb[i].t(); a1[i] @ wa[i].t()            # dgrad
            h1[i].t() @ g[:rows]; xs[i].t() @ a1[i]            # wgrad
    mg32 = [torch.zeros(H * 2 * FE + FE * H, device=dev) for _ in range(nloc)]
    mg16 = [torch.zeros(H * 2 * FE + FE * H, device=dev, dtype=bf) for _ in range(nloc)]
    gr = [torch.randn(H * 2 * FE + FE * H, device=dev, dtype=bf) for _ in range(nloc)]
    def acc(mg):
        return lambda: [m.add_(q) for m, q in zip(mg, gr)]
    # wgrad GEMMs writing fp32 (TE's gradient_accumulation_fusion: cuBLAS beta = 1 into the
    # fp32 main_grad) vs writing bf16: torch's out_dtype where this torch has it
    c1 = [torch.zeros(H, 2 * FE, device=dev) for _ in range(nloc)]
    c2 = [torch.zeros(FE, H, device=dev) for _ in range(nloc)]
    def wgrad16():
        for i in range(nloc):
            h1[i].t() @ g[:rows]; xs[i].t() @ a1[i]
    def wgrad32():
        for i in range(nloc):
            torch.addmm(c2[i], h1[i].t(), g[:rows], out_dtype=torch.float32)
            torch.addmm(c1[i], xs[i].t(), a1[i], out_dtype=torch.float32)
    flops = 6.0 * nloc * rows * (H * 2 * FE + FE * H)
    out = {"nloc": nloc, "rows_per_expert": rows, "gemm_flops": flops}
    for name, fn in (("experts_loop", loop), ("experts_bmm", bmm), ("gemm_only", gemms),
                     ("accum_fp32", acc(mg32)), ("accum_bf16", acc(mg16)),
                     ("wgrad_bf16", wgrad16), ("wgrad_fp32_accumulate", wgrad32)):
        try:
            out[name + "_s"] = bench(fn)
        except Exception as e:            # noqa: BLE001
            out[name + "_error"] = str(e)[:200]
        for p in w1 + w2 + [W1, W2, x]:
            p.grad = None
    out["gemm_only_tflops"] = flops / out.get("gemm_only_s", float("nan")) / 1e12
    del w1, w2, W1, W2, xs, a1, h1, mg32, mg16, gr, c1, c2
    torch.cuda.empty_cache()
    return out


def dispatch(nloc):
    ep = E // nloc
    cap = T * K // E                       # tokens per expert from this TP group (capacity factor 1)
    x = torch.randn(T // TP, H, device=dev, dtype=bf, requires_grad=True)      # [S/TP, H] (SP)
    wr = torch.randn(H, E, device=dev, dtype=bf, requires_grad=True)
    g = torch.randn(T // TP, H, device=dev, dtype=bf)
    def fn():
        # router on the rank's tokens, gathered routing for the TP group's tokens (sp2hp)
        logits = torch.cat([x @ wr] * TP)                  # [T, E] (stand-in for the gathered logits)
        scores = torch.softmax(logits.float(), dim=-1)
        p, idx = torch.topk(scores, K, dim=-1)
        gates = torch.zeros_like(scores).scatter(1, idx, p)
        aux = (gates.mean(0) * scores.mean(0)).sum() * E  # load-balancing loss
        cp_, ci = torch.topk(gates, cap, dim=0, sorted=False)   # [cap, E]: capacity per expert
        ind, probs = ci.t().contiguous(), cp_.t().contiguous().to(bf)   # [E, cap]
        xs = x.view(T // TP, TP, H // TP).transpose(0, 1).reshape(T, H // TP)  # sp2hp layout
        perm = xs.index_select(0, ind.view(-1))            # padded permute [E*cap, H/TP]
        recv = perm.clone()                                # EP a2a output buffer
        if nloc > 1:
            recv = recv.view(ep, nloc, cap, -1).transpose(0, 1).reshape(-1, H // TP).contiguous()
        full = torch.cat([recv] * TP)                      # all-gather over TP (dim 0 buffer)
        y = torch.cat(full.chunk(TP, dim=0), dim=-1)       # ... to the last dim [rows, H]
        # experts would run here; reduce-scatter last dim: split copy, the rank keeps its slice
        z = torch.cat(y.chunk(TP, dim=-1), dim=0)[: y.shape[0]]
        if nloc > 1:
            z = z.view(nloc, ep, cap, -1).transpose(0, 1).reshape(-1, H // TP).contiguous()
        back = z.clone()                                   # EP a2a back
        comb = back * probs.view(-1, 1)
        out = torch.zeros(T, H // TP, device=dev, dtype=bf).index_add(0, ind.view(-1), comb)
        o = out.view(TP, T // TP, H // TP).transpose(0, 1).reshape(T // TP, H)   # hp2sp
        (o + aux.to(bf)).backward(g)
    return {"nloc": nloc, "dispatch_local_s": bench(fn)}


def main():
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes":
           {"hidden": H, "expert_ffn_per_rank": FE, "experts": E, "topk": K, "tp": TP, "tokens": T},
           "experts": [], "dispatch": []}
    for nloc in (4, 2, 1):
        res["experts"].append(experts(nloc))
        res["dispatch"].append(dispatch(nloc))
        print(json.dumps(res["experts"][-1]), json.dumps(res["dispatch"][-1]), flush=True)
    s = json.dumps(res, indent=1)
    print(s)
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "moe_h100.json"), "w") as f:
        f.write(s)


if __name__ == "__main__":
    main()
