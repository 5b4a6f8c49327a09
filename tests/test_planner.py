"""Planner tests: decision-tree counts, cost-model identities, DP vs brute force, BMW,
paper observations, plan_model contract and never-worse-than-baselines."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from ds_autoplan.cost import CostModel, Strategy
from ds_autoplan.plan import Plan
from ds_autoplan.search import plan_model, search
from ds_autoplan.search.dp import Context
from ds_autoplan.search.fix import parse_fix
from ds_autoplan.search.partition import bmw, dawnpiper, merak
from ds_autoplan.search.space import count_candidates, decision_trees, strategies
from ds_autoplan.spec import SpecError, load_cluster, load_model

GB = 1024 ** 3


# -- §1.5 candidate counts ---------------------------------------------------------------
def test_paper_candidate_counts_8_gpus():
    assert count_candidates(8, prune_dp_sdp=False) == 68     # decision trees, all PP degrees
    assert count_candidates(8) == 44                         # takeaway 3 (Galvatron-BMW)
    assert count_candidates(8, with_ckpt=False) == 22        # "Galvatron" without CKPT


@pytest.mark.parametrize("N,before,after", [(4, 26, 22), (16, 146, 74), (64, 458, 158)])
def test_candidate_count_table(N, before, after):
    assert count_candidates(N, prune_dp_sdp=False) == before
    assert count_candidates(N) == after


def test_closed_form_and_pruning():
    for k in range(1, 7):
        assert len(decision_trees(2 ** k)) == 4 * k - 1
    # takeaway 3: the DP x SDP mix costs more communication than pure SDP (units of W)
    for n1, n2 in [(2, 2), (2, 4), (4, 2), (4, 4)]:
        N = n1 * n2
        mix = 2 * (n1 - 1) / n1 + 3 * (n2 - 1) / n2
        assert mix - 3 * (N - 1) / N == pytest.approx((n1 - 1) * (2 * n2 - 3) / (n1 * n2))
        assert mix > 3 * (N - 1) / N


# -- cost model ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bert8():
    m = load_model("bert-huge")
    c = load_cluster("8xtitan-24gb").with_budget(8)
    # the paper's cost model: beta_ms = 16 B/param (§2.1), what DeepSpeed's fp16 engine holds,
    # and DP gradient sync overlapped with the last backward (§2.4)
    return m, c, CostModel(m, c, "fp16", "deepspeed", overlap_grad_reduce=True)


def test_two_gpu_single_layer_picture(bert8):
    """Paper's 2-GPU picture: DP full states, half activations; SDP half of both and 1.5x
    DP's volume; TP half states, more than half activations; CKPT keeps the layer input."""
    _, _, cm = bert8
    S = [Strategy(1, 1), Strategy(1, 2), Strategy(1, 2, 3), Strategy(2, 1), Strategy(1, 2, 0, False, True)]
    t = cm.tables(S, 2)
    blk = 2
    one, dp, sdp, tp, ck = range(5)
    assert t.ms[blk, dp] == pytest.approx(t.ms[blk, one])
    assert t.f1[blk, dp] == pytest.approx(t.f1[blk, one] / 2)
    assert t.ms[blk, sdp] == pytest.approx(t.ms[blk, one] / 2)
    assert t.ms[blk, tp] == pytest.approx(t.ms[blk, one] / 2)
    assert t.f1[blk, one] / 2 < t.f1[blk, tp] < t.f1[blk, one]
    assert t.f1[blk, ck] == pytest.approx(cm.units[blk].boundary)   # b = 1 sample, input only
    W = cm.units[blk].params * 2
    ar = cm.net.all_reduce(W, 2)
    sdp_comm = 2 * cm.net.all_gather(W, 2) + cm.net.reduce_scatter(W, 2)
    assert (sdp_comm - 3 * cm.net.link(2)[1]) == pytest.approx(1.5 * (ar - cm.net.link(2)[1]))


def test_overlap_reduces_to_max_at_gamma_1(bert8):
    _, _, cm = bert8
    cm.gamma = 1.0
    assert cm.ov(3.0, 2.0) == 3.0
    cm.gamma = 1.3
    assert cm.ov(3.0, 2.0) == pytest.approx(3.6)


def test_eq9_single_stage(bert8):
    _, c, cm = bert8
    S = strategies(8)
    ctx = Context(cm, S, 1, 4, 16, c.budget_bytes)
    T, plan = ctx.search((32,))
    C, Cns, _ = ctx.stage_costs((32,), plan)
    assert T == pytest.approx(3 * Cns[0] + C[0])


def test_stage_dp_vs_brute_force():
    m = load_model({"name": "toy", "arch": "gpt", "num_layers": 4, "hidden": 256, "heads": 4,
                    "vocab": 512, "seq_len": 256})
    c = load_cluster("8xa100-80gb")
    cm = CostModel(m, c)
    S = [Strategy(1, 2), Strategy(1, 2, 3), Strategy(2, 1), Strategy(1, 2, 0, False, True)]
    t = cm.tables(S, 4)
    types = tuple([0] + [2] * 4 + [1])
    for budget in (1e12, None):
        # budget between the frugal and the fastest plan's peak
        probe = Context(cm, S, 1, 2, 4, 1e12, units=4096)
        if budget is None:
            lo = probe.e_all(types, [0, 3, 3, 3, 3, 0], 1)
            hi = probe.solve(types, 1).E_all
            budget = (lo + hi) / 2
        ctx = Context(cm, S, 1, 2, 4, budget, units=4096)
        sp = ctx.solve(types, 1)
        assert sp is not None and sp.E_all <= budget

        def tcost(plan):
            R = sum(t.R[types[i], plan[i - 1], plan[i]] for i in range(1, len(plan)))
            return float(sum(ctx.cost[u, s] for u, s in zip(types, plan)) + ctx.m * R)

        best = min(tcost(p) for p in itertools.product(range(4), repeat=len(types))
                   if all(t.allowed[u, s] for u, s in zip(types, p))
                   and ctx.e_all(types, list(p), 1) <= budget)
        assert tcost(sp.strategies) >= best - 1e-12
        assert tcost(sp.strategies) <= best * 1.15       # decoupled budget: near-optimal


def test_bmw_never_worse_than_base_and_fits(bert8):
    _, c, cm = bert8
    for P, m in [(2, 8), (4, 8), (8, 16)]:
        ctx = Context(cm, strategies(8 // P), P, m, 64 // m, c.budget_bytes)
        T, parts, plan, base = bmw(ctx)
        assert T <= base[0]
        assert sum(parts) == 32 and len(parts) == P
        _, _, mem = ctx.stage_costs(parts, plan)
        assert mem.max() <= c.budget_bytes
        for fn in (dawnpiper, merak):
            T2, p2, plan2 = fn(ctx)
            if plan2 is not None:
                assert sum(p2) == 32 and ctx.stage_costs(p2, plan2)[2].max() <= c.budget_bytes


def test_memory_balanced_split_gives_early_stages_fewer_layers(bert8):
    """§4.1/§5.6: under 1F1B the first stages hold more micro-batches."""
    from ds_autoplan.search.partition import minmax_partition, stage_matrices
    _, c, cm = bert8
    ctx = Context(cm, [Strategy(1, 2)], 4, 8, 16, c.budget_bytes)
    parts = minmax_partition(stage_matrices(ctx, [0] * len(ctx.seq), "mem"))
    assert parts[0] < parts[2] and sum(parts) == 32


@pytest.mark.parametrize("seed", range(6))
def test_minmax_partition_is_the_brute_force_optimum(bert8, seed):
    """The band DP of minmax_partition (a stage can only end where every later stage keeps
    a block) reaches the exhaustive min-max over all splits, whole and for a sub-range of
    stages and blocks (DawnPiper's sub-problems); memory and time objectives."""
    from ds_autoplan.search.partition import minmax_partition, stage_matrices
    _, c, cm = bert8
    rng = np.random.default_rng(seed)
    P = int(rng.choice([2, 3, 4]))
    ctx = Context(cm, strategies(8 // P), P, 2 * P, 16, c.budget_bytes)
    plan = [int(rng.integers(ctx.S)) for _ in ctx.seq]

    def cost(segs, stages, parts, lo):
        b, worst = lo - 1, 0.0
        for i, n in zip(stages, parts):
            a, b = b + 1, b + n
            worst = max(worst, segs.block(i, 0, segs.L)[b, a])
        return worst

    for objective in ("mem", "time"):
        segs = stage_matrices(ctx, plan, objective)
        for stages, lo, hi in ((range(P), 0, segs.L), (range(1, P), 3, segs.L), (range(P - 1), 0, 12)):
            k, n = len(stages), hi - lo
            splits = [np.diff((0,) + cut + (n,)) for cut in itertools.combinations(range(1, n), k - 1)]
            best = min(cost(segs, stages, q, lo) for q in splits)
            got = minmax_partition(segs, stages, lo, hi)
            assert np.isfinite(best) and sum(got) == n and min(got) >= 1
            assert cost(segs, stages, got, lo) == best


# -- paper observations ------------------------------------------------------------------
def _labels(cm, P, m, B_m, budget_gb):
    ctx = Context(cm, strategies(8 // P), P, m, B_m, budget_gb * GB)
    T, parts, plan, _ = bmw(ctx)
    return {ctx.strategies[i].label() for i in plan}


@pytest.mark.parametrize("P,m,B_m", [(1, 1, 16), (1, 1, 32), (2, 4, 16)])
def test_8gb_forces_ckpt_or_sdp_where_16gb_does_not(bert8, P, m, B_m):
    """Paper Fig. 6 / §5.9 at a fixed batch: BERT-Huge-32 on 8 TITAN needs CKPT or SDP
    blocks at E = 8 GB; at 16 GB plain DP/TP layers fit."""
    _, _, cm = bert8
    tight, loose = _labels(cm, P, m, B_m, 8), _labels(cm, P, m, B_m, 16)
    assert any("CKPT" in s or "SDP" in s for s in tight)
    assert not any("CKPT" in s or "SDP" in s for s in loose)


def test_bert_prefers_pp_and_dp_under_tight_budget():
    p = plan_model("bert-huge", "8xtitan-24gb", 64, precision="fp16", budget_gb=8)
    assert p.pp > 1 and p.tp == 1


# -- the plan contract and baselines -----------------------------------------------------
def test_plan_model_contract_and_roundtrip(tmp_path):
    p = plan_model("gpt3-1.3b", "2x8xa100-ib200", 256)
    assert p.pp * p.tp * p.dp == 16
    assert p.micro_batch_size * p.num_microbatches * p.dp == 256
    assert len(p.layers_per_stage) == len(p.recompute_per_stage)
    assert sum(p.layers_per_stage) == 24
    assert all(0 <= r <= 1 for r in p.recompute_per_stage)
    assert not (p.pp > 1 and p.zero_stage > 1)              # DeepSpeed pipeline rule
    p.save(tmp_path / "plan.json")
    q = Plan.load(tmp_path / "plan.json")
    assert q == p
    if q.pp > 1:
        s = q.build_schedule()
        assert s.num_stages == len(q.layers_per_stage)


@pytest.mark.parametrize("args", [("bert-huge", "8xtitan-24gb", 64, dict(budget_gb=8, precision="fp16")),
                                  ("gpt3-6.7b", "8xa100-80gb", 128, {}),
                                  ("gpt-tiny", "cpu-4", 16, {})])
def test_never_worse_than_baselines(args):
    model, cluster, B, kw = args
    r = search(model, cluster, B, wide=False, **kw)
    tok = r.plan.predicted["throughput_tokens_per_s"]
    for name, b in r.baselines.items():
        if b is not None and b.ok:
            assert tok >= B * r.model.seq_len / b.time * (1 - 1e-9), name
    assert r.plan.predicted["peak_memory_gb_per_stage"]
    assert max(r.plan.predicted["peak_memory_gb_per_stage"]) <= r.plan.predicted["memory_budget_gb"] + 1e-6


def test_schedule_choice_uses_simulator_and_fits():
    r = search("bert-huge", "8xtitan-24gb", 64, precision="fp16", budget_gb=8, wide=False)
    tried = r.plan.predicted["schedules_tried"]
    assert {e["schedule"] for e in tried} >= {"1f1b", "interleaved"}
    ok = [e for e in tried if e["fits"]]
    assert r.plan.predicted["iteration_time_s"] == pytest.approx(min(e["iteration_time_s"] for e in ok))


# -- bad input ----------------------------------------------------------------------------
def test_spec_errors(tmp_path):
    with pytest.raises(SpecError, match="unknown model preset"):
        load_model("gpt-nonexistent")
    with pytest.raises(SpecError, match="unknown cluster preset"):
        load_cluster("nowhere")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(SpecError, match="malformed YAML"):
        load_model(str(bad))
    with pytest.raises(SpecError, match="world size 16 does not match"):
        search("gpt-tiny", "cpu-4", 16, world_size=16)
    with pytest.raises(SpecError, match="cannot fit.*short by"):
        search("llama2-70b", "cpu-4", 4, wide=False)
    tiny = {"name": "t", "arch": "gpt", "num_layers": 2, "hidden": 8, "heads": 1, "vocab": 16, "seq_len": 8}
    with pytest.raises(SpecError, match="global batch 2"):
        search(tiny, "cpu-4", 2, wide=False)


def test_hf_config_parsing(tmp_path):
    import json
    cfg = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 11008,
           "vocab_size": 32000, "max_position_embeddings": 4096}
    p = tmp_path / "llama" / "config.json"
    p.parent.mkdir()
    p.write_text(json.dumps(cfg))
    m = load_model(str(p))
    ref = load_model("llama2-7b")
    assert m.total_params == pytest.approx(ref.total_params)
    assert abs(m.total_params / 1e9 - 6.74) < 0.05


@pytest.mark.parametrize("budget,m,B_m", [(6, 4, 16), (8, 2, 32), (12, 8, 8)])
def test_dawnpiper_two_stages_matches_brute_force(budget, m, B_m):
    """Theorem 4.1 (docs/dawnpiper.md §4.2): for two stages the cut searched between the
    compute- and memory-balanced cuts is optimal for the bottleneck stage time."""
    mdl = load_model("bert-huge")
    c = load_cluster("8xtitan-24gb").with_budget(budget)
    cm = CostModel(mdl, c, "fp16", "deepspeed")
    ctx = Context(cm, [Strategy(1, 4), Strategy(1, 4, 0, False, True)], 2, m, B_m, c.budget_bytes)
    brute = min(ctx.stage_costs((a, 32 - a), plan)[1].max()
                for a in range(1, 32) for T, plan in [ctx.search((a, 32 - a))] if plan is not None)
    T, parts, plan = dawnpiper(ctx)
    assert ctx.stage_costs(parts, plan)[1].max() == pytest.approx(brute)


def test_merak_balances_parameters(bert8):
    _, c, cm = bert8
    ctx = Context(cm, [Strategy(1, 2)], 4, 8, 16, c.budget_bytes)
    T, parts, plan = merak(ctx)
    params = np.array([cm.units[u].params for u in ctx.seq])
    per_stage = [params[lo:hi].sum() for lo, hi in ctx.bounds(parts)]
    assert sum(parts) == 32
    assert all(p >= params.sum() / 4 for p in per_stage[:-1])    # a shard closes past total/P


@pytest.mark.parametrize("name", ["1f1b", "v-half", "interleaved"])
def test_extrapolated_simulation_matches_exact(bert8, name):
    """Many micro-batches are costed from runs at 2P and 4P (affine steady state)."""
    from ds_autoplan.schedule import Costs, build, simulate
    from ds_autoplan.search.pipeline import num_stages, schedule_options, simulate_plan, stage_figures, \
        time_partition
    _, c, cm = bert8
    P, m = 4, 48
    ctx = Context(cm, [Strategy(1, 2), Strategy(1, 2, 0, False, True)], P, m, 4, c.budget_bytes)
    S = num_stages(name, P)
    parts = time_partition(ctx, S, lambda x: [0] * len(x.seq))
    sub = Context(cm, ctx.strategies, S, m, 4, c.budget_bytes)
    figs = stage_figures(sub, parts, [0] * len(sub.seq), [1] * len(sub.seq))
    rec = [1] * S
    T, peak, _, _ = simulate_plan(ctx, name, parts, rec, figs)
    sched = build(name, P, m, **schedule_options(name))
    f = np.array([g["f"] for g in figs])
    bw = np.array([g["bw"] + g["d_time"] for g in figs])
    w = np.array([g["w"] for g in figs])
    act = np.array([g["act"] - g["d_mem"] for g in figs])
    split = any(a.kind.name == "W" for r in sched.ranks for a in r)
    costs = Costs.per_stage(S, m, f=f, b=bw - w if split else bw, w=w if split else np.zeros(S),
                            mem_f=act, mem_b=np.zeros(S), mem_w=-act,
                            p2p=float(max(g["p2p"] for g in figs)))
    res = simulate(sched, costs)
    tail = max(sum(figs[s]["sync"] for s in range(S) if sched.placement[s] == r) for r in range(P))
    assert T == pytest.approx(res.makespan + tail, rel=0.01)
    static = [sum(figs[s]["ms"] + figs[s]["ob"] for s in range(S) if sched.placement[s] == r)
              for r in range(P)]
    assert np.allclose(peak, np.array(static) + np.array(res.peak_memory), rtol=0.02)


# -- sequence parallelism (Korthikanti et al. 2022 §4.2.2) ----------------------------------
@pytest.mark.parametrize("t,saved", [(2, 41943040.0), (4, 62914560.0)])
def test_sequence_parallel_cost_model(t, saved):
    """SP splits act_rep, the CKPT input and the p2p tensor by t; the TP volume stays."""
    m = load_model("gpt3-1.3b")                      # s = h = 2048, GPT with dropout
    # the constant-rate compute model (no GPU kind): SP changes memory and p2p only; the shape
    # model's compute saving (norms/dropout on s/t tokens) is tested in test_cost_shape.py
    cm = CostModel(m, load_cluster({**load_cluster("8xa100-80gb").__dict__, "gpu": None}))
    S = [Strategy(t, 1), Strategy(t, 1, sp=True), Strategy(t, 1, ckpt=True),
         Strategy(t, 1, ckpt=True, sp=True)]
    tab, blk, b, s, h = cm.tables(S, 2), 2, 2, 2048, 2048
    u = cm.units[blk]
    assert (u.act_rep, u.boundary) == (10 * s * h, 2 * s * h)
    # hand-computed: b * act_rep * (1 - 1/t) = 2 * 10 * 2048^2 * (1 - 1/t)
    assert b * u.act_rep * (1 - 1 / t) == saved
    assert tab.f1[blk, 0] - tab.f1[blk, 1] == pytest.approx(saved)
    assert tab.f1[blk, 1] == pytest.approx(b * (u.act_rep + u.act_tp) / t)
    assert tab.f1[blk, 3] == pytest.approx(b * 2 * s * h / t)       # CKPT keeps [s/t, b, h]
    assert tab.ob[blk, 3] == pytest.approx(tab.f1[blk, 1])
    assert tab.p2p[blk, 1] == pytest.approx(cm.net.p2p(b * 2 * s * h / t, t))
    assert tab.p2p[blk, 1] < tab.p2p[blk, 0]
    for a in (tab.fwd, tab.bwd, tab.bwd_ns, tab.ms):                  # TP comm time unchanged
        assert np.allclose(a[:, 1], a[:, 0]) and np.allclose(a[:, 3], a[:, 2])
    F = b * u.flops / (t * cm.cluster.flops)
    X = b * u.boundary
    assert tab.fwd[blk, 1] - F == pytest.approx(2 * cm.net.all_reduce(X, t))
    # reduce-scatter + all-gather move the all-reduce's 2(t-1)/t X (the ring's two phases)
    lat = cm.net.link(t)[1]
    assert cm.net.reduce_scatter(X, t) + cm.net.all_gather(X, t) - lat == pytest.approx(cm.net.all_reduce(X, t))
    assert S[1].label() == f"TP{t}+SP" and S[3].label() == f"TP{t}+SP+CKPT"


def test_sequence_parallel_lets_a_plan_fit():
    """gpt3-1.3b at 8192 tokens, 8 GB: without SP the planner must recompute or pipeline;
    with 'auto' it finds a TP plan with SP that fits without recompute and is faster
    (context parallelism, which also splits the activations, held at 1)."""
    from ds_autoplan.search.planner import Planner
    kw = dict(budget_gb=8, wide=False, baselines=False, fix={"cp": 1})
    off = search("gpt3-1.3b", "8xa100-80gb", 32, 8192, sequence_parallel="off", **kw).plan
    auto = search("gpt3-1.3b", "8xa100-80gb", 32, 8192, **kw).plan
    assert not off.sequence_parallel and auto.sequence_parallel and auto.tp > 1
    assert auto.predicted["iteration_time_s"] < off.predicted["iteration_time_s"]
    rec = lambda p: sum(r * n for r, n in zip(p.recompute_per_stage, p.layers_per_stage))  # noqa: E731
    assert rec(off) > rec(auto) == 0
    # the auto plan's configuration fits without recompute only with SP
    m, c = load_model("gpt3-1.3b", 8192), load_cluster("8xa100-80gb")
    cfg = dict(pp=auto.pp, tp=auto.tp, dp=auto.dp, zero=auto.zero_stage,
               num_microbatches=auto.num_microbatches, micro_batch=auto.micro_batch_size)
    pls = {mode: Planner(m, c, 32, budget_gb=8, sequence_parallel=mode) for mode in ("auto", "off")}
    t = {mode: pl.evaluate(pl.config(**cfg), ckpt="none", schedules=[]).time
         for mode, pl in pls.items()}
    assert np.isfinite(t["auto"]) and not np.isfinite(t["off"])


def test_sequence_parallel_modes():
    on = search("gpt-tiny", "cpu-4", 16, wide=False, sequence_parallel="on")
    assert on.plan.tp > 1 and on.plan.sequence_parallel
    assert "+SP" in on.plan.layer_strategies[1]
    # 'on' with tp = 1 forced is an error (Megatron needs TP for SP), not silently off
    with pytest.raises(SpecError, match="needs tensor parallelism"):
        search("gpt-tiny", "cpu-4", 16, wide=False, tp=1, sequence_parallel="on")
    with pytest.raises(SpecError, match="sequence_parallel must be one of"):
        search("gpt-tiny", "cpu-4", 16, wide=False, sequence_parallel="yes")
    off = search("gpt-tiny", "cpu-4", 16, wide=False, tp=2, sequence_parallel="off").plan
    auto = search("gpt-tiny", "cpu-4", 16, wide=False, tp=2).plan
    assert auto.sequence_parallel and not off.sequence_parallel
    assert auto.predicted["iteration_time_s"] <= off.predicted["iteration_time_s"] * (1 + 1e-12)
    # baselines with TP > 1 (Megatron 3D, Galvatron without BMW) use SP under 'auto' too
    ok = [b for b in on.baselines.values() if b is not None and b.ok]
    assert all(b.sp == (b.tp > 1) for b in ok) and any(b.sp for b in ok)


# -- BMW per rank for V / interleaved placements (seed 000 §IV-B2, App. B) ---------------------
def _time_balanced(ctx, name, v=2):
    """The time-balanced split of ``name`` and its stage-aware-recompute Eval (the p_t corner)."""
    from ds_autoplan.search.pipeline import num_stages, stage_aware_recompute, stage_figures, time_partition
    S = num_stages(name, ctx.pp, v)
    sp = time_partition(ctx, S, lambda x: [0] * len(x.seq))
    sub = Context(ctx.cm, ctx.strategies, S, ctx.m, ctx.B_m, ctx.E, ctx.units)
    ck = [1 if ctx.cm.units[u].checkpointable else 0 for u in sub.seq]
    figs = stage_figures(sub, sp, [0] * len(sub.seq), ck)
    return (stage_aware_recompute(ctx, name, sp, figs),
            stage_aware_recompute(ctx, name, sp, figs, max_rounds=0))


def test_rank_balance_moves_blocks_off_rank0_instead_of_recompute():
    """GPT-3 1.3B, 4 ranks, v-min, 8 GB: the time-balanced split must recompute on rank 0
    (stages 0 and 7: embedding and LM head); moving a block from stage 0 to stage 1 fits
    without recompute and is predicted faster."""
    from ds_autoplan.schedule import build
    from ds_autoplan.search.planner import Planner
    pl = Planner(load_model("gpt3-1.3b"), load_cluster("8xtitan-24gb"), 64, precision="fp16", budget_gb=8,
                 runtime="deepspeed")
    cand = pl.evaluate(pl.config(pp=4, dp=2, num_microbatches=32), schedules=["v-min"])
    tb, tb0 = _time_balanced(cand.ctx, "v-min")
    place = build("v-min", 4, 8).placement
    assert tb.ok and tb0.peak[0] > pl.E and not tb0.fits
    assert any(tb.recompute[s] for s in range(8) if place[s] == 0)
    assert cand.schedule == "v-min" and cand.partitioner == "rank-balanced"
    assert cand.parts != tb.parts and sum(cand.parts) == sum(tb.parts) == 24
    assert sum(cand.recompute) < sum(tb.recompute)
    assert cand.time < tb.time
    assert max(cand.peak) <= pl.E


@pytest.mark.parametrize("model,budget,cfg,name", [
    ("gpt3-1.3b", 8, (4, 1, 2, 0, 32, 2), "v-half"),
    ("gpt3-1.3b", 8, (8, 1, 1, 0, 32, 2), "v-zb"),
    ("t5-large", 4, (4, 1, 2, 0, 32, 2), "v-half"),
    ("t5-large", 4, (2, 1, 4, 1, 16, 4), "interleaved"),
])
def test_rank_balance_partitions_valid_and_fit(model, budget, cfg, name):
    """Every split rank_balance returns keeps all blocks, has S stages of >= 1 block, fits every
    rank under the cap (the simulator's peak per rank) and is never slower than the
    time-balanced split."""
    from ds_autoplan.search.pipeline import choose_schedule, num_stages
    from ds_autoplan.search.planner import Planner
    pl = Planner(load_model(model), load_cluster("8xtitan-24gb"), 64, precision="fp16", budget_gb=budget,
                 runtime="deepspeed")
    P, t, d, z, m, B_m = cfg
    c = pl.config(pp=P, tp=t, dp=d, zero=z, num_microbatches=m, micro_batch=B_m // d)
    ctx = pl.ctx_of(c, pl.exec_strats(c))
    evs = choose_schedule(ctx, (pl.L // P,) * P, [0] * len(ctx.seq), [name])
    e = next(x for x in evs if len(x.parts) == num_stages(name, P))     # interleaved: v = 2
    tb, _ = _time_balanced(ctx, name)
    assert e.partitioner == "rank-balanced"
    assert evs[0].time <= e.time and all(x.schedule == name for x in evs)
    assert sum(e.parts) == pl.L and len(e.parts) == num_stages(name, P) and min(e.parts) >= 1
    assert len(e.peak) == P and max(e.peak) <= pl.E and e.fits
    assert e.time < tb.time or not tb.ok


def test_cannot_fit_message_never_says_short_by_a_negative_amount():
    """A fixed configuration whose 1F1B memory floor fits but whose schedule does not (GPT-3
    175B, tp 8 pp 8, no recompute, Megatron's interleaving with 12 chunks on 64 A100s under a
    60 GB budget; it needs 62 GB): one line that says so, not 'short by -x GB'."""
    with pytest.raises(SpecError) as e:
        search("gpt3-175b", "64xa100-80gb", 64, budget_gb=60, wide=False,
               fix=parse_fix("tp=8,pp=8,mbs=1,recompute=none,schedule=interleaved,v=12,sp=on"))
    msg = str(e.value)
    assert "\n" not in msg and "short by" not in msg, msg
    assert "cannot fit" in msg and "60.0 GB budget" in msg


def test_the_per_iteration_overhead_is_charged_once_however_many_stages(bert8):
    """A calibrated ``step_overhead_ms`` is the iteration's own (spec/cluster.py): eq. 9's
    time grows by it once, not once per pipeline stage."""
    import dataclasses
    m, c, _ = bert8
    S = strategies(2)
    times = []
    for step_ms in (0.0, 5.0):
        cm = CostModel(m, dataclasses.replace(c, step_overhead_ms=step_ms), "fp16", "deepspeed",
                       overlap_grad_reduce=True)
        ctx = Context(cm, S, 4, 8, 8, c.budget_bytes)
        parts = (8, 8, 8, 8)
        _, plan = ctx.search(parts)
        times.append(ctx.pipeline_time(parts, plan))
    assert times[1] - times[0] == pytest.approx(5e-3, rel=1e-9)


@pytest.mark.parametrize("overhead", [1.0, 4.0])
def test_a_calibrated_memory_overhead_is_part_of_every_fit(overhead):
    """A cluster's calibrated ``memory_overhead_gb`` (device memory above the modelled states and
    activations) is in every reported peak, so the search's fit checks hold it too: without a
    pipeline, GPT-3 2.7B on 24 GB devices was planned at 22.5 GB (1 GB overhead) and 25.5 GB
    (4 GB) against a 21.8 GB budget."""
    import dataclasses

    from ds_autoplan.search import SearchOptions, plan_model
    from ds_autoplan.spec.cluster import load_cluster
    cluster = dataclasses.replace(load_cluster("8xtitan-24gb"), memory_overhead_gb=overhead)
    plan = plan_model("gpt3-2.7b", cluster, 32, options=SearchOptions(pp=1))
    peak, budget = max(plan.predicted["peak_memory_gb_per_stage"]), plan.predicted["memory_budget_gb"]
    assert peak <= budget, (peak, budget, plan.micro_batch_size, plan.zero_stage, plan.recompute_per_stage)
