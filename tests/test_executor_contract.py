"""The executor contract (runtime/common): one hand-written action list with R,
split B/W and a V placement runs in the DeepSpeed and in the Megatron adapter, each with
gradients equal to a non-pipelined run of the same weights and a measured peak of
saved-activation bytes equal to the simulator's; R means the same in both (a prefix of the
stage, schedule/passes.py) and is never skipped."""
from __future__ import annotations

import pytest

from ds_autoplan.schedule import Kind, Schedule, ScheduleError, build, v_placement, validate
from ds_autoplan.schedule.passes import add_recompute, recompute_layers, single_stage, stage_recompute

TOL = 1e-5


def hand_v(d: int = 2, n: int = 4, recompute=(0, 1, 2, 1)) -> Schedule:
    """V placement, 2 layers per stage: chunk 0 of every rank F ... B/W split (rank 0) or BW;
    chunk 1 R (a 1-layer prefix, or the whole stage) before its backward."""
    S, lists = 2 * d, []
    for r in range(d):
        c0, c1 = r, S - 1 - r
        keys = [("F", c0, m) for m in range(n)] + [("F", c1, m) for m in range(n)]
        for m in range(n):
            keys += [("R", c1, m)] if recompute[c1] else []
            keys += [("B", c1, m), ("W", c1, m)] if r == 0 else [("BW", c1, m)]
        for m in range(n):
            keys += [("R", c0, m)] if recompute[c0] else []
            keys += [("BW", c0, m)] if r == 0 else [("B", c0, m), ("W", c0, m)]
        lists.append(keys)
    return Schedule.from_keys("hand-v", n, v_placement(d), lists, recompute_layers=list(recompute))


def no_r(sched: Schedule) -> Schedule:
    return Schedule.from_keys("hand-v-no-r", sched.num_microbatches, sched.placement,
                              [[(a.kind.value, a.stage, a.mb) for a in lst if a.kind != Kind.R]
                               for lst in sched.ranks])


def test_recompute_pass_and_counts():
    s = add_recompute(build("1f1b", 2, 3), [1, 0])
    validate(s)
    assert s.meta["recompute_layers"] == [1, 0]
    assert recompute_layers(s, [2, 2]) == [1, 0]
    h = hand_v()
    assert recompute_layers(h, [2, 2, 2, 2]) == [0, 1, 2, 1]
    bare = Schedule.from_keys("x", 2, [0, 1], [[("F", 0, m) for m in range(2)] + [("R", 0, 0), ("BW", 0, 0), ("BW", 0, 1)],
                                               [k for m in range(2) for k in (("F", 1, m), ("BW", 1, m))]])
    assert stage_recompute(bare, 0, 3) == 3            # no count: the whole stage
    assert stage_recompute(bare, 1, 3) == 0            # no R: nothing, whatever the count
    with pytest.raises(ScheduleError, match="recomputes 0"):
        stage_recompute(bare.replace_lists(bare.ranks, recompute_layers=[0, 0]), 0, 3)
    with pytest.raises(ScheduleError, match="recomputes 4"):
        stage_recompute(bare.replace_lists(bare.ranks, recompute_layers=[4, 0]), 0, 3)
    one = single_stage(3)
    validate(one)
    assert [a.short() for a in one.ranks[0]][:2] == ["F0.0", "BW0.0"]


def test_dispatch_tables_cover_every_kind():
    from ds_autoplan.runtime.common import KINDS, dispatch_table
    with pytest.raises(TypeError, match="no handler for action kind.s. B, W"):
        dispatch_table({Kind.F: print}, "x")
    assert set(dispatch_table({k: print for k in KINDS}, "x")) == set(Kind)


@pytest.mark.parametrize("kind", list(Kind), ids=lambda k: k.value)
def test_every_kind_has_cost_memory_colour_and_rule(kind):
    """A new action kind must be defined everywhere an action is costed, measured, drawn and
    executed: this test fails naming it (and the place it misses) otherwise."""
    from ds_autoplan.runtime.common import RULES
    from ds_autoplan.runtime.common.memory import MEMORY_RULES
    from ds_autoplan.schedule import Costs
    from ds_autoplan.schedule.plots import COLORS
    assert kind in RULES, f"{kind.value}: no rule in runtime.common.RULES"
    assert kind in MEMORY_RULES, f"{kind.value}: no memory rule in runtime.common.memory"
    assert not kind.is_compute or kind in COLORS, f"{kind.value}: no colour in schedule.plots.COLORS"
    costs = Costs.uniform(build("1f1b", 2, 2), 1.0, 2.0, 3.0)
    costs.duration(kind, 0, 0)              # raises for a kind without a cost
    costs.mem_delta(kind, 0, 0, False)
    if kind.is_compute:       # a compute action costs time; only SEND/RECV may be free
        assert costs.duration(kind, 0, 0) > 0, f"{kind.value}: no duration in Costs.duration"


def test_uncosted_kind_is_an_error():
    """A kind the cost model does not handle raises instead of simulating as free."""
    from ds_autoplan.runtime.common.memory import memory_rule
    from ds_autoplan.schedule import Costs
    costs = Costs.uniform(build("1f1b", 2, 2))
    with pytest.raises(ScheduleError, match="no cost for action kind X"):
        costs.duration("X", 0, 0)
    with pytest.raises(ScheduleError, match="no cost for action kind X"):
        costs.mem_delta("X", 0, 0, False)
    with pytest.raises(ScheduleError, match="no memory rule"):
        memory_rule("X")


def test_accept_validates_lowered_lists():
    from ds_autoplan.runtime.common import accept
    from ds_autoplan.schedule import lower
    low = lower(hand_v())
    assert accept(low, num_ranks=2, num_microbatches=4) is low
    broken = low.replace_lists([low.ranks[0][1:], low.ranks[1]])     # an action dropped
    with pytest.raises(ScheduleError):
        accept(broken, num_ranks=2)
    with pytest.raises(ScheduleError, match="micro-batches"):
        accept(low, num_ranks=2, num_microbatches=8)


def _check(rows, label):
    assert sorted(r["rank"] for r in rows) == [0, 1], label
    for r in rows:
        assert r["grad_err"] <= TOL * max(1.0, r["grad_max"]), (label, r)
        assert r["peak"] == r["sim_peak"], (label, r)        # exact
    return {r["rank"]: r for r in rows}


def _runs(*items) -> list:
    """``(plan dict, Schedule or None)`` pairs as the workers read them (None: the plan's own)."""
    return [{"plan": p, "sched": s and s.to_dict()} for p, s in items]


def _in_both(runs) -> dict:
    """Every run on 2 ranks, in the DeepSpeed adapter and then (with megatron-core) in the
    Megatron adapter, in one process group: ``{"ds"|"mg": per run, the rows of its ranks}``."""
    import importlib.util

    from harness import ENV
    from ds_autoplan.runtime.launch import launch
    fns = {"ds": "harness.contract:deepspeed_case"}
    if importlib.util.find_spec("megatron") and importlib.util.find_spec("megatron.core"):
        fns["mg"] = "harness.contract:megatron_case"
    out = launch(2, [dict(run, fn=fn) for fn in fns.values() for run in runs], timeout=300,
                 env=ENV)
    return {k: [[out[r][j * len(runs) + i] for r in range(2)] for i in range(len(runs))]
            for j, k in enumerate(fns)}


def _hand_runs():
    from harness.contract import plan_dict
    return _runs(*((plan_dict(s.name, 2, 4, 4), s) for s in (hand_v(), no_r(hand_v()))))


def _plan_runs():
    """The same plan with recompute_per_stage [0.5, 0.0] and without recompute."""
    from harness.contract import plan_dict
    return _runs((plan_dict("1f1b", 2, 2, 4, [0.5, 0.0]), None), (plan_dict("1f1b", 2, 2, 4), None))


@pytest.fixture(scope="module")
def in_both():
    """The hand lists' runs, then the plan runs, in each runtime: one 2-rank process group."""
    pytest.importorskip("deepspeed")
    return _in_both(_hand_runs() + _plan_runs())


@pytest.fixture(scope="module")
def in_deepspeed(in_both):
    return in_both["ds"]


@pytest.fixture(scope="module")
def in_megatron(in_both):
    pytest.importorskip("megatron.core")
    return in_both["mg"]


def _check_hand(rows, label):
    with_r, plain = _check(rows[0], label), _check(rows[1], label + " no R")
    for rank in (0, 1):
        assert with_r[rank]["recomputes"] == 4 * (1 + rank)   # stage 3 (rank 0); 1, 2 (rank 1)
        assert with_r[rank]["peak"] < plain[rank]["peak"]


@pytest.mark.timeout(400)       # the first test pays for the fixture's process group
def test_hand_list_in_deepspeed(in_deepspeed):
    _check_hand(in_deepspeed[:2], "deepspeed")


@pytest.mark.timeout(400)
def test_hand_list_in_megatron(in_megatron):
    _check_hand(in_megatron[:2], "megatron")


def test_plan_recompute_is_one_pass_for_both_runtimes():
    """A plan's recompute_per_stage becomes R actions by schedule.passes.plan_schedule, and
    both adapters take the same list: Megatron's TransformerConfig recompute stays off."""
    from ds_autoplan.plan import Plan
    from ds_autoplan.schedule.passes import plan_schedule
    plan = Plan(pp=2, num_microbatches=4, schedule="1f1b", layers_per_stage=[4, 4],
                recompute_per_stage=[0.5, 0.0], precision="fp32")
    s = plan_schedule(plan)
    validate(s)
    assert s.meta["recompute_layers"] == [2, 0]
    assert [a.short() for a in s.ranks[0] if a.kind == Kind.R] == [f"R0.{m}" for m in range(4)]
    assert not any(a.kind == Kind.R for a in s.ranks[1])
    assert plan_schedule(plan, hand_v()) == hand_v()          # a list with R keeps its own
    assert plan_schedule(Plan(pp=2, num_microbatches=4, layers_per_stage=[4, 4],
                              recompute_per_stage=[0.0, 0.0])) == build("1f1b", 2, 4)
    one = plan_schedule(Plan(pp=1, num_microbatches=2, layers_per_stage=[4],
                             recompute_per_stage=[1.0]))
    assert [a.short() for a in one.ranks[0]] == ["F0.0", "R0.0", "BW0.0", "F0.1", "R0.1", "BW0.1"]
    pytest.importorskip("megatron.core")
    from ds_autoplan.runtime.megatron import MegatronSetup, get_forward_backward_func, plan_overrides
    from ds_autoplan.schedule import lower
    assert get_forward_backward_func(plan).schedule == lower(s)
    over, rec, layout = plan_overrides(plan)
    assert rec == [2, 0]
    for selective in (False, True):
        setup = MegatronSetup(s, 0, over, [0], rec, layout, selective)
        got = {k: v for k, v in setup.chunk_overrides(0).items() if k.startswith("recompute")}
        assert got == {"recompute_granularity": "selective" if selective else None,
                       "recompute_method": None, "recompute_num_layers": None}


@pytest.mark.timeout(700)
def test_plan_recompute_same_in_both_runtimes(in_deepspeed, in_megatron):
    """The same plan (pp 2, 1F1B, 4 + 4 layers, recompute_per_stage [0.5, 0.0], fp32) in the
    DeepSpeed and the Megatron adapter: the same lowered action lists, with R on stage 0;
    gradients equal to a non-pipelined run; measured peak saved-activation bytes per rank
    equal to the simulator's (exact) and, on rank 0, below the same plan without recompute."""
    from ds_autoplan.plan import Plan
    from ds_autoplan.schedule import lower
    from ds_autoplan.schedule.passes import plan_schedule
    rec = _plan_runs()[0]["plan"]
    assert rec["recompute_per_stage"] == [0.5, 0.0]
    expect = lower(plan_schedule(Plan.from_dict(rec)))
    for label, rows in (("deepspeed", in_deepspeed[2:]), ("megatron", in_megatron[2:])):
        with_r, without = _check(rows[0], label), _check(rows[1], label + " no recompute")
        for rank in (0, 1):
            assert with_r[rank]["actions"] == [a.short() for a in expect.ranks[rank]], (label, rank)
            assert without[rank]["recomputes"] == 0, label
        assert with_r[0]["recomputes"] == 4 and with_r[1]["recomputes"] == 0, label
        assert with_r[0]["peak"] < without[0]["peak"], label
        assert with_r[1]["peak"] == without[1]["peak"], label
        print(label, {r: (with_r[r]["peak"], without[r]["peak"], with_r[r]["grad_err"]) for r in (0, 1)})
