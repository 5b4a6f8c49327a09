"""All builders: validity, deadlock freedom (compute-only and lowered, blocking sends),
simulator properties, ZB-H1, Merak SCP and the adaptive (memory-capped) V schedule."""
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from ds_autoplan.schedule import Costs, Kind, ScheduleError, build, lower, simulate, validate
from ds_autoplan.schedule.builders import adaptive as adaptive_mod
from ds_autoplan.schedule.builders import merak, zb

ALL = [("gpipe", {}), ("1f1b", {}), ("interleaved", {"v": 2}), ("interleaved", {"v": 3}),
       ("v-min", {}), ("v-half", {}), ("v-zb", {}), ("zb-h1", {}), ("merak-scp", {}),
       ("v-zb-greedy", {"f": 1.0, "b": 1.5, "w": 0.7}),
       ("merak-scp", {"shifted": False}), ("adaptive", {}), ("adaptive", {"mem_cap": 3.0})]


def _costs(s, f=1.0, b=1.0, w=1.0, r=None, p2p=0.0, seed=None):
    S, n = s.num_stages, s.num_microbatches
    if seed is not None:   # uneven per-stage costs
        import random
        rnd = random.Random(seed)
        f, b, w = ([rnd.uniform(0.5, 2.0) for _ in range(S)] for _ in range(3))
    return Costs.per_stage(S, n, f, b, w, r=r, p2p=p2p, num_ranks=s.num_ranks)


@pytest.mark.parametrize("name,kw", ALL, ids=[f"{n}{kw}" for n, kw in ALL])
@pytest.mark.parametrize("d", range(2, 9))
def test_every_builder_valid_and_deadlock_free(name, kw, d):
    if name == "adaptive" and kw.get("mem_cap", d) < adaptive_mod.min_cap_units(d):
        kw = {"mem_cap": adaptive_mod.min_cap_units(d)}
    for n in sorted({d, 2 * d + 1, 4 * d}):
        s = build(name, d, n, **kw)
        validate(s)             # (validated here: the simulations below skip their own check)
        c = _costs(s, seed=d * 100 + n, p2p=0.1)
        res = simulate(s, c, check=False)
        assert res.makespan > 0
        low = lower(s, c)
        validate(low)
        assert simulate(low, c, check=False).makespan == pytest.approx(res.makespan)  # same timing
        # rendezvous sends: raises DeadlockError on a send/recv ordering cycle
        assert simulate(low, c, blocking=True, check=False).makespan >= res.makespan - 1e-9


kinds = st.sampled_from(sorted({n for n, _ in ALL}))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=kinds, d=st.integers(2, 6), extra=st.integers(0, 12),
       fs=st.lists(st.floats(0.2, 3.0), min_size=3, max_size=3), p2p=st.floats(0, 0.5))
def test_simulator_properties(name, d, extra, fs, p2p):
    n = d + extra
    s = build(name, d, n)
    c = Costs.per_stage(s.num_stages, n, fs[0], fs[1], fs[2], p2p=p2p, num_ranks=d)
    res = simulate(s, c)
    by_key = {a.key: a for a in res.start}
    for r, lst in enumerate(s.ranks):
        spans = sorted((res.start[a], res.end[a]) for a in lst)
        assert all(e0 <= s1 + 1e-9 for (_, e0), (s1, _) in zip(spans, spans[1:]))  # no overlap
    for a in res.start:
        k, st_, mb = a.key
        if k in (Kind.B, Kind.BW):
            assert res.start[a] >= res.end[by_key[(Kind.F, st_, mb)]] - 1e-9
            if st_ + 1 < s.num_stages:
                nxt = by_key.get((Kind.B, st_ + 1, mb)) or by_key[(Kind.BW, st_ + 1, mb)]
                lat = p2p if s.placement[st_ + 1] != a.rank else 0.0
                assert res.start[a] >= res.end[nxt] + lat - 1e-9
        if k == Kind.W:
            assert res.start[a] >= res.end[by_key[(Kind.B, st_, mb)]] - 1e-9
        if k == Kind.F and st_ > 0:
            prev = by_key[(Kind.F, st_ - 1, mb)]
            lat = p2p if s.placement[st_ - 1] != a.rank else 0.0
            assert res.start[a] >= res.end[prev] + lat - 1e-9
    for r in range(d):
        assert res.peak_memory[r] == pytest.approx(max(m for _, m in res.mem_curve[r]))
        assert min(m for _, m in res.mem_curve[r]) >= -1e-9
    assert res.makespan >= max(res.busy) - 1e-9


@pytest.mark.parametrize("name", ["v-min", "v-half", "v-zb", "v-zb-greedy", "zb-h1", "merak-scp",
                                  "adaptive"])
def test_bad_arguments_rejected(name):
    with pytest.raises(ScheduleError, match="at least 2"):
        build(name, 1, 4)
    if name.startswith("v") or name == "adaptive":
        with pytest.raises(ScheduleError, match="micro-batches"):
            build(name, 4, 3)
    with pytest.raises(ScheduleError):
        build(name, 4, 0)
    fn = {"zb-h1": zb.zb_h1, "merak-scp": merak.merak_scp,
          "adaptive": adaptive_mod.adaptive}.get(name)
    if fn is not None:     # direct calls check too
        with pytest.raises(ScheduleError):
            fn(1, 4)


# ----------------------------------------------------------------------------- ZB-H1
@pytest.mark.parametrize("d", [2, 3, 4, 8])
def test_zb_h1_bubble_third_of_1f1b_same_memory(d):
    for n in (d, 2 * d, 4 * d):
        s = build("zb-h1", d, n)
        res = simulate(s, _costs(s))
        one = simulate(build("1f1b", d, n), _costs(build("1f1b", d, n)))
        # ZB paper: bubble (d-1)(F+B-W) vs 1F1B's (d-1)(F+B+W)
        assert res.makespan == 3 * n + (d - 1)
        assert (res.makespan - 3 * n) * 3 == one.makespan - 3 * n
        assert max(res.peak_units) == max(one.peak_units) == min(n, d)


# ----------------------------------------------------------------------------- Merak SCP
def test_merak_scp_golden_order_and_makespans():
    s = build("merak-scp", 4, 5)
    txt = [" ".join(f"{a.kind.value}{a.mb}" for a in lst) for lst in s.ranks]
    assert txt[2] == "F0 F1 R0 F2 BW0 R1 BW1 F3 R2 BW2 F4 R3 BW3 R4 BW4"
    assert txt[3] == "F0 BW0 F1 BW1 F2 BW2 F3 BW3 F4 BW4"
    assert txt[0] == "F0 F1 F2 F3 R0 BW0 F4 R1 BW1 R2 BW2 R3 BW3 R4 BW4"


@pytest.mark.parametrize("s_", [2, 3, 4, 6, 8])
def test_merak_scp_beats_1f1b_with_recompute(s_):
    for m in (3, s_, 2 * s_, 4 * s_):
        if m < 3:
            continue
        c = lambda sc: _costs(sc, 1, 1, 1, r=1)     # F = R = 1, BW = 2 (Merak §5.1)
        scp = simulate(build("merak-scp", s_, m), c(build("merak-scp", s_, m)))
        plain = build("merak-scp", s_, m, shifted=False, recompute=[1] * s_)
        early = simulate(plain, c(plain))
        assert scp.makespan == 4 * m + 3 * (s_ - 2)      # docs/merak.md §5.5
        assert early.makespan == 4 * m + 3 * (s_ - 1)    # 1F1B + early recompute
        same = build("merak-scp", s_, m, shifted=False)  # same recompute flags, no shift
        assert scp.makespan < simulate(same, c(same)).makespan


def test_merak_recompute_flags_memory_and_errors():
    # in-flight micro-batches (keep_ckpt = mem_f: a stash per micro-batch): [s..4, 3, 3, 1]
    s = build("merak-scp", 6, 12)
    c = Costs.per_stage(6, 12, 1, 1, 1, r=1, keep_ckpt=1.0)
    assert simulate(s, c).peak_memory == [6, 5, 4, 3, 3, 1]
    assert s.meta["recompute"] == [1, 1, 1, 1, 1, 0]
    part = build("merak-scp", 4, 8, recompute=[0.5, 0.25, 0, 0])
    assert {a.stage for a in part.actions() if a.kind == Kind.R} == {0, 1}
    with pytest.raises(ScheduleError, match="recompute"):
        build("merak-scp", 4, 8, recompute=[1, 1])
    with pytest.raises(ScheduleError, match="recompute"):
        build("merak-scp", 4, 8, recompute=[2, 0, 0, 0])
    assert build("merak-scp", 4, 2).meta["shifted"] is False     # n < 3: early-R 1F1B


# ----------------------------------------------------------------------------- adaptive
# docs/schedules.md §4.1: bubble (unit slots) of the appendix-A search by cap (in m)
TABLE_41 = {4: {4: 11, 5: 8, 6: 5, 7: 4, 8: 3},
            8: {8: 23, 9: 20, 10: 17, 11: 14, 12: 11, 13: 10, 14: 9, 15: 8, 16: 7}}


@pytest.mark.parametrize("d", [4, 8])
def test_adaptive_respects_cap_and_is_monotone(d):
    for n in (2 * d, 4 * d):
        prev = None
        for cap_m, ref in sorted(TABLE_41[d].items()):
            s = build("adaptive", d, n, mem_cap=cap_m / 2)      # the table's cap is in m
            res = simulate(s, _costs(s))
            assert max(res.peak_units) <= cap_m / 2 + 1e-9
            bubble = res.makespan - 6 * n
            assert bubble == ref
            assert prev is None or bubble <= prev
            prev = bubble
        assert bubble == d - 1                       # at 1F1B's memory: V-ZB's bubble
    # at V-Min's memory the search beats canonical V-Min (d=8: 23 vs 27 slots)
    s = build("adaptive", 8, 16, mem_cap=4)
    vmin = build("v-min", 8, 16)
    assert simulate(s, _costs(s)).makespan < simulate(vmin, _costs(vmin)).makespan


def test_adaptive_with_real_costs_never_worse():
    """Ranking the shortlisted blocks by simulated makespan with the given pass times."""
    for f, b, w in ((1, 2, 1),):
        for cap in (4, 8):
            c = lambda s: Costs.uniform(s, 2 * f, 2 * b, 2 * w)
            tuned = build("adaptive", 8, 16, mem_cap=cap, f=f, b=b, w=w)
            plain = build("adaptive", 8, 16, mem_cap=cap)
            rt = simulate(tuned, c(tuned))
            assert rt.makespan <= simulate(plain, c(plain)).makespan
            assert max(rt.peak_units) <= cap


def test_adaptive_default_cap_minimum_and_speed():
    adaptive_mod.search.cache_clear()
    adaptive_mod.evaluate.cache_clear()
    s = build("adaptive", 8, 16)
    # the default cap (d units = 2d m) is the V-ZB block's: taken directly, no block search
    assert adaptive_mod.search.cache_info().misses == 0 and s.meta["layout"] == "v-zb block"
    assert s.meta["mem_cap"] == 8
    assert max(simulate(s, _costs(s)).peak_units) <= 8
    for d in (4, 8, 11):
        assert adaptive_mod.min_cap_units(d) == (d + 4) // 3
    with pytest.raises(ScheduleError, match=r"minimum feasible 4 units"):
        build("adaptive", 8, 16, mem_cap=3.5)
    with pytest.raises(ScheduleError, match="positive"):
        build("adaptive", 8, 16, mem_cap=-1)
