"""DawnPiper's keep / recompute / swap choice (partition-dawnpiper.md §3, §7) on synthetic
profiles with known numbers, and in-flight copies from the simulator."""
from __future__ import annotations

import itertools

import pytest

from ds_autoplan.profile import Profile, Unit
from ds_autoplan.profile.memopt import (KEEP, RECOMPUTE, SWAP, _Stage, inflight_copies, mem_opt,
                                        memory_policy)
from ds_autoplan.schedule import build

MB = 1 << 20


def synth(n=6, act=(4, 1, 6, 2, 8, 3), fwd=(1, 3, 1, 2, 1, 4), inp=1) -> Profile:
    units = [Unit(name=f"u{i}", kind="node", params=1000, param_bytes=4000, fwd_s=fwd[i] * 1e-3,
                  bwd_s=2 * fwd[i] * 1e-3, act_bytes=act[i] * MB, out_bytes=inp * MB,
                  in_bytes=inp * MB) for i in range(n)]
    return Profile("synth", "fp", {"type": "cpu", "name": "x"}, 1, units, "node")


def test_gap_and_free_time_formulas():
    p = synth()
    k = 3
    st = _Stage(p, 0, 6, k, 10e9, 4.0)
    TF, TB = 12e-3, 24e-3
    assert st.TF == pytest.approx(TF) and st.TB == pytest.approx(TB)
    # G(u) = (k-1)(TF+TB) + (TF - end_f(u)) + start_b(u)   (§7.2)
    i = 2
    end_f = (1 + 3 + 1) * 1e-3
    start_b = 2 * (2 + 1 + 4) * 1e-3
    assert st.G[i] == pytest.approx((k - 1) * (TF + TB) + (TF - end_f) + start_b)
    assert st.free_time(i) == pytest.approx(st.G[i] - 2 * 6 * MB / 10e9)
    # mem_x = W + k * A + P   (§3.3); nothing chosen: P = 0
    assert st.mem([KEEP] * 6) == pytest.approx(4 * 6 * 4000 + k * 24 * MB)
    # recomputing u1, u2 (one segment): keeps the segment input, re-materialises 7 MB once
    plan = [KEEP, RECOMPUTE, RECOMPUTE, KEEP, KEEP, KEEP]
    assert st.mem(plan) == pytest.approx(96000 + k * (17 + 1) * MB + 7 * MB)
    assert st.extra(plan) == pytest.approx(4e-3)          # RT = forward of the segment


def test_never_above_the_cap_and_monotone_in_the_cap():
    p = synth()
    base = mem_opt(p, 0, 6, float("inf"), 4).base_peak_bytes
    prev_extra = 0.0
    for frac in (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3):
        for bw in (None, 0.5, 50.0):
            pol = mem_opt(p, 0, 6, frac * base, 4, swap_GBps=bw)
            if pol.feasible:
                assert pol.peak_bytes <= frac * base
            else:
                assert pol.peak_bytes > frac * base
            if bw is None:
                assert not pol.swap
                assert pol.extra_s >= prev_extra - 1e-12   # a lower cap never runs faster
                prev_extra = pol.extra_s
    assert mem_opt(p, 0, 6, base, 4).choice == {f"u{i}": KEEP for i in range(6)}
    assert not mem_opt(p, 0, 6, 1.0, 4, swap_GBps=None).feasible


def test_recompute_only_is_close_to_brute_force():
    p = synth()
    st = _Stage(p, 0, 6, 4, 0.0, 4.0)
    base = st.mem([KEEP] * 6)
    for frac in (0.8, 0.6, 0.5):
        cap = frac * base
        best = min((st.extra(list(c)) for c in itertools.product((KEEP, RECOMPUTE), repeat=6)
                    if st.mem(list(c)) <= cap), default=None)
        pol = mem_opt(p, 0, 6, cap, 4, swap_GBps=None)
        assert pol.feasible and best is not None
        assert pol.extra_s <= 1.5 * best + 1e-12   # greedy by time per saved byte


def test_hidden_swaps_on_early_stages_recompute_on_the_last():
    # §7.2: early 1F1B stages have long gaps (swaps hide), the last stage does not
    p = synth(n=4, act=(8, 8, 8, 8), fwd=(1, 1, 1, 1))
    first = mem_opt(p, 0, 4, 0.6 * mem_opt(p, 0, 4, float("inf"), 4).base_peak_bytes, 4,
                    swap_GBps=20.0)
    assert first.feasible and first.swap and not first.recompute
    assert first.extra_s == pytest.approx(0.0)        # every transfer hidden
    late = mem_opt(p, 0, 4, 0.7 * mem_opt(p, 0, 4, float("inf"), 2).base_peak_bytes, 2,
                   swap_GBps=0.5)          # late stage: gap ~ one cycle, transfers do not hide
    assert late.feasible and late.recompute and not late.swap


def test_inflight_copies_follow_the_schedule():
    assert inflight_copies(build("1f1b", d=4, n=8)) == [4, 3, 2, 1]
    assert inflight_copies(build("1f1b", d=4, n=2)) == [2, 2, 2, 1]   # min(p - i, m)
    assert inflight_copies(build("gpipe", d=4, n=8)) == [8, 8, 8, 8]


def test_memory_policy_per_stage_feeds_the_plan():
    p = synth()
    sched = build("1f1b", d=2, n=4)
    k = inflight_copies(sched)
    pols = memory_policy(p, [(0, 3), (3, 6)], 20 * MB, k, swap_GBps=None)
    assert [x.stage for x in pols] == [0, 1] and [x.copies for x in pols] == [2, 1]
    assert all(x.feasible and x.peak_bytes <= 20 * MB for x in pols)
    assert 0 < pols[0].recompute_fraction <= 1
    assert pols[0].to_dict()["recompute_fraction"] == pols[0].recompute_fraction
    assert SWAP not in pols[1].choice.values()


def test_binary_partition_two_stages_equals_brute_force():
    # Theorem 4.1: with monotone prefixes and even MO opportunities the best 2-stage cut lies
    # in [rho_mb, rho_cb]; the binary search must find the brute-force optimum
    from ds_autoplan.profile import dawnpiper_partition
    n = 12
    p = synth(n=n, act=[3] * n, fwd=[1 + (i % 3) for i in range(n)])
    copies = [2, 1]
    for cap in (float("inf"), 40 * MB, 30 * MB, 24 * MB):
        res = dawnpiper_partition(p, copies, cap, swap_GBps=None)
        brute = min(max(*(mem_opt(p, lo, hi, cap, k, swap_GBps=None).time_s +
                          mem_opt(p, lo, hi, cap, k, swap_GBps=None).extra_s
                          if mem_opt(p, lo, hi, cap, k, swap_GBps=None).feasible else float("inf")
                          for (lo, hi), k in (((0, c), 2), ((c, n), 1)))) for c in range(1, n))
        assert res.bottleneck_s == pytest.approx(brute)
        if res.bottleneck_s < float("inf"):
            assert all(pol.peak_bytes <= cap for pol in res.policies)
            assert sum(res.units_per_stage) == n


def test_binary_partition_four_stages_meets_the_cap():
    from ds_autoplan.profile import dawnpiper_partition
    p = synth(n=16, act=[2 + i % 4 for i in range(16)], fwd=[1 + i % 2 for i in range(16)])
    copies = inflight_copies(build("1f1b", d=4, n=8))
    free = dawnpiper_partition(p, copies, float("inf"), swap_GBps=None)
    capped = dawnpiper_partition(p, copies, 0.6 * max(x.peak_bytes for x in free.policies),
                                 swap_GBps=None)
    assert capped.bottleneck_s < float("inf")
    assert capped.bottleneck_s >= free.bottleneck_s - 1e-12
    free_peak = max(x.peak_bytes for x in free.policies)
    assert max(x.peak_bytes for x in capped.policies) <= 0.6 * free_peak
    assert [lo for lo, _ in capped.bounds][1:] == [hi for _, hi in capped.bounds][:-1]


def test_prefix_only_recompute_is_what_the_runtimes_execute():
    p = synth()
    base = mem_opt(p, 0, 6, float("inf"), 3).base_peak_bytes
    for frac in (0.9, 0.7, 0.5):
        pol = mem_opt(p, 0, 6, frac * base, 3, swap_GBps=None, prefix_only=True)
        k = len(pol.recompute)
        assert pol.recompute == [f"u{i}" for i in range(k)]      # a leading run of units
        assert pol.feasible and pol.peak_bytes <= frac * base
        assert pol.recompute_fraction == k / 6
