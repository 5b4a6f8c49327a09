"""megatron-core hooks: our forward_backward_func vs Megatron's own schedules and the
no-pipeline run, on CPU with gloo (2 and 4 ranks, several schedules per process group)."""
from __future__ import annotations

import inspect
import json

import pytest

pytest.importorskip("megatron.core")
torch = pytest.importorskip("torch")

from ds_autoplan.schedule import Schedule, names, simulate, Costs, build, v_placement  # noqa: E402
from ds_autoplan.schedule.builders import builder_info  # noqa: E402
from harness import registered  # noqa: E402

TOL = 1e-5


def hand_v(d: int, n: int) -> Schedule:
    """A hand-made V schedule mixing BW, split B/W and recomputation (R) of one stage."""
    S = 2 * d
    lists = []
    for r in range(d):
        c0, c1 = r, S - 1 - r
        keys = [("F", c0, m) for m in range(n)] + [("F", c1, m) for m in range(n)]
        if r == d - 1:
            keys += [("R", c1, m) for m in range(n)]
        keys += [("BW", c1, m) for m in range(n)]
        for m in range(n):
            keys += [("B", c0, m), ("W", c0, m)]
        lists.append(keys)
    return Schedule.from_keys("hand-v", n, v_placement(d), lists)


def _cases(d: int, n: int):
    seq, v = [2] * d, [1] * (2 * d)
    cases = [dict(pp=d, n=n, schedule="1f1b", layers=seq),
             dict(pp=d, n=n, schedule="1f1b", layers=seq, runner="megatron"),
             dict(pp=d, n=n, schedule="interleaved", layers=v),
             # gloo + pp=2: Megatron's batched p2p mixes up the two directions (same peer),
             # so its own interleaved reference runs with batch_p2p_comm off there
             dict(pp=d, n=n, schedule="interleaved", layers=v, runner="megatron",
                  config={"batch_p2p_comm": d != 2})]
    for name in registered(exclude=("1f1b", "interleaved")):   # both covered above, twice
        cases.append(dict(pp=d, n=n, schedule=name, layers=[1] * builder_info(name).num_stages(d)))
    cases.append(dict(pp=d, n=n, layers=v, sched=hand_v(d, n).to_dict(), schedule="hand-v"))
    if d == 2 and "v-zb" in names():  # per-stage Megatron block recompute on V chunks + B/W split
        cases.append(dict(pp=d, n=n, schedule="v-zb", layers=[2, 2, 2, 2],
                          recompute=[0.5, 0.0, 1.0, 0.5], runner="ours"))
    return cases


def _check(cases, out, own=("1f1b", "interleaved")):
    tps = sorted({o[0].get("tp_rank", 0) for o in out})
    if len(tps) > 1:   # tensor parallel: every tp rank sees a whole pipeline
        for t in tps:
            _check(cases, [o for o in out if o[0]["tp_rank"] == t], own)
        return
    d = len(out)
    for i, case in enumerate(cases):
        label = f"{case['schedule']}/{case.get('runner', 'ours')} d={d}"
        rs = [out[r][i] for r in range(d)]
        for r in rs:
            assert r["max_grad_err"] <= TOL * max(1.0, r["max_grad"]), (label, r["rank"], r["max_grad_err"])
            # W actions run deferred weight GEMMs of the split Megatron layers (else none)
            assert (r["w_items"] > 0) == r["has_w"], (label, r["rank"], r["w_items"])
        last = [r for r in rs if r["losses"][0]]
        assert len(last) == 1, f"{label}: losses must come from exactly one rank"
        lr = last[0]
        assert len(lr["losses"][0]) == case["n"]
        for got, ref in zip(lr["losses"] + [lr["eval_losses"]], lr["ref_losses"] + [lr["ref_eval_losses"]]):
            assert got == pytest.approx(ref, abs=TOL), label
        if case.get("runner", "ours") == "ours":
            for r in rs:  # measured peak saved-activation bytes vs the simulator
                assert r["peak_bytes"][0] == r["peak_bytes"][1]
                assert abs(r["peak_bytes"][0] - r["sim_peak_bytes"]) <= 0.10 * r["sim_peak_bytes"], \
                    (label, r["rank"], r["peak_bytes"], r["sim_peak_bytes"])
    # ours == Megatron's own schedule (1F1B and interleaved), loss by loss
    by = {(c["schedule"], c.get("runner", "ours")): i for i, c in enumerate(cases)}
    for sname in own:
        a, b = by[(sname, "ours")], by[(sname, "megatron")]
        la = [x for r in range(d) for step in out[r][a]["losses"] for x in step]
        lb = [x for r in range(d) for step in out[r][b]["losses"] for x in step]
        assert len(la) == 2 * cases[a]["n"] and la == pytest.approx(lb, abs=TOL)


DROPOUT_CASE = dict(fn="dropout_case", pp=2, n=4, layers=[1, 1, 1, 1], schedule="hand-v",
                    sched=hand_v(2, 4).to_dict(), dropout=0.3)


@pytest.fixture(scope="module")
def two_ranks():
    """One 2-rank process group: every schedule's case, then the dropout case."""
    from harness.megatron_cases import launch
    cases = _cases(2, 4)
    out = launch(2, cases + [DROPOUT_CASE], timeout=300)
    return cases, [o[:len(cases)] for o in out], [o[len(cases)] for o in out]


@pytest.mark.timeout(400)       # the first test pays for the fixture's process group
def test_two_ranks_all_schedules(two_ranks):
    cases, out, _ = two_ranks
    _check(cases, out)


def _tp_cases(sp: bool) -> list:
    base = dict(pp=2, n=4, tp=2, sp=sp, ref_split=False, layers=[1, 1])
    cases = [dict(base, schedule="1f1b"), dict(base, schedule="1f1b", runner="megatron"),
             dict(base, schedule="zb-h1")]
    if "v-zb" in names():
        cases.append(dict(base, schedule="v-zb", layers=[1, 1, 1, 1]))
    return cases


MOE_CASES = [dict(fn="moe_case", pp=2, ep=2, n=4, schedule="1f1b", layers=[1, 1]),
             # the router's load-balancing loss on: the same micro-batches in both runs
             dict(fn="moe_case", pp=2, ep=2, n=4, schedule="v-half", layers=[1, 1, 1, 1], aux_loss=0.01)]


@pytest.fixture(scope="module")
def four_ranks():
    """One 4-rank process group runs every 4-rank case group (each case sets up its own
    parallel state): {group: (cases, every rank's results for them)}."""
    from harness.megatron_cases import launch
    groups = {"schedules": [c for c in _cases(4, 8) if c["schedule"] not in ("zb-h1",)],
              "tp2": _tp_cases(False), "tp2-sp": _tp_cases(True), "moe": MOE_CASES}
    out = launch(4, [c for cases in groups.values() for c in cases], timeout=600)
    res, at = {}, 0
    for name, cases in groups.items():
        res[name] = (cases, [o[at:at + len(cases)] for o in out])
        at += len(cases)
    return res


@pytest.mark.timeout(900)       # the first test pays for the fixture's process group
def test_four_ranks_all_schedules(four_ranks):
    _check(*four_ranks["schedules"])


@pytest.mark.timeout(900)
@pytest.mark.parametrize("group", ["tp2", "tp2-sp"])
def test_tensor_parallel_split_backward(four_ranks, group):
    """pp 2 x tp 2 (4 ranks), with and without sequence parallelism: 1F1B (ours and
    Megatron's), ZB-H1 and V-ZB (B/W split, V placement) equal a pp=1, tp=2 reference built
    from Megatron's own linear layers, and every rank's W runs deferred weight GEMMs."""
    cases, out = four_ranks[group]
    assert all(c["sp"] == (group == "tp2-sp") for c in cases)
    assert sorted(o[0]["tp_rank"] for o in out) == [0, 0, 1, 1]
    assert all(o[i]["w_items"] > 0 for o in out for i, c in enumerate(cases) if c["schedule"] != "1f1b")
    _check(cases, out, own=("1f1b",))


@pytest.mark.timeout(400)
def test_recompute_replays_dropout(two_ranks):
    # rank 1 recomputes its second V stage (R before B): with hidden dropout the gradients
    # equal those of the same schedule without R only if R replays the forward's RNG state
    _, _, rows = two_ranks
    assert sorted(r["recomputes"] > 0 for r in rows) == [False, True]
    for r in rows:
        assert r["max_err"] <= 1e-6, r
        assert r["dropout_effect"] > 1e-3, r


@pytest.mark.timeout(120)
def test_failing_rank_does_not_hang_the_others():
    from harness.megatron_cases import launch
    with pytest.raises(RuntimeError, match="deliberate failure") as err:
        launch(2, [dict(fn="fail_case", bad_rank=1, pp=2, n=4, schedule="v-zb",
                        layers=[1, 1, 1, 1])], timeout=100)
    assert "rank 1 (rc 1)" in str(err.value)           # it failed by itself, not at the deadline


# ------------------------------------------------------------------ in-process unit tests
def test_signature_is_megatrons():
    from megatron.core.pipeline_parallel import schedules as ms
    from ds_autoplan.runtime.megatron import get_forward_backward_func
    fb = get_forward_backward_func(schedule=build("1f1b", 2, 4))
    for f in (ms.forward_backward_pipelining_without_interleaving,
              ms.forward_backward_pipelining_with_interleaving, ms.forward_backward_no_pipelining):
        assert inspect.signature(fb) == inspect.signature(f)
    with pytest.raises(TypeError):
        fb(forward_step_func=None, not_a_megatron_kwarg=1)


def test_layouts_and_overrides():
    from ds_autoplan.runtime.megatron import StageLayerLayout, plan_overrides, stage_layer_lists
    from ds_autoplan.plan import Plan
    from megatron.core.transformer.enums import LayerType
    plan = Plan(pp=2, num_microbatches=4, schedule="1f1b", layers_per_stage=[3, 1],
                recompute_per_stage=[1.0, 0.0])
    over, rec, layout = plan_overrides(plan)
    assert layout == "Ettt|tL" and over["num_layers"] == 4 and rec == [3, 0]
    assert over["virtual_pipeline_model_parallel_size"] is None
    if "v-half" in names():
        vplan = Plan(pp=2, num_microbatches=4, schedule="v-half", layers_per_stage=[1, 2, 3, 4],
                     recompute_per_stage=[0, 0, 0, 0])
        over, _, lay = plan_overrides(vplan)
        assert over["virtual_pipeline_model_parallel_size"] == 2
        assert isinstance(lay, StageLayerLayout)
    lay = StageLayerLayout(stage_layer_lists([1, 2, 3, 4]), v_placement(2))
    lay.validate_layer_layout(num_layers=10, mtp_num_layers=None)
    # (pp rank, vp stage) -> stage: (0,0)=0 (1,0)=1 (1,1)=2 (0,1)=3; offsets in stage order
    assert lay.layout[0][1].count(LayerType.decoder) == 4 and lay.layout[1][1].count(LayerType.decoder) == 3
    assert [lay.get_layer_offset(vp_stage=c, pp_rank=r) for r, c in ((0, 0), (1, 0), (1, 1), (0, 1))] == [0, 1, 3, 6]
    with pytest.raises(Exception):
        plan_overrides(Plan(pp=2, num_microbatches=4, schedule="1f1b", layers_per_stage=[1, 1, 1]))


def test_split_spec_and_shim_restore():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from ds_autoplan.runtime.megatron import (SplitColumnParallelLinear, SplitRowParallelLinear, cpu_shim,
                                      split_backward_spec)
    spec = split_backward_spec(get_gpt_layer_local_spec())
    sa = spec.submodules.self_attention.submodules
    assert sa.linear_qkv is SplitColumnParallelLinear and sa.linear_proj is SplitRowParallelLinear
    mlp = spec.submodules.mlp.submodules
    assert mlp.linear_fc1 is SplitColumnParallelLinear and mlp.linear_fc2 is SplitRowParallelLinear
    from megatron.core.transformer.moe import token_dispatcher
    before = (torch.cuda.current_device, torch.cuda.synchronize, torch.cuda.Stream,
              torch.cuda.current_stream, token_dispatcher.maybe_move_tensor_to_cpu)
    if not torch.cuda.is_available():
        with cpu_shim(remap_cuda_factories=True):
            assert torch.zeros(2, device="cuda").device.type == "cpu"
            assert torch.cuda.current_device() == torch.device("cpu")
            # MoE dispatcher on the host: split sizes as numpy (all_to_all_single takes sizes)
            sizes = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 1]), as_numpy=True)
            assert sizes.tolist() == [3, 1] and torch.cuda.Stream() is torch.cuda.current_stream()
    assert (torch.cuda.current_device, torch.cuda.synchronize, torch.cuda.Stream,
            torch.cuda.current_stream, token_dispatcher.maybe_move_tensor_to_cpu) == before


def test_memory_ratio_of_v_schedules_in_simulator():
    """The bench's memory goals hold in the simulator for uniform costs (sanity)."""
    d, n = 4, 8
    peak = {nm: max(simulate(s, Costs.uniform(s)).peak_memory)
            for nm in ("1f1b", "v-half", "v-min") for s in [build(nm, d, n)]}
    assert peak["v-min"] / peak["1f1b"] <= 0.55 and peak["v-half"] / peak["1f1b"] <= 0.8


def test_install_swaps_megatron_dispatcher_and_undoes():
    import megatron.core.pipeline_parallel as pp_pkg
    from megatron.core.pipeline_parallel import schedules as ms
    from ds_autoplan.runtime.megatron import ScheduleRunner, install
    orig = (pp_pkg.get_forward_backward_func, ms.get_forward_backward_func)
    undo = install(schedule=build("1f1b", 2, 4))
    try:
        assert isinstance(pp_pkg.get_forward_backward_func(), ScheduleRunner)
        assert isinstance(ms.get_forward_backward_func(), ScheduleRunner)
    finally:
        undo()
    assert (pp_pkg.get_forward_backward_func, ms.get_forward_backward_func) == orig


def test_megatron_args():
    from ds_autoplan.runtime.megatron import megatron_args
    from ds_autoplan.plan import Plan
    a = megatron_args(Plan(pp=2, num_microbatches=4, schedule="interleaved", schedule_options={"v": 2},
                           layers_per_stage=[1, 2, 2, 1], recompute_per_stage=[0, 0.5, 0, 0],
                           micro_batch_size=2, global_batch_size=8, precision="bf16"))
    s = " ".join(a)
    assert "--pipeline-model-parallel-size 2" in s and "--pipeline-model-parallel-layout Et|tt|tt|tL" in s
    assert "--recompute-method block --recompute-num-layers 1" in s and "--bf16" in s


@pytest.mark.timeout(150)
def test_example_trains_on_two_ranks():
    import os
    import subprocess
    import sys
    from ds_autoplan.runtime.launch import free_port
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(free_port()), os.path.join(root, "examples", "train_megatron.py"),
           "--schedule", "v-min" if "v-min" in names() else "1f1b", "--steps", "3"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=140,
                       env={**os.environ, "PYTHONWARNINGS": "ignore"})
    steps = [ln for ln in p.stdout.splitlines() if ln.startswith("step ")]
    assert p.returncode == 0 and len(steps) == 3, p.stdout + p.stderr
    losses = [float(ln.rsplit(" ", 1)[1]) for ln in steps]
    assert losses[-1] < losses[0]
    said = [ln for ln in p.stdout.splitlines() if ln.startswith("ds_autoplan: plan ")]
    assert len(said) == 1 and "layers per chunk (per pp rank)" in said[0], p.stdout


def test_start_line_names_plan_schedule_placement_and_layers_per_chunk():
    from ds_autoplan.plan import Plan
    from ds_autoplan.runtime.megatron.setup import start_line
    from ds_autoplan.schedule.passes import plan_schedule
    plan = Plan(pp=2, num_microbatches=4, schedule="v-half", layers_per_stage=[1, 2, 2, 3],
                recompute_per_stage=[0, 0, 0, 0], micro_batch_size=2, precision="fp32", model="gpt-tiny")
    assert start_line(plan, plan_schedule(plan)) == (
        "ds_autoplan: plan gpt-tiny tp=1 pp=2 dp=1 micro-batch 2 x 4; schedule v-half (4 stages); "
        "placement v stage->pp rank [0, 1, 1, 0]; layers per chunk (per pp rank) [[1, 3], [2, 2]]")


def test_chunk_without_decoder_has_no_layers_to_recompute():
    """A chunk that is not a GPTModel (the benchmarks' sleep layers) runs: it has no decoder
    layers, so only an R would be refused (stage_recompute raises for k of 0 layers)."""
    import torch.nn as nn

    from ds_autoplan.runtime.megatron.executor import _chunk_layers
    from ds_autoplan.schedule import ScheduleError, build
    from ds_autoplan.schedule.passes import add_recompute, stage_recompute
    assert _chunk_layers(nn.Sequential(nn.Linear(2, 2))) == []
    sched = build("1f1b", 2, 2)
    assert stage_recompute(sched, 0, 0) == 0
    with pytest.raises(ScheduleError):
        stage_recompute(add_recompute(sched, [1, 1]), 0, 0)


# ------------------------------------------------------------------ expert parallelism (MoE)
@pytest.mark.timeout(900)
def test_expert_parallel_moe_pp2_ep2_1f1b_and_v_half(four_ranks):
    """Megatron's MoE layer (top-2 of 4 experts, alltoall dispatcher, per-expert MLPs) with
    expert parallelism 2 inside our 1F1B and V-Half on 4 ranks (pp 2 x ep 2): after Megatron's
    gradient reduction (dense over dp, experts over expert-dp) every rank's gradients,
    each local expert against the single-process model's expert of the same global index,
    equal the unpipelined single-process model fed all ranks' micro-batches (2 steps; V-Half
    with the router's auxiliary load-balancing loss), and V-Half's W actions run the experts'
    deferred weight GEMMs."""
    cases, out = four_ranks["moe"]
    print(json.dumps({"moe_max_grad_err": {c["schedule"]: max(o[i]["max_grad_err"] for o in out)
                                           for i, c in enumerate(cases)}}))     # pytest -s
    for i, case in enumerate(cases):
        rows = [o[i] for o in out]
        assert sorted((r["pp_rank"], r["ep_rank"]) for r in rows) == [(0, 0), (0, 1), (1, 0), (1, 1)]
        for r in rows:
            assert r["dp"] == 2 and r["local_experts"] == 2
            # each rank holds 2 of the 4 experts of each of its layers
            assert r["experts_compared"] == 2 * sum(case["layers"]) // 2, r
            assert r["max_grad_err"] <= 1e-6, (case["schedule"], r["rank"], r["max_grad_err"])
            assert r["max_grad"] > 1e-3
            assert (r["expert_w_items"] > 0) == r["has_w"] == (case["schedule"] == "v-half"), r
            if r["losses"][0]:     # the rank that holds the loss stage
                for got, ref in zip(r["losses"], r["ref_losses"]):
                    assert got == pytest.approx(ref, abs=1e-5)
        assert sum(bool(r["losses"][0]) for r in rows) == 2   # one loss rank per ep/dp rank


def test_context_parallel_plan_refused_on_cpu():
    """Megatron's context parallelism needs Transformer Engine's attention on a CUDA GPU:
    without one, initialize(plan) refuses a cp > 1 plan with one line naming the docs, before
    any process group is touched; the degrees reach Megatron's config otherwise."""
    from ds_autoplan.plan import Plan
    from ds_autoplan.runtime.megatron import initialize, plan_overrides
    from ds_autoplan.runtime.megatron.setup import context_parallel_problem
    from ds_autoplan.schedule import ScheduleError
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine may run context parallelism")
    plan = Plan(pp=2, num_microbatches=4, schedule="1f1b", layers_per_stage=[1, 1],
                recompute_per_stage=[0.0, 0.0], cp=2)
    assert context_parallel_problem(1) is None
    with pytest.raises(ScheduleError, match=r"context parallelism \(cp=2\) needs Transformer "
                                            r"Engine's attention on a CUDA GPU.*docs/megatron.md"):
        initialize(plan)
    over, _, _ = plan_overrides(plan)
    assert over["context_parallel_size"] == 2 and over["expert_model_parallel_size"] == 1


def test_split_spec_reaches_expert_linears_in_block_specs():
    """split_backward_spec swaps the experts' linear layers of a MoE layer spec, also inside a
    block spec's layer list (what Megatron-LM builds MoE models from)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from ds_autoplan.runtime.megatron import (SplitColumnParallelLinear, SplitRowParallelLinear,
                                              split_backward_spec)
    moe = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)
    block = split_backward_spec(TransformerBlockSubmodules([moe, moe]))
    for layer in block.layer_specs:
        experts = layer.submodules.mlp.submodules.experts.submodules
        assert experts.linear_fc1 is SplitColumnParallelLinear
        assert experts.linear_fc2 is SplitRowParallelLinear
    orig = moe.submodules.mlp.submodules.experts.submodules      # the input is left as it was
    assert (orig.linear_fc1, orig.linear_fc2) == (ColumnParallelLinear, RowParallelLinear)
