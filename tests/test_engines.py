"""Engine execution models (cost/engines.py): DeepSpeed's TrainSchedule step map equals the
library's, the lock-step recurrence's closed cases, and what each engine exposes."""
import numpy as np
import pytest

from ds_autoplan.cost.engines import ENGINES, get_execution, lockstep_time, trainschedule_steps
from ds_autoplan.cost.iteration import Config, config_cost
from ds_autoplan.cost.model import CostModel, Strategy
from ds_autoplan.spec import SpecError, load_cluster, load_model


@pytest.mark.parametrize("m,P", [(1, 2), (4, 2), (8, 4), (5, 3), (3, 5)])
def test_step_map_is_deepspeeds(m, P):
    from deepspeed.runtime.pipe.schedule import BackwardPass, ForwardPass, TrainSchedule
    fwd, valid, _ = trainschedule_steps(m, P)
    for s in range(P):
        for k, cmds in enumerate(TrainSchedule(m, P, s).steps()):
            kinds = {type(c) for c in cmds}
            assert (ForwardPass in kinds) == bool(fwd[k, s] and valid[k, s]), (k, s)
            assert (BackwardPass in kinds) == bool(not fwd[k, s] and valid[k, s]), (k, s)


def test_lockstep_uniform_stages_is_1f1b_and_p2p_adds_per_step():
    """Uniform stages and free links: (m + P - 1)(f + b), the 1F1B makespan; each step's two
    blocking transfers add to its critical path; a slow stage paces every step it is in."""
    f, b = np.ones(4), 3 * np.ones(4)
    assert lockstep_time(f, b, np.zeros(4), 8) == pytest.approx((8 + 3) * 4)
    with_p2p = lockstep_time(f, b, 0.1 * np.ones(4), 8)
    assert with_p2p > (8 + 3) * 4 + 0.1 * 8
    slow = lockstep_time(np.array([1, 2, 1, 1.]), np.array([3, 6, 3, 3.]), np.zeros(4), 8)
    assert slow >= 8 * 8


def test_engines_expose_what_they_serialise():
    """DeepSpeed's bf16 ZeRO-1 all-reduces gradients (2x a reduce-scatter) and sends whole
    activations from every TP rank; Megatron-LM reduces bf16 gradients in fp32; overlap
    switches hide the reduction; FSDP hides the forward all-gather behind compute."""
    m = load_model("gpt3-1.3b")
    c = load_cluster("64xa100-80gb")
    s1 = Strategy(2, 8, 1)
    blk = 2
    sync = {e: (lambda t: t.bwd[blk, 0] - t.bwd_ns[blk, 0])(CostModel(m, c, execution=e).tables([s1], 16))
            for e in ("any", "deepspeed", "megatron-core")}
    assert sync["deepspeed"] > sync["any"] and sync["megatron-core"] > sync["any"]
    ov = CostModel(m, c, execution=get_execution("megatron-core", "grad-reduce,param-gather")).tables([s1], 16)
    assert ov.bwd[blk, 0] - ov.bwd_ns[blk, 0] < sync["megatron-core"]
    ds, mg = CostModel(m, c, execution="deepspeed"), CostModel(m, c, execution="megatron-core")
    assert ds.tables([s1], 16).p2p[blk, 0] > mg.tables([s1], 16).p2p[blk, 0]
    s3 = Strategy(1, 8, 3)
    fs, plain = CostModel(m, c, execution="fsdp").tables([s3], 8), CostModel(m, c).tables([s3], 8)
    assert fs.fwd[blk, 0] < plain.fwd[blk, 0]
    assert config_cost(CostModel(m, c, execution="deepspeed"), Config(tp=1, pp=4, dp=2, micro_batch=1, num_microbatches=8, zero=1)).time > 0


def test_unknown_engine_or_overlap_is_a_clear_error():
    with pytest.raises(SpecError, match="unknown execution model"):
        get_execution("colossal")
    with pytest.raises(SpecError, match="unknown overlap"):
        get_execution("megatron-core", "everything")
    assert set(ENGINES) >= {"deepspeed", "megatron-core", "megatron-2021", "fsdp", "any"}


def test_cost_and_plan_take_the_engine_and_print_its_band(capsys, tmp_path):
    """`cost --execution/--overlap` cost under that engine's execution model and print the
    cross-validated error band stored by bench/published_runs.py; overlapping the gradient
    reduction is never slower; a wrong switch is one clear error."""
    from ds_autoplan.cli import main
    from ds_autoplan.cost.compute import calibration
    import json
    args = ["--model", "gpt3-1.3b", "--cluster", "2x8xa100-ib200", "--global-batch", "64",
            "--config", "tp=2,pp=2,mbs=2,zero=1,schedule=1f1b", "--json"]
    times = {}
    for ov in ("no-grad-reduce", "grad-reduce,param-gather"):
        assert main(["cost", *args, "--execution", "megatron-core", "--overlap", ov]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["yours"]["execution"].startswith("megatron-core")
        assert out["yours"]["error_band"] == dict(calibration()["bands"]["megatron-core"], over="megatron-core")
        times[ov] = out["yours"]["iteration_time_s"]
    assert times["grad-reduce,param-gather"] < times["no-grad-reduce"]
    assert main(["cost", *args[:-1], "--runtime", "deepspeed"]) == 0
    text = capsys.readouterr().out
    assert "execution model: deepspeed" in text and "leave-one-source-out" in text
    assert main(["cost", *args, "--overlap", "everything"]) != 0
    assert "unknown overlap" in capsys.readouterr().err
    assert main(["plan", *args[:6], "--runtime", "megatron", "--no-wide", "--quiet",
                 "--out", str(tmp_path / "p")]) == 0
    assert "execution model megatron-core" in capsys.readouterr().out
    report = (tmp_path / "p" / "report.md").read_text()
    assert "Execution model: megatron-core" in report and "leave-one-source-out" in report


def test_leave_one_source_out_never_sees_the_left_out_source():
    """bench/published_runs.py: calibrating a kind puts its median log error at zero; a source
    left out is predicted from the other sources' calibration, and a kind no other source has
    falls back to its per-kind prior (data/gpus.yaml)."""
    import math
    import os
    import statistics
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    try:
        import published_runs as pr
    finally:
        sys.path.pop(0)
    from ds_autoplan.cost.compute import gpu_kinds
    rows = [r for r in pr.load_rows() if r["id"] in ("mpt-7b-h100", "mpt-13b-h100", "bloom-176B", "mpt-7b-a100")]
    cfgs = {r["id"]: pr.cost_published(r)[0][0] for r in rows}
    prior = {k: g.sustained for k, g in gpu_kinds(calibrated=False).items()}
    full, infile, loso = pr.cross_validate(rows, cfgs, prior)
    h100 = [r for r in rows if pr.kind_of(r) == "h100-sxm-80gb"]
    assert abs(statistics.median(math.log(1 + infile[r["id"]]) for r in h100)) < 1e-3
    for r in h100:                    # only mpt2023 has H100 rows: left out, the prior predicts
        assert loso[r["id"]] == pytest.approx(pr.error(r, prior, cfgs[r["id"]]))
    bloom = next(r for r in rows if r["id"] == "bloom-176B")   # A100 from mpt2023's A100 row only
    cal = pr.calibrate([r for r in rows if r["source_id"] != "bloom2022"], cfgs, prior)
    assert loso["bloom-176B"] == pytest.approx(pr.error(bloom, cal, cfgs["bloom-176B"]))
    assert cal["a100-sxm-80gb"] != full["a100-sxm-80gb"]


def test_flash_attention_rate_follows_the_measured_table_by_length():
    """Kinds with a measured flash table (data/gpus.yaml flash_tflops_by_seq) run a causal
    kernel at the table's rate for its length (the full-count FLOPs halved), clamped at the
    ends and monotone between; kinds without one keep flash_eff of peak."""
    from ds_autoplan.cost.compute import get_gpu
    h = get_gpu("h100-sxm-80gb")
    table = dict(h.flash_seq)
    rate = lambda s: 3.5e12 / 2 / h.fused_attention(1e12, s) / 1e12   # noqa: E731
    for s, r in table.items():
        assert rate(s) == pytest.approx(r)
    assert rate(256) == pytest.approx(table[min(table)]) and rate(1 << 20) == pytest.approx(table[max(table)])
    assert table[2048] < rate(3000) < table[4096]
    fwd = dict(h.flash_fwd_seq)
    for s in table:                   # forward at its own rate, the backward takes the rest
        assert 1e12 / 2 / h.fused_attention(1e12, s, "fwd") / 1e12 == pytest.approx(fwd[s])
        assert h.fused_attention(1e12, s, "fwd") + h.fused_attention(1e12, s, "bwd") == \
            pytest.approx(h.fused_attention(1e12, s))
        assert h.fused_attention(1e12, s, "bwd") / 2.5 > h.fused_attention(1e12, s, "fwd")
    a = get_gpu("a100-sxm-80gb")
    assert not a.flash_seq and a.fused_attention(1e12, 2048, "fwd") == pytest.approx(1 / (a.peak_tflops * a.flash_eff))


def test_shipped_calibration_is_the_benchs_and_loso_holds_where_a_kind_has_two_sources():
    """data/calibration.json is what bench/published_runs.py computes from the data file (no
    stale constant ships).  Leave-one-source-out error within the published-runs bounds (median <= 7%,
    max <= 15%) for the rows whose GPU kind another source also covers -- A100 and H100, whose
    two stacks (MosaicML 2023, NVIDIA NeMo 2024) are told apart by their attention kernels and
    optimizer (execution attributes), not by a per-row constant."""
    import os
    import statistics
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    try:
        import published_runs as pr
    finally:
        sys.path.pop(0)
    from ds_autoplan.cost.compute import calibration, gpu_kinds
    rows = [r for r in pr.load_rows() if r.get("costed", True)]
    cfgs = {r["id"]: pr.cost_published(r)[0][0] for r in rows}
    prior = {k: g.sustained for k, g in gpu_kinds(calibrated=False).items()}
    full, infile, loso = pr.cross_validate(rows, cfgs, prior)
    shipped = calibration()
    assert {k: v for k, v in full.items() if v != prior[k]} == shipped["sustained"]
    assert pr.bands(rows, loso) == shipped["bands"]
    sources = {}
    for r in rows:
        sources.setdefault(pr.kind_of(r), set()).add(r["source_id"])
    e = [abs(loso[r["id"]]) for r in rows if len(sources[pr.kind_of(r)]) >= 2]
    assert len(e) >= 15 and statistics.median(e) <= 0.07 and max(e) <= 0.15
    assert len(sources["h100-sxm-80gb"]) >= 2 and len(sources["a100-sxm-80gb"]) >= 2
    assert len({r["execution"] for r in rows}) >= 3 and len({r["source_id"] for r in rows}) >= 3


def test_measured_h100_prior_predicts_a_second_h100_stack():
    """The H100 per-kind prior (data/gpus.yaml, measured on a lent H100, never fitted to a
    training run) predicts NVIDIA's published NeMo Nemotron-4 340B step times (bench data,
    source nemotron4_dgxc2024: 128-2048 DGX H100 GPUs, TP 8 PP 8 VP 12, bf16 gradient sync)
    within the in-file bound (10%) with no calibration, under the megatron-core execution
    model with the recipe's FlashAttention-2 back-end and selective recompute (2026-11-26: published 1.8-5.8% slower); the rows' published gradient-sync
    dtype reaches the execution model and the memory model's gradient buffer, their optimizer
    (distributed_fused_adam) its optimizer bytes."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    try:
        import published_runs as pr
    finally:
        sys.path.pop(0)
    rows = [r for r in pr.load_rows() if r["source_id"] == "nemotron4_dgxc2024"]
    assert len(rows) == 5
    model, cluster = pr.setup(rows[0])
    assert pr.cost_model(rows[0], model, cluster).execution.grad_bytes == 2
    # ... and sizes Megatron's gradient buffer: the data-parallel-4 row fits the planner's budget
    # with the published bf16 buffer and the recipe's optimizer, not with fp32 main gradients
    # and a 4-byte master
    from ds_autoplan.cost.memory import usable_budget
    r256 = next(r for r in rows if r["gpus"] == 256)
    bf16, fp32 = (max(pr.cost_published(x)[0][1].peak) for x in
                  (r256, {**r256, "grad_reduce_dtype": "fp32", "optimizer": "fused"}))
    assert bf16 <= usable_budget(cluster)[0] < fp32
    # the recipe's distributed_fused_adam (NeMo: Apex DistributedFusedAdam, store_param_remainders
    # for a bf16 model) keeps 2-byte master remainders: data-parallel 2 fits the H100's measured
    # limit (74.1 GB of 76.9; 79.5 with a 4-byte master) though not the planner's 72 GB budget
    assert all(pr.cost_model(r, model, cluster).execution.master_remainders for r in rows)
    r128 = next(r for r in rows if r["gpus"] == 128)
    (_, c), cl, _ = pr.cost_published(r128)
    (_, c4), _, _ = pr.cost_published({**r128, "optimizer": "fused"})
    assert c.fits and not c4.fits and max(c.peak) > usable_budget(cl)[0]
    for r in rows:
        (cfg, c), _, n = pr.cost_published(r)
        assert n == 1 and (cfg.chunks, cfg.micro_batch, cfg.dp) == (12, 1, r["gpus"] // 64)
        assert abs(pr.published_time(r) / c.time - 1) <= 0.10, r["id"]


def test_moe_and_context_parallel_rows_cost_their_published_configuration():
    """The published mixture-of-experts / context-parallel runs (bench data, source
    grok1_dgxc2024: NVIDIA's Grok-1 314B step times, EP 2-8, CP 1-2, 8-2048 H100) are costed
    with their own degrees: the expert and context degrees reach the configuration (data
    parallelism = GPUs / (tp pp cp), experts regrouped over the stage's ranks), the runs'
    capacity factor 1.0 with padding is the router imbalance (every expert holds exactly its
    capacity), every published configuration fits, and with the stack's unfused token dispatch
    (moe_dispatch: unfused, megatron-core 0.9; measured on the lent H100) and the shipped
    calibration the prediction is within the in-file bound (10%): costed (2026-11-26: -5.8..+5.5%;
    with the fused dispatch they ran up to 12% longer than predicted).  DeepSeek-V3's per-GPU
    token rate converts to a step time and is recorded, not costed."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    try:
        import published_runs as pr
    finally:
        sys.path.pop(0)
    from ds_autoplan.cost.compute import calibration
    sustained = calibration()["sustained"]["h100-sxm-80gb"]
    rows = [r for r in pr.load_rows() if r["source_id"] == "grok1_dgxc2024"]
    assert len(rows) == 9 and all(r.get("costed", True) and r["moe_dispatch"] == "unfused" for r in rows) and {r["ep"] for r in rows} == {2, 4, 8} and {r["cp"] for r in rows} == {1, 2}
    for r in rows:
        (cfg, c), cluster, n = pr.cost_published(r)
        assert n == 1 and (cfg.tp, cfg.pp, cfg.cp, cfg.ep, cfg.chunks) == (r["tp"], r["pp"], r["cp"], r["ep"], r["chunks"])
        assert cfg.dp == r["gpus"] // (r["tp"] * r["pp"] * r["cp"]) and cfg.world_size == r["gpus"]
        assert cfg.expert_dp * cfg.ep * cfg.etp == cfg.tp * cfg.cp * cfg.dp
        model, _ = pr.setup(r)
        assert model.seq_len == (4096 if r["gpus"] <= 32 else 8192) and model.num_layers == r["layers"]
        assert pr.cost_model(r, model, cluster).moe_imbalance == 1.0
        assert c.fits, r["id"]
        (_, c), _, _ = pr.cost_published(r, sustained, cfg)
        assert abs(pr.published_time(r) / c.time - 1) <= 0.10, r["id"]
        # the fused dispatch (today's megatron-core with --moe-permute-fusion) costs it less
        (_, c_fused), _, _ = pr.cost_published({**r, "moe_dispatch": "fused"}, sustained, cfg)
        assert c_fused.time < c.time
    # the default imbalance (1.1) costs the same configuration more
    r = next(r for r in rows if r["gpus"] == 32)
    (cfg, c), _, _ = pr.cost_published(r)
    (_, c_def), _, _ = pr.cost_published({k: v for k, v in r.items() if k != "moe_capacity_factor"}, cfg=cfg)
    assert c_def.time > c.time
    ds = next(r for r in pr.load_rows() if r["id"] == "dsv3-671B-2048")
    assert not ds.get("costed", True) and "FP8" in ds["not_costed"]
    assert pr.published_time(ds) == pytest.approx(15360 * 4096 / (2048 * 1543.2))


def test_unfused_moe_dispatch_is_the_h100_measurement():
    """The unfused token dispatch of megatron-core 2024 (cost/engines.py UNFUSED_DISPATCH_BYTES)
    is the one-GPU measurement stored from the lent H100 (bench/data/gpu_moe_h100.json,
    bench/gpu_moe_local.py at Grok-1's shapes): costed for one local expert's 8192 token copies
    of 1536 elements it reproduces the measured forward + backward within 2%, and it scales with
    the token copies, not the local experts; the measurement also shows why the experts stay
    costed as one grouped GEMM -- megatron-core's per-expert loop (SequentialMLP) ran within 5%
    of the batched GEMM for 1, 2 and 4 local experts -- and the cost is added only for
    the unfused stack, forward one third, backward two thirds."""
    import json
    import os
    from ds_autoplan.cost.compute import get_gpu
    from ds_autoplan.cost.engines import UNFUSED_DISPATCH_BYTES
    from ds_autoplan.cost.model import CostModel
    from ds_autoplan.spec import load_cluster, load_model
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "data",
                        "gpu_moe_h100.json")
    with open(path) as f:
        m = json.load(f)
    assert "H100" in m["device"]
    sh = m["shapes"]
    copies, width = sh["tokens"] * sh["topk"], sh["hidden"] // sh["tp"]
    g = get_gpu("h100-sxm-80gb")
    one = next(d for d in m["dispatch"] if d["nloc"] == 1)["dispatch_local_s"]
    assert g.stream(UNFUSED_DISPATCH_BYTES * copies * width) == pytest.approx(one, rel=0.02)
    for e in m["experts"]:
        assert e["experts_loop_s"] == pytest.approx(e["experts_bmm_s"], rel=0.05), e["nloc"]
    model = load_model({"name": "moe", "arch": "llama", "num_layers": 2, "hidden": 1024, "heads": 8,
                        "ffn": 4096, "moe_ffn": 4096, "num_experts": 8, "moe_topk": 2, "seq_len": 2048,
                        "vocab": 32000, "flash_attention": True})
    cl = load_cluster("8xh100-80gb")
    u = next(x for x in model.layers if x.expert_params)
    k = {(d, ep): CostModel(model, cl, "bf16", execution=get_execution("megatron-core", moe_dispatch=d)).unit_times(
        u, 1, 4, True, ep, 4) for d in ("fused", "unfused") for ep in (2, 8)}
    d = g.stream(UNFUSED_DISPATCH_BYTES * 2048 * 2 * 1024 / 4)     # s topk h / t per sample
    for ep in (2, 8):                                              # 4 and 1 local experts
        assert k["unfused", ep].fwd - k["fused", ep].fwd == pytest.approx(d / 3)
        assert k["unfused", ep].bwd - k["fused", ep].bwd == pytest.approx(2 * d / 3)
    with pytest.raises(SpecError, match="MoE token dispatch"):
        get_execution("megatron-core", moe_dispatch="fast")


def test_context_parallel_llama31_runs_are_costed_within_the_bounds():
    """Context parallelism against published runs (bench data, source llama31_dgxc2024:
    NVIDIA's NeMo 24.09 Llama 3.1 8B/70B/405B step times, CP 2 at 8192 tokens, 8-2304 H100,
    17 rows): each published configuration is costed with its own degrees (data parallelism
    = GPUs / (tp pp cp), the published interleaving) and its stack's attention kernel (cuDNN,
    configure.sh NVTE_FUSED_ATTN=1); every row fits the H100's measured allocatable memory
    (bench/published_runs.device_limit; two of them, 8B on 8 GPUs at 76.1 GB and 405B on 576 at
    74.9 GB, lie over the planner's 72 GB budget, whose headroom is policy for its own plans) and
    is in the errors: with the shipped H100 calibration every one within the in-file bound (10%;
    measured 2026-11-26: -5.4..+5.8%)."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    try:
        import published_runs as pr
    finally:
        sys.path.pop(0)
    from ds_autoplan.cost.compute import calibration
    rows = [r for r in pr.load_rows() if r["source_id"] == "llama31_dgxc2024"]
    assert len(rows) == 17 and {r["cp"] for r in rows} == {2}
    assert all(r.get("costed", True) for r in rows)
    from ds_autoplan.cost.memory import usable_budget
    from ds_autoplan.spec.cluster import GB
    cal = calibration()["sustained"]["h100-sxm-80gb"]
    over_planner = set()
    for r in rows:
        model, cluster = pr.setup(r)
        assert pr.cost_model(r, model, cluster).execution.attention == "cudnn"
        (cfg, c), _, n = pr.cost_published(r, cal)
        assert n == 1 and cfg.cp == 2 and cfg.dp == r["gpus"] // (r["tp"] * r["pp"] * 2)
        assert cfg.chunks == r["chunks"] and cfg.global_batch == r["batch"]
        assert c.fits, r["id"]
        assert abs(pr.published_time(r) / c.time - 1) <= 0.10, r["id"]
        if max(c.peak) > usable_budget(cluster)[0]:
            over_planner.add(r["id"])
    assert over_planner == {"l31-8B-8", "l31-405B-576"}
    assert 74 * GB < pr.device_limit(pr.setup(rows[0])[1]) < 77 * GB


def test_published_feasibility_is_the_measured_device_limit_not_the_planner_budget():
    """A published configuration is judged against the device's measured allocatable memory
    (bench/data/gpu_memory_h100.json: (total - outside the allocator) / reserved-over-allocated
    peak = 76.86 GiB on an H100), the planner's own plans against its budget (80 less reserve 4
    less headroom 4); a GPU kind without a measurement keeps the planner's budget."""
    import json
    import os
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(root, "bench"))
    try:
        import published_runs as pr
    finally:
        sys.path.pop(0)
    from ds_autoplan.cost.memory import usable_budget
    from ds_autoplan.spec import load_cluster
    from ds_autoplan.spec.cluster import GB
    m = json.load(open(os.path.join(root, "bench", "data", "gpu_memory_h100.json")))
    h100, a100 = load_cluster("64xh100-80gb"), load_cluster("8xa100-80gb")
    lim = pr.device_limit(h100) / GB
    assert lim == pytest.approx((m["total_gib"] - m["outside_allocator_gib"]) * m["pipeline"]["max_allocated_gib"]
                                / m["pipeline"]["max_reserved_gib"])
    assert 76.5 < lim < 77.0 and lim > usable_budget(h100)[0] / GB == pytest.approx(72.0)
    assert pr.device_limit(a100) == usable_budget(a100)[0]
    # the planner's budget is unchanged: the 8B row's configuration does not fit it
    r = next(r for r in pr.load_rows() if r["id"] == "l31-8B-8")
    model, cluster = pr.setup(r)
    (cfg, c), _, _ = pr.cost_published(r)
    from ds_autoplan.cost.iteration import config_cost
    assert c.fits and not config_cost(pr.cost_model(r, model, cluster), cfg, usable_budget(cluster)[0],
                                      pr.layout(r, model, cfg)).fits



def test_stack_kernels_and_optimizer_are_execution_switches():
    """The software stack is part of the execution model: the attention-kernel generation
    selects the GPU kind's figures for it (data/gpus.yaml attention_kernels: H100 fa1 = the
    FlashAttention-2 table x the FA1-generation/FA2 rate ratio measured on the lent H100,
    bench/data/gpu_stack_h100.json; cudnn = the measured cuDNN table), the eager optimizer
    streams EAGER_STEP_BYTES per parameter instead of the fused step's (the loop's part as
    measured there); the plan's label records them; unknown names are one clear error."""
    import json
    import os
    import statistics
    from ds_autoplan.cost.compute import get_gpu
    from ds_autoplan.cost.engines import EAGER_STEP_BYTES
    from ds_autoplan.cost.memory import OPT_STEP_BYTES
    from ds_autoplan.spec.cluster import gpu_table
    meas = json.load(open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                       "bench", "data", "gpu_stack_h100.json")))
    rate = {(a["backend"], a["b"], a["heads"], a["s"]): a["tflops"] for a in meas["attention"] if a["bwd"]}
    ratio = statistics.median(v / rate[("flash", *k[1:])] for k, v in rate.items() if k[0] == "efficient")
    scale = gpu_table()["h100-sxm-80gb"]["attention_kernels"]["fa1"]["scale"]
    assert scale == pytest.approx(ratio, abs=0.005)
    loop = [a["bytes_per_param_at_copy_bw"] for a in meas["adam"] if a["mode"] == "composer_loop"]
    assert EAGER_STEP_BYTES - 12 == pytest.approx(statistics.median(loop), abs=1.0)
    h = get_gpu("h100-sxm-80gb")
    assert h.attention == "fa2"
    fa1, cud = h.with_attention("fa1"), h.with_attention("cudnn")
    for s in (2048, 4096):
        assert fa1.fused_attention(1e12, s) == pytest.approx(h.fused_attention(1e12, s) / scale)
        assert cud.fused_attention(1e12, s) < h.fused_attention(1e12, s)
    assert h.with_attention(None) is h and h.with_attention("fa2") is h
    with pytest.raises(SpecError, match="no attention-kernel figures for 'cudnn'"):
        get_gpu("a100-sxm-80gb").with_attention("cudnn")
    m, c = load_model("gpt3-1.3b"), load_cluster("8xh100-80gb")
    s = Strategy(1, 8, 1)
    t = {k: CostModel(m, c, execution=get_execution("fsdp", attention=k)).tables([s], 16).fwd[2, 0]
         for k in ("fa1", "fa2", "cudnn")}
    assert t["cudnn"] < t["fa2"] < t["fa1"]
    eager = CostModel(m, c, execution=get_execution("fsdp", optimizer="eager"))
    fused = CostModel(m, c, execution="fsdp")
    assert eager.step_time(1e9) == pytest.approx(fused.step_time(1e9) * EAGER_STEP_BYTES / OPT_STEP_BYTES["bf16"])
    e = get_execution("fsdp", grad_reduce_dtype="fp32", attention="fa1", optimizer="eager")
    assert e.grad_bytes == 4 and "attention fa1" in e.label() and "optimizer eager" in e.label()
    for kw, msg in (({"attention": "fa9"}, "unknown attention kernel"), ({"optimizer": "lion"}, "unknown optimizer"),
                    ({"grad_reduce_dtype": "fp8"}, "unknown gradient-reduction dtype")):
        with pytest.raises(SpecError, match=msg):
            get_execution("fsdp", **kw)


def test_cost_takes_the_benchs_switches_and_costs_a_row_as_the_bench_does(capsys):
    """`ds-autoplan cost` accepts every switch bench/published_runs.py sets per row
    (--execution --overlap --grad-reduce-dtype --attention-kernel --optimizer --moe-dispatch) and builds the
    same execution model from them as the bench does from the row's keys."""
    import argparse
    import json
    import os
    import sys
    from ds_autoplan.cli import main
    from ds_autoplan.cli.plan_cmd import execution_of
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    try:
        import published_runs as pr
    finally:
        sys.path.pop(0)
    r = next(r for r in pr.load_rows() if r["id"] == "mpt-7b-h100")
    ns = argparse.Namespace(execution=r["execution"], runtime="any", overlap=r.get("overlap"),
                            grad_reduce_dtype=r["grad_reduce_dtype"], attention_kernel=r["attention_kernel"],
                            optimizer=r["optimizer"])
    assert execution_of(ns) == pr.execution(r)
    args = ["--model", "gpt3-1.3b", "--cluster", "8xh100-80gb", "--global-batch", "16",
            "--config", "tp=1,pp=1,mbs=2,zero=3", "--json", "--execution", "fsdp"]
    out = {}
    for extra in ([], ["--attention-kernel", "fa1", "--optimizer", "eager", "--grad-reduce-dtype", "fp32"]):
        assert main(["cost", *args, *extra]) == 0
        out[bool(extra)] = json.loads(capsys.readouterr().out)["yours"]
    assert "attention fa1" in out[True]["execution"] and "optimizer eager" in out[True]["execution"]
    assert out[True]["iteration_time_s"] > out[False]["iteration_time_s"]
    with pytest.raises(SystemExit) as e:
        main(["cost", *args, "--attention-kernel", "fa9"])
    assert e.value.code != 0 and "invalid choice: 'fa9'" in capsys.readouterr().err
    # the MoE token dispatch: a Grok-1 row's switch, and `cost --moe-dispatch` on an MoE model
    g = next(r for r in pr.load_rows() if r["id"] == "grok1-8")
    ns = argparse.Namespace(execution=g["execution"], runtime="any", overlap=g.get("overlap"),
                            grad_reduce_dtype=g["grad_reduce_dtype"], attention_kernel=g["attention_kernel"],
                            optimizer=g.get("optimizer"), moe_dispatch=g["moe_dispatch"])
    assert execution_of(ns) == pr.execution(g) and pr.execution(g).moe_dispatch == "unfused"
    moe = ["--model", "olmoe-1b-7b", "--cluster", "8xh100-80gb", "--global-batch", "16",
           "--config", "tp=1,pp=1,mbs=2,ep=8", "--json", "--execution", "megatron-core"]
    for extra in ([], ["--moe-dispatch", "unfused"]):
        assert main(["cost", *moe, *extra]) == 0
        out[bool(extra)] = json.loads(capsys.readouterr().out)["yours"]
    assert "MoE dispatch unfused" in out[True]["execution"]
    assert out[True]["iteration_time_s"] > out[False]["iteration_time_s"]


def test_second_moe_source_is_recorded_with_its_configuration():
    """NVIDIA's BF16 DeepSeek-V3 on 1024 H100 (bench data dsv3_dgxc2025: TP 2, PP 16, EP 64,
    ETP 1, GBS 8192, 52.04 s) is costed with its own degrees (expert data parallelism 1, the
    multi-latent attention and 256-expert shapes of the model) and fits; like the Grok-1 rows
    it ran slower than the model costs it (2026-11-26: +17.2% with the shipped calibration),
    so it is recorded, withheld, with that reason."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    try:
        import published_runs as pr
    finally:
        sys.path.pop(0)
    from ds_autoplan.cost.compute import calibration
    r = next(r for r in pr.load_rows() if r["id"] == "dsv3-671B-h100-1024")
    assert not r.get("costed", True) and "slower than the model costs it" in r["not_costed"]
    model, _ = pr.setup(r)
    assert model.num_layers == 61 and abs(model.total_params / 671.0e9 - 1) < 0.01
    (cfg, c), _, n = pr.cost_published(r, calibration()["sustained"]["h100-sxm-80gb"])
    assert n == 1 and (cfg.tp, cfg.pp, cfg.dp, cfg.ep, cfg.etp, cfg.expert_dp) == (2, 16, 32, 64, 1, 1)
    assert c.fits and 0.0 < pr.published_time(r) / c.time - 1 < 0.30
