"""DynaPipe's adaptive cyclic schedule (docs/schedules.md §5.5) on the schedule core."""
import json
import time

import numpy as np
import pytest

import ds_autoplan.schedule.builders.dynapipe  # noqa: F401  (registers "dynapipe")
from ds_autoplan.schedule import (Costs, Kind, Schedule, ScheduleError, build, lower, simulate,
                                  validate)
from ds_autoplan.schedule.builders.dynapipe import cyclic_order, safety_stock
from ds_autoplan.dynamic.replay import run_threads


def random_costs(S, n, seed, spread=8.0, p2p=0.0):
    rng = np.random.default_rng(seed)
    f = np.exp(rng.uniform(0, np.log(spread), size=n))  # per micro-batch, same on every stage
    return Costs.per_stage(S, n, f=np.tile(f, (S, 1)), b=np.tile(2 * f, (S, 1)), w=0.0,
                           mem_f=np.tile(f, (S, 1)), p2p=p2p, num_ranks=None)


@pytest.mark.parametrize("placement", ["sequential", "v", [0, 1, 2, 3, 3, 2, 1, 0], [1, 0, 2, 3]])
@pytest.mark.parametrize("n", [1, 3, 9])
def test_validates_lowers_and_simulates_without_deadlock(placement, n):
    d = 4
    S = 8 if placement == "v" or len(placement) == 8 else 4
    c = random_costs(S, n, seed=n, p2p=0.1)
    s = build("dynapipe", d, n, costs=c, placement=placement)
    validate(s)
    assert {a.kind for a in s.actions()} <= {Kind.F, Kind.BW}
    res = simulate(s, c)
    assert s.meta["makespan"] == pytest.approx(res.makespan)
    low = lower(s, c)
    validate(low)
    assert simulate(low, c).makespan == pytest.approx(res.makespan)
    simulate(low, c, blocking=True)  # rendezvous sends: raises DeadlockError on a cycle
    assert len(s.meta["safety_stock"]) == d
    json.loads(s.to_json())  # meta is JSON-ready


def test_uniform_costs_match_1f1b_and_unequal_costs_beat_it():
    d, n = 4, 12
    one = build("1f1b", d, n)
    u = Costs.uniform(one, 1, 1, 1)
    assert simulate(build("dynapipe", d, n, costs=u), u).makespan == pytest.approx(
        simulate(one, u).makespan)
    wins = []
    for seed in range(10):
        c = random_costs(d, n, seed)
        a = build("dynapipe", d, n, costs=c)
        t_a, t_1 = simulate(a, c).makespan, simulate(one, c).makespan
        assert t_a <= t_1 * 1.02
        wins.append(t_1 / t_a)
        # the adaptive schedule keeps more ready work queued than 1F1B on the middle ranks
        assert sum(a.meta["safety_stock"][1:-1]) >= sum(safety_stock(one, simulate(one, c))[1:-1])
    assert np.mean(wins) > 1.05


@pytest.mark.parametrize("placement", ["sequential", "v"])
def test_memory_limit_delays_injection_and_is_respected(placement):
    d, n = 4, 10
    S = 2 * d if placement == "v" else d
    c = random_costs(S, n, seed=3)
    free = build("dynapipe", d, n, costs=c, placement=placement)
    peak_free = max(free.meta["peak_memory"])
    pl = free.placement  # one micro-batch's footprint on its rank is the smallest valid limit
    foot = max(c.mem_f[[s for s in range(S) if pl[s] == r], :].sum(0).max() for r in range(d))
    for frac in (0.3, 0.6):
        limit = max(peak_free * frac, foot)
        s = build("dynapipe", d, n, costs=c, placement=placement, mem_limit=limit)
        res = simulate(s, c)
        assert max(res.peak_memory) <= limit + 1e-9
        assert max(res.peak_memory) < peak_free
        simulate(lower(s, c), c, blocking=True)
    with pytest.raises(ScheduleError, match="mem_limit"):
        build("dynapipe", d, n, costs=c, placement=placement, mem_limit=0.5)


def test_max_inflight_caps_micro_batches_in_flight():
    d, n = 4, 9
    for cap in (1, 2, 3):
        order = cyclic_order((0, 1, 2, 3), n, np.ones((4, n)), max_inflight=cap)
        for lst in order:
            live = peak = 0
            for k, _, _ in lst:
                live += 1 if k == Kind.F else -1
                peak = max(peak, live)
            assert peak <= cap
    with pytest.raises(ScheduleError, match="max_inflight"):
        build("dynapipe", d, n, max_inflight=0)


def test_options_from_plain_lists_and_bad_input():
    s = build("dynapipe", 2, 3, mb_f=[1, 2, 3], mb_b=[2, 4, 6], mb_mem=[1, 1, 2])
    assert s.num_microbatches == 3 and s.placement == (0, 1)
    Schedule.from_json(s.to_json())
    with pytest.raises(ScheduleError, match="one value per micro-batch"):
        build("dynapipe", 2, 3, mb_f=[1, 2])
    with pytest.raises(ScheduleError, match="placement"):
        build("dynapipe", 2, 3, placement="zigzag")
    with pytest.raises(ScheduleError, match="need 4 x 3"):
        build("dynapipe", 2, 3, placement="v", costs=random_costs(2, 3, seed=0))


def test_threaded_execution_follows_the_communication_plan():
    d, n = 3, 6
    c = random_costs(d, n, seed=1)
    s = build("dynapipe", d, n, costs=c)
    low = lower(s, c)
    ms_per_unit = 2.0  # one cost unit = 2 ms of sleep
    # time.sleep, not models.sleep: the sleep layers' sleep ends early by its running estimate of
    # the overshoot, which a machine whose load drops makes too large (busy < work, seen in CI)
    out = run_threads(low, c, ms_per_unit, sleep=time.sleep)
    pred = simulate(s, c).makespan * ms_per_unit / 1e3
    # Sleeps never end early and each rank keeps its list order, so the threads can only be
    # slower than the simulated makespan (a replay that overlapped dependent actions would
    # be faster); the upper bound is loose because a loaded machine oversleeps.
    assert pred * 0.98 <= out["wall_s"] <= 3 * pred + 0.5
    work = [sum(float(c.duration(a.kind, a.stage, a.mb)) for a in low.ranks[r]
                if not a.kind.name.startswith(("SEND", "RECV"))) * ms_per_unit / 1e3
            for r in range(d)]
    assert all(b >= 0.98 * w for b, w in zip(out["busy_s"], work))
    # a wrong receive order is detected, not hung on
    r1 = list(low.ranks[1])
    i, j = [k for k, a in enumerate(r1) if a.kind == Kind.RECV_F][:2]
    r1[i], r1[j] = r1[j], r1[i]
    bad = low.replace_lists([low.ranks[0], r1, *low.ranks[2:]])
    with pytest.raises(ScheduleError, match="mismatch|timed out"):
        run_threads(bad, c, 0.1, timeout=2.0)
