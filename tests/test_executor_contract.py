"""The executor contract (runtime/common, issue 13): one hand-written action list with R,
split B/W and a V placement runs in the DeepSpeed and in the Megatron adapter, each with
gradients equal to a non-pipelined run of the same weights and a measured peak of
saved-activation bytes equal to the simulator's; R means the same in both (a prefix of the
stage, schedule/passes.py) and is never skipped."""
from __future__ import annotations

import json

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
    with pytest.raises(TypeError, match="no handler"):
        dispatch_table({Kind.F: print}, "x")
    assert set(dispatch_table({k: print for k in KINDS}, "x")) == set(Kind)


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


@pytest.mark.timeout(200)
def test_hand_list_in_deepspeed(tmp_path):
    pytest.importorskip("deepspeed")
    from harness import ENV
    from ds_autoplan.runtime.launch import results
    scheds = [hand_v(), no_r(hand_v())]
    path = tmp_path / "s.json"
    path.write_text(json.dumps([s.to_dict() for s in scheds]))
    rows = results(["-m", "harness.contract", str(path)], 2, timeout=180, env=ENV)
    with_r = _check([r for r in rows if r["schedule"] == "hand-v"], "deepspeed")
    plain = _check([r for r in rows if r["schedule"] == "hand-v-no-r"], "deepspeed no R")
    for rank in (0, 1):
        assert with_r[rank]["recomputes"] == 4 * (1 + rank)   # stage 3 (rank 0); 1, 2 (rank 1)
        assert with_r[rank]["peak"] < plain[rank]["peak"]


@pytest.mark.timeout(200)
def test_hand_list_in_megatron():
    pytest.importorskip("megatron.core")
    from harness.megatron_cases import launch
    cases = [dict(fn="harness.contract:megatron_case", pp=2, n=4, layers=[2, 2, 2, 2], schedule=s.name, sched=s.to_dict())
             for s in (hand_v(), no_r(hand_v()))]
    out = launch(2, cases, timeout=180)
    with_r = _check([o[0] for o in out], "megatron")
    plain = _check([o[1] for o in out], "megatron no R")
    for rank in (0, 1):
        assert with_r[rank]["recomputes"] == 4 * (1 + rank)
        assert with_r[rank]["peak"] < plain[rank]["peak"]
