"""DawnPiper's keep / recompute / swap choice (docs/dawnpiper.md §3, §7) on synthetic
profiles with known numbers, and in-flight copies from the simulator."""
from __future__ import annotations

import itertools

import pytest

from ds_autoplan.profile import Profile, Unit
from ds_autoplan.search.memopt import (KEEP, RECOMPUTE, SWAP, _Stage, inflight_copies, mem_opt,
                                        memory_policy, tensor_mem_opt)
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
    from ds_autoplan.search.dawnpiper import dawnpiper_partition
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
    from ds_autoplan.search.dawnpiper import dawnpiper_partition
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


# ---- per saved tensor (docs/dawnpiper.md §2.3, §7) ------------------------------------

def tsynth(n=3, big=(8, 2, 2), small=(1, 1, 1), fwd=(1, 1, 1), inp=(1, 1, 1),
           in0_saved=True) -> Profile:
    """Unit i saves its input (made by unit i-1; u0's comes from outside the stage and is
    saved only with ``in0_saved``), one big and one small internal tensor.  ``inputs`` points
    at the saved tensor holding the input, as measure_saved records it (-1: not saved)."""
    units, tensors = [], []
    for i in range(n):
        saves_in = bool(i) or in0_saved
        ins = [[i - 1, inp[i] * MB, len(tensors) if saves_in else -1]]
        own = ((inp[i], i - 1),) * saves_in + ((big[i], i), (small[i], i))
        for idx, (b, prod) in enumerate(own):
            tensors.append({"unit": i, "owner": i, "index": idx, "bytes": b * MB, "shape": [],
                            "dtype": "float32", "users": [i], "producer": prod})
        units.append(Unit(name=f"u{i}", kind="node", params=10, param_bytes=40,
                          fwd_s=fwd[i] * 1e-3, bwd_s=2 * fwd[i] * 1e-3,
                          act_bytes=(inp[i] + big[i] + small[i]) * MB, out_bytes=inp[i] * MB,
                          in_bytes=inp[i] * MB, inputs=ins))
    return Profile("t", "fp", {"type": "cpu", "name": "x"}, 1, units, "node", tensors=tensors)


def brute(st, cap, swap=True):
    opts = (KEEP, RECOMPUTE, SWAP) if swap else (KEEP, RECOMPUTE)
    best = None
    for c in itertools.product(opts, repeat=len(st.tb)):
        c = list(c)
        if any(x == RECOMPUTE and st.prod[j] is None for j, x in enumerate(c)) \
                or st.mem(c) > cap:
            continue
        best = st.extra(c) if best is None else min(best, st.extra(c))
    return best


def test_tensor_cost_formulas():
    from ds_autoplan.search.memopt import _TensorStage
    p = tsynth()
    k, bw = 3, 2e9
    st = _TensorStage(p, 0, 3, k, bw, 4.0)
    TF, TB = 3e-3, 6e-3
    # tensor 4 = u1's big tensor: G = (k-1)(TF+TB) + (TF - end_f(u1)) + start_b(u1)  (§7.2)
    assert st.Gt[4] == pytest.approx((k - 1) * (TF + TB) + (TF - 2e-3) + 2e-3)
    assert st.tfree(4) == pytest.approx(st.Gt[4] - 2 * 2 * MB / bw)   # FreeTime = G - 2S
    assert st.prod[0] is None and st.prod[3] == 0       # u0's input comes from outside
    keep = [KEEP] * 9
    W = 4 * 3 * 40
    assert st.mem(keep) == pytest.approx(W + k * 18 * MB)          # W + k A   (§3.3)
    # recompute u1's big tensor: u1 re-runs (RT = its forward), its input (tensor 3) is kept
    plan = keep[:4] + [RECOMPUTE] + keep[5:]
    assert st.mem(plan) == pytest.approx(W + k * 16 * MB + 2 * MB)
    assert st.extra(plan) == pytest.approx(1e-3)
    # recompute u1's input too: u0 re-runs (RT = 1 + 1 ms) and reads u0's input, which the
    # kept tensor 0 holds: k (18 - 1 - 2) resident, 1 + 2 MB rematerialised in the backward
    plan2 = keep[:3] + [RECOMPUTE, RECOMPUTE] + keep[5:]
    assert st.mem(plan2) == pytest.approx(W + k * 15 * MB + 3 * MB)
    assert st.extra(plan2) == pytest.approx(2e-3)
    # ... when u0 does not save its input, the recompute must keep it as a checkpoint (+1 MB)
    nx = _TensorStage(tsynth(in0_saved=False), 0, 3, k, bw, 4.0)
    assert nx.mem([KEEP] * 8) == pytest.approx(W + k * 17 * MB)
    assert nx.mem([KEEP, KEEP, RECOMPUTE, RECOMPUTE] + [KEEP] * 4) == \
        pytest.approx(W + k * (17 - 3 + 1) * MB + 3 * MB)
    # swap: transfer stall = max(0, -FreeTime); swapped bytes come back one unit ahead
    sw = keep[:4] + [SWAP] + keep[5:]
    assert st.mem(sw) == pytest.approx(W + k * 16 * MB + 2 * MB)
    slow = _TensorStage(p, 0, 3, 1, 0.1e9, 4.0)
    assert slow.extra(sw) == pytest.approx(-slow.tfree(4) + (2 * MB - 0.1e9 * 9e-3) / 0.1e9)


def test_tensor_choice_respects_the_cap():
    p = tsynth()
    base = mem_opt(p, 0, 3, float("inf"), 3, per_tensor=True).base_peak_bytes
    assert set(mem_opt(p, 0, 3, base, 3, per_tensor=True).tensor_choice.values()) == {KEEP}
    for frac in (0.9, 0.7, 0.5, 0.35, 0.2):
        for bw in (None, 0.2, 50.0):
            pol = mem_opt(p, 0, 3, frac * base, 3, swap_GBps=bw, per_tensor=True)
            assert pol.feasible == (pol.peak_bytes <= frac * base)
            assert len(pol.tensor_choice) == 9
            if bw is None:
                assert SWAP not in pol.tensor_choice.values()
            assert pol.swap_bytes == sum(pol.tensor_bytes[t] for t, c in pol.tensor_choice.items()
                                         if c == SWAP)
    assert not mem_opt(p, 0, 3, 0.2 * base, 3, swap_GBps=None, per_tensor=True).feasible


def test_fast_link_swaps_the_long_lived_big_tensor_slow_link_recomputes_it():
    # u0's 16 MB tensor lives through the whole stage (produced first, read last in backward)
    p = tsynth(big=(16, 2, 2), fwd=(4, 4, 4))
    base = mem_opt(p, 0, 3, float("inf"), 2, per_tensor=True).base_peak_bytes
    # shed 16 MB: the big tensor's k = 2 copies less the one copy back during the backward
    cap = base - 16 * MB
    fast = mem_opt(p, 0, 3, cap, 2, swap_GBps=50.0, per_tensor=True)
    assert fast.feasible and fast.tensor_choice["u0#1"] == SWAP
    assert RECOMPUTE not in fast.tensor_choice.values()
    assert fast.extra_s == pytest.approx(0.0)    # hidden: FreeTime > 0
    slow = mem_opt(p, 0, 3, cap, 2, swap_GBps=0.05, per_tensor=True)
    assert slow.feasible and slow.tensor_choice["u0#1"] == RECOMPUTE
    # the hidden swap of u0#0 (FreeTime > 0, within the §7.4 budget) that phase 1 picks is
    # undone, as are the free riders (u0#2, u1#0: u0 re-runs anyway), once u0#1 alone fits
    assert [t for t, c in slow.tensor_choice.items() if c != KEEP] == ["u0#1"]
    assert slow.extra_s == pytest.approx(4e-3)   # RT = u0's forward
    from ds_autoplan.search.memopt import _TensorStage
    assert slow.extra_s == pytest.approx(brute(_TensorStage(p, 0, 3, 2, 0.05e9, 4.0), cap))
    assert slow.choice["u0"] == RECOMPUTE and slow.recompute_fraction == pytest.approx(1 / 3)


def test_tensor_choice_agrees_with_brute_force():
    import random
    from ds_autoplan.search.memopt import _TensorStage
    rng = random.Random(0)
    cases = exact = 0
    for _ in range(25):
        args = [tuple(rng.randint(lo, hi) for _ in range(2))
                for lo, hi in ((1, 8), (1, 3), (1, 4), (1, 3))]
        p = tsynth(2, *args)
        k, bw = rng.choice([1, 2, 4]), rng.choice([None, 0.2, 1.0, 5.0])
        st = _TensorStage(p, 0, 2, k, (bw or 0) * 1e9, 4.0)
        base = st.mem([KEEP] * 6)
        for frac in (0.8, 0.6, 0.45):
            best = brute(st, frac * base, bw is not None)
            pol = mem_opt(p, 0, 2, frac * base, k, swap_GBps=bw, per_tensor=True)
            ex = tensor_mem_opt(p, 0, 2, frac * base, k, swap_GBps=bw, exact_limit=6)
            assert pol.feasible == ex.feasible == (best is not None)
            if best is None:
                continue
            assert ex.extra_s == pytest.approx(best)
            assert pol.peak_bytes <= frac * base and pol.extra_s >= best - 1e-12
            cases += 1
            exact += pol.extra_s == pytest.approx(best)
    assert exact >= 0.8 * cases          # Capuchin's greedy is a heuristic (§7.3)


def test_per_tensor_partition_and_planner_options():
    from ds_autoplan.search.dawnpiper import dawnpiper_partition
    from ds_autoplan.search.memopt import stage_memory_options
    p = tsynth(n=4, big=(8, 6, 4, 2), small=(1, 1, 1, 1), fwd=(1, 2, 2, 1), inp=(1, 1, 1, 1))
    copies = [2, 1]
    free = dawnpiper_partition(p, copies, float("inf"), per_tensor=True)
    cap = 0.7 * max(x.peak_bytes for x in free.policies)
    res = dawnpiper_partition(p, copies, cap, per_tensor=True, swap_GBps=20.0)
    assert res.bottleneck_s < float("inf")
    assert all(x.peak_bytes <= cap and x.tensor_choice for x in res.policies)
    opts = stage_memory_options(res.policies)
    assert opts["recompute_per_stage"] == res.recompute_per_stage
    assert opts["swap_bytes_per_stage"] == [x.swap_bytes for x in res.policies]
    for units, pol in zip(opts["swap"], res.policies):
        assert sum(pol.tensor_bytes[f"{u}#{i}"] for u, ix in units.items() for i in ix) \
            == pol.swap_bytes
    import json
    assert json.loads(json.dumps(opts)) == opts


def test_tensor_prefix_only_is_the_shortest_fitting_prefix():
    # prefix_only: what recompute_per_stage executes (whole leading units); recompute-only,
    # the shortest prefix meeting the cap is optimal, which exhaustive enumeration confirms
    from ds_autoplan.search.memopt import _TensorStage
    p = tsynth(big=(8, 6, 4), fwd=(1, 2, 2))
    st = _TensorStage(p, 0, 3, 3, 0.0, 4.0, prefix=True)
    base, kps = st.mem([KEEP] * 9), set()
    for frac in (0.9, 0.7, 0.5, 0.3):
        pol = tensor_mem_opt(p, 0, 3, frac * base, 3, swap_GBps=None, prefix_only=True)
        ex = tensor_mem_opt(p, 0, 3, frac * base, 3, swap_GBps=None, prefix_only=True,
                            exact_limit=9)
        assert pol.feasible == ex.feasible
        kp = len(pol.recompute)
        kps.add(kp)
        assert pol.recompute == pol.units[:kp] and pol.recompute_fraction == kp / 3
        assert list(pol.tensor_choice.values()) == st.prefix_plan([KEEP] * 9, kp - 1)
        if pol.feasible:
            assert pol.peak_bytes <= frac * base and pol.extra_s == pytest.approx(ex.extra_s)
    assert len(kps) >= 3


def test_loss_tensors_are_never_swapped():
    # [decision] the runtimes compute the loss outside the stage's forward (memopt._TensorStage)
    p, q = tsynth(big=(2, 2, 16)), tsynth(big=(2, 2, 16))
    p.tensors[7]["owner"] = "loss"               # u2's big tensor belongs to the loss
    base = mem_opt(p, 0, 3, float("inf"), 2, per_tensor=True).base_peak_bytes
    for frac in (0.7, 0.6):
        pol = mem_opt(p, 0, 3, frac * base, 2, swap_GBps=50.0, per_tensor=True)
        assert pol.feasible and pol.tensor_choice["loss#1"] != SWAP
        # the same tensor owned by u2 is swapped: the transfer hides at 50 GB/s
        assert mem_opt(q, 0, 3, frac * base, 2, swap_GBps=50.0,
                       per_tensor=True).tensor_choice["u2#1"] == SWAP


def test_cli_profile_writes_the_per_tensor_partition_report(tmp_path, capsys):
    import json
    from ds_autoplan.cli import main
    out, rep = str(tmp_path / "p.json"), tmp_path / "p.policy.json"
    args = ["profile", "module:test_swap.model", "--out", out, "--repeats", "1", "--warmup", "0",
            "--batch-size", "2", "--stages", "2", "--per-tensor", "--swap-GBps", "1000",
            "--policy-out", str(rep)]
    assert main(args) == 0
    from ds_autoplan.profile import Profile
    p = Profile.load(out)
    for u in p.units:      # fixed times: the cut and the choice must not follow timing noise
        u.fwd_s, u.bwd_s = 1e-3, 2e-3
    p.save(out)
    assert main(args) == 0                                          # the profile is reused
    free = json.loads(rep.read_text())
    cap = 0.9 * max(free["peak_bytes_per_stage"])
    assert main(args + ["--mem-cap", str(cap / 2 ** 30)]) == 0
    d = json.loads(rep.read_text())
    assert d["per_tensor"] and d["feasible"] and d["copies"] == [2, 1]
    assert sum(d["units_per_stage"]) == 6 and max(d["peak_bytes_per_stage"]) <= cap
    assert sum(d["swap_bytes_per_stage"]) > 0
    for units, pol, sb in zip(d["swap"], d["policies"], d["swap_bytes_per_stage"]):
        assert sum(pol["tensor_bytes"][f"{u}#{i}"] for u, ix in units.items() for i in ix) == sb
        rec = [u for u in pol["units"] if pol["choice"][u] == RECOMPUTE]
        assert rec == pol["units"][:len(rec)]          # a prefix: recompute_per_stage runs it
    assert "swap bytes" in capsys.readouterr().out
    assert main(args + ["--stages", "99"]) == 2                     # one clear message
