"""V-Min / V-Half / V-ZB builders against the exact numbers of docs/schedules.md
(§2.3 blocks, §2.5 peaks, §2.6 bubbles, §2.7 real-cost growth, §3.4 table, §3.5 orders)."""
import math

import pytest

from ds_autoplan.schedule import Costs, ScheduleError, build, simulate
from ds_autoplan.schedule.builders import vshape

V = ("v-min", "v-half", "v-zb")


def unit_sim(s, f=1.0, b=1.0, w=1.0):
    """Unit model of §3.4: F, B, W cost f, b, w per V stage (2·f... per 1F1B stage), mem (1,0,-1)."""
    return simulate(s, Costs.uniform(s, 2 * f, 2 * b, 2 * w))


def v_order(s, rank):
    d = s.num_ranks
    return " ".join(f"{a.kind.value}{0 if a.stage < d else 1}.{a.mb}" for a in s.ranks[rank])


# §3.4: d, n -> (makespan, bubble ratio, peak in m) for 1F1B, V-Min, V-Half, V-ZB
TABLE_34 = {
    (2, 8): [(54, .111, 4), (51, .059, 4), (49, .020, 4), (49, .020, 4)],
    (3, 12): [(84, .143, 6), (77, .065, 4), (77, .065, 4), (74, .027, 6)],
    (4, 4): [(42, .429, 8), (35, .314, 4), (34, .294, 6), (29, .172, 8)],
    (4, 8): [(66, .273, 8), (59, .186, 4), (53, .094, 6), (51, .059, 8)],
    (4, 16): [(114, .158, 8), (107, .103, 4), (101, .050, 6), (99, .030, 8)],
    (8, 16): [(138, .304, 16), (123, .220, 8), (113, .150, 10), (103, .068, 16)],
    (8, 32): [(234, .179, 16), (219, .123, 8), (209, .081, 10), (199, .035, 16)],
    (16, 32): [(282, .319, 32), (251, .235, 12), (233, .176, 18), (207, .072, 32)],
    (16, 64): [(474, .190, 32), (443, .133, 12), (425, .096, 18), (399, .038, 32)],
}


@pytest.mark.parametrize("d,n", sorted(TABLE_34))
def test_table_3_4(d, n):
    for name, (mk, bub, peak_m) in zip(("1f1b", *V), TABLE_34[(d, n)]):
        res = unit_sim(build(name, d, n))
        assert res.makespan == mk, name
        assert res.bubble_ratio == pytest.approx(bub, abs=6e-4), name
        assert max(res.peak_units) * 2 == peak_m, name   # one unit = 2 m


def test_per_device_peaks_d4_n8():
    want = {"1f1b": [8, 6, 4, 2], "v-min": [4] * 4, "v-half": [6] * 4, "v-zb": [8] * 4}
    for name, peaks in want.items():
        assert [p * 2 for p in unit_sim(build(name, 4, 8)).peak_units] == peaks


@pytest.mark.parametrize("d", range(2, 17))
def test_closed_forms_2_5_and_2_6(d):
    """Exact peaks (units of M/d) and bubbles (unit slots) for n in {2d, 3d}."""
    bubble = {"1f1b": 6 * (d - 1), "v-min": 4 * d - (7 if d % 3 == 0 else 5),
              "v-half": 1 if d == 2 else 3 * d - (7 if d % 2 == 0 else 4), "v-zb": d - 1}
    peak = {"1f1b": d, "v-min": (d + 4) // 3, "v-half": (d + 2) // 2, "v-zb": d}
    for n in (2 * d, 3 * d):
        for name in bubble:
            res = unit_sim(build(name, d, n))
            assert res.makespan - 6 * n == bubble[name], (name, n)
            assert max(res.peak_units) == peak[name], (name, n)
            if name != "1f1b":   # balanced: every device at the peak (device 0 may be 1 m lower)
                assert min(res.peak_units) >= peak[name] - 0.5, (name, n)
        one = unit_sim(build("1f1b", d, n))
        assert one.bubble_ratio == pytest.approx((d - 1) / (n + d - 1))


def test_bubble_and_memory_vs_1f1b_asymptotes():
    """Paper Table 1: V-Min ≈ 2/3 and V-Half ≈ 1/2 of 1F1B's bubble, ≈ 1/3 and 1/2 of its
    memory; V-ZB: 1F1B's memory and a constant d-1 slots (1/6 of 1F1B's 6(d-1), §2.6)."""
    d, n = 16, 64
    one = unit_sim(build("1f1b", d, n))
    base = one.makespan - 6 * n
    for name, b_ratio, m_ratio in (("v-min", 2 / 3, 1 / 3), ("v-half", 1 / 2, 1 / 2), ("v-zb", 1 / 6, 1)):
        res = unit_sim(build(name, d, n))
        assert (res.makespan - 6 * n) / base == pytest.approx(b_ratio, abs=0.06), name
        assert max(res.peak_units) / max(one.peak_units) == pytest.approx(m_ratio, abs=0.1), name


def test_blocks_of_2_3_and_eq1_bound():
    assert vshape.vmin_block(4) == [[0, 7, 8, 15], [1, 6, 9, 14], [2, 5, 10, 13], [3, 4, 11, 12]]
    assert vshape.vhalf_block(4) == [[0, 10, 14, 25], [2, 9, 16, 24], [4, 8, 18, 23], [6, 7, 20, 22]]
    assert vshape.vzb_block(4) == [[0, 19, 20, 39], [4, 17, 24, 37], [8, 15, 28, 35], [12, 13, 32, 33]]
    for d in range(2, 17):
        for name, fn in (("v-min", vshape.vmin_block), ("v-half", vshape.vhalf_block),
                         ("v-zb", vshape.vzb_block)):
            blk = fn(d)
            assert vshape.conflict_free(blk), (name, d)
            if d > 8:
                continue
            # Eq. 1: peak_i <= sum_s ceil(l_s / T) m; lifespan from F start to W end, W at the
            # first free slot after its B (mod T)
            bound = 0
            for row in blk:
                used = {x % 6 for x in row}
                lifes = []
                for f, b in ((row[1], row[2]), (row[0], row[3])):
                    k = next(j for j in range(1, 7) if (b + j) % 6 not in used)
                    used.add((b + k) % 6)
                    lifes.append(b + k + 1 - f)
                bound = max(bound, sum(math.ceil(x / 6) for x in lifes))
            assert max(unit_sim(build(name, d, 3 * d)).peak_units) * 2 <= bound, (name, d)
    assert not vshape.conflict_free([[0, 6, 1, 2]])


GOLDEN = {
    ("v-min", 2, 4): (27, [3, 4], [
        "F0.0 F0.1 F1.0 B1.0 W1.0 B0.0 W0.0 F1.1 B1.1 W1.1 F0.2 B0.1 W0.1 F1.2 B1.2 W1.2 F0.3 B0.2 W0.2 F1.3 B1.3 W1.3 B0.3 W0.3",
        "F0.0 F1.0 B1.0 B0.0 F0.1 F1.1 W1.0 W0.0 B1.1 B0.1 F0.2 F1.2 W1.1 W0.1 B1.2 B0.2 F0.3 F1.3 W1.2 W0.2 B1.3 B0.3 W1.3 W0.3"]),
    ("v-half", 2, 4): (25, [4, 4], [
        "F0.0 F0.1 F0.2 F1.0 B1.0 W1.0 F1.1 B0.0 B1.1 W1.1 F1.2 W0.0 F0.3 B0.1 B1.2 W1.2 F1.3 B1.3 B0.2 W1.3 B0.3 W0.1 W0.2 W0.3",
        "F0.0 F1.0 F0.1 F1.1 B1.0 W1.0 B0.0 W0.0 F0.2 F1.2 B1.1 B0.1 W1.1 F0.3 W0.1 F1.3 B1.2 B0.2 B1.3 B0.3 W1.2 W1.3 W0.2 W0.3"]),
    ("v-zb", 2, 4): (25, [4, 4], [
        "F0.0 F0.1 F0.2 F1.0 B1.0 W1.0 F1.1 B1.1 B0.0 W1.1 B0.1 F0.3 W0.0 F1.2 B1.2 W1.2 W0.1 F1.3 B1.3 B0.2 W1.3 B0.3 W0.2 W0.3",
        "F0.0 F1.0 F0.1 F1.1 B1.0 B0.0 W1.0 B1.1 B0.1 F0.2 W1.1 F1.2 W0.0 F0.3 W0.1 F1.3 B1.2 B0.2 B1.3 B0.3 W1.2 W1.3 W0.2 W0.3"]),
}


@pytest.mark.parametrize("key", sorted(GOLDEN))
def test_golden_orders_3_5(key):
    name, d, n = key
    mk, peaks, orders = GOLDEN[key]
    s = build(name, d, n)
    assert [v_order(s, r) for r in range(d)] == orders
    res = unit_sim(s)
    assert res.makespan == mk
    assert [p * 2 for p in res.peak_units] == peaks


def test_golden_v_half_d4_n8():
    s = build("v-half", 4, 8)
    assert v_order(s, 0) == (
        "F0.0 F0.1 F0.2 F0.3 F0.4 F1.0 B1.0 W1.0 F1.1 B1.1 W1.1 F1.2 B0.0 B1.2 W1.2 F1.3 W0.0 "
        "F0.5 B0.1 B1.3 W1.3 F1.4 W0.1 F0.6 B0.2 B1.4 W1.4 F1.5 W0.2 F0.7 B0.3 B1.5 W1.5 F1.6 "
        "B1.6 W1.6 B0.4 W0.3 W0.4 F1.7 B1.7 B0.5 W1.7 B0.6 W0.5 W0.6 B0.7 W0.7")
    assert v_order(s, 3) == (
        "F0.0 F1.0 F0.1 F1.1 F0.2 F1.2 B1.0 W1.0 B0.0 W0.0 F0.3 F1.3 B1.1 W1.1 B0.1 W0.1 F0.4 "
        "F1.4 B1.2 W1.2 B0.2 W0.2 F0.5 F1.5 B1.3 W1.3 B0.3 F0.6 W0.3 F1.6 B1.4 B0.4 W1.4 F0.7 "
        "W0.4 F1.7 B1.5 B0.5 B1.6 B0.6 W1.5 W1.6 B1.7 B0.7 W1.7 W0.5 W0.6 W0.7")
    assert unit_sim(s).makespan == 53


# §2.7: extra time over 2n(F+B+W) at d = 4 with real, unequal F/B/W (per V stage)
GROWTH = {
    (1, 1, .5): ([18.5, 26.5, 42.5], [7.5] * 3, [3] * 3, [15] * 3),
    (1, 2, 1): ([45, 77, 141], [18, 26, 42], [6] * 3, [24] * 3),
    (1.5, 1, 1): ([25, 41, 73], [10.5] * 3, [6] * 3, [21] * 3),
    (2, 1, 1): ([39, 71, 135], [17, 25, 41], [9] * 3, [24] * 3),
    (1, 1, 2): ([9] * 3, [6] * 3, [6] * 3, [24] * 3),
}


@pytest.mark.parametrize("fbw", sorted(GROWTH))
def test_repeating_bubble_2_7(fbw):
    f, b, w = fbw
    for name, want in zip(("v-min", "v-half", "v-zb", "1f1b"), GROWTH[fbw]):
        got = [unit_sim(build(name, 4, n), f, b, w).makespan - 2 * n * (f + b + w)
               for n in (8, 16, 32)]
        assert got == pytest.approx(want), name


def test_small_n_warns_and_bad_args_rejected():
    s = build("v-half", 4, 5)
    assert "n >= 2d" in s.meta["warning"]
    assert "warning" not in build("v-half", 4, 8).meta
    for name in V:
        with pytest.raises(ScheduleError, match="at least 4 micro-batches"):
            build(name, 4, 3)
        with pytest.raises(ScheduleError, match="at least 4 micro-batches"):
            getattr(vshape, name.replace("-", "_"))(4, 3)      # direct call checks too
        with pytest.raises(ScheduleError, match="at least 2"):
            getattr(vshape, name.replace("-", "_"))(1, 4)


@pytest.mark.parametrize("d", [2, 3, 4, 6, 8])
def test_v_zb_greedy_matches_block_and_wins_at_small_n(d):
    """§2.3 / §4.3: unit costs, n >= 2d → greedy == block (bubble d-1, peak d); n = d → greedy
    is better; with uneven costs the greedy is never worse (2.7's V-ZB column)."""
    for n in (2 * d, 4 * d):
        g, blk = unit_sim(build("v-zb-greedy", d, n)), unit_sim(build("v-zb", d, n))
        assert g.makespan == blk.makespan == 6 * n + d - 1
        assert max(g.peak_units) == max(blk.peak_units) == d
    assert unit_sim(build("v-zb-greedy", d, d)).makespan <= unit_sim(build("v-zb", d, d)).makespan
    if d == 4:
        assert unit_sim(build("v-zb-greedy", 4, 4)).makespan < unit_sim(build("v-zb", 4, 4)).makespan
        for f, b, w in GROWTH:
            for n in (8, 16):
                g = unit_sim(build("v-zb-greedy", 4, n, f=f, b=b, w=w), f, b, w)
                assert g.makespan <= unit_sim(build("v-zb", 4, n), f, b, w).makespan + 1e-9
                assert max(g.peak_units) <= 4


def test_v_zb_greedy_rejects_small_cap_and_bad_costs():
    with pytest.raises(ScheduleError, match="too small"):
        build("v-zb-greedy", 4, 8, mem_cap=3.5)
    with pytest.raises(ScheduleError, match="> 0"):
        build("v-zb-greedy", 4, 8, f=0)
    assert max(unit_sim(build("v-zb-greedy", 4, 8, mem_cap=6)).peak_units) <= 6
