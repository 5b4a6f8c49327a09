"""Expert parallelism (EP, expert TP) and context parallelism (ring attention, Ulysses) in the
cost model, the search, --fix / cost and the emitters."""
from __future__ import annotations

import json
import os

import pytest

from ds_autoplan.cost.collectives import Network
from ds_autoplan.cost.engines import grad_bytes
from ds_autoplan.cost.memory import state_bytes
from ds_autoplan.cost.model import CostModel, Strategy
from ds_autoplan.emit.deepspeed import ds_config, validate
from ds_autoplan.emit.megatron import megatron_args
from ds_autoplan.plan import Plan
from ds_autoplan.search import search
from ds_autoplan.spec import SpecError, load_cluster, load_model

KW = dict(wide=False, baselines=False, keep_sim=False)
H100x64 = "64xh100-80gb"
# 64 Mixtral-sized experts, one per token (Switch routing, Fedus et al. 2022 §2.1): 265B
# parameters whose experts cannot be replicated on every data-parallel rank
TOP1 = dict(name="moe64-top1", arch="llama", num_layers=24, hidden=4096, heads=32, kv_heads=8,
            ffn=14336, vocab=32000, seq_len=4096, num_experts=64, moe_topk=1, tie_embeddings=False)


@pytest.fixture(scope="module")
def top1_free():
    """The free search of TOP1 on 64 H100 (global batch 512), shared by the tests reading it."""
    return search(TOP1, H100x64, 512, **KW)


@pytest.fixture(scope="module")
def long_free():
    """The free search of LLaMA-2 7B at 128K tokens on 64 H100 (global batch 64)."""
    return search("llama2-7b", H100x64, 64, 131072, **KW)


def _time(model, cluster, B, fix, seq=None):
    try:
        return search(model, cluster, B, seq, fix=fix, **KW).best.time
    except SpecError:
        return float("inf")


# -- cost model ---------------------------------------------------------------------------------
def _block_tables(model, strategies, B_m, cluster=H100x64, **kw):
    cm = CostModel(load_model(model), load_cluster(cluster), runtime="megatron", **kw)
    return cm, cm.tables(strategies, B_m)


def test_expert_parallelism_divides_the_expert_states():
    """A block's model states: dense parameters / tp at the dp-group's bytes, routed experts
    / (ep x etp) at the expert-data-parallel group's bytes (ZeRO-1 shards each over its own
    group: Megatron's distributed optimizer per parameter group)."""
    s1, s8 = Strategy(tp=1, dp=64, zero=1), Strategy(tp=1, dp=64, zero=1, ep=8, etp=1)
    cm, tab = _block_tables("olmoe-1b-7b", [s1, s8], 64)
    u = cm.units[2]
    We, Wd = u.expert_params, u.params - u.expert_params
    assert We > 0.9 * u.params
    assert tab.ms[2, 0] == pytest.approx(u.params * sum(state_bytes("bf16", 1, 64, "megatron")))
    assert tab.ms[2, 1] == pytest.approx(Wd * sum(state_bytes("bf16", 1, 64, "megatron"))
                                         + We / 8 * sum(state_bytes("bf16", 1, 8, "megatron")))
    assert s8.expert_dp == 8 and tab.ms[2, 1] < tab.ms[2, 0] / 4


def test_expert_gradients_reduced_over_the_expert_data_parallel_group():
    """ZeRO-0: the dense gradients all-reduced over the 64 data ranks, the experts' over their
    8 expert-data-parallel ranks (stride ep x etp = 8 apart: one per node)."""
    s = Strategy(tp=1, dp=64, zero=0, ep=8, etp=1)
    cm, tab = _block_tables("olmoe-1b-7b", [s], 64, overlap_grad_reduce=False)
    u, net = cm.units[2], Network(load_cluster(H100x64))
    Wd, We = u.params - u.expert_params, u.expert_params / 8
    gb = grad_bytes(cm.execution, "bf16", 2)       # bytes per gradient on the wire
    sync = net.all_reduce(Wd * gb, 64, 1) + net.all_reduce(We * gb, 8, 8)
    assert tab.bwd[2, 0] - tab.bwd_ns[2, 0] == pytest.approx(sync + cm.step_time(Wd + We), rel=1e-9)


def test_all_to_all_inside_a_node_is_cheaper_than_across_nodes():
    net = Network(load_cluster(H100x64))
    X = 512e6
    inside, across = net.all_to_all(X, 8, 1), net.all_to_all(X, 8, 8)
    assert inside == pytest.approx(7 / 8 * X / 360e9 + 8e-6)
    assert across == pytest.approx(7 / 8 * X / 50e9 + 20e-6)
    assert net.all_to_all(X, 16, 1) == pytest.approx(max(7 / 16 * X / 360e9 + 8e-6, 8 / 16 * X / 50e9 + 20e-6))


def test_token_dispatch_and_router_imbalance():
    """EP adds the dispatch/combine all-to-all (forward and backward) and its buffers; the
    busiest rank's share (moe_imbalance) slows EP only."""
    s1, s8 = Strategy(tp=1, dp=8), Strategy(tp=1, dp=8, ep=8, etp=1)
    cm, tab = _block_tables("olmoe-1b-7b", [s1, s8], 8, "8xh100-80gb", moe_imbalance=1.0)
    cm2, tab2 = _block_tables("olmoe-1b-7b", [s1, s8], 8, "8xh100-80gb", moe_imbalance=1.25)
    f, b, buf = cm.parallel_comm(cm.units[2], s8, 1.0, 1.0)
    X = cm.units[2].boundary * 8 / 1          # [s, h] tokens x top-8, 2 bytes
    assert f == b == pytest.approx(2 * Network(cm.cluster).all_to_all(X, 8, 1))
    assert buf == pytest.approx(2 * X)
    assert tab.ob[2, 1] > tab.ob[2, 0]
    assert tab2.fwd[2, 0] == tab.fwd[2, 0]                       # no EP: imbalance moot
    assert tab2.fwd[2, 1] > tab.fwd[2, 1] > tab.fwd[2, 0]


def test_context_parallelism_divides_activations_and_adds_the_ring():
    """cp = 4: a rank keeps and computes a quarter of the sequence (activations / 4, compute
    of b / 4 samples); the ring's K/V steps overlap attention, Ulysses' all-to-alls do not."""
    m = load_model("llama2-7b", 131072)
    cm = CostModel(m, load_cluster(H100x64), runtime="megatron")
    s1, s4 = Strategy(tp=2, dp=2, sp=True), Strategy(tp=2, dp=2, sp=True, cp=4)
    ua = Strategy(tp=2, dp=2, sp=True, cp=4, cp_comm="a2a")
    tab = cm.tables([s1, s4, ua], 8)              # 4 samples per data-parallel rank
    assert tab.f1[2, 1] == pytest.approx(tab.f1[2, 0] / 4)
    assert tab.ms[2, 1] == tab.ms[2, 0]           # ZeRO-0: states replicated over dp x cp
    k4 = cm.unit_times(cm.units[2], 4 / 4, 2, True)
    assert tab.fwd[2, 1] >= k4.fwd and tab.fwd[2, 2] > k4.fwd
    # the K, V blocks ([s/cp, 2 hkv / t], 2 bytes) passed cp - 1 times, hidden behind attention
    ring = (4 - 1) * Network(cm.cluster).ring_step(cm.units[2].boundary * 2 / 2, 4, 2)
    one = cm.tables([s1], 2).fwd[2, 0]           # the same rank's work without CP: 1 sample
    assert tab.fwd[2, 1] == pytest.approx(one + cm.ov(k4.attn, ring) - k4.attn, rel=1e-9)
    f, b, buf = cm.parallel_comm(cm.units[2], s4, 1.0, 1.0)
    assert buf > 0 and f >= 0 and b >= 0
    assert cm.admits(ua) and not cm.admits(ua._replace(cp=32))          # 32 heads over tp x cp = 64
    assert not cm.admits(Strategy(tp=1, dp=1, cp=3))                   # 131072 % 6 != 0


# -- search ---------------------------------------------------------------------------------------
def test_expert_parallelism_search_takes_the_fastest_expert_degree():
    """OLMoE (64 experts, top-8) on 64 H100: the free search's plan is as fast as the best of
    every fixed expert degree, and its ep is that degree (by this cost model the top-8
    all-to-all of ep > 1 costs more than replicating the experts saves)."""
    free = search("olmoe-1b-7b", H100x64, 1024, **KW)
    times = {ep: _time("olmoe-1b-7b", H100x64, 1024, f"ep={ep}") for ep in (1, 2, 4, 8, 16, 64)}
    best = min(times, key=times.get)
    assert free.best.time <= times[best] * (1 + 1e-9)
    assert free.plan.ep == best


def test_expert_parallelism_picked_for_a_64_expert_model_on_64_h100(top1_free):
    """64 Mixtral-sized experts, top-1: EP > 1 is faster than any ep = 1 plan, and the search
    picks it; the plan carries ep/etp and emits them."""
    free = top1_free
    dense = _time(TOP1, H100x64, 512, "ep=1")
    assert free.plan.ep > 1 and free.best.time < dense
    assert free.plan.parallel.expert_dp * free.plan.ep * free.plan.etp == free.plan.parallel.stage_ranks
    flags = " ".join(megatron_args(free.plan, load_model(TOP1)))
    assert f"--expert-model-parallel-size {free.plan.ep}" in flags
    assert "--moe-token-dispatcher-type alltoall" in flags


def test_context_parallelism_picked_at_128k_tokens_when_faster(long_free):
    """LLaMA-2 7B at 128K tokens on 64 H100: the free plan is at least as fast as every fixed
    CP degree, and CP > 1 wherever a fixed CP > 1 beats CP = 1."""
    free = long_free
    times = {cp: _time("llama2-7b", H100x64, 64, f"cp={cp}", 131072) for cp in (1, 2, 4, 8)}
    assert free.best.time <= min(times.values()) * (1 + 1e-9)
    assert min(times[c] for c in (2, 4, 8)) < times[1]
    assert free.plan.cp > 1 and free.plan.cp_comm == "p2p"
    ds = search("llama2-7b", H100x64, 64, 131072, runtime="deepspeed", **KW).plan
    assert ds.cp == 1 or ds.cp_comm == "a2a"                 # DeepSpeed's CP is Ulysses


def test_short_sequences_search_no_context_parallelism():
    from ds_autoplan.search.planner import Planner
    pl = Planner(load_model("llama2-7b"), load_cluster(H100x64), 64)
    assert pl.cps == [1] and pl.eps == [1]
    pl = Planner(load_model("llama2-7b", 131072), load_cluster(H100x64), 64)
    assert pl.cps == [1, 2, 4, 8, 16, 32]


def test_wide_space_contains_expert_and_context_plans():
    from ds_autoplan.search.planner import Planner
    pl = Planner(load_model(TOP1), load_cluster(H100x64), 512)
    key = lambda s: (s.tp, s.dp, s.zero, s.ckpt, s.ep, s.expert_tp, s.cp, s.cp_comm)  # noqa: E731
    combos = list(pl.combos(pps=[2]))
    assert {c.ep for c in combos} >= {1, 2, 32} and {c.etp for c in combos} == {1, 2, 4, 8}
    for c in combos[::37]:
        wide = {key(s) for s in pl.wide_strategies(32, c)}
        assert all(key(s) in wide for s in pl.exec_strats(c)), c
    pl = Planner(load_model("llama2-7b", 131072), load_cluster(H100x64), 64)
    for c in list(pl.combos(pps=[2]))[::11]:
        wide = {key(s) for s in pl.wide_strategies(32, c)}
        assert all(key(s) in wide for s in pl.exec_strats(c)), c


# -- --fix, cost, emit -----------------------------------------------------------------------------
def test_fix_and_cost_accept_expert_and_context_degrees(capsys):
    from ds_autoplan.cli import main
    p = search(TOP1, H100x64, 512, fix="ep=16,etp=1", **KW).plan
    assert (p.ep, p.etp) == (16, 1)
    with pytest.raises(SpecError, match="must divide the model's 64 routed experts"):
        search(TOP1, H100x64, 512, fix="ep=3", **KW)
    with pytest.raises(SpecError, match="has no experts"):
        search("llama2-7b", H100x64, 64, fix="ep=2", **KW)
    assert main(["cost", "--model", "llama2-7b", "--cluster", H100x64, "--global-batch", "64",
                 "--seq", "131072", "--config", "tp=2,cp=4,cp_comm=a2a", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["yours"]["cp"], out["yours"]["cp_comm"], out["yours"]["tp"]) == (4, "a2a", 2)


def test_expert_and_context_plans_emit_what_the_engines_accept(tmp_path, top1_free, long_free):
    """Megatron-LM's own parser takes the EP/CP flags with the plan's sizes; DeepSpeed's
    config class takes sequence_parallel_size (Ulysses) with the data-parallel batch."""
    from harness.megatron_args import CLIENT, argcheck
    moe, cp = top1_free.plan, long_free.plan
    flag_lists = []
    for p, m in ((moe, load_model(TOP1)), (cp, load_model("llama2-7b", 131072))):
        flag_lists.append(" ".join(megatron_args(p, m)).split() + [
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(m.vocab)])
        cfg = ds_config(p)
        assert cfg.get("sequence_parallel_size", 1) == p.cp
        parsed = validate(cfg, p)
        assert parsed.train_batch_size == p.global_batch_size
        assert Plan.from_json(p.to_json()) == p
    if not os.path.isdir(CLIENT):
        pytest.skip("Megatron-LM client copy not available")
    out = argcheck(tmp_path, flag_lists, 64)
    assert out[0]["ok"] and out[1]["ok"], out
    assert (out[0]["ep"], out[0]["etp"], out[0]["experts"], out[0]["dispatcher"]) == \
        (moe.ep, moe.etp, 64, "alltoall")
    assert (out[1]["cp"], out[1]["cp_comm"], out[1]["dp"]) == (cp.cp, ["p2p"], cp.dp)


def test_plan_command_fix_expert_parallelism_writes_it_everywhere(tmp_path, capsys):
    """`plan --fix ep=8,etp=1`: plan.json, the printed plan, the report and the Megatron flags
    all carry the expert degrees; an old-style plan file without them still loads."""
    from ds_autoplan.cli import main
    out = tmp_path / "plan"
    assert main(["plan", "--model", "olmoe-1b-7b", "--cluster", H100x64, "--global-batch", "1024",
                 "--fix", "ep=8,etp=1", "--no-wide", "--quiet", "--out", str(out)]) == 0
    assert "ep=8 etp=1" in capsys.readouterr().out
    p = Plan.load(out / "plan.json")
    assert (p.ep, p.etp, p.cp) == (8, 1, 1) and p.parallel.expert_dp == p.parallel.stage_ranks // 8
    assert "Expert parallelism 8 (expert tensor parallelism 1" in (out / "report.md").read_text()
    assert "--expert-model-parallel-size 8" in (out / "megatron_args.txt").read_text()


def test_published_context_parallel_configuration_does_not_beat_the_plan():
    """NVIDIA's Llama 3.1 405B proxy on 32 H100 (bench data llama31_dgxc2024: 7 layers, TP 8,
    CP 2 at 8192 tokens, DP 2, global batch 126): costed by the planner's own model, the
    published configuration is no faster than the plan -- context parallelism is searched
    down to the 4096 tokens per rank that run used (without it the plan, TP 4 PP 4, was 4.5%
    slower than the published configuration)."""
    import os
    import sys
    from ds_autoplan.cost.iteration import Config, config_cost
    from ds_autoplan.cost.memory import usable_budget
    from ds_autoplan.cost.model import CostModel
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    try:
        import published_runs as pr
    finally:
        sys.path.pop(0)
    r = next(r for r in pr.load_rows() if r["id"] == "l31-405B-32")
    model, cluster = pr.setup(r)
    pub = Config(tp=8, pp=1, dp=2, cp=2, micro_batch=1, num_microbatches=63, zero=1, sp=True)
    c = config_cost(CostModel(model, cluster, "bf16"), pub, usable_budget(cluster)[0])
    assert c.fits
    plan = search(model, cluster, 126, **KW).plan
    assert plan.predicted["iteration_time_s"] <= c.time * (1 + 1e-9)
    assert plan.cp > 1
