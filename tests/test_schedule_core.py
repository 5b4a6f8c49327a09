"""Schedule IR, validator, simulator and lowering."""
import json

import pytest
from hypothesis import given, settings, strategies as st

from ds_autoplan.schedule import (Action, Costs, DeadlockError, Kind, Schedule, ScheduleError,
                                  build, lower, simulate, validate)

F, B, W, BW = Kind.F, Kind.B, Kind.W, Kind.BW


def test_1f1b_hand_timeline():
    # d=2, n=2, F=1 and BW=2 per stage: rank 1 runs F1.0 [1,2] BW1.0 [2,4] F1.1 [4,5] BW1.1 [5,7];
    # rank 0 runs F0.0 [0,1] F0.1 [1,2] BW0.0 [4,6] BW0.1 [7,9]
    s = build("1f1b", 2, 2)
    res = simulate(s, Costs.uniform(s, 1, 1, 1))
    assert res.makespan == 9
    ends = {a.short(): t for a, t in res.end.items()}
    assert ends == {"F0.0": 1, "F0.1": 2, "BW0.0": 6, "BW0.1": 9,
                    "F1.0": 2, "BW1.0": 4, "F1.1": 5, "BW1.1": 7}
    assert res.busy == [6, 6]


@pytest.mark.parametrize("d", range(2, 9))
@pytest.mark.parametrize("mult", [1, 2, 4])
def test_1f1b_bubble_and_memory_formulas(d, mult):
    n = d * mult
    s = build("1f1b", d, n)
    res = simulate(s, Costs.uniform(s, 1, 1, 1))
    assert res.bubble_ratio == pytest.approx((d - 1) / (n + d - 1))
    # rank i holds min(d - i, n) micro-batches of its stage: rank 0 peaks at M (= d units)
    assert res.peak_units == pytest.approx([min(d - i, n) for i in range(d)])


def test_units_are_comparable_across_stage_counts():
    # interleaved with v chunks: each stage holds 1/v of a rank's share; the unit stays M/d
    s = build("interleaved", 4, 8, v=2)
    res = simulate(s, Costs.uniform(s, 1, 1, 1))
    assert res.unit == pytest.approx(1.0)
    g = build("gpipe", 4, 8)
    assert max(simulate(g, Costs.uniform(g)).peak_units) == 8  # all n micro-batches


def test_interleaved_matches_megatron_table_and_beats_1f1b():
    s = build("interleaved", 4, 8, v=2)
    assert s.meta["microbatch_group_size_per_vp_stage"] == 4
    # Megatron's rank 0 warm-up: (d-1)*2 + (v-1)*group = 10 forwards, chunk 0 of mbs 0..3 first
    r0 = [a.short() for a in s.ranks[0][:10]]
    assert r0 == ["F0.0", "F0.1", "F0.2", "F0.3", "F4.0", "F4.1", "F4.2", "F4.3", "F0.4", "F0.5"]
    one = build("1f1b", 4, 8)
    assert simulate(s, Costs.uniform(s)).makespan < simulate(one, Costs.uniform(one)).makespan
    # n not divisible by d: a Megatron-valid group size is chosen
    assert build("interleaved", 5, 17, v=2).meta["microbatch_group_size_per_vp_stage"] == 6


@pytest.mark.parametrize("name,kw", [("gpipe", {}), ("1f1b", {}), ("interleaved", {"v": 2}),
                                     ("interleaved", {"v": 3})])
@pytest.mark.parametrize("d", [2, 3, 5, 8])
def test_lowering_is_deadlock_free_and_keeps_timing(name, kw, d):
    for n in (d, d + 1, 2 * d + 1, 4 * d):
        s = build(name, d, n, **kw)
        for p2p in (0.0, 0.3):
            c = Costs.uniform(s, 1.0, 1.3, 0.7, p2p=p2p)
            base = simulate(s, c)
            low = lower(s, c)
            validate(low)
            assert simulate(low, c).makespan == pytest.approx(base.makespan)
            simulate(low, c, blocking=True)  # rendezvous sends: raises on deadlock


def test_serialisation_round_trips(tmp_path):
    s = lower(build("interleaved", 3, 6, v=2))
    assert Schedule.from_json(s.to_json()).ranks == s.ranks
    assert Schedule.from_text(s.to_text()).ranks == s.ranks
    for ext in ("json", "txt"):
        p = tmp_path / f"s.{ext}"
        s.save(str(p))
        back = Schedule.load(str(p))
        assert back.ranks == s.ranks and back.placement == s.placement
    rows = s.to_csv().splitlines()
    assert rows[0] == "rank,index,kind,stage,mb,peer"
    assert len(rows) == 1 + sum(len(x) for x in s.ranks)


def _mutate(s, rank, fn):
    lists = [list(x) for x in s.ranks]
    lists[rank] = fn(lists[rank])
    return s.replace_lists(lists)


def test_validator_rejects_malformed_schedules():
    s = build("1f1b", 2, 2)
    with pytest.raises(ScheduleError, match="missing BW|missing"):
        validate(_mutate(s, 0, lambda l: [a for a in l if a.short() != "BW0.1"]))
    with pytest.raises(ScheduleError, match="duplicate"):
        validate(_mutate(s, 0, lambda l: l + [l[0]]))
    with pytest.raises(ScheduleError, match="placed on rank"):
        validate(_mutate(s, 0, lambda l: l[:-1] + [Action(0, BW, 1, 1)]))
    with pytest.raises(ScheduleError, match="before its dependency"):
        validate(_mutate(s, 1, lambda l: [l[1], l[0]] + l[2:]))  # BW1.0 before F1.0
    split = Schedule.from_keys("x", 1, (0, 1), [[(F, 0, 0), (B, 0, 0)], [(F, 1, 0), (BW, 1, 0)]])
    with pytest.raises(ScheduleError, match="missing W"):
        validate(split)
    low = lower(s)
    bad = _mutate(low, 1, lambda l: [a for a in l if a.kind != Kind.RECV_F] )
    with pytest.raises(ScheduleError, match="do not match"):
        validate(bad)
    with pytest.raises(ScheduleError, match="not valid JSON"):
        Schedule.from_json("{bad")
    with pytest.raises(ScheduleError, match="cannot parse"):
        Schedule.from_text("# ds_autoplan schedule name=x microbatches=1 placement=0,1\nrank0: Q0.0\n")


def test_deadlock_reports_the_cycle():
    # rank 1 insists on F1.1 first; F0.1 on rank 0 comes after BW0.0, which needs BW1.0
    s = Schedule.from_keys("bad", 2, (0, 1), [
        [(F, 0, 0), (BW, 0, 0), (F, 0, 1), (BW, 0, 1)],
        [(F, 1, 1), (F, 1, 0), (BW, 1, 0), (BW, 1, 1)]])
    with pytest.raises(DeadlockError) as e:
        simulate(s, Costs.uniform(s))
    assert sorted(e.value.cycle) == [0, 1]
    assert e.value.heads == {0: "BW0.0", 1: "F1.1"}


def test_rendezvous_deadlock_in_lowered_lists_is_detected():
    # valid send/recv pairing, but each rank sends before posting the receive the other
    # side's send waits for: fine with isend, deadlock with blocking sends
    text = """# ds_autoplan schedule name=x microbatches=2 placement=0,1
rank0: F0.0 SEND_F0.0@1 F0.1 SEND_F0.1@1 RECV_B0.0@1 BW0.0 RECV_B0.1@1 BW0.1
rank1: RECV_F1.0@0 F1.0 BW1.0 SEND_B1.0@0 RECV_F1.1@0 F1.1 BW1.1 SEND_B1.1@0
"""
    s = Schedule.from_text(text)
    c = Costs.uniform(s)
    simulate(s, c)
    with pytest.raises(DeadlockError, match="wait cycle: rank 0 -> rank 1 -> rank 0"):
        simulate(s, c, blocking=True)


def test_recompute_moves_memory_to_the_recompute():
    base = build("1f1b", 2, 2)
    lists = [[x for a in lst for x in ([Action(a.rank, Kind.R, a.stage, a.mb), a]
                                       if a.kind == BW else [a])] for lst in base.ranks]
    s = base.replace_lists(lists)
    c = Costs.per_stage(2, 2, 1, 1, 1, mem_f=10, keep_ckpt=1)
    res = simulate(s, c)
    plain = simulate(base, Costs.per_stage(2, 2, 1, 1, 1, mem_f=10))
    assert res.peak_memory[0] == 1 + 10      # one boundary kept + one recomputed stage
    assert plain.peak_memory[0] == 20
    assert res.makespan > plain.makespan     # R costs a forward


@settings(max_examples=40, deadline=None)
@given(d=st.integers(2, 6), extra=st.integers(0, 6), name=st.sampled_from(["gpipe", "1f1b", "interleaved"]),
       f=st.floats(0.1, 3), b=st.floats(0.1, 3), w=st.floats(0.1, 3), p2p=st.floats(0, 1))
def test_simulator_properties(d, extra, name, f, b, w, p2p):
    n = d + extra
    s = build(name, d, n)
    res = simulate(s, Costs.uniform(s, f, b, w, p2p=p2p))
    for r in range(d):
        spans = sorted((res.start[a], res.end[a]) for a in s.ranks[r])
        assert all(e0 <= s1 + 1e-9 for (_, e0), (s1, _) in zip(spans, spans[1:]))  # no overlap
        assert res.peak_memory[r] == pytest.approx(max(m for _, m in res.mem_curve[r]))
        assert min(m for _, m in res.mem_curve[r]) >= -1e-9
    for a, st_ in res.start.items():
        if a.kind == BW:
            fwd = next(x for x in res.end if x.key == (F, a.stage, a.mb))
            assert st_ >= res.end[fwd] - 1e-9


def test_cli_simulate_json_and_errors(tmp_path, capsys):
    from ds_autoplan.cli import main
    assert main(["simulate", "--schedule", "1f1b", "-d", "4", "-n", "8", "--json",
                 "--plot", str(tmp_path / "g.png"), "--memory-plot", str(tmp_path / "m.svg")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["peak_activation"] == [4, 3, 2, 1]
    assert out["bubble_ratio"] == pytest.approx(3 / 11)
    assert set(out) >= {"makespan", "bubble_ratio", "peak_activation", "schedule"}
    assert (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "m.svg").read_text().lstrip().startswith("<?xml")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.png", "m.svg"]    # nothing else
    assert main(["simulate", "--compare", "1f1b,gpipe", "-d", "4", "-n", "8", "--json"]) == 0
    cmp_ = json.loads(capsys.readouterr().out)["compare"]
    assert cmp_[1]["peak_ratio"] == 2.0
    # builder options by signature: stages 2 and 3 keep their activations, 0 and 1 recompute
    assert main(["simulate", "--schedule", "merak-scp", "-d", "4", "-n", "8",
                 "-o", "recompute=[1,1,0,0]", "--json"]) == 0
    peaks = json.loads(capsys.readouterr().out)["peak_activation"]
    assert peaks[2] > peaks[0] and peaks[2] > peaks[1]
    for bad in (["-o", "foo=1"], ["-d", "1"], ["--times", "1,-2,1"], ["--schedule", "nope"], ["-d", "4", "-n", "0"],
                ["--file", str(tmp_path / "missing.json")]):
        assert main(["simulate", *bad]) == 2
        assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("d,n", [(2, 2), (4, 8), (3, 7)])
def test_runtime_overheads_follow_the_1f1b_formula(d, n):
    # runtime overheads: dispatch per compute action, step once per iteration; 1F1B's makespan is
    # (n + d - 1)(F + BW) (docs/schedules.md §3.4) with F -> F + δ and BW -> B + W + δ, plus step
    from ds_autoplan.schedule import Overheads
    s = build("1f1b", d, n)
    ov = Overheads(dispatch=0.25, step=3.0)
    res = simulate(s, Costs.uniform(s, 1, 1, 1, per="stage").with_overheads(ov))
    assert res.makespan == pytest.approx((n + d - 1) * (1 + 2 + 2 * 0.25) + 3.0)
    assert simulate(s, Costs.uniform(s, 1, 1, 1, per="stage")).makespan == (n + d - 1) * 3


def test_dispatch_is_paid_per_action_so_split_schedules_pay_more():
    # V-ZB runs F, B and W as separate actions (3 per stage and micro-batch) where 1F1B
    # runs F and a fused BW (2): the same dispatch costs V-ZB more per micro-batch
    from ds_autoplan.schedule import Overheads
    d, n, delta = 4, 8, 0.1
    grow = {}
    for name in ("1f1b", "v-zb"):
        s = build(name, d, n)
        c = Costs.uniform(s, 1, 1, 1)
        grow[name] = (simulate(s, c.with_overheads(Overheads(dispatch=delta))).makespan
                      - simulate(s, c).makespan)
        busy = simulate(s, c.with_overheads(Overheads(dispatch=delta))).busy
        per_rank = sum(1 for a in s.ranks[0] if a.kind.is_compute)
        assert busy[0] == pytest.approx(simulate(s, c).busy[0] + per_rank * delta)
    assert grow["v-zb"] > grow["1f1b"] > 0
    with pytest.raises(ScheduleError):
        Overheads(dispatch=-1.0)


def test_backward_transient_raises_the_peak_while_the_backward_runs():
    # d=2, n=2, per stage F allocates 1 and BW frees it (docs/schedules.md §0); a backward that
    # also holds 0.5 from its start (a deferred W's output gradient) peaks 0.5
    # higher on both ranks: rank 0 holds two micro-batches when BW0.0 starts, rank 1 one
    s = build("1f1b", 2, 2)
    c = Costs.per_stage(2, 2, 1.0, 1.0, 0.0, mem_f=1.0, mem_b=-1.0, mem_w=0.0)
    assert simulate(s, c).peak_memory == [2.0, 1.0]
    assert simulate(s, c.with_transient(0.5)).peak_memory == [2.5, 1.5]
    assert simulate(s, c.with_transient(0.5)).makespan == simulate(s, c).makespan
