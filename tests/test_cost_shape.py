"""Cost side: compute from the work's shape, memory as the engines hold it, optimizer
step and ZeRO gather, hierarchical collectives, and the published-runs validation."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from ds_autoplan.cost.collectives import Network
from ds_autoplan.cost.compute import block_times, get_gpu
from ds_autoplan.cost.iteration import Config, config_cost, split_layers, stash_peaks
from ds_autoplan.cost.memory import state_bytes
from ds_autoplan.cost.model import CostModel, Strategy
from ds_autoplan.spec import SpecError, load_cluster, load_model

A100 = get_gpu("a100-sxm-80gb")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- compute from the shape -----------------------------------------------------------------
def test_gemm_waves_and_roofline():
    """Whole waves of 256x128 tiles over 108 SMs: one tile more than a full wave costs a whole
    extra wave; a large square GEMM runs at the sustained matmul rate; a skinny one is HBM-bound."""
    per_wave = 2 * 256 * 128 * 4096 / (A100.mamf_tflops * A100.sustained * 1e12 / A100.sms)
    M, N = 256 * 27, 128 * 4                   # 27 x 4 = 108 tiles: exactly one wave
    assert A100.gemm(M, N, 4096) == pytest.approx(per_wave)
    assert A100.gemm(M + 1, N, 4096) == pytest.approx(2 * per_wave)
    big = 2 * 8192 ** 3 / A100.gemm(8192, 8192, 8192)
    assert big / 1e12 == pytest.approx(A100.mamf_tflops * A100.sustained, rel=0.05)
    skinny = A100.gemm(8192, 8192, 16)
    assert skinny == pytest.approx(A100.stream(2 * (8192 * 16 * 2 + 8192 * 8192)))


def test_efficiency_grows_with_the_shape_and_tp_splitting_lowers_it():
    """The issue's cap: one constant per GPU bounds MFU whatever the sizes.  From the shape,
    achieved FLOP/s of a GPT block grow with h, and TP-splitting a small layer loses more."""
    def eff(h, t, b=1):
        m = load_model({"name": "x", "arch": "gpt", "num_layers": 2, "hidden": h, "heads": h // 128,
                        "vocab": 51200, "seq_len": 2048, "flash_attention": False})
        k = block_times(A100, m.layers[0].shape, b, t, False)
        return 3 * b * m.layers[0].flops / t / (k.fwd + k.bwd) / 312e12
    small, mid, large = eff(1024, 1), eff(4096, 1), eff(12288, 1)
    assert small < mid < large
    assert large > 0.55                        # the 175B-class block beats the old 0.5 constant
    assert eff(1024, 8) < 0.5 * eff(1024, 1) and eff(12288, 8) > 0.85 * eff(12288, 1)


def test_selective_recompute_between_none_and_full():
    """Korthikanti et al. §5: selective recompute drops the 5as^2 attention bytes and replays
    only the attention core; full CKPT keeps the input and replays the whole forward."""
    m = load_model({"name": "x", "arch": "gpt", "num_layers": 4, "hidden": 4096, "heads": 32,
                    "vocab": 51200, "seq_len": 2048, "flash_attention": False})
    cm = CostModel(m, load_cluster("8xa100-80gb"))
    S = [Strategy(8, 1, sp=True), Strategy(8, 1, sp=True, sel=True), Strategy(8, 1, ckpt=True, sp=True)]
    t = cm.tables(S, 1)
    blk = 2
    assert t.f1[blk, 0] - t.f1[blk, 1] == pytest.approx(5 * 32 * 2048 ** 2 / 8)
    assert t.f1[blk, 2] < t.f1[blk, 1] < t.f1[blk, 0]
    assert t.bwd_ns[blk, 0] < t.bwd_ns[blk, 1] < t.bwd_ns[blk, 2]
    assert S[1].label() == "TP8+SP+SEL"


def test_unknown_gpu_kind_is_a_clear_error():
    with pytest.raises(SpecError, match="unknown gpu kind 'a200'"):
        load_cluster({**load_cluster("8xa100-80gb").__dict__, "gpu": "a200"})


# -- memory as the engines hold it --------------------------------------------------------------
def test_state_bytes_per_runtime():
    assert sum(state_bytes("bf16", 0, 8, "megatron")) == 18                 # fp32 main grads
    assert sum(state_bytes("bf16", 1, 8, "megatron")) == pytest.approx(6 + 12 / 8)   # dist. optimizer
    # a gradient reduction set to bf16 (--grad-reduce-in-bf16): Megatron's buffer is bf16 too
    assert state_bytes("bf16", 1, 8, "megatron", 2)[1] == 2 and state_bytes("bf16", 1, 8, "deepspeed", 4)[1] == 2
    assert sum(state_bytes("bf16", 1, 8, "deepspeed")) == pytest.approx(4 + 12 / 8)
    assert sum(state_bytes("bf16", 2, 8, "deepspeed")) == pytest.approx(2 + 14 / 8)
    assert sum(state_bytes("bf16", 3, 8, "deepspeed")) == pytest.approx(16 / 8)
    for z in range(4):                                                        # 'any' = the larger
        assert sum(state_bytes("bf16", z, 4)) == max(sum(state_bytes("bf16", z, 4, r))
                                                     for r in ("megatron", "deepspeed"))
    # Apex DistributedFusedAdam with store_param_remainders (NeMo's distributed_fused_adam on a
    # bf16 model): the fp32 master is a 2-byte remainder of the shard, 10 optimizer bytes not 12
    assert state_bytes("bf16", 1, 8, "megatron", 2, True) == pytest.approx((2, 2, 10 / 8))
    assert state_bytes("bf16", 0, 1, "megatron", None, True)[2] == 10
    for prec in ("fp32", "fp16"):                                             # bf16 models only
        assert state_bytes(prec, 1, 8, "megatron", None, True) == state_bytes(prec, 1, 8, "megatron")


def test_distributed_fused_adam_is_an_optimizer_switch_of_memory_not_time(capsys):
    """`--optimizer distributed-fused-adam` (cost/engines.py) charges the remainder optimizer's
    10 bytes per locally held parameter in the model-state tables, the same step time as the
    fused optimizer, and `cost` accepts it like the other stack switches."""
    import json
    from ds_autoplan.cli import main
    from ds_autoplan.cost.engines import get_execution
    from ds_autoplan.cost.model import CostModel
    m, c = load_model("gpt3-1.3b"), load_cluster("8xh100-80gb")
    s = Strategy(1, 8, 1)
    cms = {o: CostModel(m, c, "bf16", "megatron", execution=get_execution("megatron-core", optimizer=o))
           for o in ("fused", "distributed-fused-adam")}
    tabs = {o: cm.tables([s], 16) for o, cm in cms.items()}
    u = next(i for i, x in enumerate(cms["fused"].units) if x.params > 0)
    W = cms["fused"].units[u].params
    assert tabs["fused"].ms[u, 0] - tabs["distributed-fused-adam"].ms[u, 0] == pytest.approx(W * 2 / 8)
    assert tabs["fused"].fwd[u, 0] == tabs["distributed-fused-adam"].fwd[u, 0]
    args = ["cost", "--model", "gpt3-1.3b", "--cluster", "8xh100-80gb", "--global-batch", "16", "--runtime",
            "megatron", "--config", "tp=1,pp=1,mbs=2,zero=1", "--json"]
    out = {}
    for o in ("fused", "distributed-fused-adam"):
        assert main([*args, "--optimizer", o]) == 0
        out[o] = json.loads(capsys.readouterr().out)["yours"]
    assert "optimizer distributed-fused-adam" in out["distributed-fused-adam"]["execution"]
    assert out["distributed-fused-adam"]["iteration_time_s"] == pytest.approx(out["fused"]["iteration_time_s"])
    saved = out["fused"]["peak_memory_gb"][0] - out["distributed-fused-adam"]["peak_memory_gb"][0]
    # 2 bytes of each parameter's 8-way shard: 0.31 GB for the model's parameters, 0.33 as costed
    # (the untied output-layer copy counted on the last stage; rounded peaks)
    assert saved == pytest.approx(m.total_params * 2 / 8 / 2 ** 30, rel=0.1)


DS_PROBE = textwrap.dedent('''
    import os, sys, torch, deepspeed
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    deepspeed.init_distributed("gloo")
    for stage in (0, 1):
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
        n = sum(p.numel() for p in model.parameters())
        cfg = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
               "zero_optimization": {"stage": stage},
               "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}
        eng, opt, _, _ = deepspeed.initialize(model=model, config=cfg)
        for _ in range(2):                 # the second backward: Adam state exists, grads held
            loss = eng(torch.randn(2, 64, dtype=torch.bfloat16)).float().pow(2).mean()
            eng.backward(loss)
            if _ == 0:
                eng.step()
        seen = {}
        def add(t):
            if isinstance(t, torch.Tensor) and t.numel():
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        def walk(v, depth=0):
            if isinstance(v, torch.Tensor): add(v)
            elif isinstance(v, (list, tuple)) and depth < 3:
                for x in v: walk(x, depth + 1)
            elif isinstance(v, dict) and depth < 3:
                for x in v.values(): walk(x, depth + 1)
        for p in eng.module.parameters():
            add(p); add(p.grad)
        o = eng.optimizer
        for name in vars(o):
            walk(getattr(o, name))
        walk(list(o.optimizer.state.values()))
        print(stage, sum(seen.values()) / n)
''')


@pytest.mark.multiproc
def test_deepspeed_bf16_holds_what_the_accounting_says(tmp_path):
    """The installed DeepSpeed's bf16 optimizers, with gradients and Adam state live, hold the
    bytes per parameter cost/memory.py charges for d = 1 (2 + 2 + 12 without ZeRO and ZeRO-1)."""
    script = tmp_path / "probe.py"
    script.write_text(DS_PROBE)
    out = subprocess.run([sys.executable, str(script), str(29500 + os.getpid() % 1000)], capture_output=True,
                         text=True, timeout=600, cwd=tmp_path)
    lines = [ln.split() for ln in out.stdout.splitlines() if ln[:2] in ("0 ", "1 ")]
    assert len(lines) == 2, out.stdout + out.stderr
    for stage, bpp in lines:
        assert float(bpp) == pytest.approx(sum(state_bytes("bf16", int(stage), 1, "deepspeed")), abs=0.1)


def test_zero1_step_and_gather_are_exposed():
    """The Adam step streams the rank's optimizer shard; ZeRO-1 gathers the updated parameters
    after it: both are in the sync-step time (bwd - bwd_ns), never hidden by the backward."""
    m = load_model("gpt3-1.3b")
    c = load_cluster("8xa100-80gb")
    cm = CostModel(m, c)
    s0, s1 = Strategy(1, 8, 0), Strategy(1, 8, 1)
    t = cm.tables([s0, s1], 8)
    blk = 2
    W = m.layers[0].params
    step0 = cm.step_time(W)
    step1 = cm.step_time(W / 8)
    gather = cm.net.all_gather(W * 2, 8)
    assert step0 > 0 and step1 == pytest.approx(step0 / 8)
    tail1 = t.bwd[blk, 1] - t.bwd_ns[blk, 1]
    assert tail1 >= gather + step1
    # the engines as emitted reduce after the backward: the whole all-reduce is exposed;
    # overlapping it with the last backward (Galvatron §2.4) hides most of it
    assert t.bwd[blk, 0] - t.bwd_ns[blk, 0] == pytest.approx(cm.net.all_reduce(W * 2, 8) + step0)
    ovl = CostModel(m, c, overlap_grad_reduce=True).tables([s0], 8)
    assert ovl.bwd[blk, 0] - ovl.bwd_ns[blk, 0] < t.bwd[blk, 0] - t.bwd_ns[blk, 0]


# -- hierarchical collectives -----------------------------------------------------------------
def test_strided_group_pays_one_rail_contiguous_splits_over_the_node():
    c = load_cluster("64xa100-80gb")
    net = Network(c)
    X = 1e9
    assert net.layout(4, 1) == (4, 1) and net.layout(4, 8) == (1, 4) and net.layout(16, 1) == (8, 2)
    inside = net.all_reduce(X, 4, 1)
    strided = net.all_reduce(X, 4, 8)
    assert inside == pytest.approx(2 * 3 / 4 * X / (c.intra_node_GBps * 1e9) + c.intra_latency_us * 1e-6)
    assert strided == pytest.approx(2 * 3 / 4 * X / (c.rail_GBps * 1e9) + c.inter_latency_us * 1e-6)
    # 16 ranks on 2 nodes: NVLink inside, then each of the 8 rails carries 1/8 of the tensor
    two_nodes = net.all_reduce(X, 16, 1)
    assert two_nodes == pytest.approx(2 * 7 / 8 * X / (c.intra_node_GBps * 1e9) + 2 * 1 / 2 * X / 8 / (c.rail_GBps * 1e9)
                                      + (c.intra_latency_us + c.inter_latency_us) * 1e-6)
    assert inside < two_nodes < net.all_reduce(X, 16, 8) and strided > 1.5 * net.all_reduce(X, 4, 2)


# -- closed-form configuration cost ---------------------------------------------------------------
def test_closed_form_matches_eq9_for_balanced_1f1b():
    """No interleaving, even stages: T = (m + p - 1) t_mb + tail; in-flight micro-batches of
    1F1B rank r are min(p - r, m); interleaving divides the bubble by v."""
    m = load_model("gpt3-1.3b")
    cm = CostModel(m, load_cluster("8xa100-80gb"))
    c1 = config_cost(cm, Config(tp=2, pp=4, num_microbatches=16, recompute="full"))
    assert c1.time == pytest.approx(16 * c1.per_microbatch + 3 * c1.per_microbatch + c1.tail)
    c2 = config_cost(cm, Config(tp=2, pp=4, num_microbatches=16, recompute="full", chunks=2))
    assert c2.bubble == pytest.approx(3 / 2 * c2.per_microbatch)
    # stashes along the builders' order, equal stages: 1F1B rank r holds min(p - r, m)
    # micro-batches, Megatron's interleaving 2 (p - r - 1) + (v - 1) p + 1 chunk micro-batches
    # (megatron/training/theoretical_memory_usage.py: p (1 + (p - 1) / (p v)) on rank 0)
    assert list(stash_peaks(4, 16, 1, [1.0] * 4)) == [4, 3, 2, 1]
    assert list(stash_peaks(4, 2, 1, [1.0] * 4)) == [2, 2, 2, 1]
    assert list(stash_peaks(4, 16, 2, [1.0] * 8)) == [2 * (4 - r - 1) + 4 + 1 for r in range(4)]
    assert stash_peaks(8, 16, 12, [1.0] * 96)[0] == pytest.approx(12 * 8 * (1 + 7 / 96))
    # the last rank runs its last chunk's backward right after the forward: that chunk's
    # stash (the head's logits) is held once, not (v - 1) p / v + 1 / v times
    act = [1.0] * 7 + [100.0]
    assert stash_peaks(4, 16, 2, act)[3] == 4 * 1.0 + 100.0
    assert split_layers(105, 35) == [3] * 35 and sum(split_layers(10, 4)) == 10


def test_published_runs_within_issue_bounds():
    """bench/published_runs.py's cost side, with the shipped calibration: median |throughput
    error| <= 5%, max <= 10% over three stacks, and no published configuration called
    infeasible."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import published_runs as pr
    finally:
        sys.path.pop(0)
    from ds_autoplan.cost.compute import calibration
    cal = calibration()["sustained"]
    errs = []
    rows = [r for r in pr.load_rows() if r.get("costed", True)]
    for r in rows:
        kind = pr.kind_of(r)
        (cfg, c), _, _ = pr.cost_published(r, cal.get(kind))
        assert c.fits, r["id"]
        errs.append(abs(pr.published_time(r) / c.time - 1))
    assert len({r["execution"] for r in rows}) >= 3 and len({r["source_id"] for r in rows}) >= 3
    assert np.median(errs) <= 0.05 and max(errs) <= 0.10


# -- headroom ------------------------------------------------------------------------------------
def test_headroom_default_flag_and_report(tmp_path, capsys):
    """A cluster-derived budget keeps 5% of device memory free by default; an explicit
    --memory-budget-gb is a cap (no default headroom); --headroom-gb sets it; plan and report
    show it, and the plan's peak stays under the budget."""
    from ds_autoplan.cost.memory import usable_budget
    from ds_autoplan.spec.cluster import GB
    c = load_cluster("8xa100-80gb")
    assert usable_budget(c) == (pytest.approx((80 - 4 - 4) * GB), 4.0)
    assert usable_budget(c, budget_gb=30) == (pytest.approx(30 * GB), 0.0)
    assert usable_budget(c, headroom_gb=10)[0] == pytest.approx(66 * GB)
    with pytest.raises(SpecError, match="headroom"):
        usable_budget(c, headroom_gb=-1)
    with pytest.raises(SpecError, match="leaves no budget"):
        usable_budget(c, budget_gb=2, headroom_gb=3)
    from ds_autoplan.cli import main
    assert main(["plan", "--model", "gpt3-1.3b", "--cluster", "8xa100-80gb", "--global-batch", "64",
                 "--no-wide", "--headroom-gb", "10", "--out", str(tmp_path)]) == 0
    assert "/ 66.0 GB (headroom 10.0 GB kept free" in capsys.readouterr().out
    assert "headroom 10.0 GB" in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize("P,t,d,z,m,B_m", [(4, 2, 2, 0, 32, 4), (2, 4, 2, 1, 16, 8), (8, 2, 1, 0, 64, 2)])
def test_closed_form_agrees_with_the_planners_simulation(P, t, d, z, m, B_m):
    """The published-runs bench costs configurations in closed form; the planner simulates
    them.  For uniform 1F1B with full recompute on an even split they agree: time within 2%,
    peak memory exactly."""
    from ds_autoplan.search.planner import Planner
    pl = Planner(load_model("gpt3-13b"), load_cluster("2x8xa100-ib200"), 256)
    par = Config(tp=t, pp=P, dp=d, micro_batch=B_m // d, num_microbatches=m, zero=z, sp=True,
                 recompute="full")
    e = pl.evaluate(par, ckpt="full", partitioner="even", schedules=["1f1b"])
    c = config_cost(pl.cm, par, pl.E)
    assert c.time == pytest.approx(e.time, rel=0.02)
    assert max(c.peak) == pytest.approx(max(e.peak), rel=1e-6)


@pytest.mark.parametrize("P,v,m,sp", [(4, 2, 8, True), (4, 3, 12, False), (2, 4, 4, True)])
def test_closed_form_interleaved_memory_is_the_simulators(P, v, m, sp):
    """Megatron's interleaving, no recompute, even chunks: the closed form's per-rank peaks
    (stashes counted along the builder's order, the head's logits on the last chunk held for
    one micro-batch) are the planner's simulated ones, rank by rank."""
    from ds_autoplan.search.pipeline import _evaluate, stage_figures
    from ds_autoplan.search.planner import Planner
    pl = Planner(load_model("gpt3-1.3b"), load_cluster("8xa100-80gb"), 64)
    par = Config(tp=2, pp=P, dp=1, micro_batch=1, num_microbatches=m, sp=sp, chunks=v)
    ctx = pl.ctx_of(par, pl.exec_strats(par, False))
    parts = tuple(split_layers(pl.L, P * v))
    figs = stage_figures(ctx.__class__(ctx.cm, ctx.strategies, P * v, ctx.m, ctx.B_m, ctx.E, ctx.units),
                         parts, [0] * len(ctx.seq), [0] * len(ctx.seq))
    e = _evaluate(ctx, "interleaved", parts, [0] * (P * v), figs)
    c = config_cost(pl.cm, par, pl.E)
    assert c.peak == pytest.approx(e.peak, rel=1e-9)


def test_embedding_stash_is_megatrons_count():
    """The embedding stashes its token ids and its dropout mask (Megatron-LM's
    theoretical_memory_usage.py: 8 s b + s b h per micro-batch); its output is the first
    block's input, counted there once."""
    gpt, llama = load_model("gpt3-1.3b"), load_model("llama2-7b")
    for m, drop in ((gpt, True), (llama, False)):
        s, h = m.seq_len, m.hidden
        assert (m.pre.act_rep, m.pre.act_tp) == (8 * s + (s * h if drop else 0), 0.0)
        assert m.layers[0].act_rep >= 2 * s * h          # the block keeps its input


def test_deepspeed_keeps_each_in_flight_stage_output():
    """DeepSpeed's PipelineEngine holds every in-flight micro-batch's stage output
    (pipe_buffers['outputs'], freed after its backward); Megatron-LM frees it once sent
    (deallocate_pipeline_outputs).  fp32: both engines hold 16 B per parameter, so the peaks
    differ by exactly that: rank r of 1F1B holds min(p - r, m) outputs, the last stage none;
    the planner's simulation and the closed form agree."""
    from ds_autoplan.search.planner import Planner
    model, cluster = load_model("gpt3-1.3b"), load_cluster("8xa100-80gb")
    par = Config(tp=2, pp=4, dp=1, micro_batch=2, num_microbatches=8, recompute="full")
    out = 2 * model.seq_len * model.hidden * 2 * 2       # mbs 2, boundary 2 s h, fp32 x 2
    peaks = {}
    for rt in ("megatron", "deepspeed"):
        c = config_cost(CostModel(model, cluster, "fp32", rt), par)
        pl = Planner(model, cluster, 16, precision="fp32", runtime=rt)
        e = pl.evaluate(par, ckpt="full", partitioner="even", schedules=["1f1b"])
        assert c.peak == pytest.approx(e.peak, rel=1e-9)
        peaks[rt] = np.array(c.peak)
    assert peaks["deepspeed"] - peaks["megatron"] == pytest.approx([4 * out, 3 * out, 2 * out, 0.0])


def test_activation_stash_matches_the_measured_gpu_blocks():
    """bench/data/gpu_memory_h100.json (bench/gpu_memory_check.py measure, on an H100): the
    bytes six GPT / LLaMA blocks on their TP shard keep for the backward, against the model's
    act_rep + act_tp / t; within 1% (measured: 0.23% at most)."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import gpu_memory_check as g
    finally:
        sys.path.pop(0)
    res = g.compare([os.path.join(ROOT, "bench", "data", "gpu_memory_h100.json")])
    assert len(res["cases"]) == 6 and res["max_abs_error"] <= 0.01
